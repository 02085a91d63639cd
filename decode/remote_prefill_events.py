"""What the remote prefills tell the decode worker to do: the events that
decode/remote_prefill.py's `RemotePrefills` (`start`, `poll`, `set_members`) hands back and
decode/worker.py applies to its engine and streams. Only these cross from the remote
prefills to the worker; neither reaches into the other.

- `KVReady`: the KV landed and the prefill worker sampled the first token: decode it.
- `PrefillHere`: no prefill worker is left (or none could be asked), and nothing is in
  flight: prefill it locally.
- `Released`: blocks no prefill worker can be writing any more: a cancelled request's, or
  blocks set aside under a quarantine id (decode/unconfirmed_aborts.py).
- `Quarantined`: a prefill worker neither confirmed an abort nor was proven gone within the
  abort bound: the request's blocks are set aside (held, out of use) and the request goes on
  without them (prefilled here); their `Released` comes once the worker confirms or is
  proven gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from rpc import pdserve_pb2 as pb


@dataclass(frozen=True)
class KVReady:
    request_id: str
    first_token: int
    first_logprobs: object
    timings: pb.Timings | None
    num_blocks: int
    num_cached_tokens: int
    worker: str = ""  # the prefill worker that filled them


@dataclass(frozen=True)
class PrefillHere:
    """The request is prefilled on this worker after all. `cause` (a pb.LocalPrefill: its
    metric label, and what the request's first message says): the Prefill could not be sent
    (SEND_FAILED), every offered worker failed, the last in its prefill (PREFILL_FAILED) or
    in its KV transfer (TRANSFER_FAILED), or its time ran out (DEADLINE); `reasons` says what
    each try met."""

    request_id: str
    reasons: list[str]
    cause: int = pb.LOCAL_PREFILL_PREFILL_FAILED


@dataclass(frozen=True)
class Released:
    request_id: str


@dataclass(frozen=True)
class Quarantined:
    request_id: str
    quarantine_id: str  # the blocks' id until they are Released
    cancelled: bool  # the request is gone already; else it is prefilled here


Event = KVReady | PrefillHere | Released | Quarantined
