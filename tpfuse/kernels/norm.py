"""RMSNorm kernels: forward, fused residual-add forward, backward with dW reduced in a fixed order
(inside the backward launch, or for rows over 16384 elements in a combine launch).

Every kernel works on tiles of ``ROWS x BLOCK_N`` (a row is split into ``NUM_CHUNKS`` column
chunks of ``BLOCK_N`` when it is too long to keep in registers). ``NormConfig.from_shape``
derives all of it from (N, dtype) alone, and rms_norm and add_rms_norm run one compiled
kernel whose row counts are not specialised, so a row's bits depend only on N and dtype:
not on the number of rows, the row's position, the grid, or the GPU's SM count. Kernels
that must match these bit for bit (the fused all-reduce + norm, ``tpfuse.kernels.fused``)
inline the forward's tile code (``norm_tile``), and that alone is not enough: Triton picks
register layouts, and so summation orders, per compiled kernel (benchmarks/NOTES.md), so
tests/test_fused_layouts.py compiles them for sm_90 and compares their reductions' layouts.

Launchers here write into caller-provided outputs and take 2-D contiguous, 16-byte-aligned
operands (``tpfuse._runtime.aligned_contiguous``); allocation, validation and autograd live
in ``tpfuse.ops``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER
from tpfuse.kernels.allreduce import sum_in_rank_order
from tpfuse.kernels.common import EXACT_FP, round_to, to_f32

# A row of up to 16384 elements is held in registers and read from memory once (fp32 rows of
# 16384 in 8 KiB chunks instead reached 69% of copy bandwidth forward and 44% backward on H200,
# M=32768); longer rows are processed in 8 KiB chunks and read twice (the second read mostly
# hits L2), by 32 warps in the forward (bf16 N=65536 M=32768: 8 warps 68%, 16 66%, 32 80%;
# 16 or 32 KiB chunks 69-79%).
_MAX_REGISTER_ROW_ELEMS = 16384
_CHUNK_BYTES = 8 * 1024
_CHUNKED_FWD_WARPS = 32
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
# Backward tiles of up to this many lanes (rows x the pieces' widths) and bytes prefetch the
# next tile (two tiles in flight); larger ones run out of registers. H200 M=32768, without
# -> with prefetch: bf16 N=4096 311 -> 219 us; % of copy, bf16 N=8192 72 -> 89, split
# N=12288 (12288 lanes, 24 KiB) 62 -> 93, fp32 split N=5120 (20 KiB) 90 -> 94; but bf16
# N=16384 87 -> 42, fp32 split N=10240 (40 KiB) 85 -> 64, fp32 split N=12288 (48 KiB, 16
# warps) 91 -> 56.
_MAX_PREFETCH_LANES = 12288
_MAX_PREFETCH_BYTES = 32 * 1024
# Single-row tiles whose threads hold 32 or more elements each re-read the weight for dx
# rather than hold g = dy * w across the row reductions (bwd_reload_weight); that frees a
# register per element. H200 M=32768, % of copy, g held -> weight re-read: bf16 N=16384
# 72 -> 87 (ptxas no longer spills), split N=6144 63 -> 91, N=12288 62 -> 93, fp32 N=16384
# 76 -> 81 (88 on 8 warps); neutral at 40 elements per thread (bf16 split N=5120 86 -> 86,
# N=10240 89 -> 88). With fewer it is worth -14 to +1 points (fp32 split N=2880 on 4 warps:
# 87 -> 73).
_MIN_RELOAD_ELEMS_PER_THREAD = 32
# Unsplit single-row tiles over 32 KiB (fp32 rows of 12289 to 16384) run on 8 warps, not
# 16: fp32 N=16384 with the weight re-read 88% vs 81% (32 warps 80%). Split fp32 rows of
# 8193 to 12288 keep the split's warps (16): N=10240 85% (84 on 8 warps), N=12288 89% (91).
_MAX_BWD_TILE_BYTES_16_WARPS = 32 * 1024
# Two separate row reductions beat one tuple reduction on single rows of 4096 columns (H200
# bf16 M=32768, % of copy: N=4096 90 vs 70, N=2880 71 vs 55); the tuple wins elsewhere
# (N=16384 71 vs 69, N=5120 70 vs 68, N=1024 in 4-row tiles 79 vs 69). fp32 rows of 2049 to
# 3072 (pieces of a 4096-column tile) reduce each piece in two as well: 87% with them.
_BWD_TWO_REDUCTION_BLOCK_N = 4096

# Backward dW: per-program partial rows, combined in a fixed two-level order (groups of
# DW_GROUP_SIZE summed in order, then the group sums in order). Their number depends on
# (M, N, dtype) only, never the SM count, so dW has the same bits on every GPU of the arch:
# half the rows, at least 16 (or one per row), at most 256 (chunked rows: at most
# _CHUNKED_BWD_PROGRAMS / chunks, at least 1), then rows per partial rounded up to the
# backward tile's. 256 beat 1024 at every swept shape on H200;
# at small M more programs of fewer rows win (bf16, N=16384: M=16 in 16 one-row partials
# 8.2 us, 8 two-row 10.2, 4 four-row 14.6; M=128 in 64 two-row partials 13.8, 128 one-row
# 14.3, 32 four-row 16.4).
_MAX_DW_PARTIALS = 256
_MIN_DW_PARTIALS = 16
_DW_GROUP_SIZE = 16
_COMBINE_BLOCK = 1024  # dW columns per program of a column-parallel combine
# Chunked rows (N > _MAX_REGISTER_ROW_ELEMS) take a program of _CHUNKED_BWD_WARPS warps per
# (partial, chunk), about _CHUNKED_BWD_PROGRAMS of them (see rms_norm_bwd_chunks_kernel).
_CHUNKED_BWD_PROGRAMS = 512
_CHUNKED_BWD_WARPS = 8
# Where the backward kernel's dW partials are combined (its COMBINE argument): by a separate
# dw_combine_kernel launch, or inside the launch as DwPlan.combine says.
COMBINE_LAUNCH = tl.constexpr(0)
COMBINE_TREE = tl.constexpr(1)
COMBINE_COLUMNS = tl.constexpr(2)


def _pow2_warps(threads: int, cap: int) -> int:
    return min(triton.next_power_of_2(max(threads // 32, 1)), cap)


@dataclass(frozen=True)
class NormConfig:
    """Tile shape and launch parameters for one (N, dtype); shared by every norm kernel.

    Warp counts come from sweeps on H200 (scripts/tune_norm.py, benchmarks/NOTES.md): the
    forward runs 2 16-byte vectors per thread, at most 8 warps (32 on chunked rows; rows in
    two pieces, ``tail_n``, 4 vectors of the first piece per thread); the
    backward a warp per 32 vectors of a row, 4 to 16 (8 over 32 KiB), on tiles of at least
    8 KiB (stacked short rows), and rows in two pieces (``bwd_tail_n``) on 4 vectors of the
    first piece per thread. The forward's warps also
    set the fused all-reduce + RMSNorm's (tpfuse.kernels.fused), which shares its tiles:
    at decode sizes that kernel is one CTA whose per-thread work is on the critical path
    (4x H200, 1 token of 4096: 8.1 us on 4 warps, 6.8 us on 8).
    """

    block_n: int  # columns per tile (a power of two)
    tail_n: int  # forward: 0, or the row is split in block_n // 2 + tail_n columns (see _MIN_SPLIT_BLOCK)
    num_chunks: int  # column chunks per row; 1 = the row stays in registers
    rows: int  # rows per tile (forward)
    num_warps: int  # forward
    bwd_rows: int  # rows per backward tile
    bwd_tail_n: int  # as tail_n, for the backward (see _MIN_BWD_SPLIT_BYTES)
    bwd_num_warps: int
    bwd_prefetch: bool  # backward keeps the next tile's loads in flight
    bwd_joint_reduce: bool  # backward reduces x^2 and g*x in one tuple reduction
    bwd_reload_weight: bool  # backward re-reads the weight for dx rather than hold g = dy * w

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def from_shape(n: int, dtype: torch.dtype) -> "NormConfig":
        esize = torch.empty((), dtype=dtype).element_size()
        if n <= _MAX_REGISTER_ROW_ELEMS:
            block_n = triton.next_power_of_2(max(n, 1))
        else:
            block_n = _CHUNK_BYTES // esize
        num_chunks = triton.cdiv(n, block_n)
        rows = 1
        while rows < _MAX_TILE_ROWS and rows * block_n * esize < _MIN_TILE_BYTES:
            rows *= 2
        # Rows in two pieces (the forward's and the backward's rules differ in where they pay).
        splittable = num_chunks == 1 and 4 * n <= 3 * block_n  # over a quarter of the tile padding
        tail = triton.next_power_of_2(n - block_n // 2)
        tail_n = tail if splittable and block_n >= _MIN_SPLIT_BLOCK else 0
        vectors = rows * block_n // (16 // esize)
        threads = vectors // 8 if tail_n else vectors // 2  # 2 vectors per thread; split: 4 of the head
        bwd_rows = rows
        while bwd_rows < _MAX_TILE_ROWS and bwd_rows * block_n * esize < _MIN_BWD_TILE_BYTES:
            bwd_rows *= 2
        bwd_tail_n = tail if splittable and block_n * esize >= _MIN_BWD_SPLIT_BYTES else 0  # one row per tile
        if bwd_tail_n:  # 4 vectors of the head per thread
            bwd_warps = _pow2_warps(block_n // 2 // (16 // esize) // 4, 16)
        elif block_n * esize > _MAX_BWD_TILE_BYTES_16_WARPS:
            bwd_warps = 8
        else:
            bwd_warps = max(4, _pow2_warps(block_n // (16 // esize), 16))
        bwd_lanes = bwd_rows * (block_n // 2 + bwd_tail_n if bwd_tail_n else block_n)
        bwd_prefetch = num_chunks == 1 and bwd_lanes <= min(_MAX_PREFETCH_LANES, _MAX_PREFETCH_BYTES // esize)
        bwd_reload = (num_chunks == 1 and bwd_rows == 1
                      and bwd_lanes >= _MIN_RELOAD_ELEMS_PER_THREAD * 32 * bwd_warps)
        return NormConfig(
            block_n=block_n, tail_n=tail_n, num_chunks=num_chunks, rows=rows,
            num_warps=_pow2_warps(threads, 8) if num_chunks == 1 else _CHUNKED_FWD_WARPS,
            bwd_rows=bwd_rows, bwd_tail_n=bwd_tail_n, bwd_num_warps=bwd_warps, bwd_prefetch=bwd_prefetch,
            bwd_joint_reduce=not (bwd_rows == 1 and block_n == _BWD_TWO_REDUCTION_BLOCK_N),
            bwd_reload_weight=bwd_reload,
        )


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
                     SLOTS: tl.constexpr):
    """The fp32 values to normalise at offs (element offsets into RES and RES_OUT).

    x is SRC[src_offs] (SLOTS == 0: the norm's own input), or (the fused all-reduce) the sum
    of SLOTS workspace slots ``SRC + s * slot_elems`` in rank order, rounded once: exactly
    tpfuse's all-reduce result. With has_residual x becomes round(x + RES[offs]); x is
    stored to RES_OUT[offs] when store_out."""
    if SLOTS == 0:
        x = tl.load(SRC + src_offs, mask=mask, other=0.0)
    else:
        x = round_to(sum_in_rank_order(SRC, slot_elems, src_offs, mask, SLOTS), SRC.dtype.element_ty)
    if has_residual:
        x = round_to(to_f32(x) + to_f32(tl.load(RES + offs, mask=mask, other=0.0)), x.dtype)
    if store_out:
        tl.store(RES_OUT + offs, x, mask=mask)
    return to_f32(x)


@triton.jit
def _store_normed(x, inv, W, Y, row_offs, cols, mask, N, weight_offset, HAS_WEIGHT: tl.constexpr):
    """Y[row_offs + cols] = x * inv (* (W[cols] + weight_offset)), rounded once."""
    y = x * inv[:, None]
    if HAS_WEIGHT:
        y = y * (to_f32(tl.load(W + cols, mask=cols < N, other=0.0)) + weight_offset)
    tl.store(Y + row_offs + cols, round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_tile(SRC, src_rows, slot_elems, RES, W, Y, RES_OUT, rows, row_mask, N, eps, weight_offset, has_residual,
              store_out, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, SLOTS: tl.constexpr):
    """The RMSNorm forward of one tile of rows, the body of every forward kernel.

    rows: [ROWS] row indices into the [n_rows, N] operands RES, Y and RES_OUT (masked by
    row_mask); src_rows: [ROWS] int64 element offsets of the same rows' first element in SRC
    (see ``_load_norm_input`` for SRC, slot_elems and SLOTS). Writes Y = rms_norm(x) and,
    when store_out, RES_OUT = x, for x as ``_load_norm_input`` forms it. BLOCK_N, TAIL_N and
    NUM_CHUNKS are ``NormConfig``'s block_n, tail_n and num_chunks.

    A kernel calling this gets the bits of ``rms_norm_fwd_kernel`` only if Triton gives the
    tile the same register layout there (the layout fixes the order of the row reduction):
    tests/test_fused_layouts.py compiles both for sm_90 and compares."""
    src_offs = src_rows[:, None]
    row_offs = rows.to(tl.int64)[:, None] * N
    if TAIL_N > 0:
        # The row in two pieces, BLOCK_N // 2 columns and the TAIL_N after them (see
        # NormConfig.tail_n), each reduced on its own, the head's sum first.
        cols = tl.arange(0, BLOCK_N // 2)[None, :]
        tcols = BLOCK_N // 2 + tl.arange(0, TAIL_N)[None, :]
        mask = row_mask[:, None] & (cols < N)
        tmask = row_mask[:, None] & (tcols < N)
        x = _load_norm_input(SRC, src_offs + cols, slot_elems, RES, RES_OUT, row_offs + cols, mask, has_residual,
                             store_out, SLOTS)
        xt = _load_norm_input(SRC, src_offs + tcols, slot_elems, RES, RES_OUT, row_offs + tcols, tmask,
                              has_residual, store_out, SLOTS)
        inv = inv_rms(tl.sum(x * x, axis=1) + tl.sum(xt * xt, axis=1), N, eps)
        _store_normed(x, inv, W, Y, row_offs, cols, mask, N, weight_offset, HAS_WEIGHT)
        _store_normed(xt, inv, W, Y, row_offs, tcols, tmask, N, weight_offset, HAS_WEIGHT)
    elif NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask[:, None] & (cols < N)
        x = _load_norm_input(SRC, src_offs + cols, slot_elems, RES, RES_OUT, row_offs + cols, mask, has_residual,
                             store_out, SLOTS)
        _store_normed(x, row_inv_rms(x * x, N, eps), W, Y, row_offs, cols, mask, N, weight_offset, HAS_WEIGHT)
    else:
        cols = tl.arange(0, BLOCK_N)[None, :]
        sq = tl.zeros([src_rows.shape[0], BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_N + cols
            mask = row_mask[:, None] & (ccols < N)
            x = _load_norm_input(SRC, src_offs + ccols, slot_elems, RES, RES_OUT, row_offs + ccols, mask,
                                 has_residual, store_out, SLOTS)
            sq = tl.fma(x, x, sq)
        inv = row_inv_rms(sq, N, eps)
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_N + cols
            mask = row_mask[:, None] & (ccols < N)
            # Recomputing x gives the bits stored in pass one, without reading back memory
            # this program wrote.
            x = _load_norm_input(SRC, src_offs + ccols, slot_elems, RES, RES_OUT, row_offs + ccols, mask,
                                 has_residual, False, SLOTS)
            _store_normed(x, inv, W, Y, row_offs, ccols, mask, N, weight_offset, HAS_WEIGHT)


# has_residual is a runtime flag, not a constexpr, so rms_norm and add_rms_norm run the SAME
# compiled kernel, and n_rows is never specialised (Triton would compile other variants for
# n_rows == 1 and n_rows % 16 == 0), so every batch size runs it too: Triton picks register
# layouts per kernel, and the layout fixes the order of the row reduction (seen on H200: at
# N=1000 the two variants compiled as separate kernels reduced in different layouts and y
# differed by an ulp). One kernel makes y == rms_norm(residual_out) hold by construction.
@triton.jit(do_not_specialize=["n_rows", "has_residual"])
def rms_norm_fwd_kernel(
    X, RES, W, Y, RES_OUT,
    n_rows, N, eps, weight_offset, has_residual,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Y = rms_norm(X) or, with has_residual, RES_OUT = round(X + RES), Y = rms_norm(RES_OUT).
    All operands are [n_rows, N] contiguous; one program per tile of ROWS rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    norm_tile(X, rows.to(tl.int64) * N, 0, RES, W, Y, RES_OUT, rows, rows < n_rows, N, eps, weight_offset,
              has_residual, has_residual, BLOCK_N, TAIL_N, NUM_CHUNKS, HAS_WEIGHT, 0)


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    y: torch.Tensor,
    eps: float,
    weight_offset: float,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """Launch the forward on 2-D contiguous aligned operands; writes y (and residual_out).

    residual_out may alias residual only when the row fits one chunk (``NormConfig.
    num_chunks == 1``): chunked rows re-read the residual in a second pass."""
    if (residual is None) != (residual_out is None):
        raise ValueError("rms_norm_fwd: residual and residual_out go together")
    n_rows, n = x.shape
    if n_rows == 0:
        return
    cfg = NormConfig.from_shape(n, x.dtype)
    rms_norm_fwd_kernel[(triton.cdiv(n_rows, cfg.rows),)](
        X=x, RES=residual if residual is not None else x, W=weight if weight is not None else x, Y=y,
        RES_OUT=residual_out if residual_out is not None else y,
        n_rows=n_rows, N=n, eps=eps, weight_offset=weight_offset, has_residual=int(residual is not None),
        BLOCK_N=cfg.block_n, TAIL_N=cfg.tail_n, NUM_CHUNKS=cfg.num_chunks, ROWS=cfg.rows,
        HAS_WEIGHT=weight is not None, num_warps=cfg.num_warps, **EXACT_FP,
    )


# ---------------------------------------------------------------------------------------
# Backward


@dataclass(frozen=True)
class DwPlan:
    """How the dW partials of one backward call are laid out and combined.

    ``num_partials`` programs each own ``rows_per_partial`` consecutive rows (a multiple of
    the tile height) and write one fp32 partial row. The partials are summed in a fixed
    two-level order: within groups of ``group_size`` in index order, then the group sums in
    index order. ``combine`` says which programs do the sum, all in that order, so the
    choice never changes a bit (nor does ``rms_norm_bwd(fused_combine=False)``, which always
    takes the separate combine launch, for comparison):

    - "tree": the last program to finish in each group sums the group, and the last of
      those sums the group sums (``_finish_dw``). The finishers overlap with programs still
      running, which wins with many partials, but each reads whole partial rows alone.
      With one partial (M=1, or any M on rows of over 256 chunks, 2 MiB) there is nothing
      to combine: its program (each chunk's, on chunked rows) stores dW itself.
    - "columns": ``num_combine_programs`` extra programs, one per ``_COMBINE_BLOCK``
      columns, wait for every partial row and sum their columns (``_combine_when_done``).
    - "launch": the separate combine launch, ``dw_combine_kernel`` (chunked rows of more
      than one partial).

    Depends on (M, N, dtype) only.
    """

    num_partials: int
    rows_per_partial: int
    group_size: int
    combine: str
    num_combine_programs: int

    @property
    def num_groups(self) -> int:
        return triton.cdiv(self.num_partials, self.group_size)

    @staticmethod
    def from_shape(m: int, n: int, dtype: torch.dtype) -> "DwPlan":
        cfg = NormConfig.from_shape(n, dtype)
        # Chunked rows run a program per (partial, chunk): as many programs from fewer partials.
        max_partials = _MAX_DW_PARTIALS if cfg.num_chunks == 1 else max(1, _CHUNKED_BWD_PROGRAMS // cfg.num_chunks)
        num_partials = max(1, min(max_partials, max(min(m, _MIN_DW_PARTIALS), m // 2)))
        rows_per_partial = triton.cdiv(triton.cdiv(m, num_partials), cfg.bwd_rows) * cfg.bwd_rows
        num_partials = triton.cdiv(m, rows_per_partial)
        # The tree's finishers overlap with programs still running but read whole partial
        # rows alone; the column programs share the columns but start after the last
        # partial. H200, bf16, us, tree vs columns: N=2048 M=16 3.7 vs 4.5, M=1024 10.7 vs
        # 17.6; N=4096 M=16 6.1 vs 5.4, M=128 8.9 vs 8.1, M=1024 17.0 vs 25.3; N=8192 M=1024
        # 32.1 vs 31.3; N=16384 M=1024 66.9 vs 58.3; but fp32 M=32768 (256 partials) went
        # from 93-96% of copy bandwidth at N=5120-8192 to 70-84% with the columns. A single
        # partial (M=1) needs no combine at all: its program writes dW. Chunked rows, whose
        # backward is three launches over (partial, chunk) programs, take the separate
        # launch: an in-kernel combine there (the last of each chunk's programs summing the
        # chunk) lost to it, H200 bf16 N=65536, us, in-kernel vs separate: M=16 17.0 vs
        # 14.1, M=128 41.3 vs 38.2, M=1024 202.7 vs 204.7 (at M=1, no combine: 6.7 vs 8.3).
        if num_partials == 1:
            combine = "tree"
        elif cfg.num_chunks > 1:
            combine = "launch"
        elif n <= 2048 or (n <= 8192 and num_partials >= 128):
            combine = "tree"
        else:
            combine = "columns"
        return DwPlan(num_partials, rows_per_partial, _DW_GROUP_SIZE, combine,
                      triton.cdiv(n, _COMBINE_BLOCK))


@triton.jit
def _group_sum(PARTIAL, group, num_partials, N, cols, mask, GROUP_SIZE: tl.constexpr):
    """Sum of the partial rows of one group at cols, in index order, starting from the
    group's first row. Every dW combine goes through this, in both launch modes."""
    first = group * GROUP_SIZE
    # .cg: other programs wrote these rows; read them from L2, never a stale L1 line.
    acc = tl.load(PARTIAL + first * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, GROUP_SIZE):
        acc += tl.load(PARTIAL + (first + s) * N + cols, mask=mask & (first + s < num_partials), other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def _finish_dw(PARTIAL, GROUP_SUM, COUNTERS, DW, pid, num_partials, N,
               GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Called by every program after storing its partial row: the last program of each group
    sums the group, and the last group finisher sums the group sums into dW (a group's sum
    is dW itself when there is one group).

    Arrival is counted with integer atomics: a CTA barrier, then an acq_rel add by one
    thread, publishes this program's stores before the count (the CUTLASS generic-barrier
    pattern); the finisher's acquire orders its loads after every arrival it counted. Each
    finisher resets its counter to 0, so the counters are zero between calls and nothing of
    a call is baked into a captured CUDA graph.
    """
    group = pid // GROUP_SIZE
    num_groups = tl.cdiv(num_partials, GROUP_SIZE)
    group_len = tl.minimum(GROUP_SIZE, num_partials - group * GROUP_SIZE)
    tl.debug_barrier()
    if tl.atomic_add(COUNTERS + 1 + group, 1, sem="acq_rel", scope="gpu") == group_len - 1:
        tl.atomic_xchg(COUNTERS + 1 + group, 0, sem="relaxed", scope="gpu")
        if num_groups == 1:
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                acc = _group_sum(PARTIAL, group, num_partials, N, cols, cols < N, GROUP_SIZE)
                tl.store(DW + cols, round_to(acc, DW.dtype.element_ty), mask=cols < N)
        else:
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                acc = _group_sum(PARTIAL, group, num_partials, N, cols, cols < N, GROUP_SIZE)
                tl.store(GROUP_SUM + group * N + cols, acc, mask=cols < N)
            tl.debug_barrier()
            if tl.atomic_add(COUNTERS, 1, sem="acq_rel", scope="gpu") == num_groups - 1:
                tl.atomic_xchg(COUNTERS, 0, sem="relaxed", scope="gpu")
                for start in range(0, N, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < N
                    total = tl.load(GROUP_SUM + cols, mask=mask, other=0.0, cache_modifier=".cg")
                    for g in range(1, num_groups):
                        total += tl.load(GROUP_SUM + g * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(DW + cols, round_to(total, DW.dtype.element_ty), mask=mask)


@triton.jit
def _combine_columns(PARTIAL, DW, block, num_partials, N, GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """dW at column block ``block``: the same order as _finish_dw (group sums from the first
    row, then the group sums from the first group), so the same bits."""
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = _group_sum(PARTIAL, 0, num_partials, N, cols, mask, GROUP_SIZE)
    for g in range(1, tl.cdiv(num_partials, GROUP_SIZE)):
        total += _group_sum(PARTIAL, g, num_partials, N, cols, mask, GROUP_SIZE)
    tl.store(DW + cols, round_to(total, DW.dtype.element_ty), mask=mask)


@triton.jit
def _combine_when_done(PARTIAL, COUNTERS, DW, block, num_partials, num_blocks, N,
                       GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """The "columns" combine, run by the program holding ticket ``num_partials + block``:
    wait until every partial program has counted its row in COUNTERS[1], then sum the
    partials at this block's columns. The waiting cannot deadlock: tickets are drawn in
    order, so every partial ticket went to a program that is already running. The last
    combine program to finish resets the three counters (tickets, partial rows, finished
    combine programs), leaving them zero for the next call."""
    while tl.atomic_add(COUNTERS + 1, 0, sem="acquire", scope="gpu") < num_partials:
        pass
    tl.debug_barrier()  # every thread's loads of the partials after the acquire
    _combine_columns(PARTIAL, DW, block, num_partials, N, GROUP_SIZE, BLOCK)
    tl.debug_barrier()
    if tl.atomic_add(COUNTERS + 2, 1, sem="acq_rel", scope="gpu") == num_blocks - 1:
        for c in tl.static_range(3):
            tl.atomic_xchg(COUNTERS + c, 0, sem="relaxed", scope="gpu")


@triton.jit
def dw_combine_kernel(PARTIAL, DW, num_partials, N, GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """The separate-launch combine, one program per column block."""
    _combine_columns(PARTIAL, DW, tl.program_id(0), num_partials, N, GROUP_SIZE, BLOCK)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT: tl.constexpr, CACHE: tl.constexpr):
    """g = dy * (w + weight_offset) at cols, in fp32. The weight is re-read per tile (an L1
    hit) in the tile's own layout: hoisted out of the row loop it cost N=4096 85% -> 71% of
    copy bandwidth on H200. CACHE is the load's cache modifier."""
    g = to_f32(dy)
    if HAS_WEIGHT:
        g = g * (to_f32(tl.load(W + cols, mask=cols < N, other=0.0, cache_modifier=CACHE)) + weight_offset)
    return g


@triton.jit
def _bwd_row_sums(x, g, JOINT_REDUCE: tl.constexpr):
    """Per-row sums of x^2 and g*x. With JOINT_REDUCE they share one reduction: one round of
    cross-warp synchronisation per row instead of two."""
    if JOINT_REDUCE:
        sq, gx = tl.reduce((x * x, g * x), 1, _add_pair)
    else:
        sq = tl.sum(x * x, axis=1)
        gx = tl.sum(g * x, axis=1)
    return sq, gx


@triton.jit
def _store_dx(x, dy, g, inv, c, DX, DRES, offs, mask, HAS_DRES: tl.constexpr):
    """DX[offs] = inv * (g - x * inv * c) (+ DRES[offs]) of one piece; returns dy * x_hat."""
    dx = inv * (g - x * inv * c)
    if HAS_DRES:
        dx += to_f32(tl.load(DRES + offs, mask=mask, other=0.0))
    tl.store(DX + offs, round_to(dx, DX.dtype.element_ty), mask=mask)
    return dy * x * inv


@triton.jit
def _bwd_tile(x, dy, offs, mask, cols, xt, dyt, toffs, tmask, tcols, W, DX, DRES, N, eps, weight_offset,
              HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, JOINT_REDUCE: tl.constexpr, TAIL_N: tl.constexpr,
              RELOAD_WEIGHT: tl.constexpr):
    """dx for a loaded tile of rows that fit in one chunk, as one piece (x, dy at offs) or,
    with TAIL_N, two (the tail's xt, dyt at toffs; see NormConfig.bwd_tail_n). Returns
    dy * x_hat for dW, per piece (the tail's is the head's when there is no tail).

    With RELOAD_WEIGHT, g = dy * w is formed twice, for the row sums and for dx, from two
    reads of the weight, so it is not held in registers across the reductions. The second
    read has another cache modifier (".ca", which is what a plain load does anyway) so that
    the compiler cannot merge the two."""
    x = to_f32(x)
    dy = to_f32(dy)
    g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, "")
    sq, gx = _bwd_row_sums(x, g, JOINT_REDUCE)
    if TAIL_N > 0:
        xt = to_f32(xt)
        dyt = to_f32(dyt)
        gt = _weighted_grad(dyt, W, tcols, N, weight_offset, HAS_WEIGHT, "")
        sq_t, gx_t = _bwd_row_sums(xt, gt, JOINT_REDUCE)
        sq += sq_t
        gx += gx_t
    inv = inv_rms(sq, N, eps)[:, None]
    c = (gx / N)[:, None] * inv
    if RELOAD_WEIGHT:
        g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, ".ca")
    dw = _store_dx(x, dy, g, inv, c, DX, DRES, offs, mask, HAS_DRES)
    dw_t = dw
    if TAIL_N > 0:
        if RELOAD_WEIGHT:
            gt = _weighted_grad(dyt, W, tcols, N, weight_offset, HAS_WEIGHT, ".ca")
        dw_t = _store_dx(xt, dyt, gt, inv, c, DX, DRES, toffs, tmask, HAS_DRES)
    return dw, dw_t


@triton.jit
def _load_piece(X, DY, rows, row_end, cols, N):
    """x and dy of one piece of a tile: rows [ROWS] (masked from row_end), cols [1, W]."""
    mask = (rows < row_end)[:, None] & (cols < N)
    offs = rows.to(tl.int64)[:, None] * N + cols
    return tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0), offs, mask


@triton.jit
def _load_tile(X, DY, rows, row_end, cols, tcols, N, TAIL_N: tl.constexpr):
    """_load_piece for a tile's head piece (cols) and its tail (tcols); without a tail
    (TAIL_N == 0) the tail's values are the head's, and unused."""
    x, dy, offs, mask = _load_piece(X, DY, rows, row_end, cols, N)
    xt, dyt, toffs, tmask = x, dy, offs, mask
    if TAIL_N > 0:
        xt, dyt, toffs, tmask = _load_piece(X, DY, rows, row_end, tcols, N)
    return x, dy, offs, mask, xt, dyt, toffs, tmask


@triton.jit
def _store_dw_piece(DW, partial_row, dw_acc, first_col, N, num_partials, TREE: tl.constexpr):
    """The column sums of dw_acc ([ROWS, W] fp32, columns first_col onwards) into the
    program's partial row, or into dW itself when TREE and there is one partial."""
    w_cols = first_col + tl.arange(0, dw_acc.shape[1])
    if TREE and num_partials == 1:
        tl.store(DW + w_cols, round_to(tl.sum(dw_acc, axis=0), DW.dtype.element_ty), mask=w_cols < N)
    else:
        tl.store(partial_row + w_cols, tl.sum(dw_acc, axis=0), mask=w_cols < N)


@triton.jit
def _bwd_rows(DY, X, W, DX, DRES, PARTIAL, DW, pid, n_rows, N, rows_per_partial, num_partials, eps, weight_offset,
              BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
              HAS_DRES: tl.constexpr, TREE: tl.constexpr, PREFETCH: tl.constexpr, JOINT_REDUCE: tl.constexpr,
              RELOAD_WEIGHT: tl.constexpr):
    """dx for partial ``pid``'s rows (rows of one chunk) and, with HAS_WEIGHT, its partial
    row PARTIAL[pid] of dW (dW itself when TREE and there is one partial)."""
    row_start = pid * rows_per_partial
    row_end = tl.minimum(row_start + rows_per_partial, n_rows)  # masks, never a loop bound
    tile_rows = tl.arange(0, ROWS)
    partial_row = PARTIAL + pid.to(tl.int64) * N
    # The head piece (the whole tile without a tail), and the tail's columns after it.
    cols = tl.arange(0, BLOCK_N // 2 if TAIL_N > 0 else BLOCK_N)[None, :]
    dw_acc = tl.zeros([ROWS, cols.shape[1]], dtype=tl.float32)
    tcols = cols
    dw_acc_t = dw_acc
    if TAIL_N > 0:
        tcols = BLOCK_N // 2 + tl.arange(0, TAIL_N)[None, :]
        dw_acc_t = tl.zeros([ROWS, TAIL_N], dtype=tl.float32)
    rows = row_start + tile_rows
    if PREFETCH:
        # Software pipelining by hand: the next tile's loads are issued before this
        # tile's reductions, so each program keeps two tiles of x and dy in flight.
        x, dy, offs, mask, xt, dyt, toffs, tmask = _load_tile(X, DY, rows, row_end, cols, tcols, N, TAIL_N)
        for r0 in range(ROWS, rows_per_partial + ROWS, ROWS):
            nx, ndy, noffs, nmask, nxt, ndyt, ntoffs, ntmask = _load_tile(X, DY, rows + r0, row_end, cols,
                                                                          tcols, N, TAIL_N)
            dw, dw_t = _bwd_tile(x, dy, offs, mask, cols, xt, dyt, toffs, tmask, tcols, W, DX, DRES, N, eps,
                                 weight_offset, HAS_WEIGHT, HAS_DRES, JOINT_REDUCE, TAIL_N, RELOAD_WEIGHT)
            dw_acc += dw
            x, dy, offs, mask = nx, ndy, noffs, nmask
            if TAIL_N > 0:
                dw_acc_t += dw_t
                xt, dyt, toffs, tmask = nxt, ndyt, ntoffs, ntmask
    else:
        for r0 in range(0, rows_per_partial, ROWS):
            x, dy, offs, mask, xt, dyt, toffs, tmask = _load_tile(X, DY, rows + r0, row_end, cols, tcols, N,
                                                                  TAIL_N)
            dw, dw_t = _bwd_tile(x, dy, offs, mask, cols, xt, dyt, toffs, tmask, tcols, W, DX, DRES, N, eps,
                                 weight_offset, HAS_WEIGHT, HAS_DRES, JOINT_REDUCE, TAIL_N, RELOAD_WEIGHT)
            dw_acc += dw
            if TAIL_N > 0:
                dw_acc_t += dw_t
    if HAS_WEIGHT:
        _store_dw_piece(DW, partial_row, dw_acc, 0, N, num_partials, TREE)
        if TAIL_N > 0:
            _store_dw_piece(DW, partial_row, dw_acc_t, BLOCK_N // 2, N, num_partials, TREE)


# Row counts are not specialised: one compiled kernel per (N, dtype, combine mode) serves
# every M (the modes reduce rows in the same layouts, so dx has the same bits in each).
@triton.jit(do_not_specialize=["n_rows", "rows_per_partial", "num_partials", "num_combine_programs"])
def rms_norm_bwd_kernel(
    DY, X, W, DX, DRES, PARTIAL, GROUP_SUM, COUNTERS, DW,
    n_rows, N, rows_per_partial, num_partials, num_combine_programs, eps, weight_offset,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, COMBINE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, PREFETCH: tl.constexpr, JOINT_REDUCE: tl.constexpr, RELOAD_WEIGHT: tl.constexpr,
    COMBINE_BLOCK: tl.constexpr,
):
    """DX = d rms_norm(X) / dX applied to DY (+ DRES, the gradient arriving on residual_out).
    With HAS_WEIGHT, partial program p also writes PARTIAL[p] = sum over its rows of
    DY * x_hat, and COMBINE (COMBINE_LAUNCH, COMBINE_TREE or COMBINE_COLUMNS) says which
    programs reduce the partials into DW."""
    if COMBINE == COMBINE_COLUMNS:
        # Roles by ticket, not program id (see _combine_when_done).
        pid = tl.atomic_add(COUNTERS, 1, sem="relaxed", scope="gpu")
    else:
        pid = tl.program_id(0)
    if pid < num_partials:
        _bwd_rows(DY, X, W, DX, DRES, PARTIAL, DW, pid, n_rows, N, rows_per_partial, num_partials, eps,
                  weight_offset, BLOCK_N, TAIL_N, ROWS, HAS_WEIGHT, HAS_DRES, COMBINE == COMBINE_TREE,
                  PREFETCH, JOINT_REDUCE, RELOAD_WEIGHT)
        if COMBINE == COMBINE_TREE and num_partials > 1:
            _finish_dw(PARTIAL, GROUP_SUM, COUNTERS, DW, pid, num_partials, N, GROUP_SIZE, BLOCK_N)
        if COMBINE == COMBINE_COLUMNS:
            tl.debug_barrier()
            tl.atomic_add(COUNTERS + 1, 1, sem="release", scope="gpu")
    elif COMBINE == COMBINE_COLUMNS:  # only a "columns" grid has programs beyond the partials
        _combine_when_done(PARTIAL, COUNTERS, DW, pid - num_partials, num_partials, num_combine_programs, N,
                           GROUP_SIZE, COMBINE_BLOCK)


# ---------------------------------------------------------------------------------------
# Backward of chunked rows (N > _MAX_REGISTER_ROW_ELEMS)
#
# A row too long for registers needs its sums of x^2 and g*x before any of its dx, but each
# column's dx and dW term needs only that column. So the work goes to programs per (partial,
# chunk) in three launches: each chunk's two sums per row, each row's totals (added in chunk
# order), then dx per chunk with the partial's dW terms held in registers across its rows.
# x and dy are still read twice, but no fp32 partial row goes through memory per row: one
# program per row-partial used to add each row's dW terms into its partial row in memory, a
# 256 KiB read and write per bf16 row of 65536 (31% of copy bandwidth on H200, M=16384; now
# 59%). The partials are summed by the separate combine launch (DwPlan says why).


@triton.jit(do_not_specialize=["n_rows", "rows_per_partial"])
def rms_norm_bwd_chunk_sums_kernel(DY, X, W, CHUNK_SUMS, n_rows, N, rows_per_partial, weight_offset,
                                   BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """CHUNK_SUMS[row, c] = (sum of x^2, sum of g*x) over chunk c's columns, g = dy * (w +
    weight_offset), for the rows of partial program_id(0) and c = program_id(1).
    CHUNK_SUMS is [n_rows, NUM_CHUNKS, 2] fp32."""
    chunk = tl.program_id(1)
    row_start = tl.program_id(0) * rows_per_partial
    row_end = tl.minimum(row_start + rows_per_partial, n_rows)
    rows = row_start + tl.arange(0, 1)
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    x, dy, _, _ = _load_piece(X, DY, rows, row_end, cols, N)
    for r in range(1, rows_per_partial + 1):  # row r - 1, with row r's loads in flight
        nx, ndy, _, _ = _load_piece(X, DY, rows + r, row_end, cols, N)
        g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, "")
        sq, gx = _bwd_row_sums(to_f32(x), g, False)  # single 8 KiB rows: see _BWD_TWO_REDUCTION_BLOCK_N
        out = CHUNK_SUMS + ((rows + r - 1).to(tl.int64) * NUM_CHUNKS + chunk) * 2
        tl.store(out, sq, mask=rows + r - 1 < row_end)
        tl.store(out + 1, gx, mask=rows + r - 1 < row_end)
        x, dy = nx, ndy


@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_bwd_row_stats_kernel(CHUNK_SUMS, ROW_STATS, n_rows, N, eps, NUM_CHUNKS: tl.constexpr,
                                  BLOCK: tl.constexpr):
    """ROW_STATS[row] = (inv_rms, mean(g * x) * inv_rms) from the row's CHUNK_SUMS, added in
    chunk order: elementwise over a block of rows, so in that order whatever the layout."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    sums = CHUNK_SUMS + rows.to(tl.int64) * (NUM_CHUNKS * 2)
    sq = tl.load(sums, mask=mask, other=0.0)
    gx = tl.load(sums + 1, mask=mask, other=0.0)
    for c in range(1, NUM_CHUNKS):
        sq += tl.load(sums + 2 * c, mask=mask, other=0.0)
        gx += tl.load(sums + 2 * c + 1, mask=mask, other=0.0)
    inv = inv_rms(sq, N, eps)
    tl.store(ROW_STATS + 2 * rows, inv, mask=mask)
    tl.store(ROW_STATS + 2 * rows + 1, gx / N * inv, mask=mask)


@triton.jit
def _load_row_stats(ROW_STATS, rows, row_end):
    """inv_rms and mean(g * x) * inv_rms of rows [ROWS] (zero from row_end on), as [ROWS, 1]."""
    mask = rows < row_end
    ptr = ROW_STATS + 2 * rows.to(tl.int64)
    return tl.load(ptr, mask=mask, other=0.0)[:, None], tl.load(ptr + 1, mask=mask, other=0.0)[:, None]


@triton.jit(do_not_specialize=["n_rows", "rows_per_partial", "num_partials"])
def rms_norm_bwd_chunks_kernel(DY, X, W, DX, DRES, ROW_STATS, PARTIAL, DW,
                               n_rows, N, rows_per_partial, num_partials, weight_offset,
                               BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr,
                               TREE: tl.constexpr):
    """dx at chunk c = program_id(1) of the rows of partial p = program_id(0) (+ DRES), and
    with HAS_WEIGHT chunk c of PARTIAL[p], or of dW itself when TREE and there is one
    partial (DwPlan "tree"); more partials are combined by dw_combine_kernel."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    row_start = pid * rows_per_partial
    row_end = tl.minimum(row_start + rows_per_partial, n_rows)
    rows = row_start + tl.arange(0, 1)
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    dw_acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    x, dy, offs, mask = _load_piece(X, DY, rows, row_end, cols, N)
    inv, c = _load_row_stats(ROW_STATS, rows, row_end)
    for r in range(1, rows_per_partial + 1):  # row r - 1, with row r's loads in flight
        nx, ndy, noffs, nmask = _load_piece(X, DY, rows + r, row_end, cols, N)
        ninv, nc = _load_row_stats(ROW_STATS, rows + r, row_end)
        g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, "")
        dw_acc += _store_dx(to_f32(x), to_f32(dy), g, inv, c, DX, DRES, offs, mask, HAS_DRES)
        x, dy, offs, mask, inv, c = nx, ndy, noffs, nmask, ninv, nc
    if HAS_WEIGHT:
        _store_dw_piece(DW, PARTIAL + pid.to(tl.int64) * N, dw_acc, chunk * BLOCK_N, N, num_partials, TREE)


_dw_counters: dict[torch.device, torch.Tensor] = {}


def _dw_counters_for(device: torch.device, max_groups: int) -> torch.Tensor:
    """Zeroed int32 counters for the in-kernel dW combine, one set per device.

    The kernels leave them at zero, so they are allocated once and reused by every later
    call, eager or inside CUDA graphs. Consequences: backward calls that combine dW in the
    kernel must not run concurrently on two streams of one device (two graphs replayed at
    once included): with the tree they would compute a wrong dW, with the column programs
    (``DwPlan.combine == "columns"``) they can also skip dx rows or hang the GPU, as one
    call's reset can hide the other's partial count from its waiting programs. And the
    first such call on a device must not be under graph capture (memory allocated there
    would belong to the graph and be zeroed only by its replays).
    """
    counters = _dw_counters.get(device)
    if counters is None or counters.numel() < max_groups + 1:
        if not INTERPRETER and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "tpfuse.rms_norm backward: the first in-kernel dW reduction on "
                f"{device} ran under CUDA graph capture; run one backward eagerly (e.g. the "
                "usual warm-up iteration) before capturing, so its counters are allocated outside "
                "the graph")
        counters = torch.zeros(max_groups + 1, dtype=torch.int32, device=device)
        _dw_counters[device] = counters
    return counters


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    dx: torch.Tensor,
    dweight: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    dresidual_out: torch.Tensor | None = None,
    fused_combine: bool = True,
) -> None:
    """Launch the backward on 2-D contiguous aligned operands; writes dx and dweight.

    dW is combined as ``DwPlan.combine`` says (inside the backward launch, or by the
    column-parallel ``dw_combine_kernel`` launch after it), or with ``fused_combine=False``
    always by that launch (the same bits; the benchmark compares the two).
    """
    if (weight is None) != (dweight is None):
        raise ValueError("rms_norm_bwd: weight and dweight go together")
    n_rows, n = x.shape
    if dweight is not None and n_rows == 0:
        dweight.zero_()
    if n_rows == 0:
        return
    cfg = NormConfig.from_shape(n, x.dtype)
    plan = DwPlan.from_shape(n_rows, n, x.dtype)
    has_weight = weight is not None
    # Whether dW is summed (or, with one partial, stored) by the backward's own programs.
    fused = has_weight and fused_combine and plan.combine != "launch"
    partial = torch.empty((plan.num_partials, n), dtype=torch.float32, device=x.device) if has_weight else dx
    operands = dict(DY=dy, X=x, W=weight if has_weight else x, DX=dx,
                    DRES=dresidual_out if dresidual_out is not None else dx, PARTIAL=partial,
                    DW=dweight if has_weight else dx)
    if cfg.num_chunks > 1:
        fused = fused and plan.num_partials == 1  # chunked rows only store a single partial as dW
        _rms_norm_bwd_chunked(cfg, plan, operands, n_rows, n, eps, weight_offset, has_weight,
                              dresidual_out is not None, fused)
    else:
        combine = COMBINE_LAUNCH
        if fused:
            combine = COMBINE_TREE if plan.combine == "tree" else COMBINE_COLUMNS
        group_sum = counters = dx
        if combine == COMBINE_TREE:
            group_sum = torch.empty((plan.num_groups, n), dtype=torch.float32, device=x.device)
        if combine != COMBINE_LAUNCH:
            counters = _dw_counters_for(x.device, triton.cdiv(_MAX_DW_PARTIALS, _DW_GROUP_SIZE))
        # A "columns" combine runs its column programs after the partials, in the same launch.
        grid = plan.num_partials + (plan.num_combine_programs if combine == COMBINE_COLUMNS else 0)
        rms_norm_bwd_kernel[(grid,)](
            **operands, GROUP_SUM=group_sum, COUNTERS=counters,
            n_rows=n_rows, N=n, rows_per_partial=plan.rows_per_partial, num_partials=plan.num_partials,
            num_combine_programs=plan.num_combine_programs, eps=eps, weight_offset=weight_offset,
            BLOCK_N=cfg.block_n, TAIL_N=cfg.bwd_tail_n, ROWS=cfg.bwd_rows,
            HAS_WEIGHT=has_weight, HAS_DRES=dresidual_out is not None, COMBINE=combine.value,
            GROUP_SIZE=plan.group_size, PREFETCH=cfg.bwd_prefetch, JOINT_REDUCE=cfg.bwd_joint_reduce,
            RELOAD_WEIGHT=cfg.bwd_reload_weight,
            COMBINE_BLOCK=_COMBINE_BLOCK, num_warps=cfg.bwd_num_warps, **EXACT_FP,
        )
    if has_weight and not fused:
        dw_combine_kernel[(plan.num_combine_programs,)](
            PARTIAL=partial, DW=dweight, num_partials=plan.num_partials, N=n,
            GROUP_SIZE=plan.group_size, BLOCK=_COMBINE_BLOCK, num_warps=4, **EXACT_FP,
        )


_ROW_STATS_BLOCK = 1024  # rows per program of rms_norm_bwd_row_stats_kernel


def _rms_norm_bwd_chunked(cfg: NormConfig, plan: DwPlan, operands: dict, n_rows: int, n: int, eps: float,
                          weight_offset: float, has_weight: bool, has_dres: bool, tree: bool) -> None:
    """The three launches of the chunked rows' backward (see rms_norm_bwd_chunks_kernel);
    with ``tree`` (DwPlan "tree": one partial) the last stores dW itself."""
    x = operands["X"]
    chunk_sums = torch.empty((n_rows, cfg.num_chunks, 2), dtype=torch.float32, device=x.device)
    row_stats = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)
    grid = (plan.num_partials, cfg.num_chunks)
    rms_norm_bwd_chunk_sums_kernel[grid](
        DY=operands["DY"], X=x, W=operands["W"], CHUNK_SUMS=chunk_sums, n_rows=n_rows, N=n,
        rows_per_partial=plan.rows_per_partial, weight_offset=weight_offset,
        BLOCK_N=cfg.block_n, NUM_CHUNKS=cfg.num_chunks, HAS_WEIGHT=has_weight,
        num_warps=_CHUNKED_BWD_WARPS, **EXACT_FP,
    )
    rms_norm_bwd_row_stats_kernel[(triton.cdiv(n_rows, _ROW_STATS_BLOCK),)](
        CHUNK_SUMS=chunk_sums, ROW_STATS=row_stats, n_rows=n_rows, N=n, eps=eps,
        NUM_CHUNKS=cfg.num_chunks, BLOCK=_ROW_STATS_BLOCK, num_warps=4, **EXACT_FP,
    )
    rms_norm_bwd_chunks_kernel[grid](
        **operands, ROW_STATS=row_stats, n_rows=n_rows, N=n, rows_per_partial=plan.rows_per_partial,
        num_partials=plan.num_partials, weight_offset=weight_offset, BLOCK_N=cfg.block_n,
        HAS_WEIGHT=has_weight, HAS_DRES=has_dres, TREE=tree, num_warps=_CHUNKED_BWD_WARPS, **EXACT_FP,
    )
