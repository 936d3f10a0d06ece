from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.link.signatures import BeatLayout
from hdl.prim.round_robin import mask_after, next_mask, one_hot_index, round_robin_pick
from hdl.prim.skid_register import SkidRegister

__all__ = ["PacketMux"]

WIDTH = 64


class PacketMux(wiring.Component):
    """Merges packet streams (one VL's requester and responder packets) into one, whole
    packets at a time, round robin.

    While no packet is in progress, the input chosen is the first with a beat on offer
    after the one granted last (in index order, wrapping); its grant holds from that
    beat up to and including its ``end`` beat, and the next packet, from any input, can
    follow in the next cycle. An input whose packet is ready is thus passed over at most
    ``inputs - 1`` times.

    The output is a :class:`SkidRegister`: beats move at one per cycle while
    ``output.ready`` is high, with one cycle of latency, and the inputs' ``ready`` comes
    from its register, not from ``output.ready`` (docs/nic.md, Block boundaries).

    Packets are framed by ``end`` alone: beats pass unchanged (``start``, ``count`` and
    ``end_bad`` included), so a packet whose first beat lacks ``start`` still goes out
    whole, and nothing an input sends can interleave with another input's packet.

    Ports
    -----
    inputs : In(stream.Signature(BeatLayout(64))).array(inputs)
    output : Out(stream.Signature(BeatLayout(64)))
    """

    def __init__(self, *, inputs=2):
        if not isinstance(inputs, int) or not 1 <= inputs <= 16:
            raise ValueError(f"inputs must be an integer from 1 to 16, not {inputs!r}")
        self.input_count = inputs
        super().__init__({
            "inputs": In(stream.Signature(BeatLayout(WIDTH))).array(inputs),
            "output": Out(stream.Signature(BeatLayout(WIDTH))),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.input_count

        busy = Signal()                 # a packet is in progress on input ``holder``
        holder = Signal(n)              # one-hot
        mask = Signal(n, init=mask_after(0, n))
        valids = Cat(port.valid for port in self.inputs)
        pick = Signal(n)
        m.d.comb += pick.eq(Mux(busy, holder, round_robin_pick(m, valids, mask, name="input")))

        m.submodules.register = register = SkidRegister(BeatLayout(WIDTH))
        wiring.connect(m, register.o, wiring.flipped(self.output))
        beat = BeatLayout(WIDTH)(
            Array(port.payload.as_value() for port in self.inputs)[one_hot_index(pick)])
        m.d.comb += [register.i.valid.eq((valids & pick).any()),
                     register.i.payload.eq(beat)]
        for index, port in enumerate(self.inputs):
            m.d.comb += port.ready.eq(register.i.ready & pick[index])

        with m.If(register.i.valid & register.i.ready):
            m.d.sync += [busy.eq(~beat.end), holder.eq(pick), mask.eq(next_mask(pick))]
        return m
