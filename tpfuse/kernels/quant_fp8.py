"""fp8 (e4m3) quantization of activations for fp8 GEMMs: ``tpfuse.reference.quant_fp8``'s
contract, one row per program.

A row is held in registers (as the norm holds it), widened to fp32; its scale is the given
one ("tensor") or derived from the row's amax ("token") or each group's ("group"), always as
``max(amax, 1e-10) / 448`` in fp32 (a division, as the reference writes it), and every value
is ``clamp(y / s, -448, 448)`` rounded to e4m3 to nearest even. On GPUs of sm_89 and newer
the rounding is the hardware conversion (``cvt.rn.satfinite``), elsewhere the codecs'
``_e4m3_rne`` on the fp32 bits with the sign of a zero kept, as torch's cast keeps it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.codecs import _e4m3_rne, hardware_e4m3
from tpfuse.kernels.common import EXACT_FP

MODE_IDS = {"tensor": 0, "token": 1, "group": 2}
_FP8_MAX = tl.constexpr(448.0)
_AMAX_FLOOR = tl.constexpr(1e-10)


@triton.jit
def _e4m3_bits(v, HW_E4M3: tl.constexpr):
    """fp32 v (|v| <= 448) -> the e4m3fn byte (uint8) torch's cast gives."""
    if HW_E4M3:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sign = tl.where(v.to(tl.int32, bitcast=True) < 0, 0x80, 0)
    return ((_e4m3_rne(v) & 0x7F) | sign).to(tl.uint8)


@triton.jit
def quant_fp8_kernel(Y, Q, SCALE, S_OUT, N, s_stride_row, s_stride_group,
                     MODE: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, HW_E4M3: tl.constexpr):
    """Row ``program_id`` of Y [M, N] (N = groups of GROUP columns; GROUPS, their number
    rounded up to a power of two) into Q [M, N] (e4m3 bytes) and, for MODE 1 (token) and 2
    (group), its scales into S_OUT at row * s_stride_row + group * s_stride_group."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, GROUPS)[:, None]
    cols = groups * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < N
    y = tl.load(Y + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        s = tl.load(SCALE)
    elif MODE == 1:
        s = tl.maximum(tl.max(tl.max(tl.abs(y), axis=1), axis=0), _AMAX_FLOOR) / _FP8_MAX
        tl.store(S_OUT + row * s_stride_row, s)
    else:
        s = tl.maximum(tl.max(tl.abs(y), axis=1), _AMAX_FLOOR) / _FP8_MAX  # [GROUPS]
        tl.store(S_OUT + row * s_stride_row + tl.arange(0, GROUPS) * s_stride_group, s,
                 mask=tl.arange(0, GROUPS) * GROUP < N)
        s = s[:, None]
    v = tl.minimum(tl.maximum(y / s, -_FP8_MAX), _FP8_MAX)
    tl.store(Q + row * N + cols, _e4m3_bits(v, HW_E4M3), mask=mask)


def quant_fp8_into(y: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mode: str, group: int) -> None:
    """Quantize y [M, N] (contiguous) into q [M, N] (contiguous, float8_e4m3fn) and, in the
    "token" and "group" modes, its scales into ``scales`` ([M, 1], or [M, N / group] of any
    strides); in the "tensor" mode ``scales`` is the given one-element fp32 scale."""
    m, n = y.shape
    if m == 0:
        return
    # "tensor" and "token" treat the row as one group: its width, a power of two, splits it
    # into tiles of at most 1024 columns.
    width = group if mode == "group" else min(1024, triton.next_power_of_2(n))
    groups = triton.next_power_of_2(triton.cdiv(n, width))
    stride_row, stride_group = (scales.stride(0), scales.stride(1)) if mode != "tensor" else (0, 0)
    quant_fp8_kernel[(m,)](
        Y=y, Q=q.view(torch.uint8), SCALE=scales, S_OUT=scales, N=n, s_stride_row=stride_row,
        s_stride_group=stride_group, MODE=MODE_IDS[mode], GROUP=width, GROUPS=groups, HW_E4M3=hardware_e4m3(y.device),
        num_warps=_num_warps(groups * width), **EXACT_FP)


def _num_warps(elems: int) -> int:
    """Warps for a row of ``elems`` (padded) values: about 16 values a thread, 1 to 16 warps."""
    return max(1, min(16, elems // (32 * 16)))
