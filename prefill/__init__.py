"""Prefill worker: chunked prefill of the prompts decode workers send, and a push of their
KV into the decode workers' blocks (docs/design.md steps 6-7).

`python -m prefill`; role.py builds it over an engine, worker.py runs it on the engine
loop, service.py is its gRPC face.
"""
