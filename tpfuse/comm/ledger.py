"""The call ledger: each rank's host writes down every call before it launches it, and the
ranks' entries are compared, so ranks that disagree on a call fail on every rank instead of
returning numbers (docs/design.md 2.9).

A collective is correct only when every rank makes the same call: the same operation, dtype,
element count and plan (algorithm, protocol, grid), codec and norm arguments. The kernels
cannot see a disagreement: ranks passing 512 fp32 elements and 1024 bf16 ones exchange the
same bytes and return wrong sums without a sign. So the host looks, where a look costs no
device time: one file in /dev/shm per communicator, mapped by every rank of the (one-node)
group, holds a ring of ``ENTRIES`` entries per rank, entry ``n % ENTRIES`` describing the
rank's call ``n`` (counted per communicator on the host, eager calls and calls captured into
CUDA graphs alike; a replay runs no host code and is not counted).

``post(text)`` writes the entry, then (after a store-load fence) compares it with every
peer's entry of the same call number, where the peer has written it. Of two ranks, the one
that posts second therefore sees the other's entry, and a mismatch is always found, at the
latest by the last rank to post the call. That rank records it in the file's header and
raises; the others read the records at their next call or ``check()``
(``failure``). The finder does not launch the call, and the Communicator sets the abort
word of every rank's workspace, so a peer's kernel already waiting for the finder's data
stops at once rather than at its timeout, and writes NaN into its output (docs/design.md
2.6). No lock: an ``flock`` taken by ranks that post at the same moment (they do, in step with
their devices) cost 15 us a call at W=2 and 35 at W=4 on 2 cores, in sleeps and wake-ups.

A peer may be behind by any number of calls (its host is slower, or blocked); the ring holds
``ENTRIES`` of them: a rank that would overwrite an entry a peer has not compared yet waits
for that peer first (``timeout_s`` at most). Before a collective of the group's backend,
which a rank cannot leave once inside, a rank also waits until every peer has posted the call
(``wait_for_peers``), so that no rank enters NCCL while another launches a peer kernel or
makes another call. A rank that gives up waiting (there, or in a kernel) records it
(``record_gave_up``), and its peers raise at their next post instead of going on without it.

Cost: host time only, no device time: 3-5 us a post on the H200 machines
(scripts/ledger_cost.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
import struct
import threading
import time

import torch.distributed as dist

from tpfuse.comm.peer_memory import agree_on_errors

ENTRIES = 1024
"""Calls a rank's host may run ahead of the slowest peer's host before it waits. A host is
held back by the device's launch queue long before this in steady work."""
ENTRY_BYTES = 256
TEXT_BYTES = ENTRY_BYTES - 16
"""A description's bytes in an entry; a longer one keeps its head and a hash of the whole."""
_RECORD_TEXTS = (32, 32 + TEXT_BYTES)
RECORD_BYTES = 32 + 2 * TEXT_BYTES
"""A rank's record of the failure it met (``_record_at``): int64 call, peer and kind, then
its own text and the peer's at these offsets; written once, the call last."""
MISMATCH, GAVE_UP = 1, 2
"""Record kinds: two ranks' entries of a call differ; a rank gave up waiting (its text says
for what), and its peers must not go on as if it had not."""
_ANY_RECORD, _POSTED = 0, 64
"""Header offsets: a word any rank sets to 1 after writing its record (so ``failure`` is one
load), and the per-rank int64 counters of the last call each rank has posted and compared."""
_SPIN_LOOKS = 2000
"""Looks at the peers' counters, back to back, before a wait starts to sleep between looks
(a sleep takes 50-100 us on Linux, far more than a peer host's usual lag)."""
_WAIT_S = 50e-6
"""The pause between later looks."""


class LedgerUnavailable(RuntimeError):
    """The ranks could not share a ledger file (every rank raises it alike); the message says why."""


class RecordedFailure(Exception):
    """A failure some rank recorded in the ledger: ``call`` (its post count), the ``rank``
    that recorded it, the ``peer`` it names, its ``kind`` (MISMATCH or GAVE_UP) and the two
    texts (``rank_text``: its description of the call, or what it waited for; ``peer_text``:
    the peer's description, for a mismatch)."""

    def __init__(self, call: int, rank: int, peer: int, kind: int, rank_text: str, peer_text: str):
        what = (f"rank {rank} made it as {rank_text!r}, rank {peer} as {peer_text!r}" if kind == MISMATCH else
                f"rank {rank} gave up waiting for rank {peer} ({rank_text})")
        super().__init__(f"call {call}: {what}")
        self.call, self.rank, self.peer, self.kind, self.rank_text, self.peer_text = \
            call, rank, peer, kind, rank_text, peer_text


class PeersLate(TimeoutError):
    """Ranks ``late`` had not posted call ``call`` within ``timeout_s``."""

    def __init__(self, rank: int, late: list[int], call: int, timeout_s: float, what: str):
        super().__init__(f"rank {rank} waited {timeout_s:g} s for rank(s) {late} to reach call {call} before {what}")
        self.rank, self.late, self.call = rank, late, call


def _store_load_fence(lock=threading.Lock()) -> None:
    """Order this thread's earlier stores before its later loads, as seen by other processes:
    the lock's acquire is an atomic read-modify-write in CPython (a ``lock``-prefixed
    instruction on x86, a full barrier; an acquire-release one on Arm), about 0.1 us."""
    with lock:
        pass


class CallLedger:
    """The ranks' call entries in one shared file (module docstring). Collective to create:
    every rank of ``group`` (on one node) constructs it, and every rank raises
    ``LedgerUnavailable`` alike where any rank cannot create, size, open or map the file. No
    file is left in /dev/shm: it is unlinked once every rank has opened it (or failed to)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.calls = 0
        self._all_posted = 0
        """The lowest call every rank was last seen to have posted (``_wait_for_peers``)."""
        self._records = _POSTED + 8 * world_size
        self._entries = _round_up(self._records + world_size * RECORD_BYTES, 4096)
        nbytes = self._entries + world_size * ENTRIES * ENTRY_BYTES
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        path = os.path.join("/dev/shm", f"tpfuse-ledger-{token[0]}")
        self._fd, error = -1, ""
        try:
            if rank == 0:
                try:
                    self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    os.posix_fallocate(self._fd, 0, nbytes)  # zeros, and ENOSPC now rather than SIGBUS later
                except OSError as e:
                    error = f"rank 0 cannot create {path} of {nbytes} bytes: {e}"
            agree_on_errors(group, error, LedgerUnavailable)  # the file exists
            if rank != 0:
                try:
                    self._fd = os.open(path, os.O_RDWR)
                except OSError as e:
                    error = f"rank {rank} cannot open {path}: {e}"
            agree_on_errors(group, error, LedgerUnavailable)  # every rank has it open
        except BaseException:
            self.close()
            raise
        finally:  # every rank has opened it, or the construction failed: no name is needed any more
            if rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        try:
            self._map = mmap.mmap(self._fd, nbytes)
        except OSError as e:
            error = f"rank {rank} cannot map {path}: {e}"
        try:
            agree_on_errors(group, error, LedgerUnavailable)
        except BaseException:
            self.close()
            raise

    def post(self, text: str) -> None:
        """Write down this rank's next call, described by ``text``, and compare it with the
        peers' entries of that call. Raises ``RecordedFailure`` if a peer's entry differs
        (after recording the mismatch) or any rank has recorded a failure before.

        The order makes the last of two ranks to post a call see the other's entry: write the
        entry, a store-load fence, read the peers' entries, and only then publish the call as
        posted (a peer waits for that before overwriting an entry, so no entry is overwritten
        before every rank has compared it)."""
        n = self.calls + 1
        if n - ENTRIES > self._all_posted:  # entry n overwrites one a peer may not have compared yet
            self._all_posted = self._wait_for_peers(n - ENTRIES, f"call {n}")
        self._raise_recorded()
        entry = _entry_bytes(text)
        at = self._entry_at(self.rank, n)
        self._map[at + 16:at + 16 + len(entry)] = entry
        _store_word(self._map, at + 8, len(entry))
        _store_word(self._map, at, n)  # last: a reader that sees n sees the rest
        _store_load_fence()
        self.calls = n
        for peer in range(self.world_size):
            theirs = None if peer == self.rank else self._entry(peer, n)
            if theirs is not None and theirs != entry:
                self._record(n, peer, MISMATCH, entry, theirs)
                self._raise_recorded()
        _store_word(self._map, _POSTED + 8 * self.rank, n)

    def wait_for_peers(self, what: str) -> None:
        """Wait (``timeout_s`` at most) until every peer has posted and compared this rank's
        last call: on return, every rank has made it, and made it alike. Raises
        ``RecordedFailure`` for a failure recorded meanwhile, ``PeersLate`` at the timeout."""
        self._wait_for_peers(self.calls, f"call {self.calls} ({what})")
        self._raise_recorded()

    def record_gave_up(self, peer: int, what: str, call: int) -> None:
        """Record that this rank gave up waiting for ``peer`` in ``what`` (call ``call``, the
        number its error names), so that every peer raises at its next post or ``failure``
        rather than go on (into NCCL, say) without it. A peer that has already passed its own
        wait for this call when the record lands is not stopped: the record narrows that
        window to microseconds, it cannot close it."""
        self._record(max(call, 1), peer, GAVE_UP, _entry_bytes(what), b"")

    def failure(self) -> "RecordedFailure | None":
        """The failure of the lowest call any rank has recorded (None while there is none)."""
        if _load_word(self._map, _ANY_RECORD) == 0:
            return None
        found = []
        for rank in range(self.world_size):
            record = self._record_at(rank)
            call = _load_word(self._map, record)
            if call:
                texts = [bytes(self._map[record + offset:record + offset + TEXT_BYTES]).rstrip(b"\0")
                         .decode(errors="replace") for offset in _RECORD_TEXTS]
                found.append(RecordedFailure(call, rank, _load_word(self._map, record + 8),
                                             _load_word(self._map, record + 16), *texts))
        return min(found, key=lambda f: (f.call, f.rank), default=None)

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _record(self, n: int, peer: int, kind: int, text: bytes, peer_text: bytes) -> None:
        """This rank's record (once: a second failure is a consequence of the first)."""
        record = self._record_at(self.rank)
        if _load_word(self._map, record):
            return
        for offset, part in zip(_RECORD_TEXTS, (text, peer_text)):
            self._map[record + offset:record + offset + len(part)] = part
        _store_word(self._map, record + 8, peer)
        _store_word(self._map, record + 16, kind)
        _store_word(self._map, record, n)
        _store_word(self._map, _ANY_RECORD, 1)

    def _raise_recorded(self) -> None:
        found = self.failure()
        if found is not None:
            raise found

    def _record_at(self, rank: int) -> int:
        return self._records + rank * RECORD_BYTES

    def _entry_at(self, rank: int, n: int) -> int:
        return self._entries + (rank * ENTRIES + n % ENTRIES) * ENTRY_BYTES

    def _entry(self, rank: int, n: int) -> bytes | None:
        """Rank ``rank``'s text of call n, or None if it has not written call n yet."""
        at = self._entry_at(rank, n)
        if _load_word(self._map, at) != n:
            return None
        return bytes(self._map[at + 16:at + 16 + _load_word(self._map, at + 8)])

    def _wait_for_peers(self, n: int, what: str) -> int:
        """Wait until every rank has posted call n (a failure recorded meanwhile raises); the
        lowest call posted then."""
        deadline, looks = time.monotonic() + self.timeout_s, 0
        while True:
            posted = [_load_word(self._map, _POSTED + 8 * r) for r in range(self.world_size)]
            late = [r for r, p in enumerate(posted) if p < n]
            if not late:
                return min(posted)
            self._raise_recorded()
            looks += 1
            if looks > _SPIN_LOOKS:
                if time.monotonic() > deadline:
                    raise PeersLate(self.rank, late, n, self.timeout_s, what)
                time.sleep(_WAIT_S)


def _entry_bytes(text: str) -> bytes:
    """``text`` as an entry holds it: its UTF-8 bytes, or, past TEXT_BYTES, their head and a
    hash of the whole (two long descriptions that differ only at their ends still differ)."""
    data = text.encode()
    if len(data) <= TEXT_BYTES:
        return data
    return data[:TEXT_BYTES - 17] + b"#" + hashlib.blake2b(data, digest_size=8).hexdigest().encode()


def _store_word(buf, offset: int, value: int) -> None:
    """One aligned 8-byte store. The native format: struct's little-endian ones ("<q") store
    byte by byte, and a peer then read a call number half written (seen in a stress test)."""
    struct.pack_into("q", buf, offset, value)


def _load_word(buf, offset: int) -> int:
    return struct.unpack_from("q", buf, offset)[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
