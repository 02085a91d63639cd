"""Decode worker: KV reservation, continuous batching, preemption, token streaming.

Not built yet; see DESIGN.md (request lifecycle steps 5, 8-11).
"""
