"""One remote prefill's state: the request's attempts down its list of prefill workers, the
phase of the current one, and what of its answer has come. decode/remote_prefill.py moves
it from phase to phase; this file only says what it holds.

Both the Prefill RPC's reply and the KV notification (matched by the attempt's transfer id)
have to arrive before the sequence can decode. An attempt that fails while its prefill
worker may still be writing waits in ABORTING until that worker confirms nothing is in
flight or is proven gone (decode/unconfirmed_aborts.py), and only then does the next one
start, so no stale write lands in blocks another worker is filling.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import grpc

from engine.scheduler import RemotePrefill
from rpc import pdserve_pb2 as pb


class Phase(enum.Enum):
    PREFILLING = "prefilling"  # Prefill RPC in flight, KV not complete yet
    ABORTING = "aborting"  # waiting for the failed worker to confirm no write is in flight
    DONE = "done"


@dataclass
class RemotePrefillState:
    request_id: str
    prefill_workers: list[str]
    destination_blocks: list[int]
    num_cached_tokens: int
    deadline: float  # monotonic; the gateway's deadline for the whole request
    attempt: int = 0
    transfer_id: str = ""  # the current attempt's: its KV notifications carry it (new_transfer_id)
    phase: Phase = Phase.PREFILLING
    rpc: grpc.Future | None = None
    abort_rpc: grpc.Future | None = None
    kv_complete: bool = False
    first_token: int | None = None
    first_logprobs: object = None
    prefill_timings: object = None
    prefill_cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache served (its reply)
    started: float = field(default_factory=time.monotonic)
    failures: list[str] = field(default_factory=list)
    transfer_failed: bool = False  # the last failed attempt failed in its KV transfer, not its prefill
    aborting_since: float = 0.0  # monotonic: when the current attempt's abort was first asked
    retry_at: float = 0.0  # an unconfirmed abort is asked again from then
    reserved: RemotePrefill | None = None  # the schedule's reservation: the sequence and its blocks
    kv_source: pb.KVSource | None = None  # a hand-off's: the drained decode worker (first in the list) keeps its KV
    cancelled: bool = False  # the client left: once nothing is in flight, its blocks are Released

    @property
    def worker(self) -> str:
        return self.prefill_workers[self.attempt]

    @property
    def has_next_worker(self) -> bool:
        return self.attempt + 1 < len(self.prefill_workers)

