"""The sequence-parallel boundary on CPU ranks (gloo, Triton's interpreter).

The contract: rank r's ``comm.reduce_scatter_add_rms_norm(x, residual[r], w)`` is bitwise
equal to rows r * T / W .. (r + 1) * T / W - 1 of ``comm.all_reduce_add_rms_norm(x,
residual, w)`` (every algorithm) and of the split composition, and ``comm.all_gather``
puts the W slices back in rank order. Each rank builds every rank's inputs from shared seeds
and checks itself; the parent compares output digests across ranks.
"""

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tests.multiproc import no_failures, run_ranks
from tests.test_allreduce import _assert_ok, _digest, _same_bits
from tests.test_fused import DTYPES, _layer_inputs
from tests.test_quant import _poisoned_empty
from tpfuse import reference
from tpfuse.comm import Communicator

# (tokens, hidden): a row per rank, row tiles of 1 to 16 rows, a row in two pieces (5120), a
# chunked row (20000), and leading dimensions [S, B, N] (Megatron's layout) split over S.
SHAPES = [(2, 64), (8, 208), (32, 96), (4, 5120), (2, 20000), (4, 3, 128)]


def _sequence_parallel_vs_all_reduce(shapes, seed):
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for i, shape in enumerate(shapes):
            tokens, hidden = shape[0] * world // 2, shape[-1]  # tokens per rank as W=2 would have them
            full = (tokens, *shape[1:-1], hidden)
            dtype = DTYPES[i % len(DTYPES)]
            rows = torch.Size(full[:-1]).numel()
            xs, residuals, weight = _layer_inputs(seed + i, rows, hidden, dtype, world)
            x, residual = xs[rank].view(full), residuals[0].view(full)
            mine = slice(rank * tokens // world, (rank + 1) * tokens // world)
            what = f"{full} {dtype}"
            before = x.clone()
            with _poisoned_empty():
                y, res_out = comm.reduce_scatter_add_rms_norm(x, residual[mine].clone(), weight, 1e-6,
                                                              weight_offset=float(i % 2))
                gathered = comm.all_gather(y)
            split = tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, 1e-6, weight_offset=float(i % 2))
            for algo in ("oneshot", "twoshot", "auto"):
                if algo == "oneshot" and rows * hidden * x.element_size() > comm.layout.oneshot_slot_bytes:
                    continue
                fused = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-6, weight_offset=float(i % 2), algo=algo)
                for name, got, want in (("y", y, fused[0][mine]), ("residual_out", res_out, fused[1][mine])):
                    if not _same_bits(got, want):
                        failures.append(f"{what}: {name} differs from the {algo} all-reduce path's rows")
            if not (_same_bits(y, split[0][mine]) and _same_bits(res_out, split[1][mine])):
                failures.append(f"{what}: differs from the split composition's rows")
            if not _same_bits(gathered, split[0]):
                failures.append(f"{what}: all_gather does not restore the rows in rank order")
            if not _same_bits(x, before):
                failures.append(f"{what}: x was modified")
            digests.append(_digest(gathered))
    return failures, digests


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_norm_and_all_gather_equal_the_all_reduce_rows(world):
    shapes = SHAPES if world == 2 else SHAPES[:2] + SHAPES[-1:]
    _assert_ok(run_ranks(world, _sequence_parallel_vs_all_reduce, shapes, 5 * world, timeout_s=600))


def _bad_calls_raise_before_communicating():
    """Each bad call raises ValueError/TypeError on every rank, and a good call after them
    still works (no rank entered a kernel)."""
    world, failures = dist.get_world_size(), []
    with Communicator(max_bytes=1 << 14, timeout_s=10) as comm:
        x = torch.randn(2 * world, 64)
        res = torch.randn(2, 64)
        w = torch.ones(64)
        bad = {
            "tokens not a multiple of W": lambda: comm.reduce_scatter_add_rms_norm(x[:-1], res, w),
            "residual of the full T": lambda: comm.reduce_scatter_add_rms_norm(x, x, w),
            "residual of another dtype": lambda: comm.reduce_scatter_add_rms_norm(x, res.double(), w),
            "hidden size not a multiple of 16": lambda: comm.reduce_scatter_add_rms_norm(
                torch.randn(2 * world, 60), torch.randn(2, 60), None),
            "over max_bytes": lambda: comm.all_gather(torch.randn(64, 64)),
            "1-D all_gather": lambda: comm.all_gather(torch.randn(64)),
        }
        for name, call in bad.items():
            try:
                call()
                failures.append(f"{name}: no error")
            except (ValueError, TypeError):
                pass
        y, _ = comm.reduce_scatter_add_rms_norm(x, res, w)
        if y.shape != res.shape or torch.isnan(y).any():
            failures.append("a good call after the bad ones failed")
    return failures


def test_bad_sequence_parallel_calls_raise_before_any_communication():
    no_failures(run_ranks(2, _bad_calls_raise_before_communicating))


def test_sequence_parallel_on_one_rank_is_add_rms_norm():
    x, res, w = torch.randn(6, 32), torch.randn(6, 32), torch.rand(32)
    no_failures(run_ranks(1, _one_rank, x, res, w))


def _one_rank(x, res, w):
    with Communicator() as comm:
        y, res_out = comm.reduce_scatter_add_rms_norm(x, res, w)
        want = tpfuse.add_rms_norm(x, res, w)
        ok = _same_bits(y, want[0]) and _same_bits(res_out, want[1]) and _same_bits(comm.all_gather(y), y)
    return [] if ok else ["one rank: not add_rms_norm, or all_gather not the identity"]


def _backward(seed, dtype):
    """Gradients through reduce_scatter_add_rms_norm and all_gather (each rank's loss uses the
    gathered y and its own residual_out) against tpfuse.add_rms_norm's over all the rows:
    x's and residual's bitwise (a row's backward is its own), weight's to rounding (the ranks'
    partial dweights are summed in another order), and the whole backward run to run; then
    reduce_scatter's and all_gather's gradients, bitwise."""
    world, rank, failures = dist.get_world_size(), dist.get_rank(), []
    tokens, hidden = 4 * world, 96
    mine = slice(rank * tokens // world, (rank + 1) * tokens // world)
    xs, residuals, weight = _layer_inputs(seed, tokens, hidden, dtype, world)
    g = torch.Generator().manual_seed(seed + 7)
    dy, dres = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:  # on CPU ranks, or one GPU each
        xs, residuals, weight, dy, dres = (
            [t.to(comm.device) for t in xs], [t.to(comm.device) for t in residuals], weight.to(comm.device),
            dy.to(comm.device), dres.to(comm.device))
        grads = []
        for _ in range(2):
            x, res, w = (t.clone().requires_grad_() for t in (xs[rank], residuals[0][mine], weight))
            y, res_out = comm.reduce_scatter_add_rms_norm(x, res, w)
            ((comm.all_gather(y) * dy).sum() + (res_out * dres[mine]).sum()).backward()
            grads.append((x.grad, res.grad, w.grad))
        # Over all rows: the gathered y's gradient is every rank's dy, summed (exactly: W copies).
        r, res_full, w = (t.clone().requires_grad_() for t in (comm.all_reduce(xs[rank]), residuals[0], weight))
        y, res_out = tpfuse.add_rms_norm(r, res_full, w)
        ((y * (dy * world)).sum() + (res_out * dres).sum()).backward()
        dx, dresidual, dweight = grads[0]
        if not (_same_bits(dx, r.grad) and _same_bits(dresidual, res_full.grad[mine])):
            failures.append(f"{dtype}: x's or residual's gradient differs from add_rms_norm's over all rows")
        if reference.rel_err(dweight, w.grad) > reference.rel_err_budget(dtype):
            failures.append(f"{dtype}: weight's gradient {reference.rel_err(dweight, w.grad):.2e} off")
        if not all(_same_bits(a, b) for a, b in zip(*grads)):
            failures.append(f"{dtype}: the backward differs run to run")
        x = xs[rank].clone().requires_grad_()
        (comm.reduce_scatter(x) * dy[mine]).sum().backward()
        if not _same_bits(x.grad, comm.all_gather(dy[mine])):
            failures.append(f"{dtype}: reduce_scatter's gradient is not the all-gather")
        if not _same_bits(comm.reduce_scatter(xs[rank]), comm.all_reduce(xs[rank])[mine]):
            failures.append(f"{dtype}: reduce_scatter differs from the all-reduce's rows")
    return failures


@pytest.mark.smoke
def test_sequence_parallel_backward_matches_add_rms_norm_over_all_rows():
    """W=2 (the forward's tree order at W=4 is the test above's; the GPU suite runs every W)."""
    no_failures(run_ranks(2, _backward, 3, torch.bfloat16, timeout_s=600))
    no_failures(run_ranks(2, _backward, 4, torch.float32, timeout_s=600))
