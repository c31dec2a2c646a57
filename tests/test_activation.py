"""tpfuse.silu_and_mul against tpfuse.reference.silu_and_mul: bit for bit on GPUs (and against
torch's own ``F.silu(gate) * up``); under the interpreter, whose exp is numpy's, within two
units in the last place (fp32: four) and mostly bit for bit; every dtype, widths that are not
powers of two, rows and columns over several programs, row-strided inputs read in place,
special values; argument errors; opcheck.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (the model's)."""

import pytest
import torch
import torch.nn.functional as F

import tpfuse
from tests.conftest import DEVICE, ON_GPU
from tpfuse import reference

# (rows, I). On CPU the last takes two programs of columns and several of rows.
SHAPES = [(1, 8), (5, 96), (3, 1000), (70, 1536)] + ([(1, 14336), (64, 14336), (300, 7168)] if ON_GPU else [])
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _x(rows, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * i, generator=g) * 4).to(dtype).to(DEVICE)


def _assert_matches(got, x):
    """Bit for bit the reference on GPUs. Under the interpreter numpy's exp and torch's CPU exp
    differ in the last fp32 bit now and then, which can move a rounding of the silu (and so
    the product) by a unit: there each element within two units in the last place (fp32: four) of the
    float64 product of the rounded silu (float64 too) and up, and most 16-bit elements bit
    for bit."""
    want = reference.silu_and_mul(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    live = ~want.isnan()
    if ON_GPU:
        assert torch.equal(got.view(BITS[got.dtype])[live], want.view(BITS[want.dtype])[live])
        return
    g, up = x.double().chunk(2, dim=-1)
    act = (g / (1 + torch.exp(-g))).to(x.dtype).double()  # the silu rounded once, as the contract rounds it
    exact = torch.where(want.isinf(), want.double(), act * up)[live]  # overflows as torch's
    finfo = torch.finfo(x.dtype)
    err = torch.where(got.double()[live] == exact, 0.0, (got.double()[live] - exact).abs())  # infinities
    ulps = 4 if x.dtype == torch.float32 else 2  # fp32: exp's, the sum's and the division's errors
    assert bool((err <= ulps * finfo.eps * exact.abs() + finfo.tiny).all()), float((err / exact.abs()).max())
    if want.numel() >= 1000 and x.dtype != torch.float32:  # fp32 keeps exp's last bit
        assert float((got != want)[live].float().mean()) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_reference(shape, dtype):
    x = _x(*shape, dtype, sum(shape))
    y = tpfuse.silu_and_mul(x)
    _assert_matches(y, x)
    if ON_GPU:  # what the model ran before this kernel
        gate, up = x.chunk(2, dim=-1)
        assert torch.equal(y, F.silu(gate) * up)


@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")  # numpy, on CPU
def test_special_values_strided_input_and_rows_alone():
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 88.0, -88.0, 104.0, -104.0, 3e38, -3e38,
                             float("inf"), float("-inf"), float("nan")])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        i = 64
        x = _x(4, i, dtype, 7)
        x[0, : specials.numel()] = specials.to(dtype)  # gates
        x[1, i: i + specials.numel()] = specials.to(dtype)  # ups
        x[2, : specials.numel()] = specials.to(dtype)
        x[2, i: i + specials.numel()] = specials.flip(0).to(dtype)
        _assert_matches(tpfuse.silu_and_mul(x), x)
    # Rows of a wider tensor (read in place: strided rows reach the kernel), three leading
    # dimensions, and each row alone: the bits of the contiguous batch.
    wide = _x(70, 1200, torch.bfloat16, 8)
    x = wide[:, :2048]
    y = tpfuse.silu_and_mul(x)
    assert y.shape == (70, 1024) and y.is_contiguous()
    assert torch.equal(y, tpfuse.silu_and_mul(x.contiguous()))
    assert torch.equal(y[37], tpfuse.silu_and_mul(x[37:38])[0])
    x3 = wide.view(2, 5, 7, 2400)[..., :2048]
    assert torch.equal(tpfuse.silu_and_mul(x3).view(70, 1024), y)
    assert tpfuse.silu_and_mul(torch.empty(0, 2, 10, dtype=torch.bfloat16, device=DEVICE)).shape == (0, 2, 5)


def test_argument_errors():
    with pytest.raises(TypeError, match="bfloat16, float16 and float32"):
        tpfuse.silu_and_mul(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[..., 2I\]"):
        tpfuse.silu_and_mul(torch.zeros(2, 5, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[..., 2I\]"):
        tpfuse.silu_and_mul(torch.zeros((), dtype=torch.bfloat16, device=DEVICE))
    if ON_GPU:
        with pytest.raises(ValueError, match="need CUDA tensors"):
            tpfuse.silu_and_mul(torch.zeros(2, 4, dtype=torch.bfloat16))  # a CPU tensor beside CUDA


def test_custom_op_passes_opcheck():
    torch.library.opcheck(torch.ops.tpfuse.silu_and_mul.default, (_x(3, 40, torch.bfloat16, 9),))
