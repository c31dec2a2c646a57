"""The numerical contract of every tpfuse op, in plain torch.

This module is the specification the kernels are tested against:

- Bitwise ops (``all_reduce``, the ``residual_out`` of ``add_rms_norm``, the quantized
  codecs of later issues) are written here with exactly the roundings the kernels must do.
- Ops whose bits depend on a reduction order (RMSNorm and its backward) are written here in
  float64; kernels are held to a relative error budget against them, and to bitwise
  equality with each other (fused vs unfused, row alone vs row in a batch, run vs run).

"Bitwise" covers every value but the payload bits of a NaN: a result is NaN exactly where
the reference's is, with whatever payload (GPUs write 0x7FFFFFFF, torch and numpy keep
0x7FC00000, and the one-shot over Lamport words sends an all-ones NaN with its sign bit
clear, ``tpfuse.kernels.ll``). Signed zeros are values: -0.0 summed with -0.0 stays -0.0.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tpfuse.quant_format import (QUANT_CODECS, QUANT_GROUP, QUANT_PLANES, SCALE_MIN_EXP,  # noqa: F401  (re-exported)
                                 check_codec, packed_layout)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset)`` in float64.

    Returns float64 (the exact value the kernels approximate with one rounding).
    ``weight=None`` means no scaling.
    """
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    return y


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = round(f32(x) + f32(residual))`` in residual's dtype (bitwise contract),
    and ``y = rms_norm(residual_out)`` in float64, computed from the rounded residual_out."""
    residual_out = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm(residual_out, weight, eps, weight_offset=weight_offset), residual_out


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight) of ``rms_norm`` at x for the output gradient dy, in float64.

    dweight sums over every leading dimension; it is None when weight is None.
    """
    xd = x.double().detach().requires_grad_(True)
    wd = None if weight is None else weight.double().detach().requires_grad_(True)
    y = rms_norm(xd, wd, eps, weight_offset=weight_offset)
    grads = torch.autograd.grad(y, [xd] if wd is None else [xd, wd], dy.double())
    return grads[0], (grads[1] if wd is not None else None)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def rel_err_budget(dtype: torch.dtype) -> float:
    """Relative error allowed for a result rounded once to dtype and compared normwise with
    the float64 reference: the dtype's unit roundoff plus room for fp32 accumulation."""
    return UNIT_ROUNDOFF[dtype] + 2e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||out - ref|| / ||ref||, computed in float64."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def tree_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``values`` (one per rank, in rank order) over the pairwise tree every
    tpfuse reduction across ranks follows: neighbours are added level by level, an odd one out
    is carried up to the next level. ``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`` at
    8 ranks, ``(v0 + v1) + v2`` at 3; at 2 and 3 ranks this is rank order.

    Why a tree: a row-parallel layer split over t ranks sums t partials, and the same layer
    split over 2t ranks sums the halves of each of them. In the tree, the partials of
    adjacent ranks meet first, so a sum over 8 chunks of K gives the same bits whether one
    rank adds all 8 (in this tree) or 2, 4 or 8 ranks each add their share and the
    all-reduce adds the rest: the sum does not depend on the TP size (docs/design.md 1)."""
    if len(values) == 0:
        raise ValueError("tree_sum needs at least one value")
    level = list(values)
    while len(level) > 1:
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return level[0]


def all_reduce(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The all-reduce contract: the fp32 sum over ``tensors`` (one per rank, in rank order)
    in ``tree_sum``'s order, rounded once to the inputs' dtype."""
    if len(tensors) == 0:
        raise ValueError("all_reduce needs at least one tensor")
    return tree_sum([t.float() for t in tensors]).to(tensors[0].dtype)


def all_reduce_add_rms_norm(
    tensors: Sequence[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(all_reduce(tensors), residual, ...)``: the all-reduce result is rounded
    to the residual's dtype before the residual add (the tensors may be fp32 partial sums of
    a 16-bit residual: their fp32 sum is then rounded once, to the residual's dtype)."""
    return add_rms_norm(all_reduce(tensors).to(residual.dtype), residual, weight, eps, weight_offset=weight_offset)


def all_reduce_rms_norm(
    tensors: Sequence[torch.Tensor],
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r), r)`` with ``r = all_reduce(tensors)``."""
    reduced = all_reduce(tensors)
    return rms_norm(reduced, weight, eps, weight_offset=weight_offset), reduced


# ---------------------------------------------------------------- quantized all-reduce
#
# The codecs below are the bit-exact specification of ``tpfuse.quantize``/``dequantize`` and
# of ``Communicator.all_reduce(x, quant=...)``. Every step is an integer operation or an IEEE
# fp32 operation that is exact or rounds once, written the way the kernels write it (NaN
# payloads excepted, as everywhere: the module's docstring). The packed format itself
# (codecs, groups, planes, byte layout) is ``tpfuse.quant_format``'s, shared with the kernels.

QUANT_ERROR_BUDGET = {"int8": 0.010, "int6": 0.035, "fp8": 0.040, "int4": 0.13}
"""Published bound on the relative RMS error of the quantized all-reduce (Gaussian inputs,
W=2..8) against the float64 sum."""

_SCALE_MIN_BITS = (127 + SCALE_MIN_EXP) << 23
_SCALE_MIN_BF16 = _SCALE_MIN_BITS >> 16
_SCALE_NAN = 0x7FC0
_FP32_INF_BITS = 0x7F800000
_E4M3_MAX = 0x7E
"""448, the largest finite e4m3 value."""
_RINT_MAGIC = 12582912.0
"""1.5 * 2**23: in fp32, (v + M) - M rounds |v| < 2**22 to an integer, half to even (M is
even, so the tie rule of the sum is the tie rule of v)."""


def _groups_f32(x: torch.Tensor) -> torch.Tensor:
    """x flattened to fp32, zero-padded to whole groups, as (groups, 32)."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % QUANT_GROUP
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, QUANT_GROUP)


def _encode(xg: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of fp32 groups (G, 32): codes int64 (G, 32) (an int codec's value q in
    [-2**(b-1), 2**(b-1) - 1], or an e4m3 byte), scale the int64 bf16 bits (G,).

    - A group holding NaN or Inf gets a NaN scale and zero codes: it decodes to NaN.
    - int codecs: with m the group's value of largest magnitude (the negative one on a tie),
      ``s = -m / 2**(b-1)`` truncated to bf16 (at least 2**-117 in magnitude), so m maps to
      the extra negative level and no decoded value exceeds the group's largest magnitude;
      ``q = clamp(rint(x * r), -2**(b-1), 2**(b-1) - 1)`` with ``r = 1 / s`` and the product
      each rounded once in fp32, rint half to even.
    - fp8: ``s = max|x| / 448`` truncated to bf16 (at least 2**-117), computed exactly
      with an integer division of the 24-bit significand by 7 (448 = 7 * 2**6); the code is
      ``x * r`` (r and the product rounded once in fp32) rounded to e4m3 to nearest even, at
      most 448 in magnitude.
    Truncating the scale keeps every decoded magnitude at or below the group's largest one
    (finite inputs never decode to Inf). Every step is one fp32 operation, so the kernels run
    at the fp32 rate: r is at least 2**-125 (normal) and x * r never overflows.
    """
    bits = xg.view(torch.int32).to(torch.int64)
    mag = bits & 0x7FFFFFFF
    amax = mag.amax(1)
    bad = amax >= _FP32_INF_BITS
    if codec == "fp8":
        e = amax >> 23
        quot = ((amax & 0x7FFFFF) | 0x800000) // 7
        low = (quot < (1 << 21)).long()
        scale = ((e - 8 - low) << 7) | ((quot >> (14 - low)) - 128)
        scale = scale.clamp_min(_SCALE_MIN_BF16)
    else:
        k = QUANT_PLANES_BITS[codec] - 1
        pos = torch.where(bits >= 0, mag, 0).amax(1)
        neg = torch.where(bits < 0, mag, 0).amax(1)
        s_mag = ((amax - (k << 23)).clamp_min(_SCALE_MIN_BITS) & 0x7FFF0000) >> 16
        scale = s_mag | torch.where(neg >= pos, 0, 0x8000)
    scale = torch.where(bad, _SCALE_NAN, scale)
    recip = 1.0 / _bf16_bits_to_f32(scale)
    v = xg * recip[:, None]
    v = torch.where(bad[:, None], 0.0, v)
    if codec == "fp8":
        codes = _e4m3_rne(v)
    else:
        q = (v + _RINT_MAGIC) - _RINT_MAGIC
        codes = q.long().clamp(-(1 << k), (1 << k) - 1)
    return codes, scale


QUANT_PLANES_BITS = {c: sum(p) for c, p in QUANT_PLANES.items()}


def _bf16_bits_to_f32(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int64) << 16).to(torch.int32).view(torch.float32)


def _e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """fp32 v (|v| < 452) -> e4m3 byte: rounded to e4m3 to nearest even on the bits, at most
    448 in magnitude. Values below 2**-11 round to zero either way; zeroing them first keeps
    subnormal fp32 values out."""
    v32 = torch.where(v.abs() < 2.0**-11, 0.0, v)
    b = v32.view(torch.int32).to(torch.int64)
    a = b & 0x7FFFFFFF
    e = a >> 23
    shift = 20 + (121 - e).clamp(0, 11)
    sig = (a & 0x7FFFFF) | 0x800000
    r = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    code = torch.where(e >= 121, ((e - 120) << 3) + r - 8, r)
    code = torch.where(a == 0, 0, code.clamp_max(_E4M3_MAX))
    return code | torch.where((b < 0) & (code != 0), 0x80, 0)


def _decode(codes: torch.Tensor, scale: torch.Tensor, codec: str) -> torch.Tensor:
    """fp32 values (G, 32) of codes and bf16 scale bits: ``value(code) * s``, an exact product.
    A zero code decodes to +0.0 whatever the scale's sign (NaN for a NaN scale)."""
    s = _bf16_bits_to_f32(scale & 0x7FFF)[:, None]
    if codec == "fp8":
        mag = codes & 0x7F
        e4 = mag >> 3
        sig = (mag & 7) + torch.where(e4 > 0, 8, 0)
        p = e4.clamp_min(1) - 10
        v = sig.float() * ((p + 127) << 23).to(torch.int32).view(torch.float32)
        v = torch.where((codes & 0x80) != 0, 0.0 - v, v)  # +0.0 for the code 0x80, as documented
    else:
        v = torch.where((scale & 0x8000)[:, None] != 0, -codes, codes).float()
    return v * s


def _pack(codes: torch.Tensor, scale: torch.Tensor, codec: str, numel: int) -> torch.Tensor:
    groups = codes.shape[0]
    offsets, scale_offset, total = packed_layout(numel, codec)
    out = torch.zeros(total, dtype=torch.uint8, device=codes.device)
    shift = 0
    for bits, off in zip(QUANT_PLANES[codec], offsets):
        per_word = 32 // bits
        field = (codes >> shift) & ((1 << bits) - 1)
        words = (field.view(groups, -1, per_word) << (bits * torch.arange(per_word, device=codes.device))).sum(-1)
        out[off:off + groups * 4 * bits] = words.to(torch.int32).reshape(-1).view(torch.uint8)
        shift += bits
    out[scale_offset:scale_offset + 2 * groups] = scale.to(torch.int16).view(torch.uint8)
    return out


def _unpack(packed: torch.Tensor, codec: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = -(-numel // QUANT_GROUP)
    offsets, scale_offset, total = packed_layout(numel, codec)
    if packed.dtype != torch.uint8 or packed.numel() < total:
        raise ValueError(f"packed must be a uint8 tensor of at least {total} bytes for {numel} values of "
                         f"codec {codec!r}, got {packed.dtype} with {packed.numel()} elements")
    packed = packed.reshape(-1)
    if packed.storage_offset() % 4:  # the planes are read as int32 words
        packed = packed.clone()
    codes = torch.zeros(groups, QUANT_GROUP, dtype=torch.int64, device=packed.device)
    shift = 0
    for bits, off in zip(QUANT_PLANES[codec], offsets):
        per_word = 32 // bits
        words = packed[off:off + groups * 4 * bits].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        field = (words.view(groups, -1, 1) >> (bits * torch.arange(per_word, device=packed.device))) & ((1 << bits) - 1)
        codes |= field.reshape(groups, QUANT_GROUP) << shift
        shift += bits
    if codec != "fp8":
        sign = 1 << (QUANT_PLANES_BITS[codec] - 1)
        codes = (codes ^ sign) - sign
    scale = packed[scale_offset:scale_offset + 2 * groups].view(torch.int16).to(torch.int64) & 0xFFFF
    return codes, scale


def quantize(x: torch.Tensor, codec: str) -> torch.Tensor:
    """The packed form (uint8, on x's device) of x's values in flattened order; see
    ``packed_layout`` for the format and ``_encode`` for the codec."""
    check_codec(codec)
    codes, scale = _encode(_groups_f32(x.detach()), codec)
    return _pack(codes, scale, codec, x.numel())


def dequantize(packed: torch.Tensor, codec: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The values ``packed`` holds, decoded in fp32 and rounded once to dtype, as ``shape``."""
    check_codec(codec)
    numel = 1
    for d in shape:
        numel *= int(d)
    codes, scale = _unpack(packed, codec, numel)
    return _decode(codes, scale, codec).reshape(-1)[:numel].to(dtype).reshape(shape)


def quantized_all_reduce(tensors: Sequence[torch.Tensor], quant: str) -> torch.Tensor:
    """The quantized all-reduce contract: each rank's values are encoded and decoded
    (``quantize``), the decoded fp32 values summed in ``tree_sum``'s order, the sum encoded and
    decoded again, and rounded once to the inputs' dtype. Every rank holds these bits."""
    check_codec(quant)
    if len(tensors) == 0:
        raise ValueError("quantized_all_reduce needs at least one tensor")
    shape, dtype, numel = tensors[0].shape, tensors[0].dtype, tensors[0].numel()
    decoded = [_decode(*_encode(_groups_f32(t.detach()), quant), quant) for t in tensors]
    codes, scale = _encode(tree_sum(decoded), quant)
    out = _decode(codes, scale, quant).reshape(-1)[:numel]
    return out.to(dtype).reshape(shape)


# ---------------------------------------------------------------- invariant linear layers

def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float64: what ``tpfuse.invariant_matmul`` approximates (fp32
    accumulation, one rounding), held to ``rel_err`` against it. Its bits are not written
    here: a tensor core's sum inside one instruction has no torch spelling. What the contract
    fixes instead, and the tests hold kernel against kernel, is that they depend on K and the
    number of chunks alone: a row's bits are the same alone or in any batch, for any N, and a
    layer split over t ranks into 1/t of K each, whose fp32 results are summed by
    ``tree_sum``, gives the bits of the unsplit layer (docs/design.md 1.2)."""
    return x.double() @ weight.double().T


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64: query t of sequence b (q [B, H, T, D]) sits at position
    start[b] + t and attends to the keys at positions 0 to that one (k, v [B, Hkv, S, D];
    query head h reads kv head h // (H / Hkv)). What ``tpfuse.invariant_attention``
    approximates, held to ``rel_err`` against it. Its bits are the kernel's own (fixed splits
    of key positions, folded in order: docs/design.md 1.3); what the contract fixes, and the
    tests hold kernel against kernel, is that a query's bits depend on its position, its q
    and the keys and values up to its position alone: not on the batch, the other queries, a
    prefill or a decode step, or the heads on other ranks."""
    group = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ kd.transpose(-1, -2) * scale
    positions = start.to(q.device).view(-1, 1, 1, 1) + torch.arange(q.shape[2], device=q.device).view(1, 1, -1, 1)
    keys = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
    return torch.softmax(scores.masked_fill(keys > positions, float("-inf")), dim=-1) @ vd


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half rotary embedding, op for op in qk's dtype, of the query and
    key heads of qk [B, T, H + Hkv, D], token t of sequence b at position start[b] + t (rows
    of the [P, D] tables cos and sin); the rotated keys and v [B, T, Hkv, D] written into
    k_cache and v_cache [B, Hkv, S, D] at those positions; returns the rotated queries [B, H,
    T, D]. ``tpfuse.rope_and_cache`` gives these bits: each product and the sum rounded to
    the dtype once, as torch's elementwise ops round them."""
    b, t, _, d = qk.shape
    n_kv = v.shape[2]
    pos = start.to(torch.int64)[:, None] + torch.arange(t, device=qk.device)  # [B, T]
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]  # [B, T, 1, D]
    rotated = torch.cat((-qk[..., d // 2:], qk[..., :d // 2]), dim=-1)
    out = qk * c + rotated * s
    rows = torch.arange(b, device=qk.device)[:, None]
    k_cache[rows, :, pos] = out[:, :, -n_kv:]  # [B, T, Hkv, D] at (b, :, pos[b, t])
    v_cache[rows, :, pos] = v
    return out[:, :, :-n_kv].transpose(1, 2).contiguous()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate of x [..., 2I] (the gate's I columns, then up's): silu(gate) * up, op for
    op as torch's CUDA kernels compute ``F.silu(gate) * up`` in x's dtype: silu(g) = g / (1 +
    exp(-g)) in fp32, rounded to the dtype, then its product with up in fp32, rounded.
    ``tpfuse.silu_and_mul`` gives these bits on GPUs (exp is CUDA's expf there; under Triton's
    interpreter numpy's exp, which may differ from torch's CPU exp in the last fp32 bit)."""
    g, up = x.float().chunk(2, dim=-1)
    act = (g / (1 + torch.exp(-g))).to(x.dtype)
    return (act.float() * up).to(x.dtype)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row in float64 (logits [N, V], targets [N]): what
    ``tpfuse.token_log_probs`` approximates in fp32, held to an absolute error budget. Its bits
    are the kernel's (a fixed walk over the vocabulary, docs/design.md 1.4); the contract fixes
    that they depend on the row alone, tested kernel against kernel."""
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, targets.view(-1, 1)).view(-1)


def _hash32(h: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 on int64 tensors holding uint32 values (the kernel's ``_hash``)."""
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & mask
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & mask
    return h ^ (h >> 16)


def sample_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniform u in (0, 1) of every (row, token) of a draw: 23 bits of a hash of the row's
    seed, position and the token id (each hashed apart, then combined), plus a half, over 2^23
    (exact in fp32; float64 [N, V])."""
    mask = 0xFFFFFFFF
    key = _hash32(_hash32(seeds.long() & mask) ^ _hash32((positions.long() & mask) ^ 0x9E3779B9))
    h = _hash32(key.view(-1, 1) ^ _hash32(torch.arange(vocab, device=seeds.device).view(1, -1) ^ 0x85EBCA6B))
    return ((h >> 9).double() + 0.5) / 8388608.0


def sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float,
           top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded draw per row (logits [N, V]; seeds, positions [N]) from softmax(logits /
    temperature) restricted to its top-p set, in float64: (the tokens [N], the top-p set as a
    bool [N, V] mask). The draw is the token maximising z_i - log(-log(u_i)) over the set
    (Gumbel-max: token i wins with its probability), z = logits / temperature (the kernel:
    fp32 logits times fp32(1 / temperature)), u from ``sample_uniforms``; the set is the
    smallest set of most likely tokens holding at least ``top_p`` of the mass, ties kept
    together. ``tpfuse.sample`` computes the same in fp32: it may differ where two scores, or a
    set's mass and ``top_p``, are within fp32 rounding of each other, or a logit lies within
    104 / 2^40 below the set's threshold (its bisection's resolution on z - max). Finite logits
    only here (the kernel's rules for +-inf and NaN: tpfuse.kernels.sampling)."""
    inv = torch.tensor(1.0 / temperature, dtype=torch.float32)
    z = (logits.float() * inv).double()
    probs = torch.softmax(z, dim=-1)
    ordered, _ = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # the mass of the more likely tokens
    smallest = ordered.masked_fill(before >= top_p, float("inf")).amin(-1, keepdim=True)
    kept = probs >= smallest if top_p < 1.0 else torch.ones_like(probs, dtype=torch.bool)
    score = (z - z.amax(-1, keepdim=True)) - torch.log(-torch.log(sample_uniforms(seeds, positions, z.shape[-1])))
    return score.masked_fill(~kept, float("-inf")).argmax(-1), kept


# ---------------------------------------------------------------- fp8 activations for fp8 GEMMs

FP8_MAX = 448.0
"""The largest finite e4m3 value: quantized values saturate at +-FP8_MAX."""
FP8_AMAX_FLOOR = 1e-10
"""A dynamic scale is max(amax, FP8_AMAX_FLOOR) / FP8_MAX, so an all-zero row or group gets a
positive scale (and zeros), never 0 / 0."""
FP8_MODES = ("tensor", "token", "group")


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, FP8_AMAX_FLOOR) / FP8_MAX`` in fp32, correctly rounded: divided in float64
    and rounded once, which gives the fp32 quotient (torch on CUDA would multiply by the
    reciprocal of a Python number instead)."""
    return (amax.float().clamp_min(FP8_AMAX_FLOOR).double() / FP8_MAX).float()


def fp8_scale_rows(m: int) -> int:
    """Rows of the per-group scales' storage for m tokens: m rounded up to a multiple of 4, so
    that each group's column of fp32 scales starts 16-byte aligned (what the TMA loads of
    DeepGEMM-style block-scaled GEMMs need)."""
    return -(-m // 4) * 4


def quant_fp8(y: torch.Tensor, mode: str, scale: torch.Tensor | None = None,
              group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: y [..., N] quantized to e4m3 (torch.float8_e4m3fn) for an fp8 GEMM.

    Every value is quantized from y as it is (a bf16 y: from its rounded bf16 value, so a
    fused kernel that produces y and quantizes it gives the bits of producing, then
    quantizing), widened to fp32: ``q = e4m3(clamp(y * r, -448, 448))`` with ``r = 1 / s``
    the correctly rounded fp32 reciprocal of the scale (one per scale, as vLLM's and
    FlashInfer's kernels multiply by one; a division per value would cost the fused kernels
    more than the rest of the quantization), the product in fp32, the clamp saturating (a
    plain cast of a value above 448 gives NaN), the cast rounding to nearest even and keeping
    the sign of a zero. ``s`` per mode:

    - "tensor": the given ``scale`` (a positive fp32 tensor of one element), returned as is;
    - "token": per row, ``max(amax(|y_row|), 1e-10) / 448`` in fp32, scales [..., 1] fp32;
    - "group": per row and group of ``group`` consecutive columns, the same from the group's
      amax; scales [M, N / group] fp32 (M = the rows of y flattened to 2-D) stored
      column-major with M padded to ``fp8_scale_rows(M)``: the layout that vLLM's per-token-group
      quantization hands to DeepGEMM-style block-scaled GEMMs, group g of row m at element
      ``g * fp8_scale_rows(M) + m`` of the storage.

    y must be finite (an Inf or NaN gives unspecified bits)."""
    if mode not in FP8_MODES:
        raise ValueError(f"mode must be one of {FP8_MODES}, got {mode!r}")
    n = y.shape[-1]
    y2 = y.detach().reshape(-1, n).float()
    if mode == "tensor":
        s = scale.float().reshape(())
    elif mode == "token":
        s = _fp8_scale(y2.abs().amax(-1, keepdim=True))
    else:
        amax = y2.view(y2.shape[0], n // group, group).abs().amax(-1)
        s = _fp8_scale(amax)
    inv = (1.0 / s.double()).float()  # correctly rounded: a float64 quotient rounded once
    per_col = inv if mode != "group" else inv.repeat_interleave(group, dim=-1)
    q = (y2 * per_col).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(y.shape)
    if mode == "tensor":
        return q, scale
    if mode == "token":
        return q, s.reshape(*y.shape[:-1], 1)
    m = y2.shape[0]
    storage = torch.zeros(n // group, fp8_scale_rows(m), dtype=torch.float32, device=y.device)
    storage[:, :m] = s.t()
    return q, storage.t()[:m]


def dequant_fp8(q: torch.Tensor, scales: torch.Tensor, mode: str, group: int = 128) -> torch.Tensor:
    """The fp32 values q and scales (``quant_fp8``'s) stand for: each e4m3 value times its scale."""
    n = q.shape[-1]
    v = q.reshape(-1, n).float()
    if mode == "tensor":
        s = scales.float().reshape(())
    elif mode == "token":
        s = scales.reshape(-1, 1)
    else:
        s = scales.repeat_interleave(group, dim=-1)
    return (v * s).reshape(q.shape)
