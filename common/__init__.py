"""What every layer shares, without torch: the typed environment (envs), request traces
(trace), sampling parameters and the JSON-schema spec a request may carry, the tokenizer
and incremental detokenizer, where a model's files come from (model_source, gguf_convert),
prefix-cache block hashes, and the plain types results cross processes in (finish reason,
token logprobs, engine stats).

It imports nothing else of pdserve's, so the gateway, rpc and deploy can use it without
loading torch; the engine builds on it."""
