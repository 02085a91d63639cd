"""A GPU step's stand-in: an engine step that lasts a fixed wall time and costs next to no CPU.

`FixedTimeStep` takes the place of the model's forward pass and sampling
(`LLMEngine.stand_in_forward`) in bench/stream_path.py only: each step it returns a token
for every chunk that samples, then sleeps until `step_s` has passed since the engine handed
it the step. That is what a GPU step looks like from the host: the loop thread waits a
fixed time for the device (holding no core, and not the GIL), and everything around the
step, the schedule, the outputs, their way to the clients, costs what it costs here.
It is an honest stand-in for measuring that path at GPU step rates on a CPU host, and it
is never used to serve: the tokens are a counter, not a model's.

The tokens cycle through ids that each decode to visible text on their own and are never
an end-of-sequence id (`visible_token_ids`), so a stream runs to its max_tokens and every
step sends its client one SSE event.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from engine.model_runner import RunnerOutput
from engine.scheduler import SchedulerOutput


class FixedTimeStep:
    """Callable for `LLMEngine.stand_in_forward`: every step lasts `step_s` seconds of wall
    time from its call (at least the time it took to pick the tokens), the rest of it asleep.
    `steps` keeps when each step began and ended and how many tokens it sampled: the
    engine's own cadence, which the clients' can be held against."""

    def __init__(self, step_s: float, token_ids: Sequence[int]):
        if step_s <= 0:
            raise ValueError(f"step_s must be positive, not {step_s}")
        if not token_ids:
            raise ValueError("no token ids to cycle through")
        self.step_s = step_s
        self._cycle = list(token_ids)
        self._next = 0  # where the counter is in the cycle
        # per step: time.monotonic() at its call and once it woke (later than asked when the
        # host or the GIL is busy), and the tokens it sampled
        self.steps: list[tuple[float, float, int]] = []

    def __call__(self, out: SchedulerOutput) -> RunnerOutput:
        began = time.monotonic()
        cycle, n, i = self._cycle, len(self._cycle), self._next
        tokens: dict[str, int] = {}
        for chunk in out.chunks:
            if chunk.sample:
                tokens[chunk.seq.request_id] = cycle[i]
                i = i + 1 if i + 1 < n else 0
        self._next = i
        left = began + self.step_s - time.monotonic()
        if left > 0:
            time.sleep(left)
        self.steps.append((began, time.monotonic(), len(tokens)))
        return RunnerOutput(token_ids=tokens, logprobs={})


def visible_token_ids(model_dir: Path, vocab_size: int, eos_token_ids: Iterable[int]) -> list[int]:
    """The ids below `vocab_size` that are no end-of-sequence id and, where the folder has a
    tokenizer, decode alone to printable text that starts with no space (a stream's first
    token keeps its text, and every token is one SSE event of its own); with no tokenizer,
    every id but the end-of-sequence ones."""
    eos = set(eos_token_ids)
    ids = [i for i in range(vocab_size) if i not in eos]
    if not (model_dir / "tokenizer.json").is_file():
        return ids
    from common.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)

    def visible(text: str) -> bool:
        return bool(text) and text.isprintable() and not text[0].isspace() and "\ufffd" not in text

    return [i for i in ids if visible(tokenizer.decode([i], skip_special_tokens=True))]
