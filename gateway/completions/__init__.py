"""The OpenAI API a client speaks for chat and text completions: its request models, its
answer (SSE or whole) and the pieces of it (chat chunks, log-probabilities, structured
output, tool calls). The answer is also what the other APIs rewrite into their shapes."""
