"""RMSNorm backward: the launcher ``rms_norm_bwd``, and the kernel for rows held in registers.

``rms_norm_bwd`` writes dx (+ the gradient arriving on residual_out) and dW. Rows of up to
16384 elements (``NormConfig.bwd_num_chunks == 1``) are done here by ``rms_norm_bwd_kernel``: a
program per dW partial, over tiles of ``NormConfig.bwd_rows`` rows (or one row in two
pieces, ``bwd_tail_n``), whose programs also combine dW when ``DwPlan`` says so
(``norm_dw``). Longer rows go to ``norm_bwd_chunked``; the math on a loaded piece of rows,
which both use, is in ``norm_bwd_common``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, TRITON_DIVISIBILITY, to_f32
from tpfuse.kernels.norm import NormConfig, bwd_num_warps, inv_rms, warps_take_rows
from tpfuse.kernels.norm_bwd_chunked import _rms_norm_bwd_chunked
from tpfuse.kernels.norm_bwd_common import _bwd_row_sums, _load_piece, _store_dx, _weighted_grad
from tpfuse.kernels.norm_dw import (DwPlan, _combine_when_done, _dw_counters_for, _finish_dw, _store_dw_piece,
                                    dw_combine)

# Where the backward kernel's dW partials are combined (its COMBINE argument): by a separate
# dw_combine_kernel launch, or inside the launch as DwPlan.combine says.
COMBINE_LAUNCH = tl.constexpr(0)
COMBINE_TREE = tl.constexpr(1)
COMBINE_COLUMNS = tl.constexpr(2)


@triton.jit
def _bwd_tile(x, dy, offs, mask, cols, xt, dyt, toffs, tmask, tcols, W, DX, DRES, N, eps, weight_offset,
              HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, JOINT_REDUCE: tl.constexpr, TAIL_N: tl.constexpr,
              RELOAD_WEIGHT: tl.constexpr, WEIGHT_PER_ROW: tl.constexpr):
    """dx for a loaded tile of rows that fit in one chunk, as one piece (x, dy at offs) or,
    with TAIL_N, two (the tail's xt, dyt at toffs; see NormConfig.bwd_tail_n). Returns
    dy * x_hat for dW, per piece (the tail's is the head's when there is no tail).

    With RELOAD_WEIGHT, g = dy * w is formed twice, for the row sums and for dx, from two
    reads of the weight, so it is not held in registers across the reductions. The second
    read has another cache modifier (".ca", which is what a plain load does anyway) so that
    the compiler cannot merge the two."""
    x = to_f32(x)
    dy = to_f32(dy)
    g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, "", WEIGHT_PER_ROW)
    sq, gx = _bwd_row_sums(x, g, JOINT_REDUCE)
    if TAIL_N > 0:
        xt = to_f32(xt)
        dyt = to_f32(dyt)
        gt = _weighted_grad(dyt, W, tcols, N, weight_offset, HAS_WEIGHT, "", WEIGHT_PER_ROW)
        sq_t, gx_t = _bwd_row_sums(xt, gt, JOINT_REDUCE)
        sq += sq_t
        gx += gx_t
    inv = inv_rms(sq, N, eps)[:, None]
    c = (gx / N)[:, None] * inv
    if RELOAD_WEIGHT:
        g = _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT, ".ca", WEIGHT_PER_ROW)
    dw = _store_dx(x, dy, g, inv, c, DX, DRES, offs, mask, HAS_DRES)
    dw_t = dw
    if TAIL_N > 0:
        if RELOAD_WEIGHT:
            gt = _weighted_grad(dyt, W, tcols, N, weight_offset, HAS_WEIGHT, ".ca", WEIGHT_PER_ROW)
        dw_t = _store_dx(xt, dyt, gt, inv, c, DX, DRES, toffs, tmask, HAS_DRES)
    return dw, dw_t


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
def _bwd_rows(DY, X, W, DX, DRES, PARTIAL, DW, pid, n_rows, N, rows_per_partial, num_partials, eps, weight_offset,
              BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
              HAS_DRES: tl.constexpr, TREE: tl.constexpr, PREFETCH: tl.constexpr, JOINT_REDUCE: tl.constexpr,
              RELOAD_WEIGHT: tl.constexpr, WEIGHT_PER_ROW: tl.constexpr):
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
                                 weight_offset, HAS_WEIGHT, HAS_DRES, JOINT_REDUCE, TAIL_N, RELOAD_WEIGHT,
                                 WEIGHT_PER_ROW)
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
                                 weight_offset, HAS_WEIGHT, HAS_DRES, JOINT_REDUCE, TAIL_N, RELOAD_WEIGHT,
                                 WEIGHT_PER_ROW)
            dw_acc += dw
            if TAIL_N > 0:
                dw_acc_t += dw_t
    if HAS_WEIGHT:
        _store_dw_piece(DW, partial_row, dw_acc, 0, N, num_partials, TREE)
        if TAIL_N > 0:
            _store_dw_piece(DW, partial_row, dw_acc_t, BLOCK_N // 2, N, num_partials, TREE)


# Row counts are not specialised: one compiled kernel per (N, dtype, combine mode, warps) serves
# every M (the modes, and the warp counts bwd_num_warps picks by M, reduce rows in the same
# layouts, so dx has the same bits in each).
@triton.jit(do_not_specialize=["n_rows", "rows_per_partial", "num_partials", "num_combine_programs"])
def rms_norm_bwd_kernel(
    DY, X, W, DX, DRES, PARTIAL, GROUP_SUM, COUNTERS, DW,
    n_rows, N, rows_per_partial, num_partials, num_combine_programs, eps, weight_offset,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, COMBINE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, PREFETCH: tl.constexpr, JOINT_REDUCE: tl.constexpr, RELOAD_WEIGHT: tl.constexpr,
    WEIGHT_PER_ROW: tl.constexpr, COMBINE_BLOCK: tl.constexpr,
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
                  PREFETCH, JOINT_REDUCE, RELOAD_WEIGHT, WEIGHT_PER_ROW)
        if COMBINE == COMBINE_TREE and num_partials > 1:
            _finish_dw(PARTIAL, GROUP_SUM, COUNTERS, DW, pid, num_partials, N, GROUP_SIZE, BLOCK_N)
        if COMBINE == COMBINE_COLUMNS:
            tl.debug_barrier()
            tl.atomic_add(COUNTERS + 1, 1, sem="release", scope="gpu")
    elif COMBINE == COMBINE_COLUMNS:  # only a "columns" grid has programs beyond the partials
        _combine_when_done(PARTIAL, COUNTERS, DW, pid - num_partials, num_partials, num_combine_programs, N,
                           GROUP_SIZE, COMBINE_BLOCK)


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
    column-parallel ``dw_combine`` launch after it), or with ``fused_combine=False``
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
    if cfg.bwd_num_chunks > 1:
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
            counters = _dw_counters_for(x.device)
        # A "columns" combine runs its column programs after the partials, in the same launch.
        grid = plan.num_partials + (plan.num_combine_programs if combine == COMBINE_COLUMNS else 0)
        # The long-run warps keep each row's layout only on 16-byte vectors (bwd_num_warps).
        tensors = [dy, x, dx] + [t for t in (weight, dresidual_out) if t is not None]
        whole_vectors = (n % TRITON_DIVISIBILITY == 0 and all(t.dtype == x.dtype for t in tensors)
                         and all(t.data_ptr() % 16 == 0 for t in tensors))
        num_warps = bwd_num_warps(cfg, plan.rows_per_partial, whole_vectors)
        rms_norm_bwd_kernel[(grid,)](
            **operands, GROUP_SUM=group_sum, COUNTERS=counters,
            n_rows=n_rows, N=n, rows_per_partial=plan.rows_per_partial, num_partials=plan.num_partials,
            num_combine_programs=plan.num_combine_programs, eps=eps, weight_offset=weight_offset,
            BLOCK_N=cfg.bwd_block_n, TAIL_N=cfg.bwd_tail_n, ROWS=cfg.bwd_rows,
            HAS_WEIGHT=has_weight, HAS_DRES=dresidual_out is not None, COMBINE=combine.value,
            GROUP_SIZE=plan.group_size, PREFETCH=cfg.bwd_prefetch, JOINT_REDUCE=cfg.bwd_joint_reduce,
            RELOAD_WEIGHT=cfg.bwd_reload_weight,
            WEIGHT_PER_ROW=warps_take_rows(cfg.bwd_block_n, num_warps, x.element_size()),
            COMBINE_BLOCK=plan.combine_block, num_warps=num_warps, **EXACT_FP,
        )
    if has_weight and not fused:
        dw_combine(partial, dweight, plan)
