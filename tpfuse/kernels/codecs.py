"""Group quantization codecs (fp8 e4m3, int8, int6, int4): device functions and the
standalone ``quantize`` / ``dequantize``.

The numerical definition, and the packed format, are ``tpfuse.reference`` (``_encode``,
``_decode``, ``packed_layout``); the device functions here perform the same operations in
the same order, so kernels and reference agree on every bit:

- scales are computed from the fp32 bits with integer operations (max of the magnitudes,
  exponent arithmetic, truncation to bf16): no float rounding, no reciprocal that could
  overflow for tiny groups, and a NaN or Inf anywhere in a group shows in its magnitude;
- the one division, ``r = 1 / s``, is done once per group in fp32 (``div.rn.f32`` on GPUs,
  IEEE division under the interpreter: both correctly rounded), then ``x * r`` is one
  rounded fp32 product per value, at most 451.5 in magnitude for the values of the
  group the scale belongs to (never an overflow);
- rounding to an integer is ``(v + 1.5 * 2**23) - 1.5 * 2**23`` in fp32 (half to even);
- e4m3 on GPUs of sm_89 and newer is the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``
  and ``cvt.rn.f16x2.e4m3x2``, half an instruction per value) with the reference's zero and
  NaN conventions patched in; elsewhere (the interpreter, older GPUs) it is integer
  arithmetic on the fp32 bits. tests/test_quant_gpu.py proves the two bitwise equal on every
  fp32 value the encode can meet and on every byte the decode can meet;
- a group's statistics (largest magnitude, the sign that attains it, NaN or Inf) come from
  one unsigned integer maximum over the rotated bits;
- decoding is one exact fp32 product of a small integer (or e4m3 value) and the scale, and
  never subnormal (scales are at least 2**-117).

The encode neither touches float64 nor converts float to int: on H200 those run at half
and an eighth of the fp32 rate, and the encode once cost about 75 instruction slots per
value, which made the quantized all-reduce compute-bound (benchmarks/NOTES.md). The
decode's int-to-float conversion (I2FP) runs at the full rate.

Kernels are launched with ``EXACT_FP`` like every tpfuse kernel. The device functions work
on a tile of GB groups as a [GB, 32] fp32 tensor; the all-reduce (``quant_allreduce.py``)
calls the same functions on its workspace slots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tpfuse import _runtime
from tpfuse.kernels.common import EXACT_FP, round_to, to_f32
from tpfuse.quant_format import QUANT_CODECS, QUANT_GROUP, SCALE_MIN_EXP, check_codec, packed_layout

# Codec ids (the CODEC constexpr of every kernel here); the sub-byte codecs (int6, int4) last.
FP8, INT8, INT6, INT4 = 0, 1, 2, 3
CODEC_IDS = {"fp8": FP8, "int8": INT8, "int6": INT6, "int4": INT4}
_FP8, _INT6, _INT4 = tl.constexpr(FP8), tl.constexpr(INT6), tl.constexpr(INT4)  # as the kernels see them

_GROUP = tl.constexpr(QUANT_GROUP)
_INF_BITS = tl.constexpr(0x7F800000)
_SCALE_NAN = tl.constexpr(0x7FC0)
_SCALE_MIN_BITS = tl.constexpr((127 + SCALE_MIN_EXP) << 23)  # the scales' floor as fp32 bits
_SCALE_MIN_BF16 = tl.constexpr((127 + SCALE_MIN_EXP) << 7)
_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_RINT_MAGIC_BITS = tl.constexpr(0x4B400000)
_E4M3_MAX = tl.constexpr(0x7E)

TILE_ELEMS = 8192 if _runtime.INTERPRETER else 2048
"""Elements per program of the standalone kernels; the interpreter pays per operation, so it
takes large tiles."""
NUM_WARPS = 8


@triton.jit
def bf16_bits_to_f32(b):
    """fp32 value of bf16 bits held in an int32 (0..0xFFFF)."""
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne(v):
    """fp32 v (|v| < 452) -> e4m3 code (int32 0..255): rounded to e4m3 to nearest even, at
    most 448 in magnitude, +0 for a zero code (``reference._e4m3_rne``, which rounds on the
    bits with a variable shift). Here: normal e4m3 values (|v| >= 2**-6) round on the fp32
    bits at a fixed shift of 20 (a carry moves into the exponent, as it should); subnormal
    ones are multiples of 2**-9 and round as the integer |v| * 2**9 in fp32 (exact scaling)."""
    b = v.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    normal = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    sub = (tl.abs(v) * 512.0 + _RINT_MAGIC).to(tl.int32, bitcast=True) - _RINT_MAGIC_BITS
    code = tl.minimum(tl.where(a >= (121 << 23), normal - (120 << 3), sub), _E4M3_MAX)
    return code | tl.where((b < 0) & (code != 0), 0x80, 0)


@functools.cache
def hardware_e4m3(device: torch.device) -> bool:
    """Whether kernels on ``device`` convert e4m3 in hardware (the HW_E4M3 constexpr of the
    kernels here): compiled for a GPU with fp8 conversions, sm_89 (Ada) and newer."""
    return not _runtime.INTERPRETER and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _e4m3_encode(v, HW_E4M3: tl.constexpr):
    """fp32 v (|v| < 452) -> e4m3 code (``_e4m3_rne``). The hardware conversion rounds to
    nearest even and saturates at 448 as the reference does; it keeps the sign of a value
    that rounds to zero (0x80), where the reference writes +0."""
    if HW_E4M3:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        return tl.where(code == 0x80, 0, code)
    else:
        return _e4m3_rne(v)


@triton.jit
def _e4m3_decode(codes):
    """The fp32 value of e4m3 codes (int32 0..255) by the hardware conversion (exact), with
    the reference's reading of the two bytes where e4m3's hardware and the reference differ
    (neither is ever encoded): 0x7F/0xFF (NaN in hardware) are +-480, and 0x80 is +0."""
    mag = codes & 0x7F
    v = mag.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v = tl.where(mag == 0x7F, 480.0, v)
    return tl.where((codes & 0x80) != 0, 0.0 - v, v)


@triton.jit
def encode_groups(x, CODEC: tl.constexpr, HW_E4M3: tl.constexpr):
    """(codes [GB, 32] int32, scales [GB] int32 bf16 bits) of fp32 groups x [GB, 32]
    (``reference._encode``). The codes of a group with NaN or Inf are undefined here:
    ``store_packed`` stores them as zeros, and its NaN scale decodes them to NaN."""
    K: tl.constexpr = (5 if CODEC == _INT6 else 3) if CODEC >= _INT6 else 7  # bits - 1
    # The fp32 bits rotated left by one, (magnitude << 1) | sign, compare as unsigned ints by
    # magnitude, negative on a tie: one maximum gives the largest magnitude (NaN and Inf
    # included), and whether a negative value attains it.
    bits = x.to(tl.uint32, bitcast=True)
    top = tl.max((bits << 1) | (bits >> 31), axis=1)
    amax = (top >> 1).to(tl.int32)
    bad = amax >= _INF_BITS
    if CODEC == _FP8:
        e = amax >> 23
        quot = ((amax & 0x7FFFFF) | 0x800000) // 7
        low = (quot < (1 << 21)).to(tl.int32)
        scale = ((e - 8 - low) << 7) | ((quot >> (14 - low)) - 128)
        scale = tl.maximum(scale, _SCALE_MIN_BF16)
    else:
        s_mag = (tl.maximum(amax - (K << 23), _SCALE_MIN_BITS) & 0x7FFF0000) >> 16
        # The sign flips where only positive values attain a non-zero largest magnitude.
        scale = s_mag | tl.where(((top & 1) == 0) & (amax != 0), 0x8000, 0)
    scale = tl.where(bad, _SCALE_NAN, scale)
    v = x * tl.math.div_rn(1.0, bf16_bits_to_f32(scale))[:, None]
    if CODEC == _FP8:
        codes = _e4m3_encode(v, HW_E4M3)
    else:
        t = tl.minimum(tl.maximum(v + _RINT_MAGIC, _RINT_MAGIC - (1 << K)), _RINT_MAGIC + ((1 << K) - 1))
        codes = t.to(tl.int32, bitcast=True) - _RINT_MAGIC_BITS
    return codes, scale


@triton.jit
def decode_groups(codes, scale, CODEC: tl.constexpr, HW_E4M3: tl.constexpr):
    """fp32 values [GB, 32] of codes [GB, 32] and bf16 scale bits [GB] (``reference._decode``)."""
    s = bf16_bits_to_f32(scale & 0x7FFF)
    if CODEC == _FP8 and HW_E4M3:
        v = _e4m3_decode(codes)
    elif CODEC == _FP8:
        mag = codes & 0x7F
        e4 = mag >> 3
        sig = (mag & 7) + tl.where(e4 > 0, 8, 0)
        pow2 = ((tl.maximum(e4, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)
        v = sig.to(tl.float32) * pow2
        v = tl.where((codes & 0x80) != 0, 0.0 - v, v)  # +0.0 for the code 0x80, as the reference
    else:
        v = tl.where(((scale & 0x8000) != 0)[:, None], -codes, codes).to(tl.float32)
    return v * s[:, None]


@triton.jit
def _pack_plane(codes, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """[GB, BITS] uint32 words holding bits SHIFT..SHIFT+BITS-1 of every code, 32 // BITS
    codes per word, the first in the lowest bits.

    Neighbouring codes are merged pairwise with ``tl.split`` (first pairs, then pairs of
    pairs), never with a reduction: a split keeps both halves in the thread that holds them,
    where a sum over the codes of a word made Triton spread them across threads and cost
    shuffles."""
    GB: tl.constexpr = codes.shape[0]
    PER: tl.constexpr = 32 // BITS
    field = ((codes >> SHIFT) & ((1 << BITS) - 1)).to(tl.uint32)
    for level in tl.static_range(PER.bit_length() - 1):
        lo, hi = tl.split(tl.reshape(field, [GB, BITS, PER >> (level + 1), 2]))
        field = lo | (hi << (BITS << level))
    return tl.reshape(field, [GB, BITS])


@triton.jit
def _unpack_plane(words, BITS: tl.constexpr):
    """The inverse of ``_pack_plane``: [GB, 32] int32 fields of [GB, BITS] words, halving
    each word's bits with ``tl.join`` (which keeps them in the word's thread)."""
    GB: tl.constexpr = words.shape[0]
    PER: tl.constexpr = 32 // BITS
    LEVELS: tl.constexpr = PER.bit_length() - 1
    field = tl.reshape(words, [GB, BITS, 1])
    for level in tl.static_range(LEVELS):
        width = BITS << (LEVELS - 1 - level)
        field = tl.join(field & ((1 << width) - 1), field >> width)
        field = tl.reshape(field, [GB, BITS, 2 << level])
    return tl.reshape(field, [GB, 32]).to(tl.int32)


@triton.jit
def _plane_ptrs(addr, gidx, BITS: tl.constexpr):
    ptr = tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 4)
    return ptr + gidx[:, None] * BITS + tl.arange(0, BITS)[None, :]


@triton.jit
def store_packed(addr, p0, p1, psc, gidx, gmask, codes, scale, CODEC: tl.constexpr):
    """Store groups ``gidx`` ([GB], those with gmask) of a packed buffer at int64 address
    ``addr`` whose planes and scales start at byte offsets p0, p1 (int6 only) and psc. A
    group with a NaN scale is stored with zero codes."""
    bad = (scale == _SCALE_NAN)[:, None]
    if CODEC == _INT6:
        tl.store(_plane_ptrs(addr + p0, gidx, 4), tl.where(bad, 0, _pack_plane(codes, 0, 4)), mask=gmask[:, None])
        tl.store(_plane_ptrs(addr + p1, gidx, 2), tl.where(bad, 0, _pack_plane(codes, 4, 2)), mask=gmask[:, None])
    else:
        BITS: tl.constexpr = 4 if CODEC == _INT4 else 8
        tl.store(_plane_ptrs(addr + p0, gidx, BITS), tl.where(bad, 0, _pack_plane(codes, 0, BITS)),
                 mask=gmask[:, None])
    scale_ptr = (addr + psc).to(tl.pointer_type(tl.uint16))
    tl.store(scale_ptr + gidx, scale.to(tl.uint16), mask=gmask)


@triton.jit
def load_packed(addr, p0, p1, psc, gidx, gmask, CODEC: tl.constexpr):
    """(codes [GB, 32] int32, scales [GB] int32) of groups ``gidx`` of a packed buffer (the
    inverse of ``store_packed``; masked groups give zero codes and a zero scale). Peers may
    have written the buffer, so it is read through L2 (``.cg``)."""
    if CODEC == _INT6:
        lo = tl.load(_plane_ptrs(addr + p0, gidx, 4), mask=gmask[:, None], other=0, cache_modifier=".cg")
        hi = tl.load(_plane_ptrs(addr + p1, gidx, 2), mask=gmask[:, None], other=0, cache_modifier=".cg")
        codes = _unpack_plane(lo, 4) | (_unpack_plane(hi, 2) << 4)
    else:
        BITS: tl.constexpr = 4 if CODEC == _INT4 else 8
        w = tl.load(_plane_ptrs(addr + p0, gidx, BITS), mask=gmask[:, None], other=0, cache_modifier=".cg")
        codes = _unpack_plane(w, BITS)
    if CODEC != _FP8:
        SIGN: tl.constexpr = (32 if CODEC == _INT6 else 8) if CODEC >= _INT6 else 128
        codes = (codes ^ SIGN) - SIGN
    scale_ptr = (addr + psc).to(tl.pointer_type(tl.uint16))
    scale = tl.load(scale_ptr + gidx, mask=gmask, other=0, cache_modifier=".cg").to(tl.int32)
    return codes, scale


@triton.jit
def load_groups(x_ptr, tile, limit, BLOCK: tl.constexpr):
    """Tile ``tile`` of the values at x_ptr as fp32 groups [BLOCK // 32, 32] (zero past
    ``limit`` elements), the tile's group indices and which groups hold any value."""
    GB: tl.constexpr = BLOCK // _GROUP
    gidx = tile * GB + tl.arange(0, GB)
    offs = gidx[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    x = to_f32(tl.load(x_ptr + offs, mask=offs < limit, other=0.0))
    return x, offs, gidx, gidx * _GROUP < limit


@triton.jit
def quantize_kernel(x_ptr, packed_addr, numel, p0, p1, psc, CODEC: tl.constexpr, HW_E4M3: tl.constexpr,
                    BLOCK: tl.constexpr):
    x, offs, gidx, gmask = load_groups(x_ptr, tl.program_id(0), numel, BLOCK)
    codes, scale = encode_groups(x, CODEC, HW_E4M3)
    store_packed(packed_addr, p0, p1, psc, gidx, gmask, codes, scale, CODEC)


@triton.jit
def dequantize_kernel(packed_addr, out_ptr, numel, p0, p1, psc, CODEC: tl.constexpr, HW_E4M3: tl.constexpr,
                      BLOCK: tl.constexpr):
    GB: tl.constexpr = BLOCK // _GROUP
    gidx = tl.program_id(0) * GB + tl.arange(0, GB)
    offs = gidx[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    codes, scale = load_packed(packed_addr, p0, p1, psc, gidx, gidx * _GROUP < numel, CODEC)
    y = decode_groups(codes, scale, CODEC, HW_E4M3)
    tl.store(out_ptr + offs, round_to(y, out_ptr.dtype.element_ty), mask=offs < numel)


# ---------------------------------------------------------------- launchers and wrappers

def quantize_into(x: torch.Tensor, packed: torch.Tensor, codec: str) -> None:
    """Encode contiguous, 16-byte aligned x into ``packed`` (uint8, at least
    ``packed_layout(x.numel(), codec)[2]`` bytes, 16-byte aligned, on x's device)."""
    planes, psc, _ = packed_layout(x.numel(), codec)
    grid = (triton.cdiv(x.numel(), TILE_ELEMS),)
    quantize_kernel[grid](x_ptr=x, packed_addr=packed.data_ptr(), numel=x.numel(), p0=planes[0],
                          p1=planes[-1], psc=psc, CODEC=CODEC_IDS[codec], HW_E4M3=hardware_e4m3(x.device),
                          BLOCK=TILE_ELEMS, num_warps=NUM_WARPS, **EXACT_FP)


def dequantize_into(packed: torch.Tensor, codec: str, out: torch.Tensor) -> None:
    """Decode ``out.numel()`` values from ``packed`` into contiguous, aligned ``out``."""
    planes, psc, _ = packed_layout(out.numel(), codec)
    grid = (triton.cdiv(out.numel(), TILE_ELEMS),)
    dequantize_kernel[grid](packed_addr=packed.data_ptr(), out_ptr=out, numel=out.numel(), p0=planes[0],
                            p1=planes[-1], psc=psc, CODEC=CODEC_IDS[codec], HW_E4M3=hardware_e4m3(out.device),
                            BLOCK=TILE_ELEMS, num_warps=NUM_WARPS, **EXACT_FP)


def quantize(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Group-quantize x: the packed form of its values in flattened (row-major) order.

    Args:
        x: bf16, fp16 or fp32 tensor, any shape and layout, on the kernels' device.
        codec: "fp8" (e4m3), "int8", "int6" or "int4".

    Returns a new 1-D uint8 tensor on x's device of ``tpfuse.quant_format.packed_layout(
    x.numel(), codec)[2]`` bytes: groups of 32 consecutive values, each a payload of
    8/8/6/4 bits per value plus one bf16 scale; layout and codec in
    ``tpfuse.quant_format.packed_layout`` and ``_encode``. Bitwise equal to
    ``tpfuse.reference.quantize``. A group holding NaN or Inf decodes to NaN.

    Raises TypeError (not a float tensor of a supported dtype) or ValueError (unknown codec,
    wrong device).
    """
    check_codec(codec)
    _runtime.check_float_tensor(x, "x")
    # Zeroed: the alignment gaps between regions are part of the bytes and must not vary.
    packed = torch.zeros(packed_layout(x.numel(), codec)[2], dtype=torch.uint8, device=x.device)
    if x.numel():
        quantize_into(_runtime.aligned_contiguous(x.reshape(-1)), packed, codec)
    return packed


def dequantize(packed: torch.Tensor, codec: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The values ``quantize`` packed, as a new tensor of ``shape`` and ``dtype``: each value
    decoded exactly in fp32 and rounded once to dtype (``tpfuse.reference.dequantize``).

    Raises ValueError for an unknown codec, a packed tensor that is not uint8 or too small
    for ``shape``, or on the wrong device; TypeError for an unsupported dtype.
    """
    check_codec(codec)
    if dtype not in _runtime.SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; tpfuse supports bfloat16, float16 and float32")
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    err = _runtime.kernel_device_error(packed, "packed")
    if err is not None:
        raise err
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    need = packed_layout(out.numel(), codec)[2]
    if packed.dtype != torch.uint8 or packed.numel() < need:
        raise ValueError(f"packed must be a uint8 tensor of at least {need} bytes for {out.numel()} values of "
                         f"codec {codec!r}, got {packed.dtype} with {packed.numel()} elements")
    if out.numel():
        dequantize_into(_runtime.aligned_contiguous(packed.reshape(-1)), codec, out.view(-1))
    return out


__all__ = ["QUANT_CODECS", "quantize", "dequantize", "quantize_into", "dequantize_into", "encode_groups",
           "decode_groups", "store_packed", "load_packed", "load_groups"]
