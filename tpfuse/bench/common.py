"""Shared benchmark utilities: the run header, CUDA-graph timing, copy bandwidth, output files."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
from typing import Callable

import torch


def _commit() -> str:
    """The tpfuse commit under test: TPFUSE_COMMIT when it holds a commit id (the GPU
    machine gets a copy of the tree without git history, so scripts/device_check.sh passes
    it in), else the git checkout that holds this package (with "+dirty" for local changes
    under tpfuse/), else "unknown"."""
    env = os.environ.get("TPFUSE_COMMIT", "").strip()
    if re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", env):
        return env
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             cwd=package_root, check=True).stdout.strip()
        if os.path.realpath(top) != os.path.realpath(package_root):
            return "unknown"  # installed inside some other repository
        commit = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True,
                                cwd=package_root, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tpfuse"], capture_output=True, text=True,
                               cwd=package_root, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def run_header() -> dict:
    """What a result file must carry to be reproducible: machine, versions, commit, date."""
    import triton

    commit = _commit()
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if torch.cuda.is_available():
        header["gpu"] = torch.cuda.get_device_name()
        header["gpu_count"] = torch.cuda.device_count()
        header["cuda"] = torch.version.cuda
        nccl = torch.cuda.nccl.version()
        header["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return header


def graph_time_us(fn: Callable[[int], object], calls_per_graph: int = 20, repeats: int = 5,
                  min_replay_ms: float = 20.0, stream: torch.cuda.Stream | None = None, *,
                  agree: Callable[[float], float] | None = None, capture_error_mode: str = "global") -> float:
    """Median microseconds per call of ``fn(i)`` (i = call index, for rotating inputs),
    captured ``calls_per_graph`` times in one CUDA graph and replayed.

    The decode path of serving engines is graph-replayed, so launch overhead is measured the
    way it is paid there. Each timed sample replays the graph enough times to last at
    least ``min_replay_ms``. ``stream`` is the warm-up and capture stream: pass the one that
    ran the forward when ``fn`` runs an autograd backward (the backward runs on the forward's
    stream, which must be the capturing one).

    For collectives, ``agree`` is a maximum over the ranks (every rank calls it alike): the
    ranks then replay the same number of times (the largest any rank wants), line up before
    each timed sample, and the slowest rank's median is returned. ``capture_error_mode`` is
    ``torch.cuda.graph``'s ("thread_local" lets another thread, e.g. NCCL's watchdog, keep
    running during capture).
    """
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up: compilation, allocator, workspace set-up
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode=capture_error_mode):
        for i in range(calls_per_graph):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1.0, min_replay_ms / max(start.elapsed_time(end), 1e-3))
    replays = int(replays if agree is None else agree(replays))
    samples = []
    for _ in range(repeats):
        if agree is not None:
            agree(0.0)  # line the ranks up
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * calls_per_graph))
    del graph
    median = statistics.median(samples)
    return median if agree is None else agree(median)


def copy_bandwidth_gbps(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second), the ceiling
    that bandwidth-bound kernels are reported against.

    Timed eagerly with events: inside a CUDA graph a copy becomes a memcpy node run by the
    copy engines, which on H200 reach only about 2.7 TB/s against 4.2+ TB/s for SM copies.
    """
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):  # let the clocks ramp up: the first copies after idle run slow
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(samples) / 1e9


def rotation(nbytes_per_set: int, l2_bytes: int = 60 << 20) -> int:
    """How many input sets to rotate through so repeated calls do not measure the L2 cache."""
    return 1 if nbytes_per_set >= 4 * l2_bytes else min(16, -(-4 * l2_bytes // max(nbytes_per_set, 1)))


def write_results(out_dir: str, name: str, header: dict, records: list[dict], markdown: str) -> tuple[str, str]:
    """Write ``name.json`` (header + one record per measurement) and ``name.md``."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")
    with open(json_path, "w") as f:
        json.dump({"header": header, "records": records}, f, indent=1)
    with open(md_path, "w") as f:
        f.write(markdown)
    return json_path, md_path


def header_markdown(title: str, header: dict) -> str:
    fields = ", ".join(f"{k} {v}" for k, v in header.items())
    return f"# {title}\n\n{fields}\n\n"
