"""Throughput of the standalone codec kernels (``tpfuse.quantize`` / ``dequantize``) on one GPU,
fp8 with the hardware e4m3 conversion and with the integer path side by side.

Why: the quantized all-reduce encodes each value twice and decodes it W + 1 times; when a
codec's arithmetic costs more than its memory traffic, the all-reduce is compute-bound
(benchmarks/NOTES.md). On one GPU the standalone kernels show each codec's cost per value
without the network: GB/s counts the bf16 values read (or written) plus the packed bytes.

    python scripts/bench_codecs.py [--mib 256] [--out DIR] [--tile N] [--warps N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import torch
import triton.testing

from tpfuse import reference
from tpfuse.bench.common import run_header
from tpfuse.kernels import codecs


def _gbps(fn, nbytes: int) -> float:
    ms = triton.testing.do_bench_cudagraph(fn, rep=200)
    return nbytes / ms / 1e6


def measure(mib: int, tile: int | None = None, warps: int | None = None) -> list[dict]:
    n = mib * (1 << 20) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rows = [{"codec": "copy", "encode_gbps": _gbps(lambda: y.copy_(x), 2 * x.nbytes)}]
    variants = [(c, True) for c in reference.QUANT_CODECS] + [("fp8", False)]
    launch = dict(TILE_ELEMS=tile or codecs.TILE_ELEMS, NUM_WARPS=warps or codecs.NUM_WARPS)
    for codec, hw in variants:
        with mock.patch.object(codecs, "hardware_e4m3", lambda device, hw=hw: hw and codec == "fp8"), \
                mock.patch.multiple(codecs, **launch):
            packed = codecs.quantize(x, codec)
            nbytes = x.nbytes + packed.nbytes
            enc = _gbps(lambda: codecs.quantize_into(x, packed, codec), nbytes)  # noqa: B023
            dec = _gbps(lambda: codecs.dequantize_into(packed, codec, y), nbytes)  # noqa: B023
            exact = torch.equal(packed, reference.quantize(x, codec)) and torch.equal(
                y, reference.dequantize(packed, codec, x.shape, x.dtype))
        name = codec if codec != "fp8" else ("fp8 (hardware e4m3)" if hw else "fp8 (integer e4m3)")
        rows.append({"codec": name, "encode_gbps": enc, "decode_gbps": dec, "bitwise_equal_to_reference": exact})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bf16 input size in MiB")
    ap.add_argument("--out", default=None, help="directory for codecs.json and codecs.md")
    ap.add_argument("--tile", type=int, default=None,
                    help="elements per program instead of codecs.TILE_ELEMS (the all-reduce's tiles are 8192-16384)")
    ap.add_argument("--warps", type=int, default=None, help="warps per program instead of codecs.NUM_WARPS")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_codecs needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = measure(args.mib, args.tile, args.warps)
    header = run_header() | {"tile": args.tile or codecs.TILE_ELEMS, "warps": args.warps or codecs.NUM_WARPS}
    lines = [f"# Codec kernels, {args.mib} MiB of bf16, one GPU", "",
             ", ".join(f"{k}: {v}" for k, v in header.items()), "",
             "| codec | encode GB/s | decode GB/s | bitwise equal to reference |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['encode_gbps']:.0f} | {r.get('decode_gbps', float('nan')):.0f} | "
                     f"{r.get('bitwise_equal_to_reference', '')} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "codecs.json"), "w") as f:
            json.dump({"header": header, "mib": args.mib, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "codecs.md"), "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
