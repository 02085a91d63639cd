"""A request body's sampling parameters, checked against the model and the pool and turned
into the wire form once; the workers convert the wire form into the engine's."""

from __future__ import annotations

from gateway.errors import APIError
from gateway.completions.protocol import ChatCompletionRequest
from gateway.completions.structured import grammar_of
from rpc import pdserve_pb2 as pb

# Log-probability entries one request may ask for: choices x tokens x (alternatives + the
# sampled token). Each is a few Python objects on the gateway's one event loop (~750 bytes
# held until a non-streamed body is sent): n = 16, top_logprobs = 20 and 4,000 tokens was
# ~1 GB and a 500 that stalled every other client. This bound is ~100 MB.
MAX_LOGPROB_ENTRIES = 1 << 17

_PASSED_AS_IS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed")


def max_prompt_tokens(max_model_len: int, configured: int | None) -> int:
    """The longest prompt served: the configured bound, and room for one output token."""
    return min(configured or max_model_len, max_model_len - 1)


def sampling_params(body, prompt_len: int, *, max_model_len: int, max_prompt: int, kv_capacity: int | None,
                    max_output_tokens: int | None, vocab_size: int) -> pb.SamplingParams:
    """The body's parameters as the workers take them, or an APIError naming the parameter:
    413 for a prompt too long for the model or a decode worker's KV cache (`kv_capacity`,
    the largest one's, once known), 400 for an output that cannot fit or a bad token id."""
    limit = max_model_len - prompt_len
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if prompt_len > max_prompt:
        raise APIError(413, f"prompt ({prompt_len} tokens) is over this model's limit of {max_prompt} prompt "
                            "tokens", prompt_param)
    if kv_capacity is not None and prompt_len >= kv_capacity:
        raise APIError(413, f"prompt ({prompt_len} tokens) does not fit in a decode worker's KV cache "
                            f"({kv_capacity} tokens)", prompt_param)
    cap = max_output_tokens
    if cap is not None and body.output_limit is not None and body.output_limit > cap:
        raise APIError(400, f"max_tokens ({body.output_limit}) is over this server's limit of {cap}", "max_tokens")
    default = min(limit, cap or limit, limit if kv_capacity is None else kv_capacity - prompt_len)
    max_tokens = body.output_limit if body.output_limit is not None else default
    if max_tokens > limit:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                            f"limit of {max_model_len} tokens", "max_tokens")
    if kv_capacity is not None and prompt_len + max_tokens > kv_capacity:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs more KV cache than "
                            f"a decode worker has ({kv_capacity} tokens)", "max_tokens")
    p = pb.SamplingParams(max_tokens=max_tokens)
    for name in _PASSED_AS_IS:
        value = getattr(body, name)
        if value is not None:
            setattr(p, name, value)
    if body.logit_bias:
        for key, value in body.logit_bias.items():
            if int(key) >= vocab_size:
                raise APIError(400, f"logit_bias key {key} is not a token id of this model", "logit_bias")
            p.logit_bias[int(key)] = value
    if body.num_logprobs is not None:
        entries = body.n * max_tokens * (body.num_logprobs + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            param = "logprobs" if not isinstance(body, ChatCompletionRequest) or not body.num_logprobs \
                else "top_logprobs"
            raise APIError(400, f"n ({body.n}) x max_tokens ({max_tokens}) x (logprobs per token + 1: "
                                f"{body.num_logprobs + 1}) = {entries} log-probability entries is over this server's "
                                f"limit of {MAX_LOGPROB_ENTRIES} per request: ask for fewer tokens, choices or "
                                "alternatives", param)
        p.logprobs = body.num_logprobs
    p.ignore_eos = body.ignore_eos
    grammar = grammar_of(body.response_format)
    if grammar is not None:
        if body.ignore_eos:
            raise APIError(400, "ignore_eos cannot be combined with response_format: the output ends where the "
                                "schema does", "ignore_eos")
        p.grammar.CopyFrom(pb.Grammar(json_schema=grammar.json_schema, strict=grammar.strict))
    return p
