"""Rotary position embedding and the KV cache write, in one kernel (``tpfuse.rope_and_cache``).

An attention block's projection leaves, per token, H query heads, Hkv key heads and Hkv value
heads. Before attention the query and key heads are rotated (Hugging Face's rotate-half rotary
embedding, at the token's position) and the keys and values are written into the KV cache at
that position. Written in torch that is a negation, a concatenation, three elementwise kernels
and two cache writes per layer; here it is one launch, a program per block of rows (a row: one
head of one token), with the bits of the torch ops (``tpfuse.reference.rope_and_cache``):
each product and the sum rounded to the model dtype as torch rounds them. Every element is
computed on its own, so a token's output depends on its own inputs and position alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER
from tpfuse.kernels.common import EXACT_FP, round_to, to_f32

_TILE_ELEMS = 2048
"""Elements per program on GPUs (rows x head_dim padded to a power of two): 16 per thread on 4 warps."""
_INTERPRETER_TILE_ELEMS = 1 << 16
NUM_WARPS = 4


@triton.jit
def _rotated(x, xp, c, s, d, HALF: tl.constexpr):
    """x * cos + rotate_half(x) * sin in x's dtype, each product and the sum rounded once (as
    torch's three elementwise ops); xp is x at d's partner column (d + HALF) mod D."""
    ELEM: tl.constexpr = x.dtype
    r = to_f32(xp)
    # Negated as torch negates, a zero's sign too (Triton writes -r as 0 - r, which gives +0
    # for +0), and in fp32: the interpreter cannot negate bf16.
    r = tl.where(d < HALF, r * -1.0, r)
    return round_to(to_f32(round_to(to_f32(x) * to_f32(c), ELEM)) + to_f32(round_to(r * to_f32(s), ELEM)), ELEM)


@triton.jit
def rope_and_cache_kernel(QK, V, COS, SIN, START, Q, K_CACHE, V_CACHE, n_rows, T, n_heads, n_kv, D,
                          qk_sb, qk_st, qk_sh, v_sb, v_st, v_sh, cs_sp,
                          kc_sb, kc_sh, kc_sp, vc_sb, vc_sh, vc_sp,
                          ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """ROWS rows of head_dim elements: row r is head r % (H + 2 Hkv) of token r // (H + 2 Hkv)
    (sequence b, offset t: position START[b] + t), of n_rows in all. The first H + Hkv heads
    of a token (queries, keys) are rotated from QK, the last Hkv (values) copied from V;
    queries go to Q [B, H, T, D] (contiguous), keys and values into the caches at the
    position. Strides in elements; the last dimension of every operand is contiguous, and
    START [B] too. Row indices in int32 (n_rows < 2^31), offsets in int64: one sequence's
    cache may hold more than 2^31 elements."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]  # int32 (n_rows < 2^31): cheap divisions
    live = r < n_rows
    token = r // (n_heads + 2 * n_kv)
    h = (r % (n_heads + 2 * n_kv)).to(tl.int64)
    b = (token // T).to(tl.int64)
    t = (token % T).to(tl.int64)
    pos = tl.load(START + b, mask=live, other=0).to(tl.int64) + t
    d = tl.arange(0, BLOCK_D)[None, :]
    col = live & (d < D)
    rotate = (h < n_heads + n_kv) & col
    src = QK + b * qk_sb + t * qk_st + h * qk_sh
    x = tl.load(src + d, mask=rotate)
    xp = tl.load(src + (d + D // 2) % D, mask=rotate)
    c = tl.load(COS + pos * cs_sp + d, mask=col)
    s = tl.load(SIN + pos * cs_sp + d, mask=col)
    out = _rotated(x, xp, c, s, d, D // 2)
    tl.store(Q + ((b * n_heads + h) * T + t) * D + d, out, mask=rotate & (h < n_heads))
    kv = h - n_heads
    tl.store(K_CACHE + b * kc_sb + kv * kc_sh + pos * kc_sp + d, out, mask=rotate & (kv >= 0))
    vh = kv - n_kv
    is_v = (vh >= 0) & col
    vals = tl.load(V + b * v_sb + t * v_st + vh * v_sh + d, mask=is_v)
    tl.store(V_CACHE + b * vc_sb + vh * vc_sh + pos * vc_sp + d, vals, mask=is_v)


def rows_per_program(n_rows: int, block_d: int) -> int:
    """Rows (heads of tokens) per program: _TILE_ELEMS elements on GPUs; under the interpreter,
    which pays per program and per operation rather than per element, every row at once up to
    _INTERPRETER_TILE_ELEMS (a decode step of a test model in one program)."""
    cap = _INTERPRETER_TILE_ELEMS if INTERPRETER else _TILE_ELEMS
    return min(triton.next_power_of_2(n_rows), max(1, cap // block_d))


def rope_and_cache_into(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
    """Launch on checked operands (``tpfuse.rope_ops``): qk [B, T, H + Hkv, D], v [B, T, Hkv,
    D], cos and sin [P, D] (one stride), start [B] int, the caches [B, Hkv, S, D], q [B, H, T,
    D] contiguous; the last dimension of each contiguous, start contiguous."""
    b, t, heads_qk, d = qk.shape
    n_kv = v.shape[2]
    n_rows = b * t * (heads_qk + n_kv)
    if n_rows >= 2**31:
        raise ValueError(f"rope_and_cache takes fewer than 2^31 heads of tokens in one call, got {n_rows}")
    block_d = triton.next_power_of_2(d)
    rows = rows_per_program(n_rows, block_d)
    rope_and_cache_kernel[(triton.cdiv(n_rows, rows),)](
        QK=qk, V=v, COS=cos, SIN=sin, START=start, Q=q, K_CACHE=k_cache, V_CACHE=v_cache, n_rows=n_rows, T=t,
        n_heads=heads_qk - n_kv, n_kv=n_kv, D=d, qk_sb=qk.stride(0), qk_st=qk.stride(1), qk_sh=qk.stride(2),
        v_sb=v.stride(0), v_st=v.stride(1), v_sh=v.stride(2), cs_sp=cos.stride(0),
        kc_sb=k_cache.stride(0), kc_sh=k_cache.stride(1), kc_sp=k_cache.stride(2),
        vc_sb=v_cache.stride(0), vc_sh=v_cache.stride(1), vc_sp=v_cache.stride(2),
        ROWS=rows, BLOCK_D=block_d, num_warps=NUM_WARPS, **EXACT_FP)
