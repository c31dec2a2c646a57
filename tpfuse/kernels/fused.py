"""Fused all-reduce + (residual add) + RMSNorm: one kernel per algorithm, exact by construction.

``y`` and ``residual_out`` equal, bit for bit, ``r = all_reduce(x)`` (tpfuse's exact
all-reduce: fp32 sum in tree order, rounded once) followed by ``tpfuse.add_rms_norm(r,
residual, w)`` (or ``tpfuse.rms_norm(r, w)``, residual_out then being r) because:

- the reduced rows come from ``sum_in_tree_order`` and one ``round_to``, as in
  ``tpfuse.kernels.allreduce``, and are rounded before the residual add;
- the residual add and the norm are ``tpfuse.kernels.norm.norm_tile``, the body of the norm
  forward kernel, on tiles of the same shape (``NormConfig``, from N and the residual's dtype
  alone) and the same warps. The register layout Triton gives the tile fixes the order of
  the row reduction, so tests/test_fused_layouts.py compiles these kernels and the norm
  kernel for sm_90 and checks the layouts of their row reductions are the same.

Each rank adds its own residual, so residuals that differ between ranks still give every
rank its own split result.

x may be fp32 partial sums with a 16-bit residual (an invariant row-parallel layer's,
docs/design.md 1.2): the slots, LL and Lamport words carry x's fp32, the tree's sum is
rounded once to the residual's dtype, and from there everything (the ``reduced`` region,
two-shot's gather slots, the tile, y) is in the residual's dtype: the bits of
``add_rms_norm(all_reduce(x).to(residual.dtype), residual, w)``, in one launch instead of three.

- one-shot: each rank stores its rows into slot ``rank`` of every rank's data region,
  signals, waits for all W, and normalises every row from the sum of its W local slots.
  The flag kernel (``oneshot_all_reduce_norm_kernel``), between its signal and its wait,
  asks L2 for each CTA's first tile of residual and weight, which its norm reads next
  (``_prefetch_norm_operands``).
  Small messages use the LL protocol (``tpfuse.kernels.ll``), mid-size ones Lamport words,
  and a different split of the work: row tiles are cut into pieces spread over the grid,
  each piece is summed into the workspace's local ``reduced`` region, and the CTA that
  finishes a tile's last piece normalises the tile from there
  (``ll_oneshot_all_reduce_norm_kernel``). Row-wise (``rows_oneshot_all_reduce_norm_kernel``,
  small tiles and messages; by default on GPUs at W=2 only:
  ``Knobs.fused_rows_max_bytes``), every CTA that stores a piece of a tile as
  Lamport words polls the whole tile and normalises it, storing only its piece: no count
  between CTAs.
- two-shot: rows are cut into W groups of ``rows_per_group`` (whole tiles); rank s stores
  group g into scatter slot s of rank g; rank g sums its W scatter slots, rounds once and
  stores the reduced group into gather slot g of every rank; after the gather flags every
  rank normalises every row from its gather slots. Whole rows are scattered, so every row is
  reduced on one rank and normalised from one slot. The norm is done on every rank (a local,
  memory-bound pass) rather than on the owner followed by a gather of y and residual_out:
  that halves the NVLink bytes of the gather and keeps each rank's own residual.

The synchronisation (epochs, flags, timeouts, parity-rotated data regions) is
``tpfuse.kernels.sync`` over the workspace of ``tpfuse.comm.workspace``, as for the plain
all-reduce: block b handles tiles b, b + grid, ... and waits only for block b of its peers
(over LL, only for its peers' words).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.peer import (PeerContext, begin_collective, flag_row, poison, push_to_peers, sum_in_tree_order,
                                 typed_ptr)
from tpfuse.kernels.common import EXACT_FP, prefetch_l2, round_to, to_f32
from tpfuse.kernels.ll import lamport_pack, lamport_word, ll_flag, ll_pack, ll_reduce, ll_wait
from tpfuse.kernels.norm import NormConfig, norm_tile, output_amax, row_inv_rms, store_output
from tpfuse.kernels.quant_fp8 import Fp8Output, fp8_scale, zero_scale_padding
from tpfuse.kernels.sync import begin_call, end_call, signal, wait

# Operation codes of the status record; their names are in allreduce.OP_NAMES.
OP_FUSED_ONESHOT = tl.constexpr(4)
OP_FUSED_SCATTER = tl.constexpr(5)
OP_FUSED_GATHER = tl.constexpr(6)

# Counts and flags are not specialised, so every batch size and both residual modes run one
# compiled kernel per (N, x's and the residual's dtypes, world size), like the norm kernel.
_UNSPECIALISED = ["n_rows", "rows_per_group", "has_residual", "rank", "timeout_ns", "scale_rows"]


@triton.jit
def _copy_rows(X, dst, N, src_rows, dst_rows, row_ok, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """Copy the rows src_rows ([ROWS]) of the [*, N] X to ``dst`` at rows dst_rows, where row_ok."""
    cols = tl.arange(0, BLOCK_N)[None, :]
    for c in range(NUM_CHUNKS):
        ccols = c * BLOCK_N + cols
        mask = row_ok[:, None] & (ccols < N)
        vals = tl.load(X + src_rows.to(tl.int64)[:, None] * N + ccols, mask=mask)
        tl.store(dst + dst_rows.to(tl.int64)[:, None] * N + ccols, vals, mask=mask)


@triton.jit
def poison_outputs(Y, RES_OUT, Q, SCALES, scale_rows, n_rows, N, FP8: tl.constexpr, GROUP: tl.constexpr):
    """A failed call's outputs all NaN (``poison``): residual_out, and y or, with FP8, the
    e4m3 values and the scales the call derives (a "tensor" scale is the caller's input)."""
    poison(RES_OUT, n_rows * N)
    if FP8 == 0:
        poison(Y, n_rows * N)
    else:
        poison(Q, n_rows * N)
        if FP8 == 2:
            poison(SCALES, n_rows)
        elif FP8 == 3:
            poison(SCALES, N // GROUP * scale_rows)


@triton.jit
def _prefetch_norm_operands(RES, W, first, n_elems, N, ELEMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """Start moving the residual and weight under elements [first, first + ELEMS) of the
    [*, N] operands (n_elems in all) into L2, a 128-byte line per lane, so that the norm after
    the wait finds them there rather than in HBM."""
    LINE: tl.constexpr = 128 // (RES.dtype.element_ty.primitive_bitwidth // 8)  # elements per line
    elems = tl.minimum(first + tl.arange(0, max(ELEMS // LINE, 1)) * LINE, n_elems - 1).to(tl.int64)
    prefetch_l2(RES + elems)
    if HAS_WEIGHT:
        prefetch_l2(W + elems % N)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def oneshot_all_reduce_norm_kernel(
    X, RES, W, Y, RES_OUT, Q, SCALES, scale_rows, n_rows, N, eps, weight_offset, has_residual,
    table_ptr, local, status_addr, rank, timeout_ns, flags_offset, data_offset, data_bytes, slot_elems,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WORLD: tl.constexpr, PEERS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    ELEM: tl.constexpr = X.dtype.element_ty
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(
        local, status_addr, data_offset, data_bytes, n_rows, ROWS)
    zero_scale_padding(SCALES, n_rows, scale_rows, N, FP8, GROUP)
    for tile in range(pid, n_tiles, grid):
        rows = tile * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)[None, :]
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_N + cols
            mask = (rows < n_rows)[:, None] & (ccols < N)
            offs = rows.to(tl.int64)[:, None] * N + ccols
            push_to_peers(table_ptr, data, tl.load(X + offs, mask=mask), rank * slot_elems + offs, mask, rank, WORLD,
                          True)
    signal(table_ptr, flags_offset + (pid * WORLD + rank) * 8, epoch, WORLD, PEERS)
    # The first tile's residual and weight, after the stores the peers wait on (before them it
    # delayed the peers), for tiles held in registers (up to 1024 lines each). Prefetching every
    # tile of a CTA made one-shot calls of 1024+ tokens up to 49% slower (benchmarks/NOTES.md).
    if NUM_CHUNKS == 1:
        _prefetch_norm_operands(RES, W, pid * ROWS * N, n_rows * N, N, ROWS * BLOCK_N, HAS_WEIGHT)
    if wait(flag_row(local, flags_offset, WORLD), ctrl, status, epoch, rank, timeout_ns, OP_FUSED_ONESHOT, WORLD,
            PEERS):
        slot0 = typed_ptr(local, data, ELEM)
        for tile in range(pid, n_tiles, grid):
            rows = tile * ROWS + tl.arange(0, ROWS)
            norm_tile(slot0, rows.to(tl.int64) * N, slot_elems, RES, W, Y, RES_OUT, rows, rows < n_rows, N, eps,
                      weight_offset, has_residual, True, Q, SCALES, scale_rows, BLOCK_N, TAIL_N, NUM_CHUNKS, HAS_WEIGHT, WORLD,
                      FP8, GROUP, HW_E4M3)
    else:
        poison_outputs(Y, RES_OUT, Q, SCALES, scale_rows, n_rows, N, FP8, GROUP)
    end_call(ctrl, epoch)


@triton.jit
def _piece_words(piece, tile_words, n_words, PIECE_WORDS: tl.constexpr, PIECES: tl.constexpr):
    """Word offsets and mask of ``piece`` (piece % PIECES of row tile piece // PIECES)."""
    lanes = (piece % PIECES) * PIECE_WORDS + tl.arange(0, PIECE_WORDS)
    woffs = (piece // PIECES) * tile_words + lanes
    return woffs, (woffs < n_words) & (lanes < tile_words)


@triton.jit
def _count_piece(counter):
    """Count one more summed piece of a tile; returns the count before it. acq_rel: this
    CTA's stores of the piece precede the count, and the CTA that takes the last count sees
    every piece's. The release costs about 0.3 us a call (2x H200, results/2xH200/fused_ab.md,
    relaxed_count); handing the pieces over as Lamport words instead, with a relaxed count,
    measured slower (benchmarks/NOTES.md, 2026-11-26). A function of its own so that
    scripts/fused_ab.py can swap it."""
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")


@triton.jit(do_not_specialize=_UNSPECIALISED)
def ll_oneshot_all_reduce_norm_kernel(
    X, RES, W, Y, RES_OUT, Q, SCALES, scale_rows, n_rows, N, eps, weight_offset, has_residual,
    table_ptr, local, status_addr, rank, timeout_ns, ll_offset, ll_bytes, slot_words, reduced_offset, handoff_offset,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WORLD: tl.constexpr, PIECE_WORDS: tl.constexpr, PIECES: tl.constexpr,
    LAMPORT: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, HW_E4M3: tl.constexpr,
):
    """One-shot over LL words or, with LAMPORT, Lamport words (one element each).

    Each row tile (ROWS contiguous rows; N is a multiple of 16, so a tile is whole words) is
    cut into PIECES pieces of PIECE_WORDS words, spread over the whole grid, which has more
    CTAs than row tiles: one CTA cannot drain a row's NVLink stores or poll its W slots
    quickly (4x H200: an 8 KiB all-reduce takes 3.6 us on 8 CTAs, 6.4 us on 2). Every CTA
    first stores its pieces, as LL words, into slot ``rank`` of every other rank; then, per
    piece, it sums the piece from the peers' LL words and its own x (its own slot is never
    written), rounds it into the local ``reduced`` region and counts it in the tile's
    handoff counter. The CTA that counts a tile's last piece normalises the
    tile from ``reduced`` with ``norm_tile``, reading plain rows as the norm kernel does (the
    layout test compares the reductions), and resets the counter. No CTA waits for another
    CTA of its rank, so the kernel needs no more residency than the others, and runs under
    the interpreter, which runs CTAs one after another. With PIECES = 1 (small tiles, or whole
    tiles over Lamport words once the call has a row tile per CTA, ``lamport_tiling``) a piece
    is a whole tile, and the CTA that sums it normalises it without the count."""
    ELEM: tl.constexpr = X.dtype.element_ty
    OUT: tl.constexpr = RES_OUT.dtype.element_ty  # ELEM, or 16 bits under fp32 partials
    PACK: tl.constexpr = 1 if LAMPORT else 32 // ELEM.primitive_bitwidth  # elements per word
    zero_scale_padding(SCALES, n_rows, scale_rows, N, FP8, GROUP)
    WORD: tl.constexpr = lamport_word(ELEM) if LAMPORT else tl.uint64
    pid, grid, ctrl, status, epoch, region, n_tiles = begin_collective(
        local, status_addr, ll_offset, ll_bytes, n_rows, ROWS)
    flag = ll_flag(epoch)
    tile_words = ROWS * N // PACK
    n_words = tl.multiple_of(n_rows * N // PACK, 8)
    packs = tl.arange(0, PACK)[None, :]
    for piece in range(pid, n_tiles * PIECES, grid):
        woffs, wmask = _piece_words(piece, tile_words, n_words, PIECE_WORDS, PIECES)
        vals = tl.reshape(tl.load(X + woffs[:, None] * PACK + packs, mask=wmask[:, None]), [PIECE_WORDS * PACK])
        if LAMPORT:
            words = lamport_pack(vals)
        else:
            words = ll_pack(vals, flag)
        push_to_peers(table_ptr, region, words, rank * slot_words + woffs, wmask, rank, WORLD, False)
    slot0 = typed_ptr(local, region, WORD)
    reduced = typed_ptr(local, reduced_offset, OUT)
    arrived = (local + handoff_offset).to(tl.pointer_type(tl.int64))
    for piece in range(pid, n_tiles * PIECES, grid):
        woffs, wmask = _piece_words(piece, tile_words, n_words, PIECE_WORDS, PIECES)
        if LAMPORT:  # a word per element
            own = to_f32(tl.load(X + woffs, mask=wmask))
        else:
            own = to_f32(tl.reshape(tl.load(X + woffs[:, None] * PACK + packs, mask=wmask[:, None]),
                                    [PIECE_WORDS * PACK]))
        acc = ll_reduce(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns,
                        OP_FUSED_ONESHOT, WORLD, ELEM, LAMPORT, own, SPIN=LAMPORT)
        if LAMPORT:
            tl.store(reduced + woffs, round_to(acc, OUT), mask=wmask)
        else:
            tl.store(reduced + woffs[:, None] * PACK + packs, tl.reshape(round_to(acc, OUT), [PIECE_WORDS, PACK]),
                     mask=wmask[:, None])
        tl.debug_barrier()  # every thread's stores of the piece precede the count (release)
        tile = piece // PIECES
        rows = tile * ROWS + tl.arange(0, ROWS)
        if PIECES == 1:  # whole tiles: the CTA that summed the tile normalises it, nothing to count
            norm_tile(reduced, rows.to(tl.int64) * N, 0, RES, W, Y, RES_OUT, rows, rows < n_rows, N, eps,
                      weight_offset, has_residual, True, Q, SCALES, scale_rows, BLOCK_N, TAIL_N, NUM_CHUNKS,
                      HAS_WEIGHT, 0, FP8, GROUP, HW_E4M3)
        elif _count_piece(arrived + tile) == PIECES - 1:
            tl.store(arrived + tile, 0)  # the next call counts after this kernel has ended
            norm_tile(reduced, rows.to(tl.int64) * N, 0, RES, W, Y, RES_OUT, rows, rows < n_rows, N, eps,
                      weight_offset, has_residual, True, Q, SCALES, scale_rows, BLOCK_N, TAIL_N, NUM_CHUNKS,
                      HAS_WEIGHT, 0, FP8, GROUP, HW_E4M3)
    end_call(ctrl, epoch)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def rows_oneshot_all_reduce_norm_kernel(
    X, RES, W, Y, RES_OUT, Q, SCALES, scale_rows, n_rows, N, eps, weight_offset, has_residual,
    table_ptr, local, status_addr, rank, timeout_ns, rows_offset, rows_bytes, slot_words,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, WORLD: tl.constexpr,
    PIECE: tl.constexpr, PIECES: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, HW_E4M3: tl.constexpr,
):
    """One-shot, row-wise: every CTA that stores a piece of a row tile normalises the whole tile.

    The grid is one CTA per piece: CTA p stores piece p % PIECES (PIECE elements; N is a
    multiple of 16) of row tile p // PIECES as Lamport words into slot ``rank`` of every
    rank's rows region, then polls all W slots of the whole tile in the norm kernel's layout
    (tiles held in registers without a tail, ``NormConfig``), sums them in tree order, rounds,
    adds the residual and normalises, as ``norm_tile`` does, and stores only its own piece of
    y and residual_out. Nothing passes between CTAs of a rank but the Lamport words, so there
    is no handoff count and no release (``ll_oneshot_all_reduce_norm_kernel`` has both); each
    CTA reads the whole tile instead of a piece. Unlike the kernel over the LL regions, it
    stores its piece into its own slot too and polls it there: a CTA waits for its siblings'
    pieces, which orders their stores of residual_out after its read of the residual (below).
    A word is read by every CTA of its tile, so it is zeroed by the next row-wise call, not by
    a reader (``tpfuse.comm.workspace``: the rows regions rotate by row-wise call, ctrl[3],
    and the last call's bytes per slot are ctrl[4]). A CTA waits for pieces other CTAs store,
    so the grid must be resident at once, and under the interpreter, which runs CTAs one after
    another, a piece is a whole tile."""
    ELEM: tl.constexpr = X.dtype.element_ty
    OUT: tl.constexpr = RES_OUT.dtype.element_ty  # ELEM, or 16 bits under fp32 partials
    WORD: tl.constexpr = lamport_word(ELEM)
    pid = tl.program_id(0)
    zero_scale_padding(SCALES, n_rows, scale_rows, N, FP8, GROUP)
    ctrl = local.to(tl.pointer_type(tl.int64))
    status = status_addr.to(tl.pointer_type(tl.int64))
    epoch = begin_call(ctrl)
    calls = tl.load(ctrl + 3, volatile=True)  # row-wise calls finished: this call's rotation
    stale_bytes = tl.load(ctrl + 4, volatile=True)  # the last one's bytes per slot
    n_words = n_rows * N
    tile_elems = ROWS * N
    tile = pid // PIECES
    lanes = (pid % PIECES) * PIECE + tl.arange(0, PIECE)
    offs = tile * tile_elems + lanes
    pmask = (lanes < tile_elems) & (offs < n_words)
    region = rows_offset + (calls % 3) * rows_bytes
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_offs = rows.to(tl.int64)[:, None] * N
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < N)
    # The tile's residual, read before this CTA stores its piece: residual_out may alias it,
    # and the other CTAs of the tile store their pieces of it only once they have seen this one.
    # That rests on the load being served before the later stores are seen, with no fence
    # between them (the PTX model alone would allow the reverse; the load is issued an L2 round
    # trip and a peer's poll before any such store, as end_call's count rests on its reads).
    res = tl.load(RES + row_offs + cols, mask=mask & (has_residual != 0), other=0.0)
    row_scale = 1.0  # the fp8 output's: FP8 1, the static scale, loaded early; 2, below
    if FP8 == 1:
        row_scale = tl.load(SCALES)
    push_to_peers(table_ptr, region, lamport_pack(tl.load(X + offs, mask=pmask)), rank * slot_words + offs, pmask, rank,
          WORLD, True)
    # The last row-wise call's words (of any dtype: counted in bytes), in the rotation before
    # this one's, a share per CTA.
    stale = typed_ptr(local, rows_offset + ((calls + 2) % 3) * rows_bytes, WORD)
    stale_words = stale_bytes // (WORD.primitive_bitwidth // 8)
    for start in range(pid * PIECE, stale_words, tl.num_programs(0) * PIECE):
        zoffs = start + tl.arange(0, PIECE)
        for s in tl.static_range(WORLD):
            tl.store(stale + s * slot_words + zoffs, tl.zeros([PIECE], WORD), mask=zoffs < stale_words)
    acc = ll_wait(typed_ptr(local, region, WORD), slot_words, row_offs + cols, mask, 0, ctrl, status, epoch, rank,
                  timeout_ns, OP_FUSED_ONESHOT, WORLD, ELEM, True)
    x = round_to(tl.where(mask, acc, 0.0), OUT)  # padding lanes as norm_tile's: 0, not an absent word's NaN
    if has_residual:
        x = round_to(to_f32(x) + to_f32(res), OUT)
    mine = mask & ((tl.arange(0, ROWS)[:, None] * N + cols) // PIECE == pid % PIECES)
    tl.store(RES_OUT + row_offs + cols, x, mask=mine)
    xf = to_f32(x)
    inv = row_inv_rms(xf * xf, N, eps)
    if FP8 == 2:  # from the whole tile, which every CTA of it holds
        row_scale = fp8_scale(output_amax(xf, inv, W, cols, mask, N, weight_offset, HAS_WEIGHT, OUT, HW_E4M3))
    # Every CTA of the tile stores the tile's scales: the same values, from the same rows.
    store_output(xf, inv, row_scale, W, Y, Q, SCALES, scale_rows, rows, row_offs, 0, cols, mine, rows < n_rows, N,
                 weight_offset, HAS_WEIGHT, "", FP8, GROUP, HW_E4M3)
    end_call(ctrl, epoch, n_words * (WORD.primitive_bitwidth // 8))


@triton.jit(do_not_specialize=_UNSPECIALISED)
def twoshot_all_reduce_norm_kernel(
    X, RES, W, Y, RES_OUT, Q, SCALES, scale_rows, n_rows, rows_per_group, N, eps, weight_offset, has_residual,
    table_ptr, local, status_addr, rank, timeout_ns, flags_offset, flags_bytes, data_offset, data_bytes,
    gather_offset, slot_elems,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, WORLD: tl.constexpr, PEERS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    ELEM: tl.constexpr = X.dtype.element_ty
    OUT: tl.constexpr = RES_OUT.dtype.element_ty  # the gather's: ELEM, or 16 bits under fp32 partials
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(local, status_addr, data_offset, data_bytes,
                                                           rows_per_group, ROWS)
    zero_scale_padding(SCALES, n_rows, scale_rows, N, FP8, GROUP)
    cols = tl.arange(0, BLOCK_N)[None, :]
    # Reduce-scatter, part 1: group g of my rows into scatter slot `rank` of rank g.
    for tile in range(pid, n_tiles, grid):
        local_rows = tile * ROWS + tl.arange(0, ROWS)
        for g in tl.static_range(WORLD):
            rows = g * rows_per_group + local_rows
            dst = typed_ptr(tl.load(table_ptr + g), data, ELEM) + rank * slot_elems
            _copy_rows(X, dst, N, rows, local_rows, (local_rows < rows_per_group) & (rows < n_rows), BLOCK_N,
                       NUM_CHUNKS)
    signal(table_ptr, flags_offset + (pid * WORLD + rank) * 8, epoch, WORLD, PEERS)
    # Part 2: sum my group's W contributions in tree order, round once, and store the
    # reduced rows into gather slot `rank` of every rank (this one included).
    scattered = wait(flag_row(local, flags_offset, WORLD), ctrl, status, epoch, rank, timeout_ns, OP_FUSED_SCATTER,
                     WORLD, PEERS)
    if scattered:
        slot0 = typed_ptr(local, data, ELEM)
        for tile in range(pid, n_tiles, grid):
            local_rows = tile * ROWS + tl.arange(0, ROWS)
            row_ok = (local_rows < rows_per_group) & (rank * rows_per_group + local_rows < n_rows)
            for c in range(NUM_CHUNKS):
                ccols = c * BLOCK_N + cols
                mask = row_ok[:, None] & (ccols < N)
                offs = local_rows.to(tl.int64)[:, None] * N + ccols
                reduced = round_to(sum_in_tree_order(slot0, slot_elems, offs, mask, WORLD), OUT)
                push_to_peers(table_ptr, data + gather_offset, reduced, rank * slot_elems + offs, mask, rank, WORLD, True)
    # All-gather (as the two-shot all-reduce's: a block whose scatter wait failed signals nothing).
    if scattered:
        signal(table_ptr, flags_offset + flags_bytes + (pid * WORLD + rank) * 8, epoch, WORLD, PEERS)
    if scattered & wait(flag_row(local, flags_offset + flags_bytes, WORLD), ctrl, status, epoch, rank, timeout_ns,
                        OP_FUSED_GATHER, WORLD, PEERS):
        gather0 = typed_ptr(local, data + gather_offset, OUT)
        for tile in range(pid, n_tiles, grid):
            local_rows = tile * ROWS + tl.arange(0, ROWS)
            for g in tl.static_range(WORLD):  # unrolled: the W groups' loads are in flight together
                rows = g * rows_per_group + local_rows
                norm_tile(gather0 + g * slot_elems, local_rows.to(tl.int64) * N, 0, RES, W, Y, RES_OUT, rows,
                          (local_rows < rows_per_group) & (rows < n_rows), N, eps, weight_offset, has_residual, True,
                          Q, SCALES, scale_rows, BLOCK_N, TAIL_N, NUM_CHUNKS, HAS_WEIGHT, 1, FP8, GROUP, HW_E4M3)
    else:
        poison_outputs(Y, RES_OUT, Q, SCALES, scale_rows, n_rows, N, FP8, GROUP)
    end_call(ctrl, epoch)


WHOLE_TILE_MAX_VECTORS = 4
"""The fused kernel over Lamport words takes whole row tiles as pieces (``ll_pieces``) only
where a tile holds at most this many 16-byte vectors per thread of the norm's warps."""


def ll_pieces(n: int, dtype: torch.dtype, protocol: str = "ll", whole_tiles: bool = False,
              norm_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(words per piece, pieces per row tile) of the fused kernel over LL or Lamport words
    for hidden size n of x in dtype (its words; the norm's tile in norm_dtype, the
    residual's, by default dtype): one LL word (4 data bytes) per thread of the norm's warps,
    so a decode row is spread over several CTAs; over Lamport words, one 16-byte vector per
    thread, as a Lamport word is one element and carries no flag to amortise. With
    whole_tiles (Lamport words, ``lamport_tiling``), one piece per tile."""
    cfg = NormConfig.from_shape(n, norm_dtype or dtype)
    piece_words = cfg.num_warps * 32 * (16 // dtype.itemsize if protocol == "lamport" else 1)
    tile_words = cfg.rows * n if protocol == "lamport" else cfg.rows * n * dtype.itemsize // 4
    if whole_tiles:
        return triton.next_power_of_2(tile_words), 1
    return piece_words, triton.cdiv(tile_words, piece_words)


def rows_pieces(n: int, dtype: torch.dtype, piece_bytes: int,
                norm_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(elements per piece, pieces per row tile) of the row-wise kernel for hidden size n of
    x in dtype (the norm's tile in norm_dtype, as ``ll_pieces``): pieces of piece_bytes of x
    (a power of two), or one piece where the tile is smaller."""
    cfg = NormConfig.from_shape(n, norm_dtype or dtype)
    piece = min(piece_bytes // dtype.itemsize, triton.next_power_of_2(cfg.rows * n))
    return piece, triton.cdiv(cfg.rows * n, piece)


def lamport_tiling(n: int, dtype: torch.dtype, n_tiles: int, max_ctas: int,
                   norm_dtype: torch.dtype | None = None) -> str | None:
    """How the fused kernel over Lamport words cuts a call of n_tiles row tiles for up to
    max_ctas CTAs: "whole" (a piece per row tile) once the call has a row tile per CTA and a
    tile is at most WHOLE_TILE_MAX_VECTORS vectors per thread (spreading tiles then gains no
    CTAs and costs a count per piece; 2x H100, hidden 4096 x 128 tokens: 9.6 us, spread 11.6);
    "spread" (pieces of a vector per thread) while the pieces fit one wave of CTAs; None where
    neither holds (each CTA would sum and count several pieces; hidden 8192 x 64 tokens, 256
    pieces on 128 CTAs: 11.7 us against split's 10.8)."""
    pieces = ll_pieces(n, dtype, "lamport", norm_dtype=norm_dtype)[1]
    if n_tiles >= max_ctas and pieces <= WHOLE_TILE_MAX_VECTORS:
        return "whole"
    return "spread" if n_tiles * pieces <= max_ctas else None


def all_reduce_norm_into(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                         y: torch.Tensor | None, residual_out: torch.Tensor, eps: float, weight_offset: float, plan,
                         peers: PeerContext, fp8: Fp8Output | None = None) -> None:
    """Launch one fused all-reduce + (residual add) + RMSNorm over 2-D [n_rows, N]
    contiguous, 16-byte aligned operands, as ``plan`` says (``tpfuse.comm.plan.FusedPlan``).

    x: this rank's contribution (fp32 partials with a 16-bit residual: the module's
    docstring); residual: this rank's residual or None; writes y and residual_out
    (round(all_reduce(x) + residual), or all_reduce(x) without a residual; residual_out's dtype).
    residual_out may alias residual (as in ``tpfuse.kernels.norm.rms_norm_fwd``). With ``fp8``
    (y None) y is quantized to its q and scales instead of stored. Every rank
    must launch the same plan (from the shape and the knobs only). The plan's protocol:
    one-shot's, "flags", "ll" or "lamport" (x must fit the layout's ``ll_max_bytes`` or
    ``lamport_max_bytes``; pieces of ``piece_words`` words, ``pieces`` per row tile,
    ``ll_pieces``), or "rows" (``rows_oneshot_all_reduce_norm_kernel``: x must fit
    ``rows_max_bytes``, rows be held in registers without a tail, and grid be one CTA per
    piece of piece_elems elements, ``rows_pieces``); its norm: the tile of N and residual_out's dtype.
    """
    n_rows, n = x.shape
    out = residual_out.dtype
    if (x.dtype != out and not (x.dtype == torch.float32 and out.itemsize == 2)) or any(
            t is not None and t.dtype != out for t in (residual, y)):
        raise ValueError(f"all_reduce_norm_into: x {x.dtype}, residual, y and residual_out {out}: the outputs and "
                         "the residual take one dtype, x the same or fp32 partial sums of a 16-bit one")
    cfg, layout, algo, protocol, grid = plan.norm, peers.layout, plan.algo, plan.protocol, plan.grid
    if cfg != NormConfig.from_shape(n, out):  # cached: a plan for another shape must not launch
        raise ValueError(f"the plan's norm tile {cfg} is not that of hidden size {n} in {out}")
    world = layout.world_size
    common = dict(
        X=x, RES=residual if residual is not None else x, W=weight if weight is not None else x,
        Y=y if y is not None else residual_out, RES_OUT=residual_out, n_rows=n_rows, N=n, eps=eps,
        weight_offset=weight_offset, has_residual=int(residual is not None), **peers.kernel_args(),
        BLOCK_N=cfg.block_n, TAIL_N=cfg.tail_n, NUM_CHUNKS=cfg.num_chunks, ROWS=cfg.rows,
        HAS_WEIGHT=weight is not None, WORLD=world, num_warps=cfg.num_warps,
        **(fp8.kernel_args() if fp8 is not None else Fp8Output.none_args(x)), **EXACT_FP)
    if (y is None) == (fp8 is None):
        raise ValueError("all_reduce_norm_into: exactly one of y and fp8")
    if algo == "oneshot" and protocol == "rows":
        tiles, piece_elems, pieces = triton.cdiv(n_rows, cfg.rows), plan.piece_elems, plan.pieces
        if (x.numel() * x.element_size() > layout.rows_max_bytes or n % 16 or cfg.tail_n or cfg.num_chunks != 1
                or piece_elems <= 0 or piece_elems & (piece_elems - 1)
                or pieces != triton.cdiv(cfg.rows * n, piece_elems) or grid != tiles * pieces):
            raise ValueError(f"the row-wise one-shot cannot serve {n_rows} x {n} {x.dtype} on {grid} CTAs with "
                             f"pieces of {piece_elems} elements (capacity {layout.rows_max_bytes} bytes; hidden "
                             "sizes must be multiples of 16 whose rows are held in registers without a tail)")
        for key in ("TAIL_N", "NUM_CHUNKS"):
            del common[key]
        rows_oneshot_all_reduce_norm_kernel[(grid,)](
            rows_offset=layout.rows_offset(0), rows_bytes=layout.rows_bytes,
            slot_words=layout.rows_slot_bytes // x.element_size(), PIECE=piece_elems, PIECES=pieces, **common)
        return
    if algo == "oneshot" and protocol in ("ll", "lamport"):
        lamport = protocol == "lamport"
        tiles = triton.cdiv(n_rows, cfg.rows)
        capacity = layout.lamport_max_bytes if lamport else layout.ll_max_bytes
        if x.numel() * x.element_size() > capacity or n % 16 or 8 * tiles > layout.handoff_bytes:
            raise ValueError(f"the {protocol} one-shot cannot serve {n_rows} x {n} {x.dtype} with this layout "
                             f"(capacity {capacity} bytes; hidden sizes must be multiples of 16)")
        if plan.whole_tiles and not lamport:
            raise ValueError("whole_tiles is for the one-shot over Lamport words")
        ll_oneshot_all_reduce_norm_kernel[(grid,)](
            ll_offset=layout.ll_offset(0), ll_bytes=layout.ll_bytes,
            slot_words=layout.ll_slot_bytes // (x.element_size() if lamport else 8),
            reduced_offset=layout.reduced_offset, handoff_offset=layout.handoff_offset, PIECE_WORDS=plan.piece_words,
            PIECES=plan.pieces, LAMPORT=lamport, **common)
        return
    if protocol != "flags":
        raise ValueError(f"protocol must be 'flags', 'll', 'lamport' or 'rows' (one-shot only), got {protocol!r} for "
                         f"{algo!r}")
    common.update(flags_offset=layout.flag_offset(0), data_offset=layout.data_offset(0), data_bytes=layout.data_bytes,
                  PEERS=triton.next_power_of_2(world))
    if algo == "oneshot":
        oneshot_all_reduce_norm_kernel[(grid,)](slot_elems=layout.oneshot_slot_bytes // x.element_size(), **common)
    elif algo == "twoshot":
        twoshot_all_reduce_norm_kernel[(grid,)](
            rows_per_group=plan.rows_per_group, flags_bytes=layout.flag_region_bytes,
            gather_offset=layout.gather_offset, slot_elems=layout.twoshot_slot_bytes // x.element_size(), **common)
    else:
        raise ValueError(f"algo must be 'oneshot' or 'twoshot', got {algo!r}")
