"""``tpfuse.invariant_attention``: causal attention whose bits depend on a query's position
alone, as a custom op.

Kernels and launcher: ``tpfuse.kernels.attention``; contract: ``tpfuse.reference.attention``
(closeness) and docs/design.md 1.3 (the invariances, tested kernel against kernel).
"""

from __future__ import annotations

import torch

from tpfuse.kernels.attention import invariant_attention_into

Tensor = torch.Tensor


def _check_args(q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"invariant_attention takes bf16 or fp16 q, k and v of one dtype, got {q.dtype}, {k.dtype} "
                        f"and {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q [B, H, T, D] and k, v [B, Hkv, S, D] do not match: {tuple(q.shape)}, {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the query heads ({q.shape[1]}) must be a multiple of the kv heads ({k.shape[1]})")
    if start.dim() != 1 or start.shape[0] != q.shape[0] or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be an int32 or int64 [B] tensor, got {start.dtype} {tuple(start.shape)}")
    if len({q.device, k.device, v.device, start.device}) > 1:
        raise ValueError(f"q, k, v and start must be on one device, got {q.device}, {k.device}, {v.device} and "
                         f"{start.device}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")


@torch.library.custom_op("tpfuse::invariant_attention", mutates_args=())
def _invariant_attention_op(q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float) -> Tensor:
    _check_args(q, k, v, start, scale)  # for callers of torch.ops.tpfuse.invariant_attention too
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel():
        invariant_attention_into(q, k, v, start.to(torch.int32).contiguous(), scale, out)
    return out


@_invariant_attention_op.register_fake
def _(q, k, v, start, scale):
    _check_args(q, k, v, start, scale)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float) -> Tensor:
    """Causal attention of queries at given positions over a KV cache, with fixed splits.

    Args:
        q: [B, H, T, D] bf16 or fp16, any strides: query t of sequence b sits at position
            ``start[b] + t``.
        k, v: [B, Hkv, S, D], q's dtype, any strides (a KV cache, or a prefill's own keys and
            values); positions past a query's are never read for it, past every query's not at
            all (an unwritten cache may hold anything there). H must be a multiple of Hkv
            (grouped-query attention: query head h reads kv head h // (H / Hkv)).
        start: [B] int32 or int64, on q's device (a device tensor: a CUDA graph replays it
            with the values it holds then). Every ``start[b] + T - 1`` must be below S.
        scale: the scores' factor (head_dim ** -0.5 usually), > 0.

    Returns a new contiguous [B, H, T, D] tensor. A query's bits depend on its own q, position,
    and the keys and values up to its position alone: not on the other sequences of the
    batch, the other queries of a prefill (a prefill's row t equals the decode step at t),
    or the heads on other ranks (docs/design.md 1.3), on one GPU architecture and Triton
    version. Not ``torch.nn.functional.scaled_dot_product_attention``'s bits:
    ``tpfuse.reference.attention`` holds it to a relative error budget. A custom op
    (``torch.ops.tpfuse.invariant_attention``) with a fake; no autograd.
    """
    _check_args(q, k, v, start, scale)
    return torch.ops.tpfuse.invariant_attention(q, k, v, start, float(scale))
