"""Which workers serve a request: the router, the prefix index it looks prompts up in, and a
circuit breaker per decode worker."""
