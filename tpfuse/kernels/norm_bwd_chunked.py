"""RMSNorm backward of chunked rows (N > 16384, ``NormConfig.bwd_num_chunks > 1``).

A row too long for one program's registers is split across programs, a slice of its 8 KiB
chunks each (``exchange_slicing``: one chunk), and the programs of one row exchange their
chunks' sums through memory. Each stores its chunks' (sum of x^2, sum of g*x) as LL words
(the flag inside the word, as in tpfuse.kernels.ll: no fence, no barrier), and, two rows
later, reads the row's words back until every slice has written them, sums them, and forms
dx from the x and dy it still holds. So x and dy are read from memory once. The programs of
a row form a group; groups run through whole dW partials, each slice holding its columns' dW
terms of the partial's rows in registers, and write the partial's piece of its columns. The
partials are summed by the separate combine launch (DwPlan says why).

This replaced three launches (each chunk's sums, each row's totals, then dx per chunk) that
read x and dy twice, the second time from HBM. H200, us, three launches -> this
(benchmarks/NOTES.md, 2026-11-25): bf16 N=65536 M=1 6.9 -> 4.9, M=16 12.7 -> 9.3, M=128 36.8
-> 32.2, M=4096 688 -> 481 (80% of copy bandwidth), M=16384 2597 -> 1871 (82%); bf16 N=32768
M=32768 2619 -> 1892; fp32 N=65536 M=1024 388 -> 221 (86%); fp32 N=20000 M=4096 458 -> 348.

Waiting on other programs needs them resident at once: the launch is cooperative (the driver
refuses a grid that cannot be), and its grid is sized from the programs an SM holds
(``_resident_programs``). Under Triton's interpreter programs run one after another, so
there one program takes the whole row (one slice) and its waits end at once; the sums and
the dx and dW math are the same code.

dx's bits depend on N and dtype only: each chunk's sums are reduced in the chunk's own layout
([1, BLOCK_N] rows of the slice's tile, warps along the chunk), then the row's chunk sums in
the layout of one [CHUNKS_P2] vector, neither of which changes with the chunks per program
(tests/test_norm_bwd_layouts.py compiles both), and nothing depends on M or on which group
takes a row.

``norm_bwd.rms_norm_bwd`` launches it (``_rms_norm_bwd_chunked``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER
from tpfuse.kernels.common import EXACT_FP, round_to, to_f32
from tpfuse.kernels.norm import NormConfig, inv_rms
from tpfuse.kernels.norm_bwd_common import _bwd_row_sums, _store_dx
from tpfuse.kernels.norm_dw import DwPlan

# A program holds four rows of its slice (x and dy of the row it finishes, of the next two,
# published, and of the one in flight: see the kernel) on 4 warps with up to 255 registers
# per thread, two programs to an SM. H200, us, bf16 N=65536 M=16384 / fp32 N=65536 M=1024
# (scripts/tune_norm.py exchange; benchmarks/NOTES.md): 4 warps 1871 / 221, 8 warps at 128
# registers (two to an SM; bf16 spills) 3133 / 243, 8 warps at 255 (one) 2430 / 331. Two
# chunks per program spilled and lost at every shape (bf16 M=4096 on 4 warps 481 -> 2766):
# they are taken only where one-chunk slices could not all be resident (rows of over 264
# chunks on H200, bf16 over a million elements).
EXCHANGE_WARPS = 4
EXCHANGE_MAX_REGISTERS = 255


@functools.lru_cache(maxsize=None)
def _resident_programs(device_index: int, num_warps: int, max_registers: int) -> int:
    """Programs of num_warps warps at max_registers registers per thread that the GPU holds at
    once (registers and threads are the limits: a program's shared memory is 4 KiB at most,
    for its dW store's layout conversion)."""
    props = torch.cuda.get_device_properties(device_index)
    threads = 32 * num_warps
    per_sm = min(props.regs_per_multiprocessor // (max_registers * threads),
                 props.max_threads_per_multi_processor // threads)
    return per_sm * props.multi_processor_count


def exchange_slicing(num_chunks: int, device: torch.device) -> tuple[int, int]:
    """(chunks per program, programs per row) for rows of num_chunks chunks on device: one
    chunk per program, or as many (a power of two) as keep a row's programs resident at once;
    under the interpreter, which runs programs one at a time, the whole row in one program."""
    if INTERPRETER:
        chunks = triton.next_power_of_2(num_chunks)
    else:
        resident = _resident_programs(device.index, EXCHANGE_WARPS, EXCHANGE_MAX_REGISTERS)
        chunks = triton.next_power_of_2(triton.cdiv(num_chunks, resident))
    return chunks, triton.cdiv(num_chunks, chunks)


@triton.jit
def _load_slice(X, DY, row, row_end, cols, N):
    """x and dy of one row's slice (cols [CHUNKS, BLOCK_N]), zero from row_end on."""
    mask = (cols < N) & (row < row_end)
    offs = tl.cast(row, tl.int64) * N + cols
    return tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0)


@triton.jit
def _weighted_grad_held(dy, w, HAS_WEIGHT: tl.constexpr):
    """g = dy * w in fp32, w the program's weight columns + weight_offset, loaded once: a
    program's columns are the same in every row (norm_bwd_common._weighted_grad's math).
    Re-read per use instead: H200 bf16 N=65536 M=16384 1890 -> 2007 us."""
    g = to_f32(dy)
    if HAS_WEIGHT:
        g = g * w
    return g


@triton.jit
def _publish_chunk_sums(CHUNK_WORDS, x, dy, w, row, chunks, NUM_CHUNKS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """Store the (sum of x^2, sum of g*x) of each of this slice's chunks of row as two LL
    words (tpfuse.kernels.ll), each one aligned 8-byte store, so a reader that sees the flag
    sees the sum: no fence, no barrier."""
    g = _weighted_grad_held(dy, w, HAS_WEIGHT)
    sq, gx = _bwd_row_sums(to_f32(x), g, False)  # per chunk, two reductions: see norm._BWD_TWO_REDUCTION_BLOCK_N
    out = CHUNK_WORDS + (tl.cast(row, tl.int64) * NUM_CHUNKS + chunks) * 2
    tl.store(out, _ll_word(sq), mask=chunks < NUM_CHUNKS)
    tl.store(out + 1, _ll_word(gx), mask=chunks < NUM_CHUNKS)


@triton.jit
def _ll_word(v):
    """fp32 v as an LL word: its bits in the low half, flag 1 in the high half (a word of a
    call's zeroed buffer that reads 0 there is not written yet)."""
    return v.to(tl.uint32, bitcast=True).to(tl.int64) | (1 << 32)


@triton.jit
def _add_three(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _load_row_words(CHUNK_WORDS, row, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """One look at row's LL words, (sum of x^2, sum of g*x) per chunk as two [CHUNKS_P2]
    vectors: one or two words to a thread, so a look holds few registers. Padding lanes read
    as written zeros."""
    sums = CHUNK_WORDS + tl.cast(row, tl.int64) * (NUM_CHUNKS * 2)
    c = tl.arange(0, CHUNKS_P2)
    written_zero = 1 << 32
    sq_words = tl.load(sums + 2 * c, mask=c < NUM_CHUNKS, other=written_zero, volatile=True)
    gx_words = tl.load(sums + 2 * c + 1, mask=c < NUM_CHUNKS, other=written_zero, volatile=True)
    return sq_words, gx_words


@triton.jit
def _sum_row_words(sq_words, gx_words):
    """(how many words are not written yet, the row's sum of x^2, its sum of g*x), in one
    reduction."""
    unwritten = ((sq_words >> 32) == 0).to(tl.int32) + ((gx_words >> 32) == 0).to(tl.int32)
    sq = sq_words.to(tl.uint32).to(tl.float32, bitcast=True)
    gx = gx_words.to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.reduce((unwritten, sq, gx), 0, _add_three)


@triton.jit
def _row_stats(CHUNK_WORDS, row, sq_words, gx_words, N, eps, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """inv_rms and mean(g * x) * inv_rms of row from a first look at its words
    (_load_row_words), looking again until every slice has written its chunks'."""
    unwritten, sq, gx = _sum_row_words(sq_words, gx_words)
    while unwritten > 0:
        sq_words, gx_words = _load_row_words(CHUNK_WORDS, row, NUM_CHUNKS, CHUNKS_P2)
        unwritten, sq, gx = _sum_row_words(sq_words, gx_words)
    inv = inv_rms(sq, N, eps)
    return inv, gx / N * inv


@triton.jit(do_not_specialize=["n_rows", "rows_per_partial", "num_partials", "num_groups"])
def rms_norm_bwd_exchange_kernel(DY, X, W, DX, DRES, CHUNK_WORDS, PARTIAL, DW,
                                 n_rows, N, rows_per_partial, num_partials, num_groups, eps, weight_offset,
                                 BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                                 CHUNKS_P2: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr,
                                 TREE: tl.constexpr):
    """dx of rows split into slices of CHUNKS chunks of BLOCK_N columns, a program per slice
    of a group's rows, and the slices' pieces of the dW partials (see the module docstring).
    Group program_id(0) // SLICES takes partials group, group + num_groups, ...; with TREE and
    one partial it stores dW itself. CHUNK_WORDS is [n_rows, NUM_CHUNKS, 2] int64, zero at
    the launch; CHUNKS_P2 is NUM_CHUNKS rounded up to a power of two."""
    SLICES: tl.constexpr = (NUM_CHUNKS + CHUNKS - 1) // CHUNKS
    pid = tl.program_id(0)
    chunks = (pid % SLICES) * CHUNKS + tl.arange(0, CHUNKS)
    cols = chunks[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    w = cols  # unused without a weight
    if HAS_WEIGHT:
        w = to_f32(tl.load(W + cols, mask=cols < N, other=0.0)) + weight_offset
    for p in range(pid // SLICES, num_partials, num_groups):
        row_start = p * rows_per_partial
        row_end = tl.minimum(row_start + rows_per_partial, n_rows)
        dw_acc = tl.zeros([CHUNKS, BLOCK_N], dtype=tl.float32)
        # Step ``row`` loads row + 3, publishes row + 2 (loaded a step earlier) and finishes
        # row (published two steps earlier, so the other slices' sums are there by then):
        # the loads of each row have a whole step to arrive, and the row's words are looked
        # at before the publishing, in flight with it (after it: fp32 N=65536 M=1024 223 ->
        # 235 us on H200). Publishing one step ahead (three rows held) lost to this: bf16
        # N=65536 M=16384 2564 vs 1871 us, mostly in looking again for words not yet there.
        x, dy = _load_slice(X, DY, row_start, row_end, cols, N)
        x1, dy1 = _load_slice(X, DY, row_start + 1, row_end, cols, N)
        x2, dy2 = _load_slice(X, DY, row_start + 2, row_end, cols, N)
        _publish_chunk_sums(CHUNK_WORDS, x, dy, w, row_start, chunks, NUM_CHUNKS, HAS_WEIGHT)
        if row_start + 1 < row_end:
            _publish_chunk_sums(CHUNK_WORDS, x1, dy1, w, row_start + 1, chunks, NUM_CHUNKS, HAS_WEIGHT)
        for row in range(row_start, row_end):
            x3, dy3 = _load_slice(X, DY, row + 3, row_end, cols, N)
            sq_words, gx_words = _load_row_words(CHUNK_WORDS, row, NUM_CHUNKS, CHUNKS_P2)
            if row + 2 < row_end:
                _publish_chunk_sums(CHUNK_WORDS, x2, dy2, w, row + 2, chunks, NUM_CHUNKS, HAS_WEIGHT)
            inv, c = _row_stats(CHUNK_WORDS, row, sq_words, gx_words, N, eps, NUM_CHUNKS, CHUNKS_P2)
            g = _weighted_grad_held(dy, w, HAS_WEIGHT)
            offs = tl.cast(row, tl.int64) * N + cols
            dw_acc += _store_dx(to_f32(x), to_f32(dy), g, inv, c, DX, DRES, offs, cols < N, HAS_DRES)
            x, dy, x1, dy1, x2, dy2 = x1, dy1, x2, dy2, x3, dy3
        if HAS_WEIGHT:
            if TREE and num_partials == 1:
                tl.store(DW + cols, round_to(dw_acc, DW.dtype.element_ty), mask=cols < N)
            else:
                tl.store(PARTIAL + tl.cast(p, tl.int64) * N + cols, dw_acc, mask=cols < N)


def _rms_norm_bwd_chunked(cfg: NormConfig, plan: DwPlan, operands: dict, n_rows: int, n: int, eps: float,
                          weight_offset: float, has_weight: bool, has_dres: bool, tree: bool) -> None:
    """The chunked rows' backward (rms_norm_bwd_exchange_kernel); with ``tree`` (DwPlan
    "tree": one partial) it stores dW itself."""
    x = operands["X"]
    chunks, slices = exchange_slicing(cfg.bwd_num_chunks, x.device)
    resident = 1 if INTERPRETER else _resident_programs(x.device.index, EXCHANGE_WARPS, EXCHANGE_MAX_REGISTERS)
    num_groups = min(plan.num_partials, max(1, resident // slices))
    chunk_words = torch.zeros((n_rows, cfg.bwd_num_chunks, 2), dtype=torch.int64, device=x.device)
    rms_norm_bwd_exchange_kernel[(num_groups * slices,)](
        **operands, CHUNK_WORDS=chunk_words, n_rows=n_rows, N=n,
        rows_per_partial=plan.rows_per_partial, num_partials=plan.num_partials, num_groups=num_groups, eps=eps,
        weight_offset=weight_offset, BLOCK_N=cfg.bwd_block_n, CHUNKS=chunks, NUM_CHUNKS=cfg.bwd_num_chunks,
        CHUNKS_P2=triton.next_power_of_2(cfg.bwd_num_chunks),
        HAS_WEIGHT=has_weight, HAS_DRES=has_dres, TREE=tree, num_warps=EXCHANGE_WARPS,
        maxnreg=EXCHANGE_MAX_REGISTERS, launch_cooperative_grid=True, **EXACT_FP,
    )
