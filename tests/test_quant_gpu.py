"""Quantized all-reduce and codecs on GPUs: one process per GPU, NCCL group, torch symmetric memory.

Run on a GPU machine (scripts/device_check.sh quant):
    python -m pytest -m "gpu or multigpu" tests/test_quant_gpu.py

Every rank holds all ranks' random pools (same seeds), so it computes
``tpfuse.reference.quantized_all_reduce`` (plain torch, on the device) of each call itself and
counts mismatching elements on the device: the long runs never synchronize with the host
until their end. NaN payloads differ between torch and Triton, so NaN positions are compared
instead of NaN bits.
"""

import random

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tpfuse import reference
from tpfuse.kernels.codecs import _e4m3_encode, hardware_e4m3

from tests.multiproc import capture_graph, missing_peer, no_failures, run_ranks
from tests.tally import PoolChecker

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
needs_gpus = pytest.mark.skipif(NGPU < 2, reason="needs at least 2 CUDA GPUs")

WORLDS = sorted({2, NGPU})
CODECS = ["fp8", "int8", "int6", "int4"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Every codec on bf16, and on one more dtype each: fewer kernels to compile in the time limit
# (the stress test draws every combination).
CODEC_DTYPES = {"fp8": [torch.bfloat16, torch.float16], "int8": [torch.bfloat16, torch.float32],
                "int6": [torch.bfloat16, torch.float16], "int4": [torch.bfloat16, torch.float32]}
POOL = (1 << 25) + 64  # elements per rank and dtype: several segments of the default workspace


def _pools(world, seed=0, n=POOL):
    """pools[dtype][rank]: normals times powers of two from 2**-8 to 2**8 (never zeros)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pools = {}
    for dtype in DTYPES:
        scale = torch.exp2(torch.randint(-8, 9, (n,), device="cuda", generator=g).float())
        pools[dtype] = [(torch.randn(n, device="cuda", generator=g) * scale).to(dtype) for _ in range(world)]
    return pools


def _mismatches(out, ref):
    """Elements whose bits differ (NaN vs NaN counts as equal), as a device scalar."""
    as_int = {2: torch.int16, 4: torch.int32}[out.element_size()]
    out, ref = out.reshape(-1), ref.reshape(-1)
    both_nan = torch.isnan(out) & torch.isnan(ref)
    return ((out.view(as_int) != ref.view(as_int)) & ~both_nan).sum()


class _Checker(PoolChecker):
    """Calls all_reduce on slices of the pools; counts, on the device, the elements that
    differ from the reference of the path the call must take (no host sync until the end)."""

    def expect(self, out, xs, quant, quantized, what):
        ref = self.reference.quantized_all_reduce(xs, quant) if quantized else self.reference.all_reduce(xs)
        self.record(_mismatches(out, ref), what)

    def call(self, n, dtype, quant, offset=0, min_bytes=0, what=""):
        """One call; quant=None is the exact path, and so is a message below min_bytes."""
        xs = self.inputs(n, dtype, offset)
        torch.full((n,), float("nan"), dtype=dtype, device="cuda")  # poison the block out will reuse
        if quant is None:
            out = self.comm.all_reduce(xs[self.rank])
        else:
            out = self.comm.all_reduce(xs[self.rank], quant=quant, quant_min_bytes=min_bytes)
        quantized = quant is not None and n * dtype.itemsize >= min_bytes
        self.expect(out, xs, quant, quantized, what or f"n={n} {dtype} {quant} offset={offset}")
        return out


def _sizes_codecs_dtypes(sizes, big):
    from tpfuse import reference
    from tpfuse.comm import Communicator

    world = dist.get_world_size()
    with Communicator(timeout_s=60) as comm:  # default workspace: the large sizes run in segments
        check = _Checker(comm, _pools(world))
        for n in sizes:
            for codec in CODECS:
                for dtype in (CODEC_DTYPES[codec] if n <= 1 << 22 else [torch.bfloat16]):
                    check.call(n, dtype, codec, offset=n % 7 * 8)
        for n in big:
            check.call(n, torch.bfloat16, CODECS[n % 4], offset=64)
        failures = check.failures()
        # The error budget, on Gaussian inputs at a real size.
        g = torch.Generator(device="cuda").manual_seed(1)
        xs = [torch.randn(1 << 24, device="cuda", generator=g).to(torch.bfloat16) for _ in range(world)]
        exact = sum(x.double() for x in xs)
        for codec in CODECS:
            out = comm.all_reduce(xs[dist.get_rank()], quant=codec, quant_min_bytes=0)
            err = reference.rel_err(out, exact)
            if not err <= reference.QUANT_ERROR_BUDGET[codec]:
                failures.append(f"{codec}: relative error {err:.4f} over the budget")
    return failures


def _special_values():
    """NaN and Inf groups propagate; huge groups stay finite; tiny groups keep their relative
    error; zero groups are +0.0. One rank holds the NaN/Inf."""
    from tpfuse import reference
    from tpfuse.comm import Communicator

    world, rank, failures = dist.get_world_size(), dist.get_rank(), []
    n = 1 << 22
    groups = n // 32
    with Communicator(timeout_s=60) as comm:
        for codec in CODECS:
            g = torch.Generator(device="cuda").manual_seed(3)
            xs = [torch.randn(groups, 32, device="cuda", generator=g) for _ in range(world)]
            kind = torch.arange(groups, device="cuda") % 8
            for r, x in enumerate(xs):
                x[kind == 1] *= 1e-5
                x[kind == 2] *= 1e-20
                x[kind == 3] = x[kind == 3].clamp(-3, 3) * (3e38 / 3 / world)
                x[kind == 4] = 0.0
                if r == 0:
                    x[kind == 5, 7] = float("nan")
                    x[kind == 6, 0] = float("inf")
            xs = [x.reshape(-1).to(torch.bfloat16) for x in xs]
            out = comm.all_reduce(xs[rank], quant=codec, quant_min_bytes=0)
            ref = reference.quantized_all_reduce(xs, codec)
            if _mismatches(out, ref).item():
                failures.append(f"{codec}: special values differ from the reference")
            o = out.float().view(groups, 32)
            exact = sum(x.double() for x in xs).view(groups, 32)
            nan_groups = torch.isnan(o).all(1)
            if not torch.equal(nan_groups, (kind == 5) | (kind == 6)) or torch.isnan(o[~nan_groups]).any():
                failures.append(f"{codec}: NaN/Inf groups not propagated exactly to their groups")
            if not torch.isfinite(o[kind == 3]).all():
                failures.append(f"{codec}: huge groups became Inf")
            if o[kind == 4].view(torch.int32).any():
                failures.append(f"{codec}: zero groups are not +0.0")
            ordinary = reference.rel_err(o[kind == 0], exact[kind == 0])
            for k in (1, 2, 3):
                err = reference.rel_err(o[kind == k], exact[kind == k])
                if err > 1.5 * ordinary:
                    failures.append(f"{codec}: group kind {k} error {err:.4f} vs ordinary {ordinary:.4f}")
    return failures


def _stress(calls, seed):
    """Random sizes (to several segments), codecs, the exact path, dtypes and offsets every
    call; a random rank sleeps on the device before some calls; no host sync until the end."""
    from tpfuse.comm import Communicator

    world, rank = dist.get_world_size(), dist.get_rank()
    rng = random.Random(seed)  # the same sequence on every rank
    with Communicator(max_bytes=4 << 20, timeout_s=60) as comm:
        check = _Checker(comm, _pools(world, seed, n=(1 << 23) + 64))
        for call in range(calls):
            dtype = rng.choice(DTYPES)
            n = int(2 ** rng.uniform(0, 23))
            quant = rng.choice(CODECS + [None])
            min_bytes = rng.choice([0, 0, 0, 1 << 16, 1 << 40])
            if n * dtype.itemsize > 2 << 20:  # exact calls stay within the workspace (beyond it: NCCL)
                quant, min_bytes = quant or rng.choice(CODECS), 0
            offset = rng.randrange(0, (1 << 23) - n + 1)
            late, cycles = rng.randrange(world) if rng.random() < 0.01 else -1, rng.randrange(1_000, 2_000_000)
            if rank == late:
                torch.cuda._sleep(cycles)
            check.call(n, dtype, quant, offset, min_bytes, what=f"call {call}")
        return check.failures()


def _graph_replays(replays):
    """A captured sequence of quantized (one of them segmented) and exact calls, replayed with
    new data, with eager calls in between; every output checked on the device."""
    from tpfuse.comm import Communicator

    world, rank = dist.get_world_size(), dist.get_rank()
    plan = [(1, torch.float32, "int8"), (4096, torch.bfloat16, "int4"), (100_003, torch.float16, "fp8"),
            (1 << 20, torch.bfloat16, None), (3 << 21, torch.bfloat16, "int6"), (777, torch.bfloat16, "int4"),
            (3 << 20, torch.float32, "int8")]
    with Communicator(max_bytes=4 << 20, timeout_s=60) as comm:  # 3 << 21 bf16 int6 is two segments
        check = _Checker(comm, _pools(world, seed=5, n=(1 << 23) + 64))
        static_in = [torch.empty(n, dtype=dtype, device="cuda") for n, dtype, _ in plan]

        def run():
            return [comm.all_reduce(x) if q is None else comm.all_reduce(x, quant=q, quant_min_bytes=0)
                    for x, (_, _, q) in zip(static_in, plan)]

        graph, outs = capture_graph(run)
        rng = random.Random(5)
        for i in range(replays):
            offsets = [rng.randrange(0, (1 << 23) - n) for n, _, _ in plan]
            for x, (n, dtype, _), off in zip(static_in, plan, offsets):
                x.copy_(check.pools[dtype][rank][off:off + n])
            graph.replay()
            for out, (n, dtype, q), off in zip(outs, plan, offsets):
                check.expect(out, check.inputs(n, dtype, off), q, q is not None, f"replay {i} n={n} {q}")
            if i % 10 == 0:
                check.call(rng.randrange(1, 300_000), torch.bfloat16, rng.choice(CODECS), rng.randrange(0, 1 << 22),
                           what=f"eager after replay {i}")
        del graph
        return check.failures()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("codec", CODECS)
def test_gpu_codecs_bitwise_equal_to_reference(codec):
    import tpfuse
    from tpfuse import reference

    g = torch.Generator(device="cuda").manual_seed(0)
    for n in [1, 31, 33, 4097, 1_000_003, 1 << 24]:
        for dtype in DTYPES:
            scale = torch.exp2(torch.randint(-20, 21, (n,), device="cuda", generator=g).float())
            x = (torch.randn(n, device="cuda", generator=g) * scale).to(dtype)
            packed = tpfuse.quantize(x, codec)
            assert torch.equal(packed, reference.quantize(x, codec)), f"n={n} {dtype}"
            for out_dtype in DTYPES:
                torch.full((n,), float("nan"), dtype=out_dtype, device="cuda")
                y = tpfuse.dequantize(packed, codec, x.shape, out_dtype)
                assert _mismatches(y, reference.dequantize(packed, codec, x.shape, out_dtype)).item() == 0


@triton.jit
def _e4m3_codes_kernel(hw_ptr, sw_ptr, first, n, BLOCK: tl.constexpr):
    """Codes of the fp32 values whose bits are first .. first + n - 1 (int32, wrapping), by
    the hardware and the software e4m3 conversion (0 for magnitudes of 452 or more: the
    encode never meets those)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = (first + offs).to(tl.int32).to(tl.float32, bitcast=True)
    ok = tl.abs(v) < 452.0
    tl.store(hw_ptr + offs, tl.where(ok, _e4m3_encode(v, True), 0).to(tl.uint8), mask=offs < n)
    tl.store(sw_ptr + offs, tl.where(ok, _e4m3_encode(v, False), 0).to(tl.uint8), mask=offs < n)


@pytest.mark.gpu
@needs_gpu
def test_gpu_e4m3_hardware_encode_equals_reference_on_every_fp32_value():
    """The proof behind fp8's hardware conversion: over all 2**32 fp32 bit patterns whose
    value is below 452 in magnitude (every value ``x * r`` the encode can round: NaN and Inf
    groups never reach it), the hardware code, the software code and ``reference._e4m3_rne``
    are the same byte."""
    if not hardware_e4m3(torch.device("cuda")):
        pytest.skip("this GPU has no e4m3 conversion (sm_89 and newer)")
    chunk = 1 << 28
    hw = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    sw = torch.empty_like(hw)
    for first in range(0, 1 << 32, chunk):
        hw.fill_(0xAA)
        sw.fill_(0x55)
        _e4m3_codes_kernel[(chunk // 4096,)](hw, sw, first, chunk, BLOCK=4096)
        bits = torch.arange(first, first + chunk, device="cuda", dtype=torch.int64)
        v = bits.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps, as in the kernel
        ok = v.abs() < 452.0
        ref = torch.where(ok, reference._e4m3_rne(torch.where(ok, v, 0.0)), 0).to(torch.uint8)
        assert torch.equal(hw, ref), f"hardware e4m3 differs from the reference in bits {first:#x}+"
        assert torch.equal(sw, ref), f"software e4m3 differs from the reference in bits {first:#x}+"


@pytest.mark.gpu
@needs_gpu
def test_gpu_fp8_decode_equals_reference_on_every_byte():
    """Every e4m3 byte (those the encode never writes, 0x7F, 0xFF and 0x80, included) with
    random finite scales, the smallest and the largest among them, decodes to the reference's
    bits in every output dtype."""
    import tpfuse

    g = torch.Generator(device="cuda").manual_seed(1)
    scales = torch.randint(reference._SCALE_MIN_BF16, 0x7F7F, (4096,), device="cuda", generator=g)
    scales[:2] = torch.tensor([reference._SCALE_MIN_BF16, 0x7F7F])
    scales |= torch.randint(0, 2, scales.shape, device="cuda", generator=g) << 15  # fp8 ignores the sign bit
    codes = torch.arange(256, device="cuda").repeat(len(scales) // 8).view(-1, 32)
    numel = codes.numel()
    packed = reference._pack(codes, scales, "fp8", numel)
    for out_dtype in DTYPES:
        y = tpfuse.dequantize(packed, "fp8", (numel,), out_dtype)
        assert _mismatches(y, reference.dequantize(packed, "fp8", (numel,), out_dtype)).item() == 0, out_dtype


@pytest.mark.multigpu
@needs_gpus
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_quantized_bitwise_equal_to_reference_at_real_sizes(world):
    sizes = [1, 33, 4097, 100_003, 1 << 20, 3_000_001]
    big = [1 << 24, (1 << 25) - 5]  # 32 and 64 MiB of bf16: several segments of the 16 MiB workspace
    no_failures(run_ranks(world, _sizes_codecs_dtypes, sizes, big, backend="nccl", timeout_s=600))


@pytest.mark.multigpu
@needs_gpus
def test_gpu_quantized_special_values():
    no_failures(run_ranks(NGPU, _special_values, backend="nccl", timeout_s=300))


@pytest.mark.multigpu
@needs_gpus
def test_gpu_stress_20000_calls_mixing_codecs_and_the_exact_path():
    no_failures(run_ranks(NGPU, _stress, 20_000, 13, backend="nccl", timeout_s=900))


@pytest.mark.multigpu
@needs_gpus
def test_gpu_quantized_graph_capture_replayed_with_new_data():
    no_failures(run_ranks(NGPU, _graph_replays, 200, backend="nccl", timeout_s=600))


@pytest.mark.multigpu
@needs_gpus
def test_gpu_quantized_missing_peer_ends_in_timeout_error():
    no_failures(run_ranks(NGPU, missing_peer, "quantized", 1 << 20, backend="nccl", timeout_s=300))
