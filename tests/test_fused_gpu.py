"""Fused all-reduce + residual add + RMSNorm on GPUs: one process per GPU, NCCL group.

Run on a machine with >= 2 GPUs:  python -m pytest -m multigpu tests/test_fused_gpu.py

Every call is compared bitwise, on the device, with the split composition
(``comm.all_reduce`` then ``tpfuse.add_rms_norm``); mismatches are counted on the device and
read once at the end.
"""

import random

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import capture_graph, no_failures, run_ranks, table_knobs
from tests.tally import MismatchTally, ll_regions_not_zeroed
from tests.test_quant import _poisoned_empty
from tpfuse.comm.plan import FusedPlan

pytestmark = pytest.mark.multigpu

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
if NGPU < 2:
    pytest.skip("needs at least 2 CUDA GPUs", allow_module_level=True)

WORLDS = sorted({2, NGPU})
HIDDEN = [256, 1000, 2880, 4096, 5120, 7168, 8192, 16384, 20000]
TOKENS = [1, 2, 3, 16, 17, 128, 513, 2048]
ALGOS = ["oneshot", "twoshot", "auto", "split"]
PROTOCOL_KNOBS = {"lamport_max_bytes": 4 << 20, "fused_ll_max_bytes": 16 << 10, "fused_lamport_max_bytes": 4 << 20,
                  "fused_wide_ll_max_bytes": 32 << 10, "fused_wide_lamport_max_bytes": 4 << 20}
"""The fused one-shot row-wise as the world size's default says (fused_rows_max_bytes: to
64 KiB at W=2, where the tile allows; never at W=4, so its LL path runs there), over LL words
to 16 KiB (rows on the wide tile: to 32 KiB; W=2's table sends none over LL words), Lamport
words to 4 MiB, flags above, whatever the world size's table says (it may not use Lamport words
at all)."""


class _Layer(MismatchTally):
    """Random inputs of one layer call on every rank (shared seeds), its fused call, and the
    count of bytes that differ from the split composition (on the device)."""

    UNIT = "bytes"

    def __init__(self, comm):
        super().__init__()
        self.comm, self.rank, self.world = comm, dist.get_rank(), dist.get_world_size()

    def inputs(self, tokens, hidden, dtype, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs = [torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype) for _ in range(self.world)]
        residual = (torch.randn(tokens, hidden, device="cuda", generator=g) * 4).to(dtype)
        weight = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dtype)
        return xs[self.rank], residual, weight

    def split(self, x, residual, weight, offset):
        import tpfuse

        return tpfuse.add_rms_norm(self.comm.all_reduce(x), residual, weight, weight_offset=offset)

    def expect(self, got, want, what):
        self.record(sum((a.view(torch.uint8) != b.view(torch.uint8)).sum() for a, b in zip(got, want)), what)

    def check(self, tokens, hidden, dtype, algo, seed):
        """One fused call against split; by the seed, with weight_offset 0 or 1, a weight in x's
        dtype or fp32, and (a third of the calls) all_reduce_rms_norm too."""
        import tpfuse

        x, residual, weight = self.inputs(tokens, hidden, dtype, seed)
        pick = random.Random(seed)
        offset = float(pick.random() < 0.5)
        if pick.random() < 0.3:
            weight = weight.float()
        what = f"{tokens}x{hidden} {dtype} {algo} offset={offset} weight {weight.dtype}"
        want = self.split(x, residual, weight, offset)
        with _poisoned_empty():  # an output element the kernel does not write shows as NaN
            got = self.comm.all_reduce_add_rms_norm(x, residual, weight, weight_offset=offset, algo=algo)
        self.expect(got, want, what)
        if pick.random() < 0.3:
            reduced = self.comm.all_reduce(x)
            with _poisoned_empty():
                got = self.comm.all_reduce_rms_norm(x, weight, weight_offset=offset, algo=algo)
            self.expect(got, (tpfuse.rms_norm(reduced, weight, weight_offset=offset), reduced), what + " no residual")


def _grid():
    from tpfuse.comm import Communicator

    with Communicator(max_bytes=64 << 20, timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer = _Layer(comm)
        seed = 0
        for hidden in HIDDEN:
            for tokens in TOKENS:
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    if tokens * hidden * dtype.itemsize > 32 << 20:  # keep every algo inside the workspace
                        continue
                    for algo in ALGOS if hidden % 16 == 0 else ["auto", "split"]:  # others: split only
                        seed += 1
                        layer.check(tokens, hidden, dtype, algo, seed)
        world = dist.get_world_size()
        protocol = FusedPlan.from_shape(1, 4096, torch.bfloat16, comm.layout, comm.knobs).protocol
        row_wise = comm.knobs.fused_rows_max_bytes > 0  # the default, not set by the tables
        return layer.failures() + ([f"1 x 4096 ran {protocol} at W={world}"] if row_wise != (protocol == "rows") else [])


def _stress(calls, seed):
    """Shapes, dtypes and algorithms change every call, plain all-reduces in between, no sync."""
    from tpfuse.comm import Communicator

    rng = random.Random(seed)
    with Communicator(timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer = _Layer(comm)
        for call in range(calls):
            layer.check(rng.choice([1, 2, 7, 16, 64, 300]), rng.choice([512, 2880, 4096, 8192]),
                        rng.choice([torch.bfloat16, torch.float16]), rng.choice(ALGOS), seed * 1_000_000 + call)
        return layer.failures() + ll_regions_not_zeroed(comm)


def _graph_replays(replays):
    """A captured layer sequence of several shapes and algorithms, replayed with new data."""
    from tpfuse.comm import Communicator

    plan = [(1, 4096, "oneshot"), (16, 4096, "auto"), (300, 2880, "twoshot"), (2, 8192, "auto"), (64, 4096, "split"),
            (64, 4096, "oneshot")]  # 512 KiB: Lamport words (PROTOCOL_KNOBS)
    with Communicator(timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer = _Layer(comm)
        static = [layer.inputs(t, h, torch.bfloat16, 0) for t, h, _ in plan]

        def run():
            return [comm.all_reduce_add_rms_norm(x, r, w, algo=a) for (x, r, w), (_, _, a) in zip(static, plan)]

        graph, outs = capture_graph(run)
        for i in range(replays):
            for k, ((x, r, w), (t, h, _)) in enumerate(zip(static, plan)):
                nx, nr, nw = layer.inputs(t, h, torch.bfloat16, 1 + i * 10 + k)
                x.copy_(nx), r.copy_(nr), w.copy_(nw)
            graph.replay()
            for (x, r, w), out, (t, h, a) in zip(static, outs, plan):
                layer.expect(out, layer.split(x, r, w, 0.0), f"replay {i} {t}x{h} {a}")
        del graph
        return layer.failures()


def _sixty_layers(tokens, hidden, algo):
    """60 decode layers, residual carried in place, fused vs split: identical final bits."""
    import tpfuse
    from tpfuse.comm import Communicator

    with Communicator(timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer = _Layer(comm)
        _, residual, weight = layer.inputs(tokens, hidden, torch.bfloat16, 12345)
        res_fused, res_split = residual.clone(), residual.clone()
        for i in range(60):
            x, _, _ = layer.inputs(tokens, hidden, torch.bfloat16, 100 + i)
            y_fused, _ = comm.all_reduce_add_rms_norm(x, res_fused, weight, algo=algo, inplace=True)
            y_split, _ = tpfuse.add_rms_norm(comm.all_reduce(x), res_split, weight, inplace=True)
        layer.expect((y_fused, res_fused), (y_split, res_split), f"60 layers {tokens}x{hidden} {algo}")
        return layer.failures()


def _partials_grid():
    """fp32 partial sums (an invariant row-parallel layer's) into a bf16/fp16 residual, every
    algorithm and protocol, against the split composition ``add_rms_norm(all_reduce(x) rounded
    to the residual's dtype, residual, w)``; then 60 decode layers of them, residual in place."""
    import tpfuse
    from tpfuse.comm import Communicator

    with Communicator(max_bytes=64 << 20, timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer, seed = _Layer(comm), 0
        for hidden in [256, 2880, 4096, 5120, 8192, 14336, 20000]:
            for tokens in [1, 3, 16, 128, 513]:
                for dtype in (torch.bfloat16, torch.float16):
                    for algo in ALGOS:
                        seed += 1
                        x = layer.inputs(tokens, hidden, torch.float32, seed)[0]
                        _, residual, weight = layer.inputs(tokens, hidden, dtype, seed + 10_000)
                        if seed % 3 == 0:
                            weight = weight.float()
                        want = tpfuse.add_rms_norm(comm.all_reduce(x).to(dtype), residual, weight)
                        with _poisoned_empty():
                            got = comm.all_reduce_add_rms_norm(x, residual, weight, algo=algo)
                        layer.expect(got, want, f"{tokens}x{hidden} fp32 into {dtype} {algo} weight {weight.dtype}")
        _, residual, weight = layer.inputs(1, 4096, torch.bfloat16, 7)
        res_fused, res_split = residual.clone(), residual.clone()
        for i in range(60):
            x = layer.inputs(1, 4096, torch.float32, 200 + i)[0]
            y_fused, _ = comm.all_reduce_add_rms_norm(x, res_fused, weight, inplace=True)
            y_split, _ = tpfuse.add_rms_norm(comm.all_reduce(x).to(torch.bfloat16), res_split, weight, inplace=True)
        layer.expect((y_fused, res_fused), (y_split, res_split), "60 layers of fp32 partials")
        return layer.failures() + ll_regions_not_zeroed(comm)


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements' bytes, on t's device (group scales are a strided view)."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _fp8_grid():
    """all_reduce_add_rms_norm_fp8 against the split composition (add_rms_norm after the
    all-reduce, then tpfuse.quant_fp8), every algorithm, the modes in turn."""
    import tpfuse
    from tpfuse.comm import Communicator

    with Communicator(max_bytes=64 << 20, timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer, seed = _Layer(comm), 0
        for hidden in [256, 2880, 4096, 5120, 8192, 20000]:
            group = max(g for g in (16, 32, 64, 128) if hidden % g == 0)
            for tokens in [1, 3, 16, 128, 513]:
                for dtype in (torch.bfloat16, torch.float16):
                    for algo in ALGOS:
                        seed += 1
                        mode = ("tensor", "token", "group")[seed % 3]
                        x, residual, weight = layer.inputs(tokens, hidden, dtype, seed)
                        scale = torch.tensor([0.004], device="cuda") if mode == "tensor" else None
                        y, res_out = layer.split(x, residual, weight, 0.0)
                        want = (*tpfuse.quant_fp8(y, mode, scale=scale, group=group), res_out)
                        with _poisoned_empty():
                            got = comm.all_reduce_add_rms_norm_fp8(x, residual, weight, mode=mode, scale=scale,
                                                                   group=group, algo=algo)
                        layer.expect(tuple(map(device_bytes, got)), tuple(map(device_bytes, want)),
                                     f"{tokens}x{hidden} {dtype} {algo} fp8 {mode}")
        return layer.failures()


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_fused_bitwise_equal_to_split_over_the_shape_grid(world):
    no_failures(run_ranks(world, _grid, backend="nccl", timeout_s=600))


def test_gpu_fused_stress_changing_shapes_without_host_sync():
    no_failures(run_ranks(NGPU, _stress, 5000, 3, backend="nccl", timeout_s=600))


def test_gpu_fused_graph_capture_replayed_with_new_data():
    no_failures(run_ranks(NGPU, _graph_replays, 200, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("tokens, algo", [(1, "auto"), (16, "oneshot"), (16, "twoshot"), (128, "auto"),
                                         (128, "oneshot")])
def test_gpu_sixty_layer_decode_fused_equals_split(tokens, algo):
    no_failures(run_ranks(NGPU, _sixty_layers, tokens, 4096, algo, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_fused_over_fp32_partials_bitwise_equal_to_split(world):
    no_failures(run_ranks(world, _partials_grid, backend="nccl", timeout_s=600))


def test_gpu_fused_fp8_bitwise_equal_to_split_over_the_shape_grid():
    no_failures(run_ranks(NGPU, _fp8_grid, backend="nccl", timeout_s=600))
