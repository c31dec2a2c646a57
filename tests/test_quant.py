"""Quantized all-reduce and the standalone codecs on CPU (Triton's interpreter; gloo ranks).

The contract: ``tpfuse.quantize``/``dequantize`` and ``comm.all_reduce(x, quant=codec)`` are
bitwise equal to ``tpfuse.reference`` (``quantize``, ``dequantize``,
``quantized_all_reduce``), identical on every rank, and within the published error budget.
NaN payloads are not portable (torch, the interpreter and GPUs write different NaN bits), so
NaN positions are compared instead of NaN bits. Rank functions return (failures, digests).
"""

import contextlib
import os
import random

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tests.multiproc import missing_peer, no_failures, run_ranks
from tests.test_allreduce import _assert_ok, _digest, _inputs
from tpfuse import reference
from tpfuse.comm import Communicator, default_knobs
from tpfuse.comm.quant_plan import QuantPlan, check_quant
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout

CODECS = list(reference.QUANT_CODECS)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES = [1, 31, 32, 33, 1000, 8193, 20001]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype, NaN at the same positions, identical bits everywhere else."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


def _mixed(seed, n, dtype, lo=-8, hi=8):
    """Normals times powers of two from 2**lo to 2**hi (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(lo, hi + 1, (n,), generator=g).float())
    return (torch.randn(n, generator=g) * scale).to(dtype)


def _special_groups(seed, dtype):
    """Groups of 32: ordinary, tiny (< 1e-4 down to 1e-30), near the dtype's max, all zero,
    one NaN, one +Inf, one -Inf, ties on the int grids, subnormals."""
    g = torch.Generator().manual_seed(seed)
    big = torch.finfo(dtype).max

    def normal():
        return torch.randn(32, generator=g)

    groups = [normal(), normal() * 1e-5, normal() * 1e-12, normal() * 1e-30, normal().clamp(-3, 3) / 3 * big,
              torch.zeros(32), normal(), normal(), normal(),
              torch.randint(-64, 64, (32,), generator=g).float() / 4 + 0.125,
              torch.rand(32, generator=g) * torch.finfo(torch.float32).tiny]
    groups[6][5] = float("nan")
    groups[7][0] = float("inf")
    groups[8][31] = -float("inf")
    return torch.cat(groups).to(dtype)


@contextlib.contextmanager
def _poisoned_empty():
    """torch.empty returns NaN-filled (float) or 0xA5-filled (uint8) tensors: an output element
    a kernel forgets to write then shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


# ---------------------------------------------------------------- codec (no ranks)

@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 32, 33, 1000, 1 << 20])
def test_packed_layout_regions_are_aligned_disjoint_and_small(codec, n):
    planes, scales, total = reference.packed_layout(n, codec)
    groups = -(-n // 32)
    bits = sum(reference.QUANT_PLANES[codec])
    starts = list(planes) + [scales]
    ends = [p + groups * 4 * b for p, b in zip(planes, reference.QUANT_PLANES[codec])] + [scales + 2 * groups]
    assert all(s % 16 == 0 for s in starts) and total % 16 == 0
    assert all(e <= s for e, s in zip(ends, starts[1:])) and ends[-1] <= total
    assert total <= groups * (4 * bits + 2) + 16 * len(starts)  # (bits + 0.5) per value plus alignment
    assert reference.packed_layout(0, codec, groups=groups) == (planes, scales, total)


@pytest.mark.parametrize("codec", CODECS)
def test_quantize_and_dequantize_kernels_match_the_reference_bitwise(codec):
    for i, n in enumerate(SIZES):
        for d, dtype in enumerate(DTYPES):
            x = _mixed(100 * i + d, n, dtype)
            packed = tpfuse.quantize(x, codec)
            ref = reference.quantize(x, codec)
            assert torch.equal(packed, ref), f"n={n} {dtype}: packed bytes differ"
            for out_dtype in DTYPES:
                with _poisoned_empty():
                    y = tpfuse.dequantize(packed, codec, x.shape, out_dtype)
                assert _same(y, reference.dequantize(ref, codec, x.shape, out_dtype)), f"n={n} {dtype}->{out_dtype}"
    x = _mixed(7, 6 * 7 * 11, torch.bfloat16).view(6, 7, 11)  # any shape; strided input is copied
    assert torch.equal(tpfuse.quantize(x.transpose(0, 2), codec), reference.quantize(x.transpose(0, 2), codec))
    y = tpfuse.dequantize(tpfuse.quantize(x, codec), codec, (6, 7, 11), torch.float32)
    assert y.shape == (6, 7, 11) and reference.rel_err(y, x) < 0.1


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_huge_zero_nan_inf_groups(codec, dtype):
    x = _special_groups(3, dtype)
    packed = tpfuse.quantize(x, codec)
    assert torch.equal(packed, reference.quantize(x, codec))
    y = tpfuse.dequantize(packed, codec, x.shape, torch.float32).view(-1, 32)
    xg = x.float().view(-1, 32)
    assert _same(y.view(-1), reference.dequantize(packed, codec, x.shape, torch.float32))
    ordinary = reference.rel_err(y[0], xg[0])
    for g in (1, 2, 3):  # tiny groups: the same relative error as ordinary ones
        if xg[g].abs().max() > torch.finfo(dtype).tiny * 1e3:  # fp16 flushes 1e-12 and 1e-30 to zero
            assert reference.rel_err(y[g], xg[g]) < 2 * ordinary + 1e-3, f"group {g}"
    assert torch.isfinite(y[4]).all() and reference.rel_err(y[4], xg[4]) < 2 * ordinary + 1e-3  # huge
    assert torch.equal(y[5].view(torch.int32), torch.zeros(32, dtype=torch.int32))  # +0.0 exactly
    for g in (6, 7, 8):  # NaN and Inf: the affected group is NaN, its neighbours are not
        assert torch.isnan(y[g]).all(), f"group {g}"
    assert not torch.isnan(y[[0, 1, 2, 3, 4, 5, 9, 10]]).any()
    assert (y[:6].abs().amax(1) <= xg[:6].abs().amax(1)).all()  # truncated scales never overshoot


def test_quantization_is_half_to_even_and_extreme_values_are_exact():
    # One group, int8: max magnitude 128 (scale 1) and values on half-integers tie to even.
    x = torch.tensor([-128.0, 2.5, 3.5, -2.5, 0.5, 1.5, 127.0, -0.5] + [0.0] * 24)
    y = tpfuse.dequantize(tpfuse.quantize(x, "int8"), "int8", x.shape, torch.float32)
    assert y[:8].tolist() == [-128.0, 2.0, 4.0, -2.0, 0.0, 2.0, 127.0, 0.0]
    # The group's value of largest magnitude is exact in every int codec (the extra negative level).
    for codec in ("int8", "int6", "int4"):
        x = _mixed(5, 64, torch.bfloat16)
        y = tpfuse.dequantize(tpfuse.quantize(x, codec), codec, x.shape, torch.bfloat16).view(2, 32)
        idx = x.view(2, 32).float().abs().argmax(1)
        assert torch.equal(y[[0, 1], idx], x.view(2, 32)[[0, 1], idx]), codec
    # fp8: values that e4m3 holds exactly (scale 1 when the max is 448) come back exactly.
    x = torch.tensor([448.0, 1.0, -0.125, 3.5, 2 ** -9, -240.0] + [0.0] * 26)
    assert torch.equal(tpfuse.dequantize(tpfuse.quantize(x, "fp8"), "fp8", x.shape, torch.float32), x)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the Inf and NaN scales
def test_dequantize_of_arbitrary_bytes_matches_the_reference(codec):
    """Every byte pattern decodes as the reference decodes it, also codes and scales that
    quantize never writes (fp8's 0x80, subnormal, Inf or NaN scales)."""
    g = torch.Generator().manual_seed(3)
    n = 4000
    packed = torch.randint(0, 256, (reference.packed_layout(n, codec)[2],), dtype=torch.uint8, generator=g)
    for dtype in DTYPES:
        assert _same(tpfuse.dequantize(packed, codec, (n,), dtype), reference.dequantize(packed, codec, (n,), dtype))


def test_e4m3_rounding_ties_and_binade_edges_match_torch():
    """The kernels round to e4m3 on two paths (normal values on the fp32 bits, subnormal
    ones as integers) and the reference on one (a variable shift); torch's own e4m3 cast is
    a third. Groups led by 448 have scale 1, so every other value is rounded as it is."""
    g = torch.Generator().manual_seed(11)
    # Few significand bits, so ties are common; exponents across the subnormal and normal
    # ranges, and below the smallest e4m3 value (2**-9).
    sig = torch.randint(0, 64, (31 * 512,), generator=g).float() / 32 + 1
    exp = torch.randint(-13, 9, sig.shape, generator=g).float()
    v = sig * torch.exp2(exp) * (torch.randint(0, 2, sig.shape, generator=g).float() * 2 - 1)
    v = v.clamp(-448, 448)
    edges = torch.tensor([15 * 2.0 ** -10, -15 * 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -10, 1.9375, 1.0625, 432.0,
                          -440.0, 2.0 ** -6, 7 * 2.0 ** -9, 2.0 ** -11, -0.0, 0.0, 17 * 2.0 ** -10, 5 * 2.0 ** -10])
    v[:edges.numel()] = edges
    x = torch.cat([torch.full((512, 1), 448.0), v.view(512, 31)], 1).reshape(-1)
    packed = tpfuse.quantize(x, "fp8")
    assert torch.equal(packed, reference.quantize(x, "fp8"))
    y = tpfuse.dequantize(packed, "fp8", x.shape, torch.float32)
    expect = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(y.abs(), expect.abs()) and torch.equal(y[y != 0].sign(), expect[y != 0].sign())


@pytest.mark.parametrize("codec", CODECS)
def test_error_budget_on_gaussian_inputs(codec):
    """The reference's error (the kernels are bitwise equal to it) against float64, on
    2**17 Gaussian values per rank, W = 2..8."""
    budget = reference.QUANT_ERROR_BUDGET[codec]
    for world in (2, 3, 4, 8):
        g = torch.Generator().manual_seed(world)
        xs = [torch.randn(1 << 17, generator=g).to(torch.bfloat16) for _ in range(world)]
        err = reference.rel_err(reference.quantized_all_reduce(xs, codec), sum(x.double() for x in xs))
        assert err <= budget, f"W={world}: {err:.4f} > {budget}"
        assert err > budget / 4, f"W={world}: {err:.5f} is implausibly small for {codec}"


def test_codec_argument_errors():
    with pytest.raises(ValueError, match="codec"):
        tpfuse.quantize(torch.ones(4), "int3")
    with pytest.raises(TypeError, match="dtype"):
        tpfuse.quantize(torch.ones(4, dtype=torch.int32), "int8")
    with pytest.raises(ValueError, match="at least"):
        tpfuse.dequantize(torch.zeros(8, dtype=torch.uint8), "int8", (64,), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        tpfuse.dequantize(torch.zeros(100, dtype=torch.float32), "int8", (4,), torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        tpfuse.dequantize(tpfuse.quantize(torch.ones(4), "int8"), "int8", (4,), torch.int8)
    assert tpfuse.quantize(torch.empty(0), "int4").numel() == 0
    assert tpfuse.dequantize(torch.empty(0, dtype=torch.uint8), "int4", (0, 3), torch.float16).shape == (0, 3)


# ---------------------------------------------------------------- plan (no ranks)

@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("codec", CODECS)
def test_quant_plan_segments_cover_the_message_and_fit_the_slots(world, codec):
    for max_bytes in (4096, 1 << 20, 16 << 20):
        layout = WorkspaceLayout(world, max_bytes, max_blocks=128)
        for dtype in DTYPES:
            plan = QuantPlan.for_layout(layout, dtype, codec, default_knobs(world))
            assert plan.seg_chunk % max(32, ALIGN // dtype.itemsize) == 0
            assert reference.packed_layout(plan.seg_chunk, codec)[2] <= layout.twoshot_slot_bytes
            # Packed data is smaller than raw: a full segment holds more than max_bytes of input
            # once the slot holds a few groups.
            if max_bytes >= 1 << 20:
                assert world * plan.seg_chunk * dtype.itemsize > max_bytes
            for n in (1, 33, plan.seg_chunk * world - 1, plan.seg_chunk * world, 3 * plan.seg_chunk * world + 5):
                segs = plan.segments(n)
                assert segs[0].start == 0 and sum(s.numel for s in segs) == n
                for a, b in zip(segs, segs[1:]):
                    assert b.start == a.start + a.numel and a.numel == world * plan.seg_chunk
                for s in segs:
                    assert s.chunk % 32 == 0 and world * s.chunk >= s.numel and s.chunk <= plan.seg_chunk
                    assert 1 <= s.grid <= min(default_knobs(world).quant_max_ctas, 128)
                    small = s.chunk <= plan.small_max_chunk
                    assert (s.block, s.num_warps) == ((plan.small_block, plan.small_num_warps) if small
                                                      else (plan.block, plan.num_warps))
                    assert (s.start * dtype.itemsize) % 16 == 0
    # The plan depends on the layout, dtype, codec and knobs only.
    layout = WorkspaceLayout(world, 1 << 20, max_blocks=128)
    assert QuantPlan.for_layout(layout, torch.bfloat16, codec, default_knobs(world)) == QuantPlan.for_layout(
        layout, torch.bfloat16, codec, default_knobs(world))


def test_quant_plan_takes_each_codecs_tile():
    # The GPU's values, set by hand (the interpreter's tiles are all 8192): fp8 keeps 8192 on
    # large segments, the integer codecs take 16384.
    gpu = {"quant_tile": {"int4": 16384, "int6": 16384, "int8": 16384, "fp8": 8192}, "quant_small_tile": 8192}
    knobs = default_knobs(2).replace(**gpu, quant_small_tile_max_chunk=1 << 16, quant_num_warps=32)
    layout = WorkspaceLayout(2, 16 << 20, max_blocks=128)
    for codec in CODECS:
        plan = QuantPlan.for_layout(layout, torch.bfloat16, codec, knobs)
        big = plan.segments(2 * plan.seg_chunk)[0]
        assert big.chunk > plan.small_max_chunk and big.block == (8192 if codec == "fp8" else 16384)
        assert plan.seg_chunk % big.block == 0
        assert (plan.small_max_chunk, big.num_warps) == (1 << 16, 32)
        small = plan.segments(2 * 4096)[0]
        assert (small.block, small.num_warps) == (8192, 16)
    # W=4 takes W=8's warps (not measured with 32 warps)
    w4 = default_knobs(4).replace(**gpu)
    plan = QuantPlan.for_layout(WorkspaceLayout(4, 16 << 20, max_blocks=128), torch.bfloat16, "int4", w4)
    assert plan.segments(4 * plan.seg_chunk)[0].num_warps == 16
    with pytest.raises(ValueError, match="unknown codec"):
        QuantPlan.for_layout(layout, torch.bfloat16, "int5", knobs)


def test_quant_thresholds_and_argument_checks():
    for codec in CODECS:
        assert default_knobs(3).quant_min(codec) == default_knobs(8).quant_min(codec) is None  # not measured
        assert default_knobs(4).quant_min(codec) == dict(default_knobs(4).quant_min_bytes)[codec] > 0
    assert default_knobs(4).replace(quant_min_bytes={"int4": 456}).quant_min("int4") == 456
    with pytest.raises(ValueError, match="quant_min_bytes"):
        default_knobs(4).replace(quant_min_bytes={"int4": -1})
    check_quant(None, None)
    check_quant("fp8", 0)
    for quant, min_bytes, match in [("int5", None, "quant must be"), ("INT8", None, "quant must be"),
                                    (None, 10, "needs quant"), ("int8", -1, ">= 0"), ("int8", 1.5, ">= 0"),
                                    ("int8", True, ">= 0")]:
        with pytest.raises(ValueError, match=match):
            check_quant(quant, min_bytes)
    # The smallest workspace still holds a chunk of every codec and dtype.
    smallest = WorkspaceLayout(8, ALIGN, max_blocks=128)
    assert QuantPlan.for_layout(smallest, torch.float32, "int8", default_knobs(8)).seg_chunk >= 64


# ---------------------------------------------------------------- rank functions

def _call(comm, xs, codec, what, failures, digests, min_bytes=0, x=None):
    """One quantized (or, when below min_bytes, exact) call checked bitwise on this rank."""
    rank = dist.get_rank()
    src = xs[rank] if x is None else x
    before = src.clone()
    with _poisoned_empty():
        out = comm.all_reduce(src, quant=codec, quant_min_bytes=min_bytes)
    quantized = src.numel() * src.element_size() >= min_bytes
    ref = reference.quantized_all_reduce(xs, codec) if quantized else reference.all_reduce(xs)
    if not _same(out, ref.view(src.shape)):
        bad = (out.reshape(-1).view(torch.uint8) != ref.reshape(-1).view(torch.uint8)).sum().item()
        failures.append(f"{what}: {bad} bytes differ from the reference ({'quantized' if quantized else 'exact'})")
    if not _same(src, before):
        failures.append(f"{what}: the input was modified")
    digests.append(_digest(torch.nan_to_num(out, nan=0.0)))
    return out


def _bits_all_codecs(sizes):
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for i, n in enumerate(sizes):
            for c, codec in enumerate(CODECS):
                dtype = DTYPES[(i + c) % 3]
                xs = _inputs(1000 * i + c, n, dtype, world)
                _call(comm, xs, codec, f"n={n} {dtype} {codec}", failures, digests)
        # Rank 0 and 1 cancel (+-2**25) in the first value of every other group: the fp32 sum
        # in tree order (ranks 0 and 1 meet first) is exact there; another order would round the
        # small contributions away.
        for c, codec in enumerate(CODECS):
            xs = _inputs(77 + c, 4096, torch.bfloat16, world)
            xs[0][::64], xs[1][::64] = 2.0**25, -(2.0**25)
            _call(comm, xs, codec, f"cancelling {codec}", failures, digests)
        # Gaussian inputs: the kernels' error is within the budget (they equal the reference).
        for codec in CODECS:
            g = torch.Generator().manual_seed(11)
            xs = [torch.randn(40_000, generator=g).to(torch.bfloat16) for _ in range(world)]
            out = _call(comm, xs, codec, f"gaussian {codec}", failures, digests)
            err = reference.rel_err(out, sum(x.double() for x in xs))
            if err > reference.QUANT_ERROR_BUDGET[codec]:
                failures.append(f"gaussian {codec}: error {err:.4f} over the budget")
    return failures, digests


def _special_values():
    """NaN, Inf, huge, tiny and zero groups on some ranks."""
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        for c, codec in enumerate(CODECS):
            dtype = DTYPES[c % 3] if c != 3 else torch.bfloat16
            xs = [_special_groups(10 * c + r, dtype) for r in range(world)]
            for r in range(world):  # only rank 0 carries the NaN and Inf groups, ...
                if r:
                    for g in (6, 7, 8):
                        xs[r][32 * g:32 * g + 32] = _mixed(r * 10 + g, 32, dtype)
            for r in range(world):  # ... the huge group stays finite in the sum, and
                xs[r][128:160] = xs[0][128:160] / world
                xs[r][160:192] = 0  # the zero group is zero on every rank.
            out = _call(comm, xs, codec, f"special {codec}", failures, digests)
            g = out.float().view(-1, 32)
            exact = sum(x.double() for x in xs).view(-1, 32)
            if not (torch.isnan(g[6:9]).all() and not torch.isnan(g[[0, 1, 2, 3, 4, 5, 9, 10]]).any()):
                failures.append(f"{codec}: NaN/Inf groups not propagated, or NaN leaked into other groups")
            if not torch.isfinite(g[4]).all():
                failures.append(f"{codec}: the huge group became Inf")
            if not torch.equal(g[5].view(torch.int32), torch.zeros(32, dtype=torch.int32)):
                failures.append(f"{codec}: the zero group is not +0.0")
            ordinary = reference.rel_err(g[0], exact[0])
            if dtype != torch.float16 and reference.rel_err(g[1], exact[1]) > 2 * ordinary + 1e-3:
                failures.append(f"{codec}: tiny group error {reference.rel_err(g[1], exact[1]):.4f} "
                                f"vs {ordinary:.4f}")
    return failures, digests


def _changing_sizes(calls, seed, max_bytes):
    """Sizes (through several segments), codecs, dtypes and the exact/quantized choice change
    every call; no barrier between calls."""
    world, failures, digests = dist.get_world_size(), [], []
    rng = random.Random(seed)  # the same sequence on every rank
    with Communicator(max_bytes=max_bytes, timeout_s=30) as comm:
        for call in range(calls):
            n = rng.randint(20_000, 60_000) if call % 7 == 0 else rng.randint(1, 5000)
            dtype, codec = rng.choice(DTYPES), rng.choice(CODECS)
            min_bytes = rng.choice([0, 0, 0, 4096, 1 << 30])
            if n * dtype.itemsize > max_bytes // 2:
                min_bytes = min(min_bytes, 4096)  # the exact path would hand it to the backend
            xs = _inputs(seed * 100_000 + call, n, dtype, world)
            _call(comm, xs, codec, f"call {call} n={n} {dtype} {codec} min={min_bytes}", failures, digests, min_bytes)
            if rng.random() < 0.2:  # the exact path with quant=None in between
                xs = _inputs(seed * 100_000 + call + 50_000, rng.randint(1, 3000), dtype, world)
                with _poisoned_empty():
                    out = comm.all_reduce(xs[dist.get_rank()])
                if not _same(out, reference.all_reduce(xs)):
                    failures.append(f"call {call}: exact call after a quantized one differs")
                digests.append(_digest(out))
            if len(failures) > 5:
                break
    return failures, digests


def _segmented(max_bytes):
    """Messages of several segments: exact multiples of the segment, and remainders."""
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(max_bytes=max_bytes, timeout_s=30) as comm:
        for c, codec in enumerate(CODECS):
            dtype = DTYPES[c % 3]
            seg = world * QuantPlan.for_layout(comm.layout, dtype, codec, comm.knobs).seg_chunk
            for k, n in enumerate([2 * seg, 3 * seg + 17, seg - 1]):
                xs = _inputs(77 + 10 * c + k, n, dtype, world)
                _call(comm, xs, codec, f"{codec} {dtype} n={n} (segment {seg})", failures, digests)
    return failures, digests


def _slow_rank(calls, seed):
    """The last rank runs at the lowest priority with four ranks on the cores, so peers are a
    call ahead while it still reads; quantized and exact calls alternate.

    Every rank first makes a 64-element call with each codec and an exact one at normal
    priority, then the last rank is niced for the ``calls`` calls. A process's first
    calls do one-time work (lazy imports, the interpreter reading the kernels' and codecs'
    source), which the niced rank did at a sliver of the cores while its peers polled: its
    first call took 36-65 s on 2 cores. The calls after it race as before.

    The niced rank's quantized calls cost it about 1.2 s per 1000 elements on 2 cores, so the
    test makes few, small ones (at most 3000 elements; 1231 quantized in all with seed 24935,
    where 40,000 took 98 s of CI's 15 minutes): they must take every codec, an exact call
    between quantized ones, both dtypes, and a quantized call right after another (a segment
    is a launch of its own, so consecutive calls race as a segmented call's segments do); a
    failure says so if they do not. Grids of one block only: grids of several under a slow
    rank are the all-reduce slow-rank test's, whose flags the quantized kernel shares. (With
    the regions' rotation removed, these calls pass, as the 10 calls of seed 3 they replaced
    did: the all-reduce slow-rank test is the one that catches that.)"""
    world, failures, digests = dist.get_world_size(), [], []
    rng = random.Random(seed)
    # A niced rank on a loaded 2-core machine can be starved for a minute (a .ci/run at eef8b7f,
    # with other test runs beside it): the timeout only has to catch a hang within run_ranks' 300 s.
    with Communicator(max_bytes=1 << 16, timeout_s=200) as comm:
        xs = _inputs(seed, 64, torch.float32, world)
        for codec, min_bytes in [(codec, 0) for codec in CODECS] + [(CODECS[0], 1 << 30)]:
            _call(comm, xs, codec, f"warm-up {codec} min_bytes={min_bytes}", failures, digests, min_bytes=min_bytes)
        if dist.get_rank() == world - 1:
            os.nice(19)
        kinds = []  # per call: (codec or "exact", dtype, grids of its segments)
        for call in range(calls):
            n, dtype = rng.randint(1, 3000), rng.choice([torch.float32, torch.bfloat16])
            xs = _inputs(seed * 1000 + call, n, dtype, world)
            exact_fits = n * dtype.itemsize <= comm.max_bytes // 2  # else the exact path is the backend's
            codec, min_bytes = rng.choice(CODECS), rng.choice([0, 0, 1 << 30] if exact_fits else [0])
            plan = QuantPlan.for_layout(comm.layout, dtype, codec, comm.knobs)
            grids = set() if min_bytes else {g.grid for g in plan.segments(n)}
            kinds.append(("exact" if min_bytes else codec, dtype, grids))
            _call(comm, xs, codec, f"call {call} n={n}", failures, digests, min_bytes=min_bytes)
    got = {k for k, _, _ in kinds}
    grids = set().union(*(g for _, _, g in kinds))
    exact_between = any(k == "exact" for k, _, _ in kinds[1:-1])
    quant_twice = any("exact" not in (a[0], b[0]) for a, b in zip(kinds, kinds[1:]))
    if (got != {*CODECS, "exact"} or {d for _, d, _ in kinds} != {torch.float32, torch.bfloat16}
            or 1 not in grids or not exact_between or not quant_twice):
        failures.append(f"the calls miss a codec, an exact call or a dtype: {kinds}")
    return failures, digests


def _argument_errors():
    """Every rank passes the same bad arguments: each raises before communicating, so the
    next (good) call still lines up on all ranks."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(timeout_s=30) as comm:
        x = torch.ones(64)
        for kwargs, match in [(dict(quant="int3"), "quant must be"), (dict(quant="fp16"), "quant must be"),
                              (dict(quant="int8", algo="twoshot"), "algo='auto'"),
                              (dict(quant="int8", algo="ring"), "algo must be"),
                              (dict(quant="int8", quant_min_bytes=-5), ">= 0"),
                              (dict(quant_min_bytes=0), "needs quant")]:
            with pytest.raises(ValueError, match=match):
                comm.all_reduce(x, **kwargs)
        xs = _inputs(3, 3000, torch.bfloat16, world)
        _call(comm, xs, "int6", "after errors", failures, digests)
        # The knobs' threshold decides when quant_min_bytes is not given.
        with comm.using_knobs(comm.knobs.replace(quant_min_bytes={"int8": 4000})):
            for n in (1999, 2000):  # bf16: 3998 bytes (exact) and 4000 bytes (quantized)
                xs = _inputs(n, n, torch.bfloat16, world)
                with _poisoned_empty():
                    out = comm.all_reduce(xs[rank], quant="int8")
                want = reference.quantized_all_reduce(xs, "int8") if n == 2000 else reference.all_reduce(xs)
                if not _same(out, want):
                    failures.append(f"default threshold: n={n} took the wrong path")
                digests.append(_digest(out))
        # "never" (None): quant= is served exactly whatever the size.
        with comm.using_knobs(comm.knobs.replace(quant_min_bytes={"int8": None})):
            xs = _inputs(4, 5000, torch.bfloat16, world)
            with _poisoned_empty():
                out = comm.all_reduce(xs[rank], quant="int8")
            if not _same(out, reference.all_reduce(xs)):
                failures.append("a codec whose knob is None took the quantized path")
            digests.append(_digest(out))
        if comm.knobs.quant_min("int8") != default_knobs(world).quant_min("int8"):
            failures.append("using_knobs did not give the communicator's own knobs back")
    return failures, digests


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_quantized_all_reduce_bitwise_equal_to_reference_on_every_rank(world):
    _assert_ok(run_ranks(world, _bits_all_codecs, [1, 33, 4097, 30001]))


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_all_reduce_special_groups(world):
    _assert_ok(run_ranks(world, _special_values))


@pytest.mark.parametrize("world, calls", [(2, 40), (4, 14)])  # (2, 60), (4, 20) until 2026-11-28 (CI's budget)
def test_quantized_changing_sizes_codecs_and_paths_without_barriers(world, calls):
    results = run_ranks(world, _changing_sizes, calls, world, 1 << 16, timeout_s=300)
    _assert_ok(results)
    assert len(results[0][1]) >= calls


@pytest.mark.parametrize("world", [2, 4])
def test_messages_larger_than_the_workspace_run_in_segments(world):
    _assert_ok(run_ranks(world, _segmented, 8192))


def test_quantized_peers_one_call_ahead_never_overwrite_a_slow_ranks_data():
    # 5 calls of seed 24935 take every kind _slow_rank asks for (10 of seed 3 took 146-236 s)
    _assert_ok(run_ranks(4, _slow_rank, 5, 24935, timeout_s=300, fresh=True))


def test_quantized_missing_peer_ends_in_timeout_error():
    no_failures(run_ranks(2, missing_peer, "quantized", 5000, timeout_s=60))


def test_quantized_argument_errors_and_default_threshold():
    _assert_ok(run_ranks(2, _argument_errors))
