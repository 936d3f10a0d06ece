"""Formal harness: the link transmitter never starts a packet the peer's credit limit does not
cover in full (IBA's modular rule), and FCTBS advances by exactly the blocks it starts
(docs/formal.md, docs/link.md "Credit check").

Every input of the real ``LinkTransmitter`` is free in every cycle: packet sizes, beats and
framing, flow-control updates (any FCCL, so stale, lost and duplicated ones too), ``clear``,
link states, weights and resets. The rule is the documented one, written here from the docs:
a start beat taken in cycle t fits ``(limit - (FCTBS + blocks)) mod 4096 <= 2048`` with the
limit of cycle t-1 (an update counts from the second cycle after it) and FCTBS of cycle t,
``blocks = ceil((4 PktLen + 2) / 64)``; the packet is on the wire at t+2.
"""
from amaranth import Cat, Elaboratable, Module, Signal, Value
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.link.link_transmitter import LinkTransmitter
from hdl.link.signatures import FCCL_BITS, LinkState
from tb.formal import sby
from tb.formal.credit import fits


class LinkTransmitterCreditHarness(Elaboratable):
    def __init__(self, *, width=8, num_vls=2, mtu=256, fc_period=16, fc_min_interval=4,
                 fc_batch_blocks=8, transmitter=LinkTransmitter):
        self.dut = transmitter(width=width, num_vls=num_vls, mtu=mtu, fc_period=fc_period,
                               fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks)

    def elaborate(self, platform):
        m = Module()
        dut = self.dut
        sby.add_elaborated(m, dut, platform)
        vls = range(dut.num_vls)

        def free(port):
            m.d.comb += port.eq(AnySeq(len(Value.cast(port))))

        for v in vls:
            free(dut.data_in[v].valid)
            free(dut.data_in[v].payload)
            free(dut.vl_weight[v])
            free(dut.advertise_fccl[v])
        for port in (dut.clear, dut.credit_update.valid, dut.credit_update.op,
                     dut.credit_update.vl, dut.credit_update.fctbs, dut.credit_update.fccl):
            free(port)
        state = Signal(2)
        free(state)
        m.d.comb += [dut.state.eq(state),
                     Assume(state <= LinkState.ACTIVE.value)]

        # Cycles since reset (saturating at 3): the past values below exist from there on.
        age = Signal(2)
        with m.If(age != 3):
            m.d.sync += age.eq(age + 1)

        limit_before = [Signal(12, name=f"limit_before{v}") for v in vls]   # limit at t-1
        m.d.sync += [limit_before[v].eq(dut.credit_limit[v]) for v in vls]

        # What each VL took at t, held for the two cycles until its beat is on the wire.
        took, took_fits, fctbs_at, fctbs_after, blocks_of = [], [], [], [], []
        for v in vls:
            beat = dut.data_in[v]
            pktlen = Cat(beat.payload.data[40:48], beat.payload.data[32:35])
            blocks = Signal(8, name=f"blocks{v}")
            m.d.comb += blocks.eq((pktlen * 4 + 2 + 63) >> 6)
            start = Signal(name=f"took_start{v}")
            m.d.comb += start.eq(beat.valid & beat.ready & beat.payload.start)
            ok = Signal(name=f"fits{v}")
            m.d.comb += ok.eq(fits(limit_before[v], dut.fctbs[v], blocks))
            stages = [(Signal(name=f"took{v}_{d}"), Signal(name=f"fits{v}_{d}"),
                       Signal(12, name=f"fctbs{v}_{d}"), Signal(8, name=f"blocks{v}_{d}"))
                      for d in (1, 2)]
            m.d.sync += [stages[0][0].eq(start), stages[0][1].eq(ok),
                         stages[0][2].eq(dut.fctbs[v]), stages[0][3].eq(blocks)]
            m.d.sync += [a.eq(b) for a, b in zip(stages[1], stages[0])]
            after = Signal(12, name=f"fctbs_after{v}")  # FCTBS at t+1
            m.d.sync += after.eq(dut.fctbs[v])
            took.append(stages[1][0])
            took_fits.append(stages[1][1])
            fctbs_at.append(stages[1][2])
            fctbs_after.append(after)
            blocks_of.append(stages[1][3])

        cleared = Signal(2)                 # clear at t (bit 1) and at t+1 (bit 0)
        m.d.sync += cleared.eq(Cat(dut.clear, cleared[0]))
        wire = dut.wire
        data_start = Signal()
        m.d.comb += data_start.eq(wire.valid & wire.start & ~wire.link)

        m.d.comb += [Assert(invariant) for invariant in dut.formal_invariants]
        with m.If(age == 3):
            # A data packet on the wire at t+2 started at t, from one VL, within its credit.
            m.d.comb += Assert(~data_start | (Cat(took).any()))
            for v in vls:
                started = Signal(name=f"started{v}")
                m.d.comb += started.eq(data_start & took[v])
                m.d.comb += Assert(~started | took_fits[v])
                # FCTBS moves by exactly the blocks started; clear zeroes it.
                with m.If(cleared[1]):
                    m.d.comb += Assert(fctbs_after[v] == 0)
                with m.Elif(started):
                    m.d.comb += Assert(fctbs_after[v] == (fctbs_at[v] + blocks_of[v])[:FCCL_BITS])
                with m.Else():
                    m.d.comb += Assert(fctbs_after[v] == fctbs_at[v])
                # Reachable: a packet that needs more than a block starts on the exact credit.
                m.d.comb += Cover(started & (blocks_of[v] > 1) &
                                  ((limit_before[v] - fctbs_after[v])[:FCCL_BITS] == 0))
        return m
