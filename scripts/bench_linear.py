"""tpfuse.invariant_matmul against torch's F.linear (cuBLAS) on one GPU, at Llama-3-8B's layer
shapes for TP=1 and TP=2 and decode-to-prefill batch sizes, graph-replayed.

Why: the invariant layer (issue 39) needs GEMMs whose bits do not depend on the batch or the
TP size; they are worth it only near the weight-streaming rate at decode sizes. GB/s counts
the weight bytes read once per call; "row 0 = alone" says whether row 0 of the batch has the
bits of the same row computed alone (cuBLAS picks its kernel by shape, tpfuse does not).

    python scripts/bench_linear.py [--out DIR] [--batches 1 16 64 256]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import tpfuse
from tpfuse.bench.common import graph_time_us, header_markdown, rotation, run_header, write_results

# (layer, K, N, chunks, out dtype): column-parallel layers round to bf16, row-parallel ones keep
# their fp32 partial for the all-reduce. G = 8 chunks per layer; a TP=2 shard of a row-parallel
# layer holds 4 of them.
LAYERS = {
    1: [("qkv", 4096, 6144, 8, torch.bfloat16), ("o_proj", 4096, 4096, 8, torch.float32),
        ("gate_up", 4096, 28672, 8, torch.bfloat16), ("down_proj", 14336, 4096, 8, torch.float32)],
    2: [("qkv", 4096, 3072, 8, torch.bfloat16), ("o_proj", 2048, 4096, 4, torch.float32),
        ("gate_up", 4096, 14336, 8, torch.bfloat16), ("down_proj", 7168, 4096, 4, torch.float32)],
}


def measure(batches: list[int]) -> list[dict]:
    records = []
    for tp, layers in LAYERS.items():
        for name, k, n, chunks, out_dtype in layers:
            sets = rotation(n * k * 2)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(sets)]
            for m in batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                inv_us = graph_time_us(lambda i, x=x, ws=ws, c=chunks, o=out_dtype: tpfuse.invariant_matmul(
                    x, ws[i % len(ws)], c, o))
                torch_us = graph_time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i % len(ws)]))
                alone = tpfuse.invariant_matmul(x[:1], ws[0], chunks, out_dtype)
                torch_alone = F.linear(x[:1], ws[0])
                records.append(dict(
                    tp=tp, layer=name, k=k, n=n, chunks=chunks, m=m, invariant_us=inv_us, torch_us=torch_us,
                    invariant_gbps=n * k * 2 / inv_us / 1e3, torch_gbps=n * k * 2 / torch_us / 1e3,
                    invariant_row0_alone=bool(torch.equal(tpfuse.invariant_matmul(x, ws[0], chunks, out_dtype)[:1],
                                                          alone)),
                    torch_row0_alone=bool(torch.equal(F.linear(x, ws[0])[:1], torch_alone))))
                print(records[-1], flush=True)
    return records


def markdown(header: dict, records: list[dict]) -> str:
    lines = [header_markdown("invariant_matmul against F.linear (cuBLAS), one GPU, graph replay", header), "",
             "| TP | layer | K x N | chunks | M | invariant us | GB/s | torch us | GB/s | torch / invariant time | "
             "row 0 = alone (inv, torch) |", "|" + "---|" * 11]
    for r in records:
        lines.append(f"| {r['tp']} | {r['layer']} | {r['k']} x {r['n']} | {r['chunks']} | {r['m']} | "
                     f"{r['invariant_us']:.1f} | {r['invariant_gbps']:.0f} | {r['torch_us']:.1f} | "
                     f"{r['torch_gbps']:.0f} | {r['torch_us'] / r['invariant_us']:.2f} | "
                     f"{r['invariant_row0_alone']}, {r['torch_row0_alone']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = parser.parse_args()
    header = run_header()
    records = measure(args.batches)
    write_results(args.out, "linear", header, records, markdown(header, records))
    print(open(os.path.join(args.out, "linear.md")).read())


if __name__ == "__main__":
    main()
