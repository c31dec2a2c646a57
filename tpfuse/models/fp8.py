"""fp8 (e4m3) projections for ``TPModel(fp8=True)``: weights per output row, activations per token.

Each projection's weight shard [out, in] is stored in e4m3 with an fp32 scale per output row
(``max |row| / 448`` of this rank's shard); its input is quantized per token
(``tpfuse.quant_fp8(x, "token")``), by the layer boundary itself where the input is the
boundary's normed output (``Communicator.all_reduce_add_rms_norm_fp8``), and the product
runs on ``torch._scaled_mm`` with both scales, in bf16. ``torch._scaled_mm`` picks its kernel
by shape, so an fp8 model is not batch-invariant: ``TPModel`` refuses ``invariant=True``
with it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tpfuse.fp8_ops import quant_fp8

Tensor = torch.Tensor
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Fp8Activation(NamedTuple):
    """An activation quantized per token: q [..., K] e4m3, scales [..., 1] fp32."""

    q: Tensor
    scales: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 [out, in], fp32 scales [out]) of a weight [out, in], a scale per output row."""
    q, scales = quant_fp8(weight, "token")
    return q, scales.view(-1)


def fp8_linear(x: Tensor | Fp8Activation, weight: Tensor, weight_scales: Tensor,
               bias: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """x @ weight.T in ``out_dtype`` from e4m3 operands: x quantized per token first unless it
    is already an ``Fp8Activation``; weight [out, in] e4m3 with ``weight_scales`` [out]."""
    if not isinstance(x, Fp8Activation):
        x = Fp8Activation(*quant_fp8(x, "token"))
    k = x.q.shape[-1]
    out = torch._scaled_mm(x.q.reshape(-1, k), weight.t(), scale_a=x.scales.reshape(-1, 1),
                           scale_b=weight_scales.view(1, -1), out_dtype=out_dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.q.shape[:-1], weight.shape[0])
