"""OpenAI-compatible HTTP gateway (FastAPI): auth, admission, routing, SSE. Never imports torch.

app (routes), protocol (request bodies), admission (load shedding), router (which workers),
tenants (API keys and limits), backend (gRPC to the workers), responses (SSE and JSON
bodies), metrics (Prometheus), body_limit (ASGI body cap). DESIGN.md, request lifecycle
steps 1-4 and 10-11.
"""
