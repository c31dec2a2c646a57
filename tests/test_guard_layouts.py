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
CASES += [dict(kernel="fused_ll", n=8192), dict(kernel="fused_rows", n=4096), dict(kernel="fused_twoshot", n=65536)]
CASES += [dict(kernel="quant", tile=t) for t in ("large", "small")]  # W=2: 32 and 16 warps
WAITS = {"oneshot": 1, "ll": 1, "lamport": 1, "twoshot": 2, "fused_ll": 1, "fused_rows": 1, "fused_twoshot": 2,
         "quant": 2}


@pytest.fixture(scope="module")
def compiled():
    return compile_for_sm90([dict(c, report="guards") for c in CASES])


def test_every_wait_decides_across_all_warps(compiled):
    assert [r["case"]["kernel"] for r in compiled] == [c["kernel"] for c in CASES]
    for r in compiled:
        # two give_up reductions per wait at least (before the first poll, at the guard polls;
        # the compiler may copy a loop)
        assert len(r["give_up"]) >= 2 * WAITS[r["case"]["kernel"]], r
        for reduction in r["give_up"]:
            # the layout spans every warp, and its lanes are not replicated across warps, so
            # the reduction combines every warp's value through shared memory
            assert reduction["warps"] == r["num_warps"] and reduction["lanes"] <= CTA_LANES.value, r
    # the largest CTAs are covered: the fused two-shot of 65536-element rows and the quantized
    # kernel's large tile run 32 warps, CTA_LANES / 32 threads
    warps = {r["case"]["kernel"] + r["case"].get("tile", ""): r["num_warps"] for r in compiled}
    assert warps["fused_twoshot"] == warps["quantlarge"] == 32 and warps["quantsmall"] == 16


SPIN_CASES = [dict(kernel="allreduce", dtype="bf16", block=4096, warps=16),
              dict(kernel="allreduce", dtype="bf16", block=8192, warps=16),
              dict(kernel="allreduce", dtype="fp32", block=2048, warps=16),
              dict(kernel="allreduce", dtype="fp16", block=1024, warps=2),
              dict(kernel="allreduce", dtype="bf16", block=4096, warps=16, rank=1, numel=(1 << 19) + 7),
              dict(kernel="fused", dtype="bf16", n=4096, rows=1, whole=False),
              dict(kernel="fused", dtype="bf16", n=4096, rows=128, whole=True),
              dict(kernel="fused", dtype="fp32", n=5120, rows=4, whole=False)]


def test_lamport_one_shots_spin_once_per_vector_and_slot():
    """The one-shot kernels' threads spin on their own 16-byte vectors of Lamport words
    (``ll.ll_wait``'s SPIN): the spin is in the kernel once per vector a thread holds and per
    slot (the own slot's predicated off). Triton rematerialises the spin in every layout its
    results are used in, each copy a further L2 round trip (it did in the fused kernel, eight
    copies per slot, while the own rows went through a 2-D reshape); this fails if it does."""
    reports = compile_for_sm90([dict(c, report="spins") for c in SPIN_CASES])
    assert [r["case"]["kernel"] for r in reports] == [c["kernel"] for c in SPIN_CASES]
    for r in reports:
        want = 2 * r["vectors_per_thread"]  # W = 2 slots
        assert r["spins"] == r["vector_loads"] == want, r
