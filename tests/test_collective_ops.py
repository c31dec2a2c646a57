"""The collectives as custom ops (``tpfuse.comm.collective_ops``) on CPU ranks: the registry by group
name, the schemas and fakes (``torch.library.opcheck``), and ``torch.compile(fullgraph=True)``
over dynamic batch sizes giving the bits of eager (aot_eager backend: the CPU can run no
inductor-compiled Triton; the GPU suite compiles with inductor and replays CUDA graphs).
Rank functions return lists of failures."""

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_ranks
from tests.test_allreduce import _inputs, _same_bits
from tpfuse.comm import Communicator
from tpfuse.comm import collective_ops

HIDDEN = 64


def _registry():
    failures = []
    world_name = dist.group.WORLD.group_name
    with Communicator(max_bytes=1 << 16) as a, Communicator(max_bytes=1 << 16) as b:
        if (a.group_name, b.group_name) != (world_name, f"{world_name}#1"):
            failures.append(f"names {a.group_name!r}, {b.group_name!r} for group {world_name!r}")
        if collective_ops.lookup(b.group_name) is not b:
            failures.append("lookup does not find the second communicator")
    for name in (a.group_name, b.group_name):
        try:
            torch.ops.tpfuse.all_reduce(torch.ones(4), name, "auto")
            failures.append(f"an op on closed communicator {name!r} did not raise")
        except KeyError as e:
            if name not in str(e):
                failures.append(f"the error does not name {name!r}: {e}")
    with Communicator(max_bytes=1 << 16) as c:  # a closed name is free again
        if c.group_name != world_name:
            failures.append(f"after close, a new communicator is named {c.group_name!r}")
    failures += _dropped_without_close()
    return failures


def _peer_mappings() -> int:
    """This process's mappings of tpfuse's /dev/shm peer files."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/tpfuse-" in line for line in f)


def _dropped_without_close():
    """Communicators dropped without close(), five times: each is freed with its mappings and
    its registry entry (the registry holds them weakly; a finalizer unmaps)."""
    import gc

    failures, before = [], _peer_mappings()
    for _ in range(5):
        comm = Communicator(max_bytes=1 << 16)
        comm.all_reduce(torch.ones(8))
        name = comm.group_name
        del comm
        gc.collect()
        if name in collective_ops._COMMUNICATORS:
            failures.append(f"a dropped communicator is still registered as {name!r}")
    if dist.get_world_size() > 1 and _peer_mappings() != before:
        failures.append(f"{_peer_mappings() - before} peer-memory mappings outlive their dropped communicators")
    dist.barrier()  # no rank starts the next test's communicator while a peer still maps these
    return failures


def _opcheck(seed):
    """torch.library.opcheck of every collective op: schema, fake, aot dispatch (static and
    dynamic). It calls each op the same number of times on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with Communicator(max_bytes=1 << 16) as comm:
        x = _inputs(seed, 3 * HIDDEN, torch.bfloat16, world)[rank].view(3, HIDDEN)
        residual = torch.randn(3, HIDDEN).to(torch.bfloat16)
        w = torch.rand(HIDDEN).to(torch.bfloat16)
        name = comm.group_name
        cases = [
            (torch.ops.tpfuse.all_reduce, (x, name, "auto")),
            (torch.ops.tpfuse.quantized_all_reduce, (x, name, "int8", 0)),
            (torch.ops.tpfuse.all_reduce_add_rms_norm, (x, residual, w, 1e-6, 0.0, name, "oneshot")),
            (torch.ops.tpfuse.all_reduce_add_rms_norm_, (x, residual.clone(), w, 1e-6, 1.0, name, "twoshot")),
            (torch.ops.tpfuse.all_reduce_rms_norm, (x, None, 1e-6, 0.0, name, "auto")),
            (torch.ops.tpfuse.all_reduce_add_rms_norm_fp8, (x, residual, w, 1e-6, 0.0, name, "auto", "group", None, 16)),
            (torch.ops.tpfuse.all_reduce_add_rms_norm_fp8_,
             (x, residual.clone(), w, 1e-6, 0.0, name, "oneshot", "tensor", torch.tensor([0.01]), 128)),
            (torch.ops.tpfuse.reduce_scatter_add_rms_norm, (x.repeat(world, 1), residual, w, 1e-6, 0.0, name)),
            (torch.ops.tpfuse.all_gather, (residual, name)),
            (torch.ops.tpfuse.reduce_scatter, (x.repeat(world, 1), name)),
        ]
        for op, args in cases:
            torch.library.opcheck(op, args)  # raises with the failing check's name
    return []


def _layer(comm, x, residual, w, quant):
    """A layer boundary as a model calls it: every collective op, and some torch around them."""
    r = comm.all_reduce(x * 2)  # an exact scaling: the reduced bits stay comparable
    q = comm.all_reduce(x, quant=quant, quant_min_bytes=0)
    y, residual = comm.all_reduce_add_rms_norm(r, residual, w, 1e-6, inplace=True)
    y2, reduced = comm.all_reduce_rms_norm(y, w, 1e-5, weight_offset=1.0)
    y3, res3 = comm.all_reduce_add_rms_norm(x, reduced, None, 1e-6, algo="split")
    q8, scales, res8 = comm.all_reduce_add_rms_norm_fp8(x, res3, w, mode="group", group=16)
    y_sp, res_sp = comm.reduce_scatter_add_rms_norm(x.repeat(comm.world_size, 1), res8, w)  # every T divides
    return y + y2, residual, q, y3, res3, q8, scales, res8, y_sp, res_sp, comm.all_gather(y_sp)


def _compiled_matches_eager(seed, tokens_list, quant):
    world, rank, failures = dist.get_world_size(), dist.get_rank(), []
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with Communicator(max_bytes=1 << 18) as comm:
        w = (torch.rand(HIDDEN) + 0.5).to(torch.bfloat16)
        compiled = torch.compile(lambda x, residual: _layer(comm, x, residual, w, quant), backend=counter,
                                 fullgraph=True, dynamic=True)
        for i, tokens in enumerate(tokens_list):
            x = _inputs(seed + i, tokens * HIDDEN, torch.bfloat16, world)[rank].view(tokens, HIDDEN)
            residual = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + i)).to(torch.bfloat16)
            res_eager, res_compiled = residual.clone(), residual.clone()
            eager = _layer(comm, x, res_eager, w, quant)
            got = compiled(x, res_compiled)
            if i == 0:
                frames = counter.frame_count
            for k, (a, b) in enumerate(zip(got, eager)):
                if not _same_bits(a, b):
                    failures.append(f"{tokens} tokens: compiled output {k} differs from eager")
            if not _same_bits(res_compiled, res_eager):
                failures.append(f"{tokens} tokens: the in-place residual differs from eager")
            if not _same_bits(res_eager, eager[1]):
                failures.append(f"{tokens} tokens: inplace=True did not write residual_out into residual")
    if counter.frame_count != frames:
        failures.append(f"recompiled for batch sizes {tokens_list[1:]} ({frames} -> {counter.frame_count} frames)")
    return failures


def _assert_ok(results):
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.smoke
@pytest.mark.parametrize("world", [1, 2])
def test_ops_are_registered_by_group_name_and_unregistered_by_close(world):
    _assert_ok(run_ranks(world, _registry))


@pytest.mark.parametrize("world", [1, 2])
def test_collective_ops_pass_opcheck(world):
    _assert_ok(run_ranks(world, _opcheck, 11))


@pytest.mark.parametrize("world", [1, 2])
def test_compile_fullgraph_dynamic_batch_gives_eager_bits(world):
    _assert_ok(run_ranks(world, _compiled_matches_eager, 23, [2, 5, 9], "int8", timeout_s=300))


def _autograd_and_closed():
    failures = []
    comm = Communicator(max_bytes=1 << 16)
    x = torch.randn(2, HIDDEN, requires_grad=True)
    for call in (lambda: comm.all_reduce_rms_norm(x, None), lambda: comm.all_reduce_add_rms_norm(x, x, None)):
        try:
            call()
            failures.append("a fused call on a tensor that requires grad did not raise")
        except ValueError as e:
            if "not differentiable" not in str(e):
                failures.append(f"unexpected error: {e}")
    with torch.no_grad():
        y, reduced = comm.all_reduce_rms_norm(x, None)
    comm.close()
    for call in (lambda: comm.all_reduce(y), lambda: comm.all_reduce_rms_norm(y, None)):
        try:
            call()
            failures.append("a call on a closed communicator did not raise")
        except RuntimeError as e:
            if "closed" not in str(e):
                failures.append(f"unexpected error: {e}")
    return failures


def test_fused_methods_refuse_autograd_inputs_and_closed_communicators():
    _assert_ok(run_ranks(2, _autograd_and_closed))
