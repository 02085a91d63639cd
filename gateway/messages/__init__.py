"""Anthropic's Messages API: its request models and their mapping to a chat request, its
answer (SSE events or the whole message) and its error shape."""
