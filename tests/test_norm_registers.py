"""The RMSNorm backward holds bf16 rows of 2048 to 16384 columns in registers without spills
(stacked rows of 2049-3072: one register's worth), and the forward holds bf16 rows of 49152 to 65536 (NormConfig's narrow rows) with at most a
register's worth.

Its speed there rests on the register budget (benchmarks/NOTES.md, seventh session): one row's
x, dy and the dW accumulator fill most of an SM's registers at N=16384, and the weight is
re-read for dx (NormConfig.bwd_reload_weight, a second load the compiler must not merge with
the first) so that ptxas does not spill. The CPU suite cannot time anything, but it can
compile the kernel for sm_90 (tests/sm90_layouts.py) and read ptxas's report.

The forward's wide bf16 rows (64 values per thread on 32 warps) fit only if x stays in its
16-bit form across the row reduction (norm_tile's HOLD_NARROW, widen_again): with an fp32
copy held instead, ptxas spilled 152 bytes per thread; with it, 8 (two registers),
measured at 96-99% of copy bandwidth on H200.
"""


import pytest

from tests.conftest import compile_for_sm90

NS = [2048, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 16384]
# The check can fail: without the weight re-read, N=16384 spills.
SPILLING = dict(kernel="backward", dtype="bf16", n=16384, rows=4096, config={"bwd_reload_weight": False})
# Rows of 2049-3072 (multiples of 16) stack two rows per backward tile (norm._BWD_STACKED_*): the
# 16-bit tile spills one register and measured faster all the same; fp32's does not spill; N=3000
# (not a multiple of 16) keeps one row, in two pieces for fp32.
STACKED_16BIT_NS = [2560, 2880, 3072]
STACKED_MAX_SPILL_BYTES = 4
OTHER_BACKWARD = [("bf16", 3000), ("fp32", 2880), ("fp32", 3000)]


# The chunked rows' backward (tpfuse.kernels.norm_bwd_chunked) holds four rows of its 8 KiB
# chunk on 4 warps; the 16-bit ones spill one or two registers (bf16 measured at 80-82% of copy
# bandwidth, fp16 N=40000 at 70%).
CHUNKED_BACKWARD = [("bf16", 65536), ("fp16", 40000), ("fp32", 65536)]
CHUNKED_MAX_SPILL_BYTES = 8

# Narrow forward rows: a padded tile (50000) and a full one.
NARROW_NS = [50000, 65536]
NARROW_MAX_SPILL_BYTES = 8
# The check can fail: the same rows on 4 warps hold 512 values per thread.
NARROW_SPILLING = dict(kernel="forward", dtype="bf16", n=65536, rows=64, config={"num_warps": 4})


def _cases():
    return ([SPILLING] + [dict(kernel="backward", dtype="bf16", n=n, rows=4096) for n in NS]
            + [dict(kernel="backward", dtype=d, n=n, rows=4096) for d, n in OTHER_BACKWARD]
            + [dict(kernel="backward", dtype="bf16", n=n, rows=4096) for n in STACKED_16BIT_NS]
            + [NARROW_SPILLING] + [dict(kernel="forward", dtype="bf16", n=n, rows=64) for n in NARROW_NS]
            + [dict(kernel="chunked", dtype=d, n=n, rows=1024) for d, n in CHUNKED_BACKWARD])


def _backward(reports):
    return [r for r in reports if r["case"]["kernel"] == "backward"]


def _forward(reports):
    return [r for r in reports if r["case"]["kernel"] == "forward"]


@pytest.fixture(scope="module")
def reports():
    return compile_for_sm90(_cases())


def test_every_case_was_compiled(reports):
    assert [r["case"] for r in reports] == _cases()


def test_the_check_can_fail(reports):
    assert _backward(reports)[0]["spill_bytes"] > 0, reports[0]
    assert _forward(reports)[0]["spill_bytes"] > NARROW_MAX_SPILL_BYTES, _forward(reports)[0]


def test_bf16_rows_in_registers_do_not_spill(reports):
    stacked = len(STACKED_16BIT_NS)
    spilling = [r for r in _backward(reports)[1:-stacked] if r["spill_bytes"]]
    spilling += [r for r in _backward(reports)[-stacked:] if r["spill_bytes"] > STACKED_MAX_SPILL_BYTES]
    assert len(_backward(reports)) == 1 + len(NS) + len(OTHER_BACKWARD) + stacked and not spilling, spilling


def test_narrow_bf16_forward_rows_fit_in_registers(reports):
    spilling = [r for r in _forward(reports)[1:] if r["spill_bytes"] > NARROW_MAX_SPILL_BYTES]
    assert len(_forward(reports)) == 1 + len(NARROW_NS) and not spilling, spilling


def test_chunked_backward_rows_fit_in_registers(reports):
    chunked = [r for r in reports if r["case"]["kernel"] == "chunked"]
    spilling = [r for r in chunked if r["spill_bytes"] > CHUNKED_MAX_SPILL_BYTES]
    assert len(chunked) == len(CHUNKED_BACKWARD) and not spilling, spilling
