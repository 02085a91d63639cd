"""Tensor parallelism on CPU: N ranks as N processes (gloo over loopback, one torch thread
each) on tiny random checkpoints, greedy float32. Every rank's logits of a prefill and of
decode steps equal one unsharded model's within float32 tolerance, and the greedy tokens
are TP=1's and transformers'. The kinds cover sharded KV heads (llama-gqa at 2), KV heads
replicated over ranks (llama3-rope: one KV head at 2; llama-gqa at 4), and q|k|v biases
with tied embeddings (qwen2)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from bench.harness.tiny_models import VOCAB, load_hf, write_tiny_checkpoint
from common.sampling_params import SamplingParams
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from engine.weights import load_weights

BLOCK = 16
DECODE_STEPS = 4
JOIN_S = 240  # bound on a rank's whole run (spawn, load, steps) on a busy 2-core host


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 21, 37)]


@torch.inference_mode()
def _greedy(model: CausalLM, kv: KVCache, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A batched prefill of `prompts`, then DECODE_STEPS greedy decode steps of all of them:
    each step's logits [num_seqs, vocab] and each prompt's greedy tokens."""
    runner = ModelRunner(model, kv)
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    per_seq = -(-(max(map(len, prompts)) + DECODE_STEPS + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(len(seqs))]  # scattered blocks
    steps = []
    for step in range(DECODE_STEPS + 1):
        chunks = [ScheduledChunk(s, 0, s.num_tokens, t) if step == 0 else ScheduledChunk(s, s.num_tokens - 1, 1, t)
                  for s, t in zip(seqs, tables)]
        prepared = runner.prepare(SchedulerOutput(chunks))
        hidden = model(prepared.input_ids, prepared.positions, kv.layers, prepared.attention)
        logits = model.compute_logits(hidden[prepared.sample_rows])  # [num_seqs, vocab]
        order = [int(c.seq.request_id[1:]) for c in prepared.sampled]
        logits = logits[torch.tensor(order).argsort()]  # back in prompt order
        steps.append(logits)
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.append_token(tok)
    return steps, [s.output_token_ids for s in seqs]


def _num_blocks(prompts) -> int:
    return len(prompts) * -(-(max(map(len, prompts)) + DECODE_STEPS + 1) // BLOCK)


def _rank_main(folder: str, size: int, rank: int, rendezvous: str, out: str) -> None:
    """One rank: its process group, its shard of the model and its KV heads' pool, the steps."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from engine.parallel.layout import TensorParallelLayout
    from engine.parallel.sharded_weights import load_sharded_model

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        cfg = ModelConfig.from_pretrained(folder)
        layout = TensorParallelLayout.of(cfg, size, rank)
        model = load_sharded_model(folder, cfg, layout, torch.float32)
        prompts = _prompts()
        kv = KVCache(model.local_cfg, _num_blocks(prompts), BLOCK, torch.float32)
        steps, tokens = _greedy(model, kv, prompts)
        experts = {len(layer.moe.experts) for layer in model.layers if layer.moe is not None}
        torch.save({"steps": steps, "tokens": tokens, "kv_heads": kv.pool.shape[4], "experts": experts}, out)
    finally:
        dist.destroy_process_group()


def _run_ranks(folder: Path, size: int, tmp: Path) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    outs = [tmp / f"rank{r}.pt" for r in range(size)]
    procs = [ctx.Process(target=_rank_main, args=(str(folder), size, r, str(tmp / "rendezvous"), str(outs[r])))
             for r in range(size)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_S)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * size, f"rank exit codes {codes} (None: still running after {JOIN_S} s)"
    finally:
        for p in procs:  # always reaped, even when one rank failed and the others wait in a collective
            if p.is_alive():
                p.kill()
            p.join(10)
    return [torch.load(o) for o in outs]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS + 1, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind,size", [("llama-gqa", 2), ("gpt-oss", 2), ("deepseek-v3", 2), ("qwen2", 2), ("qwen3", 2),
                                       ("qwen3-moe", 2), ("mixtral", 4), ("llama-gqa", 4)])
def test_sharded_ranks_match_one_rank_and_transformers(kind, size, tmp_path):
    folder = write_tiny_checkpoint(tmp_path / kind, kind, seed=3)
    cfg = ModelConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = CausalLM(cfg, torch.float32)
    load_weights(model, folder)
    model.prepare()
    prompts = _prompts()
    want_steps, want_tokens = _greedy(model, KVCache(cfg, _num_blocks(prompts), BLOCK, torch.float32), prompts)
    hf = load_hf(folder, torch.float32)
    assert want_tokens == [_hf_greedy(hf, p) for p in prompts]

    ranks = _run_ranks(folder, size, tmp_path)
    for rank, got in enumerate(ranks):
        assert got["kv_heads"] == max(1, cfg.num_kv_heads // size)  # the pool holds this rank's KV heads only
        if cfg.moe is not None:  # each rank holds its share of the experts, whole
            assert got["experts"] == {cfg.moe.num_experts // size}, got["experts"]
        assert got["tokens"] == want_tokens, f"rank {rank}"
        for step, (g, w) in enumerate(zip(got["steps"], want_steps)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"rank {rank} step {step}: {m}")


def test_a_vocabulary_the_degree_does_not_divide(tmp_path):
    """322 rows over 4 ranks: 81, 81, 81 and 79; the short rank's logits are padded to
    gather and the padding cut, so the rows come back whole and in order."""
    import transformers

    folder = tmp_path / "odd-vocab"
    hf_cfg = transformers.LlamaConfig(vocab_size=322, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(folder)
    cfg = ModelConfig.from_pretrained(folder)
    model = CausalLM(cfg, torch.float32)
    load_weights(model, folder)
    model.prepare()
    prompts = _prompts()
    want_steps, want_tokens = _greedy(model, KVCache(cfg, _num_blocks(prompts), BLOCK, torch.float32), prompts)
    for rank, got in enumerate(_run_ranks(folder, 4, tmp_path)):
        assert got["tokens"] == want_tokens, f"rank {rank}"
        for g, w in zip(got["steps"], want_steps):
            assert g.shape == w.shape == (len(prompts), 322)
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
