from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..crc.algorithms import VCRC
from ..crc.crc_check_stage import CRCCheckStage
from .beat_facts import BeatFacts
from .packet_buffer import PacketBuffer
from .signatures import (
    BLOCK_BYTES, FCCL_BITS, BeatLayout, FlowControlOp, FlowControlSignature,
    LinkState, RouteSignature, StoreSignature, StoredBeatLayout, WireSignature, vl_index, blocks_of, check_mtu, check_width,
    lrh_pktlen, max_wire_bytes,
)

__all__ = ["LinkReceiver", "DROP_REASONS", "ROUTED_DROP_REASONS", "DropEventSignature"]

# Why a data packet was dropped (or, cut through already, marked end-bad), in counter order.
DROP_REASONS = (
    "vcrc",         # VCRC check failed
    "truncated",    # ended before LRH.PktLen said, or a new packet started first
    "overlong",     # ran past LRH.PktLen
    "too_long",     # LRH.PktLen beyond the MTU's largest packet
    "invalid_vl",   # VL is not one of our data VLs (VL15 included: no SMA here)
    "malformed",    # a start beat too short to be an IBA packet, or beats with no start
    "end_bad",      # arrived marked end-bad by a cut-through hop upstream
    "link_down",    # arrived while the port's link_down input was set (docs/link.md)
    "overflow",     # no buffer room: the sender broke the credit protocol
)
# A routed receiver (a switch input) also drops packets whose DLID the forwarding table misses.
ROUTED_DROP_REASONS = DROP_REASONS + ("unknown_dlid",)


class DropEventSignature(wiring.Signature):
    """Data packets dropped (or marked end-bad) in one cycle: ``reasons`` has bit k set for
    each drop of reason ``reasons[k]`` (:data:`DROP_REASONS`, or :data:`ROUTED_DROP_REASONS`
    for a routed receiver) (a truncated packet and the
    stray beat that cut it short are two drops in one cycle), and ``vl`` is the VL the
    packet's LRH named (0 when that is not a data VL)."""
    def __init__(self, num_vls, reasons=ROUTED_DROP_REASONS):
        super().__init__({
            "reasons": Out(len(reasons)),
            "vl": Out(vl_index(num_vls)),
        })

class LinkReceiver(wiring.Component):
    """Receiving half of a credit-based IBA link port.

    Checks every data packet (VCRC, length against LRH.PktLen, VL, MTU),
    strips the VCRC and stores it in its VL's :class:`PacketBuffer`
    (``buffer_blocks`` 64-byte blocks), from which ``data_out[vl]`` streams it:
    after the packet is complete and good, or with ``cut_through`` as soon as
    it starts, marked end-bad if it then fails. Bad packets are dropped and
    counted by reason; their blocks return to the credit pool like any other.

    Credits, per IBA: ABR counts the blocks received and is set to the peer's
    FCTBS by each flow-control packet (which heals lost packets of either
    kind); the advertised limit is FCCL = ABR + free blocks. A packet the
    sender sent within that limit always finds room, so ``overflow`` (sticky)
    never rises while the peer follows the protocol; if it does, the excess is
    dropped, never written over stored data.

    With ``store="external"`` the receiver has no buffers of its own: it writes
    packets and verdicts into a store outside it through ``store``
    (:class:`StoreSignature`, e.g. a switch's shared VOQ buffer), which reports the
    room and the freed credits back. With ``routed`` it asks a forwarding table about
    every start beat through ``route`` (:class:`RouteSignature`) and drops packets the
    table does not know (``unknown_dlid``) or whose SL maps to no VL (``invalid_vl``).
    Every drop is also reported on ``drop_event`` with the packet's VL, for per-VL
    counters.

    A data packet that gets no beat for ``stall_timeout`` cycles (None: never), or is in
    progress when ``close`` rises, is closed as truncated (docs/link.md, Link failure and
    recovery).

    Flow-control packets with a bad LPCRC, a VL we do not have or a length
    other than 6 are dropped and counted. Good ones are reported on
    ``flow_control`` when the link state accepts them: NORMAL ones are stale
    in INIT (they describe the peer's view from before our reset).
    """

    def __init__(self, *, width=64, num_vls=2, mtu=4096, buffer_blocks=None, cut_through=True,
                 store="internal", routed=False, stall_timeout=None):
        check_width(width)
        if stall_timeout is not None and (not isinstance(stall_timeout, int) or stall_timeout < 1):
            raise ValueError(f"Stall timeout must be a positive number of cycles or None, "
                             f"not {stall_timeout!r}")
        self.stall_timeout = stall_timeout
        if store not in ("internal", "external"):
            raise ValueError(f"Store must be 'internal' or 'external', not {store!r}")
        check_mtu(mtu)
        if not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        min_blocks = blocks_of(max_wire_bytes(mtu))
        if buffer_blocks is None:
            buffer_blocks = 2 * min_blocks
        if not min_blocks <= buffer_blocks <= 2047:
            raise ValueError(f"Receive buffer must hold {min_blocks} to 2047 blocks per VL "
                             f"(one largest packet for MTU {mtu}), not {buffer_blocks!r}")
        self.width = width
        self.num_vls = num_vls
        self.mtu = mtu
        self.buffer_blocks = buffer_blocks
        self.cut_through = bool(cut_through)
        # Worst case one packet per beat: a short packet holds a whole beat of a wide
        # datapath; on a narrow one a block is several beats. One more beat closes a
        # packet cut short by an overflow.
        self.buffer_beats = buffer_blocks * max(1, BLOCK_BYTES // width) + 1
        self.store_kind = store
        self.routed = bool(routed)
        self.drop_reasons = ROUTED_DROP_REASONS if routed else DROP_REASONS
        members = {"wire": In(WireSignature(width))}
        if store == "internal":
            members["data_out"] = Out(stream.Signature(BeatLayout(width))).array(num_vls)
        else:
            members["store"] = Out(StoreSignature(width, num_vls, range(self.buffer_beats + 1)))
        if routed:
            members["route"] = Out(RouteSignature())
        super().__init__({
            **members,
            "drop_event": Out(DropEventSignature(num_vls, self.drop_reasons)),
            "state": In(LinkState),
            # Data packets arriving now are dropped as link_down (LinkPort: INIT since reset).
            "link_down": In(1),
            "clear": In(1),
            # The link went down (LinkPort's clear): the data packet in progress will not be
            # finished; it is closed as truncated in the first cycle without a beat.
            "close": In(1),
            # A data packet has started on the wire and not ended (as the check register saw).
            "in_packet": Out(1),
            "flow_control": Out(FlowControlSignature()),
            "fccl": Out(FCCL_BITS, init=buffer_blocks).array(num_vls),
            "abr": Out(FCCL_BITS).array(num_vls),
            "used_blocks": Out(range(buffer_blocks + 1)).array(num_vls),
            "overflow": Out(1),
            "packets_received": Out(32).array(num_vls),
            "received": Out(1),
            "drops": Out(wiring.Signature({reason: Out(32) for reason in self.drop_reasons})),
            "discarded": Out(32),
            "forwarded_bad": Out(32),
            "fc_received": Out(32),
            "fc_bad_crc": Out(32),
            "fc_malformed": Out(32),
            "fc_ignored": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        width, num_vls = self.width, self.num_vls
        self.formal_invariants = []

        # Register the wire: the cable/PHY boundary. The VCRC check takes the beat from
        # there into its own register stage, and BeatFacts does the beat's length and
        # credit arithmetic beside it; the beat follows through a second register (w),
        # where the checks below see it together with the VCRC verdict and those facts.
        r_valid = Signal()
        r = Signal(BeatLayout(width))
        r_link = Signal()
        r_keep = Signal(width)      # the beat's bytes, a bit per lane
        wire_bytes = Mux(self.wire.end, self.wire.count, width)
        m.d.sync += [
            r_valid.eq(self.wire.valid),
            r.data.eq(self.wire.data), r.start.eq(self.wire.start), r.end.eq(self.wire.end),
            r.count.eq(self.wire.count), r.end_bad.eq(self.wire.end_bad),
            r_link.eq(self.wire.link),
            r_keep.eq(Cat(lane < wire_bytes for lane in range(width))),
        ]
        m.submodules.vcrc = vcrc = CRCCheckStage(VCRC, width)
        m.d.comb += [
            vcrc.start.eq(r.start),
            vcrc.valid.eq(r_valid),
            vcrc.data.eq(r.data),
            vcrc.keep.eq(r_keep),
            vcrc.count.eq(Mux(r.end, r.count, width)),
        ]
        m.submodules.beat_facts = beat_facts = BeatFacts(width=width, num_vls=num_vls, mtu=self.mtu)
        m.d.comb += [
            beat_facts.valid.eq(self.wire.valid), beat_facts.link.eq(self.wire.link),
            beat_facts.start.eq(self.wire.start), beat_facts.end.eq(self.wire.end),
            beat_facts.count.eq(self.wire.count), beat_facts.lrh.eq(self.wire.data[:64]),
        ]
        f = beat_facts.facts
        w_valid = Signal()
        w = Signal(BeatLayout(width))
        w_link = Signal()
        m.d.sync += [w_valid.eq(r_valid), w.eq(r), w_link.eq(r_link)]

        write_vl = Signal(vl_index(num_vls))
        write = Signal(StoredBeatLayout(width))
        write_en = Signal()
        verdict_bad = Signal()
        verdict_en = Signal()
        verdict_blocks = Signal(FCCL_BITS)
        # Per VL: room for beats, and a packet's credit blocks coming free.
        rooms, freed_valid, freed_blocks = [], [], []
        discarded, forwarded_bad = Signal(), Signal()
        if self.store_kind == "internal":
            for v in range(num_vls):
                buffer = PacketBuffer(width=width, depth=self.buffer_beats, cut_through=self.cut_through)
                m.submodules[f"buffer{v}"] = buffer
                wiring.connect(m, buffer.data_out, wiring.flipped(self.data_out[v]))
                selected = write_vl == v
                m.d.comb += [
                    buffer.write.payload.eq(write),
                    buffer.write.valid.eq(write_en & selected),
                    buffer.verdict.payload.bad.eq(verdict_bad),
                    buffer.verdict.payload.blocks.eq(verdict_blocks),
                    buffer.verdict.valid.eq(verdict_en & selected),
                ]
                rooms.append(buffer.room)
                # Used blocks are the blocks of the packets in the buffer: none when it holds
                # no beat (a formal proof asserts it, docs/formal.md).
                self.formal_invariants.append((buffer.room != self.buffer_beats) |
                                              (self.used_blocks[v] == 0))
                freed_valid.append(buffer.freed.valid)
                freed_blocks.append(buffer.freed.payload)
            m.d.comb += [
                discarded.eq(Cat(m.submodules[f"buffer{v}"].discarded for v in range(num_vls)).any()),
                forwarded_bad.eq(Cat(m.submodules[f"buffer{v}"].forwarded_bad
                                     for v in range(num_vls)).any()),
            ]
        else:
            store = self.store
            m.d.comb += [
                store.write_valid.eq(write_en), store.write_vl.eq(write_vl), store.write.eq(write),
                store.verdict_valid.eq(verdict_en), store.verdict_vl.eq(write_vl),
                store.verdict_bad.eq(verdict_bad), store.verdict_blocks.eq(verdict_blocks),
                discarded.eq(store.discarded), forwarded_bad.eq(store.forwarded_bad),
            ]
            rooms = list(store.room)
            freed_valid = list(store.freed_valid)
            freed_blocks = list(store.freed_blocks)

        # Counters count registered events, a cycle after them: a 32-bit increment is
        # deep enough on its own.
        def count_events(counter, events):
            m.d.sync += counter.eq(counter + events)

        discarded_event, forwarded_bad_event = Signal(), Signal()
        m.d.sync += [discarded_event.eq(discarded), forwarded_bad_event.eq(forwarded_bad)]
        count_events(self.discarded, discarded_event)
        count_events(self.forwarded_bad, forwarded_bad_event)

        # --- data packet state ---
        in_packet = self.in_packet  # a data packet's start has passed on the wire, its end not
        storing = Signal()          # ... and its beats go into a buffer
        end_stored = Signal()       # the buffer already holds this packet's end beat
        stored_any = Signal()
        packet_bad = Signal()       # overflow seen in this packet
        current_vl = Signal(vl_index(num_vls))
        terminate = Signal()        # the packet being stored ended without its end beat
        closing = Signal()          # ... or will: the link went down, or the packet stalled
        close_now = Signal()        # ... now, in a cycle without a beat
        stalled = Signal()          # no beat of the packet for stall_timeout cycles
        if self.stall_timeout is not None:
            stall_cycles = Signal(range(self.stall_timeout + 1))
            with m.If(w_valid | ~in_packet):
                m.d.sync += stall_cycles.eq(0)
            with m.Elif(~stalled):
                m.d.sync += stall_cycles.eq(stall_cycles + 1)
            m.d.comb += stalled.eq(stall_cycles == self.stall_timeout)
        with m.If(self.close | stalled):
            m.d.sync += closing.eq(1)
        with m.Elif(~in_packet | w_valid & w.start):
            m.d.sync += closing.eq(0)
        # What a formal proof ties to the buffers' contents and the peer's counts
        # (docs/formal.md): the packet being stored, whether any of its beats and its end
        # beat are in, and the beats in the input (r) and check (w) registers.
        self.formal_state = {"storing": storing, "stored_any": stored_any,
                             "end_stored": end_stored, "current_vl": current_vl,
                             "r_valid": r_valid, "r": r, "r_link": r_link,
                             "w_valid": w_valid, "w": w, "w_link": w_link}
        m.d.comb += [
            close_now.eq(closing & in_packet & ~w_valid),
            terminate.eq(w_valid & storing & (w.start | w_link) | close_now & storing),
        ]

        # --- credits: ABR, used blocks, FCCL ---
        # Every sum is taken from registers (the blocks of both verdicts a beat can give, a
        # packet's end or its cut-short close, are facts registered with the beat), beside
        # the decisions, which only pick one.
        fc_update = Signal()
        fc_vl = Signal(4)
        fc_fctbs = Signal(FCCL_BITS)
        for v in range(num_vls):
            used, abr = self.used_blocks[v], self.abr[v]
            gained = verdict_en & (write_vl == v)
            lost = freed_valid[v]
            def sums(base):
                return Mux(terminate, base + f.close_blocks, base + f.blocks)
            with m.If(gained & lost):
                m.d.sync += used.eq(sums(used - freed_blocks[v]))
            with m.Elif(gained):
                m.d.sync += used.eq(sums(used))
            with m.Elif(lost):
                m.d.sync += used.eq(used - freed_blocks[v])
            with m.If(self.clear):
                m.d.sync += abr.eq(0)
            with m.Elif(fc_update & (fc_vl == v)):
                m.d.sync += abr.eq(fc_fctbs)
            with m.Elif(gained):
                m.d.sync += abr.eq(sums(abr))
            # Registered: FCCL follows ABR and used blocks one cycle late.
            m.d.sync += self.fccl[v].eq(abr + self.buffer_blocks - used)

        drop_vl = Signal(vl_index(num_vls))
        drop_reasons = Signal(len(self.drop_reasons))
        m.d.sync += [self.drop_event.reasons.eq(drop_reasons), self.drop_event.vl.eq(drop_vl)]
        for k, reason in enumerate(self.drop_reasons):
            count_events(getattr(self.drops, reason), self.drop_event.reasons[k])
        def count_drop(reason):
            m.d.comb += drop_reasons[self.drop_reasons.index(reason)].eq(1)
        good = Signal(num_vls)      # a good packet ended, by VL
        good_event = Signal(num_vls)
        m.d.sync += good_event.eq(good)
        m.d.comb += self.received.eq(good_event.any())
        for v in range(num_vls):
            count_events(self.packets_received[v], good_event[v])

        # Start-beat checks.
        start_vl = w.data[4:8]
        reject = Signal()
        reject_reason = {
            "link_down": self.link_down,
            "malformed": f.malformed,
            "invalid_vl": f.invalid_vl,
            "too_long": f.too_long,
        }
        if self.routed:
            # The forwarding-table lookup of this start beat went out a cycle ago.
            m.d.comb += [
                self.route.lid.eq(Cat(r.data[24:32], r.data[16:24])),
                self.route.sl.eq(r.data[12:16]),
                self.route.pktlen.eq(lrh_pktlen(r.data)),
            ]
            reject_reason["invalid_vl"] = reject_reason["invalid_vl"] | self.route.no_vl
            reject_reason["unknown_dlid"] = self.route.unknown
        m.d.comb += reject.eq(Cat(reject_reason.values()).any())

        vl_now = Mux(w.start, start_vl[0:len(current_vl)] if num_vls > 1 else 0, current_vl)
        # Whatever this packet left in the registers before this beat (nothing, on its start).
        stored_before = ~w.start & stored_any
        end_before = ~w.start & end_stored
        overflow_before = ~w.start & packet_bad
        fits = Array(room > 1 for room in rooms)[vl_now]   # the last slot is kept for a closing beat

        m.d.comb += drop_vl.eq(Mux(terminate, current_vl, Mux(w.start & f.invalid_vl, 0, vl_now)))

        # A data beat leaves a packet in progress unless it is an end beat; a flow-control
        # beat ends any. Only the start beat decides to store a packet.
        with m.If(w_valid):
            m.d.sync += [in_packet.eq(~w_link & ~w.end), storing.eq(0)]
        with m.If(close_now):
            # The tail, should it come after all, has no start: dropped as malformed.
            m.d.sync += [in_packet.eq(0), storing.eq(0)]

        # The beat's bytes, whatever is decided (they count only with write_valid): what a store
        # derives from a start beat's header (a switch's descriptor) then starts at a register.
        m.d.comb += write.data.eq(w.data)
        with m.If(terminate):
            # Truncated: the next packet (or flow-control packet) began first. Close the
            # stored part with an empty end beat; the beat that interrupted is dropped
            # if it is a data beat (the write port is busy closing), and so is the rest of
            # its packet.
            m.d.comb += [
                write_vl.eq(current_vl),
                write.start.eq(0), write.end.eq(1), write.count.eq(0),
                write_en.eq(stored_any & ~end_stored),
                verdict_en.eq(stored_any), verdict_bad.eq(1),
                verdict_blocks.eq(f.close_blocks),
            ]
            count_drop("truncated")
            with m.If(w_valid & ~w_link):
                count_drop("malformed")
        with m.Elif(w_valid & ~w_link):
            with m.If(w.start):
                # Count the first reason that applies.
                first = None
                for reason, condition in reject_reason.items():
                    with (m.If(condition) if first is None else m.Elif(condition)):
                        count_drop(reason)
                    first = reason
                m.d.sync += [
                    storing.eq(~reject & ~w.end),
                    current_vl.eq(vl_now),
                    stored_any.eq(0),
                    end_stored.eq(0),
                    packet_bad.eq(0),
                ]
            with m.Elif(~in_packet):
                # Beats with no start: drop them as one malformed run.
                count_drop("malformed")
            with m.Elif(~w.end):
                m.d.sync += storing.eq(storing)

            with m.If(Mux(w.start, ~reject, storing)):
                m.d.comb += [
                    write_vl.eq(vl_now),
                    write.start.eq(w.start),
                    write.end.eq(f.data_end | w.end),
                    write.count.eq(f.count),
                ]
                with m.If(f.write & fits):
                    m.d.comb += write_en.eq(1)
                    m.d.sync += [stored_any.eq(1), end_stored.eq(f.data_end | w.end)]
                with m.Elif(f.write):
                    m.d.sync += [self.overflow.eq(1), packet_bad.eq(1)]
                with m.If(w.end):
                    overflowed = overflow_before | (f.write & ~fits)
                    has_stored = stored_before | (f.write & fits)
                    has_end = end_before | (f.write & fits)
                    bad = Signal()
                    m.d.comb += bad.eq(overflowed | w.end_bad | ~vcrc.match | ~f.exact)
                    m.d.comb += [
                        verdict_en.eq(has_stored),
                        verdict_bad.eq(bad),
                        verdict_blocks.eq(f.blocks),
                    ]
                    with m.If(has_stored & ~has_end):
                        # The end beat found no room: close with the kept slot.
                        m.d.comb += [write_en.eq(1), write.start.eq(0), write.end.eq(1),
                                     write.count.eq(0)]
                    with m.If(~bad):
                        m.d.comb += good.eq(Cat(vl_now == v for v in range(num_vls)))
                    with m.Elif(w.end_bad):
                        count_drop("end_bad")
                    with m.Elif(overflowed):
                        count_drop("overflow")
                    with m.Elif(f.short):
                        count_drop("truncated")
                    with m.Elif(~f.exact):
                        count_drop("overlong")
                    with m.Else():
                        count_drop("vcrc")

        # --- flow-control packets ---
        fc_op = w.data[4:8]
        fc_beat = w_valid & w_link
        fc_events = Signal(4)       # malformed, bad CRC, ignored, received
        fc_ok = fc_beat & f.fc_framing & vcrc.match & f.fc_fields
        m.d.sync += fc_events.eq(Cat(
            fc_beat & (~f.fc_framing | (vcrc.match & ~f.fc_fields)),
            fc_beat & f.fc_framing & ~vcrc.match,
            fc_ok & ~fc_update,
            fc_update,
        ))
        for counter, event in zip((self.fc_malformed, self.fc_bad_crc, self.fc_ignored, self.fc_received),
                                  fc_events):
            count_events(counter, event)
        m.d.comb += [
            fc_update.eq(fc_ok & ((fc_op == FlowControlOp.INIT.value) | (self.state != LinkState.INIT))),
            fc_vl.eq(w.data[20:24]),
            fc_fctbs.eq(Cat(w.data[8:16], w.data[0:4])),
        ]
        m.d.sync += self.flow_control.valid.eq(fc_update)
        with m.If(fc_update):
            m.d.sync += [
                self.flow_control.op.eq(fc_op),
                self.flow_control.vl.eq(fc_vl),
                self.flow_control.fctbs.eq(fc_fctbs),
                self.flow_control.fccl.eq(Cat(w.data[24:32], w.data[16:20])),
            ]
        return m
