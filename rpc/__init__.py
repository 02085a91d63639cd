"""gRPC messages and services between the gateway and the workers (see pdserve.proto)."""
