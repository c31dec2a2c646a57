"""Every warp of a collective kernel takes the same stop decision in its waits.

A wait's polls hold CTA barriers (the flag atomics' broadcast, an LL poll's reduction), so a
warp that left the loop while others polled would meet their barriers out of step.
``sync.give_up`` makes the decision (abort word, deadline) the same in every warp by a
reduction over ``CTA_LANES`` lanes, which is CTA-wide only if its layout puts distinct lanes on
every warp of the kernel. Under Triton's interpreter there are no warps, so this compiles the
kernels for sm_90 on CPU (tests/sm90_layouts.py) and reads the reductions' layouts.
"""

import pytest

from tests.conftest import compile_for_sm90
from tpfuse.kernels.sync import CTA_LANES

CASES = [dict(kernel=k) for k in ("oneshot", "ll", "lamport", "twoshot")]
CASES += [dict(kernel="fused_ll", n=8192), dict(kernel="fused_twoshot", n=65536)]
CASES += [dict(kernel="quant", num_warps=w) for w in (16, 32)]
WAITS = {"oneshot": 1, "ll": 1, "lamport": 1, "twoshot": 2, "fused_ll": 1, "fused_twoshot": 2, "quant": 2}


@pytest.fixture(scope="module")
def compiled():
    return compile_for_sm90([dict(c, report="guards") for c in CASES])


def test_every_wait_decides_across_all_warps(compiled):
    assert [r["case"]["kernel"] for r in compiled] == [c["kernel"] for c in CASES]
    for r in compiled:
        # two give_up reductions per wait at least (before the first poll, at the guard polls;
        # the compiler may copy a loop)
        assert len(r["give_up_warps"]) >= 2 * WAITS[r["case"]["kernel"]], r
        assert set(r["give_up_warps"]) == {r["num_warps"]}, r
        assert CTA_LANES.value >= 32 * r["num_warps"], r  # every warp holds lanes of its own
    # the largest CTA is covered: the fused two-shot of 65536-element rows runs 32 warps
    assert max(r["num_warps"] for r in compiled) == 32
