"""Shared test settings: which device the kernels run on, and how big the shapes may be.

Under Triton's interpreter (every machine without CUDA, and CI) kernels run on CPU and the
shapes stay small so the suite takes minutes; on a GPU the same tests run on CUDA with the
large shapes, and tests marked ``gpu`` run too.
"""

import pytest
import torch

from tpfuse._runtime import INTERPRETER

DEVICE = "cpu" if INTERPRETER else "cuda"
ON_GPU = not INTERPRETER

# Relative-error budget of one rounding to each dtype (its unit roundoff), plus room for the
# fp32 accumulation, for results compared normwise against a float64 reference.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def rel_err_budget(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype] + 2e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/device_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
