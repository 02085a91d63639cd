"""A ShareGPT-like offline workload: varied prompt and output lengths, real token ids.

Lengths are drawn from lognormal distributions shaped after published ShareGPT
statistics: about 250 prompt tokens and 200 output tokens per request on average, both
heavy-tailed (the median is well below the mean and a few requests are many times
longer). The parameters are round values chosen so that, after clipping to the default
caps ([4, 1024] prompt, [4, 512] output), the expected means are ~250 and ~200 (medians
~165 and ~160, 3% and 7% of requests at the cap); they are not a fit to the raw dataset. Prompts are slices of a fixed English text, so they are ordinary tokens rather
than random ids, and each request starts at its own offset so no two prompts share a
prefix (the prefix cache gets no free hits). Requests are meant to be run with
`ignore_eos=True` and `max_tokens=output_len`, so every system generates the same tokens.

For the serving benchmark (bench/serving.py) and the simulator, `sample_workload` draws
(prompt_len, output_len) pairs without a tokenizer, and `poisson_arrivals` the send times:

- "sharegpt": the lognormals above, clipped to [4, max_input] and [4, max_output].
- "fixed": every request `input_len` prompt tokens and `output_len` outputs.
- "long-prompt": a chat mix with long documents in it. Each request independently is long
  with probability `long_fraction` (0.2): a prompt uniform in [1500, 2000] tokens and a
  short output uniform in [16, 64]; otherwise it is ShareGPT-like with the prompt capped at
  512 and the output at 256 tokens. The long prompts are what makes prefill interfere with
  decode on an aggregated worker.

`requests_from_lengths` turns the pairs into prompts; with `vocab_size` it also replaces
each prompt's first token with a random one, so a later run (another seed) against the
same server gets no prefix-cache hits from the prompts of an earlier run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

# Means of the lognormals before clipping; clipping to the default caps brings them to ~250 / ~200.
INPUT_MEAN, INPUT_SIGMA = 270.0, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 220.0, 0.8
MIN_LEN = 4

# The long-prompt mix (see the module docstring).
LONG_FRACTION = 0.2
LONG_INPUT = (1500, 2000)
LONG_OUTPUT = (16, 64)
SHORT_MAX_INPUT, SHORT_MAX_OUTPUT = 512, 256
WORKLOADS = ("sharegpt", "fixed", "long-prompt")

CORPUS = """\
The harbour town woke slowly in winter. Before the light came up over the hills, the bakers
had already lit their ovens, and the smell of bread drifted down the narrow streets towards
the water. Fishermen checked their nets by lantern light, talking quietly about the weather,
the price of fuel and the new regulations that nobody seemed to understand. By seven the
first ferry had left for the islands, carrying a few sleepy passengers, a crate of letters
and a dog that belonged to no one in particular but travelled every morning all the same.

Learning a new skill as an adult is mostly a matter of patience. The first weeks are
exciting, because every small step feels like progress, but after a while the improvement
becomes harder to see. This is the point at which most people give up. Teachers often
recommend keeping a simple diary: write down what you practised, for how long, and one
thing that went better than the day before. Looking back over a month of notes makes it
obvious that the effort has paid off, even when a single evening felt like a waste of time.

A good soup starts with a good stock. Brown the bones or vegetables first, because the
colour brings flavour, then cover them with cold water and let the pot simmer gently for
several hours. Skim the surface from time to time. Salt should be added at the end, once
the liquid has reduced, otherwise it is easy to overdo it. Onions, carrots and celery are
the classic base, but leeks, mushrooms, fennel or a strip of lemon peel can change the
character of the stock completely. Strain it through a fine sieve and cool it quickly.

The history of maps is also a history of mistakes. Early cartographers filled the empty
spaces at the edges of the known world with sea monsters, imagined mountains and islands
that did not exist. Some of these phantom islands stayed on charts for centuries, copied
from one map to the next because nobody had sailed far enough to prove they were not there.
Modern satellite imagery has removed most of the blank spaces, yet surveyors still find
small errors, such as rivers that have changed course or coastlines that have moved.

When you plan a long walk in the mountains, tell someone where you are going and when you
expect to return. Carry more water than you think you will need, a warm layer even in
summer, and a map that does not depend on a battery. Weather changes quickly at altitude:
a clear morning can turn into fog and rain by the early afternoon. It is no failure to turn
back before reaching the summit. Experienced walkers say that the mountain will still be
there next year, and the most important part of any route is the way home.

Software projects rarely fail because of a single bad decision. More often, many small
compromises accumulate: a test that was skipped, a warning that was silenced, a quick fix
that became permanent. Each one seems reasonable at the time. The cure is not heroic
rewriting but steady maintenance, reading old code with fresh eyes, deleting what is no
longer needed and writing down why the remaining parts are the way they are. A team that
treats clarity as a feature usually ships faster in the long run, not slower.

In the evening the town grew quiet again. The ferry came back with the tide, the cafes
stacked their chairs, and the lights of the houses on the hill went out one by one. Only
the lighthouse kept its slow rhythm, sweeping the dark water every few seconds, as it had
done for more than a hundred years, long before anyone in the town could remember.
"""


class TokenEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


def corpus_token_ids(tokenizer: TokenEncoder) -> list[int]:
    """The embedded English text as token ids (no special tokens)."""
    return tokenizer.encode(CORPUS, add_special_tokens=False)


def lognormal_length(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """One length from a lognormal with the given mean (not median), clipped to [lo, hi]."""
    mu = math.log(mean) - sigma**2 / 2  # E[X] = exp(mu + sigma^2 / 2)
    return min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))


def _slices(corpus: list[int], lengths: list[int], rng: random.Random) -> list[list[int]]:
    """A slice of the (cyclically repeated) corpus per length, each at a distinct offset."""
    n = len(lengths)
    if n <= len(corpus):
        offsets = rng.sample(range(len(corpus)), n)
    else:  # more requests than corpus tokens: some prompts will share a start
        offsets = [rng.randrange(len(corpus)) for _ in range(n)]
    reps = max(lengths) // len(corpus) + 2
    long = corpus * reps
    return [long[o:o + k] for o, k in zip(offsets, lengths)]


def _sharegpt_pair(rng: random.Random, max_input: int, max_output: int) -> tuple[int, int]:
    return (lognormal_length(rng, INPUT_MEAN, INPUT_SIGMA, MIN_LEN, max_input),
            lognormal_length(rng, OUTPUT_MEAN, OUTPUT_SIGMA, MIN_LEN, max_output))


def sharegpt_requests(
    tokenizer: TokenEncoder,
    num_requests: int = 64,
    seed: int = 0,
    max_input: int = 1024,
    max_output: int = 512,
) -> list[Request]:
    """`num_requests` requests with ShareGPT-like lengths, in arrival order."""
    rng = random.Random(seed)
    lengths = [_sharegpt_pair(rng, max_input, max_output) for _ in range(num_requests)]
    prompts = _slices(corpus_token_ids(tokenizer), [p for p, _ in lengths], rng)
    return [Request(ids, out) for ids, (_, out) in zip(prompts, lengths)]


def fixed_requests(
    tokenizer: TokenEncoder, num_requests: int, prompt_len: int, output_len: int, seed: int = 0
) -> list[Request]:
    """`num_requests` requests of exactly `prompt_len` prompt tokens and `output_len` outputs."""
    rng = random.Random(seed)
    prompts = _slices(corpus_token_ids(tokenizer), [prompt_len] * num_requests, rng)
    return [Request(ids, output_len) for ids in prompts]


def sample_workload(name: str, n: int, seed: int, **params: float) -> list[tuple[int, int]]:
    """`n` (prompt_len, output_len) pairs of workload `name`, the same for the same seed.

    Params: "sharegpt" takes max_input (1024) and max_output (512); "fixed" input_len (256)
    and output_len (128); "long-prompt" long_fraction (0.2).
    """
    rng = random.Random(seed)
    if name == "sharegpt":
        allowed = {"max_input": 1024, "max_output": 512}
    elif name == "fixed":
        allowed = {"input_len": 256, "output_len": 128}
    elif name == "long-prompt":
        allowed = {"long_fraction": LONG_FRACTION}
    else:
        raise ValueError(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)}")
    unknown = set(params) - set(allowed)
    if unknown:
        raise ValueError(f"workload {name!r} takes {', '.join(allowed)}, not {', '.join(sorted(unknown))}")
    p = {**allowed, **params}
    if name == "sharegpt":
        return [_sharegpt_pair(rng, int(p["max_input"]), int(p["max_output"])) for _ in range(n)]
    if name == "fixed":
        if p["input_len"] < 1 or p["output_len"] < 1:
            raise ValueError("fixed workload lengths must be at least 1")
        return [(int(p["input_len"]), int(p["output_len"]))] * n
    pairs = []
    for _ in range(n):
        if rng.random() < p["long_fraction"]:
            pairs.append((rng.randint(*LONG_INPUT), rng.randint(*LONG_OUTPUT)))
        else:
            pairs.append(_sharegpt_pair(rng, SHORT_MAX_INPUT, SHORT_MAX_OUTPUT))
    return pairs


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times in seconds from the start for `n` requests of a Poisson process at `rate`
    requests per second (exponential gaps; the first request at 0). An infinite rate sends
    everything at once."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, times = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


FIRST_TOKEN_RANGE = (1000, 32000)  # ordinary BPE tokens in most vocabularies (no special ids)


def requests_from_lengths(
    tokenizer: TokenEncoder, lengths: list[tuple[int, int]], seed: int, vocab_size: int | None = None
) -> list[Request]:
    """A corpus-slice prompt per (prompt_len, output_len), each at a distinct offset when
    there are fewer requests than corpus tokens. With `vocab_size`, the first token of
    every prompt is drawn at random (below vocab_size), so prompts of different seeds
    share no prefix-cache block."""
    rng = random.Random(seed)
    prompts = _slices(corpus_token_ids(tokenizer), [p for p, _ in lengths], rng)
    if vocab_size is not None:
        hi = min(vocab_size, FIRST_TOKEN_RANGE[1])
        lo = min(FIRST_TOKEN_RANGE[0], hi // 2)
        for ids in prompts:
            ids[0] = rng.randrange(lo, hi)
    return [Request(ids, out) for ids, (_, out) in zip(prompts, lengths)]
