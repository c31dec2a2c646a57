"""Time tpfuse.invariant_matmul's launch configurations on one GPU, to choose
``LinearConfig.for_shape`` (tpfuse/kernels/linear.py). Not part of the library: it patches
``for_shape``.

    python scripts/tune_linear.py [--out DIR] [--batches 1 64 256] [--jobs 16] [--layers qkv ...]
                                  [--block-n 64 128 ...] [--block-t 32 64]

Per Llama-3-8B layer (TP=1, and TP=2's row-parallel shards, whose chunks and fp32 partials
differ), per M: every configuration of the grid below, each checked bit for bit (fp32 sums)
against the library's own configuration (a configuration changes no bit, LinearConfig says: this is where
that is measured) and timed graph-replayed, beside cuBLAS's F.linear. The kernels are
compiled first in --jobs processes (into Triton's cache; N is only specialised by its
divisibility, so small stand-ins of the weights serve), then timed in this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn.functional as F

import tpfuse
from tpfuse.bench.common import graph_time_us, header_markdown, rotation, run_header, write_results
from tpfuse.kernels import linear

LIBRARY = linear.LinearConfig.for_shape
# (TP, layer, K, N, chunks, out dtype): TP=1's layers (the row-parallel ones rounded by the GEMM
# at one rank), TP=2's row-parallel shards (fp32 partials, half the chunks).
LAYERS = [(1, "qkv", 4096, 6144, 8, torch.bfloat16), (1, "o_proj", 4096, 4096, 8, torch.bfloat16),
          (1, "gate_up", 4096, 28672, 8, torch.bfloat16), (1, "down_proj", 14336, 4096, 8, torch.bfloat16),
          (1, "lm_head", 4096, 128256, 8, torch.bfloat16),
          (2, "o_proj", 2048, 4096, 4, torch.float32), (2, "down_proj", 7168, 4096, 4, torch.float32)]


AXES = {"block_n": [64, 128], "block_k": [64, 128], "num_warps": [4, 8], "num_stages": [3, 4], "split": [1, 2, 4, 8]}
"""The grid's axes (command-line options override them); the token tile is the library's for
M. (16-row mma.sync dots, the kernel before the swapped layout, were measured at ea5862b:
benchmarks/NOTES.md 2026-11-29.)"""


def grid(axes: dict) -> list[dict]:
    """The configurations tried at every M (``use`` caps block_k at the chunk; a split past a
    layer's chunks is left out there, ``served``)."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def served(fields: dict, chunks: int) -> bool:
    """Whether a configuration's CTAs a tile divide the layer's chunks (else it is not run: it
    would be recorded under a split it does not have)."""
    return chunks % fields["split"] == 0


def use(fields: dict | None) -> None:
    """Patch for_shape: ``fields`` (block_k capped at the chunk), or the library's own."""
    if fields is None:
        linear.LinearConfig.for_shape = LIBRARY
        return

    def for_shape(m, n, chunks, chunk_k):
        return dataclasses.replace(LIBRARY(m, n, chunks, chunk_k), **{
            **fields, "block_k": min(fields["block_k"], chunk_k)})
    linear.LinearConfig.for_shape = staticmethod(for_shape)


def _compile(work: list[tuple]) -> int:
    """Compile each (fields, K, chunks, out dtype, M) on small stand-ins (a worker process)."""
    done = 0
    for fields, k, chunks, out_dtype, m in work:
        use(fields)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        try:
            tpfuse.invariant_matmul(x, w, chunks, out_dtype)
            done += 1
        except Exception as e:  # a configuration Triton cannot build (shared memory): timed as missing
            print(f"compile {fields} K={k}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    torch.cuda.synchronize()
    return done


def measure(batches: list[int], jobs: int, axes: dict, layers: list[tuple]) -> list[dict]:
    keys = {(k, c, d) for _, _, k, _, c, o in layers for d in (o, torch.float32)}  # fp32: the bits check
    work = [(f, k, c, o, m) for m in batches for f in grid(axes) for k, c, o in keys if served(f, c)]
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        compiled = sum(pool.map(_compile, [work[i::jobs] for i in range(jobs)]))
    print(f"compiled {compiled} of {len(work)}", flush=True)
    records = []
    for tp, name, k, n, chunks, out_dtype in layers:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(rotation(n * k * 2))]
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            use(None)
            # Bits compared on the fp32 sums (a bf16 output would hide most one-ulp differences);
            # calls timed with a kept counters buffer, as the model makes them.
            want = tpfuse.invariant_matmul(x, ws[0], chunks, torch.float32)
            counters = torch.zeros(linear.counters_for(k, chunks), dtype=torch.int32, device="cuda")
            base = dict(tp=tp, layer=name, k=k, n=n, chunks=chunks, m=m)
            torch_us = graph_time_us(lambda i: F.linear(x, ws[i % len(ws)]))
            for fields in [None] + [f for f in grid(axes) if served(f, chunks)]:
                use(fields)
                config = dataclasses.asdict(linear.LinearConfig.for_shape(m, n, chunks, k // chunks))
                try:
                    out = tpfuse.invariant_matmul(x, ws[0], chunks, torch.float32)
                    alone = tpfuse.invariant_matmul(x[:1], ws[0], chunks, torch.float32)
                    us = graph_time_us(lambda i: tpfuse.invariant_matmul(x, ws[i % len(ws)], chunks, out_dtype,
                                                                         counters))
                except Exception as e:
                    print(f"{name} m={m} {fields}: {type(e).__name__}", flush=True)
                    continue
                records.append({**base, "config": config, "library": fields is None, "us": us,
                                "gbps": n * k * 2 / us / 1e3, "torch_us": torch_us,
                                "same_bits": bool(torch.equal(out, want) and torch.equal(out[:1], alone))})
            use(None)
            mine = [r for r in records if r["layer"] == name and r["tp"] == tp and r["m"] == m]
            best = min(mine, key=lambda r: r["us"])
            print(f"TP={tp} {name} m={m}: library {mine[0]['us']:.1f} us, best {best['us']:.1f} us {best['config']}, "
                  f"torch {torch_us:.1f} us; all the library's bits: {all(r['same_bits'] for r in mine)}", flush=True)
    return records


def markdown(header: dict, records: list[dict]) -> str:
    lines = [header_markdown("invariant_matmul's launch configurations, one GPU, graph replay", header), "",
             "Per layer and M: the library's configuration, the fastest of the grid with 1, 2, 4 and 8 CTAs a "
             "tile (`split`), whether every configuration gave the library's bits, cuBLAS.", "",
             "| TP | layer | K x N | M | library us | config | split 1 | split 2 | split 4 | split 8 | best config | "
             "bits | torch us |", "|" + "---|" * 13]
    keys = sorted({(r["tp"], r["layer"], r["m"]) for r in records})
    for tp, name, m in keys:
        mine = [r for r in records if (r["tp"], r["layer"], r["m"]) == (tp, name, m)]
        cells = [f"{tp}", name, f"{mine[0]['k']} x {mine[0]['n']}", f"{m}", f"{mine[0]['us']:.1f}",
                 _config(mine[0]["config"])]
        for split in (1, 2, 4, 8):
            family = [r["us"] for r in mine[1:] if r["config"]["split"] == split]
            cells.append(f"{min(family):.1f}" if family else "-")
        best = min(mine[1:], key=lambda r: r["us"])
        cells += [_config(best["config"]), "yes" if all(r["same_bits"] for r in mine) else "NO",
                  f"{mine[0]['torch_us']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _config(c: dict) -> str:
    return f"n{c['block_n']} t{c['block_t']} k{c['block_k']} s{c['split']} w{c['num_warps']} st{c['num_stages']}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--layers", nargs="+", default=None, choices=sorted({layer[1] for layer in LAYERS}),
                   help="TP=1 and TP=2 layers of these names (default: all)")
    for axis, values in AXES.items():
        p.add_argument("--" + axis.replace("_", "-"), type=int, nargs="+", default=values)
    p.add_argument("--block-t", type=int, nargs="+", default=None, help="token tiles (default: the library's for M)")
    args = p.parse_args()
    axes = {axis: getattr(args, axis) for axis in AXES}
    if args.block_t:
        axes["block_t"] = args.block_t
    layers = [layer for layer in LAYERS if args.layers is None or layer[1] in args.layers]
    header = {**run_header(), "batches": args.batches, "grid": axes,
              "layers": [f"tp{layer[0]}:{layer[1]}" for layer in layers]}
    records = measure(args.batches, args.jobs, axes, layers)
    write_results(args.out, "tune_linear", header, records, markdown(header, records))
    print(open(os.path.join(args.out, "tune_linear.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
