"""Tensor parallelism: one model over several ranks (layout, sharded model, collectives)."""
