from amaranth import *
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.crc.icrc_engine import IcrcEngine
from hdl.ib.headers import AETH, BTH, LNH_IBA_LOCAL, LRH, from_wire
from hdl.link.signatures import BeatLayout, vl_index
from hdl.nic.signatures import (
    MAX_OUTSTANDING_BLOCKS, PSN_BITS, QPN_BITS, AxiWriteSignature, CompletionRecordLayout,
    CompletionStatus, ContextReadSignature, CqConfigLayout, EventSignature, MlxOpcode, QpState,
    RetireLayout, Syndrome,
)

__all__ = ["CompletionUnit", "RX_EVENT_DEPTH"]

WIDTH = 64                  # bytes per beat and per AXI data beat: one CQE per beat
QUEUE_DEPTH = MAX_OUTSTANDING_BLOCKS    # a record holds at least one block of the window
RX_EVENT_DEPTH = 8          # decoded responses waiting per VL for the one-per-cycle processor
JOB_DEPTH = 4               # completed records waiting for their CQE write

# BTH opcodes of the responses a requester takes (IBA table 38).
READ_FIRST = 0x0D
READ_MIDDLE = 0x0E
READ_LAST = 0x0F
READ_ONLY = 0x10
ACKNOWLEDGE = 0x11
ATOMIC_ACKNOWLEDGE = 0x12

# AETH syndrome, bits 7..5, and the NAK codes in bits 4..0.
AETH_ACK = 0b000
AETH_RNR_NAK = 0b001
AETH_NAK = 0b011
NAK_MAX_CODE = 4            # 0 PSN sequence error .. 4 invalid RD request; above: reserved
NAK_FATAL = {               # NAK code: syndrome of the error CQE it gives
    1: Syndrome.REMOTE_INVAL_REQ_ERR,
    2: Syndrome.REMOTE_ACCESS_ERR,
    3: Syndrome.REMOTE_OP_ERR,
}

LRH_BTH_BYTES = 8 + 12
AETH_BYTES = 4
ATOMIC_ACK_ETH_BYTES = 8
ICRC_BYTES = 4

CQE_OPCODE_REQ = 0x0
CQE_OPCODE_REQ_ERR = 0xD


def _psn_le(a, b):
    """``a`` at or before ``b`` in PSN order (modulo 2^24, within half the PSN space)."""
    return ~(b - a)[PSN_BITS - 1]


def _psn_lt(a, b):
    return _psn_le(a, b) & (a != b)


def _lowest(m, bits, name):
    """Index of the lowest set bit of ``bits`` (0 when none is set)."""
    index = Signal(range(max(len(bits), 2)), name=name)
    for i in reversed(range(len(bits))):
        with m.If(bits[i]):
            m.d.comb += index.eq(i)
    return index


def _round_robin(m, requests, last, name):
    """The first requester after ``last``, wrapping around; and whether there is one."""
    n = len(requests)
    after = Signal(n, name=f"{name}_after")
    m.d.comb += after.eq(requests & Cat(Const(0, 1) if i == 0 else Const(i, range(n + 1)) > last
                                             for i in range(n)))
    lowest_after = _lowest(m, after, f"{name}_lowest_after")
    lowest_any = _lowest(m, requests, f"{name}_lowest_any")
    return requests.any(), Mux(after.any(), lowest_after, lowest_any)


class _RxEventLayout(data.StructLayout):
    """A well-formed response with a good ICRC, as a VL hands it to the processor."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS, "opcode": 8, "psn": PSN_BITS, "syndrome": 8})


class _JobLayout(data.StructLayout):
    """A completed record on its way to the CQE writer."""
    def __init__(self):
        super().__init__({
            "qpn": QPN_BITS, "cqn": 8, "wqe_index": 16, "wqe_blocks": range(17),
            "opcode": 8, "byte_count": 32, "error": 1, "syndrome": 8, "write_cqe": 1,
        })


class CompletionUnit(wiring.Component):
    """Receive path, per-QP outstanding-WQE table and CQE writer of the requester
    (docs/nic.md, "Completions").

    Receive: each VL's stream (LRH .. ICRC) is always ready and has its own ICRC checker
    and header decoder, so a response never backs up the link. A packet acts only at its
    end beat, with a good ICRC and ``end_bad`` low (else ``rx_dropped_icrc``). A
    well-formed one (LNH = IBA local, a response opcode, LRH.PktLen equal to the bytes
    received and long enough for the opcode's headers, an AETH syndrome of ACK type or,
    on an ACKNOWLEDGE, RNR NAK or NAK code 0..4, DestQP below ``num_qps``) goes into its
    VL's event queue (``RX_EVENT_DEPTH``); anything else is ``rx_dropped_unexpected``.
    The processor takes one event per cycle, round robin over VLs. The link delivers at
    most one beat per cycle on average, so the queues only absorb the VLs' short-term
    skew; an event finding its queue full is dropped and counted as unexpected.

    Processor, per event for QP q at PSN p. Dropped (``rx_dropped_unexpected``) when q is
    in RESET, has had no SENT record since its reset, has a fatal NAK pending or is
    flushing (after a fatal NAK or ``qp_flush``), or when p is not in ``(ack_psn, sent_psn]``: ``sent_psn`` is the
    last PSN of q's newest SENT record, ``ack_psn`` the newest acknowledged PSN (the first
    SENT record's ``first_psn - 1`` after reset). So stale, duplicate and future PSNs
    are dropped. Otherwise:

    - ACKNOWLEDGE, ACK: ``ack_psn = p``;
    - ACKNOWLEDGE, NAK code 1/2/3: ``ack_psn = p - 1``, fatal NAK pending at p;
    - ACKNOWLEDGE, RNR NAK or NAK code 0/4: counted only (retransmission is not done);
    - READ response FIRST/MIDDLE: counted only (the payload is not written);
    - READ response LAST/ONLY: ``ack_psn = read_psn = p``;
    - ATOMIC ACKNOWLEDGE: ``ack_psn = atomic_psn = p``.

    Records from ``completion`` are kept per QP in order in one memory (``QUEUE_DEPTH``
    per QP; a record for a full queue waits on ``ready``; one for a QP number beyond
    ``num_qps`` is taken and ignored). A QP with a new record or a changed state is
    marked; the engine takes marked QPs round robin and completes head records, one per
    cycle, while the head can complete: when flushing, with WR_FLUSH_ERR; ERROR with
    its syndrome; FLUSH (or an unknown status) with WR_FLUSH_ERR; SENT with a fatal NAK
    pending at p: OK if its ``last_psn < p``, else the NAK's error, ``qp_error``, and
    flushing from then on (until ``qp_reset``); SENT otherwise: RDMA_READ when
    ``last_psn <= read_psn``, atomics when ``last_psn <= atomic_psn`` or
    ``last_psn < ack_psn``, others when ``last_psn <= ack_psn``. An OK completion pulls
    ``read_psn`` and ``atomic_psn`` up to its ``last_psn`` so that they never fall
    more than the outstanding PSNs behind (the modulo-2^24 compares assume a QP's
    unacknowledged PSNs span less than 2^23).

    ``qp_flush`` (the host moved the QP from RTS to ERR; not in docs/nic.md's interface
    list yet) makes the QP flushing at once: every record it holds and gets completes
    with WR_FLUSH_ERR, and its responses are dropped, until ``qp_reset``. Without it, a
    QP in ERR keeps waiting for the acknowledgements of its SENT records (a QP errored by
    the executor or a NAK must: its earlier records may still be acknowledged).

    CQEs: a completed record with ``signaled`` or an error, and a CQ number below
    ``num_cqs``, gets one 64-byte CQE (AXI4 INCR burst of one beat, awid 0) at
    ``base + 64 * (pi mod 2^log_size)`` (entry 0 when collapsed, where ``log_size``
    counts as 0) with owner bit ``(pi >> log_size) & 1``, ``pi`` the CQ's producer
    index. Writes are pipelined (B is not awaited); ``bready`` is always high and a
    BRESP other than OKAY counts in ``cqe_write_errors``. ``retire`` goes out in the
    cycle the record's AW and W have both been accepted (at once without a CQE), in
    completion order, which is WQE order per QP. ``cqes_written``/``error_cqes`` count
    at the same time.

    Limits and assumptions: a SENT record reaches the unit before any response to it can
    (the executor emits it with the message's last packet descriptor, a round trip ahead
    of the response), else that response is dropped as a future PSN. AETH.MSN, P_Key,
    LIDs and SL of a response are not checked; responses with a GRH are dropped.
    Retransmission and its timers are not done: after a PSN-sequence-error or RNR NAK, or
    a READ whose responses were lost (a later ACK does not complete a READ), the QP's
    records wait until ``qp_flush``. ``qp_reset`` is for an idle QP (all its records
    retired). CQ producer indices have no reset (the interface has no CQ-reset strobe)
    and continue across a reprogramming of the CQ.
    """

    def __init__(self, *, num_qps=64, num_cqs=16, num_vls=2, addr_width=64):
        if not isinstance(num_qps, int) or not 1 <= num_qps <= 1 << QPN_BITS:
            raise ValueError(f"QPs must be 1 to {1 << QPN_BITS}, not {num_qps!r}")
        if not isinstance(num_cqs, int) or not 1 <= num_cqs <= 256:
            raise ValueError(f"CQs must be 1 to 256, not {num_cqs!r}")
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        if not isinstance(addr_width, int) or not 16 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 16 to 64 bits, not {addr_width!r}")
        self.num_qps = num_qps
        self.num_cqs = num_cqs
        self.num_vls = num_vls
        self.addr_width = addr_width
        super().__init__({
            "rx": In(stream.Signature(BeatLayout(WIDTH))).array(num_vls),
            "completion": In(stream.Signature(CompletionRecordLayout())),
            "qp_state": In(QpState).array(num_qps),
            "qp_reset": In(EventSignature()),
            "qp_flush": In(EventSignature()),
            "qp_error": Out(EventSignature()),
            "cq_config": Out(ContextReadSignature(num_cqs, CqConfigLayout())),
            "retire": Out(stream.Signature(RetireLayout(), always_ready=True)),
            "axi": Out(AxiWriteSignature(addr_width, WIDTH)),
            "acks_received": Out(32),
            "naks_received": Out(32),
            "read_responses": Out(32),
            "atomic_acks": Out(32),
            "cqes_written": Out(32),
            "error_cqes": Out(32),
            "rx_dropped_icrc": Out(32),
            "rx_dropped_unexpected": Out(32),
            "cqe_write_errors": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        num_qps, num_vls = self.num_qps, self.num_vls
        qp_bits = max(num_qps - 1, 1).bit_length()
        slot_bits = (QUEUE_DEPTH - 1).bit_length()

        # Per-QP state. ``head``/``tail`` count records modulo 2 * QUEUE_DEPTH (full vs empty).
        def per_qp(shape, name):
            return Array(Signal(shape, name=f"{name}{q}") for q in range(num_qps))
        head = per_qp(slot_bits + 1, "head")
        tail = per_qp(slot_bits + 1, "tail")
        marked = per_qp(1, "marked")            # the engine should look at this QP's head
        started = per_qp(1, "started")          # a SENT record came since reset
        sent_psn = per_qp(PSN_BITS, "sent_psn")
        ack_psn = per_qp(PSN_BITS, "ack_psn")
        read_psn = per_qp(PSN_BITS, "read_psn")
        atomic_psn = per_qp(PSN_BITS, "atomic_psn")
        nak_pending = per_qp(1, "nak_pending")
        nak_psn = per_qp(PSN_BITS, "nak_psn")
        nak_syndrome = per_qp(8, "nak_syndrome")
        flushing = per_qp(1, "flushing")
        qp_in_reset = Array(Signal(name=f"in_reset{q}") for q in range(num_qps))
        for q in range(num_qps):
            m.d.comb += qp_in_reset[q].eq(self.qp_state[q] == QpState.RESET)

        m.submodules.records = records = Memory(
            shape=CompletionRecordLayout(), depth=num_qps * QUEUE_DEPTH, init=[])
        rec_write = records.write_port()
        rec_read = records.read_port(transparent_for=(rec_write,))

        m.submodules.jobs = jobs = fifo.SyncFIFOBuffered(width=_JobLayout().size, depth=JOB_DEPTH)

        # --- Receive: per VL, ICRC check and header decode; events into per-VL queues ---
        event_queues = []
        icrc_drops = []
        malformed_drops = []
        for v in range(num_vls):
            rx = self.rx[v]
            beat = rx.payload
            m.d.comb += rx.ready.eq(1)

            m.submodules[f"icrc{v}"] = icrc = IcrcEngine(WIDTH, "check")
            m.d.comb += [
                icrc.valid.eq(rx.valid),
                icrc.data.eq(beat.data),
                icrc.start.eq(beat.start),
                icrc.end.eq(beat.end),
                icrc.count.eq(beat.count),
            ]

            # Every header a response has fits in its start beat.
            header_layout = data.StructLayout({
                "lnh": 2, "pktlen": 11, "opcode": 8, "destqp": 24, "psn": PSN_BITS,
                "syndrome": 8})
            lrh = from_wire(LRH, beat.data[:64])
            bth = from_wire(BTH, beat.data[64:160])
            aeth = from_wire(AETH, beat.data[160:192])
            start_header = Signal(header_layout, name=f"start_header{v}")
            held_header = Signal(header_layout, name=f"held_header{v}")
            m.d.comb += start_header.eq(Cat(lrh.lnh, lrh.pktlen, bth.opcode, bth.destqp,
                                            bth.psn, aeth.syndrome))
            header = Signal(header_layout, name=f"header{v}")
            m.d.comb += header.eq(Mux(beat.start, start_header, held_header))

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
            length = Signal(range(129 * WIDTH + 1), name=f"length{v}")
            m.d.comb += length.eq(index * WIDTH + beat.count)

            kind = header.syndrome[5:8]
            code = header.syndrome[0:5]
            shape_ok = Signal(name=f"shape_ok{v}")
            with m.Switch(header.opcode):
                with m.Case(ACKNOWLEDGE):
                    m.d.comb += shape_ok.eq(
                        (length == LRH_BTH_BYTES + AETH_BYTES + ICRC_BYTES)
                        & ((kind == AETH_ACK) | (kind == AETH_RNR_NAK)
                           | ((kind == AETH_NAK) & (code <= NAK_MAX_CODE))))
                with m.Case(ATOMIC_ACKNOWLEDGE):
                    m.d.comb += shape_ok.eq(
                        (length == LRH_BTH_BYTES + AETH_BYTES + ATOMIC_ACK_ETH_BYTES + ICRC_BYTES)
                        & (kind == AETH_ACK))
                with m.Case(READ_FIRST, READ_LAST, READ_ONLY):
                    m.d.comb += shape_ok.eq(
                        (length >= LRH_BTH_BYTES + AETH_BYTES + ICRC_BYTES) & (kind == AETH_ACK))
                with m.Case(READ_MIDDLE):
                    m.d.comb += shape_ok.eq(length >= LRH_BTH_BYTES + ICRC_BYTES)
            well_formed = (shape_ok & (header.lnh == LNH_IBA_LOCAL)
                           & (length == header.pktlen * 4) & (header.destqp < num_qps))

            ends = rx.valid & beat.end & in_a_packet
            good = ends & icrc.icrc_ok & ~beat.end_bad

            m.submodules[f"events{v}"] = queue = fifo.SyncFIFOBuffered(
                width=_RxEventLayout().size, depth=RX_EVENT_DEPTH)
            event = _RxEventLayout()(queue.w_data)
            m.d.comb += [
                event.qpn.eq(header.destqp),
                event.opcode.eq(header.opcode),
                event.psn.eq(header.psn),
                event.syndrome.eq(header.syndrome),
                queue.w_en.eq(good & well_formed),
            ]
            event_queues.append(queue)
            icrc_drops.append(ends & ~good)
            malformed_drops.append(good & ~(well_formed & queue.w_rdy))

        # --- Event processor: one event per cycle, round robin over VLs ---
        last_vl = Signal(vl_index(num_vls))
        any_event, event_vl = _round_robin(
            m, Cat(queue.r_rdy for queue in event_queues), last_vl, "vl_rr")
        event = _RxEventLayout()(Array(queue.r_data for queue in event_queues)[event_vl])
        for v, queue in enumerate(event_queues):
            m.d.comb += queue.r_en.eq(any_event & (event_vl == v))
        with m.If(any_event):
            m.d.sync += last_vl.eq(event_vl)

        eq = event.qpn[:qp_bits]
        p = event.psn
        accept = Signal()
        m.d.comb += accept.eq(
            any_event & ~qp_in_reset[eq] & started[eq] & ~nak_pending[eq] & ~flushing[eq]
            & _psn_lt(ack_psn[eq], p) & _psn_le(p, sent_psn[eq]))
        ev_kind = event.syndrome[5:8]
        ev_code = event.syndrome[0:5]
        ev_ack = Signal()
        ev_nak = Signal()
        ev_fatal = Signal()
        ev_read = Signal()
        ev_read_done = Signal()
        ev_atomic = Signal()
        with m.If(accept):
            with m.Switch(event.opcode):
                with m.Case(ACKNOWLEDGE):
                    m.d.comb += [
                        ev_ack.eq(ev_kind == AETH_ACK),
                        ev_nak.eq(ev_kind != AETH_ACK),
                        ev_fatal.eq((ev_kind == AETH_NAK) & (ev_code >= 1) & (ev_code <= 3)),
                    ]
                with m.Case(READ_FIRST, READ_MIDDLE):
                    m.d.comb += ev_read.eq(1)
                with m.Case(READ_LAST, READ_ONLY):
                    m.d.comb += [ev_read.eq(1), ev_read_done.eq(1)]
                with m.Case(ATOMIC_ACKNOWLEDGE):
                    m.d.comb += ev_atomic.eq(1)

        # --- Engine: complete head records of marked QPs, one per cycle ---
        cur_valid = Signal()
        cur_q = Signal(range(max(num_qps, 2)))
        head_rec = rec_read.data
        last_psn = head_rec.last_psn
        nonempty = head[cur_q] != tail[cur_q]
        opcode = head_rec.opcode
        is_read = opcode == MlxOpcode.RDMA_READ.value
        is_atomic = (opcode == MlxOpcode.ATOMIC_CS.value) | (opcode == MlxOpcode.ATOMIC_FA.value)
        acknowledged = Mux(is_read, _psn_le(last_psn, read_psn[cur_q]),
                           Mux(is_atomic,
                               _psn_le(last_psn, atomic_psn[cur_q]) | _psn_lt(last_psn, ack_psn[cur_q]),
                               _psn_le(last_psn, ack_psn[cur_q])))
        can = Signal()
        error = Signal()
        syndrome = Signal(8)
        nak_error = Signal()
        with m.If(flushing[cur_q]):
            m.d.comb += [can.eq(1), error.eq(1), syndrome.eq(Syndrome.WR_FLUSH_ERR)]
        with m.Elif(head_rec.status == CompletionStatus.ERROR):
            m.d.comb += [can.eq(1), error.eq(1), syndrome.eq(head_rec.syndrome)]
        with m.Elif(head_rec.status != CompletionStatus.SENT):
            m.d.comb += [can.eq(1), error.eq(1), syndrome.eq(Syndrome.WR_FLUSH_ERR)]
        with m.Elif(nak_pending[cur_q]):
            m.d.comb += can.eq(1)
            with m.If(~_psn_lt(last_psn, nak_psn[cur_q])):
                m.d.comb += [error.eq(1), syndrome.eq(nak_syndrome[cur_q]), nak_error.eq(1)]
        with m.Else():
            m.d.comb += can.eq(acknowledged)
        ready_head = cur_valid & nonempty & can
        complete = ready_head & jobs.w_rdy

        job = _JobLayout()(jobs.w_data)
        m.d.comb += [
            jobs.w_en.eq(complete),
            job.qpn.eq(head_rec.qpn),
            job.cqn.eq(head_rec.cqn),
            job.wqe_index.eq(head_rec.wqe_index),
            job.wqe_blocks.eq(head_rec.wqe_blocks),
            job.opcode.eq(opcode),
            job.byte_count.eq(head_rec.byte_count),
            job.error.eq(error),
            job.syndrome.eq(syndrome),
            job.write_cqe.eq((error | head_rec.signaled) & (head_rec.cqn < self.num_cqs)),
        ]
        m.d.sync += [self.qp_error.valid.eq(complete & nak_error), self.qp_error.qpn.eq(cur_q)]
        with m.If(complete):
            m.d.sync += head[cur_q].eq(head[cur_q] + 1)
            with m.If(nak_error):
                m.d.sync += [nak_pending[cur_q].eq(0), flushing[cur_q].eq(1)]
            with m.If(~error):
                with m.If(_psn_lt(read_psn[cur_q], last_psn)):
                    m.d.sync += read_psn[cur_q].eq(last_psn)
                with m.If(_psn_lt(atomic_psn[cur_q], last_psn)):
                    m.d.sync += atomic_psn[cur_q].eq(last_psn)

        # Stay on the QP while its head completes (or waits for room in ``jobs``),
        # reading the next record in time; otherwise take the next marked QP.
        any_marked, pick = _round_robin(m, Cat(marked), cur_q, "qp_rr")
        with m.If(ready_head):
            m.d.comb += rec_read.addr.eq(Cat((head[cur_q] + complete)[:slot_bits], cur_q))
        with m.Else():
            m.d.comb += rec_read.addr.eq(Cat(head[pick][:slot_bits], pick))
            m.d.sync += [cur_valid.eq(any_marked), cur_q.eq(pick)]
            with m.If(any_marked):
                m.d.sync += marked[pick].eq(0)

        # --- Records in (after the engine, so that a new record re-marks its QP) ---
        rec = self.completion.payload
        rq = rec.qpn[:qp_bits]
        rec_in_range = rec.qpn < num_qps
        full = (tail[rq] - head[rq])[:slot_bits + 1] == QUEUE_DEPTH
        m.d.comb += [
            self.completion.ready.eq(~rec_in_range | ~full),
            rec_write.addr.eq(Cat(tail[rq][:slot_bits], rq)),
            rec_write.data.eq(rec),
        ]
        with m.If(self.completion.valid & rec_in_range & ~full):
            m.d.comb += rec_write.en.eq(1)
            m.d.sync += [tail[rq].eq(tail[rq] + 1), marked[rq].eq(1)]
            with m.If(rec.status == CompletionStatus.SENT):
                m.d.sync += [sent_psn[rq].eq(rec.last_psn), started[rq].eq(1)]
                with m.If(~started[rq]):
                    m.d.sync += [
                        ack_psn[rq].eq(rec.first_psn - 1),
                        read_psn[rq].eq(rec.first_psn - 1),
                        atomic_psn[rq].eq(rec.first_psn - 1),
                    ]

        # --- Event effects (after the engine: an event's PSN is newer than any it completed) ---
        with m.If(ev_ack | ev_read_done | ev_atomic):
            m.d.sync += [ack_psn[eq].eq(p), marked[eq].eq(1)]
        with m.If(ev_read_done):
            m.d.sync += read_psn[eq].eq(p)
        with m.If(ev_atomic):
            m.d.sync += atomic_psn[eq].eq(p)
        with m.If(ev_fatal):
            m.d.sync += [
                ack_psn[eq].eq(p - 1),
                nak_pending[eq].eq(1),
                nak_psn[eq].eq(p),
                marked[eq].eq(1),
            ]
            with m.Switch(ev_code):
                for nak_code, nak_syn in NAK_FATAL.items():
                    with m.Case(nak_code):
                        m.d.sync += nak_syndrome[eq].eq(nak_syn)

        # --- The host moved the QP to ERR: nothing it waits for will be retransmitted ---
        with m.If(self.qp_flush.valid & (self.qp_flush.qpn < num_qps)):
            fq = self.qp_flush.qpn[:qp_bits]
            m.d.sync += [flushing[fq].eq(1), marked[fq].eq(1)]

        # --- QP reset last: it wins over everything else in its cycle ---
        with m.If(self.qp_reset.valid & (self.qp_reset.qpn < num_qps)):
            rs = self.qp_reset.qpn[:qp_bits]
            m.d.sync += [
                head[rs].eq(0), tail[rs].eq(0), marked[rs].eq(0), started[rs].eq(0),
                nak_pending[rs].eq(0), flushing[rs].eq(0),
            ]

        # --- CQE writer: P (CQ context read) -> O (AXI AW/W) ---
        axi = self.axi
        job_head = _JobLayout()(jobs.r_data)
        p_valid = Signal()
        p_job = Signal(_JobLayout())
        o_valid = Signal()
        o_job = Signal(_JobLayout())
        aw_pending = Signal()
        w_pending = Signal()
        awaddr = Signal(self.addr_width)
        wdata = Signal(8 * WIDTH)
        m.d.comb += [
            axi.awid.eq(0), axi.awaddr.eq(awaddr), axi.awlen.eq(0),
            axi.awsize.eq((WIDTH - 1).bit_length()), axi.awburst.eq(0b01),
            axi.awvalid.eq(aw_pending),
            axi.wdata.eq(wdata), axi.wstrb.eq((1 << WIDTH) - 1), axi.wlast.eq(1),
            axi.wvalid.eq(w_pending),
            axi.bready.eq(1),
        ]
        aw_fire = aw_pending & axi.awready
        w_fire = w_pending & axi.wready
        o_done = o_valid & (~aw_pending | axi.awready) & (~w_pending | axi.wready)
        o_free = ~o_valid | o_done
        p_move = p_valid & o_free
        load_p = jobs.r_rdy & (~p_valid | p_move)
        m.d.comb += [
            jobs.r_en.eq(load_p),
            # The context answers a cycle later: address the job that P holds next cycle.
            self.cq_config.addr.eq(Mux(load_p, job_head.cqn, p_job.cqn)),
        ]
        with m.If(load_p):
            m.d.sync += [p_valid.eq(1), p_job.eq(job_head)]
        with m.Elif(p_move):
            m.d.sync += p_valid.eq(0)

        cq = self.cq_config.data
        producer = Array(Signal(16, name=f"cq_pi{c}") for c in range(self.num_cqs))
        pi = producer[p_job.cqn[:max(self.num_cqs - 1, 1).bit_length()]]
        log_size = Mux(cq.collapsed, 0, cq.log_size)
        entry = pi & ((Const(1, 17) << log_size) - 1)
        owner = (pi >> log_size)[0]
        def big_endian(value, nbytes):
            value = Value.cast(value)
            return [value[8 * (nbytes - 1 - k):8 * (nbytes - k)] for k in range(nbytes)]
        cqe_bytes = [Const(0, 8)] * WIDTH
        cqe_bytes[44:48] = big_endian(Mux(p_job.error, 0, p_job.byte_count), 4)
        cqe_bytes[55] = Mux(p_job.error, p_job.syndrome, 0)
        cqe_bytes[56:60] = big_endian(Cat(p_job.qpn, Const(0, 16), p_job.opcode), 4)
        cqe_bytes[60:62] = big_endian(p_job.wqe_index, 2)
        cqe_bytes[63] = Cat(owner, Const(0, 3),
                            Mux(p_job.error, CQE_OPCODE_REQ_ERR, CQE_OPCODE_REQ)[:4])
        cqe = Signal(8 * WIDTH)
        m.d.comb += cqe.eq(Cat(*cqe_bytes))

        with m.If(aw_fire):
            m.d.sync += aw_pending.eq(0)
        with m.If(w_fire):
            m.d.sync += w_pending.eq(0)
        with m.If(o_done):
            m.d.sync += o_valid.eq(0)
        with m.If(p_move):
            m.d.sync += [
                o_valid.eq(1), o_job.eq(p_job),
                aw_pending.eq(p_job.write_cqe), w_pending.eq(p_job.write_cqe),
                awaddr.eq(cq.base + (entry << 6)), wdata.eq(cqe),
            ]
            with m.If(p_job.write_cqe):
                m.d.sync += pi.eq(pi + 1)

        m.d.comb += [
            self.retire.valid.eq(o_done),
            self.retire.payload.qpn.eq(o_job.qpn),
            self.retire.payload.blocks.eq(o_job.wqe_blocks),
        ]

        # --- Counters ---
        def count(counter, amount):
            m.d.sync += counter.eq(counter + amount)
        count(self.acks_received, ev_ack)
        count(self.naks_received, ev_nak)
        count(self.read_responses, ev_read)
        count(self.atomic_acks, ev_atomic)
        count(self.cqes_written, o_done & o_job.write_cqe)
        count(self.error_cqes, o_done & o_job.write_cqe & o_job.error)
        count(self.rx_dropped_icrc, sum(icrc_drops))
        count(self.rx_dropped_unexpected, sum(malformed_drops) + (any_event & ~accept))
        count(self.cqe_write_errors, axi.bvalid & (axi.bresp != 0))
        return m
