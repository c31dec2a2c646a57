"""The low-latency (LL) protocol: the flag travels inside each data word, as in NCCL's LL.

With a separate flag, a one-shot all-reduce has this chain on its latency path: data stores to
the peers, a system-scope release (which waits until the peers acknowledge those stores over
NVLink), the flag store, the peer's poll of the flag, then the peer's loads of the data. In LL
each 8-byte word holds 4 bytes of data and a 4-byte flag naming the call, written by one
aligned 8-byte store: a reader that sees the flag sees the data beside it. (The stores are
Triton's plain ``st.global``, the polls ``ld.volatile``; the PTX memory model promises
single-copy atomicity to strong accesses only, and NCCL's LL uses ``st.volatile``. Aligned
8-byte stores are not split on NVIDIA GPUs or over NVLink, which NCCL's LL relies on too,
and the bitwise GPU suites check every word.) The reader polls the data words themselves,
so there is no fence, no flag store and no second load. The price is twice the bytes on the
links, so LL serves small messages only (``tpfuse.comm.plan.LL_MAX_BYTES``).

**Words.** ``word = bits | flag << 32`` (uint64); bits are one fp32 element or two 16-bit
elements (the lower-addressed one in the low half); ``flag = epoch % (2**32 - 1) + 1``,
never 0.

**Consumed words are zeroed.** After summing a tile, the reader stores 0 over every word it
read. Between calls an LL region therefore holds zeros only, and during a call a word is 0 or
carries the current call's flag. Without this, a word last written 2**32 - 1 calls earlier
(hours of decode) would carry the current flag and be taken for new data. Zeroing is safe:
a reader's region of parity p is next written in call k + 2, which no peer starts before
this rank has started call k + 1, after the zeroing kernel ended.

LL regions rotate by call parity, as the data regions do (a peer one call ahead writes the
other parity), and hold nothing but LL words (``tpfuse.comm.workspace``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.kernels.common import to_f32
from tpfuse.kernels.sync import _record_error, backoff, now_ns


@triton.jit
def ll_flag(epoch):
    """The flag of call ``epoch`` (int64) as uint64: in [1, 2**32 - 1], so never a zeroed word's."""
    return (epoch % 0xFFFFFFFF + 1).to(tl.uint64)


@triton.jit
def ll_pack(vals, flag):
    """[BLOCK] fp32 or 16-bit elements -> [BLOCK * bits // 32] uint64 LL words carrying flag."""
    if vals.dtype.primitive_bitwidth == 32:
        bits = vals.to(tl.uint32, bitcast=True)
    else:
        lo, hi = tl.split(tl.reshape(vals, [vals.shape[0] // 2, 2]))
        bits = lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    return bits.to(tl.uint64) | (flag << 32)


@triton.jit
def _unpack_f32(words, ELEM: tl.constexpr):
    """The elements in LL words widened to fp32, in element order: exactly ``to_f32`` of
    the ELEM values that were packed."""
    bits = words.to(tl.uint32)
    if ELEM.primitive_bitwidth == 32:
        vals = to_f32(bits.to(ELEM, bitcast=True))
    else:
        lo = to_f32((bits & 0xFFFF).to(tl.uint16).to(ELEM, bitcast=True))
        hi = to_f32((bits >> 16).to(tl.uint16).to(ELEM, bitcast=True))
        vals = tl.reshape(tl.join(lo, hi), [words.shape[0] * 2])
    return vals


@triton.jit
def _poll(slot0, slot_words, woffs, wmask, flag, W: tl.constexpr, ELEM: tl.constexpr):
    """One look at the W slots ``slot0 + s * slot_words`` at woffs: the fp32 sum in rank
    order of their values (``allreduce.sum_in_rank_order``'s order and roundings), and
    whether any word there does not carry ``flag`` yet. The W loads are independent, so
    they are in flight together."""
    words = tl.load(slot0 + woffs, mask=wmask, other=0, volatile=True)
    late = (words >> 32) != flag
    acc = _unpack_f32(words, ELEM)
    for s in tl.static_range(1, W):
        words = tl.load(slot0 + s * slot_words + woffs, mask=wmask, other=0, volatile=True)
        late = late | ((words >> 32) != flag)
        acc += _unpack_f32(words, ELEM)
    return acc, tl.max((late & wmask).to(tl.int32), 0) != 0


@triton.jit
def ll_reduce(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
              W: tl.constexpr, ELEM: tl.constexpr):
    """The fp32 sum in rank order of the elements in the LL words at woffs (masked by wmask)
    of the W local slots, once every word carries ``flag``; the words are then zeroed.

    Gives up, as ``sync.wait`` does, after ``timeout_ns`` or when the abort word is set: it
    then records ``(OP, rank, first late peer, epoch)`` and returns whatever it saw."""
    acc, late = _poll(slot0, slot_words, woffs, wmask, flag, W, ELEM)
    if late:
        aborted = tl.load(ctrl + 2, volatile=True) != 0
        start = now_ns()
        elapsed = start - start
        while late and not aborted and elapsed < timeout_ns:
            backoff()
            acc, late = _poll(slot0, slot_words, woffs, wmask, flag, W, ELEM)
            aborted = tl.load(ctrl + 2, volatile=True) != 0
            elapsed = now_ns() - start
        if late and not aborted:
            _record_error(ctrl, status, OP, rank, _first_late(slot0, slot_words, woffs, wmask, flag, W), epoch)
    for s in tl.static_range(W):
        tl.store(slot0 + s * slot_words + woffs, tl.zeros_like(woffs).to(tl.uint64), mask=wmask)
    return acc


@triton.jit
def _first_late(slot0, slot_words, woffs, wmask, flag, W: tl.constexpr):
    """The lowest rank whose slot still has a word without ``flag`` at woffs (W if none)."""
    first = tl.full([], W, tl.int32)
    for s in tl.static_range(W):
        words = tl.load(slot0 + s * slot_words + woffs, mask=wmask, other=0, volatile=True)
        late = tl.max((((words >> 32) != flag) & wmask).to(tl.int32), 0) != 0
        first = tl.minimum(first, tl.where(late, s, W))
    return first
