"""The Communicator's life cycle on CPU ranks: construction bounded by ``timeout_s`` (a rank
that never comes, one that comes late, one that dies half-way), and nothing left behind."""

import glob
import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_ranks
from tpfuse.comm import CommError, Communicator
from tpfuse.comm.peer_memory import SHM_DIR


def _late_rank(timeout_s, late_by_s):
    """The last rank creates its communicator ``late_by_s`` after the others, who give up
    after ``timeout_s``: every rank raises CommError naming the rank that was missing (or,
    on the late rank too), within 1.2x timeout_s; afterwards a communicator of the group works
    on every rank."""
    rank, world, failures = dist.get_rank(), dist.get_world_size(), []
    dist.barrier()
    if rank == world - 1:
        time.sleep(late_by_s)
    start = time.monotonic()
    try:
        Communicator(max_bytes=1 << 16, timeout_s=timeout_s)
        failures.append("the constructor returned")
    except CommError as e:
        seconds = time.monotonic() - start
        want = f"rank 0 waited {timeout_s:g} s for rank(s) [{world - 1}]"
        if want not in str(e):
            failures.append(f"the error does not say {want!r}: {e}")
        if rank != world - 1 and seconds > 1.2 * timeout_s:
            failures.append(f"the constructor raised after {seconds:.1f} s (timeout_s {timeout_s})")
    dist.barrier()
    with Communicator(max_bytes=1 << 16, timeout_s=10) as comm:  # the group is usable again
        out = comm.all_reduce(torch.full((8,), float(rank)))
        if not torch.equal(out, torch.full((8,), float(sum(range(world))))):
            failures.append(f"the next communicator's all_reduce gave {out.tolist()}")
    return failures


@pytest.mark.smoke
def test_a_missing_rank_ends_construction_on_every_rank_within_the_timeout():
    results = run_ranks(2, _late_rank, 2.0, 3.0, timeout_s=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


TOKEN = "5e1fdeadc0de0001"
"""The /dev/shm token of the dying construction (its files are tpfuse-TOKEN-*), so the test
looks at its own files only (another xdist worker's communicators make files of their own)."""


def _dies_while_constructing(rank, port, errors):
    import secrets

    import tpfuse.comm.peer_memory as pm

    secrets.token_hex = lambda nbytes: TOKEN
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 1:  # dies once its /dev/shm file exists, before it is mapped or unlinked
        def truncate_then_die(fd, size):
            os._exit(3)
        pm.os.ftruncate = truncate_then_die
    try:
        Communicator(max_bytes=1 << 16, timeout_s=10)
        errors.put("rank 0: the constructor returned")
    except CommError as e:
        if "failed in a collective step" not in str(e):
            errors.put(f"rank 0: unexpected error: {e}")
    except Exception as e:  # noqa: BLE001  what the test must not see: a raw backend error
        errors.put(f"rank 0: {type(e).__name__} instead of CommError: {e}")
    errors.put("done")
    errors.close()
    errors.join_thread()  # what was put is in the pipe before the exit below
    os._exit(0)  # the group lost a rank: no teardown through it


def test_a_rank_that_dies_during_construction_fails_the_others_cleanly(monkeypatch):
    """Rank 1 exits after creating its shared-memory file; rank 0 gets a CommError (not the
    backend's raw error), and neither rank's file is left in /dev/shm."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the children run tpfuse on CPU, on GPU machines too
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors = ctx.Queue()
    procs = [ctx.Process(target=_dies_while_constructing, args=(r, store.port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 3]
    assert errors.get(timeout=5) == "done"
    assert glob.glob(os.path.join(SHM_DIR, f"tpfuse-{TOKEN}-*")) == []
