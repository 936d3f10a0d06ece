from amaranth.hdl import Const, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.crc.algorithms import ICRC
from hdl.crc.beat_crc import BeatCRC
from hdl.ib.headers import (BTH, GRH, LNH_IBA_GLOBAL, LNH_IBA_LOCAL, LRH, LRH_BYTES,
                            from_wire, to_wire)
from hdl.link.signatures import check_width

__all__ = ["IcrcEngine", "variant_masks"]


class IcrcEngine(wiring.Component):
    """Invariant CRC of the packets of a beat stream, tapped beside it.

    The ports are plain inputs shaped like :class:`hdl.link.signatures.BeatLayout`
    so a block can feed it the beats it already has. Before the CRC, the
    fields a switch or router may change are replaced by ones: LRH.VL,
    BTH.resv8a and, on a packet with a GRH (LRH.LNH = 0b11), GRH TClass,
    FlowLabel and HopLmt. Those bytes lie up to 52 bytes into the packet, so
    on narrow beats they fall into later beats: the engine counts beats since
    ``start`` and keeps the LNH of the start beat.

    Parameters
    ----------
    width : int
        Bytes per beat, a power of two from 8 to 256.
    mode : "generate" or "check"
        ``"generate"``: the stream carries LRH .. pad (a multiple of 4 bytes)
        and ``icrc`` is its ICRC on the end beat. ``"check"``: the stream
        carries LRH .. ICRC and ``icrc_ok`` says on the end beat whether the
        trailing 4 bytes are the right ICRC; any length is handled, so a
        malformed packet is merely rejected.

    Ports
    -----
    valid, start, end : In(1)
    data : In(8 * width)
    count : In(range(width + 1))
        Valid bytes on the end beat.
    icrc : Out(32), generate mode
        Combinational: the ICRC of the packet, meaningful on the end beat.
    icrc_ok : Out(1), check mode
        Combinational: asserted on a valid end beat whose packet's ICRC is right.
    """
    def __init__(self, width, mode):
        check_width(width)
        if mode not in ("generate", "check"):
            raise ValueError(f"Mode must be 'generate' or 'check', not {mode!r}")
        self._width = width
        self._mode = mode
        result = {"icrc": Out(ICRC.crc_width)} if mode == "generate" else {"icrc_ok": Out(1)}
        super().__init__({
            "valid": In(1),
            "data": In(8 * width),
            "start": In(1),
            "end": In(1),
            "count": In(range(width + 1)),
            **result,
        })

    def elaborate(self, platform):
        m = Module()
        width = self._width
        beat_bits = 8 * width

        masks = variant_masks()
        masked_beats = max(mask.bit_length() for mask in masks.values()) // beat_bits + 1

        # Beat index since start, saturating once past the masked bytes.
        beat_after = Signal(range(masked_beats + 1), init=masked_beats)
        beat = Mux(self.start, 0, beat_after)
        lnh_start = from_wire(LRH, self.data[:LRH.size]).lnh
        lnh_after = Signal.like(lnh_start)
        lnh = Mux(self.start, lnh_start, lnh_after)
        with m.If(self.valid):
            m.d.sync += beat_after.eq(Mux(beat == masked_beats, masked_beats, beat + 1))
            with m.If(self.start):
                m.d.sync += lnh_after.eq(lnh_start)

        mask = Signal(beat_bits)
        for index in range(masked_beats):
            with m.If(beat == index):
                with m.Switch(lnh):
                    for kind, packet_mask in masks.items():
                        with m.Default() if kind is None else m.Case(kind):
                            m.d.comb += mask.eq(packet_mask >> index * beat_bits)

        m.submodules.beat_crc = beat_crc = BeatCRC(ICRC, width, granule=4 if self._mode == "generate" else 1)
        m.d.comb += [
            beat_crc.start.eq(self.start),
            beat_crc.valid.eq(self.valid),
            beat_crc.data.eq(self.data | mask),
            # count is only meaningful on the end beat
            beat_crc.count.eq(Mux(self.end, self.count, width)),
        ]
        if self._mode == "generate":
            m.d.comb += self.icrc.eq(beat_crc.crc)
        else:
            m.d.comb += self.icrc_ok.eq(self.valid & self.end & beat_crc.match)
        return m


def variant_masks():
    """Masks (wire order, byte 0 in bits 7..0) of the bits the ICRC takes as ones over a
    packet's first bytes, by LRH.LNH (``None``: any other LNH, a raw packet without BTH)."""
    vl = _wire_mask(LRH, "vl")
    resv8a = _wire_mask(BTH, "resv8a")
    grh_variant = _wire_mask(GRH, "tclass", "flowlabel", "hoplmt")
    return {
        LNH_IBA_GLOBAL: vl | grh_variant << 8 * LRH_BYTES | resv8a << 8 * (LRH_BYTES + GRH.size_bytes),
        LNH_IBA_LOCAL: vl | resv8a << 8 * LRH_BYTES,
        None: vl,
    }


def _wire_mask(layout, *fields):
    """Wire-order bit mask (byte 0 in bits 7..0) of ``fields`` of a ``layout`` header."""
    ones = layout.const({name: (1 << layout[name].width) - 1 for name in fields})
    return Const.cast(to_wire(layout, ones)).value
