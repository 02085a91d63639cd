"""`python -m bench.kernels --compile-only`: compile every Triton kernel variant the engine
uses for an NVIDIA target on a machine without a GPU, and report ptxas's register and
spill figures (the compiler's rules the interpreter does not enforce)."""

from __future__ import annotations

import os


def compile_only(arch: int) -> int:
    """Compile every kernel variant the engine uses (bf16, fp16, fp32; Llama-8B heads, GQA 3
    with head_dim 80; a Qwen3-MoE's experts; DeepSeek-V3's MLA decode) for sm_<arch> on a
    machine without a GPU: a stand-in driver answers the target, and launches become compiles. The interpreter does not enforce the
    compiler's rules (types across branches, dot shapes); this does, and ptxas reports
    spills. It patches Triton internals (3.5-3.9), so it is a tool, not a test."""
    import subprocess
    import tempfile

    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class TargetOnly:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(TargetOnly())
    compiled = {}
    launch = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled[kernel.hash] = (self.fn.__name__, kernel)
        return kernel

    JITFunction.run = compile_instead
    from kernels import triton_ops as tri

    i64 = dict(dtype=torch.int64)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for heads, kv_heads, head_dim in ((32, 8, 128), (6, 2, 80)):
            pool = torch.zeros(8, 2, 2, 16, kv_heads, head_dim, dtype=dt)
            k, v = pool[:, 1, 0], pool[:, 1, 1]
            qk = torch.zeros(4, heads + kv_heads, head_dim, dtype=dt)
            q = qk[:, :heads]
            tables, lens = torch.zeros(4, 32, **i64), torch.full((4,), 500, **i64)  # 512 wide: 4 splits
            for splits in (1, 4):
                tri.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=splits)
            tri.paged_prefill_attention(q, k, v, torch.tensor([0, 2, 4]), lens[:2], tables[:2], 2, 0.1)
            tri.write_kv(k, v, torch.zeros(4, **i64), torch.arange(4), qk[:, heads:], qk[:, :kv_heads])
            tri.rotary(qk, qk[:, :1], qk[:, :1])
        tri.pack_blocks(pool, torch.arange(2))
        tri.unpack_blocks(pool, torch.arange(2), torch.zeros(2, *pool.shape[1:], dtype=dt))
        x = torch.zeros(4, 4096, dtype=dt)
        tri.rms_norm(x, x[0], 1e-5)
        tri.add_rms_norm(x, x, x[0], 1e-5)
    from kernels import fused_moe

    for dt in (torch.bfloat16, torch.float16, torch.float32):  # Qwen3-30B-A3B's experts: 2048 -> 2 x 768
        ids = torch.tensor([[0, 1], [1, 2], [0, 2], [3, 1]])
        fused_moe.fused_experts(torch.zeros(4, 2048, dtype=dt), torch.zeros(4, 2 * 768, 2048, dtype=dt),
                                torch.zeros(4, 2048, 768, dtype=dt), torch.ones(4, 2, dtype=dt), ids)
    from kernels import mla_decode

    for dt in (torch.bfloat16, torch.float16, torch.float32):  # DeepSeek-V3's MLA: 128 heads, 512 + 64 entries
        pool = torch.zeros(8, 2, 2, 16, 1, 288, dtype=dt)
        mla_decode.mla_decode(torch.zeros(4, 128, 576, dtype=dt), pool[:, 1, 0], pool[:, 1, 1],
                              torch.zeros(4, 32, **i64), torch.full((4,), 500, **i64), 0.1, 512)
    zeros = torch.zeros(4, **i64)
    tri.sample(torch.zeros(4, 128256), torch.ones(4), zeros, torch.ones(4), torch.zeros(4), zeros, zeros)
    ptxas = get_ptxas(arch).path
    spills = 0
    print(f"{len(compiled)} kernel variants compiled for sm_{arch}")
    for name, kernel in sorted(compiled.values(), key=lambda x: x[0]):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(kernel.asm["ptx"])
            f.flush()
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            r = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                               capture_output=True, text=True)
        stats = [line.split("info    :")[-1].strip() for line in (r.stdout + r.stderr).splitlines()
                 if "registers" in line or "spill" in line]
        spills += sum(int(w) for line in stats for w, nxt in zip(line.split(), line.split()[1:])
                      if nxt == "bytes" and "spill" in line and w.isdigit())
        print(f"  {name:24s} warps {kernel.metadata.num_warps}  smem {kernel.metadata.shared:6d} B  "
              f"{' | '.join(stats) or r.stderr.strip()[-200:]}")
    print("no register spills" if spills == 0 else f"register spills: {spills} bytes in all")
    return 0 if spills == 0 else 1
