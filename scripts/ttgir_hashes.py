"""Hashes of tpfuse's kernels' sm_90 TTGIR, compiled on any machine (no GPU), through the real
launchers with the plans' arguments: the norm forward and backward, the all-reduce (one-shot
over flags, LL words and Lamport words; two-shot, push and pull), the fused all-reduce + RMSNorm
(each protocol, and two-shot), the quantized all-reduce, the codecs and quant_fp8.

A refactor that should not change the generated code proves it: run this before and after and
compare (source locations and value names are left out of the hashes).

    python scripts/ttgir_hashes.py > before.json   # ... change ..., run again, diff

TTGIR_WORLD=2 compiles the collectives for 2 ranks instead of 4.
"""

import dataclasses
import hashlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
sys.argv = sys.argv[:1] + ["[]"]  # sm90_layouts reads its cases from argv
import sm90_layouts as S  # noqa: E402  (imports tpfuse in its GPU mode and intercepts launches)
import torch  # noqa: E402

from tpfuse.comm import knobs_for  # noqa: E402
from tpfuse.comm.plan import AllReducePlan  # noqa: E402
from tpfuse.comm.quant_plan import QuantPlan  # noqa: E402
from tpfuse.comm.workspace import WorkspaceLayout  # noqa: E402
from tpfuse.kernels import codecs  # noqa: E402
from tpfuse.kernels.allreduce import all_reduce_into  # noqa: E402
from tpfuse.kernels.quant_allreduce import quant_all_reduce_into  # noqa: E402
from tpfuse.kernels import quant_fp8 as quant_fp8_module  # noqa: E402
from tpfuse.kernels.quant_fp8 import quant_fp8_into  # noqa: E402
from tpfuse.quant_format import QUANT_CODECS  # noqa: E402

WORLD = int(os.environ.get("TTGIR_WORLD", "4"))
KNOBS = knobs_for(WORLD)  # the package's table for any GPU model (w4.json) over the defaults
LAYOUT = WorkspaceLayout(WORLD, 1 << 24, 128, ll_max_bytes=1 << 24, lamport_max_bytes=1 << 24, rows_max_bytes=1 << 24)
PEERS = S.peers(LAYOUT)


def _hash(ttgir: str) -> str:
    # Source locations (nested in call sites) and SSA value names say nothing about the code.
    ttgir = re.sub(r"%[A-Za-z_]\w*", "%v", re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", ttgir))
    return hashlib.sha1("\n".join(line for line in ttgir.splitlines() if not line.startswith("#loc")).encode()).hexdigest()


def _launches(launch) -> list:
    S._launches.clear()
    launch()
    return list(S._launches)


def main() -> None:
    hashes = {}

    def record(name, launch):
        for i, (kernel, kwargs) in enumerate(_launches(launch)):
            hashes[f"{name}:{i}:{kernel.fn.__name__}"] = _hash(S._ttgir(kernel, kwargs))

    for dtype, n, rows in (("bf16", 4096, 5), ("fp32", 2880, 64), ("bf16", 20000, 1)):
        case = dict(dtype=dtype, n=n, rows=rows, weight="same")
        for kernel_name in ("forward", "backward"):
            kernel, kwargs = S._norm_kernel_launch(dict(case, kernel=kernel_name))
            hashes[f"norm_{kernel_name}:{dtype}:{n}:{rows}"] = _hash(S._ttgir(kernel, kwargs))
        compiled = []  # what layouts_for compiles: the norm forward, then each fused kernel
        ttgir = S._ttgir
        S._ttgir = lambda kernel, kwargs: compiled.append((kernel.fn.__name__, ttgir(kernel, kwargs))) or compiled[-1][1]
        try:
            S.layouts_for(dict(case, world=WORLD))
        finally:
            S._ttgir = ttgir
        for i, (name, text) in enumerate(compiled):
            hashes[f"fused_case:{dtype}:{n}:{rows}:{i}:{name}"] = _hash(text)
    for dtype in (torch.bfloat16, torch.float32):
        for nbytes, algo, protocol in ((8192, "oneshot", "ll"), (1 << 18, "oneshot", "lamport"),
                                       (1 << 19, "oneshot", "flags"), (1 << 22, "twoshot", "flags")):
            numel = nbytes // dtype.itemsize
            plan = AllReducePlan.from_numel(numel, dtype, LAYOUT, KNOBS, algo)
            x, out = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            for gather in (("push", "pull") if algo == "twoshot" else ("push",)):
                launch = dataclasses.replace(plan, gather=gather, protocol=protocol if algo == "oneshot" else "flags")
                record(f"allreduce_{algo}_{protocol}_{gather}:{dtype}",
                       lambda: all_reduce_into(x, out, launch, PEERS))  # noqa: B023
    for codec in QUANT_CODECS:
        x, packed = torch.empty(1 << 20, dtype=torch.bfloat16), torch.empty(1 << 20, dtype=torch.uint8)
        record(f"quantize:{codec}", lambda: codecs.quantize_into(x, packed, codec))  # noqa: B023
        record(f"dequantize:{codec}", lambda: codecs.dequantize_into(packed, codec, x))  # noqa: B023
        plan = QuantPlan.for_layout(LAYOUT, torch.bfloat16, codec, KNOBS)
        seg = plan.segments(x.numel())[0]
        record(f"quant_allreduce:{codec}", lambda: quant_all_reduce_into(  # noqa: B023
            x[:seg.numel], x[:seg.numel], plan, seg, PEERS))
    y, q = torch.empty(4, 4096, dtype=torch.bfloat16), torch.empty(4, 4096, dtype=torch.float8_e4m3fn)
    modes = (("tensor", torch.ones(1)), ("token", torch.empty(4, 1)), ("group", torch.empty(32, 8).t()[:4]))
    for mode, scales in modes:
        record(f"quant_fp8:{mode}", lambda: quant_fp8_into(y, q, scales, mode, 128))  # noqa: B023
    quant_fp8_module.hardware_e4m3 = lambda device: True  # as on sm_89+: the hardware conversion
    record("quant_fp8:group:hardware_e4m3", lambda: quant_fp8_into(y, q, scales, "group", 128))
    print(json.dumps(hashes, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
