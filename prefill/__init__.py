"""Prefill worker: queue, chunked-prefill scheduler, KV push to decode workers, gRPC service.

Not built yet; see DESIGN.md (request lifecycle steps 6-7).
"""
