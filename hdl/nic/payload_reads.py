"""Payload reads into a :class:`PacketAssembler`'s buffer, as the requester's
:class:`WqeExecutor` and the responder's :class:`ResponseGenerator` both issue them: the
64-byte words holding a packet's payload as AXI INCR bursts that do not cross 4 KiB, and
the count of buffer beats reserved for bursts issued and not yet freed."""
from amaranth import C, Cat, Mux, Signal
from amaranth.lib import data

from hdl.nic.packet_assembler import MAX_DMA_BEATS
from hdl.nic.signatures import PayloadSource

__all__ = ["PayloadBurstsLayout", "payload_bursts", "dma_payload", "payload_reservation",
           "payload_read_stage"]

BEAT_BYTES = 64
PAGE_BYTES = 4096            # AXI bursts may not cross this


class PayloadBurstsLayout(data.StructLayout):
    """The words holding ``[addr, addr + length)``: ``beats`` of them from byte ``offset``
    of the first, read as ``n_ar`` bursts (0 for an empty payload; 2 when they cross a
    4 KiB page), each ``len + 1`` beats from ``addr``."""
    def __init__(self):
        super().__init__({
            "offset": 6,
            "beats": range(MAX_DMA_BEATS + 1),
            "n_ar": range(3),
            "ar0_addr": 64, "ar0_len": 8,
            "ar1_addr": 64, "ar1_len": 8,
        })


def payload_bursts(m, addr, length):
    """A :class:`PayloadBurstsLayout` signal for ``length`` (at most 4096) bytes at
    ``addr``, driven combinationally in ``m``."""
    bursts = Signal(PayloadBurstsLayout())
    page_left = Signal(range(PAGE_BYTES // BEAT_BYTES + 1))
    m.d.comb += [
        bursts.offset.eq(addr[:6]),
        bursts.beats.eq((addr[:6] + length + BEAT_BYTES - 1) >> 6),
        page_left.eq(PAGE_BYTES // BEAT_BYTES - addr[6:12]),
    ]
    two_bursts = bursts.beats > page_left
    m.d.comb += [
        bursts.n_ar.eq(Mux(length == 0, 0, Mux(two_bursts, 2, 1))),
        bursts.ar0_addr.eq(Cat(C(0, 6), addr[6:])),
        bursts.ar0_len.eq(Mux(two_bursts, page_left, bursts.beats) - 1),
        bursts.ar1_addr.eq(Cat(C(0, 12), addr[12:] + 1)),
        bursts.ar1_len.eq(bursts.beats - page_left - 1),
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


def payload_reservation(m, buffer_beats, reserve, freed):
    """The payload-buffer beats reserved (a register in ``m``): ``reserve`` more in each
    cycle (a packet's beats as its first burst is issued), one fewer per ``freed`` strobe
    of the assembler. A strobe with nothing reserved is ignored: the assembler frees only
    beats that were reserved."""
    reserved = Signal(range(buffer_beats + 1))
    reserving = Signal(range(buffer_beats + MAX_DMA_BEATS + 1))
    m.d.comb += reserving.eq(reserved + reserve)
    m.d.sync += reserved.eq(reserving - (freed & (reserving != 0)))
    return reserved


def payload_read_stage(m, *, layout, item, item_valid, item_taken, can_pass, ar, ar_id,
                       buffer_beats, freed):
    """The pipeline stage that issues a packet's payload bursts. It holds one item of
    ``layout`` (the :class:`PayloadBurstsLayout` fields plus ``desc.dma_beats``), taken
    from ``item`` when ``item_valid`` and the stage is free or passing its item on (this
    drives ``item_taken``); issues its bursts on ``ar`` (id ``ar_id``), the first only
    once the assembler's buffer has room for all of the packet's beats (reserved then:
    the read data is always accepted); and passes the item on when its last burst is out
    and ``can_pass``. Returns the held item and the pass strobe."""
    held_valid = Signal()
    held = Signal(layout)
    ars_left = Signal(range(3))
    reserve = Signal(range(MAX_DMA_BEATS + 1))
    reserved = payload_reservation(m, buffer_beats, reserve, freed)
    first_ar = ars_left == held.n_ar
    room = reserved + held.desc.dma_beats <= buffer_beats
    m.d.comb += [
        ar.valid.eq(held_valid & (ars_left != 0) & (~first_ar | room)),
        ar.payload.id.eq(ar_id),
        ar.payload.addr.eq(Mux(first_ar, held.ar0_addr, held.ar1_addr)),
        ar.payload.len.eq(Mux(first_ar, held.ar0_len, held.ar1_len)),
    ]
    ar_fire = ar.valid & ar.ready
    passed = held_valid & ((ars_left == 0) | ((ars_left == 1) & ar_fire)) & can_pass
    m.d.comb += [
        reserve.eq(Mux(ar_fire & first_ar, held.desc.dma_beats, 0)),
        item_taken.eq(item_valid & (~held_valid | passed)),
    ]
    with m.If(ar_fire):
        m.d.sync += ars_left.eq(ars_left - 1)
    with m.If(passed):
        m.d.sync += held_valid.eq(0)
    with m.If(item_taken):
        m.d.sync += [held_valid.eq(1), held.eq(item), ars_left.eq(item.n_ar)]
    return held, passed
