from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..crc.aligned_crc import AlignedCRC, align, lead
from ..crc.algorithms import VCRC
from .signatures import (
    BeatLayout, FlowControlOp, FlowControlSignature, LinkState, WireSignature,
    FCCL_BITS, VCRC_BYTES, blocks_of, check_mtu, check_width, lrh_wire_bytes, max_wire_bytes,
    vl_index,
)

__all__ = ["LinkTransmitter", "FC_BATCH_INTERVAL"]

# Cycles between flow-control packets of one VL that report a large batch of freed blocks.
FC_BATCH_INTERVAL = 4


class LinkTransmitter(wiring.Component):
    """Sending half of a credit-based IBA link port.

    Takes one packet stream per data VL (LRH..ICRC), picks among the VLs whose
    head packet the peer's credit limit covers in full (weighted round robin,
    ``vl_weight`` 64-byte blocks per turn, at least one packet), appends the
    VCRC and drives the wire. Between data packets it sends IBA flow-control
    packets: Op INIT while the port initialises, otherwise NORMAL ones when the
    advertised FCCL changed (at most every ``fc_min_interval`` cycles per VL)
    and at least every ``fc_period`` cycles per VL, which heals lost ones; a
    change of ``fc_batch_blocks`` or more goes out after only
    ``FC_BATCH_INTERVAL`` cycles, so a sender waiting for a large packet's
    worth of credit is not held up by the batching.

    A packet whose beats run past its LRH.PktLen is cut at PktLen and marked
    end-bad, so a malformed upstream can never overrun the credits it was
    granted; a packet longer than the MTU allows, or a stream that does not
    begin with a start beat, is discarded. Each case is counted.

    Latency: two cycles from an accepted start beat to the start beat on the wire: the
    beat is chosen into a register with its CRC inputs aligned, and the VCRC is computed
    from there into the wire register.
    """

    def __init__(self, *, width=64, num_vls=2, mtu=4096, fc_period=1024, fc_min_interval=64,
                 fc_batch_blocks=64):
        check_width(width)
        check_mtu(mtu)
        if not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        if not 16 <= fc_period <= 65536:
            raise ValueError(f"Flow-control period must be 16 to 65536 cycles, not {fc_period!r}")
        if not 1 <= fc_min_interval <= fc_period:
            raise ValueError(f"Flow-control minimum interval must be 1 to fc_period cycles, "
                             f"not {fc_min_interval!r}")
        if not 1 <= fc_batch_blocks <= 2047:
            raise ValueError(f"Flow-control batch must be 1 to 2047 blocks, not {fc_batch_blocks!r}")
        self.width = width
        self.num_vls = num_vls
        self.mtu = mtu
        self.fc_batch_blocks = fc_batch_blocks
        self.fc_period = fc_period
        self.fc_min_interval = fc_min_interval
        super().__init__({
            "data_in": In(stream.Signature(BeatLayout(width))).array(num_vls),
            "wire": Out(WireSignature(width)),
            "state": In(LinkState),
            # One-cycle strobe: the link (re)enters INIT; forget FCTBS and the peer's limits.
            "clear": In(1),
            "vl_weight": In(8).array(num_vls),
            # Flow-control packets from the peer, as the receiver decoded them (limit := FCCL).
            "credit_update": In(FlowControlSignature()),
            # What our own receiver advertises per VL.
            "advertise_fccl": In(FCCL_BITS).array(num_vls),
            "fc_sent": Out(FlowControlSignature()),
            "fctbs": Out(FCCL_BITS).array(num_vls),
            "credit_limit": Out(FCCL_BITS).array(num_vls),
            "packets_sent": Out(32).array(num_vls),
            "credit_stall_cycles": Out(32).array(num_vls),
            "fc_packets_sent": Out(32),
            "discarded_too_long": Out(32),
            "discarded_framing": Out(32),
            "cut_overlong": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        width, num_vls = self.width, self.num_vls
        max_bytes = max_wire_bytes(self.mtu)

        # Two stages: the decision registers the beat with its CRC inputs aligned (stage 1),
        # then the CRC is computed from those registers and put in its lanes on the wire.
        m.submodules.vcrc = vcrc = AlignedCRC(VCRC, width)
        s1_valid, s1_link, s1_start, s1_end, s1_end_bad = (Signal(name=f"s1_{name}") for name in
                                                            ("valid", "link", "start", "end", "end_bad"))
        s1_count = Signal(range(width + 1))
        s1_data = Signal(8 * width)
        # Per lane: the beat's own byte, the CRC's low byte, its high byte (else zero).
        s1_keep, s1_low, s1_high = Signal(width), Signal(width), Signal(width)
        s1_crc_valid, s1_crc_start = Signal(), Signal()
        s1_crc_data = Signal(8 * width)
        s1_crc_lead = Signal(width + 1)
        m.d.comb += [
            vcrc.valid.eq(s1_crc_valid), vcrc.start.eq(s1_crc_start),
            vcrc.data.eq(s1_crc_data), vcrc.lead.eq(s1_crc_lead),
        ]
        m.d.sync += [
            self.wire.valid.eq(s1_valid), self.wire.link.eq(s1_link), self.wire.start.eq(s1_start),
            self.wire.end.eq(s1_end), self.wire.end_bad.eq(s1_end_bad), self.wire.count.eq(s1_count),
            self.wire.data.eq(Cat(
                Mux(s1_keep[lane], s1_data[8 * lane:8 * lane + 8], 0)
                | Mux(s1_low[lane], vcrc.crc[0:8], 0) | Mux(s1_high[lane], vcrc.crc[8:16], 0)
                for lane in range(width))),
        ]

        fctbs = Array(self.fctbs)
        limit = Array(self.credit_limit)
        inputs = Array(self.data_in)

        busy = Signal()                         # inside a data packet
        discarding = Signal()                   # dropping the rest of an input packet
        current = Signal(vl_index(num_vls))
        allowed = Signal(range(max_bytes + 1))  # bytes of LRH..ICRC still allowed by PktLen
        extra_beat = Signal()                   # VCRC spilled into one more beat
        extra_whole = Signal()                  # ... all of it, not just the high byte
        extra_bad = Signal()

        # --- per-VL head packets and credit check ---
        # PktLen is 11 bits: a corrupt one may claim up to 2047 words.
        head_len = [Signal(range(2047 * 4 + VCRC_BYTES + 1), name=f"head_len{v}")
                    for v in range(num_vls)]
        head_blocks = [Signal(FCCL_BITS, name=f"head_blocks{v}") for v in range(num_vls)]
        head_start = Signal(num_vls)
        head_too_long = Signal(num_vls)
        credit_ok = Signal(num_vls)
        eligible = Signal(num_vls)
        active = self.state == LinkState.ACTIVE
        for v in range(num_vls):
            head = self.data_in[v].payload
            m.d.comb += [
                head_len[v].eq(lrh_wire_bytes(head.data)),
                head_blocks[v].eq(blocks_of(head_len[v])),
                head_start[v].eq(self.data_in[v].valid & head.start),
                head_too_long[v].eq(head_len[v] > max_bytes),
                # IBA: send only if (FCCL - (FCTBS + blocks)) mod 4096 <= 2048.
                credit_ok[v].eq(((limit[v] - fctbs[v] - head_blocks[v]) & 0xFFF) <= 2048),
                eligible[v].eq(head_start[v] & ~head_too_long[v] & credit_ok[v] & active),
            ]
            with m.If(head_start[v] & ~head_too_long[v] & ~credit_ok[v] & active):
                m.d.sync += self.credit_stall_cycles[v].eq(self.credit_stall_cycles[v] + 1)
        # Each VL's head beat as the CRC stage takes it, aligned by its own count before the
        # VL is picked. Only a packet cut at PktLen ends elsewhere, and it goes out end-bad.
        crc_data = Array(Signal(8 * width, name=f"crc_data{v}") for v in range(num_vls))
        crc_lead = Array(Signal(width + 1, name=f"crc_lead{v}") for v in range(num_vls))
        for v in range(num_vls):
            head = self.data_in[v].payload
            own_count = Mux(head.end, head.count, width)
            m.d.comb += [crc_data[v].eq(align(head.data, own_count, width)),
                         crc_lead[v].eq(lead(own_count, width))]

        # --- flow-control packet schedule ---
        since_fc = [Signal(range(self.fc_period + 1), init=self.fc_period, name=f"since_fc{v}")
                    for v in range(num_vls)]
        last_fccl = [Signal(FCCL_BITS, name=f"last_fccl{v}") for v in range(num_vls)]
        # Registered: whether a VL wants a flow-control packet in the next cycle. The timer
        # terms look one cycle ahead, so they fire exactly when they did unregistered; the
        # FCCL terms see the advertised FCCL a cycle late, and the batch test (a subtraction
        # and a compare) two. A VL whose packet goes now wants none next cycle (its timer
        # restarts), and none goes in the cycle after a clear: the advertised FCCL is a
        # register of our receiver's and still holds the value from before the clear.
        batch_ready = Signal(num_vls)
        want_fc = Signal(num_vls)
        fc_going = Signal(num_vls)
        for v in range(num_vls):
            with m.If(since_fc[v] != self.fc_period):
                m.d.sync += since_fc[v].eq(since_fc[v] + 1)
            m.d.sync += batch_ready[v].eq(
                ((self.advertise_fccl[v] - last_fccl[v])[:FCCL_BITS] >= self.fc_batch_blocks))
            # Until the link is up, the peer may be missing our packets: repeat them often.
            # Once up, a change is reported within fc_min_interval, and a large one (a
            # batch of freed blocks the sender may be starving for) almost at once.
            m.d.sync += want_fc[v].eq(~self.clear & ~fc_going[v] & (
                (since_fc[v] >= self.fc_min_interval - 1)
                & ((self.state != LinkState.ACTIVE) | (self.advertise_fccl[v] != last_fccl[v]))
                | (since_fc[v] >= FC_BATCH_INTERVAL - 1) & batch_ready[v]
                | (since_fc[v] >= self.fc_period - 1)))
        fc_vl = Signal(vl_index(num_vls))
        for v in reversed(range(num_vls)):
            with m.If(want_fc[v]):
                m.d.comb += fc_vl.eq(v)
        fc_op = Signal(FlowControlOp)
        m.d.comb += fc_op.eq(Mux(self.state == LinkState.INIT,
                                 FlowControlOp.INIT, FlowControlOp.NORMAL))
        fc_fctbs = fctbs[fc_vl]
        fc_fccl = Array(self.advertise_fccl)[fc_vl]
        fc_vl_field = Signal(4)
        m.d.comb += fc_vl_field.eq(fc_vl)
        # IBA flow-control packet: Op|FCTBS, VL|FCCL, big-endian bit fields.
        fc_bytes = Cat(fc_fctbs[8:12], fc_op.as_value(), fc_fctbs[0:8],
                       fc_fccl[8:12], fc_vl_field, fc_fccl[0:8])

        # --- weighted round robin over eligible VLs ---
        rr_pointer = Signal(vl_index(num_vls))
        rr_budget = Signal(16)
        pick = Signal(vl_index(num_vls))
        pick_valid = Signal()
        stay = Signal()
        m.d.comb += stay.eq(eligible.bit_select(rr_pointer, 1) & (rr_budget != 0))
        with m.If(stay):
            m.d.comb += [pick.eq(rr_pointer), pick_valid.eq(1)]
        with m.Else():
            # The VL after the pointer wins first; the pointer's own VL comes last.
            for offset in reversed(range(1, num_vls + 1)):
                candidate = (rr_pointer + offset) % num_vls if num_vls > 1 else C(0, 1)
                with m.If(eligible.bit_select(candidate, 1)):
                    m.d.comb += [pick.eq(candidate), pick_valid.eq(1)]

        # --- one beat of data: PktLen enforcement, VCRC append ---
        beat = Signal(BeatLayout(width))
        beat_allowed = Signal(range(max_bytes + 1))
        natural_count = Mux(beat.end, beat.count, width)
        forced_end = ~beat.end & (beat_allowed <= width)
        out_end = beat.end | forced_end
        out_count = Signal(range(width + 1))
        m.d.comb += out_count.eq(Mux(natural_count > beat_allowed, beat_allowed, natural_count))
        malformed = forced_end | (beat.end & (beat.count != beat_allowed))

        m.d.sync += [s1_valid.eq(0), s1_crc_valid.eq(0), self.fc_sent.valid.eq(0)]

        def emit_beat(vl):
            m.d.comb += inputs[vl].ready.eq(1)
            # The VCRC goes right after the last byte, spilling into one more beat when it must.
            m.d.sync += [
                s1_valid.eq(1), s1_link.eq(0), s1_start.eq(beat.start), s1_data.eq(beat.data),
                s1_keep.eq(Cat(~out_end | (lane < out_count) for lane in range(width))),
                s1_low.eq(Cat(out_end & (lane == out_count) for lane in range(width))),
                s1_high.eq(Cat(out_end & (lane == out_count + 1) for lane in range(width))),
                s1_crc_valid.eq(1), s1_crc_start.eq(beat.start),
                s1_crc_data.eq(crc_data[vl]), s1_crc_lead.eq(crc_lead[vl]),
                busy.eq(~out_end),
                allowed.eq(beat_allowed - width),
            ]
            with m.If(out_end):
                spill = out_count + VCRC_BYTES > width
                m.d.sync += [
                    s1_end.eq(~spill),
                    s1_count.eq(Mux(spill, width, out_count + VCRC_BYTES)),
                    s1_end_bad.eq(~spill & (beat.end_bad | malformed)),
                    extra_beat.eq(spill),
                    extra_whole.eq(out_count == width),
                    discarding.eq(forced_end),
                ]
                with m.If(malformed):
                    m.d.sync += self.cut_overlong.eq(self.cut_overlong + 1)
            with m.Else():
                m.d.sync += [s1_end.eq(0), s1_count.eq(width), s1_end_bad.eq(0)]
            # A spilled beat carries the end-bad mark; remember it.
            m.d.sync += extra_bad.eq(beat.end_bad | malformed)

        m.d.comb += beat.eq(inputs[current].payload)
        m.d.comb += beat_allowed.eq(allowed)

        with m.If(extra_beat):
            # An empty beat through the CRC leaves its state, the whole packet's CRC.
            m.d.sync += [
                s1_valid.eq(1), s1_link.eq(0), s1_start.eq(0),
                s1_end.eq(1), s1_count.eq(Mux(extra_whole, VCRC_BYTES, VCRC_BYTES - 1)),
                s1_end_bad.eq(extra_bad), s1_data.eq(0), s1_keep.eq(0),
                s1_low.eq(extra_whole), s1_high.eq(Mux(extra_whole, 0b10, 0b01)),
                s1_crc_valid.eq(1), s1_crc_start.eq(0), s1_crc_data.eq(0),
                s1_crc_lead.eq(lead(0, width)),
                extra_beat.eq(0),
            ]
        with m.Elif(discarding):
            m.d.comb += inputs[current].ready.eq(1)
            with m.If(inputs[current].valid & inputs[current].payload.end):
                m.d.sync += discarding.eq(0)
        with m.Elif(busy):
            with m.If(inputs[current].valid):
                emit_beat(current)
        with m.Elif(want_fc.any()):
            # The LPCRC is the VCRC algorithm over the packet's 4 bytes: the same CRC stage.
            m.d.sync += [
                s1_valid.eq(1), s1_link.eq(1),
                s1_start.eq(1), s1_end.eq(1), s1_end_bad.eq(0),
                s1_count.eq(6), s1_data.eq(fc_bytes),
                s1_keep.eq(0b1111), s1_low.eq(0b10000), s1_high.eq(0b100000),
                s1_crc_valid.eq(1), s1_crc_start.eq(1),
                s1_crc_data.eq(align(fc_bytes, 4, width)), s1_crc_lead.eq(lead(4, width)),
                self.fc_sent.valid.eq(1),
                self.fc_sent.op.eq(fc_op),
                self.fc_sent.vl.eq(fc_vl),
                self.fc_sent.fctbs.eq(fc_fctbs),
                self.fc_sent.fccl.eq(fc_fccl),
                self.fc_packets_sent.eq(self.fc_packets_sent + 1),
            ]
            for v in range(num_vls):
                with m.If(fc_vl == v):
                    m.d.comb += fc_going[v].eq(1)
                    m.d.sync += [since_fc[v].eq(0), last_fccl[v].eq(self.advertise_fccl[v])]
        with m.Elif(pick_valid):
            m.d.comb += [beat.eq(inputs[pick].payload),
                         beat_allowed.eq(Array(head_len)[pick] - VCRC_BYTES)]
            emit_beat(pick)
            blocks = Array(head_blocks)[pick]
            m.d.sync += [
                current.eq(pick),
                fctbs[pick].eq(fctbs[pick] + blocks),
                Array(self.packets_sent)[pick].eq(Array(self.packets_sent)[pick] + 1),
                rr_pointer.eq(pick),
            ]
            with m.If(stay):
                m.d.sync += rr_budget.eq(Mux(rr_budget > blocks, rr_budget - blocks, 0))
            with m.Else():
                weight = Array(self.vl_weight)[pick]
                m.d.sync += rr_budget.eq(Mux(weight > blocks, weight - blocks, 0))
        with m.Else():
            # Junk at the head of a stream never reaches the wire: drop it, one VL at a time.
            junk_vl = Signal(vl_index(num_vls))
            junk = Signal()
            for v in reversed(range(num_vls)):
                head = self.data_in[v]
                with m.If(head.valid & (~head.payload.start | head_too_long[v])):
                    m.d.comb += [junk_vl.eq(v), junk.eq(1)]
            junk_head = inputs[junk_vl]
            with m.If(junk):
                m.d.comb += junk_head.ready.eq(1)
                with m.If(~junk_head.payload.start):
                    m.d.sync += self.discarded_framing.eq(self.discarded_framing + 1)
                with m.Else():
                    m.d.sync += [current.eq(junk_vl), discarding.eq(~junk_head.payload.end),
                                 self.discarded_too_long.eq(self.discarded_too_long + 1)]

        with m.If(self.clear):
            for v in range(num_vls):
                m.d.sync += [fctbs[v].eq(0), limit[v].eq(0),
                             since_fc[v].eq(self.fc_period), last_fccl[v].eq(0)]
        # A peer's INIT that caused the clear carries the limit to start from.
        with m.If(self.credit_update.valid & (self.credit_update.vl < num_vls)):
            m.d.sync += limit[self.credit_update.vl].eq(self.credit_update.fccl)
        return m

