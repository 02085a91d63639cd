"""OpenAI-compatible HTTP gateway (FastAPI): auth, admission, routing, SSE. Never imports torch.

Not built yet; see DESIGN.md (request lifecycle steps 1-4, 10-11).
"""
