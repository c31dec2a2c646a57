"""The packed format of the quantized all-reduce's codecs: codecs, groups, bit planes and the
byte layout of a packed tensor.

The one definition that ``tpfuse.reference`` (the codecs' bit-exact specification) and the
kernels (``tpfuse.kernels.codecs``, ``tpfuse.kernels.quant_allreduce``) and plans
(``tpfuse.comm.quant_plan``) share. Pure Python.
"""

from __future__ import annotations

QUANT_CODECS = ("fp8", "int8", "int6", "int4")
QUANT_GROUP = 32
"""Consecutive values of the flattened tensor that share one scale."""

QUANT_PLANES = {"fp8": (8,), "int8": (8,), "int6": (4, 2), "int4": (4,)}
"""Bit planes of each codec's payload, in storage order: int6 keeps each value's low 4 bits
in one plane and its high 2 bits in another, so every plane packs a power-of-two number of
values into a 32-bit word."""

PACK_ALIGN = 16
"""Every region of a packed tensor (each plane, the scales) starts at a multiple of this."""
SCALE_MIN_EXP = -117
"""Scales never go below 2**-117, so every decoded non-zero value (at least 2**-9 * 2**-117
for fp8) is a normal fp32: the kernels never produce a subnormal, whose handling could differ
between the GPU and the CPU. Only groups whose largest magnitude is below about 1e-33 (fp8)
or 2**-117 * 2**(bits-1) (int codecs) are quantized more coarsely than their magnitude
allows."""


def check_codec(codec: str) -> None:
    """ValueError unless ``codec`` is one of QUANT_CODECS."""
    if codec not in QUANT_CODECS:
        raise ValueError(f"codec must be one of {', '.join(map(repr, QUANT_CODECS))}, got {codec!r}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_layout(numel: int, codec: str, groups: int | None = None) -> tuple[tuple[int, ...], int, int]:
    """(byte offset of each payload plane, byte offset of the scales, total bytes) of the
    packed form of ``numel`` values, or of room for ``groups`` groups when given.

    The format (little-endian): each plane holds, for group g = 0, 1, ..., ``4 * bits`` bytes
    (the group's 32 values at ``bits`` bits each, value j of the group at bits
    ``bits * (j % (32 // bits))`` of 32-bit word ``j // (32 // bits)``; int8 and fp8 thus
    store one byte per value in order, int4 two values per byte, low nibble first); then one
    bf16 scale per group. Every region starts at a multiple of 16 bytes.
    """
    check_codec(codec)
    if groups is None:
        groups = -(-numel // QUANT_GROUP)
    offsets, pos = [], 0
    for bits in QUANT_PLANES[codec]:
        offsets.append(pos)
        pos = _round_up(pos + groups * 4 * bits, PACK_ALIGN)
    return tuple(offsets), pos, _round_up(pos + 2 * groups, PACK_ALIGN)
