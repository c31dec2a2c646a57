"""Quantized two-shot all-reduce over peer memory: deterministic, identical bits on every rank.

One launch reduces a segment of the message (``tpfuse.comm.quant_plan``) in the protocol of
the exact two-shot kernel (``allreduce.py``), with packed groups in place of raw values:

1. each rank encodes chunk c of its input (``codecs.encode_groups``) and stores the packed
   groups into scatter slot ``rank`` of rank c, then raises its scatter flag on every rank;
2. rank c waits for the W scatter flags, decodes the W contributions to its chunk, sums
   them in fp32 in rank order 0..W-1, encodes the sum, stores the packed sum into gather
   slot c of every peer and raises its gather flag; it decodes the same codes into its own
   output, rounded once to the dtype;
3. after the W gather flags, every rank decodes the other W-1 gather slots into its output.

So every rank decodes the same codes and scales for every group, and holds the same bits:
``tpfuse.reference.quantized_all_reduce``. Slots, flags, epochs (``sync.begin_call`` /
``end_call``), the parity rotation of data regions and the bounded waits are the exact
two-shot's; the packed planes sit at fixed offsets inside each slot (the plan's, from the
segment capacity, never from the message size). Only pushes: a rank reads its own
workspace, and every remote access is a posted store.

**Rounds.** Phase 3 only reads and writes local memory, and with one flag per phase it
would leave the links idle until the end of the call. So a call runs in ``rounds`` rounds,
each over an equal share of every CTA's tiles and each with its own flags (row r of each
phase's flags, ``workspace.FLAG_ROUNDS``): in iteration r a CTA encodes and pushes round
r + 1, reduces round r, then decodes round r - 1 while its pushes drain, and only then
raises the flags of the pushes. Rounds touch disjoint bytes of the slots, and a peer's flag
of round r covers its stores of earlier rounds, so the protocol's argument is unchanged.

The loops over ranks are runtime loops: unrolling W encodes (decodes) of a tile makes the
W=8 kernel several times larger and slower to compile, and was within 1% on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.allreduce import _begin, _flag_row
from tpfuse.kernels.codecs import (CODEC_IDS, decode_groups, encode_groups, load_groups, load_packed,
                                   store_packed)
from tpfuse.kernels.common import EXACT_FP, round_to
from tpfuse.kernels.sync import end_call, signal, wait

# Operation codes of the status record (names in allreduce.OP_NAMES).
OP_QUANT_SCATTER = tl.constexpr(10)
OP_QUANT_GATHER = tl.constexpr(11)


@triton.jit
def _scatter(x_ptr, numel, chunk, table_ptr, data, slot_bytes, p0, p1, psc, rank, pid, grid, first, end,
             W: tl.constexpr, BLOCK: tl.constexpr, CODEC: tl.constexpr):
    """Phase 1 on this CTA's tiles first..end - 1: encode tile t of every chunk c of my input
    into scatter slot ``rank`` of rank c, from c = rank on, so that ranks working in step
    write to different peers at any moment."""
    for i in range(first, end):
        for k in range(W):
            c = (rank + k) % W
            limit = tl.minimum(chunk, numel - c * chunk)
            x, offs, gidx, gmask = load_groups(x_ptr + c * chunk, pid + i * grid, limit, BLOCK)
            codes, scale = encode_groups(x, CODEC)
            store_packed(tl.load(table_ptr + c) + data + rank * slot_bytes, p0, p1, psc, gidx, gmask, codes, scale,
                         CODEC)


@triton.jit
def _reduce(out_ptr, numel, chunk, table_ptr, local, data, gather_offset, slot_bytes, p0, p1, psc, rank, pid, grid,
            first, end, W: tl.constexpr, BLOCK: tl.constexpr, CODEC: tl.constexpr):
    """Phase 2 on tiles first..end - 1 of my chunk: decode the W contributions, sum them in
    rank order, encode the sum, push it into gather slot ``rank`` of every peer (from the
    next rank on) and decode it into my output."""
    ELEM: tl.constexpr = out_ptr.dtype.element_ty
    GB: tl.constexpr = BLOCK // 32
    limit = tl.minimum(chunk, numel - rank * chunk)
    for i in range(first, end):
        gidx = (pid + i * grid) * GB + tl.arange(0, GB)
        offs = gidx[:, None] * 32 + tl.arange(0, 32)[None, :]
        gmask = gidx * 32 < limit
        codes, scale = load_packed(local + data, p0, p1, psc, gidx, gmask, CODEC)
        acc = decode_groups(codes, scale, CODEC)
        for s in range(1, W):
            codes, scale = load_packed(local + data + s * slot_bytes, p0, p1, psc, gidx, gmask, CODEC)
            acc += decode_groups(codes, scale, CODEC)
        codes, scale = encode_groups(acc, CODEC)
        for k in range(1, W):
            peer = tl.load(table_ptr + (rank + k) % W)
            store_packed(peer + data + gather_offset + rank * slot_bytes, p0, p1, psc, gidx, gmask, codes, scale,
                         CODEC)
        y = decode_groups(codes, scale, CODEC)
        tl.store(out_ptr + rank * chunk + offs, round_to(y, ELEM), mask=offs < limit)


@triton.jit
def _gather(out_ptr, numel, chunk, local, data, gather_offset, slot_bytes, p0, p1, psc, rank, pid, grid, first, end,
            W: tl.constexpr, BLOCK: tl.constexpr, CODEC: tl.constexpr):
    """Phase 3 on tiles first..end - 1: decode the other ranks' reduced chunks into my output."""
    ELEM: tl.constexpr = out_ptr.dtype.element_ty
    GB: tl.constexpr = BLOCK // 32
    for i in range(first, end):
        gidx = (pid + i * grid) * GB + tl.arange(0, GB)
        offs = gidx[:, None] * 32 + tl.arange(0, 32)[None, :]
        for c in range(W):
            if c != rank:
                limit = tl.minimum(chunk, numel - c * chunk)
                codes, scale = load_packed(local + data + gather_offset + c * slot_bytes, p0, p1, psc, gidx,
                                           gidx * 32 < limit, CODEC)
                y = decode_groups(codes, scale, CODEC)
                tl.store(out_ptr + c * chunk + offs, round_to(y, ELEM), mask=offs < limit)


@triton.jit
def quant_all_reduce_kernel(x_ptr, out_ptr, numel, chunk, rounds, table_ptr, local, status_addr, rank, timeout_ns,
                            flags_offset, flags_bytes, round_bytes, data_offset, data_bytes, gather_offset,
                            slot_bytes, p0, p1, psc, W: tl.constexpr, PEERS: tl.constexpr, BLOCK: tl.constexpr,
                            CODEC: tl.constexpr):
    pid, grid, ctrl, status, epoch, data, n_tiles = _begin(local, status_addr, data_offset, data_bytes, chunk, BLOCK)
    # Round r covers this CTA's tiles pid + i * grid for i in [r * most // rounds, (r + 1) *
    # most // rounds), `most` being the largest count of tiles of a CTA; its phases
    # synchronise on flag row r of each phase, so the phases of different rounds overlap: in
    # iteration r a CTA encodes round r + 1, reduces round r and decodes round r - 1, whose
    # local work proceeds while the links drain the pushes before it.
    mine = tl.cdiv(n_tiles - pid, grid)
    most = tl.cdiv(n_tiles, grid)
    scatter_flag = flags_offset + (pid * W + rank) * 8
    gather_flag = scatter_flag + flags_bytes
    _scatter(x_ptr, numel, chunk, table_ptr, data, slot_bytes, p0, p1, psc, rank, pid, grid, 0,
             tl.minimum(most // rounds, mine), W, BLOCK, CODEC)
    signal(table_ptr, scatter_flag, epoch, W, PEERS)
    for r in range(rounds):
        first = r * most // rounds
        end = tl.minimum((r + 1) * most // rounds, mine)
        if r + 1 < rounds:
            _scatter(x_ptr, numel, chunk, table_ptr, data, slot_bytes, p0, p1, psc, rank, pid, grid, end,
                     tl.minimum((r + 2) * most // rounds, mine), W, BLOCK, CODEC)
        # After a failed wait the abort word makes every later wait return at once.
        if wait(_flag_row(local, flags_offset + r * round_bytes, W), ctrl, status, epoch, rank, timeout_ns,
                OP_QUANT_SCATTER, W, PEERS):
            _reduce(out_ptr, numel, chunk, table_ptr, local, data, gather_offset, slot_bytes, p0, p1, psc, rank,
                    pid, grid, first, end, W, BLOCK, CODEC)
        if r > 0:
            if wait(_flag_row(local, flags_offset + flags_bytes + (r - 1) * round_bytes, W), ctrl, status, epoch,
                    rank, timeout_ns, OP_QUANT_GATHER, W, PEERS):
                _gather(out_ptr, numel, chunk, local, data, gather_offset, slot_bytes, p0, p1, psc, rank, pid,
                        grid, (r - 1) * most // rounds, tl.minimum(first, mine), W, BLOCK, CODEC)
        if r + 1 < rounds:
            signal(table_ptr, scatter_flag + (r + 1) * round_bytes, epoch, W, PEERS)
        signal(table_ptr, gather_flag + r * round_bytes, epoch, W, PEERS)
    if wait(_flag_row(local, flags_offset + flags_bytes + (rounds - 1) * round_bytes, W), ctrl, status, epoch, rank,
            timeout_ns, OP_QUANT_GATHER, W, PEERS):
        _gather(out_ptr, numel, chunk, local, data, gather_offset, slot_bytes, p0, p1, psc, rank, pid, grid,
                (rounds - 1) * most // rounds, mine, W, BLOCK, CODEC)
    end_call(ctrl, epoch)


def quant_all_reduce_into(x: torch.Tensor, out: torch.Tensor, *, codec: str, chunk: int, grid: int, block: int,
                          rounds: int, num_warps: int, planes: tuple[int, ...], scale_offset: int, table: torch.Tensor,
                          table_addrs: list[int], status_addr: int, rank: int, layout, timeout_ns: int) -> None:
    """Launch one quantized all-reduce of contiguous, 16-byte aligned ``x`` (one segment)
    into ``out`` (same numel and dtype, not aliasing x). Every rank must launch the same
    codec, chunk, grid and block, and the same planes/scale_offset (the plan's), on one stream
    at a time. ``chunk`` (elements per rank, a multiple of 32) must satisfy
    ``W * chunk >= x.numel()`` and its packed form must fit a two-shot slot. ``rounds``
    (1 to the layout's flag rows, ``workspace.FLAG_ROUNDS``): the call's synchronisation
    rounds, each over an equal share of every CTA's tiles. The other arguments are ``allreduce.all_reduce_into``'s.
    """
    world = layout.world_size
    if chunk % 32 or world * chunk < x.numel():
        raise ValueError(f"chunk={chunk} must be a multiple of 32 covering {x.numel()} elements over {world} ranks")
    max_rounds = layout.flag_region_bytes // layout.flag_round_bytes
    if not 1 <= rounds <= max_rounds:
        raise ValueError(f"rounds={rounds} must be in [1, {max_rounds}]")
    quant_all_reduce_kernel[(grid,)](
        x_ptr=x, out_ptr=out, numel=x.numel(), chunk=chunk, rounds=rounds, table_ptr=table, local=table_addrs[rank],
        status_addr=status_addr, rank=rank, timeout_ns=timeout_ns, flags_offset=layout.flag_offset(0),
        flags_bytes=layout.flag_region_bytes, round_bytes=layout.flag_round_bytes, data_offset=layout.data_offset(0),
        data_bytes=layout.data_bytes, gather_offset=layout.gather_offset, slot_bytes=layout.twoshot_slot_bytes,
        p0=planes[0], p1=planes[-1], psc=scale_offset, W=world, PEERS=triton.next_power_of_2(world), BLOCK=block,
        CODEC=CODEC_IDS[codec], num_warps=num_warps, **EXACT_FP)
