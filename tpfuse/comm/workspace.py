"""The fixed layout of a communicator's peer workspace (pure Python, no torch).

Every rank allocates one buffer of ``WorkspaceLayout.total_bytes`` with this layout; peers
write into it and the owner reads it. The byte offsets below depend only on the world size
and the capacity chosen when the communicator is created, never on the size of a message,
so a larger call after a smaller one can never land on a slot that a slow peer still reads
(docs/design.md 2.1).

Layout of one rank's buffer (every region starts at a multiple of ``ALIGN``)::

    ctrl      local words: [0] epoch of the last finished call, [1] blocks finished in
              the current call, [2] abort word (non-zero once any wait timed out), [3]
              row-wise fused calls finished, [4] bytes per slot of the last of them
    flags[0]  phase-0 arrival flags: int64 word (block b, source rank s) at
              flags[0] + (b * world_size + s) * 8, written only by rank s's block b
    flags[1]  phase-1 arrival flags (two-shot all-gather), same shape
    data[0]   message data of calls with even epoch
    data[1]   message data of calls with odd epoch
    ll[0]     low-latency (LL) or Lamport words of one-shot calls with even epoch:
              ``world_size`` slots of ``ll_slot_bytes``, slot s written only by rank s
    ll[1]     the same for odd epochs
    reduced   local only: the fused one-shot LL and Lamport kernel's reduced rows
    handoff   local only: that kernel's int64 arrival counters, one per row tile
    rows[0..2]  Lamport words of the row-wise fused one-shot (every CTA of a row tile
              normalises the whole tile, ``tpfuse.kernels.fused``): ``world_size`` slots of
              ``rows_slot_bytes`` each, used by row-wise call c (ctrl[3] before it) in
              rotation c % 3

Each data region (``data_bytes``) is cut into ``world_size`` one-shot slots (slot s holds
rank s's whole input), or, for two-shot, into ``world_size`` scatter slots (slot s holds
rank s's contribution to this rank's chunk) followed by ``world_size`` gather slots (slot s
holds the reduced chunk s). A rank's own one-shot and scatter slots are written only by the
fused flag one-shot and two-shot; the other kernels read the rank's share from its input,
and a rank's own slot in the LL regions is never written. One-shot and two-shot use the same
bytes: every call of either algorithm ends only after every peer has started it, so no peer
is ever more than one call ahead, and two data regions rotated by call parity keep call
k+1's writes off call k's data (section 2.3).

The LL regions are used by nothing but the one-shot calls over LL or Lamport words
(``tpfuse.kernels.ll``): a word there is 0 between calls, and during a call 0 or written by
the current call, which another use of the bytes would break. An LL word carries 4 bytes of
data in 8 and a Lamport word carries its own bytes, so a slot holds the larger of twice
``ll_max_bytes`` and ``lamport_max_bytes``.

The rows regions hold that kernel's Lamport words only. Every CTA of a row tile reads all
of the tile's words, so no CTA can zero them after reading without waiting for the others;
row-wise call c zeroes, instead, the words of call c - 1 (their bytes per slot are ctrl[4]) in
rotation (c - 1) % 3. Every CTA of this rank read them before call c began (kernel order),
and the peers write that rotation next in their call c + 2, which waits for this rank's call
c + 1, which starts after call c ended. So between row-wise calls the rotation of the last
one holds its words and the other two hold zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 256
"""Region and slot alignment in bytes: a multiple of the 16-byte vector width, and no two
slots share a 128-byte cache line."""

FLAG_BYTES = 8
"""Flags are int64 epochs: an int32 epoch would wrap after 2**31 calls (hours at 4 us per
call), and the one writer per word rules out sub-word flags sharing a word."""

CTRL_EPOCH, CTRL_DONE, CTRL_ABORT, CTRL_ROWS_CALLS, CTRL_ROWS_BYTES = 0, 1, 2, 3, 4
"""Indices of the int64 control words at the start of the buffer."""

NUM_PHASES = 2
NUM_PARITIES = 2
NUM_ROWS_ROTATIONS = 3


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of every region of a rank's peer workspace.

    Args:
        world_size: ranks in the group (>= 2).
        max_bytes: the largest message two-shot serves; one-shot serves up to
            ``oneshot_max_bytes`` (= 2 * max_bytes / world_size, rounded down to ALIGN).
        max_blocks: the most CTAs one call may launch (flag slots per phase).
        ll_max_bytes: the largest message the LL one-shot serves (0: none).
        lamport_max_bytes: the largest message the Lamport one-shot serves (0: none). With
            both 0 there are no LL regions.
        rows_max_bytes: the largest message the row-wise fused one-shot serves (0: none,
            and no rows regions).
    """

    world_size: int
    max_bytes: int
    max_blocks: int
    ll_max_bytes: int = 0
    lamport_max_bytes: int = 0
    rows_max_bytes: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"a workspace needs world_size >= 2, got {self.world_size}")
        if self.max_bytes < ALIGN:
            raise ValueError(f"max_bytes must be at least {ALIGN}, got {self.max_bytes}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if min(self.ll_max_bytes, self.lamport_max_bytes, self.rows_max_bytes) < 0:
            raise ValueError(f"ll_max_bytes, lamport_max_bytes and rows_max_bytes must be >= 0, got "
                             f"{self.ll_max_bytes}, {self.lamport_max_bytes} and {self.rows_max_bytes}")

    @property
    def ctrl_offset(self) -> int:
        return 0

    @property
    def ctrl_bytes(self) -> int:
        return ALIGN

    @property
    def flag_region_bytes(self) -> int:
        return _round_up(self.max_blocks * self.world_size * FLAG_BYTES, ALIGN)

    def flag_offset(self, phase: int) -> int:
        """Start of the arrival flags of ``phase`` (0: publish/scatter, 1: gather)."""
        if not 0 <= phase < NUM_PHASES:
            raise ValueError(f"phase must be 0 or 1, got {phase}")
        return self.ctrl_bytes + phase * self.flag_region_bytes

    @property
    def twoshot_slot_bytes(self) -> int:
        """Bytes of one two-shot scatter or gather slot: one rank's chunk of the message."""
        return _round_up(-(-self.max_bytes // self.world_size), ALIGN)

    @property
    def data_bytes(self) -> int:
        """Bytes of one data region (one parity)."""
        return 2 * self.world_size * self.twoshot_slot_bytes

    @property
    def oneshot_slot_bytes(self) -> int:
        """Bytes of one one-shot slot: a whole message of one rank."""
        return self.data_bytes // self.world_size

    @property
    def gather_offset(self) -> int:
        """Start of the two-shot gather slots, relative to the start of a data region."""
        return self.world_size * self.twoshot_slot_bytes

    def data_offset(self, parity: int) -> int:
        """Start of the data region of calls whose epoch has this parity."""
        if not 0 <= parity < NUM_PARITIES:
            raise ValueError(f"parity must be 0 or 1, got {parity}")
        return self.flag_offset(NUM_PHASES - 1) + self.flag_region_bytes + parity * self.data_bytes

    @property
    def ll_slot_bytes(self) -> int:
        """Bytes of one LL slot: one rank's message of up to ll_max_bytes as LL words, or of
        up to lamport_max_bytes as Lamport words."""
        return _round_up(max(2 * self.ll_max_bytes, self.lamport_max_bytes), ALIGN)

    @property
    def ll_bytes(self) -> int:
        """Bytes of one LL region (one parity): world_size slots."""
        return self.world_size * self.ll_slot_bytes

    def ll_offset(self, parity: int) -> int:
        """Start of the LL region of calls whose epoch has this parity."""
        if not 0 <= parity < NUM_PARITIES:
            raise ValueError(f"parity must be 0 or 1, got {parity}")
        return self.data_offset(NUM_PARITIES - 1) + self.data_bytes + parity * self.ll_bytes

    @property
    def reduced_offset(self) -> int:
        """Start of the local region where the fused kernel over LL or Lamport words keeps its
        reduced rows."""
        return self.ll_offset(NUM_PARITIES - 1) + self.ll_bytes

    @property
    def reduced_bytes(self) -> int:
        return _round_up(max(self.ll_max_bytes, self.lamport_max_bytes), ALIGN)

    @property
    def handoff_offset(self) -> int:
        """Start of the fused LL kernel's arrival counters, one int64 per row tile. A tile
        holds at least 1 KiB (16 elements of 2 bytes, times the norm's 32-row cap, for the
        smallest hidden size the fused kernels serve), so one word per KiB of message."""
        return self.reduced_offset + self.reduced_bytes

    @property
    def handoff_bytes(self) -> int:
        largest = max(self.ll_max_bytes, self.lamport_max_bytes)
        return _round_up((largest // 1024 + 1) * FLAG_BYTES, ALIGN) if largest else 0

    @property
    def rows_slot_bytes(self) -> int:
        """Bytes of one rows slot: one rank's message of up to rows_max_bytes as Lamport words."""
        return _round_up(self.rows_max_bytes, ALIGN)

    @property
    def rows_bytes(self) -> int:
        """Bytes of one rows rotation: world_size slots."""
        return self.world_size * self.rows_slot_bytes

    def rows_offset(self, rotation: int) -> int:
        """Start of rows rotation ``rotation`` (0, 1 or 2)."""
        if not 0 <= rotation < NUM_ROWS_ROTATIONS:
            raise ValueError(f"rotation must be 0, 1 or 2, got {rotation}")
        return self.handoff_offset + self.handoff_bytes + rotation * self.rows_bytes

    @property
    def total_bytes(self) -> int:
        return self.rows_offset(NUM_ROWS_ROTATIONS - 1) + self.rows_bytes

    def regions(self) -> list[tuple[str, int, int]]:
        """Every region and slot as (name, offset, size), for checks and debugging."""
        out = [("ctrl", self.ctrl_offset, self.ctrl_bytes)]
        out += [(f"flags[{p}]", self.flag_offset(p), self.flag_region_bytes) for p in range(NUM_PHASES)]
        w, s = self.world_size, self.twoshot_slot_bytes
        for parity in range(NUM_PARITIES):
            base = self.data_offset(parity)
            out += [(f"data[{parity}].scatter[{r}]", base + r * s, s) for r in range(w)]
            out += [(f"data[{parity}].gather[{r}]", base + self.gather_offset + r * s, s) for r in range(w)]
        if self.ll_slot_bytes:
            for parity in range(NUM_PARITIES):
                base, s = self.ll_offset(parity), self.ll_slot_bytes
                out += [(f"ll[{parity}].slot[{r}]", base + r * s, s) for r in range(w)]
            out.append(("reduced", self.reduced_offset, self.reduced_bytes))
            out.append(("handoff", self.handoff_offset, self.handoff_bytes))
        for rotation in range(NUM_ROWS_ROTATIONS if self.rows_slot_bytes else 0):
            base, s = self.rows_offset(rotation), self.rows_slot_bytes
            out += [(f"rows[{rotation}].slot[{r}]", base + r * s, s) for r in range(w)]
        return out
