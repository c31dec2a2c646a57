"""tpfuse.invariant_attention: a query's bits depend on its position, its q and the keys and
values up to it alone (not the batch, the other queries, prefill or decode, the heads on other
ranks); its error against float64 is a bf16-weights attention's.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (Llama-3-8B's heads too)."""

import pytest
import torch
import triton

import tpfuse
from tests.conftest import DEVICE, ON_GPU
from tpfuse import reference
from tpfuse.kernels import attention
from tpfuse.kernels.attention import SPLIT

# (query heads, kv heads, head_dim): multi-head with a head_dim below the dot's 16, and 4 query
# heads per kv head; on GPUs also 2 per kv head and Llama-3-8B's heads at TP=2.
HEADS = [(2, 2, 8), (8, 2, 16)] + ([(8, 4, 32), (16, 4, 128)] if ON_GPU else [])
CONTEXT = SPLIT + 37
"""Positions of the cache: a whole split and a part of a second (the interpreter's time)."""


def _operands(heads, kv_heads, d, batch, seed, dtype=torch.bfloat16, context=CONTEXT):
    """q for ``context`` positions per sequence, and a cache whose last positions hold NaN and
    Inf (as an unwritten cache may): no query may read past its own position."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, context, d, generator=g).to(dtype).to(DEVICE)
    k, v = (torch.randn(batch, kv_heads, context + 9, d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    k[:, :, context:] = float("nan")
    v[:, :, context:] = float("inf")
    return q, k, v


def _start(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("heads, kv_heads, d", [pytest.param(*HEADS[0], marks=pytest.mark.smoke)] + HEADS[1:])
def test_a_prefills_rows_are_the_decode_steps_bits(heads, kv_heads, d):
    q, k, v = _operands(heads, kv_heads, d, 1, heads + d)
    scale = d ** -0.5
    prefill = tpfuse.invariant_attention(q, k, v, _start(0), scale)
    for t in (0, 1, SPLIT - 1, SPLIT, CONTEXT - 1):
        step = tpfuse.invariant_attention(q[:, :, t:t + 1], k, v, _start(t), scale)
        assert torch.equal(step[:, :, 0], prefill[:, :, t]), t
    tail = tpfuse.invariant_attention(q[:, :, 70:], k, v, _start(70), scale)  # a prefill after a prefix
    assert torch.equal(tail, prefill[:, :, 70:])


@pytest.mark.parametrize("heads, kv_heads, d", HEADS)
def test_a_sequence_has_the_same_bits_alone_and_in_a_batch(heads, kv_heads, d):
    q, k, v = _operands(heads, kv_heads, d, 5, 2 * heads + d)
    scale = d ** -0.5
    starts = [3, 0, CONTEXT - 4, SPLIT, 60]
    for n in (1, 4):  # decode steps (split-parallel) and short prefills (one pass)
        batch = tpfuse.invariant_attention(q[:, :, :n], k, v, _start(*starts), scale)
        for b in (0, 2, 4):
            alone = tpfuse.invariant_attention(q[b:b + 1, :, :n], k[b:b + 1], v[b:b + 1], _start(starts[b]), scale)
            assert torch.equal(alone[0], batch[b]), (n, b)


@pytest.mark.parametrize("ctas", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, d", HEADS)
def test_ctas_taking_several_splits_keep_their_bits(heads, kv_heads, d, ctas, monkeypatch):
    """A decode step over 3 splits whose rows have fewer CTAs than splits (SPLIT_CTAS forced
    down, as in a large batch): one CTA taking every split, or two taking splits 0, 2 and 1.
    Each sequence's bits are the prefill's at its position, in the third split, the second
    and the first."""
    context = 2 * SPLIT + 37
    q, k, v = _operands(heads, kv_heads, d, 3, 5 * heads + d, context=context)
    prefill = tpfuse.invariant_attention(q, k, v, _start(0, 0, 0), d ** -0.5)
    monkeypatch.setattr(attention, "SPLIT_CTAS", ctas * 3 * kv_heads)  # ctas a (sequence, kv head)
    assert attention.split_ctas(3 * kv_heads, triton.cdiv(k.shape[2], SPLIT)) == ctas
    starts = [2 * SPLIT + 5, context - 1 - SPLIT, 2]
    qs = torch.stack([q[b, :, t] for b, t in enumerate(starts)])[:, :, None]
    step = tpfuse.invariant_attention(qs, k, v, _start(*starts), d ** -0.5)
    for b, t in enumerate(starts):
        assert torch.equal(step[b, :, 0], prefill[b, :, t]), b


@pytest.mark.parametrize("heads, kv_heads, d", HEADS)
def test_heads_split_over_ranks_keep_their_bits(heads, kv_heads, d):
    """A TP=t rank holds Hkv / t kv heads and their query heads."""
    q, k, v = _operands(heads, kv_heads, d, 2, 3 * heads + d)
    start = _start(0, 40)
    whole = tpfuse.invariant_attention(q[:, :, :60], k, v, start, d ** -0.5)
    group = heads // kv_heads
    for kv in range(kv_heads):
        part = tpfuse.invariant_attention(q[:, kv * group:(kv + 1) * group, :60], k[:, kv:kv + 1], v[:, kv:kv + 1],
                                          start, d ** -0.5)
        assert torch.equal(part, whole[:, kv * group:(kv + 1) * group])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, d", HEADS)
def test_error_against_float64(heads, kv_heads, d, dtype):
    q, k, v = _operands(heads, kv_heads, d, 2, 4 * heads + d, dtype)
    start = _start(0, 30)
    out = tpfuse.invariant_attention(q[:, :, :CONTEXT - 30], k, v, start, d ** -0.5)
    ref = reference.attention(q[:, :, :CONTEXT - 30], k[:, :, :CONTEXT], v[:, :, :CONTEXT], start, d ** -0.5)
    # The weights are rounded to the operands' dtype before the dot with v (FlashAttention's way):
    # twice a plain rounding's budget.
    assert reference.rel_err(out, ref) <= 2 * reference.rel_err_budget(dtype)


def test_custom_op_compiles_and_passes_opcheck():
    q, k, v = _operands(4, 2, 16, 2, 7)
    start = _start(0, 9)
    f = torch.compile(lambda a: tpfuse.invariant_attention(a, k, v, start, 0.25), fullgraph=True)
    assert torch.equal(f(q[:, :, :20]), tpfuse.invariant_attention(q[:, :, :20], k, v, start, 0.25))
    torch.library.opcheck(torch.ops.tpfuse.invariant_attention, (q[:, :, :3].contiguous(), k, v, start, 0.25))


def test_argument_errors():
    q, k, v = _operands(4, 2, 16, 1, 8)
    start = _start(0)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        tpfuse.invariant_attention(q.float(), k.float(), v.float(), start, 0.25)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        tpfuse.invariant_attention(q[:, :3], k, v, start, 0.25)
    with pytest.raises(ValueError, match="do not match"):
        tpfuse.invariant_attention(q, k[..., :8], v[..., :8], start, 0.25)
    with pytest.raises(ValueError, match="start must be"):
        tpfuse.invariant_attention(q, k, v, start.float(), 0.25)
    with pytest.raises(ValueError, match="scale must be"):
        tpfuse.invariant_attention(q, k, v, start, 0.0)
