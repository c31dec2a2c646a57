"""Mismatch counting for the long GPU runs: counts stay on the device until the end."""

import torch

from tpfuse.comm.workspace import CTRL_ROWS_CALLS, NUM_ROWS_ROTATIONS


class MismatchTally:
    """Counts mismatches on the device over many calls; ``failures()`` is the one host read,
    so a run of thousands of calls never synchronises with the host before it ends. UNIT
    names what is counted. No call at all is a failure too (a check that checked nothing)."""

    UNIT = "elements"

    def __init__(self):
        self.bad = torch.zeros((), dtype=torch.int64, device="cuda")
        self.calls = 0
        self.first_bad = {}

    def record(self, bad: torch.Tensor, what: str) -> None:
        """Add one call's mismatch count (a device scalar) under the label ``what``."""
        self.bad += bad
        self.calls += 1
        if len(self.first_bad) < 5:  # keep a few labels; read only at the end
            self.first_bad[what] = bad

    def failures(self) -> list[str]:
        total = self.bad.item()
        if total == 0 and self.calls > 0:
            return []
        return [f"{total} mismatching {self.UNIT} over {self.calls} calls; first labels: "
                + ", ".join(f"{k}: {v.item()}" for k, v in self.first_bad.items() if v.item())]


class PoolChecker(MismatchTally):
    """A tally whose calls take every rank's input from slices of shared random pools
    (``pools[dtype][rank]``, the same on every rank), so each rank can compute the reference
    of every call itself."""

    def __init__(self, comm, pools):
        import torch.distributed as dist

        from tpfuse import reference

        super().__init__()
        self.comm, self.pools, self.reference = comm, pools, reference
        self.rank = dist.get_rank()

    def inputs(self, n, dtype, offset):
        return [p[offset:offset + n] for p in self.pools[dtype]]


def ll_regions_not_zeroed(comm) -> list[str]:
    """Every LL and Lamport word read is zeroed (tpfuse.kernels.ll): once this rank's calls are done,
    its LL regions must be all zeros, and so must the rows regions (tpfuse.comm.workspace) but the
    rotation of the last row-wise call, which the next one zeroes. Failure messages, or none."""
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    layout, local = comm.layout, comm._peer.local
    assert layout.ll_bytes > 0  # LL or Lamport words: the check below has regions to read
    failures = []
    nonzero = int((local[layout.ll_offset(0):layout.ll_offset(1) + layout.ll_bytes] != 0).sum())
    if nonzero:
        failures.append(f"{nonzero} bytes of the LL regions are not zero after the calls")
    calls = int(local[CTRL_ROWS_CALLS * 8:CTRL_ROWS_CALLS * 8 + 8].view(torch.int64).item())
    for rotation in range(NUM_ROWS_ROTATIONS if layout.rows_slot_bytes else 0):
        start = layout.rows_offset(rotation)
        nonzero = int((local[start:start + layout.rows_bytes] != 0).sum())
        if nonzero and (calls == 0 or rotation != (calls - 1) % NUM_ROWS_ROTATIONS):
            failures.append(f"{nonzero} bytes of rows rotation {rotation} are not zero after {calls} row-wise calls")
    return failures
