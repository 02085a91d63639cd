"""One request's remote prefill as the decode worker tracks it: which prefill worker is
trying, its Prefill RPC, whether the KV has landed, and what to do when an attempt fails.

States: the Prefill RPC (a gRPC future) and the KV notification (KVReceiver) both have to
arrive before the sequence can decode. An attempt that fails while the prefill worker may
still be writing is aborted first (Abort RPC), and the next attempt starts only once that
worker confirms nothing is in flight or is known dead, so no stale write lands in blocks
that another worker is filling.
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field

import grpc

from rpc.proof import NotProven


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
    started: float = field(default_factory=time.monotonic)
    failures: list[str] = field(default_factory=list)

    @property
    def worker(self) -> str:
        return self.prefill_workers[self.attempt]

    @property
    def has_next_worker(self) -> bool:
        return self.attempt + 1 < len(self.prefill_workers)


def worker_is_gone(error: BaseException) -> bool:
    """A gRPC error that means the worker cannot be writing any more (dead, never reached,
    or never sent anything because it could not prove itself)."""
    return isinstance(error, NotProven) or isinstance(error, grpc.RpcError) and error.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)


def new_transfer_id(request_id: str, attempt: int) -> str:
    """`request_id.attempt.nonce`: what one attempt's notifications are matched by."""
    return f"{request_id}.{attempt}.{secrets.token_hex(4)}"


def request_of(transfer_id: str) -> str:
    return transfer_id.rsplit(".", 2)[0]
