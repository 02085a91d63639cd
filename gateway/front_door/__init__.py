"""The gateway's defences at the door, before a request reaches an API: head and body
deadlines, the per-address cap on stalled connections, trusted proxies, TLS, who may read
/metrics, what a bind exposes, and the admin socket's loopback listener."""
