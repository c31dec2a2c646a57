"""The layer boundary of a tensor-parallel block, four ways, and the logits all-gather.

A row-parallel projection (o_proj, down_proj) leaves each rank a partial sum; the boundary
sums the partials over the ranks, adds the residual stream and normalises the result for the
next block: ``(y, residual) = boundary(partial, residual, weight)``. The choices
(``BOUNDARIES``):

- ``"torch"``: ``torch.distributed.all_reduce`` (NCCL), ``partial + residual``, then
  ``F.rms_norm``: what a plain PyTorch / Hugging Face tensor-parallel model runs.
- ``"symm_mem"``: torch symmetric memory's two-shot all-reduce (peer loads and stores, no
  NVLink multicast), then the same torch add and norm. CUDA only.
- ``"split"``: ``comm.all_reduce`` then ``tpfuse.add_rms_norm``: tpfuse's exact kernels, unfused.
- ``"fused"``: ``comm.all_reduce_add_rms_norm``: one kernel, bitwise equal to ``"split"``.

"split" and "fused" also normalise with ``tpfuse.rms_norm`` where the model norms without an
all-reduce (the first layer's input norm, Qwen3's q/k norms), "torch" and "symm_mem" with
``F.rms_norm``, so each boundary is one consistent stack. At one rank (``comm`` None) the
all-reduce is the identity and no collective runs.

The collectives the model needs beyond tpfuse's are custom ops here (``tpfuse_models::*``),
opaque to ``torch.compile`` and captured by CUDA graphs like tpfuse's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpfuse.comm.plan import SequenceParallelPlan
from tpfuse.fp8_ops import quant_fp8
from tpfuse.models.fp8 import Fp8Activation
from tpfuse.norm_ops import add_rms_norm, rms_norm

Tensor = torch.Tensor
BOUNDARIES = ("torch", "symm_mem", "split", "fused")


# torch 2.13 renamed all_gather_into_tensor (a deprecation warning); the GPU machine has 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("tpfuse_models::nccl_all_reduce", mutates_args=())
def nccl_all_reduce(x: Tensor, group_name: str) -> Tensor:
    """The group backend's all-reduce (NCCL on GPUs, gloo on CPU) of x, out of place."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=_group(group_name))
    return out


@nccl_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpfuse_models::all_gather_last_dim", mutates_args=())
def all_gather_last_dim(x: Tensor, group_name: str) -> Tensor:
    """[..., n] on every rank -> [..., world * n], rank r's block at columns [r * n, (r + 1) * n)."""
    group = _group(group_name)
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(parts, x, group=group)
    return parts.view(world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])


@all_gather_last_dim.register_fake
def _(x, group_name):
    world = dist.get_world_size(_group(group_name))
    return x.new_empty((*x.shape[:-1], world * x.shape[-1]))


_SYMM_BUFFERS: dict[str, Tensor] = {}
"""The registered symmetric-memory buffer of each group that uses the "symm_mem" boundary."""


@torch.library.custom_op("tpfuse_models::symm_mem_all_reduce", mutates_args=())
def symm_mem_all_reduce(x: Tensor, group_name: str) -> Tensor:
    """torch symmetric memory's two-shot all-reduce of x (copied into the group's buffer)."""
    buf = _SYMM_BUFFERS[group_name]
    if x.numel() * x.element_size() > buf.numel():
        raise ValueError(f"symm_mem boundary: {x.numel() * x.element_size()} bytes exceed its "
                         f"{buf.numel()}-byte buffer (raise max_bytes)")
    flat = buf[: x.numel() * x.element_size()].view(x.dtype)
    flat.copy_(x.reshape(-1))
    torch.ops.symm_mem.two_shot_all_reduce_(flat, "sum", group_name)
    return flat.view(x.shape).clone()


@symm_mem_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class Boundary:
    """One of BOUNDARIES over ``comm`` (a tpfuse Communicator, or None for one rank).

    ``rms_norm(x, weight, eps, offset)`` and ``__call__(partial, residual, weight, eps,
    offset) -> (y, residual_out)``: shapes [..., hidden]; weight [hidden]; new outputs.
    """

    def __init__(self, name: str, comm=None, *, max_bytes: int = 64 << 20):
        if name not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {', '.join(map(repr, BOUNDARIES))}, got {name!r}")
        if comm is not None and comm.group is None:
            raise RuntimeError("the Communicator is closed: build the boundary (the model) on an open one")
        self.name, self.comm = name, comm
        self.world_size = 1 if comm is None else comm.world_size
        self.group_name = None if comm is None else comm.group.group_name
        self.tpfuse_norm = name in ("split", "fused")
        if name == "symm_mem" and self.world_size > 1:
            self._setup_symm_mem(max_bytes)

    def _setup_symm_mem(self, max_bytes: int) -> None:
        if self.comm.device.type != "cuda":
            raise ValueError("the 'symm_mem' boundary needs CUDA (torch symmetric memory)")
        if self.group_name not in _SYMM_BUFFERS:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8
                symm_mem.enable_symm_mem_for_group(self.group_name)
            buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=self.comm.device)
            symm_mem.rendezvous(buf, self.group_name)
            _SYMM_BUFFERS[self.group_name] = buf

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
        if self.tpfuse_norm:
            return rms_norm(x, weight, eps, weight_offset=offset)
        w = weight if offset == 0.0 else (weight.float() + offset).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over the ranks of the boundary's all-reduce (no norm): x itself at one rank."""
        if self.world_size == 1:
            return x
        if self.name == "torch":
            return torch.ops.tpfuse_models.nccl_all_reduce(x, self.group_name)
        if self.name == "symm_mem":
            return torch.ops.tpfuse_models.symm_mem_all_reduce(x, self.group_name)
        return self.comm.all_reduce(x)

    def __call__(self, partial: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float,
                 fp8: bool = False) -> tuple[Tensor | Fp8Activation, Tensor]:
        """With ``fp8`` y comes quantized per token (an ``Fp8Activation`` for the next fp8
        GEMM): the "fused" boundary quantizes in its kernel, the others (and fp32 partial
        sums, whose path below never leaves the workspace) with ``tpfuse.quant_fp8`` after the
        norm, the same bits."""
        if fp8:
            if self.name == "fused" and self.world_size > 1 and partial.dtype == residual.dtype:
                q, scales, residual = self.comm.all_reduce_add_rms_norm_fp8(partial, residual, weight, eps,
                                                                            mode="token", weight_offset=offset)
                return Fp8Activation(q, scales), residual
            y, residual = self(partial, residual, weight, eps, offset)
            return Fp8Activation(*quant_fp8(y, "token")), residual
        if partial.dtype != residual.dtype and self.tpfuse_norm:
            # An invariant model's fp32 partial sums: all-reduced in fp32 over the ranks' tree,
            # rounded once to the residual's dtype, then the residual add and norm; "fused" in
            # one kernel where the message fits the workspace (the op's own split path then
            # stays on tpfuse's all-reduce), else in slices of rows, never the backend's order.
            if self.name == "fused" and self.world_size > 1 and self._fits_workspace(partial):
                return self.comm.all_reduce_add_rms_norm(partial, residual, weight, eps, weight_offset=offset)
            reduced = self._all_reduce_in_workspace(partial).to(residual.dtype)
            return add_rms_norm(reduced, residual, weight, eps, weight_offset=offset)
        if self.name == "fused" and self.world_size > 1:
            return self.comm.all_reduce_add_rms_norm(partial, residual, weight, eps, weight_offset=offset)
        reduced = self.all_reduce(partial)
        if self.tpfuse_norm:
            return add_rms_norm(reduced, residual, weight, eps, weight_offset=offset)
        residual = reduced + residual
        return self.rms_norm(residual, weight, eps, offset), residual

    def rows_of_rank(self, x: Tensor) -> Tensor:
        """This rank's share of x's rows ([..., hidden] flattened, rank r's r-th of W equal
        slices): its slice of a sequence-parallel residual stream."""
        rows = x.reshape(-1, x.shape[-1])
        share = rows.shape[0] // self.world_size
        return rows[self.comm.rank * share:(self.comm.rank + 1) * share]

    def serves_sequence_parallel(self, x: Tensor) -> bool:
        """Whether the sequence-parallel boundary serves x's rows ([..., hidden]): they divide
        over the ranks and fit the communicator's workspace (``SequenceParallelPlan``)."""
        n = x.shape[-1]
        rows = x.numel() // n
        if self.name != "fused" or self.world_size == 1 or rows % self.world_size:
            return False
        try:
            SequenceParallelPlan.from_shape(rows // self.world_size, n, x.dtype, self.comm.layout, self.comm.knobs)
        except ValueError:
            return False
        return True

    def sequence_parallel(self, partial: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float,
                          fp8: bool = False) -> tuple[Tensor, Tensor]:
        """The boundary with the residual stream split over the ranks (sequence parallelism):
        partial [..., hidden], this rank's partial sums of every row; residual, this rank's
        rows (``rows_of_rank``). ``(y, residual_out)``: y of every row, shaped like partial,
        and this rank's rows of the residual; the bits of ``__call__``'s (the fused kernels'
        rows, gathered exactly). "fused" only, without an fp8 output (not built)."""
        if fp8:
            raise NotImplementedError("a sequence-parallel boundary with an fp8 output")
        rows = partial.reshape(-1, partial.shape[-1])
        y, residual = self.comm.reduce_scatter_add_rms_norm(rows, residual, weight, eps, weight_offset=offset)
        return self.comm.all_gather(y).view(partial.shape), residual

    def _fits_workspace(self, x: Tensor) -> bool:
        """Whether tpfuse's all-reduce takes x in one call, on its workspace."""
        return x.numel() * x.element_size() <= self.comm.max_bytes

    def _all_reduce_in_workspace(self, x: Tensor) -> Tensor:
        """tpfuse's all-reduce of [..., n] x in slices of rows that fit its workspace (rows are
        summed alone, so their bits do not depend on the slice): never the backend's, whose
        order is not the tree."""
        if self.world_size == 1:
            return x
        if self._fits_workspace(x):
            return self.comm.all_reduce(x)
        rows = x.reshape(-1, x.shape[-1])
        per_call = max(1, self.comm.max_bytes // (rows.shape[1] * rows.element_size()))
        return torch.cat([self.comm.all_reduce(part) for part in rows.split(per_call)]).view(x.shape)

    def gather_last_dim(self, x: Tensor) -> Tensor:
        """Every rank's [..., n] side by side: [..., world * n] (x itself at one rank)."""
        if self.world_size == 1:
            return x
        return torch.ops.tpfuse_models.all_gather_last_dim(x, self.group_name)
