"""How a quantized all-reduce runs: when it is used, its segments and launch shape.

Everything here is derived from (numel, dtype, codec, workspace layout, knobs), which every
rank has identically, so every rank launches the identical sequence of grids
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

from tpfuse.comm.knobs import Knobs
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout
from tpfuse.quant_format import QUANT_CODECS, QUANT_GROUP, packed_layout


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
    @functools.lru_cache(maxsize=None)
    def for_layout(cls, layout: WorkspaceLayout, dtype: torch.dtype, codec: str, knobs: Knobs) -> "QuantPlan":
        """The plan for ``codec`` on messages of ``dtype`` over workspaces of ``layout``, with
        ``knobs``'s quant_* launch shapes (cached: every call of a communicator asks). Raises
        ValueError when a slot cannot hold even one chunk unit."""
        if codec not in QUANT_CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        block, small_block = knobs.quant_tile_of(codec), knobs.quant_small_tile
        unit = max(QUANT_GROUP, ALIGN // dtype.itemsize)
        if block % unit or small_block % unit:
            raise ValueError(f"quant_tile[{codec!r}]={block} and quant_small_tile={small_block} must be multiples of "
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
        return cls(codec, layout.world_size, seg_chunk, planes, scale_offset, block, small_block,
                   knobs.quant_small_tile_max_chunk, unit, knobs.quant_num_warps, knobs.quant_small_num_warps,
                   max(1, min(knobs.quant_max_ctas, layout.max_blocks)))

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
