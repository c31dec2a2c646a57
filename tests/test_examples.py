"""The README's examples run as written (on CPU: gloo ranks under Triton's interpreter)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, ranks, says", [
    ("rms_norm.py", 1, "add_rms_norm equals rms_norm of the rounded sum"),
    ("all_reduce.py", 2, "all_reduce over 2 ranks: every element is 3; fused == split bit for bit"),
    ("tp_model.py", 2, "prefill logits (1, 8, 128)"),
])
def test_example_runs(script, ranks, says):
    path = os.path.join(ROOT, "examples", script)
    launch = [sys.executable, path] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), path]
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert says in proc.stdout
