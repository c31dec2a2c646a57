"""SwiGLU's gate: silu(gate) * up in one kernel (``tpfuse.silu_and_mul``).

A gated MLP's gate and up projections run as one GEMM whose output row holds the gate's I
columns, then the up projection's I. Written in torch, the gate is two elementwise kernels
(``F.silu(gate)``, then ``* up``) over strided halves of that output, with the silu written
to memory and read back; here it is one launch, a program per tile of rows and columns, with
torch's CUDA bits (``tpfuse.reference.silu_and_mul``): silu(g) = g / (1 + exp(-g)) in fp32
(CUDA's expf and an IEEE division, as torch's kernel compiles them) rounded to the dtype,
then the product with up in fp32 rounded to the dtype. Every element is computed on its own,
so a token's output depends on its own inputs alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tpfuse._runtime import INTERPRETER
from tpfuse.kernels.common import EXACT_FP, _INTERPRETER, round_to, to_f32

_TILE_ELEMS = 4096
"""Output elements per program on GPUs: 32 per thread on 4 warps."""
_INTERPRETER_TILE_ELEMS = 1 << 16
MAX_BLOCK_I = 1024
NUM_WARPS = 4


@triton.jit
def _exp(x):
    """expf as CUDA's libm computes it (torch's silu calls it): Triton's own exp is the fast
    ex2.approx, which differs in the last bits. The interpreter has numpy's exp."""
    if _INTERPRETER:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def silu_and_mul_kernel(X, Y, n_rows, I, x_stride, y_stride, ROWS: tl.constexpr, BLOCK_I: tl.constexpr):
    """Y[r, c] = silu(X[r, c]) * X[r, I + c] for ROWS rows and BLOCK_I columns of n_rows x I;
    strides in elements (the last dimension contiguous)."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    live = (r < n_rows) & (c < I)
    gate = tl.load(X + r * x_stride + c, mask=live)
    up = tl.load(X + r * x_stride + I + c, mask=live)
    g = to_f32(gate)
    act = round_to(tl.math.div_rn(g, 1.0 + _exp(-g)), gate.dtype)
    tl.store(Y + r * y_stride + c, round_to(to_f32(act) * to_f32(up), gate.dtype), mask=live)


def silu_and_mul_blocks(n_rows: int, i: int) -> tuple[int, int]:
    """(rows, columns) a program: up to MAX_BLOCK_I columns and _TILE_ELEMS elements on GPUs;
    under the interpreter, which pays per program rather than per element, up to
    _INTERPRETER_TILE_ELEMS (a test model's decode step in one program)."""
    block_i = min(MAX_BLOCK_I, triton.next_power_of_2(i))
    cap = _INTERPRETER_TILE_ELEMS if INTERPRETER else _TILE_ELEMS
    return min(triton.next_power_of_2(n_rows), max(1, cap // block_i)), block_i


def silu_and_mul_into(x: torch.Tensor, y: torch.Tensor) -> None:
    """Launch on checked operands (``tpfuse.activation_ops``): x [R, 2I] and y [R, I], any
    row strides, the last dimension of each contiguous."""
    n_rows, i = y.shape
    rows, block_i = silu_and_mul_blocks(n_rows, i)
    silu_and_mul_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(i, block_i))](
        X=x, Y=y, n_rows=n_rows, I=i, x_stride=x.stride(0), y_stride=y.stride(0), ROWS=rows, BLOCK_I=block_i,
        num_warps=NUM_WARPS, **EXACT_FP)
