"""How a request was served, as its answer's headers say it, so a client can check that
disaggregation happened (and `pdserve trace`, from the gateway's `first_token` event):

    x-pdserve-decode-worker: decode-0-17966...     the decode worker it ran on (role-id-incarnation)
    x-pdserve-prefill: remote                      or local
    x-pdserve-prefill-worker: prefill-1-17966...   remote: the prefill worker whose KV it decodes from
    x-pdserve-kv-blocks: 3                         remote: the KV blocks that came over from it
    x-pdserve-local-prefill-reason: below_threshold  local: why (below)
    x-pdserve-cached-tokens: 0                     prompt tokens a prefix cache served (any worker's, any tier)
    x-pdserve-prefix-source: decode-1-17966...     the sibling decode worker it fetched prompt blocks from
    x-pdserve-prefix-blocks: 6                     ... and how many (counted in the cached tokens)

Clients see workers by name (`role-worker_id-incarnation`, as `pdserve status` and /metrics
name them), never by their gRPC addresses: those are internal, and stay in the trace
(`pdserve trace`) and the admin side. A worker whose name the gateway has not learnt yet
(its first Stats) is left out of the headers.

A streamed answer's headers leave with its first bytes, so all of this comes on the request's
first message from its decode worker (pb.Served, decode/worker.py); a whole answer carries
the same. Local prefill reasons (pb.LocalPrefill): no_prefill_worker, below_threshold,
prefix_cache_hit, and the fallbacks of a remote prefill: send_failed, prefill_failed,
transfer_failed, deadline, abort_unconfirmed. With n > 1 they describe the first choice; a
replay on another decode worker after the answer began is in the trace, not the headers.
When the first message is a remote prefill's abort that came before any KV (neither a
prefill worker nor a local reason to say), how it was prefilled is not known:
`x-pdserve-prefill` and the reason are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from common.trace import SERVED_FIELDS
from rpc import pdserve_pb2 as pb
from rpc.convert import local_prefill_name

HEADER_PREFIX = "x-pdserve-"
WORKER_FIELDS = ("decode_worker", "prefill_worker", "prefix_source")  # addresses inside, names to clients


@dataclass(frozen=True)
class Served:
    decode_worker: str
    prefill: str | None  # "remote" or "local"; None: not known (a worker older than pb.Served, or an abort first)
    prefill_worker: str | None = None
    kv_blocks: int | None = None
    local_prefill_reason: str | None = None
    cached_tokens: int | None = None
    prefix_source: str | None = None  # worker/prefix_fetch.py: only when blocks came from it
    prefix_blocks: int | None = None

    @classmethod
    def of(cls, decode_worker: str, first: pb.GenerateResponse) -> Served:
        """From the request's first message from `decode_worker`."""
        if not first.HasField("served"):
            return cls(decode_worker, None)
        s = first.served
        fetched = {"prefix_source": s.prefix_source, "prefix_blocks": s.prefix_blocks} if s.prefix_source else {}
        if s.prefill_worker:
            return cls(decode_worker, "remote", prefill_worker=s.prefill_worker, kv_blocks=s.kv_blocks,
                       cached_tokens=s.cached_prompt_tokens, **fetched)
        if s.local_prefill == pb.LOCAL_PREFILL_NONE:  # a remote prefill that ended (an abort) before any KV came
            return cls(decode_worker, None, cached_tokens=s.cached_prompt_tokens, **fetched)
        return cls(decode_worker, "local", local_prefill_reason=local_prefill_name(s.local_prefill),
                   cached_tokens=s.cached_prompt_tokens, **fetched)

    def fields(self) -> dict[str, str | int]:
        """The facts known, by name (common/trace.py SERVED_FIELDS)."""
        return {name: v for name in SERVED_FIELDS if (v := getattr(self, name)) is not None}

    def headers(self, name_of: Callable[[str], str | None]) -> dict[str, str]:
        """The answer's headers, each worker named by `name_of(address)` (left out when None)."""
        out = {}
        for field, value in self.fields().items():
            if field in WORKER_FIELDS:
                value = name_of(value)
                if value is None:
                    continue
            out[HEADER_PREFIX + field.replace("_", "-")] = str(value)
        return out


def served_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The x-pdserve-* headers among `headers` (a chat answer's, kept by an answer that
    rewrites it into another API's shape)."""
    return {k: v for k, v in headers.items() if k.lower().startswith(HEADER_PREFIX)}
