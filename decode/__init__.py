"""Decode worker: KV reservation, remote or local prefill, continuous batching, preemption
and token streaming (docs/design.md steps 5-11).

`python -m decode`; role.py builds it over an engine, worker.py runs it on the engine
loop, remote_prefill.py drives its prefill workers (remote_prefill_state.py: one request's
attempts; remote_prefill_events.py: what it hands the worker; unconfirmed_aborts.py:
blocks set aside for an unanswered abort; which workers may be asked: worker/peers.py),
kv_source*.py hands a drained worker's KV over, service.py is its gRPC face.
"""
