"""``tpfuse.invariant_matmul``: a matmul whose bits depend on K alone, as a custom op.

Kernel and launcher: ``tpfuse.kernels.linear``; contract: ``tpfuse.reference.matmul`` (closeness)
and docs/design.md 1.2 (the invariances, tested kernel against kernel).
"""

from __future__ import annotations

from typing import Optional

import torch

from tpfuse.kernels.linear import check_chunks, invariant_matmul_into

Tensor = torch.Tensor


def _check_args(x: Tensor, weight: Tensor, chunks: int, out_dtype: Optional[torch.dtype],
                counters: Optional[Tensor]) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise TypeError(f"invariant_matmul takes bf16 or fp16 x and weight of the same dtype, got {x.dtype} and "
                        f"{weight.dtype}")
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] do not match: {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x and weight are on different devices: {x.device} and {weight.device}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise TypeError(f"out_dtype must be x's dtype or torch.float32, got {out_dtype}")
    check_chunks(weight.shape[1], chunks)
    if counters is not None and (counters.dtype != torch.int32 or counters.device != x.device
                                 or not counters.is_contiguous()):
        raise ValueError(f"counters must be a contiguous int32 tensor on {x.device}, got {counters.dtype} on "
                         f"{counters.device}")


def _empty_out(x: Tensor, weight: Tensor, out_dtype: Optional[torch.dtype]) -> Tensor:
    return torch.empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)


# counters is scratch the kernel leaves as it found it (zeros): not a mutated argument.
@torch.library.custom_op("tpfuse::invariant_matmul", mutates_args=())
def _invariant_matmul_op(x: Tensor, weight: Tensor, chunks: int, out_dtype: Optional[torch.dtype],
                         counters: Optional[Tensor] = None) -> Tensor:
    _check_args(x, weight, chunks, out_dtype, counters)  # for callers of torch.ops.tpfuse.invariant_matmul too
    out = _empty_out(x, weight, out_dtype)
    if out.numel():
        k = weight.shape[1]
        invariant_matmul_into(x.reshape(-1, k).contiguous(), weight.contiguous(), out.view(-1, weight.shape[0]),
                              chunks, counters)
    return out


@_invariant_matmul_op.register_fake
def _(x, weight, chunks, out_dtype, counters=None):
    _check_args(x, weight, chunks, out_dtype, counters)
    return _empty_out(x, weight, out_dtype)


def invariant_matmul(x: Tensor, weight: Tensor, chunks: int, out_dtype: Optional[torch.dtype] = None,
                     counters: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T`` with a reduction order fixed by K and ``chunks`` alone.

    Args:
        x: [..., K] bf16 or fp16 (any layout: a non-contiguous x is copied).
        weight: [N, K], x's dtype (``nn.Linear``'s layout).
        chunks: 1, 2, 4 or 8 equal chunks of K, each of 16, 32, 64 or a multiple of 128
            elements, summed over the pairwise tree; a TP=t shard of a layer of G chunks
            passes G / t (``tpfuse.kernels.linear.layer_chunks`` gives G).
        out_dtype: x's dtype (the default) or torch.float32, which keeps a row-parallel
            layer's partial sum unrounded for the all-reduce.
        counters: optional int32 zeros on x's device, at least
            ``tpfuse.kernels.linear.counters_for(K, chunks)`` of them: the per-tile counts
            of the chunks' last-CTA sum, which the kernel sets back to zero, so that a buffer
            kept by the caller saves each call a zeroing kernel. Calls sharing one must not
            run concurrently (one stream). Without it each call zeroes counts of its own.

    Returns a new [..., N] tensor. Row i's bits do not depend on the other rows or their
    number, nor on N (on one GPU architecture and Triton version); they are not
    torch.matmul's (``tpfuse.reference.matmul`` holds them to a relative error budget). A
    custom op (``torch.ops.tpfuse.invariant_matmul``) with a fake: ``torch.compile`` traces
    it and CUDA graphs capture it.
    """
    _check_args(x, weight, chunks, out_dtype, counters)
    return torch.ops.tpfuse.invariant_matmul(x, weight, chunks, out_dtype, counters)
