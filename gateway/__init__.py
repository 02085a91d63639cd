"""OpenAI-compatible HTTP gateway (FastAPI): auth, admission, routing, SSE. Never imports torch.

Its folders are its concerns, and the request's path is at the top:

    app.py, request_path.py        the routes; one request's claims, route and answer
    front_door/                    defences before a request reaches an API: head and body
                                   deadlines, the per-address cap, trusted proxies, TLS,
                                   /metrics access, what a bind exposes, the admin listener
    completions/                   the OpenAI chat and completions API: request models, the
                                   answer (SSE or whole) every API's answer starts from
    responses/                     OpenAI's Responses API: request, answer, stored answers
    messages/                      Anthropic's Messages API: request, answer, errors
    routing/                       the router, the prefix index, the circuit breakers
    (the rest)                     tenants, admission and the retry budget; the workers'
                                   backend, streams and readiness; metrics and the scrape;
                                   the processes of one gateway and what they share

The path of a request through its files is docs/design.md steps 1-4 and 10-11.
"""
