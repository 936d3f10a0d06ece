
from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..arith import or_all
from ..crc.aligned_crc import AlignedCRC, advance_and_seed, align
from ..crc.algorithms import VCRC
from ..prim.round_robin import mask_at, next_mask, round_robin_pick
from .signatures import (
    BeatLayout, FlowControlOp, FlowControlSignature, LinkState, WireSignature,
    BLOCK_BYTES, FCCL_BITS, VCRC_BYTES, blocks_of, check_mtu, check_width, lrh_pktlen,
    max_wire_bytes, vl_index,
)

__all__ = ["LinkTransmitter", "FC_BATCH_INTERVAL", "ARMED_FC_INTERVAL", "credit_view"]

# Cycles between flow-control packets of one VL that report a large batch of freed blocks.
FC_BATCH_INTERVAL = 4
# Most cycles between one VL's NORMAL packets in ARMED: the peer goes ACTIVE on one.
ARMED_FC_INTERVAL = 16
# IBA: a packet may start when (FCCL - (FCTBS + blocks)) mod 4096 <= CREDIT_WINDOW.
CREDIT_WINDOW = 2048
# On the few nets the decision is made of (eligible VLs, whether a pick may happen, the
# beat each VL sends): the LUT mapper (ABC9) would otherwise merge them into the AND trees
# around them and lose the shallow decomposition the decision is written in.
KEEP = {"keep": 1}


class LinkTransmitter(wiring.Component):
    """Sending half of a credit-based IBA link port.

    Takes one packet stream per data VL (LRH..ICRC), picks among the VLs whose
    head packet the peer's credit limit covers in full (weighted round robin,
    ``vl_weight`` 64-byte blocks per turn, at least one packet), appends the
    VCRC and drives the wire. Between data packets it sends IBA flow-control
    packets: Op INIT while the port initialises (every ``fc_min_interval`` cycles per VL),
    NORMAL ones in ARMED (every ``min(ARMED_FC_INTERVAL, fc_min_interval)`` cycles per
    VL) and in ACTIVE when the advertised FCCL changed (at most every
    ``fc_min_interval`` cycles per VL) and at least every ``fc_period`` cycles per VL,
    which heals lost ones; a
    change of ``fc_batch_blocks`` or more goes out after only
    ``FC_BATCH_INTERVAL`` cycles, so a sender waiting for a large packet's
    worth of credit is not held up by the batching.

    A packet whose beats run past its LRH.PktLen is cut at PktLen and marked
    end-bad, so a malformed upstream can never overrun the credits it was
    granted; a packet longer than the MTU allows, or a stream that does not
    begin with a start beat, is discarded. Each case is counted.

    Latency: two cycles from an accepted start beat to the start beat on the wire: every
    VL's head is registered with its CRC inputs, the choice is made after that register
    and the VCRC computed from there into the wire register. The credit test reads
    registered views of each VL's room; a credit update counts from the second cycle
    after it (docs/link.md).
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
        self.armed_fc_interval = min(ARMED_FC_INTERVAL, fc_min_interval)
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
            # Some VL's data_in beat is taken in this cycle (valid and ready).
            "taken": Out(1),
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
        # Per lane: the beat's own byte, the CRC's low byte, its high byte (else zero).
        s1_keep, s1_low, s1_high = Signal(width), Signal(width), Signal(width)
        s1_crc_valid = Signal()
        # Every VL's head beat is registered in every cycle, with its CRC inputs (the beat
        # aligned by its own count, the advance matrix and seed), and so are the bytes of a
        # flow-control packet; which of them went in (`s1_emit`, `s1_fc`, or `s1_spill` for
        # an empty spill beat) is chosen here, after the register, where the path is short.
        # s1_start .. s1_count hold the other beats' (zero for a data beat).
        s1_emit = Signal(self.num_vls)
        s1_fc, s1_spill = Signal(), Signal()
        s1_fc_bytes = Signal(32)
        s1_head = [{field: Signal(shape, name=f"s1_head{v}_{field}") for field, shape in (
            ("data", 8 * width), ("crc_data", 8 * width), ("advance", len(vcrc.advance)),
            ("seed", len(vcrc.seed)))} for v in range(self.num_vls)]
        fc_advance, fc_seed = advance_and_seed(VCRC, 4, 1, width)
        empty_advance, _ = advance_and_seed(VCRC, 0, 0, width)

        def from_head(field, fc_value, spill_value=0):
            return (_one_hot_mux(s1_emit, [fields[field] for fields in s1_head])
                    | Mux(s1_fc, fc_value, 0) | Mux(s1_spill, spill_value, 0))

        s1_data = from_head("data", s1_fc_bytes)
        m.d.comb += [
            vcrc.valid.eq(s1_crc_valid),
            vcrc.data.eq(from_head("crc_data", align(s1_fc_bytes, 4, width))),
            vcrc.advance.eq(from_head("advance", fc_advance, empty_advance)),
            vcrc.seed.eq(from_head("seed", fc_seed)),
        ]
        s1_from = [{field: Signal(shape, name=f"s1_{field}{v}") for field, shape in (
            ("start", 1), ("end", 1), ("end_bad", 1), ("count", range(width + 1)),
            ("count_cut", range(width + 1)), ("cut", 1))} for v in range(self.num_vls)]

        def from_emit(field):
            return _one_hot_mux(s1_emit, [fields[field] for fields in s1_from])

        emitted_count = _one_hot_mux(s1_emit, [Mux(fields["cut"], fields["count_cut"], fields["count"])
                                               for fields in s1_from])
        m.d.sync += [
            self.wire.valid.eq(s1_valid), self.wire.link.eq(s1_link),
            self.wire.start.eq(s1_start | from_emit("start")),
            self.wire.end.eq(s1_end | from_emit("end")),
            self.wire.end_bad.eq(s1_end_bad | from_emit("end_bad")),
            self.wire.count.eq(s1_count | emitted_count),
            self.wire.data.eq(Cat(
                Mux(s1_keep[lane], s1_data[8 * lane:8 * lane + 8], 0)
                | Mux(s1_low[lane], vcrc.crc[0:8], 0) | Mux(s1_high[lane], vcrc.crc[8:16], 0)
                for lane in range(width))),
        ]

        inputs = Array(self.data_in)
        # Blocks of the largest packet that is not discarded, and of the largest one that can
        # end in its start beat with the VCRC in the same beat (the only kind after which the
        # same VL may start again in the next cycle).
        max_blocks = blocks_of(max_bytes)
        bits = max_blocks.bit_length()
        short_blocks = -(-width // BLOCK_BYTES)

        self.formal_invariants = []
        busy = Signal()                         # inside a data packet
        discarding = Signal()                   # dropping the rest of an input packet
        current = Signal(vl_index(num_vls))
        allowed = Signal(range(max_bytes + 1))  # bytes of LRH..ICRC still allowed by PktLen
        extra_beat = Signal()                   # VCRC spilled into one more beat
        extra_whole = Signal()                  # ... all of it, not just the high byte
        extra_bad = Signal()

        # Counters count registered events, a cycle after them: a 32-bit increment is deep
        # enough on its own.
        def count_event(counter, event):
            registered = Signal(name=f"{counter.name}_event")
            m.d.sync += [registered.eq(event), counter.eq(counter + registered)]

        # --- per-VL head packets and credit check ---
        # The credit test of a head is one compare against registers: `lim` and `over` say,
        # for a room, which heads fit (see credit_view). They are computed a cycle ahead
        # from the next limit and this cycle's FCTBS, for k = 0 .. short_blocks blocks
        # started on the VL in this cycle (from FCTBS + k, kept beside FCTBS); `view_sel`
        # (registered with the decision) says which k it was, none if another size (the VL
        # then waits a cycle).
        pktlen = [lrh_pktlen(self.data_in[v].payload.data) for v in range(num_vls)]
        # Blocks of a head, less one: blocks_of(4 * PktLen + VCRC_BYTES) is PktLen // 16 + 1.
        assert all(blocks_of(4 * n + VCRC_BYTES) == n // 16 + 1 for n in range(2048))
        blocks_less1 = [pktlen[v][4:] for v in range(num_vls)]
        head_start = Signal(num_vls)
        head_too_long = Signal(num_vls)
        credit_ok = Signal(num_vls)
        eligible = Signal(num_vls, attrs=KEEP)
        lim = [[Signal(bits + 1, name=f"credit_lim{v}_{k}") for k in range(short_blocks + 1)]
               for v in range(num_vls)]
        over = [Signal(short_blocks + 1, name=f"credit_over{v}") for v in range(num_vls)]
        view_sel = [Signal(short_blocks + 1, init=1, name=f"credit_view_sel{v}")
                    for v in range(num_vls)]
        active = self.state == LinkState.ACTIVE
        for v in range(num_vls):
            m.d.comb += [
                head_start[v].eq(self.data_in[v].valid & self.data_in[v].payload.start),
                # 4 * PktLen + VCRC_BYTES > max_bytes
                head_too_long[v].eq(_less_than((max_bytes - VCRC_BYTES) // 4, pktlen[v])),
                credit_ok[v].eq(Cat(view_sel[v][k] & (over[v][k] ^ _less_than(blocks_less1[v][:bits], lim[v][k]))
                                    for k in range(short_blocks + 1)).any()),
                eligible[v].eq(head_start[v] & ~head_too_long[v] & credit_ok[v] & active),
            ]
            count_event(self.credit_stall_cycles[v], head_start[v] & ~head_too_long[v] & ~credit_ok[v] & active)
        # Each VL's head beat as the CRC stage takes it, aligned by its own count before the
        # VL is picked. Only a packet cut at PktLen ends elsewhere, and it goes out end-bad.
        crc_data = [Signal(8 * width, name=f"crc_data{v}") for v in range(num_vls)]
        crc_advance = [Signal(len(vcrc.advance), name=f"crc_advance{v}") for v in range(num_vls)]
        crc_seed = [Signal(len(vcrc.seed), name=f"crc_seed{v}") for v in range(num_vls)]
        for v in range(num_vls):
            head = self.data_in[v].payload
            own_count = Mux(head.end, head.count, width)
            m.d.comb += [crc_data[v].eq(align(head.data, own_count, width)),
                         Cat(crc_advance[v], crc_seed[v]).eq(
                             Cat(*advance_and_seed(VCRC, own_count, head.start, width)))]

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
        # Entering ARMED or ACTIVE, every VL's flow-control packet goes at once: the peer
        # waits for our NORMAL packet to go ACTIVE itself.
        state_before = Signal(LinkState)
        entered = Signal()
        m.d.sync += [state_before.eq(self.state),
                     entered.eq((self.state != state_before) & (self.state != LinkState.INIT))]
        for v in range(num_vls):
            with m.If(entered):
                m.d.sync += since_fc[v].eq(self.fc_period)
            with m.Elif(since_fc[v] != self.fc_period):
                m.d.sync += since_fc[v].eq(since_fc[v] + 1)
            m.d.sync += batch_ready[v].eq(
                ((self.advertise_fccl[v] - last_fccl[v])[:FCCL_BITS] >= self.fc_batch_blocks))
            # Until the link is up, the peer may be missing our packets: repeat them often,
            # and in ARMED more often still (the peer waits for a NORMAL packet to go ACTIVE).
            # Once up, a change is reported within fc_min_interval, and a large one (a
            # batch of freed blocks the sender may be starving for) almost at once.
            m.d.sync += want_fc[v].eq(~self.clear & ~fc_going[v] & (
                (since_fc[v] >= self.fc_min_interval - 1)
                & ((self.state != LinkState.ACTIVE) | (self.advertise_fccl[v] != last_fccl[v]))
                | (since_fc[v] >= self.armed_fc_interval - 1) & (self.state == LinkState.ARMED)
                | (since_fc[v] >= FC_BATCH_INTERVAL - 1) & batch_ready[v]
                | (since_fc[v] >= self.fc_period - 1)))
        fc_vl = Signal(vl_index(num_vls))
        for v in reversed(range(num_vls)):
            with m.If(want_fc[v]):
                m.d.comb += fc_vl.eq(v)
        fc_op = Signal(FlowControlOp)
        m.d.comb += fc_op.eq(Mux(self.state == LinkState.INIT,
                                 FlowControlOp.INIT, FlowControlOp.NORMAL))
        fc_fctbs = Array(self.fctbs)[fc_vl]
        fc_fccl = Array(self.advertise_fccl)[fc_vl]
        fc_vl_field = Signal(4)
        m.d.comb += fc_vl_field.eq(fc_vl)
        # IBA flow-control packet: Op|FCTBS, VL|FCCL, big-endian bit fields.
        fc_bytes = Cat(fc_fctbs[8:12], fc_op.as_value(), fc_fctbs[0:8],
                       fc_fccl[8:12], fc_vl_field, fc_fccl[0:8])

        # --- what happens in this cycle: the registered cases first, then the VL pick ---
        decide = ~extra_beat & ~discarding & ~busy      # at a packet boundary
        fc_now = decide & want_fc.any()
        pick_now = Signal(attrs=KEEP)
        m.d.comb += pick_now.eq(decide & ~want_fc.any())

        # Weighted round robin over eligible VLs: the VL holding the turn keeps it while it
        # has budget, else the first eligible VL after it wins, its own last. That is one
        # round-robin pick from a registered thermometer mask: from the turn's VL up while
        # it has budget, else from the VL after it.
        rr_turn = Signal(num_vls, init=1)               # one-hot: the VL holding the turn
        # (Its top bit, always set, is not stored.)
        rr_mask = (Signal(num_vls - 1, init=((1 << (num_vls - 1)) - 1) ^ ((1 << (1 % num_vls)) - 1))
                   if num_vls > 1 else C(0, 0))
        rr_budget_less1 = Signal(8)                     # its budget less one, if it has any
        rr_budget_nz = Signal()
        # The weights less one, and whether they are zero, registered (a new weight counts
        # from the next turn after the next cycle).
        weight_less1 = [Signal(8, name=f"rr_weight{v}_less1") for v in range(num_vls)]
        weight_nz = [Signal(name=f"rr_weight{v}_nz") for v in range(num_vls)]
        for v in range(num_vls):
            m.d.sync += [weight_less1[v].eq(self.vl_weight[v] - 1), weight_nz[v].eq(self.vl_weight[v] != 0)]
        grant = Signal(num_vls)
        m.d.comb += [
            grant.eq(round_robin_pick(m, eligible, Cat(rr_mask, C(1, 1)), name="rr")),
        ]
        start = Signal(num_vls)                 # a packet starts on this VL
        carry_on = Signal(num_vls, attrs=KEEP)  # the current packet's next beat goes
        emit = Signal(num_vls, attrs=KEEP)      # a beat of this VL goes into the beat register
        m.d.comb += [
            start.eq(grant & pick_now.replicate(num_vls)),
            carry_on.eq(Cat(~extra_beat & ~discarding & busy & (current == v)
                            & self.data_in[v].valid for v in range(num_vls))),
            emit.eq(start | carry_on),
        ]

        # --- per VL, the beat of that VL as it would go into the beat register (PktLen
        # enforcement, where the VCRC goes), computed before the pick; the pick chooses.
        # The bytes PktLen still allows are the current packet's (`allowed`) or, for a start
        # beat, 4 * PktLen: every test is made against both and chosen by `busy` last.
        # Lanes are handled as thermometers (lane < count, lane < allowed), so no byte
        # count is formed before a lane mask is.
        def beat_out(v, beat, pktlen):
            # A signal, not an expression: every lane's test slices it.
            head_allowed = Signal.like(allowed, name=f"head_allowed{v}")
            m.d.comb += head_allowed.eq(pktlen * 4)

            def allows(test):
                return _choose(busy, test(allowed), test(head_allowed))

            # Signals, not expressions: each is used several times and an Amaranth
            # expression is emitted again at every use.
            below_allowed = Signal(width + 1, name=f"below_allowed{v}")
            inside = Signal(width, name=f"inside{v}")
            forced_end = Signal(name=f"forced_end{v}")
            out_end = Signal(name=f"out_end{v}")
            m.d.comb += [
                below_allowed.eq(Cat(allows(lambda bound: _less_than(lane, bound))
                                     for lane in range(width + 1))),
                forced_end.eq(~beat.end & ~below_allowed[width]),
                out_end.eq(beat.end | forced_end),
                # Lanes before the end of the bytes going out (lane < min(count, allowed)).
                inside.eq(Cat((~beat.end | _less_than(lane, beat.count)) & below_allowed[lane]
                              for lane in range(width))),
            ]
            inside_at = lambda lane: inside[lane] if lane >= 0 else C(1, 1)
            count_fits = beat.end & allows(lambda bound: ~_less_than(bound, beat.count))
            malformed = forced_end | beat.end & ~allows(lambda bound: beat.count == bound)
            # The VCRC goes right after the last byte, spilling into one more beat when it must.
            spill = inside[width - 2]
            last = out_end & ~spill
            fields = s1_from[v]
            m.d.sync += [
                # A start flag inside a packet is not a new packet: the wire's framing stays
                # whole (its VCRC, restarted there, fails at the peer, which drops the packet).
                fields["start"].eq(beat.start & ~busy), fields["end"].eq(last),
                fields["end_bad"].eq(last & (beat.end_bad | malformed)),
                fields["count"].eq(Mux(last, beat.count + VCRC_BYTES, width)),
                fields["count_cut"].eq(allows(lambda bound: bound[:len(s1_count)] + VCRC_BYTES)),
                fields["cut"].eq(last & ~count_fits),
            ]
            registers = [
                (s1_keep, Cat(~out_end | inside[lane] for lane in range(width))),
                (s1_low, Cat(out_end & inside_at(lane - 1) & ~inside[lane] for lane in range(width))),
                (s1_high, Cat(out_end & inside_at(lane - 2) & ~inside_at(lane - 1)
                              for lane in range(width))),
                (busy, ~out_end), (allowed, allows(lambda bound: bound - width)),
                (extra_beat, out_end & spill), (extra_whole, inside[width - 1]),
                # A spilled beat carries the end-bad mark; remember it.
                (extra_bad, beat.end_bad | malformed),
                (discarding, forced_end),
            ]
            return registers, malformed

        beats = []
        for v in range(num_vls):
            beats.append(beat_out(v, self.data_in[v].payload, pktlen[v]))

        # Every field of the beat register is zero unless a beat goes in: no field holds a
        # value, so none needs the decision as an enable or a hold.
        m.d.sync += [register.eq(0) for register in (
            s1_valid, s1_link, s1_start, s1_end, s1_count, s1_end_bad, s1_keep, s1_low, s1_high,
            s1_crc_valid)]
        # The wide fields: every VL's head and the flow-control bytes, whatever goes.
        for v in range(num_vls):
            m.d.sync += [s1_head[v]["data"].eq(self.data_in[v].payload.data),
                         s1_head[v]["crc_data"].eq(crc_data[v]),
                         s1_head[v]["advance"].eq(crc_advance[v]), s1_head[v]["seed"].eq(crc_seed[v])]
        m.d.sync += [s1_fc_bytes.eq(fc_bytes), s1_emit.eq(emit), s1_fc.eq(fc_now),
                     s1_spill.eq(extra_beat)]
        m.d.sync += self.fc_sent.valid.eq(0)
        with m.If(emit.any()):
            m.d.sync += [s1_valid.eq(1), s1_crc_valid.eq(1)]
            for i, (register, _) in enumerate(beats[0][0]):
                m.d.sync += register.eq(_one_hot_mux(emit, [beat[0][i][1] for beat in beats]))
        with m.Elif(extra_beat):
            # An empty beat through the CRC leaves its state, the whole packet's CRC.
            m.d.sync += [
                s1_valid.eq(1), s1_link.eq(0), s1_start.eq(0),
                s1_end.eq(1), s1_count.eq(Mux(extra_whole, VCRC_BYTES, VCRC_BYTES - 1)),
                s1_end_bad.eq(extra_bad), s1_keep.eq(0),
                s1_low.eq(extra_whole), s1_high.eq(Mux(extra_whole, 0b10, 0b01)),
                s1_crc_valid.eq(1),
                extra_beat.eq(0),
            ]
        with m.Elif(fc_now):
            # The LPCRC is the VCRC algorithm over the packet's 4 bytes: the same CRC stage.
            m.d.sync += [
                s1_valid.eq(1), s1_link.eq(1),
                s1_start.eq(1), s1_end.eq(1), s1_end_bad.eq(0),
                s1_count.eq(6),
                s1_keep.eq(0b1111), s1_low.eq(0b10000), s1_high.eq(0b100000),
                s1_crc_valid.eq(1),
                self.fc_sent.valid.eq(1),
                self.fc_sent.op.eq(fc_op),
                self.fc_sent.vl.eq(fc_vl),
                self.fc_sent.fctbs.eq(fc_fctbs),
                self.fc_sent.fccl.eq(fc_fccl),
            ]
            for v in range(num_vls):
                with m.If(fc_vl == v):
                    m.d.comb += fc_going[v].eq(1)
                    m.d.sync += [since_fc[v].eq(0), last_fccl[v].eq(self.advertise_fccl[v])]

        discard_now = ~extra_beat & discarding
        with m.If(discard_now & inputs[current].valid & inputs[current].payload.end):
            m.d.sync += discarding.eq(0)

        with m.If(start.any()):
            m.d.sync += [
                current.eq(_one_hot_mux(start, [C(v, current.shape()) for v in range(num_vls)])),
                rr_turn.eq(grant),
            ]
            # The turn's budget after the packet: what the VL has left if it holds the turn with
            # budget, else its weight; less the packet's blocks. It is kept less one, so that
            # whether any is left is one compare: base - blocks >= 1 is blocks - 1 < base - 1.
            # Every VL's is formed side by side; the pick chooses.
            left_less1, left_nz, masks = [], [], []
            for v in range(num_vls):
                less1 = Cat(blocks_less1[v], C(0, 1))
                held = rr_turn[v] & rr_budget_nz
                left_nz.append(_choose(held, _less_than(less1, rr_budget_less1),
                                       weight_nz[v] & _less_than(less1, weight_less1[v])))
                # base - 1 - blocks = (base - 1) - (blocks - 1) - 1
                left_less1.append(_choose(held, _difference(rr_budget_less1, less1, 1),
                                          _difference(weight_less1[v], less1, 1)))
                one_hot = C(1 << v, num_vls)
                masks.append(Mux(left_nz[v], mask_at(one_hot), next_mask(one_hot)))
            m.d.sync += [
                rr_budget_less1.eq(_one_hot_mux(start, left_less1)),
                rr_budget_nz.eq(_one_hot_mux(start, left_nz)),
            ]
            if num_vls > 1:
                m.d.sync += rr_mask.eq(_one_hot_mux(start, masks)[:num_vls - 1])
        for v in range(num_vls):
            count_event(self.packets_sent[v], start[v])
        count_event(self.fc_packets_sent, fc_now)
        count_event(self.cut_overlong, _one_hot_mux(emit, [beat[1] for beat in beats]))

        # Junk at the head of a stream never reaches the wire: drop it, one VL at a time.
        junk_vl = Signal(vl_index(num_vls))
        junk = Signal()
        for v in reversed(range(num_vls)):
            head = self.data_in[v]
            with m.If(head.valid & (~head.payload.start | head_too_long[v])):
                m.d.comb += [junk_vl.eq(v), junk.eq(1)]
        junk_now = pick_now & ~eligible.any() & junk
        junk_head = inputs[junk_vl]
        count_event(self.discarded_framing, junk_now & ~junk_head.payload.start)
        count_event(self.discarded_too_long, junk_now & junk_head.payload.start)
        with m.If(junk_now & junk_head.payload.start):
            m.d.sync += [current.eq(junk_vl), discarding.eq(~junk_head.payload.end)]

        for v in range(num_vls):
            m.d.comb += self.data_in[v].ready.eq(
                emit[v] | discard_now & (current == v) | junk_now & (junk_vl == v))
        # The same handshakes as one bit, without the VL pick (a pick is made whenever a VL is
        # eligible): a register fed by it, as a stage in front of data_in is, stays in budget.
        m.d.comb += self.taken.eq(pick_now & (eligible.any() | junk) | carry_on.any()
                                  | discard_now & inputs[current].valid)
        self.formal_invariants.append(
            self.taken == Cat(self.data_in[v].valid & self.data_in[v].ready
                              for v in range(num_vls)).any())

        # --- credits: FCTBS, the peer's limit, the registered credit view ---
        update = self.credit_update
        for v in range(num_vls):
            fctbs, limit = self.fctbs[v], self.credit_limit[v]
            # FCTBS + k for every k a packet ending in its start beat may have, and each of
            # those + 2**bits.
            ahead = [Signal(FCCL_BITS, init=k, name=f"fctbs{v}_plus{k}")
                     for k in range(1, short_blocks + 1)]
            ahead_low = [Signal(FCCL_BITS, init=k + (1 << bits), name=f"fctbs{v}_plus{k}_{1 << bits}")
                         for k in range(short_blocks + 1)]
            # Redundant registers' relations, true in every reachable state: a formal proof
            # asserts them (docs/formal.md), which also lets its induction start from them.
            self.formal_invariants += [ahead[k - 1] == (fctbs + k)[:FCCL_BITS]
                                       for k in range(1, short_blocks + 1)]
            self.formal_invariants += [ahead_low[k] == (fctbs + k + (1 << bits))[:FCCL_BITS]
                                       for k in range(short_blocks + 1)]
            updated = update.valid & (update.vl == v)
            # The views of the next room, from the limit register: a credit update counts
            # from the second cycle after it.
            for k, base in enumerate([fctbs] + ahead):
                view_lim, view_over = credit_view(m, limit, base, ahead_low[k], bits, name=f"view{v}_{k}")
                with m.If(self.clear):
                    # Nothing may start in the next cycle (the link is leaving ACTIVE anyway);
                    # the views are rebuilt from the cleared counters the cycle after.
                    m.d.sync += [lim[v][k].eq(0), over[v][k].eq(0)]
                with m.Else():
                    m.d.sync += [lim[v][k].eq(view_lim), over[v][k].eq(view_over)]
            with m.If(self.clear):
                m.d.sync += [fctbs.eq(0), limit.eq(0), view_sel[v].eq(1)]
                m.d.sync += [register.eq(k) for k, register in enumerate(ahead, 1)]
                m.d.sync += [register.eq(k + (1 << bits)) for k, register in enumerate(ahead_low)]
            with m.Elif(start[v]):
                # FCTBS + k + blocks = (FCTBS + k + 1) + (blocks - 1): every adder has two
                # operands.
                counts = [fctbs] + ahead
                m.d.sync += [register.eq(_sum(counts[k + 1], blocks_less1[v], 0))
                             for k, register in enumerate(counts[:-1])]
                m.d.sync += ahead[-1].eq(_sum(ahead[-1], blocks_less1[v], 1))
                m.d.sync += [register.eq(_sum(register, blocks_less1[v], 1)) for register in ahead_low]
                # A packet of another size keeps the VL out for a cycle: it is still being
                # sent, or (cut short of its PktLen) it goes out end-bad anyway.
                m.d.sync += view_sel[v].eq(Cat(C(0, 1), Cat(pktlen[v][4:] == k - 1
                                                            for k in range(1, short_blocks + 1))))
            with m.Else():
                m.d.sync += view_sel[v].eq(1)
            # A peer's INIT that caused the clear carries the limit to start from.
            with m.If(updated):
                m.d.sync += limit.eq(update.fccl)
        return m


def _choose(select, a, b):
    """``Mux(select, a, b)`` as gates: both sides stay separate circuits ahead of the late
    select (Yosys would share two like operators feeding one multiplexer, putting the
    select in front of them)."""
    width = max(len(Value.cast(a)), len(Value.cast(b)))
    return a & select.replicate(width) | b & (~select).replicate(width)


def _one_hot_mux(select, values):
    """The value whose bit in ``select`` is set (at most one is); zero when none is."""
    return or_all(Mux(select[i], value, 0) for i, value in enumerate(values))


def _less_than(a, b):
    """``a < b``, unsigned (either may be an int). Between two signals, in pieces a 6-input
    LUT takes: ``<`` and ``==`` of every 3 bits (from the top), then their prefix, so a
    compare of up to 9 bits is two levels deep. Against a constant each bit is one LUT input
    and the plain compare maps as shallow (as one cell, where the pieces would be dozens
    that Verilator keeps). No compare is made that the operand's range decides (``x < 0``,
    a 2-bit ``x > 3``: Verilator's lint rejects them); those are constants."""
    def against_constant(x, k, less):
        top = (1 << len(x)) - 1
        if less:        # x < k
            return C(1, 1) if k > top else x < k if k else C(0, 1)
        return x > k if k < top else C(0, 1)

    if isinstance(a, int) and isinstance(b, int):
        return C(a < b, 1)
    if isinstance(b, int):
        return against_constant(a, b, less=True)
    if isinstance(a, int):
        return against_constant(b, a, less=False)

    def piece(x, lo, hi):
        return x[lo:hi] if lo < len(x) else None

    n = max(len(a), len(b), 1)
    result = C(0, 1)
    bounds = list(range(n, 0, -3)) + [0]
    for hi, lo in reversed(list(zip(bounds, bounds[1:]))):
        x, y = piece(a, lo, hi), piece(b, lo, hi)
        if y is None:               # x < 0 never; x == 0
            less, equal = C(0, 1), x == 0
        elif x is None:
            less, equal = y != 0, y == 0
        else:
            less, equal = y > x, y == x
        result = less | equal & result
    return result


def _difference(a, b, borrow):
    """``(a - b - borrow) mod 2**len(a)`` with every bit's borrow from a compare of the bits
    below (carry lookahead): no carry ripples through the bits."""
    bits = []
    for i in range(len(a)):
        if i == 0:
            into = C(borrow, 1)
        elif borrow:
            into = ~_less_than(b[:i], a[:i])        # a[:i] <= b[:i]
        else:
            into = _less_than(a[:i], b[:i])
        bits.append(a[i] ^ b[i] ^ into)
    return Cat(*bits)


def _sum(a, b, carry):
    """``(a + b + carry) mod 2**len(a)``, carry lookahead: a - ~b - (1 - carry)."""
    b = Cat(b, C(0, len(a) - len(b)))
    return _difference(a, ~b, 1 - carry)


def credit_view(m, limit, fctbs, fctbs_ahead, bits, *, name):
    """The IBA credit test of every head against one room, as ``(lim, over)``.

    A head of ``blocks`` blocks (fewer than ``2**bits``: longer ones are discarded) may start
    when ``(limit - (fctbs + blocks)) mod 4096 <= 2048``. With the room s = (limit - fctbs)
    mod 4096 that holds for every head when 2**bits <= s <= 2048, for blocks <= s when
    s < 2**bits, for blocks >= s - 2048 when 2048 < s < 2048 + 2**bits, and never otherwise.
    So a head fits when ``over ^ (blocks - 1 < lim)``, with ``lim`` = 2**bits and ``over``
    clear (every head), s (low room), s - 2049 and ``over`` set (high room), or 0 (none).
    The range of s is read from compares of ``limit`` with ``fctbs``, ``fctbs_ahead``
    (= fctbs + 2**bits, a register) and both + 2048 (the top bit flipped), rather than
    from s itself: no subtraction's carry runs before the range test.
    """
    B = bits
    top = FCCL_BITS - B
    window = CREDIT_WINDOW >> B         # 2048 in units of 2**bits
    half = C(CREDIT_WINDOW, FCCL_BITS)
    ge_low, ge_all, ge_half, ge_over, eq_half = (
        Signal(name=f"{name}_{what}") for what in ("ge_low", "ge_all", "ge_half", "ge_over", "eq_half"))
    m.d.comb += [
        ge_low.eq(~_less_than(limit, fctbs)),
        ge_all.eq(~_less_than(limit, fctbs_ahead)),
        ge_half.eq(~_less_than(limit, fctbs ^ half)),
        ge_over.eq(~_less_than(limit, fctbs_ahead ^ half)),
        eq_half.eq(limit == (fctbs ^ half)),
    ]
    # Whether each range [from, to) wraps past 4095, from fctbs's top bits.
    high = fctbs[B:]
    wraps_low = high == (1 << top) - 1                          # [fctbs, +2**bits)
    wraps_all = (high >= window) & (high != (1 << top) - 1)     # [+2**bits, +2048)
    wraps_over = high == window - 1                             # [+2048, +2048 + 2**bits)

    def inside(at_or_after_from, at_or_after_to, wraps):
        return Mux(wraps, at_or_after_from | ~at_or_after_to, at_or_after_from & ~at_or_after_to)

    below = inside(ge_low, ge_all, wraps_low)
    fits_all = inside(ge_all, ge_half, wraps_all) | eq_half
    over = inside(ge_half, ge_over, wraps_over) & ~eq_half
    room = _difference(limit[:B], fctbs[:B], 0)                 # s mod 2**bits
    room_less1 = _difference(limit[:B], fctbs[:B], 1)           # (s - 1) mod 2**bits
    lim = Cat(Mux(below, room, Mux(over, room_less1, 0)), fits_all)
    return lim, over
