"""``tpfuse bench norm``: RMSNorm forward, residual-add forward and backward (dx + dW), side
by side with torch, torch.compile, Liger-Kernel and quack (CuTe-DSL kernels; Liger and quack
where installed), as effective bandwidth against a device-to-device copy measured in the same
run; plus in-kernel vs separate dW combine.

Bytes counted (each input read once, each output written once; the weight is negligible):
forward 2*M*N, residual-add forward 4*M*N, backward 3*M*N elements.
On a machine without CUDA it runs a correctness and determinism check on small shapes instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import tpfuse
from tpfuse import reference
from tpfuse.bench.common import (copy_bandwidth_gbps, cpu_check_intro, cpu_check_verdict, gpu_only_flags,
                                 graph_time_us, header_markdown, rotation, run_header, write_results)
from tpfuse.kernels.norm_bwd import rms_norm_bwd

MS = [1, 16, 128, 1024, 4096, 16384, 32768, 65536]
FP32_MS = [1, 1024, 32768]
NS = [256, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 65536]
COMPILE_MS = [4096, 32768]  # torch.compile recompiles per shape: measured on a subset
COMPILE_NS = [1024, 2048, 4096, 8192, 16384]
MAX_TENSOR_BYTES = 4 << 30  # bf16 M=32768 x N=65536 (the forward target shape) and no larger
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BYTES_PER_ELEMENT = {"fwd": 2, "add_fwd": 4, "bwd": 3}
EPS = 1e-6


def _impls(with_compile: bool):
    """name -> (fwd(x, w), add_fwd(x, res, w)); backward is autograd through fwd."""
    def torch_fwd(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    def torch_add(x, res, w):
        r = x + res
        return F.rms_norm(r, (r.shape[-1],), w, EPS), r

    impls = {
        "tpfuse": (lambda x, w: tpfuse.rms_norm(x, w, EPS), lambda x, res, w: tpfuse.add_rms_norm(x, res, w, EPS)),
        "torch": (torch_fwd, torch_add),
    }
    if with_compile:
        impls["torch.compile"] = (torch.compile(torch_fwd, dynamic=False), torch.compile(torch_add, dynamic=False))
    try:  # the CuTe DSL raises RuntimeError where it has no build for the CUDA driver
        from quack import rmsnorm as quack_rmsnorm
    except (ImportError, RuntimeError) as e:
        if getattr(e, "name", None) != "quack":  # installed, but it does not load
            print(f"# quack left out: {type(e).__name__}: {e}", flush=True)
    else:
        # Output in x's dtype. add+norm returns (norm, x + res rounded to res's dtype), normalizing
        # the unrounded fp32 sum (torch and tpfuse normalize the rounded one). Backward: dW from
        # fp32 partials, one per CTA over a fixed set of rows, summed by torch (deterministic).
        impls["quack"] = (lambda x, w: quack_rmsnorm(x, w, eps=EPS),
                          lambda x, res, w: quack_rmsnorm(x, w, residual=res, eps=EPS, prenorm=True))
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return impls

    def liger_fwd(x, w):  # Liger's defaults: "llama" casting, backward in place of dy
        return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True)

    impls["liger"] = (liger_fwd, lambda x, res, w: (liger_fwd(x + res, w), None))
    return impls


def _time_shape(impls, op, m, n, dtype):
    """{impl: microseconds} for one op at one shape. A peer that fails at a shape (quack's
    fp32 add+norm at N=65536 asks for more shared memory than an H200 has) is left out of it,
    with a line saying why."""
    esize = torch.empty((), dtype=dtype).element_size()
    sets = rotation(BYTES_PER_ELEMENT[op] * m * n * esize)
    xs = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    ress = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)] if op == "add_fwd" else None
    w = torch.randn(n, device="cuda", dtype=dtype)
    times = {}
    for name, (fwd, add_fwd) in impls.items():
        if name == "torch.compile" and not (m in COMPILE_MS and n in COMPILE_NS and dtype == torch.bfloat16):
            continue
        try:
            times[name] = _time_impl(op, fwd, add_fwd, xs, ress, w, sets)
        except Exception as e:  # noqa: BLE001  (a peer's own error, reported and skipped)
            if name == "tpfuse":
                raise
            torch.cuda.synchronize()
            print(f"# {name} left out at {op} M={m} N={n} {dtype}: {type(e).__name__}: {str(e).strip()[:160]}",
                  flush=True)
    return times


def _time_impl(op, fwd, add_fwd, xs, ress, w, sets):
    if op == "fwd":
        return graph_time_us(lambda i: fwd(xs[i % sets], w))
    if op == "add_fwd":
        return graph_time_us(lambda i: add_fwd(xs[i % sets], ress[i % sets], w))
    xg = [x.clone().requires_grad_(True) for x in xs]
    wg = w.clone().requires_grad_(True)
    dys = [torch.randn_like(x) for x in xs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ys = [fwd(x, wg) for x in xg]
    return graph_time_us(
        lambda i: torch.autograd.grad(ys[i % sets], (xg[i % sets], wg), dys[i % sets], retain_graph=True),
        stream=stream)


def _time_dw_combine(m, n, dtype):
    """Backward kernel (dx + dW) with the plan's dW combine (``DwPlan.combine``) vs always the separate
    combine launch, over rotated inputs as ``_time_shape``'s (so small shapes are not timed from L2).
    Where the plan itself takes the separate launch (chunked rows, M > 1) the two run the same code."""
    sets = rotation(BYTES_PER_ELEMENT["bwd"] * m * n * dtype.itemsize)
    xs = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    dys = [torch.randn_like(x) for x in xs]
    dxs = [torch.empty_like(x) for x in xs]
    w = torch.randn(n, device="cuda", dtype=dtype)
    dw = torch.empty_like(w)
    return {f"dw_{'fused' if fused else 'separate'}": graph_time_us(
        lambda i, fused=fused: rms_norm_bwd(dys[i % sets], xs[i % sets], w, dxs[i % sets], dw, EPS, 0.0,
                                            fused_combine=fused))
        for fused in (True, False)}


def _gpu(args) -> int:
    header = run_header()
    header["copy_gbps"] = copy_gbps = copy_bandwidth_gbps()
    impls = _impls(not args.no_compile)
    header["impls"] = list(impls)
    from importlib.metadata import version
    for impl, dists in (("liger", ["liger-kernel"]), ("quack", ["quack-kernels", "nvidia-cutlass-dsl"])):
        if impl in impls:
            header.update({d.replace("-", "_"): version(d) for d in dists})
    print(f"# {header.get('gpu')}: copy bandwidth {copy_gbps:.0f} GB/s; impls {', '.join(impls)}", flush=True)
    records = []
    for dname in args.dtype:
        dtype = DTYPES[dname]
        esize = torch.empty((), dtype=dtype).element_size()
        for n in args.n:
            for m in args.m:
                if m * n * esize > MAX_TENSOR_BYTES or (dname == "fp32" and m not in args.fp32_m):
                    continue
                for op in args.ops:
                    times = _time_shape(impls, op, m, n, dtype)
                    if op == "bwd":
                        times.update(_time_dw_combine(m, n, dtype))
                    for impl, us in times.items():
                        gbps = BYTES_PER_ELEMENT[op] * m * n * esize / (us * 1e-6) / 1e9
                        records.append({"op": op, "impl": impl, "dtype": dname, "M": m, "N": n, "us": round(us, 3),
                                        "gbps": round(gbps, 1), "pct_copy": round(100 * gbps / copy_gbps, 1)})
                    line = "  ".join(f"{k} {v:.1f}us" for k, v in times.items())
                    print(f"{op:8s} {dname} M={m:6d} N={n:6d}  {line}", flush=True)
                torch.cuda.empty_cache()
    md = header_markdown("tpfuse bench norm", header) + summary_markdown(records)
    paths = write_results(args.out, "norm", header, records, md)
    print(md)
    print("wrote", *paths)
    if args.plot:
        plot(records, args.out)
    return 0


def summary_markdown(records: list[dict]) -> str:
    """Headline tables: % of copy bandwidth at the largest swept M, small-M latency, and
    in-kernel vs separate dW combine."""
    def table(rows, cols, cell, title, row_name):
        out = [f"## {title}\n", f"| {row_name} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for r in rows:
            out.append(f"| {r} | " + " | ".join(cell(r, c) for c in cols) + " |")
        return "\n".join(out) + "\n\n"

    idx = {(r["op"], r["impl"], r["dtype"], r["M"], r["N"]): r for r in records}
    text = ""
    for dname in sorted({r["dtype"] for r in records}):
        big_m = max((r["M"] for r in records if r["dtype"] == dname), default=None)
        for m in sorted({32768, big_m} & {r["M"] for r in records if r["dtype"] == dname}):
            ns = sorted({r["N"] for r in records if r["M"] == m and r["dtype"] == dname})
            for op in ("fwd", "add_fwd", "bwd"):
                impls = sorted({r["impl"] for r in records if r["op"] == op and r["M"] == m and r["dtype"] == dname},
                               key=lambda s: (s != "tpfuse", s))
                if not impls:
                    continue

                def cell(n, impl, op=op, m=m, dname=dname):
                    r = idx.get((op, impl, dname, m, n))
                    return f"{r['pct_copy']:.0f}% ({r['us']:.0f} us)" if r else "–"
                text += table(ns, impls, cell, f"{op}, {dname}, M={m}: % of copy bandwidth (time)", "N")
    small = sorted({r["M"] for r in records if r["M"] <= 16})
    if small:
        def cell_small(key, impl):
            r = idx.get(("fwd", impl, "bf16", key[0], key[1]))
            return f"{r['us']:.2f}" if r else "–"
        keys = sorted({(r["M"], r["N"]) for r in records if r["M"] in small and r["dtype"] == "bf16"
                       and r["N"] in (1024, 4096, 8192)})
        impls = sorted({r["impl"] for r in records if r["op"] == "fwd"}, key=lambda s: (s != "tpfuse", s))
        text += table([k for k in keys], impls, cell_small, "forward, bf16, small batches: us per call (graph replay)",
                      "(M, N)")
    dw = sorted({(r["M"], r["N"]) for r in records if r["impl"] == "dw_fused" and r["dtype"] == "bf16"})
    if dw:
        def cell_dw(key, col):
            f, s = idx.get(("bwd", "dw_fused", "bf16") + key), idx.get(("bwd", "dw_separate", "bf16") + key)
            return {"fused us": f"{f['us']:.1f}", "separate us": f"{s['us']:.1f}",
                    "speedup": f"{s['us'] / f['us']:.2f}x"}[col]
        text += table(dw, ["fused us", "separate us", "speedup"], cell_dw,
                      "backward dx+dW, bf16: the plan's dW combine vs always the separate combine launch "
                      "(same bits; the same code for N > 16384 with M > 1)", "(M, N)")
    return text


def plot(records: list[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for op in ("fwd", "add_fwd", "bwd"):
        sel = [r for r in records if r["op"] == op and r["dtype"] == "bf16" and r["M"] == 32768]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for impl in sorted({r["impl"] for r in sel}):
            pts = sorted((r["N"], r["pct_copy"]) for r in sel if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (hidden size)")
        ax.set_ylabel("% of device copy bandwidth")
        ax.set_title(f"RMSNorm {op}, bf16, M=32768")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(f"{out_dir}/norm_{op}.png", dpi=120, bbox_inches="tight")
        plt.close(fig)


CPU_SHAPES = [(4, 1000), (3, 4096), (2, 20000)]
"""(M, N) of the CPU check unless --m / --n name others: then every M with every N, M 4 where
only --n is given and N 4096 where only --m is (the interpreter is slow: keep them small)."""


def _cpu_check(args, gpu_only: list[str]) -> int:
    """Correctness and determinism under the interpreter (no timings), on ``args``' dtypes, ops
    and shapes (every --m with every --n, where given)."""
    shapes = CPU_SHAPES if args.m is None and args.n is None else [
        (m, n) for m in args.m or [CPU_SHAPES[0][0]] for n in args.n or [CPU_SHAPES[1][1]]]
    cpu_check_intro(f"{', '.join(args.ops)} at {', '.join(f'{m}x{n}' for m, n in shapes)} ({', '.join(args.dtype)}) "
                    "against tpfuse.reference, bitwise where the contract is", gpu_only)
    print(f"{'op':8s} {'dtype':9s} {'M':>5s} {'N':>6s} {'rel err':>9s} {'budget':>9s} {'bitwise/determ.':>16s}")
    ok = True
    g = torch.Generator().manual_seed(0)
    for dtype in (DTYPES[d] for d in args.dtype):
        budget = reference.rel_err_budget(dtype)
        for m, n in shapes:
            x, res, w, dy = (torch.randn(*shape, generator=g).to(dtype) for shape in ((m, n), (m, n), (n,), (m, n)))
            checks = []  # (op, output, reference, the bitwise or determinism check)
            if "fwd" in args.ops:
                checks.append(("fwd", tpfuse.rms_norm(x, w), reference.rms_norm(x, w), True))
            if "add_fwd" in args.ops:
                y2, r = tpfuse.add_rms_norm(x, res, w)
                checks.append(("add_fwd", y2, reference.add_rms_norm(x, res, w)[0],
                               torch.equal(y2, tpfuse.rms_norm(r, w))))
            if "bwd" in args.ops:
                grads = []
                for _ in range(3):
                    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                    grads.append(torch.autograd.grad(tpfuse.rms_norm(xg, wg), (xg, wg), dy))
                determ = all(torch.equal(a, b) for gr in grads[1:] for a, b in zip(gr, grads[0]))
                dx_ref, dw_ref = reference.rms_norm_backward(dy, x, w)
                checks += [("bwd dx", grads[0][0], dx_ref, determ), ("bwd dW", grads[0][1], dw_ref, determ)]
            for op, out, want, flag in checks:
                err = reference.rel_err(out, want)
                good = err <= (1 if op == "fwd" else 2) * budget and flag
                ok &= good
                print(f"{op:8s} {str(dtype)[6:]:9s} {m:5d} {n:6d} {err:9.2e} {budget:9.2e} "
                      f"{'yes' if flag else 'NO':>16s}{'' if good else '  FAIL'}", flush=True)
    cpu_check_verdict(ok)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpfuse bench norm", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for norm.json / norm.md / plots")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES), help="input dtypes")
    p.add_argument("--m", nargs="+", type=int, default=None,
                   help=f"rows (tokens) per call (default {' '.join(map(str, MS))}; CPU: {' '.join(str(m) for m, _ in CPU_SHAPES)})")
    p.add_argument("--n", nargs="+", type=int, default=None,
                   help=f"row length (hidden size) (default {' '.join(map(str, NS))}; "
                        f"CPU: {' '.join(str(n) for _, n in CPU_SHAPES)})")
    p.add_argument("--fp32-m", nargs="+", type=int, default=None,
                   help=f"the rows swept in fp32, a subset to bound the run time (default {' '.join(map(str, FP32_MS))})")
    p.add_argument("--ops", nargs="+", default=["fwd", "add_fwd", "bwd"], choices=list(BYTES_PER_ELEMENT),
                   help="forward, residual add + forward, backward (dx and dW)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--plot", action="store_true", help="write PNG plots (needs matplotlib)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        return _cpu_check(args, gpu_only_flags(p, vars(args), ["out", "fp32_m", "no_compile", "plot"]))
    args.m, args.n, args.fp32_m = args.m or MS, args.n or NS, args.fp32_m or FP32_MS
    return _gpu(args)


if __name__ == "__main__":
    sys.exit(main())
