"""KV transfer over NIXL: agents, layout descriptors, versioned handshake, push sessions.

Not built yet; the KV pool layout it will register is documented in engine/kv_cache.py.
"""
