"""The numerical contract of every tpfuse op, in plain torch.

This module is the specification the kernels are tested against:

- Bitwise ops (``all_reduce``, the ``residual_out`` of ``add_rms_norm``, the quantized
  codecs of later issues) are written here with exactly the roundings the kernels must do.
- Ops whose bits depend on a reduction order (RMSNorm and its backward) are written here in
  float64; kernels are held to a relative error budget against them, and to bitwise
  equality with each other (fused vs unfused, row alone vs row in a batch, run vs run).
"""

from __future__ import annotations

from typing import Sequence

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset)`` in float64.

    Returns float64 (the exact value the kernels approximate with one rounding).
    ``weight=None`` means no scaling.
    """
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    return y


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = round(f32(x) + f32(residual))`` in residual's dtype (bitwise contract),
    and ``y = rms_norm(residual_out)`` in float64, computed from the rounded residual_out."""
    residual_out = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm(residual_out, weight, eps, weight_offset=weight_offset), residual_out


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight) of ``rms_norm`` at x for the output gradient dy, in float64.

    dweight sums over every leading dimension; it is None when weight is None.
    """
    xd = x.double().detach().requires_grad_(True)
    wd = None if weight is None else weight.double().detach().requires_grad_(True)
    y = rms_norm(xd, wd, eps, weight_offset=weight_offset)
    grads = torch.autograd.grad(y, [xd] if wd is None else [xd, wd], dy.double())
    return grads[0], (grads[1] if wd is not None else None)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def rel_err_budget(dtype: torch.dtype) -> float:
    """Relative error allowed for a result rounded once to dtype and compared normwise with
    the float64 reference: the dtype's unit roundoff plus room for fp32 accumulation."""
    return UNIT_ROUNDOFF[dtype] + 2e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||out - ref|| / ||ref||, computed in float64."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def all_reduce(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The all-reduce contract: the fp32 sum over ``tensors`` in list (rank) order, starting
    from rank 0's value, rounded once to the inputs' dtype."""
    if len(tensors) == 0:
        raise ValueError("all_reduce needs at least one tensor")
    acc = tensors[0].float()
    for t in tensors[1:]:
        acc = acc + t.float()
    return acc.to(tensors[0].dtype)


def all_reduce_add_rms_norm(
    tensors: Sequence[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(all_reduce(tensors), residual, ...)``: the all-reduce result is rounded
    to the dtype before the residual add."""
    return add_rms_norm(all_reduce(tensors), residual, weight, eps, weight_offset=weight_offset)
