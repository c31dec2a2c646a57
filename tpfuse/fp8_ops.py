"""``tpfuse.quant_fp8``: activations quantized to fp8 (e4m3) for fp8 GEMMs, as a custom op.

Kernel and launcher: ``tpfuse.kernels.quant_fp8``; contract: ``tpfuse.reference.quant_fp8``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tpfuse._runtime import aligned_contiguous, check_float_tensor
from tpfuse.kernels.quant_fp8 import TILE_ELEMS, quant_fp8_into
from tpfuse.reference import FP8_MODES, fp8_scale_rows

Tensor = torch.Tensor


def fp8_outputs(y: Tensor, mode: str, group: int) -> tuple[Tensor, Tensor]:
    """q like y in e4m3, and the scales' tensor of ``mode`` (empty for "tensor")."""
    q = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=y.device)
    m = math.prod(y.shape[:-1])
    if mode == "tensor":
        return q, torch.empty(0, dtype=torch.float32, device=y.device)
    if mode == "token":
        return q, torch.empty(*y.shape[:-1], 1, dtype=torch.float32, device=y.device)
    # The padding rows (at most 3) are zeroed by the kernels (quant_fp8.zero_scale_padding).
    storage = torch.empty(y.shape[-1] // group, fp8_scale_rows(m), dtype=torch.float32, device=y.device)
    return q, storage.t()[:m]


def check_fp8_args(y: Tensor, mode: str, scale: Optional[Tensor], group: int) -> None:
    check_float_tensor(y, "y")
    if y.dim() == 0 or y.shape[-1] == 0:
        raise ValueError(f"y must have a last dimension of at least one element; got shape {tuple(y.shape)}")
    if mode not in FP8_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, FP8_MODES))}, got {mode!r}")
    if mode == "tensor":
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(f"mode='tensor' needs scale=, an fp32 tensor of one element; got {scale!r}")
        if scale.device != y.device:
            raise ValueError(f"scale is on {scale.device} but y is on {y.device}")
    elif scale is not None:
        raise ValueError(f"scale= is for mode='tensor'; mode={mode!r} derives its scales from y")
    if mode == "group" and (isinstance(group, bool) or not isinstance(group, int) or group < 16
                            or group > TILE_ELEMS or group & (group - 1) or y.shape[-1] % group):
        raise ValueError(f"group must be a power of two from 16 to {TILE_ELEMS} that divides N={y.shape[-1]}, "
                         f"got {group!r}")


@torch.library.custom_op("tpfuse::quant_fp8", mutates_args=())
def _quant_fp8_op(y: Tensor, mode: str, scale: Optional[Tensor], group: int) -> tuple[Tensor, Tensor]:
    check_fp8_args(y, mode, scale, group)  # for callers of torch.ops.tpfuse.quant_fp8 too
    q, scales = fp8_outputs(y, mode, group)
    n = y.shape[-1]
    quant_fp8_into(aligned_contiguous(y.reshape(-1, n)), q.view(-1, n),
                   scale if mode == "tensor" else scales.reshape(-1, scales.shape[-1]), mode, group)
    return q, scales


@_quant_fp8_op.register_fake
def _(y, mode, scale, group):
    check_fp8_args(y, mode, scale, group)
    return fp8_outputs(y, mode, group)


def quant_fp8(y: Tensor, mode: str = "token", *, scale: Tensor | None = None,
              group: int = 128) -> tuple[Tensor, Tensor]:
    """``(q, scales)``: y [..., N] (bf16, fp16 or fp32; finite) quantized to e4m3
    (``torch.float8_e4m3fn``, y's shape) for an fp8 GEMM, bitwise as
    ``tpfuse.reference.quant_fp8`` (each value times the correctly rounded fp32 reciprocal of
    its scale, saturation at +-448, rounding to nearest even).

    mode: "tensor" (the static ``scale``, a positive fp32 tensor of one element on y's
    device, returned as ``scales``), "token" (a scale per row: scales [..., 1] fp32) or
    "group" (a scale per row and ``group`` consecutive columns, a power of two from 16 to
    1024 dividing N: scales [M, N / group] fp32 for the M rows of y flattened, column-major
    with M padded to a multiple of 4 (the padding rows zero), as DeepGEMM-style block-scaled
    GEMMs read them). Rows of any length. New tensors (but the "tensor" scale); not
    differentiable; y is not modified.
    """
    check_fp8_args(y, mode, scale, group)
    if torch.is_grad_enabled() and y.requires_grad:
        raise RuntimeError("quant_fp8 is not differentiable: pass y.detach(), or call it under torch.no_grad()")
    q, scales = torch.ops.tpfuse.quant_fp8(y, mode, scale if mode == "tensor" else None, group)
    return (q, scale) if mode == "tensor" else (q, scales)
