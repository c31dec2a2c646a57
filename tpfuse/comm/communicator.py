"""Communicator: exact all-reduce (and fused all-reduce + RMSNorm) over peer memory, with the
group's backend as fallback."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import logging
import socket
import weakref

import torch
import torch.distributed as dist

from tpfuse import _runtime
from tpfuse.comm import collective_ops
from tpfuse.comm import tables
from tpfuse.comm.knobs import Knobs
from tpfuse.comm.ledger import MISMATCH, CallLedger, LedgerUnavailable, PeersLate, RecordedFailure
from tpfuse.comm.peer_memory import PeerMemory, PeerMemoryUnavailable
from tpfuse.comm.plan import (AllReducePlan, FusedPlan, SequenceParallelPlan, check_algo, check_fused_algo,
                             workspace_layout)
from tpfuse.comm.quant_plan import QuantPlan, check_quant
from tpfuse.comm.workspace import CTRL_ABORT, WorkspaceLayout
from tpfuse.kernels.allreduce import OP_NAMES, all_reduce_into
from tpfuse.fp8_ops import check_fp8_args, fp8_outputs
from tpfuse.kernels.fused import all_reduce_norm_into
from tpfuse.kernels.quant_fp8 import Fp8Output
from tpfuse.kernels.sequence_parallel import all_gather_into, reduce_scatter_norm_into
from tpfuse.kernels.quant_allreduce import quant_all_reduce_into
from tpfuse.kernels.norm import rms_norm_fwd
from tpfuse.kernels.peer import PeerContext
from tpfuse.kernels.sync import STATUS_WORDS, decode_status
from tpfuse.norm_ops import check_norm_args

MAX_WORLD_SIZE = 8

logger = logging.getLogger("tpfuse.comm")

MiB = 1024 * 1024
DEFAULT_MAX_BYTES = {"cuda": 16 * MiB, "cpu": 1 * MiB}
"""Largest two-shot message by default; the workspace is about 4x this per rank (64 MiB on
GPUs). On CPU the interpreter moves a few MB/s, and /dev/shm is often small in containers."""
MAX_MAX_BYTES = 512 * MiB
"""Keeps every element offset inside a data region below 2**31 (the kernels use int32)."""


class CommError(RuntimeError):
    """A collective failed across ranks (the base of tpfuse.comm's own errors)."""


class CommTimeoutError(CommError):
    """A peer did not arrive within ``timeout_s``; the communicator is unusable afterwards.

    Attributes: rank (the rank that gave up), peer (the first rank it waited for in vain),
    op (the operation), epoch (the call number, counted from 1 per communicator).
    """

    def __init__(self, op: str, rank: int, peer: int, epoch: int, timeout_s: float):
        super().__init__(f"rank {rank} waited {timeout_s:g} s for rank {peer} in {op} (call {epoch}); "
                         "the peer crashed, is stuck, or the ranks' call sequences differ. "
                         "This communicator cannot be used any more")
        self.op, self.rank, self.peer, self.epoch = op, rank, peer, epoch


class CallMismatchError(CommError):
    """Two ranks made different calls at the same point of their call sequences (another
    dtype, element count, algorithm, codec or norm argument): raised on every rank, the
    mismatched call returns no numbers (where a rank's kernel was already waiting for it, its
    output is NaN), and the communicator is unusable afterwards.

    Attributes: rank (this rank), call (the number of the call on the host, from 1: every
    call, eager or captured into a CUDA graph, counts one), ranks (the two ranks whose calls
    differ), texts (their descriptions).
    """

    def __init__(self, rank: int, found: RecordedFailure):
        super().__init__(f"the ranks disagree on call {found.call}: rank {found.rank} made it as "
                         f"{found.rank_text!r}, rank {found.peer} as {found.peer_text!r} (raised on rank {rank}). "
                         "Every rank must make the same calls in the same order, with the same shapes, dtypes, "
                         "algorithms and arguments. This communicator cannot be used any more")
        self.rank, self.call = rank, found.call
        self.ranks, self.texts = (found.rank, found.peer), (found.rank_text, found.peer_text)


class Communicator:
    """Exact all-reduce among the ranks of a process group on one node.

    ``Communicator(group=None, *, max_bytes=None, timeout_s=30.0, knobs=None)`` is collective:
    every rank of ``group`` (default: the world group) constructs it, with the same arguments.
    ``knobs`` (``tpfuse.comm.Knobs``, at the group's world size) are the settings its plans
    read, fixed for its lifetime (``self.knobs``); by default the measured table of this GPU
    model and world size over the defaults (``tpfuse.comm.knobs_for``). Every rank must have
    the same knobs: the constructor checks. It
    allocates its peer workspace once (``workspace_bytes`` per rank, about 4 * max_bytes, plus
    2 * world_size slots of the larger of twice the LL messages' and the Lamport messages' bytes
    and one more of the larger for the fused kernel's rows, and 3 * world_size slots of the
    row-wise fused kernel's largest message, ``plan.workspace_layout``: at W=4 69 MiB in all
    under the table for any GPU, whose Lamport words go to 512 KiB, and 73 MiB under H100's, to
    1 MiB; 104 MiB at W=2, whose table has Lamport words to 8 MiB and row-wise calls to 64 KiB);
    ``max_bytes`` defaults to 16 MiB on GPUs, 1 MiB on CPU). ``close()`` releases it (local,
    after the rank's last call); the communicator is also a context manager. One dropped
    without ``close()`` releases it when collected (locally), unless its ops were captured
    into a CUDA graph: the graph's kernels use the workspace, so it is held until ``close()``.

    Arrival is bounded by ``timeout_s``: a rank that does not arrive in time makes the
    constructor raise ``CommError`` naming it on every rank that did (and on the late rank
    when it comes). A rank that raises or dies during the construction's collective steps
    makes the others raise ``CommError`` where the backend reports it (gloo: at once; a rank
    stuck there holds the others for the process group's own timeout). A failed construction
    leaves no peer memory mapped and no file in /dev/shm.

    Devices: CUDA tensors (NCCL or any group; peer memory from torch symmetric memory), or
    CPU tensors under Triton's interpreter (gloo group; peer memory in /dev/shm).

    The group's backend (``torch.distributed.all_reduce``) serves a call instead, logged
    once per reason on the ``tpfuse.comm`` logger, when the message exceeds the workspace,
    the ranks cannot map each other's memory, the group spans nodes or has more than 8 ranks.

    Streams: a communicator's calls must run one after another on the device. Calls from
    one thread on different streams are ordered for you (a call on another stream than the
    last one waits for that stream); a captured graph runs on the stream it is replayed on, so
    replay it on the stream of the eager calls (or order the streams yourself). Concurrent
    calls from several threads are not supported; communicators over different groups run
    concurrently on their own streams.

    CUDA graphs: a captured ``all_reduce`` replays correctly any number of times, interleaved
    with eager calls and other graphs, because the call counter lives in device memory and is
    advanced by the kernels. Run each (dtype, algorithm) once eagerly before capturing, so
    that Triton compiles outside the capture.

    Ranks that disagree on a call: before launching a call, each rank writes down what it is
    (operation, dtype, element count, plan, codec, norm arguments) in a ledger in host memory
    shared by the group's ranks, and compares it with its peers' (``tpfuse.comm.ledger``; a
    group spanning nodes has none). A difference raises ``CallMismatchError`` on the rank
    that finds it, before it launches anything; the other ranks raise it at their next call
    or ``check()``, and a kernel of theirs already waiting for the missing call stops at once
    and writes NaN into its output. Before a call of the group's backend (``algo="nccl"``,
    fallbacks), a rank waits until every peer has posted the same call, at most ``timeout_s``:
    no rank enters NCCL while another launches a peer kernel. CUDA graph replays run no host
    code and are not compared; the captures were.

    Errors in the kernels: a wait for a peer that does not arrive within ``timeout_s`` ends
    the kernel and records the rank, the peer and the operation. Under the interpreter the
    call raises ``CommTimeoutError`` itself. On GPUs the kernel cannot raise: the record is
    in host memory and is checked at the start of every ``all_reduce`` (so the next call
    raises once the failed kernel has finished) and by ``check()``, which synchronizes the
    device first. After an error every call raises.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, max_bytes: int | None = None,
                 timeout_s: float = 30.0, knobs: Knobs | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Communicator needs torch.distributed to be initialized (init_process_group)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        self.device = (torch.device("cpu") if _runtime.INTERPRETER
                       else torch.device("cuda", torch.cuda.current_device()))
        if max_bytes is None:
            max_bytes = DEFAULT_MAX_BYTES[self.device.type]
        if not isinstance(max_bytes, int) or not 0 < max_bytes <= MAX_MAX_BYTES:
            raise ValueError(f"max_bytes must be an int in (0, {MAX_MAX_BYTES}], got {max_bytes!r}")
        self.max_bytes = max_bytes
        if knobs is None:
            knobs = tables.knobs_for(self.world_size,
                                     torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        if error := self._knob_error(knobs):
            raise ValueError(error)
        self._knobs = knobs
        self.layout: WorkspaceLayout | None = None
        self._peer: PeerMemory | None = None
        self._failure: Exception | None = None
        self._ledger: CallLedger | None = None
        self._closed = False
        self._logged: set[str] = set()
        self._on_close: list = []
        self._last_stream: torch.cuda.Stream | None = None
        self.fallback_reason = ""
        """Why no peer workspace exists (empty when one does, or when world_size is 1)."""
        if self.world_size > 1:
            _arrive(self.group, self.rank, self.world_size, self.timeout_s)
            try:
                self._setup()
            except (ValueError, CommError, torch.OutOfMemoryError):
                raise
            except RuntimeError as e:  # a collective step failed: a peer died or gave up
                raise CommError(f"rank {self.rank}: creating the Communicator failed in a collective step "
                                f"({type(e).__name__}: {e}); a peer rank probably failed or exited") from e
        self.group_name = collective_ops.register(self, self.group.group_name)
        """This communicator's name for the ``torch.ops.tpfuse`` collectives (``tpfuse.comm.collective_ops``)."""

    def _setup(self) -> None:
        peers = [None] * self.world_size
        # Ranks whose knobs differ (other tables, or other knobs passed) would pick different
        # algorithms and layouts.
        knobs = json.dumps(self.knobs.as_dict(), sort_keys=True)
        dist.all_gather_object(peers, (socket.gethostname(), self.max_bytes, knobs), group=self.group)
        if len({m for _, m, _ in peers}) > 1:
            raise ValueError(f"every rank must pass the same max_bytes; got {[m for _, m, _ in peers]}")
        if len({k for _, _, k in peers}) > 1:
            raise ValueError("every rank must have the same knobs (the same tables in tpfuse/comm/tables, or "
                             f"TPFUSE_TABLE_DIR on every rank alike, or the same knobs=); the ranks': "
                             f"{[k for _, _, k in peers]}")
        hosts = sorted({h for h, _, _ in peers})
        if len(hosts) == 1:  # the ledger is host memory of the node
            try:
                self._ledger = CallLedger(self.group, self.rank, self.world_size, self.timeout_s)
                weakref.finalize(self, self._ledger.close)
            except LedgerUnavailable as e:  # raised on every rank alike
                self._log_once(logging.WARNING, f"tpfuse Communicator: no call ledger, so ranks that disagree on a "
                                                f"call go undetected: {e}")
        if len(hosts) > 1:
            self.fallback_reason = f"the group spans nodes {hosts}"
        elif self.world_size > MAX_WORLD_SIZE:
            self.fallback_reason = f"world size {self.world_size} > {MAX_WORLD_SIZE}"
        else:
            layout = workspace_layout(self.knobs, self.max_bytes)
            try:
                self._peer = PeerMemory(self.group, layout.total_bytes, self.device)
                self.layout = layout
            except PeerMemoryUnavailable as e:
                self.fallback_reason = str(e)
        if self._peer is None:
            self._log_once(logging.WARNING, f"tpfuse Communicator uses the group's backend for every call: "
                                            f"{self.fallback_reason}")
            return
        # Dropped without close(), the communicator still releases its mappings (locally: a
        # finalizer runs whenever this rank collects it, so it never communicates).
        self._release = weakref.finalize(self, _release_peer, self._peer, self.device)
        # The status record lives in host memory the kernels write (pinned, and so mapped
        # into the device's address space on CUDA), so the host reads it without a sync.
        self._status = torch.zeros(STATUS_WORDS, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._status_view = self._status.numpy()  # reading it costs ~100 ns, not a tensor op
        table = torch.tensor(self._peer.buffer_ptrs, dtype=torch.int64, device=self.device)
        self._peers = PeerContext(table, tuple(self._peer.buffer_ptrs), self._status.data_ptr(), self.rank,
                                  self.layout, int(self.timeout_s * 1e9))
        """What every launch takes besides its plan (``tpfuse.kernels.peer.PeerContext``)."""

    @property
    def workspace_bytes(self) -> int:
        """Bytes of peer memory this rank allocated (0 without a peer workspace)."""
        return self.layout.total_bytes if self._peer is not None else 0

    def all_reduce(self, x: torch.Tensor, *, quant: str | None = None, algo: str = "auto",
                   quant_min_bytes: int | None = None) -> torch.Tensor:
        """Sum of ``x`` over the ranks of the group, as a new contiguous tensor.

        Every rank must call it, in the same order, with the same shape, dtype and algo.
        Result: every element is the fp32 sum over the ranks in a pairwise tree
        (``(x0 + x1) + (x2 + x3)`` at 4 ranks; ``tpfuse.reference.tree_sum``), rounded once
        to x's dtype (``tpfuse.reference.all_reduce``), bitwise identical on every rank, for
        "oneshot", "twoshot" and "auto" (whichever custom algorithm or size). "nccl" (and any
        fallback to the group's backend) does not carry this contract: the backend's
        summation order is its own.

        With ``quant`` ("fp8", "int8", "int6" or "int4"), messages of at least
        ``quant_min_bytes`` bytes (default: the codec's entry of ``self.knobs.quant_min_bytes``)
        take the quantized two-shot path: each rank sends its contribution group-quantized (32
        values per scale), the owner of each chunk sums the decoded contributions in fp32 in
        the tree's order and sends the re-quantized sum, and every rank decodes the same bytes. The result is
        ``tpfuse.reference.quantized_all_reduce`` bit for bit, identical on every rank and
        deterministic, but not the exact sum: its error is within
        ``tpfuse.reference.QUANT_ERROR_BUDGET`` (relative RMS on Gaussian inputs). A group of
        32 values holding a NaN or Inf comes out NaN. Smaller messages, and every message when
        there is no peer workspace, take the exact path (as ``quant=None``). Messages larger
        than the workspace run as several launches of a fixed size (``QuantPlan``). On a
        group of one rank, x is returned (copied) whatever quant is.

        Args:
            x: bf16, fp16 or fp32 tensor of any shape, stride and alignment (non-contiguous
                or misaligned inputs are copied first) on this communicator's device. Not
                modified; the result never aliases it.
            quant: None (exact) or a codec name, as above. Every rank must pass the same.
            algo: "auto" (by size, see ``AllReducePlan``), "oneshot", "twoshot", or "nccl"
                (the group's backend). With quant set it must be "auto".
            quant_min_bytes: overrides the table's threshold for this call (needs quant).

        Raises:
            TypeError: x is not a tensor, or has an unsupported dtype.
            ValueError: x is on the wrong device, algo or quant is unknown, quant is combined
                with an algo other than "auto", or the explicit algo cannot serve this
                message (too large for the workspace, or no workspace).
            CommTimeoutError: a peer did not arrive (here or in an earlier call).
            RuntimeError: the communicator is closed or failed earlier.
        """
        self._check_args(x)
        check_algo(algo)
        check_quant(quant, quant_min_bytes)
        if quant is None:
            return torch.ops.tpfuse.all_reduce(x, self.group_name, algo)
        if algo != "auto":
            raise ValueError(f"quant={quant!r} needs algo='auto' (got {algo!r}): the quantized path picks its own "
                             "algorithm")
        return torch.ops.tpfuse.quantized_all_reduce(x, self.group_name, quant, quant_min_bytes)

    def _check_args(self, x: torch.Tensor, residual=None, weight=None, eps=1e-6, weight_offset=0.0,
                    norm=False) -> None:
        """Argument errors, raised by the methods before the op (also for devices, such as
        meta, on which the op would run its fake) and again by the ops' implementations."""
        self._check_open()
        if norm:
            check_norm_args(x, weight, eps, weight_offset, residual, fp32_partials=True)
        else:
            _runtime.check_float_tensor(x, "x")
        if x.device != self.device and self.world_size > 1:
            raise ValueError(f"x is on {x.device}, but this communicator serves {self.device}")

    def _check_input(self, x: torch.Tensor) -> None:
        self._check_usable()
        self._check_args(x)

    def _all_reduce(self, x: torch.Tensor, algo: str) -> torch.Tensor:
        """``torch.ops.tpfuse.all_reduce``'s implementation: ``all_reduce(x, algo=algo)``."""
        self._check_input(x)
        check_algo(algo)
        return self._reduce(x, algo)

    def _reduce(self, x: torch.Tensor, algo: str, posted: bool = False) -> torch.Tensor:
        """The all-reduce of checked arguments (posted: the calling operation has written
        the call into the ledger already, as its own)."""
        if self.world_size == 1:
            return x.clone(memory_format=torch.contiguous_format)
        if x.numel() == 0:
            self._post(None if posted else f"all_reduce of 0 {_name(x.dtype)}")
            return x.clone(memory_format=torch.contiguous_format)
        plan = AllReducePlan.from_numel(x.numel(), x.dtype, self.layout, self.knobs, algo)
        self._post(None if posted else f"all_reduce of {x.numel()} {_name(x.dtype)}: {_plan_text(plan)}",
                   before_backend=plan.algo == "nccl")
        if plan.algo == "nccl":
            # A silent loss of the bitwise contract would surprise: warn unless it was asked for.
            level = logging.INFO if algo == "nccl" else logging.WARNING
            self._log_once(level, f"tpfuse all_reduce uses the group's backend: {plan.reason}")
            out = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, group=self.group)
            return out
        src = _runtime.aligned_contiguous(x)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._follow_last_call()
        all_reduce_into(src, out, plan, self._peers)
        if _runtime.INTERPRETER:
            self._check_usable()
        return out

    def _quantized_all_reduce(self, x: torch.Tensor, codec: str, min_bytes: int | None) -> torch.Tensor:
        """``torch.ops.tpfuse.quantized_all_reduce``'s implementation: ``all_reduce(x, quant=codec,
        quant_min_bytes=min_bytes)``."""
        self._check_input(x)
        check_quant(codec, min_bytes)
        if self.world_size == 1:
            return x.clone(memory_format=torch.contiguous_format)
        threshold = self.knobs.quant_min(codec) if min_bytes is None else min_bytes
        self._post(f"quantized all_reduce of {x.numel()} {_name(x.dtype)}: codec {codec}, min_bytes {threshold}")
        if x.numel() == 0:
            return x.clone(memory_format=torch.contiguous_format)
        out = self._quantized_segments(x, codec, min_bytes)
        return self._reduce(x, "auto", posted=True) if out is None else out

    def _quantized_segments(self, x: torch.Tensor, codec: str, min_bytes: int | None) -> torch.Tensor | None:
        """The quantized all-reduce of x, or None when the exact path serves this call."""
        threshold = self.knobs.quant_min(codec) if min_bytes is None else min_bytes
        if threshold is None or x.numel() * x.element_size() < threshold:
            return None
        if self.layout is None:
            self._log_once(logging.INFO, f"tpfuse all_reduce(quant={codec!r}) is exact: no peer workspace")
            return None
        try:
            plan = QuantPlan.for_layout(self.layout, x.dtype, codec, self.knobs)
        except ValueError as e:
            self._log_once(logging.INFO, f"tpfuse all_reduce(quant={codec!r}) is exact: {e}")
            return None
        src = _runtime.aligned_contiguous(x).view(-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        flat = out.view(-1)
        self._follow_last_call()
        for seg in plan.segments(x.numel()):
            part = slice(seg.start, seg.start + seg.numel)
            quant_all_reduce_into(src[part], flat[part], plan, seg, self._peers)
            if _runtime.INTERPRETER:
                self._check_usable()  # a failed segment must not start the next one
        return out

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                eps: float = 1e-6, *, weight_offset: float = 0.0, algo: str = "auto",
                                inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """All-reduce, residual add and RMSNorm in one kernel: ``(y, residual_out)``.

        Bitwise equal, on every rank and for every algo, to the split composition
        ``r = self.all_reduce(x); tpfuse.add_rms_norm(r, residual, weight, eps,
        weight_offset=weight_offset)``: residual_out = round(f32(r) + f32(residual)) with r
        the rounded all-reduce result, y = rms_norm(residual_out) (``tpfuse.kernels.fused``
        says why the bits match). Each rank adds its own residual.

        x may also be fp32 partial sums with a bf16/fp16 residual (an invariant row-parallel
        layer's): the fp32 all-reduce is then rounded once to the residual's dtype, the bits
        of ``self.all_reduce(x).to(residual.dtype)`` followed by the same ``add_rms_norm``,
        and y and residual_out are in the residual's dtype.

        Args:
            x: [..., N] bf16/fp16/fp32, this rank's contribution (not modified).
            residual: like x (same shape and device; x's dtype, or 16 bits under fp32 partial
                sums); this rank's residual stream.
            weight: [N], the residual's dtype or fp32, or None.
            eps, weight_offset: as for ``tpfuse.rms_norm`` (the norm scales by weight + weight_offset).
            algo: "auto" (by size: ``tpfuse.comm.plan.FusedPlan``), "oneshot" (every rank
                reads every contribution and normalises every row), "twoshot" (rows are
                reduce-scattered, every rank reduces a group of rows, gathers the others' and
                normalises every row), or "split" (the unfused composition).
            inplace: write residual_out into ``residual`` and return ``residual`` itself.

        Returns:
            y: a new tensor shaped like x, in the residual's dtype; residual_out: the same
            (``residual`` itself with inplace=True).

        Every rank must call it in the same order with the same shapes, dtypes and algo.
        Argument errors (TypeError/ValueError: shapes, dtypes, devices, weight length, algo,
        an explicit algo the workspace cannot serve) are raised before any communication
        starts. Other errors as ``all_reduce``. Not differentiable (no autograd).
        """
        self._check_args(x, residual, weight, eps, weight_offset, norm=True)
        _check_no_grad(x, residual, weight)
        check_fused_algo(algo)
        if inplace:
            y = torch.ops.tpfuse.all_reduce_add_rms_norm_(x, residual, weight, float(eps), float(weight_offset),
                                                          self.group_name, algo)
            return y, residual
        return torch.ops.tpfuse.all_reduce_add_rms_norm(x, residual, weight, float(eps), float(weight_offset),
                                                        self.group_name, algo)

    def all_reduce_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                            weight_offset: float = 0.0, algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """All-reduce and RMSNorm in one kernel: ``(y, reduced)``, bitwise equal on every rank
        to ``reduced = self.all_reduce(x); y = tpfuse.rms_norm(reduced, weight, eps,
        weight_offset=weight_offset)``. Arguments and errors as ``all_reduce_add_rms_norm``
        without the residual; both outputs are new tensors shaped like x."""
        self._check_args(x, None, weight, eps, weight_offset, norm=True)
        _check_no_grad(x, None, weight)
        check_fused_algo(algo)
        return torch.ops.tpfuse.all_reduce_rms_norm(x, weight, float(eps), float(weight_offset), self.group_name, algo)

    def all_reduce_add_rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                    eps: float = 1e-6, *, mode: str = "token", scale: torch.Tensor | None = None,
                                    group: int = 128, weight_offset: float = 0.0, algo: str = "auto",
                                    inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All-reduce, residual add, RMSNorm and fp8 quantization of y in one kernel:
        ``(q, scales, residual_out)``, for the fp8 GEMM after the boundary.

        Bitwise equal, on every rank and for every algo, to the split composition ``y,
        residual_out = self.all_reduce_add_rms_norm(x, residual, weight, eps, ...,
        algo="split"); q, scales = tpfuse.quant_fp8(y, mode, scale=scale, group=group)``:
        y is quantized from its rounded values (the residual's dtype), with the scales of
        ``tpfuse.quant_fp8`` (mode "tensor": the static ``scale``, returned as is; "token":
        scales [..., 1] fp32; "group": [M, N / group] fp32, column-major with M padded to a
        multiple of 4, the layout DeepGEMM-style block-scaled GEMMs read). y itself is not
        returned. q is ``torch.float8_e4m3fn`` shaped like x. Other arguments, the outputs'
        allocation and the errors are ``all_reduce_add_rms_norm``'s; group: a power of two
        from 16 to 1024 dividing N. Every rank must pass the same mode and group (a
        mismatch raises ``CallMismatchError`` on every rank, as any other). A failed call
        returns NaN in q (e4m3's 0x7F) and in residual_out; the scales it derives are NaN or,
        on GPUs where only the values carried the poison (the kernels over LL, Lamport and
        row-wise words), the floor's (the maxima skip NaN there): q is what says it failed.
        """
        self._check_args(x, residual, weight, eps, weight_offset, norm=True)
        check_fp8_args(x, mode, scale, group)
        _check_no_grad(x, residual, weight)
        check_fused_algo(algo)
        args = (x, residual, weight, float(eps), float(weight_offset), self.group_name, algo, mode,
                scale if mode == "tensor" else None, group)
        if inplace:
            q, scales = torch.ops.tpfuse.all_reduce_add_rms_norm_fp8_(*args)
            res_out = residual
        else:
            q, scales, res_out = torch.ops.tpfuse.all_reduce_add_rms_norm_fp8(*args)
        return q, (scale if mode == "tensor" else scales), res_out

    def _all_reduce_norm(self, x, residual, weight, eps, weight_offset, algo, inplace, fp8=None):
        """The fused ops' implementation (``tpfuse.comm.collective_ops``), where their arguments
        are checked: the methods above, and ``torch.ops.tpfuse`` called directly. fp8: None,
        or (mode, scale, group) of ``all_reduce_add_rms_norm_fp8``, whose (q, scales) then
        take y's place in the result (scales empty for mode "tensor")."""
        self._check_usable()
        self._check_args(x, residual, weight, eps, weight_offset, norm=True)
        check_fused_algo(algo)
        if fp8 is not None:
            check_fp8_args(x, *fp8)
        n = x.shape[-1]
        dtype = x.dtype if residual is None else residual.dtype  # the outputs': x's, or fp32 partials' residual's
        plan = (FusedPlan("split", reason="one rank") if self.world_size == 1 or x.numel() == 0 else
                FusedPlan.from_shape(x.numel() // n, n, x.dtype, self.layout, self.knobs, algo, dtype))
        if self.world_size > 1:
            op = "all_reduce_add_rms_norm" if residual is not None else "all_reduce_rms_norm"
            quant = "" if fp8 is None else f", fp8 per {fp8[0]}" + (f" of {fp8[2]}" if fp8[0] == "group" else "")
            self._post(f"{op} of {x.numel() // max(n, 1)} x {n} {_name(x.dtype)}"
                       + ("" if dtype == x.dtype else f" into {_name(dtype)}") + ", weight "
                       f"{None if weight is None else _name(weight.dtype)}, eps {eps!r}, weight_offset "
                       f"{weight_offset!r}{quant}: {_plan_text(plan)}")
        x2 = _runtime.aligned_contiguous(x.reshape(-1, n))
        res2 = None if residual is None else _runtime.aligned_contiguous(residual.reshape(-1, n))
        w = None if weight is None else _runtime.aligned_contiguous(weight)
        if fp8 is None:
            y, out = torch.empty(x.shape, dtype=dtype, device=x.device), None
        else:
            mode, scale, group = fp8
            q, scales = fp8_outputs(x, mode, group)
            y, out = None, Fp8Output(q.view(-1, n), scale if mode == "tensor" else scales, mode, group)
        # In place, the kernels may write residual_out over the residual (rms_norm_fwd).
        if inplace and res2.data_ptr() == residual.data_ptr():
            res_out = res2
        else:
            res_out = torch.empty(x2.shape, dtype=dtype, device=x.device)
        if plan.algo == "split":  # the unfused composition, on the same kernels as tpfuse.add_rms_norm
            reduced = self._reduce(x2, "auto", posted=self.world_size > 1).to(dtype)
            if x.numel():
                rms_norm_fwd(reduced, w, None if y is None else y.view(-1, n), float(eps), float(weight_offset),
                             *(() if res2 is None else (res2, res_out)), fp8=out)
            if residual is None:
                return y, reduced.view(x.shape)
        else:
            self._follow_last_call()
            all_reduce_norm_into(x2, w, res2, None if y is None else y.view(-1, n), res_out, float(eps),
                                 float(weight_offset), plan, self._peers, fp8=out)
            if _runtime.INTERPRETER:
                self._check_usable()
        if inplace:
            if res_out.data_ptr() != residual.data_ptr():
                residual.copy_(res_out.view(residual.shape))
        outputs = (y,) if fp8 is None else (q, scales)
        return *outputs, (residual if inplace else res_out.view(x.shape))

    def reduce_scatter_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                    eps: float = 1e-6, *,
                                    weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence-parallel boundary: reduce-scatter over dim 0, residual add and RMSNorm
        in one kernel: ``(y, residual_out)``, this rank's slice of tokens.

        x: [T, ..., N] bf16/fp16/fp32, this rank's contribution for all T tokens (not
        modified); T must be a multiple of the world size W (a padded split would change
        which rank owns a row: refused with ValueError). residual: [T / W, ..., N], x's dtype
        and device, this rank's slice of the residual stream (rows r * T / W .. (r + 1) * T /
        W - 1 of rank r). weight, eps, weight_offset: as ``all_reduce_add_rms_norm``.

        Returns new tensors shaped like residual: residual_out = round(reduced + residual),
        y = rms_norm(residual_out), bitwise equal to the same rows of
        ``all_reduce_add_rms_norm`` given the full residual (the reduced rows are tpfuse's
        all-reduce bits: fp32 sums in tree order, rounded once). Messages up to the
        communicator's ``max_bytes`` (larger ones raise ValueError: no fallback that could
        change the bits). Every rank must call it in the same order with the same shapes;
        errors as ``all_reduce``.

        Differentiable in x, residual and weight, deterministically: the norm's backward
        (``tpfuse.rms_norm``'s) on this rank's rows gives d residual_out; x's gradient is
        its all-gather (every rank's x adds into every reduced row), residual's is it, and
        weight's is the all-reduce, in tree order, of the ranks' dweight (each rank's in the
        weight's dtype). The backward's collectives run on this communicator, in the same
        order on every rank, as autograd runs them.
        """
        self._check_sequence_parallel_args(x, residual, weight, eps, weight_offset)
        return torch.ops.tpfuse.reduce_scatter_add_rms_norm(x, residual, weight, float(eps), float(weight_offset),
                                                            self.group_name)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The sequence-parallel all-gather over dim 0: x [R, ..., N] (this rank's rows,
        bf16/fp16/fp32, not modified) -> a new [W * R, ..., N] tensor, rank g's rows at
        g * R. The last dimension must be a multiple of 16 and the message (W * R rows) fit
        the communicator's ``max_bytes`` (ValueError otherwise). Errors as ``all_reduce``.
        Differentiable: the gradient is ``reduce_scatter``'s of the output's."""
        self._check_args(x)
        if x.dim() < 2:
            raise ValueError(f"x must be [rows, ..., N], got shape {tuple(x.shape)}")
        return torch.ops.tpfuse.all_gather(x, self.group_name)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x [T, ..., N] (bf16/fp16/fp32, not modified), this rank's
        rows of it: a new [T / W, ..., N] tensor, rows r * T / W .. of ``all_reduce(x)`` bit
        for bit (fp32 sums in tree order, rounded once). T a multiple of W, N of 16, the
        message within ``max_bytes`` (ValueError otherwise). Errors as ``all_reduce``.
        Differentiable: the gradient is ``all_gather``'s of the output's."""
        self._check_args(x)
        self._check_rows_divide(x)
        return torch.ops.tpfuse.reduce_scatter(x, self.group_name)

    def _check_rows_divide(self, x: torch.Tensor) -> None:
        """x is [T, ..., N] with T a multiple of the world size (a reduce-scatter's input)."""
        if x.dim() < 2 or x.shape[0] % self.world_size:
            raise ValueError(f"x must be [T, ..., N] with T a multiple of the world size {self.world_size}; got "
                             f"shape {tuple(x.shape)}")

    def _check_sequence_parallel_args(self, x, residual, weight, eps, weight_offset) -> None:
        self._check_open()
        check_norm_args(residual, weight, eps, weight_offset)
        _runtime.check_float_tensor(x, "x")
        self._check_rows_divide(x)
        want = (x.shape[0] // self.world_size, *x.shape[1:])
        if tuple(residual.shape) != want:
            raise ValueError(f"residual has shape {tuple(residual.shape)}; this rank's slice of x {tuple(x.shape)} "
                             f"is {want}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise TypeError(f"residual is {residual.dtype} on {residual.device}, x {x.dtype} on {x.device}; they "
                            "must match")
        if x.device != self.device and self.world_size > 1:
            raise ValueError(f"x is on {x.device}, but this communicator serves {self.device}")

    def _sequence_parallel_plan(self, x: torch.Tensor, rows_per_rank: int, op: str, norm: str = "") -> SequenceParallelPlan:
        """The call's plan, posted to the ledger as every rank must make it (``norm``: the
        norm's arguments, which every rank must pass alike too)."""
        n = x.shape[-1]
        plan = SequenceParallelPlan.from_shape(rows_per_rank, n, x.dtype, self.layout, self.knobs)
        self._post(f"{op} of {rows_per_rank * self.world_size} x {n} {_name(x.dtype)}{norm}: {plan.grid} CTAs")
        self._follow_last_call()
        return plan

    def _reduce_scatter_norm(self, x, residual, weight, eps, weight_offset):
        """``torch.ops.tpfuse.reduce_scatter_add_rms_norm``'s implementation."""
        self._check_usable()
        self._check_sequence_parallel_args(x, residual, weight, eps, weight_offset)
        n = x.shape[-1]
        x2 = _runtime.aligned_contiguous(x.reshape(-1, n))
        res2 = _runtime.aligned_contiguous(residual.reshape(-1, n))
        w = None if weight is None else _runtime.aligned_contiguous(weight)
        y, res_out = (torch.empty(res2.shape, dtype=x.dtype, device=x.device) for _ in range(2))
        if self.world_size == 1:
            rms_norm_fwd(x2, w, y, float(eps), float(weight_offset), res2, res_out)
        elif x.numel():
            norm = (f", weight {None if weight is None else _name(weight.dtype)}, eps {eps!r}, weight_offset "
                    f"{weight_offset!r}")
            plan = self._sequence_parallel_plan(x, res2.shape[0], "reduce_scatter_add_rms_norm", norm)
            reduce_scatter_norm_into(x2, w, res2, y, res_out, float(eps), float(weight_offset), plan, self._peers)
            if _runtime.INTERPRETER:
                self._check_usable()
        else:
            self._post(f"reduce_scatter_add_rms_norm of 0 {_name(x.dtype)}")
        return y.view(residual.shape), res_out.view(residual.shape)

    def _reduce_scatter(self, x):
        """``torch.ops.tpfuse.reduce_scatter``'s implementation."""
        self._check_input(x)
        self._check_rows_divide(x)
        n, rows = x.shape[-1], x.shape[0] // self.world_size
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        if self.world_size == 1:
            out.copy_(x)
        elif x.numel():
            plan = self._sequence_parallel_plan(x, out.numel() // n, "reduce_scatter")
            reduce_scatter_norm_into(_runtime.aligned_contiguous(x.reshape(-1, n)), None, None, out.view(-1, n), None,
                                     0.0, 0.0, plan, self._peers)
            if _runtime.INTERPRETER:
                self._check_usable()
        else:
            self._post(f"reduce_scatter of 0 {_name(x.dtype)}")
        return out

    def _all_gather(self, x):
        """``torch.ops.tpfuse.all_gather``'s implementation."""
        self._check_input(x)
        n = x.shape[-1]
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if self.world_size == 1:
            out.copy_(x)
        elif x.numel():
            plan = self._sequence_parallel_plan(x, x.numel() // n, "all_gather")
            all_gather_into(_runtime.aligned_contiguous(x.reshape(-1, n)), out.view(-1, n), plan, self._peers)
            if _runtime.INTERPRETER:
                self._check_usable()
        else:
            self._post(f"all_gather of 0 {_name(x.dtype)}")
        return out

    def _follow_last_call(self) -> None:
        """Before a launch on the peer workspace: where the last one went to another stream,
        make this one's stream wait for it (docs/design.md 2.5: a communicator's calls run one
        after another). Not inside a CUDA graph capture, whose dependencies cannot reach
        outside it: a graph is ordered by the stream it is replayed on."""
        if self.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        last, self._last_stream = self._last_stream, stream
        if last is not None and last != stream and not torch.cuda.is_current_stream_capturing():
            stream.wait_stream(last)

    @contextlib.contextmanager
    def using_knobs(self, knobs: Knobs):
        """For experiments (``tpfuse tune``): the plans read ``knobs`` for the duration of a
        with-block, then this communicator's own again. Collective: every rank enters it with
        the same knobs, which it checks. The workspace stays as constructed; knobs that reach
        past its regions are capped by them, as always."""
        self._check_open()
        error = self._knob_error(knobs)  # settled together below: a rank that raised alone would hang the others
        peers = [(error, "" if error else json.dumps(knobs.as_dict(), sort_keys=True))] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(peers, peers[0], group=self.group)
        if any(e for e, _ in peers):
            raise ValueError("using_knobs: " + "; ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(peers) if e))
        if len({k for _, k in peers}) > 1:
            raise ValueError(f"using_knobs: every rank must pass the same knobs; the ranks': {[k for _, k in peers]}")
        own, self._knobs = self._knobs, knobs
        try:
            yield self
        finally:
            self._knobs = own

    @property
    def knobs(self) -> Knobs:
        """The settings every plan of this communicator reads (the same on every rank)."""
        return self._knobs

    def _knob_error(self, knobs) -> str:
        """Why ``knobs`` cannot be this communicator's ("" when they can)."""
        if not isinstance(knobs, Knobs) or knobs.world_size != self.world_size:
            return f"knobs must be a tpfuse.comm.Knobs of world_size {self.world_size}, got {knobs!r}"
        try:
            knobs.check()
        except ValueError as e:
            return str(e)
        return ""

    def check(self) -> None:
        """Synchronize the device, then raise CommTimeoutError if any call so far failed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._check_usable()

    def on_close(self, fn) -> None:
        """Have ``close()`` call ``fn()`` first (locally), for an object that captured this
        communicator's calls into CUDA graphs to drop them (``TPModel`` drops its decode
        step's): the graphs' kernels use the workspace, and NCCL does not destroy a process
        group while a graph that captured one of its collectives exists, so
        ``destroy_process_group`` would wait for ever. A bound method is held weakly."""
        self._check_open()
        self._on_close = [ref for ref in self._on_close if ref() is not None]  # no dead methods pile up
        self._on_close.append(weakref.WeakMethod(fn) if inspect.ismethod(fn) else lambda: fn)

    def close(self) -> None:
        """Call the ``on_close`` functions, release the peer workspace (local; call it after
        this rank's last call) and unregister ``group_name``."""
        if self._closed:
            return
        callbacks, self._on_close, error = self._on_close, [], None
        for ref in callbacks:
            fn = ref()
            try:
                if fn is not None:
                    fn()
            except Exception as e:  # the close goes on; the first error is raised at its end
                error = error or e
        collective_ops.unregister(self.group_name)
        if self._ledger is not None:
            self._ledger.close()
        if self._peer is not None:
            self._release()
            self._peer = None
        # Nor does it keep the process group: held past destroy_process_group, the group would
        # be destroyed at interpreter exit, when gloo's threads can no longer take the GIL to
        # drop what they hold (an abort: "terminate called without an active exception").
        self.group = None
        self._closed = True
        if error is not None:
            raise error

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Communicator is closed")

    def _post(self, text: str | None, before_backend: bool = False) -> None:
        """Write this rank's next call, described by ``text`` (None: the calling operation has
        posted it), into the call ledger and compare it with the peers' (``tpfuse.comm.ledger``);
        before a collective of the group's backend, also wait for every peer to have posted it.
        A mismatch, or a failure another rank recorded, fails the communicator here; peers that
        do not post within ``timeout_s`` raise ``CommTimeoutError``."""
        if self._ledger is None:
            return
        try:
            if text is not None:
                self._ledger.post(text)
            if before_backend:
                self._ledger.wait_for_peers("before the group's backend")
        except RecordedFailure as found:
            self._fail(self._recorded_error(found), record=False)
        except PeersLate as late:
            self._fail(CommTimeoutError("the hosts' call check (tpfuse.comm.ledger)", self.rank, late.late[0],
                                        late.call, self.timeout_s))

    def _recorded_error(self, found: RecordedFailure) -> CommError:
        if found.kind == MISMATCH:
            return CallMismatchError(self.rank, found)
        return CommTimeoutError(found.rank_text, found.rank, found.peer, found.call, self.timeout_s)

    def _fail(self, error: CommError, record: bool = True) -> None:
        """Make ``error`` this communicator's failure and raise it, after stopping every rank's
        kernels that still wait (the abort word of every workspace: their waits give up at
        their next look, and write NaN) and, with ``record``, recording a timeout in the ledger
        (every peer raises at its next call too, rather than enter NCCL without this rank)."""
        self._failure = error
        if self._peer is not None:
            self._peer.store_word_everywhere(self.layout.ctrl_offset + 8 * CTRL_ABORT, 1)
        if record and self._ledger is not None and isinstance(error, CommTimeoutError):
            self._ledger.record_gave_up(error.peer, error.op, error.epoch)
        raise error

    def _check_usable(self) -> None:
        """Raise this communicator's failure: its own, one another rank recorded in the ledger,
        or a kernel's timeout in the status record (each found once, then kept)."""
        self._check_open()
        if self._failure is None:
            found = self._ledger.failure() if self._ledger is not None else None
            record = decode_status(self._status_view) if self._peer is not None else None
            if found is not None and found.kind == MISMATCH:  # the cause of any timeout it led to
                self._fail(self._recorded_error(found), record=False)
            if record is not None:  # this rank's own timeout, before a peer's
                op, rank, peer, epoch = record
                self._fail(CommTimeoutError(OP_NAMES.get(op, f"op {op}"), rank, peer, epoch, self.timeout_s))
            if found is not None:
                self._fail(self._recorded_error(found), record=False)
        if self._failure is not None:
            raise self._failure

    def _log_once(self, level: int, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.log(level, "%s", message)


_CONSTRUCTIONS: dict[str, int] = {}
"""Communicators this process has begun to construct, per process group name."""


def _arrive(group: dist.ProcessGroup, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank announces, in the process group's store, that it is constructing its k-th
    communicator of ``group``, and waits at most ``timeout_s`` for the others (a collective
    would wait for torch.distributed's own timeout, minutes). The first rank to settle the
    outcome writes it, atomically: "go" once it saw every rank, or that it stopped waiting.
    Every rank, a late one included, acts on that one verdict, so no rank goes on to the
    collective steps alone."""
    k = _CONSTRUCTIONS[group.group_name] = _CONSTRUCTIONS.get(group.group_name, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"tpfuse/communicator/{group.group_name}/{k}/"
    keys = [f"{prefix}arrived/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        mine = "go"
    except RuntimeError:  # the store's timeout (DistStoreError, or RuntimeError from a FileStore)
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        mine = f"rank {rank} waited {timeout_s:g} s for rank(s) {missing}"
    verdict = store.compare_set(prefix + "verdict", "", mine)
    verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
    if verdict != "go":
        raise CommError(f"creating the Communicator of group {group.group_name!r} failed on rank {rank}: {verdict} to "
                        "arrive; every rank of the group must create it, with the same arguments, within timeout_s")


def _release_peer(peer: PeerMemory, device: torch.device) -> None:
    """Unmap ``peer`` once no kernel of this rank still uses it (close(), or the finalizer)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peer.close()


@functools.lru_cache(maxsize=1024)
def _plan_text(plan) -> str:
    """A plan's fields that differ from their defaults, for the call ledger (the reason a
    plan was chosen, and the norm layout derived from the row length, left out). Cached: the
    text took 6 us a call, a hash of the frozen plan 0.4."""
    return " ".join(f"{f.name}={getattr(plan, f.name)}" for f in dataclasses.fields(plan)
                    if f.name not in ("reason", "norm") and getattr(plan, f.name) != f.default)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_no_grad(*tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ValueError("the fused all-reduce + RMSNorm is not differentiable: call it under torch.no_grad(), or "
                         "use comm.all_reduce and tpfuse.add_rms_norm / tpfuse.rms_norm")
