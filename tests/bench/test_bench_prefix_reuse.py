"""The prefix-reuse benchmark (bench/prefix_reuse.py): its workload, the sums it makes of a
deployment's /metrics and the client's records, and its quick run for real (two `pdserve
serve` deployments, routing as before and prefix routing with the disk tier), so the
script cannot rot. Only what the run recorded is checked, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness.conversations import Shape, Turn, conversations, round_order
from bench.harness.worker_procs import REPO
from bench.prefix_reuse import identical, metrics_delta, summarize, table

SHAPE = Shape(conversations=4, turns=3, system_prompts=2, system_words=50, user_words=10, max_tokens=8, concurrency=2)


def test_conversations_share_system_prompts_and_resend_their_history():
    convs = conversations(SHAPE, seed=1)
    assert conversations(SHAPE, seed=1)[3].users == convs[3].users != conversations(SHAPE, seed=2)[3].users
    assert convs[0].system == convs[2].system != convs[1].system
    assert len(convs[0].system.split()) == 4 + 50 and len(convs[0].users) == 3
    convs[0].answers += ["first answer", "second answer"]
    assert convs[0].messages(0) == [{"role": "system", "content": convs[0].system},
                                    {"role": "user", "content": convs[0].users[0]}]
    third = convs[0].messages(2)
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[2]["content"] == "first answer" and third[-1]["content"] == convs[0].users[2]
    assert third[:3] == convs[0].messages(1)[:3]  # each turn's history is the last one's prompt and answer


def test_each_round_has_its_own_seeded_order():
    assert sorted(round_order(12, 0, seed=0)) == list(range(12))
    assert round_order(12, 0, seed=0) == round_order(12, 0, seed=0)
    assert len({tuple(round_order(12, t, seed=0)) for t in range(5)}) > 1


def _samples(prompt: float, hit: float, sibling: float, written: float, entries: float) -> dict:
    s = {("pdserve_engine_prompt_tokens_total", (("role", "decode"), ("worker", w))): prompt / 2 for w in "ab"}
    s.update({("pdserve_engine_prefix_cache_hit_tokens_total", (("role", "decode"), ("worker", w))): hit / 2
              for w in "ab"})
    s[("pdserve_engine_prefix_tier_tokens_total", (("role", "decode"), ("tier", "sibling"), ("worker", "a")))] = sibling
    s[("pdserve_prefix_fetches_total", (("outcome", "fetched"), ("role", "decode"), ("worker", "a")))] = sibling / 16
    s[("pdserve_prefix_routes_total", (("by", "index"), ("pool", "decode")))] = 3
    s[("pdserve_engine_kv_disk_blocks_written_total", (("role", "decode"), ("worker", "a")))] = written
    s[("pdserve_engine_kv_disk_entries", (("role", "decode"), ("worker", "a")))] = entries
    return s


def test_the_metrics_are_what_the_workload_added_summed_over_workers():
    m = metrics_delta(_samples(100, 20, 0, 0, 0), _samples(1100, 620, 320, 40, 40))
    assert m["prompt_tokens"] == {"decode": 1000} and m["prefix_hit_tokens"] == {"decode": 600}
    assert m["computed_tokens"] == {"decode": 400}
    assert m["tier_tokens"] == {"sibling": 320} and m["fetches"] == {"fetched": 20} and m["prefill_fetches"] == {}
    assert m["routes"] == {} and m["preemptions"] == 0  # unchanged counters are left out
    assert m["disk"]["blocks_written"] == 40 and m["disk"]["entries"] == 40 and m["disk"]["max_bytes"] == 0


def test_the_client_summary_counts_computed_tokens_and_turns_that_moved():
    def turn(conv: int, t: int, prompt: int, cached: int, worker: str, ttft: float, text: str, **more) -> Turn:
        return Turn(conv, t, prompt, cached, cached, worker, ttft_s=ttft, e2e_s=ttft + 0.5, text=text, **more)

    turns = [turn(0, 0, 500, 0, "a", 0.5, "x"), turn(1, 0, 500, 480, "b", 0.1, "y"),
             turn(0, 1, 600, 496, "b", 0.2, "z", prefix_source="a", prefix_blocks=25),
             Turn(1, 1, 600, error="HTTP 500")]
    s = summarize(turns)
    assert (s["prompt_tokens"], s["cached_answers"], s["computed_answers"]) == (1600, 976, 624)
    assert s["failed"] == 1 and s["moved_turns"] == 1 and s["headers_agree"] and s["sibling_blocks"] == 25
    assert s["ttft_s"]["p50"] == 0.2
    other = {"turns": [{**t, "text": "changed"} if t["turn"] else t for t in s["turns"]]}
    assert identical(s, s) == 1.0 and identical(s, other) == 2 / 3  # the failed turn is not compared


def test_the_table_sets_each_configuration_beside_the_first():
    def result(config: str, computed: int, texts: list[str]) -> dict:
        return {"config": config, "ttft_s": {"p50": 0.5, "p90": 1.0}, "wall_s": 10.0, "prompt_tokens": 100,
                "computed_answers": computed, "moved_turns": 0, "failed": 0,
                "turns": [{"conversation": 0, "turn": t, "text": x, "error": None} for t, x in enumerate(texts)]}

    text = table([result("before", 80, ["a", "b"]), result("after", 20, ["a", "c"])])
    assert "after/before" in text
    assert next(line for line in text.splitlines() if line.startswith("computed (answers)")).endswith("0.25x")
    assert "answers identical, after vs before: 50%" in text


def test_the_quick_run_measures_prefix_routing_with_the_disk_tier(tmp_path):
    """One deployment, prefix routing and the disk tier on (routing as before is the same
    script without two flags: its figures' sums and table are checked above)."""
    out = tmp_path / "prefix_reuse.json"
    run = subprocess.run([sys.executable, "-m", "bench.prefix_reuse", "--quick", "--configs", "after",
                          "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["host"]["cpu"] and f"host: {result['host']['cpu']}" in run.stdout
    (after,) = result["configs"]
    assert after["config"] == "after" and "error" not in after, after.get("error")
    assert after["failed"] == 0 and len(after["turns"]) == 4 and after["ttft_s"]["p50"] is not None
    assert after["prompt_tokens"] > 0 and after["metrics"]["prompt_tokens"]["decode"] == after["prompt_tokens"]
    # the flags reached the deployment: decode workers routed on the index, a disk tier on each worker
    assert sum(n for k, n in after["metrics"]["routes"].items() if k.startswith("decode/")) == 4
    assert after["metrics"]["disk"]["max_bytes"] > 0
    # the second turns found their prefix (the shared system prompt at least) cached
    assert after["cached_answers"] > 0 and after["metrics"]["prefix_hit_tokens"]["decode"] > 0
