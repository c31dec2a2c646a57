"""What the call ledger (tpfuse.comm.ledger) costs the host: ``post`` and ``agree`` per call,
and an eager all-reduce's time per call with the ledger and without it (the communicator's
ledger detached for the A/B, in alternating rounds), at the launch's world size.

    torchrun --nproc-per-node 2 scripts/ledger_cost.py [--out DIR]

Gloo and Triton's interpreter without GPUs (eager calls then measure the interpreter, not the
host path: only post and agree are meaningful there), NCCL and one GPU per rank with them.
Rank 0 prints a markdown table and writes ledger_cost.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from tpfuse.bench.common import header_markdown, run_header
from tpfuse.comm import Communicator

TEXT = "all_reduce of 2048 bfloat16: algo=oneshot block=2048 grid=2 num_warps=4 protocol=lamport"


def _per_call_us(fn, calls: int, sync) -> float:
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    comm = Communicator()
    ledger = comm._ledger  # detached and put back for the A/B below (a measurement, not an API)
    post = [_per_call_us(lambda: comm._post(TEXT), args.calls, sync) for _ in range(args.rounds)]
    agree = [_per_call_us(lambda: comm._post("all_reduce of 1000 float32: algo=nccl", before_backend=True),
                          args.calls, sync) for _ in range(args.rounds)]
    x = torch.randn(2048, device=comm.device).to(torch.bfloat16)
    with_ledger, without = [], []
    for _ in range(args.rounds if cuda else 0):
        with_ledger.append(_per_call_us(lambda: comm.all_reduce(x), args.calls, sync))
        comm._ledger = None
        without.append(_per_call_us(lambda: comm.all_reduce(x), args.calls, sync))
        comm._ledger = ledger
    comm.close()
    rows = {"post_us": post, "agree_us": agree, "eager_all_reduce_4KiB_with_ledger_us": with_ledger,
            "eager_all_reduce_4KiB_without_ledger_us": without}
    if dist.get_rank() == 0:
        header = run_header()
        print(header_markdown(f"The call ledger's host cost, W={dist.get_world_size()}", header))
        print("| what | median us per call | rounds |\n|---|---|---|")
        for name, values in rows.items():
            if values:
                print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "ledger_cost.json"), "w") as f:
                json.dump({**header, "world_size": dist.get_world_size(), "calls": args.calls, **rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
