"""Sweep the quantized all-reduce's launch knobs (``tpfuse.comm.knobs``: quant_tile,
quant_num_warps, quant_max_ctas) on GPUs.

    python scripts/tune_quant.py [--bytes N ...] [--configs TILE,WARPS,CTAS ...] [--out DIR]

For each (tile, warps, CTAs), that tile for every codec on every segment,
it runs `tpfuse bench allreduce --quant`'s GPU worker on every visible GPU at the given sizes
(bits and error are checked there) and prints one line per config with every codec's time;
the full tables go to DIR/<config>/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from tpfuse.bench import quant as bench_quant
from tpfuse.bench.common import spawn_ranks
from tpfuse.quant_format import QUANT_CODECS

CONFIGS = [(2048, 8, 128), (4096, 8, 128), (2048, 16, 128), (4096, 16, 128), (8192, 16, 128), (16384, 16, 128),
           (8192, 32, 128), (16384, 32, 128), (32768, 32, 128), (8192, 16, 64)]


def _knob_changes(config) -> dict:
    """The knobs of one (tile, warps, CTAs) configuration: every segment on its tile."""
    tile, warps, ctas = config
    return {"quant_tile": dict.fromkeys(QUANT_CODECS, tile), "quant_num_warps": warps, "quant_max_ctas": ctas,
            "quant_small_tile_max_chunk": 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, nargs="+", default=[32 << 20, 256 << 20])
    p.add_argument("--out", default="tune_quant_out")
    p.add_argument("--configs", nargs="+", metavar="TILE,WARPS,CTAS",
                   help="configurations to run instead of the built-in list")
    args = p.parse_args()
    configs = [tuple(map(int, c.split(","))) for c in args.configs] if args.configs else CONFIGS
    world = torch.cuda.device_count()
    for config in configs:
        out = os.path.join(args.out, "_".join(map(str, config)))
        opts = dict(dtype="bf16", min_bytes=min(args.bytes), max_bytes=max(args.bytes), quant_max_bytes=None,
                    out=out, plot=False, knob_changes=_knob_changes(config))
        if spawn_ranks(bench_quant.gpu_worker, world, opts):
            print(f"{config}: failed", flush=True)
            continue
        with open(os.path.join(out, f"allreduce_quant_w{world}_bf16.json")) as f:
            records = json.load(f)["records"]
        print(f"tile, warps, ctas = {config}: " + "  ".join(
            f"{r['size_bytes'] >> 20}MiB {r['method']} {r['us']:.0f}" for r in records
            if r["size_bytes"] in args.bytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
