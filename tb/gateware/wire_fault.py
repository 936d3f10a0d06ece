"""Simulation-only: loses data packets on one direction of a cable, at a run-time rate.

Put on a :class:`hdl.link.signatures.WireSignature` between a sender's ``wire_out`` and the
cable, it passes every beat through in the same cycle, except that each data packet (not a
flow-control packet: ``link`` beats always pass untouched; those have their own recovery
and tests) is hit with probability ``rate / 2**16`` (0: never; 2**16: every packet):

- ``mode`` 0, corrupt: one byte among bytes 8 .. 23 of the packet (past the LRH, so the
  receiver's length and VL checks still pass; within the smallest packet a link carries) is
  XORed with a non-zero value. The receiving link port drops the packet on its VCRC check
  and counts it as a ``vcrc`` drop (a cut-through switch forwards it marked end-bad
  instead, and the next receiver counts an ``end_bad`` drop).
- ``mode`` 1, drop: the whole packet vanishes from the wire (``valid`` low for all its
  beats). The receiver never sees it, so its ABR misses the packet's blocks until the
  sender's next flow-control packet sets ABR to the sender's FCTBS, which counted them
  (docs/link.md, "Credits"); the credits come back exactly.

The random source is a 32-bit xorshift generator (linear over GF(2), like an LFSR, but
without the strong correlation of successive LFSR states that would cluster faults). It
steps once per data packet, so the choice of hit packets depends only on the packet order,
not on timing. It starts from ``seed`` (a port, so that one Verilator build serves many
seeds; 0 means :data:`DEFAULT_SEED`), taken at the first data packet after reset. ``mode``
is sampled at each packet's start beat. ``faults`` counts hit packets (wrapping).

``cut`` (a port) cuts the cable: while it is set every beat is lost, flow-control packets
and the middle of a packet included, and none is counted in ``faults``.
"""
from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.link.signatures import WireSignature, check_width

__all__ = ["WireFault", "xorshift32", "DEFAULT_SEED", "CORRUPT", "DROP", "RATE_ONE",
           "FIRST_BYTE", "BYTES"]

DEFAULT_SEED = 0x2545F491
CORRUPT, DROP = 0, 1
RATE_ONE = 1 << 16              # ``rate`` that hits every packet
FIRST_BYTE = 8                  # corrupted bytes: FIRST_BYTE .. FIRST_BYTE + BYTES - 1
BYTES = 16


def xorshift32(x):
    """One step of Marsaglia's xorshift32 (13, 17, 5), on an int or an Amaranth value."""
    if isinstance(x, int):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        return x ^ ((x << 5) & 0xFFFFFFFF)
    x = x ^ (x << 13)[:32]
    x = x ^ (x >> 17)
    return x ^ (x << 5)[:32]


class WireFault(wiring.Component):
    def __init__(self, *, width=64):
        check_width(width)
        self.width = width
        super().__init__({
            "wire_in": In(WireSignature(width)),
            "wire_out": Out(WireSignature(width)),
            "rate": In(range(RATE_ONE + 1)),
            "mode": In(1),
            "seed": In(32),
            "faults": Out(32),
            "cut": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        w_in, w_out = self.wire_in, self.wire_out
        width = self.width

        state = Signal(32)          # 0 until the first data packet after reset
        current = Mux(state != 0, state, Mux(self.seed != 0, self.seed, DEFAULT_SEED))
        draw = Signal(32)
        m.d.comb += draw.eq(xorshift32(current))

        data_beat = w_in.valid & ~w_in.link
        start = data_beat & w_in.start
        hit = Signal()
        m.d.comb += hit.eq(start & (draw[:16] < self.rate))

        dropping = Signal()         # inside a dropped packet (its start beat included)
        corrupting = Signal()       # the chosen byte has not passed yet
        target = Signal(range(FIRST_BYTE + BYTES))
        flip = Signal(8)
        offset = Signal(range(FIRST_BYTE + BYTES + width))  # packet bytes before this beat
        beat_target, beat_flip, beat_offset = Signal.like(target), Signal.like(flip), Signal.like(offset)
        beat_corrupting, beat_dropping = Signal(), Signal()

        with m.If(start):
            m.d.comb += [
                beat_target.eq(FIRST_BYTE + draw[16:20]),
                beat_flip.eq(draw[20:28] | 1),
                beat_offset.eq(0),
                beat_corrupting.eq(hit & (self.mode == CORRUPT)),
                beat_dropping.eq(hit & (self.mode == DROP)),
            ]
        with m.Else():
            m.d.comb += [beat_target.eq(target), beat_flip.eq(flip), beat_offset.eq(offset),
                         beat_corrupting.eq(corrupting), beat_dropping.eq(dropping)]

        lane_hit = Signal(width)
        for lane in range(width):
            m.d.comb += lane_hit[lane].eq(beat_corrupting & (beat_offset + lane == beat_target))
        mask = Cat(Mux(lane_hit[lane], beat_flip, 0) for lane in range(width))

        data_drop = data_beat & beat_dropping
        m.d.comb += [
            w_out.valid.eq(w_in.valid & ~data_drop & ~self.cut),
            w_out.data.eq(w_in.data ^ Mux(data_beat, mask, 0)),
            w_out.start.eq(w_in.start),
            w_out.end.eq(w_in.end),
            w_out.count.eq(w_in.count),
            w_out.end_bad.eq(w_in.end_bad),
            w_out.link.eq(w_in.link),
        ]

        with m.If(start):
            m.d.sync += state.eq(draw)
        with m.If(hit):
            m.d.sync += self.faults.eq(self.faults + 1)
        with m.If(data_beat):
            done = w_in.end
            m.d.sync += [
                target.eq(beat_target),
                flip.eq(beat_flip),
                dropping.eq(beat_dropping & ~done),
                corrupting.eq(beat_corrupting & ~lane_hit.any() & ~done),
                # Saturates: only offsets up to the last target byte matter.
                offset.eq(Mux(beat_offset >= FIRST_BYTE + BYTES, beat_offset,
                              beat_offset + width)),
            ]
        return m
