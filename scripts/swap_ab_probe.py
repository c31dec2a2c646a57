"""Weights as the MMA's rows, tokens as its columns: a probe of the layout cuBLAS takes at M = 64
(``nvjet_sm90_tst_256x64``), for issue 39's invariant GEMM past 32 rows. Not part of the library.

    python scripts/swap_ab_probe.py [--out DIR]

The library's GEMM (tpfuse/kernels/linear.py) gave every 16 rows of x their own mma.m16n8k16
dot (to ea5862b), so that a row is summed by the same instruction at every M; past 32 rows
those dots ran at about 230 TFLOPS where cuBLAS's wgmma tiles reach 560. This probe led to
the library's present layout. Here a CTA computes out.T's tile
w[BLOCK_N rows] @ x.T[:, BLOCK_T tokens], so that the weight rows fill a 64-row wgmma tile at
every M and the tokens are the instruction's N (16 to 64 as M grows). The question: does a
token's sum keep its bits when the tokens' tile (the instruction's N) changes, and how fast is
it? It reports, per Llama-3-8B TP=1 layer: the tensor-core instructions compiled; whether
every token tile gives each token the bits of token tile 16 (x of 256 rows) and row 0 alone
the bits of row 0 in the batch; and per M the fastest of a few launch configurations beside
cuBLAS (one K loop a CTA, no chunks: the bits question first, the tree after).
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tpfuse.bench.common import graph_time_us, header_markdown, rotation, run_header, write_results

LAYERS = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672), ("down_proj", 14336, 4096),
          ("lm_head", 4096, 128256)]
BATCHES = [1, 16, 64, 256]
CONFIGS = [dict(block_n=bn, block_k=bk, num_stages=st)
           for bn, bk, st in itertools.product((64, 128), (64, 128), (3, 4))]


@triton.jit
def _swapped_kernel(X, Wt, OUT, M, N, K, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[t, n] = sum_k X[t, k] Wt[n, k] (fp32) for BLOCK_N weight rows x BLOCK_T tokens a CTA,
    as (Wt @ X.T) tiles: the weight rows are the dot's rows."""
    wrows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k in range(0, K, BLOCK_K):
        w = tl.load(Wt + wrows.to(tl.int64)[:, None] * K + (k + ks)[None, :], mask=(wrows < N)[:, None], other=0.0)
        x = tl.load(X + toks.to(tl.int64)[None, :] * K + (k + ks)[:, None], mask=(toks < M)[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    tl.store(OUT + toks.to(tl.int64)[None, :] * N + wrows[:, None], acc,
             mask=(toks < M)[None, :] & (wrows < N)[:, None])


def token_tile(m: int) -> int:
    return min(64, max(16, triton.next_power_of_2(m)))


def fits(cfg: dict, block_t: int) -> bool:
    """Whether the stages' operand tiles fit an H200's 227 KiB of shared memory."""
    return cfg["num_stages"] * (cfg["block_n"] + block_t) * cfg["block_k"] * 2 <= 227 * 1024


def swapped(x: torch.Tensor, w: torch.Tensor, cfg: dict, block_t: int | None = None):
    """x @ w.T in fp32, and the compiled kernel."""
    (m, k), n = x.shape, w.shape[0]
    block_t = block_t or token_tile(m)
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    kernel = _swapped_kernel[(triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, block_t))](
        x, w, out, m, n, k, BLOCK_N=cfg["block_n"], BLOCK_T=block_t, BLOCK_K=cfg["block_k"], num_warps=4,
        num_stages=cfg["num_stages"])
    return out, kernel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    header = run_header()
    records = []
    for name, k, n in LAYERS:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(rotation(n * k * 2))]
        x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        base = CONFIGS[0]
        want = swapped(x, ws[0], base, 16)[0]
        instructions = sorted({i for bt in (16, 32, 64) for i in re.findall(
            r"\b(wgmma\.mma_async\S*|mma\.sync\.aligned\.\S+)", swapped(x, ws[0], base, bt)[1].asm["ptx"])})
        tiles_agree = all(torch.equal(swapped(x, ws[0], cfg, bt)[0], want)
                          for cfg in CONFIGS for bt in (16, 32, 64) if fits(cfg, bt))
        row0_alone = all(torch.equal(swapped(x[:m], ws[0], base)[0][:1], want[:1]) for m in (1, 2, 17, 100))
        print(f"{name}: {instructions}; every token tile and configuration the same bits: {tiles_agree}; "
              f"row 0 alone = in the batch: {row0_alone}", flush=True)
        for m in BATCHES:
            xm = x[:m].contiguous()
            torch_us = graph_time_us(lambda i: F.linear(xm, ws[i % len(ws)]))
            times = [(graph_time_us(lambda i: swapped(xm, ws[i % len(ws)], cfg)), cfg) for cfg in CONFIGS
                     if fits(cfg, token_tile(m))]
            us, cfg = min(times, key=lambda t: t[0])
            records.append(dict(layer=name, k=k, n=n, m=m, us=us, config=cfg, torch_us=torch_us,
                                instructions=instructions, tiles_agree=tiles_agree, row0_alone=row0_alone))
            print(f"  m={m}: {us:.1f} us {cfg}, cuBLAS {torch_us:.1f} us", flush=True)
    lines = [header_markdown("weights as the MMA's rows (swap AB), one GPU, graph replay", header), "",
             "| layer | K x N | M | us | config | cuBLAS us | instructions (token tiles 16, 32, 64) | "
             "token tiles agree | row 0 alone |",
             "|" + "---|" * 9]
    for r in records:
        c = r["config"]
        lines.append(f"| {r['layer']} | {r['k']} x {r['n']} | {r['m']} | {r['us']:.1f} | n{c['block_n']} "
                     f"k{c['block_k']} st{c['num_stages']} | {r['torch_us']:.1f} | {' '.join(r['instructions'])} | "
                     f"{r['tiles_agree']} | {r['row0_alone']} |")
    write_results(args.out, "swap_ab_probe", header, records, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
