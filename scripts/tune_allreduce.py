"""Sweep the all-reduce's launch knobs (``tpfuse.comm.knobs``: each launch kind's CTAs, tile and
warps, gather, protocol) on one GPU node, to choose their values. Not part of the library: each
configuration's knobs are set for its calls with ``Communicator.using_knobs``.

The size thresholds that "auto" uses (ONESHOT_MAX_BYTES, LL_MAX_BYTES, the fused and
quantized crossovers) come from `tpfuse tune` instead, which measures them at the machine's
world size and writes the table the plans read (tpfuse/comm/tables/w{W}.json); this script
writes nothing the plans read.

    python3 scripts/tune_allreduce.py --out $OUT            # one process per visible GPU

Knobs (every combination, per algorithm; a combination whose plan at a size equals one
already timed there is not timed again):
  ctas   Launch.max_ctas: CTAs per call (the grid is min(tiles, ctas)); <= 128 = MAX_BLOCKS,
         below the H200's 132 SMs, because every CTA of a grid must be resident at once
         (block b waits for block b of every peer).
  tile   Launch.tile_bytes: bytes of a tile (8 KiB = 512 16-byte vectors: one per thread at
         16 warps, two at 8).
  warps  Launch.num_warps (Lamport words: at most, with a warp per 512 bytes of tile).
  gather Knobs.gather (two-shot only): "push" (store the reduced chunk into every peer's gather
         slot, peers copy it out) or "pull" (peers load it from the owner's gather slot
         straight into their output).
  protocol  one-shot only: "flags" (separate flags), "ll" (LL words) or "lamport" (Lamport
         words) at every one-shot size swept (tpfuse.kernels.ll; ll_max_bytes and
         lamport_max_bytes set accordingly), each with its own launch shape (the knobs'
         "oneshot", "oneshot_ll" and "oneshot_lamport").
--knobs '{"oneshot": {"warps": [16]}}' replaces knob lists, --algos and --sizes-kib narrow
the sweep.

Timing is tpfuse.bench.allreduce's: CUDA-graph replay of 20 calls, inputs rotated so small
messages are not served from L2, every rank replays alike, slowest rank's median; fewer and
shorter samples than the bench (REPEATS, MIN_SAMPLE_MS below) to fit about 4 minutes with
the Triton compilations (about 27 kernels). Every configuration's result is also checked
bitwise against tpfuse.reference.all_reduce. NCCL is timed at every size for reference.

Output: a table per size (NCCL, the current default of each algorithm, the best
configurations), the configuration per algorithm with the lowest geometric-mean time ratio
to the per-size best, and tune_allreduce.json under --out (written after every size, so a
run cut short still leaves its results). --budget-s stops the sweep (all ranks together)
before the device call's limit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tpfuse.comm  # noqa: E402,F401  (sets the no-multicast environment before ranks are spawned)
from tpfuse import reference  # noqa: E402
from tpfuse.comm import Launch  # noqa: E402
from tpfuse.bench import common as C  # noqa: E402
from tpfuse.bench.common import (fmt_size, header_markdown, init_rank, random_inputs, rotation,  # noqa: E402
                                 run_header, same_bits, spawn_ranks)

KiB, MiB = 1024, 1024 * 1024
# Most telling first, so a run stopped by --budget-s still covers the targets.
SIZES = [8 * KiB, 32 * MiB, 256 * KiB, 2 * MiB, 128 * MiB, 32 * KiB, 1 * MiB, 8 * MiB, 4 * MiB, 512 * KiB]
ONESHOT_SIZES = [s for s in SIZES if s <= 8 * MiB]
KNOBS = {
    "oneshot": dict(ctas=[16, 32, 64, 128], tile=[8 * KiB, 16 * KiB, 32 * KiB], warps=[4, 8, 16], gather=["-"],
                    protocol=["flags", "ll", "lamport"]),
    "twoshot": dict(ctas=[32, 64, 96, 128], tile=[8 * KiB, 16 * KiB, 32 * KiB], warps=[4, 8, 16],
                    gather=["push", "pull"], protocol=["-"]),
}
C.REPEATS, C.MIN_SAMPLE_MS = 3, 5.0  # the bench's 5 x 20 ms per point would not fit
ALL = 1 << 40
"""A size threshold above every message."""


def _configs(algo):
    k = KNOBS[algo]
    return [dict(ctas=c, tile=t, warps=w, gather=g, protocol=pr)
            for c, t, w, g, pr in itertools.product(k["ctas"], k["tile"], k["warps"], k["gather"], k["protocol"])]


def _knob(algo, cfg) -> str:
    """plan's key of the launch knobs of this configuration."""
    return f"oneshot_{cfg['protocol']}" if cfg["protocol"] in ("ll", "lamport") else algo


def _fmt_cfg(cfg) -> str:
    g = "" if cfg.get("gather") in (None, "-") else f" {cfg['gather']}"
    pr = "" if cfg.get("protocol") in (None, "-", "flags") else f" {cfg['protocol']}"
    return f"c{cfg['ctas']} t{cfg['tile'] // KiB}K w{cfg['warps']}{g}{pr}"


def _config_knobs(knobs, algo, cfg):
    """``knobs`` with this configuration's launch shape for ``algo`` (and its protocol at every
    size, within the workspace's regions)."""
    kind = _knob(algo, cfg)
    tile = dict(tile_bytes=cfg["tile"], max_tile_bytes=cfg["tile"] if kind == "oneshot_lamport" else 0)
    changes = {kind: Launch(num_warps=cfg["warps"], max_ctas=cfg["ctas"], **tile)}
    if cfg["gather"] != "-":
        changes["gather"] = cfg["gather"]
    if cfg["protocol"] != "-":
        changes |= {"ll_max_bytes": ALL if cfg["protocol"] == "ll" else 0,
                    "lamport_max_bytes": ALL if cfg["protocol"] == "lamport" else 0}
    return knobs.replace(**changes)


def _summary(records, world, header) -> str:
    by_size = {}
    for r in records:
        by_size.setdefault(r["size_bytes"], []).append(r)
    lines = header_markdown(f"tune_allreduce, {world} ranks, bf16, us per call (CUDA-graph replay; bus GB/s)",
                            header).split("\n")[:-1]
    lines.append("| size | nccl | oneshot default | oneshot best (cfg) | twoshot default | twoshot best (cfg) | "
                 "best / nccl |")
    lines.append("|---|---|---|---|---|---|---|")
    for s in sorted(by_size):
        rs = by_size[s]
        nccl = next((r for r in rs if r["algo"] == "nccl"), None)
        cells, bests = [], []
        for algo in ("oneshot", "twoshot"):
            mine = [r for r in rs if r["algo"] == algo and r["bitwise"]]
            default = next((r for r in mine if r["default"]), None)
            best = min(mine, key=lambda r: r["us"], default=None)
            cells.append("-" if default is None else f"{default['us']:.1f} ({default['busbw_gbps']:.0f})")
            cells.append("-" if best is None
                         else f"{best['us']:.1f} ({best['busbw_gbps']:.0f}) {_fmt_cfg(best['cfg'])}")
            if best:
                bests.append(best["us"])
        ratio = f"{min(bests) / nccl['us']:.2f}" if bests and nccl else "-"
        ncell = "-" if nccl is None else f"{nccl['us']:.1f} ({nccl['busbw_gbps']:.0f})"
        lines.append(f"| {fmt_size(s)} | {ncell} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
    # One setting per algorithm (the knobs do not depend on the size): the configuration whose
    # time, over the sizes the algorithm serves, is closest to the per-size best (geomean).
    for algo, sizes in (("oneshot ll", [s for s in ONESHOT_SIZES if s <= 256 * KiB]),
                        ("oneshot lamport", [s for s in ONESHOT_SIZES if s >= 256 * KiB]),
                        ("oneshot flags", [s for s in ONESHOT_SIZES if s >= 256 * KiB]),
                        ("twoshot", [s for s in SIZES if s >= 256 * KiB]),
                        ("twoshot (>= 8 MiB)", [s for s in SIZES if s >= 8 * MiB])):
        name, _, protocol = algo.partition(" ")
        protocol = protocol if name == "oneshot" else "-"
        configs = [c for c in _configs(name) if c["protocol"] == protocol]
        best = {s: min((r["us"] for r in by_size.get(s, []) if r["algo"] == name and r["bitwise"]
                        and r["cfg"] in configs), default=None) for s in sizes}
        scores = []
        for cfg in configs:
            ratios = []
            for s in sizes:
                r = next((r for r in by_size.get(s, [])
                          if r["algo"] == name and r["cfg"] == cfg and r["bitwise"]), None)
                if r is None or best[s] is None:
                    break
                ratios.append(r["us"] / best[s])
            else:
                if ratios:
                    scores.append((math.exp(sum(map(math.log, ratios)) / len(ratios)), cfg, ratios))
        scores.sort(key=lambda t: t[0])
        lines.append(f"{algo} over {', '.join(fmt_size(s) for s in sizes)}: closest to per-size best (geomean "
                     "ratio; per-size ratios):")
        for score, cfg, ratios in scores[:5]:
            lines.append(f"  {_fmt_cfg(cfg):<22} {score:.3f}  " + " ".join(f"{x:.2f}" for x in ratios))
    wrong = sorted({f"{fmt_size(r['size_bytes'])} {r['algo']} {_fmt_cfg(r['cfg'])}" for r in records
                    if r["algo"] != "nccl" and not r["bitwise"]})
    lines.append("")
    lines.append("NOT BITWISE: " + "; ".join(wrong) if wrong else "every tpfuse result bitwise equal to the reference")
    return "\n".join(lines) + "\n"


def _worker(rank: int, world: int, port: int, opts: dict) -> None:
    from tpfuse.comm import Communicator, knobs_for
    from tpfuse.comm.plan import AllReducePlan

    global SIZES, ONESHOT_SIZES, KNOBS  # spawned ranks import this module afresh: take main's
    SIZES, ONESHOT_SIZES, KNOBS = opts["sizes"], opts["oneshot_sizes"], opts["knobs"]
    smoke = opts["cpu_smoke"]
    init_rank(rank, world, port, "gloo" if smoke else "nccl")  # joins spawn_ranks' store
    if smoke:  # the sweep's logic on CPU ranks under Triton's interpreter; times are meaningless
        C.collective_graph_us = _wall_us
    t0 = time.monotonic()
    dtype = torch.bfloat16
    sizes = [s for s in SIZES if s <= opts["max_size"]]
    knobs = knobs_for(world, None if smoke else torch.cuda.get_device_name())
    defaults = {k: dict(ctas=knobs.launch(k).max_ctas, tile=knobs.launch(k).tile_bytes,
                        warps=knobs.launch(k).num_warps, gather=knobs.gather if k == "twoshot" else "-", protocol=pr)
                for k, pr in (("oneshot", "flags"), ("oneshot_ll", "ll"), ("oneshot_lamport", "lamport"),
                              ("twoshot", "-"))}
    header = run_header() | {"world_size": world, "dtype": "bf16", "knobs": KNOBS, "defaults": defaults,
                             "repeats": C.REPEATS, "min_sample_ms": C.MIN_SAMPLE_MS}
    records, stopped = [], None
    try:
        top = max(ONESHOT_SIZES, default=0)  # LL and Lamport regions for every one-shot size
        with Communicator(max_bytes=max(max(sizes), top * world // 2),
                          knobs=knobs.replace(ll_max_bytes=top, lamport_max_bytes=top)) as comm:
            for nbytes in sizes:
                n = nbytes // dtype.itemsize
                xs = random_inputs(n, dtype, world, "cpu" if smoke else "cuda", seed=nbytes)
                ref = reference.all_reduce(xs)
                pool = [xs[rank].clone() for _ in range(rotation(nbytes))]

                def put(algo, cfg, us, bitwise, extra=None):
                    rec = dict(size_bytes=nbytes, algo=algo, cfg=cfg, us=round(us, 2), bitwise=bool(bitwise),
                               busbw_gbps=round(2 * (world - 1) / world * nbytes / (us * 1e-6) / 1e9, 1),
                               default=cfg is not None and cfg == defaults[_knob(algo, cfg)])
                    records.append(rec | (extra or {}))

                nccl_pool = [p.clone() for p in pool]
                put("nccl", None, C.collective_graph_us(lambda i: dist.all_reduce(nccl_pool[i]), len(nccl_pool)), False)
                for algo in opts["algos"]:
                    if algo == "oneshot" and nbytes not in ONESHOT_SIZES:
                        continue
                    seen = {}
                    for cfg in _configs(algo):
                        # Agreed across ranks, so every rank stops at the same configuration.
                        if C.agreed_max(time.monotonic() - t0) > opts["budget_s"]:
                            stopped = f"budget of {opts['budget_s']} s reached at {fmt_size(nbytes)} {algo}"
                            raise TimeoutError(stopped)
                        with comm.using_knobs(_config_knobs(knobs, algo, cfg)):
                            plan = AllReducePlan.from_numel(n, dtype, comm.layout, comm.knobs, algo)
                            key = (plan.block, plan.grid, plan.num_warps, plan.gather, plan.protocol)
                            if key in seen:
                                r = seen[key]
                                put(algo, cfg, r["us"], r["bitwise"], dict(grid=plan.grid, same_as=r["cfg"]))
                                continue
                            out = comm.all_reduce(pool[0], algo=algo)
                            bitwise = same_bits(out, ref)
                            us = C.collective_graph_us(lambda i: comm.all_reduce(pool[i], algo=algo), len(pool))  # noqa: B023
                        put(algo, cfg, us, bitwise, dict(grid=plan.grid))
                        seen[key] = records[-1]
                if rank == 0:
                    done = [r for r in records if r["size_bytes"] == nbytes]
                    best = {a: min((r for r in done if r["algo"] == a), key=lambda r: r["us"], default=None)
                            for a in ("nccl", "oneshot", "twoshot")}
                    print(f"[{time.monotonic() - t0:5.0f}s] {fmt_size(nbytes):>8}: " + "  ".join(
                        f"{a} {r['us']:.1f}us" + (f" ({_fmt_cfg(r['cfg'])})" if r["cfg"] else "")
                        for a, r in best.items() if r), flush=True)
                    _write(opts["out"], header, records, None)
                del xs, ref, pool, nccl_pool
                if not smoke:
                    torch.cuda.empty_cache()
    except TimeoutError:
        pass
    finally:
        if rank == 0:
            header["elapsed_s"] = round(time.monotonic() - t0, 1)
            md = _summary(records, world, header) + (f"\nSTOPPED EARLY: {stopped}\n" if stopped else "")
            print(md, flush=True)
            _write(opts["out"], header, records, md)
        dist.destroy_process_group()


def _wall_us(fn, rot: int) -> float:
    """--cpu-smoke's stand-in for the graph timing: two eager calls, wall clock."""
    start = time.perf_counter()
    for i in range(2):
        fn(i % rot)
    return C.agreed_max((time.perf_counter() - start) / 2 * 1e6)


def _write(out_dir, header, records, md):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tune_allreduce.json"), "w") as f:
        json.dump({"header": header, "records": records}, f, indent=1)
    if md is not None:
        with open(os.path.join(out_dir, "tune_allreduce.md"), "w") as f:
            f.write(md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="tune_out")
    p.add_argument("--budget-s", type=float, default=210.0, help="stop the sweep after this many seconds")
    p.add_argument("--max-size", type=int, default=max(SIZES), help="largest message to sweep (bytes)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the sweep's logic on 2 CPU ranks (Triton's interpreter, tiny sizes, few knobs)")
    p.add_argument("--algos", default="oneshot,twoshot", help="algorithms to sweep (comma-separated)")
    p.add_argument("--sizes-kib", default=None, help="message sizes to sweep, KiB (comma-separated)")
    p.add_argument("--knobs", default="{}", help='JSON replacing knob lists, e.g. {"oneshot": {"warps": [16]}}')
    opts = vars(p.parse_args(argv))
    opts["algos"] = opts["algos"].split(",")
    sizes = SIZES if opts["sizes_kib"] is None else [int(v) * KiB for v in opts["sizes_kib"].split(",")]
    knobs = {a: k | json.loads(opts["knobs"]).get(a, {}) for a, k in KNOBS.items()}
    opts.update(sizes=sizes, oneshot_sizes=[s for s in sizes if s <= 8 * MiB], knobs=knobs)
    if opts["cpu_smoke"]:
        os.environ["TRITON_INTERPRET"] = "1"  # the spawned ranks run the kernels on CPU
        knobs = {a: k | dict(ctas=[1, 4], tile=[8 * KiB, 64 * KiB], warps=[4]) for a, k in knobs.items()}
        opts.update(sizes=[8 * KiB, 64 * KiB], oneshot_sizes=[8 * KiB, 64 * KiB], knobs=knobs, max_size=64 * KiB)
        return spawn_ranks(_worker, 2, opts)
    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world < 2:
        print(f"{world} CUDA GPU(s): this sweep needs 2 or more")
        return 1
    return spawn_ranks(_worker, world, opts)


if __name__ == "__main__":
    sys.exit(main())
