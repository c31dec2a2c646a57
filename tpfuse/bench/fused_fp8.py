"""``tpfuse bench fused --quant MODE``: the fused boundary with an fp8 (e4m3) output, side by side.

Per (tokens, hidden), bf16 in, W = every visible GPU (one process each), CUDA-graph replay
(``tpfuse.bench.allreduce``'s timing), MODE "tensor" (a static scale), "token" or "group"
(scales per 128 columns):

- nccl_torch: NCCL all-reduce, torch add, torch.nn.functional.rms_norm, then the
  quantization in torch (what a plain PyTorch model runs);
- split: tpfuse all_reduce, tpfuse.add_rms_norm, tpfuse.quant_fp8 (the contract);
- fused: all_reduce_add_rms_norm, auto, without quantization (the target: fused + fp8
  within 5% of it);
- oneshot / twoshot / auto: Communicator.all_reduce_add_rms_norm_fp8(algo=...);
- flashinfer (MODE "tensor"): FlashInfer's all-reduce + residual + RMSNorm + fp8 quantization
  (kARResidualRMSNormFP8Quant, a static scale), where flashinfer is importable.

Each tpfuse method's (q, scales, residual_out) are checked bitwise against split's in the same
run; FlashInfer's q and residual_out are compared too and marked, but bind nothing. Without
two GPUs: two CPU ranks under Triton's interpreter check the bits of MODE on a few shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpfuse
from tpfuse import reference
from tpfuse.bench.common import cpu_check_intro, cpu_check_verdict, header_markdown, init_rank, layer_inputs, same_bits

SHAPES = [(t, h) for h in (4096, 8192) for t in (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)]
METHODS = ["nccl_torch", "split", "fused", "oneshot", "twoshot", "auto", "flashinfer"]
EPS, GROUP, STATIC_SCALE = 1e-6, 128, 0.02
CPU_SHAPES = [(1, 4096), (16, 1024), (32, 2048)]


def _torch_quant(y, mode, scale):
    """y quantized to e4m3 in plain torch (per tensor, token, or group of GROUP columns)."""
    v = y.float()
    if mode == "group":
        v = v.unflatten(-1, (-1, GROUP))
    s = scale if mode == "tensor" else v.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    return (v / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(y.shape), s


def _methods(comm, weight, mode, scale, flashinfer, tokens, hidden):
    def nccl_torch(x, residual):
        r = x.clone()
        dist.all_reduce(r)
        residual_out = r + residual
        return *_torch_quant(F.rms_norm(residual_out, (hidden,), weight, EPS), mode, scale), residual_out

    def split(x, residual):
        y, residual_out = tpfuse.add_rms_norm(comm.all_reduce(x), residual, weight, EPS)
        return *tpfuse.quant_fp8(y, mode, scale=scale, group=GROUP), residual_out

    def fused_fp8(algo):
        return lambda x, residual: comm.all_reduce_add_rms_norm_fp8(x, residual, weight, EPS, mode=mode, scale=scale,
                                                                    group=GROUP, algo=algo)

    methods = {"nccl_torch": nccl_torch, "split": split,
               "fused": lambda x, residual: comm.all_reduce_add_rms_norm(x, residual, weight, EPS),
               "oneshot": fused_fp8("oneshot"), "twoshot": fused_fp8("twoshot"), "auto": fused_fp8("auto")}
    if flashinfer is not None and mode == "tensor" and flashinfer.fits(tokens * hidden):
        q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=weight.device)
        y, residual_out = (torch.empty(tokens, hidden, dtype=weight.dtype, device=weight.device) for _ in range(2))
        methods["flashinfer"] = lambda x, residual: flashinfer.add_rms_norm_fp8(x, residual, weight, EPS, scale, q, y,
                                                                                residual_out)
    return methods


def _compare(name, out, want) -> dict:
    """Which outputs equal split's (q, scales, residual_out; FlashInfer: q, residual_out)."""
    if name == "flashinfer":
        q, residual_out = out
        q_bitwise, residual_out_bitwise = same_bits(q, want[0]), same_bits(residual_out, want[2])
        return dict(bitwise=q_bitwise and residual_out_bitwise, q_bitwise=q_bitwise,
                    residual_out_bitwise=residual_out_bitwise,
                    q_differ=int((q.view(torch.uint8) != want[0].view(torch.uint8)).sum().item()))
    if name in ("nccl_torch", "fused"):
        return dict(bitwise=True)  # another contract (torch's; no quantization): not compared
    return dict(bitwise=all(same_bits(a, b) for a, b in zip(out, want)))


def measure_shape(tokens, hidden, comm, flashinfer, world, rank, opts):
    """``tpfuse.bench.fused``'s records of one shape, for the fp8 output of opts["quant"]."""
    from tpfuse.bench.fused import measure_methods

    xs, residual, weight = layer_inputs(tokens, hidden, world, "cuda", seed=tokens * 100_003 + hidden)
    mode = opts["quant"]
    scale = torch.tensor([STATIC_SCALE], device="cuda") if mode == "tensor" else None
    methods = _methods(comm, weight, mode, scale, flashinfer, tokens, hidden)
    want = methods["split"](xs[rank], residual)
    # split itself against the spec: residual_out bitwise (y's own check is the plain bench's)
    spec_ok = same_bits(want[2], reference.all_reduce_add_rms_norm(xs, residual, weight, EPS)[1])

    def compare(name, out):
        rec = _compare(name, out, want)
        return rec | dict(bitwise=rec["bitwise"] and (spec_ok or name in ("nccl_torch", "fused", "flashinfer")))

    return measure_methods(methods, compare, xs[rank], residual, comm, rank)


def header(mode: str) -> dict:
    """The fp8 settings for a result file's header."""
    return {"fp8": mode, "group": GROUP} | ({"static_scale": STATIC_SCALE} if mode == "tensor" else {})


def markdown(records, header, world, mode):
    from tpfuse.bench.fused import method_cell

    by = {(r["tokens"], r["hidden"], r["method"]): r for r in records}
    md = header_markdown(f"fused all-reduce + residual add + RMSNorm + fp8 per {mode}, {world} ranks, bf16 in",
                         header)
    md += ("CUDA-graph replay, us per call. `x` marks outputs not bitwise equal to the split path (tpfuse "
           "all_reduce, add_rms_norm, quant_fp8). `fused` is the fused kernel without quantization; "
           "auto / fused is the cost of the fp8 output (target <= 1.05).\n\n")
    md += "| hidden | tokens | " + " | ".join(METHODS) + " | auto / fused | split / auto | flashinfer / auto |\n"
    md += "|---" * (len(METHODS) + 5) + "|\n"
    for hidden, tokens in sorted({(r["hidden"], r["tokens"]) for r in records}):
        cells = [method_cell(by.get((tokens, hidden, m))) for m in METHODS]
        auto, fused, split, fi = (by.get((tokens, hidden, m)) for m in ("auto", "fused", "split", "flashinfer"))
        ratio = (lambda a, b: f"{a['us'] / b['us']:.2f}" if a and b else "-")
        md += (f"| {hidden} | {tokens} | " + " | ".join(cells)
               + f" | {ratio(auto, fused)} | {ratio(split, auto)} | {ratio(fi, auto)} |\n")
    fis = [r for r in records if r["method"] == "flashinfer"]
    if fis:
        md += (f"\nflashinfer {header.get('flashinfer', '')} against split: q bitwise equal at "
               f"{sum(r['q_bitwise'] for r in fis)} of {len(fis)} shapes (at most {max(r['q_differ'] for r in fis)} "
               f"values differ), residual_out at {sum(r['residual_out_bitwise'] for r in fis)}.\n")
    return md


def cpu_worker(rank: int, world: int, port: int, opts: dict) -> None:
    from tpfuse.comm import Communicator

    shapes = [(t, h) for t, h in CPU_SHAPES if t <= opts["max_tokens"]] or [(opts["max_tokens"], 1024)]
    mode = opts["quant"]
    init_rank(rank, world, port, "gloo")
    if rank == 0:
        cpu_check_intro(f"fused + fp8 per {mode} one-shot, two-shot and auto, at "
                        f"{', '.join(f'{t} x {h}' for t, h in shapes)} (tokens x hidden), bf16, {world} emulated ranks, "
                        "bitwise against the split path", opts["gpu_only"])
    rows = []
    with Communicator(timeout_s=60) as comm:
        for tokens, hidden in shapes:
            xs, residual, weight = layer_inputs(tokens, hidden, world, "cpu", seed=tokens)
            scale = torch.tensor([STATIC_SCALE]) if mode == "tensor" else None
            methods = _methods(comm, weight, mode, scale, None, tokens, hidden)
            want = methods["split"](xs[rank], residual)
            for name in ("oneshot", "twoshot", "auto"):
                good = _compare(name, methods[name](xs[rank], residual), want)["bitwise"]
                rows.append((tokens, hidden, mode, name, good))
    dist.destroy_process_group()
    ok = all(good for *_, good in rows)
    if rank == 0:
        print("| tokens x hidden | fp8 per | algo | bitwise equal to split |\n|---|---|---|---|")
        for tokens, hidden, mode, name, good in rows:
            print(f"| {tokens} x {hidden} | {mode} | {name} | {'yes' if good else 'NO'} |")
        cpu_check_verdict(ok)
    if not ok:
        raise RuntimeError(f"rank {rank}: a fused fp8 result differs from the split path")
