"""The offline API at tensor_parallel_size=N: this process is rank 0 (scheduler, KV manager,
sampling), the other ranks are processes that run each step's plan. Greedy float32 tokens
through the whole engine (continuous batching, chunked prefill, prefix cache) equal one
rank's and transformers'; the followers stop when the engine closes; a degree the model's
heads do not allow is refused before any process starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from bench.harness.tiny_models import VOCAB, load_hf, write_tiny_checkpoint
from bench.harness.worker_procs import REPO
from common.sampling_params import SamplingParams
from engine import LLM
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.parallel.follower import rank_device
from engine.parallel.rank_group import RankGroup
from engine.parallel.rank_clock import STRAGGLER_MIN_STEPS, RankClocks, RankTime, StragglerWatch, straggler
from engine.step_buffers import StepLimits


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 40, 3, 26)]


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _engine(folder, size: int) -> LLMEngine:
    # a 16-token budget: the 40- and 26-token prompts are prefilled in chunks beside decodes
    return LLMEngine.from_folder(folder, "float32", CacheConfig(block_size=16, num_blocks=32),
                                 SchedulerConfig(max_num_batched_tokens=16, max_model_len=256),
                                 tensor_parallel_size=size)


@pytest.mark.parametrize("kind,size", [("llama-gqa", 2), ("llama3-rope", 2)])
def test_engine_at_tp_gives_one_ranks_and_transformers_tokens(kind, size, tmp_path):
    folder = write_tiny_checkpoint(tmp_path / kind, kind, seed=5)
    prompts = _prompts()
    want = _generate(_engine(folder, 1), prompts, 8)
    hf = load_hf(folder, torch.float32)
    for p, w in zip(prompts, want):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert w == ref

    engine = _engine(folder, size)
    procs = list(engine.ranks._procs)
    try:
        assert engine.kv_cache.pool.shape[4] == max(1, engine.config.model.num_kv_heads // size)
        assert _generate(engine, prompts, 8) == want
        assert _generate(engine, prompts[:2], 8) == want[:2]  # again: prefix-cache hits, same blocks on every rank
        assert engine.kv_manager.num_free_blocks == 32  # every block back in the pool
    finally:
        engine.close()
    assert [p.exitcode for p in procs] == [0] * (size - 1)  # stopped by the close, not killed


def test_a_degree_the_heads_do_not_divide_is_refused(smollm2_dir):
    with pytest.raises(UnsupportedModelError) as err:
        LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    msg = str(err.value)
    assert "num_attention_heads=9" in msg and "tensor_parallel_size=2" in msg
    assert msg.endswith("degrees that divide every count: 1, 3")


def test_smollm2_at_three_ranks_gives_one_ranks_tokens(smollm2_dir):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32) as one:
        want = one.chat(messages, params)[0].token_ids
    with LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32,
             tensor_parallel_size=3) as three:
        got = three.chat(messages, params)[0].token_ids
    assert got == want and len(want) == 12


def test_a_killed_rank_fails_the_next_step_instead_of_hanging_it(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa", seed=5)
    engine = _engine(folder, 2)
    try:
        follower = engine.ranks._procs[0]
        follower.kill()
        follower.join(30)
        assert follower.exitcode is not None
        engine.add_request("r0", _prompts()[0], SamplingParams(temperature=0, max_tokens=4))
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 is gone"):
            engine.step()
    finally:
        engine.close()


def test_a_step_that_fails_on_rank_0_alone_ends_the_group(tmp_path):
    """Rank 0's step fails after its plan went out (the followers are in its collectives):
    the group is over at once, its followers killed, and every later step fails naming why,
    instead of rank 0's next step pairing with the followers' collectives one step behind."""
    folder = write_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa", seed=5)
    engine = _engine(folder, 2)
    prepare = engine.runner.prepare
    try:
        def fails_once(out):
            engine.runner.prepare = prepare
            raise ValueError("injected on rank 0 alone")

        engine.runner.prepare = fails_once
        engine.add_request("r0", _prompts()[0], SamplingParams(temperature=0, max_tokens=4))
        with pytest.raises(ValueError, match="injected"):
            engine.step()
        follower = engine.ranks._procs[0]
        follower.join(30)
        assert follower.exitcode is not None, "the follower was left in the failed step's collectives"
        with pytest.raises(RuntimeError, match="rank 0's step failed .*injected on rank 0 alone"):
            engine.step()
    finally:
        engine.close()


def test_a_script_that_builds_a_tp_engine_at_module_level_fails_at_once_naming_the_idiom(smollm2_dir, tmp_path):
    """Each rank is a spawned process that imports the main module first: at module level,
    the script's LLM(...) runs again in every rank, which dies at import. Rank 0 says so and
    how to fix it, instead of waiting in the group's rendezvous for ranks that are gone."""
    script = tmp_path / "offline.py"
    script.write_text(f"from engine import LLM\nllm = LLM(model={str(smollm2_dir)!r}, dtype='float32', "
                      "num_kv_blocks=16, tensor_parallel_size=3)\nprint('built')\n")
    ran = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ran.returncode != 0 and "built" not in ran.stdout, (ran.stdout, ran.stderr[-3000:])
    named = re.search(r"tensor-parallel rank \d \(pid \d+\) ended", ran.stderr)
    assert named and 'if __name__ == "__main__":' in ran.stderr, ran.stderr[-3000:]


def test_every_rank_records_its_steps_and_its_time_in_collectives(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa", seed=5)
    engine = _engine(folder, 2)
    try:
        _generate(engine, _prompts(), 4)
    finally:
        engine.close()
    times = engine.ranks.clocks.read()  # once the followers stopped: a follower records after rank 0 returns
    assert [t.rank for t in times] == [0, 1]
    # both ranks ran every forward pass (one per step here: a step never runs nothing)
    assert times[0].steps == times[1].steps > 0
    for t in times:
        assert 0 < t.collective_s < t.step_s and t.compute_s == t.step_s - t.collective_s


def test_a_straggler_is_the_rank_that_computes_longest_while_the_others_wait():
    def rank(r, compute_ms, wait_ms, steps=40):
        return RankTime(r, steps, steps * (compute_ms + wait_ms) / 1e3, steps * wait_ms / 1e3)

    even = [rank(0, 10, 2), rank(1, 10.5, 1.5), rank(2, 9.8, 2.2)]
    assert straggler(even) == ""
    slow = [rank(0, 10, 8), rank(1, 18, 0.2), rank(2, 10, 8)]
    assert straggler(slow).startswith("rank 1 computes 18.0 ms a step against the others' 10.0 ms (1.8x)")
    assert straggler([rank(0, 10, 8, steps=5), rank(1, 18, 0.2, steps=5)]) == ""  # too few steps to judge
    assert straggler([rank(0, 0.1, 0), rank(1, 0.3, 0)]) == ""  # a gap within timer noise


def test_a_rank_is_named_only_once_it_was_the_straggler_in_three_windows_in_a_row():
    clocks = RankClocks(2)
    watch = StragglerWatch(clocks)

    def window(slow_rank: int | None, steps: int = 30):
        for _ in range(steps):
            for r in (0, 1):
                compute = 0.020 if r == slow_rank else 0.010
                wait = 0.0001 if r == slow_rank else 0.010 if slow_rank is not None else 0.001
                clocks.record(r, compute + wait, wait)
        return watch.look()

    assert [window(1), window(1)] == ["", ""]
    assert window(1).startswith("rank 1 computes 20.0 ms a step") and watch.look().endswith("in 3 windows in a row")
    assert window(1, steps=3).endswith("in 3 windows in a row")  # an idle window changes nothing
    assert window(None) == ""  # an even window ends the run
    assert [window(0), window(1), window(1)] == ["", "", ""]  # another rank starts a run of its own


def test_a_straggler_is_named_however_often_its_health_is_asked():
    """A slow host (steps of 100-300 ms) with several callers asking deep health (each
    gateway process, the controller): every look sees a few steps. The window grows until
    it can judge instead of each look throwing its few steps away, so the slow rank is named."""
    clocks = RankClocks(2)
    watch = StragglerWatch(clocks)
    verdicts = []
    for _ in range(4 * STRAGGLER_MIN_STEPS):  # a look after every step
        for r in (0, 1):
            clocks.record(r, 0.300 if r == 1 else 0.150 + 0.150, 0.001 if r == 1 else 0.150)
        verdicts.append(watch.look())
    assert verdicts[-1].startswith("rank 1 computes 299.0 ms a step") and verdicts[-1].endswith("in 4 windows in a row")
    third = 3 * STRAGGLER_MIN_STEPS - 1  # the look that ends the third whole window names it
    assert verdicts[third - 1] == "" and verdicts[third].endswith("in 3 windows in a row"), verdicts[third]


def test_cuda_ranks_take_a_device_each_and_too_few_devices_are_refused(tmp_path, monkeypatch):
    assert (rank_device("cuda", 0), rank_device("cuda", 3), rank_device("cpu", 2)) == ("cuda:0", "cuda:3", "cpu")
    assert rank_device("cuda:2", 1) == "cuda:3"  # from rank 0's device on
    folder = write_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa", seed=5)
    config = EngineConfig(ModelConfig.from_pretrained(folder), folder, torch.float32, CacheConfig(num_blocks=8),
                          SchedulerConfig(max_model_len=256), device="cuda", tensor_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the same answer on any machine
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size=2 from cuda on CUDA needs a device per rank "
                                           r"\(cuda:0..cuda:1\); 1 visible"):
        RankGroup(config, 8, StepLimits(16, 4, 16))


def test_shared_rank_pools_show_rank_0_what_every_rank_wrote(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa", seed=5)
    private = _engine(folder, 2)
    try:
        with pytest.raises(RuntimeError, match="not mapped in this process"):
            private.rank_pools()
    finally:
        private.close()
    engine = LLMEngine.from_folder(folder, "float32", CacheConfig(block_size=16, num_blocks=32),
                                   SchedulerConfig(max_num_batched_tokens=16, max_model_len=256),
                                   tensor_parallel_size=2, share_rank_pools=True)
    try:
        pools = engine.rank_pools()
        assert [heads for _, heads in pools] == [range(0, 1), range(1, 2)]  # 2 KV heads, one a rank
        _generate(engine, _prompts()[:1], 2)
        for pool, _ in pools:  # the 7-token prompt's block, written by each rank into its own pool
            assert pool[:, :, :, :7].abs().sum(dim=(1, 2, 3, 4, 5)).count_nonzero() >= 1
    finally:
        engine.close()
