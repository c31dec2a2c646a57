"""Where a decode step's GPU time goes: the kernels of a few eager decode steps of a one-GPU
``TPModel`` (a preset's shapes, random weights, bf16), by total time, plain and invariant.

    python scripts/profile_decode.py [--preset llama3-8b] [--batch 1] [--context 1024] [--steps 4] [--out DIR]

Eager, not graph-replayed: the profiler sees each kernel (a graph replay is one event), and
kernel times do not depend on how they were launched. Writes profile_decode.md under --out.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tpfuse.bench.common import header_markdown, run_header
from tpfuse.models import PRESETS, TPModel


def _kernel_table(model, batch: int, context: int, steps: int, prompt: int = 32) -> tuple[list, float]:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
    dec = model.decode_session(batch, context, cuda_graph=False)
    tokens = dec.prefill(ids).argmax(-1)
    for _ in range(2):  # warm-up: compiles and autotunes outside the profile
        tokens = dec.step(tokens).argmax(-1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tokens = dec.step(tokens).argmax(-1)
        torch.cuda.synchronize()
    rows = [(e.key, e.count / steps, e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    header = run_header() | vars(args)
    md = header_markdown(f"decode step kernels, {args.preset}, TP=1, batch {args.batch}", header)
    for invariant in (False, True):
        model = TPModel.random(PRESETS[args.preset], None, seed=0, boundary="split", invariant=invariant,
                               device="cuda")
        rows, total = _kernel_table(model, args.batch, args.context, args.steps)
        md += f"## {'invariant' if invariant else 'plain'}: {total / 1e3:.3f} ms of kernels per step\n\n"
        md += "| kernel | calls per step | us per step | share |\n|---|---|---|---|\n"
        md += "".join(f"| {k[:90]} | {n:.0f} | {us:.1f} | {100 * us / total:.1f}% |\n" for k, n, us in rows[:25])
        md += "\n"
        del model
        torch.cuda.empty_cache()
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_decode.md"), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
