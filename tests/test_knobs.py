"""tpfuse.comm.knobs: the plans' settings as frozen data, checked when built, fixed per
Communicator, the same on every rank (``using_knobs`` for experiments)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import no_failures, run_ranks
from tpfuse.comm import Communicator, Knobs, Launch, default_knobs, knobs_for
from tpfuse.comm.plan import AllReducePlan


def test_defaults_are_valid_and_unmeasured_world_sizes_take_w8s():
    for world in range(1, 9):
        assert default_knobs(world).check().world_size == world
    for world in (1, 3, 5, 6, 7):
        assert dataclasses.replace(default_knobs(world), world_size=8) == default_knobs(8)
    assert default_knobs(2) != default_knobs(8)


@pytest.mark.parametrize("changes, match", [
    ({"ll_max_bytes": -1}, "ll_max_bytes"),
    ({"oneshot_max_bytes": True}, "oneshot_max_bytes"),
    ({"fused_max_ctas": 0}, "fused_max_ctas"),
    ({"oneshot": Launch(8192, 0, 32)}, "oneshot.num_warps"),
    ({"twoshot": Launch(0, 16, 128)}, "twoshot.tile_bytes"),
    ({"gather": "ring"}, "gather"),
    ({"quant_min_bytes": {"int5": 1}}, "one entry per codec"),
    ({"quant_min_bytes": {"int4": -1}}, r"quant_min_bytes\[int4\]"),
    ({"quant_tile": {"fp8": 0}}, r"quant_tile\[fp8\]"),
    ({"quant_tile": {"int8": 100}}, "multiple of 128"),
    ({"oneshot_max_bytes": "512"}, "oneshot_max_bytes"),
    ({"oneshot": Launch(3000, 16, 32)}, "power of two"),
    ({"oneshot_lamport": Launch(2048, 16, 128)}, "max_tile_bytes"),
    ({"fused_rows_piece_bytes": 0}, "fused_rows_piece_bytes"),
    ({"source": 3}, "source"),
])
def test_bad_knobs_raise_naming_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        default_knobs(2).replace(**changes)


def test_knobs_are_frozen_hashable_values():
    knobs = default_knobs(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        knobs.ll_max_bytes = 0
    changed = knobs.replace(quant_min_bytes={"int4": 1 << 30}, oneshot_max_bytes=0)
    assert changed.quant_min("int4") == 1 << 30 and changed.quant_min("int8") == knobs.quant_min("int8")
    assert knobs.oneshot_max_bytes > 0 and hash(knobs) != hash(changed) and knobs == default_knobs(4)
    assert isinstance(knobs_for(4), Knobs)


def _knobs_per_communicator():
    """Two communicators of one group with other knobs plan alike on every rank; using_knobs
    swaps a communicator's knobs for a with-block and gives its own back; knobs of another
    world size, or that differ between the ranks, raise ValueError on every rank."""
    world, rank, failures = dist.get_world_size(), dist.get_rank(), []
    twoshot = default_knobs(world).replace(oneshot_max_bytes=0)
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    want = torch.arange(1000, dtype=torch.float32) * sum(range(1, world + 1))
    with Communicator(max_bytes=1 << 16) as comm, Communicator(max_bytes=1 << 16, knobs=twoshot) as other:
        if AllReducePlan.from_numel(1000, torch.float32, other.layout, other.knobs).algo != "twoshot":
            failures.append("the knobs passed did not reach the plans")
        for c in (comm, other):
            if not torch.equal(c.all_reduce(x), want):
                failures.append(f"wrong sum under {c.knobs.source} knobs")
        with comm.using_knobs(twoshot):
            if comm.knobs is not twoshot or not torch.equal(comm.all_reduce(x), want):
                failures.append("using_knobs did not take effect")
        if comm.knobs == twoshot:
            failures.append("using_knobs did not give the communicator's own knobs back")
        for bad, match in ((default_knobs(world + 1), "world_size"),
                           (twoshot.replace(ll_max_bytes=rank), "same knobs")):
            try:
                with comm.using_knobs(bad):
                    failures.append(f"using_knobs accepted knobs it should refuse ({match})")
            except ValueError as e:
                if match not in str(e):
                    failures.append(f"using_knobs raised {e}")
        if not torch.equal(comm.all_reduce(x), want):
            failures.append("the communicator failed after a refused using_knobs")
    for bad, match in ((default_knobs(world + 1), "world_size"),
                       (default_knobs(world).replace(oneshot_max_bytes=4096 * rank), "same knobs")):
        try:
            Communicator(max_bytes=1 << 16, knobs=bad).close()
            failures.append(f"a Communicator was created with knobs it should refuse ({match})")
        except ValueError as e:
            if match not in str(e):
                failures.append(f"Communicator raised {e}")
    return failures


def test_each_communicator_keeps_its_knobs_and_ranks_must_agree():
    no_failures(run_ranks(2, _knobs_per_communicator))
