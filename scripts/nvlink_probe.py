"""Raw NVLink rates between GPU 0 and GPU 1 of one process: the copy engines (peer memcpy,
one or several streams a direction) against SM kernels that store to or load from the peer
(Triton, 16-byte vectors). One direction and both at once. The question it answers: can an
all-reduce whose bytes move on the copy engines beat the SM-driven two-shot's bus bandwidth
(issue 19: >= 380 GB/s from 32 MiB at W=2; the SM two-shot reaches about 320)?

    python3 scripts/nvlink_probe.py --out DIR

Small messages are not probed: each launch is a Python call, so their time is the host's.
Rates are bytes crossing the link in one direction per second (for both directions at once,
each direction's bytes over the time both take).
"""

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from tpfuse.bench.common import run_header


@triton.jit
def _copy_kernel(SRC, DST, n, BLOCK: tl.constexpr):
    """DST[i] = SRC[i], a grid-stride loop of BLOCK-element tiles (either may be the peer's)."""
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n), mask=offs < n)


def _time_us(launch, streams, reps=20):
    """Mean us of launch() over reps, issued on `streams` (joined on the first), after warm-up."""
    s0 = streams[0]
    for _ in range(3):
        launch()
    for s in streams:
        s.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s0):
        start.record(s0)
    for s in streams[1:]:
        s.wait_event(start)
    for _ in range(reps):
        launch()
    for s in streams[1:]:
        done = torch.cuda.Event()
        done.record(s)
        s0.wait_event(done)
    end.record(s0)
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--mib", type=int, nargs="+", default=[32, 128])
    opts = p.parse_args()
    assert torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for d in (0, 1):  # a peer copy each way: torch then enables the peer access a kernel needs
        torch.ones(1, device=f"cuda:{1 - d}").copy_(torch.ones(1, device=f"cuda:{d}"))
    rows = []
    for mib in opts.mib:
        n = mib * 2**20 // 2
        src = {d: torch.randn(n, device=f"cuda:{d}").to(torch.bfloat16) for d in (0, 1)}
        dst = {d: torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{d}") for d in (0, 1)}
        streams = {d: [torch.cuda.Stream(device=d) for _ in range(4)] for d in (0, 1)}

        def ce(senders, k):  # sender d's copy engine moves src[d] into dst[1 - d], in k parts
            bounds = [(j * n // k, (j + 1) * n // k) for j in range(k)]

            def launch():
                for d in senders:
                    for j, (lo, hi) in enumerate(bounds):
                        with torch.cuda.stream(streams[d][j]):
                            dst[1 - d][lo:hi].copy_(src[d][lo:hi], non_blocking=True)
            return launch, [streams[d][j] for d in senders for j in range(k)]

        def sm(senders, runner, ctas):  # src[d] into dst[1 - d], by GPU d's SMs (push) or 1 - d's (pull)
            def launch():
                for d in senders:
                    g = d if runner == "push" else 1 - d
                    with torch.cuda.device(g), torch.cuda.stream(streams[g][0]):
                        _copy_kernel[(ctas,)](src[d], dst[1 - d], n, BLOCK=4096, num_warps=8)
            return launch, [streams[d if runner == "push" else 1 - d][0] for d in senders]

        cases = {}
        for senders, tag in (((0,), "one way"), ((0, 1), "both ways")):
            for k in (1, 2, 4):
                cases[f"copy engine, {k} stream(s), {tag}"] = senders, ce(senders, k)
            for runner in ("push", "pull"):
                for mult in (1, 2, 4):
                    cases[f"SM {runner}, {mult * sms} CTAs, {tag}"] = senders, sm(senders, runner, mult * sms)
        for name, (senders, (launch, used)) in cases.items():
            for d in (0, 1):
                dst[d].fill_(float("nan"))
            us = _time_us(launch, used)
            exact = all(torch.equal(dst[1 - d].cpu(), src[d].cpu()) for d in senders)
            rows.append(dict(mib=mib, case=name, us=round(us, 1), gbps_per_direction=round(n * 2 / us / 1e3, 1),
                             exact=exact))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(opts.out, "nvlink_probe.json"), "w") as f:
        json.dump(dict(header=run_header(), records=rows), f, indent=1)


if __name__ == "__main__":
    main()
