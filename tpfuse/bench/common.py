"""Shared benchmark utilities: the run header, rank processes, CUDA-graph timing (alone and
across ranks), copy bandwidth, inputs, bit comparison, output files."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KiB, MiB = 1024, 1024 * 1024
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CALLS_PER_GRAPH, REPEATS, MIN_SAMPLE_MS = 20, 5, 20.0
"""Collective timing (``collective_graph_us``); scripts/tune_allreduce.py lowers the last two."""


def _commit() -> str:
    """The tpfuse commit under test: TPFUSE_COMMIT when set ("unknown" unless it holds a
    commit id: the GPU machine's copy of the tree may carry a stale git history, so
    scripts/device_check.sh sets it and never reads that history), else the git checkout that
    holds this package (with "+dirty" for local changes under tpfuse/), else "unknown"."""
    env = os.environ.get("TPFUSE_COMMIT", "").strip()
    if env:
        return env if re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", env) else "unknown"
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
        if torch.cuda.device_count() > 1:
            header["topology"] = gpu_topology()
    return header


def gpu_topology() -> str:
    """How the GPUs are linked, as ``nvidia-smi topo -m``'s first GPU row says (e.g. "GPU0 X
    NV18 NV18 NV18"), or "unknown"."""
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    rows = [line.split() for line in text.splitlines() if line.startswith("GPU0")]
    return " ".join(rows[0][:1 + torch.cuda.device_count()]) if rows else "unknown"


def collective_header(comm) -> dict:
    """``run_header`` and what a collective's timings depend on beyond the commit: the world
    size and the knobs of ``comm`` (a Communicator; the defaults, or a table's)."""
    return run_header() | {"world_size": comm.world_size, "knobs": comm.knobs.as_dict()}


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
    """Write ``name.json`` (header + one record per measurement) and ``name.md``, each whole (a
    temporary file renamed over it): a run killed while rewriting them (``tpfuse tune`` writes
    them after each sweep) leaves the previous ones."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")
    for path, text in ((json_path, json.dumps({"header": header, "records": records}, indent=1)), (md_path, markdown)):
        with open(f"{path}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)
    return json_path, md_path


def gpu_only_flags(parser, opts: dict, names: list[str]) -> list[str]:
    """The flags among ``names`` (option dests) that ``opts`` sets away from ``parser``'s
    defaults: on CPU, where those options do not apply, the check says so rather than
    ignoring them silently."""
    return [f"--{name.replace('_', '-')}" for name in names if opts.get(name) != parser.get_default(name)]


def cpu_check_intro(what: str, gpu_only: list[str]) -> None:
    """The opening line of every benchmark's CPU check (the same words in each)."""
    note = f"; {', '.join(gpu_only)} apply to GPU runs only" if gpu_only else ""
    print(f"CPU check: {what}{note}", flush=True)


def cpu_check_verdict(ok: bool) -> None:
    """The closing line of every benchmark's CPU check."""
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)


def header_markdown(title: str, header: dict) -> str:
    """A results file's title and header line; knobs by their source (the JSON has them all)."""
    fields = ", ".join(f"{k} {v['source'] if k == 'knobs' and isinstance(v, dict) else v}" for k, v in header.items())
    return f"# {title}\n\n{fields}\n\n"


# ---- collectives: rank processes and timing agreed over the ranks


def spawn_ranks(worker, world: int, opts: dict) -> int:
    """Run ``worker(rank, world, port, opts)`` in ``world`` spawned processes, port that of the
    process group's store, which this process holds (``init_rank`` joins it); 0 when every
    rank returns, else 1 after printing the failure."""
    # Bound here to a port the system picks, and held while the ranks run: a port found free,
    # released and bound again by rank 0 could be taken meanwhile by another process.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.spawn(_rank_main, args=(worker, world, store.port, opts), nprocs=world, join=True)
    # The two kinds of ProcessException: torch.multiprocessing does not export the base class.
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


def _rank_main(rank: int, worker, world: int, port: int, opts: dict) -> None:
    """A spawned rank: ``worker``, then an exit that skips the interpreter's finalization.
    A worker's exception propagates (mp.spawn reports it, exit code 1). After a normal return
    every result has been checked and written, but finalization can still abort the process:
    CI saw gloo ranks die there with SIGABRT ("terminate called without an active exception",
    benchmarks/NOTES.md), as C++ threads and objects of the process group outlive the Python
    objects they reference. os._exit leaves without running any of it."""
    import multiprocessing.util

    worker(rank, world, port, opts)
    sys.stdout.flush()
    sys.stderr.flush()
    # multiprocessing's own exit step, which unlinks the named semaphores this rank made (tqdm,
    # used by torch.compile, makes one): skipped, they are reported as leaked at exit.
    multiprocessing.util._run_finalizers(0)
    os._exit(0)


def run_workers(gpu_worker, cpu_worker, opts: dict) -> int:
    """Run a collective benchmark where it can run: as this torchrun rank, on every visible
    GPU (2 or more, one spawned process each), or else as two CPU ranks under Triton's
    interpreter (``cpu_worker``, a correctness check). Returns the exit code."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        gpu_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, opts)
        return 0
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ngpu >= 2:
        return spawn_ranks(gpu_worker, ngpu, opts)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the spawned ranks (they inherit it) run the kernels on CPU
    try:
        return spawn_ranks(cpu_worker, 2, opts)
    finally:  # not for what this process runs next (a TP=1 GPU decode, say)
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def init_rank(rank: int, world: int, port: int | None, backend: str) -> None:
    """Join the benchmark's process group: "nccl" on GPU LOCAL_RANK (default: rank), or
    "gloo" on CPU; port: that of ``spawn_ranks``' store, None for torchrun's environment."""
    init = dict(init_method="env://") if port is None else dict(store=dist.TCPStore("127.0.0.1", port))
    if backend == "gloo":
        dist.init_process_group("gloo", rank=rank, world_size=world, **init)
        return
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local), **init)


def agreed_max(value: float) -> float:
    """The largest ``value`` over the ranks (a collective: on the GPU for NCCL, on CPU for gloo)."""
    device = "cpu" if dist.get_backend() == "gloo" else "cuda"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def collective_graph_us(fn, rot: int) -> float:
    """Microseconds per call of ``fn(i)``, CALLS_PER_GRAPH calls captured in one graph; every
    rank replays the same number of times (a collective must), starting together; slowest
    rank's median."""
    return graph_time_us(lambda i: fn(i % rot), CALLS_PER_GRAPH, REPEATS, MIN_SAMPLE_MS, agree=agreed_max,
                         capture_error_mode="thread_local")  # NCCL's watchdog thread keeps running


def random_inputs(numel: int, dtype: torch.dtype, world: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Every rank's input (the same on every rank, from the seed), never zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(numel, generator=g, device=device).to(dtype) for _ in range(world)]


def layer_inputs(tokens: int, hidden: int, world: int, device: str, seed: int):
    """Every rank's x ([tokens, hidden] bf16), one residual and a weight ([hidden]) for the
    fused all-reduce + RMSNorm (the same on every rank, from the seed)."""
    g = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16) for _ in range(world)]
    residual = (torch.randn(tokens, hidden, generator=g, device=device) * 4).to(torch.bfloat16)
    weight = (torch.rand(hidden, generator=g, device=device) + 0.5).to(torch.bfloat16)
    return xs, residual, weight


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bytes (a copy first: a strided view, such as per-group fp8 scales,
    has no byte view)."""
    def raw(t):
        return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)

    return a.shape == b.shape and torch.equal(raw(a), raw(b))


def fmt_size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


class SymmMemAllReduce:
    """torch's own symmetric-memory all-reduce ops on one registered buffer (the peer we
    compare with; tpfuse itself reaches symmetric memory only through tpfuse.comm)."""

    def __init__(self, nbytes: int, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buf = symm_mem.empty(nbytes // dtype.itemsize, dtype=dtype, device="cuda")
        symm_mem.rendezvous(self.buf, group)

    def oneshot(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", self.group_name)

    def twoshot(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", self.group_name)


FLASHINFER_MAX_BYTES = 32 * MiB
"""The FlashInfer peer's workspace: 2048 tokens of hidden 8192 in bf16 (vLLM hands FlashInfer
decode and small prefill batches)."""


class FlashInferAllReduce:
    """FlashInfer's all-reduce kernels (``flashinfer.comm.allreduce_fusion``: TensorRT-LLM's
    one-/two-shot kernels, what vLLM's all-reduce + RMSNorm fusion pass calls) as a peer: the
    plain all-reduce (pattern kAllReduce) and all-reduce + residual add + RMSNorm
    (kARResidualRMSNorm), fp32 accumulation, FlashInfer's own one-/two-shot choice.

    ``create`` returns None where flashinfer cannot be imported or its workspace not made,
    on any rank (that rank prints why). The workspace is FlashInfer's "trtllm" backend, named
    explicitly: its "auto" may pick the NVLink-multicast backend, which tpfuse never uses
    (the "trtllm" one maps peer memory without multicast). It holds FLASHINFER_MAX_BYTES;
    FlashInfer serves any [tokens, hidden] call whose elements fit it (``fits``). Every rank
    calls every method (collectives)."""

    def __init__(self, fc, version: str, dtype: torch.dtype):
        self.fc, self.version = fc, version
        self.capacity = FLASHINFER_MAX_BYTES // dtype.itemsize  # elements
        hidden = 4096  # FlashInfer sizes its workspace by max_token_num * hidden_dim only
        self.workspace = fc.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=dist.get_world_size(), rank=dist.get_rank(),
            max_token_num=self.capacity // hidden, hidden_dim=hidden, dtype=dtype)

    @classmethod
    def create(cls, dtype: torch.dtype) -> "FlashInferAllReduce | None":
        peer = None
        try:
            import flashinfer
            import flashinfer.comm as fc

            peer = cls(fc, flashinfer.__version__, dtype)
        except Exception as e:  # noqa: BLE001  not installed, or no kernels for this machine: measure the rest
            print(f"flashinfer unavailable ({type(e).__name__}: {e}); its column stays empty", flush=True)
        # A peer that only some ranks have would leave the others' kernels polling for ever, so
        # it is used only where every rank has one (a workspace made on one rank alone is left
        # as it is: FlashInfer's destroy waits on every rank).
        if dist.is_initialized() and agreed_max(float(peer is None)) > 0:
            return None
        return peer

    def fits(self, numel: int) -> bool:
        return numel <= self.capacity

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out ([tokens, hidden]) = the sum over ranks of x (same shape)."""
        self.fc.allreduce_fusion(input=x, workspace=self.workspace, pattern=self.fc.AllReduceFusionPattern.kAllReduce,
                                 output=out, fp32_acc=True)
        return out

    def add_rms_norm(self, x, residual, weight, eps, y, residual_out):
        """residual_out = all_reduce(x) + residual, y = rms_norm(residual_out) * weight, into
        the given [tokens, hidden] tensors."""
        self.fc.allreduce_fusion(input=x, workspace=self.workspace,
                                 pattern=self.fc.AllReduceFusionPattern.kARResidualRMSNorm, residual_in=residual,
                                 residual_out=residual_out, norm_out=y, rms_gamma=weight, rms_eps=eps, fp32_acc=True)
        return y, residual_out

    def add_rms_norm_fp8(self, x, residual, weight, eps, scale, q, y, residual_out):
        """residual_out = all_reduce(x) + residual, q = e4m3 of rms_norm(residual_out) *
        weight with the static ``scale`` (kARResidualRMSNormFP8Quant, as vLLM's fusion pass
        calls it; y: a scratch for the unquantized norm). Returns (q, residual_out)."""
        self.fc.allreduce_fusion(input=x, workspace=self.workspace,
                                 pattern=self.fc.AllReduceFusionPattern.kARResidualRMSNormFP8Quant,
                                 residual_in=residual, residual_out=residual_out, norm_out=y, quant_out=q,
                                 scale_factor=scale, rms_gamma=weight, rms_eps=eps, fp32_acc=True)
        return q, residual_out

    def close(self) -> None:
        self.workspace.destroy()
