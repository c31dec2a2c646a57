"""``tpfuse.RMSNorm``: a drop-in for ``torch.nn.RMSNorm`` backed by tpfuse's kernels."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from tpfuse.norm_ops import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Same constructor and state_dict keys as ``torch.nn.RMSNorm`` (a ``weight`` of
    ``normalized_shape`` when ``elementwise_affine``), normalising over the trailing
    ``len(normalized_shape)`` dimensions.

    ``forward(x)`` returns ``y``; ``forward(x, residual)`` returns ``(y, residual_out)`` with
    ``residual_out = x + residual`` rounded to the dtype and ``y = norm(residual_out)``
    (see ``tpfuse.add_rms_norm``). Differs from torch's module only in ``eps``: torch's
    default (None) means the dtype's machine epsilon; tpfuse's default is 1e-6, and None is
    accepted with torch's meaning.
    """

    def __init__(self, normalized_shape, eps: float | None = 1e-6, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(t.shape[t.dim() - k:]) != self.normalized_shape:
            raise ValueError(f"input of shape {tuple(t.shape)} does not end in normalized_shape {self.normalized_shape}")
        return t.reshape(*t.shape[: t.dim() - k], -1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        w = None if self.weight is None else self.weight.reshape(-1)
        if w is not None and w.dtype not in (x.dtype, torch.float32):
            w = w.to(x.dtype)  # as torch.nn.RMSNorm accepts, e.g. a bf16 module on fp32 input
        if residual is None:
            return rms_norm(self._flat(x), w, eps).view(x.shape)
        y, r = add_rms_norm(self._flat(x), self._flat(residual), w, eps)
        return y.view(x.shape), r.view(x.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
