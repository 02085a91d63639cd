"""Helpers shared by the Triton kernels.

Importing this module imports triton, so on CPU `TRITON_INTERPRET=1` must be set first
(`kernels.get_ops` does it). In the interpreter bf16 arithmetic is wrong (a bf16 `tl.dot`
multiplies the raw bits, adds give NaN) and so is its fp32 -> bf16 conversion (it
truncates), so the kernels load bf16, compute in fp32 and round back to bf16 with integer
ops there; on a GPU the same code uses the hardware conversion and native bf16 dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRET: bool = bool(triton.knobs.runtime.interpret)  # fixed when the kernels are defined
_INTERPRET = tl.constexpr(INTERPRET)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """`x.to(dtype)` with round-to-nearest-even to bf16, also in the interpreter."""
    if _INTERPRET and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # NaN and inf keep their top bits
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def dot_operand(x):
    """A tile as `tl.dot` may take it: bf16 goes to fp32 in the interpreter only."""
    if _INTERPRET and x.dtype == tl.bfloat16:
        y = x.to(tl.float32)
    else:
        y = x
    return y
