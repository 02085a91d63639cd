"""Decode steps against the roofline, and offline throughput against transformers, on one
device, for `python -m bench.gpu_pd`.

The engine here is an LLMEngine built on the device (the Triton op set on CUDA, the
host's on CPU); its decode step is timed by bench/roofline.py's `measure_decode` (steps in
which all B sequences decode) and set against `decode_roofline`, whose copy bandwidth and
matmul rates are measured on the same device in the same run (a device-to-device copy on a
GPU). CUDA graphs: `graph_decode` is the hook for the engine's graph replay; until the
engine captures graphs it answers why not, and the column says "not available".

Throughput: a ShareGPT-like batch (deploy/planner/workload.py) through the engine
(continuous batching) and through transformers' `generate` (static batches, left-padded,
each run to its longest request; only requested tokens counted), both on the device.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from bench.offline import left_pad
from bench.roofline import MachineRates, measure_bandwidth, measure_decode
from deploy.planner.workload import Request, sharegpt_requests


class EngineOnDevice(NamedTuple):
    """What bench/roofline.py's measure_decode reads of an LLM: its engine and tokenizer."""

    engine: object  # engine.llm_engine.LLMEngine
    tokenizer: object  # a TokenEncoder (deploy/planner/workload.py)


class FoldedEncoder:
    """A tokenizer whose ids are folded into a smaller vocabulary: realistic prompt lengths for a
    tiny random-weight checkpoint that has no tokenizer of its own (its text means nothing)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + t % (self.vocab_size - 3) for t in self.tokenizer.encode(text, add_special_tokens)]


def _timed(fn, device: str, repeats: int) -> float:
    """Best seconds of one call after a warm-up, synchronized on a GPU."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def device_rates(cfg, dtype: torch.dtype, batches: list[int], device: str, copy_mib: int) -> MachineRates:
    """Copy bandwidth (bytes read + written per second) and matmul rates, measured on `device`."""
    if device == "cpu":
        bandwidth = measure_bandwidth(copy_mib)
    else:
        n = copy_mib * 2**20
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        bandwidth = 2 * n / _timed(lambda: dst.copy_(src), device, 10)

    def matmul(m: int) -> float:
        x = torch.randn(m, cfg.hidden_size, device=device).to(dtype)  # [m, hidden]
        w = torch.randn(cfg.intermediate_size, cfg.hidden_size, device=device).to(dtype)  # [ffn, hidden]
        return 2 * m * cfg.hidden_size * cfg.intermediate_size / _timed(lambda: F.linear(x, w), device, 5)

    return MachineRates(bandwidth, matmul(4096 if device != "cpu" else 256), {b: matmul(b) for b in batches})


def make_engine(folder: Path, dtype: torch.dtype, device: str, max_num_seqs: int, num_blocks: int,
                budget: int):
    os.environ["PDSERVE_KERNELS"] = "auto"
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    cfg = ModelConfig.from_pretrained(folder)
    return LLMEngine(EngineConfig(cfg, folder, dtype, CacheConfig(16, num_blocks),
                                  SchedulerConfig(budget, max_num_seqs, min(cfg.max_model_len, 4096)), device))


def graph_decode(engine, batch: int) -> str:
    """Why the decode step of `batch` sequences cannot be replayed as a CUDA graph here.

    The hook for graph capture: once the engine captures its decode step per batch bucket,
    time it here with `measure_decode` the way eager is timed, and return the result instead."""
    return "not available: the engine does not capture CUDA graphs yet"


def decode_table(folder: Path, dtype: torch.dtype, device: str, batches: list[int], prompt_len: int, steps: int,
                 encoder, copy_mib: int) -> dict:
    from engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(folder)
    rates = device_rates(cfg, dtype, batches, device, copy_mib)
    top, budget = max(batches), 2048
    out_len = math.ceil(top * prompt_len / (budget - top)) + steps + 2  # what measure_decode asks for
    per_seq = math.ceil((prompt_len + out_len) / 16) + 1
    engine = make_engine(folder, dtype, device, top, top * per_seq + 64, budget)
    llm = EngineOnDevice(engine, encoder)
    rows = []
    for b in batches:
        d = measure_decode(llm, cfg, dtype, rates, b, prompt_len, steps, seed=b)
        rows.append({"batch": b, "steps": d.steps, "context": d.context, "eager_ms": d.mean_s * 1e3,
                     "eager_median_ms": d.median_s * 1e3, "graphs": graph_decode(engine, b),
                     "roofline_ms": d.roofline.seconds * 1e3, "memory_ms": d.roofline.memory_s * 1e3,
                     "bound": d.roofline.bound, "bytes_per_step": d.roofline.bytes_moved,
                     "eager_over_roofline": d.mean_s / d.roofline.seconds})
    del engine, llm
    return {"model": cfg.name, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
            "rates": asdict(rates), "rows": rows}


def engine_throughput(engine, requests: list[Request]) -> float:
    """Seconds for all requests through the engine at once (continuous batching)."""
    from common.sampling_params import SamplingParams

    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", requests[0].prompt_token_ids[:32], warm)
    while engine.has_unfinished():
        engine.step()
    got: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"t{i}", r.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        got[f"t{i}"] = 0
    while engine.has_unfinished():
        for d in engine.step():
            got[d.request_id] += len(d.token_ids)
    seconds = time.perf_counter() - t0
    for i, r in enumerate(requests):
        if got[f"t{i}"] != r.output_len:
            raise RuntimeError(f"request {i}: {got[f't{i}']} tokens, asked for {r.output_len}")
    return seconds


def transformers_throughput(folder: Path, dtype: torch.dtype, requests: list[Request], batch: int,
                            device: str) -> tuple[float, int]:
    """(seconds, tokens generated) of transformers' generate in static batches on `device`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else (
        eos[0] if isinstance(eos, list) else eos)

    def generate(chunk: list[Request], new: int) -> None:
        ids, mask = left_pad([r.prompt_token_ids for r in chunk], pad)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad)
        if out.shape[1] != ids.shape[1] + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked {new}")

    generate(requests[:2], 4)  # warm-up
    generated, t0 = 0, time.perf_counter()
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        new = max(r.output_len for r in chunk)
        generate(chunk, new)
        generated += new * len(chunk)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, generated


def throughput_table(folder: Path, dtype: torch.dtype, device: str, encoder, num_requests: int, max_input: int,
                     max_output: int, hf_batch: int) -> dict:
    requests = sharegpt_requests(encoder, num_requests, 0, max_input, max_output)
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.output_len for r in requests)
    blocks = sum(math.ceil((len(r.prompt_token_ids) + r.output_len) / 16) + 1 for r in requests) + 64
    engine = make_engine(folder, dtype, device, num_requests, blocks, budget=2048)
    ours_s = engine_throughput(engine, requests)
    del engine
    hf_s, hf_generated = transformers_throughput(folder, dtype, requests, hf_batch, device)
    return {"requests": num_requests, "prompt_tokens": prompt, "output_tokens": output, "hf_batch": hf_batch,
            "pdserve_s": ours_s, "pdserve_output_tps": output / ours_s,
            "transformers_s": hf_s, "transformers_output_tps": output / hf_s,
            "transformers_generated": hf_generated, "ratio": hf_s / ours_s}
