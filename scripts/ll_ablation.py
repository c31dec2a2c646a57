"""Where the small all-reduce's time goes: `tpfuse.kernels.ll.ll_reduce` swapped for variants
that each leave one part out, timed as `tpfuse bench allreduce` times (graph replay).

    torchrun --nproc-per-node 2 scripts/ll_ablation.py --variant base [--max-bytes B] [--tag T] --out DIR

One variant per process: Triton refuses a kernel whose globals changed after it compiled.
(Its variants guard64 and relaxed_end, at 407a231, are the kernels' own since: sync.GUARD_POLLS
and sync.end_call. An earlier spin variant, over LL words a word at a time and slower everywhere,
is at 6053190.)
Variants (every one but "base" and "poll" gives wrong sums or drops a guard; measurement only):
  base      the kernel as it is;
  no_zero   the consumed words are not zeroed (LL: still waits on the flags; Lamport words:
            every call after the first takes the last call's words as arrived, so no wait);
  no_guard  the poll loop reads neither the abort word nor the clock (over Lamport words it
            also polls CTA-wide, without base's per-thread spin: compare it with poll);
  no_wait   no poll at all: the local slots are summed as they are (the floor without the
            cross-GPU wait);
  poll      Lamport words: the CTA-wide poll from the first look, as before the per-thread
            spin (``ll.ll_wait``'s SPIN; the spin as a variant was at d04b3d7); LL: as base;
  copy      no collective: a one-pass copy kernel on the same grid (the launch floor);
  zero_behind  LL words only: the consumed words are not zeroed after the poll; instead, before
            the first poll, the same number of words is zeroed in a scratch area (the workspace's
            ``reduced`` region), as a kernel that clears the previous call's words while it
            waits would (the timing of that idea, not a protocol: Lamport sizes would not wait).
            W=2's table sends no size over LL words since 2e67899: run it there with
            TPFUSE_TABLE_DIR holding a table that has LL_MAX_BYTES.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tpfuse.kernels.allreduce as ar
from tpfuse.bench.common import collective_graph_us, random_inputs, rotation, run_header, same_bits
from tpfuse.kernels import ll


@triton.jit
def _zero(slot0, slot_words, woffs, wmask, rank, W: tl.constexpr):
    """Zero the words at woffs of every slot but ``rank``'s (the kernels' own slot is never written)."""
    for s in tl.static_range(W):
        tl.store(slot0 + s * slot_words + woffs, tl.zeros_like(woffs).to(slot0.dtype.element_ty),
                 mask=wmask & (s != rank))


@triton.jit
def _no_zero(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
             W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False, own=None,
             SPIN: tl.constexpr = False):
    acc, late = ll.poll_slots(slot0, slot_words, woffs, wmask, flag, W, ELEM, LAMPORT, own, rank)
    while late:
        acc, late = ll.poll_slots(slot0, slot_words, woffs, wmask, flag, W, ELEM, LAMPORT, own, rank)
    return acc


@triton.jit
def _no_guard(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
              W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False, own=None,
              SPIN: tl.constexpr = False):
    acc = _no_zero(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP, W, ELEM, LAMPORT,
                   own)
    _zero(slot0, slot_words, woffs, wmask, rank, W)
    return acc


@triton.jit
def _no_wait(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
             W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False, own=None,
             SPIN: tl.constexpr = False):
    acc, late = ll.poll_slots(slot0, slot_words, woffs, wmask, flag, W, ELEM, LAMPORT, own, rank)
    _zero(slot0, slot_words, woffs, wmask, rank, W)
    return acc


@triton.jit
def _poll_first(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
                W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False, own=None,
                SPIN: tl.constexpr = False):
    return ll.ll_reduce(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP, W, ELEM,
                        LAMPORT, own, False)


ZB_OFFSET = tl.constexpr(0)  # byte offset of the workspace's reduced region, set in main() before compiling
ZB_STRIDE = tl.constexpr(8192)  # scratch words per slot: more than the LL sizes measured here


@triton.jit
def _zero_behind(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
                 W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False, own=None,
                 SPIN: tl.constexpr = False):
    scratch = (ctrl.to(tl.pointer_type(tl.uint8)) + ZB_OFFSET).to(slot0.dtype)
    _zero(scratch, ZB_STRIDE, woffs, wmask, rank, W)
    return ll.ll_wait(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP, W, ELEM,
                      LAMPORT, own)


@triton.jit
def _copy_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < numel), mask=offs < numel)


VARIANTS = {"base": None, "no_zero": _no_zero, "no_guard": _no_guard, "no_wait": _no_wait, "poll": _poll_first,
            "copy": None, "zero_behind": _zero_behind}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 65536])
    p.add_argument("--max-bytes", type=int, default=None,
                   help="the Communicator's max_bytes (its workspace is about 4x; default: its own default)")
    p.add_argument("--tag", default="", help="appended to the result file's name (repeated runs)")
    p.add_argument("--out", default=".")
    opts = p.parse_args()
    if VARIANTS[opts.variant] is not None:
        ar.ll_reduce = VARIANTS[opts.variant]
    from tpfuse.comm import Communicator

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    rows = []
    with Communicator(max_bytes=opts.max_bytes) as comm:
        global ZB_OFFSET
        ZB_OFFSET = tl.constexpr(comm.layout.reduced_offset)
        from tpfuse.comm.plan import AllReducePlan
        for nbytes in opts.sizes:
            protocol = AllReducePlan.from_numel(nbytes // 2, torch.bfloat16, comm.layout, comm.knobs).protocol
            if opts.variant == "zero_behind" and (protocol != "ll" or nbytes // 4 > ZB_STRIDE.value):
                raise SystemExit(f"zero_behind times LL sizes of at most {4 * ZB_STRIDE.value} bytes; "
                                 f"{nbytes} is {protocol}")
            xs = random_inputs(nbytes // 2, torch.bfloat16, world, "cuda", seed=nbytes)
            want = sum(x.float() for x in xs).to(torch.bfloat16)
            rot = rotation(nbytes)
            pool = [xs[rank].clone() for _ in range(rot)]
            if opts.variant == "copy":  # 1 KiB tiles on 4 warps, as LL's at these sizes
                outs = [torch.empty_like(x) for x in pool]

                def fn(i):
                    _copy_kernel[(triton.cdiv(nbytes, 1024),)](pool[i], outs[i], pool[i].numel(), BLOCK=512,
                                                               num_warps=4)
                    return outs[i]
                exact = same_bits(fn(0), pool[0])
            else:
                def fn(i):
                    return comm.all_reduce(pool[i])
                exact = same_bits(fn(0), want)
            us = collective_graph_us(fn, rot)
            rows.append(dict(variant=opts.variant, max_bytes=comm.max_bytes, size_bytes=nbytes, us=round(us, 2),
                             exact=exact, protocol=protocol))
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
        with open(os.path.join(opts.out, f"ll_ablation_{opts.variant}{opts.tag}.json"), "w") as f:
            json.dump(dict(header=run_header(), records=rows), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
