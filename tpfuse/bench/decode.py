"""``tpfuse bench decode``: what the layer boundary costs per generated token, in a real model.

A tensor-parallel ``TPModel`` (a preset's shapes, seeded random weights, bf16) over every
visible GPU (one process each, or torchrun's ranks). Per batch size: a prompt of
``--prompt`` random tokens, then ``--steps`` greedy decode steps, each step one CUDA-graph
replay, with a KV cache of ``--context`` positions (decode attention reads the filled ones
alone, ``tpfuse.invariant_attention``, in every model). Per boundary (``tpfuse.models.
boundary``: "torch", "symm_mem", "split", "fused", and "torch"/"fused" under
``torch.compile`` at ``--compile-batches``): ms per decode step (median over the steps,
slowest rank), tokens per second, and the share of the step spent at the layer boundary
(the 2 x layers boundary calls of one step timed alone, graph-replayed, over the step).

The same run checks the bits: "fused" and compiled "fused" give "split"'s logits at every
step, and a second "fused" decode (a new capture) repeats the first. With ``--invariant`` an
invariant model of the same weights (``TPModel(invariant=True)``: invariant GEMMs and
attention, fp32 partials all-reduced over the ranks' tree, then the residual add and norm;
"split" and "fused" are one path there) runs beside them as "invariant", and the table gives
its tokens/s against the plain fused model's, its logits' normwise error against split's, fed
split's greedy tokens (a run fails past ``INVARIANT_REL_ERR``: the speed of a kernel that sums
the wrong numbers is not a result), and whether sequence 0 decoded alone, fed the same tokens,
has the bits it has in the batch (the batch invariance the mode promises; ``tpfuse verify``
checks TP sizes too). The header gives the
weight-read floor: this rank's weights without the embedding table, read once per step at
the GPU's nominal bandwidth (H100 3.35 TB/s, H200 4.8 TB/s). Results: a table, JSON,
markdown and a PNG plot (ms per step vs batch) under ``--out``. On a machine without GPUs:
a tiny config over two CPU ranks under Triton's interpreter, checking the bits; timings
need GPUs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import tpfuse
from tpfuse.bench.common import (agreed_max, cpu_check_intro, cpu_check_verdict, gpu_only_flags, graph_time_us,
                                 header_markdown, init_rank, run_header, run_workers, same_bits, spawn_ranks,
                                 write_results)
from tpfuse.models import PRESETS
from tpfuse.reference import rel_err as reference_rel_err

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
BOUNDARIES = ["torch", "symm_mem", "split", "fused"]
COMPILED = ["torch", "fused"]


def _options(argv):
    p = argparse.ArgumentParser(prog="tpfuse bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", help="a tpfuse.models.PRESETS name (default llama3-8b)")
    p.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=BATCHES,
                   help="comma-separated batch sizes (default 1,2,...,256)")
    p.add_argument("--compile-batches", type=lambda s: [int(b) for b in s.split(",") if b], default=[1, 32],
                   help="batch sizes also measured under torch.compile (default 1,32; '' for none)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32; CPU: 4)")
    p.add_argument("--context", type=int, default=1024, help="KV-cache positions (default 1024)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; CPU: 6 steps checked)")
    p.add_argument("--boundaries", default=",".join(BOUNDARIES), help="comma-separated (default: all four)")
    p.add_argument("--invariant", action="store_true",
                   help="also an invariant model of the same weights (GPU runs)")
    p.add_argument("--fp8", action="store_true",
                   help="the model's projections in fp8 (TPModel(fp8=True): the boundary quantizes in its kernel; "
                        "not with --invariant)")
    p.add_argument("--out", default="bench_out", help="output folder (GPU runs)")
    p.add_argument("--plot", action="store_true", help="also write a PNG plot (needs matplotlib)")
    opts = vars(p.parse_args(argv))
    opts["boundaries"] = opts["boundaries"].split(",")
    unknown = set(opts["boundaries"]) - set(BOUNDARIES)
    if unknown or opts["preset"] not in PRESETS:
        p.error(f"unknown boundary {sorted(unknown)} (choose from {', '.join(BOUNDARIES)})" if unknown else
                f"unknown preset {opts['preset']!r} (choose from {', '.join(PRESETS)})")
    gpu = torch.cuda.is_available()
    if opts["prompt"] is None:
        opts["prompt"] = 32 if gpu else 4
    if opts["steps"] is None:
        opts["steps"] = 32 if gpu else 6
    if opts["prompt"] < 1 or opts["steps"] < 1:
        p.error("--prompt and --steps must be >= 1")
    opts["batch_given"] = opts["batch"] != BATCHES
    if opts["fp8"] and opts["invariant"]:
        p.error("--fp8 and --invariant do not go together (an fp8 model is not invariant)")
    if opts["invariant"] and "split" not in opts["boundaries"]:
        p.error("--invariant needs the split boundary (its logits are checked against split's)")
    opts["gpu_only"] = gpu_only_flags(p, opts, ["context", "out", "plot", "invariant"])
    return opts


def _decode(model, ids, steps, context, compile, forced=None):
    """Greedy decode of ``steps`` tokens after ``ids``: (per-step ms, logits [1 + steps, B, V],
    the prefill's first). ``forced`` [steps, B]: the tokens fed instead of the model's own
    (another model's greedy tokens, so that the two models' logits compare step by step)."""
    dec = model.decode_session(ids.shape[0], context, compile=compile)
    logits = dec.prefill(ids)
    out, times = [logits.clone()], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(steps):
        tokens = logits.argmax(-1) if forced is None else forced[i]
        dist.barrier()  # the ranks start each step together: the slowest rank's time is the step's
        start.record()
        logits = dec.step(tokens)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        out.append(logits.clone())
    return times, torch.stack(out)


INVARIANT_REL_ERR = 0.1
"""The most the invariant model's logits may differ (normwise, prefill and every step, fed the
plain model's tokens) from the plain model's: other GEMM and attention kernels, the same bf16
arithmetic (1.8e-2 for a 32-layer random model's prefill on CPU); a kernel summing the wrong
numbers is off by about 1."""
NOMINAL_TB_S = {"H100": 3.35, "H200": 4.8}
"""HBM bandwidth by GPU model, as its datasheet gives it (the floor's rate)."""


def _floor_ms(model) -> float | None:
    """The weight-read floor of one decode step on this rank: every weight but the embedding
    table (a lookup) read once at the GPU's nominal bandwidth; None for other GPUs."""
    rate = next((tb for name, tb in NOMINAL_TB_S.items() if name in torch.cuda.get_device_name()), None)
    if rate is None:
        return None
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens")
    return weight_bytes / (rate * 1e12) * 1e3


def _boundary_ms(model, batch):
    """ms of one step's 2 x layers boundary calls, alone, graph-replayed."""
    c = model.config
    g = torch.Generator(device="cuda").manual_seed(batch)
    residual = torch.randn(batch, 1, c.hidden_size, generator=g, device="cuda").to(model.dtype)
    x = torch.randn_like(residual, dtype=torch.float32 if model.invariant else model.dtype)  # the partial sums
    weight = model.norm

    def calls(_):
        h, r = x, residual
        for _ in range(2 * c.num_layers):
            h, r = model.boundary(x, r, weight, c.rms_norm_eps, c.norm_weight_offset, fp8=model.fp8)
        return h

    return graph_time_us(calls, calls_per_graph=1, repeats=5, min_replay_ms=20.0, agree=agreed_max,
                         capture_error_mode="thread_local") / 1e3


def _measure(comm, config, opts, rank):
    """Every (batch, boundary) record, and the bit failures."""
    from tpfuse.models import TPModel

    records, failures = [], []
    t0 = time.time()
    model = TPModel.random(config, comm, seed=0, boundary="split", fp8=opts["fp8"])
    invariant = TPModel.random(config, comm, seed=0, boundary="split", invariant=True) if opts["invariant"] else None
    floor = _floor_ms(model)
    for batch in opts["batch"]:
        g = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(0, config.vocab_size, (batch, opts["prompt"]), generator=g, device="cuda")
        # split first (the bits the fused runs must give), a second fused decode last (a new
        # capture, which must repeat the first).
        runs = sorted([(b, False) for b in opts["boundaries"]], key=lambda r: r[0] != "split")
        runs += [(b, True) for b in COMPILED if batch in opts["compile_batches"] and b in opts["boundaries"]]
        if "fused" in opts["boundaries"]:
            runs.append(("fused", False))
        runs = [(model, "", *r) for r in runs]
        if invariant is not None:
            runs.append((invariant, "invariant", "fused", False))
        reference, seen = None, set()
        for m, kind, boundary, compiled in runs:
            m.set_boundary(boundary)
            # The invariant model is fed the plain model's greedy tokens: its logits then compare.
            forced = reference[:-1].argmax(-1) if kind == "invariant" else None
            times, logits = _decode(m, ids, opts["steps"], opts["context"], compiled, forced)
            ms = agreed_max(statistics.median(times))
            again = (kind, boundary, compiled) in seen
            name = (kind or boundary) + ("+compile" if compiled else "") + (" (again)" if again else "")
            rec = dict(batch=batch, boundary=name, ms_per_step=round(ms, 4), tokens_per_s=round(batch / ms * 1e3, 1))
            if floor is not None:
                rec["vs_floor"] = round(ms / floor, 3)
            if boundary == "split" and not compiled:
                reference = logits
            elif boundary == "fused" and not kind and reference is not None:
                rec["bitwise_vs_split"] = bool(same_bits(logits, reference))
                if not rec["bitwise_vs_split"]:
                    failures.append(f"batch {batch} {name}: logits differ from split's")
            elif kind == "invariant":  # the same prompt and tokens as split's: the logits compare
                rec["rel_err_vs_split"] = reference_rel_err(logits, reference)
                if not rec["rel_err_vs_split"] < INVARIANT_REL_ERR:
                    failures.append(f"batch {batch} invariant: logits off the plain model's by "
                                    f"{rec['rel_err_vs_split']:.2e}")
                # Batch invariance: sequence 0 alone, fed the same tokens, has its bits in the batch.
                alone = _decode(m, ids[:1], opts["steps"], opts["context"], False, forced[:, :1])[1]
                rec["alone_equal"] = bool(same_bits(alone[:, 0], logits[:, 0]))
                if not rec["alone_equal"]:
                    failures.append(f"batch {batch} invariant: sequence 0's logits differ from its own alone")
                del alone
            if not again and not compiled:
                rec["boundary_ms"] = round(_boundary_ms(m, batch), 4)
                rec["boundary_share"] = round(rec["boundary_ms"] / ms, 3)
            seen.add((kind, boundary, compiled))
            records.append(rec)
            if rank == 0:
                print(f"[{time.time() - t0:6.0f} s] batch {batch:3d} {name:16s} {ms:7.3f} ms/step "
                      f"{rec['tokens_per_s']:9.1f} tok/s" + (f"  boundary {rec['boundary_ms']:.3f} ms"
                                                              if "boundary_ms" in rec else "")
                      + (f"  bits==split: {rec['bitwise_vs_split']}" if "bitwise_vs_split" in rec else "")
                      + (f"  rel err vs split: {rec['rel_err_vs_split']:.1e}  sequence 0 alone = in the batch: "
                         f"{rec['alone_equal']}" if "rel_err_vs_split" in rec else ""),
                      flush=True)
            del logits
            if compiled:  # torch.compile's cache keeps a compiled decode session (and its KV cache) alive
                m.set_boundary("split")
                torch._dynamo.reset()
        del reference
        torch.cuda.empty_cache()
    return records, failures, floor


def _gpu_worker(rank, world, port, opts):
    init_rank(rank, world, port, "nccl")

    header = run_header() | {"world_size": world, "preset": opts["preset"], "prompt": opts["prompt"],
                             "context": opts["context"], "steps": opts["steps"], "fp8": opts["fp8"]}
    with tpfuse.Communicator() as comm:
        records, failures, floor = _measure(comm, PRESETS[opts["preset"]], opts, rank)
    if floor is not None:
        header["floor_ms"] = round(floor, 4)
    # The model and its captured graphs are gone: NCCL's teardown waits for graphs that hold its work.
    gc.collect()
    torch.cuda.synchronize()
    if rank == 0:
        md = _markdown(records, header, world)
        print(md)
        name = (f"decode_{opts['preset']}_tp{world}" + ("_invariant" if opts["invariant"] else "")
                + ("_fp8" if opts["fp8"] else ""))
        paths = write_results(opts["out"], name, header, records, md)
        print("wrote", *paths)
        if opts["plot"]:
            _plot(records, f"{opts['out']}/{name}.png", f"{opts['preset']}, TP={world}, decode step")
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError("; ".join(failures))


def _markdown(records, header, world) -> str:
    by = {(r["batch"], r["boundary"]): r for r in records}
    names = list(dict.fromkeys(r["boundary"] for r in records))
    with_invariant = "invariant" in names
    md = header_markdown(f"decode step, {header['preset']}, TP={world}", header)
    md += ("ms per decode step (CUDA-graph replay, median over the steps, slowest rank); in brackets the "
           "boundary's share of the step. `=` marks fused runs whose logits equal split's bit for bit at "
           "the prefill and every step, `x` runs that differ.")
    if "floor_ms" in header:
        md += (f" The weight-read floor is {header['floor_ms']:.3f} ms per step (this rank's weights but the "
               "embedding table, at the GPU's nominal bandwidth); `fused / floor` is fused's step over it.")
    md += "\n\n| batch | " + " | ".join(names) + " | fused tok/s | fused vs torch | fused vs split |"
    extra = (["fused / floor"] if "floor_ms" in header else []) + (
        ["invariant tok/s vs fused", "invariant rel err vs split", "invariant: alone = in batch"]
        if with_invariant else [])
    md += "".join(f" {e} |" for e in extra) + "\n" + "|---" * (len(names) + 4 + len(extra)) + "|\n"
    for b in sorted({r["batch"] for r in records}):
        cells = []
        for n in names:
            r = by.get((b, n))
            if r is None:
                cells.append("-")
                continue
            mark = {True: " =", False: " x"}.get(r.get("bitwise_vs_split"), "")
            share = f" ({100 * r['boundary_share']:.0f}%)" if "boundary_share" in r else ""
            cells.append(f"{r['ms_per_step']:.3f}{share}{mark}")
        fused, torch_, split = by.get((b, "fused")), by.get((b, "torch")), by.get((b, "split"))
        ratio = (lambda other: f"{other['ms_per_step'] / fused['ms_per_step']:.2f}x" if fused and other else "-")
        md += (f"| {b} | " + " | ".join(cells) + f" | {fused['tokens_per_s']:.0f} | " if fused else
               f"| {b} | " + " | ".join(cells) + " | - | ") + f"{ratio(torch_)} | {ratio(split)} |"
        if "floor_ms" in header:
            md += f" {fused['vs_floor']:.2f}x |" if fused else " - |"
        if with_invariant:
            inv = by.get((b, "invariant"))
            md += f" {fused['ms_per_step'] / inv['ms_per_step']:.2f}x |" if fused and inv else " - |"
            md += f" {inv['rel_err_vs_split']:.1e} |" if inv and "rel_err_vs_split" in inv else " - |"
            md += f" {'yes' if inv['alone_equal'] else 'NO'} |" if inv and "alone_equal" in inv else " - |"
        md += "\n"
    return md


def _plot(records, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib; no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["boundary"] for r in records):
        pts = sorted((r["batch"], r["ms_per_step"]) for r in records if r["boundary"] == name)
        if len(pts) > 1 and "again" not in name:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


CPU_BATCHES = [2]
"""The CPU check's batch sizes unless --batch names others."""


def _cpu_worker(rank, world, port, opts):
    """Two CPU ranks, the preset's architecture at a tiny size: every boundary asked for, and
    "fused" compiled (aot_eager) at every batch unless --compile-batches is empty, against
    "split"'s bits."""
    init_rank(rank, world, port, "gloo")
    from tpfuse.models import TPModel

    config = PRESETS[opts["preset"]].replace(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                                             num_heads=4, num_kv_heads=2, head_dim=16)
    batches = opts["batch"] if opts["batch_given"] else CPU_BATCHES
    runs = [(b, False) for b in opts["boundaries"] if b != "symm_mem"] + (
        [("fused", "aot_eager")] if opts["compile_batches"] and "fused" in opts["boundaries"] else [])
    if rank == 0:
        asked_symm_mem = "symm_mem" in opts["boundaries"] and opts["boundaries"] != BOUNDARIES
        gpu_only = opts["gpu_only"] + (["--boundaries symm_mem"] if asked_symm_mem else [])
        cpu_check_intro(f"{opts['preset']}'s architecture{' with fp8 projections' if opts['fp8'] else ''} at hidden 64, "
                        f"2 layers, {world} emulated ranks; batch "
                        f"{', '.join(map(str, batches))}, a {opts['prompt']}-token prompt, {opts['steps']} greedy steps; "
                        "logits of each boundary against split's", gpu_only)
    failures, t0 = [], time.monotonic()
    with tpfuse.Communicator(max_bytes=1 << 18) as comm:
        model = TPModel.random(config, comm, seed=0, boundary="split", fp8=opts["fp8"])
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch, opts["prompt"]), generator=torch.Generator().manual_seed(batch))
            results = {}
            for boundary, compiled in [("split", False)] + [r for r in runs if r != ("split", False)]:
                model.set_boundary(boundary)
                results[(boundary, compiled)] = model.generate(ids, opts["steps"], compile=compiled, return_logits=True)[1]
                if (boundary, compiled) == ("split", False):
                    verdict = "the reference"
                elif boundary == "torch":  # torch's all-reduce and norm promise closeness to tpfuse's, not bits
                    diff = (results[(boundary, compiled)] - results[("split", False)]).abs().max().item()
                    verdict = f"max |logit - split's| {diff:.3g} (closeness, not bits, is promised)"
                else:
                    same = same_bits(results[(boundary, compiled)], results[("split", False)])
                    verdict = f"logits bitwise equal to split's: {'yes' if same else 'NO'}"
                    if not same:
                        failures.append(f"batch {batch} {boundary}{' compiled' if compiled else ''}")
                if rank == 0:
                    print(f"[{time.monotonic() - t0:5.0f} s] batch {batch} {boundary}"
                          f"{' compiled' if compiled else ''}: {verdict}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        cpu_check_verdict(not failures)
    if failures:
        raise AssertionError(f"logits differ from split's: {', '.join(failures)}")


def main(argv=None) -> int:
    opts = _options(sys.argv[1:] if argv is None else argv)
    if torch.cuda.is_available() and torch.cuda.device_count() == 1 and "RANK" not in os.environ:
        return spawn_ranks(_gpu_worker, 1, opts)  # TP=1: the baseline without communication
    return run_workers(_gpu_worker, _cpu_worker, opts)
