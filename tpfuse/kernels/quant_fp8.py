"""fp8 (e4m3) quantization of activations for fp8 GEMMs: ``tpfuse.reference.quant_fp8``'s
contract, one row per program, in tiles of at most TILE_ELEMS columns.

Each value is widened to fp32; the scale is the given one ("tensor"), or derived from the
row's amax ("token": a first pass over the row's tiles) or each group's ("group": one pass,
a tile holding whole groups), always as ``max(amax, 1e-10) / 448`` in fp32; every value is
``clamp(y / s, -448, 448)`` rounded to e4m3 to nearest even. Both divisions are correctly
rounded (``div_rn``: Triton's ``/`` is the approximate ``div.full.f32`` on GPUs). On GPUs of
sm_89 and newer the rounding to e4m3 is the hardware conversion (``cvt.rn.satfinite``),
elsewhere the codecs' ``_e4m3_rne`` on the fp32 bits with the sign of a zero kept, as torch's
cast keeps it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.codecs import _e4m3_rne, hardware_e4m3
from tpfuse.kernels.common import EXACT_FP

MODE_IDS = {"tensor": 0, "token": 1, "group": 2}
TILE_ELEMS = 1024
"""Columns a program holds at once (8 per thread on 4 warps); rows of any length loop over them."""
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
def _scale(amax):
    return tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)


@triton.jit
def _quantize(y, s, HW_E4M3: tl.constexpr):
    return _e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(y, s), -_FP8_MAX), _FP8_MAX), HW_E4M3)


@triton.jit
def quant_fp8_kernel(Y, Q, SCALE, S_OUT, N, s_stride_row, s_stride_group,
                     MODE: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, HW_E4M3: tl.constexpr):
    """Row ``program_id`` of Y [M, N] into Q [M, N] (e4m3 bytes), in tiles of GROUPS x GROUP
    columns: for MODE 2 (group) GROUP is the scale group, and each group's scale goes to
    S_OUT at row * s_stride_row + group * s_stride_group; for MODE 1 (token) the row's scale
    goes to S_OUT at row * s_stride_row; MODE 0 (tensor) reads its scale from SCALE."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if MODE == 0:
        s = tl.load(SCALE)
    elif MODE == 1:
        amax = tl.zeros([GROUPS, GROUP], tl.float32)
        for start in range(0, N, GROUPS * GROUP):
            cols = start + tile
            amax = tl.maximum(amax, tl.abs(tl.load(Y + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)))
        s = _scale(tl.max(tl.max(amax, axis=1), axis=0))
        tl.store(S_OUT + row * s_stride_row, s)
    for start in range(0, N, GROUPS * GROUP):
        cols = start + tile
        mask = cols < N
        y = tl.load(Y + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if MODE == 2:
            group_s = _scale(tl.max(tl.abs(y), axis=1))  # [GROUPS]
            groups = start // GROUP + tl.arange(0, GROUPS)
            tl.store(S_OUT + row * s_stride_row + groups * s_stride_group, group_s, mask=groups * GROUP < N)
            q = _quantize(y, group_s[:, None], HW_E4M3)
        else:
            q = _quantize(y, s, HW_E4M3)
        tl.store(Q + row * N + cols, q, mask=mask)


def quant_fp8_into(y: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mode: str, group: int) -> None:
    """Quantize y [M, N] (contiguous) into q [M, N] (contiguous, float8_e4m3fn) and, in the
    "token" and "group" modes, its scales into ``scales`` ([M, 1], or [M, N / group] of any
    strides); in the "tensor" mode ``scales`` is the given one-element fp32 scale. A group of
    "group" divides N and is a power of two of at most TILE_ELEMS."""
    m, n = y.shape
    if m == 0:
        return
    # A tile is whole groups ("group"), or one group of up to TILE_ELEMS columns.
    width = group if mode == "group" else min(TILE_ELEMS, triton.next_power_of_2(n))
    groups = max(1, TILE_ELEMS // width) if mode == "group" else 1
    stride_row, stride_group = (scales.stride(0), scales.stride(1)) if mode != "tensor" else (0, 0)
    quant_fp8_kernel[(m,)](
        Y=y, Q=q.view(torch.uint8), SCALE=scales, S_OUT=scales, N=n, s_stride_row=stride_row,
        s_stride_group=stride_group, MODE=MODE_IDS[mode], GROUP=width, GROUPS=groups, HW_E4M3=hardware_e4m3(y.device),
        num_warps=4, **EXACT_FP)
