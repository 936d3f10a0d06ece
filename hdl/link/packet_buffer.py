from amaranth import *
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from .signatures import BeatLayout, FCCL_BITS, check_width

__all__ = ["PacketBuffer"]


class PacketBuffer(wiring.Component):
    """Receive buffer of one VL: beats in arrival order, verdicts one per packet.

    The writer pushes a packet's beats as they arrive (``write``, no
    backpressure: the credit protocol guarantees room, and ``room`` lets the
    writer check it: a register, so that the writer's decision to write
    can depend on it at little depth) and pushes the packet's verdict (``verdict``: bad, and
    the credit blocks it held) once the packet has ended. Every stored packet
    ends with a beat marked ``end``.

    The reader forwards a packet whose verdict is known and good; skips,
    beat by beat, one whose verdict is known and bad; and, with
    ``cut_through``, starts forwarding a packet whose verdict is not known yet,
    holding its end beat until the verdict arrives and marking it ``end_bad``
    if the packet turned out bad. Releasing a packet (forwarded or skipped)
    reports its blocks on ``freed`` so the receiver can return the credits.

    No rewinding and no races between writer and reader: a verdict is always
    consumed with the end beat of its own packet.
    """

    def __init__(self, *, width, depth, cut_through):
        check_width(width)
        if depth < 2:
            raise ValueError(f"Packet buffer depth must be at least 2 beats, not {depth!r}")
        self.width = width
        self.depth = depth
        self.cut_through = bool(cut_through)
        self._stored = data.StructLayout({
            "data": 8 * width, "start": 1, "end": 1, "count": range(width + 1)})
        self._verdict = data.StructLayout({"bad": 1, "blocks": FCCL_BITS})
        super().__init__({
            "write": In(stream.Signature(self._stored, always_ready=True)),
            "room": Out(range(depth + 1), init=depth),
            "verdict": In(stream.Signature(self._verdict, always_ready=True)),
            "data_out": Out(stream.Signature(BeatLayout(width))),
            "freed": Out(stream.Signature(FCCL_BITS, always_ready=True)),
            "discarded": Out(1),        # strobe: a bad packet was skipped unseen
            "forwarded_bad": Out(1),    # strobe: a cut-through packet left marked end-bad
        })

    def elaborate(self, platform):
        m = Module()

        m.submodules.beats = beats = fifo.SyncFIFOBuffered(
            width=self._stored.size, depth=self.depth)
        m.submodules.verdicts = verdicts = fifo.SyncFIFOBuffered(
            width=self._verdict.size, depth=self.depth)

        m.d.comb += [
            beats.w_data.eq(self.write.payload),
            beats.w_en.eq(self.write.valid),
            verdicts.w_data.eq(self.verdict.payload),
            verdicts.w_en.eq(self.verdict.valid),
        ]

        head = data.View(self._stored, beats.r_data)
        verdict = data.View(self._verdict, verdicts.r_data)
        forwarding = Signal()   # the head packet has started out
        skipping = Signal()
        # A formal proof ties skipping to the verdict it follows (docs/formal.md).
        self.formal_skipping = skipping

        release = Signal()
        m.d.comb += [
            self.freed.valid.eq(release),
            self.freed.payload.eq(verdict.blocks),
            verdicts.r_en.eq(release),
        ]

        out = self.data_out
        m.d.comb += [
            out.payload.data.eq(head.data),
            out.payload.start.eq(head.start),
            out.payload.end.eq(head.end),
            out.payload.count.eq(head.count),
            out.payload.end_bad.eq(head.end & verdict.bad),
        ]

        # ``depth - beats.level``, kept as a register: written and read beats move it.
        wrote = self.write.valid & beats.w_rdy
        read = beats.r_en & beats.r_rdy
        m.d.sync += self.room.eq(Mux(wrote, Mux(read, self.room, self.room - 1),
                                     Mux(read, self.room + 1, self.room)))

        known_bad = verdicts.r_rdy & verdict.bad
        with m.If(skipping | (~forwarding & beats.r_rdy & known_bad)):
            m.d.comb += beats.r_en.eq(beats.r_rdy)
            with m.If(beats.r_rdy):
                m.d.sync += skipping.eq(~head.end)
                with m.If(head.end):
                    m.d.comb += release.eq(1)
                with m.If(~skipping):
                    m.d.comb += self.discarded.eq(1)
        with m.Else():
            may_start = forwarding | verdicts.r_rdy | self.cut_through
            # An end beat waits for its verdict.
            m.d.comb += out.valid.eq(beats.r_rdy & may_start & (~head.end | verdicts.r_rdy))
            with m.If(out.valid & out.ready):
                m.d.comb += beats.r_en.eq(1)
                m.d.sync += forwarding.eq(~head.end)
                with m.If(head.end):
                    m.d.comb += [release.eq(1), self.forwarded_bad.eq(verdict.bad)]
        return m
