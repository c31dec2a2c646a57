"""tpfuse.token_log_probs and tpfuse.sample: a row's bits depend on that row alone (its logits,
target, seed and position), never the batch; against float64 (tpfuse.reference) the log-probs
are within budget and the draws the reference's; the draws follow softmax(logits / T) over the
top-p set.

Runs on CPU under Triton's interpreter (small vocabularies) and on CUDA (Llama-3's too)."""

import pytest
import torch

import tpfuse
from tests.conftest import DEVICE, ON_GPU
from tpfuse import reference
from tpfuse.kernels.sampling import BLOCK

# Below one block, a block and a ragged tail; on GPUs also Llama-3's vocabulary.
VOCABS = [101, BLOCK + 377] + ([128256] if ON_GPU else [])
DTYPES = [torch.bfloat16, torch.float32]


def _logits(rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEVICE)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2**40, (n,), generator=g).to(DEVICE), torch.randint(0, 4096, (n,), generator=g).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [pytest.param(VOCABS[0], marks=pytest.mark.smoke)] + VOCABS[1:])
def test_a_rows_bits_are_the_same_alone_and_in_any_batch(vocab, dtype):
    """A row alone, and inside batches of other random rows at a random place: the same
    log-prob and the same draw (top_p 1 and 0.8) bit for bit."""
    logits = _logits(4, vocab, dtype, vocab)
    targets = torch.randint(0, vocab, (4,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    seeds, positions = _rows(4, vocab)
    lp = tpfuse.token_log_probs(logits, targets)
    draws = {p: tpfuse.sample(logits, seeds, positions, 0.7, p) for p in (1.0, 0.8)}
    for batch in (3, 9) + ((64, 257) if ON_GPU else ()):
        other = _logits(batch, vocab, dtype, batch)
        at = int(torch.randint(batch, (1,)))
        for i in (0, 3):
            rows = other.clone()
            rows[at] = logits[i]
            t, s, pos = (torch.full((batch,), int(v[i]), dtype=torch.int64, device=DEVICE)
                         for v in (targets, seeds, positions))
            assert torch.equal(tpfuse.token_log_probs(rows, t)[at].view(torch.int32), lp[i].view(torch.int32))
            for p, d in draws.items():
                assert tpfuse.sample(rows, s, pos, 0.7, p)[at] == d[i]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_log_probs_within_budget_of_float64(vocab, dtype):
    logits = _logits(16, vocab, dtype, 3)
    logits[0, 5] = 80.0  # a row dominated by one token: its log-prob near 0, the others' near -80
    targets = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    targets[0] = 5
    out = tpfuse.token_log_probs(logits, targets)
    want = reference.token_log_probs(logits, targets)
    # fp32 sums over V terms: the log of the sum is off by about V * 2^-24 at worst, relative
    # to 1; the picked logit minus the max is exact up to one rounding.
    budget = 1e-6 * (1 + want.abs()) + vocab * 2**-24
    assert ((out.double() - want).abs() <= budget).all(), (out.double() - want).abs().max()


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
@pytest.mark.parametrize("vocab", VOCABS)
def test_draws_are_the_references_and_inside_the_top_p_set(vocab, top_p):
    logits = _logits(12, vocab, torch.bfloat16, 5)
    seeds, positions = _rows(12, 6)
    got = tpfuse.sample(logits, seeds, positions, 0.8, top_p)
    want, kept = reference.sample(logits, seeds, positions, 0.8, top_p)
    assert torch.equal(got, want)
    assert kept.gather(1, got.view(-1, 1)).all()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_draws_follow_the_distribution_over_seeds(top_p):
    """One row of 6 tokens drawn with 2000 seeds: each token's frequency within 5 sigma of its
    probability (temperature 0.5: sharper than the logits); with top_p 0.8, none outside the
    set and the set's tokens at their renormalised probabilities. The counts are the
    reference's draws (float64, vectorised), and the kernel's draws are those bit for bit: all
    of them on GPUs, the first rows under the interpreter (75 ms a top-p row there)."""
    seeds = 2000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -3.0]], device=DEVICE).expand(seeds, 6).contiguous()
    seed_rows = torch.arange(seeds, device=DEVICE) * 7919 + 3
    positions = torch.full((seeds,), 17, device=DEVICE)
    drawn, kept = reference.sample(logits, seed_rows, positions, 0.5, top_p)
    rows = seeds if ON_GPU else (200 if top_p == 1.0 else 40)
    assert torch.equal(tpfuse.sample(logits[:rows], seed_rows[:rows], positions[:rows], 0.5, top_p), drawn[:rows])
    probs = torch.softmax(logits[0].double() / 0.5, -1) * kept[0]
    probs /= probs.sum()
    counts = torch.bincount(drawn, minlength=6).double()
    sigma = (seeds * probs * (1 - probs)).sqrt()
    assert ((counts - seeds * probs).abs() <= 5 * sigma + 1e-9).all(), (counts, seeds * probs)


def test_the_same_seed_and_position_draw_the_same_others_differ():
    logits = (_logits(1, 500, torch.float32, 7) / 6).expand(64, 500).contiguous()  # flat: many likely tokens
    seeds = torch.full((64,), 5, device=DEVICE)
    positions = torch.arange(64, device=DEVICE)
    draws = tpfuse.sample(logits, seeds, positions, 1.0)
    assert torch.equal(draws, tpfuse.sample(logits, seeds, positions, 1.0))
    assert len(set(draws.tolist())) > 16  # other positions: other noise, other tokens


def test_strided_rows_infinities_and_nan():
    """Seeds, positions and targets of any strides (an expanded seed: stride 0) give the bits of
    contiguous ones; a row holding +inf draws among its +inf entries (log-prob -log(count) there),
    and never a NaN entry."""
    logits = _logits(4, 300, torch.float32, 10)
    seeds = torch.tensor([9], device=DEVICE).expand(4)
    positions = torch.arange(8, device=DEVICE)[::2]
    assert torch.equal(tpfuse.sample(logits, seeds, positions, 0.9, 0.9),
                       tpfuse.sample(logits, seeds.contiguous(), positions.contiguous(), 0.9, 0.9))
    targets = torch.arange(0, 12, device=DEVICE)[::3]
    assert torch.equal(tpfuse.token_log_probs(logits, targets), tpfuse.token_log_probs(logits, targets.contiguous()))
    logits[0, [7, 40]] = float("inf")
    logits[1, 5:] = float("nan")
    for top_p in (1.0, 0.5):
        draws = tpfuse.sample(logits, seeds, positions, 1.0, top_p)
        assert draws[0] in (7, 40) and draws[1] < 5
    log_probs = tpfuse.token_log_probs(logits, torch.tensor([40, 0, 0, 0], device=DEVICE))
    assert log_probs[0] == -torch.log(torch.tensor(2.0)) and log_probs[1].isnan()


def test_custom_ops_pass_opcheck():
    logits = _logits(3, 101, torch.bfloat16, 8)
    rows = torch.tensor([0, 5, 100], device=DEVICE)
    torch.library.opcheck(torch.ops.tpfuse.token_log_probs.default, (logits, rows))
    torch.library.opcheck(torch.ops.tpfuse.sample.default, (logits, rows, rows, 0.9, 0.95))


def test_bad_arguments_raise_clear_errors():
    logits = _logits(3, 101, torch.bfloat16, 9)
    rows = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        tpfuse.token_log_probs(logits.double(), rows)
    with pytest.raises(ValueError, match=r"targets must be int64 \[3\]"):
        tpfuse.token_log_probs(logits, rows.int())
    with pytest.raises(ValueError, match="contiguous last dim"):
        tpfuse.token_log_probs(logits.t(), rows)
    with pytest.raises(ValueError, match=r"seeds must be int64 \[3\]"):
        tpfuse.sample(logits, rows[:2], rows)
    for temperature in (0.0, -1.0, float("inf"), float("nan"), 1e-40):
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            tpfuse.sample(logits, rows, rows, temperature)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            tpfuse.sample(logits, rows, rows, 1.0, top_p)
    assert tpfuse.token_log_probs(logits[:0], rows[:0]).shape == (0,)
