"""Log-probabilities of given tokens and seeded sampling, each row's bits its own (docs/design.md 1.4).

One program per row of logits walks the vocabulary in blocks of ``BLOCK`` (fixed: never chosen
from the number of rows or the vocabulary size), keeping one running value per lane, and
combines the lanes with one ``tl.max`` / ``tl.sum`` at the end. The order of every sum is
therefore fixed by the vocabulary size alone: a row's result does not depend on the batch it
is in, and with logits that do not depend on the TP size (an invariant model) neither does it.

- ``token_log_probs_kernel``: ``logits[target] - logsumexp(logits)`` in fp32.
- ``sample_kernel``: a draw from softmax(logits / temperature) restricted to its top-p set, by
  the Gumbel-max trick: the token maximising ``z_i + g_i``, with z = logits / temperature and
  g_i = -log(-log(u_i)), u_i a hash of (seed, position, i), each hashed apart before they are
  combined. The draw depends on the row's logits, its seed and its position alone. The top-p
  set is the tokens with z - max >= theta, theta the largest value (found by bisection,
  ``TOP_P_STEPS`` halvings of [-104, 0]) whose set holds at least ``top_p`` of the probability
  mass: the smallest set of most likely tokens, ties kept together (to within 104 / 2^40 of
  the threshold).

Rows holding +inf give all probability to their +inf entries. A NaN entry makes its row's
log-probabilities NaN and is never drawn (top-p then keeps the row's other tokens); a row of
-inf alone draws token 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, to_f32

BLOCK = 1024
"""Vocabulary entries per step of a row's walk (one value per lane of 4 warps, 8 per thread)."""
NUM_WARPS = 4
TOP_P_STEPS = 40
"""Bisection steps on the top-p threshold, over z - max in [-104, 0] (below -104 exp() is 0 in
fp32): the threshold to within 104 / 2^40, about 1e-10."""


@triton.jit
def _load_z(LOGITS, row, offs, V, stride, inv_temperature):
    return tl.where(offs < V, to_f32(tl.load(LOGITS + row * stride + offs, mask=offs < V, other=0.0))
                    * inv_temperature, float("-inf"))


@triton.jit
def _row_max(LOGITS, row, V, stride, inv_temperature, BLOCK: tl.constexpr):
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        m = tl.maximum(m, _load_z(LOGITS, row, start + tl.arange(0, BLOCK), V, stride, inv_temperature))
    return tl.max(m, 0)


@triton.jit
def _shifted(z, m):
    """z - m, the row's max m at 0; in a row holding +inf, its +inf entries at 0 and the rest
    at -inf (they share all the probability)."""
    return tl.where(m == float("inf"), tl.where(z == float("inf"), 0.0, float("-inf")), z - m)


@triton.jit
def _mass_above(LOGITS, row, V, stride, inv_temperature, m, theta, BLOCK: tl.constexpr):
    """sum(exp(z - m)) over the row's entries with z - m >= theta (theta -inf: all of them)."""
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        d = _shifted(_load_z(LOGITS, row, start + tl.arange(0, BLOCK), V, stride, inv_temperature), m)
        s += tl.where(d < theta, 0.0, tl.exp(d))  # NaN entries count (as NaN)
    return tl.sum(s, 0)


@triton.jit
def token_log_probs_kernel(LOGITS, TARGETS, OUT, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = _row_max(LOGITS, row, V, stride, 1.0, BLOCK)
    total = _mass_above(LOGITS, row, V, stride, 1.0, m, float("-inf"), BLOCK)
    picked = _shifted(to_f32(tl.load(LOGITS + row * stride + tl.load(TARGETS + row))), m)
    tl.store(OUT + row, picked - tl.log(total))


@triton.jit
def _hash(h):
    """A 32-bit integer hash (Wellons' lowbias32) of uint32 h."""
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def sample_kernel(LOGITS, SEEDS, POSITIONS, OUT, V, stride, inv_temperature, top_p, BLOCK: tl.constexpr,
                  TOP_P_STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = _row_max(LOGITS, row, V, stride, inv_temperature, BLOCK)
    theta = tl.full((), float("-inf"), tl.float32)  # on z - m
    if top_p < 1.0:
        need = top_p * _mass_above(LOGITS, row, V, stride, inv_temperature, m, float("-inf"), BLOCK)
        lo = tl.full((), -104.0, tl.float32)  # exp(-104) is below fp32's smallest subnormal: all the mass
        hi = tl.zeros((), tl.float32)
        for _ in range(TOP_P_STEPS):
            mid = lo + (hi - lo) * 0.5
            if _mass_above(LOGITS, row, V, stride, inv_temperature, m, mid, BLOCK) >= need:
                lo = mid
            else:
                hi = mid
        theta = lo
    key = _hash(_hash(tl.load(SEEDS + row).to(tl.uint32)) ^ _hash(tl.load(POSITIONS + row).to(tl.uint32) ^ 0x9E3779B9))
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        d = _shifted(_load_z(LOGITS, row, offs, V, stride, inv_temperature), m)
        h = _hash(key ^ _hash(offs.to(tl.uint32) ^ 0x85EBCA6B))
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits and a half: exact in fp32
        score = tl.where((d >= theta) & (offs < V), d - tl.log(-tl.log(u)), float("-inf"))
        take = score > best  # strict: a lane keeps its earliest index among equal scores
        best = tl.where(take, score, best)
        best_i = tl.where(take, offs, best_i)
    top = tl.max(best, 0)
    tl.store(OUT + row, tl.min(tl.where(best == top, best_i, V), 0).to(tl.int64))


def token_log_probs_into(logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor) -> None:
    """logits [N, V] (last dim contiguous), targets int64 [N] in 0..V-1 -> out fp32 [N]."""
    n, v = logits.shape
    token_log_probs_kernel[(n,)](logits, targets, out, v, logits.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS,
                                 **EXACT_FP)


def sample_into(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float,
                top_p: float, out: torch.Tensor) -> None:
    """logits [N, V] (last dim contiguous), seeds and positions int64 [N] -> out int64 [N]."""
    n, v = logits.shape
    sample_kernel[(n,)](logits, seeds, positions, out, v, logits.stride(0), 1.0 / temperature, top_p, BLOCK=BLOCK,
                        TOP_P_STEPS=TOP_P_STEPS, num_warps=NUM_WARPS, **EXACT_FP)
