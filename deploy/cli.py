"""The `pdserve` command: serve, scale, status (the deployment), profile and tune (the
planner), trace (one request's timeline), chat (offline), bench (the serving benchmark)."""

from __future__ import annotations

import argparse
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The benchmark sits above everything it measures: it runs as its own program
        # (bench/serving_cli.py, with its own parser), never imported from here.
        return subprocess.call([sys.executable, "-m", "bench.serving_cli", *argv[1:]])
    from deploy.planner import profile, tune
    from deploy.serve import add_commands
    from engine.cli import add_chat_command
    from deploy.observe import trace

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
