"""``tpfuse.token_log_probs`` and ``tpfuse.sample``: what an RL or evaluation loop reads from
logits, with each row's bits its own, as custom ops.

Kernels and launchers: ``tpfuse.kernels.sampling``; contracts: ``tpfuse.reference.token_log_probs``
and ``tpfuse.reference.sample`` (closeness), docs/design.md 1.4 (the invariance, tested kernel
against kernel).
"""

from __future__ import annotations

import math

import torch

from tpfuse.kernels.sampling import sample_into, token_log_probs_into

Tensor = torch.Tensor


def _check_logits(logits: Tensor, rows: Tensor, what: str) -> None:
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with V >= 1 and a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if rows.dtype != torch.int64 or rows.shape != (logits.shape[0],):
        raise ValueError(f"{what} must be int64 [{logits.shape[0]}], got {rows.dtype} {tuple(rows.shape)}")
    if rows.device != logits.device:
        raise ValueError(f"{what} is on {rows.device}, logits on {logits.device}")


@torch.library.custom_op("tpfuse::token_log_probs", mutates_args=())
def _token_log_probs_op(logits: Tensor, targets: Tensor) -> Tensor:
    _check_logits(logits, targets, "targets")
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if out.numel():
        token_log_probs_into(logits, targets.contiguous(), out)
    return out


@_token_log_probs_op.register_fake
def _(logits, targets):
    _check_logits(logits, targets, "targets")
    return torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)


@torch.library.custom_op("tpfuse::sample", mutates_args=())
def _sample_op(logits: Tensor, seeds: Tensor, positions: Tensor, temperature: float, top_p: float) -> Tensor:
    _check_sample(logits, seeds, positions, temperature, top_p)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if out.numel():
        sample_into(logits, seeds.contiguous(), positions.contiguous(), temperature, top_p, out)
    return out


@_sample_op.register_fake
def _(logits, seeds, positions, temperature, top_p):
    _check_sample(logits, seeds, positions, temperature, top_p)
    return torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)


def _check_sample(logits: Tensor, seeds: Tensor, positions: Tensor, temperature: float, top_p: float) -> None:
    _check_logits(logits, seeds, "seeds")
    _check_logits(logits, positions, "positions")
    if not (temperature > 0 and math.isfinite(temperature)
            and torch.tensor(1.0 / temperature, dtype=torch.float32).isfinite()):
        raise ValueError(f"temperature must be finite and > 0, its inverse finite in fp32 (greedy decoding is "
                         f"argmax), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] of every row.

    Args:
        logits: [N, V] bf16, fp16 or fp32, last dim contiguous (rows may be strided).
        targets: int64 [N] on logits' device (any strides), each in 0..V-1 (not checked: an
            id outside reads outside the row).

    Returns a new fp32 [N] tensor. A row's bits depend on that row's logits and target alone
    (a fixed walk over the vocabulary: docs/design.md 1.4), not on the other rows, so with an
    invariant model's logits they are the same at any batch and TP size. Within 1e-5 * (1 +
    |log p|)-ish of ``tpfuse.reference.token_log_probs`` (float64). A custom op
    (``torch.ops.tpfuse.token_log_probs``) with a fake; no autograd.
    """
    _check_logits(logits, targets, "targets")
    return torch.ops.tpfuse.token_log_probs(logits, targets)


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, temperature: float = 1.0, top_p: float = 1.0) -> Tensor:
    """One seeded draw per row from softmax(logits / temperature), restricted to its top-p set.

    Args:
        logits: [N, V] bf16, fp16 or fp32, last dim contiguous.
        seeds, positions: int64 [N] on logits' device (any strides); only their low 32 bits
            are used. A sequence's draw at a position depends on its logits, seed and position
            alone.
        temperature: finite and > 0 with a finite fp32 inverse (greedy decoding is
            ``logits.argmax(-1)``).
        top_p: in (0, 1]: the draw is from the smallest set of most likely tokens holding at
            least this much of the probability mass (ties kept together); 1 keeps them all.

    Returns a new int64 [N] tensor of token ids. A row holding +inf draws among its +inf
    entries; NaN entries are never drawn. The draw is the Gumbel-max of the row
    (``tpfuse.reference.sample`` states it in float64, with the hash that makes the noise), so
    token i is drawn with its probability over the seeds. Its bits do not depend on the other
    rows (docs/design.md 1.4): with an invariant model's logits, the same tokens at any batch
    and TP size. A custom op (``torch.ops.tpfuse.sample``) with a fake.
    """
    _check_sample(logits, seeds, positions, temperature, top_p)
    return torch.ops.tpfuse.sample(logits, seeds, positions, float(temperature), float(top_p))
