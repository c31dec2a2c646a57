"""The plans' settings, as data: one frozen ``Knobs`` per (world size, GPU model).

Words used throughout: **knobs** are these settings; a **table** is a file of measured knobs
(``tpfuse.comm.tables``, written by ``tpfuse tune``); a **plan** is what one call does,
derived from the knobs and the call's shape (``tpfuse.comm.plan``, ``tpfuse.comm.quant_plan``);
the **layout** is where a communicator's workspace keeps what (``tpfuse.comm.workspace``).

A ``Communicator`` takes its knobs once, at construction (``Communicator(knobs=...)``, by
default the table of its GPU model and world size over ``default_knobs``), checks that every
rank has the same ones, and hands them to every plan: nothing here changes at run time, so
ranks cannot drift apart (docs/design.md 2.5). Experiments build their own knobs with
``knobs.replace(...)``. Sizes are message bytes; what chose each value is in
benchmarks/NOTES.md, "Knobs", under the knob's name in capitals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpfuse._runtime import INTERPRETER
from tpfuse.quant_format import QUANT_CODECS

KiB = 1024
MiB = 1024 * KiB

LAUNCH_KINDS = ("oneshot", "oneshot_ll", "oneshot_lamport", "twoshot")
QUANT_TILE_UNIT = 128
"""Quantized tiles are multiples of this many elements: whole groups of 32, and whole 256-byte
units of every dtype (``tpfuse.comm.quant_plan``)."""
GATHER_MODES = ("push", "pull")


@dataclass(frozen=True)
class Launch:
    """A kernel's launch shape: bytes per tile (one-shot over Lamport words: the smallest, the
    tile growing with the message up to ``max_tile_bytes``), warps per CTA (there: at most) and
    CTAs per call (at most). Every CTA of a grid must be resident at once (block b waits for
    block b of every peer, tpfuse.kernels.sync), so ``max_ctas`` stays at or below the SM count
    at one CTA per SM."""

    tile_bytes: int
    num_warps: int
    max_ctas: int
    max_tile_bytes: int = 0


@dataclass(frozen=True)
class Knobs:
    """Every setting the plans read, at one world size. Build them with ``default_knobs(W)``
    or ``tpfuse.comm.knobs_for(W, gpu_name)`` (``Knobs(W)`` alone holds the field defaults
    below, W=2's GPU values, whatever W and device), then ``knobs.replace(...)``, which
    checks. Frozen. ``check()`` validates; ``Communicator`` calls it."""

    world_size: int
    source: str = "defaults"
    """Where the values came from ("defaults", a table's file name, or what an experiment says)."""

    # ---- The all-reduce (tpfuse.comm.plan.AllReducePlan).
    oneshot_max_bytes: int = 512 * KiB
    """Largest message "auto" sends to one-shot (then two-shot)."""
    ll_max_bytes: int = 128 * KiB
    """Largest one-shot message over LL words (tpfuse.kernels.ll): no fence and no flag round
    trip, for twice the bytes on the links. With the fused LL knobs and lamport_max_bytes it
    sizes the workspace's LL regions (``tpfuse.comm.plan.workspace_layout``)."""
    lamport_max_bytes: int = 0
    """Largest one-shot message over Lamport words (the data is its own flag), above LL's; 0:
    never."""
    nccl_min_bytes: int | None = None
    """Smallest message "auto" hands to the group's backend; None: never. Setting it trades the
    bitwise contract for speed on large messages, so a person decides it: no table sets it."""
    oneshot: Launch = Launch(8 * KiB, 16, 32)
    """One-shot with flags. 8 KiB is 512 threads of one 16-byte vector."""
    oneshot_ll: Launch = Launch(1 * KiB, 4, 64)
    """One-shot over LL words, which carry 4 data bytes in 8."""
    oneshot_lamport: Launch = Launch(2 * KiB, 16, 128, max_tile_bytes=16 * KiB)
    """One-shot over Lamport words: a message is cut into tiles of nbytes / (tiles_per_cta *
    max_ctas), a power of two within [tile_bytes, max_tile_bytes], a warp per 512 bytes."""
    lamport_tiles_per_cta: int = 1
    twoshot: Launch = Launch(8 * KiB, 16, 128)
    gather: str = "push"
    """Two-shot's all-gather: "push" stores each reduced chunk into every peer's gather slot
    (posted remote stores, local polls, one local copy); "pull" has every peer load it from the
    owner's slot into its output (remote loads, no copy)."""

    # ---- Fused all-reduce + residual add + RMSNorm (tpfuse.comm.plan.FusedPlan). The fused_*
    # sizes are measured at hidden 4096 bf16, their fused_wide_* twins at hidden 8192
    # (tpfuse.comm.plan.FUSED_WIDE_TILE).
    fused_oneshot_max_bytes: int = 512 * KiB
    """Largest message (x's bytes) "auto" sends to the fused one-shot with flags, for norm
    tiles of at most fused_oneshot_max_vectors vectors per thread (a decode call is a CTA per
    row tile, its per-thread work on the critical path); wider tiles only once the call has a
    row tile for each of fused_max_ctas CTAs."""
    fused_oneshot_max_vectors: int = 4
    fused_ll_max_bytes: int = 128 * KiB
    """Largest message the fused one-shot sends over LL words (a row spread over several CTAs);
    a knob of its own, as it stops paying before the all-reduce's."""
    fused_lamport_max_bytes: int = 0
    """Largest message the fused one-shot sends over Lamport words, above LL's; 0: never."""
    fused_twoshot_max_bytes: int = 0
    """Largest message "auto" sends to the fused two-shot; above every fused limit, "split"."""
    fused_wide_oneshot_max_bytes: int = 512 * KiB
    fused_wide_ll_max_bytes: int = 128 * KiB
    fused_wide_lamport_max_bytes: int = 0
    fused_wide_twoshot_max_bytes: int = 0
    fused_rows_max_bytes: int = 64 * KiB
    """Largest message the fused one-shot runs row-wise (before LL's and Lamport's): each CTA
    that stores a piece of a row tile polls the whole tile and normalises it, storing only its
    piece. Only for tiles of at most fused_rows_max_tile_bytes held without a tail. Not swept
    by `tpfuse tune` (scripts/fused_ab.py measures it); it sizes the workspace's rows regions."""
    fused_rows_max_tile_bytes: int = 8 * KiB
    fused_rows_piece_bytes: int = 1 * KiB
    """Bytes of x each CTA of a row-wise call stores."""
    fused_max_ctas: int = 128
    """CTAs per fused call; every CTA resident at once, as for ``Launch.max_ctas``."""

    # ---- The quantized all-reduce (tpfuse.comm.quant_plan.QuantPlan).
    quant_min_bytes: tuple[tuple[str, int | None], ...] = (
        ("int4", 2 * MiB), ("int6", 4 * MiB), ("int8", 4 * MiB), ("fp8", 8 * MiB))
    """(codec, smallest message that takes the quantized path when that codec is requested;
    None: never). Smaller messages take the exact path; ``quant_min_bytes=`` overrides it per
    call."""
    quant_tile: tuple[tuple[str, int], ...] = (("int4", 16384), ("int6", 16384), ("int8", 16384), ("fp8", 8192))
    """(codec, elements per tile on large segments; a multiple of 32)."""
    quant_small_tile: int = 8192
    """The tile of segments of at most quant_small_tile_max_chunk elements per rank, so that
    every CTA still gets several tiles."""
    quant_small_tile_max_chunk: int = 1 << 22
    quant_num_warps: int = 32
    """Warps per CTA on the large tile (W=2's; other world sizes 16)."""
    quant_small_num_warps: int = 16
    quant_max_ctas: int = 128

    def launch(self, kind: str) -> Launch:
        """The launch shape of ``kind``, one of LAUNCH_KINDS."""
        return getattr(self, kind)

    def quant_min(self, codec: str) -> int | None:
        return dict(self.quant_min_bytes)[codec]

    def quant_tile_of(self, codec: str) -> int:
        return dict(self.quant_tile)[codec]

    def replace(self, **changes) -> Knobs:
        """A copy with ``changes`` (field names; ``quant_min_bytes`` may be a dict), checked."""
        for key in ("quant_min_bytes", "quant_tile"):
            if isinstance(changes.get(key), dict):
                changes[key] = tuple((dict(getattr(self, key)) | changes[key]).items())
        return dataclasses.replace(self, **changes).check()

    def as_dict(self) -> dict:
        """Plain values (what ranks compare, and what results record)."""
        return dataclasses.asdict(self)

    def check(self) -> Knobs:
        """Raise ValueError for a value no plan can use; return self."""
        defaults = Knobs(self.world_size)
        for field in dataclasses.fields(self):
            value, name = getattr(self, field.name), field.name
            default = getattr(defaults, name)
            if isinstance(default, Launch):
                _check_launch(name, value)
            elif isinstance(default, int) or (default is None and value is not None):
                # sizes may be 0 (never); counts may not
                _check_size(name, value, minimum=0 if name.endswith("_bytes") else 1)
            elif isinstance(default, str) and not isinstance(value, str):
                raise ValueError(f"knobs: {name} must be a string, got {value!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"knobs: gather must be one of {GATHER_MODES}, got {self.gather!r}")
        if _is_pow2(self.fused_rows_piece_bytes) < 16:
            raise ValueError("knobs: fused_rows_piece_bytes must be a power of two >= 16, got "
                             f"{self.fused_rows_piece_bytes}")
        for name in ("quant_min_bytes", "quant_tile"):
            codecs = [c for c, _ in getattr(self, name)]
            if sorted(codecs) != sorted(QUANT_CODECS):
                raise ValueError(f"knobs: {name} needs one entry per codec {QUANT_CODECS}, got {codecs}")
        for codec, size in self.quant_min_bytes:
            if size is not None:
                _check_size(f"quant_min_bytes[{codec}]", size)
        for name, elems in [(f"quant_tile[{c}]", e) for c, e in self.quant_tile] + [("quant_small_tile",
                                                                                     self.quant_small_tile)]:
            _check_size(name, elems, minimum=1)
            if elems % QUANT_TILE_UNIT:  # whole groups of whole 16-byte vectors in every dtype
                raise ValueError(f"knobs: {name} must be a multiple of {QUANT_TILE_UNIT}, got {elems}")
        return self


def _is_pow2(value: int) -> int:
    """value where it is a power of two, else 0."""
    return value if value > 0 and value & (value - 1) == 0 else 0


def _check_launch(name: str, launch) -> None:
    if not isinstance(launch, Launch):
        raise ValueError(f"knobs: {name} must be a Launch, got {launch!r}")
    for key, value in dataclasses.asdict(launch).items():
        _check_size(f"{name}.{key}", value, minimum=0 if key == "max_tile_bytes" else 1)
    if _is_pow2(launch.tile_bytes) < 16 or not _is_pow2(launch.num_warps) or launch.num_warps > 32:
        raise ValueError(f"knobs: {name} needs a tile of a power of two of at least 16 bytes and 1 to 32 warps, a "
                         f"power of two; got {launch}")
    if name == "oneshot_lamport" and (_is_pow2(launch.max_tile_bytes) < launch.tile_bytes):
        raise ValueError(f"knobs: {name}.max_tile_bytes must be a power of two >= tile_bytes, got {launch}")


def _check_size(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"knobs: {name} must be an int >= {minimum}, got {value!r}")


def default_knobs(world_size: int) -> Knobs:
    """The knobs without a table: W=2's and W=4's measured long ago, W=8's (which every other
    world size takes) guesses; under Triton's interpreter, the CPU tests' (below)."""
    knobs = Knobs(world_size)
    if world_size not in (2, 4):
        knobs = dataclasses.replace(
            knobs, oneshot_max_bytes=128 * KiB, ll_max_bytes=64 * KiB, fused_oneshot_max_bytes=128 * KiB,
            fused_ll_max_bytes=64 * KiB, fused_wide_oneshot_max_bytes=128 * KiB, fused_wide_ll_max_bytes=64 * KiB,
            quant_min_bytes=tuple((codec, None) for codec, _ in knobs.quant_min_bytes))
    if world_size != 2:
        knobs = dataclasses.replace(knobs, fused_rows_max_bytes=0, quant_small_tile_max_chunk=1 << 23,
                                    quant_num_warps=16)
    return (_interpreter_knobs(knobs) if INTERPRETER else knobs).check()


def _interpreter_knobs(knobs: Knobs) -> Knobs:
    """The CPU tests' knobs: the protocols within the tests' sizes, and few large tiles (the
    interpreter pays per operation, not per element, and runs blocks one after another, each a
    flag round). A row-wise piece is a whole tile: a CTA waiting for a piece that a later CTA
    stores would wait for ever."""
    return dataclasses.replace(
        knobs, ll_max_bytes=64 * KiB, lamport_max_bytes=128 * KiB if knobs.world_size not in (2, 4) else 256 * KiB,
        oneshot=Launch(64 * KiB, 16, 4), oneshot_ll=Launch(64 * KiB, 4, 4),
        oneshot_lamport=Launch(64 * KiB, 16, 4, max_tile_bytes=64 * KiB), twoshot=Launch(64 * KiB, 16, 4),
        fused_ll_max_bytes=16 * KiB, fused_wide_ll_max_bytes=16 * KiB, fused_lamport_max_bytes=128 * KiB,
        fused_wide_lamport_max_bytes=128 * KiB, fused_rows_max_bytes=1 * KiB, fused_rows_piece_bytes=64 * KiB,
        fused_max_ctas=4, quant_tile=tuple((codec, 8192) for codec in QUANT_CODECS), quant_small_tile=4096,
        quant_small_tile_max_chunk=1 << 14, quant_max_ctas=4)
