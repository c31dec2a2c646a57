"""Compile the RMSNorm forward kernel and the fused all-reduce + RMSNorm kernels for sm_90 on
any machine (no GPU needed) and report the register layout of each row reduction.

Why: y's bits depend on the order of the row reduction, which follows the register layout
Triton gives the reduced tile, and Triton picks layouts per compiled kernel. The fused
kernels equal the unfused path bit for bit only if their reduction has the norm kernel's
layout (tpfuse/kernels/fused.py). tests/test_fused_layouts.py runs this file as a script,
in a process of its own because tpfuse must be imported in its GPU mode (on a machine
without CUDA it would otherwise switch to Triton's interpreter, which compiles nothing).

The kernels are launched through tpfuse's real launchers with CPU tensors; the launch is
intercepted and compiled with Triton's own argument specialisation (alignment and
divisibility of every argument, as on a GPU), for the H200's target.

Usage: python tests/sm90_layouts.py '<json list of cases>'; prints one JSON object per case:
{"case": ..., "tail_n": NormConfig.tail_n, "norm": [layouts], "oneshot": [layouts], "oneshot_ll": [layouts],
"oneshot_lamport": [layouts], "oneshot_lamport_whole": [layouts], "twoshot": [layouts]} (oneshot_ll,
oneshot_lamport: the one-shot kernel over LL and Lamport words; _whole: with whole row tiles), a layout being
the reduced operand's type with its layout attribute written out. A case with "report": "guards" reports a
collective kernel's warps and the layouts of its waits' stop decisions (tests/test_guard_layouts.py,
``guard_reductions``); "report": "spins", the Lamport one-shot's per-thread spins
(``lamport_spins``); "report": "matmul", invariant_matmul's tensor-core instructions
(``matmul_instructions``). A case with "kernel":
"backward" (or "chunked", the same for rows over 16384) or "forward" reports instead that
norm kernel's registers and spill bytes per thread from ptxas (tests/test_norm_registers.py);
one with "report": "reductions", the backward kernel's warps and row-reduction layouts
(tests/test_norm_bwd_layouts.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402

torch.cuda.is_available = lambda: True  # import tpfuse in its GPU mode

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpfuse.comm.knobs import default_knobs  # noqa: E402
from tpfuse.comm.plan import AllReducePlan, FusedPlan, SequenceParallelPlan  # noqa: E402
from tpfuse.comm.quant_plan import QuantSegment  # noqa: E402
from tpfuse.comm.workspace import WorkspaceLayout  # noqa: E402
from tpfuse.kernels.peer import PeerContext  # noqa: E402
from tpfuse.kernels.fused import all_reduce_norm_into, ll_pieces, rows_pieces  # noqa: E402
from tpfuse.kernels import norm_bwd_chunked  # noqa: E402
from tpfuse.kernels.norm import NormConfig, rms_norm_fwd  # noqa: E402
from tpfuse.kernels.norm_bwd import rms_norm_bwd  # noqa: E402
from tpfuse.kernels.linear import invariant_matmul_into  # noqa: E402
from tpfuse.kernels import quant_fp8  # noqa: E402
from tpfuse.fp8_ops import fp8_outputs  # noqa: E402
from tpfuse.kernels.quant_fp8 import Fp8Output  # noqa: E402
from tpfuse.kernels.sequence_parallel import reduce_scatter_norm_into  # noqa: E402

quant_fp8.hardware_e4m3 = lambda device: True  # an sm_90 GPU's conversion, for tensors on the CPU

TARGET = GPUTarget("cuda", 90, 32)


def peers(layout: WorkspaceLayout, rank: int = 1) -> PeerContext:
    """A peer context at made-up addresses (the kernels are compiled, never run)."""
    world = layout.world_size
    return PeerContext(torch.zeros(world, dtype=torch.int64), tuple((1 << 40) + r * (1 << 30) for r in range(world)),
                       1 << 36, rank, layout, 10**9)


def fused_plan(n: int, dtype: torch.dtype, algo: str, protocol: str, grid: int, rows_per_group: int = 1,
               whole: bool = False, piece_elems: int = 0, x_dtype: torch.dtype | None = None) -> FusedPlan:
    """A fused plan as ``FusedPlan.from_shape`` builds them, for any grid: the norm in dtype,
    x in x_dtype (default dtype)."""
    cfg = NormConfig.from_shape(n, dtype)
    x_dtype = x_dtype or dtype
    piece_words, pieces = ll_pieces(n, x_dtype, protocol, whole, dtype) if protocol in ("ll", "lamport") else (0, 0)
    if protocol == "rows":
        pieces = -(-cfg.rows * n // piece_elems)
    return FusedPlan(algo, grid=grid, rows_per_group=rows_per_group, protocol=protocol, whole_tiles=whole,
                     piece_elems=piece_elems, piece_words=piece_words, pieces=pieces, norm=cfg)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_launches: list[tuple[JITFunction, dict]] = []


def _intercept(self, *args, grid, warmup, **kwargs):
    _launches.append((self, kwargs))


JITFunction.run = _intercept


def _source(kernel: JITFunction, kwargs: dict):
    """(backend, source, options) of what JITFunction.run would compile for these arguments
    on an sm_90 GPU."""
    backend = make_backend(TARGET)
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return backend, ASTSource(kernel, signature, constexprs, attrs), options.__dict__


def _compile(kernel: JITFunction, kwargs: dict):
    """The compiled kernel, every stage to the cubin (for ptxas's register counts)."""
    _, source, options = _source(kernel, kwargs)
    return compile(source, target=TARGET, options=options)


def _ttgir(kernel: JITFunction, kwargs: dict) -> str:
    """The kernel's TTGIR, where Triton has chosen its layouts: ``compile``'s first two stages
    alone, a third of the whole compile's time (the later stages lower, but do not change,
    the layouts)."""
    backend, source, options = _source(kernel, kwargs)
    options = backend.parse_options(options)
    stages = {}
    backend.add_stages(stages, options, source.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    metadata = {}
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return str(module)


def _reductions(axis: int) -> re.Pattern:
    """A reduction along ``axis``: its combining body and its operands' types (one or, for a
    tuple, more)."""
    return re.compile(r'"tt\.reduce"\([^)]*\) <\{axis = %d : i32\}> \((\{.*?\})\) : \(([^)]*)\)' % axis, re.S)


def row_reduction_layouts(ttgir: str, axis: int = 1) -> list[str]:
    """Types of the fp32 operands of every row sum (each operand of a tuple reduction), with
    the layout alias replaced by its definition; with axis=0, of every sum along axis 0
    instead (of 1-D tensors, e.g. the chunked backward's sum of a row's chunk sums). Maxima
    (an fp8 output's amax) are left out: their result does not depend on the order."""
    aliases = dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, re.M))
    return [ty.replace(alias, aliases.get(alias, alias)) for body, operands in _reductions(axis).findall(ttgir)
            if "arith.addf" in body for ty, alias in re.findall(r"(tensor<[0-9x]+xf32, (#[\w.]+)>)", operands)]


def _launch_args(launch, first: bool = False) -> tuple[JITFunction, dict]:
    """The one kernel launch that ``launch`` makes (first: the first of several, e.g. the
    backward kernel before its separate dW combine)."""
    _launches.clear()
    launch()
    if first:
        return _launches[0]
    (kernel, kwargs), = _launches
    return kernel, kwargs


def layouts_for(case: dict) -> dict:
    """The row reductions' layouts of the norm kernel and of the fused kernels on (dtype, n,
    rows, world, weight); with case["partials"], the fused kernels take fp32 x (partial sums)
    into the norm's dtype."""
    dtype, n, rows, world = DTYPES[case["dtype"]], case["n"], case["rows"], case["world"]
    x_dtype = torch.float32 if case.get("partials") else dtype
    x, res, y, res_out = (torch.empty(rows, n, dtype=dtype) for _ in range(4))
    weight = {"same": torch.empty(n, dtype=dtype), "fp32": torch.empty(n), "none": None}[case["weight"]]
    out = {"case": case, "tail_n": NormConfig.from_shape(n, dtype).tail_n}
    kernel, kwargs = _launch_args(lambda: rms_norm_fwd(x, weight, y, 1e-6, 0.0, res, res_out))
    out["norm"] = row_reduction_layouts(_ttgir(kernel, kwargs))
    fp8 = None
    if case.get("fp8"):  # the kernels with an fp8 output instead of y, against the plain norm kernel
        mode = case["fp8"]
        q, scales = fp8_outputs(x, mode, 16)
        fp8, y = Fp8Output(q, torch.ones(1) if mode == "tensor" else scales, mode, 16), None
        kernel, kwargs = _launch_args(lambda: rms_norm_fwd(x, weight, None, 1e-6, 0.0, res, res_out, fp8=fp8))
        out["norm_fp8"] = row_reduction_layouts(_ttgir(kernel, kwargs))
    # offsets only: nothing is allocated
    layout = WorkspaceLayout(world, 1 << 24, 128, ll_max_bytes=1 << 24, lamport_max_bytes=1 << 24,
                             rows_max_bytes=1 << 24)
    for name, algo, protocol, whole in (("oneshot", "oneshot", "flags", False), ("oneshot_ll", "oneshot", "ll", False),
                                        ("oneshot_lamport", "oneshot", "lamport", False),
                                        ("oneshot_lamport_whole", "oneshot", "lamport", True),
                                        ("twoshot", "twoshot", "flags", False)):
        if protocol != "flags" and n % 16:
            continue  # the LL and Lamport kernel needs whole-word rows (its launcher refuses)
        plan = fused_plan(n, dtype, algo, protocol, 1, rows, whole, x_dtype=x_dtype)
        kernel, kwargs = _launch_args(lambda: all_reduce_norm_into(  # noqa: B023  (called right here)
            x.to(x_dtype), weight, res, y, res_out, 1e-6, 0.0, plan, peers(layout), fp8))
        out[name] = row_reduction_layouts(_ttgir(kernel, kwargs))
    if n % 16 == 0 and case.get("reduce_scatter", True) and not case.get("partials"):  # the sequence-parallel one
        sp_layout = WorkspaceLayout(world, 1 << 30, 128)  # room for every case's rows
        sp_plan = SequenceParallelPlan.from_shape(rows, n, dtype, sp_layout, default_knobs(world))
        kernel, kwargs = _launch_args(lambda: reduce_scatter_norm_into(
            torch.empty(world * rows, n, dtype=dtype), weight, res, y, res_out, 1e-6, 0.0, sp_plan, peers(sp_layout),
            fp8))
        out["reduce_scatter"] = row_reduction_layouts(_ttgir(kernel, kwargs))
    cfg = NormConfig.from_shape(n, dtype)
    if n % 16 == 0 and not cfg.tail_n and cfg.num_chunks == 1:  # what the row-wise kernel serves
        piece, pieces = rows_pieces(n, x_dtype, 1024, dtype)
        plan = fused_plan(n, dtype, "oneshot", "rows", -(-rows // cfg.rows) * pieces, rows, piece_elems=piece,
                          x_dtype=x_dtype)
        kernel, kwargs = _launch_args(lambda: all_reduce_norm_into(x.to(x_dtype), weight, res, y, res_out, 1e-6, 0.0,
                                                                   plan, peers(layout), fp8))
        out["oneshot_rows"] = row_reduction_layouts(_ttgir(kernel, kwargs))
    return out


def _norm_kernel_launch(case: dict) -> tuple[JITFunction, dict]:
    """The launch of the norm kernel ``case["kernel"]`` ("backward", or "forward": add_rms_norm's)
    on (dtype, n, rows), with ``case["config"]`` (NormConfig fields) overriding the tile config
    at every M and ``case["weight"]`` ("same", the default, "fp32" or "none") the weight's dtype."""
    dtype, n, rows = DTYPES[case["dtype"]], case["n"], case["rows"]
    x, dx = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=dtype)
    w = {"same": torch.empty(n, dtype=dtype), "fp32": torch.empty(n), "none": None}[case.get("weight", "same")]
    dw = None if w is None else torch.empty_like(w)
    torch.cuda.is_current_stream_capturing = lambda: False  # the launcher asks, to allocate its counters
    # The chunked backward sizes its grid from the SMs (norm_bwd_chunked._resident_programs): an
    # H200's, or case["sms"] of them.
    norm_bwd_chunked._resident_programs.cache_clear()
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
        multi_processor_count=case.get("sms", 132))
    config = dict(case.get("config", {}))
    if "bwd_num_warps" in config:  # long runs too
        config.setdefault("bwd_long_run_warps", config["bwd_num_warps"])
    base = NormConfig.from_shape
    NormConfig.from_shape = staticmethod(lambda n_, dt: dataclasses.replace(base(n_, dt), **config))
    try:
        if case["kernel"] == "forward":
            return _launch_args(lambda: rms_norm_fwd(x, w, dx, 1e-6, 0.0, x.clone(), x.clone()))
        return _launch_args(lambda: rms_norm_bwd(x, x, w, dx, dw, 1e-6, 0.0), first=True)
    finally:
        NormConfig.from_shape = staticmethod(base)


def backward_reductions(case: dict) -> dict:
    """The backward kernel's warps and row_reduction_layouts (the joint reduction of x^2 and
    g*x has two operands), for (dtype, n, rows) as in kernel_registers; for chunked rows also
    the chunks per program and the reductions along axis 0 ("vector_reductions")."""
    kernel, kwargs = _norm_kernel_launch(dict(case, kernel="backward"))
    ttgir = _ttgir(kernel, kwargs)
    return {"case": case, "num_warps": kwargs["num_warps"], "reductions": row_reduction_layouts(ttgir),
            "chunks": kwargs.get("CHUNKS"), "vector_reductions": row_reduction_layouts(ttgir, axis=0)}


def kernel_registers(case: dict) -> dict:
    """ptxas's registers per thread and spill-store bytes for the norm kernel ``case["kernel"]``
    ("backward", or "forward": add_rms_norm's) of (dtype, n, rows), with ``case["config"]``
    (NormConfig fields) overriding the tile config."""
    kernel, kwargs = _norm_kernel_launch(case)
    return {"case": case, **_ptxas_usage(_compile(kernel, kwargs).asm["ptx"])}


def _ptxas_usage(ptx: str) -> dict:
    """ptxas's registers per thread and spill-store bytes for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([get_ptxas(TARGET.arch).path, f"-arch=sm_{TARGET.arch}a", "-v", path, "-o",
                                 os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1))}


def matmul_instructions(case: dict) -> dict:
    """The tensor-core instructions of ``invariant_matmul``'s kernel for x [m, k] bf16 and a
    weight [n, k] in ``chunks`` chunks, out dtype ``out``, in the configuration the library
    picks there, and ptxas's spill bytes per thread (tests/test_invariant_matmul.py)."""
    x = torch.empty(case["m"], case["k"], dtype=torch.bfloat16)
    w = torch.empty(case["n"], case["k"], dtype=torch.bfloat16)
    out = torch.empty(case["m"], case["n"], dtype=DTYPES[case["out"]])
    kernel, kwargs = _launch_args(lambda: invariant_matmul_into(x, w, out, case["chunks"]))
    ptx = _compile(kernel, kwargs).asm["ptx"]
    return {"case": case, "block_n": kwargs["BLOCK_N"], "block_t": kwargs["BLOCK_T"], "split": kwargs["SPLIT"],
            "num_warps": kwargs["num_warps"],
            "mma": sorted(set(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\.aligned\.\S+)", ptx))),
            **_ptxas_usage(ptx)}


def guard_reductions(case: dict) -> dict:
    """The warps of the collective kernel ``case["kernel"]`` and, for each of its
    ``sync.give_up`` reductions (over CTA_LANES int32 lanes), the warps its layout spans and the
    lanes one pass of the layout covers (sizePerThread * threadsPerWarp * warpsPerCTA): "oneshot",
    "ll", "lamport", "twoshot" (the all-reduce), "fused_ll", "fused_rows", "fused_twoshot" (bf16
    rows of ``case["n"]``) or "quant" (int4 at W=2 on the plan's ``case["tile"]``, "large" or "small",
    with that tile's warps)."""
    from tpfuse.comm.quant_plan import QuantPlan
    from tpfuse.kernels.allreduce import all_reduce_into
    from tpfuse.kernels.quant_allreduce import quant_all_reduce_into
    from tpfuse.kernels.sync import CTA_LANES

    world, kind = 2, case["kernel"]
    layout = WorkspaceLayout(world, 1 << 24, 128, ll_max_bytes=1 << 16, lamport_max_bytes=1 << 22,
                             rows_max_bytes=1 << 16)
    if kind in ("oneshot", "ll", "lamport", "twoshot"):
        x = torch.empty(8192, dtype=torch.bfloat16)
        plan = AllReducePlan("twoshot" if kind == "twoshot" else "oneshot", block=1024, grid=4, num_warps=4,
                             chunk=4096, protocol=kind if kind in ("ll", "lamport") else "flags")
        launch = lambda: all_reduce_into(x, torch.empty_like(x), plan, peers(layout))  # noqa: E731
    elif kind in ("fused_ll", "fused_rows", "fused_twoshot"):
        x, n = torch.empty(2, case["n"], dtype=torch.bfloat16), case["n"]
        piece, pieces = rows_pieces(n, torch.bfloat16, 1024)
        plan = (fused_plan(n, torch.bfloat16, "oneshot", "rows", 2 * pieces, piece_elems=piece)  # one-row tiles
                if kind == "fused_rows" else
                fused_plan(n, torch.bfloat16, "twoshot" if kind == "fused_twoshot" else "oneshot",
                           "ll" if kind == "fused_ll" else "flags", 4))
        launch = lambda: all_reduce_norm_into(  # noqa: E731
            x, torch.empty(n, dtype=torch.bfloat16), x.clone(), x.clone(), x.clone(), 1e-6, 0.0, plan, peers(layout))
    else:
        plan = QuantPlan.for_layout(layout, torch.bfloat16, "int4", default_knobs(world))
        block, warps = (plan.block, plan.num_warps) if case["tile"] == "large" else (plan.small_block,
                                                                                   plan.small_num_warps)
        x = torch.empty(1 << 16, dtype=torch.bfloat16)
        segment = QuantSegment(0, x.numel(), chunk=1 << 15, block=block, grid=4, num_warps=warps)
        launch = lambda: quant_all_reduce_into(x, torch.empty_like(x), plan, segment, peers(layout))  # noqa: E731
    kernel, kwargs = _launch_args(launch)
    ttgir = _ttgir(kernel, kwargs)
    aliases = dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, re.M))
    spans = []
    for _, operands in _reductions(0).findall(ttgir):
        for alias in re.findall(r"tensor<%dxi32, (#[\w.]+)>" % CTA_LANES.value, operands):
            per_thread, per_warp, warps = (int(re.search(r"%s = \[(\d+)\]" % key, aliases[alias]).group(1))
                                           for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
            spans.append({"warps": warps, "lanes": per_thread * per_warp * warps})
    return {"case": case, "num_warps": kwargs["num_warps"], "give_up": spans}


def lamport_spins(case: dict) -> dict:
    """The one-shot over Lamport words at W=2 on ``case.get("rank", 0)``, ``case["kernel"]``
    "allreduce" (``case["dtype"]`` tiles of ``case["block"]`` elements on ``case["warps"]`` warps,
    ``case.get("numel", 2**19)`` elements) or "fused" (rows of
    ``case["n"]``, ``case["rows"]`` of them, ``case["whole"]`` tiles): its copies of the
    per-thread spin (``ll._spin_vectors``: labels in the PTX), its 16-byte volatile loads, and
    the 16-byte vectors each thread holds per slot."""
    from tpfuse.kernels.allreduce import all_reduce_into

    world, dtype = 2, DTYPES[case["dtype"]]
    layout = WorkspaceLayout(world, 1 << 24, 128, ll_max_bytes=1 << 16, lamport_max_bytes=1 << 22,
                             rows_max_bytes=1 << 16)
    context = peers(layout, case.get("rank", 0))  # rank 1: a constant to Triton
    if case["kernel"] == "allreduce":
        x = torch.empty(case.get("numel", 1 << 19), dtype=dtype)
        plan = AllReducePlan("oneshot", block=case["block"], grid=128, num_warps=case["warps"], protocol="lamport")
        launch = lambda: all_reduce_into(x, torch.empty_like(x), plan, context)  # noqa: E731
        words = case["block"]
    else:
        x = torch.empty(case["rows"], case["n"], dtype=dtype)
        plan = fused_plan(case["n"], dtype, "oneshot", "lamport", 4, case["rows"], case["whole"])
        launch = lambda: all_reduce_norm_into(  # noqa: E731
            x, torch.empty(case["n"], dtype=dtype), x.clone(), x.clone(), x.clone(), 1e-6, 0.0, plan, context)
        words = ll_pieces(case["n"], dtype, "lamport", case["whole"])[0]
    kernel, kwargs = _launch_args(launch)
    ptx = _compile(kernel, kwargs).asm["ptx"]
    return {"case": case, "spins": ptx.count("SPIN:"), "vector_loads": ptx.count("ld.volatile.global.v4.u32"),
            "vectors_per_thread": max(1, words * dtype.itemsize // 16 // (32 * kwargs["num_warps"]))}


if __name__ == "__main__":
    report = {"registers": kernel_registers, "reductions": backward_reductions, "layouts": layouts_for,
              "guards": guard_reductions, "spins": lamport_spins, "matmul": matmul_instructions}
    for c in json.loads(sys.argv[1]):
        print(json.dumps(report[c.get("report", "registers" if "kernel" in c else "layouts")](c)), flush=True)
