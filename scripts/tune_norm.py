"""Time RMSNorm kernel variants on a GPU, to choose the values in tpfuse/kernels/norm*.py.
Not part of the library: it patches ``NormConfig.from_shape`` and the dW partial count.

    python3 scripts/tune_norm.py [MODE[=CASES] ...] > tune.txt

bwd: tile rows x warps x prefetch x joint reduction per N (M=32768, bf16; bwd=[dtype:]M:N,...
picks), then the best three per N again with 512 dW partials; fwd: warps x rows per N
(fwd=[dtype:]M:N,... picks), forward and add+norm; chunk: rows too long for registers
(N=65536): forward chunk bytes x warps, then exchange; exchange: the chunked backward's warps
x registers per thread x partials (exchange=dtype:N:M,...;... picks); dw: dW partials x
combine mode at small M (dw=dtype:M:N,... picks the shapes); fp32: warps for fp32 rows of
16384 held in registers; split: forward rows in two pieces vs one padded tile
(NormConfig.tail_n); bwdsplit: the same for the backward (bwd_tail_n), with warps x prefetch
x bwd_reload_weight; wide: bf16 rows of 16385-65536 elements, forward and add+norm, chunked
(read twice) vs held in registers as bf16 on 16 or 32 warps; bwdm, bwdbase, fwdm: per M
(see their docstrings). Every backward variant's dx and dW are checked against an fp32 torch
computation before it is timed.
"""

import dataclasses
import itertools
import sys

import torch
import triton

from tpfuse.bench.common import copy_bandwidth_gbps, graph_time_us, rotation
from tpfuse.kernels import norm, norm_bwd_chunked, norm_dw
from tpfuse.kernels.norm import NormConfig, rms_norm_fwd
from tpfuse.kernels.norm_bwd import rms_norm_bwd
from tpfuse.kernels.norm_dw import DwPlan

base_from_shape = NormConfig.from_shape
DT = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
M = 32768


def use_config(**fields):
    if "bwd_num_warps" in fields:  # at every M (the launcher otherwise takes bwd_long_run_warps on long runs)
        fields.setdefault("bwd_long_run_warps", fields["bwd_num_warps"])

    def from_shape(n, dtype):
        return dataclasses.replace(base_from_shape(n, dtype), **fields)
    NormConfig.from_shape = staticmethod(from_shape)


def pct(nbytes, us, copy):
    return 100 * nbytes / (us * 1e-6) / 1e9 / copy


def bwd_variants(n, dt=DT):
    base = base_from_shape(n, dt)
    tile_rows = [r for r in (1, 2, 4, 8, 16, 32) if r >= base.rows and r * base.block_n <= max(8192, base.block_n)]
    warps = [w for w in (4, 8, 16, 32) if w * 32 * 8 <= tile_rows[-1] * base.block_n * 2 or w == 4]
    for rows, w, prefetch, joint in itertools.product(tile_rows, warps, (False, True), (False, True)):
        if w * 32 * 8 > rows * base.block_n * 2 and w > 4:  # more threads than 16-byte vectors
            continue
        if prefetch and (base.num_chunks > 1 or rows * base.block_n > norm.MAX_PREFETCH_LANES):
            continue
        yield dict(bwd_rows=rows, bwd_num_warps=w, bwd_prefetch=prefetch, bwd_joint_reduce=joint, bwd_tail_n=0,
                   bwd_reload_weight=False)


def check_bwd(x, dy, w, dx, dw):
    xf, dyf, wf = x.float(), dy.float(), w.float()
    inv = torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-6)
    g = dyf * wf
    ref_dx = inv * (g - xf * inv * (g * xf).mean(1, keepdim=True) * inv)
    ref_dw = (dyf * xf * inv).sum(0)
    return (torch.allclose(dx.float(), ref_dx, rtol=2e-2, atol=2e-2)
            and (dw is None or torch.allclose(dw.float(), ref_dw, rtol=2e-2, atol=2e-2 * ref_dw.abs().max().item())))


def time_checked_bwd(x, dy, w, dx, dw, fused_combine=True):
    """(us per call, whether dx and dW were right) of the backward under the current config;
    dx and dW are poisoned first. x, dy, dx may be lists of input sets, rotated through (as
    `tpfuse bench norm` does), so small shapes are not timed from L2."""
    xs, dys, dxs = (t if isinstance(t, list) else [t] for t in (x, dy, dx))
    sets = len(xs)
    dxs[0].fill_(float("nan"))
    dw.fill_(float("nan"))
    rms_norm_bwd(dys[0], xs[0], w, dxs[0], dw, 1e-6, 0.0, fused_combine=fused_combine)
    ok = check_bwd(xs[0], dys[0], w, dxs[0], dw)
    return graph_time_us(lambda i: rms_norm_bwd(dys[i % sets], xs[i % sets], w, dxs[i % sets], dw, 1e-6, 0.0,
                                                fused_combine=fused_combine)), ok


def rotated_bwd_inputs(m, n, dt):
    """x, dy, dx as lists of input sets to rotate through (as `tpfuse bench norm` does, so
    small shapes are not timed from L2), the weight and dW."""
    sets = rotation(3 * m * n * dt.itemsize)
    x = [torch.randn(m, n, device="cuda", dtype=dt) for _ in range(sets)]
    w = torch.randn(n, device="cuda", dtype=dt)
    return x, [torch.randn_like(t) for t in x], [torch.empty_like(t) for t in x], w, torch.empty_like(w)


def tune_bwd(copy, cases=",".join(f"{M}:{n}" for n in [256, 512, 1024, 2048, 2880, 4096, 5120, 8192, 16384])):
    """Backward tiles per shape, [dtype:]M:N,... (bwd=CASES on the command line; bf16 unless
    fp32: leads): today's config first, then the variants (single-piece rows, g held)."""
    for case in cases.split(","):
        *dname, m, n = case.split(":")
        dt, m, n = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname[0] if dname else "bf16"], int(m), int(n)
        x, dy, dx, w, dw = rotated_bwd_inputs(m, n, dt)
        base = base_from_shape(n, dt)
        print(f"bwd {str(dt)[6:]} M={m} N={n} base rows={base.bwd_rows} warps={base.bwd_num_warps} "
              f"prefetch={base.bwd_prefetch} joint={base.bwd_joint_reduce} tail={base.bwd_tail_n} "
              f"reload={base.bwd_reload_weight}", flush=True)
        timed = []
        for fields in [{}] + list(bwd_variants(n, dt)):
            use_config(**fields)
            us, ok = time_checked_bwd(x, dy, w, dx, dw)
            timed.append((us, fields))
            print(f"  {fields or 'base'} {us:.1f}us {pct(3 * m * n * dt.itemsize, us, copy):.0f}%"
                  f"{'' if ok else ' WRONG'}", flush=True)
        for us, fields in sorted(timed, key=lambda t: t[0])[:3]:
            use_config(**fields)
            norm_dw.MAX_DW_PARTIALS = 512
            us512, _ = time_checked_bwd(x, dy, w, dx, dw)
            norm_dw.MAX_DW_PARTIALS = 256
            print(f"  partials 512: {fields or 'base'} {us512:.1f}us {pct(3 * m * n * dt.itemsize, us512, copy):.0f}% "
                  f"(256: {us:.1f}us)", flush=True)
    NormConfig.from_shape = staticmethod(base_from_shape)


def tune_fwd(copy, cases=",".join(f"{M if n < 65536 else 4096}:{n}" for n in [2880, 5120, 65536])):
    """Forward and add+norm (one config serves both) per warps x rows, [dtype:]M:N,... (fwd=CASES
    on the command line; bf16 unless fp32: leads); inputs rotate as in `tpfuse bench norm`; y
    checked against fp32 torch."""
    for case in cases.split(","):
        *dname, m, n = case.split(":")
        dt, m, n = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname[0] if dname else "bf16"], int(m), int(n)
        esize = dt.itemsize
        sets = rotation(4 * m * n * esize)
        xs = [torch.randn(m, n, device="cuda", dtype=dt) for _ in range(sets)]
        ress = [torch.randn_like(x) for x in xs]
        y, res_out, w = torch.empty_like(xs[0]), torch.empty_like(xs[0]), torch.randn(n, device="cuda", dtype=dt)
        ref = torch.nn.functional.rms_norm(xs[0].float(), (n,), w.float(), 1e-6)
        base = base_from_shape(n, dt)
        for warps, rows in itertools.product([4, 8, 16, 32], sorted({1, 2, base.rows})):
            use_config(num_warps=warps, rows=rows)
            y.fill_(float("nan"))
            rms_norm_fwd(xs[0], w, y, 1e-6, 0.0)
            ok = torch.allclose(y.float(), ref, rtol=1 / 128, atol=1e-2)
            fwd = graph_time_us(lambda i: rms_norm_fwd(xs[i % sets], w, y, 1e-6, 0.0))
            add = graph_time_us(lambda i: rms_norm_fwd(xs[i % sets], w, y, 1e-6, 0.0, ress[i % sets], res_out))
            print(f"fwd {str(dt)[6:]} N={n} M={m} warps={warps} rows={rows} base=({base.num_warps},{base.rows}) "
                  f"fwd {fwd:.1f}us {pct(2 * m * n * esize, fwd, copy):.0f}% add {add:.1f}us "
                  f"{pct(4 * m * n * esize, add, copy):.0f}%"
                  f"{'' if ok else ' WRONG'}", flush=True)
    NormConfig.from_shape = staticmethod(base_from_shape)


def tune_chunk(copy):
    """Rows too long for registers: forward chunk bytes x warps (bf16 N=65536, M=32768); the
    backward's program count (DwPlan, via CHUNKED_BWD_PROGRAMS) x warps per M."""
    n = 65536
    x = torch.randn(M, n, device="cuda", dtype=DT)
    y = torch.empty_like(x)
    w = torch.randn(n, device="cuda", dtype=DT)
    default_chunk = norm.CHUNK_BYTES, norm.STREAM_CHUNK_BYTES
    for chunk_bytes in (8192, 16384, 32768, 65536):
        norm.CHUNK_BYTES = norm.STREAM_CHUNK_BYTES = chunk_bytes
        base_from_shape.cache_clear()
        for warps in (8, 16, 32):
            use_config(num_warps=warps)
            us = graph_time_us(lambda i: rms_norm_fwd(x, w, y, 1e-6, 0.0))
            print(f"fwd N={n} M={M} chunk={chunk_bytes} warps={warps} {us:.1f}us {pct(2 * M * n * 2, us, copy):.0f}%",
                  flush=True)
    norm.CHUNK_BYTES, norm.STREAM_CHUNK_BYTES = default_chunk
    base_from_shape.cache_clear()
    NormConfig.from_shape = staticmethod(base_from_shape)
    del x, y
    tune_exchange(copy)


EXCHANGE_CASES = "bf16:65536:1,16,1024,4096,16384;fp32:65536:1024;fp32:32768:16384;bf16:20000:32768"
# (warps, registers per thread); today's first.
EXCHANGE_VARIANTS = [(4, 255), (8, 128), (8, 255)]


def tune_exchange(copy, cases=EXCHANGE_CASES):
    """The chunked rows' backward (norm_bwd_chunked): warps x registers per thread (so programs
    per SM) x dW partials (CHUNKED_BWD_PROGRAMS), per dtype:N:M,...;... Every variant's dx
    and dW are checked against torch and compared bit for bit with today's."""
    base = norm_bwd_chunked.EXCHANGE_WARPS, norm_bwd_chunked.EXCHANGE_MAX_REGISTERS
    base_programs = norm_dw.CHUNKED_BWD_PROGRAMS
    for case in cases.split(";"):
        dname, n, ms = case.split(":")
        dt, n = DTYPES[dname], int(n)
        for m in map(int, ms.split(",")):
            x, dy, dx, w, dw = rotated_bwd_inputs(m, n, dt)
            ref = None
            for programs, variant in itertools.product((base_programs, 2 * base_programs), EXCHANGE_VARIANTS):
                norm_bwd_chunked.EXCHANGE_WARPS, norm_bwd_chunked.EXCHANGE_MAX_REGISTERS = variant
                norm_dw.CHUNKED_BWD_PROGRAMS = programs
                try:
                    us, ok = time_checked_bwd(x, dy, w, dx, dw)
                except Exception as e:  # a grid the GPU cannot hold at once, or out of registers
                    print(f"exchange {dname} N={n} M={m} programs={programs} {variant} failed: {e}", flush=True)
                    continue
                dx[0].fill_(float("nan"))
                rms_norm_bwd(dy[0], x[0], w, dx[0], dw, 1e-6, 0.0)
                outs = (dx[0].clone(), dw.clone())
                ref = outs if ref is None else ref
                same = (f" dx {'same' if torch.equal(outs[0], ref[0]) else 'DIFFERENT'}"
                        f" dW {'same' if torch.equal(outs[1], ref[1]) else 'different'}")
                print(f"exchange {dname} N={n} M={m} programs={programs} warps={variant[0]} regs={variant[1]} "
                      f"{us:.1f}us {pct(3 * m * n * dt.itemsize, us, copy):.0f}%"
                      f"{'' if ok else ' WRONG'}{same}", flush=True)
            del x, dy, dx
    norm_bwd_chunked.EXCHANGE_WARPS, norm_bwd_chunked.EXCHANGE_MAX_REGISTERS = base
    norm_dw.CHUNKED_BWD_PROGRAMS = base_programs


DW_CASES = ",".join(f"{d}:{m}:{n}" for (d, m), n in itertools.product(
    [("bf16", 1024), ("fp32", 1024), ("bf16", 4096)], [2048, 2880, 4096, 5120, 7168, 8192]))


def tune_dw(copy, cases=DW_CASES):
    """dW plans at small M: partials (of whole backward tiles) x combine ("tree"; "columns"
    on column blocks of 256 or 1024; "launch", the separate combine, on the same blocks) per
    case, dtype:M:N,... (dw=CASES on the command line); 32-256 partials up to M=4096, 128-1024
    above. Inputs rotate as in `tpfuse bench norm`."""
    base_plan = DwPlan.from_shape
    for case in cases.split(","):
        dname, m, n = case.split(":")
        dt, m, n = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname], int(m), int(n)
        x, dy, dx, w, dw = rotated_bwd_inputs(m, n, dt)
        base = base_plan(m, n, dt)
        tile_rows = base_from_shape(n, dt).bwd_rows
        us, ok = time_checked_bwd(x, dy, w, dx, dw)
        print(f"dw {str(dt)[6:]} M={m} N={n} plan partials={base.num_partials} {base.combine} "
              f"{us:.1f}us{'' if ok else ' WRONG'}", flush=True)
        combines = ["tree", "columns256", "columns1024", "launch256", "launch1024"]
        counts = [32, 64, 128, 256] if m <= 4096 else [128, 256, 512, 1024]
        for partials, combine in itertools.product(counts, combines):
            rows = -(-max(1, -(-m // partials)) // tile_rows) * tile_rows
            block = 1024 if combine.endswith("1024") else 256
            plan = dataclasses.replace(base, num_partials=-(-m // rows), rows_per_partial=rows,
                                       combine="tree" if combine == "tree" else "columns",
                                       num_combine_programs=-(-n // block), combine_block=block)
            DwPlan.from_shape = staticmethod(lambda m_, n_, d_, plan=plan: plan)
            us, ok = time_checked_bwd(x, dy, w, dx, dw, fused_combine=not combine.startswith("launch"))
            DwPlan.from_shape = staticmethod(base_plan)
            print(f"  partials={plan.num_partials} rows={rows} {combine} {us:.1f}us "
                  f"{pct(3 * m * n * dt.itemsize, us, copy):.0f}%{'' if ok else ' WRONG'}", flush=True)


def tune_fp32(copy):
    m, n = M, 16384
    x = torch.randn(m, n, device="cuda")
    y, dy, w = torch.empty_like(x), torch.randn_like(x), torch.randn(n, device="cuda")
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    for warps in (8, 16, 32):
        use_config(num_warps=warps, bwd_num_warps=warps)
        us = graph_time_us(lambda i: rms_norm_fwd(x, w, y, 1e-6, 0.0))
        print(f"fp32 fwd N={n} warps={warps} {us:.1f}us {pct(2 * m * n * 4, us, copy):.0f}%", flush=True)
        us = graph_time_us(lambda i: rms_norm_bwd(dy, x, w, dx, dw, 1e-6, 0.0))
        print(f"fp32 bwd N={n} warps={warps} {us:.1f}us {pct(3 * m * n * 4, us, copy):.0f}%", flush=True)
    NormConfig.from_shape = staticmethod(base_from_shape)


def tune_split(copy):
    """Forward rows in two pieces (NormConfig.tail_n) vs one padded tile, per warp count;
    "padded" is the config before the split (tail_n=0, warps from the padded tile)."""
    for dt, n in itertools.product([torch.bfloat16, torch.float32], [1280, 2880, 5120, 10240]):
        base = base_from_shape(n, dt)
        if not base.tail_n:
            continue
        esize = dt.itemsize
        padded_warps = norm._pow2_warps(base.rows * base.block_n // (16 // esize) // 2, 8)
        variants = [("padded", dict(tail_n=0, num_warps=padded_warps))]
        variants += [(f"split w{w}", dict(num_warps=w)) for w in (4, 8, 16)]
        for m in (M, 1):
            x = torch.randn(m, n, device="cuda", dtype=dt)
            res, y, r_out = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
            w = torch.randn(n, device="cuda", dtype=dt)
            ref = torch.nn.functional.rms_norm(x.float(), (n,), w.float(), 1e-6)
            for name, fields in variants:
                use_config(**fields)
                y.fill_(float("nan"))
                rms_norm_fwd(x, w, y, 1e-6, 0.0)
                ok = torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
                fwd = graph_time_us(lambda i: rms_norm_fwd(x, w, y, 1e-6, 0.0))
                add = graph_time_us(lambda i: rms_norm_fwd(x, w, y, 1e-6, 0.0, res, r_out))
                print(f"split {str(dt)[6:]} N={n} M={m} {name}: "
                      f"fwd {fwd:.2f}us {pct(2 * m * n * esize, fwd, copy):.0f}% add {add:.2f}us {pct(4 * m * n * esize, add, copy):.0f}%{'' if ok else ' WRONG'}", flush=True)
    NormConfig.from_shape = staticmethod(base_from_shape)


def tune_bwd_split(copy, cases="bf16:2880,bf16:5120,bf16:7168,bf16:8192,bf16:10240,bf16:16384,fp32:2880,"
                                 "fp32:5120,fp32:16384"):
    """Backward rows in two pieces (NormConfig.bwd_tail_n) vs one padded tile, and g = dy * w
    held or re-formed from a second weight read (bwd_reload_weight), per warps x prefetch;
    "base" is the current config, "padded" one tile with the rules of unsplit rows. cases:
    dtype:N,... (bwdsplit=CASES on the command line)."""
    for case in cases.split(","):
        dt, n = {"bf16": torch.bfloat16, "fp32": torch.float32}[case.split(":")[0]], int(case.split(":")[1])
        base = base_from_shape(n, dt)
        x = torch.randn(M, n, device="cuda", dtype=dt)
        dy, w = torch.randn_like(x), torch.randn(n, device="cuda", dtype=dt)
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        variants = [("base", {})]
        if base.bwd_tail_n:
            lanes_cap = min(norm.MAX_PREFETCH_LANES, norm._MAX_PREFETCH_BYTES // dt.itemsize)
            variants.append(("padded", dict(
                bwd_tail_n=0, bwd_num_warps=max(4, norm._pow2_warps(base.block_n // (16 // dt.itemsize), 16)),
                bwd_prefetch=base.block_n <= lanes_cap, bwd_reload_weight=False)))
        for warps, prefetch, reload in itertools.product((4, 8, 16, 32), (False, True), (False, True)):
            if warps == 32 and n < 16384 or warps == 4 and n >= 16384 or warps * 32 * 4 > n:
                continue
            variants.append((f"w{warps} p{int(prefetch)} r{int(reload)}",
                             dict(bwd_num_warps=warps, bwd_prefetch=prefetch, bwd_reload_weight=reload)))
        for name, fields in variants:
            use_config(**fields)
            us, ok = time_checked_bwd(x, dy, w, dx, dw)
            print(f"bwdsplit {str(dt)[6:]} N={n} tail={NormConfig.from_shape(n, dt).bwd_tail_n} {name}: "
                  f"{us:.1f}us {pct(3 * M * n * dt.itemsize, us, copy):.0f}%{'' if ok else ' WRONG'}", flush=True)
    NormConfig.from_shape = staticmethod(base_from_shape)


def tune_wide(copy):
    """bf16 rows over 16384: the chunked forward (pass two re-reads the row, mostly from L2)
    against the whole row held in registers in its 16-bit form (one tile of next_power_of_2(N)
    lanes). Each variant's y is checked against fp32 torch, and add+norm's y against
    rms_norm(residual_out) bit for bit, before it is timed."""
    for n, m in [(65536, 16384), (65536, 32768), (65536, 1024), (65536, 4096), (49152, 16384), (40000, 32768),
                 (34816, 32768), (32768, 32768), (24576, 32768), (20480, 32768), (32768, 1024)]:
        x = torch.randn(m, n, device="cuda", dtype=DT)
        res, w = torch.randn_like(x), torch.randn(n, device="cuda", dtype=DT)
        y, res_out, y2 = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        chunk = (norm.STREAM_CHUNK_BYTES if n * 2 >= norm._STREAM_ROW_BYTES else norm.CHUNK_BYTES) // 2
        chunked = dict(block_n=chunk, num_chunks=triton.cdiv(n, chunk), rows=1, tail_n=0, num_warps=32)
        reg = dict(block_n=triton.next_power_of_2(n), num_chunks=1, rows=1, tail_n=0)
        for name, fields in [("chunked", chunked), ("reg w32", dict(reg, num_warps=32)),
                             ("reg w16", dict(reg, num_warps=16))]:
            use_config(**fields)
            y.fill_(float("nan"))
            rms_norm_fwd(x, w, y, 1e-6, 0.0)
            ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
            ok = torch.allclose(y.float(), ref, rtol=1 / 128, atol=1e-2)
            rms_norm_fwd(x, w, y, 1e-6, 0.0, res, res_out)
            rms_norm_fwd(res_out, w, y2, 1e-6, 0.0)
            ok = ok and torch.equal(y.view(torch.int16), y2.view(torch.int16))
            fwd = graph_time_us(lambda i: rms_norm_fwd(x, w, y, 1e-6, 0.0))
            add = graph_time_us(lambda i: rms_norm_fwd(x, w, y, 1e-6, 0.0, res, res_out))
            print(f"wide bf16 N={n} M={m} {name} (default chunks {base_from_shape(n, DT).num_chunks}): fwd {fwd:.1f}us "
                  f"{pct(2 * m * n * 2, fwd, copy):.1f}%  add {add:.1f}us {pct(4 * m * n * 2, add, copy):.1f}%"
                  f"{'' if ok else ' WRONG'}", flush=True)
        NormConfig.from_shape = staticmethod(base_from_shape)
        del x, res, y, res_out, y2


def _shapes_by_m(cases, ms):
    """(dtype name, dtype, N, Ms) per case of dtype:N,...[;M,...] (the Ms default to ms)."""
    cases, _, m_list = cases.partition(";")
    ms = [int(m) for m in m_list.split(",")] if m_list else ms
    for case in cases.split(","):
        dname, n = case.split(":")
        yield dname, DTYPES[dname], int(n), ms


def tune_bwd_by_m(copy, cases="bf16:256,bf16:512,bf16:1024,fp32:256,fp32:512", ms=(1024, 4096, 16384, 32768, 65536),
                  base_only=False):
    """Backward tiles of short rows per M, dtype:N,... (bwdm=CASES; bwdbase=CASES times today's
    launch only): today's launch (its warps from norm.bwd_num_warps), then rows x warps as given
    (at every M), every variant's dx compared bit for bit with today's on the
    same inputs ("bits differ" marks a variant whose row reductions are laid out differently,
    which a choice by M must not take: a row's dx bits may depend on N and dtype only).
    CASES may end in ;M,M,... to pick the Ms."""
    for dname, dt, n, ms in _shapes_by_m(cases, ms):
        base = base_from_shape(n, dt)
        variants = [] if base_only else [
            dict(bwd_rows=rows, bwd_num_warps=warps)
            for rows in sorted({base.bwd_rows, 2 * base.bwd_rows, 4 * base.bwd_rows}) for warps in (4, 8, 16)
            if warps * 32 * (16 // dt.itemsize) <= rows * base.bwd_block_n]  # a 16-byte vector per thread at least
        for m in ms:
            x, dy, dx, w, dw = rotated_bwd_inputs(m, n, dt)
            ref = None
            for fields in [None] + variants:
                if fields is None:
                    warps = norm.bwd_num_warps(base, DwPlan.from_shape(m, n, dt).rows_per_partial, True)
                    label = f"today rows={base.bwd_rows} warps={warps}"
                else:
                    use_config(**fields)
                    label = str(fields)
                us, ok = time_checked_bwd(x, dy, w, dx, dw)  # leaves this config's dx of set 0 in dx[0]
                same = "" if ref is None or torch.equal(dx[0], ref) else " bits differ"
                ref = dx[0].clone() if ref is None else ref
                print(f"bwdm {dname} N={n} M={m} {label} {us:.2f}us {pct(3 * m * n * dt.itemsize, us, copy):.0f}%"
                      f"{'' if ok else ' WRONG'}{same}", flush=True)
                NormConfig.from_shape = staticmethod(base_from_shape)
            del x, dy, dx


def tune_fwd_by_m(copy, cases="bf16:256,bf16:512,bf16:1024,fp32:256", ms=(1024, 4096, 16384, 32768, 65536)):
    """Forward and add+norm tiles of short rows per M, dtype:N,...[;M,...] (fwdm=CASES): today's
    config, then rows x warps, each variant's y (and add+norm's y and residual_out) compared bit
    for bit with today's on the same inputs ("bits differ": a layout a choice by M must not take)."""
    for dname, dt, n, ms in _shapes_by_m(cases, ms):
        base = base_from_shape(n, dt)
        vec = 16 // dt.itemsize
        variants = [dict(rows=rows, num_warps=warps) for rows in (base.rows, 2 * base.rows, 4 * base.rows,
                                                                  8 * base.rows)
                    for warps in (1, 2, 4, 8, 16) if warps * 32 * vec <= rows * base.block_n]
        for m in ms:
            sets = rotation(4 * m * n * dt.itemsize)
            xs = [torch.randn(m, n, device="cuda", dtype=dt) for _ in range(sets)]
            ress = [torch.randn_like(x) for x in xs]
            y, res_out, w = torch.empty_like(xs[0]), torch.empty_like(xs[0]), torch.randn(n, device="cuda", dtype=dt)
            ref_fp32 = torch.nn.functional.rms_norm(xs[0].float(), (n,), w.float(), 1e-6)
            ref = None
            for fields in [None] + variants:
                if fields is not None:
                    use_config(**fields)
                y.fill_(float("nan"))
                rms_norm_fwd(xs[0], w, y, 1e-6, 0.0)
                ok = torch.allclose(y.float(), ref_fp32, rtol=1 / 128, atol=1e-2)
                y_add, r_add = torch.full_like(y, float("nan")), torch.full_like(y, float("nan"))
                rms_norm_fwd(xs[0], w, y_add, 1e-6, 0.0, ress[0], r_add)
                outs = (y.clone(), y_add, r_add)
                same = "" if ref is None or all(torch.equal(a, b) for a, b in zip(outs, ref)) else " bits differ"
                ref = outs if ref is None else ref
                fwd = graph_time_us(lambda i: rms_norm_fwd(xs[i % sets], w, y, 1e-6, 0.0))
                add = graph_time_us(lambda i: rms_norm_fwd(xs[i % sets], w, y, 1e-6, 0.0, ress[i % sets], res_out))
                label = f"today rows={base.rows} warps={base.num_warps}" if fields is None else str(fields)
                print(f"fwdm {dname} N={n} M={m} {label} fwd {fwd:.2f}us "
                      f"{pct(2 * m * n * dt.itemsize, fwd, copy):.0f}% "
                      f"add {add:.2f}us {pct(4 * m * n * dt.itemsize, add, copy):.0f}%{'' if ok else ' WRONG'}{same}",
                      flush=True)
                NormConfig.from_shape = staticmethod(base_from_shape)
            del xs, ress


if __name__ == "__main__":
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s")
    for what in sys.argv[1:] or ["bwd", "fwd"]:
        what, _, arg = what.partition("=")
        tune = {"bwd": tune_bwd, "fwd": tune_fwd, "chunk": tune_chunk, "dw": tune_dw, "fp32": tune_fp32,
                "split": tune_split, "bwdsplit": tune_bwd_split, "wide": tune_wide, "bwdm": tune_bwd_by_m,
                "fwdm": tune_fwd_by_m, "exchange": tune_exchange,
                "bwdbase": lambda c, *a: tune_bwd_by_m(c, *a, base_only=True)}[what]
        if arg and what not in ("bwd", "fwd", "bwdsplit", "dw", "bwdm", "bwdbase", "fwdm", "exchange"):
            sys.exit(f"{what} takes no argument (only bwd=[dtype:]M:N,..., fwd=[dtype:]M:N,..., bwdsplit=dtype:N,... and "
                     "dw=dtype:M:N,..., bwdm=/bwdbase=/fwdm=dtype:N,...[;M,...], exchange=dtype:N:M,...;...)")
        tune(copy, arg) if arg else tune(copy)
