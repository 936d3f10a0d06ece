"""The pipelined switch's crossbar: each output takes the beats of the input that holds it into
a SkidRegister, so an input's handshake ends in registers (docs/switch.md, In the switch)."""

from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import or_all
from hdl.link.signatures import BeatLayout, check_width, vl_index
from hdl.prim.skid_register import SkidRegister

__all__ = ["Crossbar", "CrossbarBeat"]


def CrossbarBeat(width, num_vls):
    """A beat through the crossbar: the beat and the output VL it goes on."""
    return data.StructLayout({"beat": BeatLayout(width), "vl": vl_index(num_vls)})


class Crossbar(wiring.Component):
    """``ports`` inputs to ``ports`` outputs, one packet per output at a time.

    Input i offers the beats of its current packet on ``inputs[i]``; ``released[i]``: that
    packet sends no more beats (its last one is taken, or it is skipped unsent).
    ``starting[o]`` (one-hot or zero): the input that starts a packet to output o in this
    cycle, only while the output has no input queued (the switch's start rule). A start to a
    free output makes the input its holder from the next cycle; a start to an output still
    held makes it the output's queued input (``queueing[o]``, a register), which holds the
    output from the cycle after the holder is released, so its first beat follows the
    holder's last one with no idle cycle. A queued input released before it holds (its
    packet skipped) leaves the queue. An input holds an output only while its packet goes
    there, so the crossbar needs no port number.

    ``outputs[o]`` is output o's :class:`SkidRegister`: its ``valid`` and ``payload`` are
    registers, its ``ready`` pops it (the transmitter's ``taken``). ``inputs[i].ready`` is
    an AND-OR of registers (the one-hot holders, the skid registers' room): one LUT level
    up to 3 outputs, two up to 18. A beat taken on ``inputs`` in cycle c is
    on ``outputs`` from c + 1. Reset state: no holder, no queue.
    """

    def __init__(self, *, ports, num_vls, width):
        if not isinstance(ports, int) or not 2 <= ports <= 16:
            raise ValueError(f"Ports must be an integer from 2 to 16, not {ports!r}")
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be an integer from 1 to 15, not {num_vls!r}")
        check_width(width)
        self.ports = ports
        self.num_vls = num_vls
        self.width = width
        beat = CrossbarBeat(width, num_vls)
        super().__init__({
            "inputs": In(stream.Signature(beat)).array(ports),
            "released": In(ports),
            "starting": In(ports).array(ports),
            "outputs": Out(stream.Signature(beat)).array(ports),
            "queueing": Out(ports),
        })

    def elaborate(self, platform):
        m = Module()
        P = self.ports
        # One-hot, so an input's ready is an AND-OR of registers, with no index to compare
        # (depth: it reaches the input buffer's `finishing` and, through it, the start).
        holder = [Signal(P, name=f"holder{o}") for o in range(P)]   # the input holding o
        queued = [Signal(P, name=f"queued{o}") for o in range(P)]   # ... queued (`queueing`)
        queueing = self.queueing
        valids = Cat(port.valid for port in self.inputs)
        skids = []
        for o in range(P):
            skid = m.submodules[f"skid{o}"] = SkidRegister(CrossbarBeat(self.width, self.num_vls))
            skids.append(skid)
            m.d.comb += [skid.i.valid.eq((holder[o] & valids).any()),
                         skid.i.payload.eq(or_all([Mux(holder[o][i], self.inputs[i].payload, 0)
                                                   for i in range(P)]))]
            wiring.connect(m, skid.o, wiring.flipped(self.outputs[o]))
        # An input holds an output only while its packet goes there: no compare with its port.
        for i in range(P):
            m.d.comb += self.inputs[i].ready.eq(Cat(holder[o][i] & skids[o].i.ready
                                                    for o in range(P)).any())

        for o in range(P):
            starting = self.starting[o]
            holder_done = (holder[o] & self.released).any()
            queued_done = queueing[o] & (queued[o] & self.released).any()
            promoted = queueing[o] & ~queued_done
            with m.If(holder_done):
                m.d.sync += [holder[o].eq(Mux(promoted, queued[o], 0)), queueing[o].eq(0)]
            with m.Elif(queued_done):
                m.d.sync += queueing[o].eq(0)
            with m.If(starting.any()):
                with m.If(holder[o].any() & ~holder_done | promoted):
                    m.d.sync += [queued[o].eq(starting), queueing[o].eq(1)]
                with m.Else():
                    m.d.sync += holder[o].eq(starting)
        return m
