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

    @property
    def compat_hash(self) -> str:
        return compatibility_hash(self.model, self.layout)

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
            "compat_hash": self.compat_hash,
        }).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferInfo:
        try:
            d = json.loads(data)
            version = d["protocol_version"]
            if version != PROTOCOL_VERSION:
                raise HandshakeError(f"peer speaks transfer protocol {version}, this worker {PROTOCOL_VERSION}")
            info = cls(d["agent_name"], base64.b64decode(d["agent_metadata"]), d["model"],
                       KVLayout(**d["layout"]), int(d["base_addr"]), int(d["device_id"]), version)
            parse_agent_name(info.agent_name)  # an unparseable name would break add_peer for every later peer
        except HandshakeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HandshakeError(f"malformed transfer info: {e}") from e
        if d.get("compat_hash") != info.compat_hash:
            raise HandshakeError(f"transfer info of {info.agent_name}: compatibility hash does not match its fields")
        return info


def check_compatible(local: TransferInfo, remote: TransferInfo) -> None:
    """Raise HandshakeError naming every field on which the two workers disagree."""
    if local.compat_hash == remote.compat_hash:
        return
    mine = {"protocol": local.protocol_version, "model": local.model, **local.layout.compatibility_fields()}
    theirs = {"protocol": remote.protocol_version, "model": remote.model, **remote.layout.compatibility_fields()}
    diffs = ", ".join(f"{k}: {mine[k]!r} here vs {theirs.get(k)!r}" for k in mine if mine[k] != theirs.get(k))
    raise HandshakeError(f"{remote.agent_name} is incompatible with {local.agent_name} ({diffs}); "
                         "both sides must serve the same model with the same dtype, block size and layout")
