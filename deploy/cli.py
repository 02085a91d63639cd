"""The `pdserve` command: serve, scale, status (the deployment), profile and tune (the
planner), trace (one request's timeline), chat (offline)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # bench/serving.py has its own parser; imported only when used
        from bench.serving import main as bench_main

        return bench_main(argv[1:])
    from deploy import profile, trace, tune
    from deploy.serve import add_commands
    from engine.cli import add_chat_command

    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    profile.add_command(sub)
    tune.add_command(sub)
    trace.add_command(sub)
    add_chat_command(sub)
    sub.add_parser("bench", add_help=False, help="serving benchmark: latency, SLO attainment, goodput")
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
