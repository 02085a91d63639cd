"""The host's CPU as detected at run time, and what `dtype="auto"` makes of it (kernels/host.py).

The expectations are read from the host itself (/proc/cpuinfo, torch), so the same test
holds on an AVX-512 + AMX host and on an AVX2-only one: each checks the path it takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import parse_dtype, resolve_dtype
from kernels import linear
from kernels.host import auto_dtype, cpu


def _flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    pytest.fail("no flags line in /proc/cpuinfo")


def test_capabilities_are_this_hosts():
    caps, flags = cpu(), _flags()
    assert caps.amx_bf16 == ("amx_bf16" in flags) and caps.avx512_bf16 == ("avx512_bf16" in flags)
    assert caps.torch_isa == torch.backends.cpu.get_cpu_capability()
    assert caps.isa in caps.describe() and caps.model_name in caps.describe()
    if "avx512f" not in flags:  # oneDNN's bf16 needs AVX-512: an AVX2 host has none
        assert not caps.onednn_bf16 and not caps.native_bf16


def test_the_capability_rule_is_bf16_exactly_where_the_cpu_computes_it_natively(monkeypatch):
    flags = _flags()
    native = "amx_bf16" in flags or "avx512_bf16" in flags
    dtype, why = auto_dtype()
    assert dtype == (torch.bfloat16 if native else torch.float32), why
    assert ("natively" in why) == native and cpu().isa in why
    # With the calibration off `auto` is the rule everywhere (tests/kernels/test_dtype_choice.py: on).
    monkeypatch.setenv("PDSERVE_DTYPE_CALIBRATION", "off")
    assert resolve_dtype("auto")[0] == dtype and parse_dtype("auto") == dtype


def test_an_explicit_dtype_is_honoured_on_any_host():
    assert resolve_dtype("bfloat16") == (torch.bfloat16, "it was asked for")
    assert parse_dtype("float32") == torch.float32 and parse_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="use 'auto' or one of"):
        parse_dtype("fp8")


def test_the_linear_path_follows_the_cpu():
    supported, why = linear.packing_supported()
    assert supported == cpu().onednn_bf16, why
    assert cpu().isa in why or "oneDNN" in why


def test_the_kv_pool_is_zeroed_aligned_and_on_huge_pages_where_the_host_allows():
    from kernels import memory

    pool = memory.zeros((7, 3, 2, 16, 3, 64), torch.bfloat16)
    assert pool.shape == (7, 3, 2, 16, 3, 64) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool.any()
    if memory._thp_mode() in ("always", "madvise"):
        assert pool.data_ptr() % memory.HUGE_PAGE == 0


def test_a_kv_pool_larger_than_the_available_memory_is_refused_at_start(monkeypatch):
    """Its pages fault in at first use, so the check is made when it is made (MemAvailable)."""
    from kernels import memory

    monkeypatch.setattr(memory, "_available_bytes", lambda: 3 << 20)
    with pytest.raises(MemoryError, match=r"KV pool of 4 MiB does not fit the 3 MiB .*--kv-memory-gib"):
        memory.zeros((4 << 20,), torch.uint8)
    assert memory.zeros((2 << 20,), torch.uint8).numel() == 2 << 20


def test_shared_memory_is_reserved_when_made_and_too_little_room_is_a_clear_error(tmp_path, monkeypatch):
    from kernels import memory

    a = memory.shared_zeros(tmp_path / "pool", (4, 8), torch.float32)
    b = memory.shared_zeros(tmp_path / "pool", (4, 8), torch.float32)  # a second mapping of the same bytes
    a[1, 2] = 5.0
    assert b[1, 2] == 5.0 and (tmp_path / "pool").stat().st_blocks * 512 >= 4 * 8 * 4  # reserved, not sparse

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(memory.os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match=r"cannot reserve 0.00 GiB of shared memory in .* \(No space left on "
                                           r"device; .* GiB free there\).*--shm-size"):
        memory.shared_zeros(tmp_path / "other", (4, 8), torch.float32)
    assert not (tmp_path / "other").exists()
