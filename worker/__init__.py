"""What the prefill and decode workers share: the engine loop thread and its liveness, the
process set-up and shutdown, the gRPC service both roles answer, and the parent watch."""
