"""fp8 (e4m3) quantization of activations for fp8 GEMMs: ``tpfuse.reference.quant_fp8``'s
contract, one row per program, in tiles of at most TILE_ELEMS columns.

Each value is widened to fp32; the scale is the given one ("tensor"), or derived from the
row's amax ("token": a first pass over the row's tiles) or each group's ("group": one pass,
a tile holding whole groups), always as ``max(amax, 1e-10) / 448`` in fp32; every value is
``clamp(y * (1 / s), -448, 448)`` rounded to e4m3 to nearest even, with ``1 / s`` one
correctly rounded fp32 reciprocal per scale. Both divisions are correctly rounded
(``div_rn``: Triton's ``/`` is the approximate ``div.full.f32`` on GPUs). On GPUs of
sm_89 and newer the rounding to e4m3 is the hardware conversion (``cvt.rn.satfinite``),
elsewhere the codecs' ``_e4m3_rne`` on the fp32 bits with the sign of a zero kept, as torch's
cast keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.codecs import _e4m3_rne, hardware_e4m3
from tpfuse.kernels.common import EXACT_FP

MODE_IDS = {"tensor": 1, "token": 2, "group": 3}
"""The MODE / FP8 constexpr of the kernels here and of the norm kernels' fp8 output (0: none)."""
TILE_ELEMS = 1024
"""Columns a program holds at once (8 per thread on 4 warps); rows of any length loop over them."""
_FP8_MAX = tl.constexpr(448.0)
_AMAX_FLOOR = tl.constexpr(1e-10)


@triton.jit
def _e4m3_bits(v, HW_E4M3: tl.constexpr):
    """fp32 v -> the e4m3fn byte (uint8) torch's cast gives, NaN to a NaN byte. The software
    path takes |v| <= 448 or NaN (``_quantize`` clamps first; NaN comes out 0x7F); the
    hardware conversion saturates any v at +-448 itself."""
    if HW_E4M3:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sign = tl.where(v.to(tl.int32, bitcast=True) < 0, 0x80, 0)
    return tl.where(v != v, 0x7F, (_e4m3_rne(v) & 0x7F) | sign).to(tl.uint8)


@triton.jit
def fp8_scale(amax):
    """``max(amax, 1e-10) / 448`` in fp32, correctly rounded (the reference's _fp8_scale)."""
    return tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)


@triton.jit
def fp8_reciprocal(s):
    """1 / s, correctly rounded: once per scale, so that each value costs a multiply (a
    correctly rounded division per value made the fused boundary's fp8 output 11-40% slower
    than the boundary without it; benchmarks/NOTES.md)."""
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def _quantize(y, inv, HW_E4M3: tl.constexpr):
    """y * inv (inv = ``fp8_reciprocal(s)``) saturated at +-448, as e4m3 bytes; a NaN stays NaN
    (the poison of a failed collective must not come out as numbers). The hardware conversion
    saturates by itself (``cvt.rn.satfinite``: out-of-range values and infinities to +-448, NaN
    to NaN), so the clamp, two instructions per value, is only the software path's."""
    v = y * inv
    if not HW_E4M3:
        v = tl.minimum(tl.maximum(v, -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL), _FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
    return _e4m3_bits(v, HW_E4M3)


@triton.jit
def row_amax(y, mask):
    """[ROWS]: max |y| over each row's lanes in mask, of a [ROWS, B] fp32 tile (exact in any
    order, so no layout question arises)."""
    return tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)


@triton.jit
def store_fp8_tile(y, row_scale, Q, SCALES, scale_rows, rows, row_offs, col0, cols, mask, scales_mask, N,
                   FP8: tl.constexpr, GROUP: tl.constexpr, HW_E4M3: tl.constexpr, VEC: tl.constexpr):
    """A norm kernel's output tile quantized, as ``tpfuse.quant_fp8`` would quantize it.

    y: [ROWS, B] fp32, the widened values of the rounded output (zero in padding lanes) of
    rows ``rows`` ([ROWS]) and columns col0 + [0, B) (``cols`` [1, B]), stored as e4m3 bytes
    to Q at row_offs + cols where mask. FP8 (``MODE_IDS``): 1, the static scale ``row_scale``
    (the caller loads it before the row, so that the load's latency overlaps the row's, and it
    is inverted only here: a division right after the load stalled every warp on it, 0.5 us
    a call); 2, the rows' scales ``row_scale`` [ROWS] (from their amax over
    the whole row, which the caller has), stored to SCALES[rows]; 3, a scale per GROUP columns,
    from this tile's groups (B is
    whole groups), stored column-major, group g of row m at SCALES[g * scale_rows + m]. The
    scales are stored where scales_mask ([ROWS]) holds.

    VEC: the elements of a 16-byte vector of the norm's input. The e4m3 stores are declared
    contiguous in runs of VEC only: Triton's coalescing gives every memory access of a tile
    the widest vector any of them allows, and 16 bytes of e4m3 (16 elements) would widen
    the whole tile's layout, and so change the order of the row's sum of squares against
    the norm kernel's (tests/test_fused_layouts.py)."""
    if FP8 == 1:
        q = _quantize(y, fp8_reciprocal(row_scale), HW_E4M3)
    elif FP8 == 2:
        tl.store(SCALES + rows, row_scale, mask=scales_mask)
        q = _quantize(y, fp8_reciprocal(row_scale)[:, None], HW_E4M3)
    else:
        ROWS: tl.constexpr = y.shape[0]
        B: tl.constexpr = y.shape[1]
        y3 = tl.reshape(y, [ROWS, B // GROUP, GROUP])
        group_s = fp8_scale(tl.max(tl.abs(y3), axis=2))  # [ROWS, B // GROUP]
        groups = col0 // GROUP + tl.arange(0, B // GROUP)[None, :]
        tl.store(SCALES + groups.to(tl.int64) * scale_rows + rows[:, None], group_s,
                 mask=scales_mask[:, None] & (groups * GROUP < N))
        q = tl.reshape(_quantize(y3, fp8_reciprocal(group_s)[:, :, None], HW_E4M3), [ROWS, B])
    tl.store(Q + tl.max_contiguous(row_offs + cols, [1, VEC]), q, mask=mask)


@triton.jit
def zero_scale_padding(SCALES, n_rows, scale_rows, N, FP8: tl.constexpr, GROUP: tl.constexpr):
    """Per-group scales (FP8 3) only, by program 0: the padding rows n_rows .. scale_rows - 1 of
    every group's column (at most 3, ``reference.fp8_scale_rows``) set to zero, as the
    reference's. In the kernel, not by a torch fill before it: a fill is one more launch per
    call (at 1 token of 4096 it made the fused fp8 output 1.45x the fused kernel, against
    1.13x per token; benchmarks/NOTES.md)."""
    if FP8 == 3:
        if tl.program_id(0) == 0:
            pad = n_rows + tl.arange(0, 4)[None, :]
            for start in range(0, N // GROUP, 256):
                groups = start + tl.arange(0, 256)[:, None]
                tl.store(SCALES + groups.to(tl.int64) * scale_rows + pad, tl.zeros([256, 4], tl.float32),
                         mask=(groups < N // GROUP) & (pad < scale_rows))


@dataclass(frozen=True)
class Fp8Output:
    """Where a norm kernel's fp8 output goes: the e4m3 values q (the output's shape, 2-D
    contiguous), and the scales as ``tpfuse.quant_fp8`` returns them for ``mode``: the given
    one-element scale ("tensor"), [M, 1] ("token") or the column-major [M, N / group] view
    ("group"). The norm kernels' extra arguments, in one place (``kernel_args``)."""

    q: torch.Tensor
    scales: torch.Tensor
    mode: str
    group: int

    def kernel_args(self) -> dict:
        return dict(Q=self.q.view(torch.uint8), SCALES=self.scales,
                    scale_rows=self.scales.stride(1) if self.mode == "group" else 0, FP8=MODE_IDS[self.mode],
                    GROUP=self.group if self.mode == "group" else 1, HW_E4M3=hardware_e4m3(self.q.device))

    @staticmethod
    def none_args(like: torch.Tensor) -> dict:
        """The same arguments for a kernel that writes y itself, not fp8."""
        return dict(Q=like, SCALES=like, scale_rows=0, FP8=0, GROUP=1, HW_E4M3=False)


@triton.jit
def quant_fp8_kernel(Y, Q, SCALE, S_OUT, N, s_stride_row, s_stride_group,
                     MODE: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, HW_E4M3: tl.constexpr):
    """Row ``program_id`` of Y [M, N] into Q [M, N] (e4m3 bytes), in tiles of GROUPS x GROUP
    columns (MODE: ``MODE_IDS``): for MODE 3 (group) GROUP is the scale group, and each
    group's scale goes to S_OUT at row * s_stride_row + group * s_stride_group; for MODE 2
    (token) the row's scale goes to S_OUT at row * s_stride_row; MODE 1 (tensor) reads its
    scale from SCALE."""
    row = tl.program_id(0).to(tl.int64)
    if MODE == 3:
        zero_scale_padding(S_OUT, tl.num_programs(0), s_stride_group, N, MODE, GROUP)
    tile = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if MODE == 1:
        s = tl.load(SCALE)
        inv = fp8_reciprocal(s)
    elif MODE == 2:
        amax = tl.zeros([GROUPS, GROUP], tl.float32)
        for start in range(0, N, GROUPS * GROUP):
            cols = start + tile
            amax = tl.maximum(amax, tl.abs(tl.load(Y + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)))
        s = fp8_scale(tl.max(tl.max(amax, axis=1), axis=0))
        tl.store(S_OUT + row * s_stride_row, s)
        inv = fp8_reciprocal(s)
    for start in range(0, N, GROUPS * GROUP):
        cols = start + tile
        mask = cols < N
        y = tl.load(Y + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if MODE == 3:
            group_s = fp8_scale(tl.max(tl.abs(y), axis=1))  # [GROUPS]
            groups = start // GROUP + tl.arange(0, GROUPS)
            tl.store(S_OUT + row * s_stride_row + groups * s_stride_group, group_s, mask=groups * GROUP < N)
            q = _quantize(y, fp8_reciprocal(group_s)[:, None], HW_E4M3)
        else:
            q = _quantize(y, inv, HW_E4M3)
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
