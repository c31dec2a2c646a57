"""Device functions shared by every tpfuse kernel."""

import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER

_INTERPRETER = tl.constexpr(INTERPRETER)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round fp32 x to DTYPE to nearest, ties to even: the one rounding of every output.

    On GPUs this is the native conversion. Triton's interpreter truncates fp32 -> bf16
    casts (and rounds ties away from even where it does round), which would break the
    bitwise contracts on CPU, so there the rounding is done on the bits.
    """
    if _INTERPRETER and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs`` (``prefetch.global.L2``): a hint, no result.
    Addresses must be valid. The interpreter has no cache, so there it does nothing."""
    if not _INTERPRETER:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\nprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


TRITON_DIVISIBILITY = 16
"""Triton specialises integer arguments on divisibility by this: a row length that is a
multiple of it lets the compiler prove every row 16-byte aligned (vector loads and stores, and
the register layouts the bitwise contracts were checked with); others compile differently."""


# Launch options of every tpfuse kernel. LLVM contracts a*b + c into an FMA depending on the
# code around it (seen on H200: the same row reduction compiled inside the rms_norm and the
# add_rms_norm kernels fused different multiply-adds and gave different bits). With
# contraction off, each + and * rounds once, as written, in every kernel, so a device
# function gives the same bits wherever it is inlined; write tl.fma where an FMA is meant.
EXACT_FP = {"enable_fp_fusion": False}


@triton.jit
def to_f32(x):
    """x widened to fp32 exactly. Triton's interpreter converts bf16 subnormals to wrong
    values; there the bf16 bits are moved into the top half of the fp32 bits instead."""
    if _INTERPRETER and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)
