"""Shared test settings: which device the kernels run on, and how big the shapes may be.

Under Triton's interpreter (every machine without CUDA, and CI) kernels run on CPU and the
shapes stay small so the suite takes minutes; on a GPU the same tests run on CUDA with the
large shapes, and tests marked ``gpu`` run too.
"""

import json
import os
import subprocess
import sys

import pytest

from tpfuse._runtime import INTERPRETER

DEVICE = "cpu" if INTERPRETER else "cuda"
ON_GPU = not INTERPRETER


def compile_for_sm90(cases: list[dict]) -> list[dict]:
    """tests/sm90_layouts.py's report per case, in order, run in processes of their own (it
    imports tpfuse in GPU mode to compile for sm_90, which this process, under the interpreter,
    cannot): the cases are cut into one contiguous share per CPU core, compiled side by side."""
    script = os.path.join(os.path.dirname(__file__), "sm90_layouts.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    share = -(-len(cases) // max(1, min(len(cases), os.cpu_count() or 1)))
    procs = [subprocess.Popen([sys.executable, script, json.dumps(cases[i:i + share])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(0, len(cases), share)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        assert proc.returncode == 0, err[-4000:]
        reports += [json.loads(line) for line in out.splitlines()]
    return reports


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/device_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
