"""Communicator.all_reduce on CPU ranks (gloo, Triton's interpreter, peer memory in /dev/shm).

Every rank builds all ranks' inputs from shared seeds, so each checks its result bitwise
against ``tpfuse.reference.all_reduce`` itself, with no collective between calls; output
digests are compared across ranks in the parent. Rank functions return lists of failures.
"""

import hashlib
import logging
import os
import random
import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.conftest import DEVICE
from tests.multiproc import MISMATCHES, mismatched_calls, missing_peer, no_failures, run_ranks, table_knobs
from tests.tally import ll_regions_not_zeroed
from tpfuse import reference
from tpfuse.comm import CommTimeoutError, Communicator, Launch, default_knobs
from tpfuse.comm.plan import AllReducePlan
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout
from tpfuse.kernels.peer import tree_sum
import triton  # after tpfuse, which sets up Triton's interpreter on CPU
import triton.language as tl

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ALGOS = ["oneshot", "twoshot", "auto"]
# Element counts: 1, around 16-byte vectors, odd, around the interpreter's 64 KiB tiles and
# beyond several tiles per block (300 KB at fp32).
SIZES = [1, 2, 7, 8, 9, 17, 127, 1000, 4097, 32769, 75001]


def _inputs(seed: int, numel: int, dtype: torch.dtype, world: int) -> list[torch.Tensor]:
    """Every rank's input for one call: normals times powers of two from 2**-8 to 2**8, so
    that sums cancel and round (never zeros). Element 0 tells the order of the sum from 4
    ranks on: 2**12, 2**-13, -2**12, 2**-13, ... sum to 0 in the pairwise tree (each pair
    rounds to its large term) and to 2**-13 in rank order."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (numel,), generator=g).float())
    xs = [(torch.randn(numel, generator=g) * scale).to(dtype) for _ in range(world)]
    for r, x in enumerate(xs):
        x[0] = 2.0**-13 if r % 2 else (-1) ** (r // 2) * 2.0**12
    return xs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements' bytes in order (a copy: a view with a size-1 dimension can pass as
    contiguous with a stride that a byte view refuses)."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(_bytes(t).numpy().tobytes()).hexdigest()


def _check(comm, xs, what, failures, digests, algo="auto", x=None):
    """One call with input ``x`` (default: this rank's entry of xs), checked bitwise."""
    rank = dist.get_rank()
    src = xs[rank] if x is None else x
    before = src.clone()
    out = comm.all_reduce(src, algo=algo)
    ref = reference.all_reduce(xs)
    if not _same_bits(out, ref.view(src.shape)):
        bad = (out.float().flatten() != ref.float()).sum().item()
        failures.append(f"{what}: {bad} of {ref.numel()} elements differ from the reference")
    if not _same_bits(src, before):
        failures.append(f"{what}: the input was modified")
    digests.append(_digest(out))


# ---------------------------------------------------------------- the reference's order (no ranks)

class _Term(str):
    """A term that writes its sums out: ``_Term("0") + _Term("1") == "(0+1)"``."""

    def __add__(self, other):
        return _Term(f"({self}+{other})")


@pytest.mark.parametrize("world, tree", [
    (1, "0"), (2, "(0+1)"), (3, "((0+1)+2)"), (4, "((0+1)+(2+3))"), (6, "(((0+1)+(2+3))+(4+5))"),
    (7, "(((0+1)+(2+3))+((4+5)+6))"), (8, "(((0+1)+(2+3))+((4+5)+(6+7)))")])
def test_reference_sums_ranks_over_the_pairwise_tree(world, tree):
    assert reference.tree_sum([_Term(str(r)) for r in range(world)]) == tree


@triton.jit
def _tree_sum_kernel(X, Y, W: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    parts = ()
    for s in tl.static_range(W):
        parts = parts + (tl.load(X + s * BLOCK + offs),)
    tl.store(Y + offs, tree_sum(parts))


@pytest.mark.parametrize("world", range(1, 9))
def test_the_kernels_tree_is_the_reference_tree(world):
    """``peer.tree_sum`` (every kernel's sum across ranks goes through it) adds as
    ``reference.tree_sum`` does: values of many magnitudes, so any other order rounds otherwise."""
    g = torch.Generator().manual_seed(world)
    x = (torch.randn(world, 256, generator=g) * torch.exp2(torch.randint(-24, 25, (world, 256), generator=g)))
    y = torch.full((256,), float("nan"), device=DEVICE)
    _tree_sum_kernel[(1,)](x.to(DEVICE), y, world, 256)
    assert _same_bits(y.cpu(), reference.tree_sum(list(x.unbind(0))))


def test_tree_sum_over_chunks_does_not_depend_on_how_ranks_share_them():
    """8 fp32 partials (a row-parallel layer's K chunks): each of t ranks sums its 8/t in the
    tree and the all-reduce sums the ranks' sums in the tree, the same bits for t = 1, 2, 4, 8."""
    g = torch.Generator().manual_seed(0)
    chunks = list(torch.randn(8, 4096, generator=g) * torch.exp2(torch.randint(-20, 21, (8, 4096), generator=g)))
    whole = reference.tree_sum(chunks)
    for t in (1, 2, 4, 8):
        per_rank = [reference.tree_sum(chunks[r * 8 // t:(r + 1) * 8 // t]) for r in range(t)]
        assert _same_bits(reference.tree_sum(per_rank), whole), t
    assert not _same_bits(sum(chunks[1:], chunks[0]), whole)  # rank order would not do


# ---------------------------------------------------------------- layout and plan (no ranks)

@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("max_bytes", [ALIGN, 1000, 1 << 20, 16 << 20])
def test_workspace_regions_are_disjoint_aligned_and_inside(world, max_bytes):
    layout = WorkspaceLayout(world, max_bytes, max_blocks=128)
    regions = sorted(layout.regions(), key=lambda r: r[1])
    for name, offset, size in regions:
        assert offset % ALIGN == 0 and size > 0, name
    for (n0, o0, s0), (n1, o1, _) in zip(regions, regions[1:]):
        assert o0 + s0 <= o1, f"{n0} overlaps {n1}"
    assert regions[-1][1] + regions[-1][2] == layout.total_bytes
    assert layout.flag_region_bytes >= 128 * world * 8
    assert layout.twoshot_slot_bytes * world >= max_bytes
    assert layout.oneshot_slot_bytes * world == layout.data_bytes
    assert layout.gather_offset == world * layout.twoshot_slot_bytes
    assert not any(name.startswith(("ll", "reduced", "handoff")) for name, _, _ in regions)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("ll_max_bytes, lamport_max_bytes", [(1, 0), (4096, 0), (300_000, 0), (4096, 1 << 20)])
def test_ll_regions_are_disjoint_and_hold_ll_and_lamport_messages(world, ll_max_bytes, lamport_max_bytes):
    layout = WorkspaceLayout(world, 1 << 20, max_blocks=128, ll_max_bytes=ll_max_bytes,
                             lamport_max_bytes=lamport_max_bytes, rows_max_bytes=ll_max_bytes)
    regions = sorted(layout.regions(), key=lambda r: r[1])
    for (n0, o0, s0), (n1, o1, _) in zip(regions, regions[1:]):
        assert o0 + s0 <= o1, f"{n0} overlaps {n1}"
    assert regions[-1][1] + regions[-1][2] == layout.total_bytes
    rows = [size for name, _, size in regions if name.startswith("rows")]
    assert len(rows) == 3 * world and all(size == layout.rows_slot_bytes >= ll_max_bytes for size in rows)
    slots = {name: (offset, size) for name, offset, size in regions if name.startswith("ll")}
    assert len(slots) == 2 * world
    # an LL word carries 4 data bytes in 8, a Lamport word its own bytes
    assert all(size == layout.ll_slot_bytes >= max(2 * ll_max_bytes, lamport_max_bytes) for _, size in slots.values())
    assert layout.ll_slot_bytes < max(2 * ll_max_bytes, lamport_max_bytes) + ALIGN
    assert slots["ll[1].slot[0]"][0] == layout.ll_offset(1) == layout.ll_offset(0) + layout.ll_bytes
    assert layout.reduced_bytes >= ll_max_bytes


def test_workspace_layout_does_not_depend_on_messages_and_default_is_tens_of_mib():
    layout = WorkspaceLayout(4, 16 << 20, max_blocks=128)
    assert 16 << 20 < layout.total_bytes < 100 << 20
    assert layout.data_offset(1) - layout.data_offset(0) == layout.data_bytes


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=1, max_bytes=4096, max_blocks=8), "world_size"),
    (dict(world_size=2, max_bytes=16, max_blocks=8), "max_bytes"),
    (dict(world_size=2, max_bytes=4096, max_blocks=0), "max_blocks"),
])
def test_workspace_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkspaceLayout(**kwargs)


def test_plan_picks_by_size_and_refuses_what_does_not_fit():
    layout = WorkspaceLayout(4, 1 << 20, max_blocks=128)
    bf16, knobs = torch.bfloat16, default_knobs(4)
    assert AllReducePlan.from_numel(1000, bf16, layout, knobs).algo == "oneshot"
    big = AllReducePlan.from_numel(400_000, bf16, layout, knobs)
    assert big.algo == "twoshot" and big.chunk * 2 <= layout.twoshot_slot_bytes and big.grid >= 1
    assert AllReducePlan.from_numel(1 << 20, bf16, layout, knobs).algo == "nccl"
    assert AllReducePlan.from_numel(10, bf16, None, knobs).reason == "no peer workspace"
    with pytest.raises(ValueError, match="max_bytes"):
        AllReducePlan.from_numel(1 << 20, bf16, layout, knobs, "oneshot")
    with pytest.raises(ValueError, match="algo must be"):
        AllReducePlan.from_numel(10, bf16, layout, knobs, "ring")
    # LL up to the workspace's LL capacity and ll_max_bytes, Lamport words up to its Lamport
    # capacity and lamport_max_bytes (256 KiB under the interpreter), separate flags above.
    ll_layout = WorkspaceLayout(4, 1 << 20, max_blocks=128, ll_max_bytes=8192, lamport_max_bytes=65536)
    lamport = knobs.replace(lamport_max_bytes=256 << 10)
    protocol = {n: AllReducePlan.from_numel(n, bf16, ll_layout, lamport, "oneshot").protocol
                for n in (4096, 4097, 32768, 32769)}
    assert protocol == {4096: "ll", 4097: "lamport", 32768: "lamport", 32769: "flags"}
    assert AllReducePlan.from_numel(4096, bf16, layout, knobs, "oneshot").protocol == "flags"  # no LL regions
    assert AllReducePlan.from_numel(4096, bf16, ll_layout, knobs, "twoshot").protocol == "flags"
    # The same size gives the same grid, whatever came before (nothing but the size counts).
    assert AllReducePlan.from_numel(12345, bf16, layout, knobs) == AllReducePlan.from_numel(12345, bf16, layout, knobs)


def test_lamport_tiles_grow_with_the_message():
    """The 2x H200 sweep's best tile and warps at every size (``Knobs.oneshot_lamport``): one
    tile per CTA, within the launch shape's tile range."""
    from tpfuse.comm import plan as P
    knobs = default_knobs(2).replace(oneshot_lamport=Launch(2 << 10, 16, 128, max_tile_bytes=16 << 10))
    got = {kib: P.tile_and_warps(knobs, "oneshot_lamport", kib << 10)
           for kib in (1, 8, 256, 512, 1024, 2048, 3000, 4096, 8192, 65536)}
    assert got == {1: (2048, 4), 8: (2048, 4), 256: (2048, 4), 512: (4096, 8), 1024: (8192, 16),
                   2048: (16384, 16), 3000: (16384, 16), 4096: (16384, 16), 8192: (16384, 16), 65536: (16384, 16)}
    assert P.tile_and_warps(knobs, "oneshot_ll", 8192) == (knobs.oneshot_ll.tile_bytes, knobs.oneshot_ll.num_warps)


def test_plan_follows_the_knobs():
    from tpfuse.comm import plan as P
    layout = WorkspaceLayout(4, 16 << 20, max_blocks=128)
    bf16 = torch.bfloat16
    knobs = default_knobs(4).replace(oneshot=Launch(16384, 4, 8), oneshot_ll=Launch(1024, 2, 6),
                                     oneshot_lamport=Launch(16384, 2, 10, max_tile_bytes=16384),
                                     twoshot=Launch(32768, 16, 96), gather="pull")
    one = AllReducePlan.from_numel(1 << 20, bf16, layout, knobs, "oneshot")
    assert (one.block, one.grid, one.num_warps) == (8192, 8, 4)
    two = AllReducePlan.from_numel(8 << 20, bf16, layout, knobs, "twoshot")
    assert (two.block, two.grid, two.num_warps, two.gather) == (16384, 96, 16, "pull")  # 128 tiles, 96 CTAs
    assert AllReducePlan.from_numel(8 << 20, bf16, layout, knobs).algo == "twoshot"  # auto stays exact by default
    to_nccl = knobs.replace(nccl_min_bytes=4 << 20)  # bytes; numel below is bf16
    assert AllReducePlan.from_numel((4 << 20) // 2 - 1, bf16, layout, to_nccl).algo == "twoshot"
    assert AllReducePlan.from_numel((4 << 20) // 2, bf16, layout, to_nccl).algo == "nccl"
    assert AllReducePlan.from_numel((4 << 20) // 2, bf16, layout, to_nccl, "twoshot").algo == "twoshot"
    ll_layout = WorkspaceLayout(4, 16 << 20, max_blocks=128, ll_max_bytes=64 << 10)
    ll = AllReducePlan.from_numel(4096, bf16, ll_layout, knobs, "oneshot")
    assert ll.protocol == "ll" and (ll.block, ll.grid, ll.num_warps) == (512, 6, 2)  # 8 tiles, 6 CTAs
    knobs = knobs.replace(ll_max_bytes=1000)
    assert AllReducePlan.from_numel(4096, bf16, ll_layout, knobs, "oneshot").protocol == "flags"
    assert AllReducePlan.from_numel(500, bf16, ll_layout, knobs, "oneshot").protocol == "ll"
    knobs = knobs.replace(lamport_max_bytes=3 << 20)
    lamport_layout = P.workspace_layout(knobs, 16 << 20)  # one-shot holds 8 MiB, so Lamport the knob's 3 MiB
    # LL words to fused_ll_max_bytes (for the fused kernel), more than ll_max_bytes now
    assert (lamport_layout.ll_max_bytes, lamport_layout.lamport_max_bytes) == (knobs.fused_ll_max_bytes, 3 << 20)
    lamport = AllReducePlan.from_numel(1 << 20, bf16, lamport_layout, knobs, "oneshot")
    assert lamport.protocol == "lamport" and (lamport.block, lamport.grid, lamport.num_warps) == (8192, 10, 2)
    assert AllReducePlan.from_numel((3 << 20) // 2 + 1, bf16, lamport_layout, knobs, "oneshot").protocol == "flags"
    small = P.workspace_layout(default_knobs(2).replace(lamport_max_bytes=1 << 20), 1024)
    assert small.ll_max_bytes == small.lamport_max_bytes == 1024  # capped by the one-shot capacity
    with pytest.raises(ValueError, match="gather"):
        knobs.replace(gather="ring")
    with pytest.raises(ValueError, match="num_warps"):
        knobs.replace(twoshot=Launch(8192, 0, 4))


# ---------------------------------------------------------------- rank functions

def _sizes_dtypes_algos(sizes, knobs=None):
    """``knobs``: changes to the default knobs (``tests.multiproc.table_knobs``)."""
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(max_bytes=2 << 20, timeout_s=20, knobs=table_knobs(**(knobs or {}))) as comm:
        for i, n in enumerate(sizes):
            for d, dtype in enumerate(DTYPES):
                for algo in ALGOS:
                    xs = _inputs(1000 * i + 10 * d + ALGOS.index(algo), n, dtype, world)
                    _check(comm, xs, f"n={n} {dtype} {algo}", failures, digests, algo)
    return failures, digests


def _stress(calls, seed, knobs=None):
    """Sizes, dtypes and algorithms change every call (shrinking and growing), no barrier."""
    world, failures, digests = dist.get_world_size(), [], []
    rng = random.Random(seed)  # the same sequence on every rank
    with Communicator(max_bytes=1 << 20, timeout_s=20, knobs=table_knobs(**(knobs or {}))) as comm:
        for call in range(calls):
            n = rng.randint(40_000, 120_000) if call % 25 == 0 else rng.randint(1, 3000)
            dtype, algo = rng.choice(DTYPES), rng.choice(ALGOS)
            xs = _inputs(seed * 100_000 + call, n, dtype, world)
            _check(comm, xs, f"call {call} n={n} {dtype} {algo}", failures, digests, algo)
            if len(failures) > 5:
                break
        failures += ll_regions_not_zeroed(comm)
    return failures, digests


def _every_transition(k):
    """A walk over states 0..k-1 that takes every ordered pair (i, j), i == j included, as
    consecutive steps exactly once: an Eulerian circuit of the complete digraph with loops
    (Hierholzer), k * k + 1 steps."""
    unused, stack, walk = {v: list(range(k)) for v in range(k)}, [0], []
    while stack:
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]


def _every_plan_transition():
    """Every launch shape the plan gives (algorithm, LL, grid) followed by every other, with no
    barrier: each growing and shrinking pattern between protocols and grids, by construction
    rather than by chance."""
    from tpfuse.comm.plan import AllReducePlan

    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(max_bytes=1 << 20, timeout_s=20) as comm:
        states = {}  # (algo, protocol, grid) -> (numel, algo argument): the smallest message per state
        for algo in ALGOS:
            n = 1
            while n < 300_000:
                try:
                    p = AllReducePlan.from_numel(n, torch.float32, comm.layout, comm.knobs, algo)
                    states.setdefault((p.algo, p.protocol, p.grid), (n, algo))
                except ValueError:  # more than an explicit algorithm can serve
                    pass
                n = int(n * 1.25) + 1
        if len(states) < 8 or {p for _, p, _ in states} != {"ll", "lamport", "flags"}:
            failures.append(f"only {len(states)} launch shapes found: {sorted(states)}")
        picks = list(states.values())
        backend = states.get(("nccl", "flags", 0))
        for call, s in enumerate(_every_transition(len(picks))):
            n, algo = picks[s]
            xs = _inputs(90_000 + call, n, torch.float32, world)
            if picks[s] == backend:  # the backend's sum has no bitwise contract: close to float64
                out = comm.all_reduce(xs[dist.get_rank()], algo=algo)
                err = (out.double() - sum(x.double() for x in xs)).abs().max().item()
                if not err <= 1e-5 * max(x.abs().max().item() for x in xs):
                    failures.append(f"call {call} n={n} (backend): off the float64 sum by {err}")
            else:
                _check(comm, xs, f"call {call} n={n} {algo}", failures, digests, algo)
        failures += ll_regions_not_zeroed(comm)
    return failures, digests


def _slow_rank_mid_kernel(calls, seed, gather):
    """The last rank runs at the lowest CPU priority while four ranks share the cores, so it
    is still reading call k's data inside the kernel when its peers already write call k+1:
    this is what the parity rotation of the regions is for (removing the LL and Lamport regions'
    rotation fails here: it hangs within the first calls).

    Every rank first makes one 1-element call of each algorithm at normal priority, then the
    last rank is niced for the ``calls`` calls. A process's first call does one-time
    work (lazy imports, the interpreter reading the kernels' source: a few seconds of CPU),
    which the niced rank did at a sliver of the cores while its peers polled: its first call
    took 34-74 s on 2 cores. The calls after it race as before.

    The niced rank's calls are most of the test's time (5-18 s each on 2 cores), so it makes
    few: the sequence must take one-shot over LL and over Lamport words, two-shot on grids of
    1 and 2 blocks, both dtypes, and an LL or Lamport call right after another (the peers'
    call k+1 writes the LL regions that the slow rank still reads for call k); a failure
    says so if it does not. With the rotation removed (``begin_collective``'s ``epoch % 2`` as 0), the
    5 calls of seed 8 still hang, at the LL call after the Lamport one (checked). With the
    gather "pull" (not a table's choice) only two-shot calls differ, so that run makes
    two-shot calls only: on grids of 1 and 2 blocks, both dtypes."""
    world, failures, digests = dist.get_world_size(), [], []
    rng = random.Random(seed)
    # A niced rank on a loaded 2-core machine can be starved for over a minute (a .ci/run of
    # e0ac64a beside a compile: "rank 2 waited 60 s for rank 3"); the timeout only has to catch
    # a hang within run_ranks' limit.
    with Communicator(max_bytes=2 << 20, timeout_s=200, knobs=table_knobs(gather=gather)) as comm:
        for algo in ("oneshot", "twoshot"):
            _check(comm, _inputs(seed, 1, torch.float32, world), f"warm-up {algo}", failures, digests, algo)
        if dist.get_rank() == world - 1:
            os.nice(19)
        kinds, protocols = set(), []
        for call in range(calls):  # grids change from call to call, so tiles move between blocks
            n, dtype = rng.randint(1, 80_000), rng.choice([torch.float32, torch.bfloat16])
            xs = _inputs(seed * 100_000 + call, n, dtype, world)
            algo = rng.choice(["oneshot", "twoshot"]) if gather == "push" else "twoshot"
            plan = AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, algo)
            kinds.add((plan.algo, plan.protocol, plan.grid, dtype))
            protocols.append(plan.protocol)
            _check(comm, xs, f"call {call} n={n} {dtype}", failures, digests, algo)
    want = {("twoshot", "flags", 1), ("twoshot", "flags", 2), torch.float32, torch.bfloat16}
    if gather == "push":
        want |= {("oneshot", "ll"), ("oneshot", "lamport")}
    got = {k[:2] for k in kinds} | {k[:3] for k in kinds} | {k[3] for k in kinds}
    back_to_back = gather != "push" or any(a != "flags" and b != "flags" for a, b in zip(protocols, protocols[1:]))
    if not want <= got or not back_to_back:
        failures.append(f"the calls miss {want - got} or two LL/Lamport calls in a row: {sorted(map(str, kinds))}")
    return failures, digests


PROTOCOL_KNOBS = {"ll_max_bytes": 64 << 10, "lamport_max_bytes": 256 << 10}
"""Knobs under which one-shot takes each protocol by size (the interpreter's; on GPUs the
measured tables' may differ): LL to 64 KiB, Lamport words to 256 KiB, flags above."""


def _special_values(device="cpu"):
    """NaN, Inf and signed zeros through every protocol: one-shot over LL, Lamport words and
    flags (PROTOCOL_KNOBS), and two-shot. Lamport words cannot carry a value whose bits are all ones (a NaN) as
    it is (tpfuse.kernels.ll), so such values are planted at every tile, on one rank and on
    all. Where any rank has a NaN (or Inf - Inf) the result is NaN, whose payload bits are not
    part of the contract; every other element is bitwise the reference's: an element that
    is -0.0 on every rank sums to -0.0."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(max_bytes=2 << 20, timeout_s=20, knobs=table_knobs(**PROTOCOL_KNOBS)) as comm:
        for d, dtype in enumerate(DTYPES):
            bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
            cases = [(8 << 10, "oneshot", "ll"), (128 << 10, "oneshot", "lamport"), (400 << 10, "oneshot", "flags"),
                     (8 << 10, "twoshot", "flags")]
            for c, (nbytes, algo, protocol) in enumerate(cases):
                n = nbytes // dtype.itemsize
                plan = AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, algo)
                if plan.protocol != protocol:
                    failures.append(f"{nbytes} bytes {algo}: protocol {plan.protocol}, expected {protocol}")
                xs = _inputs(500 + 10 * d + c, n, dtype, world)
                g = torch.Generator().manual_seed(600 + 10 * d + c)
                every = torch.randint(0, n, (max(8, n // 500),), generator=g)  # all ones on every rank
                for r, x in enumerate(xs):
                    x.view(bits)[torch.randint(0, n, (max(8, n // 500),), generator=g)] = -1  # all ones on rank r
                    x.view(bits)[every] = -1
                    x[:6] = torch.tensor([-0.0, -0.0 if r else 0.0, float("inf") if r else -float("inf"),
                                          float("nan") if r == world - 1 else 1.0, 2.0, 3.0]).to(dtype)
                    x.view(bits)[4] = -1 if r == 0 else 0
                    x.view(bits)[5] = {torch.int32: 0x7FFFFFFF, torch.int16: 0x7FFF}[bits]  # all ones but the sign
                out = comm.all_reduce(xs[rank].to(device), algo=algo).cpu()
                ref = reference.all_reduce(xs)
                nan = torch.isnan(ref)
                if not (torch.equal(torch.isnan(out), nan) and _same_bits(out[~nan], ref[~nan])):
                    failures.append(f"{dtype} {nbytes} bytes {algo}: NaN positions or other bits differ")
                if not (nan[2:6].all() and not nan[:2].any() and torch.signbit(out[0]) and not torch.signbit(out[1])):
                    failures.append(f"{dtype} {nbytes} bytes {algo}: the planted values came out wrong")
                digests.append(_digest(torch.where(nan, torch.zeros_like(out), out)))
        failures += ll_regions_not_zeroed(comm)
    return failures, digests


def _late_rank(late):
    """Rank ``late`` sleeps before every third call, so its peers wait in the kernel."""
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(timeout_s=20) as comm:
        for call in range(12):
            if dist.get_rank() == late and call % 3 == 1:
                time.sleep(0.4)
            xs = _inputs(7_000 + call, 3000 + 500 * call, torch.bfloat16, world)
            _check(comm, xs, f"call {call}", failures, digests, ALGOS[call % 3])
    return failures, digests


def _late_to_the_backend():
    """Rank 1 comes to an algo="nccl" call 3 s late, with a 1.5 s timeout: rank 0 gives up
    in the hosts' wait before the backend (never inside it), and rank 1, arriving, raises
    from rank 0's record instead of entering the backend alone."""
    failures = []
    comm = Communicator(timeout_s=1.5)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(3)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(100), algo="nccl")
        failures.append("the call returned")
    except CommTimeoutError as e:
        if e.rank != 0 or e.peer != 1 or "ledger" not in e.op:
            failures.append(f"unexpected error contents: rank={e.rank} peer={e.peer} op={e.op!r}")
    if time.monotonic() - start > 2 * 1.5:
        failures.append(f"the error took {time.monotonic() - start:.1f} s")
    comm.close()
    dist.barrier()
    return failures


def _without_a_ledger_file():
    """Rank 0 cannot allocate the ledger's file: every rank logs that it has no ledger, and the
    communicator still sums correctly; no file is left in /dev/shm."""
    import logging
    import os

    from tpfuse.comm import ledger

    failures, seen = [], []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("tpfuse.comm").addHandler(handler)
    real = ledger.os.posix_fallocate

    def refuse(*args):
        raise OSError(28, "No space left on device")

    ledger.os.posix_fallocate = refuse if dist.get_rank() == 0 else real
    before = set(os.listdir("/dev/shm"))
    try:
        with Communicator(timeout_s=20) as comm:
            out = comm.all_reduce(torch.full((64,), float(dist.get_rank() + 1)))
            if comm._ledger is not None or not torch.equal(out, torch.full_like(out, 3.0)):
                failures.append("a ledger exists, or the sum is wrong")
    finally:
        ledger.os.posix_fallocate = real
        logging.getLogger("tpfuse.comm").removeHandler(handler)
    if not any("no call ledger" in m and "No space left" in m for m in seen):
        failures.append(f"not logged: {seen}")
    dist.barrier()
    if {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("tpfuse-ledger")}:
        failures.append("a ledger file is left in /dev/shm")
    return failures


def test_without_a_ledger_file_the_communicator_works_and_says_so():
    no_failures(run_ranks(2, _without_a_ledger_file, timeout_s=60))


def test_a_rank_late_to_the_backend_ends_every_rank_in_timeout_error():
    no_failures(run_ranks(2, _late_to_the_backend, timeout_s=60))


def _layouts_and_edges():
    """Non-contiguous, misaligned, any shape, empty tensors, world size 1, input errors."""
    world, rank, failures, digests = dist.get_world_size(), dist.get_rank(), [], []
    with Communicator(timeout_s=20) as comm:
        assert comm.workspace_bytes == comm.layout.total_bytes > 0
        for i, dtype in enumerate(DTYPES):
            full = _inputs(50 + i, 2 * 3001 + 1, dtype, world)
            xs = [f[::2] for f in full]  # strided views
            _check(comm, [x.contiguous() for x in xs], f"strided {dtype}", failures, digests, x=xs[rank])
            xs = [f[1:3002] for f in full]  # 2 or 4 bytes past a 16-byte boundary
            _check(comm, [x.clone() for x in xs], f"misaligned {dtype}", failures, digests, x=xs[rank])
            xs = [f[:3000].view(30, 100).t() for f in full]  # 2-D transposed
            _check(comm, [x.contiguous() for x in xs], f"transposed {dtype}", failures, digests, x=xs[rank])
            xs = [f[:6000].view(10, 20, 30) for f in full]
            _check(comm, xs, f"3-D {dtype}", failures, digests)
            for shape in [(0,), (0, 5)]:
                out = comm.all_reduce(torch.empty(shape, dtype=dtype))
                if out.shape != shape or out.dtype != dtype:
                    failures.append(f"empty {shape}: got {out.shape} {out.dtype}")
        with pytest.raises(TypeError, match="dtype"):
            comm.all_reduce(torch.ones(8, dtype=torch.int32))
        with pytest.raises(TypeError, match="torch.Tensor"):
            comm.all_reduce([1.0, 2.0])
        with pytest.raises(ValueError, match="meta"):
            comm.all_reduce(torch.ones(8, device="meta"))
        with pytest.raises(ValueError, match="algo must be"):
            comm.all_reduce(torch.ones(8), algo="ring")
        with pytest.raises(ValueError, match="max_bytes"):
            comm.all_reduce(torch.ones(1 << 20), algo="oneshot")
    # World size 1: every rank joins every new group, then uses its own.
    solo = [dist.new_group([r]) for r in range(world)][rank]
    with Communicator(solo) as comm:
        x = _inputs(9, 1001, torch.float16, 1)[0]
        out = comm.all_reduce(x)
        if comm.workspace_bytes != 0 or not _same_bits(out, x) or out.data_ptr() == x.data_ptr():
            failures.append("world size 1 must return a copy and allocate nothing")
    with pytest.raises(ValueError, match="timeout_s"):
        Communicator(timeout_s=0)
    with pytest.raises(ValueError, match="same max_bytes"):
        Communicator(max_bytes=4096 * (rank + 1))
    return failures, digests


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fallback_is_logged_once():
    world, rank, failures = dist.get_world_size(), dist.get_rank(), []
    records = _Records()
    log = logging.getLogger("tpfuse.comm")
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        with Communicator(max_bytes=4096, timeout_s=20) as comm:
            for call, algo in enumerate(["auto", "auto", "nccl", "nccl"]):
                xs = _inputs(call, 5000, torch.float32, world)  # 20 KB: past this workspace
                out = comm.all_reduce(xs[rank], algo=algo)
                if not torch.allclose(out, reference.all_reduce(xs), rtol=1e-5, atol=1e-5):
                    failures.append(f"backend result wrong for algo={algo}")
        if [("workspace" in m, "requested" in m) for m in records.messages] != [(True, False), (False, True)]:
            failures.append(f"expected one log per reason, got {records.messages}")
        records.messages.clear()
        real = socket.gethostname
        socket.gethostname = lambda: f"{real()}-{rank}"  # pretend each rank is on its own node
        try:
            with Communicator(timeout_s=20) as comm:
                xs = _inputs(3, 100, torch.float32, world)
                out = comm.all_reduce(xs[rank], algo="auto")
                if comm.workspace_bytes != 0 or "spans nodes" not in comm.fallback_reason:
                    failures.append(f"multi-node group must fall back, reason={comm.fallback_reason!r}")
                if not torch.allclose(out, reference.all_reduce(xs), rtol=1e-5, atol=1e-5):
                    failures.append("multi-node fallback result wrong")
                with pytest.raises(ValueError, match="peer workspace"):
                    comm.all_reduce(xs[rank], algo="twoshot")
        finally:
            socket.gethostname = real
        if not any("spans nodes" in m for m in records.messages):
            failures.append(f"multi-node fallback not logged: {records.messages}")
    finally:
        log.removeHandler(records)
    return failures


def _ll_flags_across_the_32_bit_wrap():
    """LL flags are the epoch modulo 2**32 - 1, plus 1: calls across that wrap must still
    find their words (the epoch is set just below it on every rank before any call)."""
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(timeout_s=20) as comm:
        comm._peer.local[:8].view(torch.int64)[0] = 2**32 - 4
        dist.barrier()
        for call in range(6):  # epochs 2**32 - 3 .. 2**32 + 2: flags 2**32 - 2, 2**32 - 1, 1, 2, 3, 4
            xs = _inputs(300 + call, 999 + call, torch.bfloat16, world)
            _check(comm, xs, f"call {call}", failures, digests, "oneshot")
        if int(comm._peer.local[:8].view(torch.int64)[0]) != 2**32 + 2:
            failures.append("the epoch did not advance once per call")
        failures += ll_regions_not_zeroed(comm)
    return failures, digests


# ---------------------------------------------------------------- tests

def _assert_ok(results):
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests), "ranks hold different bits"
    assert len(digests[0]) > 0


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_bitwise_equal_to_reference_for_all_sizes_dtypes_algos(world):
    _assert_ok(run_ranks(world, _sizes_dtypes_algos, SIZES))


def _subnormals():
    """bf16 subnormal inputs (Triton's interpreter widens them wrongly unless the kernels
    convert through ``common.to_f32``)."""
    world, failures, digests = dist.get_world_size(), [], []
    with Communicator(timeout_s=20) as comm:
        for algo in ("oneshot", "twoshot"):
            g = torch.Generator().manual_seed(ALGOS.index(algo))
            xs = [(torch.randn(1000, generator=g) * 1e-39).to(torch.bfloat16) for _ in range(world)]
            _check(comm, xs, f"subnormal {algo}", failures, digests, algo)
    return failures, digests


def test_bf16_subnormals_are_summed_exactly():
    _assert_ok(run_ranks(2, _subnormals))


@pytest.mark.parametrize("world", [2, 3])
def test_nan_inf_and_signed_zeros_through_every_protocol(world):
    _assert_ok(run_ranks(world, _special_values))


def test_world_size_3_is_served_too():
    _assert_ok(run_ranks(3, _sizes_dtypes_algos, [1, 1000, 40001]))


def test_world_size_8_is_served():
    """The largest world size the peer kernels serve, here as 8 CPU processes (no 8-GPU
    machine has run the device suite)."""
    _assert_ok(run_ranks(8, _sizes_dtypes_algos, [1, 4097], timeout_s=600))


# W=2: 1000 calls until 2026-11-28, then 600, 300, 200 (CI's budget; the GPU suite runs 50000)
@pytest.mark.parametrize("world, calls", [(2, 200), (4, 100)])
def test_stress_changing_sizes_without_barriers(world, calls):
    results = run_ranks(world, _stress, calls, world, timeout_s=300)
    _assert_ok(results)
    assert len(results[0][1]) == calls


@pytest.mark.parametrize("world", [2, 4])
def test_every_transition_between_launch_shapes_without_barriers(world):
    assert sorted(zip(_every_transition(3), _every_transition(3)[1:])) == [(i, j) for i in range(3) for j in range(3)]
    _assert_ok(run_ranks(world, _every_plan_transition, timeout_s=600))


@pytest.mark.parametrize("gather, calls, seed", [("push", 5, 8), ("pull", 3, 29546)])
def test_peers_one_call_ahead_never_overwrite_a_slow_ranks_data(gather, calls, seed):
    # 5 calls of seed 8 take every kind _slow_rank_mid_kernel asks for (12 of seed 1 took 70-97 s);
    # 3 two-shot calls of seed 29546 every kind it asks of "pull" (72,036 elements in all)
    _assert_ok(run_ranks(4, _slow_rank_mid_kernel, calls, seed, gather, timeout_s=600, fresh=True))


def test_twoshot_pull_gather_is_bitwise_equal_too():
    _assert_ok(run_ranks(4, _sizes_dtypes_algos, [1, 9, 4097, 75001], {"gather": "pull"}))
    _assert_ok(run_ranks(2, _stress, 150, 5, {"gather": "pull"}))  # CI's budget (300 until 2026-11-28)


def test_ll_flags_wrap_at_32_bits():
    _assert_ok(run_ranks(2, _ll_flags_across_the_32_bit_wrap))


@pytest.mark.parametrize("world", [2, 4])
def test_late_rank_is_waited_for(world):
    _assert_ok(run_ranks(world, _late_rank, world - 1))


@pytest.mark.parametrize("world, algo, numel", [(2, "oneshot", 100), (2, "oneshot", 20000), (2, "oneshot", 100000),
                                                (2, "twoshot", 100), (4, "auto", 100)])
def test_missing_peer_ends_in_timeout_error_not_a_hang(world, algo, numel):
    no_failures(run_ranks(world, missing_peer, "all_reduce", numel, algo, timeout_s=60))


@pytest.mark.smoke
def test_ranks_that_disagree_on_a_call_all_raise_and_return_no_numbers():
    no_failures(run_ranks(2, mismatched_calls, list(MISMATCHES), timeout_s=300))


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_edges_and_input_errors(world):
    _assert_ok(run_ranks(world, _layouts_and_edges))


def test_fallback_to_backend_is_logged_once_per_reason():
    failures = run_ranks(2, _fallback_is_logged_once)
    assert not [f for fs in failures for f in fs], failures
