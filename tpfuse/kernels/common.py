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
def round_to_bf16_f32(x, PACKED: tl.constexpr):
    """``to_f32(round_to(x, tl.bfloat16))`` for fp32 x: rounded to bf16 and widened again,
    where the rounded value is only used widened (an fp8 output quantizes y's rounded value).
    Written as that, it compiles to a conversion per value (F2F.BF16.F32, a quarter-rate
    instruction) and a shift back; with PACKED (a GPU of sm_80 or newer) a packed conversion
    (cvt.rn.bf16x2.f32, the same rounding) takes two values at a time and two integer
    operations widen them. On one H200 that cut the fp8 output's cost in the norm kernel at
    1 x 4096 from 0.26 to 0.13 us a call (benchmarks/NOTES.md, 2026-11-28 seventh session)."""
    tl.static_assert(x.dtype == tl.float32, "round_to_bf16_f32 takes fp32 values (two registers per pair)")
    if _INTERPRETER or not PACKED:
        return to_f32(round_to(x, tl.bfloat16))
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
        "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)


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
