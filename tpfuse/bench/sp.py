"""``tpfuse bench sp``: the sequence-parallel boundary (reduce-scatter + residual add + RMSNorm,
then all-gather) against NCCL and torch, and against the all-reduce boundary, side by side.

Per (tokens T, hidden), bf16, W = every visible GPU (one process each), CUDA-graph replay
(``tpfuse.bench.allreduce``'s timing), each rank holding T / W rows of the residual stream:

- nccl_torch: NCCL reduce_scatter_tensor, torch add, torch.nn.functional.rms_norm, NCCL
  all_gather_into_tensor (Megatron's and vLLM's sequence-parallel boundary);
- tpfuse: Communicator.reduce_scatter_add_rms_norm, then all_gather;
- tpfuse_rs / tpfuse_ag: each of the two alone;
- allreduce: the non-sequence-parallel boundary, all_reduce_add_rms_norm over all T rows (auto).

tpfuse's rows are checked bitwise against the same rows of the split composition (tpfuse
all_reduce, then add_rms_norm) and the gathered rows against its y; NCCL's are compared too
and marked, but bind nothing. Without two GPUs: two CPU ranks under Triton's interpreter
check the bits on a few shapes.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpfuse
from tpfuse.bench.common import (MiB, collective_graph_us, collective_header, cpu_check_intro, cpu_check_verdict,
                                 gpu_only_flags, header_markdown, init_rank, layer_inputs, rotation, run_workers,
                                 same_bits, write_results)

SHAPES = [(t, 4096) for t in (64, 128, 256, 512, 1024, 2048, 4096)] + [(t, 8192) for t in (64, 256, 512, 1024)]
METHODS = ["nccl_torch", "tpfuse", "tpfuse_rs", "tpfuse_ag", "allreduce"]
EPS = 1e-6
CPU_SHAPES = [(4, 1024), (16, 2048)]


def _methods(comm, weight, world, tokens, hidden, y_rows):
    """The methods, each (x, residual rows) -> outputs; tpfuse_ag gathers ``y_rows``."""
    rows = tokens // world

    def nccl_torch(x, residual):
        reduced = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(reduced, x)
        residual_out = reduced + residual
        y = F.rms_norm(residual_out, (hidden,), weight, EPS)
        gathered = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, y)
        return y, residual_out, gathered

    def sequence_parallel(x, residual):
        y, residual_out = comm.reduce_scatter_add_rms_norm(x, residual, weight, EPS)
        return y, residual_out, comm.all_gather(y)

    return {"nccl_torch": nccl_torch, "tpfuse": sequence_parallel,
            "tpfuse_rs": lambda x, residual: comm.reduce_scatter_add_rms_norm(x, residual, weight, EPS),
            "tpfuse_ag": lambda x, residual: (comm.all_gather(y_rows),),
            "allreduce": None}  # over the full residual: measured apart


def _expected(comm, x, residual_full, weight, mine):
    """Split's rows of this rank, and its whole y: (y rows, residual_out rows, y)."""
    y, residual_out = tpfuse.add_rms_norm(comm.all_reduce(x), residual_full, weight, EPS)
    return y[mine], residual_out[mine], y


def _measure_shape(tokens, hidden, comm, world, rank):
    xs, residual_full, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 100_003 + hidden)
    x, rows = xs[rank], tokens // world
    mine = slice(rank * rows, (rank + 1) * rows)
    residual = residual_full[mine].clone()
    want = _expected(comm, x, residual_full, weight, mine)
    rot = rotation(2 * x.numel() * x.element_size())
    pool = [(x.clone(), residual.clone(), residual_full.clone()) for _ in range(rot)]
    records = []
    for name, fn in _methods(comm, weight, world, tokens, hidden, want[0]).items():
        if name == "allreduce":
            us = collective_graph_us(lambda i: comm.all_reduce_add_rms_norm(pool[i][0], pool[i][2], weight, EPS), rot)
            records.append(dict(tokens=tokens, hidden=hidden, method=name, us=round(us, 2), bitwise=True))
            continue
        out = fn(x, residual)
        checked = {"tpfuse_rs": want[:2], "tpfuse_ag": want[2:]}.get(name, want)
        bitwise = all(same_bits(a, b) for a, b in zip(out, checked))
        us = collective_graph_us(lambda i: fn(pool[i][0], pool[i][1]), rot)  # noqa: B023  (called right here)
        records.append(dict(tokens=tokens, hidden=hidden, method=name, us=round(us, 2), bitwise=bool(bitwise)))
    return records


def _markdown(records, header, world):
    by = {(r["tokens"], r["hidden"], r["method"]): r for r in records}
    md = header_markdown(f"sequence-parallel boundary, {world} ranks, bf16", header)
    md += ("CUDA-graph replay, us per call; a call's message is T x hidden bf16 (x of the reduce-scatter). "
           "tpfuse = reduce_scatter_add_rms_norm + all_gather; `x` marks outputs not bitwise equal to the split "
           "composition's rows (binding for tpfuse only). Target: nccl_torch / tpfuse >= 1.2 at 1-8 MiB.\n\n")
    md += "| hidden | tokens | MiB | " + " | ".join(METHODS) + " | nccl_torch / tpfuse | allreduce / tpfuse |\n"
    md += "|---" * (len(METHODS) + 5) + "|\n"
    for hidden, tokens in sorted({(r["hidden"], r["tokens"]) for r in records}):
        cells = [("-" if (r := by.get((tokens, hidden, m))) is None else
                  f"{r['us']:.1f}{'' if r['bitwise'] else ' x'}") for m in METHODS]
        sp, base, ar = (by.get((tokens, hidden, m)) for m in ("tpfuse", "nccl_torch", "allreduce"))
        ratio = (lambda a, b: f"{a['us'] / b['us']:.2f}" if a and b else "-")
        md += (f"| {hidden} | {tokens} | {tokens * hidden * 2 / MiB:.2f} | " + " | ".join(cells)
               + f" | {ratio(base, sp)} | {ratio(ar, sp)} |\n")
    return md


def _gpu_worker(rank: int, world: int, port: int | None, opts: dict) -> None:
    from tpfuse.comm import Communicator

    init_rank(rank, world, port, "nccl")
    shapes = [(t, h) for t, h in SHAPES if t <= opts["max_tokens"] and t % world == 0]
    if not shapes:
        raise ValueError(f"no shape of at most {opts['max_tokens']} tokens divides over {world} ranks "
                         f"(shapes: {SHAPES})")
    max_bytes = max(t * h * 2 for t, h in shapes)
    try:
        records = []
        with Communicator(max_bytes=max_bytes) as comm:
            for tokens, hidden in shapes:
                records += _measure_shape(tokens, hidden, comm, world, rank)
                if rank == 0:
                    print(f"{tokens:>6} x {hidden}: " + "  ".join(
                        f"{r['method']} {r['us']:.1f}us{'' if r['bitwise'] else '(x)'}" for r in records
                        if (r["tokens"], r["hidden"]) == (tokens, hidden)), flush=True)
        wrong = [f"{r['tokens']}x{r['hidden']} {r['method']}" for r in records
                 if not r["bitwise"] and r["method"].startswith("tpfuse")]
        if rank == 0:
            header = collective_header(comm) | {"dtype": "bf16", "tpfuse_max_bytes": max_bytes}
            md = _markdown(records, header, world)
            print(md)
            print("wrote " + ", ".join(write_results(opts["out"], f"sp_w{world}_bf16", header, records, md)))
        if wrong:
            raise RuntimeError(f"rank {rank}: outputs not bitwise equal to the split composition's rows: {wrong}")
    finally:
        dist.destroy_process_group()


def _cpu_worker(rank: int, world: int, port: int, opts: dict) -> None:
    from tpfuse.comm import Communicator

    shapes = [(t, h) for t, h in CPU_SHAPES if t <= opts["max_tokens"]] or [(world, 1024)]
    init_rank(rank, world, port, "gloo")
    if rank == 0:
        cpu_check_intro(f"reduce_scatter_add_rms_norm + all_gather at {', '.join(f'{t} x {h}' for t, h in shapes)} "
                        f"(tokens x hidden), bf16, {world} emulated ranks, bitwise against the split composition's rows",
                        opts["gpu_only"])
    rows = []
    with Communicator(timeout_s=60) as comm:
        for tokens, hidden in shapes:
            xs, residual_full, weight = layer_inputs(tokens, hidden, world, "cpu", seed=tokens)
            mine = slice(rank * tokens // world, (rank + 1) * tokens // world)
            want = _expected(comm, xs[rank], residual_full, weight, mine)
            out = _methods(comm, weight, world, tokens, hidden, want[0])["tpfuse"](xs[rank], residual_full[mine].clone())
            rows.append((tokens, hidden, all(same_bits(a, b) for a, b in zip(out, want))))
    dist.destroy_process_group()
    ok = all(good for *_, good in rows)
    if rank == 0:
        print("| tokens x hidden | bitwise equal to split's rows, and gathered |\n|---|---|")
        for tokens, hidden, good in rows:
            print(f"| {tokens} x {hidden} | {'yes' if good else 'NO'} |")
        cpu_check_verdict(ok)
    if not ok:
        raise RuntimeError(f"rank {rank}: a sequence-parallel result differs from the split composition's rows")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpfuse bench sp", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for sp_*.json / .md")
    p.add_argument("--max-tokens", type=int, default=max(t for t, _ in SHAPES),
                   help="leave out the shapes of more tokens than this (default: every shape)")
    opts = vars(p.parse_args(argv))
    opts["gpu_only"] = gpu_only_flags(p, opts, ["out"])
    return run_workers(_gpu_worker, _cpu_worker, opts)


if __name__ == "__main__":
    sys.exit(main())
