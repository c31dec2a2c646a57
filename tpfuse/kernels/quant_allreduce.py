"""Quantized two-shot all-reduce over peer memory: deterministic, identical bits on every rank.

One launch reduces a segment of the message (``tpfuse.comm.quant_plan``) in the protocol of
the exact two-shot kernel (``allreduce.py``), with packed groups in place of raw values:

1. each rank encodes chunk c of its input (``codecs.encode_groups``) and stores the packed
   groups into scatter slot ``rank`` of rank c, then raises its scatter flag on every rank;
2. rank c waits for the W scatter flags, decodes the W contributions to its chunk, sums
   them in fp32 in tree order (``peer.tree_sum``), encodes the sum, stores the packed sum into gather
   slot c of every peer and raises its gather flag; it decodes the same codes into its own
   output, rounded once to the dtype;
3. after the W gather flags, every rank decodes the other W-1 gather slots into its output.

So every rank decodes the same codes and scales for every group, and holds the same bits:
``tpfuse.reference.quantized_all_reduce``. Slots, flags, epochs (``sync.begin_call`` /
``end_call``), the parity rotation of data regions and the bounded waits are the exact
two-shot's; the packed planes sit at fixed offsets inside each slot (the plan's, from the
segment capacity, never from the message size). Only pushes: a rank reads its own
workspace, and every remote access is a posted store.

The loops over ranks are runtime loops: unrolling W encodes (decodes) of a tile makes the
W=8 kernel several times larger and slower to compile, for no gain in a bandwidth-bound
kernel (to be confirmed by the GPU benchmark).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.peer import PeerContext, begin_collective, flag_row, poison, tree_sum
from tpfuse.kernels.codecs import (CODEC_IDS, decode_groups, encode_groups, hardware_e4m3, load_groups, load_packed,
                                   store_packed)
from tpfuse.kernels.common import EXACT_FP, round_to
from tpfuse.kernels.sync import end_call, signal, wait

# Operation codes of the status record (names in allreduce.OP_NAMES).
OP_QUANT_SCATTER = tl.constexpr(10)
OP_QUANT_GATHER = tl.constexpr(11)


@triton.jit
def quant_all_reduce_kernel(x_ptr, out_ptr, numel, chunk, table_ptr, local, status_addr, rank, timeout_ns,
                            flags_offset, flags_bytes, data_offset, data_bytes, gather_offset, slot_bytes,
                            p0, p1, psc, W: tl.constexpr, PEERS: tl.constexpr, BLOCK: tl.constexpr,
                            CODEC: tl.constexpr, HW_E4M3: tl.constexpr):
    ELEM: tl.constexpr = out_ptr.dtype.element_ty
    GB: tl.constexpr = BLOCK // 32
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(
        local, status_addr, data_offset, data_bytes, chunk, BLOCK)
    # 1. Encode chunk c of my input into scatter slot `rank` of rank c, from c = rank on, so
    # that ranks working in step write to different peers at any moment.
    for tile in range(pid, n_tiles, grid):
        for k in range(W):
            c = (rank + k) % W
            limit = tl.minimum(chunk, numel - c * chunk)
            x, offs, gidx, gmask = load_groups(x_ptr + c * chunk, tile, limit, BLOCK)
            codes, scale = encode_groups(x, CODEC, HW_E4M3)
            store_packed(tl.load(table_ptr + c) + data + rank * slot_bytes, p0, p1, psc, gidx, gmask, codes, scale,
                         CODEC)
    signal(table_ptr, flags_offset + (pid * W + rank) * 8, epoch, W, PEERS)
    # 2. Decode my chunk's W contributions, sum in tree order, encode the sum, push it.
    scattered = wait(flag_row(local, flags_offset, W), ctrl, status, epoch, rank, timeout_ns, OP_QUANT_SCATTER, W,
                     PEERS)
    if scattered:
        limit = tl.minimum(chunk, numel - rank * chunk)
        for tile in range(pid, n_tiles, grid):
            gidx = tile * GB + tl.arange(0, GB)
            offs = gidx[:, None] * 32 + tl.arange(0, 32)[None, :]
            gmask = gidx * 32 < limit
            parts = ()
            for s in tl.static_range(W):
                codes, scale = load_packed(local + data + s * slot_bytes, p0, p1, psc, gidx, gmask, CODEC)
                parts = parts + (decode_groups(codes, scale, CODEC, HW_E4M3),)
            codes, scale = encode_groups(tree_sum(parts), CODEC, HW_E4M3)
            for k in range(1, W):  # from the next rank on, as in phase 1
                peer = tl.load(table_ptr + (rank + k) % W)
                store_packed(peer + data + gather_offset + rank * slot_bytes, p0, p1, psc, gidx, gmask, codes, scale,
                             CODEC)
            y = decode_groups(codes, scale, CODEC, HW_E4M3)
            tl.store(out_ptr + rank * chunk + offs, round_to(y, ELEM), mask=offs < limit)
    # 3. Decode the other ranks' reduced chunks (as the two-shot all-reduce's gather: a block
    # whose scatter wait failed signals nothing).
    if scattered:
        signal(table_ptr, flags_offset + flags_bytes + (pid * W + rank) * 8, epoch, W, PEERS)
    gather_flags = flag_row(local, flags_offset + flags_bytes, W)
    if scattered & wait(gather_flags, ctrl, status, epoch, rank, timeout_ns, OP_QUANT_GATHER, W, PEERS):
        for tile in range(pid, n_tiles, grid):
            gidx = tile * GB + tl.arange(0, GB)
            offs = gidx[:, None] * 32 + tl.arange(0, 32)[None, :]
            for c in range(W):
                if c != rank:
                    limit = tl.minimum(chunk, numel - c * chunk)
                    codes, scale = load_packed(local + data + gather_offset + c * slot_bytes, p0, p1, psc, gidx,
                                               gidx * 32 < limit, CODEC)
                    y = decode_groups(codes, scale, CODEC, HW_E4M3)
                    tl.store(out_ptr + c * chunk + offs, round_to(y, ELEM), mask=offs < limit)
    else:
        poison(out_ptr, numel)
    end_call(ctrl, epoch)


def quant_all_reduce_into(x: torch.Tensor, out: torch.Tensor, plan, segment, peers: PeerContext) -> None:
    """Launch one quantized all-reduce of contiguous, 16-byte aligned ``x`` (one segment)
    into ``out`` (same numel and dtype, not aliasing x). ``plan`` (``tpfuse.comm.quant_plan.
    QuantPlan``) gives the codec and the packed planes' and scales' offsets in a slot,
    ``segment`` (its ``QuantSegment``) the chunk, grid, block and warps. Every rank must
    launch the same plan and segment, on one stream at a time. ``segment.chunk`` (elements per
    rank, a multiple of 32) must satisfy ``W * chunk >= x.numel()`` and its packed form must
    fit a two-shot slot.
    """
    layout, chunk = peers.layout, segment.chunk
    world = layout.world_size
    if chunk % 32 or world * chunk < x.numel():
        raise ValueError(f"chunk={chunk} must be a multiple of 32 covering {x.numel()} elements over {world} ranks")
    quant_all_reduce_kernel[(segment.grid,)](
        x_ptr=x, out_ptr=out, numel=x.numel(), chunk=chunk, **peers.kernel_args(), flags_offset=layout.flag_offset(0),
        flags_bytes=layout.flag_region_bytes, data_offset=layout.data_offset(0), data_bytes=layout.data_bytes,
        gather_offset=layout.gather_offset, slot_bytes=layout.twoshot_slot_bytes, p0=plan.planes[0],
        p1=plan.planes[-1], psc=plan.scale_offset, W=world, PEERS=triton.next_power_of_2(world), BLOCK=segment.block,
        CODEC=CODEC_IDS[plan.codec], HW_E4M3=hardware_e4m3(x.device), num_warps=segment.num_warps, **EXACT_FP)
