"""A row's backward reduction is laid out the same at every M, so dx's bits depend on N and
dtype only.

The backward launcher picks the kernel's warps by how many rows each program runs through
(norm.bwd_num_warps: twice the warps on long runs of short rows). A row's dx bits follow the
order of its row reductions, which is fixed by the reduced tile's layout along the columns:
elements per thread, lanes and warps across a row (the rows dimension may differ). Under
Triton's interpreter every layout sums alike, so this compiles the kernel for sm_90 on CPU
(tests/sm90_layouts.py) at a short and a long M and compares those layouts.
"""

import re

import pytest
import torch

from tests.conftest import compile_for_sm90
from tpfuse.kernels.norm import NormConfig

SHORT_M, LONG_M = 1024, 65536  # 256 dW partials of 4 and of 256 rows
# Tiles of 4 to 32 rows whose warps double on long runs: 16-bit rows of 256 (a warp per row),
# 512 (2 warps per row), 768 (a padded tile) and 1024 (4 warps per row); fp32 rows of 64 (a warp
# holds two rows) to 512.
CASES = [("bf16", 256), ("bf16", 512), ("bf16", 768), ("bf16", 1024), ("fp16", 256),
         ("fp32", 64), ("fp32", 256), ("fp32", 512)]
# Tiles that keep their warps: one 16-byte vector per thread on twice the warps (bf16 64, 4 KiB
# tiles; bf16 2048, 2 rows of 8 KiB on 8 warps), rows in two pieces (bf16 5120) and single rows
# (fp32 4096).
KEEP = [(torch.bfloat16, 64), (torch.bfloat16, 2048), (torch.bfloat16, 5120), (torch.float32, 4096)]
# Calls that keep their warps although the tile would double them: tiles laid out in narrower
# vectors, where more warps would split a row (rows that are not a multiple of 16 elements without
# a weight; an fp32 weight beside bf16 rows).
NARROW = [("bf16", 1000, "none"), ("bf16", 250, "none"), ("fp32", 300, "none"), ("bf16", 1024, "fp32"),
          ("bf16", 600, "fp32")]
# The check can fail: a single-row tile (bf16 4096 on 16 warps) on 8 warps spreads each row
# over 8 warps instead of 16.
SINGLE_ROW = dict(dtype="bf16", n=4096)
SINGLE_ROW_WARPS = 8
# Chunked rows (tpfuse.kernels.norm_bwd_chunked) take one 8 KiB chunk per program, or more where
# one-chunk programs of a row could not all be resident (here: on 4 SMs, 8 resident programs for
# 10 to 32 chunks): each chunk and the row's chunk sums must be reduced alike in both.
CHUNKED = [("bf16", 65536), ("fp32", 65536), ("fp16", 40000)]
FEW_SMS = 4


def _cases():
    cases = [dict(report="reductions", dtype=d, n=n, rows=m) for d, n in CASES for m in (SHORT_M, LONG_M)]
    cases += [dict(report="reductions", dtype=d, n=n, rows=m, weight=w)
              for d, n, w in NARROW for m in (SHORT_M, LONG_M)]
    cases += [dict(report="reductions", dtype=d, n=n, rows=SHORT_M, **sms) for d, n in CHUNKED
              for sms in ({}, {"sms": FEW_SMS})]
    return cases + [dict(report="reductions", rows=SHORT_M, **SINGLE_ROW),
                    dict(report="reductions", rows=SHORT_M, config={"bwd_num_warps": SINGLE_ROW_WARPS}, **SINGLE_ROW)]


@pytest.fixture(scope="module")
def reports():
    return {(r["case"]["dtype"], r["case"]["n"], r["case"]["rows"], "config" in r["case"] or "sms" in r["case"],
             r["case"].get("weight")): r for r in compile_for_sm90(_cases())}


def across_a_row(layout: str) -> tuple:
    """What fixes a row's summation order in a blocked layout: its column component of
    sizePerThread, threadsPerWarp and warpsPerCTA, and the order."""
    fields = dict(re.findall(r"(\w+) = \[([0-9, ]+)\]", layout))
    assert {"sizePerThread", "threadsPerWarp", "warpsPerCTA", "order"} <= fields.keys(), layout
    per_dim = {k: [int(v) for v in fields[k].split(",")] for k in fields}
    return tuple(per_dim[k][1] for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA")) + (tuple(per_dim["order"]),)


def test_every_case_was_compiled(reports):
    assert len(reports) == len(_cases())
    assert all(r["reductions"] for r in reports.values())


@pytest.mark.parametrize("dtype, n", CASES)
def test_long_runs_take_more_warps_and_reduce_rows_alike(reports, dtype, n):
    short, long = reports[(dtype, n, SHORT_M, False, None)], reports[(dtype, n, LONG_M, False, None)]
    assert long["num_warps"] == 2 * short["num_warps"]  # the case covers the switch
    assert len(short["reductions"]) == len(long["reductions"])
    assert [across_a_row(a) for a in short["reductions"]] == [across_a_row(b) for b in long["reductions"]]


def test_the_check_sees_a_row_spread_over_other_warps(reports):
    base, fewer = (reports[(SINGLE_ROW["dtype"], SINGLE_ROW["n"], SHORT_M, c, None)] for c in (False, True))
    assert fewer["num_warps"] == SINGLE_ROW_WARPS != base["num_warps"]
    assert [across_a_row(a) for a in base["reductions"]] != [across_a_row(b) for b in fewer["reductions"]]


@pytest.mark.parametrize("dtype, n", KEEP)
def test_other_tiles_keep_their_warps_on_long_runs(dtype, n):
    cfg = NormConfig.from_shape(n, dtype)
    assert cfg.bwd_long_run_warps == cfg.bwd_num_warps


@pytest.mark.parametrize("dtype, n, weight", NARROW)
def test_tiles_in_narrower_vectors_keep_their_warps_and_layouts(reports, dtype, n, weight):
    short, long = reports[(dtype, n, SHORT_M, False, weight)], reports[(dtype, n, LONG_M, False, weight)]
    assert long["num_warps"] == short["num_warps"]
    assert [across_a_row(a) for a in short["reductions"]] == [across_a_row(b) for b in long["reductions"]]


@pytest.mark.parametrize("dtype, n", CHUNKED)
def test_chunked_rows_reduce_alike_at_any_chunks_per_program(reports, dtype, n):
    """Per chunk (the rows of [CHUNKS, BLOCK_N] tiles) and across the row's chunk sums."""
    one, two = reports[(dtype, n, SHORT_M, False, None)], reports[(dtype, n, SHORT_M, True, None)]
    assert one["chunks"] == 1 and two["chunks"] > 1  # the case covers both
    assert one["reductions"] and len(one["reductions"]) == len(two["reductions"])  # x^2 and g*x per chunk
    assert [across_a_row(a) for a in one["reductions"]] == [across_a_row(b) for b in two["reductions"]]
    assert one["vector_reductions"] and one["vector_reductions"] == two["vector_reductions"]
