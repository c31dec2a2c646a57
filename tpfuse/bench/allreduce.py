"""``tpfuse bench allreduce``: tpfuse all-reduce (auto, one-shot, two-shot) side by side with
NCCL, torch symmetric memory (one_shot_all_reduce, two_shot_all_reduce_) and, where it is
importable, FlashInfer's all-reduce (``FlashInferAllReduce``: messages of whole
FLASHINFER_HIDDEN-element rows that fit its workspace), in the same run and the same processes: one process per
visible GPU (spawned here, or started by torchrun).

Per message size: CUDA-graph replay latency (20 calls per graph, median of 5 timed samples,
every rank replaying the same number of times; the slowest rank's median is reported; tpfuse
and NCCL rotate input buffers so small messages are not served from L2, torch symm-mem runs
on its one registered buffer), bus bandwidth 2(W-1)/W * bytes / time, and whether the result
is bitwise equal to tpfuse.reference.all_reduce. torch symm-mem is timed on data already in
its buffer (no copy-in), tpfuse and NCCL on ordinary tensors.

On a machine without two GPUs it runs two CPU ranks under Triton's interpreter, checks
correctness on a few sizes and prints a short table (timings need GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import tpfuse.comm  # noqa: F401  (sets the no-multicast environment before ranks are spawned)
from tpfuse import reference
from tpfuse.bench.common import (DTYPES, KiB, FlashInferAllReduce, SymmMemAllReduce, collective_graph_us,
                                 collective_header, cpu_check_intro, cpu_check_verdict, fmt_size, gpu_only_flags,
                                 header_markdown, init_rank, random_inputs, rotation, run_workers, same_bits,
                                 write_results)

SIZES = [4 * KiB << i for i in range(17)]  # 4 KiB .. 256 MiB
METHODS = ["nccl", "symm_oneshot", "symm_twoshot", "flashinfer", "tpfuse_auto", "tpfuse_oneshot", "tpfuse_twoshot"]
FLASHINFER_HIDDEN = 4096
"""FlashInfer's kernels take [tokens, hidden] rows: a message is cut into rows of this many."""


def _measure_size(nbytes, dtype, comm, symm, flashinfer, world, rank):
    """Records for one message size: every method's bits against the reference, then its time."""
    from tpfuse.comm.plan import AllReducePlan

    n = nbytes // dtype.itemsize
    xs = random_inputs(n, dtype, world, "cuda", seed=nbytes)
    ref = reference.all_reduce(xs)
    rot = rotation(nbytes)
    pool = [xs[rank].clone() for _ in range(rot)]
    sym = symm.buf[:n] if symm is not None else None
    runs = {"nccl": (lambda x: dist.all_reduce(x), pool)}
    if sym is not None:
        runs["symm_oneshot"] = (symm.oneshot, [sym])
        runs["symm_twoshot"] = (symm.twoshot, [sym])
    rows = n // FLASHINFER_HIDDEN
    if flashinfer is not None and n % FLASHINFER_HIDDEN == 0 and flashinfer.fits(n):
        fi_out = torch.empty(rows, FLASHINFER_HIDDEN, dtype=dtype, device="cuda")
        runs["flashinfer"] = (lambda x: flashinfer.all_reduce(x.view(rows, -1), fi_out).view(-1), pool)
    for algo in ("auto", "oneshot", "twoshot"):
        try:
            AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, algo)
        except ValueError:
            continue  # this algorithm does not serve this size with this workspace
        runs[f"tpfuse_{algo}"] = ((lambda a: lambda x: comm.all_reduce(x, algo=a))(algo), pool)
    records = []
    for method, (fn, inputs) in runs.items():
        try:
            inputs[0].copy_(xs[rank])
            out = fn(inputs[0])
            bitwise = same_bits(inputs[0] if out is None else out, ref)  # nccl and two-shot work in place
            us = collective_graph_us(lambda i: fn(inputs[i]), len(inputs))  # noqa: B023  (called right here)
        except Exception as e:  # noqa: BLE001  a peer's limit (every rank raises alike): keep measuring
            if rank == 0:
                print(f"{method} at {fmt_size(nbytes)} failed: {type(e).__name__}: {e}", flush=True)
            continue
        rec = dict(size_bytes=nbytes, method=method, us=round(us, 2), bitwise=bool(bitwise),
                   busbw_gbps=round(2 * (world - 1) / world * nbytes / (us * 1e-6) / 1e9, 1))
        if method in ("tpfuse_auto", "tpfuse_oneshot"):
            plan = AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, method.removeprefix("tpfuse_"))
            rec["algo"] = plan.algo + (f"/{plan.protocol}" if plan.algo == "oneshot" else "")
        records.append(rec)
    return records


def _markdown(records, header, world, dtype_name, max_bytes) -> str:
    by = {(r["size_bytes"], r["method"]): r for r in records}
    sizes = sorted({r["size_bytes"] for r in records})
    md = header_markdown(f"all-reduce, {world} ranks, {dtype_name}", header)
    md += (f"CUDA-graph replay, us per call (bus bandwidth GB/s); tpfuse workspace max_bytes={max_bytes}. "
           "`x` marks results that are not bitwise equal to tpfuse.reference.all_reduce.\n\n")
    md += "| size | " + " | ".join(METHODS) + " | auto / best(NCCL, symm) |\n"
    md += "|---" * (len(METHODS) + 2) + "|\n"
    for s in sizes:
        cells = []
        for m in METHODS:
            r = by.get((s, m))
            cells.append("-" if r is None else f"{r['us']:.1f} ({r['busbw_gbps']:.0f}){'' if r['bitwise'] else ' x'}"
                         + (f" [{r['algo']}]" if "algo" in r else ""))
        peers = [by[(s, m)]["us"] for m in ("nccl", "symm_oneshot", "symm_twoshot") if (s, m) in by]
        auto = by.get((s, "tpfuse_auto"))
        ratio = f"{auto['us'] / min(peers):.2f}" if auto and peers else "-"
        md += f"| {fmt_size(s)} | " + " | ".join(cells) + f" | {ratio} |\n"
    return md


def _plot(records, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in METHODS:
        pts = sorted((r["size_bytes"], r["us"]) for r in records if r["method"] == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="us per call (graph replay)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def _gpu_worker(rank: int, world: int, port: int | None, opts: dict) -> None:
    from tpfuse.comm import Communicator

    init_rank(rank, world, port, "nccl")
    dtype = DTYPES[opts["dtype"]]
    sizes = [s for s in SIZES if opts["min_bytes"] <= s <= opts["max_bytes"]]
    max_bytes = max(sizes)
    flashinfer = None
    try:
        try:
            symm = SymmMemAllReduce(max_bytes, dtype)
        except Exception as e:  # noqa: BLE001  torch builds without symmetric memory: measure the rest
            symm = None
            if rank == 0:
                print(f"torch symmetric memory unavailable ({type(e).__name__}: {e}); its columns stay empty")
        flashinfer = FlashInferAllReduce.create(dtype)
        records = []
        with Communicator(max_bytes=max_bytes) as comm:
            for nbytes in sizes:
                records += _measure_size(nbytes, dtype, comm, symm, flashinfer, world, rank)
                if rank == 0:
                    print(f"{fmt_size(nbytes):>8}: " + "  ".join(f"{r['method']} {r['us']:.1f}us" for r in records
                                                             if r["size_bytes"] == nbytes), flush=True)
        wrong = [f"{fmt_size(r['size_bytes'])} {r['method']}" for r in records
                 if r["method"].startswith("tpfuse") and not r["bitwise"]]
        if rank == 0:
            header = collective_header(comm) | {"dtype": opts["dtype"], "tpfuse_max_bytes": max_bytes}
            if flashinfer is not None:
                header["flashinfer"] = flashinfer.version
            md = _markdown(records, header, world, opts["dtype"], max_bytes)
            print(md)
            name = f"allreduce_w{world}_{opts['dtype']}"
            paths = write_results(opts["out"], name, header, records, md)
            print("wrote " + ", ".join(paths))
            if opts["plot"]:
                _plot(records, os.path.join(opts["out"], f"{name}.png"), f"all-reduce, {world}x {header.get('gpu')}")
        if wrong:
            raise RuntimeError(f"rank {rank}: tpfuse results not bitwise equal to the reference: {wrong}")
    finally:
        try:
            if flashinfer is not None:
                flashinfer.close()
        finally:
            dist.destroy_process_group()


CPU_SIZES = (4 * KiB, 64 * KiB, 256 * KiB)


def _cpu_worker(rank: int, world: int, port: int, opts: dict) -> None:
    import time

    from tpfuse.comm import Communicator

    dtype = DTYPES[opts["dtype"]]
    sizes = [s for s in CPU_SIZES if opts["min_bytes"] <= s <= opts["max_bytes"]] or [min(opts["min_bytes"], opts["max_bytes"])]
    init_rank(rank, world, port, "gloo")
    if rank == 0:
        cpu_check_intro(f"one-shot, two-shot and auto all-reduce at {', '.join(map(fmt_size, sizes))}, "
                        f"{opts['dtype']}, {world} emulated ranks, bitwise against tpfuse.reference", opts["gpu_only"])
    rows = []
    with Communicator(max_bytes=max(1 << 20, *sizes), timeout_s=60) as comm:
        for nbytes in sizes:
            xs = random_inputs(nbytes // dtype.itemsize, dtype, world, "cpu", seed=nbytes)
            ref = reference.all_reduce(xs)
            for algo in ("oneshot", "twoshot", "auto"):
                start = time.perf_counter()
                out = comm.all_reduce(xs[rank], algo=algo)
                rows.append((nbytes, algo, same_bits(out, ref), (time.perf_counter() - start) * 1e3))
    dist.destroy_process_group()
    ok = all(good for _, _, good, _ in rows)
    if rank == 0:
        print("| size | algo | bitwise equal to reference | interpreter ms (not a GPU timing) |\n|---|---|---|---|")
        for nbytes, algo, good, ms in rows:
            print(f"| {fmt_size(nbytes)} | {algo} | {'yes' if good else 'NO'} | {ms:.0f} |")
        cpu_check_verdict(ok)
    if not ok:
        raise RuntimeError(f"rank {rank}: a result differs from tpfuse.reference.all_reduce")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpfuse bench allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for allreduce_*.json / .md / .png")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="the messages' dtype (default bf16)")
    p.add_argument("--min-bytes", type=int, default=None, help="smallest message (default 4 KiB; --quant: 1 MiB)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="largest message, and tpfuse's max_bytes (default 256 MiB; --quant: 512 MiB)")
    p.add_argument("--quant", action="store_true",
                   help="the quantized all-reduce (fp8, int8, int6, int4) next to the exact path and NCCL "
                        "(tpfuse.bench.quant); writes allreduce_quant_*")
    p.add_argument("--quant-max-bytes", type=int, default=None,
                   help="with --quant: max_bytes of the codecs' communicator (default: --max-bytes; "
                        "smaller ones run large messages in segments)")
    p.add_argument("--plot", action="store_true", help="write a latency-vs-size PNG (needs matplotlib)")
    opts = vars(p.parse_args(argv))
    opts["gpu_only"] = gpu_only_flags(p, opts, ["out", "quant_max_bytes", "plot"])
    gpu_worker, cpu_worker = _gpu_worker, _cpu_worker
    if opts["quant"]:
        from tpfuse.bench import quant

        gpu_worker, cpu_worker = quant.gpu_worker, quant.cpu_worker
    else:
        opts["min_bytes"] = opts["min_bytes"] or SIZES[0]
        opts["max_bytes"] = opts["max_bytes"] or SIZES[-1]
    return run_workers(gpu_worker, cpu_worker, opts)


if __name__ == "__main__":
    sys.exit(main())
