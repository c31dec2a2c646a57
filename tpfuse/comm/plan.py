"""How an all-reduce of a given size runs: algorithm and launch shape, in one place.

Everything here is derived from (numel, dtype, workspace layout, knobs), which every rank
has identically (a ``Communicator`` checks that its ranks' knobs agree), so every rank
launches the identical grid (docs/design.md 2.5). The knobs (``tpfuse.comm.knobs.Knobs``:
size thresholds, launch shapes) are data passed in, never module state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpfuse.comm.knobs import Knobs
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout
from tpfuse.kernels.common import TRITON_DIVISIBILITY
from tpfuse.kernels.fused import lamport_tiling, ll_pieces, rows_pieces
from tpfuse.kernels.norm import NormConfig

MAX_BLOCKS = 128
"""Flag slots per phase in the workspace: every grid must fit."""
MAX_ELEMENTS = 2**31 - 1
"""Kernels index elements with int32."""


ALGOS = ("auto", "oneshot", "twoshot", "nccl")


def workspace_layout(knobs: Knobs, max_bytes: int) -> WorkspaceLayout:
    """A communicator's workspace: two-shot to max_bytes, one-shot to its slots' capacity, and
    LL regions for LL words up to the largest of the LL knobs (all-reduce, fused, fused wide),
    for Lamport words up to lamport_max_bytes, and rows regions up to fused_rows_max_bytes
    (each at most the one-shot capacity)."""
    world_size = knobs.world_size
    oneshot_capacity = WorkspaceLayout(world_size, max_bytes, MAX_BLOCKS).oneshot_slot_bytes
    ll = max(knobs.ll_max_bytes, knobs.fused_ll_max_bytes, knobs.fused_wide_ll_max_bytes)
    return WorkspaceLayout(world_size, max_bytes, MAX_BLOCKS, min(ll, oneshot_capacity),
                           min(knobs.lamport_max_bytes, oneshot_capacity),
                           min(knobs.fused_rows_max_bytes, oneshot_capacity))


def oneshot_protocol(nbytes: int, knobs: Knobs, layout: WorkspaceLayout) -> str:
    """One-shot's protocol for a message of nbytes: "ll" up to ll_max_bytes, "lamport" up to
    lamport_max_bytes, else "flags" (each within the workspace's capacity)."""
    if nbytes <= min(layout.ll_max_bytes, knobs.ll_max_bytes):
        return "ll"
    if nbytes <= min(layout.lamport_max_bytes, knobs.lamport_max_bytes):
        return "lamport"
    return "flags"


def tile_and_warps(knobs: Knobs, kind: str, nbytes: int) -> tuple[int, int]:
    """(tile bytes, warps) of the launch ``kind`` (``tpfuse.comm.knobs.LAUNCH_KINDS``) for a
    message of nbytes: its launch shape's, but for one-shot over Lamport words, whose tile
    grows with the message (``Knobs.oneshot_lamport``)."""
    launch = knobs.launch(kind)
    if kind != "oneshot_lamport":
        return launch.tile_bytes, launch.num_warps
    per_tile = nbytes // (knobs.lamport_tiles_per_cta * launch.max_ctas)
    tile = min(launch.max_tile_bytes, max(launch.tile_bytes, 1 << max(per_tile.bit_length() - 1, 0)))  # a power of 2
    return tile, max(1, min(launch.num_warps, tile // 512))  # 32 threads x 16 bytes per warp


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {', '.join(map(repr, ALGOS))}, got {algo!r}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AllReducePlan:
    """Algorithm and launch shape of one all-reduce.

    algo: "oneshot", "twoshot" or "nccl" (the group's backend: NCCL on GPUs, gloo on CPU);
    reason: why "nccl" was chosen (empty otherwise); block: elements per tile; grid: CTAs;
    chunk: elements of each rank's share (two-shot; a multiple of ALIGN bytes); gather:
    two-shot's all-gather mode (``Knobs.gather``); protocol: one-shot's, "ll", "lamport" or "flags"
    (``oneshot_protocol``; "flags" for every other algorithm).
    """

    algo: str
    block: int = 0
    grid: int = 0
    num_warps: int = 8
    chunk: int = 0
    gather: str = "push"
    protocol: str = "flags"
    reason: str = ""

    @classmethod
    def from_numel(cls, numel: int, dtype: torch.dtype, layout: WorkspaceLayout | None, knobs: Knobs,
                   algo: str = "auto") -> "AllReducePlan":
        """The plan for an all-reduce of ``numel`` elements of ``dtype`` over
        ``knobs.world_size`` ranks whose workspaces have ``layout`` (None: no peer workspace).

        ``algo="auto"`` picks one-shot up to oneshot_max_bytes (its protocol by size:
        ``oneshot_protocol``), else two-shot, else the backend from nccl_min_bytes on (never,
        by default) or when the message does not fit the workspace. An explicit "oneshot" or
        "twoshot" that the workspace cannot serve raises ValueError.
        """
        check_algo(algo)
        if algo == "nccl":
            return cls("nccl", reason="algo='nccl' was requested")
        if layout is None:
            if algo == "auto":
                return cls("nccl", reason="no peer workspace")
            raise ValueError(f"algo={algo!r} needs a peer workspace, and this communicator has none")
        world_size, esize = knobs.world_size, dtype.itemsize
        nbytes = numel * esize
        align = ALIGN // esize
        chunk = _cdiv(_cdiv(numel, world_size), align) * align
        fits = {
            "oneshot": nbytes <= layout.oneshot_slot_bytes,
            "twoshot": chunk * esize <= layout.twoshot_slot_bytes,
        }
        if algo == "auto":
            small = nbytes <= knobs.oneshot_max_bytes
            nccl_min = knobs.nccl_min_bytes
            if nccl_min is not None and nbytes >= nccl_min:
                return cls("nccl", reason=f"messages of {nccl_min} bytes and more go to the backend (nccl_min_bytes)")
            algo = "oneshot" if small and fits["oneshot"] else "twoshot"
            if not fits[algo] or numel > MAX_ELEMENTS:
                return cls("nccl", reason=f"messages too large for the workspace (max_bytes={layout.max_bytes})")
        elif not fits[algo] or numel > MAX_ELEMENTS:
            cap = layout.oneshot_slot_bytes if algo == "oneshot" else layout.max_bytes
            raise ValueError(f"algo={algo!r} serves messages up to about {cap} bytes with this workspace "
                             f"(max_bytes={layout.max_bytes}); got {nbytes} bytes. Create the Communicator "
                             "with a larger max_bytes, or use algo='auto'")
        protocol = oneshot_protocol(nbytes, knobs, layout) if algo == "oneshot" else "flags"
        kind = f"oneshot_{protocol}" if protocol != "flags" else algo
        tile_bytes, num_warps = tile_and_warps(knobs, kind, nbytes)
        block = tile_bytes // esize
        tiles = _cdiv(numel if algo == "oneshot" else chunk, block)
        grid = max(1, min(tiles, knobs.launch(kind).max_ctas, layout.max_blocks))
        if algo == "oneshot":
            return cls(algo, block=block, grid=grid, num_warps=num_warps, protocol=protocol)
        return cls(algo, block=block, grid=grid, num_warps=num_warps, chunk=chunk, gather=knobs.gather)


# ---- Fused all-reduce + residual add + RMSNorm (Communicator.all_reduce_add_rms_norm). The
# fused kernels (tpfuse.kernels.fused) take the norm's tile shape and warps, fixed by (N,
# dtype), so only the algorithm and the grid are chosen here.
FUSED_WIDE_TILE = (8192, torch.bfloat16)
"""(hidden, dtype) of the row on which `tpfuse tune` measures the fused_wide_* thresholds;
calls whose norm tile is that row's (bf16/fp16 hidden 6160-8192, fp32 2064-4096) take them in
place of the fused_* ones: a fused kernel's cost follows the norm's tile, split's does not, so
one threshold per kernel could not serve both widths. A table without fused_wide_* entries
gives wide rows its narrow values (``tpfuse.comm.tables.read_table``)."""
FUSED_HIDDEN_MULTIPLE = TRITON_DIVISIBILITY
"""The fused kernels serve hidden sizes that are multiples of this, the divisibility Triton
specialises on: for other sizes the compiler cannot prove rows 16-byte aligned, and the
fused kernels' row reduction may get another register layout than tpfuse.rms_norm's (seen
for fp16 N=1000 with tests/test_fused_layouts.py), which would change y's bits."""

FUSED_ALGOS = ("auto", "oneshot", "twoshot", "split")


def _tile(n: int, dtype: torch.dtype) -> tuple[int, ...]:
    """What a fused kernel's per-row work follows: the norm tile's bytes, tail bytes, chunks,
    rows and warps for rows of n elements of dtype."""
    cfg = NormConfig.from_shape(n, dtype)
    return cfg.block_n * dtype.itemsize, cfg.tail_n * dtype.itemsize, cfg.num_chunks, cfg.rows, cfg.num_warps


@functools.lru_cache(maxsize=None)
def uses_wide_knobs(n: int, dtype: torch.dtype) -> bool:
    """Whether fused calls on rows of n elements of dtype take the fused_wide_* thresholds:
    their norm tile is FUSED_WIDE_TILE's. Cached: every fused call's plan asks, and the
    answer depends on the shape alone."""
    return _tile(n, dtype) == _tile(*FUSED_WIDE_TILE)


def fused_thresholds(knobs: Knobs, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(LL, Lamport, one-shot, two-shot) largest message bytes of the fused kernels for rows of
    n elements of dtype: the fused_wide_* knobs where ``uses_wide_knobs``, else the fused_* ones."""
    prefix = "fused_wide_" if uses_wide_knobs(n, dtype) else "fused_"
    return tuple(getattr(knobs, f"{prefix}{algo}_max_bytes") for algo in ("ll", "lamport", "oneshot", "twoshot"))


def check_fused_algo(algo: str) -> None:
    if algo not in FUSED_ALGOS:
        raise ValueError(f"algo must be one of {', '.join(map(repr, FUSED_ALGOS))}, got {algo!r}")


@dataclass(frozen=True)
class FusedPlan:
    """How one fused all-reduce + RMSNorm of [n_rows, n] runs.

    algo: "oneshot", "twoshot" or "split"; grid: CTAs; rows_per_group: rows each rank reduces
    in two-shot (rank g owns rows [g * rows_per_group, (g + 1) * rows_per_group); a multiple
    of the norm's tile rows, so no tile spans two owners); protocol: one-shot's, "ll",
    "lamport" or "flags" (as ``AllReducePlan.protocol``), or "rows" (``Knobs.fused_rows_max_bytes``);
    whole_tiles: over Lamport words, a CTA per whole row tile
    (``tpfuse.kernels.fused.lamport_tiling``); piece_elems: row-wise, the elements of x each
    CTA stores; piece_words: over LL or Lamport words, the words of a piece
    (``tpfuse.kernels.fused.ll_pieces``); pieces: row-wise, over LL or Lamport words, the
    pieces of a row tile; norm: the norm's tile (None for "split"); reason: why "split" was
    chosen. From (n_rows, n, dtype, norm_dtype, layout, knobs) only, like ``AllReducePlan``.
    """

    algo: str
    grid: int = 0
    rows_per_group: int = 0
    protocol: str = "flags"
    whole_tiles: bool = False
    piece_elems: int = 0
    piece_words: int = 0
    pieces: int = 0
    norm: NormConfig | None = None
    reason: str = ""

    @classmethod
    def from_shape(cls, n_rows: int, n: int, dtype: torch.dtype, layout: WorkspaceLayout | None, knobs: Knobs,
                   algo: str = "auto", norm_dtype: torch.dtype | None = None) -> "FusedPlan":
        """dtype: x's, which sets the bytes moved; norm_dtype: the residual's and outputs',
        which sets the norm's tile (default dtype; fp32 partials with a 16-bit residual,
        ``tpfuse.kernels.fused``). The thresholds below count x's bytes.

        "auto" picks one-shot up to fused_oneshot_max_bytes (row-wise up to
        fused_rows_max_bytes where the tile allows, over LL up to fused_ll_max_bytes, over
        Lamport words up to fused_lamport_max_bytes; above those with flags, for hidden sizes
        with at most fused_oneshot_max_vectors vectors per thread, or once the call has
        fused_max_ctas row tiles), two-shot up to fused_twoshot_max_bytes, else "split" (also
        when the workspace cannot hold the message, or n is not a multiple of
        FUSED_HIDDEN_MULTIPLE). Rows whose norm tile is FUSED_WIDE_TILE's use the fused_wide_*
        twins of these knobs. An explicit "oneshot" or "twoshot" that cannot serve the shape
        raises ValueError."""
        check_fused_algo(algo)
        if algo == "split":
            return cls("split", reason="algo='split' was requested")
        if layout is None:
            if algo == "auto":
                return cls("split", reason="no peer workspace")
            raise ValueError(f"algo={algo!r} needs a peer workspace, and this communicator has none")
        if n % FUSED_HIDDEN_MULTIPLE:
            if algo == "auto":
                return cls("split", reason=f"hidden size {n} is not a multiple of {FUSED_HIDDEN_MULTIPLE}")
            raise ValueError(f"algo={algo!r} needs a hidden size that is a multiple of {FUSED_HIDDEN_MULTIPLE}, got "
                             f"{n}; use algo='auto' or 'split'")
        norm_dtype = norm_dtype or dtype
        cfg = NormConfig.from_shape(n, norm_dtype)
        tile_rows, world_size, max_ctas = cfg.rows, knobs.world_size, knobs.fused_max_ctas
        esize = dtype.itemsize
        nbytes = n_rows * n * esize
        rows_per_group = {"oneshot": n_rows, "twoshot": _cdiv(_cdiv(n_rows, world_size), tile_rows) * tile_rows}
        fits = {"oneshot": nbytes <= layout.oneshot_slot_bytes,
                "twoshot": rows_per_group["twoshot"] * n * esize <= layout.twoshot_slot_bytes}
        if n_rows * n > MAX_ELEMENTS:
            fits = {"oneshot": False, "twoshot": False}
        tiling = lamport_tiling(n, dtype, _cdiv(n_rows, tile_rows), max_ctas, norm_dtype)
        ll_max, lamport_max, oneshot_max, twoshot_max = fused_thresholds(knobs, n, norm_dtype)
        piece_elems, pieces = rows_pieces(n, dtype, knobs.fused_rows_piece_bytes, norm_dtype)
        row_wise = (nbytes <= min(layout.rows_max_bytes, knobs.fused_rows_max_bytes)
                    and cfg.tail_n == 0 and cfg.num_chunks == 1
                    and cfg.rows * cfg.block_n * esize <= knobs.fused_rows_max_tile_bytes
                    and _cdiv(n_rows, tile_rows) * pieces <= min(max_ctas, layout.max_blocks))
        if row_wise:
            protocol = "rows"
        elif nbytes <= min(layout.ll_max_bytes, ll_max):
            protocol = "ll"
        elif nbytes <= min(layout.lamport_max_bytes, lamport_max) and tiling is not None:
            protocol = "lamport"
        else:
            protocol = "flags"
        if algo == "auto":
            vectors_per_thread = cfg.rows * cfg.block_n * esize // 16 / (cfg.num_warps * 32)
            flag_kernel_pays = (vectors_per_thread <= knobs.fused_oneshot_max_vectors
                                or _cdiv(n_rows, tile_rows) >= max_ctas)
            if nbytes <= oneshot_max and fits["oneshot"] and (protocol != "flags" or flag_kernel_pays):
                algo = "oneshot"
            elif nbytes <= twoshot_max and fits["twoshot"]:
                algo = "twoshot"
            else:
                return cls("split", reason="message above the fused kernels' sizes or the workspace")
        elif not fits[algo]:
            raise ValueError(f"algo={algo!r} cannot serve {n_rows} x {n} {dtype} with this workspace "
                             f"(max_bytes={layout.max_bytes}); create the Communicator with a larger max_bytes, "
                             "or use algo='auto' or 'split'")
        protocol = protocol if algo == "oneshot" else "flags"
        work = _cdiv(rows_per_group[algo], tile_rows)  # row tiles
        whole_tiles = protocol == "lamport" and tiling == "whole"
        if protocol == "rows":  # one piece per CTA
            return cls(algo, grid=work * pieces, rows_per_group=n_rows, protocol=protocol, piece_elems=piece_elems,
                       pieces=pieces, norm=cfg)
        piece_words = pieces = 0
        if protocol != "flags":  # the kernel's pieces (tpfuse.kernels.fused), which any CTA may take
            piece_words, pieces = ll_pieces(n, dtype, protocol, whole_tiles, norm_dtype)
            work *= pieces
        grid = max(1, min(work, max_ctas, layout.max_blocks))
        return cls(algo, grid=grid, rows_per_group=rows_per_group[algo], protocol=protocol, whole_tiles=whole_tiles,
                   piece_words=piece_words, pieces=pieces, norm=cfg)


@dataclass(frozen=True)
class SequenceParallelPlan:
    """How one sequence-parallel call (``reduce_scatter_add_rms_norm`` or ``all_gather``) of
    rows_per_rank rows of hidden size n per rank runs (``tpfuse.kernels.sequence_parallel``):
    grid CTAs, each taking the row tiles of ``norm`` (the norm's tile, shared by both calls)
    b, b + grid, ... From the shape, the layout and the knobs only."""

    rows_per_rank: int
    grid: int
    norm: NormConfig

    @classmethod
    def from_shape(cls, rows_per_rank: int, n: int, dtype: torch.dtype, layout: WorkspaceLayout | None,
                   knobs: Knobs) -> "SequenceParallelPlan":
        """ValueError where the workspace cannot serve the call: no workspace, a hidden size
        that is not a multiple of FUSED_HIDDEN_MULTIPLE, or a rank's rows over a two-shot
        slot (the whole message over ``max_bytes``). Never a fallback: another path could
        give other bits."""
        if layout is None:
            raise ValueError("the sequence-parallel collectives need a peer workspace, and this communicator has none")
        if n % FUSED_HIDDEN_MULTIPLE:
            raise ValueError(f"the sequence-parallel collectives need a hidden size that is a multiple of "
                             f"{FUSED_HIDDEN_MULTIPLE}, got {n}")
        if rows_per_rank * n * dtype.itemsize > layout.twoshot_slot_bytes or rows_per_rank * n * knobs.world_size > MAX_ELEMENTS:
            raise ValueError(f"{knobs.world_size} x {rows_per_rank} rows of {n} {dtype} exceed this workspace "
                             f"(max_bytes={layout.max_bytes}): create the Communicator with a larger max_bytes")
        cfg = NormConfig.from_shape(n, dtype)
        grid = max(1, min(_cdiv(rows_per_rank, cfg.rows), knobs.fused_max_ctas, layout.max_blocks))
        return cls(rows_per_rank, grid, cfg)
