"""tpfuse.silu_and_mul against tpfuse.reference.silu_and_mul: bit for bit on GPUs (and against
torch's own ``F.silu(gate) * up``), within one unit in the last place under the interpreter
(numpy's exp against torch's CPU exp); every dtype, widths that are not powers of two, rows
over several programs, strided inputs, special values; argument errors; opcheck.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (the model's)."""

import pytest
import torch
import torch.nn.functional as F

import tpfuse
from tests.conftest import DEVICE, ON_GPU
from tpfuse import reference
from tpfuse.kernels import activation

# (rows, I). On CPU the last takes two programs of columns and of rows.
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
    # A strided [..., 2I] view (every other row of a larger tensor, three leading dims) and
    # each row alone: the same bits as the contiguous batch.
    big = _x(12, 48, torch.bfloat16, 8).view(2, 3, 2, 96)
    x = big[:, :, 0]
    y = tpfuse.silu_and_mul(x)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y, tpfuse.silu_and_mul(x.contiguous()))
    assert torch.equal(y[1, 2], tpfuse.silu_and_mul(x[1, 2:3])[0])
    assert tpfuse.silu_and_mul(torch.empty(0, 2, 10, dtype=torch.bfloat16, device=DEVICE)).shape == (0, 2, 5)


def test_blocks_cover_the_model_shapes():
    # Every output element is in exactly one program's tile: columns up to MAX_BLOCK_I a program.
    for rows, i in [(1, 14336), (64, 14336), (256, 7168), (3, 1000)]:
        r, c = activation.silu_and_mul_blocks(rows, i)
        assert c <= activation.MAX_BLOCK_I and c == min(activation.MAX_BLOCK_I, 1 << (i - 1).bit_length())
        assert r >= 1 and (r & (r - 1)) == 0


def test_argument_errors():
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        tpfuse.silu_and_mul(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[..., 2I\]"):
        tpfuse.silu_and_mul(torch.zeros(2, 5, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[..., 2I\]"):
        tpfuse.silu_and_mul(torch.zeros((), dtype=torch.bfloat16, device=DEVICE))


def test_custom_op_passes_opcheck():
    torch.library.opcheck(torch.ops.tpfuse.silu_and_mul.default, (_x(3, 40, torch.bfloat16, 9),))
