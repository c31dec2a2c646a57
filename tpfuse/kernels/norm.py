"""RMSNorm: the tile configuration of every norm kernel (``NormConfig``) and the forward.

Every kernel works on tiles of ``ROWS x BLOCK_N`` (a row is split into ``NUM_CHUNKS`` column
chunks of ``BLOCK_N`` when it is too long to keep in registers). ``NormConfig.from_shape``
derives all of it, forward and backward, from (N, dtype) alone, and rms_norm and
add_rms_norm run one compiled kernel whose row counts are not specialised, so a row's bits
depend only on N and dtype: not on the number of rows, the row's position, the grid, or the
GPU's SM count. Kernels that must match these bit for bit (the fused all-reduce + norm,
``tpfuse.kernels.fused``) inline the forward's tile code (``norm_tile``), and that alone is
not enough: Triton picks register layouts, and so summation orders, per compiled kernel
(benchmarks/NOTES.md), so tests/test_fused_layouts.py compiles them for sm_90 and compares
their reductions' layouts.

The backward, with dW reduced in a fixed order, is in the modules beside this one:
``norm_bwd`` (its launcher, and the kernel for rows held in registers), ``norm_bwd_chunked``
(rows over 16384 elements, split across programs that exchange their chunks' sums),
``norm_bwd_common`` (the per-piece math the two share) and ``norm_dw`` (the dW partials' plan
and combine).

Launchers write into caller-provided outputs and take 2-D contiguous, 16-byte-aligned
operands (``tpfuse._runtime.aligned_contiguous``); allocation, validation and autograd live
in ``tpfuse.norm_ops``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.peer import sum_in_tree_order
from tpfuse.kernels.common import EXACT_FP, TRITON_DIVISIBILITY, round_to, round_to_bf16_f32, to_f32
from tpfuse.kernels.quant_fp8 import Fp8Output, fp8_scale, row_amax, store_fp8_tile, zero_scale_padding

# A row of up to 16384 elements is held in registers and read from memory once (fp32 rows of
# 16384 in 8 KiB chunks instead reached 69% of copy bandwidth forward and 44% backward on H200,
# M=32768). Longer rows are processed in chunks: the forward (and the fused all-reduce + norm,
# which shares its tiles) reads them twice, the second read mostly from L2, on 32 warps in
# chunks of 16 KiB, or of 64 KiB for rows of 128 KiB and more, whose passes carry cache
# hints (``norm_tile``); the backward splits a row's 8 KiB chunks across programs that hold
# them and exchange their sums (tpfuse.kernels.norm_bwd_chunked).
# H200, % of copy, forward / add+norm (benchmarks/NOTES.md, 2026-11-24), 8 KiB chunks without
# hints -> this rule: bf16 N=65536 M=16384 81 / 81 -> 88 / 94, fp32 N=32768 72 / 68 -> 92 /
# 96, fp32 N=65536 M=4096 65 / 78 -> 93 / 86; bf16 N=32768 (16 KiB chunks) 95 / 92 -> 92 /
# 96. 32 warps won at every chunk size; the chunk sizes are not monotonic (bf16 N=65536
# forward: 79 / 73 / 78 / 86% at 8 / 16 / 32 / 64 KiB), and the hints lose on shorter rows
# (bf16 N=32768 forward 92 -> 78%).
_MAX_REGISTER_ROW_ELEMS = 16384
# bf16 rows of 49152 to 65536 elements are held in registers too, in their 16-bit form
# (norm_tile's HOLD_NARROW), one row per program on 32 warps: 64 bf16 per thread, read from
# HBM once. H200 bf16, two runs (scripts/tune_norm.py wide), % of copy, chunked (read twice)
# -> held, forward / add+norm: N=65536 M=32768 90.8 / 97.3 -> 99.2 / 99.4 and 88.7 / 95.3 ->
# 95.9 / 97.5, M=4096 86.6 / 90.7 -> 91.4 / 91.9, M=1024 81.8 / 89.4 -> 80.3 / 87.0 and 78.3 /
# 87.6 -> 79.5 / 85.7 (add+norm loses 2 points at M=1024, 8 waves of one-row programs); N=49152
# (a tile of 65536 a quarter padding) M=16384 89.4 / 87.9 -> 93.3 / 94.8. With more padding
# the forward lost (N=40000 90.8 -> 84.0, N=34816 92.1 -> 77.6; tiles of 32768 at N=20480
# to 32768 lost 6-24 points), so those rows stay chunked. 16 warps (128 values per thread)
# won add+norm (N=65536 M=32768 98.4%) but lost the forward (92.8%). fp16 and fp32 stay
# chunked: fp32 has no 16-bit form, and fp16's widening is a conversion the compiler would
# merge (see widen_again).
_MIN_NARROW_ROW_ELEMS = 49152
_MAX_NARROW_ROW_ELEMS = 65536
CHUNK_BYTES = 16 * 1024
_STREAM_ROW_BYTES = 128 * 1024
STREAM_CHUNK_BYTES = 64 * 1024
_MAX_REGISTER_ROW = tl.constexpr(_MAX_REGISTER_ROW_ELEMS)  # norm_tile's test for narrow rows
_STREAM_CHUNK = tl.constexpr(STREAM_CHUNK_BYTES)  # norm_tile's test for streaming chunks
_CHUNKED_FWD_WARPS = 32
_BWD_CHUNK_BYTES = 8 * 1024
# Short rows are stacked into tiles of at least 2 KiB (H200, M=32768 bf16: N=512 reached 91%
# of copy bandwidth with 2-row tiles on 2 warps, 85% with 8-row tiles on 8 warps).
_MIN_TILE_BYTES = 2 * 1024
_MAX_TILE_ROWS = 32
# A forward row of N in (B, 1.5 B] columns, with B a power of two and the padded tile 2 B of
# at least _MIN_SPLIT_BLOCK elements, is covered by two pieces of B and next_power_of_2(N - B)
# lanes on 4 vectors per thread of the first piece, instead of one tile of 2 B lanes of which
# over a quarter would be padding. H200, M=32768, % of copy, padded -> split (warps): bf16
# N=5120 90 -> 98 (4), N=10240 80 -> 101 (8), fp32 N=10240 79 -> 99 (8), fp32 N=5120 100 -> 99
# (8). The price is a second row reduction: at M=1 a call takes 0.1-0.4 us longer (bf16
# N=5120 2.16 -> 2.23 us, add_rms_norm 2.27 -> 2.61). Smaller tiles did not gain (bf16 N=2880
# 96 -> 97 at 4 warps; N=1280 91 -> 78), so they stay padded.
_MIN_SPLIT_BLOCK = 8192
# Backward tiles stack short rows up to 8 KiB: with 256 programs (the dW partials) one row
# per tile left too few bytes in flight per SM (H200 bf16 M=32768, % of copy, 2 KiB-minimum
# tiles -> 8 KiB: N=256 31 -> 45, N=512 41 -> 63, N=1024 45 -> 79, N=2048 68 -> 86). Their
# warps follow the row (a warp per 32 vectors of a row, 4 to 16), not the tile: stacked rows
# go to more vectors per thread (N=1024 in 4-row tiles: 4 warps 79%, 8 72%, 16 45%).
_MIN_BWD_TILE_BYTES = 8 * 1024
# The backward splits single rows as the forward does, from padded tiles of 16 KiB, also on
# 4 vectors per thread of the first piece. H200, M=32768, % of copy, padded -> split: bf16
# N=5120 71 -> 86 (4 warps), N=10240 62 -> 89 (8), fp32 N=2880 79 -> 87 (4), N=5120 93 -> 94
# (8). bf16 N=2880 (an 8 KiB tile) did not gain: 73 -> 71 at best.
_MIN_BWD_SPLIT_BYTES = 16 * 1024
# The backward's tile rules; what measured each: benchmarks/NOTES.md, "Knobs", the norm.
MAX_PREFETCH_LANES = 12288
_MAX_PREFETCH_BYTES = 32 * 1024
"""Backward tiles of up to this many lanes (rows x the pieces' widths) and bytes prefetch the
next tile (two tiles in flight); larger ones run out of registers."""
_MIN_RELOAD_ELEMS_PER_THREAD = 32
"""Single-row tiles whose threads hold this many elements or more re-read the weight for dx
rather than hold g = dy * w across the row reductions: a register per element freed."""
_MAX_BWD_TILE_BYTES_16_WARPS = 32 * 1024
"""Unsplit single-row tiles over this run on 8 warps, not 16."""
_BWD_TWO_REDUCTION_BLOCK_N = 4096
"""Single rows of this many columns reduce in two separate reductions, not one tuple
reduction (fp32 rows of 2049-3072, in pieces of such a tile, too)."""
_BWD_STACKED_BLOCK_N = 4096
_BWD_STACKED_ROWS = 2
_BWD_STACKED_WARPS = {2: 16, 4: 8}  # by element size
"""Rows of 2049 to 3072 elements (a 4096-column tile over a quarter padding), of a multiple of
TRITON_DIVISIBILITY elements, stack two rows per backward tile, unsplit, with one tuple
reduction (others: Triton cannot prove the second row aligned, and ptxas spills). The 16-bit
tile spills 4 bytes; tests/test_norm_registers.py holds it to that."""
_LONG_RUN_ROWS = 128
"""Backward programs that run through this many rows or more per dW partial take twice the
warps on tiles whose warps already span a row, where each thread still holds two 16-byte
vectors (``bwd_long_run_warps``): the extra warps take rows, each row is reduced in the same
layout, and dx keeps its bits at every M (tests/test_norm_bwd_layouts.py). Only where every
access of the tile is a 16-byte vector (bwd_num_warps' whole_vectors)."""


def warps_take_rows(block_n: int, num_warps: int, esize: int) -> bool:
    """Whether a tile of ``block_n``-column rows on ``num_warps`` has warps along its rows:
    Triton lays a blocked tile's warps along a row first, up to the row's 16-byte vectors / 32
    (on a tile whose accesses are all 16-byte vectors)."""
    return num_warps * 32 * (16 // esize) > block_n


def _pow2_warps(threads: int, cap: int) -> int:
    return min(triton.next_power_of_2(max(threads // 32, 1)), cap)


@dataclass(frozen=True)
class NormConfig:
    """Tile shape and launch parameters for one (N, dtype); shared by every norm kernel.

    Warp counts come from sweeps on H200 (scripts/tune_norm.py, benchmarks/NOTES.md): the
    forward runs 2 16-byte vectors per thread, at most 8 warps (32 on chunked rows and on
    bf16 rows held narrow, see _MIN_NARROW_ROW_ELEMS; rows in two pieces, ``tail_n``, 4
    vectors of the first piece per thread); the
    backward a warp per 32 vectors of a row, 4 to 16 (8 over 32 KiB), on tiles of at least
    8 KiB (stacked short rows), and rows in two pieces (``bwd_tail_n``) on 4 vectors of the
    first piece per thread. The forward's warps also
    set the fused all-reduce + RMSNorm's (tpfuse.kernels.fused), which shares its tiles:
    at decode sizes that kernel is one CTA whose per-thread work is on the critical path
    (4x H200, 1 token of 4096: 8.1 us on 4 warps, 6.8 us on 8).
    """

    block_n: int  # columns per tile or forward chunk (a power of two)
    tail_n: int  # forward: 0, or the row is split in block_n // 2 + tail_n columns (see _MIN_SPLIT_BLOCK)
    num_chunks: int  # forward column chunks per row; 1 = the row stays in registers
    bwd_block_n: int  # as block_n, for the backward (8 KiB chunks)
    bwd_num_chunks: int  # as num_chunks, for the backward
    rows: int  # rows per tile (forward)
    num_warps: int  # forward
    bwd_rows: int  # rows per backward tile
    bwd_tail_n: int  # as tail_n, for the backward (see _MIN_BWD_SPLIT_BYTES)
    bwd_num_warps: int
    bwd_long_run_warps: int  # bwd_num_warps for programs of _LONG_RUN_ROWS rows or more (bwd_num_warps())
    bwd_prefetch: bool  # backward keeps the next tile's loads in flight
    bwd_joint_reduce: bool  # backward reduces x^2 and g*x in one tuple reduction
    bwd_reload_weight: bool  # backward re-reads the weight for dx rather than hold g = dy * w

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def from_shape(n: int, dtype: torch.dtype) -> "NormConfig":
        esize = torch.empty((), dtype=dtype).element_size()
        held = n <= _MAX_REGISTER_ROW_ELEMS  # as fp32, forward and backward
        narrow = dtype == torch.bfloat16 and _MIN_NARROW_ROW_ELEMS <= n <= _MAX_NARROW_ROW_ELEMS  # forward
        if held:
            block_n = bwd_block_n = triton.next_power_of_2(max(n, 1))
        else:
            chunk_bytes = STREAM_CHUNK_BYTES if n * esize >= _STREAM_ROW_BYTES else CHUNK_BYTES
            block_n = triton.next_power_of_2(n) if narrow else chunk_bytes // esize
            bwd_block_n = _BWD_CHUNK_BYTES // esize
        num_chunks = triton.cdiv(n, block_n)
        rows = 1
        while rows < _MAX_TILE_ROWS and rows * block_n * esize < _MIN_TILE_BYTES:
            rows *= 2
        # Rows in two pieces (the forward's and the backward's rules differ in where they pay).
        splittable = held and 4 * n <= 3 * block_n  # over a quarter of the tile padding
        tail = triton.next_power_of_2(n - block_n // 2)
        tail_n = tail if splittable and block_n >= _MIN_SPLIT_BLOCK else 0
        vectors = rows * block_n // (16 // esize)
        threads = vectors // 8 if tail_n else vectors // 2  # 2 vectors per thread; split: 4 of the head
        bwd_rows = rows
        while bwd_rows < _MAX_TILE_ROWS and bwd_rows * bwd_block_n * esize < _MIN_BWD_TILE_BYTES:
            bwd_rows *= 2
        bwd_tail_n = tail if splittable and bwd_block_n * esize >= _MIN_BWD_SPLIT_BYTES else 0  # one row per tile
        if splittable and bwd_block_n == _BWD_STACKED_BLOCK_N and n % TRITON_DIVISIBILITY == 0:  # two rows, unsplit
            bwd_rows, bwd_tail_n, bwd_warps = _BWD_STACKED_ROWS, 0, _BWD_STACKED_WARPS[esize]
        elif bwd_tail_n:  # 4 vectors of the head per thread
            bwd_warps = _pow2_warps(bwd_block_n // 2 // (16 // esize) // 4, 16)
        elif bwd_block_n * esize > _MAX_BWD_TILE_BYTES_16_WARPS:
            bwd_warps = 8
        else:
            bwd_warps = max(4, _pow2_warps(bwd_block_n // (16 // esize), 16))
        # On twice the warps: the extra warps take rows, and each thread keeps two 16-byte vectors.
        extra_take_rows = bwd_tail_n == 0 and warps_take_rows(bwd_block_n, 2 * bwd_warps, esize)
        two_vectors = bwd_rows * bwd_block_n * esize >= 2 * 16 * 32 * (2 * bwd_warps)
        bwd_long_run_warps = 2 * bwd_warps if extra_take_rows and two_vectors else bwd_warps
        bwd_lanes = bwd_rows * (bwd_block_n // 2 + bwd_tail_n if bwd_tail_n else bwd_block_n)
        bwd_prefetch = held and bwd_lanes <= min(MAX_PREFETCH_LANES, _MAX_PREFETCH_BYTES // esize)
        bwd_reload = (held and bwd_rows == 1
                      and bwd_lanes >= _MIN_RELOAD_ELEMS_PER_THREAD * 32 * bwd_warps)
        return NormConfig(
            block_n=block_n, tail_n=tail_n, num_chunks=num_chunks, bwd_block_n=bwd_block_n,
            bwd_num_chunks=triton.cdiv(n, bwd_block_n), rows=rows,
            num_warps=_pow2_warps(threads, 8) if held else _CHUNKED_FWD_WARPS,
            bwd_rows=bwd_rows, bwd_tail_n=bwd_tail_n, bwd_num_warps=bwd_warps,
            bwd_long_run_warps=bwd_long_run_warps, bwd_prefetch=bwd_prefetch,
            bwd_joint_reduce=not (bwd_rows == 1 and bwd_block_n == _BWD_TWO_REDUCTION_BLOCK_N),
            bwd_reload_weight=bwd_reload,
        )


def bwd_num_warps(cfg: NormConfig, rows_per_partial: int, whole_vectors: bool) -> int:
    """The backward kernel's warps for programs of ``rows_per_partial`` rows (DwPlan).
    whole_vectors: every access of the tile is a 16-byte vector (16-byte aligned operands, rows
    of a multiple of TRITON_DIVISIBILITY elements, a weight and a residual gradient of the rows'
    dtype or none); without it the long-run warps would change a row's layout."""
    long_run = whole_vectors and rows_per_partial >= _LONG_RUN_ROWS
    return cfg.bwd_long_run_warps if long_run else cfg.bwd_num_warps


@triton.jit
def inv_rms(sum_sq, N, eps):
    """1 / sqrt(mean(x^2) + eps) from a row's sum of squares."""
    return 1.0 / tl.sqrt(sum_sq / N + eps)


@triton.jit
def row_inv_rms(sq, N, eps):
    """inv_rms per row, from sq: [ROWS, BLOCK_N] fp32 per-lane sums of x^2 (zero in padding
    lanes). The forward's row reduction. Its bits depend on the layout Triton gives the tile,
    which it picks per compiled kernel, so bitwise equality between two kernels needs the
    same layout, not just this function (see norm_tile)."""
    return inv_rms(tl.sum(sq, axis=1), N, eps)


@triton.jit
def _load_norm_input(SRC, src_offs, slot_elems, RES, RES_OUT, offs, mask, has_residual, store_out,
                     SLOTS: tl.constexpr, EVICT: tl.constexpr):
    """The values to normalise at offs, in RES_OUT's dtype (element offsets into RES and RES_OUT).

    x is SRC[src_offs] (SLOTS == 0: the norm's own input, of RES_OUT's dtype), or (the fused
    all-reduce) the sum of SLOTS workspace slots ``SRC + s * slot_elems`` in tree order,
    rounded once to RES_OUT's dtype: exactly tpfuse's all-reduce result, or with slots of fp32
    partials (a 16-bit RES_OUT) that result rounded to the residual's dtype. With has_residual
    x becomes round(x + RES[offs]); x is stored to RES_OUT[offs] when store_out. EVICT: the
    L2 eviction policy of the loads of SRC (SLOTS == 0) and RES."""
    if SLOTS == 0:
        x = tl.load(SRC + src_offs, mask=mask, other=0.0, eviction_policy=EVICT)
    else:
        x = round_to(sum_in_tree_order(SRC, slot_elems, src_offs, mask, SLOTS), RES_OUT.dtype.element_ty)
    if has_residual:
        x = round_to(to_f32(x) + to_f32(tl.load(RES + offs, mask=mask, other=0.0, eviction_policy=EVICT)), x.dtype)
    if store_out:
        tl.store(RES_OUT + offs, x, mask=mask)
    return x


@triton.jit
def widen_again(x):
    """x (bf16) widened to fp32 by moving its bits, not by a conversion, so the compiler
    cannot merge it with an earlier to_f32(x) and keep that fp32 copy live instead of x's 16
    bits (sm_90, bf16 N=65536 on 32 warps: 152 bytes of spills per thread with to_f32, 8 with
    this). fp16 has no such exact move, so fp16 rows are never held narrow."""
    tl.static_assert(x.dtype == tl.bfloat16, "only bf16 rows are held narrow")
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def normed(x, inv, W, cols, N, weight_offset, HAS_WEIGHT: tl.constexpr):
    """x * inv (* (W[cols] + weight_offset)) in fp32, before the rounding to the output dtype."""
    y = x * inv[:, None]
    if HAS_WEIGHT:
        y = y * (to_f32(tl.load(W + cols, mask=cols < N, other=0.0)) + weight_offset)
    return y


@triton.jit
def store_normed(x, inv, W, Y, row_offs, cols, mask, N, weight_offset, HAS_WEIGHT: tl.constexpr,
                  CACHE: tl.constexpr):
    """Y[row_offs + cols] = x * inv (* (W[cols] + weight_offset)), rounded once, stored with
    cache modifier CACHE."""
    y = normed(x, inv, W, cols, N, weight_offset, HAS_WEIGHT)
    tl.store(Y + row_offs + cols, round_to(y, Y.dtype.element_ty), mask=mask, cache_modifier=CACHE)


@triton.jit
def rounded_normed(x, inv, W, cols, N, weight_offset, HAS_WEIGHT: tl.constexpr, ELEM: tl.constexpr,
                   HW_E4M3: tl.constexpr):
    """``normed`` rounded to ELEM (y's dtype) and widened again: the y an fp8 output quantizes
    (bf16 in packed pairs on GPUs with the hardware e4m3 conversion, sm_89 and newer)."""
    y = normed(x, inv, W, cols, N, weight_offset, HAS_WEIGHT)
    if ELEM == tl.bfloat16:
        return round_to_bf16_f32(y, HW_E4M3)
    return to_f32(round_to(y, ELEM))


@triton.jit
def store_output(x, inv, row_scale, W, Y, Q, SCALES, scale_rows, rows, row_offs, col0, cols, mask, row_mask, N,
                 weight_offset, HAS_WEIGHT: tl.constexpr, CACHE: tl.constexpr, FP8: tl.constexpr,
                 GROUP: tl.constexpr, HW_E4M3: tl.constexpr):
    """The normed tile stored as y (FP8 == 0: ``store_normed``) or as fp8 to Q and SCALES
    (``tpfuse.kernels.quant_fp8.store_fp8_tile``, which says what row_scale holds)."""
    if FP8 == 0:
        store_normed(x, inv, W, Y, row_offs, cols, mask, N, weight_offset, HAS_WEIGHT, CACHE)
    else:
        y = rounded_normed(x, inv, W, cols, N, weight_offset, HAS_WEIGHT, Y.dtype.element_ty, HW_E4M3)
        store_fp8_tile(y, row_scale, Q, SCALES, scale_rows, rows, row_offs, col0, cols, mask, row_mask, N, FP8, GROUP,
                       HW_E4M3, 128 // Y.dtype.element_ty.primitive_bitwidth)


@triton.jit
def output_amax(x, inv, W, cols, mask, N, weight_offset, HAS_WEIGHT: tl.constexpr, ELEM: tl.constexpr,
                HW_E4M3: tl.constexpr):
    """[ROWS]: max |y| of the rounded output over the tile's lanes in mask (for FP8 == 2)."""
    return row_amax(rounded_normed(x, inv, W, cols, N, weight_offset, HAS_WEIGHT, ELEM, HW_E4M3), mask)


@triton.jit
def norm_tile(SRC, src_rows, slot_elems, RES, W, Y, RES_OUT, rows, row_mask, N, eps, weight_offset, has_residual,
              store_out, Q, SCALES, scale_rows, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
              NUM_CHUNKS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SLOTS: tl.constexpr, FP8: tl.constexpr,
              GROUP: tl.constexpr, HW_E4M3: tl.constexpr):
    """The RMSNorm forward of one tile of rows, the body of every forward kernel.

    rows: [ROWS] row indices into the [n_rows, N] operands RES, Y and RES_OUT (masked by
    row_mask); src_rows: [ROWS] int64 element offsets of the same rows' first element in SRC
    (see ``_load_norm_input`` for SRC, slot_elems and SLOTS). Writes Y = rms_norm(x) and,
    when store_out, RES_OUT = x, for x as ``_load_norm_input`` forms it. BLOCK_N, TAIL_N and
    NUM_CHUNKS are ``NormConfig``'s block_n, tail_n and num_chunks. With FP8 (the
    ``tpfuse.kernels.quant_fp8.MODE_IDS`` of a mode) y is not stored but quantized from its
    rounded values to Q and SCALES (``Fp8Output``, ``store_fp8_tile``): the bits of
    ``tpfuse.quant_fp8(y)``, since a row's scale comes from the max of the same values.

    A kernel calling this gets the bits of ``rms_norm_fwd_kernel`` only if Triton gives the
    tile the same register layout there (the layout fixes the order of the row reduction):
    tests/test_fused_layouts.py compiles both for sm_90 and compares."""
    ELEM: tl.constexpr = Y.dtype.element_ty
    src_offs = src_rows[:, None]
    row_offs = rows.to(tl.int64)[:, None] * N
    # The fp8 output's scale: FP8 1, the static scale, loaded before the row so that the two
    # loads' latencies overlap; 2, the rows' scales, set below; otherwise unused.
    row_scale = 1.0
    if FP8 == 1:
        row_scale = tl.load(SCALES)
    if TAIL_N > 0:
        # The row in two pieces, BLOCK_N // 2 columns and the TAIL_N after them (see
        # NormConfig.tail_n), each reduced on its own, the head's sum first.
        cols = tl.arange(0, BLOCK_N // 2)[None, :]
        tcols = BLOCK_N // 2 + tl.arange(0, TAIL_N)[None, :]
        mask = row_mask[:, None] & (cols < N)
        tmask = row_mask[:, None] & (tcols < N)
        x = to_f32(_load_norm_input(SRC, src_offs + cols, slot_elems, RES, RES_OUT, row_offs + cols, mask,
                                    has_residual, store_out, SLOTS, ""))
        xt = to_f32(_load_norm_input(SRC, src_offs + tcols, slot_elems, RES, RES_OUT, row_offs + tcols, tmask,
                                     has_residual, store_out, SLOTS, ""))
        inv = inv_rms(tl.sum(x * x, axis=1) + tl.sum(xt * xt, axis=1), N, eps)
        if FP8 == 2:
            row_scale = fp8_scale(tl.maximum(
                output_amax(x, inv, W, cols, mask, N, weight_offset, HAS_WEIGHT, ELEM, HW_E4M3),
                output_amax(xt, inv, W, tcols, tmask, N, weight_offset, HAS_WEIGHT, ELEM, HW_E4M3)))
        store_output(x, inv, row_scale, W, Y, Q, SCALES, scale_rows, rows, row_offs, 0, cols, mask, row_mask, N,
                     weight_offset, HAS_WEIGHT, "", FP8, GROUP, HW_E4M3)
        store_output(xt, inv, row_scale, W, Y, Q, SCALES, scale_rows, rows, row_offs, BLOCK_N // 2, tcols, tmask,
                     row_mask, N, weight_offset, HAS_WEIGHT, "", FP8, GROUP, HW_E4M3)
    elif NUM_CHUNKS == 1:
        # A row longer than fp32 registers hold (bf16 only, see _MIN_NARROW_ROW_ELEMS) is kept
        # in its 16-bit form across the reduction and widened again for y.
        HOLD_NARROW: tl.constexpr = BLOCK_N > _MAX_REGISTER_ROW
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask[:, None] & (cols < N)
        x = _load_norm_input(SRC, src_offs + cols, slot_elems, RES, RES_OUT, row_offs + cols, mask, has_residual,
                             store_out, SLOTS, "")
        xf = to_f32(x)
        inv = row_inv_rms(xf * xf, N, eps)
        if HOLD_NARROW:
            xf = widen_again(x)
        if FP8 == 2:
            row_scale = fp8_scale(output_amax(xf, inv, W, cols, mask, N, weight_offset, HAS_WEIGHT, ELEM, HW_E4M3))
        store_output(xf, inv, row_scale, W, Y, Q, SCALES, scale_rows, rows, row_offs, 0, cols, mask, row_mask, N,
                     weight_offset, HAS_WEIGHT, "", FP8, GROUP, HW_E4M3)
    else:
        # Streaming chunks (rows of 128 KiB and more, see NormConfig) ask L2 to keep what pass
        # one reads, to drop it once pass two has read it, and to stream y past it.
        STREAM: tl.constexpr = BLOCK_N * ELEM.primitive_bitwidth // 8 >= _STREAM_CHUNK
        KEEP: tl.constexpr = "evict_last" if STREAM else ""
        DROP: tl.constexpr = "evict_first" if STREAM else ""
        Y_CACHE: tl.constexpr = ".cs" if STREAM else ""
        cols = tl.arange(0, BLOCK_N)[None, :]
        sq = tl.zeros([src_rows.shape[0], BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_N + cols
            mask = row_mask[:, None] & (ccols < N)
            x = to_f32(_load_norm_input(SRC, src_offs + ccols, slot_elems, RES, RES_OUT, row_offs + ccols, mask,
                                        has_residual, store_out, SLOTS, KEEP))
            sq = tl.fma(x, x, sq)
        inv = row_inv_rms(sq, N, eps)
        if store_out:
            tl.debug_barrier()  # pass one's stores to RES_OUT are visible to every thread of the program
        if FP8 == 2:  # a pass more, for the rows' amax of y before any of it is quantized
            amax = tl.zeros([src_rows.shape[0]], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                ccols = c * BLOCK_N + cols
                mask = row_mask[:, None] & (ccols < N)
                x = _chunk_again(SRC, src_offs, slot_elems, RES, RES_OUT, row_offs, ccols, mask, has_residual,
                                 store_out, SLOTS, KEEP)
                amax = tl.maximum(amax, output_amax(x, inv, W, ccols, mask, N, weight_offset, HAS_WEIGHT, ELEM,
                                                    HW_E4M3))
            row_scale = fp8_scale(amax)
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_N + cols
            mask = row_mask[:, None] & (ccols < N)
            x = _chunk_again(SRC, src_offs, slot_elems, RES, RES_OUT, row_offs, ccols, mask, has_residual, store_out,
                             SLOTS, DROP)
            store_output(x, inv, row_scale, W, Y, Q, SCALES, scale_rows, rows, row_offs, c * BLOCK_N, ccols, mask,
                         row_mask, N, weight_offset, HAS_WEIGHT, Y_CACHE, FP8, GROUP, HW_E4M3)


@triton.jit
def _chunk_again(SRC, src_offs, slot_elems, RES, RES_OUT, row_offs, ccols, mask, has_residual, store_out,
                 SLOTS: tl.constexpr, EVICT: tl.constexpr):
    """A chunk's x after pass one of a chunked row, in fp32, read with eviction policy EVICT."""
    if store_out:
        # x as pass one stored it: half the bytes of x and the residual (or of SLOTS
        # workspace slots), just written and so in L2, and correct when RES_OUT aliases RES.
        x = to_f32(tl.load(RES_OUT + row_offs + ccols, mask=mask, other=0.0, eviction_policy=EVICT))
    else:  # (a return under a branch on a runtime value does not compile)
        x = to_f32(_load_norm_input(SRC, src_offs + ccols, slot_elems, RES, RES_OUT, row_offs + ccols, mask,
                                    has_residual, False, SLOTS, EVICT))
    return x


# has_residual is a runtime flag, not a constexpr, so rms_norm and add_rms_norm run the SAME
# compiled kernel, and n_rows is never specialised (Triton would compile other variants for
# n_rows == 1 and n_rows % 16 == 0), so every batch size runs it too: Triton picks register
# layouts per kernel, and the layout fixes the order of the row reduction (seen on H200: at
# N=1000 the two variants compiled as separate kernels reduced in different layouts and y
# differed by an ulp). One kernel makes y == rms_norm(residual_out) hold by construction.
@triton.jit(do_not_specialize=["n_rows", "has_residual", "scale_rows"])
def rms_norm_fwd_kernel(
    X, RES, W, Y, RES_OUT, Q, SCALES, scale_rows,
    n_rows, N, eps, weight_offset, has_residual,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, HW_E4M3: tl.constexpr,
):
    """Y = rms_norm(X) or, with has_residual, RES_OUT = round(X + RES), Y = rms_norm(RES_OUT);
    with FP8, y quantized to Q and SCALES instead (``norm_tile``). All operands are
    [n_rows, N] contiguous; one program per tile of ROWS rows."""
    zero_scale_padding(SCALES, n_rows, scale_rows, N, FP8, GROUP)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    norm_tile(X, rows.to(tl.int64) * N, 0, RES, W, Y, RES_OUT, rows, rows < n_rows, N, eps, weight_offset,
              has_residual, has_residual, Q, SCALES, scale_rows, BLOCK_N, TAIL_N, NUM_CHUNKS, HAS_WEIGHT, 0, FP8,
              GROUP, HW_E4M3)


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    y: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    fp8: Fp8Output | None = None,
) -> None:
    """Launch the forward on 2-D contiguous aligned operands; writes y (and residual_out), or
    with ``fp8`` its quantized values and scales instead (y None).

    residual_out may alias residual: a row held in registers reads each element before
    writing it, and chunked rows read x back from residual_out in their second pass."""
    if (residual is None) != (residual_out is None):
        raise ValueError("rms_norm_fwd: residual and residual_out go together")
    if (y is None) == (fp8 is None):
        raise ValueError("rms_norm_fwd: exactly one of y and fp8")
    n_rows, n = x.shape
    if n_rows == 0:
        return
    cfg = NormConfig.from_shape(n, x.dtype)
    rms_norm_fwd_kernel[(triton.cdiv(n_rows, cfg.rows),)](
        X=x, RES=residual if residual is not None else x, W=weight if weight is not None else x,
        Y=y if y is not None else x, RES_OUT=residual_out if residual_out is not None else x,
        n_rows=n_rows, N=n, eps=eps, weight_offset=weight_offset, has_residual=int(residual is not None),
        BLOCK_N=cfg.block_n, TAIL_N=cfg.tail_n, NUM_CHUNKS=cfg.num_chunks, ROWS=cfg.rows,
        HAS_WEIGHT=weight is not None, num_warps=cfg.num_warps,
        **(fp8.kernel_args() if fp8 is not None else Fp8Output.none_args(x)), **EXACT_FP,
    )
