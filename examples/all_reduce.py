"""All-reduce and the fused layer boundary on several ranks:

    torchrun --nproc-per-node 2 examples/all_reduce.py

One process per rank: on GPUs (NCCL, one GPU each) or, without CUDA, on CPU (gloo, the
kernels under Triton's interpreter, peer memory in /dev/shm).
"""

import os

import torch
import torch.distributed as dist

import tpfuse

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    device = "cuda"
else:
    dist.init_process_group("gloo")
    device = "cpu"
rank, world = dist.get_rank(), dist.get_world_size()

with tpfuse.Communicator() as comm:  # collective: every rank constructs it
    x = torch.full((4, 1024), float(rank + 1), dtype=torch.bfloat16, device=device)
    out = comm.all_reduce(x)  # the fp32 sum over ranks (a pairwise tree), rounded once
    assert torch.all(out == world * (world + 1) / 2)

    # At a row-parallel layer's output: all-reduce + residual add + RMSNorm in one kernel,
    # the same bits as the three steps apart.
    residual = torch.randn(4, 1024, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(0))
    weight = torch.ones(1024, dtype=torch.bfloat16, device=device)
    y, residual_out = comm.all_reduce_add_rms_norm(x, residual, weight, eps=1e-6)
    y_split, residual_split = tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, eps=1e-6)
    assert torch.equal(y, y_split) and torch.equal(residual_out, residual_split)
    if rank == 0:
        print(f"all_reduce over {world} ranks: every element is {out[0, 0].item():g}; fused == split bit for bit")
dist.destroy_process_group()
