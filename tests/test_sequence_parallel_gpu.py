"""The sequence-parallel boundary on GPUs: one process per GPU, NCCL group.

Run on a machine with >= 2 GPUs:  python -m pytest -m multigpu tests/test_sequence_parallel_gpu.py

Rank r's ``reduce_scatter_add_rms_norm`` against rows r * T / W .. of the fused all-reduce
path and of the split composition, and ``all_gather`` against the whole; eager and
graph-replayed. Mismatches are counted on the device and read once at the end.
"""

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import capture_graph, no_failures, run_ranks, table_knobs
from tests.test_fused_gpu import NGPU, PROTOCOL_KNOBS, _Layer, device_bytes
from tests.test_quant import _poisoned_empty

pytestmark = pytest.mark.multigpu

HIDDEN = [256, 2880, 4096, 5120, 8192, 20000]
ROWS_PER_RANK = [1, 2, 16, 64, 513]


def _mine(tokens):
    rank, world = dist.get_rank(), dist.get_world_size()
    return slice(rank * tokens // world, (rank + 1) * tokens // world)


def _grid():
    from tpfuse.comm import Communicator

    with Communicator(max_bytes=64 << 20, timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer, seed, world = _Layer(comm), 0, dist.get_world_size()
        for hidden in HIDDEN:
            for rows in ROWS_PER_RANK:
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    seed += 1
                    tokens = rows * world
                    if tokens * hidden * dtype.itemsize > comm.max_bytes:
                        continue  # beyond the workspace: refused (tests/test_sequence_parallel.py)
                    x, residual, weight = layer.inputs(tokens, hidden, dtype, seed)
                    mine = _mine(tokens)
                    with _poisoned_empty():
                        y, res_out = comm.reduce_scatter_add_rms_norm(x, residual[mine].clone(), weight)
                        gathered = comm.all_gather(y)
                    what = f"{tokens}x{hidden} {dtype}"
                    split = layer.split(x, residual, weight, 0.0)
                    layer.expect((y, res_out), (split[0][mine], split[1][mine]), what + " against split")
                    fused = comm.all_reduce_add_rms_norm(x, residual, weight)
                    layer.expect((y, res_out), (fused[0][mine], fused[1][mine]), what + " against fused")
                    layer.expect((gathered,), (split[0],), what + " all_gather")
        return layer.failures()


def _graph_replays(replays):
    """Captured: a reduce-scatter + norm, its all-gather and an fp8 fused call, replayed with
    new data against eager split compositions."""
    import tpfuse
    from tpfuse.comm import Communicator

    with Communicator(timeout_s=60, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        layer, world = _Layer(comm), dist.get_world_size()
        tokens = 64 * world
        mine = _mine(tokens)
        x, residual, weight = layer.inputs(tokens, 4096, torch.bfloat16, 0)
        res_slice = residual[mine].clone()

        def run():
            y, res_out = comm.reduce_scatter_add_rms_norm(x, res_slice, weight)
            return y, res_out, comm.all_gather(y), *comm.all_reduce_add_rms_norm_fp8(x, residual, weight, group=128)

        graph, outs = capture_graph(run)
        for i in range(replays):
            nx, nr, nw = layer.inputs(tokens, 4096, torch.bfloat16, 1 + i)
            x.copy_(nx), residual.copy_(nr), weight.copy_(nw), res_slice.copy_(nr[mine])
            graph.replay()
            y, res_out = layer.split(x, residual, weight, 0.0)
            want = (y[mine], res_out[mine], y, *tpfuse.quant_fp8(y, "token", group=128), res_out)
            layer.expect(tuple(map(device_bytes, outs)), tuple(map(device_bytes, want)), f"replay {i}")
        del graph
        return layer.failures()


def test_gpu_reduce_scatter_norm_and_all_gather_equal_the_all_reduce_rows():
    no_failures(run_ranks(NGPU, _grid, backend="nccl", timeout_s=600))


def test_gpu_sequence_parallel_and_fp8_graph_capture_replayed_with_new_data():
    no_failures(run_ranks(NGPU, _graph_replays, 50, backend="nccl", timeout_s=600))


def test_gpu_sequence_parallel_backward_matches_add_rms_norm_over_all_rows():
    from tests.test_sequence_parallel import _backward

    for dtype in (torch.bfloat16, torch.float32):
        no_failures(run_ranks(NGPU, _backward, 3, dtype, backend="nccl", timeout_s=600))
