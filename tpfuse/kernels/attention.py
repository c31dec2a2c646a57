"""Attention whose bits depend on a query's position alone: batch-invariant decode and prefill
(docs/design.md 1.3).

A query at position p attends to the keys at positions 0..p. They are cut into splits of
``SPLIT`` positions (fixed: never chosen from the batch, the context length or the number of
CTAs). Split j of a query gives a partial ``(m_j, l_j, o_j)``: the scores
``s = (q . k) * scale`` in fp32 of its keys, their max, ``l_j = sum(exp(s - m_j))`` and
``o_j = sum(exp(s - m_j) v)`` (the weights rounded to v's dtype for the tensor cores, as
FlashAttention does), from one 16-row dot each (``BLOCK_M`` rows: a row's dot is the same
instruction whether the row is alone or one of 16). The splits are
folded in order, 0, 1, 2, ..., into ``(m, l, o)`` (``_fold``), and the output is ``o / l``
rounded once. A query's bits therefore depend on its own q, the keys and values up to its
position, and nothing else: not the batch around it, the other queries of a prefill, the
heads on other ranks (TP), or how the work is spread over CTAs.

Two ways to run the same arithmetic, chosen by shape (the bits cannot tell them apart):

- one pass (prefills): a CTA per (sequence, kv head, block of 16 query rows) folds every split
  of its rows in a loop;
- split-parallel (decode steps, one query per sequence): ``split_ctas`` CTAs per (sequence,
  kv head, row block) take its splits in turn (CTA c: splits c, c + split_ctas, ...) and store
  each split's partial in fp32; a second kernel folds them in order with the same ``_fold``.
  A CTA stops at its rows' last position, so the grid can cover the whole cache (and a CUDA
  graph capture any later position) without a CTA per unfilled split (``split_ctas``).

Query rows of a kv head are its ``group`` query heads (grouped-query attention) at each query
position: row r is position r // group, head r % group of the group; their keys are loaded
once per split for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, _INTERPRETER, round_to, to_f32

SPLIT = 64
"""Key positions per split: a [16, 64] score tile per dot, and at a context of 1024 sixteen
splits per (sequence, kv head) in a decode step."""
BLOCK_M = 16
"""Query rows per dot (one mma.m16n8k16 row block), for every shape."""
NUM_WARPS = 4
SPLIT_CTAS = 1024
"""The split-parallel way's CTAs per launch, about: a CTA per split up to it, fewer CTAs each
taking several splits past it (``split_ctas``)."""


def split_ctas(programs: int, n_splits: int) -> int:
    """CTAs per (sequence, kv head, row block), of which a decode step has ``programs``, over
    n_splits splits: one per split while there are at most SPLIT_CTAS in all, else fewer, each
    taking splits in turn.
    A CTA per split of the whole cache made 8192 CTAs at batch 64 (context 1024), nearly all
    past the filled positions, and the kernel took 1.74 ms of a 7.2 ms step (H200,
    benchmarks/NOTES.md). Which CTA computes a split never changes its bits."""
    return max(1, min(n_splits, SPLIT_CTAS // programs))


@triton.jit
def _split_partial(q, K, V, sks, skd, svs, svd, row_pos, j, scale, D, SPLIT: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Split j's partial for the rows of q ([BLOCK_M, BLOCK_D], their positions row_pos):
    (m_j, l_j, o_j). Keys past a row's position weigh 0 for that row; keys past every row's
    position are not loaded (0), so the values of unwritten cache positions never enter."""
    kpos = j * SPLIT + tl.arange(0, SPLIT)
    dims = tl.arange(0, BLOCK_D)
    load = (kpos <= tl.max(row_pos, 0))[:, None] & (dims < D)[None, :]
    k = tl.load(K + kpos.to(tl.int64)[:, None] * sks + dims[None, :] * skd, mask=load, other=0.0)
    v = tl.load(V + kpos.to(tl.int64)[:, None] * svs + dims[None, :] * svd, mask=load, other=0.0)
    if _INTERPRETER:  # numpy has no bf16 matmul: widen exactly, sum in fp32
        s = tl.dot(to_f32(q), tl.trans(to_f32(k)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    valid = kpos[None, :] <= row_pos[:, None]
    s = tl.where(valid, s * scale, float("-inf"))
    m = tl.max(s, 1)
    p = tl.where(valid, tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
    l = tl.sum(p, 1)
    if _INTERPRETER:
        o = tl.dot(to_f32(p.to(v.dtype)), to_f32(v), input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v)
    return m, l, o


@triton.jit
def _fold(m, l, o, m_j, l_j, o_j, take):
    """(m, l, o) with split partial (m_j, l_j, o_j) folded in, for the rows where ``take``;
    the others unchanged. The first fold of a row gives its partial exactly (its alpha is
    exp(-inf) = 0 and its beta 1)."""
    m_new = tl.maximum(m, m_j)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - ref)
    beta = tl.exp(m_j - ref)
    o_new = o * alpha[:, None] + o_j * beta[:, None]
    l_new = l * alpha + l_j * beta
    return tl.where(take, m_new, m), tl.where(take, l_new, l), tl.where(take[:, None], o_new, o)


@triton.jit
def _finish(o, l, DTYPE: tl.constexpr):
    """o / l rounded once; padding rows (l = 0) give 0, not 0 / 0."""
    return round_to(o / tl.where(l == 0.0, 1.0, l)[:, None], DTYPE)


@triton.jit
def _rows(pid_row, START, T, GROUP, HKV, BLOCK_M: tl.constexpr):
    """This CTA's sequence, kv head, rows (within the kv head's T * GROUP), whether each is
    real, and each row's position."""
    row_blocks = tl.cdiv(T * GROUP, BLOCK_M)
    bh = pid_row // row_blocks
    b = bh // HKV
    kvh = bh % HKV
    rows = (pid_row % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < T * GROUP
    row_pos = tl.where(real, tl.load(START + b) + rows // GROUP, -1)
    return b, kvh, rows, real, row_pos


@triton.jit
def attention_kernel(Q, K, V, OUT, PART, START, T, D, GROUP, HKV, n_splits, scale,
                     sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                     STORE_PARTIAL: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """One pass (STORE_PARTIAL False: every split folded, then o / l into OUT [B, H, T, D]) or
    the split-parallel way (STORE_PARTIAL True: splits program_id(1), + num_programs(1), ...,
    each split's partial into PART [B, H, T, n_splits, BLOCK_D + 2] fp32, its o then m and
    l). Splits past every row's position are skipped: the split-parallel grid covers the
    whole cache."""
    b, kvh, rows, real, row_pos = _rows(tl.program_id(0), START, T, GROUP, HKV, BLOCK_M)
    live = tl.minimum(n_splits, tl.max(row_pos, 0) // SPLIT + 1)  # splits up to the rows' last position
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + rows % GROUP
    q = tl.load(Q + b.to(tl.int64) * sqb + heads[:, None] * sqh + (rows // GROUP)[:, None] * sqt
                + dims[None, :] * sqd, mask=real[:, None] & (dims < D)[None, :], other=0.0)
    K_bh = K + b.to(tl.int64) * skb + kvh * skh
    V_bh = V + b.to(tl.int64) * svb + kvh * svh
    m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l0 = tl.zeros([BLOCK_M], tl.float32)
    o0 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    out_rows = (b.to(tl.int64) * HKV * GROUP + heads) * T + rows // GROUP  # [B, H, T] flattened
    if STORE_PARTIAL:
        for j in range(tl.program_id(1), live, tl.num_programs(1)):
            m_j, l_j, o_j = _split_partial(q, K_bh, V_bh, sks, skd, svs, svd, row_pos, j, scale, D, SPLIT, BLOCK_D)
            keep = real & (j * SPLIT <= row_pos)  # nothing where the split is past the rows
            # folded into the empty state, as a one-pass CTA's first split is (the same bits)
            m, l, o = _fold(m0, l0, o0, m_j, l_j, o_j, keep)
            part = PART + (out_rows * n_splits + j) * (BLOCK_D + 2)
            tl.store(part[:, None] + dims[None, :], o, mask=keep[:, None])
            tl.store(part + BLOCK_D, m, mask=keep)
            tl.store(part + BLOCK_D + 1, l, mask=keep)
    else:
        m, l, o = m0, l0, o0
        for j in range(0, live):
            m_j, l_j, o_j = _split_partial(q, K_bh, V_bh, sks, skd, svs, svd, row_pos, j, scale, D, SPLIT, BLOCK_D)
            m, l, o = _fold(m, l, o, m_j, l_j, o_j, j * SPLIT <= row_pos)
        tl.store(OUT + out_rows[:, None] * D + dims[None, :], _finish(o, l, OUT.dtype.element_ty),
                 mask=real[:, None] & (dims < D)[None, :])


@triton.jit
def merge_kernel(PART, OUT, START, T, D, GROUP, HKV, n_splits, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The split-parallel way's second step: each row's partials folded in split order (the
    one-pass kernel's ``_fold``, on the same values), then o / l into OUT."""
    b, kvh, rows, real, row_pos = _rows(tl.program_id(0), START, T, GROUP, HKV, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + rows % GROUP
    out_rows = (b.to(tl.int64) * HKV * GROUP + heads) * T + rows // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, tl.minimum(tl.max(row_pos, 0) // SPLIT + 1, n_splits)):
        take = real & (j * SPLIT <= row_pos)
        part = PART + (out_rows * n_splits + j) * (BLOCK_D + 2)
        o_j = tl.load(part[:, None] + dims[None, :], mask=take[:, None], other=0.0)
        m_j = tl.load(part + BLOCK_D, mask=take, other=float("-inf"))
        l_j = tl.load(part + BLOCK_D + 1, mask=take, other=0.0)
        m, l, o = _fold(m, l, o, m_j, l_j, o_j, take)
    tl.store(OUT + out_rows[:, None] * D + dims[None, :], _finish(o, l, OUT.dtype.element_ty),
             mask=real[:, None] & (dims < D)[None, :])


def invariant_attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                             scale: float, out: torch.Tensor) -> None:
    """Launch the attention of q [B, H, T, D] (query t of sequence b at position start[b] + t)
    over k, v [B, Hkv, S, D] (positions 0..S-1; any strides) into contiguous out [B, H, T, D];
    start: int32 [B] on the device. One query per sequence (T = 1) takes the split-parallel
    way, over a grid that covers all S positions (``split_ctas``); longer ones the one pass."""
    batch, heads, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    group = heads // hkv
    block_d = max(16, triton.next_power_of_2(d))
    n_splits = triton.cdiv(s, SPLIT)
    row_blocks = triton.cdiv(t * group, BLOCK_M)
    common = dict(Q=q, K=k, V=v, OUT=out, START=start, T=t, D=d, GROUP=group, HKV=hkv, n_splits=n_splits,
                  scale=scale, sqb=q.stride(0), sqh=q.stride(1), sqt=q.stride(2), sqd=q.stride(3), skb=k.stride(0),
                  skh=k.stride(1), sks=k.stride(2), skd=k.stride(3), svb=v.stride(0), svh=v.stride(1),
                  svs=v.stride(2), svd=v.stride(3), SPLIT=SPLIT, BLOCK_M=BLOCK_M, BLOCK_D=block_d,
                  num_warps=NUM_WARPS, **EXACT_FP)
    if t == 1:
        part = torch.empty(batch * heads * n_splits * (block_d + 2), dtype=torch.float32, device=q.device)
        programs = batch * hkv * row_blocks
        attention_kernel[(programs, split_ctas(programs, n_splits))](PART=part, STORE_PARTIAL=True, **common)
        merge_kernel[(programs,)](part, out, start, t, d, group, hkv, n_splits, SPLIT=SPLIT, BLOCK_M=BLOCK_M,
                                  BLOCK_D=block_d, num_warps=NUM_WARPS, **EXACT_FP)
    else:
        attention_kernel[(batch * hkv * row_blocks, 1)](PART=out, STORE_PARTIAL=False, **common)
