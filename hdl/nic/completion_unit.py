"""The requester's completion unit: the engine that decides from responses which WQEs
complete, between its response decoder and its CQE writer (docs/nic.md, "Completions")."""
from amaranth import Array, Cat, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.arith import count_registered, count_registered_sum, lookahead_sum
from hdl.link.signatures import BeatLayout
from hdl.nic.cqe_writer import JOB_DEPTH, CqeWriter
from hdl.nic.response_decoder import (
    ACKNOWLEDGE, AETH_ACK, AETH_BYTES, AETH_NAK, AETH_RNR_NAK, ATOMIC_ACKNOWLEDGE,
    LRH_BTH_BYTES, READ_FIRST, READ_LAST, READ_MIDDLE, READ_ONLY, STORED_OPCODES,
    ResponseDecoder, ResponseEventLayout,
)
from hdl.nic.response_writer import ORIG_WORD4_BYTE
from hdl.prim.round_robin import mask_after, next_mask, one_hot_index, round_robin_pick
from hdl.nic.signatures import (
    PSN_BITS, RECORD_QUEUE_DEPTH, RESPONSE_SEQ_BITS, AxiWriteSignature,
    CompletionRecordLayout, CompletionStatus, ContextReadSignature, CqConfigLayout,
    EventSignature, MlxOpcode, PacketSentLayout, QpState, ReceiveCompletionLayout,
    RetireLayout, ResponseVerdictLayout, RewindLayout, Syndrome,
)

__all__ = ["CompletionUnit", "RNR_TIMER_TICKS", "TIMER_TICK_CYCLES"]

WIDTH = 64                  # bytes per beat and per AXI data beat
QUEUE_DEPTH = RECORD_QUEUE_DEPTH
TIMER_TICK_CYCLES = 1638    # 4.096 us at 400 MHz: IBA's unit of the local ACK timeout
TIMER_BITS = 20             # tick stamps; a wait is at most 2**19 ticks
MAX_TIMEOUT_EXPONENT = 19   # ack_timeout codes above this wait 2**19 ticks (2.1 s)
SCAN_INTERVAL = 16          # cycles between timer scans when the engine is busy
RNR_INFINITE = 7            # rnr_retry value meaning: retry without limit

# IBA RNR NAK timer codes (table 45) in microseconds, and in timer ticks (rounded up).
_RNR_TIMER_US = (655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280,
                 1920, 2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440,
                 81920, 122880, 163840, 245760, 327680, 491520)
RNR_TIMER_TICKS = tuple(-(-us * 1000 // 4096) for us in _RNR_TIMER_US)

NAK_FATAL = {               # NAK code: syndrome of the error CQE it gives
    1: Syndrome.REMOTE_INVAL_REQ_ERR,
    2: Syndrome.REMOTE_ACCESS_ERR,
    3: Syndrome.REMOTE_OP_ERR,
}


def _psn_le(a, b):
    """``a`` at or before ``b`` in PSN order (modulo 2^24, within half the PSN space)."""
    return ~(b - a)[PSN_BITS - 1]


def _psn_lt(a, b):
    return _psn_le(a, b) & (a != b)


def _sum_is_zero(a, b):
    """``a + b == 0`` modulo 2^len(a), without a carry chain: the sum is 0 exactly when
    every bit's carry in is ``a | b`` of the bit below (a LUT per bit, then an AND)."""
    return (a ^ b) == Cat(Const(0, 1), (a | b)[:len(a) - 1])


def _is_atomic(opcode):
    """An mlx5 atomic opcode: IBA's (ATOMIC_CS, ATOMIC_FA) or masked (0x14, 0x15)."""
    return opcode.matches(MlxOpcode.ATOMIC_CS.value, MlxOpcode.ATOMIC_FA.value,
                          MlxOpcode.ATOMIC_MASKED_CS.value, MlxOpcode.ATOMIC_MASKED_FA.value)


def _head_outcome(m, rec, st, flushing, name):
    """Whether head record ``rec`` of a QP in state ``st`` can complete, and how: (can,
    error, syndrome, nak_error)."""
    last_psn = rec.last_psn
    is_read = rec.opcode == MlxOpcode.RDMA_READ.value
    is_atomic = _is_atomic(rec.opcode)
    # READ and atomic WQEs complete only by their own responses: their data must land.
    acknowledged = Mux(is_read, _psn_le(last_psn, st.read_psn),
                       Mux(is_atomic, _psn_le(last_psn, st.atomic_psn),
                           _psn_le(last_psn, st.ack_psn)))
    can = Signal(name=f"{name}_can")
    error = Signal(name=f"{name}_error")
    syndrome = Signal(8, name=f"{name}_syndrome")
    nak_error = Signal(name=f"{name}_nak_error")
    with m.If(flushing):
        m.d.comb += [can.eq(1), error.eq(1), syndrome.eq(Syndrome.WR_FLUSH_ERR)]
    with m.Elif(rec.status == CompletionStatus.ERROR):
        m.d.comb += [can.eq(1), error.eq(1), syndrome.eq(rec.syndrome)]
    with m.Elif(rec.status != CompletionStatus.SENT):
        m.d.comb += [can.eq(1), error.eq(1), syndrome.eq(Syndrome.WR_FLUSH_ERR)]
    with m.Elif(st.nak_pending):
        m.d.comb += can.eq(1)
        with m.If(~_psn_lt(last_psn, st.nak_psn)):
            m.d.comb += [error.eq(1), syndrome.eq(st.nak_syndrome), nak_error.eq(1)]
    with m.Else():
        m.d.comb += can.eq(acknowledged)
    return can, error, syndrome, nak_error


class _StateLayout(data.StructLayout):
    """A QP's row in the engine's state memory; all zero is the state after ``qp_reset``."""
    def __init__(self, count_bits):
        super().__init__({
            "head": count_bits,     # records completed, modulo 2 * QUEUE_DEPTH (full vs empty)
            # The PSNs below hold the QP's; until the engine writes the row after the first
            # SENT record, they are that record's ``first_psn - 1`` (``_TailLayout.base_psn``).
            "primed": 1,
            "ack_psn": PSN_BITS,
            "read_psn": PSN_BITS,
            "atomic_psn": PSN_BITS,
            "nak_pending": 1,
            "nak_psn": PSN_BITS,
            "nak_syndrome": 8,
            # Reliability (docs/nic-reliability.md).
            "rewind_pending": 1,    # a sequence NAK or response gap: rewind at the head
            "gap_seen": 1,          # rewound and no progress since: ignore further gaps
            "rnr_pending": 1,       # an RNR NAK: rewind once its wait is over
            "rnr_code": 5,
            "armed": 1,             # the timer runs since ``stamp``
            "stamp": TIMER_BITS,
            "retries_used": 3,
            "rnr_used": 3,
            "data_seq": RESPONSE_SEQ_BITS,  # the newest response the QP took data from
            "rhead": count_bits,    # READ/atomic records whose responses all came
        })


class _TailLayout(data.StructLayout):
    """A QP's row in the record path's memory; all zero is the state after ``qp_reset``."""
    def __init__(self, count_bits):
        super().__init__({
            "tail": count_bits,     # records taken, modulo 2 * QUEUE_DEPTH
            "started": 1,           # a SENT record came since reset
            "sent_psn": PSN_BITS,
            "base_psn": PSN_BITS,   # the first SENT record's ``first_psn - 1``
            "rtail": count_bits,    # SENT READ/atomic records taken, modulo 2 * QUEUE_DEPTH
        })


class _ReadLayout(data.StructLayout):
    """A SENT RDMA_READ or atomic record as the response path needs it."""
    def __init__(self):
        super().__init__({
            "first_psn": PSN_BITS, "last_psn": PSN_BITS, "byte_count": 32, "laddr": 64,
            "mtu": 3, "atomic": 1,
            "last_bytes": range(4096 + 1),  # the payload of its last response
        })


class CompletionUnit(wiring.Component):
    """The requester's completions: the response decoder (``decoder``, a block), the engine
    with its per-QP outstanding-WQE table and retransmission timers (here), and the CQE
    writer (``cqe_writer``, a block), wired port to port with no register between them
    (docs/nic.md, "Completions": the blocks, their ports and handshakes).

    Receive: the decoder hands over the well-formed responses of each VL on its
    ``events[v]`` (docs/nic.md, "Response decoder"); the engine (below) takes one event per
    cycle, round robin over VLs.

    Engine: the per-QP state (queue head, PSNs, pending NAK) is one row of a memory, so
    that no per-QP register is read or written at a variable index. One operation per
    cycle goes through it: an event (always first) or a completion attempt on a QP's
    head. An operation reads its QP's row when it is issued, reads the head record
    (completion) a cycle later, and writes the row back a cycle after that, when it
    acts; later operations see its effects (the row is bypassed to the one behind it).
    Records do not use the engine: the record path owns a second row per QP (queue tail,
    ``sent_psn``, whether a SENT record came and the first one's ``first_psn - 1``, which
    the engine takes as its PSNs until it writes its row). A record is taken when its
    queue has room (below: a flag per QP), reads that row and the head in the cycle it is
    taken and writes itself at the tail and the row back in the next; engine operations
    issued in the cycle it is taken or later see it. ``qp_flush`` and ``qp_reset`` apply
    to operations and records issued after the strobe's cycle; one issued in it or before
    acts before the strobe (a reset discards what it wrote). So records are taken at one per cycle
    while the engine completes heads at one per cycle (completions of one QP back to
    back too), sharing its cycles only with events.

    Wire: ``sent`` (from the executor, a cycle after each request packet's descriptor
    handshake, the point where the packet is committed to the wire) gives the QP and PSN
    of every packet sent, resent ones included. Per QP, ``wire_psn`` is the highest PSN
    sent since the QP's reset (modulo 2^24, as below; none after ``qp_reset``): a
    strobe is read in the cycle after it (W1) and written in the next (W2) when its PSN
    is after ``wire_psn`` or the QP has sent nothing yet, so a rewind's resent packets
    leave it where it was. An event issued in cycle t sees the strobes of cycles up to
    t - 1. Strobes for a QP number beyond ``num_qps`` are ignored.

    Processor, per event for QP q at PSN p. Dropped (``rx_dropped_unexpected``) when q is
    in RESET (``qp_state`` as it was in the event's issue cycle), has had no SENT record since its reset, has a fatal NAK pending or is
    flushing (after a fatal NAK or ``qp_flush``), or when p is not in ``(ack_psn,
    sent_psn]`` or is after ``wire_psn`` (or q has sent nothing): ``sent_psn`` is the
    last PSN of q's newest SENT record, ``ack_psn`` the newest acknowledged PSN (the first
    SENT record's ``first_psn - 1`` after reset). A record comes with its message's first
    packet, so ``sent_psn`` runs ahead of the wire while a message is being sent: an
    answer for a packet not sent yet is bad input. So stale, duplicate, future and
    unsent PSNs are dropped. Otherwise:

    - ACKNOWLEDGE, ACK: ``ack_psn = p``; if it covers R (below), R's responses went
      missing: unless ``gap_seen``, a rewind is pending;
    - ACKNOWLEDGE, NAK code 1/2/3: ``ack_psn = p - 1``, fatal NAK pending at p, or at
      R's first PSN if that is before p (R, below, never got its data);
    - ACKNOWLEDGE, NAK code 0 (PSN sequence error): ``ack_psn = p - 1``; unless
      ``gap_seen``, a rewind is pending (below);
    - ACKNOWLEDGE, RNR NAK: ``ack_psn = p - 1``; the RNR wait (the AETH timer code, IBA
      table 45, in ticks rounded up: ``RNR_TIMER_TICKS``) starts;
    - ACKNOWLEDGE, NAK code 4: counted only;
    - READ response, ATOMIC ACKNOWLEDGE: these refer to R, the QP's oldest SENT
      RDMA_READ or atomic record whose responses have not all been taken (a second
      per-QP queue of those records, ``reads``, with its tail in the record path's row
      and its head ``rhead`` in the engine's). One is *taken* only if R is a READ (resp.
      an atomic), p is ``ack_psn + 1`` inside R or R's first PSN (then it also
      acknowledges everything before R, as IBA lets a response do), the opcode is the
      one its position in R needs (ONLY, FIRST, MIDDLE, LAST), and its payload is as
      long as that position's (the path MTU; for the last, the rest of ``R.byte_count``:
      ``byte_count mod MTU``, or a whole MTU when that is 0 and the count is not, which is
      ``byte_count`` minus the bytes before it as the executor numbers a READ's PSNs, one
      per MTU; the AtomicAckETH for an atomic). Taken: ``ack_psn = p``, LAST/ONLY
      ``read_psn = p`` and R leaves the queue, atomic ``atomic_psn = p``, and a
      ``verdict`` writes its payload at ``R.laddr + (p - R.first_psn) * mtu``. Not taken
      with ``ack_psn + 1 < p`` (a response went missing): unless ``gap_seen``, a rewind
      is pending. ``read_responses``/``atomic_acks`` count those taken and those telling
      of a loss; the others are ``rx_dropped_unexpected``.

    Every packet the ResponseWriter stored (READ responses, ATOMIC ACKNOWLEDGE, with the
    sequence number ``rx_seq`` gives beside its beats) gets exactly one decision: a
    ``discard`` strobe three cycles after its end beat (D's decision, registered) when it
    does not become an event (bad ICRC,
    end-bad, malformed, event queue full), else a ``verdict`` (write or not) three cycles
    after its event's X (V1 and V2 form the address: docs/nic.md, "Completions"). An event that moves ``ack_psn`` forward is progress: the retry
    counters restart, ``gap_seen`` clears and the timer stops.

    Retransmission (go-back-N, docs/nic-reliability.md). The QP's head record H is
    *stuck* when it is SENT and cannot complete. A timer scan (an engine operation on
    QP ``scan_q``, issued when the engine has nothing else to do and at least every
    ``SCAN_INTERVAL`` cycles, walking the QPs in turn) arms the timer on a stuck head
    (``stamp = now``; ``now`` counts ticks of ``timer_tick`` cycles), restarts it
    (``stamp = now``) on a stuck head when a packet of the QP went out (``sent``) since
    the QP's previous scan, unless an RNR wait runs, and disarms it on an empty queue.
    Progress and a rewind disarm it, so its reference is the first scan after the latest
    of: the last progress, the last rewind, the last packet sent (so a message being sent
    cannot time out while its packets keep leaving). A rewind is due when H is stuck and:
    a rewind is pending (seen by a completion operation or a scan), or the RNR wait is
    over (scan), or the timer ran
    ``2**min(ack_timeout, 19)`` ticks with ``ack_timeout`` (from H) not 0 and no packet
    of the QP sent since the previous scan (scan). Then,
    if the QP is in ERR or flushing, it flushes; else if the retries are used up
    (``retries_used == retry_cnt``; RNR: ``rnr_retry != 7`` and ``rnr_used ==
    rnr_retry``) a fatal NAK is pending at ``H.first_psn`` with TRANSPORT_RETRY_EXC_ERR
    (RNR_RETRY_EXC_ERR), which completes H with that error, errors and flushes the QP;
    else ``rewind`` goes out a cycle later with ``(q, H.wqe_index, H.first_psn)``,
    ``ack_psn``, ``read_psn`` and ``atomic_psn`` go back to ``H.first_psn - 1``, the
    retry counter used counts one more, ``gap_seen`` is set, and the pending rewind, the
    RNR wait and the timer clear.

    Records from ``completion`` are kept per QP in order in one memory (``QUEUE_DEPTH``
    per QP; a record waits on ``ready`` while its QP's queue holds ``QUEUE_DEPTH - 1`` or
    more, a registered flag per QP: the record in R2 may not be in it yet, so the queue
    still fills; one for a QP number beyond ``num_qps`` is taken and ignored). A QP with a new record or a changed state is
    marked (a new record only when it is its queue's head); the engine takes
    marked QPs round robin and completes head records, one per cycle, while the head can
    complete: when flushing, with WR_FLUSH_ERR; ERROR with
    its syndrome; FLUSH (or an unknown status) with WR_FLUSH_ERR; SENT with a fatal NAK
    pending at p: OK if its ``last_psn < p``, else the NAK's error, ``qp_error``, and
    flushing from then on (until ``qp_reset``); SENT otherwise: RDMA_READ when
    ``last_psn <= read_psn``, atomics when ``last_psn <= atomic_psn`` (only their own
    responses complete them: their data must land), others when ``last_psn <= ack_psn``. An OK completion pulls
    ``read_psn`` and ``atomic_psn`` up to its ``last_psn`` so that they never fall
    more than the outstanding PSNs behind (the modulo-2^24 compares assume a QP's
    unacknowledged PSNs span less than 2^23).

    ``qp_flush`` (the host moved the QP from RTS to ERR; docs/nic.md) makes the QP flushing at once: every record it holds and gets completes
    with WR_FLUSH_ERR, and its responses are dropped, until ``qp_reset``. Without it, a
    QP in ERR keeps waiting for the acknowledgements of its SENT records (a QP errored by
    the executor or a NAK must: its earlier records may still be acknowledged).

    Every counter counts a registered event, a cycle after it (``retransmits_*`` and
    ``retries_exhausted`` a cycle after the rewind or give-up they count); the two that
    count several events in a cycle, ``rx_dropped_icrc`` and ``rx_dropped_unexpected``,
    register their sum as well and move two cycles after their events.

    CQEs: each completed record goes to the CQE writer (``job``), which writes its CQE, if
    any, and retires it; receive completions (``receive``) share it (docs/nic.md, "CQE
    writer"). The engine issues a completion only while the writer's jobs queue has room
    for it and the completions ahead of it (``job_level``).

    Limits and assumptions: a SENT record reaches the unit before any response to it can
    (the executor emits it with the message's first packet descriptor, a round trip ahead
    of the response), else that response is dropped as a future PSN: records held behind
    one the unit refuses (its QP's queue nearly full) can come late (docs/nic.md,
    Completions). AETH.MSN, P_Key,
    LIDs and SL of a response are not checked; responses with a GRH are dropped.
    A READ response or atomic acknowledge that implicitly acknowledges earlier requests
    (their ACK was lost) is not taken: the go-back-N retry recovers it. ``qp_reset`` is
    for an idle QP (all its records retired). A CQ's producer index starts at 0 after a reset and after ``cq_reset`` (the
    host wrote its context).
    """

    def __init__(self, *, num_qps=64, num_cqs=16, num_vls=2, addr_width=64,
                 timer_tick=TIMER_TICK_CYCLES):
        if not isinstance(timer_tick, int) or not 1 <= timer_tick <= 1 << 16:
            raise ValueError(f"Timer tick must be 1 to 65536 cycles, not {timer_tick!r}")
        # The blocks check the other parameters.
        self.decoder = ResponseDecoder(num_qps=num_qps, num_vls=num_vls)
        self.cqe_writer = CqeWriter(num_cqs=num_cqs, addr_width=addr_width)
        self.timer_tick = timer_tick
        self.num_qps = num_qps
        self.num_cqs = num_cqs
        self.num_vls = num_vls
        self.addr_width = addr_width
        super().__init__({
            "rx": In(stream.Signature(BeatLayout(WIDTH))).array(num_vls),
            "completion": In(stream.Signature(CompletionRecordLayout())),
            "sent": In(stream.Signature(PacketSentLayout(), always_ready=True)),
            "qp_state": In(QpState).array(num_qps),
            "qp_reset": In(EventSignature()),
            "qp_flush": In(EventSignature()),
            "cq_reset": In(EventSignature()),     # ``qpn`` carries the CQ number
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
            "receive": In(stream.Signature(ReceiveCompletionLayout())),
            "recv_cqes": Out(32),
            "rx_seq": In(RESPONSE_SEQ_BITS).array(num_vls),
            "discard": Out(stream.Signature(RESPONSE_SEQ_BITS, always_ready=True)),
            "verdict": Out(stream.Signature(ResponseVerdictLayout(), always_ready=True)),
            "landed": In(RESPONSE_SEQ_BITS),
            "rewind": Out(stream.Signature(RewindLayout(), always_ready=True)),
            "retransmits_nak": Out(32),
            "retransmits_timeout": Out(32),
            "retransmits_rnr": Out(32),
            "retries_exhausted": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        num_qps, num_vls = self.num_qps, self.num_vls
        qp_bits = max(num_qps - 1, 1).bit_length()
        slot_bits = (QUEUE_DEPTH - 1).bit_length()
        count_bits = slot_bits + 1
        state_layout = _StateLayout(count_bits)
        tail_layout = _TailLayout(count_bits)

        def onehot(q, en):
            """Bit ``q`` when ``en``: per-QP flags change through masks, as an indexed
            assignment would elaborate into a case per QP."""
            return Mux(en, (Const(1, num_qps) << q)[:num_qps], 0)

        m.submodules.state = state = Memory(shape=state_layout, depth=num_qps, init=[])
        state_write = state.write_port()
        state_read = state.read_port(transparent_for=(state_write,))
        # The record path reads the head to know how full the queue is.
        head_read = state.read_port(transparent_for=(state_write,))

        # Queue tails and the PSNs records set: the record path's own row per QP, so that
        # a record takes no engine operation. The engine reads it for events and heads.
        m.submodules.tails = tails = Memory(shape=tail_layout, depth=num_qps, init=[])
        tail_write = tails.write_port()
        tail_read = tails.read_port(transparent_for=(tail_write,))
        engine_tail_read = tails.read_port(transparent_for=(tail_write,))

        # Per QP, the highest PSN on the wire (``sent``): answers beyond it are not taken.
        # A sent packet updates it in two steps, W1 (read) and W2 (write if newer).
        m.submodules.wire = wire = Memory(shape=PSN_BITS, depth=num_qps, init=[])
        wire_write = wire.write_port()
        wire_update_read = wire.read_port(transparent_for=(wire_write,))
        engine_wire_read = wire.read_port(transparent_for=(wire_write,))

        m.submodules.records = records = Memory(
            shape=CompletionRecordLayout(), depth=num_qps * QUEUE_DEPTH, init=[])
        rec_write = records.write_port()
        # A record written in the cycle the engine reads a head is that head.
        rec_read = records.read_port(transparent_for=(rec_write,))

        # Per QP, its SENT READ and atomic records again, in order (a second queue of the
        # same depth, so it cannot fill first): responses refer to the oldest whose
        # responses have not all come, which need not be the head (earlier WQEs may be
        # acknowledged by the response itself, and completions lag events).
        m.submodules.reads = reads = Memory(
            shape=_ReadLayout(), depth=num_qps * QUEUE_DEPTH, init=[])
        read_write = reads.write_port()
        read_read = reads.read_port(transparent_for=(read_write,))

        m.submodules.cqe_writer = writer = self.cqe_writer
        wiring.connect(m, wiring.flipped(self.receive), writer.receive)
        wiring.connect(m, wiring.flipped(self.cq_reset), writer.cq_reset)
        wiring.connect(m, writer.cq_config, wiring.flipped(self.cq_config))
        wiring.connect(m, writer.retire, wiring.flipped(self.retire))
        wiring.connect(m, writer.axi, wiring.flipped(self.axi))
        m.d.comb += [
            writer.landed.eq(self.landed),
            self.cqes_written.eq(writer.cqes_written),
            self.error_cqes.eq(writer.error_cqes),
            self.recv_cqes.eq(writer.recv_cqes),
            self.cqe_write_errors.eq(writer.cqe_write_errors),
        ]

        # Per-QP flags outside the state memory: the strobes change them without reading
        # a row, and the round-robin picker and ``completion.ready`` need them for all QPs.
        marked = Signal(num_qps)        # the engine should look at this QP's head
        flushing = Signal(num_qps)
        # Reset since its row was last written: the row reads as 0. Memories keep their
        # contents through a reset, so every row starts fresh.
        fresh = Signal(num_qps, init=(1 << num_qps) - 1)
        tail_fresh = Signal(num_qps, init=(1 << num_qps) - 1)
        wire_fresh = Signal(num_qps, init=(1 << num_qps) - 1)    # nothing sent since reset
        # A packet went out since the QP's last timer scan: the scan restarts its timer.
        sent_since_scan = Signal(num_qps)
        # QUEUE_DEPTH - 1 records or more in the QP's queue: R2 may hold one more, so R1
        # takes a record only while its QP's flag is clear (``completion.ready`` reads a
        # register, not R2's fill test).
        nearly_full = Signal(num_qps)
        # ``qp_state`` registered, so that S selects its QP's bit from registers: an
        # operation sees the state of its issue cycle.
        in_reset = Signal(num_qps)
        in_err = Signal(num_qps)
        m.d.sync += [
            in_reset.eq(Cat(self.qp_state[q] == QpState.RESET for q in range(num_qps))),
            in_err.eq(Cat(self.qp_state[q] == QpState.ERR for q in range(num_qps))),
        ]

        # The strobes act on the flags a cycle late, after the operations issued in their
        # cycle (which a strobe follows, as it wins over everything else in its cycle).
        reset_valid = Signal()
        reset_q = Signal(range(max(num_qps, 2)))
        flush_valid = Signal()
        flush_q = Signal(range(max(num_qps, 2)))
        # Their one-hot masks are registered beside them, so the flags' updates decode none.
        reset_mask = Signal(num_qps)
        flush_mask = Signal(num_qps)
        reset_in_range = self.qp_reset.valid & (self.qp_reset.qpn < num_qps)
        flush_in_range = self.qp_flush.valid & (self.qp_flush.qpn < num_qps)
        m.d.sync += [
            reset_valid.eq(reset_in_range),
            reset_q.eq(self.qp_reset.qpn),
            reset_mask.eq(onehot(self.qp_reset.qpn[:qp_bits], reset_in_range)),
            flush_valid.eq(flush_in_range),
            flush_q.eq(self.qp_flush.qpn),
            flush_mask.eq(onehot(self.qp_flush.qpn[:qp_bits], flush_in_range)),
        ]

        # --- Timer: ``now`` counts ticks of ``timer_tick`` cycles ---
        # ``now_next`` is ``now`` of the next cycle, a register too, so that S can work out
        # the ticks an operation will see elapsed in X.
        now = Signal(TIMER_BITS)
        now_next = Signal(TIMER_BITS, init=int(self.timer_tick == 1))
        prescaler = Signal(range(self.timer_tick))
        ticks = Const(1) if self.timer_tick == 1 else prescaler == self.timer_tick - 1
        ticks_next = Const(1) if self.timer_tick == 1 else prescaler == self.timer_tick - 2
        m.d.sync += [
            now.eq(now_next),
            now_next.eq(lookahead_sum(m, now_next, ticks_next, name="now_next")[:TIMER_BITS]),
        ]
        with m.If(prescaler == self.timer_tick - 1):
            m.d.sync += prescaler.eq(0)
        with m.Else():
            m.d.sync += prescaler.eq(prescaler + 1)

        # --- Receive: the response decoder's per-VL event queues ---
        m.submodules.decoder = decoder = self.decoder
        for v in range(num_vls):
            wiring.connect(m, wiring.flipped(self.rx[v]), decoder.rx[v])
            m.d.comb += decoder.rx_seq[v].eq(self.rx_seq[v])
        wiring.connect(m, decoder.discard, wiring.flipped(self.discard))
        m.d.comb += self.rx_dropped_icrc.eq(decoder.rx_dropped_icrc)

        # --- Record path, beside the engine: R1 (take the record, read its QP's tail row
        # and head) and R2 (write the record at the tail, write the tail row back). A
        # record taken in a cycle is seen by every engine operation issued in it or after.
        r2_valid = Signal()
        r2_q = Signal(range(max(num_qps, 2)))
        r2_qmask = Signal(num_qps)      # bit r2_q
        r2_record = Signal(CompletionRecordLayout())
        r2_nearly_full = Signal()       # R2's QP holds QUEUE_DEPTH - 1 records or more after it
        rec = self.completion.payload
        rq = rec.qpn[:qp_bits]
        rec_in_range = rec.qpn < num_qps
        rec_blocked = nearly_full.bit_select(rq, 1)
        m.d.comb += [
            self.completion.ready.eq(~rec_in_range | ~rec_blocked),
            tail_read.addr.eq(rq),
            head_read.addr.eq(rq),
        ]
        m.d.sync += [
            r2_valid.eq(self.completion.valid & rec_in_range & ~rec_blocked),
            r2_q.eq(rq),
            r2_qmask.eq(onehot(rq, 1)),
            r2_record.eq(rec),
        ]

        # --- Wire: W1 reads the QP's highest PSN sent, W2 writes the packet's if it is newer
        # (after a rewind, packets go out again below it) ---
        w2_valid = Signal()
        w2_q = Signal(range(max(num_qps, 2)))
        w2_psn = Signal(PSN_BITS)
        sent_q = self.sent.payload.qpn[:qp_bits]
        sent_valid = self.sent.valid & (self.sent.payload.qpn < num_qps)
        m.d.comb += wire_update_read.addr.eq(sent_q)
        m.d.sync += [w2_valid.eq(sent_valid), w2_q.eq(sent_q), w2_psn.eq(self.sent.payload.psn)]
        w2_newer = wire_fresh.bit_select(w2_q, 1) | _psn_lt(wire_update_read.data, w2_psn)
        m.d.comb += [
            wire_write.addr.eq(w2_q),
            wire_write.data.eq(w2_psn),
            wire_write.en.eq(w2_valid & w2_newer),
        ]

        # --- Engine: one operation per cycle through I (issue: read the QP's state row),
        # S (state row in, bypassed from X; a completion reads its head record) and X
        # (execute: write the row back). An operation sees every operation issued before
        # it, every record taken in or before its issue cycle and every qp_flush/qp_reset
        # strobe before its issue cycle; a strobe in its issue cycle or later takes effect
        # after it.
        s_ev, s_cmp, s_scan = Signal(), Signal(), Signal()
        s_q = Signal(range(max(num_qps, 2)))
        s_event = Signal(ResponseEventLayout())
        x_ev, x_cmp, x_scan = Signal(), Signal(), Signal()
        x_q = Signal(range(max(num_qps, 2)))
        x_qmask = Signal(num_qps)       # bit x_q
        x_event = Signal(ResponseEventLayout())
        x_state = Signal(state_layout)
        x_tail = Signal(tail_layout)
        x_in_reset = Signal()
        x_in_err = Signal()
        x_flushing = Signal()
        x_killed = Signal()             # a qp_reset of its QP in its issue cycle: no writes
        x_new = Signal(state_layout)
        x_sets_flushing = Signal()
        x_on_wire = Signal()            # the event's PSN is not beyond the QP's wire PSN
        x_sent_since = Signal()         # a packet of its QP went out since its last scan
        x_psn_less_one = Signal(PSN_BITS)   # the event's PSN - 1, for the NAKs' ack_psn
        x_elapsed = Signal(TIMER_BITS)  # ticks from the row's stamp to now
        x_stamps = Signal()             # X writes ``now`` into the row's stamp
        x_writes = (x_ev | x_cmp | x_scan) & ~x_killed
        complete = Signal()             # X completes its QP's head

        # R2: the tail row as read, else as reset; the head as X leaves it. The queue's
        # count is found against the head as read and against X's head, both registers,
        # and chosen by X's completion last.
        r_tail = Signal(tail_layout)
        r_new = Signal(tail_layout)
        with m.If(~tail_fresh.bit_select(r2_q, 1)):
            m.d.comb += r_tail.eq(tail_read.data)
        r_count_read = (r_tail.tail - Mux(fresh.bit_select(r2_q, 1), 0,
                                          head_read.data.head))[:count_bits]
        r_count_x = (r_tail.tail - x_state.head)[:count_bits]     # before X's completion
        r_on_x = x_writes & (x_q == r2_q)
        def r_count_is(n):
            return Mux(r_on_x, Mux(complete, r_count_x == n + 1, r_count_x == n),
                       r_count_read == n)
        m.d.comb += [
            r2_nearly_full.eq(r_count_is(QUEUE_DEPTH - 2) | r_count_is(QUEUE_DEPTH - 1)),
            r_new.eq(r_tail),
            r_new.tail.eq(r_tail.tail + 1),
            tail_write.addr.eq(r2_q),
            tail_write.data.eq(r_new),
            tail_write.en.eq(r2_valid),
            rec_write.addr.eq(Cat(r_tail.tail[:slot_bits], r2_q)),
            rec_write.data.eq(r2_record),
            rec_write.en.eq(r2_valid),
        ]
        with m.If(r2_record.status == CompletionStatus.SENT):
            m.d.comb += [r_new.sent_psn.eq(r2_record.last_psn), r_new.started.eq(1)]
            with m.If(~r_tail.started):
                m.d.comb += r_new.base_psn.eq(r2_record.first_psn - 1)
        r2_atomic = _is_atomic(r2_record.opcode)
        r2_rest = r2_record.byte_count[:12] & ((Const(128, 13) << r2_record.mtu) - 1)[:12]
        r2_reads = (r2_valid & (r2_record.status == CompletionStatus.SENT)
                    & ((r2_record.opcode == MlxOpcode.RDMA_READ.value) | r2_atomic))
        m.d.comb += [
            read_write.addr.eq(Cat(r_tail.rtail[:slot_bits], r2_q)),
            read_write.data.first_psn.eq(r2_record.first_psn),
            read_write.data.last_psn.eq(r2_record.last_psn),
            read_write.data.byte_count.eq(r2_record.byte_count),
            read_write.data.laddr.eq(r2_record.laddr),
            read_write.data.mtu.eq(r2_record.mtu),
            read_write.data.atomic.eq(r2_atomic),
            # A READ's PSNs span its byte count at the MTU (the executor's rule), so its
            # last response carries the rest: byte_count modulo the MTU, or a whole MTU.
            read_write.data.last_bytes.eq(Mux(r2_rest != 0, r2_rest,
                                              Mux(r2_record.byte_count == 0, 0,
                                                  Const(128, 13) << r2_record.mtu))),
            read_write.en.eq(r2_reads),
        ]
        with m.If(r2_reads):
            m.d.comb += r_new.rtail.eq(r_tail.rtail + 1)
        # A record that becomes its QP's head marks the QP (the engine drops the mark if
        # the head cannot complete yet: an event marks it again).
        r_marks = r2_valid & r_count_is(0)

        # The engine stays on a QP (``cur_q``), issuing a completion for it every cycle
        # while the one in S leaves a record behind and the one in X completed and left
        # one; otherwise it takes the next marked QP (clearing its mark). Each completion
        # needs room in ``jobs`` for itself and those ahead of it.
        cur_active = Signal()
        cur_q = Signal(range(max(num_qps, 2)))
        cur_onehot = Signal(num_qps, init=1)    # bit cur_q: the round robin's last grant
        any_marked = marked.any()
        pick_onehot = round_robin_pick(m, marked, next_mask(cur_onehot), name="qp_rr")
        pick = one_hot_index(pick_onehot)

        # I: events first (their queues are short and the link does not wait), then timer
        # scans when one is due, then completions, then scans.
        vl_mask = Signal(num_vls, init=mask_after(0, num_vls))
        event_ready = Cat(events.valid for events in decoder.events)
        any_event = event_ready.any()
        event_pick = round_robin_pick(m, event_ready, vl_mask, name="vl_rr")
        event = ResponseEventLayout()(Array(events.payload for events in decoder.events)[
            one_hot_index(event_pick)])
        for v, events in enumerate(decoder.events):
            m.d.comb += events.ready.eq(event_pick[v])
        with m.If(any_event):
            m.d.sync += vl_mask.eq(next_mask(event_pick))

        # Timer scans walk the QPs; while the engine is busy, one goes in every
        # SCAN_INTERVAL cycles, so each QP is looked at least every
        # SCAN_INTERVAL * num_qps cycles (1024 with 64 QPs, under one tick).
        scan_q = Signal(range(max(num_qps, 2)))
        since_scan = Signal(range(SCAN_INTERVAL + 1))
        scan_due = since_scan == SCAN_INTERVAL
        s_short = Signal()              # S's QP has fewer than 2 records
        drained = Signal()
        on_cur = cur_active & (cur_q == x_q)
        cur_done = x_cmp & on_cur & (~complete | drained)
        cur_go = cur_active & ~cur_done & ~(s_cmp & (s_q == cur_q) & s_short)
        jobs_room = writer.job_level + s_cmp + x_cmp < JOB_DEPTH - 1
        cmp_request = jobs_room & (cur_go | any_marked)
        issue_scan = ~any_event & (scan_due | ~cmp_request)
        issue_cmp = ~any_event & cmp_request & ~scan_due

        i_q = Signal(range(max(num_qps, 2)))
        with m.If(any_event):
            m.d.comb += i_q.eq(event.qpn[:qp_bits])
        with m.Elif(issue_scan):
            m.d.comb += i_q.eq(scan_q)
        with m.Else():
            m.d.comb += i_q.eq(Mux(cur_go, cur_q, pick))
        with m.If(issue_scan):
            m.d.sync += [scan_q.eq(Mux(scan_q == num_qps - 1, 0, scan_q + 1)), since_scan.eq(0)]
        with m.Elif(~scan_due):
            m.d.sync += since_scan.eq(since_scan + 1)
        m.d.comb += [state_read.addr.eq(i_q), engine_tail_read.addr.eq(i_q),
                     engine_wire_read.addr.eq(i_q)]
        m.d.sync += [
            s_ev.eq(any_event), s_cmp.eq(issue_cmp), s_scan.eq(issue_scan),
            s_q.eq(i_q), s_event.eq(event),
        ]

        # S: the row as X leaves it, else as reset, else as read; the tail row as R2
        # leaves it, else as reset, else as read; PSNs from the first SENT record until
        # the row holds them.
        s_row = Signal(state_layout)
        s_tail = Signal(tail_layout)
        s_state = Signal(state_layout)
        x_same = (x_ev | x_cmp | x_scan) & (x_q == s_q)
        with m.If(x_same):
            with m.If(~x_killed):
                m.d.comb += s_row.eq(x_new)
        with m.Elif(~fresh.bit_select(s_q, 1)):
            m.d.comb += s_row.eq(state_read.data)
        with m.If(r2_valid & (r2_q == s_q)):
            m.d.comb += s_tail.eq(r_new)
        with m.Elif(~tail_fresh.bit_select(s_q, 1)):
            m.d.comb += s_tail.eq(engine_tail_read.data)
        m.d.comb += [
            s_state.eq(s_row),
            s_state.primed.eq(s_row.primed | s_tail.started),
        ]
        with m.If(~s_row.primed):
            m.d.comb += [
                s_state.ack_psn.eq(s_tail.base_psn),
                s_state.read_psn.eq(s_tail.base_psn),
                s_state.atomic_psn.eq(s_tail.base_psn),
            ]
        m.d.comb += [
            rec_read.addr.eq(Cat(s_state.head[:slot_bits], s_q)),
            read_read.addr.eq(Cat(s_state.rhead[:slot_bits], s_q)),
        ]
        # Fewer than 2 records, and the ticks elapsed since the stamp as X will see them:
        # found against the row as read and against X's row, both registers, and chosen by
        # X's outcome last (its completion; whether it stamps the row, with ``now``).
        s_count_read = (s_tail.tail - Mux(fresh.bit_select(s_q, 1), 0,
                                          state_read.data.head))[:count_bits]
        s_count_x = (s_tail.tail - x_state.head)[:count_bits]     # before X's completion
        m.d.comb += s_short.eq(Mux(x_same, Mux(x_killed, s_tail.tail < 2,
                                               Mux(complete, s_count_x < 3, s_count_x < 2)),
                                   s_count_read < 2))
        elapsed_read = lookahead_sum(m, now_next, ~state_read.data.stamp, 1,
                                     name="elapsed_read")[:TIMER_BITS]
        elapsed_x = lookahead_sum(m, now_next, ~x_state.stamp, 1, name="elapsed_x")[:TIMER_BITS]
        s_elapsed = Signal(TIMER_BITS)
        with m.If(x_same & ~x_killed):
            m.d.comb += s_elapsed.eq(Mux(x_stamps, ticks, elapsed_x))
        with m.Elif(x_same | fresh.bit_select(s_q, 1)):
            m.d.comb += s_elapsed.eq(now_next)
        with m.Else():
            m.d.comb += s_elapsed.eq(elapsed_read)
        # The event's PSN has been on the wire: decided here, so X's acceptance only
        # adds a register.
        s_on_wire = ~wire_fresh.bit_select(s_q, 1) & _psn_le(s_event.psn, engine_wire_read.data)
        m.d.sync += [
            x_ev.eq(s_ev), x_cmp.eq(s_cmp), x_scan.eq(s_scan),
            x_q.eq(s_q), x_qmask.eq(onehot(s_q, 1)), x_event.eq(s_event),
            x_psn_less_one.eq(s_event.psn - 1),
            x_elapsed.eq(s_elapsed),
            x_state.eq(s_state), x_tail.eq(s_tail),
            x_flushing.eq(flushing.bit_select(s_q, 1)
                          | (x_same & ~x_killed & x_sets_flushing)),
            # ``reset_valid`` is now a reset in its issue cycle. One in its S cycle reaches
            # the flags along with its writes, and wins.
            x_killed.eq(reset_valid & (reset_q == s_q)),
            # The QP's state as the operation reads its rows (S), not where it is picked.
            x_in_reset.eq(in_reset.bit_select(s_q, 1)),
            x_in_err.eq(in_err.bit_select(s_q, 1)),
            x_on_wire.eq(s_on_wire),
            x_sent_since.eq(sent_since_scan.bit_select(s_q, 1)),
        ]

        # X
        st = x_state
        m.d.comb += [
            x_new.eq(st),
            state_write.addr.eq(x_q),
            state_write.data.eq(x_new),
            state_write.en.eq(x_writes),
        ]
        x_marks = Signal()

        # X: the head record, read in S, for every operation.
        head_rec = rec_read.data
        head_valid = st.head != x_tail.tail
        last_psn = head_rec.last_psn
        first_psn = head_rec.first_psn
        opcode = head_rec.opcode
        head_sent = head_valid & (head_rec.status == CompletionStatus.SENT)
        head_is_read = head_sent & (opcode == MlxOpcode.RDMA_READ.value)
        head_is_atomic = head_sent & _is_atomic(opcode)
        can, error, syndrome, nak_error = _head_outcome(m, head_rec, st, x_flushing, "head")

        # X, event for QP q at PSN p.
        p = x_event.psn
        accept = Signal()
        m.d.comb += accept.eq(
            x_ev & ~x_in_reset & x_tail.started & ~st.nak_pending & ~x_flushing
            & _psn_lt(st.ack_psn, p) & _psn_le(p, x_tail.sent_psn) & x_on_wire)
        ev_kind = x_event.syndrome[5:8]
        ev_code = x_event.syndrome[0:5]
        ev_ack = Signal()
        ev_nak = Signal()
        ev_fatal = Signal()
        ev_seq_nak = Signal()
        ev_rnr = Signal()
        ev_read = Signal()
        ev_atomic = Signal()
        with m.If(accept):
            with m.Switch(x_event.opcode):
                with m.Case(ACKNOWLEDGE):
                    m.d.comb += [
                        ev_ack.eq(ev_kind == AETH_ACK),
                        ev_nak.eq(ev_kind != AETH_ACK),
                        ev_fatal.eq((ev_kind == AETH_NAK) & (ev_code >= 1) & (ev_code <= 3)),
                        ev_seq_nak.eq((ev_kind == AETH_NAK) & (ev_code == 0)),
                        ev_rnr.eq(ev_kind == AETH_RNR_NAK),
                    ]
                with m.Case(READ_FIRST, READ_MIDDLE, READ_LAST, READ_ONLY):
                    m.d.comb += ev_read.eq(1)
                with m.Case(ATOMIC_ACKNOWLEDGE):
                    m.d.comb += ev_atomic.eq(1)

        # Responses with data refer to R, the QP's oldest READ/atomic whose responses have
        # not all come. One is taken at the next PSN (``ack_psn + 1``) inside R, or at R's
        # first PSN beyond it (it acknowledges the requests before R, as IBA allows), with
        # the opcode and length of its position in R; its payload then lands.
        rd = read_read.data
        rd_valid = st.rhead != x_tail.rtail
        index = Signal(PSN_BITS)
        m.d.comb += index.eq(p - rd.first_psn)
        at_first = p == rd.first_psn
        at_last = p == rd.last_psn
        want_opcode = Mux(at_first & at_last, READ_ONLY,
                          Mux(at_first, READ_FIRST, Mux(at_last, READ_LAST, READ_MIDDLE)))
        want_bytes = Mux(at_last, rd.last_bytes, Const(128, 13) << rd.mtu)
        # An accepted event is after ``ack_psn``, so it is after the next PSN unless it is
        # the next one (``p - ack_psn - 1 == 0``, found without a carry chain).
        p_is_next = _sum_is_zero(p, ~st.ack_psn)
        in_position = ((p_is_next & _psn_le(rd.first_psn, p) & _psn_le(p, rd.last_psn))
                       | (at_first & ~p_is_next))
        take_read = Signal()
        take_atomic = Signal()
        m.d.comb += [
            take_read.eq(ev_read & rd_valid & ~rd.atomic & in_position
                         & (x_event.opcode == want_opcode)
                         & (x_event.payload_bytes == want_bytes)),
            take_atomic.eq(ev_atomic & rd_valid & rd.atomic & at_first),
        ]
        taken = take_read | take_atomic
        # A response past the next PSN that is not R's first: the ones before it went
        # missing. An ACK covering R: R's responses went missing.
        missing = (ev_read | ev_atomic) & ~taken & ~p_is_next
        response_gap = missing | (ev_ack & rd_valid & _psn_le(rd.first_psn, p))
        # Neither taken nor telling of a loss: a response that does not fit.
        misfit = (ev_read | ev_atomic) & ~taken & ~missing

        # The event's acknowledged PSN, apart from the row.
        event_ack = Signal(PSN_BITS)
        m.d.comb += event_ack.eq(st.ack_psn)
        with m.If(ev_ack):
            m.d.comb += [event_ack.eq(p), x_marks.eq(1)]
        with m.If(taken):
            m.d.comb += [event_ack.eq(p), x_new.data_seq.eq(x_event.seq), x_marks.eq(1)]
            with m.If(at_last):
                m.d.comb += x_new.rhead.eq(st.rhead + 1)
        with m.If(take_read & at_last):
            m.d.comb += x_new.read_psn.eq(p)
        with m.If(take_atomic):
            m.d.comb += x_new.atomic_psn.eq(p)
        # A fatal NAK past R: R's responses went missing and will not come again (the
        # responder's QP is in error), so the error lands on R.
        nak_at_r = rd_valid & _psn_lt(rd.first_psn, p)
        nak_at = Signal(PSN_BITS)
        m.d.comb += nak_at.eq(Mux(nak_at_r, rd.first_psn, p))
        with m.If(ev_fatal):
            m.d.comb += [
                event_ack.eq(Mux(nak_at_r, rd.first_psn - 1, x_psn_less_one)),
                x_new.nak_pending.eq(1),
                x_new.nak_psn.eq(nak_at),
                x_marks.eq(1),
            ]
            with m.Switch(ev_code):
                for nak_code, nak_syn in NAK_FATAL.items():
                    with m.Case(nak_code):
                        m.d.comb += x_new.nak_syndrome.eq(nak_syn)
        with m.If(ev_seq_nak | ev_rnr):
            m.d.comb += [event_ack.eq(x_psn_less_one), x_marks.eq(1)]
        # After a rewind, NAKs and gaps caused by packets sent before it are stale.
        with m.If((ev_seq_nak | response_gap) & ~st.gap_seen):
            m.d.comb += [x_new.rewind_pending.eq(1), x_marks.eq(1)]
        m.d.comb += x_new.ack_psn.eq(event_ack)
        # Progress: ``ack_psn`` moves forward. An accepted event is after it, so an ACK or
        # a taken response is progress, ``p - 1`` is unless p is the next PSN, and R's
        # ``first_psn - 1`` is compared apart, beside the choice.
        progress = (ev_ack | taken | ((ev_seq_nak | ev_rnr) & ~p_is_next)
                    | (ev_fatal & Mux(nak_at_r, _psn_lt(st.ack_psn, (rd.first_psn - 1)[:PSN_BITS]),
                                      ~p_is_next)))
        with m.If(progress):
            m.d.comb += [x_new.retries_used.eq(0), x_new.rnr_used.eq(0),
                         x_new.gap_seen.eq(0), x_new.armed.eq(0)]
        with m.If(ev_rnr):
            m.d.comb += [x_new.rnr_pending.eq(1), x_new.rnr_code.eq(ev_code),
                         x_new.armed.eq(1), x_new.stamp.eq(now), x_stamps.eq(1)]

        # Every stored response gets one verdict (a reset in its issue cycle included), two
        # cycles after X: V1 shifts the response's index in R by the MTU, V2 adds ``laddr``.
        v1 = Signal(ResponseVerdictLayout())
        v1_valid = Signal()
        v1_index = Signal(PSN_BITS)
        v1_mtu = Signal(3)
        v1_laddr = Signal(64)
        v2 = Signal(ResponseVerdictLayout())
        v2_valid = Signal()
        v2_offset = Signal(PSN_BITS + 12)
        v2_laddr = Signal(64)
        stored_event = x_ev & x_event.opcode.matches(*STORED_OPCODES)
        m.d.sync += [
            v1_valid.eq(stored_event),
            v1.seq.eq(x_event.seq),
            v1.write.eq(taken & ~x_killed & (x_event.payload_bytes != 0)),
            # A 4-byte atomic's original value lands big-endian, as NVSHMEM reads it: the
            # ResponseWriter keeps those 4 wire bytes where the stored copy's ICRC was.
            v1.bytes.eq(Mux(rd.atomic & rd.byte_count[2], 4, x_event.payload_bytes)),
            v1.offset.eq(Mux(x_event.opcode == READ_MIDDLE, LRH_BTH_BYTES,
                             Mux(rd.atomic & rd.byte_count[2], ORIG_WORD4_BYTE,
                                 LRH_BTH_BYTES + AETH_BYTES))),
            v1_index.eq(index), v1_mtu.eq(rd.mtu), v1_laddr.eq(rd.laddr),
            v2_valid.eq(v1_valid), v2.eq(v1),
            v2_offset.eq((v1_index << 7) << v1_mtu), v2_laddr.eq(v1_laddr),
            self.verdict.valid.eq(v2_valid),
            self.verdict.payload.eq(v2),
            self.verdict.payload.addr.eq(
                lookahead_sum(m, v2_laddr, v2_offset, name="verdict_addr")[:64]),
        ]

        # X, completion of the head.
        x_not_full = Signal()
        m.d.comb += [
            complete.eq(x_cmp & head_valid & can),
            drained.eq((st.head + 1)[:count_bits] == x_tail.tail),
            x_not_full.eq((x_tail.tail - st.head)[:count_bits] != QUEUE_DEPTH),
        ]

        job = writer.job.payload
        m.d.comb += [
            writer.job.valid.eq(complete),
            job.qpn.eq(head_rec.qpn),
            job.cqn.eq(head_rec.cqn),
            job.wqe_index.eq(head_rec.wqe_index),
            job.wqe_blocks.eq(head_rec.wqe_blocks),
            job.opcode.eq(opcode),
            job.byte_count.eq(head_rec.byte_count),
            job.error.eq(error),
            job.syndrome.eq(syndrome),
            job.write_cqe.eq((error | head_rec.signaled) & (head_rec.cqn < self.num_cqs)),
            # Its CQE must not overtake its data: it waits until that response landed.
            job.wait_data.eq(~error & (head_is_read | head_is_atomic)),
            job.data_seq.eq(st.data_seq),
            job.next_psn.eq(Mux(head_sent, last_psn + 1, 0)),
        ]
        m.d.sync += [self.qp_error.valid.eq(complete & nak_error), self.qp_error.qpn.eq(x_q)]
        with m.If(complete):
            m.d.comb += x_new.head.eq(st.head + 1)
            with m.If(nak_error):
                m.d.comb += [x_new.nak_pending.eq(0), x_sets_flushing.eq(1)]
            with m.If(~error):
                with m.If(_psn_lt(st.read_psn, last_psn)):
                    m.d.comb += x_new.read_psn.eq(last_psn)
                with m.If(_psn_lt(st.atomic_psn, last_psn)):
                    m.d.comb += x_new.atomic_psn.eq(last_psn)

        # X, retransmission. The head is stuck when it is SENT and not acknowledged. A
        # scan arms the timer on a stuck head, and restarts it if a packet of the QP went
        # out since its last scan (a record now comes with its message's first packet,
        # and the timer covers packets sent); it fires after 2**ack_timeout ticks without
        # progress or a packet sent; an RNR NAK's wait runs on the same stamp.
        stuck = head_valid & ~can & ~x_in_reset & x_tail.started
        elapsed = x_elapsed
        # ``elapsed >= 2**min(ack_timeout, 19)``: a bit set at or above the exponent.
        waited = Cat(*(elapsed[i] & (head_rec.ack_timeout <= i)
                       for i in range(MAX_TIMEOUT_EXPONENT)), elapsed[MAX_TIMEOUT_EXPONENT:]).any()
        timed_out = st.armed & ~x_sent_since & (head_rec.ack_timeout != 0) & waited
        rnr_ticks = Array(Const(t, TIMER_BITS) for t in RNR_TIMER_TICKS)[st.rnr_code]
        do_rnr = x_scan & stuck & st.rnr_pending & (elapsed >= rnr_ticks)
        do_nak = (x_cmp | x_scan) & stuck & ~st.rnr_pending & st.rewind_pending
        do_timeout = x_scan & stuck & ~st.rnr_pending & ~st.rewind_pending & timed_out
        with m.If(x_scan & stuck & (~st.armed | x_sent_since) & ~st.rnr_pending):
            m.d.comb += [x_new.armed.eq(1), x_new.stamp.eq(now), x_stamps.eq(1)]
        with m.If(x_scan & ~head_valid):
            m.d.comb += x_new.armed.eq(0)
        with m.If(x_scan & head_valid & can):
            m.d.comb += x_marks.eq(1)

        retries_out = Mux(do_rnr,
                          (head_rec.rnr_retry != RNR_INFINITE) & (st.rnr_used >= head_rec.rnr_retry),
                          st.retries_used >= head_rec.retry_cnt)
        rewinds = Signal()
        exhausted = Signal()
        with m.If(do_rnr | do_nak | do_timeout):
            m.d.comb += [x_new.rewind_pending.eq(0), x_new.rnr_pending.eq(0),
                         x_new.armed.eq(0), x_marks.eq(1)]
            with m.If(x_in_err | x_flushing):
                # A QP in ERR does not send again: what it waits for is flushed.
                m.d.comb += x_sets_flushing.eq(1)
            with m.Elif(retries_out):
                m.d.comb += [
                    exhausted.eq(1),
                    x_new.nak_pending.eq(1),
                    x_new.nak_psn.eq(first_psn),
                    x_new.nak_syndrome.eq(Mux(do_rnr, Syndrome.RNR_RETRY_EXC_ERR,
                                              Syndrome.TRANSPORT_RETRY_EXC_ERR)),
                ]
            with m.Else():
                m.d.comb += [
                    rewinds.eq(1),
                    x_new.ack_psn.eq(first_psn - 1),
                    x_new.read_psn.eq(first_psn - 1),
                    x_new.atomic_psn.eq(first_psn - 1),
                    x_new.gap_seen.eq(1),
                ]
                with m.If(do_rnr):
                    m.d.comb += x_new.rnr_used.eq(st.rnr_used + 1)
                with m.Else():
                    m.d.comb += x_new.retries_used.eq(st.retries_used + 1)
        m.d.sync += [
            self.rewind.valid.eq(rewinds & ~x_killed),
            self.rewind.payload.qpn.eq(x_q),
            self.rewind.payload.wqe_index.eq(head_rec.wqe_index),
            self.rewind.payload.psn.eq(first_psn),
        ]

        with m.If(complete & ~on_cur & ~drained):
            # The engine has left the QP meanwhile: come back for its next head.
            m.d.comb += x_marks.eq(1)
        with m.If(cur_done):
            m.d.sync += cur_active.eq(0)
        with m.If(issue_cmp & ~cur_go):
            m.d.sync += [cur_active.eq(1), cur_q.eq(pick), cur_onehot.eq(pick_onehot)]

        # --- Per-QP flags; a qp_reset wins over everything else in its cycle ---
        x_mask = Mux(x_writes, x_qmask, 0)
        # The host moved the QP to ERR (``flush_mask``): nothing it waits for will be
        # retransmitted.
        r2_mask = Mux(r2_valid, r2_qmask, 0)
        m.d.sync += [
            marked.eq(((marked & ~Mux(issue_cmp & ~cur_go, pick_onehot, 0))
                       | Mux(x_marks, x_mask, 0) | Mux(r_marks, r2_mask, 0)
                       | flush_mask) & ~reset_mask),
            flushing.eq((flushing | Mux(x_sets_flushing, x_mask, 0) | flush_mask) & ~reset_mask),
            # R2's count has X's completion of this cycle; X's completion leaves fewer than
            # QUEUE_DEPTH - 1 unless the queue was full (X's tail has no record R2 writes
            # now, so it is not full when R2 is on its QP: R2's count decides).
            nearly_full.eq(((nearly_full & ~Mux(complete & x_not_full, x_mask, 0))
                            | Mux(r2_nearly_full, r2_mask, 0)) & ~reset_mask),
            fresh.eq((fresh & ~x_mask) | reset_mask),
            tail_fresh.eq((tail_fresh & ~r2_mask) | reset_mask),
            wire_fresh.eq((wire_fresh & ~onehot(w2_q, w2_valid)) | reset_mask),
            # A scan in S takes the flag to X; a packet sent in that cycle sets it again.
            sent_since_scan.eq(((sent_since_scan & ~onehot(s_q, s_scan))
                                | onehot(sent_q, sent_valid)) & ~reset_mask),
        ]

        # --- Counters: each counts a registered event, a cycle after it; the two that count
        # several events a cycle register their sum too, two cycles after them ---
        for counter, event in ((self.acks_received, ev_ack),
                               (self.naks_received, ev_nak),
                               (self.read_responses, ev_read & ~misfit),
                               (self.atomic_acks, ev_atomic & ~misfit),
                               (self.retransmits_nak, rewinds & do_nak & ~x_killed),
                               (self.retransmits_timeout, rewinds & do_timeout & ~x_killed),
                               (self.retransmits_rnr, rewinds & do_rnr & ~x_killed),
                               (self.retries_exhausted, exhausted & ~x_killed)):
            count_registered(m, counter, event)
        count_registered_sum(m, self.rx_dropped_unexpected, [x_ev & ~accept, misfit],
                             registered=[decoder.malformed[v] for v in range(num_vls)])
        return m
