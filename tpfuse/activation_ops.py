"""``tpfuse.silu_and_mul``: SwiGLU's gate, silu(gate) * up, in one kernel, as a custom op.

Kernel and launcher: ``tpfuse.kernels.activation``; contract: ``tpfuse.reference.silu_and_mul``
(bit for bit on GPUs).
"""

from __future__ import annotations

import torch

from tpfuse._runtime import check_float_tensor
from tpfuse.kernels.activation import silu_and_mul_into

Tensor = torch.Tensor


def _check_args(x: Tensor) -> None:
    check_float_tensor(x, "silu_and_mul's x")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul takes x [..., 2I] (the gate's I columns, then up's), got {tuple(x.shape)}")


def _empty_out(x: Tensor) -> Tensor:
    return torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)


@torch.library.custom_op("tpfuse::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: Tensor) -> Tensor:
    _check_args(x)  # for callers of torch.ops.tpfuse.silu_and_mul too
    y = _empty_out(x)
    if y.numel():
        rows = x.reshape(-1, x.shape[-1])  # a view where the leading dimensions allow
        silu_and_mul_into(rows if rows.stride(-1) == 1 else rows.contiguous(), y.view(-1, y.shape[-1]))
    return y


@_silu_and_mul_op.register_fake
def _(x):
    _check_args(x)
    return _empty_out(x)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's gate: ``F.silu(x[..., :I]) * x[..., I:]`` in one kernel.

    Args:
        x: [..., 2I] bf16, fp16 or fp32, the gate's I columns then up's in each row (a fused
            gate/up projection's output). Rows may be strided (a slice of a wider tensor is
            read in place); a last dimension that is not contiguous is copied first.

    Returns a new contiguous [..., I] tensor of x's dtype. Bit for bit torch's eager
    ``F.silu(gate) * up`` on GPUs (``tpfuse.reference.silu_and_mul``): the silu is rounded to
    the dtype before the product, as torch's two ops round it (kernels that keep it in fp32,
    such as FlashInfer's ``silu_and_mul``, give other bits). Each row from its own inputs
    alone; one launch instead of two, and no round trip of the silu through memory. A custom
    op (``torch.ops.tpfuse.silu_and_mul``) with a fake; no autograd.
    """
    _check_args(x)
    return torch.ops.tpfuse.silu_and_mul(x)
