"""Paged decode attention on CPU: the native kernel (reads the blocks in place) against the
torch ops (gather every block with index_select, then SDPA), side by side in one run.

    python -m bench.cpu_attention [--threads 2] [--json out.json]

Shapes: SmolLM2-135M (9 query heads over 3 KV heads of 64) and a Llama-3-8B layer (32
over 8 of 128), 16-token blocks scattered over a block-major pool as engine/kv_cache.py
lays it out, batch 1, 8 and 32 at context 270 and 1024, float32 and bfloat16. Each time is
the median of repeated calls (one layer); GB/s is the K/V bytes that must be read, against
this machine's copy bandwidth measured in the same run (a 256 MiB tensor copy). The host's
CPU and ISA head the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kernels import native, reference
from kernels.host import cpu

SHAPES = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}
BLOCK = 16


def median_seconds(fn, repeat: int = 15) -> float:
    """Median wall time of `repeat` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_seconds(lambda: dst.copy_(src), 5)  # read + written


def run(threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    lib = native.load(Path(tempfile.gettempdir()) / "pdserve-bench-native")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, (heads, kv_heads, head_dim) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            for batch in (1, 8, 32):
                for ctx in (270, 1024):
                    width = -(-ctx // BLOCK)
                    num_blocks = batch * width + 8
                    pool = torch.randn(num_blocks, 2, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
                    k, v = pool[:, 0], pool[:, 1]
                    tables = torch.randperm(num_blocks, generator=gen)[:batch * width].view(batch, width)
                    lens = torch.full((batch,), ctx, dtype=torch.int64)
                    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
                    scale = head_dim ** -0.5
                    t_torch = median_seconds(lambda: reference.paged_decode_attention(q, k, v, tables, lens, scale))
                    t_native = median_seconds(lambda: native.paged_decode_attention(lib, q, k, v, tables, lens, scale))
                    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * q.element_size()
                    rows.append(dict(model=model, dtype=str(dtype).removeprefix("torch."), batch=batch, ctx=ctx,
                                     torch_ms=t_torch * 1e3, native_ms=t_native * 1e3, speedup=t_torch / t_native,
                                     native_gbs=kv_bytes / t_native / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    host = cpu()
    bw = copy_bandwidth()
    print(f"host: {host.describe()}; native build: {native.isa_level()}; copy bandwidth {bw / 1e9:.1f} GB/s "
          f"(read + written), {args.threads} threads")
    rows = run(args.threads)
    print("| model | dtype | batch | context | torch ops ms | native ms | native vs torch | native K/V GB/s "
          "(vs copy) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['ctx']} | {r['torch_ms']:.3f} | "
              f"{r['native_ms']:.3f} | {r['speedup']:.2f}x | {r['native_gbs']:.1f} ({r['native_gbs'] * 1e9 / bw:.2f}x) |")
    if args.json:
        args.json.write_text(json.dumps({"host": host.describe(), "isa_level": native.isa_level(),
                                         "copy_bandwidth_gbs": bw / 1e9, "threads": args.threads, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
