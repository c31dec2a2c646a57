"""How a quantized all-reduce runs: when it is used, its segments and launch shape.

Everything here is derived from (numel, world size, dtype, codec, workspace layout), which
every rank has identically, so every rank launches the identical sequence of grids
(docs/design.md 2.5).

**Segments.** A quantized call moves packed data through the same two-shot scatter and
gather slots as the exact all-reduce (``tpfuse.comm.workspace``). One launch serves at most
``W * seg_chunk`` elements: ``seg_chunk`` is the largest per-rank chunk whose packed form
fits a slot, fixed by the layout, dtype and codec and never by the message. A longer message
runs as consecutive launches over segments of that size (the last one shorter), each a full
protocol round with its own epoch; the packed planes inside a slot sit at offsets fixed by
``seg_chunk``, so no address depends on the message size. With the default 16 MiB
workspace at W=4 a slot holds 4 MiB: about 7.4 M bf16 elements per rank with int4, 3.9 M
with int8 or fp8, so a 512 MiB bf16 message runs in 9 (int4) to 17 (int8) launches.

**Groups.** Chunks are multiples of 32 elements (and of 256 bytes of the input), so the
groups of 32 that share a scale are the same consecutive elements of the flattened message
whatever the segmentation: ``tpfuse.reference.quantized_all_reduce`` does not know about
chunks or segments, and the kernels match it bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpfuse._runtime import INTERPRETER
from tpfuse.comm.plan import for_world
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout
from tpfuse.reference import QUANT_CODECS, QUANT_GROUP, packed_layout

MiB = 1024 * 1024


# ---- Tunable knobs, all in one place, first set on 4x H200 (2026-11-21, bf16, W=4). Tile,
# warps and CTAs from scripts/tune_quant.py (int4 at 32 / 256 MiB, us; NCCL 175 / 1184), with
# the fp32 codecs of commit 36cb75f: (4096, 8, 128) 79 / 634, (8192, 8, 128) 72 / 478,
# (8192, 16, 128) 68 / 449, (16384, 16, 128) 76 / 445, (16384, 32, 128) 75 / 427; the other
# codecs rank the same except that 32 warps never help them. Before (float64 codecs, commit
# 1a57e8d): (2048, 8, 128) 224 / 2049, (16384, 16, 128) 135 / 909, 64 CTAs half as fast.
# W=2's warps and small-tile limit come from 2x H200 (2026-11-26, the codecs of c9cdcd2,
# results/2xH200/tune_quant_w2.md), where 32 warps did help; W=4 and W=8 keep the 4x H200
# values (W=8's entries), as 32 warps were not measured there with today's codecs.
#
# QUANT_MIN_BYTES: smallest message (input bytes) that takes the quantized path when a
#   codec is requested, by codec and world size (other world sizes: W=8's); None = never.
#   Below it the exact path serves the call. W=4 from 4x H200 (2026-11-21, bf16, commit
#   2f9a6b6, benchmarks/results/allreduce_quant_w4_bf16.md): the smallest size from which
#   the codec beats both NCCL and the exact path at every larger size measured (int4 18.1 us
#   at 2 MiB vs exact 22.1 and NCCL 35.6; int8 and int6 from 4 MiB, where int8 30.3 us vs
#   exact 36.5; fp8 from 8 MiB, 50.1 vs 55.7: at 4 MiB it led the exact path by 1%, within
#   run-to-run noise). W=2 from 2 of the 4x H200's GPUs (commit f471ee6,
#   allreduce_quant_w2_bf16.md), the same crossovers: int4 12.9 us at 2 MiB vs exact 15.5 and
#   NCCL 32.3; int8 and int6 from 4 MiB (int8 19.6 vs exact 21.9); fp8 from 8 MiB (32.5 vs
#   33.9; at 4 MiB 23.2 vs 21.9). W=8 is not measured (no 8-GPU machine was available), so
#   there, and for world sizes without an entry, the codecs are never chosen by default.
#   ``quant_min_bytes=`` forces a codec from any size. These are the defaults: W reads
#   tables/w{W}.json when it exists (`tpfuse tune --write-table`, see tpfuse.comm.tables).
# QUANT_TILE: elements per tile (a multiple of 32: a tile is TILE / 32 groups), by codec.
#   fp8 keeps 8192 at every size: on 2x H100 (W=2, scripts/tune_quant.py, us,
#   tiles of 8192 / 16384 on every segment, 16 warps, 128 CTAs) fp8 took 85 / 90 at 32 MiB and
#   166 / 184 at 64 MiB while int8 took 76 / 75 and 145 / 137, int6 81 / 74 and 165 / 147,
#   int4 58 / 54 and 112 / 106 (2026-11-25). The interpreter pays per operation, so it
#   takes large tiles.
# QUANT_SMALL_TILE, QUANT_SMALL_TILE_MAX_CHUNK: segments of at most this many elements per
#   rank (by world size) use the smaller tile, so that every CTA still gets several tiles (at
#   32 MiB, W=4, a chunk of 4 M elements is 2 integer-codec tiles of 16384 per CTA; 8192 was
#   6-12% faster for every codec, 16384 0-5% faster at 256 MiB; 2026-11-21, after the fp32
#   codecs). At W=2, chunks over 4 M elements (a 32 MiB message, or a full segment of the
#   default workspace) take the large tile: int4 47 us at 32 MiB against 51 on 8192, int8 73
#   against 74, fp8 (whose large tile is 8192 too) 75 (2x H200, 32 warps).
# QUANT_NUM_WARPS, QUANT_SMALL_NUM_WARPS: warps per CTA on the large tile (by world size) and
#   on the small one. W=2 runs 32 on the large: on 2x H200 (us at 32 / 256 MiB, 16 -> 32
#   warps) int4 on 16384 48 / 334 -> 47 / 304, int6 68 / 505 -> 68 / 482, fp8 on 8192 81 /
#   634 -> 75 / 548, int8 on 16384 72 / 492 -> 73 / 495. 16 on the small: with 32 there, 1-8
#   MiB took 3-9% longer (int4 at 1 MiB 11.9 -> 13.0 us, `bench allreduce --quant` at 9f16fff).
# QUANT_MAX_CTAS: CTAs per launch; every CTA must be resident at once (see
#   tpfuse.kernels.sync), so it stays at or below the SM count (132 on H200).
QUANT_MIN_BYTES: dict[str, dict[int, int | None]] = {
    "int4": {2: 2 * MiB, 4: 2 * MiB, 8: None},
    "int6": {2: 4 * MiB, 4: 4 * MiB, 8: None},
    "int8": {2: 4 * MiB, 4: 4 * MiB, 8: None},
    "fp8": {2: 8 * MiB, 4: 8 * MiB, 8: None},
}
QUANT_TILE = (dict.fromkeys(QUANT_CODECS, 8192) if INTERPRETER else
              {"int4": 16384, "int6": 16384, "int8": 16384, "fp8": 8192})
QUANT_SMALL_TILE = 4096 if INTERPRETER else 8192
QUANT_SMALL_TILE_MAX_CHUNK = {8: 1 << 14} if INTERPRETER else {2: 1 << 22, 8: 1 << 23}
QUANT_NUM_WARPS = {2: 32, 8: 16}
QUANT_SMALL_NUM_WARPS = 16
QUANT_MAX_CTAS = 4 if INTERPRETER else 128


def check_quant(quant: str | None, quant_min_bytes: int | None) -> None:
    """Raise ValueError for an unknown codec or a bad quant_min_bytes (before any
    communication)."""
    if quant is not None and quant not in QUANT_CODECS:
        raise ValueError(f"quant must be None or one of {', '.join(map(repr, QUANT_CODECS))}, got {quant!r}")
    if quant_min_bytes is not None:
        if quant is None:
            raise ValueError("quant_min_bytes needs quant= (a codec)")
        if isinstance(quant_min_bytes, bool) or not isinstance(quant_min_bytes, int) or quant_min_bytes < 0:
            raise ValueError(f"quant_min_bytes must be an int >= 0, got {quant_min_bytes!r}")


def default_quant_min_bytes(codec: str, world_size: int) -> int | None:
    """The message size from which ``codec`` is used (QUANT_MIN_BYTES), None for never."""
    return for_world(QUANT_MIN_BYTES[codec], world_size)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QuantSegment:
    """One launch: elements [start, start + numel) of the message, ``chunk`` elements per
    rank, tiles of ``block`` elements on ``grid`` CTAs of ``num_warps`` warps."""

    start: int
    numel: int
    chunk: int
    block: int
    grid: int
    num_warps: int


@dataclass(frozen=True)
class QuantPlan:
    """Launch shape of quantized all-reduces of one (layout, dtype, codec).

    seg_chunk: elements per rank of a full segment; planes, scale_offset: byte offsets of the
    packed planes and scales inside every slot (``packed_layout`` of seg_chunk elements);
    block, small_block, small_max_chunk: elements per tile, ``small_block`` for segments of
    at most ``small_max_chunk`` elements per rank; num_warps, small_num_warps: warps per CTA
    on each; unit: chunks are multiples of it.
    """

    codec: str
    world_size: int
    seg_chunk: int
    planes: tuple[int, ...]
    scale_offset: int
    block: int
    small_block: int
    small_max_chunk: int
    unit: int
    num_warps: int
    small_num_warps: int
    max_ctas: int

    @classmethod
    def for_layout(cls, layout: WorkspaceLayout, dtype: torch.dtype, codec: str) -> "QuantPlan":
        """The plan for ``codec`` on messages of ``dtype`` over workspaces of ``layout``.
        Raises ValueError when a slot cannot hold even one chunk unit."""
        # Cached per knob values too, so that changing a knob (tests, tuning) takes effect.
        if codec not in QUANT_CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        world = layout.world_size
        return cls._build(layout, dtype, codec, QUANT_TILE[codec], QUANT_SMALL_TILE,
                          for_world(QUANT_SMALL_TILE_MAX_CHUNK, world), for_world(QUANT_NUM_WARPS, world),
                          QUANT_SMALL_NUM_WARPS, QUANT_MAX_CTAS)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _build(cls, layout: WorkspaceLayout, dtype: torch.dtype, codec: str, block: int, small_block: int,
               small_max_chunk: int, num_warps: int, small_num_warps: int, max_ctas: int) -> "QuantPlan":
        unit = max(QUANT_GROUP, ALIGN // dtype.itemsize)
        if block % unit or small_block % unit:
            raise ValueError(f"QUANT_TILE[{codec!r}]={block} and QUANT_SMALL_TILE={small_block} must be multiples of "
                             f"{unit}")
        slot = layout.twoshot_slot_bytes
        # The most groups whose packed form fits a slot (packed_layout is monotone in groups).
        lo, hi = 0, slot
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if packed_layout(0, codec, groups=mid)[2] <= slot:
                lo = mid
            else:
                hi = mid - 1
        seg_chunk = lo * QUANT_GROUP // unit * unit
        if seg_chunk >= block:
            seg_chunk = seg_chunk // block * block
        if seg_chunk == 0:
            raise ValueError(f"the workspace slots ({slot} bytes) are too small for a quantized chunk")
        planes, scale_offset, _ = packed_layout(seg_chunk, codec)
        return cls(codec, layout.world_size, seg_chunk, planes, scale_offset, block, small_block, small_max_chunk,
                   unit, num_warps, small_num_warps, max(1, min(max_ctas, layout.max_blocks)))

    def segments(self, numel: int) -> list[QuantSegment]:
        """The launches of a message of ``numel`` elements, in order."""
        full = self.world_size * self.seg_chunk
        out = []
        for start in range(0, numel, full):
            n = min(full, numel - start)
            chunk = self.seg_chunk if n == full else _cdiv(_cdiv(n, self.world_size), self.unit) * self.unit
            small = chunk <= self.small_max_chunk
            block = self.small_block if small else self.block
            out.append(QuantSegment(start, n, chunk, block, max(1, min(_cdiv(chunk, block), self.max_ctas)),
                                    self.small_num_warps if small else self.num_warps))
        return out
