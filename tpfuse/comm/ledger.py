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
latest by the last rank to post the call. That rank records it in its record in the file's
header and raises; the others read the records at their next call or ``check()``
(``failure``). The finder does not launch the call, and the Communicator sets the abort
word of every rank's workspace, so a peer's kernel already waiting for the finder's data
stops at once rather than at its timeout, and writes NaN into its output (docs/design.md
2.6). No lock: an ``flock`` taken by ranks that post at the same moment (they do, in step with
their devices) cost 15 us a call at W=2 and 35 at W=4 on 2 cores, in sleeps and wake-ups.

A peer may be behind by any number of calls (its host is slower, or blocked); the ring holds
``ENTRIES`` of them: a rank that would overwrite an entry a peer has not compared yet waits
for that peer first (``timeout_s`` at most). ``agree(text)`` (before a collective of the
group's backend, which a rank cannot leave once inside) posts, then waits until every peer
has posted the call too, so that no rank enters NCCL while another launches a peer kernel.

Cost: host time only, no device time: 3-5 us a post on the H200 machines
(scripts/ledger_cost.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import threading
import time

import torch.distributed as dist

ENTRIES = 1024
"""Calls a rank's host may run ahead of the slowest peer's host before it waits. A host is
held back by the device's launch queue long before this in steady work."""
ENTRY_BYTES = 256
TEXT_BYTES = ENTRY_BYTES - 16
RECORD_BYTES = 2 * ENTRY_BYTES
_RECORD_TEXTS = (16, ENTRY_BYTES)
"""A rank's record of the mismatch it found (``_record_at``): int64 call and peer, then its
own text and the peer's at these offsets; written once, the call last."""
_ANY_FOUND, _POSTED = 0, 64
"""Header offsets: a word any finder sets to 1 after writing its record (so ``failure`` is
one load), and the per-rank int64 counters of the last call each rank has posted and compared."""
_SPIN_LOOKS = 2000
"""Looks at the peers' counters, back to back, before a wait starts to sleep between looks
(a sleep takes 50-100 us on Linux, far more than a peer host's usual lag)."""
_WAIT_S = 50e-6
"""The pause between later looks."""


def _store_load_fence(lock=threading.Lock()) -> None:
    """Order this thread's earlier stores before its later loads, as seen by other processes:
    the lock's acquire is an atomic read-modify-write in CPython (a ``lock``-prefixed
    instruction on x86, a full barrier; an acquire-release one on Arm), about 0.1 us."""
    with lock:
        pass


class CallLedger:
    """The ranks' call entries in one shared file (module docstring). Collective to create:
    every rank of ``group`` (on one node) constructs it. A failed construction leaves no file
    in /dev/shm; the file is unlinked once every rank has mapped it."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.calls = 0
        self._records = _POSTED + 8 * world_size
        self._entries = _round_up(self._records + world_size * RECORD_BYTES, 4096)
        nbytes = self._entries + world_size * ENTRIES * ENTRY_BYTES
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        path = os.path.join("/dev/shm", f"tpfuse-ledger-{token[0]}")
        self._fd, error = -1, ""
        try:
            if rank == 0:
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(self._fd, nbytes)  # a new file reads as zeros
        except OSError as e:
            error = f"rank 0 cannot create {path}: {e}"
        try:
            errors = [None] * world_size
            dist.all_gather_object(errors, error, group=group)  # the file exists (or the reason why not)
            if rank != 0 and not any(errors):
                try:
                    self._fd = os.open(path, os.O_RDWR)
                except OSError as e:
                    error = f"rank {rank} cannot open {path}: {e}"
            if not any(errors):
                dist.all_gather_object(errors, error, group=group)  # every rank has it open
            if any(errors):
                raise RuntimeError("; ".join(e for e in errors if e))
            self._map = mmap.mmap(self._fd, nbytes)
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
            raise
        finally:  # every rank has opened it, or the construction failed: no name is needed any more
            if rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def post(self, text: str) -> None:
        """Write down this rank's next call, described by ``text``, and compare it with the
        peers' entries of that call. Raises ``CallMismatch`` (after recording it) if a peer's
        entry differs, or if any rank has recorded a mismatch before.

        The order makes the last of two ranks to post a call see the other's entry: write the
        entry, a store-load fence, read the peers' entries, and only then publish the call as
        posted (a peer waits for that before overwriting an entry, so no entry is overwritten
        before every rank has compared it)."""
        n = self.calls + 1
        if n > ENTRIES:  # entry n overwrites entry n - ENTRIES, which every peer must have compared
            self._wait_for_peers(n - ENTRIES, f"call {n}")
        self._raise_found()
        entry = text.encode()[:TEXT_BYTES]
        at = self._entry_at(self.rank, n)
        self._map[at + 16:at + 16 + len(entry)] = entry
        _store_word(self._map, at + 8, len(entry))
        _store_word(self._map, at, n)  # last: a reader that sees n sees the rest
        _store_load_fence()
        self.calls = n
        for peer in range(self.world_size):
            theirs = None if peer == self.rank else self._entry(peer, n)
            if theirs is not None and theirs != entry:
                record = self._record_at(self.rank)
                for offset, part in zip(_RECORD_TEXTS, (entry, theirs)):
                    self._map[record + offset:record + offset + len(part)] = part
                _store_word(self._map, record + 8, peer)
                _store_word(self._map, record, n)
                _store_word(self._map, _ANY_FOUND, 1)
                self._raise_found()
        _store_word(self._map, _POSTED + 8 * self.rank, n)

    def agree(self, text: str) -> None:
        """``post(text)``, then wait (``timeout_s`` at most) until every peer has posted and
        compared this call too: on return, every rank has made it, and made it alike."""
        self.post(text)
        self._wait_for_peers(self.calls, f"call {self.calls} ({text})")

    def failure(self) -> "CallMismatch | None":
        """The mismatch of the lowest call any rank has recorded (None while there is none)."""
        if _load_word(self._map, _ANY_FOUND) == 0:
            return None
        found = []
        for finder in range(self.world_size):
            record = self._record_at(finder)
            call, peer = _load_word(self._map, record), _load_word(self._map, record + 8)
            if call:
                texts = [bytes(self._map[record + offset:record + offset + TEXT_BYTES]).rstrip(b"\0")
                         .decode(errors="replace") for offset in _RECORD_TEXTS]
                found.append(CallMismatch(call, finder, peer, *texts))
        return min(found, key=lambda f: (f.call, f.finder), default=None)

    def close(self) -> None:
        if self._fd >= 0:
            self._map.close()
            os.close(self._fd)
            self._fd = -1

    def _raise_found(self) -> None:
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

    def _wait_for_peers(self, n: int, what: str) -> None:
        """Wait until every rank has posted call n (a mismatch recorded meanwhile raises)."""
        deadline, looks = time.monotonic() + self.timeout_s, 0
        while True:
            late = [r for r in range(self.world_size) if _load_word(self._map, _POSTED + 8 * r) < n]
            if not late:
                return
            self._raise_found()
            looks += 1
            if looks > _SPIN_LOOKS:
                if time.monotonic() > deadline:
                    raise PeersLate(self.rank, late, n, self.timeout_s, what)
                time.sleep(_WAIT_S)


def _store_word(buf, offset: int, value: int) -> None:
    """One aligned 8-byte store. The native format: struct's little-endian ones ("<q") store
    byte by byte, and a peer then read a call number half written (seen in a stress test)."""
    struct.pack_into("q", buf, offset, value)


def _load_word(buf, offset: int) -> int:
    return struct.unpack_from("q", buf, offset)[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PeersLate(TimeoutError):
    """Ranks ``late`` had not posted call ``call`` within ``timeout_s``."""

    def __init__(self, rank: int, late: list[int], call: int, timeout_s: float, what: str):
        super().__init__(f"rank {rank} waited {timeout_s:g} s for rank(s) {late} to reach call {call} before {what}")
        self.rank, self.late, self.call = rank, late, call


class CallMismatch(Exception):
    """What ``CallLedger`` raises: call n (the host's count), the rank that found it and its
    description, and the peer whose entry differed and that one's. The Communicator turns it
    into ``CallMismatchError`` for this rank."""

    def __init__(self, call: int, finder: int, peer: int, finder_text: str, peer_text: str):
        super().__init__(f"call {call}: rank {finder} made it as {finder_text}; rank {peer} as {peer_text}")
        self.call, self.finder, self.peer, self.finder_text, self.peer_text = call, finder, peer, finder_text, peer_text
