"""``tpfuse.rope_and_cache``: the rotary embedding of the query and key heads and the KV cache
write in one kernel, as a custom op.

Kernel and launcher: ``tpfuse.kernels.rope``; contract: ``tpfuse.reference.rope_and_cache``
(bit for bit).
"""

from __future__ import annotations

import torch

from tpfuse.kernels.rope import rope_and_cache_into

Tensor = torch.Tensor


def _check_args(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, start: Tensor, k_cache: Tensor,
                v_cache: Tensor) -> None:
    if qk.dtype not in (torch.bfloat16, torch.float16, torch.float32) or any(
            t.dtype != qk.dtype for t in (v, cos, sin, k_cache, v_cache)):
        raise TypeError("rope_and_cache takes qk, v, cos, sin and the caches in one dtype (bf16, fp16 or fp32), got "
                        f"{[t.dtype for t in (qk, v, cos, sin, k_cache, v_cache)]}")
    if qk.dim() != 4 or v.dim() != 4 or v.shape[:2] != qk.shape[:2] or v.shape[3] != qk.shape[3]:
        raise ValueError(f"qk [B, T, H + Hkv, D] and v [B, T, Hkv, D] do not match: {tuple(qk.shape)} and "
                         f"{tuple(v.shape)}")
    b, _, heads_qk, d = qk.shape
    n_kv = v.shape[2]
    if n_kv == 0 or heads_qk <= n_kv or d % 2:
        raise ValueError("v must hold at least one head, qk its query heads then as many key heads, and D must be "
                         f"even; got qk {tuple(qk.shape)} and v {tuple(v.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != d or cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must be [P, D] tables of one layout, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or \
            k_cache.shape[1] != n_kv or k_cache.shape[3] != d:
        raise ValueError(f"the caches must be [B, Hkv, S, D] = [{b}, {n_kv}, S, {d}], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if start.dim() != 1 or start.shape[0] != b or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be an int32 or int64 [B] tensor, got {start.dtype} {tuple(start.shape)}")
    if any(t.numel() and t.stride(-1) != 1 for t in (qk, v, cos, k_cache, v_cache)):
        raise ValueError("the last dimension of qk, v, cos, sin and the caches must be contiguous")
    if len({t.device for t in (qk, v, cos, sin, start, k_cache, v_cache)}) > 1:
        raise ValueError("qk, v, cos, sin, start and the caches must be on one device")


@torch.library.custom_op("tpfuse::rope_and_cache", mutates_args=("k_cache", "v_cache"))
def _rope_and_cache_op(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, start: Tensor, k_cache: Tensor,
                       v_cache: Tensor) -> Tensor:
    _check_args(qk, v, cos, sin, start, k_cache, v_cache)  # for callers of torch.ops.tpfuse.rope_and_cache too
    b, t, heads_qk, d = qk.shape
    q = torch.empty(b, heads_qk - v.shape[2], t, d, dtype=qk.dtype, device=qk.device)
    if q.numel():
        rope_and_cache_into(qk, v, cos, sin, start.contiguous(), k_cache, v_cache, q)
    return q


@_rope_and_cache_op.register_fake
def _(qk, v, cos, sin, start, k_cache, v_cache):
    _check_args(qk, v, cos, sin, start, k_cache, v_cache)
    b, t, heads_qk, d = qk.shape
    return torch.empty(b, heads_qk - v.shape[2], t, d, dtype=qk.dtype, device=qk.device)


def rope_and_cache(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, start: Tensor, k_cache: Tensor,
                   v_cache: Tensor) -> Tensor:
    """Rotate the query and key heads and write the keys and values into a KV cache, in one kernel.

    Args:
        qk: [B, T, H + Hkv, D], the query heads then the key heads of T tokens of B sequences
            (any strides but the last dimension's), as a fused QKV projection leaves them.
        v: [B, T, Hkv, D], the value heads (any strides but the last dimension's).
        cos, sin: [P, D] rotary tables (Hugging Face's: the angles' cos and sin, times the
            rope scaling, in the model dtype), of one layout.
        start: [B] int32 or int64 on the same device: token t of sequence b sits at position
            ``start[b] + t`` (0 for a prefill from the start; a decode step's positions). Every
            ``start[b] + T - 1`` must be below P and below S: it is not checked (the values
            live on the device, and reading them would stall the host).
        k_cache, v_cache: [B, Hkv, S, D], written in place at each token's position (keys
            rotated, values as given); nothing else in them is read or written.

    Every tensor has qk's dtype (bf16, fp16 or fp32). Returns the rotated queries, a new
    contiguous [B, H, T, D] tensor. Bit for bit Hugging Face's rotate-half embedding in the
    model dtype (``x * cos + rotate_half(x) * sin``, each product and the sum rounded as
    torch's ops round them; ``tpfuse.reference.rope_and_cache``). A custom op
    (``torch.ops.tpfuse.rope_and_cache``, mutating the caches) with a fake; no autograd.
    """
    _check_args(qk, v, cos, sin, start, k_cache, v_cache)
    return torch.ops.tpfuse.rope_and_cache(qk, v, cos, sin, start, k_cache, v_cache)
