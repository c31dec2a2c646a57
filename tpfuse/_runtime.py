"""Where tpfuse's Triton kernels run: compiled on CUDA, or under Triton's interpreter on CPU.

Imported first by ``tpfuse/__init__.py``. On a machine without CUDA it sets
``TRITON_INTERPRET=1`` before any kernel is defined, so ``@triton.jit`` functions run on CPU
tensors with no setup by the user. On a CUDA machine the user's own setting is respected
(``TRITON_INTERPRET=1`` there runs the interpreter on CPU tensors, which is how the CPU tests
can be run on a GPU machine).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # Triton decides at import time whether its own library functions (tl.sum, tl.max, ...)
    # are compiled or interpreted; imported without the interpreter, they fail inside
    # tpfuse's kernels with an obscure error on the first call. Say so here instead.
    _tl = sys.modules.get("triton.language")
    if _tl is not None and type(_tl.sum).__name__ == "JITFunction":
        raise ImportError(
            "tpfuse: this machine has no CUDA, so tpfuse runs its Triton kernels under Triton's "
            "interpreter, but triton was imported before tpfuse without TRITON_INTERPRET=1 and its "
            "library is set up for compiling. Import tpfuse before triton (and before libraries "
            "that import it), or set TRITON_INTERPRET=1 in the environment.")

INTERPRETER: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run under Triton's interpreter (inputs must then be CPU tensors)."""

if INTERPRETER:
    from tpfuse._interpreter import install as _install_interpreter_patch_once

    _install_interpreter_patch_once()

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_device_error(t: torch.Tensor, what: str) -> ValueError | None:
    """The error for a tensor the kernels cannot run on, or None when it is servable."""
    if INTERPRETER and t.device.type != "cpu":
        return ValueError(
            f"{what} is on {t.device}, but tpfuse runs its kernels under Triton's interpreter "
            "(TRITON_INTERPRET=1 or no CUDA), which needs CPU tensors"
        )
    if not INTERPRETER and t.device.type != "cuda":
        return ValueError(
            f"{what} is on {t.device}: on a machine with CUDA, tpfuse's kernels need CUDA tensors "
            "(set TRITON_INTERPRET=1 before importing tpfuse to run them on CPU)"
        )
    return None


def check_float_tensor(t: torch.Tensor, what: str) -> None:
    """Raise TypeError/ValueError unless t is a bf16/fp16/fp32 tensor on a servable device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} has dtype {t.dtype}; tpfuse supports bfloat16, float16 and float32")
    err = kernel_device_error(t, what)
    if err is not None:
        raise err


def aligned_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous and 16-byte aligned, else an aligned contiguous copy.

    Triton specialises a kernel on whether each pointer is 16-byte aligned, and the
    specialisation picks the vector width and so the register layout that a row reduction
    sums in. Giving every kernel aligned, contiguous operands makes the compiled kernel, and
    so the bits, depend on the shape and dtype alone.
    """
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
