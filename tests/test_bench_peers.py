"""The benchmarks' optional peers on a machine without them: FlashInfer's absence leaves its
columns empty, and the tables still form (the GPU runs fill them: scripts/device_check.sh)."""

import sys

import torch

from tpfuse.bench import fused
from tpfuse.bench.common import FlashInferAllReduce


def test_flashinfer_peer_is_none_where_flashinfer_cannot_be_imported(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises ImportError
    assert FlashInferAllReduce.create(torch.bfloat16) is None
    assert "flashinfer unavailable (ModuleNotFoundError" in capsys.readouterr().out


def test_fused_table_compares_auto_with_flashinfer_and_reports_its_bits():
    rec = dict(tokens=16, hidden=4096, bitwise=True)
    records = [rec | dict(method="split", us=6.8), rec | dict(method="auto", us=6.3, algo="oneshot"),
               rec | dict(method="nccl_torch", us=15.1),
               rec | dict(method="flashinfer", us=7.56, bitwise=False, y_bitwise=False, residual_out_bitwise=True,
                          y_max_abs_diff=0.0078125)]
    md = fused._markdown(records, {"flashinfer": "0.7.2.post1"}, 2)
    row = next(line for line in md.splitlines() if line.startswith("| 4096 | 16 |"))
    assert row.split(" | ")[-4:] == ["7.6 x", "1.08x", "2.40x", "1.20x |"]
    assert "residual_out bitwise equal at 1 of 1 shapes, y at 0 (largest |y difference| 0.00781)" in md
