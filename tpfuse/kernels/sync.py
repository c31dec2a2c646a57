"""Cross-rank synchronisation device functions: call epochs, arrival flags, bounded waits.

Every collective kernel in tpfuse synchronises with these functions and nothing else.

**Epochs.** A rank's workspace starts with control words (see ``tpfuse.comm.workspace``):
``ctrl[0]`` holds the epoch of the last finished call. Every block of a call reads it at
its start (``begin_call``) and works with ``epoch = ctrl[0] + 1``; the last block to finish
(counted by ``ctrl[1]``) stores the new epoch (``end_call``). The epoch therefore lives in
device memory and is advanced by the kernel itself: a CUDA graph that captured a call holds
no epoch value, and every replay, interleaved with eager calls in any pattern, runs with the
next epoch (docs/design.md 2.2). All ranks make the same sequence of calls, so all agree on it.

**Flags.** Flag words are int64 and have exactly one writer: block b of rank s writes its
slot (b, s) in the flag region of the phase on each destination rank, storing the call's
epoch. A waiter accepts ``flag >= epoch``, never ``==``: a peer may already have moved on
to the next call (2.2, 2.3).

**Memory ordering.** ``signal`` first runs a CTA barrier, so every thread's peer stores
precede the barrier, then each flag is written by an atomic exchange with release semantics
at system scope: by cumulativity the release covers the whole CTA's stores (the pattern of
CUTLASS's generic barrier). ``wait`` polls with acquire atomics at system scope and ends
with a CTA barrier, so every thread's later loads see the peers' data; callers additionally
load peer-written data with ``cache_modifier=".cg"`` so no stale L1 line is used (2.4).

**Bounded waits.** ``wait`` gives up after ``timeout_ns`` (read from ``%globaltimer`` on
GPUs, from the host's monotonic clock under Triton's interpreter), records
``{op, rank, peer, epoch}`` in the host-visible status record and sets the local abort word,
so every later wait on this rank returns at once instead of spinning (2.6). The decision to
stop is taken by the whole CTA at once (``give_up``): a poll holds CTA barriers, which warps
leaving the loop at different polls would mismatch. A GPU kernel cannot raise: the host reads
the status record (``Communicator`` documents when).

Capacity limits the kernels rely on, checked on the host: a call launches at most
``WorkspaceLayout.max_blocks`` blocks (one flag slot per block), and every block of a grid
is resident at once (a grid stays at or below the SM count, so it fits even at one CTA per
SM: two-shot uses up to 128 CTAs on H200's 132 SMs), so a block's wait for the same block on
a peer cannot wait on a block that is not yet scheduled.
"""

from __future__ import annotations

import time

import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER

STATUS_WORDS = 8
"""Length of the int64 status record: [valid, op, rank, peer, epoch, unused...]
(``_record_error`` writes it, ``decode_status`` reads it)."""


def decode_status(words) -> tuple[int, int, int, int] | None:
    """(op, rank, peer, epoch) of a recorded error, or None while the record is not valid."""
    if int(words[0]) == 0:
        return None
    return int(words[1]), int(words[2]), int(words[3]), int(words[4])


GUARD_POLLS = tl.constexpr(64 if not INTERPRETER else 1)
"""A waiting loop reads the abort word and the clock once per this many polls: on GPUs those
two reads took 0.2 us off a 3.4 us one-shot when left out (scripts/ll_ablation.py, 2x H200),
and 64 polls take tens of microseconds at most, against timeouts of seconds. The
interpreter looks every time (its polls sleep)."""

POLL_SLEEP_S = 50e-6
"""Under the interpreter, the pause between polls: ranks are processes sharing a few cores,
and a sleeping poller leaves the core to the peer it waits for."""

CTA_LANES = tl.constexpr(1024)
"""Lanes of ``cta_any``'s reduction on GPUs: at least the threads of the largest CTA (32 warps), so
that its layout spans every warp and the reduction goes through shared memory."""


if INTERPRETER:

    @triton.jit
    def now_ns():
        """The host's monotonic clock in ns."""
        return time.monotonic_ns()

    @triton.jit
    def backoff():
        time.sleep(POLL_SLEEP_S)

    @triton.jit
    def system_fence():
        """The interpreter's loads and stores are plain x86 accesses, in program order."""
        pass

    @triton.jit
    def cta_any(flag):
        """A program runs as one Python thread: its scalars are one value already (a
        CTA-wide reduction at every poll made the emulated ranks' slow-peer test take 75 s, not 60)."""
        return flag

else:

    @triton.jit
    def now_ns():
        """``%globaltimer`` in ns (a device-wide clock; resolution about 1 us)."""
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def backoff():
        """GPUs poll flat out: the flags are in local L2 and the wait is short."""
        pass

    @triton.jit
    def system_fence():
        """``fence.acq_rel.sys``: this thread's earlier stores, host memory included, are
        seen before its later ones."""
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tfence.acq_rel.sys;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def cta_any(flag):
        """``flag`` (a per-thread scalar) or-ed over the CTA: the same in every thread."""
        return tl.max(tl.full([CTA_LANES], 0, tl.int32) + flag.to(tl.int32), 0) != 0


@triton.jit
def begin_call(ctrl_ptr):
    """The epoch of the call this block belongs to (ctrl_ptr: int64* to the control words).

    The load bypasses L1: ``ctrl[0]`` was written by the previous call's last block, which
    may have run on another SM."""
    return tl.load(ctrl_ptr, volatile=True) + 1


@triton.jit
def end_call(ctrl_ptr, epoch, rows_bytes=-1):
    """Count this block as finished; the last block of the grid publishes ``epoch`` and, for
    a row-wise fused call (rows_bytes >= 0: its Lamport bytes per slot), counts the call in
    ctrl[3] and stores rows_bytes in ctrl[4] (``tpfuse.comm.workspace``), which blocks read
    at their start as they read the epoch.

    The count is a relaxed atomic. Only the last block to count writes ``ctrl``, after its
    atomic returned, so after every other block's increment; what must not happen is that
    store reaching a block that has not read the old epoch yet. Every block's read is done
    before its increment issues: the block used the value (its flag and data region) to get
    there, and in every kernel here a CTA barrier (in ``signal``, ``wait`` or an LL poll)
    lies between ``begin_call`` and ``end_call`` (every CTA of a planned grid has work). That
    rests on the dependency, which the PTX memory model does not promise by itself; the
    acq_rel count that did also waited for the peers to acknowledge the block's NVLink stores
    (a release), 0.3 us of a 3.4 us one-shot on 2x H200 (scripts/ll_ablation.py), for an
    ordering no reader relies on: a peer sees this call's data through its flags or LL words,
    the next call (the next kernel on the stream) sees both stores here, and no block reads
    its epoch after counting. A grid of one block has nothing to count: it stores the epoch
    without the atomic's round trip to L2."""
    if tl.num_programs(0) == 1:
        tl.store(ctrl_ptr, epoch)
        _count_rows_call(ctrl_ptr, rows_bytes)
    else:
        finished = tl.atomic_add(ctrl_ptr + 1, 1, sem="relaxed", scope="gpu")
        if finished == tl.num_programs(0) - 1:
            tl.store(ctrl_ptr + 1, 0)
            tl.store(ctrl_ptr, epoch)
            _count_rows_call(ctrl_ptr, rows_bytes)


@triton.jit
def _count_rows_call(ctrl_ptr, rows_bytes):
    """``end_call``'s bookkeeping of a row-wise fused call (nothing for rows_bytes < 0)."""
    if rows_bytes >= 0:
        tl.store(ctrl_ptr + 3, tl.load(ctrl_ptr + 3, volatile=True) + 1)
        tl.store(ctrl_ptr + 4, rows_bytes)


@triton.jit
def signal(table_ptr, flag_offset, epoch, W: tl.constexpr, PEERS: tl.constexpr):
    """Raise this block's flag to ``epoch`` on every rank (itself included).

    table_ptr: int64* to the W workspace base addresses; flag_offset: byte offset of this
    block's (block, source rank) flag word in the phase's flag region. PEERS is W rounded up
    to a power of two."""
    tl.debug_barrier()
    peers = tl.arange(0, PEERS)
    live = peers < W
    bases = tl.load(table_ptr + peers, mask=live, other=0)
    flags = (bases + flag_offset).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(flags, tl.full([PEERS], 0, tl.int64) + epoch, mask=live, sem="release", scope="sys")


@triton.jit
def give_up(ctrl_ptr, start, now, timeout_ns):
    """Whether a waiting loop stops: the abort word is set, or ``timeout_ns`` passed since
    ``start`` (``now_ns`` readings), as the same value in every thread of the CTA.

    Each thread reads the abort word and the clock on its own, so near the deadline, or as
    another block sets the abort word, warps could disagree and some leave a loop whose polls
    hold CTA barriers (the atomics' broadcast, an LL poll's reduction) while others stay in
    it: a barrier mismatch. The decision is or-ed over the CTA instead."""
    return cta_any((tl.load(ctrl_ptr + 2, volatile=True) != 0) | (now - start >= timeout_ns))


@triton.jit
def wait(flags_ptr, ctrl_ptr, status_ptr, epoch, rank, timeout_ns, OP: tl.constexpr,
         W: tl.constexpr, PEERS: tl.constexpr):
    """Wait until every rank's flag in ``flags_ptr[0:W]`` (int64*, this block's local flag
    row) reaches ``epoch``; returns True, or False after a timeout or an earlier abort (both
    looked at, through ``give_up``, when the first look at the flags fails and every
    GUARD_POLLS polls after it).

    On timeout, records ``(OP, rank, first late peer, epoch)`` in the status record (the
    first recording wins) and sets the local abort word."""
    peers = tl.arange(0, PEERS)
    live = peers < W
    zeros = tl.full([PEERS], 0, tl.int64)
    # The atomics' results reach every thread through shared memory, so `ready` is the
    # same in all of them; `stop` is made so by ``give_up``.
    seen = tl.where(live, tl.atomic_add(flags_ptr + peers, zeros, mask=live, sem="acquire", scope="sys"), epoch)
    ready = tl.min(seen, 0) >= epoch
    if not ready:
        start = now_ns()
        stop = give_up(ctrl_ptr, start, start, timeout_ns)
        polls = 0
        while not ready and not stop:
            backoff()
            seen = tl.where(live, tl.atomic_add(flags_ptr + peers, zeros, mask=live, sem="acquire", scope="sys"),
                            epoch)
            ready = tl.min(seen, 0) >= epoch
            polls += 1
            if polls % GUARD_POLLS == 0:
                stop = give_up(ctrl_ptr, start, now_ns(), timeout_ns)
        if not ready:  # records nothing after an abort: the abort word is set already
            _record_error(ctrl_ptr, status_ptr, OP, rank, tl.min(tl.where(seen < epoch, peers, PEERS), 0), epoch)
    tl.debug_barrier()
    return ready


@triton.jit
def _record_error(ctrl_ptr, status_ptr, op, rank, peer, epoch):
    """Set the local abort word; the block that sets it first fills the status record.

    The record is in host memory, written with plain stores (atomics on host memory would
    need PCIe atomics): the fields, a system-scope fence, then ``valid``, so a host that
    sees ``valid`` sees the fields."""
    unset = tl.zeros([], tl.int64)
    if tl.atomic_cas(ctrl_ptr + 2, unset, unset + 1, sem="acq_rel", scope="gpu") == 0:
        tl.store(status_ptr + 1, op)
        tl.store(status_ptr + 2, rank)
        tl.store(status_ptr + 3, peer)
        tl.store(status_ptr + 4, epoch)
        system_fence()
        tl.store(status_ptr + 0, 1)
