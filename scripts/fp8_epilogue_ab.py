"""Where the fused boundary's fp8 output spends its time: the fused kernels (auto) with and
without the fp8 epilogue, and the epilogue with one of its parts swapped out, timed as
`tpfuse bench fused` times (graph replay).

    torchrun --nproc-per-node 2 scripts/fp8_epilogue_ab.py --variant base --out DIR
    ncu ... python scripts/fp8_epilogue_ab.py --ncu   (one GPU: the norm kernel alone, eager)

With --profile, each method's graph of 20 calls at 1 token is replayed under torch.profiler
instead, and rank 0 lists the kernels it ran per call and their mean GPU time: what of a
call's replayed time is the kernel's own.

One variant per process (Triton refuses a kernel whose globals changed after it compiled):
  base              the kernels as they are (every fp8 output checked against split's bits);
  approx_reciprocal fp8_reciprocal is Triton's approximate ``1.0 / s``, not ``div_rn``;
  no_clamp          _quantize without the saturation at +-448 (measured at 200a52e; since
                    a023c46 the hardware path has no clamp, and this is base there);
  truncate          _e4m3_bits is the fp32's top byte, not the conversion to e4m3;
  bytes_only        store_fp8_tile stores the top byte of y's fp32 bits and nothing else: no
                    scale, reciprocal, clamp, conversion or scale store.
The variants' outputs are wrong by design: they measure, and are never checked.
Methods per shape: fused (no fp8), tensor / token / group (the fp8 output, auto), and the
norm kernel alone on each rank's GPU (add_rms_norm of one tile, y or fp8 per tensor / token):
whether the epilogue's cost is the kernel's own or rides on the collective's critical path.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tpfuse
from tpfuse.bench.common import (
    collective_graph_us,
    graph_time_us,
    layer_inputs,
    rotation,
    run_header,
    same_bits,
)
from tpfuse.fp8_ops import fp8_outputs
from tpfuse.kernels import norm, quant_fp8
from tpfuse.kernels.quant_fp8 import _e4m3_bits

SHAPES = [(1, 4096), (8, 4096), (64, 4096), (128, 4096), (1, 8192), (32, 8192)]
EPS, GROUP = 1e-6, 128
MODES = ("tensor", "token", "group")


@triton.jit
def _approx_reciprocal(s):
    return 1.0 / s


@triton.jit
def _no_clamp(y, inv, HW_E4M3: tl.constexpr):
    return _e4m3_bits(y * inv, HW_E4M3)


@triton.jit
def _truncate(v, HW_E4M3: tl.constexpr):
    return (v.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)


@triton.jit
def _bytes_only(y, row_scale, Q, SCALES, scale_rows, rows, row_offs, col0, cols, mask, scales_mask, N,
                FP8: tl.constexpr, GROUP: tl.constexpr, HW_E4M3: tl.constexpr, VEC: tl.constexpr):
    q = (y.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)
    tl.store(Q + tl.max_contiguous(row_offs + cols, [1, VEC]), q, mask=mask)


VARIANTS = {"base": None, "approx_reciprocal": (quant_fp8, "fp8_reciprocal", _approx_reciprocal),
            "no_clamp": (quant_fp8, "_quantize", _no_clamp), "truncate": (quant_fp8, "_e4m3_bits", _truncate),
            "bytes_only": (norm, "store_fp8_tile", _bytes_only)}


def _norm_methods(residual, weight, scale):
    """The norm kernel alone on this GPU: y, or the fp8 output per tensor / per token."""
    n = residual.shape[-1]
    x = torch.randn_like(residual)
    res_out, y = torch.empty_like(residual), torch.empty_like(residual)

    def run(mode):
        if mode is None:
            return lambda i: norm.rms_norm_fwd(x, weight, y, EPS, 0.0, residual, res_out)
        q, scales = fp8_outputs(x, mode, GROUP)
        out = quant_fp8.Fp8Output(q.view(-1, n), scale if mode == "tensor" else scales, mode, GROUP)
        return lambda i: norm.rms_norm_fwd(x, weight, None, EPS, 0.0, residual, res_out, fp8=out)

    return {"norm": run(None), "norm_tensor": run("tensor"), "norm_token": run("token")}


def _ncu():
    """Each norm method of the first shape eagerly, 5 calls apiece, for ncu (one GPU)."""
    _, residual, weight = layer_inputs(1, 4096, 1, "cuda", seed=5)
    scale = torch.full((1,), 0.02, device="cuda")
    for name, fn in _norm_methods(residual, weight, scale).items():
        torch.cuda.nvtx.range_push(name)
        for i in range(5):
            fn(i)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def _profile(fn, rot) -> list[dict]:
    """Kernels per call of ``fn`` replayed in a graph of 20 calls, with their mean GPU time."""
    for i in range(3):
        fn(i % rot)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(20):
            fn(i % rot)
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    replays = 50
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return [{"kernel": e.key[:60], "per_call": e.count / (20 * replays), "us": round(e.device_time, 2)}
            for e in prof.key_averages() if e.device_time > 0 and e.count >= replays]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, default="base")
    p.add_argument("--out", default=".")
    p.add_argument("--ncu", action="store_true", help="one GPU, eager norm calls only (see the docstring)")
    p.add_argument("--profile", action="store_true", help="kernels per call under torch.profiler (1 token)")
    opts = p.parse_args()
    if VARIANTS[opts.variant] is not None:
        module, name, fn = VARIANTS[opts.variant]
        setattr(module, name, fn)
    if opts.ncu:
        return _ncu()
    from tpfuse.comm import Communicator

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    scale = torch.full((1,), 0.02, device="cuda")
    rows = []
    with Communicator() as comm:
        for tokens, hidden in SHAPES:
            xs, residual, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 100_003 + hidden + 7)
            x = xs[rank]
            rot = rotation(2 * x.numel() * x.element_size())
            pool = [(x.clone(), residual.clone()) for _ in range(rot)]

            def fp8(mode):
                return lambda i: comm.all_reduce_add_rms_norm_fp8(*pool[i], weight, EPS, mode=mode, group=GROUP,
                                                                  scale=scale if mode == "tensor" else None)
            methods = {"fused": lambda i: comm.all_reduce_add_rms_norm(*pool[i], weight, EPS),
                       **{mode: fp8(mode) for mode in MODES}}
            if opts.profile:
                if tokens == 1:
                    for method, fn in {**methods, **_norm_methods(residual, weight, scale)}.items():
                        rows.append({"variant": opts.variant, "method": method, "tokens": tokens, "hidden": hidden,
                                     "kernels": _profile(fn, rot)})
                        if rank == 0:
                            print(json.dumps(rows[-1]), flush=True)
                continue
            y, _ = tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, EPS)
            for method, fn in methods.items():
                exact = None
                if opts.variant == "base" and method in MODES:
                    want = tpfuse.quant_fp8(y, method, scale=scale if method == "tensor" else None, group=GROUP)
                    exact = all(same_bits(a, b) for a, b in zip(fn(0)[:2], want))
                rows.append(dict(variant=opts.variant, method=method, tokens=tokens, hidden=hidden,
                                 us=round(collective_graph_us(fn, rot), 2), exact=exact))
            for method, fn in _norm_methods(residual, weight, scale).items():
                rows.append(dict(variant=opts.variant, method=method, tokens=tokens, hidden=hidden,
                                 us=round(graph_time_us(fn), 2), exact=None))
            if rank == 0:
                print(json.dumps([r for r in rows if r["tokens"] == tokens and r["hidden"] == hidden]), flush=True)
    if rank == 0:
        with open(os.path.join(opts.out, f"fp8_epilogue_ab_{opts.variant}{'_profile' if opts.profile else ''}.json"), "w") as f:
            json.dump(dict(header=run_header(), records=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
