"""The fused all-reduce + RMSNorm kernels (and the sequence-parallel reduce-scatter + RMSNorm,
and those with an fp8 output) reduce each row in the norm kernel's register layout.

The CPU tests of tests/test_fused.py run under Triton's interpreter, which sums a row in its
own order whatever the kernel, so they cannot see a layout difference; on a GPU the layout
Triton picks for the reduced tile fixes the summation order, and so y's bits. Here every
kernel is compiled for sm_90 (the H200's target, no GPU needed; tests/sm90_layouts.py) with
the arguments its launcher passes, and the layouts of the row reductions are compared.
"""

import itertools

import pytest

from tests.conftest import ON_GPU, compile_for_sm90

# Hidden sizes the fused kernels serve (multiples of FUSED_HIDDEN_MULTIPLE): tiles of 1 to 32
# rows, every tile width, 5120 (rows in two pieces), 2880/7168 (padded tiles), chunked rows
# (fp32 14336, 20000; fp16 and fp32 50000), bf16 rows held narrow (50000 padded, 65536).
HIDDEN = [16, 64, 96, 208, 256, 1008, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 14336, 16384, 20000, 50000, 65536]
DTYPES = ["bf16", "fp16", "fp32"]
WORLDS = [2, 4, 8]
WEIGHTS = ["same", "fp32", "none"]


# A hidden size the fused kernels do not serve, where the layouts do differ: the check can fail.
UNSERVED = dict(dtype="fp16", n=1000, rows=5, world=4, weight="same")


# The kernels with an fp8 output (each mode) on every norm path: rows held (4096), in two
# pieces (5120), chunked (fp32 20000), held narrow (bf16 65536).
FP8_CASES = [dict(dtype=dtype, n=n, rows=rows, world=world, weight="same", fp8=mode)
             for dtype, n, rows, world, mode in [("bf16", 4096, 1, 2, "token"), ("fp16", 5120, 5, 4, "group"),
                                                 ("fp32", 20000, 1, 8, "tensor"), ("bf16", 65536, 64, 2, "group")]]


# fp32 partial sums normalised into bf16/fp16 (the invariant model's boundary): x's loads are
# fp32, the tile the norm's; rows held (4096, 14336 as Llama's widths), in two pieces (5120),
# chunked (fp16 50000, bf16 20000) and held narrow (bf16 65536).
PARTIALS_CASES = [dict(dtype=dtype, n=n, rows=rows, world=world, weight=weight, partials=True)
                  for dtype, n, rows, world, weight in [("bf16", 4096, 1, 2, "same"), ("fp16", 4096, 64, 4, "fp32"),
                                                        ("bf16", 5120, 5, 8, "none"), ("bf16", 14336, 1, 2, "fp32"),
                                                        ("bf16", 20000, 5, 2, "same"), ("fp16", 50000, 1, 4, "same"),
                                                        ("bf16", 65536, 1, 2, "same"), ("fp16", 1024, 5, 2, "same")]]


def _cases():
    """Every dtype at every hidden size on the GPU machine (scripts/device_check.sh test_norm; the
    check needs its CPU cores, not its GPU); in the CI, for its time, a third: each hidden size
    in one dtype, each dtype over six sizes spread over the list, in tiles of 1, 5 and 64 rows."""
    cases = [UNSERVED]
    for i, (dtype, n) in enumerate(itertools.product(DTYPES, HIDDEN)):
        if not ON_GPU and (i // 3 + i // len(HIDDEN)) % 3:
            continue
        # the reduce-scatter + norm on a quarter of the cases (widths spread over the list; in the
        # full list every dtype, rows and world size, in the CI's third W = 2, 4 and tiles of 1,
        # 5 rows), for the time: its tile code is the one-shot kernels' (SLOTS = W)
        cases.append(dict(dtype=dtype, n=n, rows=[1, 5, 64][i % 3], world=WORLDS[i % 3],
                          weight=WEIGHTS[(i + i // 9) % 3], reduce_scatter=i % 4 == 0))
    return cases + FP8_CASES + PARTIALS_CASES


@pytest.fixture(scope="module")
def compiled():
    return compile_for_sm90(_cases())


def test_every_case_was_compiled(compiled):
    assert [r["case"] for r in compiled] == _cases()


def test_fused_kernels_reduce_rows_in_the_norm_kernels_layout(compiled):
    wrong = []
    for r in compiled[1:]:
        # One row reduction per row piece (NormConfig.tail_n): a finder that found nothing
        # would compare nothing.
        norm = r["norm"]
        assert len(norm) == (2 if r["tail_n"] else 1), r
        # a kernel may inline the norm more than once
        for algo in ("norm_fp8", "oneshot", "oneshot_ll", "oneshot_lamport", "oneshot_lamport_whole", "oneshot_rows",
                     "twoshot", "reduce_scatter"):
            if algo == "norm_fp8" and not r["case"].get("fp8"):
                continue
            if algo in ("oneshot_rows", "reduce_scatter") and algo not in r:
                continue  # row-wise: rows with a tail, chunked or of other widths are not served; the
                # reduce-scatter: compiled for a quarter of the cases
            copies = len(r[algo]) // len(norm)
            if not r[algo] or r[algo] != norm * copies:
                wrong.append(f"{r['case']}: {algo} reduces in {r[algo]}, the norm kernel in {norm}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_the_difference_that_excludes_other_hidden_sizes(compiled):
    """fp16, N=1000: Triton cannot prove the rows 16-byte aligned, and the fused kernels'
    reduction gets another layout. This is why ``FUSED_HIDDEN_MULTIPLE`` exists; should a
    new Triton stop differing here, the restriction may be revisited."""
    r = compiled[0]
    assert r["case"] == UNSERVED and len(r["norm"]) == 1
    assert r["oneshot"] and r["twoshot"]
    assert all(layout != r["norm"][0] for layout in r["oneshot"] + r["twoshot"])
