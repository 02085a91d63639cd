"""Native CPU kernels (kernels/csrc/), built with the host's C++ compiler and loaded through
ctypes: paged decode and prefill attention that read K/V in place through the block tables
(paged_decode.cpp, paged_prefill.cpp), the row-wise ops between the matmuls (norm_act.cpp: RMS norm with the
residual add, rotary embedding, SiLU-and-multiply), one pass each, and the small-batch
matmuls of decode steps (bf16: amx_bf16.cpp on AMX tiles, gemv_bf16.cpp with AVX512-BF16
dot instructions, over one packed layout; float32, and bf16 widened on CPUs with no bf16
hardware: gemm_f32.cpp's FMA tiles), and greedy rows' token choice (greedy.cpp: argmax).

Built once per ISA level the host runs (AVX-512: `-march=x86-64-v4`, AVX2:
`x86-64-v3`, else generic x86-64), into `<cache>/native/`, keyed by the source's hash and
the flags, at the first use in a process (a worker's start-up, never a request's path: a
second or two, logged). No torch headers: the library takes raw pointers and element
strides. With no compiler, `load` raises `NativeUnavailable` naming what is missing, and
the caller falls back to the torch ops.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from common import envs
from kernels.host import cpu

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = [_CSRC / name for name in ("paged_decode.cpp", "paged_prefill.cpp", "norm_act.cpp", "gemv_bf16.cpp", "amx_bf16.cpp",
                                     "gemm_f32.cpp", "greedy.cpp")]
HEADERS = [_CSRC / "simd.h"]  # part of the build key
_FLAGS = {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"], "generic": ["-march=x86-64"]}
_COMMON = ["-O3", "-std=c++17", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_F32 = ctypes.c_float
SIGNATURES = {  # the library's functions: argument types (all return int: 0, or -1 = not served)
    "pdserve_paged_decode": [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR,
                             _PTR, _I64, _I64, _INT, _INT, _INT, _INT, _INT, _F32, _INT, _INT],
    "pdserve_paged_prefill": [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR,
                              _PTR, _I64, _PTR, _I64, _I64, _INT, _INT, _INT, _INT, _INT, _F32, _INT],
    "pdserve_rms_norm": [_INT, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT, _F32, _INT],
    "pdserve_rotary": [_INT, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _INT, _INT],
    "pdserve_silu_mul": [_INT, _PTR, _I64, _PTR, _I64, _I64, _INT, _INT],
    "pdserve_gemv_bf16": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT, _INT, _INT],
    "pdserve_amx_bf16": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT, _INT, _INT],
    "pdserve_gemm_f32": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT, _INT, _INT],
    "pdserve_gemm_bf16_fma": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT, _INT, _INT],
    "pdserve_argmax": [_PTR, _I64, _PTR, _I64, _I64, _INT],
}
# The small-batch matmuls: kernel -> (function, dtype). "amx": AMX tiles (amx_bf16.cpp),
# "dots": AVX512-BF16 dot instructions (gemv_bf16.cpp), "f32": FMA tiles (gemm_f32.cpp),
# "fma_bf16": the same FMA tiles over bf16 weights widened in registers (no bf16 hardware).
MATMULS = {"amx": ("pdserve_amx_bf16", torch.bfloat16), "dots": ("pdserve_gemv_bf16", torch.bfloat16),
           "f32": ("pdserve_gemm_f32", torch.float32), "fma_bf16": ("pdserve_gemm_bf16_fma", torch.bfloat16)}
MATMUL_BLOCK = 16  # output rows per packed block


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded on this host (the message says why)."""


def isa_level() -> str:
    """The widest vector ISA this host runs: avx512, avx2 or generic."""
    caps = cpu()
    if caps.avx512:
        return "avx512"
    return "avx2" if caps.torch_isa.startswith("AVX2") or caps.torch_isa.startswith("AVX512") else "generic"


def runnable_levels() -> list[str]:
    """Every ISA level this host can run a build of, narrowest first (tests check each)."""
    caps = cpu()
    avx2 = caps.torch_isa.startswith(("AVX2", "AVX512"))
    return ["generic"] + (["avx2"] if avx2 else []) + (["avx512"] if caps.avx512 else [])


def build(cache_dir: Path, level: str | None = None) -> Path:
    """The shared library for `level` (default: this host's), compiled unless cached."""
    level = level or isa_level()
    compiler = envs.cxx() or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeUnavailable("no C++ compiler found (install g++, or set CXX): native CPU kernels are off")
    flags = [*_COMMON, *_FLAGS[level]]
    sources = b"".join(f.read_bytes() for f in [*SOURCES, *HEADERS])
    key = hashlib.sha256(sources + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = cache_dir / "native" / f"pdserve-{level}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes starting together (a deployment's workers, parallel tests) build once: the
    # others wait on the lock, then find the library.
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            _compile(compiler, flags, level, target)
    return target


def _compile(compiler: str, flags: list[str], level: str, target: Path) -> None:
    log.info("building native CPU kernels for %s (%s)", level, " ".join(_FLAGS[level]))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # One compiler per source, all at once (paged_decode.cpp's instantiations take most
        # of the time: ~15 s of ~26 s serial at x86-64-v4), then one link.
        compile_flags = [f for f in flags if f != "-shared"]
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        jobs = [subprocess.Popen([compiler, *compile_flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for src, obj in zip(SOURCES, objects)]
        failed = [(src, job.communicate()[1]) for src, job in zip(SOURCES, jobs)]
        failed = [(src, err) for (src, err), job in zip(failed, jobs) if job.returncode != 0]
        out = Path(tmp) / target.name
        if not failed:
            done = subprocess.run([compiler, *flags, *map(str, objects), "-o", str(out)], capture_output=True, text=True)
            if done.returncode != 0:
                failed = [(Path("(link)"), done.stderr)]
        if failed:
            names = ", ".join(src.name for src, _ in failed)
            raise NativeUnavailable(f"{compiler} failed on {names}:\n{failed[0][1][-2000:]}")
        out.replace(target)  # atomic: a process that finds it finds all of it


@functools.cache
def load(cache_dir: Path) -> ctypes.CDLL:
    """The library for this host, built if need be (once per process)."""
    return open_library(build(cache_dir))


def open_library(path: Path) -> ctypes.CDLL:
    """A built library, its function typed."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def _qkv_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """The attention kernels' leading arguments: dtype code, q's pointer and token / head
    strides, each cache's pointer and block / position / head strides."""
    return (DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
            k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], head_dim contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
    out: torch.Tensor | None = None,
    dots: bool = True,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """kernels.reference.paged_decode_attention, reading each block where it lies.

    `dots=False` keeps bfloat16 scores on rows widened to float32 even where the CPU has
    AVX512-BF16 dot instructions (the tests check both paths)."""
    num_seqs, num_heads, head_dim = q.shape
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"native decode attention takes float32 or bfloat16, one dtype (got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype})")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("native decode attention needs head_dim contiguous in q and the caches")
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    rc = lib.pdserve_paged_decode(
        *_qkv_args(q, k_cache, v_cache),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, torch.get_num_threads(), int(dots))
    if rc != 0:
        raise ValueError(f"native decode attention refused the shapes: {num_heads} heads over {k_cache.shape[2]} "
                         f"KV heads, head_dim {head_dim}")
    return out


def paged_prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the chunks' queries, one after another
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], head_dim contiguous, chunks written
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int64
    context_lens: torch.Tensor,  # [num_seqs] int64: each chunk is the last positions of its context
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim]
    """kernels.reference.paged_prefill_attention, reading each block where it lies; None
    where the kernel does not serve the shapes or the build has no vector ISA (the caller
    then runs the reference)."""
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or q.stride(2) != 1 \
            or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        return None
    num_heads, head_dim = q.shape[1], q.shape[2]
    cu = cu_seqlens_q.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    rc = lib.pdserve_paged_prefill(
        *_qkv_args(q, k_cache, v_cache),
        cu.data_ptr(), lens.data_ptr(), tables.data_ptr(), tables.stride(0), out.data_ptr(), out.stride(0),
        out.stride(1), lens.shape[0], num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
        torch.get_num_threads())
    return out if rc == 0 else None


def _rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A 2-D (or more) tensor of `dtype` whose last dimension is contiguous: what the row kernels take."""
    return t.dtype == dtype and t.dim() >= 2 and t.stride(-1) == 1 and t.device.type == "cpu"


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(norm(x + residual), x + residual), or (norm(x), None) without a residual: the
    reference's rms_norm / add_rms_norm. None where the kernel does not serve these
    tensors (the caller then runs the torch op)."""
    if x.dtype not in DTYPES or x.dim() != 2 or not _rows(x, x.dtype) or not weight.is_contiguous() \
            or weight.dtype != x.dtype or (residual is not None and not (_rows(residual, x.dtype)
                                                                          and residual.shape == x.shape)):
        return None
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    res_out = torch.empty(rows, hidden, dtype=x.dtype) if residual is not None else None
    rc = lib.pdserve_rms_norm(
        DTYPES[x.dtype], x.data_ptr(), x.stride(0),
        residual.data_ptr() if residual is not None else None, residual.stride(0) if residual is not None else 0,
        res_out.data_ptr() if res_out is not None else None, hidden,
        weight.data_ptr(), out.data_ptr(), hidden, rows, hidden, eps, torch.get_num_threads())
    return None if rc != 0 else (out, res_out)


def rotary(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [tokens, heads, head_dim], head_dim contiguous (a view of the qkv matmul's output)
    cos: torch.Tensor,  # [tokens, 1, head_dim]
    sin: torch.Tensor,
) -> torch.Tensor | None:  # [tokens, heads, head_dim], contiguous
    """The reference's rotary, or None where the kernel does not serve these tensors."""
    if x.dtype not in DTYPES or x.dim() != 3 or x.stride(2) != 1 or cos.dtype != x.dtype or sin.dtype != x.dtype \
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape != sin.shape \
            or cos.shape != (x.shape[0], 1, x.shape[2]):
        return None
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
    rc = lib.pdserve_rotary(DTYPES[x.dtype], x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                            head_dim, out.data_ptr(), heads * head_dim, head_dim, tokens, heads, head_dim,
                            torch.get_num_threads())
    return None if rc != 0 else out


def silu_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:  # [rows, 2 * width] -> [rows, width]
    """silu(gate) * up of the two halves of x's rows, or None where the kernel does not serve x."""
    if x.dtype not in DTYPES or x.dim() != 2 or not _rows(x, x.dtype) or x.shape[1] % 2:
        return None
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype)
    rc = lib.pdserve_silu_mul(DTYPES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), width, rows, width,
                              torch.get_num_threads())
    return None if rc != 0 else out


def argmax(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:  # [rows, n] float32 -> [rows] int64
    """x.argmax(dim=-1) (the first index of each row's maximum; of its first NaN if it has
    one), or None where the kernel does not take x."""
    if x.dtype != torch.float32 or x.dim() != 2 or not _rows(x, x.dtype) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.pdserve_argmax(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return None if rc != 0 else out


def pack_matmul_weight(weight: torch.Tensor, kernel: str) -> torch.Tensor | None:
    """A [n, k] weight in the layout of a small-batch matmul kernel (MATMULS), or None where
    the kernel cannot take it. bf16 ("amx", "dots", "fma_bf16"): [n/16, k/2, 16, 2], each 64-byte row
    the (k, k+1) pair of 16 output rows; float32 ("f32"): [n/16, k, 16]."""
    n, k = weight.shape
    if weight.dtype != MATMULS[kernel][1] or n % MATMUL_BLOCK:
        return None
    if kernel == "f32":
        return weight.view(n // MATMUL_BLOCK, MATMUL_BLOCK, k).transpose(1, 2).contiguous()
    if k % 2:
        return None
    return weight.view(n // MATMUL_BLOCK, MATMUL_BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def matmul(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [m, k], rows contiguous
    packed: torch.Tensor,  # pack_matmul_weight(weight [n, k], kernel)
    bias: torch.Tensor | None,  # [n]
    kernel: str,
) -> torch.Tensor | None:  # [m, n]
    """x @ weight.T + bias by a small-batch kernel; None where it does not serve (the CPU
    lacks its ISA, a shape it cannot take: the caller runs its other matmul)."""
    name, dtype = MATMULS[kernel]
    if x.dtype != dtype or x.dim() != 2 or x.stride(1) != 1 or (bias is not None and (
            bias.dtype != dtype or not bias.is_contiguous())):
        return None
    m, k = x.shape
    n = packed.shape[0] * MATMUL_BLOCK
    k_packed = packed.shape[1] if kernel == "f32" else packed.shape[1] * 2
    if k_packed != k:
        raise ValueError(f"native matmul: x has {k} columns, the weight {k_packed}")
    out = torch.empty(m, n, dtype=dtype)
    rc = getattr(lib, name)(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                            out.data_ptr(), n, m, n, k, torch.get_num_threads())
    return None if rc != 0 else out
