"""One-shot and two-shot all-reduce over peer memory, exact by construction.

Each rank's result element is the fp32 sum of ``f32(x_0) .. f32(x_{W-1})`` over the pairwise
tree (``(x_0 + x_1) + (x_2 + x_3)`` at W = 4), rounded once (``tpfuse.reference.all_reduce``),
on every rank and for every size, because every output element of both algorithms comes from
the same order of fp32 adds: ``peer.tree_sum``, through ``sum_in_tree_order`` here and
``tpfuse.kernels.ll``'s poll over LL and Lamport words.

Both kernels push: a rank writes into its peers' workspaces and reads only its own, so
every poll is of local memory and every remote access is a posted store.

- one-shot: each rank writes its input into slot ``rank`` of every other rank's data region,
  raises its flag there, waits for all W flags, and sums its W - 1 local slots and its own
  input, in tree order. One flag round trip.
  Small messages use the LL protocol instead (``tpfuse.kernels.ll``): the same slots hold
  LL words in the LL regions, and the reader polls the words themselves; mid-size ones
  Lamport words there (the data as its own flag, half LL's bytes).
- two-shot: each rank writes chunk c of its input into scatter slot ``rank`` of rank c (c
  not itself); rank c sums its W - 1 scatter slots and its own chunk of x (in tree order),
  rounds once, and writes the result straight into its own output and, in the all-gather, to
  the other ranks: "push" stores it into gather slot c of every peer, which copies its W-1
  gather slots to its output after the gather flags; "pull" stores it into its own gather
  slot c only, and every peer, after the gather flags, loads the W-1 other ranks' gather
  slots over the links straight into its output (the one exception to "read only your own
  workspace"). Each rank moves 2(W-1)/W of the message over the links either way.

Addresses come from the workspace layout (``tpfuse.comm.workspace``), a table of the W ranks'
workspace bases as mapped in this process (int64), and two integer arguments: this rank's own
base (also in the table, but an argument saves a dependent load on the latency path) and the
host-visible status record. Block b of every rank handles the same tiles and synchronises only with block
b of its peers, so blocks never wait on each other within a rank (and Triton's interpreter,
which runs blocks one after another, runs the protocol too). The kernels know nothing of
torch.distributed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import EXACT_FP, round_to, to_f32
from tpfuse.kernels.ll import lamport_pack, lamport_word, ll_flag, ll_pack, ll_reduce
from tpfuse.kernels.peer import (PeerContext, begin_collective, flag_row, poison, push_to_peers,
                                 sum_in_tree_order, typed_ptr)
from tpfuse.kernels.sync import end_call, signal, wait

# Operation codes of the status record (``sync.wait``), named for error messages.
OP_ONESHOT = tl.constexpr(1)
OP_TWOSHOT_SCATTER = tl.constexpr(2)
OP_TWOSHOT_GATHER = tl.constexpr(3)
OP_NAMES = {1: "one-shot all_reduce", 2: "two-shot all_reduce (reduce-scatter phase)",
            3: "two-shot all_reduce (all-gather phase)",
            4: "fused all_reduce + rms_norm (one-shot)",  # codes 4-6 of fused.py
            5: "fused all_reduce + rms_norm (reduce-scatter phase)",
            6: "fused all_reduce + rms_norm (all-gather phase)",
            7: "reduce_scatter_add_rms_norm",  # codes of sequence_parallel.py
            8: "all_gather",
            10: "quantized all_reduce (reduce-scatter phase)",  # codes of quant_allreduce.py
            11: "quantized all_reduce (all-gather phase)"}


@triton.jit
def oneshot_all_reduce_kernel(x_ptr, out_ptr, numel, table_ptr, local, status_addr, rank, timeout_ns, flags_offset,
                              data_offset, data_bytes, slot_elems, W: tl.constexpr, PEERS: tl.constexpr,
                              BLOCK: tl.constexpr):
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(
        local, status_addr, data_offset, data_bytes, numel, BLOCK)
    for tile in range(pid, n_tiles, grid):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        vals = tl.load(x_ptr + offs, mask=mask)
        push_to_peers(table_ptr, data, vals, rank * slot_elems + offs, mask, rank, W, False)
    signal(table_ptr, flags_offset + (pid * W + rank) * 8, epoch, W, PEERS)
    if wait(flag_row(local, flags_offset, W), ctrl, status, epoch, rank, timeout_ns, OP_ONESHOT, W, PEERS):
        slot0 = typed_ptr(local, data, ELEM)
        for tile in range(pid, n_tiles, grid):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            mask = offs < numel
            own = to_f32(tl.load(x_ptr + offs, mask=mask))
            acc = sum_in_tree_order(slot0, slot_elems, offs, mask, W, own, rank)
            tl.store(out_ptr + offs, round_to(acc, ELEM), mask=mask)
    else:
        poison(out_ptr, numel)
    end_call(ctrl, epoch)


@triton.jit
def ll_oneshot_all_reduce_kernel(x_ptr, out_ptr, numel, n_words, table_ptr, local, status_addr, rank, timeout_ns,
                                 ll_offset, ll_bytes, slot_words, W: tl.constexpr, BLOCK: tl.constexpr,
                                 LAMPORT: tl.constexpr):
    """One-shot over LL words or, with LAMPORT, over Lamport words (``tpfuse.kernels.ll``);
    BLOCK elements per tile. n_words, the message's words, is an argument so that Triton
    specialises on its divisibility and the word loads and stores are vectorised (a mask
    derived from numel would make LL's scalar)."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    WORDS: tl.constexpr = BLOCK if LAMPORT else BLOCK * ELEM.primitive_bitwidth // 32
    WORD: tl.constexpr = lamport_word(ELEM) if LAMPORT else tl.uint64
    pid, grid, ctrl, status, epoch, region, n_tiles = begin_collective(
        local, status_addr, ll_offset, ll_bytes, numel, BLOCK)
    flag = ll_flag(epoch)
    for tile in range(pid, n_tiles, grid):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        woffs = tile * WORDS + tl.arange(0, WORDS)
        vals = tl.load(x_ptr + offs, mask=offs < numel)
        if LAMPORT:
            words = lamport_pack(vals)
        else:
            words = ll_pack(vals, flag)
        push_to_peers(table_ptr, region, words, rank * slot_words + woffs, woffs < n_words, rank, W, False)
    slot0 = typed_ptr(local, region, WORD)
    for tile in range(pid, n_tiles, grid):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        woffs = tile * WORDS + tl.arange(0, WORDS)
        own = to_f32(tl.load(x_ptr + offs, mask=offs < numel))
        acc = ll_reduce(slot0, slot_words, woffs, woffs < n_words, flag, ctrl, status, epoch, rank, timeout_ns,
                        OP_ONESHOT, W, ELEM, LAMPORT, own, SPIN=LAMPORT)
        tl.store(out_ptr + offs, round_to(acc, ELEM), mask=offs < numel)
    end_call(ctrl, epoch)


@triton.jit
def twoshot_all_reduce_kernel(x_ptr, out_ptr, numel, chunk, table_ptr, local, status_addr, rank, timeout_ns,
                              flags_offset, flags_bytes, data_offset, data_bytes, gather_offset, slot_elems,
                              W: tl.constexpr, PEERS: tl.constexpr, BLOCK: tl.constexpr, GATHER_PULL: tl.constexpr):
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    pid, grid, ctrl, status, epoch, data, n_tiles = begin_collective(
        local, status_addr, data_offset, data_bytes, chunk, BLOCK)
    # Reduce-scatter, part 1: chunk c of my input into scatter slot `rank` of rank c, from
    # c = rank + 1 on, so that ranks working in step write to different peers at any moment.
    # My own chunk stays in x, which part 2 reads in place of my own scatter slot.
    for tile in range(pid, n_tiles, grid):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        for k in tl.static_range(1, W):
            c = (rank + k) % W
            mask = (offs < chunk) & (c * chunk + offs < numel)
            vals = tl.load(x_ptr + c * chunk + offs, mask=mask)
            dst = typed_ptr(tl.load(table_ptr + c), data, ELEM) + rank * slot_elems
            tl.store(dst + offs, vals, mask=mask)
    signal(table_ptr, flags_offset + (pid * W + rank) * 8, epoch, W, PEERS)
    # Part 2: sum my chunk's W contributions, round once, store the result into my output
    # and (push) into gather slot `rank` of every peer, or (pull) into my own gather slot.
    scattered = wait(flag_row(local, flags_offset, W), ctrl, status, epoch, rank, timeout_ns, OP_TWOSHOT_SCATTER, W,
                     PEERS)
    if scattered:
        slot0 = typed_ptr(local, data, ELEM)
        for tile in range(pid, n_tiles, grid):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            mask = (offs < chunk) & (rank * chunk + offs < numel)
            own = to_f32(tl.load(x_ptr + rank * chunk + offs, mask=mask))
            y = round_to(sum_in_tree_order(slot0, slot_elems, offs, mask, W, own, rank), ELEM)
            tl.store(out_ptr + rank * chunk + offs, y, mask=mask)
            if GATHER_PULL:
                tl.store(typed_ptr(local, data + gather_offset, ELEM) + rank * slot_elems + offs, y, mask=mask)
            else:
                push_to_peers(table_ptr, data + gather_offset, y, rank * slot_elems + offs, mask, rank, W, False)
    # All-gather. A block whose scatter wait failed pushed no reduced chunk: it signals
    # nothing, so no peer takes its gather slots for this call's (the peers time out, or stop
    # at the abort word); its own gather wait returns at once (the abort word), and its
    # outputs are NaN whichever way that wait went.
    # Pull: a peer reads my gather slot of call k until it has finished call k; I rewrite it
    # in call k + 2 only after every peer has signalled call k + 2's scatter (parity rotation).
    if scattered:
        signal(table_ptr, flags_offset + flags_bytes + (pid * W + rank) * 8, epoch, W, PEERS)
    gather_flags = flag_row(local, flags_offset + flags_bytes, W)
    if scattered & wait(gather_flags, ctrl, status, epoch, rank, timeout_ns, OP_TWOSHOT_GATHER, W, PEERS):
        for tile in range(pid, n_tiles, grid):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            for c in tl.static_range(W):
                if c != rank:
                    mask = (offs < chunk) & (c * chunk + offs < numel)
                    if GATHER_PULL:
                        src = typed_ptr(tl.load(table_ptr + c), data + gather_offset, ELEM) + c * slot_elems
                    else:
                        src = typed_ptr(local, data + gather_offset, ELEM) + c * slot_elems
                    vals = tl.load(src + offs, mask=mask, cache_modifier=".cg")
                    tl.store(out_ptr + c * chunk + offs, vals, mask=mask)
    else:
        poison(out_ptr, numel)
    end_call(ctrl, epoch)


def all_reduce_into(x: torch.Tensor, out: torch.Tensor, plan, peers: PeerContext) -> None:
    """Launch one all-reduce of contiguous, 16-byte aligned ``x`` into ``out`` (same shape
    and dtype, not aliasing x), as ``plan`` says (``tpfuse.comm.plan.AllReducePlan``: algo,
    grid, block, num_warps; chunk, elements per rank for two-shot; gather, two-shot's
    all-gather, "push" or "pull"; protocol, one-shot's, "flags", "ll" or "lamport", the
    message fitting the layout's ``ll_max_bytes`` or ``lamport_max_bytes``). Every rank must
    launch the same plan (derived from the message size and the knobs only) on one stream at
    a time.
    """
    algo, grid, block, num_warps, protocol = plan.algo, plan.grid, plan.block, plan.num_warps, plan.protocol
    layout = peers.layout
    world = layout.world_size
    nbytes = x.numel() * x.element_size()
    if algo == "oneshot" and protocol in ("ll", "lamport"):
        lamport = protocol == "lamport"
        capacity = layout.lamport_max_bytes if lamport else layout.ll_max_bytes
        if nbytes > capacity:
            raise ValueError(f"the {protocol} one-shot serves up to {capacity} bytes with this layout, got {nbytes}")
        word_bytes = x.element_size() if lamport else 8
        ll_oneshot_all_reduce_kernel[(grid,)](
            x_ptr=x, out_ptr=out, numel=x.numel(), n_words=x.numel() if lamport else -(-nbytes // 4),
            **peers.kernel_args(), ll_offset=layout.ll_offset(0), ll_bytes=layout.ll_bytes,
            slot_words=layout.ll_slot_bytes // word_bytes, W=world, BLOCK=block, LAMPORT=lamport, num_warps=num_warps,
            **EXACT_FP)
        return
    if protocol != "flags":
        raise ValueError(f"protocol must be 'flags', 'll' or 'lamport' (one-shot only), got {protocol!r} for {algo!r}")
    common = dict(x_ptr=x, out_ptr=out, numel=x.numel(), **peers.kernel_args(), flags_offset=layout.flag_offset(0),
                  data_offset=layout.data_offset(0), data_bytes=layout.data_bytes, W=world,
                  PEERS=triton.next_power_of_2(world), BLOCK=block, num_warps=num_warps, **EXACT_FP)
    if algo == "oneshot":
        oneshot_all_reduce_kernel[(grid,)](slot_elems=layout.oneshot_slot_bytes // x.element_size(), **common)
    elif algo == "twoshot":
        twoshot_all_reduce_kernel[(grid,)](chunk=plan.chunk, flags_bytes=layout.flag_region_bytes,
                                           gather_offset=layout.gather_offset, GATHER_PULL=plan.gather == "pull",
                                           slot_elems=layout.twoshot_slot_bytes // x.element_size(), **common)
    else:
        raise ValueError(f"algo must be 'oneshot' or 'twoshot', got {algo!r}")
