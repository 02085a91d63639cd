"""A worker's step log (PDSERVE_STEP_LOG, worker/step_log.py) and the fit of a deployment's
step costs from it (deploy/step_fit.py): a real engine loop on a tiny model logs each step's
shape as the scheduler made it, and the fit recovers known contention and loop terms."""

from __future__ import annotations

import logging
import time

import pytest

from deploy.profile import Profile
from deploy.sim_worker import StepShape
from deploy.simulator import Pools, simulate
from deploy.step_cost import KNOTS, price
from deploy.step_fit import LoggedStep, TokenRate, fit, iterations, read_steps
from engine import LLMEngine, SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from tests.tiny_models import write_tiny_checkpoint
from worker import step_log
from worker.loop import EngineLoop

SCHED = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256)


def test_an_engine_loop_logs_each_step_as_its_scheduler_made_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STEP_LOG", "1")
    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    engine = LLMEngine.from_folder(folder, "float32", CacheConfig(8, 64), SCHED)
    path = tmp_path / "worker.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(step_log.LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    loop = EngineLoop(engine)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        loop.call(lambda: engine.add_request("a", list(range(3, 23)), params))  # 20 tokens: one chunk
        loop.call(lambda: engine.add_request("b", list(range(30, 70)), params))  # 40: two chunks at 32 a step
        deadline = time.monotonic() + 60
        while loop.call(engine.has_unfinished):
            assert time.monotonic() < deadline, "the requests did not finish"
            time.sleep(0.01)
    finally:
        loop.stop()
        logger.removeHandler(handler)
        handler.close()
    steps = list(read_steps([path]))
    assert steps[0].shape.prefill_chunks[0] == (0, 20) and steps[0].gap_s is None
    chunks = [c for s in steps for c in s.shape.prefill_chunks]
    assert sum(n for _, n in chunks) == 60  # every prompt token once, in chunks of at most 32 a step
    assert all(s.shape.num_tokens <= 32 for s in steps)
    assert sum(s.shape.num_sampled for s in steps) == 12  # six tokens each
    decodes = [c for s in steps for c in s.shape.decode_contexts]
    assert sorted(decodes)[:2] == [21, 22] and max(decodes) == 45  # contexts as the runner sees them
    assert all(0 < s.engine_s <= s.busy_s for s in steps)


def _coef() -> list[float]:
    coef = [0.005 + 2e-5 * k for k in KNOTS]  # a constant and a cost per token through the linears
    return coef + [1e-6, 0.0, 0.0, 0.0]  # and the KV read per context token


def test_the_fit_recovers_a_deployments_contention_and_loop_terms():
    """Steps slower by 1.4x, and by 0.2 more per 100 tokens/s streamed (a light phase, then a
    heavy one), each iteration 2 ms + 0.5 ms per sampled row longer, 1 ms between steps."""
    coef, steps, t = _coef(), [], 0.0
    for i in range(120):
        batch = 1 if i < 60 else 8
        shape = StepShape(tuple(100 + 10 * j for j in range(batch)), ((0, 64),) if i % 5 == 0 else (),
                          batch + (i % 5 == 0))
        rate = TokenRate(steps).at(t)
        engine = price(coef, shape) * (1.4 + 0.002 * rate)
        busy = engine + 0.002 + 0.0005 * shape.num_sampled
        steps.append(LoggedStep(t, "decode d0", shape, engine, busy, None if i == 0 else 0.001))
        t += busy + 0.001
    assert TokenRate(steps).at(t) > 5 * TokenRate(steps[:60]).at(steps[59].t)  # two different loads
    terms = fit(coef, steps)["aggregated"]  # no prefill worker among them
    assert terms.scale == pytest.approx(1.4, rel=1e-3) and terms.per_token_rate == pytest.approx(0.002, rel=1e-2)
    assert terms.fixed_s == pytest.approx(0.003, abs=1e-4)  # the loop's own 2 ms and the 1 ms before each next step
    assert terms.per_sampled_s == pytest.approx(0.0005, rel=0.05)
    assert terms.error < 0.01
    assert len(list(iterations(steps))) == 120


def test_a_profile_with_loop_terms_prices_each_role_by_them():
    p = Profile("m", "float32", 1, 16, 512, 1 << 16, step_coef=_coef())
    shape = StepShape((200, 300), (), 2)
    assert p.step_s(shape, "prefill") == pytest.approx(price(p.step_coef, shape))
    p.loop_terms = {"decode": [2.0, 0.001, 0.0005, 0.01]}
    assert p.step_s(shape, "decode") == pytest.approx(2 * price(p.step_coef, shape) + 0.002)
    assert p.step_s(shape, "decode", 50.0) == pytest.approx(2.5 * price(p.step_coef, shape) + 0.002)
    assert p.step_s(shape, "prefill") == pytest.approx(price(p.step_coef, shape))  # no terms for that kind
    slow = simulate(p, Pools(1, 1), [(0.0, 64, 16)])[0]
    p.loop_terms["prefill"] = [3.0, 0.0, 0.0]  # a prefill worker three times slower: a later first token
    assert simulate(p, Pools(1, 1), [(0.0, 64, 16)])[0].ttft > slow.ttft
    alone = simulate(p, Pools(0, 1), [(0.0, 64, 16)])[0]
    p.loop_terms["aggregated"] = [2.0, 0.0, 0.0]  # an aggregated worker's terms are its own
    assert simulate(p, Pools(0, 1), [(0.0, 64, 16)])[0].finish > alone.finish
