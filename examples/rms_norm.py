"""RMSNorm on one device: `python examples/rms_norm.py` (a GPU if there is one, else the CPU)."""

import torch

import tpfuse

device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(16, 4096, dtype=torch.bfloat16, device=device)
residual = torch.randn_like(x)
weight = torch.randn(4096, dtype=torch.bfloat16, device=device)

y = tpfuse.rms_norm(x, weight, eps=1e-6)
y2, residual_out = tpfuse.add_rms_norm(x, residual, weight)  # residual_out = round(x + residual)
assert torch.equal(y2, tpfuse.rms_norm(residual_out, weight))  # bit for bit
assert torch.equal(y, tpfuse.reference.rms_norm(x, weight)) or tpfuse.reference.rel_err(
    y, tpfuse.reference.rms_norm(x, weight)) < tpfuse.reference.rel_err_budget(x.dtype)

norm = tpfuse.RMSNorm(4096, device=device, dtype=torch.bfloat16)  # a drop-in for torch.nn.RMSNorm
print("rms_norm:", tuple(norm(x).shape), "- add_rms_norm equals rms_norm of the rounded sum, bit for bit")
