"""The completion unit's response decoder: per VL, the ICRC check and header decode of each
received response, and a queue of the well-formed ones for the engine (docs/nic.md,
"Response decoder")."""
from amaranth import C, Cat, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import count_registered_sum, lookahead_sum
from hdl.crc.algorithms import ICRC
from hdl.crc.crc_check_stage import CRCCheckStage
from hdl.crc.icrc_engine import variant_masks
from hdl.ib.headers import AETH, BTH, LNH_IBA_LOCAL, LRH, from_wire
from hdl.link.signatures import BeatLayout
from hdl.nic.signatures import PSN_BITS, QPN_BITS, RESPONSE_SEQ_BITS

__all__ = ["ResponseDecoder", "ResponseEventLayout", "RX_EVENT_DEPTH"]

WIDTH = 64                  # bytes per beat
RX_EVENT_DEPTH = 8          # decoded responses waiting per VL for the one-per-cycle engine

# BTH opcodes of the responses a requester takes (IBA table 38).
READ_FIRST = 0x0D
READ_MIDDLE = 0x0E
READ_LAST = 0x0F
READ_ONLY = 0x10
ACKNOWLEDGE = 0x11
ATOMIC_ACKNOWLEDGE = 0x12
STORED_OPCODES = (READ_FIRST, READ_MIDDLE, READ_LAST, READ_ONLY, ATOMIC_ACKNOWLEDGE)

# AETH syndrome, bits 7..5, and the NAK codes in bits 4..0.
AETH_ACK = 0b000
AETH_RNR_NAK = 0b001
AETH_NAK = 0b011
NAK_MAX_CODE = 4            # 0 PSN sequence error .. 4 invalid RD request; above: reserved

LRH_BTH_BYTES = 8 + 12
AETH_BYTES = 4
ATOMIC_ACK_ETH_BYTES = 8
ICRC_BYTES = 4


class ResponseEventLayout(data.StructLayout):
    """A well-formed response with a good ICRC, as a VL hands it to the engine."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS, "opcode": 8, "psn": PSN_BITS, "syndrome": 8,
                          "seq": RESPONSE_SEQ_BITS,     # the ResponseWriter's, if stored
                          "payload_bytes": range(8192)})


class ResponseDecoder(wiring.Component):
    """Per VL: W (the beat and its header registered) -> D (the decision, with the ICRC
    match) -> the VL's event queue; ports, checks and timing in docs/nic.md."""

    def __init__(self, *, num_qps=64, num_vls=2):
        if not isinstance(num_qps, int) or not 1 <= num_qps <= 1 << QPN_BITS:
            raise ValueError(f"QPs must be 1 to {1 << QPN_BITS}, not {num_qps!r}")
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        self.num_qps = num_qps
        self.num_vls = num_vls
        super().__init__({
            "rx": In(stream.Signature(BeatLayout(WIDTH))).array(num_vls),
            "rx_seq": In(RESPONSE_SEQ_BITS).array(num_vls),
            "events": Out(stream.Signature(ResponseEventLayout())).array(num_vls),
            "discard": Out(stream.Signature(RESPONSE_SEQ_BITS, always_ready=True)),
            "malformed": Out(num_vls),
            "rx_dropped_icrc": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        # Per VL, W registers the beat and its header, the ICRC check stage takes it
        # (docs/fpga.md: a CRC one stage behind its beats) while W works out the header's
        # facts; D decides with the check's match: events into per-VL queues.
        discards = []
        icrc_drops = []
        malformed_drops = []
        header_layout = data.StructLayout({
            "lnh": 2, "pktlen": 11, "opcode": 8, "padcnt": 2, "destqp": 24,
            "psn": PSN_BITS, "syndrome": 8})
        variant_masks_by_lnh = variant_masks()
        for v in range(self.num_vls):
            rx = self.rx[v]
            beat = rx.payload
            m.d.comb += rx.ready.eq(1)

            # Every header a response has fits in its start beat.
            lrh = from_wire(LRH, beat.data[:64])
            bth = from_wire(BTH, beat.data[64:160])
            aeth = from_wire(AETH, beat.data[160:192])
            start_header = Signal(header_layout, name=f"start_header{v}")
            held_header = Signal(header_layout, name=f"held_header{v}")
            m.d.comb += start_header.eq(Cat(lrh.lnh, lrh.pktlen, bth.opcode, bth.padcnt,
                                            bth.destqp, bth.psn, aeth.syndrome))

            # Beats before this one, saturating beyond the longest packet (8188 bytes).
            beats_before = Signal(range(129), name=f"beats_before{v}")
            in_packet = Signal(name=f"in_packet{v}")
            index = Mux(beat.start, 0, beats_before)
            in_a_packet = beat.start | in_packet
            with m.If(rx.valid & in_a_packet):
                m.d.sync += [
                    in_packet.eq(~beat.end),
                    beats_before.eq(Mux(index == 128, 128, index + 1)),
                ]
                with m.If(beat.start):
                    m.d.sync += held_header.eq(start_header)

            # W: the beat as it came, its byte lanes for the check, its packet's header.
            w_valid = Signal(name=f"w_valid{v}")
            w_beat = Signal(BeatLayout(WIDTH), name=f"w_beat{v}")
            w_lanes = Signal(WIDTH, name=f"w_lanes{v}")
            w_ends = Signal(name=f"w_ends{v}")
            w_index = Signal(range(129), name=f"w_index{v}")
            w_header = Signal(header_layout, name=f"w_header{v}")
            w_seq = Signal(RESPONSE_SEQ_BITS, name=f"w_seq{v}")
            m.d.sync += [
                w_valid.eq(rx.valid),
                w_beat.eq(beat),
                w_lanes.eq(Cat(~beat.end | (beat.count > lane) for lane in range(WIDTH))),
                w_ends.eq(rx.valid & beat.end & in_a_packet),
                w_index.eq(index),
                w_header.eq(Mux(beat.start, start_header, held_header)),
                w_seq.eq(self.rx_seq[v]),
            ]
            # The ICRC takes the bits a switch may change as ones; they lie in the start beat.
            variant = Signal(8 * WIDTH, name=f"icrc_variant{v}")
            with m.If(w_beat.start):
                with m.Switch(from_wire(LRH, w_beat.data[:64]).lnh):
                    for kind, mask in variant_masks_by_lnh.items():
                        with m.Default() if kind is None else m.Case(kind):
                            m.d.comb += variant.eq(mask)
            m.submodules[f"icrc{v}"] = icrc = CRCCheckStage(ICRC, WIDTH)
            m.d.comb += [
                icrc.valid.eq(w_valid),
                icrc.start.eq(w_beat.start),
                icrc.data.eq(w_beat.data | variant),
                icrc.keep.eq(w_lanes),
                icrc.count.eq(Mux(w_beat.end, w_beat.count, WIDTH)),
            ]

            # W: the header's checks. The length is index * WIDTH + count; against a
            # constant below one beat it is a test of the count on the first beat.
            header = w_header
            count = w_beat.count
            first_beat = w_index == 0
            kind = header.syndrome[5:8]
            code = header.syndrome[0:5]
            def length_is(n):
                return first_beat & (count == n)
            def length_at_least(n):
                return ~first_beat | (count >= n)
            shape_ok = Signal(name=f"shape_ok{v}")
            with m.Switch(header.opcode):
                with m.Case(ACKNOWLEDGE):
                    m.d.comb += shape_ok.eq(
                        length_is(LRH_BTH_BYTES + AETH_BYTES + ICRC_BYTES)
                        & ((kind == AETH_ACK) | (kind == AETH_RNR_NAK)
                           | ((kind == AETH_NAK) & (code <= NAK_MAX_CODE))))
                with m.Case(ATOMIC_ACKNOWLEDGE):
                    m.d.comb += shape_ok.eq(
                        length_is(LRH_BTH_BYTES + AETH_BYTES + ATOMIC_ACK_ETH_BYTES + ICRC_BYTES)
                        & (kind == AETH_ACK))
                with m.Case(READ_FIRST, READ_LAST, READ_ONLY):
                    m.d.comb += shape_ok.eq(
                        length_at_least(LRH_BTH_BYTES + AETH_BYTES + ICRC_BYTES)
                        & (kind == AETH_ACK))
                with m.Case(READ_MIDDLE):
                    m.d.comb += shape_ok.eq(length_at_least(LRH_BTH_BYTES + ICRC_BYTES))
            # PktLen * 4 == index * WIDTH + count, split at the beat: a full beat carries.
            pktlen_bytes = header.pktlen * 4
            pktlen_beats = pktlen_bytes[6:]
            pktlen_ok = Mux(count == WIDTH,
                            (pktlen_bytes[:6] == 0) & (pktlen_beats == w_index + 1),
                            (pktlen_bytes[:6] == count[:6]) & (pktlen_beats == w_index))
            # Payload: READ response data (MIDDLE has no AETH), the atomic's original value.
            overhead = Signal(range(WIDTH), name=f"overhead{v}")
            m.d.comb += overhead.eq(Mux(header.opcode == READ_MIDDLE, LRH_BTH_BYTES,
                                        LRH_BTH_BYTES + AETH_BYTES)
                                    + ICRC_BYTES + header.padcnt)

            d_ends = Signal(name=f"d_ends{v}")
            d_end_bad = Signal(name=f"d_end_bad{v}")
            d_well_formed = Signal(name=f"d_well_formed{v}")
            d_stored = Signal(name=f"d_stored{v}")
            d_header = Signal(header_layout, name=f"d_header{v}")
            d_seq = Signal(RESPONSE_SEQ_BITS, name=f"d_seq{v}")
            d_length = Signal(range(129 * WIDTH + 1), name=f"d_length{v}")
            d_overhead = Signal(range(WIDTH), name=f"d_overhead{v}")
            d_atomic = Signal(name=f"d_atomic{v}")
            d_has_payload = Signal(name=f"d_has_payload{v}")
            m.d.sync += [
                d_ends.eq(w_ends),
                d_end_bad.eq(w_beat.end_bad),
                d_well_formed.eq(shape_ok & (header.lnh == LNH_IBA_LOCAL) & pktlen_ok
                                 & (header.destqp < self.num_qps)),
                d_stored.eq(header.opcode.matches(*STORED_OPCODES)),
                d_header.eq(header),
                d_seq.eq(w_seq),
                d_length.eq(w_index * WIDTH + count),
                d_overhead.eq(overhead),
                d_atomic.eq(header.opcode == ATOMIC_ACKNOWLEDGE),
                d_has_payload.eq(length_at_least(overhead)),
            ]

            # D: the decision, with the ICRC check's match of the end beat.
            payload_bytes = Signal(range(8192), name=f"payload_bytes{v}")
            beyond = lookahead_sum(m, d_length, ~Cat(d_overhead, C(0, len(d_length) - len(d_overhead))),
                                   1, name=f"payload_sum{v}")[:len(payload_bytes)]
            with m.If(d_atomic):
                m.d.comb += payload_bytes.eq(ATOMIC_ACK_ETH_BYTES)
            with m.Elif(d_has_payload):
                m.d.comb += payload_bytes.eq(beyond)
            good = d_ends & icrc.match & ~d_end_bad

            m.submodules[f"events{v}"] = queue = fifo.SyncFIFOBuffered(
                width=ResponseEventLayout().size, depth=RX_EVENT_DEPTH)
            event = ResponseEventLayout()(queue.w_data)
            m.d.comb += [
                event.qpn.eq(d_header.destqp),
                event.opcode.eq(d_header.opcode),
                event.psn.eq(d_header.psn),
                event.syndrome.eq(d_header.syndrome),
                event.seq.eq(d_seq),
                event.payload_bytes.eq(payload_bytes),
                queue.w_en.eq(good & d_well_formed),
                self.events[v].valid.eq(queue.r_rdy),
                self.events[v].payload.eq(queue.r_data),
                queue.r_en.eq(self.events[v].ready),
            ]
            icrc_drops.append(d_ends & ~good)
            malformed_drops.append(good & ~(d_well_formed & queue.w_rdy))
            # The ResponseWriter stored this packet; without an event nothing else will
            # decide on it. It stores one packet at a time, so one VL ends one per cycle.
            discards.append((d_ends & d_stored & ~(good & d_well_formed & queue.w_rdy), d_seq))

        discard_valid = Signal()
        discard_seq = Signal(RESPONSE_SEQ_BITS)
        m.d.sync += discard_valid.eq(0)
        for valid, seq in discards:
            with m.If(valid):
                m.d.sync += [discard_valid.eq(1), discard_seq.eq(seq)]
        m.d.comb += [self.discard.valid.eq(discard_valid), self.discard.payload.eq(discard_seq)]

        # A malformed drop also counts in the engine's ``rx_dropped_unexpected``: registered
        # here as the counter registers its events.
        m.d.sync += self.malformed.eq(Cat(malformed_drops))
        count_registered_sum(m, self.rx_dropped_icrc, icrc_drops)
        return m
