"""``tpfuse tune``: measure the choices that "auto" makes, at this machine's world size, and
derive the plan table (``tpfuse.comm.tables``) from the measurements.

One process per visible GPU (W = every GPU; spawned here, or started by torchrun). Per
message size, bf16, four sweeps, in this order:

- all-reduce: one-shot over LL words, over Lamport words, with flags, two-shot (and NCCL,
  for reference only) -> LL_MAX_BYTES, LAMPORT_MAX_BYTES and ONESHOT_MAX_BYTES;
- fused all-reduce + add + RMSNorm at hidden 4096 (``tpfuse bench fused``'s), tokens =
  size / 8 KiB: one-shot over LL words, over Lamport words, with flags, two-shot, split ->
  FUSED_LL_MAX_BYTES, FUSED_LAMPORT_MAX_BYTES, FUSED_ONESHOT_MAX_BYTES, FUSED_TWOSHOT_MAX_BYTES;
- the same at hidden 8192 (tokens = size / 16 KiB) -> their FUSED_WIDE_* twins, which serve
  the rows whose norm tile is hidden 8192's (``tpfuse.comm.plan.FUSED_WIDE_TILE``);
- quantized all-reduce: each codec against the exact path -> QUANT_MIN_BYTES.

Each sweep runs under the knobs the sweeps before it derived (split and "exact" run the
derived all-reduce), so it measures what "auto" will do. Timing is ``tpfuse bench``'s
(CUDA-graph replay, rotated inputs, slowest rank's median); every timed method's output is
first checked bitwise against tpfuse.reference (the codecs: against
``reference.quantized_all_reduce``, and their error against the codec's budget). A method that fails its check fails the run and no table is
written. Writes tune_w{W}_bf16.json / .md under --out; with --write-table also the table
w{W}-{model}.json of the GPU's model (``tpfuse.comm.tables.gpu_model``; w{W}.json without a
GPU), into tpfuse/comm/tables/ or --table-dir. The sweep's results are also written after
each sweep but the last, so a run killed later leaves what it measured. --budget-s, counted
from the start of the command (spawning the ranks and setting up take part of it), stops the
sweep (all ranks together); a sweep cut short gives no knobs.

Without two GPUs: two CPU ranks under Triton's interpreter run the same sweep on tiny sizes
(one call per point, wall clock): a check of the bits and the plumbing, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import tpfuse
from tpfuse import reference
from tpfuse.bench.common import (KiB, MiB, agreed_max, collective_graph_us, fmt_size, header_markdown, init_rank,
                                 layer_inputs, random_inputs, rotation, run_header, run_workers, same_bits,
                                 write_results)
from tpfuse.comm import tables
from tpfuse.comm.plan import FUSED_WIDE_TILE, AllReducePlan, FusedPlan

SIZES = [8 * KiB << i for i in range(13)]  # 8 KiB .. 32 MiB
CPU_SIZES = [8 * KiB, 32 * KiB]
EPS, DTYPE = 1e-6, torch.bfloat16
FUSED_HIDDEN = {"fused": 4096, "fused_wide": FUSED_WIDE_TILE[0]}
"""The hidden size of each fused sweep (both ``tpfuse bench fused``'s): 4096 for the FUSED_*
knobs, FUSED_WIDE_TILE's (a bf16 row, as DTYPE) for the FUSED_WIDE_* ones."""
FUSED_KNOB_PREFIX = {"fused": "FUSED_", "fused_wide": "FUSED_WIDE_"}
LL_SWEEP_MAX = 2 * MiB
"""LL one-shot is swept up to here: its workspace regions take 4 * W bytes per message byte,
and it sends twice the bytes, so it loses long before."""
ONESHOT_SWEEP_MAX = 8 * MiB
"""One-shot (Lamport words, flags) is swept up to here (each rank reads W whole messages)."""
TOLERANCE = 0.03
ALLREDUCE_CHAIN = ("oneshot_ll", "oneshot_lamport", "oneshot_flags", "twoshot")
FUSED_CHAIN = ("oneshot_ll", "oneshot_lamport", "oneshot_flags", "twoshot", "split")
CODECS = reference.QUANT_CODECS
SWEEPS = ("allreduce", "fused", "fused_wide", "quant")
"""In this order: each sweep runs under the knobs of the sweeps before it."""
SMALLEST_ON_TIES = ("oneshot_ll", "oneshot_lamport")
"""Methods whose threshold breaks ties toward the smaller size: LL, in both chains, and
Lamport words. Their thresholds also size every Communicator's workspace (its LL regions take
about 4 * W bytes per byte of LL_MAX_BYTES or FUSED_LL_MAX_BYTES, 2 * W per byte of
LAMPORT_MAX_BYTES), so sizes where they are no better than the next method go to it."""
FUSED_SMALLEST_ON_TIES = FUSED_CHAIN[:-1]
"""In the fused chain every kernel breaks ties toward the smaller size, so split keeps every
size where no fused kernel wins by more than TOLERANCE: each sweep measures one hidden size
for a range of them, and split's cost is the all-reduce's at every hidden size while a fused
kernel's follows the norm's tile for that hidden size (2x H100: the flag kernel
tied split at 4096 x 256 tokens, 14.8 vs 14.7 us, and lost at 5120 x 128, 13.0 vs 12.2)."""


# ---- from timings to knobs (pure functions; timings: {method: {size_bytes: us}})
#
# The plans give each algorithm one range of sizes, in a fixed order (all-reduce: LL up to
# LL_MAX_BYTES, then Lamport words up to LAMPORT_MAX_BYTES, then flags up to
# ONESHOT_MAX_BYTES, then two-shot), so the knobs are the
# crossovers of a chain: nondecreasing thresholds, one per algorithm but the last. Among all
# such thresholds (each 0 = never, or a measured size) we take the one that loses least
# against the per-size best, where a time within TOLERANCE (3%) of the best counts as no
# loss: run-to-run noise is about that large, and it must not move a crossover. A single
# noisy point then cannot split an algorithm's range, unlike "the last size where it wins".
# Among equally good thresholds the largest win: an algorithm keeps every size where it is
# best or within 3% of the best (earlier in the chain is simpler: one-shot over two-shot,
# exact over a codec). LL and Lamport words are the exception (SMALLEST_ON_TIES): the smallest
# of their equally good thresholds wins, since a larger one costs workspace, so they keep only
# the sizes where the next method loses by more than 3%; and so is every fused kernel against
# split (FUSED_SMALLEST_ON_TIES). A method not measured at a size cannot take it.


def chain_thresholds(times: dict[str, dict[int, float]], chain: tuple[str, ...],
                     tolerance: float = TOLERANCE, smallest_on_ties: tuple[str, ...] = SMALLEST_ON_TIES
                     ) -> tuple[int, ...]:
    """The largest size each of chain[:-1] serves (0: none), nondecreasing; chain[-1] takes
    every size above the last threshold. Ties go to the larger threshold, but for the methods
    in smallest_on_ties."""
    sizes = sorted({s for method in chain for s in times.get(method, {})})
    best = {s: min(times[m][s] for m in chain if s in times.get(m, {})) for s in sizes}

    def loss(thresholds):
        total = 0.0
        for s in sizes:
            method = next((m for m, t in zip(chain, thresholds) if s <= t), chain[-1])
            us = times.get(method, {}).get(s)
            if us is None:
                return float("inf")
            slower = us / best[s] - 1
            total += slower if slower > tolerance else 0.0
        return total

    candidates = itertools.combinations_with_replacement([0] + sizes, len(chain) - 1)  # nondecreasing tuples
    best_thresholds = max(candidates, key=lambda ts: (-loss(ts), tuple(
        -t if m in smallest_on_ties else t for m, t in zip(chain, ts))))
    if loss(best_thresholds) == float("inf"):
        raise ValueError(f"no thresholds for {chain} cover every measured size: {times}")
    return best_thresholds


def quant_min_bytes(exact: dict[int, float], codec: dict[int, float], tolerance: float = TOLERANCE) -> int | None:
    """QUANT_MIN_BYTES for a codec: the smallest measured size above the exact path's range
    (None: the exact path keeps every measured size)."""
    (exact_max,) = chain_thresholds({"exact": exact, "codec": codec}, ("exact", "codec"), tolerance)
    return min((s for s in codec if s > exact_max), default=None)


def _swept(times: dict[str, dict[int, float]]) -> list[int]:
    return sorted({s for method in times.values() for s in method})


def _observed(threshold: int, swept: list[int], smallest: int = SIZES[0]) -> bool:
    """Whether a crossover at ``threshold`` was seen inside the sweep: an algorithm that kept
    the largest size swept may keep larger ones, and one that lost the smallest may win
    smaller ones unless the sweep began at ``smallest``, the smallest size it can measure."""
    return threshold < swept[-1] and (threshold > 0 or swept[0] <= smallest)


def derive_knobs(timings: dict[str, dict[str, dict[int, float]]]) -> dict:
    """Table knobs (``tpfuse.comm.tables``) from the timings of the sweeps that ran to the end
    ({sweep: {method: {size_bytes: us}}}, a sweep of SWEEPS). A knob whose crossover
    lies outside the sizes swept is left out (its default stays): a sweep of 8-16 KiB must
    not end one-shot at 16 KiB. The fused chains of a sweep that reached SIZES[-1] are the
    exception at the top: a fused kernel that holds the largest size swept serves up to that
    size, and split (the unfused path, same bits) the unmeasured sizes above. Where two
    algorithms are within TOLERANCE, the earlier in its
    chain keeps the sizes, but for LL: LL_MAX_BYTES is the smallest threshold as good as any,
    because it also sizes every Communicator's workspace (SMALLEST_ON_TIES)."""
    knobs = {}
    if timings.get("allreduce"):
        swept = _swept(timings["allreduce"])
        ll, lamport, oneshot = chain_thresholds(timings["allreduce"], ALLREDUCE_CHAIN)
        derived = (("LL_MAX_BYTES", ll), ("LAMPORT_MAX_BYTES", lamport), ("ONESHOT_MAX_BYTES", oneshot))
        knobs |= {k: t for k, t in derived if _observed(t, swept)}
    for sweep, prefix in FUSED_KNOB_PREFIX.items():
        if not (timings.get(sweep) and _swept(timings[sweep])):
            continue
        swept = _swept(timings[sweep])
        ll, lamport, oneshot, twoshot = chain_thresholds(timings[sweep], FUSED_CHAIN,
                                                         smallest_on_ties=FUSED_SMALLEST_ON_TIES)
        twoshot = twoshot if twoshot > oneshot else 0  # the plan's "never"
        derived = ((f"{prefix}LL_MAX_BYTES", ll), (f"{prefix}LAMPORT_MAX_BYTES", lamport),
                   (f"{prefix}ONESHOT_MAX_BYTES", oneshot), (f"{prefix}TWOSHOT_MAX_BYTES", twoshot))
        row = FUSED_HIDDEN[sweep] * DTYPE.itemsize
        smallest = min((s for s in SIZES if s % row == 0), default=row)  # one row: the smallest call
        holds_top = swept[-1] >= SIZES[-1]
        knobs |= {k: t for k, t in derived if (holds_top and t == swept[-1]) or _observed(t, swept, smallest)}
    if timings.get("quant"):
        q = timings["quant"]
        swept = _swept(q)
        quant = {}
        for c in CODECS:
            if c in q:
                first = quant_min_bytes(q["exact"], q[c])
                # None ("never") only from a sweep that reached SIZES[-1]; a codec that wins at the
                # smallest size swept may win below it.
                if swept[-1] >= SIZES[-1] if first is None else (first > swept[0] or swept[0] <= SIZES[0]):
                    quant[c] = first
        if quant:
            knobs["QUANT_MIN_BYTES"] = quant
    return knobs


# ---- the sweep (every rank)


class _OutOfTime(Exception):
    pass


class _Sweeper:
    """Times methods on every rank alike and collects the records (rank 0 writes them)."""

    def __init__(self, comm, world: int, rank: int, budget_s: float, t0: float):
        self.comm, self.world, self.rank, self.budget_s, self.t0 = comm, world, rank, budget_s, t0
        self.device = comm.device.type
        self.records: list[dict] = []

    def time(self, sweep: str, nbytes: int, method: str, fn, rot: int, check) -> None:
        """Check ``fn(0)``'s output, then record us per call of ``fn(i)``, i < rot: graph replay
        on GPUs, the checked call's wall clock under the interpreter. ``check(out)`` returns
        (correct, rel_err or None); correct is None for a method timed for reference only
        (NCCL), else whether out equals its reference bit for bit (codecs: and is within their
        error budget). Every rank must call it alike."""
        if agreed_max(time.monotonic() - self.t0) > self.budget_s:  # agreed: every rank stops at the same point
            raise _OutOfTime(f"budget of {self.budget_s:g} s reached at {sweep} {fmt_size(nbytes)} {method}")
        start = time.perf_counter()
        out = fn(0)
        elapsed_us = (time.perf_counter() - start) * 1e6
        correct, err = check(out)
        if correct is not None:
            correct = agreed_max(0.0 if correct else 1.0) == 0.0  # wrong on any rank: wrong
        us = agreed_max(elapsed_us) if self.device == "cpu" else collective_graph_us(fn, rot)
        rec = dict(sweep=sweep, size_bytes=nbytes, method=method, us=round(us, 2), correct=correct)
        self.records.append(rec if err is None else rec | {"rel_err": err})

    def allreduce(self, nbytes: int) -> None:
        n = nbytes // DTYPE.itemsize
        xs = random_inputs(n, DTYPE, self.world, self.device, seed=nbytes)
        ref = reference.all_reduce(xs)
        rot = rotation(nbytes)
        pool = [xs[self.rank].clone() for _ in range(rot)]
        layout = self.comm.layout
        # One-shot's protocol is LL_MAX_BYTES's and LAMPORT_MAX_BYTES's choice (within the
        # workspace's LL regions).
        sweep_max = {"oneshot_ll": layout.ll_max_bytes, "oneshot_lamport": layout.lamport_max_bytes,
                     "oneshot_flags": ONESHOT_SWEEP_MAX}  # two-shot: every size
        knobs = {"oneshot_ll": {"LL_MAX_BYTES": layout.ll_max_bytes},
                 "oneshot_lamport": {"LL_MAX_BYTES": 0, "LAMPORT_MAX_BYTES": layout.lamport_max_bytes},
                 "oneshot_flags": {"LL_MAX_BYTES": 0, "LAMPORT_MAX_BYTES": 0}, "twoshot": {}}
        for method in ALLREDUCE_CHAIN:
            algo = method.split("_")[0]
            if nbytes > sweep_max.get(method, nbytes):
                continue
            with self.comm.using_knobs(tables.with_table(self.comm.knobs, knobs[method], "tune")):
                try:
                    AllReducePlan.from_numel(n, DTYPE, layout, self.comm.knobs, algo)
                except ValueError:
                    continue  # the workspace cannot serve it: not measured, never chosen
                self.time("allreduce", nbytes, method, (lambda a: lambda i: self.comm.all_reduce(pool[i], algo=a))(
                    algo), rot, lambda out: (same_bits(out, ref), None))
        peer = [p.clone() for p in pool]
        self.time("allreduce", nbytes, "nccl", lambda i: dist.all_reduce(peer[i]), rot, lambda out: (None, None))

    def fused(self, nbytes: int, sweep: str) -> None:
        hidden, prefix = FUSED_HIDDEN[sweep], FUSED_KNOB_PREFIX[sweep]
        tokens = nbytes // (hidden * DTYPE.itemsize)
        if tokens == 0 or tokens * hidden * DTYPE.itemsize != nbytes:
            return
        xs, residual, weight = layer_inputs(tokens, hidden, self.world, self.device, seed=tokens)
        expected = tpfuse.add_rms_norm(reference.all_reduce(xs), residual, weight, EPS)  # the contract's bits
        rot = rotation(2 * nbytes)
        pool = [(xs[self.rank].clone(), residual.clone()) for _ in range(rot)]
        # One-shot's protocol is the sweep's FUSED_*LL_MAX_BYTES's and FUSED_*LAMPORT_MAX_BYTES's
        # choice (within the workspace's LL regions), never row-wise, which the chain has no
        # place for (Knobs.fused_rows_max_bytes: measured by scripts/fused_ab.py).
        ll, lamport = f"{prefix}LL_MAX_BYTES", f"{prefix}LAMPORT_MAX_BYTES"
        knobs = {"oneshot_ll": {ll: nbytes}, "oneshot_lamport": {ll: 0, lamport: nbytes},
                 "oneshot_flags": {ll: 0, lamport: 0}}
        for method in FUSED_CHAIN:
            algo = method.split("_")[0]
            no_rows = {**knobs.get(method, {}), "FUSED_ROWS_MAX_BYTES": 0}
            with self.comm.using_knobs(tables.with_table(self.comm.knobs, no_rows, "tune")):
                try:
                    plan = FusedPlan.from_shape(tokens, hidden, DTYPE, self.comm.layout, self.comm.knobs, algo)
                except ValueError:
                    continue
                if method.startswith("oneshot") and plan.protocol != method.removeprefix("oneshot_"):
                    continue  # above the protocol's range (the workspace's): not measured, never chosen
                fn = (lambda a: lambda i: self.comm.all_reduce_add_rms_norm(*pool[i], weight, EPS, algo=a))(algo)
                self.time(sweep, nbytes, method, fn, rot,
                          lambda out: (all(same_bits(a, b) for a, b in zip(out, expected)), None))

    def quant(self, nbytes: int) -> None:
        n = nbytes // DTYPE.itemsize
        xs = random_inputs(n, DTYPE, self.world, self.device, seed=nbytes)
        exact64 = sum(x.double() for x in xs)
        rot = rotation(nbytes)
        pool = [xs[self.rank].clone() for _ in range(rot)]
        ref = reference.all_reduce(xs)
        self.time("quant", nbytes, "exact", lambda i: self.comm.all_reduce(pool[i]), rot,
                  lambda out: (same_bits(out, ref), None))
        for codec in CODECS:
            qref = reference.quantized_all_reduce(xs, codec)

            def check(out, codec=codec, qref=qref):
                err = reference.rel_err(out, exact64)
                return same_bits(out, qref) and err <= reference.QUANT_ERROR_BUDGET[codec], err

            fn = (lambda c: lambda i: self.comm.all_reduce(pool[i], quant=c, quant_min_bytes=0))(codec)
            self.time("quant", nbytes, codec, fn, rot, check)

    def run(self, sweep: str, nbytes: int) -> None:
        """Measure one size of one sweep (of SWEEPS)."""
        if sweep in FUSED_HIDDEN:
            self.fused(nbytes, sweep)
        else:
            getattr(self, sweep)(nbytes)

    def timings(self, sweep: str) -> dict[str, dict[int, float]]:
        """{method: {size: us}} of one sweep, correct results only."""
        out: dict[str, dict[int, float]] = {}
        for r in self.records:
            if r["sweep"] == sweep and r["correct"]:
                out.setdefault(r["method"], {})[r["size_bytes"]] = r["us"]
        return out


def _workspace_bytes(sizes: list[int], world: int) -> tuple[int, dict]:
    """(max_bytes, knobs sizing the LL regions) of a workspace that serves every swept size:
    two-shot to the largest (the fused two-shot: at least a row of the widest sweep per rank),
    one-shot to ONESHOT_SWEEP_MAX (its slots hold 2 * max_bytes / W), LL words to
    LL_SWEEP_MAX, Lamport words to ONESHOT_SWEEP_MAX."""
    top = max(sizes)
    widest_row = max(FUSED_HIDDEN.values()) * DTYPE.itemsize
    return max(top, min(top, ONESHOT_SWEEP_MAX) * world // 2, widest_row * world), {
        "LL_MAX_BYTES": min(top, LL_SWEEP_MAX), "LAMPORT_MAX_BYTES": min(top, ONESHOT_SWEEP_MAX)}


def _worker(rank: int, world: int, port: int | None, opts: dict) -> None:
    from tpfuse._runtime import INTERPRETER
    from tpfuse.comm import Communicator

    init_rank(rank, world, port, "gloo" if INTERPRETER else "nccl")
    sizes = opts["sizes"] or (CPU_SIZES if INTERPRETER else SIZES)
    max_bytes, region_knobs = _workspace_bytes(sizes, world)
    try:
        knobs = tables.knobs_for(world, None if INTERPRETER else torch.cuda.get_device_name())
        comm = Communicator(max_bytes=max_bytes, timeout_s=60 if INTERPRETER else 30,
                            knobs=tables.with_table(knobs, region_knobs, "tune"))  # sizes the LL regions
        if comm.layout is None:
            raise RuntimeError(f"no peer workspace, so nothing to tune: {comm.fallback_reason}")
        timings, stopped = {}, None
        with comm:
            sweeper = _Sweeper(comm, world, rank, opts["budget_s"], opts["t0"])
            try:
                for sweep in SWEEPS:
                    with comm.using_knobs(tables.with_table(knobs, derive_knobs(timings), "tune")):  # as "auto" will
                        for nbytes in sizes:
                            sweeper.run(sweep, nbytes)
                            if rank == 0:
                                print(f"[{time.monotonic() - sweeper.t0:5.0f}s] {sweep} {fmt_size(nbytes):>7}: "
                                      + "  ".join(f"{r['method']} {r['us']:.1f}us" for r in sweeper.records
                                                  if (r["sweep"], r["size_bytes"]) == (sweep, nbytes)), flush=True)
                    timings[sweep] = sweeper.timings(sweep)
                    if rank == 0 and sweep != SWEEPS[-1]:  # a kill (a step's timeout) then leaves these
                        wrong = _wrong(sweeper.records)
                        _write(opts, world, sweeper.records, {} if wrong else derive_knobs(timings),
                               f"written after the {sweep} sweep: the run was killed (or is still running) "
                               "before the next sweep ended", wrong, max_bytes, INTERPRETER)
            except _OutOfTime as e:
                stopped = str(e)
        wrong = _wrong(sweeper.records)
        if rank == 0:
            _report(opts, world, sweeper.records, {} if wrong else derive_knobs(timings), stopped, wrong,
                    max_bytes, INTERPRETER)
        if wrong:
            raise RuntimeError(f"rank {rank}: results not equal to their reference, so no table: {wrong}")
    finally:
        dist.destroy_process_group()


def _wrong(records: list[dict]) -> list[str]:
    """The records whose results were not equal to their reference."""
    return [f"{r['sweep']} {fmt_size(r['size_bytes'])} {r['method']}" for r in records if r["correct"] is False]


def _write(opts, world, records, knobs, stopped, wrong, max_bytes, interpreter) -> tuple[dict, str, tuple[str, str]]:
    """Write tune_w{W}_bf16.json / .md under --out; returns (header, markdown, paths)."""
    header = run_header() | {"world_size": world, "dtype": "bf16", "hidden": FUSED_HIDDEN, "tolerance": TOLERANCE,
                             "tpfuse_max_bytes": max_bytes, "budget_s": opts["budget_s"], "stopped": stopped,
                             "device": "cpu (Triton interpreter)" if interpreter else "cuda", "derived_knobs": knobs}
    name = f"tune_w{world}_bf16"
    md = header_markdown(f"tpfuse tune, {world} ranks, bf16", header)
    md += ("us per call (CUDA-graph replay; under the interpreter, one call's wall clock). `x`: not equal to its "
           "reference (codecs: or over their error budget). Sizes are message bytes ("
           + "; ".join(f"{s}: tokens x {h}" for s, h in FUSED_HIDDEN.items()) + ").\n")
    for sweep in SWEEPS:
        methods = list(dict.fromkeys(r["method"] for r in records if r["sweep"] == sweep))
        by = {(r["size_bytes"], r["method"]): r for r in records if r["sweep"] == sweep}
        md += f"\n## {sweep}\n\n| size | " + " | ".join(methods) + " |\n" + "|---" * (len(methods) + 1) + "|\n"
        for s in sorted({s for s, _ in by}):
            cells = ["-" if (s, m) not in by else f"{by[(s, m)]['us']:.1f}" + (" x" if by[(s, m)]["correct"] is False
                                                                               else "") for m in methods]
            md += f"| {fmt_size(s)} | " + " | ".join(cells) + " |\n"
    md += f"\nDerived knobs (W={world}): {json.dumps(knobs)}\n"
    md += f"\nSTOPPED EARLY: {stopped} (that sweep and later ones give no knobs)\n" if stopped else ""
    md += f"\nNOT EQUAL TO THE REFERENCE: {'; '.join(wrong)}\n" if wrong else ""
    return header, md, write_results(opts["out"], name, header, records, md)


def _report(opts, world, records, knobs, stopped, wrong, max_bytes, interpreter) -> None:
    """The run's end: its results written and printed, and with --write-table the table."""
    header, md, paths = _write(opts, world, records, knobs, stopped, wrong, max_bytes, interpreter)
    print(md, flush=True)
    print("wrote " + ", ".join(paths))
    if opts["write_table"] and not knobs:
        print("no table written: no knobs derived (no sweep ran to the end with every result correct, or no "
              "crossover lay inside the sizes swept)")
    elif opts["write_table"]:
        provenance = {k: header[k] for k in ("gpu", "topology", "date", "commit", "torch", "triton", "cuda", "device")
                      if header.get(k) is not None}
        table = {"world_size": world, "knobs": knobs,
                 "provenance": provenance | {"sweep": os.path.basename(paths[0]), "tolerance": TOLERANCE}}
        os.makedirs(opts["table_dir"], exist_ok=True)
        model = tables.gpu_model(header["gpu"]) if header.get("gpu") else None
        path = tables.table_path(opts["table_dir"], world, model)
        tables.write_table(path, table)
        print(f"wrote {path}")


def _size(text: str) -> int:
    """Bytes from "8K", "4M" or "65536"."""
    scale = {"K": KiB, "M": MiB}.get(text[-1:].upper(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or a number with K or M)") from None
    if value <= 0 or value % KiB:
        raise argparse.ArgumentTypeError(f"sizes must be positive multiples of 1 KiB, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    # The budget's start, passed to the ranks: time.monotonic is the machine's CLOCK_MONOTONIC,
    # one clock for every process (torchrun's ranks each start their own, at about this time).
    t0 = time.monotonic()
    p = argparse.ArgumentParser(prog="tpfuse tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="tune_out", help="directory for tune_w{W}_bf16.json / .md")
    p.add_argument("--write-table", action="store_true", help="also write the plan table w{W}-{gpu model}.json")
    p.add_argument("--table-dir", default=tables.PACKAGE_DIR,
                   help="where --write-table writes (default: tpfuse/comm/tables, which the plans read)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop the sweep this many seconds after the command started")
    p.add_argument("--sizes", type=_size, nargs="+", default=None,
                   help=f"message sizes, e.g. 8K 1M (default {fmt_size(SIZES[0])} .. {fmt_size(SIZES[-1])}; "
                        f"without GPUs {', '.join(map(fmt_size, CPU_SIZES))})")
    opts = vars(p.parse_args(argv)) | {"t0": t0}
    opts["sizes"] = sorted(set(opts["sizes"])) if opts["sizes"] else None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):  # run_workers' test for torchrun
        print("No multi-GPU machine: the sweep runs on 2 emulated CPU ranks under Triton's interpreter, a check "
              "of bits and plumbing. Its timings are the interpreter's, not a measurement of any GPU: they are "
              "written as a table only with --write-table --table-dir DIR outside the package.", flush=True)
        if opts["write_table"] and os.path.realpath(opts["table_dir"]) == os.path.realpath(tables.PACKAGE_DIR):
            print("tpfuse tune: refusing to write CPU timings into tpfuse/comm/tables (the plans would read them); "
                  "pass --table-dir DIR", file=sys.stderr)
            return 2
    return run_workers(_worker, _worker, opts)


if __name__ == "__main__":
    sys.exit(main())
