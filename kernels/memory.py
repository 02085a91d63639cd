"""Host memory for the big, long-lived tensors (the KV pool): backed by transparent huge
pages where Linux allows it.

A decode step reads every sequence's KV blocks, which lie far apart in the pool (each
block holds all layers' K and V), so with 4 KiB pages nearly every block read misses the
TLB; 2 MiB pages cut those misses ~500x (bench/RESULTS.md: decode attention at batch 32
~20% faster). `zeros` asks for huge pages with madvise(MADV_HUGEPAGE) before the memory is
first touched, where /sys/kernel/mm/transparent_hugepage/enabled is `always` or
`madvise`; elsewhere (`never`, not Linux, not CPU) it is plain `torch.zeros`. The choice
is logged once per process. The memory is a fresh private mapping, zero by the kernel's
word, whose pages are faulted in where first used (huge where granted), not at
allocation: touching a 1 GiB pool took 2.5 s of a worker's 4.6 s start on a KVM guest, for
blocks most workers never fill; a block's first write pays its page's fault once. So that a
pool the host cannot hold still fails at start, not at the first busy hour, a pool larger
than the memory the kernel says is available (MemAvailable) is refused, naming both.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
from pathlib import Path

import torch

from kernels.host import log_choice

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_SHMEM_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


@functools.cache
def _thp_mode(setting: Path = _THP_MODE) -> str:
    """`always`, `madvise` or `never` (the bracketed word of the kernel's setting), or why none."""
    try:
        text = setting.read_text()
    except OSError:
        return "unavailable"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype), on huge pages where the host allows (see the module docstring)."""
    mode = _thp_mode()
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    available = _available_bytes() if torch.device(device).type == "cpu" else None
    if available is not None and nbytes > available:
        raise MemoryError(f"a KV pool of {nbytes / 2**20:.0f} MiB does not fit the {available / 2**20:.0f} MiB of "
                          "memory available on this host (MemAvailable): give it fewer blocks (--kv-memory-gib, "
                          "--kv-blocks)")
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux") or mode not in ("always", "madvise"):
        log_choice("KV pool pages", "4 KiB", f"transparent huge pages are {mode} here")
        return torch.zeros(shape, dtype=dtype, device=device)
    size = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    # private and anonymous: zero pages, none mapped until touched (the tensor keeps the mapping alive)
    area = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary inside it
    if _madvise()(raw.data_ptr() + start, size, _MADV_HUGEPAGE) != 0:
        log_choice("KV pool pages", "4 KiB", f"madvise(MADV_HUGEPAGE) failed (errno {ctypes.get_errno()})")
    else:
        log_choice("KV pool pages", "2 MiB transparent huge pages, faulted in at first use",
                   f"transparent huge pages are {mode} here")
    return raw[start:start + nbytes].view(dtype).view(shape)


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def shared_zeros(path: str | Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor mapped from the file `path` (created; on tmpfs such as /dev/shm
    it is memory, not disk): every process that maps the same path sees the same bytes.
    A tensor-parallel group's ranks keep their KV pools this way, so rank 0 can hand all of
    them to its transfer agent (engine/parallel/rank_group.py). Removing the file once
    every process mapped it frees the memory with the last mapping. Huge pages are asked
    for (madvise) where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them
    (`advise`, `within_size`, `always`); elsewhere the pool is on 4 KiB pages."""
    numel = int(torch.Size(shape).numel())
    if not Path(path).exists():  # the maker reserves every page now: a tmpfs too small fails here, clearly,
        _reserve(Path(path), numel * dtype.itemsize)  # rather than with SIGBUS at the first step that fills it
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    mode = _thp_mode(_SHMEM_THP_MODE)
    if mode not in ("advise", "within_size", "always"):
        log_choice("shared KV pool pages", "4 KiB", f"shared-memory huge pages are {mode} here")
    elif _madvise()(tensor.data_ptr(), tensor.numel() * tensor.element_size(), _MADV_HUGEPAGE) != 0:
        log_choice("shared KV pool pages", "4 KiB", f"madvise(MADV_HUGEPAGE) failed (errno {ctypes.get_errno()})")
    else:
        log_choice("shared KV pool pages", "2 MiB transparent huge pages", f"shared-memory huge pages are {mode}")
    return tensor.view(shape)


def _reserve(path: Path, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.unlink(path)
        free = os.statvfs(path.parent)
        raise RuntimeError(f"cannot reserve {nbytes / 2**30:.2f} GiB of shared memory in {path.parent} "
                           f"({e.strerror}; {free.f_bavail * free.f_frsize / 2**30:.2f} GiB free there): a "
                           "tensor-parallel worker keeps its other ranks' KV pools there; give it more room "
                           "(a container's --shm-size) or a smaller KV pool") from None
    finally:
        os.close(fd)
