"""The checks a KV writer makes on a Prefill's destination before it writes anything.

A prefill worker (its computed prompt) and a drained decode worker (a handed-off request's
kept blocks: decode/kv_source.py) both write into blocks another decode worker reserved.
What they write must land only where that worker's pool has blocks, each block once, and
the blocks must be exactly those the tokens need past the ones it has cached.
"""

from __future__ import annotations

from rpc import pdserve_pb2 as pb
from transfer import TransferInfo


def checked_destination(request_id: str, req: pb.PrefillRequest, num_tokens: int, block_size: int,
                        members: frozenset[str] | None) -> TransferInfo:
    """The destination's transfer info once every check passed; ValueError (HandshakeError
    is one) naming what is wrong otherwise. `members`: the agents writes may go to (None:
    any that checks out, a worker started by hand)."""
    dest = req.destination
    if dest.num_cached_tokens % block_size:
        raise ValueError(f"request {request_id}: num_cached_tokens {dest.num_cached_tokens} is not a block multiple")
    num_blocks = -(-num_tokens // block_size)
    skip = dest.num_cached_tokens // block_size
    if len(dest.block_ids) != num_blocks - skip:
        raise ValueError(f"request {request_id}: {len(dest.block_ids)} destination blocks for {num_blocks - skip} "
                         f"uncached blocks")
    info = TransferInfo.from_bytes(req.decode_transfer_info)
    if info.agent_name != dest.agent_name:
        raise ValueError(f"request {request_id}: destination {dest.agent_name!r} but transfer info of "
                         f"{info.agent_name!r}")
    if members is not None and info.agent_name not in members:  # before it can touch a known peer
        raise ValueError(f"request {request_id}: {info.agent_name!r} is not a decode worker of this deployment")
    pool = info.layout.num_blocks  # writes go only where the peer's pool has blocks, each once
    bad = next((b for b in dest.block_ids if not 0 <= b < pool), None)
    if bad is not None:
        raise ValueError(f"request {request_id}: destination block {bad} is outside {dest.agent_name}'s pool of {pool}")
    if len(set(dest.block_ids)) != len(dest.block_ids):
        raise ValueError(f"request {request_id}: destination blocks repeat")
    return info
