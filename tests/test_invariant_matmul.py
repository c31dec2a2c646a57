"""tpfuse.invariant_matmul: a row's bits do not depend on the batch around it, on N, or on how
K is split over ranks (the chunks' tree); its error against float64 is fp32 accumulation's.

Runs on CPU under Triton's interpreter (small shapes) and on CUDA (the model's shapes too)."""

import pytest
import torch

import tpfuse
from tests.conftest import DEVICE, ON_GPU, compile_for_sm90
from tpfuse import reference

# (K, N, chunks): tiny ones for the interpreter; Llama-3-8B's layers at TP=2 on GPUs.
SHAPES = [(256, 96, 8), (2048, 64, 8), (512, 40, 4)] + (
    [(4096, 3072, 8), (4096, 7168, 8), (7168, 4096, 4), (2048, 4096, 4)] if ON_GPU else [])
BATCHES = [1, 5, 16, 24, 64] + ([100, 256] if ON_GPU else [])
"""Token tiles of 16, 32 and 64 on GPUs (``LinearConfig.block_t``; 16 under the interpreter), and
more than one token tile."""
ROWS = (0, 3, 17, 40, 63, 99)


def _operands(k, n, m, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().to(DEVICE)
    x = torch.randn(m, k, generator=g).bfloat16().to(DEVICE)
    return x, w


@pytest.mark.parametrize("k, n, chunks", SHAPES)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(k, n, chunks):
    x, w = _operands(k, n, max(BATCHES), k + n)
    alone = [tpfuse.invariant_matmul(x[i:i + 1], w, chunks, torch.float32) for i in ROWS]
    for m in BATCHES:
        batch = tpfuse.invariant_matmul(x[:m], w, chunks, torch.float32)
        for i, row in zip(ROWS, alone):
            if i < m:
                assert torch.equal(batch[i], row[0]), (m, i)
        last = tpfuse.invariant_matmul(x[m - 1:m], w, chunks, torch.float32)
        assert torch.equal(batch[m - 1], last[0]), (m, "last row")


@pytest.mark.parametrize("k, n, chunks", SHAPES)
def test_a_split_over_ranks_summed_over_the_tree_gives_the_unsplit_bits(k, n, chunks):
    x, w = _operands(k, n, 5, k * n)
    whole = tpfuse.invariant_matmul(x, w, chunks, torch.float32)
    for t in (2, 4, 8):
        if chunks % t:
            continue
        part = k // t
        shards = [tpfuse.invariant_matmul(x[:, r * part:(r + 1) * part].contiguous(),
                                          w[:, r * part:(r + 1) * part].contiguous(), chunks // t, torch.float32)
                  for r in range(t)]
        assert torch.equal(reference.tree_sum(shards), whole), t
    # Column shards (a column-parallel layer at any TP size) give the columns' bits.
    assert torch.equal(tpfuse.invariant_matmul(x, w[: n // 2].contiguous(), chunks, torch.float32), whole[:, : n // 2])


@pytest.mark.parametrize("k, n, chunks", SHAPES[:2])
def test_error_against_float64(k, n, chunks):
    x, w = _operands(k, n, 7, 1)
    ref = reference.matmul(x, w)
    assert reference.rel_err(tpfuse.invariant_matmul(x, w, chunks, torch.float32), ref) < 1e-6
    out = torch.full((7, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out.copy_(tpfuse.invariant_matmul(x, w, chunks))
    assert out.dtype == torch.bfloat16 and reference.rel_err(out, ref) < reference.rel_err_budget(torch.bfloat16)
    assert torch.equal(out, tpfuse.invariant_matmul(x, w, chunks, torch.float32).bfloat16())  # one rounding


def test_a_kept_counters_buffer_is_left_zero_and_changes_no_bit():
    """One counters buffer over calls of other shapes and chunks: each call's bits are those
    without it (its own zeroed counts), and the buffer is zero after every call (a count left
    behind would keep the next call's tiles from ever being summed)."""
    from tpfuse.kernels import linear

    shapes = [(256, 96, 8, 40), (512, 40, 4, 3), (256, 96, 2, 70), (256, 96, 8, 1)]
    counters = torch.zeros(max(linear.counters_for(k, c) for k, _, c, _ in shapes), dtype=torch.int32,
                           device=DEVICE)
    for i, (k, n, chunks, m) in enumerate(shapes * 2):
        x, w = _operands(k, n, m, 20 + i)
        want = tpfuse.invariant_matmul(x, w, chunks, torch.float32)
        assert torch.equal(tpfuse.invariant_matmul(x, w, chunks, torch.float32, counters), want), (k, n, chunks, m)
        assert not counters.any(), (k, n, chunks, m)
    # Too small for the launch: the call zeroes counts of its own, the same bits.
    x, w = _operands(256, 96, 40, 9)
    assert torch.equal(tpfuse.invariant_matmul(x, w, 8, None, counters[:1]), tpfuse.invariant_matmul(x, w, 8))
    with pytest.raises(ValueError, match="counters must be"):
        tpfuse.invariant_matmul(x, w, 8, None, counters.long())


@pytest.mark.parametrize("k, n, chunks, m", [(256, 96, 2, 130)] + (
    [(4096, 4096, 8, 256), (2048, 4096, 4, 100)] if ON_GPU else []))
def test_a_kept_counters_buffer_serves_many_token_tiles(k, n, chunks, m):
    """Token tiles past the first (their counts sit further in the buffer), on GPUs of 64
    tokens: the same bits as without the buffer, which is zero after."""
    from tpfuse.kernels import linear

    counters = torch.zeros(linear.counters_for(k, chunks), dtype=torch.int32, device=DEVICE)
    for seed in (1, 2):
        x, w = _operands(k, n, m, seed)
        want = tpfuse.invariant_matmul(x, w, chunks, torch.float32)
        assert torch.equal(tpfuse.invariant_matmul(x, w, chunks, torch.float32, counters), want)
        assert not counters.any()


@pytest.mark.parametrize("fields", [dict(block_n=128, block_t=64, num_warps=8, split=1),
                                    dict(block_n=64, block_t=32, num_warps=4, split=2)])
def test_the_gpus_tiles_give_the_same_bits_under_the_interpreter(monkeypatch, fields):
    """The GPUs' wider tiles (128 weight rows, 32 and 64 tokens), whose masks the interpreter's
    own configuration never reaches, on a ragged shape (the last token tile and column block
    part-full): the bits of the interpreter's configuration (its K step kept: its dot sums a
    step in one product)."""
    import dataclasses

    from tpfuse.kernels import linear

    x, w = _operands(256, 96, 70, 11)
    want = tpfuse.invariant_matmul(x, w, 4, torch.float32)
    library = linear.LinearConfig.for_shape
    monkeypatch.setattr(linear.LinearConfig, "for_shape",
                        staticmethod(lambda *shape: dataclasses.replace(library(*shape), **fields)))
    assert linear.LinearConfig.for_shape(70, 96, 4, 64).block_n == fields["block_n"]
    assert torch.equal(tpfuse.invariant_matmul(x, w, 4, torch.float32), want)


def test_counters_for_covers_every_launch(monkeypatch):
    """counters_for(k, chunks) >= the tiles of any launch whose CTAs share tiles (the only
    ones that count), with the GPUs' configurations (the interpreter's token tiles never
    widen), at M = 1-300 and at prefill sizes."""
    from tpfuse.kernels import linear

    monkeypatch.setattr(linear, "_INTERPRETER", False)
    for k, n, chunks in [(4096, 4096, 8), (4096, 28672, 8), (2048, 4096, 4), (14336, 4096, 8), (4096, 128256, 8),
                         (256, 96, 2), (512, 40, 4)]:
        bound = linear.counters_for(k, chunks)
        for m in [*range(1, 301), 2048, 65536]:  # the configurations change below 257 rows
            cfg = linear.LinearConfig.for_shape(m, n, chunks, k // chunks)
            token_tiles, blocks = linear._tiles(m, n, cfg)
            assert cfg.split == 1 or token_tiles * blocks <= bound, (k, n, chunks, m)


def test_every_configuration_the_library_picks_sums_with_one_mma_instruction():
    """Compiled for sm_90 on any machine (tests/sm90_layouts.py): at M = 1, 64 and 256, whose
    configurations differ (16 to 64 tokens a tile, 1 to 8 CTAs a tile), the kernel's only
    tensor-core instruction is a 64-row wgmma tile of weight rows (bf16 in, fp32 sums) whose N
    is the token tile (a warpgroup's share of it), and ptxas spills nothing. That a token's
    bits do not follow N is measured on GPUs (the tests above, and scripts/swap_ab_probe.py)."""
    cases = [dict(report="matmul", m=m, n=n, k=k, chunks=chunks, out=out) for m in (1, 64, 256)
             for n, k, chunks, out in [(4096, 4096, 8, "bf16"), (28672, 4096, 8, "bf16"), (4096, 2048, 4, "fp32"),
                                       (768, 4096, 8, "bf16"), (8192, 4096, 8, "bf16")]]
    reports = compile_for_sm90(cases)
    assert [r["case"] for r in reports] == cases
    assert {r["block_t"] for r in reports} == {16, 64}, reports  # both token tiles were compiled
    assert {r["block_n"] for r in reports} == {64, 128}, reports  # and both weight tiles
    assert {r["split"] for r in reports} >= {1, 2, 4, 8}, reports
    for r in reports:
        # Warpgroups take 64 weight rows each, then share the tokens: one warpgroup's tokens.
        n = r["block_t"] // max(1, r["num_warps"] // 4 // (r["block_n"] // 64))
        assert r["mma"] == [f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"], r
        # 128 weight rows summing 8 chunks keep three levels of the tree beside the running sum
        # (about 210 registers a thread in the flattened loop; a loop per chunk spilled 80 bytes).
        assert r["spill_bytes"] == 0, r


@pytest.mark.parametrize("k, n, chunks, m", [(256, 96, 8, 40), (512, 40, 4, 3), (256, 96, 2, 70), (2048, 64, 8, 20)])
def test_a_tiles_chunks_shared_by_any_number_of_ctas_give_the_same_bits(monkeypatch, k, n, chunks, m):
    """1 to ``chunks`` CTAs a tile (``LinearConfig.split``), each summing its run of chunks
    over its subtree of the tree and the last CTA adding the subtrees: the contract's bits
    (each chunk summed alone, from zero, then the chunks over the pairwise tree) for every
    split, in fp32 and rounded (one CTA a tile rounds its own sums). Chunks of one K step and,
    at K = 2048, of two."""
    import dataclasses

    from tpfuse.kernels import linear

    x, w = _operands(k, n, m, k + m)
    part = k // chunks
    want = reference.tree_sum([tpfuse.invariant_matmul(x[:, c * part:(c + 1) * part].contiguous(),
                                                       w[:, c * part:(c + 1) * part].contiguous(), 1, torch.float32)
                               for c in range(chunks)])
    library = linear.LinearConfig.for_shape
    for split in (1, 2, 4, 8)[:chunks.bit_length()]:
        monkeypatch.setattr(linear.LinearConfig, "for_shape",
                            staticmethod(lambda *shape, s=split: dataclasses.replace(library(*shape), split=s)))
        assert torch.equal(tpfuse.invariant_matmul(x, w, chunks, torch.float32), want), split
        assert torch.equal(tpfuse.invariant_matmul(x, w, chunks), want.bfloat16()), split


def test_layer_chunks_are_served():
    from tpfuse.kernels.linear import check_chunks, layer_chunks

    assert [layer_chunks(k) for k in (4096, 14336, 2048, 128, 64, 384, 640, 2880)] == [8, 8, 8, 8, 4, 1, 1, 1]
    for k in (4096, 14336, 2048, 128, 64, 384, 640):
        check_chunks(k, layer_chunks(k))
    with pytest.raises(ValueError, match="does not split"):
        check_chunks(2880, 1)  # 2880 = 22.5 x 128


def test_leading_dimensions_and_empty_batches():
    x, w = _operands(256, 48, 6, 2)
    out = tpfuse.invariant_matmul(x.view(2, 3, 256), w, 8)
    assert out.shape == (2, 3, 48) and torch.equal(out.view(6, 48), tpfuse.invariant_matmul(x, w, 8))
    assert tpfuse.invariant_matmul(x[:0], w, 8).shape == (0, 48)


def test_custom_op_compiles_and_passes_opcheck():
    x, w = _operands(256, 48, 5, 5)
    f = torch.compile(lambda a: tpfuse.invariant_matmul(a, w, 8, torch.float32), fullgraph=True)
    assert torch.equal(f(x), tpfuse.invariant_matmul(x, w, 8, torch.float32))
    torch.library.opcheck(torch.ops.tpfuse.invariant_matmul, (x, w, 8, torch.float32, None))
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.tpfuse.invariant_matmul, (x, w, 8, torch.float32, counters))


def test_argument_errors():
    x, w = _operands(256, 48, 2, 3)
    with pytest.raises(ValueError, match="chunks must be"):
        tpfuse.invariant_matmul(x, w, 3)
    with pytest.raises(ValueError, match="does not split"):
        tpfuse.invariant_matmul(x[:, :200].contiguous(), w[:, :200].contiguous(), 8)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        tpfuse.invariant_matmul(x.float(), w.float(), 8)
    with pytest.raises(ValueError, match="do not match"):
        tpfuse.invariant_matmul(x, w.t().contiguous(), 8)
    with pytest.raises(ValueError, match="does not split"):
        tpfuse.invariant_matmul(x[:, :192].contiguous(), w[:, :192].contiguous(), 4)  # chunks of 48
    with pytest.raises(TypeError, match="out_dtype"):
        tpfuse.invariant_matmul(x, w, 8, torch.float16)
