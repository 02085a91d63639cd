"""A decoder layer's ops besides attention on CPU, native kernels against torch's, side by
side in one run: the linears (bf16 and float32), and the row-wise ops between them.

    python -m bench.cpu_layer_ops [--threads 2] [--json out.json]

Linears: a whole model's worth of distinct weights (SmolLM2-135M: 30 layers of
qkv 576->960, o 576->576, gate|up 576->3072, down 1536->576, and the 576->49152 LM head),
so each pass streams every weight from memory as a decode step does; x of 1 to 512 rows.
Each matmul kernel the host runs: bf16 oneDNN's packed weights (kernels/linear.py),
F.linear, the native AVX512-BF16 dot kernel and the native AMX one (kernels/csrc/
gemv_bf16.cpp, amx_bf16.cpp), the native FMA tiles over widened bf16 (gemm_f32.cpp); float32 F.linear and the native FMA-tile one (gemm_f32.cpp). GB/s is weight bytes per second, against this machine's read bandwidth
(a sum over a 256 MiB tensor) measured in the same run. Row-wise ops: RMS norm with its
residual add, rotary over the q|k heads of a qkv row, SiLU-and-multiply, at 1, 32 and 512
rows, in float32 and bfloat16, torch reference vs native (kernels/csrc/norm_act.cpp).
Times are medians of repeated calls. The host's CPU and ISA head the output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.cpu_attention import median_seconds
from kernels import native, reference
from kernels.host import cpu

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
HEAD = (576, 49152)
LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def read_bandwidth() -> float:
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    return src.numel() * 4 / median_seconds(lambda: src.sum(), 5)


def linears(lib, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [HEAD]
    weights = [(0.02 * torch.randn(n, k, generator=gen)).to(dtype) for k, n in shapes]
    kernels = {"F.linear": lambda x, w, packed: F.linear(x, w)}
    packs = {}
    caps = cpu()
    if dtype == torch.float32:
        if native.isa_level() != "generic":
            packs["native"] = [native.pack_matmul_weight(w, "f32") for w in weights]
            kernels["native f32"] = lambda x, w, packed: native.matmul(lib, x, packed, None, "f32")
    elif caps.onednn_bf16:
        packs["oneDNN"] = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
        kernels["oneDNN"] = lambda x, w, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if dtype == torch.bfloat16 and native.isa_level() != "generic":
        packs["native"] = [native.pack_matmul_weight(w, "dots") for w in weights]  # one layout for all three
        kernels["native fma_bf16"] = lambda x, w, packed: native.matmul(lib, x, packed, None, "fma_bf16")
    if dtype == torch.bfloat16 and caps.avx512_bf16:
        kernels["native dots"] = lambda x, w, packed: native.matmul(lib, x, packed, None, "dots")
    if dtype == torch.bfloat16 and caps.amx_bf16:
        kernels["native AMX"] = lambda x, w, packed: native.matmul(lib, x, packed, None, "amx")
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    rows = []
    for m in ROWS:
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for k, _ in shapes}}
        row = dict(rows=m)
        for name, fn in kernels.items():
            pack = packs.get("native" if name.startswith("native") else name, [None] * len(weights))

            def one_pass(fn=fn, pack=pack):
                for (k, _), w, p in zip(shapes, weights, pack):
                    fn(xs[k], w, p)

            seconds = median_seconds(one_pass, 5)
            row[name] = dict(ms=seconds * 1e3, gbs=weight_bytes / seconds / 1e9)
        rows.append(row)
        best = min((v["ms"], k) for k, v in row.items() if k != "rows")
        print(f"[bench] {str(dtype)[6:]}, {m} rows: " + ", ".join(f"{k} {v['ms']:.1f} ms" for k, v in row.items() if k != "rows")
              + f" (best: {best[1]})", flush=True)
    return rows


def row_ops(lib) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 32, 512):
            x = torch.randn(n, 576, generator=gen).to(dtype)
            res = torch.randn(n, 576, generator=gen).to(dtype)
            w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
            qk = torch.randn(n, 960, generator=gen).to(dtype)[:, :768].view(n, 12, 64)
            cos = torch.randn(n, 1, 64, generator=gen).to(dtype)
            sin = torch.randn(n, 1, 64, generator=gen).to(dtype)
            gu = torch.randn(n, 3072, generator=gen).to(dtype)
            ops = {
                "add_rms_norm": (lambda: reference.add_rms_norm(x, res, w, 1e-5),
                                 lambda: native.rms_norm(lib, x, w, 1e-5, residual=res)),
                "rotary": (lambda: reference.rotary(qk, cos, sin), lambda: native.rotary(lib, qk, cos, sin)),
                "silu_mul": (lambda: reference.silu_mul(gu), lambda: native.silu_mul(lib, gu)),
            }
            for name, (ref, nat) in ops.items():
                t_ref, t_nat = median_seconds(ref, 50), median_seconds(nat, 50)
                out.append(dict(op=name, dtype=str(dtype).removeprefix("torch."), rows=n, torch_us=t_ref * 1e6,
                                native_us=t_nat * 1e6, speedup=t_ref / t_nat))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.load(Path(tempfile.gettempdir()) / "pdserve-bench-native")
    host = cpu()
    bw = read_bandwidth()
    print(f"host: {host.describe()}; native build: {native.isa_level()}; read bandwidth {bw / 1e9:.1f} GB/s, "
          f"{args.threads} threads")
    tables = {}
    for dtype in (torch.bfloat16, torch.float32):
        lin = tables[str(dtype).removeprefix("torch.")] = linears(lib, dtype)
        names = [k for k in lin[0] if k != "rows"]
        base = "oneDNN" if "oneDNN" in names else "F.linear"
        print(f"\n{str(dtype).removeprefix('torch.')} linears, one pass over SmolLM2's {LAYERS} layers + LM head "
              "(ms; weight GB/s, vs read bandwidth)")
        print("| rows | " + " | ".join(names) + f" | best native vs {base} |")
        print("|---|" + "---|" * (len(names) + 1))
        for r in lin:
            cells = [f"{r[k]['ms']:.1f} ({r[k]['gbs']:.1f}, {r[k]['gbs'] * 1e9 / bw:.2f}x)" for k in names]
            nat = [r[k]["ms"] for k in names if k.startswith("native")]
            ratio = f"{r[base]['ms'] / min(nat):.2f}x" if nat else "-"
            print(f"| {r['rows']} | " + " | ".join(cells) + f" | {ratio} |")
    rows = row_ops(lib)
    print("\nrow-wise ops (us per call)")
    print("| op | dtype | rows | torch | native | native vs torch |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['dtype']} | {r['rows']} | {r['torch_us']:.1f} | {r['native_us']:.1f} | "
              f"{r['speedup']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"host": host.describe(), "isa_level": native.isa_level(),
                                         "read_bandwidth_gbs": bw / 1e9, "threads": args.threads,
                                         "linears": tables, "row_ops": rows}, indent=1))


if __name__ == "__main__":
    main()
