"""RMSNorm backward: the math on one loaded piece of rows, shared by both backward paths.

A piece is ``[ROWS, W]``: a tile of rows held in registers, or one of a row's two pieces
(``NormConfig.bwd_tail_n``), in ``norm_bwd``; one chunk of one long row in
``norm_bwd_chunked``. It has a module of its own because ``norm_bwd`` launches the chunked
path, which needs it too.
"""

import triton
import triton.language as tl

from tpfuse.kernels.common import _INTERPRETER, round_to, to_f32


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _weighted_grad(dy, W, cols, N, weight_offset, HAS_WEIGHT: tl.constexpr, CACHE: tl.constexpr,
                   PER_ROW: tl.constexpr):
    """g = dy * (w + weight_offset) at cols, in fp32. The weight is re-read per tile (an L1
    hit): hoisted out of the row loop it cost N=4096 85% -> 71% of copy bandwidth on H200.
    CACHE is the load's cache modifier. With PER_ROW (tiles whose warps take rows:
    norm.warps_take_rows) it is read per row of the tile, so that its load has the tile's
    layout. Read once as [1, W] there, its load set the layout of the whole tile: x and dy were
    converted to it through shared memory every tile, and a row's reduction crossed warps
    (benchmarks/NOTES.md, 2026-11-25). Elsewhere (with a weight of the rows' dtype) the two
    layouts agree, and reading per row only loads the weight more often (bf16 N=1024 on 4 warps, us, per row -> once: M=16 3.36 ->
    3.19, M=128 5.26 -> 4.98)."""
    g = to_f32(dy)
    if HAS_WEIGHT:
        wcols = tl.broadcast_to(cols, g.shape) if PER_ROW else cols
        g = g * (to_f32(tl.load(W + wcols, mask=wcols < N, other=0.0, cache_modifier=CACHE)) + weight_offset)
    return g


@triton.jit
def _bwd_row_sums(x, g, JOINT_REDUCE: tl.constexpr):
    """Per-row sums of x^2 and g*x. With JOINT_REDUCE they share one reduction: one round of
    cross-warp synchronisation per row instead of two. JOINT_REDUCE comes from N and the dtype
    (NormConfig), never from the rows, so a row's bits do not depend on the batch either way.
    The interpreter folds a tuple reduction element by element in Python (97 of 106 s of a
    16 x 5120 backward test) but tl.sum in one numpy call: there it takes the two sums."""
    if JOINT_REDUCE and not _INTERPRETER:
        sq, gx = tl.reduce((x * x, g * x), 1, _add_pair)
    else:
        sq = tl.sum(x * x, axis=1)
        gx = tl.sum(g * x, axis=1)
    return sq, gx


@triton.jit
def _store_dx(x, dy, g, inv, c, DX, DRES, offs, mask, HAS_DRES: tl.constexpr):
    """DX[offs] = inv * (g - x * inv * c) (+ DRES[offs]) of one piece; returns dy * x_hat."""
    dx = inv * (g - x * inv * c)
    if HAS_DRES:
        dx += to_f32(tl.load(DRES + offs, mask=mask, other=0.0))
    tl.store(DX + offs, round_to(dx, DX.dtype.element_ty), mask=mask)
    return dy * x * inv


@triton.jit
def _load_piece(X, DY, rows, row_end, cols, N):
    """x and dy of one piece of a tile: rows [ROWS] (masked from row_end), cols [1, W]."""
    mask = (rows < row_end)[:, None] & (cols < N)
    offs = rows.to(tl.int64)[:, None] * N + cols
    return tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0), offs, mask
