"""A fake nixl_agent for unit tests of the pusher and the receiver (test_push_receive.py,
test_transfer_faults.py) and of the workers' transfer bookkeeping (tests/worker/test_worker_steps.py):
every write it is asked for stays in flight (state PROC) until the test moves it to DONE
or ERR, so a test decides when and how each write ends. The real NIXL agents
are tested in separate processes (tests/transfer/test_transfer.py) and in the real system
(tests/worker/test_workers.py, tests/e2e/test_chaos.py)."""

from __future__ import annotations

from dataclasses import replace

from bench.harness.transfer_peers import MODEL
from transfer.agent import Peer, TransferAgent
from transfer.handshake import TransferInfo
from transfer.layout import KVLayout

LAYOUT = KVLayout(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


class FakeXfer:
    def __init__(self, local: list[int], remote: list[int], notif: bytes):
        self.local, self.remote, self.notif = local, remote, notif
        self.state = "PROC"  # the test moves it to DONE or ERR
        self.posted = False
        self.released = False
        # NIXL's release() of a write still in progress asks its backend to cancel it and
        # raises when it cannot: a test sets this False to have the write go on regardless.
        self.cancellable = True

    def release(self) -> None:
        if self.posted and self.state == "PROC" and not self.cancellable:
            raise RuntimeError("NIXL_IN_PROG: the transfer is still in progress")
        self.released = True


class FakeNixl:
    """The calls KVPusher and TransferAgent make on nixl_agent; writes stay in flight until told."""

    def __init__(self):
        self.made: list[FakeXfer] = []
        self.notifs: list[tuple[str, bytes]] = []
        self.incoming: dict[str, list[bytes]] = {}
        self.post_error: Exception | None = None

    def make_prepped_xfer(self, op, local_side, local_idx, remote_side, remote_idx, notif=b""):
        assert (op, local_side, remote_side) == ("WRITE", "local-dlist", "remote-dlist")
        self.made.append(FakeXfer(list(local_idx), list(remote_idx), notif))
        return self.made[-1]

    def register_memory(self, tensor) -> str:  # a staging area's registration
        return "registration"

    def deregister_memory(self, registration) -> None:
        pass

    def get_xfer_descs(self, rows, mem_type: str):  # a tensor-parallel write's rows, kept as they are
        return rows

    def initialize_xfer(self, op, local_rows, remote_rows, peer: str, notif=b""):
        assert op == "WRITE"
        self.made.append(FakeXfer([tuple(r) for r in local_rows], [tuple(r) for r in remote_rows], notif))
        return self.made[-1]

    def transfer(self, handle: FakeXfer) -> str:
        if self.post_error is not None:
            raise self.post_error
        handle.posted = True
        return "PROC"

    def check_xfer_state(self, handle: FakeXfer) -> str:
        return handle.state

    def send_notif(self, peer: str, message: bytes) -> None:
        self.notifs.append((peer, message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.incoming = self.incoming, {}
        return out


def fake_agent(regions_per_block: int = 1) -> TransferAgent:
    """A TransferAgent whose NIXL is FakeNixl (built without __init__, which would load NIXL)."""
    agent = object.__new__(TransferAgent)
    agent.name, agent.model = "prefill-0-1", MODEL
    agent.layout = replace(LAYOUT, regions_per_block=regions_per_block)
    agent.nixl = FakeNixl()
    agent.local_dlist = "local-dlist"
    agent.ranks = ()  # one rank: the prepped descriptor lists
    agent.peers = {"decode-0-1": Peer("decode-0-1", TransferInfo("decode-0-1", b"", MODEL, agent.layout, 0),
                                      "remote-dlist")}
    return agent
