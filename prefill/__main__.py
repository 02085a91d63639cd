"""python -m prefill --port P [--model M] ...: a prefill worker process."""

from __future__ import annotations

from prefill.role import PREFILL
from worker.process import main

if __name__ == "__main__":
    main({"prefill": PREFILL}, "prefill")
