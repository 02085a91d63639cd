"""The Triton kernels on a CUDA GPU: each checked against its torch reference, then timed.

    python -m bench.kernels                  # CUDA GPU: about a minute, a table last
    python -m bench.kernels --interpret      # no GPU: the same checks at toy sizes in Triton's
                                             # interpreter, no timing (a smoke test of this script)
    python -m bench.kernels --compile-only   # no GPU: compile every kernel for sm_90 (H100/H200)
                                             # and print ptxas' registers and spills (~1.5 min)

Without a CUDA device and without either flag it says so and exits with status 2.

Shapes are Llama-3-8B's (32 query heads and 8 KV heads of 128, hidden 4096, vocab 128256,
bf16, 16-token blocks; the KV pool block-major as in engine/kv_cache.py, so attention
reads strided per-layer views) at sizes that fill an H100/H200. Each kernel and its
torch reference (kernels/reference.py) run on the same inputs; times are the median of
`triton.testing.do_bench` (L2 flushed between calls). Memory-bound kernels report GB/s
(bytes that must move: read + written) against this device's copy bandwidth, measured
the same way (a 1 GiB tensor copy); prefill attention reports TFLOP/s against a bf16
8192^3 matmul. Sampling reports its share of a Llama-8B decode step at batch 256, the
step modelled from below as reading the 16 GB of weights once at copy bandwidth (so the
share is an upper bound).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from bench.kernels_compile import compile_only

LLAMA_8B_WEIGHT_BYTES = 8.03e9 * 2  # bf16


@dataclass(frozen=True)
class Sizes:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    block_size: int
    layers: int  # in the pool of the pack/unpack case (a block holds every layer)
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    prefill: tuple[tuple[int, int], ...]  # (context, chunk) per sequence
    tokens: int  # write_kv, RMSNorm, rotary
    pack_blocks: int
    sample_rows: int


FULL = Sizes(heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=128256, block_size=16, layers=32,
             decode=((64, 4096), (4, 32768)), prefill=((1024, 1024),) * 4 + ((2048, 1024),) * 4,
             tokens=8192, pack_blocks=128, sample_rows=256)
TOY = Sizes(heads=8, kv_heads=2, head_dim=32, hidden=256, vocab=1000, block_size=16, layers=2,
            decode=((3, 70),), prefill=((20, 20), (45, 7)), tokens=37, pack_blocks=5, sample_rows=16)


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float | None = None  # Triton
    ref_ms: float | None = None  # torch reference
    amount: float = 0.0  # bytes moved, or flops
    unit: str = "GB/s"  # or "TFLOP/s", or "% step"
    ceiling: float | None = None  # device rate in the same unit
    check: str = "ok"


class Bench:
    def __init__(self, sizes: Sizes, device: str, timed: bool):
        import torch

        self.torch = torch
        self.sz = sizes
        self.device = device
        self.timed = timed
        self.dtype = torch.bfloat16
        self.g = torch.Generator(device=device).manual_seed(0)
        self.copy_bw = self.matmul_rate = None
        if timed:
            n = 2**29  # 1 GiB of bf16
            src = torch.ones(n, dtype=self.dtype, device=device)
            dst = torch.empty_like(src)
            self.copy_bw = 2 * n * 2 / (self._time(lambda: dst.copy_(src)) * 1e-3) / 1e9  # GB/s
            del src, dst
            a = torch.randn(8192, 8192, dtype=self.dtype, device=device)
            self.matmul_rate = 2 * 8192**3 / (self._time(lambda: a @ a) * 1e-3) / 1e12  # TFLOP/s
            del a

    def _time(self, fn: Callable[[], object]) -> float:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def timing(self, row: Row, fn: Callable[[], object], ref_fn: Callable[[], object]) -> Row:
        if self.timed:
            row.ms, row.ref_ms = self._time(fn), self._time(ref_fn)
        return row

    def randn(self, *shape, scale: float = 1.0):
        t = self.torch.randn(*shape, generator=self.g, device=self.device, dtype=self.torch.float32)
        return (t * scale).to(self.dtype)

    def close(self, got, expect, atol=1e-2, rtol=1e-2) -> str:
        got = got.float()
        if got.isnan().any():
            return "FAIL: NaN"
        err = (got - expect.float()).abs()
        bad = err > atol + rtol * expect.float().abs()
        return "ok" if not bad.any() else f"FAIL: {int(bad.sum())} values off (max err {err.max().item():.3g})"

    def paged(self, lens: list[int], layers: int = 2):
        """A block-major pool with the contexts in shuffled blocks; per-layer strided views."""
        torch, sz = self.torch, self.sz
        n_blocks = [math.ceil(n / sz.block_size) for n in lens]
        total = sum(n_blocks) + 1
        pool = self.randn(total, layers, 2, sz.block_size, sz.kv_heads, sz.head_dim)
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(1)).tolist()
        tables = [[perm.pop() for _ in range(n)] for n in n_blocks]
        width = max(n_blocks)
        block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=self.device)
        return pool, pool[:, 1, 0], pool[:, 1, 1], block_tables

    # --- one method per kernel; each returns table rows -------------------------------

    def decode_attention(self, ref, tri) -> list[Row]:
        torch, sz = self.torch, self.sz
        rows = []
        for batch, ctx in sz.decode:
            lens = [ctx] * batch
            pool, k, v, tables = self.paged(lens)
            q = self.randn(batch, sz.heads, sz.head_dim)
            lens_t = torch.tensor(lens, device=self.device)
            scale = sz.head_dim**-0.5
            out = tri.paged_decode_attention(q, k, v, tables, lens_t, scale)
            expect = ref.paged_decode_attention(q.float(), k.float(), v.float(), tables, lens_t, scale)
            kv_bytes = 2 * batch * ctx * sz.kv_heads * sz.head_dim * 2 + 2 * q.numel() * 2
            row = Row("decode attention", f"batch {batch} x ctx {ctx}", amount=kv_bytes, ceiling=self.copy_bw,
                      check=self.close(out, expect))
            del expect
            rows.append(self.timing(
                row, lambda: tri.paged_decode_attention(q, k, v, tables, lens_t, scale),
                lambda: ref.paged_decode_attention(q, k, v, tables, lens_t, scale)))
            del pool, k, v
        return rows

    def prefill_attention(self, ref, tri) -> list[Row]:
        torch, sz = self.torch, self.sz
        seqs = sz.prefill
        pool, k, v, tables = self.paged([c for c, _ in seqs])
        cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], device=self.device)
        lens = torch.tensor([c for c, _ in seqs], device=self.device)
        max_new = max(n for _, n in seqs)
        q = self.randn(int(cu[-1]), sz.heads, sz.head_dim)
        scale = sz.head_dim**-0.5
        out = tri.paged_prefill_attention(q, k, v, cu, lens, tables, max_new, scale)
        expect = ref.paged_prefill_attention(q.float(), k.float(), v.float(), cu, lens, tables, max_new, scale)
        visible = sum(n * (c - n) + n * (n + 1) // 2 for c, n in seqs)  # causal (query, key) pairs
        row = Row("prefill attention", f"{len(seqs)} chunks, {int(cu[-1])} tokens", amount=4 * sz.heads *
                  sz.head_dim * visible, unit="TFLOP/s", ceiling=self.matmul_rate, check=self.close(out, expect))
        return [self.timing(row, lambda: tri.paged_prefill_attention(q, k, v, cu, lens, tables, max_new, scale),
                            lambda: ref.paged_prefill_attention(q, k, v, cu, lens, tables, max_new, scale))]

    def write_kv(self, ref, tri) -> list[Row]:
        torch, sz = self.torch, self.sz
        n = sz.tokens
        num_blocks = math.ceil(n / sz.block_size) * 2
        pool = self.randn(num_blocks, 2, 2, sz.block_size, sz.kv_heads, sz.head_dim)
        expect = pool.clone()
        slots = torch.randperm(num_blocks * sz.block_size, device=self.device)[:n]
        blocks, offsets = slots // sz.block_size, slots % sz.block_size
        kv = self.randn(n, 2 * sz.kv_heads, sz.head_dim)
        k, v = kv[:, :sz.kv_heads], kv[:, sz.kv_heads:]
        tri.write_kv(pool[:, 1, 0], pool[:, 1, 1], blocks, offsets, k, v)
        ref.write_kv(expect[:, 1, 0], expect[:, 1, 1], blocks, offsets, k, v)
        row = Row("KV cache write", f"{n} tokens", amount=2 * kv.numel() * 2, ceiling=self.copy_bw,  # read + write
                  check="ok" if torch.equal(pool, expect) else "FAIL: slots differ")
        kc, vc = pool[:, 1, 0], pool[:, 1, 1]
        return [self.timing(row, lambda: tri.write_kv(kc, vc, blocks, offsets, k, v),
                            lambda: ref.write_kv(kc, vc, blocks, offsets, k, v))]

    def pack_unpack(self, ref, tri) -> list[Row]:
        torch, sz = self.torch, self.sz
        n = sz.pack_blocks
        pool = self.randn(4 * n, sz.layers, 2, sz.block_size, sz.kv_heads, sz.head_dim)
        ids = torch.randperm(4 * n, device=self.device)[:n]
        staging = tri.pack_blocks(pool, ids)
        block_bytes = pool[0].numel() * 2
        shape = f"{n} blocks of {block_bytes / 2**20:.2f} MiB"
        pack = Row("KV pack", shape, amount=2 * n * block_bytes, ceiling=self.copy_bw,
                   check="ok" if torch.equal(staging, ref.pack_blocks(pool, ids)) else "FAIL")
        new = self.randn(*staging.shape)
        got, expect = pool.clone(), pool.clone()
        tri.unpack_blocks(got, ids, new)
        ref.unpack_blocks(expect, ids, new)
        unpack = Row("KV unpack", shape, amount=2 * n * block_bytes, ceiling=self.copy_bw,
                     check="ok" if torch.equal(got, expect) else "FAIL")
        del expect
        return [self.timing(pack, lambda: tri.pack_blocks(pool, ids, out=staging),
                            lambda: ref.pack_blocks(pool, ids)),
                self.timing(unpack, lambda: tri.unpack_blocks(got, ids, new),
                            lambda: ref.unpack_blocks(got, ids, new))]

    def norm_rope(self, ref, tri) -> list[Row]:
        torch, sz = self.torch, self.sz
        n = sz.tokens
        x, res = self.randn(n, sz.hidden), self.randn(n, sz.hidden, scale=4.0)
        w = (1 + 0.1 * self.randn(sz.hidden).float()).to(self.dtype)
        out, res_out = tri.add_rms_norm(x, res, w, 1e-5)
        expect, expect_res = ref.add_rms_norm(x, res, w, 1e-5)
        check = self.close(out, expect, atol=1e-2, rtol=1e-2)
        if not torch.equal(res_out, expect_res):
            check = "FAIL: residual differs"
        norm = Row("add + RMSNorm", f"{n} x {sz.hidden}", amount=4 * x.numel() * 2, ceiling=self.copy_bw,
                   check=check)
        heads = sz.heads + sz.kv_heads
        qkv = self.randn(n, heads + sz.kv_heads, sz.head_dim)
        qk = qkv[:, :heads]
        angle = torch.arange(n, device=self.device, dtype=torch.float32)[:, None] * torch.rand(
            sz.head_dim // 2, generator=self.g, device=self.device)
        emb = torch.cat([angle, angle], dim=-1)[:, None, :]
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        rot = tri.rotary(qk, cos, sin)
        rope = Row("rotary (q and k)", f"{n} tokens x {heads} heads", amount=2 * qk.numel() * 2 + 2 * cos.numel() * 2,
                   ceiling=self.copy_bw, check="ok" if torch.equal(rot, ref.rotary(qk, cos, sin)) else
                   self.close(rot, ref.rotary(qk, cos, sin), atol=1e-2, rtol=1e-2))
        return [self.timing(norm, lambda: tri.add_rms_norm(x, res, w, 1e-5), lambda: ref.add_rms_norm(x, res, w, 1e-5)),
                self.timing(rope, lambda: tri.rotary(qk, cos, sin), lambda: ref.rotary(qk, cos, sin))]

    def sampling(self, ref, tri) -> list[Row]:
        from engine.seeded_random import seeded_exponentials

        torch, sz = self.torch, self.sz
        b, vocab = sz.sample_rows, sz.vocab
        # Peaked logits in bf16 (as a model's are): the top-p cut falls between well-separated
        # masses, so float rounding cannot move it, and equal logits across a cut stay whole
        # in both (an upper set): the kept sets must be equal.
        logits = self.randn(b, vocab, scale=4.0).float()
        temp = torch.full((b,), 0.8, device=self.device)
        top_k = torch.full((b,), 50, device=self.device)
        top_p = torch.full((b,), 0.9, device=self.device)
        min_p = torch.full((b,), 0.05, device=self.device)
        seeds = torch.arange(b, device=self.device) * 7919 + 1
        positions = torch.zeros(b, dtype=torch.int64, device=self.device)
        args = (logits, temp, top_k, top_p, min_p)
        exps = seeded_exponentials(seeds, positions, vocab)
        check = "ok"
        if not torch.equal(tri.sampling_mask(*args), ref.sampling_mask(*args)):
            check = "FAIL: kept sets differ"
        got, expect = tri.sample(*args, seeds, positions), ref.sample(*args, exps)
        if check == "ok" and (got != expect).sum() > 1:  # an exact near-tie may flip one draw
            check = f"FAIL: {int((got != expect).sum())} of {b} seeded draws differ"
        step_ms = LLAMA_8B_WEIGHT_BYTES / (self.copy_bw * 1e9) * 1e3 if self.copy_bw else None
        row = Row("sampling k/p/min-p", f"{b} x {vocab}", amount=step_ms or 0.0, unit="% step", check=check)
        return [self.timing(row, lambda: tri.sample(*args, seeds, positions), lambda: ref.sample(*args, exps))]


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _table(rows: list[Row], bench: Bench) -> str:
    lines = ["| kernel | shape | Triton ms | torch ms | speedup | achieved | device | % of device | check |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        speedup = r.ref_ms / r.ms if r.ms and r.ref_ms else None
        if r.unit == "% step":
            achieved = f"{_fmt(r.ms, '.3f')} ms"
            device = f"step >= {_fmt(r.amount or None, '.2f')} ms"
            pct = 100 * r.ms / r.amount if r.ms and r.amount else None
        else:
            scale = 1e9 if r.unit == "GB/s" else 1e12
            rate = r.amount / (r.ms * 1e-3) / scale if r.ms else None
            achieved, device = f"{_fmt(rate, '.0f' if r.unit == 'GB/s' else '.1f')} {r.unit}", \
                f"{_fmt(r.ceiling, '.0f' if r.unit == 'GB/s' else '.1f')} {r.unit}"
            pct = 100 * rate / r.ceiling if rate and r.ceiling else None
        lines.append(f"| {r.kernel} | {r.shape} | {_fmt(r.ms, '.3f')} | {_fmt(r.ref_ms, '.3f')} | "
                     f"{_fmt(speedup, '.2f')}{'x' if speedup else ''} | {achieved} | {device} | "
                     f"{_fmt(pct, '.0f')}{'%' if pct is not None else ''} | {r.check} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: run the checks at toy sizes in Triton's interpreter, without timing")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: compile every kernel for --arch and report registers and spills")
    parser.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only (90: H100/H200)")
    args = parser.parse_args(argv)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only(args.arch)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("bench.kernels: no CUDA device here, so there is nothing to time. The kernels' correctness "
              "runs on CPU in `pytest tests/kernels/test_kernels_triton.py`; `python -m bench.kernels --interpret` "
              "smoke-tests this script at toy sizes.", file=sys.stderr)
        return 2
    from kernels import reference as ref
    from kernels import triton_ops as tri

    t0 = time.perf_counter()
    device = "cpu" if args.interpret else "cuda"
    bench = Bench(TOY if args.interpret else FULL, device, timed=not args.interpret)
    if args.interpret:
        print("Triton interpreter, toy sizes: checks only, no timing.")
    else:
        print(f"{torch.cuda.get_device_name()}: copy {bench.copy_bw:.0f} GB/s (read + write, 1 GiB), "
              f"bf16 matmul {bench.matmul_rate:.0f} TFLOP/s (8192^3)", flush=True)
    rows: list[Row] = []
    for case in (bench.decode_attention, bench.prefill_attention, bench.write_kv, bench.pack_unpack,
                 bench.norm_rope, bench.sampling):
        try:
            new = case(ref, tri)
        except Exception as e:  # a kernel that fails to compile or run is a row, not the end
            traceback.print_exc()
            new = [Row(case.__name__, "-", check=f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:80]}")]
        for r in new:
            print(f"  {r.kernel:20s} {r.shape:28s} {_fmt(r.ms, '.3f')} ms  {r.check}", flush=True)
        rows.extend(new)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{time.perf_counter() - t0:.0f} s\n")
    print(_table(rows, bench))
    return 0 if all(r.check == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
