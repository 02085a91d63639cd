"""OpenAI-compatible HTTP gateway (FastAPI): auth, admission, routing, SSE. Never imports torch.

The path of a request through its files is docs/design.md steps 1-4 and 10-11: app
(routes), the front-door middleware (request_id, head_deadline with per_ip_cap,
body_limit), protocol and params (request bodies), tenants, admission (load shedding),
request_path (one request's claims and answer), router and readiness (which workers),
backend and decode_stream (gRPC to the workers), responses, text_stream and logprobs (SSE
and JSON bodies), metrics and scrape (Prometheus).
"""
