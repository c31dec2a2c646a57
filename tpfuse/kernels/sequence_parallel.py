"""The sequence-parallel boundary: reduce-scatter + residual add + RMSNorm, and all-gather
(and a plain reduce-scatter, the all-gather's backward).

With sequence parallelism a row-parallel layer's all-reduce becomes a reduce-scatter: rank r
gets rows [r * R, (r + 1) * R) of the sum (R = T / W of the T tokens), adds its slice of the
residual stream and normalises it; an all-gather restores the T rows before the next
column-parallel layer. These are the two halves of the fused two-shot kernel
(``tpfuse.kernels.fused``), and keep its bits:

- ``reduce_scatter_norm_kernel``: rank s stores its rows of group g into scatter slot s of
  rank g (the two-shot kernel's first phase); rank g sums its W slots in tree order and
  rounds once, in ``norm_tile`` reading SLOTS = W (the one-shot kernels' way), then adds
  the residual slice and normalises. Every reduced element is the rounded tree-order sum,
  as in every all-reduce of tpfuse, so the rows equal the corresponding rows of
  ``all_reduce_add_rms_norm`` (and of the split composition), and with an fp8 output those
  of its fp8 form.
- ``all_gather_kernel``: rank s stores its R rows into slot s of every rank, then copies the
  W slots into the [T, N] output in rank order.

Both are one phase (store, signal, wait, read), like the one-shot all-reduce: a rank reads
its data region of call k before its call k ends, and a peer writes that region again in
call k + 2, after waiting for this rank's call k + 1 signal, so the two parity regions
suffice without a barrier at the end (docs/design.md, section 8). Slots are the two-shot
scatter slots (``WorkspaceLayout.twoshot_slot_bytes``): R rows of a rank per slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, round_to
from tpfuse.kernels.fused import _copy_rows, poison_outputs
from tpfuse.kernels.norm import norm_tile
from tpfuse.kernels.peer import (PeerContext, begin_collective, flag_row, poison, push_to_peers, sum_in_tree_order,
                                 typed_ptr)
from tpfuse.kernels.quant_fp8 import Fp8Output, zero_scale_padding
from tpfuse.kernels.sync import end_call, signal, wait

# Operation codes of the status record; their names are in allreduce.OP_NAMES.
OP_REDUCE_SCATTER_NORM = tl.constexpr(7)
OP_ALL_GATHER = tl.constexpr(8)

_UNSPECIALISED = ["rows_per_rank", "has_residual", "rank", "timeout_ns", "scale_rows"]


@triton.jit
def _chunk(rows, c, n_rows, N, BLOCK_N: tl.constexpr):
    """Column chunk c of the [ROWS] rows of a [n_rows, N] operand: (mask, element offsets)."""
    ccols = c * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return (rows < n_rows)[:, None] & (ccols < N), rows.to(tl.int64)[:, None] * N + ccols


@triton.jit(do_not_specialize=_UNSPECIALISED)
def reduce_scatter_norm_kernel(
    X, RES, W, Y, RES_OUT, Q, SCALES, scale_rows, rows_per_rank, N, eps, weight_offset, has_residual,
    table_ptr, local, status_addr, rank, timeout_ns, flags_offset, data_offset, data_bytes, slot_elems,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WORLD: tl.constexpr, PEERS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
    HW_E4M3: tl.constexpr, NORM: tl.constexpr,
):
    """X: [W * rows_per_rank, N], this rank's contribution; RES, Y, RES_OUT: [rows_per_rank, N],
    this rank's rows. Block b handles row tiles b, b + grid, ... of every group. Without NORM,
    a plain reduce-scatter: Y = the reduced rows (the all-reduce's bits), nothing else."""
    ELEM: tl.constexpr = X.dtype.element_ty
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(local, status_addr, data_offset, data_bytes,
                                                                      rows_per_rank, ROWS)
    zero_scale_padding(SCALES, rows_per_rank, scale_rows, N, FP8, GROUP)
    for tile in range(pid, n_tiles, grid):
        local_rows = tile * ROWS + tl.arange(0, ROWS)
        for g in tl.static_range(WORLD):
            dst = typed_ptr(tl.load(table_ptr + g), data, ELEM) + rank * slot_elems
            _copy_rows(X, dst, N, g * rows_per_rank + local_rows, local_rows, local_rows < rows_per_rank, BLOCK_N,
                       NUM_CHUNKS)
    signal(table_ptr, flags_offset + (pid * WORLD + rank) * 8, epoch, WORLD, PEERS)
    if wait(flag_row(local, flags_offset, WORLD), ctrl, status, epoch, rank, timeout_ns, OP_REDUCE_SCATTER_NORM,
            WORLD, PEERS):
        slot0 = typed_ptr(local, data, ELEM)
        for tile in range(pid, n_tiles, grid):
            rows = tile * ROWS + tl.arange(0, ROWS)
            if NORM:
                norm_tile(slot0, rows.to(tl.int64) * N, slot_elems, RES, W, Y, RES_OUT, rows, rows < rows_per_rank,
                          N, eps, weight_offset, has_residual, True, Q, SCALES, scale_rows, BLOCK_N, TAIL_N,
                          NUM_CHUNKS, HAS_WEIGHT, WORLD, FP8, GROUP, HW_E4M3)
            else:
                for c in range(NUM_CHUNKS):
                    mask, offs = _chunk(rows, c, rows_per_rank, N, BLOCK_N)
                    tl.store(Y + offs, round_to(sum_in_tree_order(slot0, slot_elems, offs, mask, WORLD), ELEM),
                             mask=mask)
    elif NORM:
        poison_outputs(Y, RES_OUT, Q, SCALES, scale_rows, rows_per_rank, N, FP8, GROUP)
    else:
        poison(Y, rows_per_rank * N)
    end_call(ctrl, epoch)


@triton.jit(do_not_specialize=["rows_per_rank", "rank", "timeout_ns"])
def all_gather_kernel(
    X, OUT, rows_per_rank, N, table_ptr, local, status_addr, rank, timeout_ns, flags_offset, data_offset, data_bytes,
    slot_elems, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, WORLD: tl.constexpr,
    PEERS: tl.constexpr,
):
    """X: [rows_per_rank, N], this rank's rows; OUT: [W * rows_per_rank, N], rank g's rows at
    g * rows_per_rank."""
    ELEM: tl.constexpr = X.dtype.element_ty
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(local, status_addr, data_offset, data_bytes,
                                                                      rows_per_rank, ROWS)
    for tile in range(pid, n_tiles, grid):
        rows = tile * ROWS + tl.arange(0, ROWS)
        for c in range(NUM_CHUNKS):
            mask, offs = _chunk(rows, c, rows_per_rank, N, BLOCK_N)
            push_to_peers(table_ptr, data, tl.load(X + offs, mask=mask), rank * slot_elems + offs, mask, rank, WORLD,
                          True)
    signal(table_ptr, flags_offset + (pid * WORLD + rank) * 8, epoch, WORLD, PEERS)
    if wait(flag_row(local, flags_offset, WORLD), ctrl, status, epoch, rank, timeout_ns, OP_ALL_GATHER, WORLD, PEERS):
        slot0 = typed_ptr(local, data, ELEM)
        for tile in range(pid, n_tiles, grid):
            rows = tile * ROWS + tl.arange(0, ROWS)
            for c in range(NUM_CHUNKS):
                mask, offs = _chunk(rows, c, rows_per_rank, N, BLOCK_N)
                for g in tl.static_range(WORLD):  # unrolled: the W slots' loads are in flight together
                    # written by peers: read through L2, as sum_in_tree_order reads
                    vals = tl.load(slot0 + g * slot_elems + offs, mask=mask, cache_modifier=".cg")
                    tl.store(OUT + (g * rows_per_rank).to(tl.int64) * N + offs, vals, mask=mask)
    else:
        poison(OUT, WORLD * rows_per_rank * N)
    end_call(ctrl, epoch)


def _launch_args(plan, peers: PeerContext, esize: int) -> dict:
    """What both kernels take from the plan (``tpfuse.comm.plan.SequenceParallelPlan``) and
    the workspace."""
    layout, cfg = peers.layout, plan.norm
    return dict(rows_per_rank=plan.rows_per_rank, **peers.kernel_args(), flags_offset=layout.flag_offset(0),
                data_offset=layout.data_offset(0), data_bytes=layout.data_bytes,
                slot_elems=layout.twoshot_slot_bytes // esize, BLOCK_N=cfg.block_n, NUM_CHUNKS=cfg.num_chunks,
                ROWS=cfg.rows, WORLD=layout.world_size, PEERS=triton.next_power_of_2(layout.world_size),
                num_warps=cfg.num_warps)


def reduce_scatter_norm_into(x, weight, residual, y, residual_out, eps: float, weight_offset: float, plan,
                             peers: PeerContext, fp8: Fp8Output | None = None) -> None:
    """Launch the reduce-scatter + (residual add) + RMSNorm over 2-D contiguous, 16-byte
    aligned operands: x [W * R, N]; residual, y, residual_out [R, N] (residual_out may alias
    residual; y None with ``fp8``), R = plan.rows_per_rank. residual_out None: a plain
    reduce-scatter into y (weight, residual and fp8 None)."""
    if (y is None) == (fp8 is None):
        raise ValueError("reduce_scatter_norm_into: exactly one of y and fp8")
    norm = residual_out is not None
    if not norm and (weight is not None or residual is not None or fp8 is not None):
        raise ValueError("reduce_scatter_norm_into: a plain reduce-scatter takes no weight, residual or fp8")
    reduce_scatter_norm_kernel[(plan.grid,)](
        X=x, RES=residual if residual is not None else x, W=weight if weight is not None else x,
        Y=y if y is not None else residual_out, RES_OUT=residual_out if norm else x, N=x.shape[1], eps=eps,
        weight_offset=weight_offset, has_residual=int(residual is not None), TAIL_N=plan.norm.tail_n,
        HAS_WEIGHT=weight is not None, NORM=norm, **_launch_args(plan, peers, x.element_size()),
        **(fp8.kernel_args() if fp8 is not None else Fp8Output.none_args(x)), **EXACT_FP)


def all_gather_into(x, out, plan, peers: PeerContext) -> None:
    """Launch the all-gather of x [R, N] (2-D contiguous, 16-byte aligned) into out [W * R, N]."""
    all_gather_kernel[(plan.grid,)](X=x, OUT=out, N=x.shape[1], **_launch_args(plan, peers, x.element_size()))
