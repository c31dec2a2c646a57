"""RMSNorm forward, residual-add forward and backward against tpfuse.reference.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (large shapes)."""

import pytest
import torch
import triton

import tpfuse
from tpfuse import reference
from tpfuse.kernels import norm_dw
from tpfuse.kernels.norm import NormConfig, bwd_num_warps, rms_norm_fwd
from tpfuse.kernels.norm_bwd import rms_norm_bwd
from tpfuse.kernels.norm_dw import DwPlan
from tests.conftest import DEVICE, ON_GPU
from tests.test_allreduce import _same_bits
from tpfuse.reference import rel_err, rel_err_budget

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if ON_GPU:
    NS = [1, 7, 256, 1000, 2880, 4096, 5120, 7168, 14336, 16384, 20000, 40000, 50000, 65536]
    MS = [0, 1, 16, 1000, 3000]
else:
    # 20000 exceeds the register-resident row for every dtype: the chunked path.
    NS = [1, 7, 64, 1000, 2880, 5120, 20000]  # 2880, 5120: rows in two pieces (tail_n, bwd_tail_n)
    MS = [0, 1, 5, 37]
WEIGHTS = ["none", "plain", "offset1"]


def _inputs(m, n, dtype, weight_kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g).to(dtype).to(DEVICE)
    w = None if weight_kind == "none" else (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    off = 1.0 if weight_kind == "offset1" else 0.0
    return x, w, off


def _rows_for(n):
    return [m for m in MS if m * n <= (50_000_000 if ON_GPU else 1_000_000)]


def _reference_cases():
    """(n, dtype, weight_kind) for test_forward_and_backward_match_reference: on GPUs every dtype
    with every weight kind at each N; under the interpreter (the CI's time) every dtype at each
    N with one weight kind, taken in turn, so that every (dtype, weight kind) and every (N,
    weight kind) pair still occurs."""
    if ON_GPU:
        return [(n, dtype, weight_kind) for n in NS for dtype in DTYPES for weight_kind in WEIGHTS]
    return [(n, dtype, WEIGHTS[(i + j) % len(WEIGHTS)]) for i, n in enumerate(NS) for j, dtype in enumerate(DTYPES)]


@pytest.mark.parametrize("n, dtype, weight_kind", _reference_cases(),
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_forward_and_backward_match_reference(n, dtype, weight_kind):
    budget = rel_err_budget(dtype)
    for m in _rows_for(n):
        x, w, off = _inputs(m, n, dtype, weight_kind, seed=n * 31 + m)
        y = tpfuse.rms_norm(x, w, 1e-6, weight_offset=off)
        assert y.shape == x.shape and y.dtype == dtype
        if m == 0:
            continue
        assert rel_err(y, reference.rms_norm(x, w, 1e-6, weight_offset=off)) <= budget

        xg = x.clone().requires_grad_(True)
        wg = None if w is None else w.clone().requires_grad_(True)
        dy = torch.randn(m, n, dtype=torch.float32).to(dtype).to(DEVICE)
        tpfuse.rms_norm(xg, wg, 1e-6, weight_offset=off).backward(dy)
        dx_ref, dw_ref = reference.rms_norm_backward(dy, x, w, 1e-6, weight_offset=off)
        if n > 1:  # at N=1 the exact dx is 0 up to eps: an absolute check below covers it
            assert rel_err(xg.grad, dx_ref) <= 2 * budget
        assert (xg.grad.double() - dx_ref).abs().max().item() <= 1e-2 * max(1.0, dx_ref.abs().max().item())
        if w is not None:
            # dW sums M terms dy * x_hat of both signs: its fp32 accumulation error scales with
            # the terms' magnitudes, not with |dW| (at N=1 a cancelling sum failed a purely
            # relative check), so allow 16 fp32 ulps of sum |dy * x_hat| on top of the budget.
            xd = x.double()
            terms = dy.double() * xd * torch.rsqrt(xd.pow(2).mean(1, keepdim=True) + 1e-6)
            slack = 16 * 2.0**-24 * terms.abs().sum(0).norm().item()
            err = (wg.grad.double() - dw_ref.double()).norm().item()
            assert err <= 2 * budget * dw_ref.double().norm().item() + slack


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
def test_add_rms_norm_is_bitwise_rms_norm_of_rounded_sum(n, dtype):
    for m in _rows_for(n)[1:]:
        x, w, off = _inputs(m, n, dtype, "offset1", seed=n + m)
        residual = torch.randn(m, n).to(dtype).to(DEVICE)
        y, residual_out = tpfuse.add_rms_norm(x, residual, w, weight_offset=off)
        _, residual_out_ref = reference.add_rms_norm(x, residual, w, weight_offset=off)
        assert torch.equal(residual_out, residual_out_ref)
        assert torch.equal(y, tpfuse.rms_norm(residual_out, w, weight_offset=off))


def _batch_invariance_cases():
    """(n, dtype): on GPUs every dtype at every N; under the interpreter, which sums every row
    by the same code whatever the batch (the launcher's choices are what it checks), every
    dtype at N = 64 and one of each path's N (rows held, in two pieces, chunked)."""
    if ON_GPU:
        return [(n, dtype) for n in [64, 1000, 2880, 4096, 7168, 20000] for dtype in DTYPES]
    return [(64, dtype) for dtype in DTYPES] + [(1000, torch.bfloat16), (2880, torch.float16),
                                                (20000, torch.float32)]


@pytest.mark.parametrize("n, dtype", _batch_invariance_cases(),
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_batch_invariance(n, dtype):
    """A row alone and inside a batch of many rows, at a random position: the same bits."""
    m = 1000 if ON_GPU else 200 if n <= 2880 else 40  # under the interpreter every row runs the same code
    x, w, _ = _inputs(m, n, dtype, "plain", seed=n)
    residual = torch.randn(m, n).to(dtype).to(DEVICE)
    pos = int(torch.randint(m, (1,)))
    y_batch = tpfuse.rms_norm(x, w)
    y_alone = tpfuse.rms_norm(x[pos : pos + 1].clone(), w)
    assert torch.equal(y_batch[pos : pos + 1], y_alone)
    yb, rb = tpfuse.add_rms_norm(x, residual, w)
    ya, ra = tpfuse.add_rms_norm(x[pos : pos + 1].clone(), residual[pos : pos + 1].clone(), w)
    assert torch.equal(yb[pos : pos + 1], ya) and torch.equal(rb[pos : pos + 1], ra)
    # Row counts divisible by 16 (Triton specialises such integers unless told not to; the
    # interpreter specialises nothing, so a short batch serves there).
    m16 = 1024 if ON_GPU else 32
    x16 = torch.randn(m16, n).to(dtype).to(DEVICE)
    x16[pos % m16] = x[pos]
    assert torch.equal(tpfuse.rms_norm(x16, w)[pos % m16 : pos % m16 + 1], y_alone)


@pytest.mark.parametrize("n", [64, 1000, 20000])
def test_backward_is_deterministic(n):
    m = 3000 if ON_GPU else {64: 300, 1000: 300, 20000: 12}[n]
    x, w, _ = _inputs(m, n, torch.bfloat16, "plain", seed=7)
    dy = torch.randn(m, n).to(torch.bfloat16).to(DEVICE)
    results = []
    # Under the interpreter CTAs run one after another in a fixed order, so repeats can only
    # show state a call leaves behind (the dW combine's counters): two calls show it.
    for _ in range(10 if ON_GPU else 2):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        tpfuse.rms_norm(xg, wg).backward(dy)
        results.append((xg.grad, wg.grad))
    for dx, dw in results[1:]:
        assert torch.equal(dx, results[0][0]) and torch.equal(dw, results[0][1])


@pytest.mark.parametrize("n, m", [
    (n, m) for n in [256, 1000, 3000] + ([4096, 5120, 10240, 16384, 20000] if ON_GPU else [])
    for m in [1, 5, 64, 300] + ([4096, 32768] if ON_GPU else [])])
def test_fused_and_separate_dw_combine_give_the_same_bits(m, n):
    """The plan's in-kernel combine (the tree, or column programs: n=3000 with 5 or 32
    partials) against the separate launch, twice in a row: the in-kernel counters must be
    back at zero after each call. On GPU also rows in two pieces (5120, 10240; at 300 rows
    and 4096 rows a short call's partials, combined by the separate launch over columns of 256), with the
    weight re-read (16384), and chunked rows (20000: the separate launch from two rows on),
    whose layouts the interpreter does not have."""
    columns = ((n in (3000, 4096, 5120) and m in (5, 64))  # few partials
               or (n in (10240, 16384) and m > 1))  # rows over 8192 in one chunk: columns from 2 partials
    launch = (n == 20000 and m > 1) or (n == 5120 and m in (300, 4096))  # chunked rows; short calls, rows of 8-20 KiB
    expected = "launch" if launch else "columns" if columns else "tree"
    assert DwPlan.from_shape(m, n, torch.bfloat16).combine == expected
    _check_combines_agree(m, n)


# Short calls (257-4096 rows of up to 8192 elements), the sweep's best at M=1024-4096:
# (dtype, M, N) -> (partials, combine, columns per combine program).
SHORT_CALL_PLANS = [
    ((torch.bfloat16, 1024, 4096), (128, "tree", 256)), ((torch.bfloat16, 4096, 4096), (256, "tree", 256)),
    ((torch.bfloat16, 2048, 5120), (256, "launch", 256)), ((torch.bfloat16, 4096, 6144), (256, "launch", 256)),
    ((torch.bfloat16, 4096, 7168), (128, "launch", 256)), ((torch.bfloat16, 2048, 8192), (128, "launch", 256)),
    ((torch.float32, 2048, 2880), (256, "columns", 256)), ((torch.float32, 4096, 5120), (128, "columns", 256)),
    ((torch.float32, 2048, 7168), (128, "tree", 256)), ((torch.float32, 4096, 8192), (128, "tree", 256)),
    # outside: wider rows (few wide rows: 128 partials by columns of 1024), more rows (the M=32768 rule)
    ((torch.bfloat16, 4096, 10240), (128, "columns", 1024)), ((torch.bfloat16, 8192, 7168), (256, "tree", 1024)),
]


@pytest.mark.parametrize("shape, plan", SHORT_CALL_PLANS)
def test_short_call_plans(shape, plan):
    p = DwPlan.from_shape(*shape[1:], shape[0])
    assert (p.num_partials, p.combine, p.combine_block) == plan


@pytest.mark.parametrize("dtype, n, combine", [(torch.bfloat16, 5120, "launch"), (torch.float32, 2880, "columns")])
def test_short_call_combined_over_columns_of_256(dtype, n, combine, monkeypatch):
    """The short-call plan on rows of 8-20 KiB (from 257 rows, too slow for the interpreter:
    here from 9 rows, with at most 4 partials; 16 rows): the separate launch for 16-bit rows, column
    programs in the backward's launch for fp32."""
    monkeypatch.setattr(norm_dw, "FEW_ROWS_MAX_PARTIALS", 4)
    plan = DwPlan.from_shape(16, n, dtype)  # fp32 N=2880: tiles of two rows, four to a partial
    assert (plan.combine, plan.combine_block, plan.num_partials, plan.num_combine_programs) == (
        combine, 256, 4, triton.cdiv(n, 256))
    _check_combines_agree(16, n, dtype)


def _check_combines_agree(m, n, dtype=torch.bfloat16):
    x, w, _ = _inputs(m, n, dtype, "plain", seed=m + n)
    dy = torch.randn(m, n).to(dtype).to(DEVICE)
    dy[:, 0], x[:, 0] = 0.0, -x[:, 0].abs() - 1  # dW[0] sums -0.0 terms: +0.0 in either combine
    outs = []
    for fused in (True, True, False):
        dx = torch.full_like(x, float("nan"))
        dw = torch.full_like(w, float("nan"))
        rms_norm_bwd(dy, x, w, dx, dw, 1e-6, 0.0, fused_combine=fused)
        outs.append((dx, dw))
        if fused and x.device in norm_dw._dw_counters:
            assert not norm_dw._dw_counters[x.device].any()
    assert not outs[0][1].isnan().any() and not outs[0][0].isnan().any()
    for dx, dw in outs[1:]:
        assert _same_bits(outs[0][0], dx) and _same_bits(outs[0][1], dw)
    _, dw_ref = reference.rms_norm_backward(dy, x, w)
    assert rel_err(outs[0][1], dw_ref) <= 2 * rel_err_budget(dtype)


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_partial_on_chunked_rows_writes_dw_without_a_combine(dtype, m, monkeypatch):
    """One partial (M=1; M=7 in one partial as rows of over CHUNKED_BWD_PROGRAMS chunks
    get it, forced here): on chunked rows its programs store dW themselves, with the
    separate launch's bits, signed zeros included."""
    n = 20000
    if m > 1:
        monkeypatch.setattr(norm_dw, "CHUNKED_BWD_PROGRAMS", 1)
    plan = DwPlan.from_shape(m, n, dtype)
    assert NormConfig.from_shape(n, dtype).num_chunks > 1
    assert plan.combine == "tree" and plan.rows_per_partial == m
    x, w, _ = _inputs(m, n, dtype, "plain", seed=3)
    dy = torch.randn(m, n).to(dtype).to(DEVICE)
    dy[:, :64], x[:, :32] = 0.0, -x[:, :32].abs() - 1  # dW[:32] = -0.0 per row, +0.0 once combined
    outs = []
    for fused in (True, False):
        dx, dw = torch.full_like(x, float("nan")), torch.full_like(w, float("nan"))
        rms_norm_bwd(dy, x, w, dx, dw, 1e-6, 0.0, fused_combine=fused)
        outs.append((dx, dw))
    assert _same_bits(outs[0][0], outs[1][0]) and _same_bits(outs[0][1], outs[1][1])
    assert not torch.signbit(outs[0][1][:32]).any()
    dx_ref, dw_ref = reference.rms_norm_backward(dy, x, w)
    assert rel_err(outs[0][1], dw_ref) <= 2 * rel_err_budget(dtype)
    assert rel_err(outs[0][0], dx_ref) <= 2 * rel_err_budget(dtype)


# On GPU, short rows also in a batch whose programs run long enough for twice the warps
# (norm.bwd_num_warps), and rows where they must not take them: unaligned rows without a weight,
# and an fp32 weight beside bf16 rows (both laid out in narrower vectors); chunked rows in
# groups that take several dW partials each (norm_bwd_chunked).
@pytest.mark.parametrize("dtype, n, weight", [(torch.bfloat16, 1000, "plain"), (torch.bfloat16, 20000, "plain")]
                         + ([(torch.bfloat16, 256, "plain"), (torch.float32, 512, "plain"),
                             (torch.bfloat16, 1000, "none"), (torch.bfloat16, 1024, "fp32"),
                             (torch.bfloat16, 65536, "plain"), (torch.float32, 40000, "none")] if ON_GPU else []))
def test_backward_dx_is_batch_invariant(dtype, n, weight):
    """A row's dx alone (one dW partial, the tree, 4 warps on short rows) and inside a batch at
    a random position: the same bits."""
    long_runs = ON_GPU and n <= 1024
    m = 40000 if long_runs else 300 if ON_GPU else 12
    if long_runs and weight == "plain":
        cfg = NormConfig.from_shape(n, dtype)
        alone, batch = (bwd_num_warps(cfg, DwPlan.from_shape(rows, n, dtype).rows_per_partial, True) for rows in (1, m))
        assert batch > alone  # the case covers the switch
    x, w, _ = _inputs(m, n, dtype, "plain", seed=n + 1)
    w = {"plain": w, "none": None, "fp32": w.float()}[weight]
    dy = torch.randn(m, n).to(dtype).to(DEVICE)
    pos = int(torch.randint(m, (1,)))
    dx_batch, dx_alone = torch.full_like(x, float("nan")), torch.full_like(x[:1], float("nan"))
    dw = None if w is None else torch.empty_like(w)
    rms_norm_bwd(dy, x, w, dx_batch, dw, 1e-6, 0.0)
    rms_norm_bwd(dy[pos:pos + 1].clone(), x[pos:pos + 1].clone(), w, dx_alone, dw, 1e-6, 0.0)
    assert not dx_alone.isnan().any() and torch.equal(dx_batch[pos:pos + 1], dx_alone)


# The backward's row layouts (NormConfig): rows in two pieces (bwd_tail_n) with and without
# prefetch and with and without the weight re-read for dx (bwd_reload_weight), the re-read
# without pieces, and tails whose last lanes are past N. (dtype, n, m, with dresidual)
# Chunked rows (the exchange backward, norm_bwd_chunked): several rows per partial with a shorter last
# partial (41 rows in 14 partials of 3), fp32 rows in 10 chunks, and a masked last chunk.
# Rows of 2049-3072 two to a tile (an odd M: the last tile's second row masked).
BWD_LAYOUT_CASES = [(torch.bfloat16, 5000, 5, True), (torch.float32, 2049, 3, False),
                    (torch.float32, 9000, 4, True), (torch.bfloat16, 12289, 2, False),
                    (torch.float32, 12289, 2, True), (torch.float16, 6144, 5, False),
                    (torch.bfloat16, 20000, 41, True), (torch.float32, 20000, 7, False),
                    (torch.bfloat16, 2880, 5, True), (torch.float32, 3072, 3, False)]


def test_backward_layout_cases_cover_every_row_layout():
    cfgs = [(NormConfig.from_shape(n, dtype), n) for dtype, n, _, _ in BWD_LAYOUT_CASES]
    kinds = {(c.bwd_num_chunks, c.bwd_tail_n > 0, c.bwd_prefetch, c.bwd_reload_weight) for c, _ in cfgs}
    assert {(1, True, True, True), (1, True, True, False), (1, True, False, False), (1, False, False, True)} <= kinds
    assert any(c.bwd_tail_n and n < c.block_n // 2 + c.bwd_tail_n for c, n in cfgs)  # a masked tail
    stacked = [(c, n) for c, n in cfgs if c.bwd_num_chunks == 1 and c.bwd_rows == 2 and c.bwd_block_n == 4096]
    assert {c.bwd_num_warps for c, _ in stacked} == {8, 16}  # rows of 2049-3072 two to a tile, fp32 and bf16
    plans = [DwPlan.from_shape(m, n, dtype) for dtype, n, m, _ in BWD_LAYOUT_CASES]
    assert any(c.bwd_num_chunks > 1 and p.rows_per_partial > 1 and p.num_partials * p.rows_per_partial > m
               for (c, _), p, (_, _, m, _) in zip(cfgs, plans, BWD_LAYOUT_CASES))  # a chunked partial of fewer rows


@pytest.mark.parametrize("dtype, n, m, with_dres", BWD_LAYOUT_CASES)
def test_backward_row_layouts(dtype, n, m, with_dres):
    """dx and dW against the reference, no store outside dx and dW (NaN guards on both
    sides), and the same bits from the in-kernel combine twice and the separate launch."""
    x, w, _ = _inputs(m, n, dtype, "plain", seed=n + m)
    dy = torch.randn(m, n, device=DEVICE).to(dtype)
    dres = torch.randn(m, n, device=DEVICE).to(dtype) if with_dres else None
    guard = 64  # elements on each side; keeps the views 16-byte aligned
    outs = []
    for fused in (True, True, False):
        dx_buf = torch.full((m * n + 2 * guard,), float("nan"), dtype=dtype, device=DEVICE)
        dw_buf = torch.full((n + 2 * guard,), float("nan"), dtype=dtype, device=DEVICE)
        dx, dw = dx_buf[guard:guard + m * n].view(m, n), dw_buf[guard:guard + n]
        rms_norm_bwd(dy, x, w, dx, dw, 1e-6, 0.0, dres, fused_combine=fused)
        for buf, inner in ((dx_buf, m * n), (dw_buf, n)):
            assert buf[:guard].isnan().all() and buf[guard + inner:].isnan().all()
        if fused and x.device in norm_dw._dw_counters:
            assert not norm_dw._dw_counters[x.device].any()
        outs.append((dx, dw))
    for dx, dw in outs[1:]:
        assert torch.equal(outs[0][0], dx) and torch.equal(outs[0][1], dw)
    dx_ref, dw_ref = reference.rms_norm_backward(dy, x, w)
    if with_dres:
        dx_ref = dx_ref + dres.double()
    assert rel_err(outs[0][0], dx_ref) <= 2 * rel_err_budget(dtype)
    assert rel_err(outs[0][1], dw_ref) <= 2 * rel_err_budget(dtype)


@pytest.mark.parametrize("n", [7, 1000, 20000])
def test_launchers_write_every_output_element(n):
    m = 9
    x, w, _ = _inputs(m, n, torch.float16, "plain", seed=3)
    residual = torch.randn(m, n).to(torch.float16).to(DEVICE)
    y = torch.full_like(x, float("nan"))
    r_out = torch.full_like(x, float("nan"))
    rms_norm_fwd(x, w, y, 1e-6, 0.0, residual=residual, residual_out=r_out)
    assert not y.isnan().any() and not r_out.isnan().any()


@pytest.mark.parametrize("dtype, n", [(torch.float32, 1000), (torch.bfloat16, 1000), (torch.float16, 2880),
                                      (torch.bfloat16, 5000), (torch.bfloat16, 20000)])
def test_add_rms_norm_backward_with_gradients_on_both_outputs(dtype, n):
    m = 6
    x, w, off = _inputs(m, n, dtype, "offset1", seed=11)
    residual = torch.randn(m, n, device=DEVICE).to(dtype)
    dy, dr = torch.randn(m, n, device=DEVICE).to(dtype), torch.randn(m, n, device=DEVICE).to(dtype)
    xg, rg, wg = (t.clone().requires_grad_(True) for t in (x, residual, w))
    y, r_out = tpfuse.add_rms_norm(xg, rg, wg, weight_offset=off)
    torch.autograd.backward([y, r_out], [dy, dr])
    r_ref = (x.float() + residual.float()).to(dtype).double()  # the norm sees the rounded sum
    dnorm_ref, dw_ref = reference.rms_norm_backward(dy, r_ref, w, weight_offset=off)
    budget = 2 * rel_err_budget(dtype)
    assert rel_err(xg.grad, dnorm_ref + dr.double()) <= budget
    assert rel_err(rg.grad, dnorm_ref + dr.double()) <= budget
    assert rel_err(wg.grad, dw_ref) <= budget
    # Gradient only on residual_out: the norm contributes nothing.
    xg2 = x.clone().requires_grad_(True)
    _, r2 = tpfuse.add_rms_norm(xg2, residual, w)
    r2.backward(dr)
    assert torch.equal(xg2.grad, dr)


@pytest.mark.parametrize("n", [1000, 20000, 50000])  # 20000: chunked rows, read in two passes; 50000: narrow
def test_inplace_add_rms_norm_writes_residual(n):
    m = 5
    x, w, _ = _inputs(m, n, torch.bfloat16, "plain", seed=5)
    residual = torch.randn(m, n).to(torch.bfloat16).to(DEVICE)
    y_ref, r_ref = tpfuse.add_rms_norm(x, residual, w)
    res_in = residual.clone()
    y, r = tpfuse.add_rms_norm(x, res_in, w, inplace=True)
    assert r is res_in and torch.equal(res_in, r_ref) and torch.equal(y, y_ref)
    # A non-contiguous residual is updated in place as well.
    wide = torch.randn(m, 2 * n).to(torch.bfloat16).to(DEVICE)
    view = wide[:, ::2]
    expect_y, expect_r = tpfuse.add_rms_norm(x, view.clone(), w)
    y2, r2 = tpfuse.add_rms_norm(x, view, w, inplace=True)
    assert r2 is view and torch.equal(view, expect_r) and torch.equal(y2, expect_y)
    with pytest.raises(ValueError, match="not differentiable"):
        tpfuse.add_rms_norm(x.clone().requires_grad_(True), residual.clone(), w, inplace=True)


@pytest.mark.parametrize("n", [50000, 65536])  # a padded tile and a full one
def test_narrow_bf16_rows(n):
    """bf16 rows of 49152 to 65536 are held in registers in their 16-bit form (NormConfig's
    narrow rows): y close to the reference, add_rms_norm's y equal to rms_norm(residual_out),
    and a row's bits independent of its batch."""
    cfg = NormConfig.from_shape(n, torch.bfloat16)
    assert cfg.num_chunks == 1 and cfg.block_n == 65536 and cfg.num_warps == 32
    assert NormConfig.from_shape(n, torch.float16).num_chunks > 1  # fp16 cannot be held narrow
    assert NormConfig.from_shape(40000, torch.bfloat16).num_chunks > 1  # too much padding
    x, w, _ = _inputs(3, n, torch.bfloat16, "plain", seed=n)
    residual = torch.randn(3, n).to(torch.bfloat16).to(DEVICE)
    y = tpfuse.rms_norm(x, w)
    assert rel_err(y, reference.rms_norm(x, w, 1e-6)) <= rel_err_budget(torch.bfloat16)
    assert _same_bits(tpfuse.rms_norm(x[1:2], w), y[1:2])
    y2, r = tpfuse.add_rms_norm(x, residual, w)
    assert _same_bits(r, (x.float() + residual.float()).to(torch.bfloat16))
    assert _same_bits(y2, tpfuse.rms_norm(r, w))


@pytest.mark.smoke
def test_non_contiguous_misaligned_and_leading_shapes_give_the_same_bits():
    n = 1000
    x, w, _ = _inputs(12, n, torch.bfloat16, "plain", seed=9)
    y = tpfuse.rms_norm(x, w)
    transposed = x.t().contiguous().t()
    assert not transposed.is_contiguous()
    assert torch.equal(tpfuse.rms_norm(transposed, w), y)
    buf = torch.empty(12 * n + 1, dtype=torch.bfloat16, device=DEVICE)
    misaligned = buf[1:].view(12, n)
    misaligned.copy_(x)
    assert misaligned.data_ptr() % 16 != 0
    assert torch.equal(tpfuse.rms_norm(misaligned, w), y)
    assert torch.equal(tpfuse.rms_norm(x.view(3, 4, n), w), y.view(3, 4, n))


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_propagate_like_the_reference(dtype):
    x, w, _ = _inputs(4, 64, dtype, "plain", seed=1)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    y = tpfuse.rms_norm(x, w)
    ref = reference.rms_norm(x, w)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    finite = ref.isfinite()
    assert rel_err(y[finite], ref[finite]) <= rel_err_budget(dtype)
    assert y[1].isnan().all() and not y[0].isnan().any()
    # Through the residual add, and backward: the poisoned rows' gradients, not the others'.
    residual = torch.randn_like(x)
    bad = torch.zeros_like(x)
    bad[1, 3], bad[2, 5] = float("nan"), float("inf")
    y_ok, r_ok = tpfuse.add_rms_norm(torch.zeros_like(x), residual, w)
    y_bad, r_bad = tpfuse.add_rms_norm(bad, residual, w)
    assert r_bad[1, 3].isnan() and r_bad[2, 5].isinf() and y_bad[1].isnan().all()
    assert torch.equal(r_bad[0], r_ok[0]) and torch.equal(y_bad[0], y_ok[0])
    xg = x.clone().requires_grad_(True)
    tpfuse.rms_norm(xg, w).backward(torch.ones_like(x))
    assert xg.grad[1].isnan().all() and xg.grad[0].isfinite().all() and xg.grad[3].isfinite().all()


def test_fp32_weight_with_bf16_input():
    x, _, _ = _inputs(7, 1000, torch.bfloat16, "none", seed=2)
    w = torch.randn(1000, device=DEVICE)
    y = tpfuse.rms_norm(x, w)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference.rms_norm(x, w)) <= rel_err_budget(torch.bfloat16)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    tpfuse.rms_norm(xg, wg).backward(dy)
    dx_ref, dw_ref = reference.rms_norm_backward(dy, x, w)
    assert xg.grad.dtype == torch.bfloat16 and wg.grad.dtype == torch.float32
    assert rel_err(xg.grad, dx_ref) <= 2 * rel_err_budget(torch.bfloat16)
    assert rel_err(wg.grad, dw_ref) <= 2 * rel_err_budget(torch.bfloat16)


def test_launchers_reject_inconsistent_outputs():
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    with pytest.raises(ValueError, match="residual and residual_out"):
        rms_norm_fwd(x, w, torch.empty_like(x), 1e-6, 0.0, residual=x.clone())
    with pytest.raises(ValueError, match="weight and dweight"):
        rms_norm_bwd(x, x, w, torch.empty_like(x), None, 1e-6, 0.0)


@pytest.mark.smoke
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight has shape \(63,\); expected \(64,\)"):
        tpfuse.rms_norm(x, torch.ones(63, device=DEVICE))
    with pytest.raises(TypeError, match="residual has dtype torch.float16 but x has dtype torch.float32"):
        tpfuse.add_rms_norm(x, x.half())
    with pytest.raises(ValueError, match="residual has shape"):
        tpfuse.add_rms_norm(x, x[:2])
    with pytest.raises(TypeError, match="torch.int32"):
        tpfuse.rms_norm(torch.ones(4, 64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="weight has dtype torch.float64"):
        tpfuse.rms_norm(x, torch.ones(64, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="meta"):
        tpfuse.rms_norm(x, torch.ones(64, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        tpfuse.add_rms_norm(x, torch.ones(4, 64, device="meta"))
    with pytest.raises(ValueError, match="0-dim"):
        tpfuse.rms_norm(torch.tensor(1.0, device=DEVICE))
    with pytest.raises(ValueError, match="weight_offset"):
        tpfuse.rms_norm(x, None, weight_offset=1.0)
    import numpy as np

    assert torch.equal(tpfuse.rms_norm(x, None, np.float32(1e-5)), tpfuse.rms_norm(x, None, 1e-5))  # any real
    for eps in (0.0, -1e-6, float("nan"), float("inf"), "1e-6", True):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            tpfuse.rms_norm(x, None, eps)
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            tpfuse.add_rms_norm(x, x, None, eps)


def test_empty_inputs():
    for shape in [(0, 64), (2, 0, 64)]:
        x = torch.randn(shape, device=DEVICE)
        w = torch.randn(64, device=DEVICE, requires_grad=True)
        y, r = tpfuse.add_rms_norm(x, x.clone(), w)
        assert y.shape == x.shape and r.shape == x.shape
        xg = x.clone().requires_grad_(True)
        tpfuse.rms_norm(xg, w).sum().backward()
        assert xg.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
        w.grad = None
