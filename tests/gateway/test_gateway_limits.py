"""Bad input and limits at the gateway: clear 4xx with the parameter named, bodies bounded
as they arrive, overload shed with fast 429s, values bounded to what the wire and the
engine hold, and a full worker still answering its health checks."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from bench.harness.gateway_procs import CHAT, data_lines, gateway, raw_post
from bench.harness.worker_procs import REPO, free_port, start_workers, wait_idle, wait_until
from rpc import pdserve_pb2 as pb


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": "smollm2", "messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ({"model": "smollm2", "messages": CHAT, "temperature": 3}, 400, "temperature"),
    ({"model": "smollm2", "messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": []}, 400, "messages"),
    ({"model": "smollm2", "messages": CHAT, "n": 17}, 400, "n"),  # over MAX_CHOICES
    ({"model": "smollm2", "messages": CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "smollm2", "messages": CHAT, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"model": "smollm2", "messages": CHAT, "stop": "x" * 60_000}, 400, "stop"),  # held back and searched per token
    ({"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi " * 9000}]}, 413, "messages"),
    ({"model": "gpt-5", "messages": CHAT}, 404, "model"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800 hi"}]}', 400, "messages"),
])
def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(system, client, body, status, param):
    url = system[0]
    if isinstance(body, bytes):
        resp = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    else:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    ok = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content


def test_oversized_body_is_413(system):
    resp = httpx.post(f"{system[0]}/v1/completions", content=b"x" * (2 << 20), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "error" in resp.json()




def test_a_chunked_body_is_counted_as_it_arrives_and_refused_past_the_limit(system, smollm2_dir, tmp_path):
    """No Content-Length: the limit is enforced on the bytes as they come, so 413 comes while
    the client is still sending (it never finishes here), and nothing larger is parsed."""
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--max-body-bytes", "3000") as url:
        answer = raw_post(url, {}, [b"x" * 1000] * 4, finish=False)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"request body over 3000 bytes" in answer
        small = raw_post(url, {}, [b'{"model": "smollm2", "prompt": "Hi", ', b'"max_tokens": 2}'], finish=True)
        assert small.startswith(b"HTTP/1.1 200"), small[:300]


def test_a_client_that_stops_sending_its_body_gets_408(system, smollm2_dir, tmp_path):
    """A half-sent body does not hold a connection open: past --body-timeout without a byte,
    408 and the connection back; a client that keeps sending is served."""
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--body-timeout", "1") as url:
        answer = raw_post(url, {}, [b'{"model": "smollm2", '], finish=False)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"not received within 1s" in answer
        ok = raw_post(url, {}, [b'{"model": "smollm2", "prompt": "Hi", ', b'"max_tokens": 2}'], finish=True)
        assert ok.startswith(b"HTTP/1.1 200"), ok[:300]


def test_a_body_that_trickles_in_gets_408_at_its_whole_deadline(system, smollm2_dir, tmp_path):
    """A client that sends a byte before every pause would time out still gets 408 once the
    whole body took longer than the pause bound plus the size limit at the slowest rate
    allowed (here 1 s + 4096 B at 16 KiB/s = 1.25 s): it cannot hold a connection forever."""
    import socket

    from gateway.front_door.body_limit import MIN_BODY_BYTES_PER_S

    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--body-timeout", "1", "--max-body-bytes", "4096") as url:
        host, port = url.removeprefix("http://").split(":")
        deadline_s = 1 + 4096 / MIN_BODY_BYTES_PER_S
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ntransfer-encoding: chunked\r\n"
                      "content-type: application/json\r\n\r\n".encode())
            answer = b""
            s.settimeout(0.5)
            for _ in range(40):  # a byte every 0.5 s (under the 1 s pause bound) for up to 20 s
                try:
                    s.sendall(b"1\r\n \r\n")
                except OSError:  # the server answered and closed: its answer is still to be read
                    pass
                try:
                    answer += s.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if answer:
                    break
            s.settimeout(5)
            while b"in all" not in answer:  # the rest of the answer (its head may come alone)
                try:
                    chunk = s.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert f"not received within {deadline_s:g}s in all".encode() in answer, answer[:300]


def test_configured_limits_on_prompt_tokens_and_body_size(system, smollm2_dir, tmp_path):
    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--max-prompt-tokens", "50", "--max-body-bytes", "3000") as url:
        long = httpx.post(f"{url}/v1/completions", timeout=30,
                          json={"model": "smollm2", "prompt": "word " * 100, "max_tokens": 2})
        assert long.status_code == 413 and long.json()["error"]["param"] == "prompt", long.text
        many = httpx.post(f"{url}/v1/chat/completions", timeout=30,  # refused before the template renders them
                          json={"model": "smollm2", "messages": [{"role": "user", "content": ""}] * 51, "max_tokens": 2})
        assert many.status_code == 413 and "51 messages cannot fit" in many.json()["error"]["message"], many.text
        big = httpx.post(f"{url}/v1/completions", timeout=30,
                         json={"model": "smollm2", "prompt": "x", "max_tokens": 2, "user": "u" * 4000})
        assert big.status_code == 413, big.text
        ok = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_overload_is_shed_with_fast_429s(system, smollm2_dir, tmp_path):
    """Past the predicted-TTFT bound the gateway answers 429 at once; admitted requests complete."""
    import concurrent.futures

    _, prefill, decode = system
    with gateway(smollm2_dir, [decode.address], [prefill.address], tmp_path / "gateway.log",
                 "--max-ttft", "1.5") as url:
        story = "Tell me a long story about the sea and its ships. " * 40  # ~450 tokens each

        def ask(i):
            return httpx.post(f"{url}/v1/completions", timeout=120,
                              json={"model": "smollm2", "prompt": f"{i} {story}", "max_tokens": 2})

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(ask, range(12)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 429}, codes
        assert 200 in codes and 429 in codes, codes  # some shed, the rest served
        shed = next(r for r in responses if r.status_code == 429)
        assert shed.json()["error"]["code"] == "overloaded" and int(shed.headers["retry-after"]) >= 1
        ok = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200  # the queue drained: admitted again


STORY = "Tell me a long story about the sea and its ships. " * 40  # ~450 tokens


def test_no_kv_headroom_is_a_fast_429_and_too_big_a_prompt_a_413(system, smollm2_dir, tmp_path):
    """A decode worker with 48 blocks (768 tokens): while one ~450-token request runs there is
    no room for another, so the gateway refuses it at once instead of queueing it."""
    _, prefill, _ = system
    (small,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "48"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [small.address], [prefill.address], tmp_path / "gateway.log",
                     "--health-interval", "0.2") as url:
            assert httpx.get(f"{url}/ready", timeout=10).status_code == 200  # Stats read: capacity known
            huge = httpx.post(f"{url}/v1/completions", timeout=30,
                              json={"model": "smollm2", "prompt": STORY * 2, "max_tokens": 1})
            assert huge.status_code == 413 and huge.json()["error"]["param"] == "prompt", huge.text
            too_long = httpx.post(f"{url}/v1/completions", timeout=30,
                                  json={"model": "smollm2", "prompt": STORY, "max_tokens": 400})
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens", too_long.text
            hold = {"model": "smollm2", "prompt": STORY, "max_tokens": 200, "stream": True, "logit_bias": {"2": -100}}
            with httpx.stream("POST", f"{url}/v1/completions", json=hold, timeout=60) as first:
                assert first.status_code == 200, first.read()
                lines = first.iter_lines()
                assert "error" not in next(data_lines(lines))
                other = httpx.post(f"{url}/v1/completions", timeout=30,
                                   json={"model": "smollm2", "prompt": "Another: " + STORY[:1500], "max_tokens": 2})
                assert other.status_code == 429, other.text
                assert "KV cache room" in other.json()["error"]["message"] and other.headers["retry-after"] == "1"
                # answered at once, not queued behind the running request: that one is still running
                assert small.stats().running_requests == 1
            s = wait_idle(small)
            assert s.free_blocks == s.total_blocks

            def room_seen() -> bool:
                """The stream was cut, not ended: its KV is room once a Stats asked after says
                so. Each /metrics scrape asks one (no wait on a health round, however slow the host)."""
                time.sleep(0.05)
                text = httpx.get(f"{url}/metrics", timeout=30).text
                gauges = {name: {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                                 for line in text.splitlines() if line.startswith(f"pdserve_worker_{name}{{")}
                          for name in ("kv_blocks_free", "kv_blocks_total")}
                return float(s.total_blocks) in gauges["kv_blocks_total"].values() and \
                    gauges["kv_blocks_free"] == gauges["kv_blocks_total"]  # the prefill worker's are there too

            wait_until(room_seen, 60, "the gateway's Stats to show the workers' blocks all free")
            again = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"model": "smollm2", "prompt": "Another: " + STORY[:1500], "max_tokens": 2})
            assert again.status_code == 200, again.text
    finally:
        small.stop()


def test_long_prompts_sent_back_to_back_to_an_idle_worker_are_never_refused(system, smollm2_dir, tmp_path):
    """Each ~450-token prompt takes most of a 48-block decode worker while it runs, and the
    gateway reads its Stats every 0.2 s, so one lands while it runs. Sent one after another,
    each after the previous answer, none is refused: a request's KV claim ends with it, not
    at the next Stats (an agent resends its long conversation turn after turn)."""
    _, prefill, _ = system
    (small,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "48"], {})], smollm2_dir, tmp_path)
    try:
        with gateway(smollm2_dir, [small.address], [prefill.address], tmp_path / "gateway.log",
                     "--health-interval", "0.2") as url:
            assert httpx.get(f"{url}/ready", timeout=10).status_code == 200  # Stats read: capacity known
            for turn in range(4):
                r = httpx.post(f"{url}/v1/completions", timeout=120,
                               json={"model": "smollm2", "prompt": f"Turn {turn}. {STORY}", "max_tokens": 40,
                                     "ignore_eos": True})
                assert r.status_code == 200, (turn, r.text)
    finally:
        small.stop()


def test_the_request_timeout_is_the_users_bound_and_by_default_follows_the_workers_speed(smollm2_dir, tmp_path):
    """A decode worker whose steps last at least 0.4 s (a slow host): 12 tokens take ~5 s.
    `--request-timeout 2` is the user's bound: the stream ends with an error; with no flag
    the deadline is derived from the request's tokens and the measured step, and it completes."""
    (slow,) = start_workers([("decode", ["--dtype", "float32", "--kv-blocks", "64"],
                              {"PDSERVE_FAULT_STEP_FLOOR_S": "0.4"})], smollm2_dir, tmp_path, timeout_s=120)
    body = {"model": "smollm2", "prompt": "Count:", "max_tokens": 12, "ignore_eos": True, "stream": True}
    try:
        with gateway(smollm2_dir, [slow.address], [], tmp_path / "bound.log", "--request-timeout", "2") as url:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                events = list(data_lines(r.iter_lines()))
            assert events[-1] == "data: [DONE]" and "error" in events[-2], events[-3:]
        with gateway(smollm2_dir, [slow.address], [], tmp_path / "derived.log") as url:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                events = list(data_lines(r.iter_lines()))
            assert events[-1] == "data: [DONE]" and not any("error" in e for e in events), events[-3:]
            assert sum(e.count('"text"') for e in events) >= 1
    finally:
        slow.stop()


def test_an_open_gateway_refuses_a_non_loopback_bind_unless_told(system, smollm2_dir, tmp_path):
    """No tenants file and an address other machines could reach: the gateway will not start,
    and says why; `--insecure-no-api-keys` (which names the risk) or API keys let it."""
    _, prefill, decode = system
    cmd = [sys.executable, "-m", "gateway", "--model", str(smollm2_dir), "--served-name", "smollm2",
           "--decode", decode.address, "--host", "0.0.0.0", "--port", str(free_port())]
    refused = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to serve on 0.0.0.0 without API keys" in refused.stderr, refused
    port = free_port()
    gw = subprocess.Popen([*cmd[:-1], str(port), "--insecure-no-api-keys"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert gw.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        gw.terminate()
        out, _ = gw.communicate(timeout=10)
    assert "with no API keys" in out  # warned, loudly


@pytest.mark.parametrize("field, value", [("top_k", 2**40), ("max_tokens", 2**40), ("seed", -1),
                                          ("logit_bias", {"\u00b2": 1.0}), ("logit_bias", {"1" * 40: 1.0})])
def test_a_value_the_wire_or_the_engine_cannot_hold_is_a_400_naming_it(system, field, value):
    """Every field is range-checked to what the proto (int32 top_k, max_tokens) and the engine
    accept: past it, 400 with the parameter named, never a 500."""
    url, _, _ = system
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": "Hi", field: value})
    assert r.status_code == 400, (field, value, r.status_code, r.text)
    assert field in json.dumps(r.json()["error"]), r.text


def test_twice_max_num_seqs_open_streams_leave_health_and_stats_answered(system):
    """Every open Generate stream holds one of the decode worker's gRPC threads: with twice
    `max_num_seqs` (64) streams open, all are admitted (running or queued) and Health, deep
    too, and Stats are still answered; none waits inside gRPC for a thread."""
    _, _, decode = system
    streams = 2 * 64
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4], params=pb.SamplingParams(max_tokens=400, ignore_eos=True))
    calls = [decode.stub.Generate(pb.GenerateRequest(request_id=f"open-{i}", prompt_token_ids=req.prompt_token_ids,
                                                     params=req.params), timeout=300) for i in range(streams)]

    def all_open() -> bool:
        try:
            s = decode.stub.Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return False  # queued behind the streams for a thread
        return s.running_requests + s.waiting_requests == streams

    try:
        wait_until(all_open, 120, f"{streams} streams admitted at once")
        assert decode.stub.Health(pb.HealthRequest(), timeout=5).ok
        assert decode.stub.Health(pb.HealthRequest(deep=True), timeout=30).ok
    finally:
        for c in calls:
            c.cancel()
    s = wait_idle(decode, timeout_s=60)
    assert s.running_requests == 0 and s.waiting_requests == 0 and s.free_blocks == s.total_blocks, s


def test_what_one_request_may_ask_of_logprobs_is_bounded(client):
    """n = 16 x 400 tokens x 21 log-probabilities each is 134,400 entries, past the bound:
    a 400 that names the parameter and the limit, at once (not a generation that builds
    ~100 MB of objects on the gateway's event loop). Under the bound it is served."""
    import openai

    from gateway.params import MAX_LOGPROB_ENTRIES

    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", messages=msgs, n=16, max_tokens=400, logprobs=True,
                                       top_logprobs=20)
    assert refused.value.body["param"] == "top_logprobs" and str(MAX_LOGPROB_ENTRIES) in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="log-probability entries"):
        client.completions.create(model="smollm2", prompt="Hi", n=16, max_tokens=2000, logprobs=5)
    ok = client.chat.completions.create(model="smollm2", messages=msgs, n=2, max_tokens=4, logprobs=True,
                                        top_logprobs=3)
    assert len(ok.choices) == 2 and len(ok.choices[0].logprobs.content[0].top_logprobs) == 3
