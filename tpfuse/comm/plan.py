"""How an all-reduce of a given size runs: algorithm and launch shape, in one place.

Everything here is derived from (numel, world size, dtype, workspace layout), which every
rank has identically, so every rank launches the identical grid (docs/design.md 2.5).

The GPU thresholds, CTA counts, tile size and warps were set from the 4x H200 sweep
(scripts/tune_allreduce.py, W=4 bf16; the knob notes below and benchmarks/NOTES.md), within
H200's limits (132 SMs).

The size thresholds keyed by world size (``tpfuse.comm.tables.SIZE_KNOBS``) are defaults
(from the 4x H200 sweep; W=8's entries, never measured, are guesses): a measured table
``tpfuse/comm/tables/w{W}.json`` (``tpfuse tune --write-table`` on a W-GPU machine) replaces
them for that W when tpfuse.comm is imported (``tpfuse.comm.tables``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpfuse._runtime import INTERPRETER
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout
from tpfuse.kernels.common import TRITON_DIVISIBILITY
from tpfuse.kernels.fused import lamport_tiling, ll_pieces, rows_pieces
from tpfuse.kernels.norm import NormConfig

KiB = 1024

# ---- Tunable knobs, all in one place. Set from scripts/tune_allreduce.py on 4x H200
# (2026-11-20, W=4 bf16, benchmarks/NOTES.md): 16 warps beat 8 at every size for both
# algorithms (3-12%); one-shot is flat for 32-128 CTAs and beats two-shot to 512 KiB
# (256 KiB: 8.6 vs 10.7 us; 1 MiB: 16.6 vs 15.8); two-shot with 128 CTAs was within 0-4% of
# the per-size best from 256 KiB to 128 MiB (32 MiB: 168.9 us, 298 GB/s, NCCL 177.3; 128 MiB
# 647 us, NCCL 615). The per-world-size thresholds below are W=4's, reused elsewhere, but
# W reads tables/w{W}.json when it exists (the size knobs of tpfuse.comm.tables.SIZE_KNOBS):
# W=2 and W=4 have one, from `tpfuse tune` on 2x and 4x H200.
#
# ONESHOT_MAX_BYTES: largest message "auto" sends to one-shot, by world size (other sizes:
#   W=8's). Above it, two-shot.
# NCCL_MIN_BYTES: smallest message "auto" hands to the group's backend (NCCL), by world size;
#   None = never (auto stays exact, bitwise equal to tpfuse.reference, at every size the
#   workspace holds). Set it only where the sweep shows two-shot losing to NCCL by more than
#   5%: NCCL's results are not bitwise reproducible, so this trades the exactness contract
#   of "auto" for speed on large messages. A person decides this, so `tpfuse tune` times NCCL
#   for reference only and no table sets it.
# TILE_BYTES: bytes of a tile; on GPUs 8 KiB = 512 threads (NUM_WARPS 16) x one 16-byte
#   vector. The "oneshot_ll" entries of TILE_BYTES, NUM_WARPS and MAX_CTAS serve one-shot
#   over LL, whose 8-byte words carry 4 data bytes. The interpreter pays per operation, not
#   per element, so it takes large tiles.
#   One-shot over Lamport words takes a range of tile sizes instead (`tile_and_warps`).
# NUM_WARPS: warps per CTA, per algorithm (one-shot over Lamport words: at most).
# LAMPORT_TILES_PER_CTA: one-shot over Lamport words cuts a message into tiles of
#   nbytes / (this * MAX_CTAS) rounded down to a power of two, within its TILE_BYTES range, and
#   takes a warp per 512 bytes of tile (one 16-byte vector per thread, up to NUM_WARPS).
#   2x H100 sweep (scripts/tune_allreduce.py at 07762fc, W=2 bf16, 2-16 KiB tiles, 4-16
#   warps, 32-128 CTAs; benchmarks/NOTES.md): the best tile grew with the message,
#   2 KiB on 4 warps to 1 MiB (7.5 us), 4 KiB on 8 warps at 2 MiB (11.3), 8 KiB on 16 at 4 MiB
#   (18.7), 16 KiB on 16 at 8 MiB (34.0), all on 128 CTAs: 4 tiles per CTA each time. A
#   single tile for all sizes lost 4-16% (4 KiB on 8 warps). Once a rank no longer stored
#   into its own slot (04d26bf), the best tile grew fourfold: 2x H200 sweep at f592754
#   (results/2xH200/tune_lamport_tiles.md, 128 CTAs): 2 KiB to 256 KiB, 4 KiB at 512 KiB
#   (4.8 us, 2 KiB 5.1), 8 KiB on 16 warps at 1 MiB (6.55, the old rule's 2 KiB 7.14),
#   16 KiB at 2 MiB (10.38, old 4 KiB 10.89) and 4 MiB (18.05, old 8 KiB 18.14): tiles of
#   nbytes / MAX_CTAS within the 2-16 KiB range, which this rule (1) gives at every size swept.
# MAX_CTAS: CTAs per call, per algorithm. Every CTA of a grid must be resident at once
#   (block b waits for block b of every peer, see tpfuse.kernels.sync), so a grid must stay
#   at or below the SM count (132 on H200) with one CTA per SM; MAX_BLOCKS (flag slots) caps
#   it too. Under the interpreter blocks run one after another and each costs a flag round,
#   so few large blocks are fastest.
# GATHER: two-shot's all-gather phase. "push": the owner of chunk c stores its reduced chunk
#   into gather slot c of every peer, which then copies the W-1 gather slots to its output
#   (posted remote stores, local polls, one extra local copy). "pull": the owner stores it
#   into its own gather slot only, and every peer loads it from there straight into its
#   output (remote loads, no local copy).
# LL_MAX_BYTES: largest message one-shot sends over the LL protocol (tpfuse.kernels.ll: flags
#   inside the data words, twice the bytes on the links, no fence and no flag round trip), by
#   world size (other sizes: W=8's); larger one-shot messages use Lamport words or separate
#   flags. With FUSED_LL_MAX_BYTES and LAMPORT_MAX_BYTES it sizes the workspace's LL regions
#   (`workspace_layout`: 2 * W slots of the larger of twice LL's bytes and Lamport's, plus
#   the larger of the two for the fused kernel's reduced rows). The interpreter's
#   value keeps both protocols inside the CPU tests' sizes. 4x H200 sweep (W=4 bf16):
#   LL with 1 KiB tiles on 4 warps (2 words per thread), up to 64 CTAs: 8 KiB 3.65 us (flags
#   5.06), 64 KiB 5.12 (6.04), 128 KiB 6.71 (6.9), 256 KiB LL 10.6, flags 8.4. A tile of
#   4 KiB on one CTA took 8.5 us at 8 KiB: a CTA drains its NVLink stores slowly, so LL
#   wants many small CTAs. W=8 is not measured (its LL sends 7 peers twice the bytes).
# LAMPORT_MAX_BYTES: largest message one-shot sends over Lamport words (tpfuse.kernels.ll: the
#   data is its own flag; the bytes of the flag one-shot on the links, no fence and no flag
#   round trip), by world size, for sizes above LL_MAX_BYTES; larger one-shot messages use
#   separate flags. 0 (never) until measured at that world size (`tpfuse tune`); the
#   interpreter's value keeps the protocol inside the CPU tests' sizes.
ONESHOT_MAX_BYTES = {2: 512 * KiB, 4: 512 * KiB, 8: 128 * KiB}
LL_MAX_BYTES = ({2: 128 * KiB, 4: 128 * KiB, 8: 64 * KiB} if not INTERPRETER else
                {2: 64 * KiB, 4: 64 * KiB, 8: 64 * KiB})
LAMPORT_MAX_BYTES = ({2: 0, 4: 0, 8: 0} if not INTERPRETER else
                     {2: 256 * KiB, 4: 256 * KiB, 8: 128 * KiB})
NCCL_MIN_BYTES: dict[int, int | None] = {2: None, 4: None, 8: None}
TILE_BYTES = ({"oneshot": 8 * KiB, "oneshot_ll": 1 * KiB, "oneshot_lamport": (2 * KiB, 16 * KiB), "twoshot": 8 * KiB}
              if not INTERPRETER else
              {"oneshot": 64 * KiB, "oneshot_ll": 64 * KiB, "oneshot_lamport": (64 * KiB, 64 * KiB),
               "twoshot": 64 * KiB})
NUM_WARPS = {"oneshot": 16, "oneshot_ll": 4, "oneshot_lamport": 16, "twoshot": 16}
LAMPORT_TILES_PER_CTA = 1
MAX_CTAS = ({"oneshot": 32, "oneshot_ll": 64, "oneshot_lamport": 128, "twoshot": 128} if not INTERPRETER else
            {"oneshot": 4, "oneshot_ll": 4, "oneshot_lamport": 4, "twoshot": 4})
GATHER = "push"
GATHER_MODES = ("push", "pull")
MAX_BLOCKS = 128
"""Flag slots per phase in the workspace: every grid above must fit."""
MAX_ELEMENTS = 2**31 - 1
"""Kernels index elements with int32."""


ALGOS = ("auto", "oneshot", "twoshot", "nccl")


def for_world(knob: dict, world_size: int):
    """A knob keyed by world size, at ``world_size``: its own entry, else W=8's."""
    return knob.get(world_size, knob[8])


def workspace_layout(world_size: int, max_bytes: int) -> WorkspaceLayout:
    """A communicator's workspace: two-shot to max_bytes, one-shot to its slots' capacity, and
    LL regions for LL words up to the largest of LL_MAX_BYTES and the fused LL knobs and for
    Lamport words up to LAMPORT_MAX_BYTES, and rows regions up to FUSED_ROWS_MAX_BYTES, as the
    knobs are now (each at most the one-shot capacity)."""
    oneshot_capacity = WorkspaceLayout(world_size, max_bytes, MAX_BLOCKS).oneshot_slot_bytes
    ll = max(for_world(knob, world_size) for knob in (LL_MAX_BYTES, FUSED_LL_MAX_BYTES, FUSED_WIDE_LL_MAX_BYTES))
    return WorkspaceLayout(world_size, max_bytes, MAX_BLOCKS, min(ll, oneshot_capacity),
                           min(for_world(LAMPORT_MAX_BYTES, world_size), oneshot_capacity),
                           min(for_world(FUSED_ROWS_MAX_BYTES, world_size), oneshot_capacity))


def uses_ll(nbytes: int, world_size: int, layout: WorkspaceLayout) -> bool:
    """Whether a one-shot message of nbytes goes over LL: LL_MAX_BYTES as it is now (tuning
    scripts lower it at run time), within the LL capacity of the workspace."""
    return nbytes <= min(layout.ll_max_bytes, for_world(LL_MAX_BYTES, world_size))


def oneshot_protocol(nbytes: int, world_size: int, layout: WorkspaceLayout) -> str:
    """One-shot's protocol for a message of nbytes: "ll" up to LL_MAX_BYTES, "lamport" up to
    LAMPORT_MAX_BYTES, else "flags" (each as it is now, within the workspace's capacity)."""
    if uses_ll(nbytes, world_size, layout):
        return "ll"
    if nbytes <= min(layout.lamport_max_bytes, for_world(LAMPORT_MAX_BYTES, world_size)):
        return "lamport"
    return "flags"


def tile_and_warps(knob: str, nbytes: int) -> tuple[int, int]:
    """(tile bytes, warps) of the launch knob ``knob`` (a key of TILE_BYTES) for a message of
    nbytes: TILE_BYTES's and NUM_WARPS's entries, but for one-shot over Lamport words, whose
    tile grows with the message (LAMPORT_TILES_PER_CTA)."""
    if knob != "oneshot_lamport":
        return TILE_BYTES[knob], NUM_WARPS[knob]
    smallest, largest = TILE_BYTES[knob]
    per_tile = nbytes // (LAMPORT_TILES_PER_CTA * MAX_CTAS[knob])
    tile = min(largest, max(smallest, 1 << max(per_tile.bit_length() - 1, 0)))  # a power of two
    return tile, max(1, min(NUM_WARPS[knob], tile // 512))  # 32 threads x 16 bytes per warp


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {', '.join(map(repr, ALGOS))}, got {algo!r}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AllReducePlan:
    """Algorithm and launch shape of one all-reduce.

    algo: "oneshot", "twoshot" or "nccl" (the group's backend: NCCL on GPUs, gloo on CPU);
    reason: why "nccl" was chosen (empty otherwise); block: elements per tile; grid: CTAs;
    chunk: elements of each rank's share (two-shot; a multiple of ALIGN bytes); gather:
    two-shot's all-gather mode (see GATHER); protocol: one-shot's, "ll", "lamport" or "flags"
    (``oneshot_protocol``; "flags" for every other algorithm).
    """

    algo: str
    block: int = 0
    grid: int = 0
    num_warps: int = 8
    chunk: int = 0
    gather: str = "push"
    protocol: str = "flags"
    reason: str = ""

    @classmethod
    def from_numel(cls, numel: int, world_size: int, dtype: torch.dtype, layout: WorkspaceLayout | None,
                   algo: str = "auto") -> "AllReducePlan":
        """The plan for an all-reduce of ``numel`` elements of ``dtype`` over ``world_size``
        ranks whose workspaces have ``layout`` (None: no peer workspace).

        ``algo="auto"`` picks one-shot up to ONESHOT_MAX_BYTES (its protocol by size:
        ``oneshot_protocol``), else two-shot, else the
        backend from NCCL_MIN_BYTES on (never, by default) or when the message does not fit
        the workspace. An explicit "oneshot" or
        "twoshot" that the workspace cannot serve raises ValueError.
        """
        check_algo(algo)
        if algo == "nccl":
            return cls("nccl", reason="algo='nccl' was requested")
        if layout is None:
            if algo == "auto":
                return cls("nccl", reason="no peer workspace")
            raise ValueError(f"algo={algo!r} needs a peer workspace, and this communicator has none")
        esize = dtype.itemsize
        nbytes = numel * esize
        align = ALIGN // esize
        chunk = _cdiv(_cdiv(numel, world_size), align) * align
        fits = {
            "oneshot": nbytes <= layout.oneshot_slot_bytes,
            "twoshot": chunk * esize <= layout.twoshot_slot_bytes,
        }
        if algo == "auto":
            small = nbytes <= for_world(ONESHOT_MAX_BYTES, world_size)
            nccl_min = for_world(NCCL_MIN_BYTES, world_size)
            if nccl_min is not None and nbytes >= nccl_min:
                return cls("nccl", reason=f"messages of {nccl_min} bytes and more go to the backend (NCCL_MIN_BYTES)")
            algo = "oneshot" if small and fits["oneshot"] else "twoshot"
            if not fits[algo] or numel > MAX_ELEMENTS:
                return cls("nccl", reason=f"messages too large for the workspace (max_bytes={layout.max_bytes})")
        elif not fits[algo] or numel > MAX_ELEMENTS:
            cap = layout.oneshot_slot_bytes if algo == "oneshot" else layout.max_bytes
            raise ValueError(f"algo={algo!r} serves messages up to about {cap} bytes with this workspace "
                             f"(max_bytes={layout.max_bytes}); got {nbytes} bytes. Create the Communicator "
                             "with a larger max_bytes, or use algo='auto'")
        protocol = oneshot_protocol(nbytes, world_size, layout) if algo == "oneshot" else "flags"
        knob = f"oneshot_{protocol}" if protocol != "flags" else algo
        tile_bytes, num_warps = tile_and_warps(knob, nbytes)
        block = tile_bytes // esize
        tiles = _cdiv(numel if algo == "oneshot" else chunk, block)
        grid = max(1, min(tiles, MAX_CTAS[knob], layout.max_blocks))
        if algo == "oneshot":
            return cls(algo, block=block, grid=grid, num_warps=num_warps, protocol=protocol)
        if GATHER not in GATHER_MODES:
            raise ValueError(f"GATHER must be one of {GATHER_MODES}, got {GATHER!r}")
        return cls(algo, block=block, grid=grid, num_warps=NUM_WARPS[algo], chunk=chunk, gather=GATHER)


# ---- Fused all-reduce + residual add + RMSNorm (Communicator.all_reduce_add_rms_norm).
# The fused kernels (tpfuse.kernels.fused) take the norm's tile shape and warps, fixed by
# (N, dtype) (NormConfig), so only the algorithm and the grid are chosen here. Set from
# `tpfuse bench fused` on 4x H200 (W=4 bf16, benchmarks/NOTES.md), the defaults: W reads
# tables/w{W}.json when it exists (the FUSED_* size knobs, measured at hidden 4096 bf16 by
# `tpfuse tune`, and their FUSED_WIDE_* twins, measured at hidden 8192); W=2 and W=4 have one.
#
# FUSED_ONESHOT_MAX_BYTES: largest message (x's bytes) "auto" sends to the fused one-shot
#   kernel, by world size (other sizes: W=8's), and only for hidden sizes whose norm tile
#   holds at most FUSED_ONESHOT_MAX_VECTORS 16-byte vectors per thread: a decode call is one
#   CTA per row tile, and its per-thread work is on the critical path. The limit was 2 when
#   1-token calls used the flag kernel (4x H200, before LL: hidden 8192, 4 vectors per
#   thread, 0.97x of split at 1 token); those calls now go over LL (below), and above the LL
#   limit 4 vectors measured faster fused than split (hidden 8192 bf16, flags: 4x H200, 16
#   tokens 10.4 vs 10.8 us; 2x H100, 16 tokens 8.2 vs 8.5, 128 tokens 14.8 vs 19.2), so the
#   limit is 4. Tiles of more vectors per thread (bf16 hidden 4112-6144, 8208-16384 and
#   49152-65536; fp32 4112-16384) go fused only once the call has a row tile for each of
#   FUSED_MAX_CTAS CTAs (2x H100, hidden 5120 bf16, flags: 16 tokens 9.1 us fused vs 7.9
#   split, 128 tokens 13.0 vs 15.6). That needs 128 rows under FUSED_ONESHOT_MAX_BYTES, which
#   no table allows at these sizes now (W=2's 1 MiB since 2e67899 holds 128 rows of 4096 bf16
#   at most; the wide tile's own knob covers hidden 6160-8192); the rule stays for tables that do.
# FUSED_LL_MAX_BYTES: largest message the fused one-shot sends over LL, by world size (within
#   the workspace's LL regions, which it sizes with LL_MAX_BYTES); "auto" takes the
#   fused one-shot for these whatever FUSED_ONESHOT_MAX_VECTORS says: that kernel spreads each
#   row over several CTAs (commit d9ff098, W=4: hidden 4096, 1-16 tokens, fused 5.2-8.0 us,
#   split 5.5-8.6; hidden 8192, 1 token, 5.9 vs 6.6). Above it the flag kernel and the vectors
#   rule apply (W=4, hidden 4096, 32 tokens: 9.7 vs 10.5 us). A knob of its own because the
#   fused LL kernel stops paying before the all-reduce's does: W=2 (`tpfuse tune` at 4c797ca),
#   the all-reduce over LL wins to 256 KiB (5.5 us vs flags 6.2), the fused LL kernel at 256 KiB
#   (32 tokens) took 9.1 us against split's 7.7.
# FUSED_LAMPORT_MAX_BYTES: largest message the fused one-shot sends over Lamport words, above
#   FUSED_LL_MAX_BYTES, by world size (within the workspace's Lamport capacity,
#   LAMPORT_MAX_BYTES); the same kernel as LL's, with whole row tiles or pieces of a 16-byte
#   vector per thread, where one of them pays (`tpfuse.kernels.fused.lamport_tiling`; else the
#   flag kernel's rules apply). Like LL's, "auto" takes it whatever FUSED_ONESHOT_MAX_VECTORS
#   says. 0 (never) until measured at that world size (`tpfuse tune`).
# FUSED_TWOSHOT_MAX_BYTES: largest message "auto" sends to the fused two-shot kernel (0: never;
#   it measured 0.91-0.98x of split from 128 to 1024 tokens).
#   Above both, "split" (tpfuse all_reduce, then add_rms_norm: the same bits).
# FUSED_MAX_CTAS: CTAs per fused call. Every CTA must be resident at once (as for MAX_CTAS):
#   the norm's tiles use at most 32 warps (chunked rows and bf16 rows held narrow; 8
#   otherwise), so 128 CTAs fit
#   H200's 132 SMs at one CTA per SM.
FUSED_ONESHOT_MAX_BYTES = {2: 512 * KiB, 4: 512 * KiB, 8: 128 * KiB}
FUSED_ONESHOT_MAX_VECTORS = 4
FUSED_LL_MAX_BYTES = ({2: 128 * KiB, 4: 128 * KiB, 8: 64 * KiB} if not INTERPRETER else  # LL_MAX_BYTES's defaults
                      {2: 16 * KiB, 4: 16 * KiB, 8: 16 * KiB})
FUSED_LAMPORT_MAX_BYTES = {2: 0, 4: 0, 8: 0} if not INTERPRETER else {2: 128 * KiB, 4: 128 * KiB, 8: 128 * KiB}
FUSED_TWOSHOT_MAX_BYTES = {2: 0, 4: 0, 8: 0}
# FUSED_ROWS_MAX_BYTES: largest message the fused one-shot runs row-wise (protocol "rows",
#   before LL's and Lamport's): the CTAs that store the pieces of a row tile, as Lamport words,
#   each poll the whole tile and normalise it, storing only their own piece of y and
#   residual_out. No handoff count between them (its acq_rel release cost 0.3 us on a small
#   call wherever it stood) and no round trip through the reduced region; each CTA polls the
#   whole tile instead, so only tiles of at most FUSED_ROWS_MAX_TILE_BYTES held in registers
#   without a tail (NormConfig) run row-wise, one piece per CTA within FUSED_MAX_CTAS. 2x H200,
#   the measurement-only fused_ab variant redundant_norm (LL words, acd19a5): hidden 4096 x 1
#   token 4.48 us against the LL kernel's 4.87, x 2 4.75 against 4.98, 2880 x 1 (a row padded
#   to 4096 lanes) 4.35 against 4.70, 5120 x 1 (a tail: not row-wise here) 8.45 against 5.54 (20
#   CTAs of 4 warps, each polling an 8192-lane row). The kernel, 2x H200 at 93bad7f
#   (results/2xH200/fused_ab.md), against the same tree with it off: hidden 4096 x 1 / 2 / 4 /
#   8 / 16 tokens 3.95 / 4.26 / 4.64 / 4.78 / 5.42 us against 4.62 / 4.95 / 5.11 / 5.38 / 5.64,
#   2880 x 1 / 16 3.91 / 5.04 against 4.48 / 5.44. Once the Lamport kernel's threads spin on
#   their own vectors (results/2xH200/fused_rows_ab.md, 2e67899): 4096 x 1 / 2 / 4 / 8 / 16
#   3.97 / 4.33 / 4.57 / 4.78 / 5.45 against 4.53 / 4.48 / 4.62 / 4.87 / 5.13 (split 5.36 at 16),
#   2880 x 16 5.06 against 4.99: W=2's 64 KiB. 4x H200, W=4 (results/4xH200/fused_ab_w4.md):
#   slower, 4096 x 1 5.51 against 4.81, so never there; W=8 never, not measured. Narrower rows
#   take it by the same rule, unmeasured (bf16 hidden 1024 to 64 tokens, 256 to 256: 128
#   CTAs, each polling a tile of at most 8 KiB as at 4096). A row-wise call first zeroes the last
#   one's words (up to W x 64 KiB), on its own grid: after an 8-token call a 1-token call at
#   4096 zeroes 128 KiB on 8 CTAs, once, on a change of batch size. Not swept by `tpfuse tune`,
#   which times the other protocols with it off; row-wise also needs FUSED_ONESHOT_MAX_BYTES
#   (the "auto" one-shot limit) to reach it, which a table could set below it unmeasured.
# FUSED_ROWS_PIECE_BYTES: bytes of x each CTA of a row-wise call stores, 1 KiB: the LL kernel's
#   pieces at hidden 4096 (8 CTAs a row), as in the measurement above. The interpreter runs
#   CTAs one after another, so a CTA waiting for pieces of its own rank that a later CTA stores
#   would wait for ever: there a piece is a whole tile.
FUSED_ROWS_MAX_BYTES = {2: 64 * KiB, 4: 0, 8: 0} if not INTERPRETER else {2: 1 * KiB, 4: 1 * KiB, 8: 1 * KiB}
FUSED_ROWS_MAX_TILE_BYTES = 8 * KiB
FUSED_ROWS_PIECE_BYTES = 1 * KiB if not INTERPRETER else 64 * KiB
# FUSED_WIDE_TILE: (hidden, dtype) of the row on which `tpfuse tune` measures the FUSED_WIDE_*
#   thresholds; calls whose norm tile is that row's (the same bytes, chunks, rows and warps:
#   bf16 and fp16 hidden 6160-8192, fp32 2064-4096) take them in place of the four above,
#   which are measured at hidden 4096 bf16 and serve every other tile. A fused kernel's cost
#   follows the norm's tile while split's is the all-reduce's at every width, so one
#   threshold per kernel could not serve both within 3% (2x H200 at 4c718f7: at 8 MiB the
#   flag one-shot tied split at hidden 4096, 42.0 vs 42.8 us, and won at 8192, 39.2 vs 42.7;
#   the fused two-shot won at 8192 x 2048 tokens, 135.0 vs 141.6, and never at 4096). Other
#   tiles (e.g. bf16 hidden 5120, 16384) are not measured and keep the hidden-4096 values.
#   Defaults: the narrow ones; a table without FUSED_WIDE_* entries gives wide rows its
#   narrow values (``tpfuse.comm.tables.read_table``).
FUSED_WIDE_TILE = (8192, torch.bfloat16)
FUSED_WIDE_LL_MAX_BYTES = dict(FUSED_LL_MAX_BYTES)
FUSED_WIDE_LAMPORT_MAX_BYTES = dict(FUSED_LAMPORT_MAX_BYTES)
FUSED_WIDE_ONESHOT_MAX_BYTES = dict(FUSED_ONESHOT_MAX_BYTES)
FUSED_WIDE_TWOSHOT_MAX_BYTES = dict(FUSED_TWOSHOT_MAX_BYTES)
FUSED_MAX_CTAS = 128 if not INTERPRETER else 4
FUSED_HIDDEN_MULTIPLE = TRITON_DIVISIBILITY
"""The fused kernels serve hidden sizes that are multiples of this, the divisibility Triton
specialises on: for other sizes the compiler cannot prove rows 16-byte aligned, and the
fused kernels' row reduction may get another register layout than tpfuse.rms_norm's (seen
for fp16 N=1000 with tests/test_fused_layouts.py), which would change y's bits."""

FUSED_ALGOS = ("auto", "oneshot", "twoshot", "split")


def _tile(n: int, dtype: torch.dtype) -> tuple[int, ...]:
    """What a fused kernel's per-row work follows: the norm tile's bytes, tail bytes, chunks,
    rows and warps for rows of n elements of dtype."""
    cfg = NormConfig.from_shape(n, dtype)
    return cfg.block_n * dtype.itemsize, cfg.tail_n * dtype.itemsize, cfg.num_chunks, cfg.rows, cfg.num_warps


@functools.lru_cache(maxsize=None)
def uses_wide_knobs(n: int, dtype: torch.dtype) -> bool:
    """Whether fused calls on rows of n elements of dtype take the FUSED_WIDE_* thresholds:
    their norm tile is FUSED_WIDE_TILE's. Cached: every fused call's plan asks, and the
    answer depends on the shape alone."""
    return _tile(n, dtype) == _tile(*FUSED_WIDE_TILE)


def fused_thresholds(world_size: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(LL, Lamport, one-shot, two-shot) largest message bytes of the fused kernels at
    ``world_size`` for rows of n elements of dtype: the FUSED_WIDE_* knobs where
    ``uses_wide_knobs``, else the FUSED_* ones (each as it is now)."""
    knobs = ((FUSED_WIDE_LL_MAX_BYTES, FUSED_WIDE_LAMPORT_MAX_BYTES, FUSED_WIDE_ONESHOT_MAX_BYTES,
              FUSED_WIDE_TWOSHOT_MAX_BYTES) if uses_wide_knobs(n, dtype) else
             (FUSED_LL_MAX_BYTES, FUSED_LAMPORT_MAX_BYTES, FUSED_ONESHOT_MAX_BYTES, FUSED_TWOSHOT_MAX_BYTES))
    return tuple(for_world(knob, world_size) for knob in knobs)


def check_fused_algo(algo: str) -> None:
    if algo not in FUSED_ALGOS:
        raise ValueError(f"algo must be one of {', '.join(map(repr, FUSED_ALGOS))}, got {algo!r}")


@dataclass(frozen=True)
class FusedPlan:
    """How one fused all-reduce + RMSNorm of [n_rows, n] runs.

    algo: "oneshot", "twoshot" or "split"; grid: CTAs; rows_per_group: rows each rank reduces
    in two-shot (rank g owns rows [g * rows_per_group, (g + 1) * rows_per_group); a multiple
    of the norm's tile rows, so no tile spans two owners); protocol: one-shot's, "ll",
    "lamport" or "flags" (as ``AllReducePlan.protocol``), or "rows" (FUSED_ROWS_MAX_BYTES);
    whole_tiles: over Lamport words, a CTA per whole row tile
    (``tpfuse.kernels.fused.lamport_tiling``); piece_elems: row-wise, the elements of x each
    CTA stores; reason: why "split" was chosen. From (n_rows, n, dtype, world size, layout)
    only, like ``AllReducePlan``.
    """

    algo: str
    grid: int = 0
    rows_per_group: int = 0
    protocol: str = "flags"
    whole_tiles: bool = False
    piece_elems: int = 0
    reason: str = ""

    @classmethod
    def from_shape(cls, n_rows: int, n: int, world_size: int, dtype: torch.dtype, layout: WorkspaceLayout | None,
                   algo: str = "auto") -> "FusedPlan":
        """"auto" picks one-shot up to FUSED_ONESHOT_MAX_BYTES (row-wise up to FUSED_ROWS_MAX_BYTES
        where the tile allows, over LL up to FUSED_LL_MAX_BYTES,
        over Lamport words up to FUSED_LAMPORT_MAX_BYTES; above those with flags, for hidden
        sizes with at most FUSED_ONESHOT_MAX_VECTORS vectors per thread, or once the call has
        FUSED_MAX_CTAS row tiles),
        two-shot up to FUSED_TWOSHOT_MAX_BYTES, else "split" (also when the workspace cannot
        hold the message, or n is not a multiple of FUSED_HIDDEN_MULTIPLE). Rows whose norm
        tile is FUSED_WIDE_TILE's use the FUSED_WIDE_* twins of these knobs. An explicit
        "oneshot" or "twoshot" that cannot serve the shape raises ValueError."""
        check_fused_algo(algo)
        if algo == "split":
            return cls("split", reason="algo='split' was requested")
        if layout is None:
            if algo == "auto":
                return cls("split", reason="no peer workspace")
            raise ValueError(f"algo={algo!r} needs a peer workspace, and this communicator has none")
        if n % FUSED_HIDDEN_MULTIPLE:
            if algo == "auto":
                return cls("split", reason=f"hidden size {n} is not a multiple of {FUSED_HIDDEN_MULTIPLE}")
            raise ValueError(f"algo={algo!r} needs a hidden size that is a multiple of {FUSED_HIDDEN_MULTIPLE}, got "
                             f"{n}; use algo='auto' or 'split'")
        cfg = NormConfig.from_shape(n, dtype)
        tile_rows = cfg.rows
        esize = dtype.itemsize
        nbytes = n_rows * n * esize
        rows_per_group = {"oneshot": n_rows, "twoshot": _cdiv(_cdiv(n_rows, world_size), tile_rows) * tile_rows}
        fits = {"oneshot": nbytes <= layout.oneshot_slot_bytes,
                "twoshot": rows_per_group["twoshot"] * n * esize <= layout.twoshot_slot_bytes}
        if n_rows * n > MAX_ELEMENTS:
            fits = {"oneshot": False, "twoshot": False}
        tiling = lamport_tiling(n, dtype, _cdiv(n_rows, tile_rows), FUSED_MAX_CTAS)
        ll_max, lamport_max, oneshot_max, twoshot_max = fused_thresholds(world_size, n, dtype)
        piece_elems, pieces = rows_pieces(n, dtype, FUSED_ROWS_PIECE_BYTES)
        row_wise = (nbytes <= min(layout.rows_max_bytes, for_world(FUSED_ROWS_MAX_BYTES, world_size))
                    and cfg.tail_n == 0 and cfg.num_chunks == 1
                    and cfg.rows * cfg.block_n * esize <= FUSED_ROWS_MAX_TILE_BYTES
                    and _cdiv(n_rows, tile_rows) * pieces <= min(FUSED_MAX_CTAS, layout.max_blocks))
        if row_wise:
            protocol = "rows"
        elif nbytes <= min(layout.ll_max_bytes, ll_max):
            protocol = "ll"
        elif nbytes <= min(layout.lamport_max_bytes, lamport_max) and tiling is not None:
            protocol = "lamport"
        else:
            protocol = "flags"
        if algo == "auto":
            vectors_per_thread = cfg.rows * cfg.block_n * esize // 16 / (cfg.num_warps * 32)
            flag_kernel_pays = (vectors_per_thread <= FUSED_ONESHOT_MAX_VECTORS
                                or _cdiv(n_rows, tile_rows) >= FUSED_MAX_CTAS)
            if nbytes <= oneshot_max and fits["oneshot"] and (protocol != "flags" or flag_kernel_pays):
                algo = "oneshot"
            elif nbytes <= twoshot_max and fits["twoshot"]:
                algo = "twoshot"
            else:
                return cls("split", reason="message above the fused kernels' sizes or the workspace")
        elif not fits[algo]:
            raise ValueError(f"algo={algo!r} cannot serve {n_rows} x {n} {dtype} with this workspace "
                             f"(max_bytes={layout.max_bytes}); create the Communicator with a larger max_bytes, "
                             "or use algo='auto' or 'split'")
        protocol = protocol if algo == "oneshot" else "flags"
        work = _cdiv(rows_per_group[algo], tile_rows)  # row tiles
        whole_tiles = protocol == "lamport" and tiling == "whole"
        if protocol == "rows":  # one piece per CTA
            return cls(algo, grid=work * pieces, rows_per_group=n_rows, protocol=protocol, piece_elems=piece_elems)
        if protocol != "flags":  # the kernel's pieces (tpfuse.kernels.fused), which any CTA may take
            work *= ll_pieces(n, dtype, protocol, whole_tiles)[1]
        grid = max(1, min(work, FUSED_MAX_CTAS, layout.max_blocks))
        return cls(algo, grid=grid, rows_per_group=rows_per_group[algo], protocol=protocol, whole_tiles=whole_tiles)
