"""A short measurement of the engine's CPU kernels in bf16 and float32, for `dtype="auto"`
(kernels/dtype_choice.py decides and caches).

Where the CPU has no bf16 dot product the native kernels still run bf16 (widened onto the
float32 FMA tiles, kernels/linear.py): half the bytes per weight against the widening's
cost, so which dtype is faster depends on the host and is measured, not assumed. The
workload is what an engine step runs on a SmolLM2-135M-shaped decoder layer (the default
model), through the op set `kernels.get_ops("cpu")` returns and kernels.linear's packed
matmuls, at this process's thread count: a decode step (DECODE_SEQS sequences at CONTEXT
tokens, over enough distinct layers that the weights do not fit the last-level cache,
as a whole model's do not) and a prefill step (one PREFILL_TOKENS chunk). The two dtypes
and shapes take turns, and each keeps its fastest repeat (the least disturbed by other
work on the host); the median repeats must name the same winner for the verdict to be
cached. Under a second on a quiet 2-core host.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels import linear


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's sizes, and the layer count the rates are scaled to."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def weight_elements(self) -> int:
        """qkv, o, gate|up and down projections."""
        h, i = self.hidden, self.intermediate
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + h * 2 * i + i * h


SMOLLM2_135M = LayerShape(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=30)
DECODE_SEQS = 8
CONTEXT = 256  # each decoding sequence's context
PREFILL_TOKENS = 256  # one prefill chunk, its own context
BLOCK_SIZE = 16
TIME_BUDGET_S = 0.25  # the timed repeats, both dtypes and shapes together
MIN_REPEATS, MAX_REPEATS = 3, 50
DEFAULT_LLC_BYTES = 32 << 20


@dataclass(frozen=True)
class Rates:
    """Tokens per second of a whole model of the shape's layer count (its LM head aside)."""

    decode: float
    prefill: float

    @property
    def tokens_per_s(self) -> float:
        """Over a request with as many prompt as output tokens: decode time dominates, as
        it does in generation."""
        return 2 / (1 / self.decode + 1 / self.prefill)


@dataclass(frozen=True)
class Measurement:
    """Both dtypes' rates from each step's fastest repeat (the least disturbed by other work
    on the host), and the same ratio from the median repeats as a check."""

    bf16: Rates
    float32: Rates
    seconds: float  # the calibration's own wall time, set-up included
    median_ratio: float  # `ratio` from the median repeats

    @property
    def ratio(self) -> float:
        """bf16's rate over float32's (> 1: bf16 is faster here)."""
        return self.bf16.tokens_per_s / self.float32.tokens_per_s

    @property
    def settled(self) -> bool:
        """The fastest and the median repeats name the same faster dtype: other work on the
        host did not decide it (an unsettled verdict is used, not cached)."""
        return (self.ratio >= 1) == (self.median_ratio >= 1)


@dataclass(frozen=True)
class _Weight:
    weight: torch.Tensor | None  # [out, in]; None where the packed copies serve every x
    packed: linear.PackedWeight | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear.linear(x, self.weight, None, self.packed)


@dataclass(frozen=True)
class _Layer:
    qkv: _Weight
    o: _Weight
    gate_up: _Weight
    down: _Weight
    norm: torch.Tensor  # [hidden]: both norms' weight
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor

    def copy(self) -> _Layer:
        """The same numbers in new memory (a copy is much cheaper than drawing them again)."""
        return _Layer(*(_Weight(w.weight.clone(), None) for w in (self.qkv, self.o, self.gate_up, self.down)),
                      norm=self.norm, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone())

    def packed(self, library) -> _Layer:
        """Its weights packed as engine/model.py's Linear packs them."""
        def pack(w: _Weight) -> _Weight:
            packed = linear.pack_weight(w.weight, library)
            return _Weight(None if packed is not None and packed.serves_every_x else w.weight, packed)

        return _Layer(pack(self.qkv), pack(self.o), pack(self.gate_up), pack(self.down), self.norm, self.k_cache,
                      self.v_cache)


@dataclass(frozen=True)
class _Batch:
    """One step's inputs: its tokens' rows, where their K/V go, what attention reads."""

    x: torch.Tensor  # [tokens, hidden]
    cos: torch.Tensor  # [tokens, 1, head_dim]
    sin: torch.Tensor
    slot_blocks: torch.Tensor  # [tokens]
    slot_offsets: torch.Tensor  # [tokens]
    block_tables: torch.Tensor  # [seqs, blocks per seq]
    context_lens: torch.Tensor  # [seqs]
    cu_seqlens: torch.Tensor | None  # [seqs + 1]: a prefill step's chunks; None for decodes


def measure(shape: LayerShape = SMOLLM2_135M) -> Measurement:
    """Both dtypes' decode and prefill rates on this host, at torch's thread count now."""
    start = time.perf_counter()
    ops = kernels.get_ops("cpu")
    library = ops.matmul_library()
    decode_layers = _layers_beyond_cache(shape)
    steps: dict[tuple[torch.dtype, str], Callable[[], None]] = {}
    work: dict[str, tuple[int, int]] = {"decode": (DECODE_SEQS, decode_layers), "prefill": (PREFILL_TOKENS, 1)}
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        first = _layer(shape, dtype, gen)
        layers = [first.packed(library)] + [first.copy().packed(library) for _ in range(decode_layers - 1)]
        steps[dtype, "decode"] = _step(ops, shape, layers, _decode_batch(shape, dtype, gen))
        steps[dtype, "prefill"] = _step(ops, shape, layers[:1], _prefill_batch(shape, dtype, gen))
    times: dict[tuple[torch.dtype, str], list[float]] = {key: [] for key in steps}
    for step in steps.values():  # warm-up: first-touch pages, the kernels' first calls
        step()
    timed = time.perf_counter()
    while len(times[torch.float32, "decode"]) < MIN_REPEATS or (
            len(times[torch.float32, "decode"]) < MAX_REPEATS and time.perf_counter() - timed < TIME_BUDGET_S):
        for key, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - t0)

    def rates(dtype: torch.dtype, pick: Callable[[list[float]], float]) -> Rates:
        # seconds per token through a whole model: each step's time per layer, times its layers
        per_token = {kind: pick(times[dtype, kind]) / layers * shape.layers / tokens
                     for kind, (tokens, layers) in work.items()}
        return Rates(decode=1 / per_token["decode"], prefill=1 / per_token["prefill"])

    medians = Measurement(rates(torch.bfloat16, statistics.median), rates(torch.float32, statistics.median), 0.0,
                          median_ratio=math.nan)
    return Measurement(rates(torch.bfloat16, min), rates(torch.float32, min), time.perf_counter() - start,
                       median_ratio=medians.ratio)


def _layers_beyond_cache(shape: LayerShape) -> int:
    """Distinct layers whose bf16 weights fill the last-level cache twice over (2 to 16), so
    that decode streams them from memory as a whole model's are."""
    per_layer = shape.weight_elements * torch.bfloat16.itemsize
    return max(2, min(16, math.ceil(2 * _llc_bytes() / per_layer)))


def _llc_bytes() -> int:
    """The largest CPU cache's size as Linux reports it, else DEFAULT_LLC_BYTES."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=DEFAULT_LLC_BYTES)


def _layer(shape: LayerShape, dtype: torch.dtype, gen: torch.Generator) -> _Layer:
    """A layer of random weights and a random KV pool, not packed yet."""
    def weight(out: int, inp: int) -> _Weight:
        return _Weight(torch.empty(out, inp, dtype=dtype).uniform_(-0.05, 0.05, generator=gen), None)

    h = shape.hidden
    blocks = DECODE_SEQS * CONTEXT // BLOCK_SIZE + PREFILL_TOKENS // BLOCK_SIZE
    kv = (blocks, BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    return _Layer(qkv=weight(shape.q_size + 2 * shape.kv_size, h), o=weight(h, shape.q_size),
                  gate_up=weight(2 * shape.intermediate, h), down=weight(h, shape.intermediate),
                  norm=torch.ones(h, dtype=dtype),
                  k_cache=torch.empty(kv, dtype=dtype).uniform_(-1, 1, generator=gen),
                  v_cache=torch.empty(kv, dtype=dtype).uniform_(-1, 1, generator=gen))


def _rows(shape: LayerShape, tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.empty(tokens, shape.hidden, dtype=dtype).uniform_(-1, 1, generator=gen)
    angles = torch.rand(tokens, 1, shape.head_dim, generator=gen) * math.pi
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def _decode_batch(shape: LayerShape, dtype: torch.dtype, gen: torch.Generator) -> _Batch:
    per_seq = CONTEXT // BLOCK_SIZE
    tables = torch.arange(DECODE_SEQS * per_seq).view(DECODE_SEQS, per_seq)
    return _Batch(*_rows(shape, DECODE_SEQS, dtype, gen), slot_blocks=tables[:, -1].clone(),
                  slot_offsets=torch.full((DECODE_SEQS,), (CONTEXT - 1) % BLOCK_SIZE),
                  block_tables=tables, context_lens=torch.full((DECODE_SEQS,), CONTEXT), cu_seqlens=None)


def _prefill_batch(shape: LayerShape, dtype: torch.dtype, gen: torch.Generator) -> _Batch:
    first = DECODE_SEQS * CONTEXT // BLOCK_SIZE
    positions = torch.arange(PREFILL_TOKENS)
    return _Batch(*_rows(shape, PREFILL_TOKENS, dtype, gen), slot_blocks=first + positions // BLOCK_SIZE,
                  slot_offsets=positions % BLOCK_SIZE,
                  block_tables=torch.arange(first, first + PREFILL_TOKENS // BLOCK_SIZE).view(1, -1),
                  context_lens=torch.tensor([PREFILL_TOKENS]), cu_seqlens=torch.tensor([0, PREFILL_TOKENS]))


def _step(ops, shape: LayerShape, layers: list[_Layer], batch: _Batch) -> Callable[[], None]:
    """One engine step through `layers`: engine/model.py's DecoderLayer.forward, op for op."""
    n, scale = batch.x.shape[0], shape.head_dim**-0.5

    def run() -> None:
        x, residual = batch.x, batch.x
        for layer in layers:
            h, residual = ops.add_rms_norm(x, residual, layer.norm, 1e-5)
            qk, v = layer.qkv(h).split([shape.q_size + shape.kv_size, shape.kv_size], dim=-1)
            qk = ops.rotary(qk.view(n, shape.heads + shape.kv_heads, shape.head_dim), batch.cos, batch.sin)
            q, k = qk.split([shape.heads, shape.kv_heads], dim=1)
            ops.write_kv(layer.k_cache, layer.v_cache, batch.slot_blocks, batch.slot_offsets, k,
                         v.view(n, shape.kv_heads, shape.head_dim))
            if batch.cu_seqlens is None:
                attn = ops.paged_decode_attention(q, layer.k_cache, layer.v_cache, batch.block_tables,
                                                  batch.context_lens, scale)
            else:
                attn = ops.paged_prefill_attention(q, layer.k_cache, layer.v_cache, batch.cu_seqlens,
                                                   batch.context_lens, batch.block_tables, n, scale)
            h, residual = ops.add_rms_norm(layer.o(attn.reshape(n, shape.q_size)), residual, layer.norm, 1e-5)
            x = layer.down(ops.silu_mul(layer.gate_up(h)))

    return run
