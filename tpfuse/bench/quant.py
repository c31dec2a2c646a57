"""``tpfuse bench allreduce --quant``: the quantized all-reduce (fp8, int8, int6, int4) next to
tpfuse's exact all-reduce and NCCL, in the same run and the same processes (one per visible
GPU).

Per message size (1 MiB to 512 MiB, bf16 Gaussian inputs): CUDA-graph replay latency (the
slowest rank's median of 5 samples; 20 calls per graph up to 16 MiB, fewer above so a
graph's outputs stay within a few GiB; inputs rotated so small messages are not served from
L2), effective bus bandwidth ``2(W-1)/W * bytes / time`` on the uncompressed bytes, the
speed-up over NCCL, each method's relative RMS error against the float64 sum, and whether the
result is bitwise equal to its contract (``tpfuse.reference.all_reduce`` for the exact path,
``quantized_all_reduce`` for the codecs, checked on the device). The quantized calls pass
``quant_min_bytes=0`` so that every size is measured on the quantized path; the markdown ends
with the smallest size from which each codec beats both NCCL and the exact path at every
larger size measured (the value for ``Knobs.quant_min_bytes``).

Without two GPUs: two CPU ranks under Triton's interpreter check bits and errors on a few
small sizes (timings need GPUs).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tpfuse import reference
from tpfuse.bench.common import (DTYPES, KiB, MiB, agreed_max, collective_header, cpu_check_intro,
                                 cpu_check_verdict, fmt_size, graph_time_us, header_markdown, init_rank, random_inputs,
                                 rotation, same_bits, write_results)

QUANT_SIZES = [MiB << i for i in range(10)]  # 1 MiB .. 512 MiB
CODECS = list(reference.QUANT_CODECS)
METHODS = ["tpfuse_exact"] + [f"tpfuse_{c}" for c in CODECS] + ["nccl"]  # NCCL last: it works in place
REPEATS, MIN_SAMPLE_MS = 5, 20.0
GRAPH_BYTES = 256 * MiB
"""Calls per graph: as many as keep 256 MiB of messages in one graph (2 to 20)."""


def _calls_per_graph(nbytes: int) -> int:
    return max(2, min(20, GRAPH_BYTES // nbytes))


def _quantized(method: str) -> str | None:
    codec = method.removeprefix("tpfuse_")
    return codec if codec in CODECS else None


def _measure_size(nbytes, dtype, comm, qcomm, world, rank):
    n = nbytes // dtype.itemsize
    xs = random_inputs(n, dtype, world, "cuda", seed=nbytes)
    exact64 = torch.zeros(n, dtype=torch.float64, device="cuda")
    for x in xs:
        exact64 += x.double()
    rot = rotation(nbytes)
    pool = [xs[rank].clone() for _ in range(rot)]
    runs = {"tpfuse_exact": lambda x: comm.all_reduce(x, algo="auto"), "nccl": lambda x: dist.all_reduce(x)}
    for codec in CODECS:
        runs[f"tpfuse_{codec}"] = (lambda c: lambda x: qcomm.all_reduce(x, quant=c, quant_min_bytes=0))(codec)
    records = []
    for method in METHODS:
        fn, codec = runs[method], _quantized(method)
        try:
            pool[0].copy_(xs[rank])
            out = fn(pool[0])
            out = pool[0] if out is None else out  # NCCL works in place
            ref = reference.quantized_all_reduce(xs, codec) if codec else reference.all_reduce(xs)
            bitwise = same_bits(out, ref)
            err = reference.rel_err(out, exact64)
            del out, ref
            us = graph_time_us(lambda i: fn(pool[i % rot]), _calls_per_graph(nbytes), REPEATS,  # noqa: B023
                               MIN_SAMPLE_MS, agree=agreed_max, capture_error_mode="thread_local")
        except Exception as e:  # noqa: BLE001  every rank raises alike (a limit): keep measuring
            if rank == 0:
                print(f"{method} at {fmt_size(nbytes)} failed: {type(e).__name__}: {e}", flush=True)
            continue
        records.append(dict(size_bytes=nbytes, method=method, us=round(us, 2), bitwise=bool(bitwise),
                            rel_err=err, busbw_gbps=round(2 * (world - 1) / world * nbytes / (us * 1e-6) / 1e9, 1)))
    nccl = next((r["us"] for r in records if r["method"] == "nccl"), None)
    for r in records:
        r["speedup_vs_nccl"] = round(nccl / r["us"], 3) if nccl else None
    return records


def suggested_min_bytes(records) -> dict[str, int | None]:
    """Per codec, the smallest measured size from which the codec is faster than both NCCL
    and the exact path at every larger measured size (None: it never wins at the top)."""
    by = {(r["size_bytes"], r["method"]): r["us"] for r in records}
    sizes = sorted({r["size_bytes"] for r in records})
    out = {}
    for codec in CODECS:
        best = None
        for s in reversed(sizes):
            mine = by.get((s, f"tpfuse_{codec}"))
            peers = [by[(s, m)] for m in ("nccl", "tpfuse_exact") if (s, m) in by]
            if mine is None or not peers or mine >= min(peers):
                break
            best = s
        out[codec] = best
    return out


def _markdown(records, header, world, dtype_name, max_bytes, quant_max_bytes) -> str:
    by = {(r["size_bytes"], r["method"]): r for r in records}
    sizes = sorted({r["size_bytes"] for r in records})
    md = header_markdown(f"quantized all-reduce, {world} ranks, {dtype_name}", header)
    md += (f"CUDA-graph replay, us per call (bus bandwidth GB/s on the uncompressed bytes) [speed-up over NCCL]. "
           f"Exact path: workspace max_bytes={max_bytes}; codecs: max_bytes={quant_max_bytes} (larger messages "
           "run in segments). `x` marks results that are not bitwise equal to their tpfuse.reference contract.\n\n")
    md += "| size | " + " | ".join(METHODS) + " |\n" + "|---" * (len(METHODS) + 1) + "|\n"
    for s in sizes:
        cells = []
        for m in METHODS:
            r = by.get((s, m))
            cells.append("-" if r is None else f"{r['us']:.1f} ({r['busbw_gbps']:.0f}) [{r['speedup_vs_nccl']:.2f}x]"
                         + ("" if r["bitwise"] or m == "nccl" else " x"))
        md += f"| {fmt_size(s)} | " + " | ".join(cells) + " |\n"
    md += "\nRelative RMS error against the float64 sum (Gaussian inputs), %:\n\n"
    md += "| size | " + " | ".join(METHODS) + " |\n" + "|---" * (len(METHODS) + 1) + "|\n"
    for s in sizes:
        md += f"| {fmt_size(s)} | " + " | ".join(
            "-" if (s, m) not in by else f"{100 * by[(s, m)]['rel_err']:.3f}" for m in METHODS) + " |\n"
    budget = ", ".join(f"{c} {100 * b:g}%" for c, b in reference.QUANT_ERROR_BUDGET.items())
    md += f"\nError budget: {budget}.\n\nSuggested QUANT_MIN_BYTES (a table's; Knobs.quant_min_bytes) at W={world} "
    md += "(smallest size from which the codec beats NCCL and the exact path at every larger size): "
    md += ", ".join(f"{c}: {'never' if s is None else fmt_size(s)}" for c, s in suggested_min_bytes(records).items())
    return md + "\n"


def gpu_worker(rank: int, world: int, port: int | None, opts: dict) -> None:
    """One rank of the GPU run; ``opts["knob_changes"]`` (scripts/tune_quant.py) changes the
    communicators' default knobs."""
    from tpfuse.comm import Communicator, knobs_for

    init_rank(rank, world, port, "nccl")
    knobs = knobs_for(world, torch.cuda.get_device_name()).replace(**opts.get("knob_changes", {}))
    dtype = DTYPES[opts["dtype"]]
    lo = opts["min_bytes"] or QUANT_SIZES[0]
    hi = opts["max_bytes"] or QUANT_SIZES[-1]
    sizes = [s for s in QUANT_SIZES if lo <= s <= hi]
    max_bytes = max(sizes)
    quant_max_bytes = opts.get("quant_max_bytes") or max_bytes
    try:
        records = []
        with contextlib.ExitStack() as stack:
            comm = stack.enter_context(Communicator(max_bytes=max_bytes, knobs=knobs))
            qcomm = comm if quant_max_bytes == max_bytes else stack.enter_context(
                Communicator(max_bytes=quant_max_bytes, knobs=knobs))
            for nbytes in sizes:
                records += _measure_size(nbytes, dtype, comm, qcomm, world, rank)
                torch.cuda.empty_cache()  # the next size's inputs may need what this size cached
                if rank == 0:
                    print(f"{fmt_size(nbytes):>8}: " + "  ".join(
                        f"{r['method']} {r['us']:.1f}us {100 * r['rel_err']:.2f}%" for r in records
                        if r["size_bytes"] == nbytes), flush=True)
        wrong = [f"{fmt_size(r['size_bytes'])} {r['method']}" for r in records
                 if r["method"] != "nccl" and not r["bitwise"]]
        over = [f"{fmt_size(r['size_bytes'])} {r['method']} {100 * r['rel_err']:.2f}%" for r in records
                if _quantized(r["method"]) and r["rel_err"] > reference.QUANT_ERROR_BUDGET[_quantized(r["method"])]]
        if rank == 0:
            header = collective_header(comm) | {"dtype": opts["dtype"], "tpfuse_max_bytes": max_bytes,
                                     "quant_max_bytes": quant_max_bytes, "input": "gaussian"}
            md = _markdown(records, header, world, opts["dtype"], max_bytes, quant_max_bytes)
            print(md)
            paths = write_results(opts["out"], f"allreduce_quant_w{world}_{opts['dtype']}", header, records, md)
            print("wrote " + ", ".join(paths))
        if wrong or over:
            raise RuntimeError(f"rank {rank}: not bitwise equal to the reference: {wrong}; over the budget: {over}")
    finally:
        dist.destroy_process_group()


def cpu_worker(rank: int, world: int, port: int, opts: dict) -> None:
    import time

    from tpfuse.comm import Communicator

    dtype = DTYPES[opts["dtype"]]
    gpu_only = opts["gpu_only"] + [f for f, v in (("--min-bytes", opts["min_bytes"]), ("--max-bytes", opts["max_bytes"]))
                                   if v is not None]
    init_rank(rank, world, port, "gloo")
    if rank == 0:
        cpu_check_intro(f"{', '.join(CODECS)} all-reduce at 64 KiB and 256 KiB (in segments), {opts['dtype']} "
                        f"Gaussian inputs, {world} emulated ranks, bitwise against tpfuse.reference and within each "
                        "codec's error budget", gpu_only)
    rows = []
    with Communicator(max_bytes=64 * KiB, timeout_s=60) as comm:  # 256 KiB runs in segments
        for nbytes in (64 * KiB, 256 * KiB):
            xs = random_inputs(nbytes // dtype.itemsize, dtype, world, "cpu", seed=nbytes)
            exact64 = sum(x.double() for x in xs)
            for codec in CODECS:
                start = time.perf_counter()
                out = comm.all_reduce(xs[rank], quant=codec, quant_min_bytes=0)
                ms = (time.perf_counter() - start) * 1e3
                ok = same_bits(out, reference.quantized_all_reduce(xs, codec))
                err = reference.rel_err(out, exact64)
                rows.append((nbytes, codec, ok, err, err <= reference.QUANT_ERROR_BUDGET[codec], ms))
    dist.destroy_process_group()
    ok = all(good and within for _, _, good, _, within, _ in rows)
    if rank == 0:
        print("| size | codec | bitwise equal to reference | relative error % | within budget | "
              "interpreter ms (not a GPU timing) |\n|---|---|---|---|---|---|")
        for nbytes, codec, good, err, within, ms in rows:
            print(f"| {fmt_size(nbytes)} | {codec} | {'yes' if good else 'NO'} | {100 * err:.3f} | "
                  f"{'yes' if within else 'NO'} | {ms:.0f} |")
        cpu_check_verdict(ok)
    if not ok:
        raise RuntimeError(f"rank {rank}: a quantized result differs from the reference or exceeds the budget")