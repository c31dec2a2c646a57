"""RMSNorm backward of chunked rows (N > 16384, ``NormConfig.bwd_num_chunks > 1``).

A row too long for registers needs its sums of x^2 and g*x before any of its dx, but each
column's dx and dW term needs only that column. So the work goes to programs per (partial,
chunk) in three launches: each chunk's two sums per row, each row's totals (added in chunk
order), then dx per chunk with the partial's dW terms held in registers across its rows.
x and dy are still read twice, but no fp32 partial row goes through memory per row: one
program per row-partial used to add each row's dW terms into its partial row in memory, a
256 KiB read and write per bf16 row of 65536 (31% of copy bandwidth on H200, M=16384; now
59%). The partials are summed by the separate combine launch (DwPlan says why).

``norm_bwd.rms_norm_bwd`` runs these launches (``_rms_norm_bwd_chunked``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, to_f32
from tpfuse.kernels.norm import NormConfig, inv_rms
from tpfuse.kernels.norm_bwd_common import _bwd_row_sums, _load_piece, _store_dx, _weighted_grad
from tpfuse.kernels.norm_dw import DwPlan, _store_dw_piece

_CHUNKED_BWD_WARPS = 8  # per (partial, chunk) program; DwPlan sets the number of programs
_ROW_STATS_BLOCK = 1024  # rows per program of rms_norm_bwd_row_stats_kernel


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
        g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, "", PER_ROW=False)
        sq, gx = _bwd_row_sums(to_f32(x), g, False)  # single 8 KiB rows: see norm._BWD_TWO_REDUCTION_BLOCK_N
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
        g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, "", PER_ROW=False)
        dw_acc += _store_dx(to_f32(x), to_f32(dy), g, inv, c, DX, DRES, offs, mask, HAS_DRES)
        x, dy, offs, mask, inv, c = nx, ndy, noffs, nmask, ninv, nc
    if HAS_WEIGHT:
        _store_dw_piece(DW, PARTIAL + pid.to(tl.int64) * N, dw_acc, chunk * BLOCK_N, N, num_partials, TREE)


def _rms_norm_bwd_chunked(cfg: NormConfig, plan: DwPlan, operands: dict, n_rows: int, n: int, eps: float,
                          weight_offset: float, has_weight: bool, has_dres: bool, tree: bool) -> None:
    """The three launches of the chunked rows' backward (see rms_norm_bwd_chunks_kernel);
    with ``tree`` (DwPlan "tree": one partial) the last stores dW itself."""
    x = operands["X"]
    chunk_sums = torch.empty((n_rows, cfg.bwd_num_chunks, 2), dtype=torch.float32, device=x.device)
    row_stats = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)
    grid = (plan.num_partials, cfg.bwd_num_chunks)
    rms_norm_bwd_chunk_sums_kernel[grid](
        DY=operands["DY"], X=x, W=operands["W"], CHUNK_SUMS=chunk_sums, n_rows=n_rows, N=n,
        rows_per_partial=plan.rows_per_partial, weight_offset=weight_offset,
        BLOCK_N=cfg.bwd_block_n, NUM_CHUNKS=cfg.bwd_num_chunks, HAS_WEIGHT=has_weight,
        num_warps=_CHUNKED_BWD_WARPS, **EXACT_FP,
    )
    rms_norm_bwd_row_stats_kernel[(triton.cdiv(n_rows, _ROW_STATS_BLOCK),)](
        CHUNK_SUMS=chunk_sums, ROW_STATS=row_stats, n_rows=n_rows, N=n, eps=eps,
        NUM_CHUNKS=cfg.bwd_num_chunks, BLOCK=_ROW_STATS_BLOCK, num_warps=4, **EXACT_FP,
    )
    rms_norm_bwd_chunks_kernel[grid](
        **operands, ROW_STATS=row_stats, n_rows=n_rows, N=n, rows_per_partial=plan.rows_per_partial,
        num_partials=plan.num_partials, weight_offset=weight_offset, BLOCK_N=cfg.bwd_block_n,
        HAS_WEIGHT=has_weight, HAS_DRES=has_dres, TREE=tree, num_warps=_CHUNKED_BWD_WARPS, **EXACT_FP,
    )
