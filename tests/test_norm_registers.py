"""The RMSNorm backward holds bf16 rows of 2048 to 16384 columns in registers without spills.

Its speed there rests on the register budget (benchmarks/NOTES.md, seventh session): one row's
x, dy and the dW accumulator fill most of an SM's registers at N=16384, and the weight is
re-read for dx (NormConfig.bwd_reload_weight, a second load the compiler must not merge with
the first) so that ptxas does not spill. The CPU suite cannot time anything, but it can
compile the kernel for sm_90 (tests/sm90_layouts.py) and read ptxas's report.
"""


import pytest

from tests.conftest import compile_for_sm90

NS = [2048, 2880, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 16384]
# The check can fail: without the weight re-read, N=16384 spills.
SPILLING = dict(kernel="backward", dtype="bf16", n=16384, rows=4096, config={"bwd_reload_weight": False})


def _cases():
    return [SPILLING] + [dict(kernel="backward", dtype="bf16", n=n, rows=4096) for n in NS]


@pytest.fixture(scope="module")
def reports():
    return compile_for_sm90(_cases())


def test_every_case_was_compiled(reports):
    assert [r["case"] for r in reports] == _cases()


def test_the_check_can_fail(reports):
    assert reports[0]["spill_bytes"] > 0, reports[0]


def test_bf16_rows_in_registers_do_not_spill(reports):
    spilling = [r for r in reports[1:] if r["spill_bytes"]]
    assert not spilling, spilling
