"""tpfuse.quant_fp8 against tpfuse.reference.quant_fp8, bit for bit: every mode and dtype,
saturation, ties, zeros and their signs, the group scales' column-major padded layout read
the way a block-scaled GEMM reads it, argument errors, opcheck.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (large shapes, where the
e4m3 rounding is the hardware conversion)."""

import pytest
import torch
import triton
import triton.language as tl

import tpfuse
from tests.conftest import DEVICE, ON_GPU
from tpfuse import reference
from tpfuse.kernels.common import round_to_bf16_f32
from tpfuse.kernels.quant_fp8 import quant_fp8_into

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 256), (3, 384), (2, 3, 1024), (5, 4096), (2, 5120), (2, 2500)] + (
    [(64, 7168), (300, 8192), (2048, 16384), (4, 53248), (2, 1 << 20)] if ON_GPU else [])


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _check(y, mode, scale=None, group=128):
    q, s = tpfuse.quant_fp8(y, mode, scale=scale, group=group)
    rq, rs = reference.quant_fp8(y, mode, scale, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == y.shape
    bad = (_bytes(q) != _bytes(rq)).sum().item()
    assert bad == 0, f"{mode} {tuple(y.shape)} {y.dtype}: {bad} bytes differ"
    assert s.shape == rs.shape and s.stride() == rs.stride() and torch.equal(s, rs)
    if mode == "group":  # the whole storage, the padding rows too
        full = (rs.shape[1], reference.fp8_scale_rows(rs.shape[0]))
        assert torch.equal(torch.as_strided(s, full, (full[1], 1)), torch.as_strided(rs, full, (full[1], 1)))
    return q, s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_mode_is_bitwise_the_reference(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    y = (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 20).to(dtype).to(DEVICE)
    _check(y, "token")
    if shape[-1] % 128 == 0:
        _check(y, "group")
        _check(y, "group", group=64)
    _check(y, "tensor", scale=torch.tensor([0.02], device=DEVICE))  # saturates beyond 8.96


@pytest.mark.smoke
def test_saturation_ties_and_zeros():
    # With scale 1, y is the value to round: e4m3 ties (1.0625 between 1 and 1.125: to even),
    # values past 448 (saturated, never NaN), a zero and a negative zero, and values that
    # round to a negative zero (their sign kept, as torch's cast keeps it).
    values = [1.0625, 1.1875, -1.0625, 2.0**-9, 3 * 2.0**-10, 2.0**-11, 447.0, 448.0, 464.0, 500.0, -1e6, 0.0, -0.0,
              -2.0**-12, 240.0, 232.0]
    y = torch.tensor([values * 8], dtype=torch.float32, device=DEVICE)
    q, _ = _check(y, "tensor", scale=torch.ones(1, device=DEVICE))
    got = _bytes(q)[0, :len(values)].tolist()  # by position: 0.0 and -0.0 are equal keys
    at = {k: got[values.index(k)] for k in (500.0, 464.0, 448.0, -1e6, 1.0625, -2.0**-12)}
    assert at[500.0] == at[464.0] == at[448.0] == 0x7E and at[-1e6] == 0xFE  # saturated at +-448
    assert at[1.0625] == 0x38 and got[11] == 0 and got[12] == at[-2.0**-12] == 0x80  # +0, -0, a negative zero
    # An all-zero row and group: the floored scale, and zeros.
    z = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEVICE)
    for mode in ("token", "group"):
        q, s = _check(z, mode)
        assert torch.all(s == torch.tensor(1e-10) / 448.0) and not _bytes(q).any()


@triton.jit
def _round_kernel(X, Y, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, round_to_bf16_f32(tl.load(X + offs), True))


def test_y_rounded_in_pairs_is_the_cast():
    # The fp8 output quantizes y rounded to bf16 (round_to_bf16_f32: on GPUs, two values per
    # cvt.rn.bf16x2.f32): the same bits as torch's cast and widening, in either position of
    # a pair (pairs are consecutive elements; each special value sits at an even and at an odd
    # index), for ties to even, values that round up into the next binade, to bf16's largest
    # value (3.3961e38) or to infinity (-3.4e38), subnormals, signed zeros and infinities; NaN
    # stays NaN.
    special = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0 - 2.0**-9, 3.3961e38, -3.4e38, 2.0**-130,
               3 * 2.0**-134, -(2.0**-149), 2.0**-127 * (1 + 2.0**-8), 0.0, -0.0, float("inf"), float("-inf"),
               float("nan"), 448.0]
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.tensor(special + special[::-1]), torch.randn(1024 - 2 * len(special), generator=g)])
    x = x.to(DEVICE)
    y = torch.full_like(x, 7.0)
    _round_kernel[(1,)](x, y, BLOCK=1024)
    want = x.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    assert torch.equal(y[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_dynamic_scales_are_the_correctly_rounded_quotient():
    """amax / 448 divided, never amax times a rounded 1/448 (which differs in the last bit for
    about half of all amax values; torch on CUDA divides by a Python number that way)."""
    amax = torch.rand(64, generator=torch.Generator().manual_seed(3)) * 100 + 1e-3
    y = torch.zeros(64, 128)
    y[:, 5] = -amax
    want = (amax.double() / 448).float()
    assert not torch.equal(amax * torch.tensor(1 / 448), want)  # the case matters for these values
    for impl in (tpfuse.quant_fp8, reference.quant_fp8):
        token = impl(y.to(DEVICE), "token")[1]
        group = impl(y.to(DEVICE), "group")[1]
        assert torch.equal(token.cpu().view(-1), want) and torch.equal(group.cpu().view(-1), want), impl


def test_the_launcher_writes_every_output_element():
    y = torch.randn(7, 512, device=DEVICE).to(torch.bfloat16)
    for mode, group in (("token", 128), ("group", 128), ("group", 32)):
        rq, rs = reference.quant_fp8(y, mode, None, group)
        q = torch.full(y.shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)  # NaN poison
        s = torch.full_like(rs, float("nan"))
        quant_fp8_into(y, q, s, mode, group)
        assert torch.equal(_bytes(q), _bytes(rq)) and torch.equal(s, rs), mode


def test_group_scales_in_the_layout_a_block_scaled_gemm_reads():
    """A block-scaled GEMM reads group g of row m at element g * fp8_scale_rows(M) + m of the
    scales' storage; read so, q and its scales give y @ w.T within e4m3's error."""
    m, n, out = 6, 512, 48
    y = torch.randn(m, n, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(out, n, device=DEVICE)
    q, s = tpfuse.quant_fp8(y, "group")
    pad = reference.fp8_scale_rows(m)
    assert s.shape == (m, n // 128) and s.stride() == (1, pad) and pad == 8
    storage = torch.as_strided(s, (n // 128, pad), (pad, 1))  # the whole column-major buffer
    acc = torch.zeros(m, out, device=DEVICE)
    for g in range(n // 128):
        cols = slice(g * 128, (g + 1) * 128)
        acc += (q[:, cols].float() @ w[:, cols].T) * storage[g, :m, None]  # per-group partial, then its scale
    want = y.float() @ w.T
    assert torch.allclose(acc, reference.dequant_fp8(q, s, "group") @ w.T, rtol=1e-5, atol=1e-4)
    assert reference.rel_err(acc, want.double()) < 0.05


def test_argument_errors():
    y = torch.randn(4, 256, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    for kwargs, match in [(dict(mode="row"), "mode must be"), (dict(mode="tensor"), "scale="),
                          (dict(mode="tensor", scale=one.double()), "fp32"), (dict(mode="tensor", scale=one.repeat(2)),
                                                                              "one element"),
                          (dict(mode="token", scale=one), "scale= is for"), (dict(mode="group", group=96), "power of two"),
                          (dict(mode="group", group=512), "divides"), (dict(mode="group", group=8), "from 16"),
                          (dict(mode="group", group=2048), "power of two")]:
        with pytest.raises(ValueError, match=match):
            tpfuse.quant_fp8(y, **kwargs)
    with pytest.raises(TypeError):
        tpfuse.quant_fp8(y.to(torch.int32))
    with pytest.raises(ValueError, match="last dimension"):
        tpfuse.quant_fp8(torch.empty(3, 0, device=DEVICE))
    with torch.no_grad():
        tpfuse.quant_fp8(y.clone().requires_grad_())  # no graph is recorded: allowed
    with pytest.raises(RuntimeError, match="not differentiable"):
        tpfuse.quant_fp8(y.requires_grad_())
    with pytest.raises(ValueError, match="scale="):  # the op checks its arguments too
        torch.ops.tpfuse.quant_fp8(y.detach(), "tensor", None, 128)
    q, s = tpfuse.quant_fp8(torch.empty(0, 256, device=DEVICE), "group")  # no rows: empty outputs
    assert q.shape == (0, 256) and s.shape == (0, 2)


def test_custom_op_passes_opcheck():
    y = torch.randn(3, 256, device=DEVICE).to(torch.bfloat16)
    for mode, scale in (("token", None), ("group", None), ("tensor", torch.full((1,), 0.01, device=DEVICE))):
        torch.library.opcheck(torch.ops.tpfuse.quant_fp8, (y, mode, scale, 128))
