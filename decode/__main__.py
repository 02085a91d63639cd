"""python -m decode --port P [--model M] ...: a decode worker process (also the aggregated mode)."""

from __future__ import annotations

from decode.role import DECODE
from worker.process import main

if __name__ == "__main__":
    main({"decode": DECODE}, "decode")
