"""What every collective kernel shares: the host-side ``PeerContext`` its launcher takes, and
the device functions of the peer protocol (typed workspace pointers, the push of a tile to
the peers, a block's flag row, the collective prologue (epoch and data region) and the
pairwise-tree sum over the slots).

The synchronisation itself (epochs, flags, bounded waits) is ``tpfuse.kernels.sync``'s; the
LL and Lamport words are ``tpfuse.kernels.ll``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import to_f32
from tpfuse.kernels.sync import begin_call


@dataclass(frozen=True)
class PeerContext:
    """Where a communicator's collectives run, built once per communicator and passed to every
    launcher with the call's plan: ``table``, an int64 tensor of the W workspace bases on the
    device, and ``table_addrs``, the same as ints; ``status_addr``, the address of the int64
    status record (``sync.STATUS_WORDS``) that the device writes and the host reads; this
    ``rank``; the workspaces' ``layout`` (``tpfuse.comm.workspace.WorkspaceLayout``); and the
    waits' bound, ``timeout_ns``."""

    table: torch.Tensor
    table_addrs: tuple[int, ...]
    status_addr: int
    rank: int
    layout: object
    timeout_ns: int

    @property
    def local(self) -> int:
        """This rank's workspace base."""
        return self.table_addrs[self.rank]

    def kernel_args(self) -> dict:
        """The arguments every collective kernel takes from the context."""
        return dict(table_ptr=self.table, local=self.local, status_addr=self.status_addr, rank=self.rank,
                    timeout_ns=self.timeout_ns)


@triton.jit
def typed_ptr(base, byte_offset, ELEM: tl.constexpr):
    """A typed pointer to a workspace address (16-byte aligned by the layout)."""
    return tl.multiple_of((base + byte_offset).to(tl.pointer_type(ELEM)), 16)


@triton.jit
def tree_sum(parts):
    """The sum of the tuple ``parts`` (one block per rank, in rank order) over the pairwise
    tree of ``reference.tree_sum``: neighbours are added level by level, an odd one out is
    carried up to the next level. W <= 8 ranks: three levels."""
    for _ in tl.static_range(3):
        if len(parts) > 1:
            pairs = ()
            for i in tl.static_range(len(parts) // 2):
                pairs = pairs + (parts[2 * i] + parts[2 * i + 1],)
            if len(parts) % 2 == 1:
                pairs = pairs + (parts[len(parts) - 1],)
            parts = pairs
    tl.static_assert(len(parts) == 1, "tree_sum serves at most 8 ranks")
    return parts[0]


@triton.jit
def sum_in_tree_order(slot0, slot_elems, offs, mask, W: tl.constexpr, own=None, rank=0):
    """fp32 sum over the W slots ``slot0 + s * slot_elems`` (s = 0..W-1) at ``offs``, in the
    pairwise tree order of ``tree_sum``; the data was written by peers, so it is read through
    L2 (``.cg``). With ``own`` (this rank's elements at offs, widened to fp32), slot ``rank``
    is not read: own stands in for it, so a kernel that passes own need not store its
    elements into its own slot."""
    parts = ()
    for s in tl.static_range(W):
        if own is None:
            vals = to_f32(tl.load(slot0 + s * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg"))
        else:  # s == rank is a uniform scalar: that slot's load is predicated off as a whole
            vals = to_f32(tl.load(slot0 + s * slot_elems + offs, mask=mask & (s != rank), other=0.0,
                                  cache_modifier=".cg"))
            vals = tl.where(s == rank, own, vals)
        parts = parts + (vals,)
    return tree_sum(parts)


@triton.jit
def push_to_peers(table_ptr, byte_offset, vals, offs, mask, rank, W: tl.constexpr, OWN: tl.constexpr):
    """Store ``vals`` at ``byte_offset`` + offs (elements) in every other rank's workspace and,
    with OWN, this rank's own, starting with this rank's (``rank``, then ``rank + 1``, ...):
    ranks working in step then write to different peers at any moment instead of all to the
    same one."""
    for k in tl.static_range(0 if OWN else 1, W):
        dst = (rank + k) % W
        tl.store(typed_ptr(tl.load(table_ptr + dst), byte_offset, vals.dtype) + offs, vals, mask=mask)


@triton.jit
def poison(out_ptr, numel):
    """NaN over all ``numel`` elements of ``out_ptr``: what a block whose wait failed (a
    timeout, or an abort: a peer's timeout or a call the ranks disagree on) stores instead of
    its results, so that a failed call returns no numbers (docs/design.md 2.6). The whole
    output, not a share: the other blocks' tiles may be fine, this block's are not, and
    covering them all needs no tiling. A failure path: written for brevity, not speed."""
    BLOCK: tl.constexpr = 1024
    ELEM: tl.constexpr = out_ptr.dtype.element_ty
    for start in range(0, numel, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if ELEM == tl.uint8:  # e4m3 bytes (tpfuse.kernels.quant_fp8): 0x7F is NaN
            tl.store(out_ptr + offs, tl.full([BLOCK], 0x7F, tl.uint8), mask=offs < numel)
        else:
            tl.store(out_ptr + offs, tl.full([BLOCK], float("nan"), ELEM), mask=offs < numel)


@triton.jit
def flag_row(local, flags_offset, W: tl.constexpr):
    """This block's W local flag words (one per source rank) in a phase's flag region."""
    return (local + flags_offset + tl.program_id(0) * W * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def begin_collective(local, status_addr, data_offset, data_bytes, n, BLOCK: tl.constexpr):
    """A collective kernel's prologue: this block's index and the grid size, the control and status
    words as pointers, this call's epoch (``sync.begin_call``), the byte offset of this
    epoch's data region (parity rotation) and the number of BLOCK-element tiles in ``n``
    elements."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    ctrl = local.to(tl.pointer_type(tl.int64))
    status = status_addr.to(tl.pointer_type(tl.int64))
    epoch = begin_call(ctrl)
    data = data_offset + (epoch % 2) * data_bytes
    n_tiles = tl.cdiv(n, BLOCK)
    return pid, grid, ctrl, status, epoch, data, n_tiles
