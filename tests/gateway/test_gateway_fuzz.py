"""schemathesis against the gateway's own OpenAPI spec, over a real decode worker (aggregated,
SmolLM2): whatever the generated bodies, parameters and headers, no response is a 5xx and
the gateway keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from bench.harness.gateway_procs import gateway
from bench.harness.worker_procs import start_workers, wait_idle


@pytest.fixture(scope="module")
def fuzz_url(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    (decode,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "512", "--no-transfer"], {})],
                              smollm2_dir, logs, timeout_s=120)
    try:
        # a small output cap keeps each accepted request short; generated values above it get a 400
        with gateway(smollm2_dir, [decode.address], [], logs / "gateway.log", "--max-output-tokens", "4") as url:
            yield url
        s = wait_idle(decode)
        assert s.free_blocks == s.total_blocks and s.running_requests == 0  # nothing leaked
    finally:
        decode.stop()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(fuzz_url, mode):
    """Valid bodies (run through the model) and invalid ones (types, ranges, missing fields)."""
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    seen: dict[int, int] = {}

    @given(case=schema.as_strategy(mode), served=st.booleans())
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case, served):
        if served and mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = "smollm2"  # else nearly every valid body is a 404 for its random model
        response = case.call(base_url=fuzz_url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.method} {case.path} {case.body!r:.300} -> " \
                                           f"{response.status_code}: {response.text[:300]}"

    check()
    assert httpx.get(f"{fuzz_url}/health", timeout=10).status_code == 200
    print(mode.value, "status counts:", dict(sorted(seen.items())))
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= code < 500 for code in seen), seen  # the bad inputs really were refused
    else:
        assert 200 in seen, seen  # and valid ones really were served
