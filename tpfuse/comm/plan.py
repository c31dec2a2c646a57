"""How an all-reduce of a given size runs: algorithm and launch shape, in one place.

Everything here is derived from (numel, world size, dtype, workspace layout), which every
rank has identically, so every rank launches the identical grid (docs/design.md 2.5).

The size thresholds keyed by world size (``tpfuse.comm.tables.SIZE_KNOBS``) are defaults
(W=8's entries, never measured, are guesses): a measured table of the world size and GPU
model (``tpfuse tune --write-table``) replaces them (``tpfuse.comm.tables``). CTA counts,
tiles and warps fit H200's and H100's 132 SMs. What chose each value is in
benchmarks/NOTES.md, "Knobs", under the knob's name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpfuse._runtime import INTERPRETER
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout
from tpfuse.kernels.common import TRITON_DIVISIBILITY
from tpfuse.kernels.fused import lamport_tiling, ll_pieces, rows_pieces
from tpfuse.kernels.norm import NormConfig

KiB = 1024

# ---- The all-reduce's knobs. The size thresholds keyed by world size are defaults that a
# measured table replaces (tpfuse.comm.tables); what chose each value: benchmarks/NOTES.md,
# "Knobs", under the knob's name.
ONESHOT_MAX_BYTES = {2: 512 * KiB, 4: 512 * KiB, 8: 128 * KiB}
"""Largest message "auto" sends to one-shot (then two-shot), by world size (others: W=8's)."""
LL_MAX_BYTES = ({2: 128 * KiB, 4: 128 * KiB, 8: 64 * KiB} if not INTERPRETER else
                {2: 64 * KiB, 4: 64 * KiB, 8: 64 * KiB})
"""Largest one-shot message over LL words (tpfuse.kernels.ll): no fence and no flag round
trip, for twice the bytes on the links. With the fused LL knobs and LAMPORT_MAX_BYTES it sizes
the workspace's LL regions (``workspace_layout``). The interpreter's keeps the protocols inside
the CPU tests' sizes."""
LAMPORT_MAX_BYTES = ({2: 0, 4: 0, 8: 0} if not INTERPRETER else
                     {2: 256 * KiB, 4: 256 * KiB, 8: 128 * KiB})
"""Largest one-shot message over Lamport words (the data is its own flag), above LL's; 0
(never) until measured at that world size."""
NCCL_MIN_BYTES: dict[int, int | None] = {2: None, 4: None, 8: None}
"""Smallest message "auto" hands to the group's backend; None: never. Setting it trades the
bitwise contract for speed on large messages, so a person decides it: no table sets it."""
TILE_BYTES = ({"oneshot": 8 * KiB, "oneshot_ll": 1 * KiB, "oneshot_lamport": (2 * KiB, 16 * KiB), "twoshot": 8 * KiB}
              if not INTERPRETER else
              {"oneshot": 64 * KiB, "oneshot_ll": 64 * KiB, "oneshot_lamport": (64 * KiB, 64 * KiB),
               "twoshot": 64 * KiB})
"""Bytes of a tile per launch knob (one-shot over Lamport words: a range, ``tile_and_warps``).
8 KiB is 512 threads of one 16-byte vector; LL words carry 4 data bytes in 8; the interpreter
pays per operation, not per element, so it takes large tiles."""
NUM_WARPS = {"oneshot": 16, "oneshot_ll": 4, "oneshot_lamport": 16, "twoshot": 16}
"""Warps per CTA per launch knob (one-shot over Lamport words: at most)."""
LAMPORT_TILES_PER_CTA = 1
"""One-shot over Lamport words cuts a message into tiles of nbytes / (this * MAX_CTAS), a
power of two within TILE_BYTES's range, with a warp per 512 bytes of tile."""
MAX_CTAS = ({"oneshot": 32, "oneshot_ll": 64, "oneshot_lamport": 128, "twoshot": 128} if not INTERPRETER else
            {"oneshot": 4, "oneshot_ll": 4, "oneshot_lamport": 4, "twoshot": 4})
"""CTAs per call per launch knob. Every CTA of a grid must be resident at once (block b waits
for block b of every peer, tpfuse.kernels.sync), so a grid stays at or below the SM count at
one CTA per SM, and within MAX_BLOCKS. The interpreter runs blocks one after another, each a
flag round: few large blocks are fastest there."""
GATHER = "push"
"""Two-shot's all-gather: "push" stores each reduced chunk into every peer's gather slot
(posted remote stores, local polls, one local copy); "pull" has every peer load it from the
owner's slot into its output (remote loads, no copy)."""
GATHER_MODES = ("push", "pull")
MAX_BLOCKS = 128
"""Flag slots per phase in the workspace: every grid above must fit."""
MAX_ELEMENTS = 2**31 - 1
"""Kernels index elements with int32."""


ALGOS = ("auto", "oneshot", "twoshot", "nccl")


def for_world(knob: dict, world_size: int):
    """A knob keyed by world size, at ``world_size``: its own entry, else W=8's."""
    return knob.get(world_size, knob[8])


def workspace_layout(world_size: int, max_bytes: int) -> WorkspaceLayout:
    """A communicator's workspace: two-shot to max_bytes, one-shot to its slots' capacity, and
    LL regions for LL words up to the largest of LL_MAX_BYTES and the fused LL knobs and for
    Lamport words up to LAMPORT_MAX_BYTES, and rows regions up to FUSED_ROWS_MAX_BYTES, as the
    knobs are now (each at most the one-shot capacity)."""
    oneshot_capacity = WorkspaceLayout(world_size, max_bytes, MAX_BLOCKS).oneshot_slot_bytes
    ll = max(for_world(knob, world_size) for knob in (LL_MAX_BYTES, FUSED_LL_MAX_BYTES, FUSED_WIDE_LL_MAX_BYTES))
    return WorkspaceLayout(world_size, max_bytes, MAX_BLOCKS, min(ll, oneshot_capacity),
                           min(for_world(LAMPORT_MAX_BYTES, world_size), oneshot_capacity),
                           min(for_world(FUSED_ROWS_MAX_BYTES, world_size), oneshot_capacity))


def uses_ll(nbytes: int, world_size: int, layout: WorkspaceLayout) -> bool:
    """Whether a one-shot message of nbytes goes over LL: LL_MAX_BYTES as it is now (tuning
    scripts lower it at run time), within the LL capacity of the workspace."""
    return nbytes <= min(layout.ll_max_bytes, for_world(LL_MAX_BYTES, world_size))


def oneshot_protocol(nbytes: int, world_size: int, layout: WorkspaceLayout) -> str:
    """One-shot's protocol for a message of nbytes: "ll" up to LL_MAX_BYTES, "lamport" up to
    LAMPORT_MAX_BYTES, else "flags" (each as it is now, within the workspace's capacity)."""
    if uses_ll(nbytes, world_size, layout):
        return "ll"
    if nbytes <= min(layout.lamport_max_bytes, for_world(LAMPORT_MAX_BYTES, world_size)):
        return "lamport"
    return "flags"


def tile_and_warps(knob: str, nbytes: int) -> tuple[int, int]:
    """(tile bytes, warps) of the launch knob ``knob`` (a key of TILE_BYTES) for a message of
    nbytes: TILE_BYTES's and NUM_WARPS's entries, but for one-shot over Lamport words, whose
    tile grows with the message (LAMPORT_TILES_PER_CTA)."""
    if knob != "oneshot_lamport":
        return TILE_BYTES[knob], NUM_WARPS[knob]
    smallest, largest = TILE_BYTES[knob]
    per_tile = nbytes // (LAMPORT_TILES_PER_CTA * MAX_CTAS[knob])
    tile = min(largest, max(smallest, 1 << max(per_tile.bit_length() - 1, 0)))  # a power of two
    return tile, max(1, min(NUM_WARPS[knob], tile // 512))  # 32 threads x 16 bytes per warp


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
    two-shot's all-gather mode (see GATHER); protocol: one-shot's, "ll", "lamport" or "flags"
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
    def from_numel(cls, numel: int, world_size: int, dtype: torch.dtype, layout: WorkspaceLayout | None,
                   algo: str = "auto") -> "AllReducePlan":
        """The plan for an all-reduce of ``numel`` elements of ``dtype`` over ``world_size``
        ranks whose workspaces have ``layout`` (None: no peer workspace).

        ``algo="auto"`` picks one-shot up to ONESHOT_MAX_BYTES (its protocol by size:
        ``oneshot_protocol``), else two-shot, else the
        backend from NCCL_MIN_BYTES on (never, by default) or when the message does not fit
        the workspace. An explicit "oneshot" or
        "twoshot" that the workspace cannot serve raises ValueError.
        """
        check_algo(algo)
        if algo == "nccl":
            return cls("nccl", reason="algo='nccl' was requested")
        if layout is None:
            if algo == "auto":
                return cls("nccl", reason="no peer workspace")
            raise ValueError(f"algo={algo!r} needs a peer workspace, and this communicator has none")
        esize = dtype.itemsize
        nbytes = numel * esize
        align = ALIGN // esize
        chunk = _cdiv(_cdiv(numel, world_size), align) * align
        fits = {
            "oneshot": nbytes <= layout.oneshot_slot_bytes,
            "twoshot": chunk * esize <= layout.twoshot_slot_bytes,
        }
        if algo == "auto":
            small = nbytes <= for_world(ONESHOT_MAX_BYTES, world_size)
            nccl_min = for_world(NCCL_MIN_BYTES, world_size)
            if nccl_min is not None and nbytes >= nccl_min:
                return cls("nccl", reason=f"messages of {nccl_min} bytes and more go to the backend (NCCL_MIN_BYTES)")
            algo = "oneshot" if small and fits["oneshot"] else "twoshot"
            if not fits[algo] or numel > MAX_ELEMENTS:
                return cls("nccl", reason=f"messages too large for the workspace (max_bytes={layout.max_bytes})")
        elif not fits[algo] or numel > MAX_ELEMENTS:
            cap = layout.oneshot_slot_bytes if algo == "oneshot" else layout.max_bytes
            raise ValueError(f"algo={algo!r} serves messages up to about {cap} bytes with this workspace "
                             f"(max_bytes={layout.max_bytes}); got {nbytes} bytes. Create the Communicator "
                             "with a larger max_bytes, or use algo='auto'")
        protocol = oneshot_protocol(nbytes, world_size, layout) if algo == "oneshot" else "flags"
        knob = f"oneshot_{protocol}" if protocol != "flags" else algo
        tile_bytes, num_warps = tile_and_warps(knob, nbytes)
        block = tile_bytes // esize
        tiles = _cdiv(numel if algo == "oneshot" else chunk, block)
        grid = max(1, min(tiles, MAX_CTAS[knob], layout.max_blocks))
        if algo == "oneshot":
            return cls(algo, block=block, grid=grid, num_warps=num_warps, protocol=protocol)
        if GATHER not in GATHER_MODES:
            raise ValueError(f"GATHER must be one of {GATHER_MODES}, got {GATHER!r}")
        return cls(algo, block=block, grid=grid, num_warps=NUM_WARPS[algo], chunk=chunk, gather=GATHER)


# ---- Fused all-reduce + residual add + RMSNorm (Communicator.all_reduce_add_rms_norm). The
# fused kernels (tpfuse.kernels.fused) take the norm's tile shape and warps, fixed by (N,
# dtype), so only the algorithm and the grid are chosen here. The FUSED_* size knobs are
# measured at hidden 4096 bf16 by `tpfuse tune`, their FUSED_WIDE_* twins at hidden 8192; what
# chose each value: benchmarks/NOTES.md, "Knobs".
FUSED_ONESHOT_MAX_BYTES = {2: 512 * KiB, 4: 512 * KiB, 8: 128 * KiB}
"""Largest message (x's bytes) "auto" sends to the fused one-shot with flags, by world size,
for norm tiles of at most FUSED_ONESHOT_MAX_VECTORS vectors per thread (a decode call is a CTA
per row tile, its per-thread work on the critical path); wider tiles only once the call has a
row tile for each of FUSED_MAX_CTAS CTAs."""
FUSED_ONESHOT_MAX_VECTORS = 4
"""The most 16-byte vectors per thread of a norm tile that the fused flag one-shot takes."""
FUSED_LL_MAX_BYTES = ({2: 128 * KiB, 4: 128 * KiB, 8: 64 * KiB} if not INTERPRETER else  # LL_MAX_BYTES's defaults
                      {2: 16 * KiB, 4: 16 * KiB, 8: 16 * KiB})
"""Largest message the fused one-shot sends over LL words (a row spread over several CTAs),
whatever the tile's vectors; a knob of its own, as it stops paying before the all-reduce's."""
FUSED_LAMPORT_MAX_BYTES = {2: 0, 4: 0, 8: 0} if not INTERPRETER else {2: 128 * KiB, 4: 128 * KiB, 8: 128 * KiB}
"""Largest message the fused one-shot sends over Lamport words, above LL's (whole row tiles or
pieces, ``tpfuse.kernels.fused.lamport_tiling``); 0 until measured at that world size."""
FUSED_TWOSHOT_MAX_BYTES = {2: 0, 4: 0, 8: 0}
"""Largest message "auto" sends to the fused two-shot; above every fused limit, "split"."""
FUSED_ROWS_MAX_BYTES = {2: 64 * KiB, 4: 0, 8: 0} if not INTERPRETER else {2: 1 * KiB, 4: 1 * KiB, 8: 1 * KiB}
"""Largest message the fused one-shot runs row-wise (protocol "rows", before LL's and
Lamport's): each CTA that stores a piece of a row tile polls the whole tile and normalises
it, storing only its piece; no count between CTAs. Only for tiles of at most
FUSED_ROWS_MAX_TILE_BYTES held without a tail. Not swept by `tpfuse tune`; it sizes the
workspace's rows regions."""
FUSED_ROWS_MAX_TILE_BYTES = 8 * KiB
"""The largest norm tile the row-wise kernel takes (each CTA polls all of it)."""
FUSED_ROWS_PIECE_BYTES = 1 * KiB if not INTERPRETER else 64 * KiB
"""Bytes of x each CTA of a row-wise call stores. The interpreter runs CTAs one after another,
so a CTA waiting for a piece a later CTA stores would wait for ever: a piece is a whole tile."""
FUSED_WIDE_TILE = (8192, torch.bfloat16)
"""(hidden, dtype) of the row on which `tpfuse tune` measures the FUSED_WIDE_* thresholds;
calls whose norm tile is that row's (bf16/fp16 hidden 6160-8192, fp32 2064-4096) take them in
place of the four above: a fused kernel's cost follows the norm's tile, split's does not, so
one threshold per kernel could not serve both widths. A table without FUSED_WIDE_* entries
gives wide rows its narrow values (``tpfuse.comm.tables.read_table``)."""
FUSED_WIDE_LL_MAX_BYTES = dict(FUSED_LL_MAX_BYTES)
FUSED_WIDE_LAMPORT_MAX_BYTES = dict(FUSED_LAMPORT_MAX_BYTES)
FUSED_WIDE_ONESHOT_MAX_BYTES = dict(FUSED_ONESHOT_MAX_BYTES)
FUSED_WIDE_TWOSHOT_MAX_BYTES = dict(FUSED_TWOSHOT_MAX_BYTES)
FUSED_MAX_CTAS = 128 if not INTERPRETER else 4
"""CTAs per fused call; every CTA resident at once, as for MAX_CTAS (the norm's tiles use at
most 32 warps)."""
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
    """Whether fused calls on rows of n elements of dtype take the FUSED_WIDE_* thresholds:
    their norm tile is FUSED_WIDE_TILE's. Cached: every fused call's plan asks, and the
    answer depends on the shape alone."""
    return _tile(n, dtype) == _tile(*FUSED_WIDE_TILE)


def fused_thresholds(world_size: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(LL, Lamport, one-shot, two-shot) largest message bytes of the fused kernels at
    ``world_size`` for rows of n elements of dtype: the FUSED_WIDE_* knobs where
    ``uses_wide_knobs``, else the FUSED_* ones (each as it is now)."""
    knobs = ((FUSED_WIDE_LL_MAX_BYTES, FUSED_WIDE_LAMPORT_MAX_BYTES, FUSED_WIDE_ONESHOT_MAX_BYTES,
              FUSED_WIDE_TWOSHOT_MAX_BYTES) if uses_wide_knobs(n, dtype) else
             (FUSED_LL_MAX_BYTES, FUSED_LAMPORT_MAX_BYTES, FUSED_ONESHOT_MAX_BYTES, FUSED_TWOSHOT_MAX_BYTES))
    return tuple(for_world(knob, world_size) for knob in knobs)


def check_fused_algo(algo: str) -> None:
    if algo not in FUSED_ALGOS:
        raise ValueError(f"algo must be one of {', '.join(map(repr, FUSED_ALGOS))}, got {algo!r}")


@dataclass(frozen=True)
class FusedPlan:
    """How one fused all-reduce + RMSNorm of [n_rows, n] runs.

    algo: "oneshot", "twoshot" or "split"; grid: CTAs; rows_per_group: rows each rank reduces
    in two-shot (rank g owns rows [g * rows_per_group, (g + 1) * rows_per_group); a multiple
    of the norm's tile rows, so no tile spans two owners); protocol: one-shot's, "ll",
    "lamport" or "flags" (as ``AllReducePlan.protocol``), or "rows" (FUSED_ROWS_MAX_BYTES);
    whole_tiles: over Lamport words, a CTA per whole row tile
    (``tpfuse.kernels.fused.lamport_tiling``); piece_elems: row-wise, the elements of x each
    CTA stores; reason: why "split" was chosen. From (n_rows, n, dtype, world size, layout)
    only, like ``AllReducePlan``.
    """

    algo: str
    grid: int = 0
    rows_per_group: int = 0
    protocol: str = "flags"
    whole_tiles: bool = False
    piece_elems: int = 0
    reason: str = ""

    @classmethod
    def from_shape(cls, n_rows: int, n: int, world_size: int, dtype: torch.dtype, layout: WorkspaceLayout | None,
                   algo: str = "auto") -> "FusedPlan":
        """"auto" picks one-shot up to FUSED_ONESHOT_MAX_BYTES (row-wise up to FUSED_ROWS_MAX_BYTES
        where the tile allows, over LL up to FUSED_LL_MAX_BYTES,
        over Lamport words up to FUSED_LAMPORT_MAX_BYTES; above those with flags, for hidden
        sizes with at most FUSED_ONESHOT_MAX_VECTORS vectors per thread, or once the call has
        FUSED_MAX_CTAS row tiles),
        two-shot up to FUSED_TWOSHOT_MAX_BYTES, else "split" (also when the workspace cannot
        hold the message, or n is not a multiple of FUSED_HIDDEN_MULTIPLE). Rows whose norm
        tile is FUSED_WIDE_TILE's use the FUSED_WIDE_* twins of these knobs. An explicit
        "oneshot" or "twoshot" that cannot serve the shape raises ValueError."""
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
        cfg = NormConfig.from_shape(n, dtype)
        tile_rows = cfg.rows
        esize = dtype.itemsize
        nbytes = n_rows * n * esize
        rows_per_group = {"oneshot": n_rows, "twoshot": _cdiv(_cdiv(n_rows, world_size), tile_rows) * tile_rows}
        fits = {"oneshot": nbytes <= layout.oneshot_slot_bytes,
                "twoshot": rows_per_group["twoshot"] * n * esize <= layout.twoshot_slot_bytes}
        if n_rows * n > MAX_ELEMENTS:
            fits = {"oneshot": False, "twoshot": False}
        tiling = lamport_tiling(n, dtype, _cdiv(n_rows, tile_rows), FUSED_MAX_CTAS)
        ll_max, lamport_max, oneshot_max, twoshot_max = fused_thresholds(world_size, n, dtype)
        piece_elems, pieces = rows_pieces(n, dtype, FUSED_ROWS_PIECE_BYTES)
        row_wise = (nbytes <= min(layout.rows_max_bytes, for_world(FUSED_ROWS_MAX_BYTES, world_size))
                    and cfg.tail_n == 0 and cfg.num_chunks == 1
                    and cfg.rows * cfg.block_n * esize <= FUSED_ROWS_MAX_TILE_BYTES
                    and _cdiv(n_rows, tile_rows) * pieces <= min(FUSED_MAX_CTAS, layout.max_blocks))
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
            flag_kernel_pays = (vectors_per_thread <= FUSED_ONESHOT_MAX_VECTORS
                                or _cdiv(n_rows, tile_rows) >= FUSED_MAX_CTAS)
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
            return cls(algo, grid=work * pieces, rows_per_group=n_rows, protocol=protocol, piece_elems=piece_elems)
        if protocol != "flags":  # the kernel's pieces (tpfuse.kernels.fused), which any CTA may take
            work *= ll_pieces(n, dtype, protocol, whole_tiles)[1]
        grid = max(1, min(work, FUSED_MAX_CTAS, layout.max_blocks))
        return cls(algo, grid=grid, rows_per_group=rows_per_group[algo], protocol=protocol, whole_tiles=whole_tiles)
