"""The engine on a CUDA GPU, through the Triton op set, against references nobody here wrote.

    python -m bench.cuda_engine        # needs a CUDA device; exits 2 without one

For each tiny random-weight checkpoint kind of bench/harness/tiny_models.py (Llama GQA, MHA with
tied embeddings, Llama-3 RoPE scaling, Mistral, Qwen2 with q/k/v biases), float32:
- greedy tokens of the engine on CUDA (Triton kernels: paged decode and varlen prefill
  attention, KV writes, fused norms, RoPE, the batched sampler) against the argmax of Hugging
  Face transformers' forward on the same GPU, one prompt at a time, EOS not stopping either;
- the same requests, plus a seeded sampled one, through the engine on CPU with the torch
  reference ops: identical tokens (the seeded draws hash the same (seed, position, token));
- what the run exercises: chunked prefill (a 200-token prompt in 64-token chunks beside
  decodes), prefix-cache hits (a second round over a shared prefix), no leaked KV block.
Prints one line per kind and exits 1 on any mismatch. The CPU machine's tests run the same
comparison in Triton's interpreter (tests/kernels/test_engine_triton.py); this is the compiled path.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

MAX_NEW = 12


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, vocab, (37,), generator=g).tolist()  # two full 16-token blocks and some
    return [shared + [5, 6], shared, torch.randint(3, vocab, (200,), generator=g).tolist(), [7],
            torch.randint(3, vocab, (11,), generator=g).tolist()]


def engine_tokens(folder: Path, device: str, kernels: str) -> tuple[dict[str, list[int]], float]:
    """Two rounds: the first prompt alone (fills the prefix cache), then all at once."""
    os.environ["PDSERVE_KERNELS"] = kernels
    from common.sampling_params import SamplingParams
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    cfg = ModelConfig.from_pretrained(folder)
    engine = LLMEngine(EngineConfig(cfg, folder, torch.float32, CacheConfig(block_size=16, num_blocks=96),
                                    SchedulerConfig(max_model_len=512, max_num_batched_tokens=64), device))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=123, max_tokens=MAX_NEW,
                            ignore_eos=True)
    ps = prompts(cfg.vocab_size)
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()

    def run(batch) -> None:
        for rid, prompt, params in batch:
            engine.add_request(rid, prompt, params)
            outs[rid] = []
        while engine.has_unfinished():
            for d in engine.step():
                outs[d.request_id].extend(d.token_ids)

    run([("first", ps[0], greedy)])
    run([(f"r{i}", p, greedy) for i, p in enumerate(ps)] + [("seeded", ps[2], seeded)])
    stats = engine.stats()
    assert stats.prefix_cache_hit_rate > 0, "the second round hit no cached prefix"
    assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"
    return outs, time.perf_counter() - t0


def hf_greedy(folder: Path, vocab: int) -> dict[str, list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    out = {}
    for i, p in enumerate(prompts(vocab)):  # the argmax of the model's forward, EOS included (ignore_eos)
        ids = list(p)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        out[f"r{i}"] = ids[len(p):]
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this checks the engine on a GPU", file=sys.stderr)
        return 2
    from bench.harness.tiny_models import KINDS, write_tiny_checkpoint
    from engine.config import ModelConfig

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32, both systems
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            folder = write_tiny_checkpoint(Path(tmp) / kind, kind, seed=4)
            vocab = ModelConfig.from_pretrained(folder).vocab_size
            gpu, gpu_s = engine_tokens(folder, "cuda", "auto")
            cpu, cpu_s = engine_tokens(folder, "cpu", "torch")
            hf = hf_greedy(folder, vocab)
            vs_hf = sum(gpu[r] == hf[r] for r in hf)
            vs_cpu = sum(gpu[r] == cpu[r] for r in cpu)
            ok = vs_hf == len(hf) and vs_cpu == len(cpu)
            failed += not ok
            print(f"{kind:<15} greedy = transformers on the GPU: {vs_hf}/{len(hf)}; "
                  f"= the CPU engine (torch ops), seeded included: {vs_cpu}/{len(cpu)}; "
                  f"{gpu_s:.1f} s GPU (compiles included) / {cpu_s:.1f} s CPU  {'ok' if ok else 'MISMATCH'}")
            if not ok:
                for r in cpu:
                    if gpu[r] != cpu[r] or (r in hf and gpu[r] != hf[r]):
                        print(f"    {r}: gpu {gpu[r]}\n    {'':{len(r)}}  cpu {cpu[r]}\n    {'':{len(r)}}  hf  {hf.get(r)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
