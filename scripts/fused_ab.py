"""The fused one-shot (explicit algo="oneshot": row-wise, over LL or Lamport words or flags, as
the plan picks for the shape) with one of its parts left out or changed, timed as `tpfuse bench
fused` times (graph replay), with split (all_reduce, then add_rms_norm) as the control that no
variant touches. Every variant but the rows ones runs with row-wise calls off: they change the
LL / Lamport / flag kernels, which row-wise calls bypass (at W=2 hidden 4096 to 16 tokens).

    torchrun --nproc-per-node W scripts/fused_ab.py --variant base --tag _r1 --out DIR

One variant per process: Triton refuses a kernel whose globals changed after it compiled.
Variants (checked against split's bits every run):
  base           the kernels as they are (row-wise off, as above: the same as no_rows);
  no_prefetch    the residual and weight are not prefetched into L2 before the wait
                 (``tpfuse.kernels.fused._prefetch_norm_operands`` a no-op; since d626dcc only
                 the flag one-shot prefetches, so only its shapes change; at 24bfc2f the LL /
                 Lamport kernel did too);
  relaxed_count  the handoff count of the pieces of a tile is a relaxed atomic, not acq_rel
                 (``_count_piece``): measurement only, the last CTA may read a piece before it
                 is visible;
  double_pieces  LL / Lamport pieces of twice the words (half the CTAs; whole tiles as they
                 are); the plan's Lamport tiling rule sees the doubled pieces too;
  early_release, release_before_wait
                 an extra acq_rel atomic that changes nothing (adds 0 to the block count) at
                 the start of every fused kernel, or in the LL / Lamport kernel after the
                 stores to the peers and before each piece's poll: whether the handoff count's 0.3 us
                 (relaxed_count) is the release itself or its wait for this CTA's NVLink stores.
                 (results/2xH200/fused_ab.md: each costs 0.25-0.6 us at 1-16 tokens, so it is the
                 release itself.)
  rows, rows_64, rows_128, no_rows
                 the fused one-shot row-wise up to 16, 64 or 128 KiB, or never
                 (FUSED_ROWS_MAX_BYTES at this world size; no_rows is base by another name,
                 kept for the results that name it);
  rows_4k_pieces row-wise up to 16 KiB in pieces of 4 KiB (FUSED_ROWS_PIECE_BYTES; 1 KiB as
                 shipped): fewer CTAs, so fewer writers for each tile's poll to wait out,
                 each storing more (a W=4 question: row-wise measured slower there);
  lamport_4m     W=2's defaults (row-wise to 128 KiB until db6fbb8, 64 KiB since), with the
                 fused one-shot over Lamport words up to 4 MiB on every tile
                 (FUSED_LAMPORT_MAX_BYTES and its wide twin; the table's 1 MiB and 512 KiB
                 were tuned before the own slot went): whether it now beats the flag
                 one-shot at 2 MiB;
  (rows_1m, at 864f179 only: row-wise to 1 MiB, the pieces of calls past FUSED_MAX_CTAS 1 KiB
                 pieces growing up to whole rows; slower at 128 tokens, results/2xH200/rows_1m_ab.)
  (redundant_norm, at acd19a5 only: every CTA of a one-row LL tile normalising the whole row,
                 the measurement that led to the row-wise kernel; removed once that kernel came.)
Every variant also times the change of batch size in a decode step after a prefill: a graph of
pairs (TRANSITION: a 128-token call, then a 1-token call, hidden 4096), reported as method
"pair" at tokens 1 (us per pair; the separate calls' times are in the same run), since a
row-wise call zeroes the last row-wise call's words first, however large.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tpfuse
import tpfuse.comm.plan as plan
import tpfuse.kernels.fused as fused
from tpfuse.bench.common import collective_graph_us, layer_inputs, rotation, run_header, same_bits

SHAPES = [(1, 4096), (2, 4096), (4, 4096), (8, 4096), (16, 4096), (64, 4096), (128, 4096), (256, 4096),
          (1, 2880), (16, 2880), (1, 5120), (1, 8192), (16, 8192), (64, 8192)]
EPS = 1e-6


@triton.jit
def _no_prefetch(RES, W, first, n_elems, N, ELEMS, HAS_WEIGHT):
    pass


@triton.jit
def _relaxed_count(counter):
    return tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")


@triton.jit
def _early_release(local, status_addr, data_offset, data_bytes, n, BLOCK: tl.constexpr):
    pid, grid, ctrl, status, epoch, data, n_tiles = _begin(local, status_addr, data_offset, data_bytes, n, BLOCK)
    tl.atomic_add(ctrl + 1, 0, sem="acq_rel", scope="gpu")  # adds 0 to the block count: a release, nothing else
    return pid, grid, ctrl, status, epoch, data, n_tiles


@triton.jit
def _release_before_wait(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns,
                         OP: tl.constexpr, W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False,
                         own=None):
    tl.atomic_add(ctrl + 1, 0, sem="acq_rel", scope="gpu")  # as _early_release, after this CTA's stores
    return _ll_reduce(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP, W, ELEM,
                      LAMPORT, own)


_begin, _ll_reduce, _ll_pieces = fused.begin_collective, fused.ll_reduce, fused.ll_pieces


def _double_pieces(n, dtype, protocol="ll", whole_tiles=False):
    piece_words, pieces = _ll_pieces(n, dtype, protocol, whole_tiles)
    return (piece_words, pieces) if pieces == 1 else (2 * piece_words, triton.cdiv(pieces, 2))


VARIANTS = {"base": None, "no_prefetch": ("_prefetch_norm_operands", _no_prefetch),
            "relaxed_count": ("_count_piece", _relaxed_count), "double_pieces": ("ll_pieces", _double_pieces),
            "early_release": ("begin_collective", _early_release), "release_before_wait": ("ll_reduce", _release_before_wait),
            "rows": None, "rows_64": None, "rows_128": None, "no_rows": None, "rows_4k_pieces": None,
            "lamport_4m": None}
ROWS_MAX_BYTES = {"rows": 16 << 10, "rows_64": 64 << 10, "rows_128": 128 << 10, "no_rows": 0,
                  "rows_4k_pieces": 16 << 10, "lamport_4m": 128 << 10}
TRANSITION = (128, 1, 4096)  # (tokens before, tokens after, hidden)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--tag", default="", help="appended to the result file's name (repeated runs)")
    p.add_argument("--out", default=".")
    opts = p.parse_args()
    if VARIANTS[opts.variant] is not None:
        name, fn = VARIANTS[opts.variant]
        setattr(fused, name, fn)
        if name == "ll_pieces":  # the plan sizes the grid and the launch's pieces by it
            setattr(plan, name, fn)
    from tpfuse.comm import Communicator, knobs_for

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    changes = {"fused_rows_max_bytes": ROWS_MAX_BYTES.get(opts.variant, 0)}  # it sizes the workspace too
    if opts.variant == "rows_4k_pieces":
        changes["fused_rows_piece_bytes"] = 4 << 10
    if opts.variant == "lamport_4m":
        changes["fused_lamport_max_bytes"] = changes["fused_wide_lamport_max_bytes"] = 4 << 20
    knobs = knobs_for(world, torch.cuda.get_device_name()).replace(**changes)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    rows = []
    with Communicator(knobs=knobs) as comm:
        for tokens, hidden in SHAPES:
            xs, residual, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 100_003 + hidden + 11)
            x = xs[rank]
            rot = rotation(2 * x.numel() * x.element_size())
            pool = [(x.clone(), residual.clone()) for _ in range(rot)]
            methods = {
                "split": lambda i: tpfuse.add_rms_norm(comm.all_reduce(pool[i][0]), pool[i][1], weight, EPS),
                "oneshot": lambda i: comm.all_reduce_add_rms_norm(pool[i][0], pool[i][1], weight, EPS,
                                                                  algo="oneshot"),
            }
            want = methods["split"](0)
            fplan = plan.FusedPlan.from_shape(tokens, hidden, x.dtype, comm.layout, comm.knobs, "oneshot")
            for method, fn in methods.items():
                exact = all(same_bits(a, b) for a, b in zip(fn(0), want))
                us = collective_graph_us(fn, rot)
                rows.append(dict(variant=opts.variant, tag=opts.tag, world=world, method=method, tokens=tokens,
                                 hidden=hidden, us=round(us, 2), exact=exact, protocol=fplan.protocol,
                                 grid=fplan.grid))
                if rank == 0:
                    print(json.dumps(rows[-1]), flush=True)
        big, small, hidden = TRANSITION
        calls = []
        for tokens in (big, small):
            xs, residual, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 7 + 3)
            calls.append((xs[rank], residual, weight))

        def pair(i):
            return [comm.all_reduce_add_rms_norm(x, r, w, EPS, algo="oneshot") for x, r, w in calls]
        want = [tpfuse.add_rms_norm(comm.all_reduce(x), r, w, EPS) for x, r, w in calls]
        exact = all(same_bits(a, b) for got, ref in zip(pair(0), want) for a, b in zip(got, ref))
        us = collective_graph_us(pair, 1)
        rows.append(dict(variant=opts.variant, tag=opts.tag, world=world, method="pair", tokens=small, hidden=hidden,
                         us=round(us, 2), exact=exact, protocol=f"after {big} tokens", grid=0))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        with open(os.path.join(opts.out, f"fused_ab_{opts.variant}{opts.tag}.json"), "w") as f:
            json.dump(dict(header=run_header(), records=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
