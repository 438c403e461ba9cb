"""The room's shared Triton helpers: block sizes, the compute dtype and the rounding store every kernel
module uses (the mHC and xHC tiles build on them in :mod:`.mhc_common` and :mod:`.xhc_common`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhc.streams import compute_dtype  # noqa: F401  (float64 with a float64 input, else fp32; re-exported)


def np2(x: int) -> int:
    """The next power of two ≥ max(x, 2): a padded tile dimension."""
    return max(2, triton.next_power_of_2(int(x)))


def tl_dtype(dtype: torch.dtype):
    """The Triton compute type of a torch compute dtype (float64 or fp32)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def row_block_c(C: int, rows: int, inner: int) -> int:
    """The C block of a kernel that holds ``rows × inner`` values per column in registers."""
    return max(16, min(triton.next_power_of_2(C), 8192 // (rows * inner)))


@triton.jit
def cast(x, PTR):
    """x (fp32/fp64) in PTR's element type; bf16 rounds to nearest even explicitly (the Triton
    interpreter's float->bf16 conversion truncates; on GPUs this equals the native conversion)."""
    if PTR.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(PTR.dtype.element_ty)

