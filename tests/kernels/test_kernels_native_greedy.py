"""The native greedy pick (kernels/csrc/greedy.cpp) against torch.argmax on fresh random
logits at every ISA level this host can run: the first index of each row's maximum (ties
planted on purpose), a row's first NaN where it has one, infinities, rows whose length is
not a multiple of the vector width, strided rows; and the op set falling back to torch for
what the kernel does not take."""

from __future__ import annotations

import pytest
import torch

from kernels import native, native_ops

LEVELS = native.runnable_levels()


def served(level: str) -> bool:
    return level != "generic"  # vector code only


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows,width", [(1, 49152), (32, 49152), (5, 1000), (3, 7), (64, 130)])
def test_argmax_matches_torch_with_planted_ties(libraries, level, rows, width):
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen)
    top = x.max(dim=-1).values
    for r in range(rows):  # copies of the maximum later in the row: the first must win
        later = torch.randint(0, width, (3,), generator=gen)
        x[r, later] = top[r]
    got = native.argmax(libraries[level], x)
    if not served(level):
        assert got is None
        return
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("level", LEVELS)
def test_argmax_takes_nan_and_infinities_as_torch_does(libraries, level):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4096, generator=gen)
    x[0, 100] = float("nan")
    x[0, 2000] = float("inf")  # NaN beats +inf in torch's rule
    x[1, 50] = float("inf")
    x[1, 3000] = float("inf")  # the first +inf
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 4095] = float("nan")
    x[4, 17] = float("-inf")
    got = native.argmax(libraries[level], x)
    if not served(level):
        assert got is None  # the op set uses torch there
        return
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("level", LEVELS)
def test_argmax_reads_strided_rows(libraries, level):
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(8, 3000, generator=gen)
    x = big[::2, 100:2900]  # row stride 6000, not the width
    got = native.argmax(libraries[level], x)
    assert (got is None) if not served(level) else torch.equal(got, x.argmax(dim=-1))


def test_op_set_falls_back_to_torch_for_what_the_kernel_does_not_take():
    gen = torch.Generator().manual_seed(5)
    for x in (torch.randn(4, 100, generator=gen, dtype=torch.float64),
              torch.randn(4, 100, generator=gen).to(torch.bfloat16),
              torch.randn(100, 4, generator=gen).t()):  # columns not contiguous
        assert torch.equal(native_ops.argmax(x), x.argmax(dim=-1))
