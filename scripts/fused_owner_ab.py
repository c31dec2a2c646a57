"""The fused one-shot over LL / Lamport words with and without one owner CTA per row tile,
timed side by side in one process pair as `tpfuse bench fused` times (graph replay).

    torchrun --nproc-per-node 2 scripts/fused_owner_ab.py --out DIR

"count": every CTA sums the pieces it stored and the CTA that counts a tile's last piece
normalises it (plan.FUSED_OWNER_MAX_WORDS = 0); "owner": the pieces are stored by the whole
grid, and the tile's owner sums the whole tile and normalises it (the knob set high). Rounds
alternate count, owner, count, owner so drift shows. Every output is compared bitwise with
split's (all_reduce, then add_rms_norm) in the same run.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import tpfuse
from tpfuse.bench.common import collective_graph_us, layer_inputs, rotation, run_header, same_bits
from tpfuse.comm import plan

SHAPES = [(1, 4096), (2, 4096), (4, 4096), (16, 4096), (64, 4096), (1, 2880), (2, 2880), (16, 2880),
          (1, 5120), (1, 8192), (16, 8192)]
EPS = 1e-6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=".")
    opts = p.parse_args()
    from tpfuse.comm import Communicator

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    rows = []
    settings = {"count": {w: 0 for w in plan.FUSED_OWNER_MAX_WORDS}, "owner": {w: 1 << 20 for w in
                                                                                plan.FUSED_OWNER_MAX_WORDS}}
    with Communicator() as comm:
        for tokens, hidden in SHAPES:
            xs, residual, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 100_003 + hidden + 7)
            x = xs[rank]
            want = tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, EPS)
            rot = rotation(2 * x.numel() * x.element_size())
            pool = [(x.clone(), residual.clone()) for _ in range(rot)]
            for rnd in range(opts.rounds):
                for name, knob in settings.items():
                    plan.FUSED_OWNER_MAX_WORDS = knob
                    fp = plan.FusedPlan.from_shape(tokens, hidden, world, x.dtype, comm.layout, "oneshot")

                    def fn(i):
                        return comm.all_reduce_add_rms_norm(pool[i][0], pool[i][1], weight, EPS, algo="oneshot")
                    got = fn(0)
                    exact = all(same_bits(a, b) for a, b in zip(got, want))
                    us = collective_graph_us(fn, rot)
                    rows.append(dict(tokens=tokens, hidden=hidden, variant=name, round=rnd, us=round(us, 2),
                                     exact=exact, protocol=fp.protocol, owner_reduces=fp.owner_reduces,
                                     grid=fp.grid))
                    if rank == 0:
                        print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        with open(os.path.join(opts.out, f"fused_owner_ab_w{world}.json"), "w") as f:
            json.dump(dict(header=run_header(), records=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
