"""One NIXL agent per worker: its KV pool registered once, peers cached by agent name.

The agent runs without NIXL's progress thread (it busy-spins a core): the worker's loop
calls `poll_notifications()` and the pusher's `poll()`, which also drives connection
wire-up, so a passive side must keep polling. It is created in strict thread-sync mode,
so a call from another thread cannot crash it, but it is meant for one loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from transfer.handshake import HandshakeError, TransferInfo, check_compatible, parse_agent_name
from transfer.layout import KVLayout, region_table
from transfer.messages import Notification, decode
from transfer.ranks import RankPool, Side
from transfer.staging import Staging

log = logging.getLogger(__name__)
MAX_PEERS = 1024  # distinct workers a pool talks to; a restarted one replaces its older incarnation


class UnknownPeerError(KeyError):
    """No handshake was done with this agent name (or it was replaced by a newer incarnation)."""


@dataclass
class Peer:
    name: str
    info: TransferInfo
    dlist: object  # NIXL prepared descriptor list of the peer's pool regions (None with a tensor-parallel side)


def _nixl():
    """NIXL's Python API from whichever CUDA build is installed: nixl-cu12 (the project's
    dependency; on CPU it loads no CUDA) or nixl-cu13 (a CUDA 13 machine's)."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


class TransferAgent:
    def __init__(self, name: str, pool: torch.Tensor, layout: KVLayout, model: str,
                 ranks: list[tuple[torch.Tensor, range]] | None = None):
        """`pool` with `layout`; `ranks`: a tensor-parallel worker's pools with the KV heads
        each holds, rank 0's (`pool`) first, all of `layout`'s shape (transfer/ranks.py)."""
        for p in [pool, *(t for t, _ in ranks or ())]:
            if p.numel() * p.element_size() != layout.pool_bytes:
                raise ValueError(f"pool holds {p.numel() * p.element_size()} bytes, layout says {layout.pool_bytes}")
            if not p.is_contiguous():
                raise ValueError("a KV pool must be one contiguous tensor")
        if ranks and ranks[0][0].data_ptr() != pool.data_ptr():
            raise ValueError("the first rank's pool must be `pool` (rank 0's)")
        nixl_agent, nixl_agent_config, sync = _nixl()
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                   sync_mode=sync.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self.pool = pool
        self.layout = layout
        self.model = model
        self.mem_type = "DRAM" if pool.device.type == "cpu" else "VRAM"
        self.device_id = 0 if pool.device.type == "cpu" else pool.device.index or 0
        self.nixl = nixl_agent(name, config)
        self._registration = self.nixl.register_memory(pool)
        self.ranks = tuple(RankPool(t.data_ptr(), heads.start, len(heads)) for t, heads in ranks) \
            if ranks and len(ranks) > 1 else ()
        self._rank_registrations = [self.nixl.register_memory(t) for t, _ in (ranks or ())[1:]]
        # every rank's pool as blocks of the layout (rank 0's first), what packing reads
        shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        dtype = getattr(torch, layout.dtype)
        self.rank_tensors = [t.view(-1).view(torch.uint8).view(dtype).view(shape)
                             for t in ([t for t, _ in ranks] if ranks else [pool])]
        self._staging: Staging | None = None
        self.local_dlist = self.nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", region_table(pool.data_ptr(), layout, self.device_id), self.mem_type)
        self.peers: dict[str, Peer] = {}

    def info(self) -> TransferInfo:
        """What peers need to write into this worker's pool (serve it over the control plane)."""
        return TransferInfo(self.name, self.nixl.get_agent_metadata(), self.model, self.layout,
                            self.pool.data_ptr(), self.device_id, ranks=self.ranks, mem_type=self.mem_type)

    def add_peer(self, info: TransferInfo) -> str:
        """Load a peer's agent after checking compatibility; replaces older incarnations of it."""
        if info.agent_name in self.peers:
            return info.agent_name
        check_compatible(self.info_without_metadata(), info)
        if len(self.peers) >= MAX_PEERS and not any(p.info.worker_key == info.worker_key for p in self.peers.values()):
            raise HandshakeError(f"{info.agent_name}: {MAX_PEERS} peers already; a deployment has fewer workers")
        same_worker = [p for p in self.peers.values() if p.info.worker_key == info.worker_key]
        incarnation = parse_agent_name(info.agent_name)[2]
        for known in same_worker:  # late info from before a restart must not replace the restarted worker
            if parse_agent_name(known.name)[2] > incarnation:
                raise HandshakeError(f"{info.agent_name} is older than the known {known.name}: stale transfer info")
        for stale in same_worker:
            log.info("peer %s replaced by %s (new incarnation)", stale.name, info.agent_name)
            self.remove_peer(stale.name)
        loaded = self.nixl.add_remote_agent(info.agent_metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if name != info.agent_name:
            self.nixl.remove_remote_agent(name)
            raise HandshakeError(f"agent metadata names {name!r} but the info says {info.agent_name!r}")
        # the prepped list of a one-rank pair's writes; a tensor-parallel side writes through
        # descriptors made per chunk (transfer/ranks.py), so nothing is prepared for it
        dlist = None if self.ranks or info.ranks else self.nixl.prep_xfer_dlist(
            name, region_table(info.base_addr, info.layout, info.device_id), info.mem_type)  # the peer's kind
        self.peers[name] = Peer(name, info, dlist)
        return name

    def staging(self) -> Staging:
        """The registered scratch memory a push between different degrees packs blocks in
        (made on first use: workers of equal degrees never need it)."""
        if self._staging is None:
            self._staging = Staging(self.nixl, device=self.pool.device)
        return self._staging

    @property
    def side(self) -> Side:
        """This worker's pools, as a write between tensor-parallel workers reads them."""
        return Side(self.layout, self.ranks or (RankPool(self.pool.data_ptr(), 0, self.layout.num_kv_heads),))

    def info_without_metadata(self) -> TransferInfo:
        return TransferInfo(self.name, b"", self.model, self.layout, self.pool.data_ptr(), self.device_id,
                            ranks=self.ranks, mem_type=self.mem_type)

    def peer(self, name: str) -> Peer:
        try:
            return self.peers[name]
        except KeyError:
            raise UnknownPeerError(f"no handshake with {name!r} (known: {sorted(self.peers)})") from None

    def remove_peer(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        if peer is None:
            return
        if peer.dlist is not None:
            peer.dlist.release()
        try:
            self.nixl.remove_remote_agent(name)
        except Exception as e:  # a dead peer may fail to disconnect cleanly; it is gone either way
            log.info("removing peer %s: %s", name, e)

    def send_notification(self, peer: str, message: bytes) -> None:
        self.nixl.send_notif(peer, message)

    def poll_notifications(self) -> list[Notification]:
        """New pdkv notifications from any peer (also drives NIXL's progress for wire-up)."""
        out = []
        for sender, messages in self.nixl.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for message in messages:
                notif = decode(sender, message)
                if notif is None:
                    log.warning("ignoring a notification from %s that is not pdkv/1: %r", sender, message[:64])
                else:
                    out.append(notif)
        return out

    def close(self) -> None:
        for name in list(self.peers):
            self.remove_peer(name)
        self.local_dlist.release()
        if self._staging is not None:
            self._staging.close()
        for registration in self._rank_registrations:
            self.nixl.deregister_memory(registration)
        self.nixl.deregister_memory(self._registration)
