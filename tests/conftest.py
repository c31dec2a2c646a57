"""Shared test settings: which device the kernels run on, and how big the shapes may be.

Under Triton's interpreter (every machine without CUDA, and CI) kernels run on CPU and the
shapes stay small so the suite takes minutes; on a GPU the same tests run on CUDA with the
large shapes, and tests marked ``gpu`` run too.
"""

import pytest

from tpfuse._runtime import INTERPRETER

DEVICE = "cpu" if INTERPRETER else "cuda"
ON_GPU = not INTERPRETER

def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/device_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
