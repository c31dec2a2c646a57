"""Fused all-reduce + residual add + RMSNorm on CPU ranks (gloo, Triton's interpreter).

The contract: ``comm.all_reduce_add_rms_norm(x, residual, w)`` is bitwise equal, on every
rank and for every algorithm, to the split composition ``r = comm.all_reduce(x);
tpfuse.add_rms_norm(r, residual, w)`` (and ``all_reduce_rms_norm`` to ``rms_norm(r), r``).
Each rank builds every rank's inputs from shared seeds and checks itself; the parent compares
output digests across ranks. Rank functions return (failures, digests).
"""

import random

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tests.conftest import ON_GPU
from tests.multiproc import missing_peer, no_failures, run_ranks, table_knobs
from tests.tally import ll_regions_not_zeroed
from tests.test_allreduce import _assert_ok, _digest, _inputs, _same_bits
from tests.test_quant import _poisoned_empty
from tpfuse import reference
from tpfuse.comm import Communicator, default_knobs
from tpfuse.comm.plan import AllReducePlan, FusedPlan, workspace_layout
from tpfuse.comm.workspace import WorkspaceLayout
from tpfuse.kernels.fused import ll_pieces
from tpfuse.kernels.norm import NormConfig

FUSED_ALGOS = ["oneshot", "twoshot", "auto"]
# (tokens, hidden): a row per rank and fewer rows than ranks, row tiles of 1..16 rows, hidden
# sizes padded to wider tiles, 5120 (a row in two pieces), and rows longer than the register
# limit (chunked; with flags at 2 x 20000 and, under the interpreter's knobs, 1 x 9008 fp32), and a bf16 row
# held narrow (1 x 50000, NormConfig's narrow rows).
SHAPES = [(1, 64), (3, 208), (5, 1008), (17, 256), (2, 5120), (40, 96), (2, 20000), (4, 48), (1, 9008), (1, 50000)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _layer_inputs(seed, tokens, hidden, dtype, world, same_residual=True):
    """Every rank's x, the residual (one shared, or one per rank), and a weight."""
    xs = [x.view(tokens, hidden) for x in _inputs(seed, tokens * hidden, dtype, world)]
    g = torch.Generator().manual_seed(seed + 1)
    n_res = 1 if same_residual else world
    residuals = [(torch.randn(tokens, hidden, generator=g) * 4).to(dtype) for _ in range(n_res)]
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return xs, residuals, weight


def _compare(what, fused, split, failures):
    for name, a, b in zip(("y", "second output"), fused, split):
        if not _same_bits(a, b):
            bad = (a.float() != b.float()).sum().item()
            failures.append(f"{what}: {name} differs from the split path in {bad} of {b.numel()} elements")


def _fused_vs_split(shapes, seed, same_residual, skip=()):
    """Every shape but those in ``skip`` (which keep their place: a shape's dtype, weight and
    offsets come from its index in ``shapes``)."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for i, (tokens, hidden) in enumerate(shapes):
            if (tokens, hidden) in skip:
                continue
            dtype = DTYPES[i % len(DTYPES)]
            for a, algo in enumerate(FUSED_ALGOS):
                offset = float((a + i) % 2)  # every algorithm with both offsets over the shapes
                xs, residuals, weight = _layer_inputs(seed + 100 * i + a, tokens, hidden, dtype, world, same_residual)
                if (i // len(DTYPES)) % 2:
                    weight = weight.float()  # an fp32 weight with every dtype
                x, residual = xs[rank], residuals[0 if same_residual else rank]
                what = f"{tokens}x{hidden} {dtype} {algo} offset={offset} weight {weight.dtype}"
                before = (x.clone(), residual.clone())
                with _poisoned_empty():  # an output element the kernel does not write shows as NaN
                    fused = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-6, weight_offset=offset, algo=algo)
                r = comm.all_reduce(x)
                split = tpfuse.add_rms_norm(r, residual, weight, 1e-6, weight_offset=offset)
                _compare(what, fused, split, failures)
                if not (_same_bits(x, before[0]) and _same_bits(residual, before[1])):
                    failures.append(f"{what}: an input was modified")
                # The split path itself against the spec: residual_out bitwise, y close.
                ref_y, ref_res = reference.all_reduce_add_rms_norm(xs, residual, weight, 1e-6, weight_offset=offset)
                if not _same_bits(fused[1], ref_res):
                    failures.append(f"{what}: residual_out differs from the reference")
                if reference.rel_err(fused[0], ref_y) > reference.rel_err_budget(dtype):
                    failures.append(f"{what}: y off the float64 reference")
                with _poisoned_empty():
                    fused = comm.all_reduce_rms_norm(x, weight, 1e-6, weight_offset=offset, algo=algo)
                _compare(what + " no residual", fused, (tpfuse.rms_norm(r, weight, 1e-6, weight_offset=offset), r),
                         failures)
                digests.append(_digest(fused[0]) + _digest(fused[1]))
    return failures, digests


FP8_MODES = ["tensor", "token", "group"]


def _fp8_group(hidden):
    """The largest power-of-two scale group from 16 to 128 that divides ``hidden``."""
    return max(g for g in (16, 32, 64, 128) if hidden % g == 0)


def _fused_fp8_vs_split(shapes, seed):
    """all_reduce_add_rms_norm_fp8 against the split composition (all-reduce, add_rms_norm,
    quant_fp8), bitwise, every mode meeting every algorithm over the shapes; a static scale
    small enough that values saturate."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for i, (tokens, hidden) in enumerate(shapes):
            dtype, group = DTYPES[i % len(DTYPES)], _fp8_group(hidden)
            for a, algo in enumerate(FUSED_ALGOS + ["split"]):
                mode = FP8_MODES[(i + a) % len(FP8_MODES)]
                xs, residuals, weight = _layer_inputs(seed + 100 * i + a, tokens, hidden, dtype, world)
                x, residual = xs[rank], residuals[0]
                scale = torch.tensor([0.004]) if mode == "tensor" else None
                what = f"{tokens}x{hidden} {dtype} {algo} fp8 {mode} (group {group})"
                inplace = a % 2 == 1
                res_in = residual.clone()
                with _poisoned_empty():
                    q, scales, res_out = comm.all_reduce_add_rms_norm_fp8(
                        x, res_in, weight, 1e-6, mode=mode, scale=scale, group=group, algo=algo, inplace=inplace)
                y, want_res = tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, 1e-6)
                want_q, want_scales = tpfuse.quant_fp8(y, mode, scale=scale, group=group)
                for name, got, want in (("q", q, want_q), ("scales", scales, want_scales),
                                        ("residual_out", res_out, want_res)):
                    if not _same_bits(got, want):
                        failures.append(f"{what}: {name} differs from the split path")
                if inplace != (res_out.data_ptr() == res_in.data_ptr()) or (not inplace and not _same_bits(res_in, residual)):
                    failures.append(f"{what}: inplace={inplace} broken")
                if mode == "group":  # the whole storage, the padding rows too (zero), as the reference's
                    ref_scales = reference.quant_fp8(y, mode, None, group)[1]
                    whole = (hidden // group, reference.fp8_scale_rows(tokens))
                    if not _same_bits(scales.as_strided(whole, (scales.stride(1), 1)),
                                      ref_scales.as_strided(whole, (ref_scales.stride(1), 1))):
                        failures.append(f"{what}: the scales' storage differs from the reference's")
                dequant = reference.dequant_fp8(q, scales, mode, group)
                if mode != "tensor" and reference.rel_err(dequant, y) > 0.08:
                    failures.append(f"{what}: q * scales is {reference.rel_err(dequant, y):.3f} off y")
                if mode == "tensor" and q.float().abs().max() != 448:
                    failures.append(f"{what}: the static scale was meant to saturate")
                digests.append(_digest(q) + _digest(scales) + _digest(res_out))
    return failures, digests


# fp32 partials (an invariant row-parallel layer's) normalised into a 16-bit residual, with
# fused_max_ctas at 16: every launch kind (row-wise, LL, Lamport words over whole tiles and
# spread, flags on rows held, in two pieces, chunked and held narrow, two-shot, split).
PARTIALS_SHAPES = [(1, 64), (3, 208), (64, 256), (1, 5120), (1, 50000), (2, 20000)]
PARTIALS_MAX_CTAS = 16
PARTIALS_DTYPES = (torch.bfloat16, torch.float16)  # the residual's, by shape


def _fp32_partials_vs_split(shapes, seed):
    """all_reduce_add_rms_norm of fp32 x into a bf16/fp16 residual against the split
    composition ``add_rms_norm(all_reduce(x).to(residual.dtype), residual, w)``, bitwise, for
    every algorithm; in place on one, with an fp8 output (quant_fp8 of split's y) on another."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30, knobs=table_knobs(fused_max_ctas=PARTIALS_MAX_CTAS)) as comm:
        for i, (tokens, hidden) in enumerate(shapes):
            dtype = PARTIALS_DTYPES[i % 2]
            for a, algo in enumerate(FUSED_ALGOS):
                _, residuals, weight = _layer_inputs(seed + 10 * i + a, tokens, hidden, dtype, world)
                xs = _layer_inputs(seed + 10 * i + a, tokens, hidden, torch.float32, world)[0]
                x = xs[rank]
                residual, w = residuals[0], weight.float() if (i + a) % 2 else weight
                what = f"{tokens}x{hidden} fp32 into {dtype} {algo} weight {w.dtype}"
                y, res_out = tpfuse.add_rms_norm(comm.all_reduce(x).to(dtype), residual, w, 1e-6)
                inplace = a == i % len(FUSED_ALGOS)
                res_in = residual.clone()
                with _poisoned_empty():
                    fused = comm.all_reduce_add_rms_norm(x, res_in, w, 1e-6, algo=algo, inplace=inplace)
                _compare(what, fused, (y, res_out), failures)
                if inplace != (fused[1].data_ptr() == res_in.data_ptr()):
                    failures.append(f"{what}: inplace={inplace} broken")
                if not _same_bits(fused[1], reference.all_reduce_add_rms_norm(xs, residual, w)[1]):
                    failures.append(f"{what}: residual_out differs from the reference")
                if a == (i + 1) % len(FUSED_ALGOS):
                    mode = FP8_MODES[i % len(FP8_MODES)]
                    scale = torch.tensor([0.004]) if mode == "tensor" else None
                    with _poisoned_empty():
                        q, scales, _ = comm.all_reduce_add_rms_norm_fp8(x, residual, w, 1e-6, mode=mode, scale=scale,
                                                                         group=_fp8_group(hidden), algo=algo)
                    want_q, want_scales = tpfuse.quant_fp8(y, mode, scale=scale, group=_fp8_group(hidden))
                    if not (_same_bits(q, want_q) and _same_bits(scales, want_scales)):
                        failures.append(f"{what}: the fp8 output ({mode}) differs from the split path's")
                digests.append(_digest(fused[0]) + _digest(fused[1]))
    return failures, digests


def _partials_launches(world):
    """The (algorithm, protocol, whole tiles) of each call _fp32_partials_vs_split makes."""
    knobs = default_knobs(world).replace(fused_max_ctas=PARTIALS_MAX_CTAS)
    layout = workspace_layout(knobs, 1 << 20)
    return {(p.algo, p.protocol, p.whole_tiles) for i, shape in enumerate(PARTIALS_SHAPES) for a in FUSED_ALGOS
            for p in [FusedPlan.from_shape(*shape, torch.float32, layout, knobs, a, PARTIALS_DTYPES[i % 2])]}


def _inplace_shapes_and_no_weight():
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for i, (shape, algo) in enumerate([((2, 3, 64), "oneshot"), ((4, 1, 96), "twoshot"),
                                           ((3, 20000), "twoshot"), ((6, 128), "split")]):
            tokens = torch.Size(shape[:-1]).numel()
            xs, residuals, weight = _layer_inputs(40 + i, tokens, shape[-1], torch.bfloat16, world)
            xs, residual = [x.view(shape) for x in xs], residuals[0].view(shape)
            w = None if i % 2 else weight
            r = comm.all_reduce(xs[rank])
            want = tpfuse.add_rms_norm(r, residual, w)
            res_in = residual.clone()
            with _poisoned_empty():
                y, res_out = comm.all_reduce_add_rms_norm(xs[rank], res_in, w, algo=algo, inplace=True)
            if res_out.data_ptr() != res_in.data_ptr():
                failures.append(f"{shape} {algo}: inplace must return the residual tensor itself")
            _compare(f"inplace {shape} {algo}", (y, res_in), want, failures)
            if y.shape != shape:
                failures.append(f"{shape}: y has shape {tuple(y.shape)}")
            digests.append(_digest(y) + _digest(res_in))
        # Non-contiguous x and residual.
        xs, residuals, weight = _layer_inputs(77, 8, 128, torch.float16, world)
        x, residual = xs[rank].t().contiguous().t(), residuals[0][:, ::1].t().contiguous().t()
        r = comm.all_reduce(x)
        _compare("strided", comm.all_reduce_add_rms_norm(x, residual, weight, algo="twoshot"),
                 tpfuse.add_rms_norm(r, residual, weight), failures)
    return failures, digests


def _bad_inputs_raise_before_communicating():
    """Each bad call raises on every rank before any kernel runs, so a good call after it
    still pairs up across ranks (a started protocol would leave the epochs out of step)."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=10) as comm:
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        w = torch.randn(64, dtype=torch.bfloat16)
        bad = [
            (ValueError, "residual has shape", lambda: comm.all_reduce_add_rms_norm(x, x[:2], w)),
            (TypeError, "residual has dtype", lambda: comm.all_reduce_add_rms_norm(x, x.float(), w)),
            # fp32 partial sums go with a 16-bit residual, and the weight follows the residual
            (TypeError, "residual has dtype", lambda: comm.all_reduce_add_rms_norm(x.half(), x, w)),
            (TypeError, "weight has dtype", lambda: comm.all_reduce_add_rms_norm(x.float(), x, w.half())),
            (TypeError, "residual is", lambda: comm.reduce_scatter_add_rms_norm(x.float(), x[:4 // world], w)),
            (TypeError, "residual has dtype", lambda: tpfuse.add_rms_norm(x.float(), x, w)),
            (ValueError, "weight has shape", lambda: comm.all_reduce_add_rms_norm(x, x, w[:32])),
            (ValueError, "weight has shape", lambda: comm.all_reduce_rms_norm(x, w[:63])),
            (TypeError, "dtype", lambda: comm.all_reduce_rms_norm(x.to(torch.int32), w)),
            (ValueError, "algo must be", lambda: comm.all_reduce_add_rms_norm(x, x, w, algo="ring")),
            (ValueError, "eps must be", lambda: comm.all_reduce_add_rms_norm(x, x, w, 0.0)),
            (ValueError, "eps must be", lambda: comm.all_reduce_rms_norm(x, w, float("nan"))),
            (ValueError, "max_bytes", lambda: comm.all_reduce_rms_norm(torch.randn(600, 1024), None,
                                                                         algo="oneshot")),
            (ValueError, "multiple of 16", lambda: comm.all_reduce_rms_norm(x[:, :60], w[:60], algo="twoshot")),
        ]
        for error, match, call in bad:
            with pytest.raises(error, match=match):
                call()
        xs, residuals, weight = _layer_inputs(5, 4, 64, torch.bfloat16, world)
        r = comm.all_reduce(xs[rank])
        fused = comm.all_reduce_add_rms_norm(xs[rank], residuals[0], weight)
        _compare("after the bad calls", fused, tpfuse.add_rms_norm(r, residuals[0], weight), failures)
        digests.append(_digest(fused[0]))
    return failures, digests


def _decode_layers(layers, tokens, hidden, seed):
    """``layers`` consecutive layers (random x per layer, residual carried) fused with a random
    algorithm each and split: the final residual and output must be the same bits."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    rng = random.Random(seed)
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        _, residuals, weight = _layer_inputs(seed, tokens, hidden, torch.bfloat16, world)
        res_fused, res_split = residuals[0].clone(), residuals[0].clone()
        for layer in range(layers):
            xs, _, _ = _layer_inputs(seed + 1 + layer, tokens, hidden, torch.bfloat16, world)
            y_fused, _ = comm.all_reduce_add_rms_norm(xs[rank], res_fused, weight, algo=rng.choice(FUSED_ALGOS),
                                                      inplace=True)
            y_split, _ = tpfuse.add_rms_norm(comm.all_reduce(xs[rank]), res_split, weight, inplace=True)
        _compare(f"after {layers} layers", (y_fused, res_fused), (y_split, res_split), failures)
        digests.append(_digest(y_fused) + _digest(res_fused))
    return failures, digests


def _row_wise_calls(calls):
    """Row-wise calls (tokens, hidden, dtype, mode) in turn, against the split path, with the
    knob at 16 KiB, so that calls take up to fused_max_ctas (4 here) row tiles. Modes: "res",
    "inplace" (residual_out is the residual), "nores" (all_reduce_rms_norm), "f32w" (an fp32
    weight with offset 1). Each call zeroes the words the one before left, whose bytes a call of
    another dtype must count alike (an fp32 call leaves twice a bf16 call's bytes)."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30, knobs=table_knobs(fused_rows_max_bytes=16 << 10)) as comm:
        for call, (tokens, hidden, dtype, mode) in enumerate(calls):
            p = FusedPlan.from_shape(tokens, hidden, dtype, comm.layout, comm.knobs)
            if p.protocol != "rows":
                failures.append(f"call {call}: {tokens} x {hidden} {dtype} ran {p.protocol}, not row-wise")
            xs, residuals, weight = _layer_inputs(call, tokens, hidden, dtype, world)
            what = f"call {call}: {tokens} x {hidden} {dtype} {mode} on {p.grid} CTAs"
            if mode == "nores":
                reduced = comm.all_reduce(xs[rank])
                got, want = comm.all_reduce_rms_norm(xs[rank], weight), (tpfuse.rms_norm(reduced, weight), reduced)
            elif mode == "inplace":
                want = tpfuse.add_rms_norm(comm.all_reduce(xs[rank]), residuals[0], weight)
                residual = residuals[0].clone()
                got = (comm.all_reduce_add_rms_norm(xs[rank], residual, weight, inplace=True)[0], residual)
            else:
                w, offset = (weight.float(), 1.0) if mode == "f32w" else (weight, 0.0)
                want = tpfuse.add_rms_norm(comm.all_reduce(xs[rank]), residuals[0], w, weight_offset=offset)
                got = comm.all_reduce_add_rms_norm(xs[rank], residuals[0], w, weight_offset=offset)
            _compare(what, got, want, failures)
            digests.append(_digest(got[0]))
        failures += ll_regions_not_zeroed(comm)
    return failures, digests


def _changing_calls(calls, seed):
    """The calls of _changing_shapes_without_barriers: (tokens, hidden, dtype, fused algo, the
    algo of a plain all-reduce before it or None)."""
    rng, out = random.Random(seed), []
    for _ in range(calls):
        tokens, hidden = rng.choice([1, 2, 7, 33]), rng.choice([64, 96, 512, 1008, 1000])
        # hidden 1000 is served by "auto" only, through the split path.
        dtype, algo = rng.choice(DTYPES), rng.choice(FUSED_ALGOS if hidden % 16 == 0 else ["auto"])
        plain = rng.choice(["oneshot", "twoshot"]) if rng.random() < 0.3 else None
        out.append((tokens, hidden, dtype, algo, plain))
    return out


def _changing_launches(world, calls, seed):
    """The launch kinds of _changing_shapes_without_barriers's calls in order: a plain
    all-reduce's (algorithm, protocol), a fused call's (algorithm, protocol, whole tiles)."""
    knobs = default_knobs(world)
    layout, out = workspace_layout(knobs, 1 << 20), []
    for tokens, hidden, dtype, algo, plain in _changing_calls(calls, seed):
        if plain is not None:
            p = AllReducePlan.from_numel(tokens * hidden, dtype, layout, knobs, plain)
            out.append(("all_reduce", p.algo, p.protocol))
        p = FusedPlan.from_shape(tokens, hidden, dtype, layout, knobs, algo)
        out.append(("fused", p.algo, p.protocol, p.whole_tiles))
    return out


def _changing_shapes_without_barriers(calls, seed):
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for call, (tokens, hidden, dtype, algo, plain) in enumerate(_changing_calls(calls, seed)):
            xs, residuals, weight = _layer_inputs(seed * 1000 + call, tokens, hidden, dtype, world)
            if plain is not None:  # plain all-reduces in between advance the same epochs
                comm.all_reduce(xs[rank], algo=plain)
            fused = comm.all_reduce_add_rms_norm(xs[rank], residuals[0], weight, algo=algo)
            want = reference.all_reduce_add_rms_norm(xs, residuals[0], weight)
            if not _same_bits(fused[1], want[1]):
                failures.append(f"call {call} {tokens}x{hidden} {dtype} {algo}: residual_out wrong")
            digests.append(_digest(fused[0]))
        failures += ll_regions_not_zeroed(comm)
    return failures, digests


# ---------------------------------------------------------------- tests

def test_fused_plan_picks_by_size_and_keeps_groups_whole_tiles():
    layout = WorkspaceLayout(4, 1 << 20, max_blocks=128)
    bf16, k = torch.bfloat16, default_knobs(4)
    assert FusedPlan.from_shape(4, 4096, bf16, layout, k).algo == "oneshot"
    assert FusedPlan.from_shape(4, 4096, bf16, None, k).algo == "split"
    # The flag kernel's tiles: hidden 8192 bf16 holds 4 vectors per thread (fused), 5120 holds
    # 8 (split; an explicit "oneshot" still serves it).
    assert FusedPlan.from_shape(1, 8192, bf16, layout, k).algo == "oneshot"
    assert FusedPlan.from_shape(1, 5120, bf16, layout, k).algo == "split"
    assert FusedPlan.from_shape(1, 5120, bf16, layout, k, "oneshot").algo == "oneshot"
    # ... unless the call has a row tile for every CTA (W=2: one-shot up to 8 MiB).
    big, k2 = WorkspaceLayout(2, 8 << 20, max_blocks=128), default_knobs(2).replace(fused_oneshot_max_bytes=8 << 20)
    assert FusedPlan.from_shape(k2.fused_max_ctas - 1, 5120, bf16, big, k2).algo == "split"
    assert FusedPlan.from_shape(k2.fused_max_ctas, 5120, bf16, big, k2).algo == "oneshot"
    two_shot = k.replace(fused_twoshot_max_bytes=1 << 20)
    assert FusedPlan.from_shape(200, 2048, bf16, layout, two_shot).algo == "twoshot"  # 800 KiB > one-shot's 512 KiB
    cfg = NormConfig.from_shape(256, bf16)
    two = FusedPlan.from_shape(63, 256, bf16, layout, k, "twoshot")
    assert cfg.rows == 4 and two.rows_per_group == 16 and two.grid == 4
    assert FusedPlan.from_shape(4096, 4096, bf16, layout, k).algo == "split"  # 32 MiB > workspace
    with pytest.raises(ValueError, match="max_bytes"):
        FusedPlan.from_shape(4096, 4096, bf16, layout, k, "twoshot")
    with pytest.raises(ValueError, match="algo must be"):
        FusedPlan.from_shape(1, 64, bf16, layout, k, "nccl")
    cfg = NormConfig.from_shape(96, bf16)
    assert FusedPlan.from_shape(40, 96, bf16, layout, k2, "twoshot").rows_per_group % cfg.rows == 0
    # Up to fused_ll_max_bytes (within the workspace's LL regions) one-shot goes over LL, and
    # auto takes it whatever the vectors per thread; above, the flag kernel and the vectors rule.
    ll_layout = WorkspaceLayout(4, 1 << 20, max_blocks=128, ll_max_bytes=64 << 10)
    k = k.replace(ll_max_bytes=64 << 10, fused_ll_max_bytes=16 << 10,
                  fused_wide_ll_max_bytes=16 << 10)  # hidden 8192 bf16 is a wide row
    one = FusedPlan.from_shape(1, 5120, bf16, ll_layout, k)  # 10 KiB: LL, 8 vectors per thread
    pieces = ll_pieces(5120, bf16)[1]
    assert one.algo == "oneshot" and one.protocol == "ll"
    assert one.grid == min(pieces, k.fused_max_ctas)  # a CTA per piece
    assert FusedPlan.from_shape(2, 5120, bf16, ll_layout, k).algo == "split"  # 20 KiB: flags, 8 vectors
    two = FusedPlan.from_shape(2, 5120, bf16, ll_layout, k, "oneshot")
    assert two.algo == "oneshot" and two.protocol == "flags"
    flags4 = FusedPlan.from_shape(2, 8192, bf16, ll_layout, k)  # 32 KiB: flags, 4 vectors
    assert flags4.algo == "oneshot" and flags4.protocol == "flags"
    flags = FusedPlan.from_shape(4, 4096, bf16, ll_layout, k)  # 32 KiB: flags, 2 vectors
    assert flags.algo == "oneshot" and flags.protocol == "flags"
    k = k.replace(fused_wide_ll_max_bytes=1 << 20)  # the LL regions still bound it
    assert FusedPlan.from_shape(4, 8192, bf16, ll_layout, k).protocol == "ll"  # 64 KiB: the LL regions' capacity
    assert FusedPlan.from_shape(8, 8192, bf16, ll_layout, k, "oneshot").protocol == "flags"  # 128 KiB: above it
    k = k.replace(ll_max_bytes=0)  # the all-reduce's LL limit does not
    assert FusedPlan.from_shape(4, 8192, bf16, ll_layout, k).protocol == "ll"
    # Lamport words above fused_ll_max_bytes, up to fused_lamport_max_bytes and the workspace's
    # Lamport capacity, where whole row tiles or one wave of pieces pay (lamport_tiling, here
    # for fused_max_ctas = 4); auto takes them whatever the vectors per thread.
    lamport_layout = WorkspaceLayout(4, 1 << 20, max_blocks=128, ll_max_bytes=16 << 10, lamport_max_bytes=128 << 10)
    k = k.replace(fused_ll_max_bytes=4 << 10, fused_lamport_max_bytes=64 << 10, fused_max_ctas=4)
    piece_words, pieces = ll_pieces(4096, bf16, "lamport")
    assert piece_words == NormConfig.from_shape(4096, bf16).num_warps * 32 * 8 and pieces == 2  # a vector per thread
    spread = FusedPlan.from_shape(2, 4096, bf16, lamport_layout, k)  # 16 KiB: 2 rows x 2 pieces, one wave
    assert (spread.algo, spread.protocol, spread.whole_tiles, spread.grid) == ("oneshot", "lamport", False, 4)
    assert FusedPlan.from_shape(3, 4096, bf16, lamport_layout, k, "oneshot").protocol == "flags"  # 6 pieces
    whole = FusedPlan.from_shape(8, 4096, bf16, lamport_layout, k)  # 64 KiB: a row tile per CTA and more
    assert (whole.protocol, whole.whole_tiles, whole.grid) == ("lamport", True, 4)
    assert FusedPlan.from_shape(4, 5120, bf16, lamport_layout, k).protocol == "flags"  # 5 vectors: neither pays
    assert FusedPlan.from_shape(1, 1024, bf16, lamport_layout, k).protocol == "ll"
    k = k.replace(fused_lamport_max_bytes=1 << 20)  # the Lamport capacity still bounds it
    assert FusedPlan.from_shape(16, 4096, bf16, lamport_layout, k).protocol == "lamport"  # 128 KiB
    assert FusedPlan.from_shape(17, 4096, bf16, lamport_layout, k, "oneshot").protocol == "flags"
    # Hidden sizes off the multiple of 16 take the split path (tests/test_fused_layouts.py says why).
    assert FusedPlan.from_shape(4, 1000, bf16, layout, k).algo == "split"
    with pytest.raises(ValueError, match="multiple of 16"):
        FusedPlan.from_shape(4, 1000, bf16, layout, k, "oneshot")


def test_fused_plan_runs_small_tiles_row_wise():
    """Row-wise (protocol "rows") up to fused_rows_max_bytes and the workspace's rows capacity,
    for tiles held in registers without a tail of at most fused_rows_max_tile_bytes, one CTA
    per piece within fused_max_ctas; else the protocols after it."""
    bf16 = torch.bfloat16
    k = default_knobs(2).replace(fused_rows_piece_bytes=1 << 10, fused_max_ctas=128,  # the GPU knobs
                                 fused_rows_max_bytes=16 << 10, fused_ll_max_bytes=64 << 10,
                                 fused_wide_ll_max_bytes=64 << 10)
    layout = WorkspaceLayout(2, 1 << 20, 128, ll_max_bytes=64 << 10, rows_max_bytes=16 << 10)
    for tokens in (1, 2):  # a 4096-element row is 8 pieces of 512
        p = FusedPlan.from_shape(tokens, 4096, bf16, layout, k)
        assert (p.algo, p.protocol, p.grid, p.piece_elems) == ("oneshot", "rows", 8 * tokens, 512)
    assert FusedPlan.from_shape(4, 4096, bf16, layout, k).protocol == "ll"  # 32 KiB: above the knob
    assert FusedPlan.from_shape(1, 2880, bf16, layout, k).grid == 6  # a padded row: 5 full pieces and 320 elements
    assert FusedPlan.from_shape(1, 5120, bf16, layout, k).protocol == "ll"  # a 16 KiB tile (and a tail)
    assert FusedPlan.from_shape(1, 8192, bf16, layout, k).protocol == "ll"  # a 16 KiB tile
    assert FusedPlan.from_shape(1, 4096, bf16, layout, k, "twoshot").protocol == "flags"
    small = FusedPlan.from_shape(3, 256, bf16, layout, k)  # one tile (NormConfig's rows) holds all three
    assert (small.protocol, small.grid) == ("rows", NormConfig.from_shape(256, bf16).rows * 256 * 2 // 1024)
    wide_k = k.replace(fused_rows_max_bytes=256 << 10)  # past W=2's 64 KiB: the CTA cap rules
    wide = WorkspaceLayout(2, 1 << 20, 128, ll_max_bytes=64 << 10, rows_max_bytes=256 << 10)
    p = FusedPlan.from_shape(16, 4096, bf16, wide, wide_k)
    assert (p.protocol, p.grid) == ("rows", 128)  # 128 pieces, fused_max_ctas
    assert FusedPlan.from_shape(17, 4096, bf16, wide, wide_k).protocol != "rows"  # 136 pieces
    assert FusedPlan.from_shape(2, 4096, bf16, layout, wide_k).protocol == "rows"  # 16 KiB: the layout's capacity
    assert FusedPlan.from_shape(3, 4096, bf16, layout, wide_k).protocol == "ll"
    no_rows = WorkspaceLayout(2, 1 << 20, 128, ll_max_bytes=64 << 10)
    assert FusedPlan.from_shape(1, 4096, bf16, no_rows, k).protocol == "ll"
    assert FusedPlan.from_shape(1, 4096, bf16, layout, k.replace(fused_rows_max_bytes=0)).protocol == "ll"


def _fused_launches(world, skip=()):
    """The (algorithm, protocol, whole tiles) of each call _fused_vs_split makes at ``world``."""
    knobs = default_knobs(world)
    layout = workspace_layout(knobs, 1 << 20)
    return {(p.algo, p.protocol, p.whole_tiles) for i, shape in enumerate(SHAPES) if shape not in skip
            for p in (FusedPlan.from_shape(*shape, DTYPES[i % len(DTYPES)], layout, knobs, a) for a in FUSED_ALGOS)}


# Under the interpreter W=4 leaves out 17 x 256 and 40 x 96 (half its 100 s; W=2 runs them, with
# the same dtypes and weights): the shapes left still take every fused launch kind at W=4.
W4_CPU_SKIP = [] if ON_GPU else [(17, 256), (40, 96)]


@pytest.mark.parametrize("world", [2, 4])
def test_fused_is_bitwise_equal_to_split(world):
    skip = W4_CPU_SKIP if world == 4 else []
    if skip:
        assert _fused_launches(world, skip) == _fused_launches(world)
    _assert_ok(run_ranks(world, _fused_vs_split, SHAPES, 11 * world, True, skip, timeout_s=600))


def test_fused_at_world_size_8():
    """The largest world size, as 8 CPU processes (no 8-GPU machine has run the device suite)."""
    _assert_ok(run_ranks(8, _fused_vs_split, [(1, 64), (9, 96)], 88, False, timeout_s=600))


def test_fused_over_fp32_partials_is_bitwise_equal_to_split():
    assert _partials_launches(2) == {("oneshot", "rows", False), ("oneshot", "ll", False), ("oneshot", "lamport", True),
                                     ("oneshot", "lamport", False), ("oneshot", "flags", False),
                                     ("twoshot", "flags", False), ("split", "flags", False)}
    _assert_ok(run_ranks(2, _fp32_partials_vs_split, PARTIALS_SHAPES, 23, timeout_s=600))


@pytest.mark.smoke
def test_fused_uses_each_ranks_own_residual():
    """Residuals that differ across ranks: every rank still gets its own split result."""
    results = run_ranks(2, _fused_vs_split, SHAPES[:4], 5, False, timeout_s=600)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("world", [2, 4])
def test_fused_inplace_shapes_strides_and_no_weight(world):
    _assert_ok(run_ranks(world, _inplace_shapes_and_no_weight, timeout_s=600))


# Every fused launch kind (row-wise, LL, Lamport, flags, two-shot, split) and every norm path
# (held, in two pieces, chunked; narrow rows are held rows here) with each fp8 mode somewhere.
FP8_SHAPES = [(1, 64), (3, 208), (2, 5120), (17, 256), (2, 20000)]


@pytest.mark.smoke
@pytest.mark.parametrize("world", [2])
def test_fused_fp8_is_bitwise_equal_to_split(world):
    _assert_ok(run_ranks(world, _fused_fp8_vs_split, FP8_SHAPES, 7 * world, timeout_s=600))


def test_bad_inputs_raise_before_any_communication():
    _assert_ok(run_ranks(2, _bad_inputs_raise_before_communicating))


@pytest.mark.smoke
def test_sixty_layer_decode_fused_equals_split():
    _assert_ok(run_ranks(2, _decode_layers, 60, 2, 256, 3, timeout_s=600))


@pytest.mark.parametrize("algo, numel", [("oneshot", 128), ("oneshot", 1024), ("oneshot", 20000), ("twoshot", 128)])
def test_missing_peer_ends_fused_call_in_timeout_error(algo, numel):
    """One-shot row-wise (128 fp32 elements), over LL (1024) and over flags (20000), and two-shot."""
    no_failures(run_ranks(2, missing_peer, "fused", numel, algo, timeout_s=60))


def test_row_wise_calls_of_mixed_dtypes_modes_and_tiles():
    """1-4 row tiles a call (a CTA each under the interpreter), every mode, and calls of other
    dtypes in turn (an fp32 call, then 2-byte ones: its words must all be zeroed)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    calls = [(6, 128, fp32, "res"), (12, 256, bf16, "res"), (10, 256, fp16, "inplace"), (3, 48, fp16, "nores"),
             (13, 128, fp32, "f32w"), (9, 256, bf16, "res"), (1, 64, fp32, "res"), (14, 256, bf16, "inplace"),
             (16, 96, fp32, "res"), (2, 512, bf16, "nores")]
    _assert_ok(run_ranks(2, _row_wise_calls, calls, timeout_s=300))


# Seeds whose shorter runs take every launch kind, and at least as many distinct transitions
# between kinds, as the runs these replaced (150 calls of seed 2 at W=2: 68 s on 2 cores; 40
# of seed 4 at W=4: 57 s); searched again when the row-wise kind came (W=4 then needed 22 calls).
@pytest.mark.parametrize("world, calls, seed", [(2, 75, 571), (4, 22, 3622)])
def test_changing_shapes_and_algorithms_without_barriers(world, calls, seed):
    kinds = _changing_launches(world, calls, seed)
    before = _changing_launches(world, {2: 150, 4: 40}[world], world)
    assert set(kinds) >= set(before) and len(set(zip(kinds, kinds[1:]))) >= len(set(zip(before, before[1:])))
    results = run_ranks(world, _changing_shapes_without_barriers, calls, seed, timeout_s=600)
    _assert_ok(results)
    assert len(results[0][1]) == calls
