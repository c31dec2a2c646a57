"""Public RMSNorm functions, their torch.library custom ops and autograd.

Layers: ``tpfuse.kernels.norm`` and ``norm_bwd`` (kernels + launchers into given outputs) ->
custom ops here (allocate, flatten to 2-D, registered with fake implementations so
``torch.compile`` traces them and CUDA graphs capture them) -> autograd registration -> the
public functions, which validate their arguments before anything runs.
"""

from __future__ import annotations

import math
import numbers

from typing import Optional

import torch

from tpfuse._runtime import aligned_contiguous, check_float_tensor
from tpfuse.kernels.norm import rms_norm_fwd
from tpfuse.kernels.norm_bwd import rms_norm_bwd

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------
# Validation


def check_norm_args(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                    residual: Optional[Tensor] = None, fp32_partials: bool = False):
    """fp32_partials: x may be fp32 with a 16-bit residual (the fused all-reduce's partial
    sums), the norm then in the residual's dtype."""
    check_float_tensor(x, "x")
    # Comparisons, not math.isfinite: torch.compile traces a defaulted eps as a symbolic float,
    # and math.isfinite on one breaks the graph. NaN fails both comparisons.
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf:
        # eps = 0 turns an all-zero row into 0 * inf = NaN; a NaN or negative eps, every row.
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one); got a 0-dim tensor")
    n = x.shape[-1]
    if residual is not None:
        check_float_tensor(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}")
        if residual.dtype != x.dtype and not (fp32_partials and x.dtype == torch.float32):
            raise TypeError(f"residual has dtype {residual.dtype} but x has dtype {x.dtype}; they must match"
                            + (" (or x be fp32 partial sums)" if fp32_partials else ""))
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")
    if weight is None:
        if weight_offset != 0.0:
            raise ValueError("weight_offset is only meaningful with a weight; got weight=None")
        return
    check_float_tensor(weight, "weight")
    if weight.shape != (n,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({n},) for x of shape {tuple(x.shape)}")
    dtype = x.dtype if residual is None else residual.dtype  # the norm's
    if weight.dtype not in (dtype, torch.float32):
        raise TypeError(f"weight has dtype {weight.dtype}; it must be the normalised rows' dtype ({dtype}) or "
                        "float32")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")


def _rows(t: Tensor) -> Tensor:
    """t as a 2-D, contiguous, 16-byte-aligned [rows, N] tensor (a copy only when needed)."""
    return aligned_contiguous(t.reshape(-1, t.shape[-1]))


def _aligned_weight(w: Optional[Tensor]) -> Optional[Tensor]:
    """The weight (or None) contiguous and 16-byte aligned (a copy only when needed)."""
    return None if w is None else aligned_contiguous(w)


# ---------------------------------------------------------------------------------------
# Custom ops


@torch.library.custom_op("tpfuse::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float) -> Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        rms_norm_fwd(_rows(x), _aligned_weight(weight), y.view(-1, x.shape[-1]), eps, weight_offset)
    return y


@_rms_norm_op.register_fake
def _(x, weight, eps, weight_offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpfuse::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float
) -> tuple[Tensor, Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        n = x.shape[-1]
        rms_norm_fwd(_rows(x), _aligned_weight(weight), y.view(-1, n), eps, weight_offset,
                        residual=_rows(residual), residual_out=residual_out.view(-1, n))
    return y, residual_out


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, weight_offset):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.custom_op("tpfuse::add_rms_norm_", mutates_args=("residual",))
def _add_rms_norm_inplace_op(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float
) -> Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        n = x.shape[-1]
        res = _rows(residual)  # residual itself where it is contiguous and aligned, else a copy
        # The kernel may write residual_out over the residual (rms_norm_fwd).
        rms_norm_fwd(_rows(x), _aligned_weight(weight), y.view(-1, n), eps, weight_offset, residual=res, residual_out=res)
        if res.data_ptr() != residual.data_ptr():
            residual.copy_(res.view(residual.shape))
    return y


@_add_rms_norm_inplace_op.register_fake
def _(x, residual, weight, eps, weight_offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpfuse::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], dresidual_out: Optional[Tensor],
    eps: float, weight_offset: float,
) -> tuple[Tensor, Tensor]:
    """(dx, dweight); dweight is an empty tensor when weight is None."""
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty(0 if weight is None else weight.shape, dtype=x.dtype if weight is None else weight.dtype,
                          device=x.device)
    rms_norm_bwd(_rows(dy), _rows(x), _aligned_weight(weight), dx.view(-1, n),
                    dweight if weight is not None else None, eps, weight_offset,
                    dresidual_out=None if dresidual_out is None else _rows(dresidual_out))
    return dx, dweight


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, dresidual_out, eps, weight_offset):
    dweight = x.new_empty(0) if weight is None else torch.empty_like(weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dweight


# ---------------------------------------------------------------------------------------
# Autograd


def _norm_backward(ctx, dy: Optional[Tensor], dresidual_out: Optional[Tensor]):
    (x, weight) = ctx.saved_tensors
    if dy is None:  # only residual_out was used downstream
        dy = torch.zeros_like(x)
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    dx, dweight = torch.ops.tpfuse.rms_norm_backward(dy, x, weight, dresidual_out, ctx.eps, ctx.weight_offset)
    return dx, (dweight if weight is not None and ctx.needs_input_grad[ctx.weight_index] else None)


def _setup_norm(ctx, inputs, output, weight_index: int, saved_x):
    ctx.eps, ctx.weight_offset = inputs[weight_index + 1], inputs[weight_index + 2]
    ctx.weight_index = weight_index
    ctx.save_for_backward(saved_x, inputs[weight_index])


def _rms_norm_setup(ctx, inputs, output):
    _setup_norm(ctx, inputs, output, 1, inputs[0])


def _rms_norm_bwd(ctx, dy):
    dx, dweight = _norm_backward(ctx, dy, None)
    return dx, dweight, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    _setup_norm(ctx, inputs, output, 2, output[1])  # the norm's input is residual_out


def _add_rms_norm_bwd(ctx, dy, dresidual_out):
    # residual_out = x + residual, so both inputs receive the gradient of residual_out.
    dres, dweight = _norm_backward(ctx, dy, dresidual_out)
    return dres, dres, dweight, None, None


torch.library.register_autograd("tpfuse::rms_norm", _rms_norm_bwd, setup_context=_rms_norm_setup)
torch.library.register_autograd("tpfuse::add_rms_norm", _add_rms_norm_bwd, setup_context=_add_rms_norm_setup)


# ---------------------------------------------------------------------------------------
# Public functions


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *, weight_offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dimension.

    ``y = x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset)``, computed in fp32 and
    rounded once to x's dtype (``weight_offset=1.0`` is the Gemma convention).

    Args:
        x: ``[..., N]``, bfloat16 / float16 / float32, any layout (non-contiguous inputs are
            copied; the bits are the same).
        weight: ``[N]`` in x's dtype or float32, or None for no scaling.
        eps: added to the mean square; a finite number > 0 (else ValueError).
        weight_offset: added to weight (requires a weight).

    Returns:
        y: a new contiguous tensor of x's shape and dtype.

    The row reduction order depends only on N and dtype, so a row's result never depends on
    the batch it is in (batch invariance) or the GPU's SM count. Differentiable in x and
    weight; the backward reduces dweight in a fixed order (deterministic, no float
    atomics): inside the backward kernel, or by a second launch with the same order where
    that measured faster. Raises TypeError/ValueError for unsupported dtypes, wrong weight
    shape, or tensors on different devices.
    """
    check_norm_args(x, weight, eps, weight_offset)
    return torch.ops.tpfuse.rms_norm(x, weight, float(eps), float(weight_offset))


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Residual add followed by RMSNorm, in one pass.

    ``residual_out = round(f32(x) + f32(residual))`` in residual's dtype, then
    ``y = rms_norm(residual_out, weight, eps, weight_offset=...)`` computed from the rounded
    residual_out, so ``y`` is bit-identical to ``rms_norm(residual_out, ...)``.

    Args:
        x, residual: ``[..., N]``, same shape and dtype (bfloat16 / float16 / float32).
        weight: ``[N]`` in x's dtype or float32, or None.
        inplace: write residual_out into ``residual`` and return ``residual`` itself as the
            second output (the serving-engine convention). Not differentiable.

    Returns:
        ``(y, residual_out)``: y is a new tensor; residual_out is new, or ``residual`` when
        ``inplace=True``.

    Differentiable (with ``inplace=False``): gradients may arrive on both y and
    residual_out; x and residual both receive ``d residual_out`` (the two are summed
    inside the backward kernel).
    """
    check_norm_args(x, weight, eps, weight_offset, residual)
    if inplace:
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, residual, weight)
        ):
            raise ValueError("add_rms_norm(inplace=True) is not differentiable; use inplace=False under autograd")
        y = torch.ops.tpfuse.add_rms_norm_(x, residual, weight, float(eps), float(weight_offset))
        return y, residual
    return torch.ops.tpfuse.add_rms_norm(x, residual, weight, float(eps), float(weight_offset))
