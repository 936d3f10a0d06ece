"""Two-entry stream register whose output and whose ``ready`` are both registers, so neither
side's handshake reaches the other in a cycle (docs/switch.md, Crossbar register; docs/nic.md,
Block boundaries)."""

from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["SkidRegister", "tagged_input"]


class SkidRegister(wiring.Component):
    """``i`` to ``o`` in one cycle, one beat per cycle, order kept.

    ``o.valid`` and ``o.payload`` are the head register. ``i.ready`` is high while the
    second (skid) register is empty, a register itself: a beat taken while the head is
    not taken goes there, and the head refills from it. A beat taken in cycle c is on
    ``o`` from c + 1; reset state empty.
    """

    def __init__(self, layout):
        super().__init__({
            "i": In(stream.Signature(layout)),
            "o": Out(stream.Signature(layout)),
        })

    def elaborate(self, platform):
        m = Module()
        skid = Signal.like(self.i.payload)
        skid_valid = Signal()
        taken = self.i.valid & self.i.ready
        m.d.comb += self.i.ready.eq(~skid_valid)
        with m.If(~self.o.valid | self.o.ready):
            m.d.sync += [self.o.valid.eq(skid_valid | taken),
                         self.o.payload.eq(Mux(skid_valid, skid, self.i.payload)),
                         skid_valid.eq(0)]
        with m.Elif(taken):
            m.d.sync += [skid.eq(self.i.payload), skid_valid.eq(1)]
        return m


def tagged_input(m, name, source, **tags):
    """``source`` into ``m`` through a :class:`SkidRegister` named ``name``, with ``tags``
    (name: a one-bit function of a payload) worked out as a beat enters and registered
    beside it, so that logic behind the register decides from flip-flops. Returns the
    register's ``o``: its payload's ``beat`` is ``source``'s payload, the tags beside it;
    ``source.ready`` is the register's (a flip-flop)."""
    layout = data.StructLayout({"beat": source.payload.shape(), **{tag: 1 for tag in tags}})
    skid = m.submodules[name] = SkidRegister(layout)
    m.d.comb += [
        skid.i.valid.eq(source.valid),
        skid.i.payload.beat.eq(source.payload),
        source.ready.eq(skid.i.ready),
    ]
    for tag, of in tags.items():
        m.d.comb += skid.i.payload[tag].eq(of(source.payload))
    return skid.o
