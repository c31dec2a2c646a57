"""Communicator.all_reduce on GPUs: one process per GPU, NCCL group, torch symmetric memory.

Run on a machine with >= 2 GPUs:  python -m pytest -m multigpu tests/test_allreduce_gpu.py

Every rank holds all ranks' random pools (same seeds), so it computes the reference of each
call itself, on the device, and counts mismatching elements on the device: the long runs
never synchronize with the host until their end.
"""

import random

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import (MISMATCHES, capture_graph, mismatched_calls, missing_peer, no_failures, run_ranks,
                             table_knobs)
from tests.tally import PoolChecker, ll_regions_not_zeroed
from tests.test_allreduce import _special_values

pytestmark = pytest.mark.multigpu

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
if NGPU < 2:
    pytest.skip("needs at least 2 CUDA GPUs", allow_module_level=True)

WORLDS = sorted({2, NGPU})
PROTOCOL_KNOBS = {"ll_max_bytes": 8 << 10, "lamport_max_bytes": 1 << 20}
"""One-shot over LL words to 8 KiB, Lamport words to 1 MiB, flags above, whatever the world
size's table says (W=2's uses no LL words, W=8's no Lamport words)."""
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
POOL = (1 << 23) + 64  # elements per rank and dtype: the largest size at any offset below 64


def _pools(world, seed=0):
    """pools[dtype][rank]: the random data every rank draws its inputs from (never zeros;
    magnitudes from 2**-8 to 2**8, so sums cancel and round)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pools = {}
    for dtype in DTYPES:
        scale = torch.exp2(torch.randint(-8, 9, (POOL,), device="cuda", generator=g).float())
        pools[dtype] = [(torch.randn(POOL, device="cuda", generator=g) * scale).to(dtype) for _ in range(world)]
    return pools


class _Checker(PoolChecker):
    """Calls all_reduce on slices of the pools; counts, on the device, the elements that
    differ from tpfuse.reference.all_reduce (no host sync until ``failures``)."""

    def expect(self, out, xs, what):
        ref = self.reference.all_reduce(xs)
        as_int = {2: torch.int16, 4: torch.int32}[out.element_size()]
        self.record((out.reshape(-1).view(as_int) != ref.view(as_int)).sum(), what)

    def call(self, n, dtype, algo, offset=0, what=""):
        xs = self.inputs(n, dtype, offset)
        torch.full((n,), float("nan"), dtype=dtype, device="cuda")  # poison the block out will reuse
        out = self.comm.all_reduce(xs[self.rank], algo=algo)
        self.expect(out, xs, what or f"n={n} {dtype} {algo} offset={offset}")
        return out


def _sizes_dtypes_algos(sizes, knobs):
    from tpfuse.comm import Communicator
    from tpfuse.comm.plan import AllReducePlan

    world = dist.get_world_size()
    with Communicator(timeout_s=30, knobs=table_knobs(**knobs)) as comm:
        check = _Checker(comm, _pools(world))
        for n in sizes:
            for dtype in DTYPES:
                for algo in ["oneshot", "twoshot", "auto"]:
                    if AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, "auto").algo == "nccl":
                        continue  # past the workspace: covered by the fallback test
                    try:
                        AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, algo)
                    except ValueError:
                        continue  # one-shot does not serve this size
                    check.call(n, dtype, algo, offset=n % 7)  # odd offsets: misaligned inputs
        x = check.pools[torch.bfloat16][dist.get_rank()]
        strided = [p[: 2 * 100_001: 2] for p in check.pools[torch.bfloat16]]
        check.expect(comm.all_reduce(x[: 2 * 100_001: 2]), [s.contiguous() for s in strided], "strided")
        out = comm.all_reduce(x[:0])
        failures = check.failures()
        if out.numel() != 0:
            failures.append("empty input gave a non-empty result")
    return failures


def _stress(calls, seed):
    """Random sizes, dtypes, algorithms and offsets every call; a random rank sleeps on the
    device before some calls; no host sync until the end."""
    from tpfuse.comm import Communicator
    from tpfuse.comm.plan import AllReducePlan

    world, rank = dist.get_world_size(), dist.get_rank()
    rng = random.Random(seed)  # the same sequence on every rank
    with Communicator(timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        check = _Checker(comm, _pools(world, seed))
        for call in range(calls):
            dtype = rng.choice(DTYPES)
            n = int(2 ** rng.uniform(0, 21))
            algo = rng.choice(["auto", "auto", "oneshot", "twoshot"])
            if algo == "oneshot" and n * dtype.itemsize > comm.layout.oneshot_slot_bytes:
                algo = "twoshot"
            offset = rng.randrange(0, POOL - n)
            late, cycles = rng.randrange(world) if rng.random() < 0.01 else -1, rng.randrange(1_000, 2_000_000)
            if rank == late:
                torch.cuda._sleep(cycles)  # this rank's kernel starts up to ~1 ms late
            assert AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, algo).algo != "nccl"
            check.call(n, dtype, algo, offset, what=f"call {call}")
        failures = check.failures()
        failures += ll_regions_not_zeroed(comm)
        return failures



def _graph_replays(replays):
    """A captured sequence of differently sized all-reduces, replayed with new data each
    time, with eager calls in between; every output checked on the device."""
    from tpfuse.comm import Communicator

    world, rank = dist.get_world_size(), dist.get_rank()
    plan = [(1, torch.float32, "auto"), (4096, torch.bfloat16, "oneshot"), (100_003, torch.float16, "twoshot"),
            (1 << 20, torch.bfloat16, "auto"), (777, torch.bfloat16, "twoshot"), (3 << 20, torch.float32, "auto"),
            (200_000, torch.bfloat16, "oneshot")]  # 400 KB: Lamport words (PROTOCOL_KNOBS)
    with Communicator(timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        check = _Checker(comm, _pools(world, seed=5))
        static_in = [torch.empty(n, dtype=dtype, device="cuda") for n, dtype, _ in plan]
        graph, outs = capture_graph(lambda: [comm.all_reduce(x, algo=algo) for x, (_, _, algo) in zip(static_in, plan)])
        rng = random.Random(5)
        for i in range(replays):
            offsets = [rng.randrange(0, POOL - n) for n, _, _ in plan]
            for x, (n, dtype, _), off in zip(static_in, plan, offsets):
                x.copy_(check.pools[dtype][rank][off:off + n])
            graph.replay()
            for out, (n, dtype, algo), off in zip(outs, plan, offsets):
                check.expect(out, check.inputs(n, dtype, off), f"replay {i} n={n} {algo}")
            if i % 10 == 0:
                check.call(rng.randrange(1, 300_000), torch.bfloat16, "auto", rng.randrange(0, POOL // 2),
                           what=f"eager after replay {i}")
        del graph
        return check.failures()


def _fallback():
    from tpfuse.comm import Communicator

    world, rank, failures = dist.get_world_size(), dist.get_rank(), []
    with Communicator(max_bytes=1 << 20, timeout_s=30) as comm:
        pools = _pools(world, seed=9)
        for n, algo in [(1 << 20, "auto"), (1000, "nccl")]:  # 4 MB fp32 > max_bytes; forced backend
            xs = [p[:n] for p in pools[torch.float32]]
            out = comm.all_reduce(xs[rank], algo=algo)
            ref = sum(x.double() for x in xs)
            if not torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4):
                failures.append(f"backend result wrong for n={n} algo={algo}")
    return failures


def _streams(calls):
    """One communicator called from two streams in turn without a host sync (each call waits
    for the last one's stream); two communicators over two groups, each on a stream of its
    own, running at once; a graph captured on one stream replayed on another. Every output is
    checked on its stream's tally."""
    from tpfuse.comm import Communicator

    world = dist.get_world_size()
    pools, rng = _pools(world, seed=21), random.Random(21)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    failures = []
    with Communicator(timeout_s=60) as comm:
        check = _Checker(comm, pools)
        for call in range(calls):
            with torch.cuda.stream(streams[call % 2]):
                check.call(rng.randrange(1, 300_000), rng.choice(DTYPES), "auto", rng.randrange(0, POOL // 2),
                           what=f"two streams, call {call}")
        torch.cuda.synchronize()
        failures += check.failures()
        # A graph captured on a side stream, replayed on streams[1], eager calls between the
        # replays on the current stream. A replay launches no host code of tpfuse's: like any
        # CUDA work, it is ordered by the stream it is replayed on, so that stream waits for the
        # communicator's last call (docs/design.md 2.5); the eager calls wait for the replay.
        check = _Checker(comm, pools)
        x = torch.empty(50_000, dtype=torch.bfloat16, device="cuda")
        graph, out = capture_graph(lambda: comm.all_reduce(x))
        for i in range(20):
            offset = rng.randrange(0, POOL // 2)
            streams[1].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(streams[1]):
                x.copy_(check.inputs(50_000, torch.bfloat16, offset)[dist.get_rank()])
                graph.replay()
                check.expect(out, check.inputs(50_000, torch.bfloat16, offset), f"replay {i} on another stream")
            torch.cuda.current_stream().wait_stream(streams[1])
            check.call(777, torch.float32, "auto", offset, what=f"eager after replay {i}")
        del graph
        torch.cuda.synchronize()
        failures += check.failures()
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    comms = [Communicator(g, timeout_s=60) for g in groups]
    checks = [_Checker(c, pools) for c in comms]
    for call in range(calls):
        for k in (0, 1):
            with torch.cuda.stream(streams[k]):
                checks[k].call(rng.randrange(1, 300_000), torch.bfloat16, "auto", rng.randrange(0, POOL // 2),
                               what=f"group {k}, call {call}")
    torch.cuda.synchronize()
    for k in (0, 1):
        failures += [f"group {k}: {f}" for f in checks[k].failures()]
        comms[k].close()
        dist.destroy_process_group(groups[k])
    return failures


@pytest.mark.parametrize("knobs", ["pinned", "table"])
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_bitwise_equal_to_reference_at_real_sizes(world, knobs):
    """Under PROTOCOL_KNOBS, which reach every protocol, and under the world size's table as
    it ships (W=2's: Lamport words to 8 MiB, several vectors a thread, odd sizes)."""
    sizes = [1, 7, 8, 1000, 4097, 65536, 100_003, 1 << 20, 3_000_001, 1 << 23]
    no_failures(run_ranks(world, _sizes_dtypes_algos, sizes, PROTOCOL_KNOBS if knobs == "pinned" else {},
                           backend="nccl", timeout_s=600))


def test_gpu_nan_inf_and_signed_zeros_through_every_protocol():
    failures = run_ranks(NGPU, _special_values, "cuda", backend="nccl", timeout_s=300)
    no_failures([fs for fs, _ in failures])


def test_gpu_stress_50000_calls_without_host_sync():
    no_failures(run_ranks(NGPU, _stress, 50_000, 11, backend="nccl", timeout_s=900))


def test_gpu_graph_capture_replayed_1000_times_with_new_data():
    no_failures(run_ranks(NGPU, _graph_replays, 1000, backend="nccl", timeout_s=600))


def test_gpu_backend_fallback():
    no_failures(run_ranks(NGPU, _fallback, backend="nccl", timeout_s=300))


@pytest.mark.parametrize("op, numel, algo", [("all_reduce", 1000, "auto"), ("all_reduce", 1 << 20, "oneshot"),
                                            ("all_reduce", 1 << 20, "twoshot"), ("fused", 1 << 14, "auto")])
def test_gpu_missing_peer_ends_in_timeout_error(op, numel, algo):
    no_failures(run_ranks(NGPU, missing_peer, op, numel, algo, backend="nccl", timeout_s=300))


def test_gpu_ranks_that_disagree_on_a_call_all_raise_and_return_no_numbers():
    no_failures(run_ranks(NGPU, mismatched_calls, list(MISMATCHES), backend="nccl", timeout_s=300))


def test_gpu_calls_from_several_streams():
    no_failures(run_ranks(NGPU, _streams, 200, backend="nccl", timeout_s=600))
