"""How the process's C allocator treats the large, short-lived tensors of a CPU step.

glibc serves an allocation above its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with a fresh mapping and returns the heap's top to the OS once it passes the trim
threshold, so a tensor of megabytes made and freed every step (the sampler's [batch,
vocab] float32 probabilities: 6 MiB at batch 32) page-faults in all its pages again every
step. On a VM host a fault is dear: the temperature-1 sampler at batch 32 took 12 ms
where its arithmetic takes 2.5 ms. `keep_freed_memory` serves everything below 32 MiB from
the heap and keeps up to TRIM_THRESHOLD of freed memory there for the next step, what
vLLM gets on CPU by preloading tcmalloc. Weights and the KV cache (one allocation each,
above the threshold) still get their own mappings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = 256 * 2**20  # freed memory a process may keep for reuse
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from <malloc.h>

_done = False


def keep_freed_memory() -> bool:
    """Set the thresholds once per process (idempotent); False where the C library is not
    glibc (nothing changed)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt differ
    except (OSError, AttributeError, TypeError):
        log.info("allocator left as it is: the C library (%s) is not glibc", name)
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("allocator: blocks under %d MiB from the heap, up to %d MiB of freed memory kept for reuse",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        log.warning("allocator: glibc refused the mmap/trim thresholds; large step tensors fault in each step")
    _done = ok
    return ok
