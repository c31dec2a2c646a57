"""``tpfuse.silu_and_mul``: SwiGLU's gate, silu(gate) * up, in one kernel, as a custom op.

Kernel and launcher: ``tpfuse.kernels.activation``; contract: ``tpfuse.reference.silu_and_mul``
(bit for bit on GPUs).
"""

from __future__ import annotations

import torch

from tpfuse.kernels.activation import silu_and_mul_into

Tensor = torch.Tensor


def _check_args(x: Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"silu_and_mul takes bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul takes x [..., 2I] (the gate's I columns, then up's), got {tuple(x.shape)}")


def _empty_out(x: Tensor) -> Tensor:
    return torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)


@torch.library.custom_op("tpfuse::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: Tensor) -> Tensor:
    _check_args(x)  # for callers of torch.ops.tpfuse.silu_and_mul too
    y = _empty_out(x)
    if y.numel():
        silu_and_mul_into(x.reshape(-1, x.shape[-1]).contiguous(), y.view(-1, y.shape[-1]))
    return y


@_silu_and_mul_op.register_fake
def _(x):
    _check_args(x)
    return _empty_out(x)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's gate: ``F.silu(x[..., :I]) * x[..., I:]`` in one kernel.

    Args:
        x: [..., 2I] bf16, fp16 or fp32, the gate's I columns then up's in each row (a fused
            gate/up projection's output; any layout: a non-contiguous x is copied).

    Returns a new [..., I] tensor of x's dtype. Bit for bit torch's ``F.silu(gate) * up`` on
    GPUs (``tpfuse.reference.silu_and_mul``), each row from its own inputs alone; one launch
    instead of two and the silu's round trip through memory. A custom op
    (``torch.ops.tpfuse.silu_and_mul``) with a fake; no autograd.
    """
    _check_args(x)
    return torch.ops.tpfuse.silu_and_mul(x)
