"""Generate rpc/pdserve_pb2.py and pdserve_pb2_grpc.py from pdserve.proto.

    python -m rpc.codegen            # rewrite the generated files
    python -m rpc.codegen --check    # exit 1 if they are stale

The generated code is kept in the tree so workers need no protoc at run time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = Path("rpc/pdserve.proto")
GENERATED = ("pdserve_pb2.py", "pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


def stale_files() -> list[str]:
    """Generated files that differ from what the proto gives now."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / PROTO.parent
        return [name for name in GENERATED
                if not (ROOT / PROTO.parent / name).is_file()
                or (fresh / name).read_bytes() != (ROOT / PROTO.parent / name).read_bytes()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the generated files are current")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: rpc/{name} (run python -m rpc.codegen)", file=sys.stderr)
        return 1 if stale else 0
    generate(ROOT)
    print(f"wrote {', '.join(f'rpc/{n}' for n in GENERATED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
