"""What every collective kernel shares: the host-side ``PeerContext`` its launcher takes, and
the device functions of the peer protocol (typed workspace pointers, the push of a tile to
the peers, a block's flag row, the collective prologue (epoch and data region) and the
rank-order sum over the slots).

The synchronisation itself (epochs, flags, bounded waits) is ``tpfuse.kernels.sync``'s; the
LL and Lamport words are ``tpfuse.kernels.ll``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.common import to_f32
from tpfuse.kernels.sync import announce_call, begin_call, look_calls


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

    def kernel_args(self, call_desc: int) -> dict:
        """The arguments every collective kernel takes from the context, and the call's
        description (``describe_call``), which the kernel checks against its peers'."""
        return dict(table_ptr=self.table, local=self.local, status_addr=self.status_addr, rank=self.rank,
                    timeout_ns=self.timeout_ns, call_desc=call_desc)


# What a call word describes (docs/design.md 2.9): the operation, the dtype, the path (the
# algorithm and its protocol) and the codec, each as its index here, and the element count.
CALL_OPS = ("all_reduce", "all_reduce_add_rms_norm", "quantized all_reduce", "all_reduce over NCCL")
CALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CALL_PATHS = ("oneshot/flags", "oneshot/ll", "oneshot/lamport", "oneshot/rows", "twoshot/flags", "nccl")
CALL_CODECS = (None, "fp8", "int8", "int6", "int4")
_NUMEL_BITS = 28


def describe_call(op: str, dtype: torch.dtype, numel: int, path: str, codec: str | None = None) -> int:
    """A call's description as the 40 bits of its call word (``sync.call_word``): bit 39 set
    (so the value is always an int64 kernel argument), then the op, dtype, path and codec
    indices (3 bits each but the dtype's 2) and the element count modulo 2**28."""
    fields = (CALL_OPS.index(op), CALL_DTYPES.index(dtype), CALL_PATHS.index(path), CALL_CODECS.index(codec))
    desc = 1
    for value, bits in zip(fields, (3, 2, 3, 3)):
        desc = desc << bits | value
    return desc << _NUMEL_BITS | numel % (1 << _NUMEL_BITS)


def call_text(desc: int) -> str:
    """``describe_call``'s description in words."""
    numel = desc & ((1 << _NUMEL_BITS) - 1)
    codec, path, dtype, op = (desc >> _NUMEL_BITS) & 7, (desc >> 31) & 7, (desc >> 34) & 3, (desc >> 36) & 7
    names = (CALL_OPS, CALL_DTYPES, CALL_PATHS, CALL_CODECS)
    if desc >> 39 != 1 or any(i >= len(n) for i, n in zip((op, dtype, path, codec), names)):
        return f"an unknown call (word {desc:#x})"
    quant = f", quant={CALL_CODECS[codec]}" if codec else ""
    dtype_name = str(CALL_DTYPES[dtype]).replace("torch.", "")
    return f"{CALL_OPS[op]} of {numel} elements of {dtype_name} ({CALL_PATHS[path]}{quant})"


@triton.jit
def typed_ptr(base, byte_offset, ELEM: tl.constexpr):
    """A typed pointer to a workspace address (16-byte aligned by the layout)."""
    return tl.multiple_of((base + byte_offset).to(tl.pointer_type(ELEM)), 16)


@triton.jit
def tree_add(partials, vals, s: tl.constexpr):
    """Rank ``s``'s values folded into ``partials``, the tuple of pending sums of the pairwise
    tree of ``reference.tree_sum`` after ranks 0..s-1 (start from ``()``): the adds happen as
    soon as both their operands exist (a binary counter: rank s closes the subtrees its
    trailing one bits stand for), so a loop over the ranks keeps the adds beside the loads,
    as a running sum did; ``tree_total`` ends it. W <= 8 ranks."""
    top = vals
    for level in tl.static_range(3):
        if (s + 1) % (2 << level) == 0:  # rank s closes a subtree of 2 << level ranks
            top = partials[len(partials) - 1] + top
            rest = ()
            for i in tl.static_range(len(partials) - 1):
                rest = rest + (partials[i],)
            partials = rest
    return partials + (top,)


@triton.jit
def tree_total(partials):
    """The sum ``tree_add``'s partials stand for: the pending subtrees, smallest (last) first,
    each added onto the one before it (an odd one out carried up, as the tree has it)."""
    total = partials[len(partials) - 1]
    for i in tl.static_range(len(partials) - 1):
        total = partials[len(partials) - 2 - i] + total
    return total


@triton.jit
def tree_sum(parts):
    """The sum of the tuple ``parts`` (one block per rank, in rank order) in the pairwise tree
    order of ``reference.tree_sum``."""
    partials = ()
    for s in tl.static_range(len(parts)):
        partials = tree_add(partials, parts[s], s)
    return tree_total(partials)


@triton.jit
def sum_in_tree_order(slot0, slot_elems, offs, mask, W: tl.constexpr, own=None, rank=0):
    """fp32 sum over the W slots ``slot0 + s * slot_elems`` (s = 0..W-1) at ``offs``, in the
    pairwise tree order of ``tree_sum``; the data was written by peers, so it is read through
    L2 (``.cg``). With ``own`` (this rank's elements at offs, widened to fp32), slot ``rank``
    is not read: own stands in for it, so a kernel that passes own need not store its
    elements into its own slot."""
    partials = ()
    for s in tl.static_range(W):
        if own is None:
            vals = to_f32(tl.load(slot0 + s * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg"))
        else:  # s == rank is a uniform scalar: that slot's load is predicated off as a whole
            vals = to_f32(tl.load(slot0 + s * slot_elems + offs, mask=mask & (s != rank), other=0.0,
                                  cache_modifier=".cg"))
            vals = tl.where(s == rank, own, vals)
        partials = tree_add(partials, vals, s)
    return tree_total(partials)


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
def flag_row(local, flags_offset, W: tl.constexpr):
    """This block's W local flag words (one per source rank) in a phase's flag region."""
    return (local + flags_offset + tl.program_id(0) * W * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def begin_collective(table_ptr, local, status_addr, rank, call_desc, data_offset, data_bytes, n, BLOCK: tl.constexpr,
                     W: tl.constexpr):
    """A collective kernel's prologue: this block's index and the grid size, the control and status
    words as pointers, this call's epoch (``sync.begin_call``), the byte offset of this
    epoch's data region (parity rotation), the number of BLOCK-element tiles in ``n``
    elements, and a first look at the peers' call words (``sync.look_calls``) after this
    rank's own went out (``sync.announce_call``)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    ctrl = local.to(tl.pointer_type(tl.int64))
    status = status_addr.to(tl.pointer_type(tl.int64))
    epoch = begin_call(ctrl)
    announce_call(table_ptr, epoch, call_desc, rank, W)
    data = data_offset + (epoch % 2) * data_bytes
    n_tiles = tl.cdiv(n, BLOCK)
    return pid, grid, ctrl, status, epoch, data, n_tiles, look_calls(local, epoch, rank, W)


@triton.jit
def poison(out_ptr, start, n, BLOCK: tl.constexpr):
    """NaN into this block's grid-stride share of ``out_ptr[start:start + n]``: what a call
    writes when it cannot use what its peers sent (a mismatched call, a timeout)."""
    for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        # Made in fp32 and converted: the interpreter has no bf16 NaN constant.
        nan = tl.full([BLOCK], float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + start + offs, nan, mask=offs < n)
