"""The transfer handshake: what a worker publishes so peers can write into its KV pool.

A worker's transfer identity is its agent name `role-worker_id-incarnation`: a restarted
worker gets a new incarnation, so a peer never reaches it through a stale agent. Peers
check the compatibility hash (model, dtype, block size, layout, protocol version) before
loading the agent metadata; a mismatch is refused with the differing fields named.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from transfer.layout import PROTOCOL_VERSION, KVLayout, compatibility_hash
from transfer.ranks import RankPool, Side

MAX_RANKS = 1024  # a peer's claimed tensor-parallel degree, bounded like its layout
MEM_TYPES = ("DRAM", "VRAM")  # outside the compatibility hash: a host pool and a GPU's may pair


class HandshakeError(ValueError):
    """A peer's transfer info is malformed or incompatible with ours (the message says how)."""


def agent_name(role: str, worker_id: str, incarnation: int) -> str:
    if "-" in role or not role:
        raise ValueError(f"role {role!r}: must be non-empty and contain no '-'")
    if not worker_id or incarnation < 0:
        raise ValueError(f"worker id {worker_id!r}, incarnation {incarnation!r}: need a non-empty id "
                         "and an incarnation >= 0, or parse_agent_name cannot read the name back")
    return f"{role}-{worker_id}-{incarnation}"


def parse_agent_name(name: str) -> tuple[str, str, int]:
    """(role, worker_id, incarnation) of an agent name made by `agent_name`."""
    role, _, rest = name.partition("-")
    worker_id, _, incarnation = rest.rpartition("-")
    if not role or not worker_id or not incarnation.isdigit():
        raise HandshakeError(f"agent name {name!r} is not role-worker_id-incarnation")
    return role, worker_id, int(incarnation)


@dataclass(frozen=True)
class TransferInfo:
    """One worker's published transfer identity (the reply of its TransferInfo RPC)."""

    agent_name: str
    agent_metadata: bytes  # NIXL agent metadata, a few kB
    model: str
    layout: KVLayout
    base_addr: int  # address of the pool's first byte in the worker's process
    device_id: int = 0
    protocol_version: int = PROTOCOL_VERSION
    # A tensor-parallel worker's pools, rank 0 first (transfer/ranks.py); () for one rank
    # holding every KV head at base_addr. `layout` is then each rank's pool.
    ranks: tuple[RankPool, ...] = ()
    mem_type: str = "DRAM"  # NIXL's memory kind of the pools: DRAM (host) or VRAM (a GPU's)

    @property
    def rank_pools(self) -> tuple[RankPool, ...]:
        return self.ranks or (RankPool(self.base_addr, 0, self.layout.num_kv_heads),)

    @property
    def total_kv_heads(self) -> int:
        return max(r.head_start + r.head_count for r in self.rank_pools)

    @property
    def side(self) -> Side:
        return Side(self.layout, self.rank_pools)

    @property
    def compat_hash(self) -> str:
        return compatibility_hash(self.model, self.layout, self.total_kv_heads)

    @property
    def worker_key(self) -> tuple[str, str]:
        """(role, worker_id): the same worker across incarnations."""
        role, worker_id, _ = parse_agent_name(self.agent_name)
        return role, worker_id

    def to_bytes(self) -> bytes:
        return json.dumps({
            "protocol_version": self.protocol_version,
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
            "model": self.model,
            "layout": self.layout.__dict__,
            "base_addr": self.base_addr,
            "device_id": self.device_id,
            "ranks": [[r.base_addr, r.head_start, r.head_count] for r in self.ranks],
            "mem_type": self.mem_type,
            "compat_hash": self.compat_hash,
        }).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferInfo:
        try:
            d = json.loads(data)
            version = d["protocol_version"]
            if version != PROTOCOL_VERSION:
                raise HandshakeError(f"peer speaks transfer protocol {version}, this worker {PROTOCOL_VERSION}")
            ranks = tuple(RankPool(int(a), int(s), int(c)) for a, s, c in d.get("ranks", ()))
            mem_type = d.get("mem_type", "DRAM")  # a peer from before the field: host memory
            if mem_type not in MEM_TYPES:
                raise HandshakeError(f"memory kind {mem_type!r}: one of {', '.join(MEM_TYPES)}")
            info = cls(d["agent_name"], base64.b64decode(d["agent_metadata"]), d["model"],
                       KVLayout(**d["layout"]), int(d["base_addr"]), int(d["device_id"]), version, ranks, mem_type)
            parse_agent_name(info.agent_name)  # an unparseable name would break add_peer for every later peer
            check_ranks(info)
        except HandshakeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HandshakeError(f"malformed transfer info: {e}") from e
        if d.get("compat_hash") != info.compat_hash:
            raise HandshakeError(f"transfer info of {info.agent_name}: compatibility hash does not match its fields")
        return info


def check_ranks(info: TransferInfo) -> None:
    """A tensor-parallel worker's pools must each hold as many heads as its layout says, and
    together every head from 0 (a claim that leaves a head out would leave blocks unwritten)."""
    if not info.ranks:
        return
    if len(info.ranks) > MAX_RANKS:
        raise HandshakeError(f"{info.agent_name}: {len(info.ranks)} ranks, more than {MAX_RANKS}")
    held = set()
    for i, r in enumerate(info.ranks):
        if r.head_count != info.layout.num_kv_heads or r.head_start < 0:
            raise HandshakeError(f"{info.agent_name}: rank {i} holds KV heads {r.head_start}..+{r.head_count}, "
                                 f"its layout says {info.layout.num_kv_heads} per rank")
        held.update(r.heads)
    if held != set(range(info.total_kv_heads)):
        raise HandshakeError(f"{info.agent_name}: its ranks hold KV heads {sorted(held)}, not every head from 0")


def check_compatible(local: TransferInfo, remote: TransferInfo) -> None:
    """Raise HandshakeError naming every field on which the two workers disagree (their
    tensor-parallel degrees may differ: the model's KV heads are compared, not a rank's)."""
    if local.compat_hash == remote.compat_hash:
        return
    mine = {"protocol": local.protocol_version, "model": local.model,
            **local.layout.compatibility_fields(local.total_kv_heads)}
    theirs = {"protocol": remote.protocol_version, "model": remote.model,
              **remote.layout.compatibility_fields(remote.total_kv_heads)}
    diffs = ", ".join(f"{k}: {mine[k]!r} here vs {theirs.get(k)!r}" for k in mine if mine[k] != theirs.get(k))
    raise HandshakeError(f"{remote.agent_name} is incompatible with {local.agent_name} ({diffs}); "
                         "both sides must serve the same model with the same dtype, block size and layout")
