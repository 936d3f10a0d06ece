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
before it. For k-induction the harness also states what ties the buffers' contents (read
through ``FifoContents``), the peer's counts and ``BeatFacts``' position registers to each
other (64-byte beats only).
"""
from amaranth import Cat, Elaboratable, Module, Mux, Signal, Value
from amaranth.lib import data
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.link.link_receiver import LinkReceiver
from hdl.link.signatures import BLOCK_BYTES, FCCL_BITS, LinkState, blocks_of, lrh_pktlen, max_wire_bytes
from tb.formal import sby
from tb.formal.credit import CREDIT_WINDOW, fits
from tb.formal.fifo_contents import FifoContents, elaborate_now


class LinkReceiverCreditHarness(Elaboratable):
    def __init__(self, *, width=64, num_vls=2, mtu=256, buffer_blocks=None, stall_timeout=2,
                 receiver=LinkReceiver):
        if width != BLOCK_BYTES:
            # The invariants on BeatFacts' position registers are written for beats of one
            # block each.
            raise ValueError(f"The receiver's credit proof is stated for 64-byte beats, "
                             f"not {width!r}")
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
        stored_beats = []
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
            self.buffer_invariants(m, dut, v, buffer, stored, platform)
            stored_beats.append(stored)
        self.pipeline_invariants(m, dut, elaborated, fctbs, stored_beats, platform)

        m.d.comb += [Assert(invariant) for invariant in dut.formal_invariants]
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
                    # Induction: the limit lies between FCTBS and the FCCL.
                    Assert((limit[v] - fctbs[v])[:FCCL_BITS] <=
                           (fccl - fctbs[v])[:FCCL_BITS]),
                ]
            # Induction: the FCCL register is last cycle's ABR + free blocks.
            fccl_next = Signal(FCCL_BITS, init=buffer_blocks, name=f"fccl_next{v}")
            m.d.sync += fccl_next.eq(abr + buffer_blocks - used)
            m.d.comb += Assert(fccl == fccl_next)
            # Reachable: the buffer full of stored packets, then drained with every
            # credit back.
            m.d.comb += Cover(was_full[v] & (used == 0) & (abr == fctbs[v]) &
                              ((fccl - fctbs[v])[:FCCL_BITS] == buffer_blocks))
        return m

    @staticmethod
    def buffer_invariants(m, dut, v, buffer, stored, platform):
        """VL v's buffer contents against the credits: ``used_blocks`` is the sum of the
        verdicts' blocks, one verdict per stored end beat (the packet being stored may have
        its end beat in before its verdict), beats after the last end beat only of the
        packet being stored, each stored packet within the beats its verdict was charged."""
        module = elaborate_now(buffer, platform)
        beats = FifoContents(m, module.submodules.beats)
        verdicts = FifoContents(m, module.submodules.verdicts)
        state = dut.formal_state
        ours = state["storing"] & state["stored_any"] & (state["current_vl"] == v)
        end_waits = ours & state["end_stored"]          # its end beat is in, its verdict not
        tail_waits = ours & ~state["end_stored"]
        beats_per_block = max(1, BLOCK_BYTES // dut.width)

        ends, packet_of = [], []
        for j, entry in enumerate(beats.entries):
            packet = Signal(range(len(beats.entries) + 1), name=f"packet_of{v}_{j}")
            m.d.comb += packet.eq(sum(ends))
            packet_of.append(packet)
            ends.append((j < beats.level) & data.View(buffer._stored, entry).end)
        end_count = Signal(range(len(beats.entries) + 1), name=f"end_beats{v}")
        m.d.comb += end_count.eq(sum(ends))

        def packet_beats(k):
            return sum((j < beats.level) & (packet_of[j] == k) for j in range(len(ends)))

        used_sum = Signal(FCCL_BITS + 4, name=f"verdict_blocks{v}")
        blocks = [data.View(buffer._verdict, entry).blocks for entry in verdicts.entries]
        m.d.comb += used_sum.eq(sum(Mux(i < verdicts.level, blocks[i], 0)
                                    for i in range(len(blocks))))
        tail = Signal(range(len(beats.entries) + 1), name=f"tail_beats{v}")
        m.d.comb += tail.eq(packet_beats(end_count))
        m.d.comb += [
            Assert(buffer.room == buffer.depth - beats.level),
            Assert(dut.used_blocks[v] == used_sum),
            Assert(verdicts.level == end_count - end_waits),
            Assert(tail_waits | (tail == 0)),
            Assert(tail <= stored),
        ]
        # A bad packet is skipped only while its verdict is at the verdict FIFO's output.
        head_verdict = data.View(buffer._verdict, verdicts.entries[0])
        m.d.comb += Assert(~buffer.formal_skipping |
                           (module.submodules.verdicts.r_rdy & head_verdict.bad))
        for k in range(len(blocks)):
            with m.If(k < verdicts.level):
                m.d.comb += Assert(packet_beats(k) <= beats_per_block * blocks[k])
            with m.If(end_waits & (k == verdicts.level)):
                m.d.comb += Assert(packet_beats(k) <= stored)

    @staticmethod
    def pipeline_invariants(m, dut, elaborated, fctbs, stored_beats, platform):
        """What ties the peer's FCTBS to the receiver's registers: the blocks of the data
        packets in the input (r) and check (w) registers and of the packet being stored are
        within FCTBS - ABR; a flow-control packet there carries the FCTBS the peer had when it
        sent it; ``BeatFacts``' position registers describe the packet being stored (its
        charge, the beats so far); the redundant copies of the input register agree."""
        state = dut.formal_state
        beat_facts = elaborated.submodules.beat_facts
        elaborate_now(beat_facts, platform)
        facts = beat_facts.formal_state
        r, w = state["r"], state["w"]
        r_start = state["r_valid"] & ~state["r_link"] & r.start
        w_start = state["w_valid"] & ~state["w_link"] & w.start
        w_data = state["w_valid"] & ~state["w_link"]

        def charge(beat):
            return blocks_of(lrh_pktlen(beat.data) * 4 + 2)

        def fc_fctbs(beat):
            return Cat(beat.data[8:16], beat.data[0:4])

        m.d.comb += [
            Assert(facts["valid"] == state["r_valid"]), Assert(facts["link"] == state["r_link"]),
            Assert(facts["start"] == r.start), Assert(facts["end"] == r.end),
            Assert(facts["count"] == r.count), Assert(facts["lrh"] == r.data[:64]),
            Assert(~state["r_valid"] | (facts["nbytes"] == Mux(r.end, r.count, dut.width))),
            Assert(~state["storing"] | dut.in_packet),
            Assert(~state["storing"] | state["stored_any"]),
        ]
        ahead, past = facts["ahead"], facts["past"]
        m.d.comb += [
            Assert(ahead >= -1), Assert(facts["ahead_many"] == (ahead > 1)),
            Assert(facts["ahead_one"] == (ahead == 1)), Assert(facts["ahead_zero"] == (ahead == 0)),
            Assert(past == (ahead == -1)),
        ]
        with m.If(~past):
            m.d.comb += [
                Assert(facts["done"] >= 1), Assert(facts["tail"][:2] == 2),
                Assert(facts["done_next"] == facts["done"] + 1),
                Assert(ahead + facts["done"] + 1 == facts["packet_blocks"]),
            ]
        for v in range(dut.num_vls):
            open_charge = Signal(FCCL_BITS, name=f"open_charge{v}")
            with m.If(w_start & (w.data[4:8] == v)):
                m.d.sync += open_charge.eq(charge(w))
            stored = stored_beats[v]
            ours = state["storing"] & (state["current_vl"] == v)
            r_charged = Mux(r_start & (r.data[4:8] == v), charge(r), 0)
            in_flight = Signal(FCCL_BITS + 2, name=f"in_flight{v}")
            m.d.comb += in_flight.eq(Mux(ours, open_charge, 0) +
                                     Mux(w_start & (w.data[4:8] == v), charge(w), 0) + r_charged)
            # While clear is up, FCTBS and ABR restart at 0: what is still in the receiver
            # from before it fits in the free space.
            m.d.comb += Assert(in_flight + dut.used_blocks[v] <= dut.buffer_blocks)
            with m.If(~dut.clear):
                m.d.comb += Assert(in_flight <= (fctbs[v] - dut.abr[v])[:FCCL_BITS])
                with m.If(state["r_valid"] & state["r_link"] & (r.data[20:24] == v)):
                    m.d.comb += Assert(fc_fctbs(r) == fctbs[v])
                with m.If(state["w_valid"] & state["w_link"] & (w.data[20:24] == v)):
                    m.d.comb += Assert(fc_fctbs(w) == (fctbs[v] - r_charged)[:FCCL_BITS])
            with m.If(ours & ~w_start):
                m.d.comb += Assert(facts["packet_blocks"] == open_charge)
                # Its data end (in the last beat, or filling the one before when the last
                # holds only the VCRC: aligned) is stored once the position is past it.
                data_ended = past | (facts["aligned"] & (ahead == 0))
                m.d.comb += Assert(~data_ended | state["end_stored"] |
                                   (w_data & (beat_facts.facts.data_end | w.end)))
                m.d.comb += Assert(~state["end_stored"] | data_ended)
                with m.If(past):
                    m.d.comb += Assert(stored <= facts["packet_blocks"])
                with m.Else():
                    m.d.comb += Assert(stored + w_data <= facts["done"])
