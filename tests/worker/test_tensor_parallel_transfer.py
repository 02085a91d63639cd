"""Prefill and decode workers of different tensor-parallel degrees, as real processes over
gRPC and NIXL, for the new families' tiny random checkpoints (Qwen3-MoE, gpt-oss with its
sinks and a window shorter than the prompts, and DeepSeek-V3 whose pool holds latents; 4
query and 2 KV heads, or one latent replicated on every rank; 8 experts split across the
ranks; float64: the KV is the attention's whatever the experts' split): 1 -> 1, 2 -> 1,
1 -> 2 and 2 -> 2 each give the offline engine's greedy tokens at one rank, and the KV came
from the prefill worker (the decode worker's first message names it and the blocks that
came over), with every block free on both sides afterwards. Equal degrees move whole blocks
rank to rank; different ones move each rank's heads (transfer/ranks.py). The bytes pushed
are the blocks in the model's KV spec once per receiving rank (a latent block once per
group: a CPU group's ranks share one latent pool, engine/parallel/rank_group.py). Through a real gateway, the official openai client gets
transformers' tokens at prefill TP 2 -> decode TP 1 and TP 1 -> TP 2, and for the families
whose KV or attention is new to the pool (gpt-oss's sinks and windows, DeepSeek's latents),
a stream moved mid-way (live migration from a drained TP 2 worker to a TP 1 one; a replay
on a TP 2 worker after a TP 1 one is killed with kill -9) still gives them."""

from __future__ import annotations

import json
import random
import shutil

import httpx
import pytest
import torch
from openai import OpenAI

from bench.harness.gateway_procs import admin_gateway, data_lines
from bench.harness.tiny_models import VOCAB, load_hf, write_tiny_checkpoint
from bench.harness.worker_procs import start_workers
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from deploy.drain import DrainEnd, drain, holdings_of
from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from rpc import pdserve_pb2 as pb
from tests.worker.grpc_calls import RPC_TIMEOUT_S, assert_idle, generate_request, random_prompt

BLOCK = 16
ARGS = ["--dtype", "float64", "--kv-blocks", "64", "--max-num-batched-tokens", "32"]
ADMIN_TOKEN = "admin-token-for-the-families-test"
# The workers a stream moves from: every step lasts at least 50 ms, so a 48-token stream is
# still mid-way when the test moves it after its 4th chunk, on any host.
STEP_FLOOR = {"PDSERVE_FAULT_STEP_FLOOR_S": "0.05"}
MOVED_TOKENS = 48


# The families whose attention or KV is new to the pool: Qwen3's q/k norms (Qwen3-MoE's), gpt-oss's
# sinks and windows, DeepSeek's latents. Qwen3 dense and Mixtral share these workers' paths (their
# attention is Qwen3-MoE's and Llama's); their experts at TP 2 are tests/engine/test_tensor_parallel.py's.
@pytest.fixture(scope="module", params=["qwen3-moe", "gpt-oss", "deepseek-v3"])
def model(request, tmp_path_factory, smollm2_dir):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's; the prompts are ids < VOCAB
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def hf_text(model):
    """prompt, n -> the text of transformers' n greedy tokens (float64, no EOS), as the gateway detokenizes it."""
    hf, tokenizer = load_hf(model), Tokenizer.from_pretrained(model)

    def text(prompt: list[int], n: int) -> str:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        return tokenizer.decode(out[0, len(prompt):].tolist())
    return text


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    """Prefill and decode workers at one and two ranks: {(role, degree): worker}."""
    specs = [(role, [*ARGS, "--worker-id", str(tp), "--tensor-parallel-size", str(tp)], {})
             for role in ("prefill", "decode") for tp in (1, 2)]
    started = start_workers(specs, model, tmp_path_factory.mktemp("logs"), timeout_s=240)
    yield {(role, tp): w for (role, tp), w in zip([(r, t) for r in ("prefill", "decode") for t in (1, 2)], started)}
    for w in started:
        w.stop()


def _offline(model, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine.from_folder(model, "float64", CacheConfig(block_size=BLOCK, num_blocks=64),
                                   SchedulerConfig(max_num_batched_tokens=32, max_model_len=512))
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        for delta in engine.step():
            out.extend(delta.token_ids)
    return out


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_kv_pushed_between_degrees_gives_one_ranks_tokens(workers, model, prefill_tp, decode_tp):
    p, d = workers["prefill", prefill_tp], workers["decode", decode_tp]
    prompt = random_prompt(random.Random(prefill_tp * 10 + decode_tp), 45)  # three blocks, prefilled in chunks
    tokens, served = [], []
    pushed = _pushed_bytes(p)
    request = generate_request(prompt, 10, prefill=[p.address], ignore_eos=True)
    for msg in d.stub.Generate(request, timeout=RPC_TIMEOUT_S):
        tokens.extend(msg.token_ids)
        served += [msg.served] if msg.HasField("served") else []
        final = msg
    assert final.error.code == pb.ERROR_NONE, final.error
    assert tokens == _offline(model, prompt, 10)
    assert [(s.prefill_worker, s.local_prefill) for s in served] == [(p.address, pb.LOCAL_PREFILL_NONE)]
    assert served[0].kv_blocks == -(-len(prompt) // BLOCK)  # every block of the prompt came over
    # The bytes that crossed are the blocks in the model's KV spec, once per receiving rank: its
    # heads' share of a block; a latent model's one entry once per group (its ranks share a pool)
    cfg = ModelConfig.from_pretrained(model)
    heads = max(1, cfg.num_kv_heads // decode_tp)
    spec_bytes = cfg.num_layers * 2 * BLOCK * heads * cfg.head_dim * 8  # one rank's share of a block, float64
    copies = 1 if cfg.mla is not None else decode_tp
    assert _pushed_bytes(p) - pushed == served[0].kv_blocks * copies * spec_bytes
    assert_idle(p, d)


def _pushed_bytes(prefill) -> float:
    return _metric(prefill, "pdserve_kv_transfer_bytes_total", 'peer_role="decode"')


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (40,), generator=g).tolist()  # 3 blocks; 5 windows of gpt-oss's 8


def test_the_openai_client_gets_transformers_tokens_between_degrees(workers, model, hf_text, tmp_path):
    with admin_gateway(model, [workers["decode", 1].address], [workers["prefill", 2].address],
                       tmp_path / "gateway.log", ADMIN_TOKEN) as (url, members):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        for prefill_tp, decode_tp in ((2, 1), (1, 2)):
            p, d = workers["prefill", prefill_tp], workers["decode", decode_tp]
            members([d.address], [p.address])
            prompt = _prompt(prefill_tp)
            out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == hf_text(prompt, 12), (prefill_tp, decode_tp)
            assert out.usage.completion_tokens == 12
            assert f"prefill on {p.address}" in d.log_path.read_text(errors="replace")
            assert_idle(p, d)


@pytest.mark.parametrize("model", ["gpt-oss", "deepseek-v3"], indirect=True)
def test_a_stream_moved_between_degrees_live_or_replayed_gives_transformers_tokens(workers, model, hf_text,
                                                                                   tmp_path):
    d1, d2, p1, p2 = (workers["decode", 1], workers["decode", 2], workers["prefill", 1], workers["prefill", 2])
    movers = start_workers([("decode", [*ARGS, "--worker-id", "7", "--tensor-parallel-size", "2"], STEP_FLOOR),
                            ("decode", [*ARGS, "--worker-id", "8"], STEP_FLOOR)], model, tmp_path)
    a, c = movers
    try:
        with admin_gateway(model, [a.address], [p1.address], tmp_path / "gateway.log", ADMIN_TOKEN,
                           "--health-interval", "3600") as (url, members):
            def hand_off() -> None:  # live migration: a (TP 2) keeps the KV, d1 (TP 1) pulls it
                members([d1.address], [p1.address])
                result = drain(lambda: holdings_of(a.stub.Drain(pb.DrainRequest(hand_off=True), timeout=30)),
                               a.alive, lambda: True, bound_s=300, health_interval_s=2, unhealthy_after=3)
                assert result.end is DrainEnd.EMPTY, result

            prompt = _prompt(21)
            assert _stream_through(url, prompt, hand_off) == hf_text(prompt, MOVED_TOKENS)
            assert "kept KV pushed to its taker" in a.log_path.read_text(errors="replace")
            assert f"KV from {a.address}" in d1.log_path.read_text(errors="replace")

            def kill() -> None:  # replay: c (TP 1) dies; d2 (TP 2) gets the streamed tokens' KV from p2
                members([c.address, d2.address], [p2.address])
                c.kill()

            members([c.address], [p2.address])
            prompt = _prompt(22)
            replays = d2.log_path.read_text(errors="replace").count(", remote prefill")
            assert _stream_through(url, prompt, kill) == hf_text(prompt, MOVED_TOKENS)
            assert d2.log_path.read_text(errors="replace").count(", remote prefill") == replays + 1
        assert_idle(d1, d2, p1, p2)
    finally:
        for w in movers:
            w.stop()


def _stream_through(url: str, prompt: list[int], move) -> str:
    """A greedy stream of MOVED_TOKENS through the gateway, `move` called after its 4th chunk; its text."""
    body = {"model": httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"], "prompt": prompt,
            "max_tokens": MOVED_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    text, chunks = [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in data_lines(resp.iter_lines()):
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            chunks += 1
            if chunks == 4:
                move()
    return "".join(text)


@pytest.mark.parametrize("model", ["deepseek-v3"], indirect=True)
def test_a_latent_prefix_fetched_from_a_decode_sibling_of_another_degree_gives_its_tokens(workers, model):
    """A conversation's next turn (tests/worker/test_prefill_prefix_fetch.py's, on latent blocks):
    the TP 1 decode worker holds the first turn's prompt and answer, the TP 2 prefill worker only
    the prompt; the second turn's remote prefill fetches the answer's latent blocks from the
    decode worker over NIXL instead of computing them, and gives the tokens the decode worker
    gives computing the turn itself."""
    p, d = workers["prefill", 2], workers["decode", 1]
    rng = random.Random(31)
    first = random_prompt(rng, 3 * BLOCK)
    answer, served = _turn(d, first, [p.address], 40)
    assert served.prefill_worker == p.address
    turn2 = first + answer + random_prompt(rng, 20)
    d_holds = (len(first) + len(answer) - 1) // BLOCK  # full blocks the decode worker cached
    fetched = _metric(p, "pdserve_engine_prefix_tier_tokens_total", 'tier="sibling"')
    tokens, served = _turn(d, turn2, [p.address], 8)
    assert served.prefill_worker == p.address and served.cached_prompt_tokens >= d_holds * BLOCK
    assert _metric(p, "pdserve_engine_prefix_tier_tokens_total", 'tier="sibling"') - fetched >= \
        (d_holds - len(first) // BLOCK) * BLOCK  # the answer's blocks came from the decode worker
    want, _ = _turn(d, turn2, [], 8)  # the decode worker computing the turn itself, from its own cache
    assert tokens == want
    assert_idle(p, d)


def _turn(d, prompt: list[int], prefill: list[str], max_tokens: int) -> tuple[list[int], pb.Served]:
    tokens, served = [], None
    for msg in d.stub.Generate(generate_request(prompt, max_tokens, prefill, ignore_eos=True), timeout=RPC_TIMEOUT_S):
        assert msg.error.code == pb.ERROR_NONE, msg.error
        served = msg.served if msg.HasField("served") else served
        tokens.extend(msg.token_ids)
    return tokens, served


def _metric(w, name: str, label: str) -> float:
    text = w.stub.Metrics(pb.MetricsRequest(), timeout=10).exposition.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)
