"""A matmul whose bits depend on K alone: batch- and TP-invariant linear layers (docs/design.md 1.2).

``invariant_matmul(x, weight, chunks)`` computes ``x @ weight.T`` so that each output
element's reduction order is fixed by K and ``chunks`` only, never by M or N (for a given GPU
architecture and Triton version: a tensor core's sum inside one instruction is its own, and
the interpreter's differs from a GPU's):

- 16-row blocks, each its own dot (mma.m16n8k16, never a wgmma tile), so that a row is
  summed by the same tensor-core instructions whether it is alone or one of many, and no
  split of K chosen from the shape; the rest of the launch configuration (``LinearConfig``)
  changes no bit;
- K is cut into ``chunks`` equal chunks, each summed in BLOCK_K steps, in order, into an fp32
  accumulator of its own, and the chunks' fp32 partials are added over the pairwise tree
  (``peer.tree_sum``). A CTA sums a run of consecutive chunks (a subtree, in one loop:
  ``_chunk_tree``); where ``LinearConfig.split`` CTAs share a tile's chunks, the last of
  them to arrive adds their subtrees (an acq_rel count per tile: the deterministic last-CTA
  pattern, one launch) and sets the tile's count back to zero: a caller's counters buffer
  (``counters_for``) serves every later launch without a zeroing kernel of its own.

The tree is what makes the result TP-invariant: a row-parallel layer over t ranks gives each
rank a contiguous 1/t of K, so with ``chunks = G / t`` (G chunks in all, a power of two), a
rank's result is a subtree of the G-chunk tree, and the all-reduce's tree over the ranks
(``tpfuse.reference.tree_sum``) completes it: the same bits as one rank's
``invariant_matmul(x, weight, G)`` (tests/test_invariant_matmul.py).

The chunks also spread a product over CTAs: a tile's chunks are shared by G / 2 CTAs (two
chunks each), more where the GPU would otherwise have too few CTAs. Fewer than G CTAs a tile
means fewer fp32 partials making the round trip through memory (with G = 8 at M = 64 they were
half of gate_up's weight bytes). For larger M a CTA applies each weight block it loads to up
to 4 row blocks, each its own 16-row dot (``LinearConfig.row_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, _INTERPRETER, round_to, to_f32
from tpfuse.kernels.peer import tree_sum

BLOCK_M = 16
"""Rows per tile: one mma.m16n8k16 row block on sm_80+, for every M (never a wgmma tile)."""
MIN_BLOCK_N = 64
"""The narrowest column block ``LinearConfig.for_shape`` picks."""
MAX_CHUNKS = 8
MIN_CTAS = 256
"""``LinearConfig.for_shape`` spreads a product over more CTAs while it has fewer than this."""
PARTIAL_BYTES = 256 << 20
"""The most bytes of fp32 chunk partials one launch writes (a prefill of thousands of rows
would otherwise take GBs for an LM head); more rows go through in slices."""


@dataclass(frozen=True)
class LinearConfig:
    """The launch configuration of one ``invariant_matmul`` launch. None of it changes a bit:
    every row block is its own 16-row dot chaining its chunk's k16 mma steps in order, whatever
    the blocks around it or BLOCK_K (the GPU tests compare the fp32 sums of rows alone and in
    batches, which take other configurations; scripts/tune_linear.py compared 32-128
    configurations per layer and M with the library's on an H200, the outputs of TP=1's layers
    in bf16 and TP=2's fp32 partials: the same bits every time)."""

    block_m: int
    """Rows of one dot: BLOCK_M (16), one mma.m16n8k16 row block. (64, a wgmma tile, would
    be another instruction, with other bits: measured at ae1c83a, never picked.)"""
    block_n: int
    block_k: int
    row_blocks: int
    """Row blocks a CTA sums with each weight block it loads: how often the weights are read."""
    split: int
    """CTAs sharing one tile's chunks (a power of two dividing them), each summing a run of
    chunks / split: more CTAs, and more fp32 partials through memory, as it grows."""
    num_warps: int
    num_stages: int

    @classmethod
    def for_shape(cls, m: int, n: int, chunks: int, chunk_k: int) -> "LinearConfig":
        """The chunk in steps of 128; 64 columns a CTA up to 32 rows, 128 past them (with 4 row
        blocks, and still when fewer are taken below); each CTA sums two chunks, and where that
        leaves fewer than MIN_CTAS CTAs, first 2 row blocks a CTA instead of 4, then more CTAs a
        tile, down to a chunk each. Chosen from scripts/tune_linear.py's sweep (H200,
        benchmarks/NOTES.md 2026-11-29): over Llama-3-8B's TP=1 layers a step's GEMMs take 3.95,
        5.73 and 16.29 ms at M = 1, 64 and 256 this way, the sweep's fastest per layer 3.90, 5.52
        and 16.27. Under the interpreter, which sums
        a dot's K in one numpy product, the blocks never change (the split changes no bit there
        either)."""
        row_blocks = min(4, triton.next_power_of_2(triton.cdiv(m, BLOCK_M)))
        block_n = 128 if row_blocks == 4 and not _INTERPRETER else MIN_BLOCK_N
        split = max(1, chunks // 2)
        while triton.cdiv(m, BLOCK_M * row_blocks) * triton.cdiv(n, block_n) * split < MIN_CTAS:
            if row_blocks == 4:
                row_blocks = 2
            elif split < chunks:
                split *= 2
            else:
                break
        return cls(block_m=BLOCK_M, block_n=block_n, block_k=min(128, chunk_k), row_blocks=row_blocks, split=split,
                   num_warps=4, num_stages=3)


def _slice_rows(n: int, chunks: int) -> int:
    """The most rows one launch takes: its fp32 partials within PARTIAL_BYTES."""
    return max(BLOCK_M, PARTIAL_BYTES // (4 * chunks * n) // BLOCK_M * BLOCK_M)


def _tiles(m: int, n: int, cfg: LinearConfig) -> tuple[int, int]:
    """The launch grid's (row groups, column blocks) over m rows and n columns."""
    return triton.cdiv(m, cfg.block_m * cfg.row_blocks), triton.cdiv(n, cfg.block_n)


def counters_for(n: int, k: int, chunks: int) -> int:
    """The int32 counters a product with an [n, k] weight in ``chunks`` chunks needs at any M
    (one per tile of its largest launch; 0 with one chunk): the size of a ``counters`` buffer."""
    if chunks == 1:
        return 0
    check_chunks(k, chunks)
    # The most row groups (2 row blocks each past 16 rows, one group below) and column blocks.
    return triton.cdiv(_slice_rows(n, chunks), 2 * BLOCK_M) * triton.cdiv(n, MIN_BLOCK_N)


def _served(k: int, chunks: int) -> bool:
    """Whether K cuts into ``chunks`` chunks of 16, 32, 64 or a multiple of 128 elements."""
    chunk_k = k // chunks
    return k % chunks == 0 and (chunk_k in (16, 32, 64) or chunk_k % 128 == 0)


def layer_chunks(k: int) -> int:
    """G, the chunks of a layer whose whole reduction is K long: the most of 8, 4 and 2 that
    ``check_chunks`` serves (8 for every Llama-3 layer), else 1. A TP=t shard of a
    row-parallel layer passes G / t."""
    return next((chunks for chunks in (8, 4, 2) if _served(k, chunks)), 1)


def check_chunks(k: int, chunks: int) -> int:
    """The chunk length of ``chunks`` chunks of K, or ValueError where the split is not served."""
    if chunks not in (1, 2, 4, 8):
        raise ValueError(f"chunks must be 1, 2, 4 or 8 (a power of two of at most {MAX_CHUNKS}), got {chunks}")
    if not _served(k, chunks):
        raise ValueError(f"K={k} does not split into {chunks} chunks of 16, 32, 64 or a multiple of 128 elements "
                         "(each chunk is summed in steps of 128, or in one power-of-two step)")
    return k // chunks


@triton.jit
def _add(a, b):
    """Two tuples of tiles, added tile by tile."""
    sums = ()
    for i in tl.static_range(len(a)):
        sums = sums + (a[i] + b[i],)
    return sums


@triton.jit
def _chunk_tree(X, Wt, rows0, cols, M, N, K, k0, CHUNK_K: tl.constexpr, BLOCK_K: tl.constexpr,
                ROW_BLOCKS: tl.constexpr, LEAVES: tl.constexpr):
    """A tuple of ROW_BLOCKS fp32 [BLOCK_M, BLOCK_N] tiles: the row blocks from rows0 on, times
    cols, of x @ w.T over LEAVES (1, 2, 4 or 8) chunks of CHUNK_K columns from k0, each chunk
    summed in BLOCK_K steps, in order, from zero, and the chunks' sums added over the pairwise
    tree (a subtree of ``peer.tree_sum``'s). Each weight block is loaded once per step and used
    by every row block, each its own 16-row dot.

    One loop over every step (one software pipeline, not one per chunk): at the end of chunk
    c the chunk's sum is kept in a slot for its level of the tree until its sibling is done,
    as a binary counter carries (slot 0 a chunk, 1 a pair, 2 four), and the last chunk's sum
    is added to the kept ones after the loop: at most log2(LEAVES) kept sums."""
    tl.static_assert(CHUNK_K % BLOCK_K == 0, "the K step must divide the chunk (its loads are not masked)")
    BLOCK_M: tl.constexpr = rows0.shape[0]
    STEPS: tl.constexpr = CHUNK_K // BLOCK_K
    acc = ()
    for _ in tl.static_range(ROW_BLOCKS):
        acc = acc + (tl.zeros([BLOCK_M, cols.shape[0]], tl.float32),)
    slot0, slot1, slot2 = acc, acc, acc
    ks = tl.arange(0, BLOCK_K)
    for step in range(0, LEAVES * STEPS):
        k = k0 + step * BLOCK_K
        b = tl.load(Wt + cols.to(tl.int64)[None, :] * K + (k + ks)[:, None], mask=(cols < N)[None, :], other=0.0)
        if _INTERPRETER:  # numpy has no bf16 matmul: widen exactly, sum in fp32
            b = to_f32(b)
        new = ()
        for rb in tl.static_range(ROW_BLOCKS):
            rows = rows0 + rb * BLOCK_M
            a = tl.load(X + rows.to(tl.int64)[:, None] * K + (k + ks)[None, :], mask=(rows < M)[:, None], other=0.0)
            if _INTERPRETER:
                new = new + (tl.dot(to_f32(a), b, acc[rb], input_precision="ieee"),)
            else:
                new = new + (tl.dot(a, b, acc[rb]),)
        acc = new
        if LEAVES > 1:
            c = step // STEPS
            if step % STEPS == STEPS - 1 and c < LEAVES - 1:  # chunk c done, not the last
                if c % 2 == 0:
                    slot0 = acc
                elif c % 4 == 1:
                    slot1 = _add(slot0, acc)
                else:  # c % 8 == 3 (7 is the last chunk at 8 leaves)
                    slot2 = _add(slot1, _add(slot0, acc))
                zero = ()
                for _ in tl.static_range(ROW_BLOCKS):
                    zero = zero + (tl.zeros([BLOCK_M, cols.shape[0]], tl.float32),)
                acc = zero
    if LEAVES >= 2:
        acc = _add(slot0, acc)
    if LEAVES >= 4:
        acc = _add(slot1, acc)
    if LEAVES == 8:
        acc = _add(slot2, acc)
    return acc


@triton.jit
def _tile(rows, cols, M, N):
    """Offsets and mask of the rows x cols tile of an [M, N] row-major output."""
    return rows.to(tl.int64)[:, None] * N + cols[None, :], (rows < M)[:, None] & (cols < N)[None, :]


@triton.jit(do_not_specialize=["M"])  # M == 1 compiles as any other M
def invariant_matmul_kernel(X, Wt, OUT, PARTIAL, COUNTS, M, N, K,
                            CHUNKS: tl.constexpr, CHUNK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                            SPLIT: tl.constexpr):
    """Grid (groups of ROW_BLOCKS row blocks, column blocks, SPLIT): a CTA sums CHUNKS / SPLIT
    consecutive chunks of its tile. PARTIAL: fp32 [SPLIT, M, N] (SPLIT > 1); COUNTS: int32
    zeros, one per (row group, column block) tile, left zero. Each row block is its own 16-row
    dot with the same weight block: ROW_BLOCKS changes how often the weights are read, SPLIT
    how the tree's subtrees are spread over CTAs, never a bit of a row."""
    tl.static_assert(SPLIT <= CHUNKS and CHUNKS % SPLIT == 0, "SPLIT CTAs share a tile's chunks evenly")
    pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    LEAVES: tl.constexpr = CHUNKS // SPLIT
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows0 = pid_m * ROW_BLOCKS * BLOCK_M + tl.arange(0, BLOCK_M)
    size = M.to(tl.int64) * N
    accs = _chunk_tree(X, Wt, rows0, cols, M, N, K, part * LEAVES * CHUNK_K, CHUNK_K, BLOCK_K, ROW_BLOCKS, LEAVES)
    for rb in tl.static_range(ROW_BLOCKS):
        offs, mask = _tile(rows0 + rb * BLOCK_M, cols, M, N)
        if SPLIT == 1:
            tl.store(OUT + offs, round_to(accs[rb], OUT.dtype.element_ty), mask=mask)
        else:
            tl.store(PARTIAL + part * size + offs, accs[rb], mask=mask)
    if SPLIT > 1:
        tl.debug_barrier()  # every thread's partials precede the count (release)
        counter = COUNTS + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            # Every CTA of the tile has counted: nothing else touches the count in this launch,
            # and the next launch on the stream starts after this one ends.
            tl.store(counter, 0)
            for rb in tl.static_range(ROW_BLOCKS):
                offs, mask = _tile(rows0 + rb * BLOCK_M, cols, M, N)
                parts = ()
                for p in tl.static_range(SPLIT):
                    parts = parts + (tl.load(PARTIAL + p * size + offs, mask=mask, other=0.0, cache_modifier=".cg"),)
                tl.store(OUT + offs, round_to(tree_sum(parts), OUT.dtype.element_ty), mask=mask)


def _launch(x2: torch.Tensor, w: torch.Tensor, out: torch.Tensor, chunks: int, chunk_k: int,
            counters: torch.Tensor | None) -> None:
    """One launch over the rows of x2 [m, K] into out [m, N] (contiguous row slices)."""
    (m, k), n = x2.shape, w.shape[0]
    cfg = LinearConfig.for_shape(m, n, chunks, chunk_k)
    groups, blocks = _tiles(m, n, cfg)
    partial = torch.empty((cfg.split, m, n) if cfg.split > 1 else (1,), dtype=torch.float32, device=x2.device)
    tiles = groups * blocks if cfg.split > 1 else 1  # one count a tile; none read with one CTA a tile
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
    invariant_matmul_kernel[(groups, blocks, cfg.split)](
        X=x2, Wt=w, OUT=out, PARTIAL=partial, COUNTS=counters, M=m, N=n, K=k, CHUNKS=chunks, CHUNK_K=chunk_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROW_BLOCKS=cfg.row_blocks,
        SPLIT=cfg.split, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **EXACT_FP)


def invariant_matmul_into(x2: torch.Tensor, w: torch.Tensor, out: torch.Tensor, chunks: int,
                          counters: torch.Tensor | None = None) -> None:
    """x2 [m, K] @ w.T into out [m, N] (all contiguous; arguments checked by the caller,
    ``tpfuse.linear_ops``), rows in slices whose fp32 partials take at most PARTIAL_BYTES (a
    row's bits do not depend on its slice). ``counters``: int32 zeros, at least
    ``counters_for(N, K, chunks)`` of them, left zero (else each launch zeroes its own)."""
    (m, k), n = x2.shape, w.shape[0]
    chunk_k = check_chunks(k, chunks)
    rows = _slice_rows(n, chunks) if chunks > 1 else max(m, 1)
    for start in range(0, m, rows):
        part = slice(start, min(m, start + rows))
        _launch(x2[part], w, out[part], chunks, chunk_k, counters)
