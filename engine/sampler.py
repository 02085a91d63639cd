"""Batched next-token sampling: penalties, bias, temperature, top-k/top-p/min-p, seeds.

Everything per step is vectorized over the batch. `SamplingMetadata.build` turns the
requests' Python-side parameters into tensors once per step and records which stages any
row needs, so `Sampler` skips the rest. Rows that need an expensive stage (top-k, top-p,
penalties) are gathered into a sub-batch; cheap elementwise stages run on the whole batch
with neutral values for the rows that did not ask.

Rows without a seed sample by inverse CDF: one uniform draw u from the torch generator per
row, token = the first whose cumulative probability exceeds u. Rows with a seed run the
exponential race, token = argmax(probs / E), E ~ Exp(1) per token, with E derived from a
counter-based hash of (seed, output position, token id), so a seeded request samples the
same tokens whatever shares its batch and whatever ran before. Both pick token i with
probability probs[i]; the race costs a vocabulary of draws per row (0.8 ms for 49k tokens
on one CPU core, 27 ms at batch 32: bench/sampler_cost.py), the inverse CDF one draw and a
cumulative sum.

The op set picks the form (`OpSet.sample_step`, handed a `RowDraw`): the torch and native
op sets take the torch stages here (`RowDraw.per_row`); the Triton kernels on CUDA run
temperature, truncation and the draw as one kernel over the whole batch
(kernels/sampling.py), fed dense per-row parameters (`RowDraw.dense`), where rows without
a seed get a fresh seed per step from the torch generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat
from typing import Sequence

import torch

import kernels
from common.sampling_params import SamplingParams, SamplingParamsError
from common.token_logprobs import TokenLogprobs
from engine.seeded_random import seeded_exponentials
from kernels.op_set import DenseSampling

# Temperatures below this are treated as greedy: dividing by them overflows float32.
_MIN_TEMPERATURE = 1e-5


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass
class PenaltyTensors:
    """Repetition / presence / frequency penalties for the sub-batch of rows that set any."""

    rows: torch.Tensor  # [num_pen] int64 row indices into the batch
    repetition: torch.Tensor  # [num_pen] float32
    presence: torch.Tensor  # [num_pen] float32
    frequency: torch.Tensor  # [num_pen] float32
    seen_mask: torch.Tensor  # [num_pen, vocab] bool: token in prompt or output (repetition)
    output_counts: torch.Tensor  # [num_pen, vocab] float32: times the token was output

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[Sequence[int]],
        output_ids: list[Sequence[int]],
        rows: list[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyTensors:
        """Prompts are read only for rows with a repetition penalty: presence and frequency
        look at output tokens alone."""

        def scatter_index(seqs: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            sub_rows = list(chain.from_iterable(repeat(j, len(s)) for j, s in enumerate(seqs)))
            tokens = list(chain.from_iterable(seqs))
            return _tensor(sub_rows, torch.int64, device), _tensor(tokens, torch.int64, device)

        out_index = scatter_index([output_ids[i] for i in rows])
        counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
        ones = torch.ones(out_index[1].shape, dtype=torch.float32, device=device)
        counts.index_put_(out_index, ones, accumulate=True)
        seen = counts > 0
        prompts = [prompt_ids[i] if params[i].repetition_penalty != 1.0 else () for i in rows]
        if any(len(p) for p in prompts):
            seen[scatter_index(prompts)] = True

        def per_row(name: str) -> torch.Tensor:
            return _tensor([getattr(params[i], name) for i in rows], torch.float32, device)

        return cls(
            rows=_tensor(rows, torch.int64, device),
            repetition=per_row("repetition_penalty"),
            presence=per_row("presence_penalty"),
            frequency=per_row("frequency_penalty"),
            seen_mask=seen,
            output_counts=counts,
        )


@dataclass
class SamplingMetadata:
    """Per-step sampling tensors for one batch of `num_seqs` rows (one row per request).

    Stages that are costly per row (top-k, top-p, penalties, seeds) hold only the rows
    that use them, with their row indices; the rest are [num_seqs] with neutral values.
    """

    num_seqs: int
    vocab_size: int
    # Stage flags: the hot path skips every stage no row asks for.
    all_greedy: bool
    any_truncation: bool
    any_penalty: bool
    any_bias: bool
    any_seeded: bool
    max_logprobs: int | None  # largest params.logprobs in the batch; None if no row asks

    greedy: torch.Tensor | None  # [num_seqs] bool; None unless greedy and sampled rows mix
    temperature: torch.Tensor  # [num_seqs] float32; 1.0 on greedy rows (they skip it)
    min_p: torch.Tensor | None  # [num_seqs] float32, 0.0 = off; None when no row uses it
    top_k_rows: torch.Tensor | None  # [num_top_k] int64: sampled rows with 0 < top_k < vocab
    top_k: torch.Tensor | None  # [num_top_k] int64
    max_top_k: int
    top_p_rows: torch.Tensor | None  # [num_top_p] int64: sampled rows with top_p < 1
    top_p: torch.Tensor | None  # [num_top_p] float32
    penalties: PenaltyTensors | None
    # logit_bias as sparse (row, token, value) triples.
    bias_rows: torch.Tensor | None  # [num_bias] int64
    bias_tokens: torch.Tensor | None  # [num_bias] int64
    bias_values: torch.Tensor | None  # [num_bias] float32
    # Seeded sampled rows; the hash counter is (seed, position, token id) where position is
    # the number of tokens the request has output so far.
    seeded_rows: torch.Tensor | None  # [num_seeded] int64
    seeds: torch.Tensor | None  # [num_seeded] int64
    positions: torch.Tensor | None  # [num_seeded] int64
    num_logprobs: list[int | None]  # per row params.logprobs, for shaping the output
    # Structured output: the rows under a grammar and the tokens each may take next.
    grammar_rows: torch.Tensor | None = None  # [num_grammar] int64
    grammar_allowed: torch.Tensor | None = None  # [num_grammar, vocab] bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[Sequence[int]],
        output_ids: list[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        grammar: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """grammar: (rows, [len(rows), vocab] bool allowed tokens) for the rows under one."""
        n = len(params)
        assert len(prompt_ids) == n and len(output_ids) == n

        def opt(values: list, dtype: torch.dtype) -> torch.Tensor | None:
            return _tensor(values, dtype, device) if values else None

        # Truncation and seeds only matter on sampled rows; greedy rows take the argmax.
        sampled = [p.temperature >= _MIN_TEMPERATURE for p in params]
        all_greedy = not any(sampled)
        greedy = None
        if not all_greedy and not all(sampled):
            greedy = _tensor([not s for s in sampled], torch.bool, device)
        temps = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]

        top_k_rows = [i for i in range(n) if sampled[i] and 0 < params[i].top_k < vocab_size]
        top_p_rows = [i for i in range(n) if sampled[i] and params[i].top_p < 1.0]
        min_ps = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        any_min_p = any(m > 0.0 for m in min_ps)
        seeded_rows = [i for i in range(n) if sampled[i] and params[i].seed is not None]

        penalty_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        penalties = None
        if penalty_rows:
            penalties = PenaltyTensors.build(
                params, prompt_ids, output_ids, penalty_rows, vocab_size, device
            )

        bias = [(i, tok, v) for i, p in enumerate(params) for tok, v in p.logit_bias.items()]
        for _, tok, _ in bias:
            if tok >= vocab_size:
                raise SamplingParamsError(
                    f"logit_bias key {tok}: not a token id (vocab size is {vocab_size})"
                )

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_seqs=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            any_truncation=bool(top_k_rows or top_p_rows or any_min_p),
            any_penalty=penalties is not None,
            any_bias=bool(bias),
            any_seeded=bool(seeded_rows),
            max_logprobs=max(requested) if requested else None,
            greedy=greedy,
            temperature=_tensor(temps, torch.float32, device),
            min_p=opt(min_ps if any_min_p else [], torch.float32),
            top_k_rows=opt(top_k_rows, torch.int64),
            top_k=opt([params[i].top_k for i in top_k_rows], torch.int64),
            max_top_k=max((params[i].top_k for i in top_k_rows), default=0),
            top_p_rows=opt(top_p_rows, torch.int64),
            top_p=opt([params[i].top_p for i in top_p_rows], torch.float32),
            penalties=penalties,
            bias_rows=opt([row for row, _, _ in bias], torch.int64),
            bias_tokens=opt([tok for _, tok, _ in bias], torch.int64),
            bias_values=opt([value for _, _, value in bias], torch.float32),
            seeded_rows=opt(seeded_rows, torch.int64),
            seeds=opt([params[i].seed for i in seeded_rows], torch.int64),
            positions=opt([len(output_ids[i]) for i in seeded_rows], torch.int64),
            num_logprobs=[p.logprobs for p in params],
            grammar_rows=_tensor(grammar[0], torch.int64, device) if grammar else None,
            grammar_allowed=grammar[1].to(device) if grammar else None,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # None when no row asked for logprobs; else one entry per row, None where that row didn't.
    logprobs: list[TokenLogprobs | None] | None


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """`logits` in float32 with logit_bias, the penalties and the grammars' masks applied
    (what greedy rows take the argmax of): a copy when there is anything to apply, else
    `logits` itself (as float32). The input is never modified, and neither is the result
    afterwards."""
    if not meta.any_bias and not meta.any_penalty and meta.grammar_rows is None:
        return logits.float()  # no copy when already float32: a batch-32 step's logits are 6 MB
    logits = logits.to(dtype=torch.float32, copy=True)  # [num_seqs, vocab]
    if meta.any_bias:
        logits.index_put_((meta.bias_rows, meta.bias_tokens), meta.bias_values, accumulate=True)
    if meta.any_penalty:
        pen = meta.penalties
        sub = logits[pen.rows]  # [num_pen, vocab]
        rep = pen.repetition[:, None]  # [num_pen, 1]
        sub = torch.where(pen.seen_mask, torch.where(sub > 0, sub / rep, sub * rep), sub)
        counts = pen.output_counts  # [num_pen, vocab]
        sub -= pen.presence[:, None] * (counts > 0) + pen.frequency[:, None] * counts
        logits[pen.rows] = sub
    if meta.grammar_rows is not None:  # last: no bias or penalty lifts a token the grammar forbids
        rows = meta.grammar_rows
        logits[rows] = logits[rows].masked_fill(~meta.grammar_allowed, float("-inf"))
    return logits


def sampling_probs(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Distribution sampled rows draw from: softmax(processed / temperature) restricted
    by top-k, then top-p, then min-p (each on the distribution left by the one before).
    Greedy rows get softmax(processed); they never sample from it."""
    scaled = processed / meta.temperature[:, None]  # [num_seqs, vocab]
    if meta.any_truncation:
        scaled = _truncate(scaled, meta)
    return scaled.softmax(dim=-1)


def _truncate(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Set the logits of tokens outside each row's top-k / top-p / min-p set to -inf."""
    ninf = float("-inf")
    if meta.top_k_rows is not None:
        sub = logits[meta.top_k_rows]  # [num_top_k, vocab]
        top = sub.topk(meta.max_top_k, dim=-1).values  # [num_top_k, max_top_k], descending
        kth = top.gather(1, (meta.top_k - 1)[:, None])  # [num_top_k, 1]
        logits[meta.top_k_rows] = sub.masked_fill(sub < kth, ninf)  # ties with the k-th stay
    if meta.top_p_rows is not None:
        # Keep tokens while the mass before them (descending) < top_p: a prefix of the sorted
        # row (the top token's is 0, so it is kept). The cut is the last kept logit, and
        # tokens tied with it stay too, whichever order the sort put them in: an upper set,
        # as the GPU kernel keeps (kernels/sampling.py).
        sub = logits[meta.top_p_rows]  # [num_top_p, vocab]
        sorted_logits = sub.sort(dim=-1, descending=True).values
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        num_kept = (mass_before < meta.top_p[:, None]).sum(dim=-1, keepdim=True)  # [num_top_p, 1] >= 1
        cut = sorted_logits.gather(1, num_kept - 1)
        logits[meta.top_p_rows] = sub.masked_fill(sub < cut, ninf)
    if meta.min_p is not None:
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf is a no-op.
        max_logit = logits.max(dim=-1, keepdim=True).values  # [num_seqs, 1]
        logits = logits.masked_fill(logits < max_logit + meta.min_p.log()[:, None], ninf)
    return logits


class Sampler:
    """Picks one token per row. Stateless apart from the generator for unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # None: torch's default generator for the device

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_seqs, vocab] raw model logits (any float dtype; not modified)."""
        assert logits.shape == (meta.num_seqs, meta.vocab_size), logits.shape
        processed = process_logits(logits, meta)  # [num_seqs, vocab] float32
        ops = kernels.get_ops(processed.device)
        if meta.all_greedy:
            token_ids = ops.argmax(processed)  # [num_seqs]
        else:
            token_ids = ops.sample_step(processed, RowDraw(meta, self.generator))
            if meta.greedy is not None:
                token_ids = torch.where(meta.greedy, ops.argmax(processed), token_ids)
        ids = token_ids.tolist()
        return SamplerOutput(ids, _logprobs(logits, token_ids, ids, meta))


@dataclass(frozen=True)
class RowDraw:
    """One step's sampled rows in the two forms an op set takes (kernels.op_set.StepSampling)."""

    meta: SamplingMetadata
    generator: torch.Generator | None  # for unseeded rows; None: torch's default

    def per_row(self, processed: torch.Tensor) -> torch.Tensor:  # [num_seqs, vocab] -> [num_seqs]
        """An exact draw from each row's truncated distribution: inverse CDF on unseeded rows,
        the seeded exponential race on seeded ones."""
        meta, probs = self.meta, sampling_probs(processed, self.meta)
        if not meta.any_seeded:
            return _inverse_cdf(probs, self.generator)
        token_ids = torch.empty(meta.num_seqs, dtype=torch.int64, device=probs.device)
        if meta.seeded_rows.numel() < meta.num_seqs:
            unseeded = torch.ones(meta.num_seqs, dtype=torch.bool, device=probs.device)
            unseeded[meta.seeded_rows] = False
            token_ids[unseeded] = _inverse_cdf(probs[unseeded], self.generator)
        exp = seeded_exponentials(meta.seeds, meta.positions, meta.vocab_size)  # [num_seeded, vocab]
        token_ids[meta.seeded_rows] = (probs[meta.seeded_rows] / exp).argmax(dim=-1)
        return token_ids

    def dense(self) -> DenseSampling:
        """Each row's parameters, neutral where unused; rows without a seed draw a random one
        (position 0) from the generator."""
        meta, device = self.meta, self.meta.temperature.device
        n = meta.num_seqs
        top_k = torch.zeros(n, dtype=torch.int64, device=device)
        top_p = torch.ones(n, dtype=torch.float32, device=device)
        if meta.top_k_rows is not None:
            top_k[meta.top_k_rows] = meta.top_k
        if meta.top_p_rows is not None:
            top_p[meta.top_p_rows] = meta.top_p
        min_p = meta.min_p if meta.min_p is not None else torch.zeros(n, dtype=torch.float32, device=device)
        seeds = torch.randint(0, 2**63 - 1, (n,), generator=self.generator, device=device)
        positions = torch.zeros(n, dtype=torch.int64, device=device)
        if meta.any_seeded:
            seeds[meta.seeded_rows] = meta.seeds
            positions[meta.seeded_rows] = meta.positions
        return DenseSampling(meta.temperature, top_k, top_p, min_p, seeds, positions)


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[num_rows, vocab] probabilities -> [num_rows] token ids, one uniform draw per row.

    The cumulative sum is in float64 (a float32 one over 49k tokens drifts by ~1e-5), and
    the draw is scaled to each row's own total, kept strictly below it: the first token whose
    cumulative probability exceeds it then always has positive probability, so a token that
    truncation or a grammar masked to zero is never picked."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [num_rows, vocab]
    total = cdf[:, -1:]  # [num_rows, 1]
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)  # [num_rows]


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, ids: list[int], meta: SamplingMetadata
) -> list[TokenLogprobs | None] | None:
    """Logprobs from log_softmax of the RAW model logits: what the model believes, before
    bias, penalties, temperature and truncation (which would give -inf for truncated tokens
    and depend on the sampling knobs rather than the model)."""
    if meta.max_logprobs is None:
        return None
    logp = logits.float().log_softmax(dim=-1)  # [num_seqs, vocab]
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1).tolist()  # [num_seqs]
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if meta.max_logprobs > 0:
        top = logp.topk(min(meta.max_logprobs, meta.vocab_size), dim=-1)  # [num_seqs, n_top]
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(meta.num_logprobs):
        if n is None:
            out.append(None)
            continue
        pairs = list(zip(top_ids[i][:n], top_vals[i][:n])) if n else []
        out.append(TokenLogprobs(ids[i], chosen[i], pairs))
    return out
