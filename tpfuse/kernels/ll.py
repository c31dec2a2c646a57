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
links, so LL serves small messages only (``Knobs.ll_max_bytes``, tpfuse.comm.knobs).

**Words.** ``word = bits | flag << 32`` (uint64); bits are one fp32 element or two 16-bit
elements (the lower-addressed one in the low half); ``flag = epoch % (2**32 - 1) + 1``,
never 0.

**Consumed words are zeroed.** After summing a tile, the reader stores 0 over every word it
read. Between calls an LL region therefore holds zeros only, and during a call a word is 0 or
carries the current call's flag. Without this, a word last written 2**32 - 1 calls earlier
(hours of decode) would carry the current flag and be taken for new data. Zeroing is safe:
a reader's region of parity p is next written in call k + 2, which no peer starts before
this rank has started call k + 1, after the zeroing kernel ended.

The one-shot kernels over the LL regions (the all-reduce's and the fused LL / Lamport kernel)
store nothing into the reader's own slot: a reader sums its peers' words and its own input,
which it reads again from x (local memory the kernel has just read, where the slot would cost
a store, a poll and a zeroing per byte). Its own slot stays zero. (The fused row-wise kernel,
in regions of its own, does use its own slot: ``tpfuse.kernels.fused``.)

LL regions rotate by call parity, as the data regions do (a peer one call ahead writes the
other parity), and hold nothing but LL words and Lamport words (``tpfuse.comm.workspace``).

**Lamport words: the data is its own flag.** LL sends 8 bytes per 4 of data. A Lamport word
(TensorRT-LLM's name for the scheme) is one element and nothing else: the sender stores the
complement of the element's bits (uint16 or uint32), and a zero word means "not written yet".
An element whose bits are all ones (a NaN) would complement to 0, so it is sent as the NaN
with its sign bit clear: the sum is NaN either way, and NaN payload bits are not part of the
contract (``tpfuse.reference``). Every other value arrives exactly. The reader polls the
words until none is 0, so each element is checked on its own and a vector store that lands
in pieces is waited out (the one-shot kernels' threads each spin on their own 16-byte
vectors first, ``ll_wait``'s SPIN); consumed words are zeroed as above. One byte on the
links per byte of data, where LL sends two, so Lamport serves one-shot messages up to
``Knobs.lamport_max_bytes``. (FlashInfer's version uses -0.0 as its sentinel
and sends inputs' -0.0 as +0.0, changing the bits of signed zeros; complemented words cost
no value's bits.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse._runtime import INTERPRETER
from tpfuse.kernels.common import to_f32
from tpfuse.kernels.peer import tree_sum
from tpfuse.kernels.sync import GUARD_POLLS, _record_error, backoff, give_up, now_ns

SPIN_LOOKS = tl.constexpr(1 << 16)
"""The most looks a thread's first wait for a vector of Lamport words takes (``_spin``) before
the CTA falls back to the guarded poll: about 40 ms at an L2 round trip each. The spin reads
neither the clock nor the abort word (a read of it would sit on every call's critical path),
so a wait that ends in a timeout or meets an abort first spends up to SPIN_LOOKS looks per
vector a thread holds, per peer slot and per tile, bounded, against timeouts of seconds."""


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


@triton.constexpr_function
def lamport_word(elem):
    """The Lamport word type of elements of dtype ``elem``: the unsigned integer of its width."""
    return tl.uint32 if elem.primitive_bitwidth == 32 else tl.uint16


@triton.jit
def _complement(bits):
    """~bits for uint16 or uint32 (Triton's interpreter cannot invert unsigned integers)."""
    ONES: tl.constexpr = 0xFFFFFFFF if bits.dtype.primitive_bitwidth == 32 else 0xFFFF
    return bits ^ tl.full(bits.shape, ONES, bits.dtype)


@triton.jit
def lamport_pack(vals):
    """[BLOCK] fp32 or 16-bit elements -> [BLOCK] Lamport words (uint32 or uint16 of the
    same width): the complement of each element's bits, never 0 (an element whose bits are
    all ones, a NaN, is sent as the NaN with the sign bit clear, whose complement is the
    sign bit alone)."""
    WORD: tl.constexpr = lamport_word(vals.dtype)
    SIGN: tl.constexpr = 0x80000000 if WORD.primitive_bitwidth == 32 else 0x8000
    words = _complement(vals.to(WORD, bitcast=True))
    return tl.where(words == 0, tl.full(words.shape, SIGN, WORD), words)


@triton.jit
def _arrived_f32(words, flag, ELEM: tl.constexpr, LAMPORT: tl.constexpr):
    """(whether each word has arrived, its elements widened to fp32 in element order)."""
    if LAMPORT:
        arrived = words != 0
        vals = to_f32(_complement(words).to(ELEM, bitcast=True))
    else:
        arrived = (words >> 32) == flag
        vals = _unpack_f32(words, ELEM)
    return arrived, vals


@triton.jit
def poll_slots(slot0, slot_words, woffs, wmask, flag, W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr,
               own=None, rank=0):
    """One look at the W slots ``slot0 + s * slot_words`` at woffs: the fp32 sum of their
    values in ``peer.tree_sum``'s order (``peer.sum_in_tree_order``'s order and roundings), and
    whether any word there has not arrived yet. The W loads are independent, so they are in
    flight together. With ``own`` (this rank's elements widened to fp32, in element order),
    slot ``rank`` is not read: own stands in for it."""
    parts = ()
    for s in tl.static_range(W):
        if own is None:
            words = tl.load(slot0 + s * slot_words + woffs, mask=wmask, other=0, volatile=True)
            arrived, vals = _arrived_f32(words, flag, ELEM, LAMPORT)
        else:
            mine = s == rank  # a uniform scalar: the load is predicated off as a whole
            words = tl.load(slot0 + s * slot_words + woffs, mask=wmask & (s != rank), other=0, volatile=True)
            arrived, vals = _arrived_f32(words, flag, ELEM, LAMPORT)
            arrived = arrived | mine
            vals = tl.where(mine, own, vals)
        parts = parts + (vals,)
        if s == 0:
            late = ~arrived
        else:
            late = late | ~arrived
    return tree_sum(parts), _any(late & wmask)


@triton.jit
def _any(flags):
    """Whether any lane of the 1-D or 2-D boolean ``flags`` is set, as one CTA-wide value."""
    lanes = flags.to(tl.int32)
    if len(flags.shape) == 2:
        lanes = tl.max(lanes, 1)
    return tl.max(lanes, 0) != 0


@triton.constexpr_function
def _spin_asm(word_bits):
    """``_spin_vectors``'s PTX: $0-$3 the vector, $4 its least word, $5 the address, $6 live."""
    if word_bits == 16:  # the smaller half of each register
        least = "".join(f"and.b32 t0, ${r}, 65535; shr.u32 t1, ${r}, 16; min.u32 t0, t0, t1; "
                        + ("mov.u32 $4, t0;\n" if r == 0 else "min.u32 $4, $4, t0;\n") for r in range(4))
    else:
        least = "min.u32 $4, $0, $1; min.u32 t0, $2, $3; min.u32 $4, $4, t0;\n"
    # live ($6) is read before any output is written: an output may share its register
    return ("{\n.reg .pred p, q;\n.reg .u32 n, t0, t1;\nsetp.eq.u32 p, $6, 0;\n"
            "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; mov.u32 $4, 0; mov.u32 n, 0;\n"
            "@p bra DONE;\nSPIN:\n"
            "ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$5];\nadd.u32 n, n, 1;\n" + least +
            f"setp.eq.u32 p, $4, 0;\nsetp.lt.u32 q, n, {SPIN_LOOKS.value};\nand.pred p, p, q;\n@p bra SPIN;\n"
            "DONE:\n}")


if INTERPRETER:

    @triton.jit
    def _spin_vectors(ptrs, live, WORD_BITS: tl.constexpr):
        """The interpreter's stand-in (it cannot run PTX): one look at the four 32-bit
        registers, and their least word; a vector not there yet is reported late, and the
        guarded poll waits for it. So the CPU tests run ``_spin``'s masks and word order."""
        regs = ptrs.to(tl.pointer_type(tl.uint32))
        on = live != 0
        r0 = tl.load(regs, mask=on, other=0, volatile=True)
        r1 = tl.load(regs + 1, mask=on, other=0, volatile=True)
        r2 = tl.load(regs + 2, mask=on, other=0, volatile=True)
        r3 = tl.load(regs + 3, mask=on, other=0, volatile=True)
        if WORD_BITS == 16:
            least = tl.minimum(tl.minimum(tl.minimum(r0 & 0xFFFF, r0 >> 16), tl.minimum(r1 & 0xFFFF, r1 >> 16)),
                               tl.minimum(tl.minimum(r2 & 0xFFFF, r2 >> 16), tl.minimum(r3 & 0xFFFF, r3 >> 16)))
        else:
            least = tl.minimum(tl.minimum(r0, r1), tl.minimum(r2, r3))
        return r0, r1, r2, r3, least

else:

    @triton.jit
    def _spin_vectors(ptrs, live, WORD_BITS: tl.constexpr):
        """The four 32-bit registers of the 16-byte vector of Lamport words at each of ``ptrs``
        (16-byte aligned), loaded with ld.volatile until none of its WORD_BITS-bit words is 0
        or SPIN_LOOKS looks have passed, and its least word (0: not every word has arrived);
        zeros, and no load, where ``live`` is 0. Each thread loops on its own: no CTA-wide
        decision."""
        return tl.inline_asm_elementwise(_spin_asm(WORD_BITS), "=r,=r,=r,=r,=r,l,r", [ptrs, live],
                                         dtype=(tl.uint32, ) * 5, is_pure=False, pack=1)


@triton.jit
def _vector_ends(t, VEC: tl.constexpr):
    """(first, last) element of each group of VEC (a power of two) consecutive elements of 1-D t."""
    n: tl.constexpr = t.shape[0] // VEC
    first = t
    last = t
    for level in tl.static_range(VEC.bit_length() - 1):
        first, _ = tl.split(tl.reshape(first, [n, VEC >> (level + 1), 2]))
        _, last = tl.split(tl.reshape(last, [n, VEC >> (level + 1), 2]))
    return tl.reshape(first, [n]), tl.reshape(last, [n])


@triton.jit
def _spin(slot0, slot_words, woffs, wmask, W: tl.constexpr, ELEM: tl.constexpr, own, rank):
    """``poll_slots``' result for Lamport words at 1-D woffs (groups of 16 bytes, 16-byte
    aligned), with ``own``, once each thread's vectors have arrived: each thread spins on its
    own vectors (``_spin_vectors``), so a vector is summed one L2 round trip after it lands,
    where a CTA-wide poll looks again only after every thread's last look. Vectors are taken
    whole: one whose first and last words are both in wmask (the callers' masks are prefixes)
    is waited for; one only partly in it (the all-reduce's last vector where numel is not a
    multiple of a vector) is reported late, for the guarded poll; one outside it is skipped."""
    BITS: tl.constexpr = slot0.dtype.element_ty.primitive_bitwidth
    VEC: tl.constexpr = 128 // BITS
    n: tl.constexpr = woffs.shape[0] // VEC
    voffs = _vector_ends(woffs, VEC)[0]
    first, last = _vector_ends(wmask.to(tl.int32), VEC)
    live = first & last
    late = tl.zeros([n], tl.int1)  # per vector, in the spin's layout
    parts = ()
    for s in tl.static_range(W):
        mine = s == rank  # a uniform scalar: the own slot is neither read nor waited for
        r0, r1, r2, r3, least = _spin_vectors(slot0 + s * slot_words + voffs, tl.where(mine, 0, live), BITS)
        late = late | ((least == 0) & ((first | last) != 0) & (s != rank))
        regs = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [n * 4])  # r0 r1 r2 r3
        if BITS == 16:  # the lower-addressed word in the low half
            words = tl.reshape(tl.join((regs & 0xFFFF).to(tl.uint16), (regs >> 16).to(tl.uint16)), [n * VEC])
        else:
            words = regs
        parts = parts + (tl.where(mine, own, _arrived_f32(words, 0, ELEM, True)[1]),)
    return tree_sum(parts), _any(late)


@triton.jit
def ll_reduce(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
              W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr = False, own=None, SPIN: tl.constexpr = False):
    """``ll_wait``'s sum of the words at woffs (masked by wmask) of the W local slots (with
    ``own``, of the W - 1 other slots and own); the words read are then zeroed."""
    acc = ll_wait(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP, W, ELEM, LAMPORT,
                  own, SPIN)
    for s in tl.static_range(W):
        read = wmask if own is None else wmask & (s != rank)
        tl.store(slot0 + s * slot_words + woffs, tl.zeros_like(woffs).to(slot0.dtype.element_ty), mask=read)
    return acc


@triton.jit
def ll_wait(slot0, slot_words, woffs, wmask, flag, ctrl, status, epoch, rank, timeout_ns, OP: tl.constexpr,
            W: tl.constexpr, ELEM: tl.constexpr, LAMPORT: tl.constexpr, own=None, SPIN: tl.constexpr = False):
    """The fp32 sum in tree order (``peer.tree_sum``) of the elements in the words at woffs (1-D, or 2-D for
    Lamport words; masked by wmask) of the W local slots, once every word has arrived (LL
    words: carries ``flag``; with LAMPORT, Lamport words: is not 0). The words are left as
    they are. With ``own`` (this rank's elements widened to fp32, in the words' element
    order), slot ``rank`` is neither read nor waited for: own stands in for it, so a kernel
    that passes own need not store its elements into its own slot.

    With SPIN (Lamport words at 1-D woffs in 16-byte aligned vectors, and own), the first
    look is ``_spin``: on a GPU each thread spins on its own vectors, for at most SPIN_LOOKS
    looks, and the polls below run only if a vector is still missing after it (2x H100, the
    one-shot all-reduce: 1 MiB 6.6 -> 6.3 us, 4 MiB 17.9 -> 16.7; benchmarks/NOTES.md). The
    callers pass own in woffs' 1-D layout: where own and the sum went through a 2-D
    reshape, Triton 3.6 rematerialised the spin once per result and layout (eight spins
    per slot in the fused kernel's TTGIR, each a further L2 round trip);
    tests/test_guard_layouts.py counts them.

    Gives up, as ``sync.wait`` does, after ``timeout_ns`` or when the abort word is set (both
    looked at, through ``sync.give_up``, when the first poll finds a word missing and every
    ``sync.GUARD_POLLS`` polls after it): it
    then records ``(OP, rank, first late peer, epoch)`` and returns NaN."""
    if SPIN:
        tl.static_assert(LAMPORT and len(woffs.shape) == 1, "SPIN waits on Lamport words at 1-D offsets")
        acc, late = _spin(slot0, slot_words, woffs, wmask, W, ELEM, own, rank)
    else:
        acc, late = poll_slots(slot0, slot_words, woffs, wmask, flag, W, ELEM, LAMPORT, own, rank)
    if late:  # `late` is a CTA-wide reduction, `stop` too (sync.give_up): all warps loop alike
        start = now_ns()
        stop = give_up(ctrl, start, start, timeout_ns)
        polls = 0
        while late and not stop:
            backoff()
            acc, late = poll_slots(slot0, slot_words, woffs, wmask, flag, W, ELEM, LAMPORT, own, rank)
            polls += 1
            if polls % GUARD_POLLS == 0:
                stop = give_up(ctrl, start, now_ns(), timeout_ns)
        if late:  # records nothing after an abort: the abort word is set already
            skipped = W if own is None else rank
            _record_error(ctrl, status, OP, rank,
                          _first_late(slot0, slot_words, woffs, wmask, flag, skipped, W, ELEM, LAMPORT), epoch)
            acc = tl.full(acc.shape, float("nan"), tl.float32)  # no numbers from a failed wait (peer.poison)
    return acc


@triton.jit
def _first_late(slot0, slot_words, woffs, wmask, flag, skipped, W: tl.constexpr, ELEM: tl.constexpr,
                LAMPORT: tl.constexpr):
    """The lowest rank other than ``skipped`` whose slot still has a word at woffs that has
    not arrived (W if none)."""
    first = tl.full([], W, tl.int32)
    for s in tl.static_range(W):
        words = tl.load(slot0 + s * slot_words + woffs, mask=wmask, other=0, volatile=True)
        arrived, _ = _arrived_f32(words, flag, ELEM, LAMPORT)
        late = _any(~arrived & wmask) & (s != skipped)
        first = tl.minimum(first, tl.where(late, s, W))
    return first
