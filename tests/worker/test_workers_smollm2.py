"""SmolLM2 through real prefill and decode worker processes (gRPC + NIXL), float32:
the disaggregated output equals the offline engine's, and the model still says Paris."""

from __future__ import annotations

import threading

import pytest

from bench.harness.worker_procs import start_workers, wait_idle
from engine import LLM, SamplingParams
from rpc import pdserve_pb2 as pb

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def workers(smollm2_dir, tmp_path_factory):
    args = ["--dtype", "float32", "--kv-blocks", "256"]
    procs = start_workers([("prefill", args, {}), ("decode", args, {})], smollm2_dir,
                          tmp_path_factory.mktemp("logs"), timeout_s=120)
    yield procs
    for w in procs:
        w.stop()


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=256)


def generate(decode, prompt_ids, prefill_workers, rid):
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt_ids, prefill_workers=prefill_workers,
                             params=pb.SamplingParams(temperature=0, max_tokens=24))
    tokens, last = [], None
    for msg in decode.stub.Generate(req, timeout=120):
        tokens += list(msg.token_ids)
        last = msg
    return tokens, last


def test_disaggregated_smollm2_equals_the_offline_engine(workers, offline):
    prefill, decode = workers
    chats = [offline.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    expected = [o.token_ids for o in offline.generate(chats, SamplingParams(temperature=0, max_tokens=24))]
    results: dict[int, tuple] = {}

    def run(i):
        results[i] = generate(decode, chats[i], [prefill.address], f"smol-{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, want in enumerate(expected):
        tokens, last = results[i]
        assert tokens == want, PROMPTS[i]
        assert last.usage.completion_tokens == len(want)
    assert "Paris" in offline.tokenizer.decode(results[0][0])
    assert decode.stats().kv_blocks_transferred > 0  # the prompts' KV really crossed over NIXL
    for w in workers:
        s = wait_idle(w)
        assert s.free_blocks == s.total_blocks and s.running_requests == 0
