"""OpenAI's Responses API: its request models and their mapping to a chat request, its answer
(SSE events or the whole response object), and the store of answers kept for
previous_response_id."""
