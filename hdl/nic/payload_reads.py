"""Payload reads into a :class:`PacketAssembler`'s buffer, as the requester's
:class:`WqeExecutor` and the responder's :class:`ResponseGenerator` both issue them: the
64-byte words holding a packet's payload as AXI INCR bursts that do not cross 4 KiB, and
the count of buffer beats reserved for bursts issued and not yet freed."""
from amaranth import C, Cat, Mux, Signal
from amaranth.lib import data

from hdl.nic.packet_assembler import MAX_DMA_BEATS

__all__ = ["PayloadBurstsLayout", "payload_bursts", "payload_reservation"]

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
