"""The one rounding of an fp32 result to the output dtype, bitwise equal to torch's ``.to()``.

On GPUs Triton's cast is round-to-nearest-even, as torch's is. Triton 3.6's interpreter
truncates fp32 -> bf16 (its ``_convert_float`` ignores the rounding mode of a plain cast and
never carries into the exponent), so under the interpreter bf16 is rounded here with integer
arithmetic; fp16 and fp32 casts there go through numpy, which rounds to nearest even.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER

_INTEGER_BF16_ROUNDING = tl.constexpr(INTERPRETER)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to DTYPE to nearest, ties to even (NaN -> the canonical bf16 NaN)."""
    if _INTEGER_BF16_ROUNDING and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
