"""Time RMSNorm kernel variants (warps, tile rows, dW partials) on a GPU, to choose the
values in tpfuse/kernels/norm.py. Not part of the library: it patches the config functions.

    python3 scripts/tune_norm.py > tune.txt
"""

import dataclasses
import itertools

import torch

from tpfuse.bench.common import copy_bandwidth_gbps, graph_time_us
from tpfuse.kernels import norm as K

base_from_shape = K.NormConfig.from_shape


def with_config(warps=None, rows=None):
    def from_shape(n, dtype):
        cfg = base_from_shape(n, dtype)
        return dataclasses.replace(cfg, num_warps=warps or cfg.num_warps, rows=rows or cfg.rows)
    K.NormConfig.from_shape = staticmethod(from_shape)


copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s")
dt = torch.bfloat16
for n, m in itertools.product([1024, 2048, 4096, 5120, 8192, 16384], [4096, 32768]):
    x = torch.randn(m, n, device="cuda", dtype=dt)
    dy, w = torch.randn_like(x), torch.randn(n, device="cuda", dtype=dt)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    base = base_from_shape(n, dt)
    for warps, partials in itertools.product([4, 8, 16], [256, 1024]):
        with_config(warps=warps)
        K._MAX_DW_PARTIALS = partials
        us = graph_time_us(lambda i: K.rms_norm_bwd(dy, x, w, dx, dw, 1e-6, 0.0))
        print(f"bwd N={n} M={m} warps={warps} partials={partials} base_warps={base.num_warps} "
              f"{us:.1f}us {100 * 3 * m * n * 2 / (us * 1e-6) / 1e9 / copy:.0f}%", flush=True)
K._MAX_DW_PARTIALS = 256
for n in [512, 1024, 2880, 4096, 5120, 7168, 16384]:
    m = 32768
    x = torch.randn(m, n, device="cuda", dtype=dt)
    y, w = torch.empty_like(x), torch.randn(n, device="cuda", dtype=dt)
    base = base_from_shape(n, dt)
    for warps, rows in itertools.product([2, 4, 8, 16], sorted({1, 2, base.rows})):
        with_config(warps=warps, rows=rows)
        us = graph_time_us(lambda i: K.rms_norm_fwd(x, w, y, 1e-6, 0.0))
        print(f"fwd N={n} warps={warps} rows={rows} base=({base.num_warps},{base.rows}) {us:.1f}us "
              f"{100 * 2 * m * n * 2 / (us * 1e-6) / 1e9 / copy:.0f}%", flush=True)
