"""Run a test function on W ranks: one process per rank, a process group over 127.0.0.1; and
what the rank functions of the suites share (``table_knobs``, ``missing_peer``,
``capture_graph``, ``no_failures``).

``run_ranks(world_size, fn, *args)`` calls ``fn(*args)`` in every rank's process and returns
the W results (index = rank). A rank that raises makes it raise AssertionError with that
rank's traceback; ranks that do not answer within ``timeout_s`` are killed and it raises
AssertionError. Rank processes are started once per (world size, backend) and reused by
later calls, so each test pays only for its own work; ``fn`` must be a module-level function
(it is sent by reference). Test functions usually return a list of failure messages.

CPU ranks (backend "gloo") run tpfuse under Triton's interpreter (TRITON_INTERPRET=1 is set
before they import anything), so these tests also run on GPU machines. GPU ranks (backend
"nccl") each use GPU ``rank``.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import time
import traceback

_ENV = {
    "gloo": {"TRITON_INTERPRET": "1"},
    "nccl": {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"},
}


def _serve(rank: int, world_size: int, port: int, backend: str, inbox, outbox) -> None:
    os.environ.update(_ENV[backend], LOCAL_RANK=str(rank))  # init_rank's GPU, whatever the parent had set
    import torch.distributed as dist

    from tpfuse.bench.common import init_rank

    init_rank(rank, world_size, port, backend)  # joins the parent's store (RankPool), as the benches' ranks do
    outbox.put((rank, "ready", None))
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            outbox.put((rank, "ok", fn(*args)))
        except BaseException:  # the parent reports whatever the rank hit
            outbox.put((rank, "raised", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` rank processes waiting for functions to run."""

    def __init__(self, world_size: int, backend: str = "gloo", start_timeout_s: float = 120.0):
        import torch.distributed as dist  # here: the ranks import this module before setting _ENV

        ctx = mp.get_context("spawn")
        # The group's store, on a port the system picks as it binds, held by this process while
        # the ranks live: a port found free, released and bound again by rank 0 could be taken
        # meanwhile (another test run's group, say), failing rank 0 or sending rank 1 elsewhere.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self._store.port
        self.world_size = world_size
        self.broken = False
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_serve, args=(r, world_size, port, backend, self._inboxes[r], self._outbox),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._collect("start the ranks", start_timeout_s)

    def run(self, fn, *args, timeout_s: float = 120.0) -> list:
        for inbox in self._inboxes:
            inbox.put((fn, args))
        return self._collect(f"{fn.__name__}{args!r}", timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list:
        results, errors = [None] * self.world_size, []
        deadline = time.monotonic() + timeout_s
        for _ in range(self.world_size):
            while True:
                try:
                    rank, kind, value = self._outbox.get(timeout=0.5)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.close()
                        why = f"rank processes {dead} died" if dead else f"not finished within {timeout_s} s (hang?)"
                        raise AssertionError(f"{what}: {why}") from None
            if kind == "raised":
                errors.append(f"rank {rank} raised:\n{value}")
            results[rank] = value
        if errors:
            self.close()  # a rank that raised may have left its peers mid-protocol
            raise AssertionError("\n".join(errors))
        return results

    def close(self) -> None:
        if self.broken:
            return
        self.broken = True
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_pools: dict[tuple[int, str], RankPool] = {}


def run_ranks(world_size: int, fn, *args, backend: str = "gloo", timeout_s: float = 120.0,
              fresh: bool = False) -> list:
    """``fn(*args)`` on every rank of a ``world_size`` group; the list of their results.

    ``fresh=True`` runs it in new processes that end afterwards (for functions that change
    their process for good, such as lowering its priority)."""
    if fresh:
        pool = RankPool(world_size, backend)
        try:
            return pool.run(fn, *args, timeout_s=timeout_s)
        finally:
            pool.close()
    pool = _pools.get((world_size, backend))
    if pool is None or pool.broken:
        pool = _pools[(world_size, backend)] = RankPool(world_size, backend)
    return pool.run(fn, *args, timeout_s=timeout_s)


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()


def table_knobs(**changes):
    """In a rank: the knobs a Communicator over the world group takes by default (its GPU
    model's table, or the defaults), with ``changes`` (``Knobs`` fields)."""
    import torch
    import torch.distributed as dist

    from tpfuse.comm import knobs_for

    device = torch.cuda.get_device_name() if dist.get_backend() == "nccl" else None
    return knobs_for(dist.get_world_size(), device).replace(**changes)


def no_failures(results: list) -> None:
    """Assert that no rank reported a failure: ``results`` is ``run_ranks``' list of each rank's
    failure messages."""
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def _one_call(comm, op: str, numel: int, algo: str):
    """The call ``missing_peer`` makes: an all-reduce, a fused one of two rows, or an int4 one."""
    import torch

    x = torch.ones(numel, device=comm.device)
    if op == "fused":
        x = x.view(2, numel // 2)
        return comm.all_reduce_add_rms_norm(x, torch.ones_like(x), torch.ones(numel // 2, device=comm.device),
                                            algo=algo)
    if op == "quantized":
        return comm.all_reduce(x, quant="int4", quant_min_bytes=0)
    return comm.all_reduce(x, algo=algo)


def missing_peer(op: str = "all_reduce", numel: int = 1000, algo: str = "auto") -> list[str]:
    """In a rank: the last rank never calls ``op`` (``_one_call``); every other rank must get
    ``CommTimeoutError`` naming itself, the last rank and the operation (under the interpreter
    from the call, on GPUs from ``check()``) within 10 s of a 2 s timeout, and every later call
    must raise it too."""
    import time

    import torch.distributed as dist

    from tpfuse.comm import CommTimeoutError, Communicator

    rank, world, failures = dist.get_rank(), dist.get_world_size(), []
    comm = Communicator(timeout_s=2.0)
    dist.barrier()  # the live ranks enter the call together: the only late one is the last
    if rank != world - 1:
        start = time.monotonic()
        try:
            _one_call(comm, op, numel, algo)
            comm.check()
            failures.append(f"{op} returned without the last rank")
        except CommTimeoutError as e:
            word = "quantized" if op == "quantized" else "all_reduce"
            if (e.rank, e.peer) != (rank, world - 1) or f"rank {world - 1}" not in str(e) or word not in e.op:
                failures.append(f"unexpected error contents: rank={e.rank} peer={e.peer} op={e.op!r}: {e}")
        if time.monotonic() - start > 10:
            failures.append(f"the timeout of 2 s took {time.monotonic() - start:.1f} s")
        try:
            _one_call(comm, "all_reduce", 100, "auto")
            failures.append("a failed communicator accepted another call")
        except CommTimeoutError:
            pass
    comm.close()
    dist.barrier()
    return failures


def capture_graph(run):
    """``run()`` warmed up on a side stream (Triton compiles outside the capture), then
    captured in a CUDA graph: (the graph, what the captured ``run()`` returned). The capture is
    thread-local: NCCL's watchdog thread keeps running meanwhile."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        outs = run()
    return graph, outs
