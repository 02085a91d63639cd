"""How a request was served, from its first message (gateway/served.py), without workers:
what the headers say of a remote prefill, a local one, and one that is not known."""

from __future__ import annotations

from gateway.served import Served, served_headers
from rpc import pdserve_pb2 as pb


NAMES = {"d:1": "decode-1-7", "d:2": "decode-2-7", "d:3": "decode-3-7", "p:1": "prefill-1-7"}


def _first(**served) -> pb.GenerateResponse:
    msg = pb.GenerateResponse()
    msg.served.SetInParent()  # present even when every field is its default
    msg.served.MergeFrom(pb.Served(**served))
    return msg


def test_remote_and_local_prefills_say_so():
    remote = Served.of("d:1", _first(prefill_worker="p:1", kv_blocks=3, cached_prompt_tokens=16)).headers(NAMES.get)
    assert remote == {"x-pdserve-decode-worker": "decode-1-7", "x-pdserve-prefill": "remote",
                      "x-pdserve-prefill-worker": "prefill-1-7", "x-pdserve-kv-blocks": "3", "x-pdserve-cached-tokens": "16"}
    local = Served.of("d:1", _first(local_prefill=pb.LOCAL_PREFILL_BELOW_THRESHOLD)).headers(NAMES.get)
    assert local == {"x-pdserve-decode-worker": "decode-1-7", "x-pdserve-prefill": "local",
                     "x-pdserve-local-prefill-reason": "below_threshold", "x-pdserve-cached-tokens": "0"}


def test_an_abort_before_any_kv_does_not_claim_a_local_prefill():
    """A remote prefill aborted before its KV came: no prefill worker, no local reason. How
    it was prefilled is not known, and the headers leave it out rather than say local."""
    headers = Served.of("d:1", _first()).headers(NAMES.get)
    assert headers == {"x-pdserve-decode-worker": "decode-1-7", "x-pdserve-cached-tokens": "0"}
    assert Served.of("d:1", pb.GenerateResponse()).headers(NAMES.get) == {"x-pdserve-decode-worker": "decode-1-7"}  # an older worker


def test_an_answer_rewritten_keeps_only_the_served_headers():
    assert served_headers({"x-pdserve-prefill": "remote", "content-type": "text/event-stream",
                           "x-request-id": "r1"}) == {"x-pdserve-prefill": "remote"}


def test_blocks_fetched_from_a_sibling_name_it():
    local = Served.of("d:1", _first(local_prefill=pb.LOCAL_PREFILL_NO_PREFILL_WORKER, cached_prompt_tokens=96,
                                     prefix_source="d:2", prefix_blocks=6)).headers(NAMES.get)
    assert local["x-pdserve-prefix-source"] == "decode-2-7" and local["x-pdserve-prefix-blocks"] == "6"
    remote = Served.of("d:1", _first(prefill_worker="p:1", kv_blocks=1, cached_prompt_tokens=32,
                                     prefix_source="d:3", prefix_blocks=2)).headers(NAMES.get)
    assert remote["x-pdserve-prefix-source"] == "decode-3-7" and remote["x-pdserve-prefix-blocks"] == "2"
    assert "x-pdserve-prefix-source" not in Served.of("d:1", _first(prefill_worker="p:1")).headers(NAMES.get)


def test_clients_see_workers_by_name_never_by_address():
    """Addresses are internal (the trace keeps them); a worker the gateway cannot name yet is left out."""
    served = Served.of("d:1", _first(prefill_worker="p:9", kv_blocks=1, prefix_source="d:2", prefix_blocks=1))
    headers = served.headers(NAMES.get)
    assert not any(":" in v for v in headers.values()), headers
    assert "x-pdserve-prefill-worker" not in headers and headers["x-pdserve-prefix-source"] == "decode-2-7"
    assert served.fields()["prefill_worker"] == "p:9"  # the trace's
