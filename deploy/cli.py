"""The `pdserve` command: serve, scale, status (the deployment) and chat (offline)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from deploy.serve import add_commands
    from engine.cli import add_chat_command

    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    add_chat_command(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
