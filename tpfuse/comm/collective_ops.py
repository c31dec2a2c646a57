"""The Communicator's collectives as ``torch.library`` custom ops, found by group name.

``torch.compile`` cannot trace a Python method that launches Triton kernels on peer memory,
and a graph break at every layer boundary would cost a compiled model most of its gain. So
each collective is a custom op with a fake implementation (shapes only), and the
``Communicator`` methods call these ops: eager, compiled and CUDA-graph-captured code run the
same implementation, and so give the same bits.

A communicator is named by its ``group_name`` (the process group's name, with ``#k``
appended when another open communicator of the same group already holds that name). It is
registered when constructed and unregistered by ``close()``; an op naming no open
communicator raises ``KeyError``. The registry holds communicators weakly: one dropped
without ``close()`` is freed (its finalizer releases its peer memory, locally), except that
a communicator whose ops were captured into a CUDA graph is held until ``close()``, since
the graph's kernels replay on its workspace.

Ops (every rank of the group must call them in the same order, with the same shapes):

- ``tpfuse::all_reduce(x, group_name, algo) -> Tensor``
- ``tpfuse::quantized_all_reduce(x, group_name, codec, min_bytes) -> Tensor`` (min_bytes:
  None = the codec's entry of the communicator's ``knobs.quant_min_bytes``)
- ``tpfuse::all_reduce_add_rms_norm(x, residual, weight, eps, weight_offset, group_name,
  algo) -> (y, residual_out)``
- ``tpfuse::all_reduce_add_rms_norm_(...)`` the same arguments, writes residual_out into
  ``residual`` (declared mutated) and returns y
- ``tpfuse::all_reduce_rms_norm(x, weight, eps, weight_offset, group_name, algo) -> (y,
  reduced)``
- ``tpfuse::all_reduce_add_rms_norm_fp8(x, residual, weight, eps, weight_offset, group_name,
  algo, fp8_mode, scale, group) -> (q, scales, residual_out)``, scales empty for mode "tensor"
  (an output cannot alias the input scale); ``..._fp8_`` the same arguments, writes
  residual_out into ``residual`` and returns (q, scales)
- ``tpfuse::reduce_scatter_add_rms_norm(x, residual, weight, eps, weight_offset, group_name)
  -> (y, residual_out)``, both shaped like residual (this rank's slice of dim 0)
- ``tpfuse::all_gather(x, group_name) -> Tensor`` of W times x's dim 0
- ``tpfuse::reduce_scatter(x, group_name) -> Tensor`` of x's dim 0 over W

The sequence-parallel ops are differentiable (``register_autograd`` below: each one's
backward is the others' forward, and the norm's ``tpfuse::rms_norm_backward``).

Their semantics are the Communicator methods' of the same names. Outputs are new tensors of
x's shape (but the sequence-parallel ones') and dtype, contiguous (fp8 values and scales:
``tpfuse.quant_fp8``'s, the per-group scales a column-major view); none aliases an input.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

import tpfuse.norm_ops  # noqa: F401  (tpfuse::rms_norm_backward, which the backward below calls)
from tpfuse.fp8_ops import fp8_outputs

Tensor = torch.Tensor

_COMMUNICATORS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Open communicators of this process by group name (weakly: the caller owns them)."""
_HELD_FOR_GRAPHS: dict = {}
"""Communicators whose ops ran during a CUDA graph capture, by name, held until closed."""


def register(comm, group_name: str) -> str:
    """Register ``comm`` under ``group_name`` (``#1``, ``#2``, ... appended while taken); the name."""
    name, k = group_name, 0
    while name in _COMMUNICATORS:
        k += 1
        name = f"{group_name}#{k}"
    _COMMUNICATORS[name] = comm
    return name


def unregister(group_name: str) -> None:
    _COMMUNICATORS.pop(group_name, None)
    _HELD_FOR_GRAPHS.pop(group_name, None)


def lookup(group_name: str):
    """The open communicator named ``group_name``; KeyError naming the open ones otherwise.
    During a CUDA graph capture it is also held until closed (the graph outlives the call)."""
    comm = _COMMUNICATORS.get(group_name)
    if comm is None:
        raise KeyError(f"no open tpfuse Communicator has group_name {group_name!r} (open: {sorted(_COMMUNICATORS)}); "
                       "construct one on this process group first, and do not close it while ops still use it")
    if comm.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _HELD_FOR_GRAPHS[group_name] = comm
    return comm


def _like(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpfuse::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str, algo: str) -> Tensor:
    return lookup(group_name)._all_reduce(x, algo)


@all_reduce.register_fake
def _(x, group_name, algo):
    return _like(x)


@torch.library.custom_op("tpfuse::quantized_all_reduce", mutates_args=())
def quantized_all_reduce(x: Tensor, group_name: str, codec: str, min_bytes: Optional[int]) -> Tensor:
    return lookup(group_name)._quantized_all_reduce(x, codec, min_bytes)


@quantized_all_reduce.register_fake
def _(x, group_name, codec, min_bytes):
    return _like(x)


@torch.library.custom_op("tpfuse::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                            group_name: str, algo: str) -> tuple[Tensor, Tensor]:
    return lookup(group_name)._all_reduce_norm(x, residual, weight, eps, weight_offset, algo, inplace=False)


@all_reduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset, group_name, algo):
    return _like(residual), _like(residual)  # residual's dtype: x may be fp32 partials


@torch.library.custom_op("tpfuse::all_reduce_add_rms_norm_", mutates_args=("residual",))
def all_reduce_add_rms_norm_(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                             group_name: str, algo: str) -> Tensor:
    return lookup(group_name)._all_reduce_norm(x, residual, weight, eps, weight_offset, algo, inplace=True)[0]


@all_reduce_add_rms_norm_.register_fake
def _(x, residual, weight, eps, weight_offset, group_name, algo):
    return _like(residual)


@torch.library.custom_op("tpfuse::all_reduce_rms_norm", mutates_args=())
def all_reduce_rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float, group_name: str,
                        algo: str) -> tuple[Tensor, Tensor]:
    return lookup(group_name)._all_reduce_norm(x, None, weight, eps, weight_offset, algo, inplace=False)


@all_reduce_rms_norm.register_fake
def _(x, weight, eps, weight_offset, group_name, algo):
    return _like(x), _like(x)


@torch.library.custom_op("tpfuse::all_reduce_add_rms_norm_fp8", mutates_args=())
def all_reduce_add_rms_norm_fp8(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                                weight_offset: float, group_name: str, algo: str, fp8_mode: str, scale: Optional[Tensor],
                                group: int) -> tuple[Tensor, Tensor, Tensor]:
    return lookup(group_name)._all_reduce_norm(x, residual, weight, eps, weight_offset, algo, False,
                                               (fp8_mode, scale, group))


@all_reduce_add_rms_norm_fp8.register_fake
def _(x, residual, weight, eps, weight_offset, group_name, algo, fp8_mode, scale, group):
    return *fp8_outputs(x, fp8_mode, group), _like(residual)


@torch.library.custom_op("tpfuse::all_reduce_add_rms_norm_fp8_", mutates_args=("residual",))
def all_reduce_add_rms_norm_fp8_(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                                 weight_offset: float, group_name: str, algo: str, fp8_mode: str,
                                 scale: Optional[Tensor], group: int) -> tuple[Tensor, Tensor]:
    return lookup(group_name)._all_reduce_norm(x, residual, weight, eps, weight_offset, algo, True,
                                               (fp8_mode, scale, group))[:2]


@all_reduce_add_rms_norm_fp8_.register_fake
def _(x, residual, weight, eps, weight_offset, group_name, algo, fp8_mode, scale, group):
    return fp8_outputs(x, fp8_mode, group)


@torch.library.custom_op("tpfuse::reduce_scatter_add_rms_norm", mutates_args=())
def reduce_scatter_add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                                group_name: str) -> tuple[Tensor, Tensor]:
    return lookup(group_name)._reduce_scatter_norm(x, residual, weight, eps, weight_offset)


@reduce_scatter_add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset, group_name):
    return _like(residual), _like(residual)


@torch.library.custom_op("tpfuse::all_gather", mutates_args=())
def all_gather(x: Tensor, group_name: str) -> Tensor:
    return lookup(group_name)._all_gather(x)


@all_gather.register_fake
def _(x, group_name):
    world_size = lookup(group_name).world_size
    return x.new_empty((world_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("tpfuse::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, group_name: str) -> Tensor:
    return lookup(group_name)._reduce_scatter(x)


@reduce_scatter.register_fake
def _(x, group_name):
    comm = lookup(group_name)
    comm._check_rows_divide(x)
    return x.new_empty((x.shape[0] // comm.world_size, *x.shape[1:]))


def _sequence_parallel_setup(ctx, inputs, output):
    x, residual, weight, eps, weight_offset, group_name = inputs
    ctx.eps, ctx.weight_offset, ctx.group_name = eps, weight_offset, group_name
    ctx.save_for_backward(output[1], weight)  # the norm's input: residual_out


def _sequence_parallel_backward(ctx, dy, dresidual_out):
    residual_out, weight = ctx.saved_tensors
    if dy is None:  # only residual_out was used downstream
        dy = torch.zeros_like(residual_out)
    drows, dweight = torch.ops.tpfuse.rms_norm_backward(dy.to(residual_out.dtype), residual_out, weight,
                                                        dresidual_out, ctx.eps, ctx.weight_offset)
    dx = torch.ops.tpfuse.all_gather(drows, ctx.group_name)
    if weight is not None and ctx.needs_input_grad[2]:
        dweight = torch.ops.tpfuse.all_reduce(dweight, ctx.group_name, "auto")
    else:
        dweight = None
    return dx, drows, dweight, None, None, None


def _group_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


torch.library.register_autograd("tpfuse::reduce_scatter_add_rms_norm", _sequence_parallel_backward,
                                setup_context=_sequence_parallel_setup)
torch.library.register_autograd("tpfuse::all_gather", lambda ctx, grad: (
    torch.ops.tpfuse.reduce_scatter(grad.contiguous(), ctx.group_name), None), setup_context=_group_setup)
torch.library.register_autograd("tpfuse::reduce_scatter", lambda ctx, grad: (
    torch.ops.tpfuse.all_gather(grad.contiguous(), ctx.group_name), None), setup_context=_group_setup)
