"""The workers a worker asks to write KV into its pool (a decode worker's prefill workers and
KV sources, decode/remote_prefill.py; the sibling a prefix is fetched from,
worker/prefix_fetch.py): the deployment's membership, one channel per address, the proof
each offered worker gives before it is asked, what proves a worker can no longer be
writing, what counts as an answer to an Abort, and the ids their notifications carry.

Membership (`set_members`, from the deploy controller's SetPeers): once known, only its
workers are asked (and proven), and a worker that leaves it is gone (the controller removes
a worker only once its process ended): its channel is closed, so whatever later listens on
its port must prove itself afresh, and what waited for it (an abort's answer, blocks set
aside: decode/unconfirmed_aborts.py) waits no more. Until the first list (workers started by
hand) any offered worker that proves itself is asked, and a silent one's blocks wait for
its answer.
"""

from __future__ import annotations

import logging
import secrets
import threading

import grpc

from rpc import auth
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.proof import NotProven

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0  # one Abort call: a network bound (the writer answers from its RPC thread)
ABORT_RETRY_S = 1.0  # an Abort that failed without proof is asked again after this


def worker_is_gone(error: BaseException) -> bool:
    """A call's error that proves the worker cannot be writing: it never sent anything (it
    could not prove itself; it does not serve prefills), or nothing listens at its address
    (connection refused: a worker closes its server only after its loop and pushes have
    stopped, or it died). UNAVAILABLE alone proves nothing: a connection that broke or a
    host gone silent may have a live worker behind it, still writing."""
    if isinstance(error, NotProven):
        return True
    if not isinstance(error, grpc.RpcError):
        return False
    return error.code() is grpc.StatusCode.UNIMPLEMENTED or (
        error.code() is grpc.StatusCode.UNAVAILABLE and "connection refused" in (error.details() or "").lower())


class KVPeers:
    """The membership and the channels of one decode worker's prefill workers. `members` may
    be set from any thread (one assignment); the channels are opened by the loop and the RPC
    threads (proving) both, under a lock."""

    def __init__(self):
        self.members: frozenset[str] | None = None  # the deployment's workers (SetPeers); None: not told
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]] = {}
        self._channels_lock = threading.Lock()

    def set_members(self, addresses: list[str]) -> None:
        """The deployment's workers now; the channels of those that left close (their calls
        in flight end CANCELLED)."""
        members = self.members = frozenset(addresses)
        with self._channels_lock:
            left = [a for a in self._channels if a not in members]
            for address in left:
                self._channels.pop(address)[0].close()
        for address in left:
            log.info("prefill peer %s left the deployment: its channel closed", address)

    def gone(self, address: str, error: BaseException | None = None) -> bool:
        """Known not to be writing: out of the deployment's membership, or `error` proves it."""
        return (self.members is not None and address not in self.members) or (
            error is not None and worker_is_gone(error))

    def proven(self, addresses: list[str], timeout_s: float) -> list[str]:
        """The offered prefill workers that proved they belong to this deployment (the
        internal token goes to no other address: rpc/proof.py). Runs on the request's
        RPC thread, so the first proof to a worker, a round trip, never holds the loop; one
        that cannot prove itself or be reached now is left out of this request's choices,
        and so is one outside the membership, without a call."""
        proven = []
        members = self.members
        for address in addresses:
            if members is not None and address not in members:
                log.warning("prefill worker %s left out: not a worker of this deployment now", address)
                continue
            try:
                auth.prove(self._channel(address)[0], timeout_s)
                proven.append(address)
            except grpc.RpcError as e:
                log.warning("prefill worker %s left out: %s", address, e.details())
        return proven

    def stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        return self._channel(address)[1]

    def _channel(self, address: str) -> tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]:
        with self._channels_lock:
            entry = self._channels.get(address)
            if entry is None:
                ch = auth.channel(address)
                entry = self._channels[address] = (ch, pb_grpc.PrefillWorkerStub(ch))
            return entry


def abort_answered(rpc: grpc.Future, request_id: str, worker: str, peers: KVPeers) -> bool:
    """The abort is confirmed (nothing of the request in flight) or the worker proven gone."""
    try:
        rpc.result()
        return True
    except grpc.RpcError as e:
        if peers.gone(worker, e):
            return True
        log.warning("request %s: %s did not confirm the abort (%s: %s); its blocks stay out of use",
                    request_id, worker, e.code().name, e.details())
        return False


def new_transfer_id(request_id: str, attempt: int) -> str:
    """`request_id.attempt.nonce`: what one attempt's notifications are matched by."""
    return f"{request_id}.{attempt}.{secrets.token_hex(4)}"


def request_of(transfer_id: str) -> str:
    return transfer_id.rsplit(".", 2)[0]
