"""Prefill and decode on one GPU: the one prepared run for a lent GPU machine, and its CPU dry run.

    bash bench/gpu_pd_run.sh                          # on the GPU machine: install the carried wheels, run
    python -m bench.gpu_pd --out DIR                  # on a GPU, with NIXL, FastAPI and uvicorn installed
    python -m bench.gpu_pd --cpu --quick --out DIR    # the dry run of every phase on this CPU (make test runs it)

Four phases, each in a child process of its own with a time bound (--quick: tiny sizes):
1. push: KV pushed over NIXL between two processes' pools on the device (VRAM segments on a
   GPU, DRAM on a CPU), against a copy of the same bytes on the same device without NIXL (a
   device-to-device torch copy on a GPU, memcpy on a CPU), the last push verified; UCX's own
   report (UCX_PROTO_INFO) says which transport carried the writes (bench/harness/device_push.py).
2. serve: a prefill and a decode worker on the device, as processes, and the gateway; requests
   served end to end with their KV pushed over NIXL: greedy float32 tokens equal to the CPU
   engine's and to transformers' on the device, the answer saying the KV came from the prefill
   worker (x-pdserve-prefill: remote, x-pdserve-kv-blocks > 0) and the prefill worker's transfer
   counters showing the bytes, for a tiny checkpoint and SmolLM2 (bench/harness/pd_request.py).
3. decode: the engine's decode step at batch 1 / 8 / 32 / 128, eager, CUDA graphs (a column
   that says "not available" until the engine captures graphs) and the roofline of weights +
   KV bytes over the copy bandwidth measured on the device (bench/harness/device_decode.py).
4. throughput: a ShareGPT-like batch through the engine and through transformers' generate.
Every figure is printed with the device's name (torch.cuda.get_device_name; the CPU's model
name) and all of them are written to gpu_pd.json in the --out folder.

Exit status: 0 every phase ran and passed; 1 a token mismatch or KV that did not come from the
prefill worker; 2 no CUDA device (without --cpu); 3 a phase failed, timed out, or cannot run on
this tree yet (the output says which and why).

On the lent GPU machine (torch with CUDA 13, no NIXL, FastAPI, uvicorn or gguf there): the
wheels and SmolLM2's GGUF travel with the calls, made ready by `python -m bench.gpu_pd_prepare`
and installed there by bench/gpu_pd_run.sh. nixl-cu12 1.5.1 is a 65.5 MiB wheel, over the 64 MiB
a call carries: the CUDA 13 build, nixl-cu13, goes instead, without the expert-parallel
libraries it bundles (29 MiB then), and the GGUF (94 MiB) is split across three calls on one
warm machine; one call without SmolLM2 is the fallback (bench/gpu_pd_prepare.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PHASES = ("push", "serve", "decode", "throughput")
FULL_BOUND_S = {"push": 60, "serve": 200, "decode": 100, "throughput": 120}  # well under 10 minutes in all
QUICK_BOUND_S = {"push": 60, "serve": 120, "decode": 60, "throughput": 60}
# (label, layers, KV heads, head dim): the pools pushed, bfloat16, blocks of 16 tokens
PUSH_SHAPES = {"smollm2": ("SmolLM2-135M", 30, 3, 64), "llama8b": ("Llama-8B shape", 32, 8, 128),
               "tiny": ("tiny", 2, 2, 64)}


def log(msg: str) -> None:
    print(f"[gpu_pd {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    from kernels.host import cpu

    return cpu().model_name or "unknown CPU"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_pd", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_pd.json")
    p.add_argument("--cpu", action="store_true", help="the dry run: every phase on this CPU")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the dry run's)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    p.add_argument("--smollm2", default="smollm2", help="SmolLM2: the alias, a .gguf file or a Hugging Face folder; "
                   "'none': a random-weight checkpoint of its shape for the decode and throughput phases, and "
                   "no SmolLM2 served")
    p.add_argument("--tokenizer", type=Path, help="a folder with SmolLM2's tokenizer.json (with --smollm2 none)")
    p.add_argument("--serve-smollm2", action=argparse.BooleanOptionalAction, default=None,
                   help="also serve SmolLM2 end to end (default: on, off with --quick)")
    p.add_argument("--dtype", default=None, help="decode and throughput phases (default: bfloat16 on a GPU, "
                                                 "float32 on a CPU); the served tokens are always float32")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child process's one phase
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if unknown := [x for x in args.phases if x not in PHASES]:
        p.error(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    args.device = "cpu" if args.cpu else "cuda"
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    if args.serve_smollm2 is None:
        args.serve_smollm2 = not args.quick and args.smollm2 != "none"
    if args.smollm2 == "none" and (args.serve_smollm2 or args.tokenizer is None):
        p.error("--smollm2 none serves no SmolLM2 and needs --tokenizer")
    return args


def sizes(quick: bool) -> dict:
    if quick:
        return dict(push_shapes=["tiny"], push_tokens=256, push_repeats=3, max_new=8, decode_batches=[1, 8],
                    decode_prompt=32, decode_steps=4, requests=8, max_input=64, max_output=16, hf_batch=4,
                    copy_mib=64)
    return dict(push_shapes=["smollm2", "llama8b"], push_tokens=2048, push_repeats=5, max_new=16,
                decode_batches=[1, 8, 32, 128], decode_prompt=256, decode_steps=16, requests=64, max_input=512,
                max_output=256, hf_batch=32, copy_mib=1024)


# --- each phase, run in a child process; returns its JSON -----------------------------------------

def phase_push(args, size: dict, work: Path, models: dict[str, Path]) -> dict:
    from bench.harness.device_push import measure_push
    from transfer.layout import KVLayout

    rows = []
    for name in size["push_shapes"]:
        label, layers, heads, head_dim = PUSH_SHAPES[name]
        blocks = size["push_tokens"] // 16
        layout = KVLayout(2 * blocks, layers, 16, heads, head_dim, "bfloat16")
        log(f"push: {label}, {blocks} blocks of {layout.block_bytes / 2**10:g} KiB")
        rows.append({"shape": label, **measure_push(args.device, layout, blocks, 4, size["push_repeats"], work)})
    return {"rows": rows}


def phase_serve(args, size: dict, work: Path, models: dict[str, Path]) -> dict:
    from bench.harness.pd_request import serve_and_check

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on every side
    results = []
    for name in ["tiny"] + (["smollm2"] if args.serve_smollm2 else []):
        log(f"serve: {name} end to end over a prefill and a decode worker")
        logs = work / f"serve-{name}"
        logs.mkdir(exist_ok=True)
        results.append(serve_and_check(models[name], args.device, size["max_new"], (40, 23), logs,
                                       ready_timeout_s=150))
    return {"models": results}


def _decode_model(args, models: dict[str, Path]):
    """(folder, prompt encoder): SmolLM2 on a GPU run, the tiny checkpoint in a quick one."""
    from common.tokenizer import Tokenizer

    if args.quick:
        from bench.harness.device_decode import FoldedEncoder
        from engine.config import ModelConfig

        vocab = ModelConfig.from_pretrained(models["tiny"]).vocab_size
        return models["tiny"], FoldedEncoder(Tokenizer.from_pretrained(models["smollm2"]), vocab)
    return models["smollm2"], Tokenizer.from_pretrained(models["smollm2"])


def phase_decode(args, size: dict, work: Path, models: dict[str, Path]) -> dict:
    from bench.harness.device_decode import decode_table
    from engine.config import resolve_dtype

    folder, encoder = _decode_model(args, models)
    return decode_table(folder, resolve_dtype(args.dtype)[0], args.device, size["decode_batches"],
                        size["decode_prompt"], size["decode_steps"], encoder, size["copy_mib"])


def phase_throughput(args, size: dict, work: Path, models: dict[str, Path]) -> dict:
    from bench.harness.device_decode import throughput_table
    from engine.config import resolve_dtype

    folder, encoder = _decode_model(args, models)
    return {"model": folder.name, "dtype": args.dtype,
            **throughput_table(folder, resolve_dtype(args.dtype)[0], args.device, encoder, size["requests"],
                               size["max_input"], size["max_output"], size["hf_batch"])}


PHASE_RUNS = {"push": phase_push, "serve": phase_serve, "decode": phase_decode, "throughput": phase_throughput}


def run_child(args) -> int:
    """One phase in this process; its JSON to <phase>.json in the work folder. SIGTERM (the parent's time bound)
    unwinds, so every process the phase started is stopped by its helper; a SIGKILL still ends
    the workers and the gateway, which watch this process (PDSERVE_PARENT_PID)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    os.environ["PDSERVE_PARENT_PID"] = str(os.getpid())
    models = {k: Path(v) for k, v in json.loads((args.work / "models.json").read_text()).items()}
    result = PHASE_RUNS[args.phase](args, sizes(args.quick), args.work, models)
    (args.work / f"{args.phase}.json").write_text(json.dumps(result, indent=1))
    return 0


# --- the parent: models once, each phase bounded, the report ----------------------------------------

def prepare_models(args, work: Path) -> dict[str, str]:
    """The tiny checkpoint (with SmolLM2's tokenizer, for the gateway) and SmolLM2, converted once
    (or, with --smollm2 none, a random-weight checkpoint of its shape with its tokenizer)."""
    from bench.harness.pd_request import with_tokenizer
    from bench.harness.tiny_models import write_sized_checkpoint, write_tiny_checkpoint
    from common.model_source import resolve_model

    if args.smollm2 == "none":
        smollm2 = with_tokenizer(write_sized_checkpoint(work / "smollm2-shape-random", 9, 3, 64), args.tokenizer)
    else:
        smollm2 = resolve_model(args.smollm2)
    tiny = with_tokenizer(write_tiny_checkpoint(work / "tiny-llama-gqa", "llama-gqa", seed=4), smollm2)
    return {"tiny": str(tiny), "smollm2": str(smollm2)}


def run_phase(name: str, argv: list[str], work: Path, bound_s: float) -> dict:
    """Run one phase in a child process for at most `bound_s`; its JSON, or why there is none."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.gpu_pd", *argv, "--phase", name, "--work", str(work)]
    log_path = work / f"{name}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            status = "ok" if proc.wait(bound_s) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {bound_s:.0f} s"
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")
    sys.stderr.write(text)
    result = work / f"{name}.json"
    if status == "ok" and result.exists():
        return {"status": "ok", "seconds": time.perf_counter() - t0, **json.loads(result.read_text())}
    return {"status": status, "seconds": time.perf_counter() - t0, "error": text[-4000:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        return run_child(args)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run the dry run with --cpu", file=sys.stderr)
        return 2
    from bench.harness.pd_report import render, verdict

    name = device_name(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "device_kind": args.device, "torch": torch.__version__, "quick": args.quick,
              "dtype": args.dtype, "phases": {}}
    bounds = QUICK_BOUND_S if args.quick else FULL_BOUND_S
    child_argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-pd-") as tmp:
        work = Path(tmp)
        log(f"device: {name}; preparing the models")
        (work / "models.json").write_text(json.dumps(prepare_models(args, work)))
        for phase in args.phases:
            log(f"phase {phase} (at most {bounds[phase]} s)")
            report["phases"][phase] = run_phase(phase, child_argv, work, bounds[phase])
            print(render(name, phase, report["phases"][phase]), flush=True)
    code, why = verdict(report)
    report["exit"] = {"code": code, "why": why}
    (args.out / "gpu_pd.json").write_text(json.dumps(report, indent=1))
    print(f"[{name}] {why} (exit {code}); figures in {args.out / 'gpu_pd.json'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
