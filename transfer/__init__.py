"""KV transfer over NIXL: one agent per worker, a versioned handshake, chunk-wise pushes.

    agent = TransferAgent(agent_name("prefill", "0", incarnation), kv_cache.pool, layout, model)
    info = agent.info().to_bytes()             # served by the worker's TransferInfo RPC
    peer = agent.add_peer(TransferInfo.from_bytes(their_info))   # checks the compat hash
    pusher = KVPusher(agent); receiver = KVReceiver(agent)       # sender / receiver sides
    # in the engine loop: pusher.poll() and receiver.poll() return events, never raise

Layout: the pool is block-major (engine/kv_cache.py), so one block is one contiguous
region holding K and V of every layer (360 KiB for SmolLM2 in bf16, 2 MiB for a
Llama-8B shape). Measured here (bench/RESULTS.md, `python -m bench.transfer`): pushing a
2k-token prompt runs at the kernel's cross-process copy rate (~5-6 GB/s, 0.65x libc
memcpy for SmolLM2) whatever the granularity: one region per block, per layer (12 KiB)
or per layer and K/V (6 KiB) are within 1.13x of each other for SmolLM2 and 1.35x for
the Llama-8B shape (32-64 KiB regions best there). The default is one region per block
(`regions_per_block=1`, fewest descriptors); `regions_per_block=num_layers` is there for
per-layer streaming.

Failures are state: a push ends DONE, FAILED (with the remote blocks not confirmed and a
reason: a NIXL error such as a disconnected peer, or the timeout) or ABORTED (once nothing
is in flight); a receive ends COMPLETE, ABORTED or TIMED_OUT.
"""

from __future__ import annotations

from transfer.agent import TransferAgent, UnknownPeerError
from transfer.handshake import HandshakeError, TransferInfo, agent_name, check_compatible
from transfer.layout import PROTOCOL_VERSION, KVLayout, compatibility_hash
from transfer.push import KVPusher, PushEvent, PushStatus
from transfer.receive import KVReceiver, ReceiveEvent, ReceiveStatus

__all__ = [
    "PROTOCOL_VERSION", "HandshakeError", "KVLayout", "KVPusher", "KVReceiver", "PushEvent", "PushStatus",
    "ReceiveEvent", "ReceiveStatus", "TransferAgent", "TransferInfo", "UnknownPeerError", "agent_name",
    "check_compatible", "compatibility_hash",
]
