"""Peer memory: one buffer per rank that every rank of the group can load from and store to.

The only module of tpfuse that calls torch's symmetric-memory API. Two implementations:

- CUDA: ``torch.distributed._symmetric_memory`` (``symm_mem.empty`` + ``rendezvous``), plain
  peer loads/stores over NVLink. NVLink multicast is never used: the environment switches
  below are set before any rendezvous (docs/design.md 2.8).
- CPU (Triton's interpreter): a file per rank in /dev/shm, mapped by every rank's process.
  Each process maps the files at its own addresses, so each builds its own address table.

Both zero the buffers and end with a barrier of the group, so no peer writes into a buffer
before its owner has cleared it.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import torch
import torch.distributed as dist

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)

SHM_DIR = "/dev/shm"


class PeerMemoryUnavailable(RuntimeError):
    """The ranks cannot map each other's memory; the message says why."""


class PeerMemory:
    """``nbytes`` of zeroed memory per rank, mapped by every rank.

    Collective: every rank of ``group`` constructs it with the same ``nbytes``. Attributes:
    ``rank``, ``world_size``, ``nbytes``, ``device``, ``buffer_ptrs`` (this process's address
    of each rank's buffer, index = group rank). ``close()`` releases this rank's mappings
    (local; a peer's mapping keeps the memory alive until that peer closes).

    Raises PeerMemoryUnavailable when the memory cannot be shared.
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = nbytes
        self.device = device
        self._tensors: list[torch.Tensor] = []
        self._handle = None
        if device.type == "cuda":
            self._map_cuda(group)
        else:
            self._map_shm(group)
        self.buffer_ptrs: list[int] = (
            list(self._handle.buffer_ptrs) if self._handle is not None else [t.data_ptr() for t in self._tensors]
        )

    def _map_cuda(self, group: dist.ProcessGroup) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        devices = [None] * self.world_size
        dist.all_gather_object(devices, self.device.index, group=group)
        no_p2p = [p for p in devices if p != self.device.index
                  and not torch.cuda.can_device_access_peer(self.device.index, p)]
        agree_on_errors(group, f"GPU {self.device.index} cannot access peer GPUs {no_p2p} (no P2P)" if no_p2p
                        else "")
        # The allocation can fail on one rank alone (out of memory): every rank learns of it
        # before the rendezvous, in which the others would otherwise wait for it forever.
        error = ""
        try:
            buf = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            buf.zero_()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # whatever torch or the driver says is the reason to log
            error = f"symmetric-memory allocation of {self.nbytes} bytes failed on GPU {self.device.index}: " \
                    f"{type(e).__name__}: {e}"
        agree_on_errors(group, error)
        try:
            self._handle = symm_mem.rendezvous(buf, group.group_name)
        except Exception as e:
            raise PeerMemoryUnavailable(f"symmetric-memory rendezvous failed: {type(e).__name__}: {e}") from e
        self._tensors = [buf]
        dist.barrier(group=group)

    def _map_shm(self, group: dist.ProcessGroup) -> None:
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        paths = [os.path.join(SHM_DIR, f"tpfuse-{token[0]}-{r}") for r in range(self.world_size)]
        try:
            fd = os.open(paths[self.rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            agree_on_errors(group, f"rank {self.rank} cannot create {paths[self.rank]}: {e}")
        mapped = False
        try:
            error = ""
            try:
                os.ftruncate(fd, self.nbytes)  # a new file reads as zeros
            except OSError as e:
                error = f"rank {self.rank} cannot size {paths[self.rank]} to {self.nbytes} bytes: {e}"
            finally:
                os.close(fd)
            agree_on_errors(group, error)
            try:
                self._tensors = [torch.from_file(p, shared=True, size=self.nbytes, dtype=torch.uint8) for p in paths]
            except RuntimeError as e:
                error = f"rank {self.rank} cannot map the peer files: {e}"
            agree_on_errors(group, error)
            mapped = True
        finally:
            # Unlinked once every rank has mapped every file (or given up): the mappings keep
            # the memory alive, and nothing is left in /dev/shm after a crash. On a failure,
            # every path: a peer that died between creating its file and unlinking it cannot.
            for path in paths if not mapped else paths[self.rank:self.rank + 1]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if not mapped:
                self._tensors = []

    @property
    def local(self) -> torch.Tensor:
        """This rank's buffer as a uint8 tensor."""
        return self._tensors[0] if self._handle is not None else self._tensors[self.rank]

    def store_word_everywhere(self, offset: int, value: int) -> None:
        """Store the int64 ``value`` at byte ``offset`` of every rank's buffer, this one's
        included. On CPU at once, into the mapped files; on CUDA by fills queued on the current
        stream, after this rank's earlier kernels (so it stops the calls from the failed one on,
        not earlier ones still queued on the peers), not waited for. Not during a CUDA graph
        capture (nothing runs then; it is skipped)."""
        if self._handle is None:
            for t in self._tensors:
                t[offset:offset + 8].view(torch.int64).fill_(value)
        elif not torch.cuda.is_current_stream_capturing():
            for r in range(self.world_size):
                self._handle.get_buffer(r, (1,), torch.int64, offset // 8).fill_(value)

    def close(self) -> None:
        self._tensors = []
        self._handle = None
        self.buffer_ptrs = []


def agree_on_errors(group: dist.ProcessGroup, error: str, raises=PeerMemoryUnavailable) -> None:
    """Collective: raise ``raises`` on every rank if any rank reports an error (a non-empty
    ``error``), so that no rank goes on to a collective step that a failed rank skips."""
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if any(errors):
        raise raises("; ".join(e for e in errors if e))

