"""How an all-reduce of a given size runs: algorithm and launch shape, in one place.

Everything here is derived from (numel, world size, dtype, workspace layout), which every
rank has identically, so every rank launches the identical grid (DESIGN.md 2.5).

The GPU thresholds and CTA counts are PROVISIONAL: chosen from the anchors in
/work/shared/ANCHORS.md (torch symm-mem one-shot beats two-shot up to ~128-512 KiB at W=4)
and H200 limits (132 SMs), to be set from `tpfuse bench allreduce` on 4x/8x H200.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpfuse._runtime import INTERPRETER
from tpfuse.comm.workspace import ALIGN, WorkspaceLayout

KiB = 1024

# Largest message auto sends to one-shot, by world size (provisional; other sizes: W=8's).
ONESHOT_MAX_BYTES = {2: 512 * KiB, 4: 256 * KiB, 8: 128 * KiB}
# Bytes of a tile: on GPUs 8 KiB = 256 threads x two 16-byte vectors (provisional); the
# interpreter pays per operation, not per element, so it takes large tiles.
TILE_BYTES = 8 * KiB if not INTERPRETER else 64 * KiB
NUM_WARPS = 8
# CTAs per call (provisional). Capped far below the H200's 132 SMs so a whole grid is
# resident even beside other work; under the interpreter, blocks run one after another and
# each costs a flag round, so few large blocks are fastest.
MAX_CTAS = {"oneshot": 32, "twoshot": 64} if not INTERPRETER else {"oneshot": 4, "twoshot": 4}
MAX_BLOCKS = 128
"""Flag slots per phase in the workspace: every grid above must fit."""
MAX_ELEMENTS = 2**31 - 1
"""Kernels index elements with int32."""


ALGOS = ("auto", "oneshot", "twoshot", "nccl")


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
    chunk: elements of each rank's share (two-shot; a multiple of ALIGN bytes).
    """

    algo: str
    block: int = 0
    grid: int = 0
    num_warps: int = NUM_WARPS
    chunk: int = 0
    reason: str = ""

    @classmethod
    def from_numel(cls, numel: int, world_size: int, dtype: torch.dtype, layout: WorkspaceLayout | None,
                   algo: str = "auto") -> "AllReducePlan":
        """The plan for an all-reduce of ``numel`` elements of ``dtype`` over ``world_size``
        ranks whose workspaces have ``layout`` (None: no peer workspace).

        ``algo="auto"`` picks one-shot up to ONESHOT_MAX_BYTES, else two-shot, else the
        backend when the message does not fit the workspace. An explicit "oneshot" or
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
        block = TILE_BYTES // esize
        align = ALIGN // esize
        chunk = _cdiv(_cdiv(numel, world_size), align) * align
        fits = {
            "oneshot": nbytes <= layout.oneshot_slot_bytes,
            "twoshot": chunk * esize <= layout.twoshot_slot_bytes,
        }
        if algo == "auto":
            small = nbytes <= ONESHOT_MAX_BYTES.get(world_size, ONESHOT_MAX_BYTES[8])
            algo = "oneshot" if small and fits["oneshot"] else "twoshot"
            if not fits[algo] or numel > MAX_ELEMENTS:
                return cls("nccl", reason=f"messages too large for the workspace (max_bytes={layout.max_bytes})")
        elif not fits[algo] or numel > MAX_ELEMENTS:
            cap = layout.oneshot_slot_bytes if algo == "oneshot" else layout.max_bytes
            raise ValueError(f"algo={algo!r} serves messages up to about {cap} bytes with this workspace "
                             f"(max_bytes={layout.max_bytes}); got {nbytes} bytes. Create the Communicator "
                             "with a larger max_bytes, or use algo='auto'")
        tiles = _cdiv(numel if algo == "oneshot" else chunk, block)
        grid = max(1, min(tiles, MAX_CTAS[algo], layout.max_blocks))
        return cls(algo, block=block, grid=grid, chunk=chunk if algo == "twoshot" else 0)
