"""One request served end to end with its KV pushed over NIXL, for `python -m bench.gpu_pd`.

A prefill worker and a decode worker (`python -m prefill` / `python -m decode`, float32,
both on the given device) and a gateway over them, as processes. Two prompts, greedy,
ignore_eos:
- one as a Generate call on the decode worker naming the prefill worker (the call the
  gateway makes): its token ids, and its first message's served facts (the KV came from
  the prefill worker, how many blocks);
- one through the gateway's /v1/completions: its x-pdserve-* headers (gateway/served.py)
  and its text.
Their tokens are set against the engine's on CPU with the torch reference ops and against
transformers' argmax on the device, the text against the reference tokens' decoding. The
prefill worker's Prometheus registry (its Metrics call) gives the bytes it pushed, and with
UCX_PROTO_INFO=y the workers' logs say which transport UCX chose for the writes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import torch

from bench.harness.device_push import ucx_writes
from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import WorkerSpec, start_workers
from rpc import pdserve_pb2 as pb

SERVED_NAME = "smollm2"  # what bench.harness.gateway_procs names the model for clients


def worker_device_args(device: str) -> list[str]:
    """The worker flags that put its engine on `device`; RuntimeError when the workers cannot."""
    if device == "cpu":
        return []
    from worker.process import worker_arguments

    if "--device" not in worker_arguments("decode")._option_string_actions:
        raise RuntimeError("the workers take no --device flag (worker/process.py): a worker's engine runs on "
                           "the CPU only, so nothing can be served on a GPU yet")
    return ["--device", device]


def prompts(vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    """Two prompts of fixed random ids (seeded) that share no prefix, so neither hits a cache."""
    g = torch.Generator().manual_seed(49)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_tokens(folder: Path, ps: list[list[int]], max_new: int, device: str, kernels: str) -> list[list[int]]:
    """Greedy tokens of pdserve's engine in this process, all prompts in one batch."""
    os.environ["PDSERVE_KERNELS"] = kernels
    from common.sampling_params import SamplingParams
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    cfg = ModelConfig.from_pretrained(folder)
    engine = LLMEngine(EngineConfig(cfg, folder, torch.float32, CacheConfig(block_size=16, num_blocks=128),
                                    SchedulerConfig(max_model_len=1024, max_num_batched_tokens=512), device))
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
        outs[f"r{i}"] = []
    while engine.has_unfinished():
        for d in engine.step():
            outs[d.request_id].extend(d.token_ids)
    return [outs[f"r{i}"] for i in range(len(ps))]


def transformers_tokens(folder: Path, ps: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    """The argmax of transformers' forward on `device`, one prompt at a time, EOS not stopping."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    out = []
    for p in ps:
        ids = list(p)
        with torch.no_grad():
            for _ in range(max_new):
                ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
        out.append(ids[len(p):])
    del model
    return out


def pushed_bytes(exposition: bytes) -> dict[str, float]:
    """The prefill worker's transfer counters from its Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    got = {"bytes": 0.0, "pushes": 0.0, "seconds": 0.0}
    for family in text_string_to_metric_families(exposition.decode()):
        for s in family.samples:
            if s.name == "pdserve_kv_transfer_bytes_total":
                got["bytes"] += s.value
            elif s.name == "pdserve_kv_transfer_seconds_count":
                got["pushes"] += s.value
            elif s.name == "pdserve_kv_transfer_seconds_sum":
                got["seconds"] += s.value
    return got


def with_tokenizer(folder: Path, tokenizer_folder: Path) -> Path:
    """A model folder the gateway can tokenize for: a tiny checkpoint has no tokenizer of its
    own, so SmolLM2's is copied in (the prompts here are ids below the tiny vocabulary)."""
    if not (folder / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_folder / name, folder / name)
    return folder


def serve_and_check(folder: Path, device: str, max_new: int, lengths: tuple[int, int], log_dir: Path,
                    ready_timeout_s: float) -> dict:
    """Everything above for one model; `tokens_match` and `kv_remote` say whether it passed."""
    from common.tokenizer import Tokenizer
    from engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(folder).vocab_size
    ps = prompts(vocab, lengths)
    t0 = time.perf_counter()
    cpu_ref = engine_tokens(folder, ps, max_new, "cpu", "torch")
    hf_ref = transformers_tokens(folder, ps, max_new, device)
    refs_s = time.perf_counter() - t0
    args = ["--dtype", "float32", "--kv-blocks", "256", *worker_device_args(device)]
    env = {"UCX_PROTO_INFO": "y", "PDSERVE_KERNELS": "auto"}
    t0 = time.perf_counter()
    prefill, decode = start_workers([WorkerSpec("prefill", args, env), WorkerSpec("decode", args, env)],
                                    folder, log_dir, ready_timeout_s)
    try:
        start_s = time.perf_counter() - t0
        params = pb.SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
        grpc_tokens, served = [], None
        for msg in decode.stub.Generate(pb.GenerateRequest(request_id="gpu-pd-0", prompt_token_ids=ps[0],
                                                           params=params, prefill_workers=[prefill.address]),
                                        timeout=120):
            if served is None and msg.HasField("served"):
                served = msg.served
            grpc_tokens.extend(msg.token_ids)
        body = {"model": SERVED_NAME, "prompt": ps[1], "max_tokens": max_new, "temperature": 0, "ignore_eos": True}
        with gateway(folder, [decode.address], [prefill.address], log_dir / "gateway.log") as url:
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        answer.raise_for_status()
        metrics = pushed_bytes(prefill.stub.Metrics(pb.MetricsRequest(), timeout=10).exposition)
    finally:
        prefill.stop()
        decode.stop()
    tokenizer = Tokenizer.from_pretrained(folder)
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-pdserve-")}
    text = answer.json()["choices"][0]["text"]
    kv_remote = (served is not None and bool(served.prefill_worker) and served.kv_blocks > 0
                 and headers.get("x-pdserve-prefill") == "remote" and int(headers.get("x-pdserve-kv-blocks", 0)) > 0
                 and metrics["bytes"] > 0)
    tokens_match = (grpc_tokens == cpu_ref[0] == hf_ref[0] and cpu_ref[1] == hf_ref[1]
                    and text == tokenizer.decode(cpu_ref[1]))
    return {
        "model": folder.name, "device": device, "prompt_tokens": [len(p) for p in ps], "max_new": max_new,
        "tokens_match": tokens_match, "kv_remote": kv_remote,
        "generate": {"tokens": grpc_tokens, "cpu_engine": cpu_ref[0], "transformers": hf_ref[0],
                     "served": None if served is None else {"prefill_worker": served.prefill_worker,
                                                            "kv_blocks": served.kv_blocks}},
        "completions": {"text": text, "reference_text": tokenizer.decode(cpu_ref[1]), "headers": headers,
                        "cpu_engine": cpu_ref[1], "transformers": hf_ref[1]},
        "transfer_metrics": metrics,
        "ucx_writes": ucx_writes(prefill.log_path, decode.log_path),
        "references_s": refs_s, "workers_start_s": start_s,
    }
