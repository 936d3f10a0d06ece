from amaranth import *
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.arith import lookahead_sum, sum3
from hdl.crc.algorithms import ICRC
from hdl.crc.crc_check_stage import CRCCheckStage
from hdl.crc.icrc_engine import variant_masks
from hdl.ib.headers import (ATOMIC_ETH, BTH, ICRC_BYTES, IMMDT, LNH_IBA_LOCAL, LRH,
                            MASKED_ATOMIC_ETH, RETH, from_wire)
from hdl.link.signatures import BeatLayout, vl_index
from hdl.nic.signatures import (MAX_NIC_HEADER_BYTES, MAX_PACKET_BEATS, RX_BUFFER_BEAT_BITS,
                                ContextReadSignature, RequestDescriptorLayout)
from hdl.prim.skid_register import tagged_input

__all__ = ["RequestReceiver", "DESCRIPTOR_DEPTH"]

WIDTH = 64                  # bytes per beat
DESCRIPTOR_DEPTH = 16       # kept requests whose descriptor the engine has not taken yet
MAX_PAYLOAD_BYTES = 4096

# BTH opcodes (IBA table 38, RC).
SEND_FIRST, SEND_MIDDLE, SEND_LAST, SEND_LAST_IMM, SEND_ONLY, SEND_ONLY_IMM = range(0x00, 0x06)
(WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST, WRITE_LAST_IMM, WRITE_ONLY,
 WRITE_ONLY_IMM) = range(0x06, 0x0C)
READ_REQUEST = 0x0C
FIRST_RESPONSE, LAST_RESPONSE = 0x0D, 0x12   # READ responses, ACKNOWLEDGE, ATOMIC ACKNOWLEDGE
COMPARE_SWAP, FETCH_ADD = 0x13, 0x14
# This project's masked atomics (docs/nic-formats.md): 8-byte CS, FA, 4-byte CS, FA.
MASKED_ATOMICS = (0xD3, 0xD4, 0xF3, 0xF4)

LRH_BTH_BYTES = LRH.size_bytes + BTH.size_bytes


class RequestReceiver(wiring.Component):
    """Receive side of the responder (docs/nic-responder.md, "Receive").

    Per VL, a packet whose start beat carries a response opcode (0x0D..0x12) goes on to
    ``responses[vl]`` unchanged, beat for beat with that stream's ready; the route is held
    to its end beat. Every other packet is a request, stored whole (LRH .. ICRC) in a
    ring of ``buffer_beats`` 64-byte beats: one VL's request at a time, VLs taken round
    robin at packet boundaries, one beat per cycle with no gap between packets. A beat is
    taken only while the ring has room and a start beat only while the descriptor queue
    (``DESCRIPTOR_DEPTH``) can take one more, so nothing is dropped for space. Beats past
    ``MAX_PACKET_BEATS`` are taken but not stored. The link's framing is trusted: a
    non-start beat on a VL outside any packet is discarded, and a VL's beats from a
    request's start to its end are that request's.

    Each VL's beats enter through an input register (:func:`tagged_input`): ``rx.ready``
    is a flip-flop, and the opcode's class is decoded as a beat enters, so that T steers
    from a register. T's room and descriptor room are flags registered a cycle ahead for
    the worst case of that cycle (docs/nic-responder.md, "Input registers").

    Three stages after it: T takes a beat (steering, arbitration, room); W, a cycle later, writes
    it into the ring and feeds it to the ICRC check (:class:`CRCCheckStage`, its lanes
    past the count masked by a thermometer registered in T). On the end beat W also
    reduces the header (every request header lies in the start beat, held from it; a
    masked atomic's fills it, its ICRC in the next beat) to registered facts: the descriptor, the opcode's shape, compares of the count and beat
    index against the header's overhead, DLID, LNH, TVer, PktLen. D, the cycle after the
    end beat, decides from those registers and the ICRC match: a kept packet's
    descriptor enters the queue (on ``request`` in the next cycle, two after the end beat
    was in W, as a buffered queue written in W would show it); a dropped one's beats are
    given back in that same cycle: the write pointer is chosen between the two outcomes,
    so the next packet's first beat, in W in that cycle, is written where the dropped one
    began. Ports behave as if the
    decision were taken in W; only the counters move: each counts D's decision, a cycle
    after W's would have been counted.

    ``release`` frees beats of kept packets, oldest first (the consumer never frees more
    than it was given); ``buffer_read`` reads the ring (data one cycle after addr).

    Parameters
    ----------
    num_vls : int
        Data VLs, 1..15.
    buffer_beats : int
        Ring size in beats: a power of two, at least ``2 * MAX_PACKET_BEATS`` (one packet
        can be stored while the one before it is consumed) and at most
        ``2 ** RX_BUFFER_BEAT_BITS``.
    """
    def __init__(self, *, num_vls=2, buffer_beats=256):
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"num_vls must be an integer from 1 to 15, not {num_vls!r}")
        if (not isinstance(buffer_beats, int) or buffer_beats < 2 * MAX_PACKET_BEATS
                or buffer_beats > 1 << RX_BUFFER_BEAT_BITS or buffer_beats & (buffer_beats - 1)):
            raise ValueError(f"buffer_beats must be a power of two from {2 * MAX_PACKET_BEATS} "
                             f"to {1 << RX_BUFFER_BEAT_BITS}, not {buffer_beats!r}")
        self._num_vls = num_vls
        self._buffer_beats = buffer_beats
        beat = BeatLayout(WIDTH)
        super().__init__({
            "rx": In(stream.Signature(beat)).array(num_vls),
            "responses": Out(stream.Signature(beat)).array(num_vls),
            "lid": In(16),
            "request": Out(stream.Signature(RequestDescriptorLayout())),
            "buffer_read": In(ContextReadSignature(buffer_beats, unsigned(8 * WIDTH))),
            "release": In(stream.Signature(range(MAX_PACKET_BEATS + 1), always_ready=True)),
            "requests_received": Out(32),
            "rx_request_icrc_drops": Out(32),
            "rx_request_malformed": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        num_vls = self._num_vls
        depth = self._buffer_beats
        addr_bits = exact_log2(depth)
        header_bits = 8 * MAX_NIC_HEADER_BYTES

        m.submodules.buffer = buffer = Memory(shape=unsigned(8 * WIDTH), depth=depth, init=[])
        write = buffer.write_port()
        read = buffer.read_port(domain="sync")
        m.d.comb += [
            read.addr.eq(self.buffer_read.addr),
            self.buffer_read.data.eq(read.data),
        ]

        # Written in D, a cycle after W: first-word-fall-through shows an entry in the
        # cycle after its write, when a buffered queue written in W would.
        m.submodules.descriptors = descriptors = fifo.SyncFIFO(
            width=RequestDescriptorLayout().size, depth=DESCRIPTOR_DEPTH)
        m.d.comb += [
            self.request.valid.eq(descriptors.r_rdy),
            self.request.payload.eq(descriptors.r_data),
            descriptors.r_en.eq(self.request.ready),
        ]

        # --- Stage T (take): steering, arbitration, flow control ---
        busy = Signal()                      # a request packet's beats are being taken
        current = Signal(vl_index(num_vls))
        last_grant = Signal(vl_index(num_vls))
        beats_before = Signal(range(MAX_PACKET_BEATS + 1))  # saturates: too long beyond

        # --- Stage W (write): the beat taken in the cycle before is stored and checked;
        # on its end beat the packet is kept or dropped in this same cycle, so the next
        # packet's first beat, one cycle behind, is written where a dropped one began.
        w_valid = Signal()
        w_beat = Signal(BeatLayout(WIDTH))
        w_first = Signal()
        w_index = Signal(range(MAX_PACKET_BEATS + 1))
        w_stores = Signal()
        held_header = Signal(header_bits)

        # Ring pointers carry one bit above the address so that full and empty differ.
        write_ptr = Signal(addr_bits + 1)     # where stage W writes
        tail = Signal(addr_bits + 1)          # oldest beat not yet released
        packet_start = Signal(addr_bits + 1)  # first beat of the packet in stage W
        with m.If(self.release.valid):
            m.d.sync += tail.eq(tail + self.release.payload)
        # Stage D (decide) sits a cycle behind W. Its drop gives the dropped packet's
        # beats back at once: W writes at ``d_start`` instead.
        d_drop = Signal()
        d_keep = Signal()
        d_decide = Signal()
        d_start = Signal(addr_bits + 1)
        writing = Signal()
        m.d.comb += writing.eq(w_valid & w_stores)
        write_at = Signal(addr_bits + 1)
        m.d.comb += write_at.eq(Mux(d_drop, d_start, write_ptr))
        # T's room is a flag worked out a cycle ahead from registers, for the worst case
        # of that cycle: the ring's beats in use after W's write (``write_ptr - tail +
        # writing``, a drop or a release only lowers it) plus a beat taken now, which W
        # writes next cycle; room if that leaves a beat free.
        room = Signal(init=1)
        in_use_plus_one = sum3(m, write_ptr, ~tail, Cat(writing, C(1, 1)), addr_bits + 1,
                               name="in_use_plus_one")
        m.d.sync += room.eq(~in_use_plus_one[addr_bits])

        # --- Steering per VL, from input registers that decode the opcode as a beat enters ---
        def is_response(beat):
            opcode = beat.data[8 * LRH.size_bytes:8 * LRH.size_bytes + 8]
            return (opcode >= FIRST_RESPONSE) & (opcode <= LAST_RESPONSE)
        inputs = [tagged_input(m, f"input{v}", self.rx[v], response=is_response)
                  for v in range(num_vls)]
        request_pending = Signal(num_vls)
        grant = Signal(vl_index(num_vls))
        granted = Signal()
        select = Signal(vl_index(num_vls))
        accept = Signal()
        m.d.comb += select.eq(Mux(busy, current, grant))
        for v in range(num_vls):
            rx, out = inputs[v], self.responses[v]
            start = rx.payload.beat.start
            in_response = Signal(name=f"in_response{v}")
            ours = busy & (current == v)
            route_response = in_response | (start & rx.payload.response & ~ours)
            starts_request = start & ~in_response & ~ours & ~rx.payload.response
            m.d.comb += [
                request_pending[v].eq(rx.valid & starts_request),
                out.valid.eq(rx.valid & route_response),
                out.payload.eq(rx.payload.beat),
            ]
            with m.If(route_response):
                m.d.comb += rx.ready.eq(out.ready)
            with m.Elif(ours | starts_request):
                m.d.comb += rx.ready.eq(accept & (select == v))
            with m.Else():
                m.d.comb += rx.ready.eq(1)
            with m.If(rx.valid & rx.ready & route_response):
                m.d.sync += in_response.eq(~rx.payload.beat.end)

        # Round robin: the first VL after the last one granted that offers a request.
        with m.Switch(last_grant):
            for last in range(num_vls):
                with m.Case(last):
                    for v in reversed([(last + 1 + k) % num_vls for k in range(num_vls)]):
                        with m.If(request_pending[v]):
                            m.d.comb += [grant.eq(v), granted.eq(1)]

        beat = BeatLayout(WIDTH)(Array(Value.cast(inputs[v].payload.beat)
                                       for v in range(num_vls))[select])
        valid = Array(inputs[v].valid for v in range(num_vls))[select]
        index = Mux(busy, beats_before, 0)
        stores = index < MAX_PACKET_BEATS
        # A start beat reserves its descriptor: the queue's entries, the one D may be
        # adding (not in the level yet) and the one W's end beat may add. A flag worked
        # out a cycle ahead for the worst case: the queue's entries now, D's and W's
        # packets kept and an end beat taken now (reads only lower it).
        ending = w_valid & w_beat.end
        descriptor_room = Signal(init=1)
        m.d.sync += descriptor_room.eq(
            descriptors.level + d_decide + ending < DESCRIPTOR_DEPTH - 1)
        m.d.comb += accept.eq(Mux(busy, ~stores | room, granted & room & descriptor_room))
        take = valid & accept

        # The ICRC check's byte lanes (every lane of a beat, an end beat's first count),
        # worked out per VL before the select so that W masks with a register.
        lanes = Array(Signal(WIDTH, name=f"lanes{v}") for v in range(num_vls))
        for v in range(num_vls):
            payload = inputs[v].payload.beat
            m.d.comb += lanes[v].eq(Cat(~payload.end | (payload.count > lane) for lane in range(WIDTH)))
        w_lanes = Signal(WIDTH)
        with m.If(take):
            m.d.sync += [
                w_lanes.eq(lanes[select]),
                busy.eq(~beat.end),
                beats_before.eq(Mux(index == MAX_PACKET_BEATS, MAX_PACKET_BEATS, index + 1)),
                w_beat.eq(beat),
                w_first.eq(~busy),
                w_index.eq(index),
                w_stores.eq(stores),
            ]
            with m.If(~busy):
                m.d.sync += [current.eq(select), last_grant.eq(select)]
        m.d.sync += w_valid.eq(take)

        # --- Stage W ---
        m.d.comb += [
            write.addr.eq(write_at[:addr_bits]),
            write.data.eq(w_beat.data),
            write.en.eq(writing),
        ]
        # The ICRC takes the bits a switch may change as ones; they lie in the start beat.
        masks = variant_masks()
        if max(mask.bit_length() for mask in masks.values()) > 8 * WIDTH:
            raise ValueError("the ICRC's variant fields must lie in the start beat")
        start_lnh = from_wire(LRH, w_beat.data[:LRH.size]).lnh
        variant = Signal(8 * WIDTH)
        with m.If(w_first):
            with m.Switch(start_lnh):
                for kind, mask in masks.items():
                    with m.Default() if kind is None else m.Case(kind):
                        m.d.comb += variant.eq(mask)
        m.submodules.icrc = icrc = CRCCheckStage(ICRC, WIDTH)
        m.d.comb += [
            icrc.valid.eq(w_valid),
            icrc.start.eq(w_first),
            icrc.data.eq(w_beat.data | variant),
            icrc.keep.eq(w_lanes),
            icrc.count.eq(Mux(w_beat.end, w_beat.count, WIDTH)),
        ]
        start = Mux(w_first, write_at, packet_start)
        header = Mux(w_first, w_beat.data[:header_bits], held_header)
        with m.If(w_valid & w_first):
            m.d.sync += [packet_start.eq(write_at), held_header.eq(w_beat.data[:header_bits])]
        decide = w_valid & w_beat.end
        after_kept = lookahead_sum(m, write_ptr, writing, name="after_kept")
        after_dropped = lookahead_sum(m, d_start, writing, name="after_dropped")
        m.d.sync += write_ptr.eq(Mux(d_drop, after_dropped, after_kept)[:addr_bits + 1])

        # --- Stage W: the header's checks and the descriptor, registered for D ---
        lrh = from_wire(LRH, header[:8 * LRH.size_bytes])
        bth = from_wire(BTH, header[8 * LRH.size_bytes:8 * LRH_BTH_BYTES])
        extension = header[8 * LRH_BTH_BYTES:]
        reth = from_wire(RETH, extension[:RETH.size])
        atomic = from_wire(ATOMIC_ETH, extension[:ATOMIC_ETH.size])
        masked = from_wire(MASKED_ATOMIC_ETH, extension[:MASKED_ATOMIC_ETH.size])
        immdt = from_wire(IMMDT, extension[:IMMDT.size])
        immdt_after_reth = from_wire(IMMDT, extension[RETH.size:RETH.size + IMMDT.size])

        descriptor = Signal(RequestDescriptorLayout())
        header_bytes = descriptor.header_bytes
        known = Signal()
        no_payload = Signal()
        m.d.comb += [
            descriptor.vl.eq(lrh.vl),
            descriptor.sl.eq(lrh.sl),
            descriptor.slid.eq(lrh.slid),
            descriptor.opcode.eq(bth.opcode),
            descriptor.se.eq(bth.se),
            descriptor.ackreq.eq(bth.ackreq),
            descriptor.pkey.eq(bth.pkey),
            descriptor.destqp.eq(bth.destqp),
            descriptor.psn.eq(bth.psn),
            descriptor.beats.eq(w_index + 1),
            descriptor.buffer_beat.eq(start[:addr_bits]),
            known.eq(1),
        ]
        with_reth = [descriptor.va.eq(reth.va), descriptor.rkey.eq(reth.rkey),
                     descriptor.dmalen.eq(reth.dmalen)]
        def atomic_fields(eth):
            # The fields a plain and a masked AtomicETH share, and no payload after them.
            return [descriptor.va.eq(eth.va), descriptor.rkey.eq(eth.rkey),
                    descriptor.swap_add.eq(eth.swap_add), descriptor.compare.eq(eth.compare),
                    no_payload.eq(1)]

        with m.Switch(bth.opcode):
            with m.Case(SEND_FIRST, SEND_MIDDLE, SEND_LAST, SEND_ONLY, WRITE_MIDDLE, WRITE_LAST):
                m.d.comb += header_bytes.eq(LRH_BTH_BYTES)
            with m.Case(SEND_LAST_IMM, SEND_ONLY_IMM, WRITE_LAST_IMM):
                m.d.comb += [header_bytes.eq(LRH_BTH_BYTES + IMMDT.size_bytes),
                             descriptor.imm.eq(immdt.imm)]
            with m.Case(WRITE_FIRST, WRITE_ONLY):
                m.d.comb += [header_bytes.eq(LRH_BTH_BYTES + RETH.size_bytes), *with_reth]
            with m.Case(WRITE_ONLY_IMM):
                m.d.comb += [header_bytes.eq(LRH_BTH_BYTES + RETH.size_bytes + IMMDT.size_bytes),
                             *with_reth, descriptor.imm.eq(immdt_after_reth.imm)]
            with m.Case(READ_REQUEST):
                m.d.comb += [header_bytes.eq(LRH_BTH_BYTES + RETH.size_bytes), *with_reth,
                             no_payload.eq(1)]
            with m.Case(COMPARE_SWAP, FETCH_ADD):
                m.d.comb += [header_bytes.eq(LRH_BTH_BYTES + ATOMIC_ETH.size_bytes),
                             *atomic_fields(atomic)]
            with m.Case(*MASKED_ATOMICS):
                m.d.comb += [header_bytes.eq(LRH_BTH_BYTES + MASKED_ATOMIC_ETH.size_bytes),
                             *atomic_fields(masked),
                             descriptor.swap_mask.eq(masked.swap_mask),
                             descriptor.compare_mask.eq(masked.compare_mask)]
            with m.Default():
                m.d.comb += known.eq(0)

        # The bytes beyond the payload: overhead = header_bytes + ICRC + pad, below one
        # beat (at most 55) for every opcode that may carry payload; 68 for a masked
        # atomic, which has none. The packet's length is index * WIDTH + count, so against
        # the overhead: length >= overhead is index > 0 or count >= overhead; a payload of
        # at most 4096 bytes (64 beats) is index < 64, or index == 64 and count <= overhead;
        # no payload is length == overhead: index == overhead // WIDTH, count the rest.
        overhead = Signal(range(2 * WIDTH))
        m.d.comb += overhead.eq(header_bytes + ICRC_BYTES + bth.padcnt)
        count = w_beat.count
        # The bytes stored; D replaces them by the payload (less the overhead).
        m.d.comb += descriptor.payload_bytes.eq(w_index * WIDTH + count)
        pktlen_bytes = lrh.pktlen * 4
        # PktLen * 4 == index * WIDTH + count, split at the beat: count == WIDTH carries.
        pktlen_beats = pktlen_bytes[exact_log2(WIDTH):]
        pktlen_ok = Mux(count == WIDTH,
                        (pktlen_bytes[:exact_log2(WIDTH)] == 0) & (pktlen_beats == w_index + 1),
                        (pktlen_bytes[:exact_log2(WIDTH)] == count[:exact_log2(WIDTH)])
                        & (pktlen_beats == w_index))
        d_descriptor = Signal(RequestDescriptorLayout())
        d_length = Signal(range(MAX_PACKET_BEATS * WIDTH + 1))
        d_overhead = Signal.like(overhead)
        d_known, d_no_payload, d_pad0 = Signal(), Signal(), Signal()
        d_first_beat, d_before_64, d_beat_64 = Signal(), Signal(), Signal()
        d_count_ge, d_count_le = Signal(), Signal()
        d_no_payload_length = Signal()      # length == overhead
        # Past MAX_PACKET_BEATS the length saturates: such a packet is malformed outright.
        d_link_ok = Signal()        # stored whole, LNH, DLID, TVer and PktLen right
        d_icrc_bad = Signal()       # end_bad
        m.d.sync += [
            d_decide.eq(decide),
            d_descriptor.eq(descriptor),
            d_start.eq(start),
            d_length.eq(w_index * WIDTH + count),
            d_overhead.eq(overhead),
            d_known.eq(known),
            d_no_payload.eq(no_payload),
            d_pad0.eq(bth.padcnt == 0),
            d_first_beat.eq(w_index == 0),
            d_before_64.eq(w_index < MAX_PAYLOAD_BYTES // WIDTH),
            d_beat_64.eq(w_index == MAX_PAYLOAD_BYTES // WIDTH),
            d_count_ge.eq(count >= overhead),
            d_count_le.eq(count <= overhead),
            d_no_payload_length.eq((w_index == overhead[exact_log2(WIDTH):])
                                   & (count == overhead[:exact_log2(WIDTH)])),
            d_link_ok.eq(w_stores & (lrh.lnh == LNH_IBA_LOCAL) & (lrh.dlid == self.lid)
                         & (bth.tver == 0) & pktlen_ok),
            d_icrc_bad.eq(w_beat.end_bad),
        ]

        # --- Stage D: the decision ---
        overhead_wide = Cat(d_overhead, C(0, len(d_length) - len(d_overhead)))
        payload = lookahead_sum(m, d_length, ~overhead_wide, 1, name="payload")   # length - overhead
        shape_ok = Mux(d_no_payload, d_no_payload_length & d_pad0,
                       (~d_first_beat | d_count_ge) & (d_before_64 | (d_beat_64 & d_count_le)))
        well_formed = Signal()
        icrc_good = Signal()
        m.d.comb += [
            well_formed.eq(d_known & shape_ok & d_link_ok),
            icrc_good.eq(icrc.match & ~d_icrc_bad),
            d_keep.eq(d_decide & icrc_good & well_formed),
            d_drop.eq(d_decide & ~d_keep),
        ]
        written = Signal(RequestDescriptorLayout())
        m.d.comb += [
            written.eq(d_descriptor),
            written.payload_bytes.eq(payload),
            descriptors.w_en.eq(d_keep),
            descriptors.w_data.eq(written),
        ]

        # Counters count D's decision: a cycle after W's would have been counted.
        for counter, event in ((self.requests_received, d_keep),
                               (self.rx_request_icrc_drops, d_decide & ~icrc_good),
                               (self.rx_request_malformed, d_decide & icrc_good & ~well_formed)):
            with m.If(event):
                m.d.sync += counter.eq(counter + 1)
        return m
