"""Why a request's output ended, as every layer from the engine to the gateway names it."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # could not be served (e.g. every prefill attempt failed)
