"""Each model family side by side: offline tokens/s against transformers on the same
checkpoint shape, a mixture of experts' layer time split, and KV bytes per token.

    python -m bench.model_families [--requests 16] [--prompt 128] [--output 32] [--dtype float32]

One run on this host, for each family (Llama, Qwen3, Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3): a random-weight
checkpoint of one small shape written with transformers (hidden 512, 8 layers, 8 query and
2 KV heads of 64; the MoE families 16 experts, top 2, each expert a quarter of the dense
MLP's width, so about as much compute a token as the dense ones), then (1) pdserve's
`LLM.generate` over --requests requests (continuous batching) against transformers'
`generate` over the same requests in one static batch, the same dtype and one torch thread
each unless --threads says otherwise; (2) for the MoE families, one layer's time split
over a decode-sized batch (--requests tokens) and a prefill-sized one (--prompt tokens):
the router (its matmul, softmax and top-k), the grouping of tokens by expert, the experts;
(3) KV bytes per token, for this shape and for the published configs of the models each
family stands for. Progress goes to stderr, the tables to stdout; the host's CPU heads them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.model_source import resolve_model
from engine import LLM, SamplingParams
from engine.config import ModelConfig, parse_dtype
from engine.model import CausalLM
from kernels import get_ops
from kernels.host import cpu

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
FAMILIES = {  # name: (transformers config class, what differs from SHAPE)
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=384,
                                         norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=384)),
    # half the layers windowed at 128 positions (fewer than a request's 160), sinks, YaRN, biased experts
    "gpt-oss": ("GptOssConfig", dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=384,
                                     sliding_window=128, rope_parameters={
                                         "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 64,
                                         "rope_theta": 150000.0})),
    # latent attention (q LoRA 192, latent 128 + rotary 32 a token: 320 B a layer in float16 terms
    # against GQA's 512 here), 16 experts in 4 groups, one shared expert, layer 0 dense
    "deepseek-v3": ("DeepseekV3Config", dict(num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128,
                                             qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, head_dim=32,
                                             n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=384,
                                             n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1)),
}
# KV bytes per token of the published configs each family stands for (config.json values:
# layers, KV heads, head_dim), at bfloat16.
PUBLISHED = {"Llama-3.1-8B": (32, 8, 128), "Qwen3-8B": (36, 8, 128), "Qwen3-30B-A3B": (48, 4, 128),
             "Mixtral-8x7B": (32, 8, 128), "gpt-oss-120b": (36, 8, 64),
             "DeepSeek-V3": (61, 1, 288)}  # its latent entry, 512 + 64, as the pool's K and V halves
# gpt-oss-120b: 18 of its 36 layers windowed at 128 positions: past 128 tokens of context, what
# those layers' attention reads stops growing; pdserve still keeps and ships every position of
# every layer (the KV blocks are shared by all layers), so its bytes per token are the full ones.


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_checkpoint(folder: Path, family: str) -> Path:
    import transformers

    cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # transformers' own init
    model.save_pretrained(folder)
    tokenizer = resolve_model("smollm2")  # LLM loads a tokenizer; the requests here are token ids
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def requests(n: int, prompt: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(n)]


def run_pdserve(folder: Path, dtype: str, prompts: list[list[int]], output: int) -> float:
    """Output tokens/s of one generate call over every prompt (a warm-up call first)."""
    llm = LLM(model=str(folder), dtype=dtype, max_num_seqs=len(prompts), kv_cache_memory_gib=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * output / (time.perf_counter() - t0)


def run_transformers(folder: Path, dtype: torch.dtype, prompts: list[list[int]], output: int) -> float:
    """Output tokens/s of transformers' generate over the prompts in one static batch (equal lengths)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output, min_new_tokens=output,
                             do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + output
    return len(prompts) * output / seconds


def moe_split(folder: Path, dtype: torch.dtype, tokens: int, repeats: int = 20) -> dict[str, float]:
    """Median milliseconds of one MoE layer's parts over `tokens` rows: router, grouping, experts."""
    from engine.weights import load_weights

    cfg = ModelConfig.from_pretrained(folder)
    model = CausalLM(cfg, dtype)
    load_weights(model, folder)
    model.prepare()
    moe, ops = next(layer.moe for layer in model.layers if layer.moe is not None), get_ops("cpu")
    x = torch.randn(tokens, cfg.hidden_size, dtype=dtype) * 0.5
    parts: dict[str, list[float]] = {"router": [], "grouping": [], "experts": []}
    with torch.inference_mode():
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            weights, ids = moe.route(x)
            t1 = time.perf_counter()
            order = ids.flatten().argsort(stable=True)
            ends = torch.bincount(ids.flatten(), minlength=cfg.moe.num_experts).cumsum(0).tolist()
            t2 = time.perf_counter()
            moe(x, ops)  # the whole layer: the experts are what it adds to the two parts above
            t3 = time.perf_counter()
            parts["router"].append(t1 - t0)
            parts["grouping"].append(t2 - t1)
            parts["experts"].append((t3 - t2) - (t2 - t0))
            del order, ends, weights
    return {k: statistics.median(v[2:]) * 1e3 for k, v in parts.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    host = cpu()
    dtype = parse_dtype(args.dtype)
    prompts = requests(args.requests, args.prompt, SHAPE["vocab_size"])
    rows, splits = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            folder = write_checkpoint(Path(tmp) / family, family)
            log(f"{family}: pdserve")
            ours = run_pdserve(folder, args.dtype, prompts, args.output)
            log(f"{family}: transformers")
            theirs = run_transformers(folder, dtype, prompts, args.output)
            cfg = ModelConfig.from_pretrained(folder)
            rows.append((family, ours, theirs, cfg.kv_bytes_per_token(dtype), cfg.num_parameters()))
            if cfg.moe is not None:
                for tokens in (args.requests, args.prompt):
                    splits.append((family, tokens, moe_split(folder, dtype, tokens)))
    print(f"host: {host.model_name} ({host.isa}); torch {torch.__version__}, transformers "
          f"{importlib.metadata.version('transformers')}; {args.dtype}, {args.threads} thread(s); "
          f"{args.requests} requests of {args.prompt} prompt + {args.output} output tokens")
    print(f"\n{'family':<11}{'params':>9}{'pdserve tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}{'KV B/token':>12}")
    for family, ours, theirs, kv, params in rows:
        print(f"{family:<11}{params / 1e6:>8.1f}M{ours:>15.1f}{theirs:>20.1f}{ours / theirs:>7.2f}x{kv:>12}")
    if splits:
        print(f"\n{'MoE layer':<11}{'tokens':>7}{'router ms':>11}{'grouping ms':>13}{'experts ms':>12}")
        for family, tokens, ms in splits:
            print(f"{family:<11}{tokens:>7}{ms['router']:>11.3f}{ms['grouping']:>13.3f}{ms['experts']:>12.3f}")
    print(f"\n{'published model':<16}{'KV bytes/token (bf16)':>22}")
    for name, (layers, kv_heads, head_dim) in PUBLISHED.items():
        print(f"{name:<16}{2 * layers * kv_heads * head_dim * 2:>22}")


if __name__ == "__main__":
    main()
