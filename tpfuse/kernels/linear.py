"""A matmul whose bits depend on K alone: batch- and TP-invariant linear layers (docs/design.md 1.2).

``invariant_matmul(x, weight, chunks)`` computes ``x @ weight.T`` so that each output
element's reduction order is fixed by K and ``chunks`` only, never by M or N (for a given GPU
architecture and Triton version: a tensor core's sum inside one instruction is its own, and
the interpreter's differs from a GPU's):

- the weights are the dot's rows and the tokens its columns: a CTA computes the transposed
  tile ``w[BLOCK_N rows] @ x.T[:, BLOCK_T tokens]``, so that on sm_90 64-row wgmma tiles of
  weight rows (one a warpgroup, one or two a CTA) serve every M and only the instruction's N
  (BLOCK_T, 16 to 64 tokens) follows the batch. A token's sum chains the same k16 steps
  whatever the tokens beside it: on an H200 every token tile and block shape gave every token
  the same bits (scripts/swap_ab_probe.py, and the GPU tests here). This is cuBLAS's own
  layout at 64 rows; the 16-row mma.sync dots before it ran at about 40% of its rate past 32
  rows (benchmarks/NOTES.md 2026-11-29);
- K is cut into ``chunks`` equal chunks, each summed in BLOCK_K steps, in order, into an fp32
  accumulator of its own, and the chunks' fp32 partials are added over the pairwise tree
  (``peer.tree_sum``), never a split of K chosen from the shape. A CTA sums a run of
  consecutive chunks (its subtree); where ``LinearConfig.split`` CTAs share a tile's chunks,
  the last of them to arrive adds their subtrees (an acq_rel count per tile: the
  deterministic last-CTA pattern, one launch) and sets the tile's count back to zero: a
  caller's counters buffer (``counters_for``) serves every later launch without a zeroing
  kernel of its own. The rest of the launch configuration (``LinearConfig``) changes no bit.

The tree is what makes the result TP-invariant: a row-parallel layer over t ranks gives each
rank a contiguous 1/t of K, so with ``chunks = G / t`` (G chunks in all, a power of two), a
rank's result is a subtree of the G-chunk tree, and the all-reduce's tree over the ranks
(``tpfuse.reference.tree_sum``) completes it: the same bits as one rank's
``invariant_matmul(x, weight, G)`` (tests/test_invariant_matmul.py).

The chunks also spread a product with few column blocks over enough CTAs to stream the
weights; where the tiles alone fill the GPU, one CTA sums all of a tile's chunks and no fp32
partial makes the round trip through memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, _INTERPRETER, round_to
from tpfuse.kernels.peer import tree_sum

BLOCK_N = 64
"""Weight rows a CTA: one 64-row wgmma tile on sm_90 (two, 128 rows, for 64 tokens a tile
where that alone fills the GPU: ``LinearConfig.for_shape``)."""
MIN_BLOCK_T = 16
"""The fewest tokens a tile (tl.dot's smallest N); up to 64 as M grows."""
MAX_CHUNKS = 8
MIN_CTAS = 256
"""``LinearConfig.for_shape`` spreads a tile's chunks over more CTAs while it has fewer than
this (so a launch whose CTAs share tiles has fewer tiles than this, and its fp32 partials stay
small: a few MB at most)."""
WIDE_MIN_CTAS = 128
"""128 weight rows a CTA only where the tiles alone number this many (an H200 has 132 SMs)."""


@dataclass(frozen=True)
class LinearConfig:
    """The launch configuration of one ``invariant_matmul`` launch. None of it changes a bit
    (the GPU tests compare the fp32 sums of rows alone and in batches, which take other
    configurations; scripts/tune_linear.py compares every configuration it times with the
    library's)."""

    block_n: int
    """Weight rows a CTA, the dot's rows."""
    block_t: int
    """Tokens a CTA, the dot's columns (the wgmma instruction's N)."""
    block_k: int
    split: int
    """CTAs sharing one tile's chunks (a power of two dividing them), each summing a run of
    chunks / split: enough CTAs to fill the GPU, no more fp32 partials than that takes."""
    num_warps: int
    num_stages: int

    @classmethod
    def for_shape(cls, m: int, n: int, chunks: int, chunk_k: int) -> "LinearConfig":
        """The fastest rule over scripts/tune_linear.py's grid on an H200 (Llama-3-8B's layers at
        TP 1 and 2, M = 1-256; benchmarks/NOTES.md 2026-11-29), measured before the chunk loop
        was flattened (its records differ in places: a new sweep should choose again):

        - 64 tokens a tile (M > 32) where 128-row tiles alone number WIDE_MIN_CTAS (at M =
          64 gate_up and lm_head; at 256 every TP=1 layer): 128 weight rows a CTA on two
          warpgroups, all its chunks in one CTA.
        - Otherwise 64 weight rows on one warpgroup, a tile's chunks shared by more CTAs
          (down to one chunk each) while fewer than MIN_CTAS (two a SM); one CTA summing all
          its chunks steps through K by 64 in 4 stages, CTAs sharing them by 128 in 3.

        Under the interpreter, which sums a dot's K in one numpy product, the blocks never
        change (the split changes no bit there either). On sm_90 the wgmma instructions add
        K in steps of 16 whatever the block (tests/test_invariant_matmul.py, on GPUs)."""
        block_t = MIN_BLOCK_T if _INTERPRETER else min(64, max(MIN_BLOCK_T, triton.next_power_of_2(m)))
        token_tiles = triton.cdiv(m, block_t)
        if block_t == 64 and token_tiles * triton.cdiv(n, 2 * BLOCK_N) >= WIDE_MIN_CTAS:
            return cls(block_n=2 * BLOCK_N, block_t=block_t, block_k=min(128, chunk_k), split=1,
                       num_warps=8, num_stages=4)
        split = 1
        while split < chunks and token_tiles * triton.cdiv(n, BLOCK_N) * split < MIN_CTAS:
            split *= 2
        block_k = 128 if split > 1 or _INTERPRETER else 64
        return cls(block_n=BLOCK_N, block_t=block_t, block_k=min(block_k, chunk_k), split=split,
                   num_warps=4, num_stages=4 if split == 1 else 3)


def _tiles(m: int, n: int, cfg: LinearConfig) -> tuple[int, int]:
    """The launch grid's (token tiles, column blocks) over m rows and n columns."""
    return triton.cdiv(m, cfg.block_t), triton.cdiv(n, cfg.block_n)


def counters_for(k: int, chunks: int) -> int:
    """The int32 counters a product of reduction length K in ``chunks`` chunks needs at any M
    and N: the size of a ``counters`` buffer. One a tile where CTAs share tiles, which happens
    only below MIN_CTAS tiles; none with one chunk."""
    if chunks == 1:
        return 0
    check_chunks(k, chunks)
    return MIN_CTAS


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
                         "(each chunk is summed in steps of 64 or 128, or in one power-of-two step)")
    return k // chunks


@triton.jit
def _chunk_sum(X, Wt, toks, cols, M, N, K, k0, CHUNK_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 [BLOCK_N, BLOCK_T] tile w[cols] @ x[toks].T over K columns [k0, k0 + CHUNK_K),
    summed from zero in BLOCK_K steps, in order (a loop of a fixed count, which
    ``_chunk_tree``'s flattening needs)."""
    tl.static_assert(CHUNK_K % BLOCK_K == 0, "the K step must divide the chunk (its loads are not masked)")
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([cols.shape[0], toks.shape[0]], tl.float32)
    for step in range(0, CHUNK_K // BLOCK_K):
        k = k0 + step * BLOCK_K
        w = tl.load(Wt + cols.to(tl.int64)[:, None] * K + (k + ks)[None, :], mask=(cols < N)[:, None], other=0.0)
        x = tl.load(X + toks.to(tl.int64)[None, :] * K + (k + ks)[:, None], mask=(toks < M)[None, :], other=0.0)
        if _INTERPRETER:  # numpy has no bf16 matmul, and BLAS's fp32 order follows the shape: sum in fp64
            acc += tl.dot(w.to(tl.float64), x.to(tl.float64), input_precision="ieee").to(tl.float32)
        else:
            acc = tl.dot(w, x, acc)
    return acc


@triton.jit
def _chunk_tree(X, Wt, toks, cols, M, N, K, k0, CHUNK_K: tl.constexpr, BLOCK_K: tl.constexpr,
                LEAVES: tl.constexpr):
    """``_chunk_sum`` of LEAVES (1, 2, 4 or 8) consecutive chunks from k0, added over the
    pairwise tree (a subtree of ``peer.tree_sum``'s): each chunk's sum is kept in a slot for its
    level of the tree until its sibling is done, as a binary counter carries (slot 0 a chunk, 1
    a pair, 2 four), and the last chunk's sum is added to the kept ones after the loop; at most
    log2(LEAVES) kept sums, updated by selects. Triton flattens the chunk loop and each chunk's
    K loop into one pipelined loop (``tl.range(flatten=True)``; with branches for the slots
    and the K loop's bounds taken from the chunk it left them nested), so the loads run ahead
    across a chunk's end where a loop per chunk refilled its pipeline (H200, gate_up at M = 64:
    71.5 -> 61.5 us, lm_head 293 -> 256; benchmarks/NOTES.md). Each chunk's sum still starts
    from zero in the dot's own chain; a reset written by hand inside one loop had miscompiled
    with wgmma (Triton 3.6, sm_90), the flattened loop passes tests/test_invariant_matmul.py
    on an H200."""
    zero = tl.zeros([cols.shape[0], toks.shape[0]], tl.float32)
    acc, slot0, slot1, slot2 = zero, zero, zero, zero
    for c in tl.range(0, LEAVES, flatten=True):
        acc = _chunk_sum(X, Wt, toks, cols, M, N, K, k0 + c * CHUNK_K, CHUNK_K, BLOCK_K)
        kept = c < LEAVES - 1
        slot2 = tl.where(kept & (c % 8 == 3), slot1 + (slot0 + acc), slot2)
        slot1 = tl.where(kept & (c % 4 == 1), slot0 + acc, slot1)
        slot0 = tl.where(kept & (c % 2 == 0), acc, slot0)
    if LEAVES >= 2:
        acc = slot0 + acc
    if LEAVES >= 4:
        acc = slot1 + acc
    if LEAVES == 8:
        acc = slot2 + acc
    return acc


@triton.jit
def _tile(toks, cols, M, N):
    """Offsets and mask of the transposed (cols x toks) tile of an [M, N] row-major output."""
    return toks.to(tl.int64)[None, :] * N + cols[:, None], (toks < M)[None, :] & (cols < N)[:, None]


@triton.jit(do_not_specialize=["M"])  # M == 1 compiles as any other M
def invariant_matmul_kernel(X, Wt, OUT, PARTIAL, COUNTS, M, N, K,
                            CHUNKS: tl.constexpr, CHUNK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (token tiles, column blocks, SPLIT): a CTA sums CHUNKS / SPLIT consecutive chunks
    of its tile. PARTIAL: fp32 [SPLIT, M, N] (SPLIT > 1); COUNTS: int32 zeros, one per (token
    tile, column block), left zero. The weight rows are the dot's rows at every M: BLOCK_T
    changes the instruction's N and how often the weights are read, SPLIT on which CTA a
    subtree is summed, never a bit of a token."""
    tl.static_assert(SPLIT <= CHUNKS and CHUNKS % SPLIT == 0, "SPLIT CTAs share a tile's chunks evenly")
    pid_t, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    LEAVES: tl.constexpr = CHUNKS // SPLIT
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _chunk_tree(X, Wt, toks, cols, M, N, K, part * LEAVES * CHUNK_K, CHUNK_K, BLOCK_K, LEAVES)
    offs, mask = _tile(toks, cols, M, N)
    if SPLIT == 1:
        tl.store(OUT + offs, round_to(acc, OUT.dtype.element_ty), mask=mask)
    else:
        size = M.to(tl.int64) * N
        tl.store(PARTIAL + part * size + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials precede the count (release)
        counter = COUNTS + pid_t * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            # Every CTA of the tile has counted: nothing else touches the count in this launch,
            # and the next launch on the stream starts after this one ends.
            tl.store(counter, 0)
            parts = ()
            for p in tl.static_range(SPLIT):
                parts = parts + (tl.load(PARTIAL + p * size + offs, mask=mask, other=0.0, cache_modifier=".cg"),)
            tl.store(OUT + offs, round_to(tree_sum(parts), OUT.dtype.element_ty), mask=mask)


def invariant_matmul_into(x2: torch.Tensor, w: torch.Tensor, out: torch.Tensor, chunks: int,
                          counters: torch.Tensor | None = None) -> None:
    """x2 [m, K] @ w.T into out [m, N] (all contiguous; arguments checked by the caller,
    ``tpfuse.linear_ops``) in one launch: a column block's token tiles run side by side and
    share its weights in L2. ``counters``: int32 zeros, at least ``counters_for(K,
    chunks)`` of them, left zero (else the launch zeroes its own, where CTAs share tiles)."""
    (m, k), n = x2.shape, w.shape[0]
    chunk_k = check_chunks(k, chunks)
    cfg = LinearConfig.for_shape(m, n, chunks, chunk_k)
    token_tiles, blocks = _tiles(m, n, cfg)
    partial = torch.empty((cfg.split, m, n) if cfg.split > 1 else (1,), dtype=torch.float32, device=x2.device)
    if cfg.split == 1:  # no count is read: any int32 pointer, no zeroing kernel
        counters = counters if counters is not None else torch.empty(1, dtype=torch.int32, device=x2.device)
    elif counters is None or counters.numel() < token_tiles * blocks:  # one count a tile
        counters = torch.zeros(token_tiles * blocks, dtype=torch.int32, device=x2.device)
    invariant_matmul_kernel[(token_tiles, blocks, cfg.split)](
        X=x2, Wt=w, OUT=out, PARTIAL=partial, COUNTS=counters, M=m, N=n, K=k, CHUNKS=chunks, CHUNK_K=chunk_k,
        BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, SPLIT=cfg.split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **EXACT_FP)

