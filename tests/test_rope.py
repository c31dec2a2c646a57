"""tpfuse.rope_and_cache against tpfuse.reference.rope_and_cache, bit for bit: every dtype,
grouped-query heads, head sizes that are not powers of two, prefill and decode positions,
strided inputs as a fused QKV projection leaves them, caches written only where they should
be; argument errors; opcheck.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (larger ones)."""

import pytest
import torch

import tpfuse
from tests.conftest import DEVICE, ON_GPU
from tpfuse import reference

# (batch, tokens, query heads, kv heads, head_dim, cache length)
# The last CPU shape takes three programs of rows under the interpreter (rope.rows_per_program).
SHAPES = [(1, 1, 4, 2, 64, 8), (3, 5, 6, 2, 32, 16), (2, 1, 8, 8, 80, 12), (2, 4, 3, 1, 128, 9),
          (2, 40, 8, 4, 128, 48)] + (
    [(16, 1, 32, 8, 128, 2048), (2, 512, 32, 8, 128, 1024), (64, 1, 64, 8, 128, 4096)] if ON_GPU else [])


def _tables(positions, d, dtype, g):
    """Rotary tables as the model builds them (fp32 angles, cos/sin rounded once)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = 1.0 + torch.rand((), generator=g).item()  # a rope scaling, so the products round
    return (emb.cos() * scale).to(dtype).to(DEVICE), (emb.sin() * scale).to(dtype).to(DEVICE)


def _case(shape, dtype, decode, seed):
    b, t, heads, kv, d, s = shape
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, t, heads + 2 * kv, d, generator=g) * 3).to(dtype).to(DEVICE)
    qk, v = qkv[:, :, :heads + kv], qkv[:, :, heads + kv:]  # strided views of one projection
    cos, sin = _tables(s, d, dtype, g)
    start = (torch.randint(0, s - t + 1, (b,), generator=g) if decode else torch.zeros(b, dtype=torch.int64))
    caches = [torch.randn(b, kv, s, d, generator=g).to(dtype).to(DEVICE) for _ in range(4)]
    return qk, v, cos, sin, start.to(DEVICE), caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_bitwise_the_reference(shape, decode, dtype):
    qk, v, cos, sin, start, (k_cache, v_cache, k_want, v_want) = _case(shape, dtype, decode, sum(shape) + decode)
    k_want.copy_(k_cache)
    v_want.copy_(v_cache)
    q = tpfuse.rope_and_cache(qk, v, cos, sin, start, k_cache, v_cache)
    q_want = reference.rope_and_cache(qk, v, cos, sin, start, k_want, v_want)
    assert q.shape == q_want.shape and q.is_contiguous()
    # Every cache element: the written positions take the new keys and values, the rest keep theirs.
    for got, want in ((q, q_want), (k_cache, k_want), (v_cache, v_want)):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got.view(torch.int32),
                           want.view(torch.uint8) if want.dtype != torch.float32 else want.view(torch.int32))


@pytest.mark.smoke
def test_matches_the_models_torch_ops():
    # What the model ran before this kernel: _apply_rope on the transposed heads, then the
    # cache written by indexing (decode: one token per sequence, each at its own position).
    qk, v, cos, sin, start, (k_cache, v_cache, _, _) = _case((3, 1, 4, 2, 64, 10), torch.bfloat16, True, 7)
    heads = qk.shape[2] - v.shape[2]
    x = qk.transpose(1, 2)
    c, s = cos[start][:, None, None], sin[start][:, None, None]
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    want = x * c + rotated * s
    q = tpfuse.rope_and_cache(qk, v, cos, sin, start, k_cache, v_cache)
    assert torch.equal(q, want[:, :heads])
    rows = torch.arange(3, device=q.device)
    assert torch.equal(k_cache[rows, :, start], want[:, heads:, 0])
    assert torch.equal(v_cache[rows, :, start], v[:, 0])


def test_signed_zeros_special_values_and_any_start():
    # A zero's sign as torch's ops give it (the rotated half negates the partner: -(+0) is
    # -0), infinities, NaN and subnormals; start as int32 and as a strided view.
    qk, v, cos, sin, _, (k_cache, v_cache, k_want, v_want) = _case((2, 2, 2, 1, 8, 6), torch.bfloat16, True, 5)
    # Column d's partner is d + 4 mod 8: -0 beside +0 gives -0 * 1 + -(+0) * 1 = -0.
    special = torch.tensor([-0.0, 0.0, float("inf"), 1e-40, 0.0, -0.0, float("nan"), -1e-40])
    qk = qk.clone()
    qk[0, 0, 0] = special.to(qk.dtype)
    qk[1, 1, 1] = special.flip(0).to(qk.dtype)
    cos.fill_(1.0)
    sin.fill_(1.0)
    k_want.copy_(k_cache)
    v_want.copy_(v_cache)
    for start in (torch.tensor([1, 3], dtype=torch.int32, device=DEVICE),
                  torch.tensor([[1, 9], [3, 9]], device=DEVICE)[:, 0]):
        q = tpfuse.rope_and_cache(qk, v, cos, sin, start, k_cache, v_cache)
        q_want = reference.rope_and_cache(qk, v, cos, sin, start, k_want, v_want)
        for got, want in ((q, q_want), (k_cache, k_want), (v_cache, v_want)):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


def test_argument_errors():
    qk, v, cos, sin, start, (k_cache, v_cache, _, _) = _case((2, 3, 4, 2, 32, 8), torch.bfloat16, False, 1)
    ok = (qk, v, cos, sin, start, k_cache, v_cache)
    bad = [
        ((qk.float(),) + ok[1:], TypeError, "one dtype"),
        ((qk, v[:, :2]) + ok[2:], ValueError, "do not match"),
        ((qk[:, :, :2], v) + ok[2:], ValueError, "at least one head"),
        ((qk[..., :31], v[..., :31], cos[:, :31], sin[:, :31], start, k_cache[..., :31], v_cache[..., :31]),
         ValueError, "must be even"),
        (ok[:2] + (cos[:, :16], sin[:, :16]) + ok[4:], ValueError, r"\[P, D\] tables"),
        (ok[:3] + (sin[:4],) + ok[4:], ValueError, r"\[P, D\] tables"),
        (ok[:5] + (k_cache[:1], v_cache[:1]), ValueError, "caches must be"),
        (ok[:4] + (start.float(),) + ok[5:], ValueError, "start must be"),
        (ok[:4] + (start[:1],) + ok[5:], ValueError, "start must be"),
        ((qk.transpose(2, 3).contiguous().transpose(2, 3),) + ok[1:], ValueError, "contiguous"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            tpfuse.rope_and_cache(*args)


def test_custom_op_passes_opcheck():
    qk, v, cos, sin, start, (k_cache, v_cache, _, _) = _case((2, 2, 4, 2, 32, 8), torch.bfloat16, True, 3)
    torch.library.opcheck(torch.ops.tpfuse.rope_and_cache.default, (qk, v, cos, sin, start, k_cache, v_cache))
