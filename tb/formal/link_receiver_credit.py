"""Formal harness: a link receiver whose peer keeps the credit rule never overflows, never
advertises more than its free space, and returns every block exactly (docs/formal.md).

The real ``LinkReceiver`` takes a free wire (any beat, framing, length, CRC, flow-control
packet), a free consumer, and free ``state``, ``link_down``, ``close`` and resets. The peer is
modelled here: per VL its FCTBS (the blocks of every data start beat it puts on the wire,
``ceil((4 PktLen + 2) / 64)``) and the limit it last heard, which it may take from the
receiver's ``fccl`` in any cycle or keep (flow-control packets lost, late or repeated); a
start beat must fit ``(limit - (FCTBS + blocks)) mod 4096 <= 2048`` and a link beat carries
the peer's FCTBS of its VL. ``clear`` resets the peer's counts and limit with ABR, as a
link's re-initialisation does, and stays up while the receiver still holds a packet from
before it.
"""
from amaranth import Cat, Elaboratable, Module, Mux, Signal, Value
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.link.link_receiver import LinkReceiver
from hdl.link.signatures import BLOCK_BYTES, FCCL_BITS, LinkState, blocks_of, lrh_pktlen, max_wire_bytes
from tb.formal import sby
from tb.formal.credit import CREDIT_WINDOW, fits


class LinkReceiverCreditHarness(Elaboratable):
    def __init__(self, *, width=8, num_vls=2, mtu=256, buffer_blocks=None, stall_timeout=2,
                 receiver=LinkReceiver):
        if buffer_blocks is None:
            buffer_blocks = blocks_of(max_wire_bytes(mtu))     # the smallest buffer allowed
        self.dut = receiver(width=width, num_vls=num_vls, mtu=mtu, buffer_blocks=buffer_blocks,
                            cut_through=True, stall_timeout=stall_timeout)

    def elaborate(self, platform):
        m = Module()
        dut = self.dut
        elaborated = sby.add_elaborated(m, dut, platform)
        vls = range(dut.num_vls)
        buffer_blocks = dut.buffer_blocks

        def free(port):
            m.d.comb += port.eq(AnySeq(len(Value.cast(port))))

        wire = dut.wire
        for port in (wire.valid, wire.data, wire.start, wire.end, wire.count, wire.end_bad,
                     wire.link, dut.link_down, dut.close, dut.clear):
            free(port)
        for v in vls:
            free(dut.data_out[v].ready)
        state = Signal(2)
        free(state)
        # Only the values the ports' shapes mean: a link state, a count of at most a beat.
        m.d.comb += [dut.state.eq(state), Assume(state <= LinkState.ACTIVE.value),
                     Assume(wire.count <= dut.width)]

        # Cycles since reset (saturating at 3).
        age = Signal(2)
        with m.If(age != 3):
            m.d.sync += age.eq(age + 1)

        # Clear: the link re-initialises. It stays up while anything from before it is in the
        # receiver (a data packet in progress, a beat in the input or check register), and no
        # data packet starts while it is up; the peer's FCTBS and limit restart from zero
        # with ABR.
        data_beat = Signal()
        m.d.comb += data_beat.eq(wire.valid & ~wire.link)
        beat_before = Signal(2)             # a beat on the wire one and two cycles ago
        m.d.sync += beat_before.eq(Cat(wire.valid, beat_before[0]))
        cleared_before = Signal(2)          # clear one and two cycles ago
        m.d.sync += cleared_before.eq(Cat(dut.clear, cleared_before[0]))
        m.d.comb += [
            Assume(~cleared_before[0] | dut.clear | ~(dut.in_packet | beat_before.any())),
            Assume(~dut.clear | ~(data_beat & wire.start)),
        ]

        start = Signal()
        m.d.comb += start.eq(data_beat & wire.start)
        start_vl = wire.data[4:8]
        blocks = Signal(8)                  # the peer's charge for the packet: its PktLen
        m.d.comb += blocks.eq(blocks_of(lrh_pktlen(wire.data) * 4 + 2))
        fc_beat = Signal()
        m.d.comb += fc_beat.eq(wire.valid & wire.link)
        fc_vl = wire.data[20:24]
        fc_fctbs = Cat(wire.data[8:16], wire.data[0:4])

        fctbs, limit, was_full = [], [], []
        for v in vls:
            peer_fctbs = Signal(FCCL_BITS, name=f"peer_fctbs{v}")
            peer_limit = Signal(FCCL_BITS, name=f"peer_limit{v}")
            grant = Signal(name=f"grant{v}")        # a flow-control packet of ours reaches it
            free(grant)
            starts = Signal(name=f"starts{v}")
            m.d.comb += starts.eq(start & (start_vl == v))
            m.d.comb += [
                Assume(~starts | fits(peer_limit, peer_fctbs, blocks)),
                Assume(~(fc_beat & (fc_vl == v)) | (fc_fctbs == peer_fctbs)),
            ]
            with m.If(dut.clear):
                m.d.sync += [peer_fctbs.eq(0), peer_limit.eq(0)]
            with m.Else():
                with m.If(starts):
                    m.d.sync += peer_fctbs.eq(peer_fctbs + blocks)
                # The fccl register shows the value from before a clear for one more cycle.
                with m.If(grant & ~cleared_before[0]):
                    m.d.sync += peer_limit.eq(dut.fccl[v])
            full = Signal(name=f"was_full{v}")
            with m.If(dut.used_blocks[v] == buffer_blocks):
                m.d.sync += full.eq(1)
            fctbs.append(peer_fctbs)
            limit.append(peer_limit)
            was_full.append(full)

        # Each stored packet's beats, its closing beat included, fit in the blocks it is
        # charged: what makes buffer_blocks * max(1, 64 / width) + 1 beats enough.
        beats_per_block = max(1, BLOCK_BYTES // dut.width)
        for v in vls:
            buffer = elaborated.submodules[f"buffer{v}"]
            write, verdict = buffer.write, buffer.verdict
            stored = Signal(range(dut.buffer_beats + 1), name=f"packet_beats{v}")
            stored_now = Signal.like(stored, name=f"packet_beats_now{v}")
            m.d.comb += stored_now.eq(Mux(write.valid, Mux(write.payload.start, 1, stored + 1),
                                          stored))
            m.d.sync += stored.eq(stored_now)
            m.d.comb += Assert(~verdict.valid |
                               (stored_now <= beats_per_block * verdict.payload.blocks))

        m.d.comb += [Assert(invariant) for invariant in dut.formal_invariants]
        with m.If(age == 3):
            m.d.comb += Assert(~dut.overflow)
            for v in vls:
                used, abr, fccl = dut.used_blocks[v], dut.abr[v], dut.fccl[v]
                free_blocks = buffer_blocks - used
                m.d.comb += Assert(used <= buffer_blocks)
                # ABR never ahead of the peer's FCTBS; what the peer sent beyond it fits in
                # the free space: stored + in flight (or lost, until a flow-control packet)
                # never exceed the buffer.
                m.d.comb += Assert((fctbs[v] - abr)[:FCCL_BITS] <= free_blocks)
                with m.If(~cleared_before[0]):
                    # The advertised limit never exceeds the free space, and the peer's
                    # (older) limit never exceeds the advertised one.
                    m.d.comb += [
                        Assert((fccl - fctbs[v])[:FCCL_BITS] <= free_blocks),
                        Assert((fccl - limit[v])[:FCCL_BITS] <= CREDIT_WINDOW),
                    ]
                # Reachable: the buffer full of stored packets, then drained with every
                # credit back.
                m.d.comb += Cover(was_full[v] & (used == 0) & (abr == fctbs[v]) &
                                  ((fccl - fctbs[v])[:FCCL_BITS] == buffer_blocks))
        return m
