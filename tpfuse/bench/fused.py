"""``tpfuse bench fused``: all-reduce + residual add + RMSNorm, fused and unfused, side by side.

Per (tokens, hidden), bf16, W = every visible GPU (one process each), CUDA-graph replay
(``tpfuse.bench.allreduce``'s timing: 20 calls per graph, slowest rank's median):

- nccl_torch: NCCL all-reduce, torch add, torch.nn.functional.rms_norm (what a plain
  PyTorch model runs);
- split: tpfuse all_reduce, then tpfuse.add_rms_norm (the unfused composition, the contract);
- oneshot / twoshot / auto: Communicator.all_reduce_add_rms_norm(algo=...);
- flashinfer: FlashInfer's fused all-reduce + residual + RMSNorm (``FlashInferAllReduce``),
  where flashinfer is importable, for calls that fit its workspace.

Each tpfuse method's outputs are checked bitwise against split's in the same run, and
split's residual_out against tpfuse.reference; FlashInfer's are compared too and marked,
but bind nothing. Without two GPUs: two CPU ranks under Triton's
interpreter check the bits on a few shapes (timings need GPUs).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpfuse
from tpfuse import reference
from tpfuse.bench import fused_fp8
from tpfuse.bench.common import (FlashInferAllReduce, collective_graph_us, collective_header, cpu_check_intro,
                                 cpu_check_verdict, gpu_only_flags, header_markdown, init_rank, layer_inputs, rotation,
                                 run_workers, same_bits, write_results)

DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [512, 1024, 2048, 4096, 8192, 16384]
SHAPES = ([(t, 4096) for t in DECODE + PREFILL] + [(t, 2880) for t in (1, 16, 128, 2048)]
          + [(t, 5120) for t in (1, 16, 128, 2048)] + [(t, 8192) for t in (1, 16, 64, 128, 512, 2048)])
METHODS = ["nccl_torch", "split", "oneshot", "twoshot", "auto", "flashinfer"]
EPS = 1e-6


def _methods(comm, weight, flashinfer, tokens, hidden):
    def nccl_torch(x, residual):
        r = x.clone()
        dist.all_reduce(r)
        residual_out = r + residual
        return F.rms_norm(residual_out, (x.shape[-1],), weight, EPS), residual_out

    def split(x, residual):
        return tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, EPS)

    def fused(algo):
        return lambda x, residual: comm.all_reduce_add_rms_norm(x, residual, weight, EPS, algo=algo)

    methods = {"nccl_torch": nccl_torch, "split": split, "oneshot": fused("oneshot"), "twoshot": fused("twoshot"),
               "auto": fused("auto")}
    if flashinfer is not None and flashinfer.fits(tokens * hidden):
        y, residual_out = (torch.empty(tokens, hidden, dtype=weight.dtype, device=weight.device) for _ in range(2))
        methods["flashinfer"] = lambda x, residual: flashinfer.add_rms_norm(x, residual, weight, EPS, y, residual_out)
    return methods


def measure_methods(methods, compare, x, residual, comm, rank) -> list[dict]:
    """Each method's record on the [tokens, hidden] call (x, residual): ``compare(name,
    outputs)`` (a dict with "bitwise"), then its time. One-shot and two-shot are left out where
    the workspace cannot serve the shape; FlashInfer where it refuses it (every rank alike)."""
    from tpfuse.comm.plan import FusedPlan

    tokens, hidden = x.shape
    rot = rotation(2 * x.numel() * x.element_size())
    pool = [(x.clone(), residual.clone()) for _ in range(rot)]
    records = []
    for name, fn in methods.items():
        if name in ("oneshot", "twoshot"):
            try:
                FusedPlan.from_shape(tokens, hidden, x.dtype, comm.layout, comm.knobs, name)
            except ValueError:
                continue  # this algorithm does not serve the shape with this workspace
        try:
            rec = dict(tokens=tokens, hidden=hidden, method=name) | compare(name, fn(x, residual))
            rec["us"] = round(collective_graph_us(lambda i: fn(*pool[i]), rot), 2)  # noqa: B023  (called right here)
        except Exception as e:  # noqa: BLE001  only the peer may refuse a shape (every rank alike)
            if name != "flashinfer":
                raise
            if rank == 0:
                print(f"flashinfer at {tokens} x {hidden} failed: {type(e).__name__}: {e}", flush=True)
            continue
        if name == "auto":
            plan = FusedPlan.from_shape(tokens, hidden, x.dtype, comm.layout, comm.knobs)
            rec["algo"] = plan.algo + (f"/{plan.protocol}" if plan.algo == "oneshot" else "")
        records.append(rec)
    return records


def method_cell(r: dict | None) -> str:
    """A table cell: us, `x` where the outputs are not split's bits, the plan."""
    if r is None:
        return "-"
    return f"{r['us']:.1f}{'' if r['bitwise'] else ' x'}" + (f" [{r['algo']}]" if "algo" in r else "")


def _measure_shape(tokens, hidden, comm, flashinfer, world, rank, opts):
    xs, residual, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 100_003 + hidden)
    x = xs[rank]
    methods = _methods(comm, weight, flashinfer, tokens, hidden)
    split_out = methods["split"](x, residual)
    spec_ok = same_bits(split_out[1], reference.all_reduce_add_rms_norm(xs, residual, weight, EPS)[1])

    def compare(name, out):
        same = [same_bits(a, b) for a, b in zip(out, split_out)]
        bitwise = name == "nccl_torch" or bool(all(same) and spec_ok)
        if name == "flashinfer":  # the peer's: which outputs match split's, and y's largest difference
            return dict(bitwise=bitwise, y_bitwise=bool(same[0]), residual_out_bitwise=bool(same[1]),
                        y_max_abs_diff=(out[0].float() - split_out[0].float()).abs().max().item())
        return dict(bitwise=bitwise)

    return measure_methods(methods, compare, x, residual, comm, rank)


def _markdown(records, header, world):
    by = {(r["tokens"], r["hidden"], r["method"]): r for r in records}
    shapes = sorted({(r["hidden"], r["tokens"]) for r in records})
    md = header_markdown(f"fused all-reduce + residual add + RMSNorm, {world} ranks, bf16", header)
    md += ("CUDA-graph replay, us per call. `x` marks outputs not bitwise equal to the split path "
           "(tpfuse all_reduce, then tpfuse.add_rms_norm). Speedups are split / auto, nccl_torch / auto and "
           "flashinfer / auto.\n\n")
    md += ("| hidden | tokens | " + " | ".join(METHODS)
           + " | auto vs split | auto vs nccl_torch | auto vs flashinfer |\n")
    md += "|---" * (len(METHODS) + 5) + "|\n"
    for hidden, tokens in shapes:
        cells = [method_cell(by.get((tokens, hidden, m))) for m in METHODS]
        auto, split, base, fi = (by.get((tokens, hidden, m)) for m in ("auto", "split", "nccl_torch", "flashinfer"))
        ratio = (lambda a, b: f"{b['us'] / a['us']:.2f}x" if a and b else "-")
        md += (f"| {hidden} | {tokens} | " + " | ".join(cells)
               + f" | {ratio(auto, split)} | {ratio(auto, base)} | {ratio(auto, fi)} |\n")
    fis = [r for r in records if r["method"] == "flashinfer"]
    if fis:
        md += (f"\nflashinfer {header.get('flashinfer', '')} against split: residual_out bitwise equal at "
               f"{sum(r['residual_out_bitwise'] for r in fis)} of {len(fis)} shapes, y at "
               f"{sum(r['y_bitwise'] for r in fis)} (largest |y difference| "
               f"{max(r['y_max_abs_diff'] for r in fis):.3g}).\n")
    return md


def _gpu_worker(rank: int, world: int, port: int | None, opts: dict) -> None:
    """Every shape's records, the table and the files; with opts["quant"] those of the fp8
    output (``tpfuse.bench.fused_fp8``)."""
    from tpfuse.comm import Communicator

    init_rank(rank, world, port, "nccl")
    quant = opts["quant"]
    shapes = [s for s in (fused_fp8.SHAPES if quant else SHAPES) if s[0] <= opts["max_tokens"]]
    measure = fused_fp8.measure_shape if quant else _measure_shape
    max_bytes = max(t * h * 2 for t, h in shapes)
    flashinfer = FlashInferAllReduce.create(torch.bfloat16) if quant in (None, "tensor") else None
    try:
        records = []
        with Communicator(max_bytes=max_bytes) as comm:
            for tokens, hidden in shapes:
                records += measure(tokens, hidden, comm, flashinfer, world, rank, opts)
                if rank == 0:
                    print(f"{tokens:>6} x {hidden}: " + "  ".join(
                        f"{r['method']} {r['us']:.1f}us{'' if r['bitwise'] else '(x)'}" for r in records
                        if (r["tokens"], r["hidden"]) == (tokens, hidden)), flush=True)
        wrong = [f"{r['tokens']}x{r['hidden']} {r['method']}" for r in records
                 if not r["bitwise"] and r["method"] != "flashinfer"]
        if rank == 0:
            header = collective_header(comm) | {"dtype": "bf16", "tpfuse_max_bytes": max_bytes}
            header |= fused_fp8.header(quant) if quant else {}
            if flashinfer is not None:
                header["flashinfer"] = flashinfer.version
            md = fused_fp8.markdown(records, header, world, quant) if quant else _markdown(records, header, world)
            print(md)
            name = f"fused_fp8_{quant}_w{world}_bf16" if quant else f"fused_w{world}_bf16"
            print("wrote " + ", ".join(write_results(opts["out"], name, header, records, md)))
        if wrong:
            raise RuntimeError(f"rank {rank}: outputs not bitwise equal to the split path: {wrong}")
    finally:
        try:
            if flashinfer is not None:
                flashinfer.close()
        finally:
            dist.destroy_process_group()


CPU_SHAPES = [(1, 4096), (16, 1024), (64, 2880)]  # (tokens, hidden)


def _cpu_worker(rank: int, world: int, port: int, opts: dict) -> None:
    from tpfuse.comm import Communicator

    shapes = [(t, h) for t, h in CPU_SHAPES if t <= opts["max_tokens"]] or [(opts["max_tokens"], 1024)]
    init_rank(rank, world, port, "gloo")
    if rank == 0:
        cpu_check_intro(f"fused one-shot, two-shot and auto at {', '.join(f'{t} x {h}' for t, h in shapes)} "
                        f"(tokens x hidden), bf16, {world} emulated ranks, bitwise against the split path",
                        opts["gpu_only"])
    rows = []
    with Communicator(timeout_s=60) as comm:
        for tokens, hidden in shapes:
            xs, residual, weight = layer_inputs(tokens, hidden, world, "cpu", seed=tokens)
            methods = _methods(comm, weight, None, tokens, hidden)
            split_out = methods["split"](xs[rank], residual)
            for name in ("oneshot", "twoshot", "auto"):
                out = methods[name](xs[rank], residual)
                rows.append((tokens, hidden, name, all(same_bits(a, b) for a, b in zip(out, split_out))))
    dist.destroy_process_group()
    ok = all(good for *_, good in rows)
    if rank == 0:
        print("| tokens x hidden | algo | bitwise equal to split |\n|---|---|---|")
        for tokens, hidden, name, good in rows:
            print(f"| {tokens} x {hidden} | {name} | {'yes' if good else 'NO'} |")
        cpu_check_verdict(ok)
    if not ok:
        raise RuntimeError(f"rank {rank}: a fused result differs from the split path")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpfuse bench fused", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for fused_*.json / .md")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="leave out the shapes of more tokens (rows) than this (default: every shape)")
    p.add_argument("--quant", choices=["tensor", "token", "group"], default=None,
                   help="the fused kernel with an fp8 output (all_reduce_add_rms_norm_fp8) scaled per tensor, "
                        "token or group of 128 columns, against split, the fused kernel without it and FlashInfer "
                        "(tpfuse.bench.fused_fp8)")
    opts = vars(p.parse_args(argv))
    shapes = fused_fp8.SHAPES if opts["quant"] else SHAPES
    if opts["max_tokens"] is None:
        opts["max_tokens"] = max(t for t, _ in shapes)
    opts["gpu_only"] = gpu_only_flags(p, opts, ["out"])
    return run_workers(_gpu_worker, fused_fp8.cpu_worker if opts["quant"] else _cpu_worker, opts)


if __name__ == "__main__":
    sys.exit(main())
