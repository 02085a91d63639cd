"""python -m deploy.role_process --role prefill|decode --port P ...: a worker process whose
role the controller can change in place.

It serves one role as `python -m prefill` or `python -m decode` would (the same flags after
`--role`), and answers ChangeRole: once drained and holding nothing, it stops serving that
role and serves the other over the weights it has loaded, on a new port with a new NIXL
agent (worker/role_change.py). The deploy controller starts every worker this way
(deploy/hosts.py), so a planner move costs a drain and a warm-up, not a cold start.
"""

from __future__ import annotations

import argparse

from decode.role import DECODE
from prefill.role import PREFILL
from worker.process import main

ROLES = {"prefill": PREFILL, "decode": DECODE}


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.role_process", add_help=False)
    parser.add_argument("--role", choices=sorted(ROLES), required=True)
    known, rest = parser.parse_known_args(argv)
    main(ROLES, known.role, rest)


if __name__ == "__main__":
    run()
