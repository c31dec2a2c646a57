"""RMSNorm backward, dW: the partial rows, their plan (``DwPlan``) and their combine.

Each backward program (``norm_bwd``, ``norm_bwd_chunked``) sums dy * x_hat over its rows
into one fp32 partial row (``_store_dw_piece``), and the partials are summed into dW in a
fixed two-level order, by the backward's own programs (``_finish_dw``, the "tree";
``_combine_when_done``, the "columns") or by a separate launch (``dw_combine``): the same
order in each, so the same bits. ``DwPlan.from_shape`` chooses the partials and the combine
from (M, N, dtype) alone. The in-kernel combines count arrivals in per-device counters
(``_dw_counters_for``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER
from tpfuse.kernels.common import EXACT_FP, round_to
from tpfuse.kernels.norm import NormConfig

# Per-program partial rows, combined in a fixed two-level order (groups of
# _DW_GROUP_SIZE summed in order, then the group sums in order). Their number depends on
# (M, N, dtype) only, never the SM count, so dW has the same bits on every GPU of the arch:
# half the rows, at least 16 (or one per row), at most 256 (chunked rows: at most
# CHUNKED_BWD_PROGRAMS / chunks, at least 1), then rows per partial rounded up to the
# backward tile's. 256 beat 1024 at every swept shape on H200;
# at small M more programs of fewer rows win (bf16, N=16384: M=16 in 16 one-row partials
# 8.2 us, 8 two-row 10.2, 4 four-row 14.6; M=128 in 64 two-row partials 13.8, 128 one-row
# 14.3, 32 four-row 16.4).
# At M <= 4096, rows of 16 KiB or more take at most 128 partials, combined by columns: one
# wave on H200's 132 SMs and half the partial bytes (benchmarks/NOTES.md, 2026-11-24; H200
# bf16, us, 128 partials by columns vs 256 by the rule below: N=8192 M=1024 24.0 vs 32.0,
# M=4096 63.0 vs 72.2; N=16384 M=1024 41.5 vs 51.3, M=4096 121.1 vs 129.9; N=4096 (8 KiB
# rows) gained at M=1024 only, 17.2 vs 18.6, and lost from M=2048). Short calls (below)
# replaced this rule from 257 rows on rows of up to 8192 elements: it serves M <= 256 and
# wider rows.
MAX_DW_PARTIALS = 256
# Short calls, 257 to 4096 rows of up to 8192 elements: up to 1024 rows 128 partials (one
# wave), above it 128 for rows of over 12 KiB and 256 for shorter ones; rows of 8 KiB to
# 20 KiB combined over columns of 256, by the separate launch for 16-bit rows and by in-kernel
# column programs for fp32 rows, and by the tree otherwise (fp32 rows of over 20 KiB too).
# H200, us, 256 partials and the rules below -> this (scripts/tune_norm.py dw,
# benchmarks/NOTES.md 2026-11-24), M=1024: bf16 N=2048 10.6
# -> 8.9, N=2880 15.0 -> 13.6, N=4096 17.3 -> 15.0, N=5120 24.1 -> 17.2, N=7168 29.7 ->
# 19.5, N=8192 (128 by columns of 1024) 23.6 -> 21.8; fp32 N=2880 19.5 -> 17.1, N=4096 22.4
# -> 21.8, N=5120 26.5 -> 25.1, N=7168 37.5 -> 32.9, N=8192 40.5 -> 36.6. The separate
# launch against the in-kernel columns, both over 256 columns, in `tpfuse bench norm`
# (autograd, us): bf16 N=5120 19.5 vs 22.5, N=7168 20.6 vs 21.4, N=8192 22.2 vs 23.0; fp32
# N=2880 22.1 vs 20.8, N=5120 26.6 vs 25.0 (the sweep had them even: 17.3 vs 17.3 at fp32
# N=2880). fp16 takes bf16's rule, unmeasured. M=2048 and 4096 (the sweep, us, the rules
# before -> this): bf16 N=4096 unchanged (256 by the tree); N=5120 34.7 -> 31.2 and 50.8 ->
# 48.0, N=6144 38.9 -> 34.6 and 57.9 -> 53.2 (256 partials); N=7168 42.7 -> 33.7 and 68.2 ->
# 58.0, N=8192 37.2 -> 35.5 and 63.5 -> 61.9 (128); fp32 N=2880 32.6 -> 30.5 and 51.0 -> 49.1
# (256), N=5120 42.2 -> 40.7 and 74.2 -> 72.7, N=7168 62.7 -> 54.4 and 113.9 -> 99.3, N=8192
# 69.1 -> 61.7 and 125.0 -> 114.9 (128). Each was the sweep's best of 32-256 partials by
# tree, columns or launch, over 256 or 1024 columns, but bf16 N=6144 at M=2048 (columns of
# 256, 33.5).
_SHORT_MAX_N = 8192
_ONE_WAVE_ROWS = 1024
_SHORT_FEWER_PARTIALS_ROW_BYTES = 12 * 1024  # over _ONE_WAVE_ROWS: 128 partials for rows over this
_SHORT_COLUMNS_ROW_BYTES = (8 * 1024, 20 * 1024)  # over the first, up to the second
_SHORT_COMBINE_BLOCK = 256
_FEW_ROWS = 4096
_FEW_ROWS_MIN_ROW_BYTES = 16 * 1024
FEW_ROWS_MAX_PARTIALS = 128
_MIN_DW_PARTIALS = 16
_DW_GROUP_SIZE = 16
_COMBINE_BLOCK = 1024  # DwPlan.combine_block, but for short calls
# Chunked rows (N > 16384, norm_bwd_chunked) take CHUNKED_BWD_PROGRAMS / chunks partials
# (bf16 N=65536: 32), which their groups of programs run through: twice as many lost or tied
# at every swept shape on H200 (bf16 N=65536 M=128 32.2 vs 45.1 us, M=4096 481 vs 501; fp32
# N=65536 M=1024 221 vs 233).
CHUNKED_BWD_PROGRAMS = 512


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
    - "columns": ``num_combine_programs`` extra programs, one per ``combine_block``
      columns, wait for every partial row and sum their columns (``_combine_when_done``).
    - "launch": the separate combine launch, ``dw_combine`` (chunked rows of more than
      one partial; short calls on 16-bit rows of 8-20 KiB).

    Depends on (M, N, dtype) only.
    """

    num_partials: int
    rows_per_partial: int
    group_size: int
    combine: str
    num_combine_programs: int
    combine_block: int  # dW columns per program of a column-parallel combine ("columns", "launch")

    @property
    def num_groups(self) -> int:
        return triton.cdiv(self.num_partials, self.group_size)

    @staticmethod
    def from_shape(m: int, n: int, dtype: torch.dtype) -> "DwPlan":
        cfg = NormConfig.from_shape(n, dtype)
        row_bytes = n * dtype.itemsize
        few_wide_rows = cfg.bwd_num_chunks == 1 and m <= _FEW_ROWS and row_bytes >= _FEW_ROWS_MIN_ROW_BYTES
        short = 2 * FEW_ROWS_MAX_PARTIALS < m <= _FEW_ROWS and n <= _SHORT_MAX_N
        if cfg.bwd_num_chunks > 1:  # a program per (partial, chunk): as many programs from fewer partials
            max_partials = max(1, CHUNKED_BWD_PROGRAMS // cfg.bwd_num_chunks)
        elif short:
            fewer = m <= _ONE_WAVE_ROWS or row_bytes > _SHORT_FEWER_PARTIALS_ROW_BYTES
            max_partials = FEW_ROWS_MAX_PARTIALS if fewer else MAX_DW_PARTIALS
        else:
            max_partials = FEW_ROWS_MAX_PARTIALS if few_wide_rows else MAX_DW_PARTIALS
        num_partials = max(1, min(max_partials, max(min(m, _MIN_DW_PARTIALS), m // 2)))
        rows_per_partial = triton.cdiv(triton.cdiv(m, num_partials), cfg.bwd_rows) * cfg.bwd_rows
        num_partials = triton.cdiv(m, rows_per_partial)
        # The tree's finishers overlap with programs still running but read whole partial
        # rows alone; the column programs share the columns but start after the last
        # partial. H200, bf16, us, tree vs columns: N=2048 M=16 3.7 vs 4.5, M=1024 10.7 vs
        # 17.6; N=4096 M=16 6.1 vs 5.4, M=128 8.9 vs 8.1, M=1024 17.0 vs 25.3; N=8192 M=1024
        # 32.1 vs 31.3; N=16384 M=1024 66.9 vs 58.3; but fp32 M=32768 (256 partials) went
        # from 93-96% of copy bandwidth at N=5120-8192 to 70-84% with the columns. A single
        # partial (M=1) needs no combine at all: its program writes dW. Chunked rows take the
        # separate launch: with their earlier backward (three launches over (partial, chunk)
        # programs) an in-kernel combine (the last of each chunk's programs summing the
        # chunk) lost to it, H200 bf16 N=65536, us, in-kernel vs separate: M=16 17.0 vs
        # 14.1, M=128 41.3 vs 38.2, M=1024 202.7 vs 204.7 (at M=1, no combine: 6.7 vs 8.3).
        combine_block = _COMBINE_BLOCK
        if num_partials == 1:
            combine = "tree"
        elif cfg.bwd_num_chunks > 1:
            combine = "launch"
        elif short:
            if _SHORT_COLUMNS_ROW_BYTES[0] < row_bytes <= _SHORT_COLUMNS_ROW_BYTES[1]:
                combine = "columns" if dtype == torch.float32 else "launch"
            else:
                combine = "tree"
            combine_block = _SHORT_COMBINE_BLOCK
        elif n <= 2048 or (n <= 8192 and num_partials >= 128 and not few_wide_rows):
            combine = "tree"
        else:
            combine = "columns"
        return DwPlan(num_partials, rows_per_partial, _DW_GROUP_SIZE, combine,
                      triton.cdiv(n, combine_block), combine_block)


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


def dw_combine(partial: torch.Tensor, dweight: torch.Tensor, plan: DwPlan) -> None:
    """The separate combine launch: dweight = the sum of the [num_partials, N] fp32 partial
    rows, in the plan's order."""
    dw_combine_kernel[(plan.num_combine_programs,)](
        PARTIAL=partial, DW=dweight, num_partials=plan.num_partials, N=partial.shape[1],
        GROUP_SIZE=plan.group_size, BLOCK=plan.combine_block, num_warps=4, **EXACT_FP,
    )


_dw_counters: dict[torch.device, torch.Tensor] = {}


def _dw_counters_for(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for the in-kernel dW combine, one set per device, enough for
    every plan: one per group of up to MAX_DW_PARTIALS partials and one more (``_finish_dw``;
    ``_combine_when_done`` uses the first three).

    The kernels leave them at zero, so they are allocated once and reused by every later
    call, eager or inside CUDA graphs. Consequences: backward calls that combine dW in the
    kernel must not run concurrently on two streams of one device (two graphs replayed at
    once included): with the tree they would compute a wrong dW, with the column programs
    (``DwPlan.combine == "columns"``) they can also skip dx rows or hang the GPU, as one
    call's reset can hide the other's partial count from its waiting programs. And the
    first such call on a device must not be under graph capture (memory allocated there
    would belong to the graph and be zeroed only by its replays).
    """
    max_groups = triton.cdiv(MAX_DW_PARTIALS, _DW_GROUP_SIZE)
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
