"""Payload reads into a :class:`PacketAssembler`'s buffer, as the requester's
:class:`WqeExecutor` and the responder's :class:`ResponseGenerator` both issue them: the
64-byte words holding a packet's payload as AXI INCR bursts that do not cross 4 KiB, and
the buffer beats reserved for bursts issued and not yet freed."""
from amaranth import C, Cat, Mux, Signal, signed
from amaranth.lib import data

from hdl.arith import lookahead_sum
from hdl.nic.packet_assembler import MAX_DMA_BEATS
from hdl.nic.signatures import PayloadSource

__all__ = ["PayloadBurstsLayout", "payload_words", "payload_bursts", "dma_payload",
           "payload_read_stage"]

BEAT_BYTES = 64
PAGE_BYTES = 4096            # AXI bursts may not cross this
PAGE_BEATS = PAGE_BYTES // BEAT_BYTES
BEATS_BITS = 7               # MAX_DMA_BEATS and one less fit; payload_words is modulo this


class PayloadBurstsLayout(data.StructLayout):
    """The words holding a non-empty payload: ``beats`` of them from byte ``offset`` of
    the first, read as ``n_ar`` bursts (2 when they cross a 4 KiB page), each ``len + 1``
    beats from ``addr``."""
    def __init__(self):
        super().__init__({
            "offset": 6,
            "beats": range(MAX_DMA_BEATS + 1),
            "n_ar": range(3),
            "ar0_addr": 64, "ar0_len": 8,
            "ar1_addr": 64, "ar1_len": 8,
        })


def payload_words(m, offset, length, *, name="words"):
    """``(beats, beats_less1)`` modulo 2**7: the 64-byte words holding ``length`` bytes (at
    least one) from byte ``offset`` of the first, and one fewer, driven combinationally in
    ``m``. Only ``length`` modulo 8192 counts."""
    width = 6 + BEATS_BITS
    length = length[:width]
    # Each one lookahead sum, its constant folded into an operand: offset + 63, and
    # offset - 1 sign-extended (offset 0 borrows from every bit above).
    up = lookahead_sum(m, length, offset + (BEAT_BYTES - 1), name=f"{name}_up")
    down = lookahead_sum(m, length, Cat((offset - 1)[:6], (offset == 0).replicate(width - 6)),
                         name=f"{name}_down")
    return up[6:width], down[6:width]


def payload_bursts(m, addr, beats, beats_less1):
    """A :class:`PayloadBurstsLayout` signal for a non-empty payload at ``addr`` held by
    ``beats`` words (``beats_less1``, one fewer: :func:`payload_words`), driven
    combinationally in ``m``."""
    bursts = Signal(PayloadBurstsLayout())
    # The page index of the payload's last word, counted from the first word's page: 64 or
    # more when the payload crosses into the next page.
    last = Signal(8)
    m.d.comb += last.eq(lookahead_sum(m, addr[6:12], beats_less1, name="last_word"))
    crosses = last >= PAGE_BEATS
    m.d.comb += [
        bursts.offset.eq(addr[:6]),
        bursts.beats.eq(beats),
        bursts.n_ar.eq(Mux(crosses, 2, 1)),
        bursts.ar0_addr.eq(Cat(C(0, 6), addr[6:])),
        bursts.ar0_len.eq(Mux(crosses, ~addr[6:12], beats_less1)),    # to the page's end
        bursts.ar1_addr.eq(Cat(C(0, 12), lookahead_sum(m, addr[12:], 0, 1, name="next_page"))),
        bursts.ar1_len.eq(last - PAGE_BEATS),
    ]
    return bursts


def dma_payload(item, bursts):
    """The statements that make ``item`` (a stage item: a packet descriptor ``desc`` and
    the :class:`PayloadBurstsLayout` burst fields) read its payload by DMA as ``bursts``."""
    return [
        item.desc.source.eq(PayloadSource.DMA),
        item.desc.offset.eq(bursts.offset),
        item.desc.dma_beats.eq(bursts.beats),
        item.n_ar.eq(bursts.n_ar),
        item.ar0_addr.eq(bursts.ar0_addr), item.ar0_len.eq(bursts.ar0_len),
        item.ar1_addr.eq(bursts.ar1_addr), item.ar1_len.eq(bursts.ar1_len),
    ]


def payload_read_stage(m, *, layout, item, item_valid, item_taken, beats, beats_less1,
                       can_pass, ar, ar_id, buffer_beats, freed, reserve=None, pieces=None):
    """The pipeline stage that issues a packet's payload bursts. It holds one item of
    ``layout`` (the :class:`PayloadBurstsLayout` fields plus ``desc.dma_beats``), taken
    from ``item`` when ``item_valid`` and the stage is free or passing its item on (this
    drives ``item_taken``); issues its bursts on ``ar`` (id ``ar_id``), the first only once
    the assembler's buffer has room for all of the packet's beats (reserved then: the read
    data is always accepted), one reserved beat freed per ``freed`` strobe (a strobe with
    nothing reserved is ignored: the assembler frees only beats that were reserved); and
    passes the item on when its last burst is out and ``can_pass``. Returns the held item
    and the pass strobe.

    ``reserve`` (default: the item's payload source is DMA) says whether an item reserves
    ``beats``. With ``pieces`` (a stream of ``layout``'s ``piece`` field), each held item
    with bursts writes its ``piece`` record there, before or with its first burst, which
    waits for it.

    The room test is a register's sign: ``spare``, the free beats less the held packet's
    while its first burst waits, is computed as the item is taken, from ``beats`` and
    ``beats_less1`` (:func:`payload_words` of an item with a DMA payload, anything for
    another): a user keeps those in registers for this path to stay short."""
    held_valid = Signal()
    held = Signal(layout)
    issued = Signal(range(3))                   # bursts of the held item issued
    free = Signal(range(buffer_beats + 1), init=buffer_beats)      # beats not reserved
    spare = Signal(signed(len(free) + 1), init=buffer_beats)
    width = len(spare)
    first_ar = issued == 0
    if pieces is None:
        recorded = C(1)
    else:
        noted = Signal()                        # the held item's piece record is written
        m.d.comb += [pieces.valid.eq(held_valid & (held.n_ar != 0) & ~noted),
                     pieces.payload.eq(held.piece)]
        recorded = noted | pieces.ready
        with m.If(item_taken):
            m.d.sync += noted.eq(0)
        with m.Elif(pieces.valid & pieces.ready):
            m.d.sync += noted.eq(1)
    m.d.comb += [
        ar.valid.eq(held_valid & (issued != held.n_ar) & (~first_ar | (~spare[-1] & recorded))),
        ar.payload.id.eq(ar_id),
        ar.payload.addr.eq(Mux(first_ar, held.ar0_addr, held.ar1_addr)),
        ar.payload.len.eq(Mux(first_ar, held.ar0_len, held.ar1_len)),
    ]
    ar_fire = ar.valid & ar.ready
    first_fire = ar_fire & first_ar
    passed = held_valid & ((issued == held.n_ar) | ((issued + 1 == held.n_ar) & ar_fire)) & can_pass
    m.d.comb += item_taken.eq(item_valid & (~held_valid | passed))

    # Every sum from registers, chosen by the handshakes afterwards: an item is taken only
    # when the held one has no first burst waiting, or issues it now, so then spare is
    # what is free after this cycle's reservation.
    freeing = freed & (first_fire | (free != buffer_beats))
    if reserve is None:
        reserve = item.desc.source == PayloadSource.DMA
    reserving = item_taken & reserve
    spare_bits = spare.as_unsigned()
    free_more = lookahead_sum(m, free, 0, 1, name="free_more")[:width]
    spare_more = lookahead_sum(m, spare_bits, 0, 1, name="spare_more")[:width]
    def minus(value, name):
        return lookahead_sum(m, spare_bits, ~Cat(value, C(0, width - len(value))), 1,
                             name=name)[:width]
    spare_less = minus(beats, "spare_less")
    spare_less_but1 = minus(beats_less1, "spare_less_but1")       # spare - beats + 1
    with m.If(first_fire):
        m.d.sync += free.eq(Mux(freeing, spare_more, spare_bits))
    with m.Else():
        m.d.sync += free.eq(Mux(freeing, free_more, free))
    with m.If(reserving):
        m.d.sync += spare.eq(Mux(freeing, spare_less_but1, spare_less))
    with m.Else():
        m.d.sync += spare.eq(Mux(freeing, spare_more, spare_bits))

    with m.If(ar_fire):
        m.d.sync += issued.eq(issued + 1)
    with m.If(passed):
        m.d.sync += held_valid.eq(0)
    with m.If(item_taken):
        m.d.sync += [held_valid.eq(1), held.eq(item), issued.eq(0)]
    return held, passed
