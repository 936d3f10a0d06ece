"""The CompletionUnit's bench (hdl/nic/completion_unit.py): a Python reference, records and
responses driven cycle by cycle in Amaranth's simulator; tb/test_completion_unit.py and
tb/test_completion_unit_receive.py run their tests on it.

One testbench drives the unit cycle by cycle. The reference keeps, per QP, the queue of
records the unit accepted, ``sent_psn``/``wire_psn``/``ack_psn``/``read_psn``/``atomic_psn``, a pending
fatal NAK, the flushing flag, the reliability state (``gap_seen``, both retry counters)
and R's queue (the SENT READ/atomic records whose responses have not all been taken), and
completes head records by the rules of docs/nic.md and docs/nic-reliability.md (as the
unit's docstring states them exactly). Responses are real packets (models/packet.py, with
ICRC), applied to the reference when they are queued for the unit; ``sent`` strobes one
per cycle, by default (``auto_sent``) one for each SENT record's last PSN in the cycle
after the unit took it (every packet of the record on the wire, as before records came
with a message's first packet; the reference moves ``wire_psn`` as the record is taken),
else only those a test queues on ``sent_due``, applied to the reference as they are
driven; all packets about one
QP's state travel on that QP's VL, so the unit sees them in the order the reference
applied them, and a response only ever refers to records the unit already took. A rewind
the reference finds due (sequence NAK, response gap, an ACK covering R, the end of an RNR
wait) it applies at once and expects on ``rewind`` (qpn, the head's wqe_index and
first_psn), in order, exactly once; meanwhile nothing more is sent for that QP (as a
responder that waits for the retransmission), so whenever the unit rewinds, it is the same
rewind. With ``timeouts`` (the timer tests) a rewind the reference did not expect must be
a due timeout.

The bench plays the ResponseWriter: each packet with a stored opcode (READ response,
ATOMIC ACKNOWLEDGE) starts only while no other VL's stored packet is passing, gets the next
sequence number on ``rx_seq[vl]`` for all its beats, and must get exactly one decision:
``discard`` for a bad ICRC, end_bad or malformed one, a ``verdict`` without write for a
well-formed one not taken, for a taken one a verdict writing ``bytes`` = its payload
length from ``offset`` (20 for READ MIDDLE, else 24) at ``R.laddr + (p - R.first_psn) *
MTU`` (an atomic's 8 bytes at ``R.laddr``; a READ response without payload writes
nothing). ``landed`` follows the decisions in sequence order, each packet a random delay
(0..24 cycles) after its decision; the retire of a READ or atomic completed OK must come
at least 2 cycles (CQE writer P, O) after ``landed`` passed its last response.
"""
from collections import deque
from dataclasses import dataclass

from amaranth.sim import Simulator

from hdl.link.signatures import BeatLayout
from hdl.nic.completion_unit import CompletionUnit
from hdl.nic.signatures import (
    CompletionRecordLayout, CqConfigLayout, QpState, ReceiveCompletionLayout,
)
from models import mlx5
from models.crc import icrc_bytes
from models.ib import AETH, BTH, AtomicAckETH, Opcode
from models.nic import read_response_opcode
from models.packet import build_packet
from tb.amaranth_sim import Driver

M24 = 1 << 24
WIDTH = 64
BEAT = BeatLayout(WIDTH)

WRITE, WRITE_IMM, SEND, SEND_IMM, READ, ATOMIC_CS, ATOMIC_FA = 0x08, 0x09, 0x0A, 0x0B, 0x10, 0x11, 0x12
ATOMICS = (ATOMIC_CS, ATOMIC_FA)
SENT, ERROR, FLUSH = 0, 1, 2
WR_FLUSH_ERR = 0x05
NAK_SYNDROME = {1: 0x12, 2: 0x13, 3: 0x14}
TRANSPORT_RETRY_EXC_ERR, RNR_RETRY_EXC_ERR = 0x15, 0x16
# READ responses and ATOMIC ACKNOWLEDGE: the ResponseWriter stores them
STORED_OPCODES = (0x0D, 0x0E, 0x0F, 0x10, 0x12)
LOCAL_SYNDROMES = (0x01, 0x02, 0x04)
RESP_WR_IMM, RESP_SEND, RESP_SEND_IMM, RESP_ERR = 1, 2, 3, 14
RECV_OPCODES = (RESP_WR_IMM, RESP_SEND, RESP_SEND_IMM, RESP_ERR)


def le(a, b):
    return (b - a) % M24 < (1 << 23)


def lt(a, b):
    return a != b and le(a, b)


# --- Reference --------------------------------------------------------------------------------

@dataclass
class Rec:
    qpn: int
    cqn: int
    wqe_index: int
    wqe_blocks: int
    opcode: int
    byte_count: int
    first_psn: int
    last_psn: int
    signaled: int
    status: int
    syndrome: int = 1
    laddr: int = 0
    mtu: int = 1
    retry_cnt: int = 7
    rnr_retry: int = 7
    ack_timeout: int = 0
    # filled in by the reference at completion
    error: bool = False
    cqe_syndrome: int = 0
    write_cqe: bool = False
    nak_error: bool = False
    qp_error_seen: bool = False
    data: object = None     # READ/atomic: its last response taken (Stored); its CQE waits for it

    def payload(self):
        return {k: getattr(self, k) for k in (
            "qpn", "cqn", "wqe_index", "wqe_blocks", "opcode", "byte_count", "first_psn",
            "last_psn", "signaled", "status", "syndrome", "laddr", "mtu", "retry_cnt",
            "rnr_retry", "ack_timeout")}

    def mtu_bytes(self):
        return 128 << self.mtu

    def read_packets(self):
        return (self.last_psn - self.first_psn) % M24 + 1

    def read_payload_bytes(self, k):
        """Payload bytes of READ response packet ``k`` (of ``read_packets()``)."""
        n = self.read_packets()
        return self.mtu_bytes() if k < n - 1 else self.byte_count - (n - 1) * self.mtu_bytes()


class Stored:
    """A packet the ResponseWriter stores (READ response, ATOMIC ACKNOWLEDGE): the decision
    the unit must give it, its sequence number once its beats pass, when it was decided."""
    def __init__(self, expect):
        # "discard" (strobe), "nowrite" (verdict without write), "reject" (either), or
        # ("write", addr, bytes, offset)
        self.expect = expect
        self.seq = None
        self.ended = None
        self.decided = None
        self.delay = 0
        self.info = None            # (qpn, opcode, psn, length), for messages


class QpRef:
    def __init__(self):
        self.reset()

    def reset(self):
        self.queue = deque()
        self.started = False
        self.on_wire = False            # a packet was sent since reset
        self.sent = self.wire = self.ack = self.read = self.atomic = 0
        self.nak = None
        self.flushing = False
        self.gap_seen = False
        self.retries = self.rnr_used = 0
        # SENT READ/atomic records whose responses have not all been taken; the oldest is R
        self.reads = deque()


class Reference:
    def __init__(self, num_qps, num_cqs, qp_states):
        self.num_qps = num_qps
        self.num_cqs = num_cqs
        self.qp_states = qp_states
        self.qps = [QpRef() for _ in range(num_qps)]
        self.completed = [deque() for _ in range(num_qps)]     # completed, not yet retired
        self.rewinds = [deque() for _ in range(num_qps)]       # (wqe_index, psn) due, not seen
        self.holder = None          # the Stored of the last packet given to ``packet``
        self.counters = dict.fromkeys((
            "acks_received", "naks_received", "read_responses", "atomic_acks", "cqes_written",
            "error_cqes", "rx_dropped_icrc", "rx_dropped_unexpected", "cqe_write_errors",
            "recv_cqes", "retransmits_nak", "retransmits_timeout", "retransmits_rnr",
            "retries_exhausted"), 0)

    def enqueue(self, rec):
        if rec.qpn >= self.num_qps:
            return
        qp = self.qps[rec.qpn]
        qp.queue.append(rec)
        if rec.status == SENT:
            if not qp.started:
                qp.ack = qp.read = qp.atomic = (rec.first_psn - 1) % M24
                qp.started = True
            qp.sent = rec.last_psn
            if rec.opcode == READ or rec.opcode in ATOMICS:
                qp.reads.append(rec)
        self.advance(rec.qpn)

    def flush(self, q):
        self.qps[q].flushing = True
        self.advance(q)

    def packet_sent(self, q, psn):
        """A ``sent`` strobe: ``wire_psn`` moves to ``psn`` unless that is a resend below it."""
        qp = self.qps[q]
        if not qp.on_wire or lt(qp.wire, psn):
            qp.wire = psn
        qp.on_wire = True

    def packet(self, destqp, opcode, psn, syndrome, payload_len=0):
        """A well-formed response with a good ICRC; returns whether it was accepted (its PSN
        in the window of a QP that takes responses). ``self.holder`` is the Stored of a READ
        response or ATOMIC ACKNOWLEDGE, with the decision the unit must give it."""
        c = self.counters
        stored = opcode in STORED_OPCODES
        self.holder = Stored("nowrite") if stored else None
        qp = self.qps[destqp] if destqp < self.num_qps else None
        if (qp is None or self.qp_states[destqp] == QpState.RESET or not qp.started
                or qp.nak is not None or qp.flushing
                or not (lt(qp.ack, psn) and le(psn, qp.sent))
                or not qp.on_wire or not le(psn, qp.wire)):
            c["rx_dropped_unexpected"] += 1
            return False
        kind, code = syndrome >> 5, syndrome & 31
        old_ack = qp.ack
        due = None
        if opcode == Opcode.ACKNOWLEDGE:
            if kind == 0:
                c["acks_received"] += 1
                qp.ack = psn
                if qp.reads and le(qp.reads[0].first_psn, psn) and not qp.gap_seen:
                    due = "nak"     # it covers R: R's responses went missing
            else:
                c["naks_received"] += 1
                if kind == 3 and code in NAK_SYNDROME:
                    if qp.reads and lt(qp.reads[0].first_psn, psn):
                        psn = qp.reads[0].first_psn     # R never got its data: it errors
                    qp.ack = (psn - 1) % M24
                    qp.nak = (psn, NAK_SYNDROME[code])
                elif kind == 3 and code == 0:
                    qp.ack = (psn - 1) % M24
                    if not qp.gap_seen:
                        due = "nak"
                elif kind == 1:
                    qp.ack = (psn - 1) % M24
                    due = "rnr"
        else:
            r = qp.reads[0] if qp.reads else None
            nxt = (qp.ack + 1) % M24
            taken = False
            if r is not None and (psn == nxt and le(r.first_psn, psn) and le(psn, r.last_psn)
                                  or psn == r.first_psn and lt(nxt, psn)):
                if opcode == Opcode.ATOMIC_ACKNOWLEDGE:
                    if r.opcode in ATOMICS:
                        taken = True
                        qp.atomic = psn
                        self.holder.expect = ("write", r.laddr, 8, 24)
                elif r.opcode == READ:
                    k = (psn - r.first_psn) % M24
                    n = r.read_packets()
                    if (opcode == read_response_opcode(k, n)
                            and payload_len == r.read_payload_bytes(k)):
                        taken = True
                        if k == n - 1:
                            qp.read = psn
                        addr = (r.laddr + k * r.mtu_bytes()) % (1 << 64)
                        offset = 20 if opcode == Opcode.RDMA_READ_RESPONSE_MIDDLE else 24
                        if payload_len:
                            self.holder.expect = ("write", addr, payload_len, offset)
            if taken and psn == r.last_psn:
                qp.reads.popleft()
                r.data = self.holder
            missing = not taken and lt((qp.ack + 1) % M24, psn)
            if taken or missing:
                c["atomic_acks" if opcode == Opcode.ATOMIC_ACKNOWLEDGE else "read_responses"] += 1
            else:
                c["rx_dropped_unexpected"] += 1     # it does not fit
            if taken:
                qp.ack = psn
            elif missing and not qp.gap_seen:
                due = "nak"     # the responses before it went missing
        if lt(old_ack, qp.ack):
            qp.retries = qp.rnr_used = 0
            qp.gap_seen = False
        self.advance(destqp)
        if due is not None:
            # The responder sends nothing more for this QP until the rewind: whenever the
            # unit does it, it is the same one.
            self.due(destqp, due)
        return True

    def due(self, q, kind):
        """A rewind is due for QP ``q`` (``kind``: "nak", "rnr" or "timeout"), its head
        stuck. Returns "rewind" (then expected on ``rewind``), "exhausted" or "flush"."""
        qp = self.qps[q]
        assert qp.queue, ("a rewind due without a stuck head", q)
        h = qp.queue[0]
        if self.qp_states[q] == QpState.ERR or qp.flushing:
            qp.flushing = True
            self.advance(q)
            return "flush"
        if kind == "rnr":
            out = h.rnr_retry != 7 and qp.rnr_used >= h.rnr_retry
        else:
            out = qp.retries >= h.retry_cnt
        if out:
            self.counters["retries_exhausted"] += 1
            qp.nak = (h.first_psn, RNR_RETRY_EXC_ERR if kind == "rnr" else TRANSPORT_RETRY_EXC_ERR)
            self.advance(q)
            return "exhausted"
        qp.ack = qp.read = qp.atomic = (h.first_psn - 1) % M24
        if kind == "rnr":
            qp.rnr_used += 1
        else:
            qp.retries += 1
        qp.gap_seen = True
        self.counters["retransmits_" + kind] += 1
        self.rewinds[q].append((h.wqe_index, h.first_psn))
        return "rewind"

    def advance(self, q):
        qp = self.qps[q]
        while qp.queue:
            r = qp.queue[0]
            error, syndrome, nak_error = False, 0, False
            if qp.flushing:
                error, syndrome = True, WR_FLUSH_ERR
            elif r.status == ERROR:
                error, syndrome = True, r.syndrome
            elif r.status != SENT:
                error, syndrome = True, WR_FLUSH_ERR
            elif qp.nak is not None:
                if not lt(r.last_psn, qp.nak[0]):
                    error, syndrome, nak_error = True, qp.nak[1], True
            elif r.opcode == READ:
                if not le(r.last_psn, qp.read):
                    return
            elif r.opcode in ATOMICS:
                if not le(r.last_psn, qp.atomic):
                    return
            elif not le(r.last_psn, qp.ack):
                return
            qp.queue.popleft()
            if nak_error:
                qp.nak = None
                qp.flushing = True
            if not error:
                if lt(qp.read, r.last_psn):
                    qp.read = r.last_psn
                if lt(qp.atomic, r.last_psn):
                    qp.atomic = r.last_psn
            r.error, r.cqe_syndrome, r.nak_error = error, syndrome, nak_error
            r.write_cqe = bool((error or r.signaled) and r.cqn < self.num_cqs)
            self.completed[q].append(r)


def cqe_bytes(rec, owner):
    b = bytearray(64)
    b[56:60] = ((rec.opcode << 24) | rec.qpn).to_bytes(4, "big")
    b[60:62] = rec.wqe_index.to_bytes(2, "big")
    if rec.error:
        b[55] = rec.cqe_syndrome
        b[63] = 0xD0 | owner
    else:
        b[44:48] = rec.byte_count.to_bytes(4, "big")
        b[63] = owner
    # The host-side model of the same CQE (another engineer's code) must agree byte for byte.
    if rec.error:
        model = mlx5.build_error_cqe(rec.qpn, rec.wqe_index, rec.opcode, rec.cqe_syndrome, owner)
    else:
        model = mlx5.build_requester_cqe(rec.qpn, rec.wqe_index, rec.opcode, rec.byte_count, owner)
    assert model == bytes(b), (model.hex(), bytes(b).hex())
    return bytes(b)


@dataclass
class RecvRec:
    """A receive completion from the responder (``ReceiveCompletionLayout``)."""
    qpn: int
    cqn: int
    opcode: int
    byte_count: int = 0
    imm: int = 0
    wqe_counter: int = 0
    syndrome: int = 0

    def bits(self):
        """The record as ``ReceiveCompletionLayout`` bits (packed by hand: ``const``
        takes only the enums' members, and the bench also sends other opcodes)."""
        value = 0
        for name, field in ReceiveCompletionLayout():
            value |= (getattr(self, name) & ((1 << field.width) - 1)) << field.offset
        return value

    def writes(self, num_cqs):
        """Whether the unit writes a CQE for it: a receive opcode and a CQ it has."""
        return self.opcode in RECV_OPCODES and self.cqn < num_cqs


def recv_cqe_bytes(rec, owner):
    """``mlx5_cqe64`` (``mlx5_err_cqe`` for RESP_ERR) of a receive completion, from
    rdma-core's mlx5dv.h offsets, checked against models/mlx5.py's."""
    b = bytearray(64)
    b[56:60] = rec.qpn.to_bytes(4, "big")
    b[60:62] = rec.wqe_counter.to_bytes(2, "big")
    b[63] = rec.opcode << 4 | owner
    if rec.opcode == RESP_ERR:
        b[55] = rec.syndrome
    else:
        b[44:48] = rec.byte_count.to_bytes(4, "big")
        if rec.opcode != RESP_SEND:
            b[36:40] = rec.imm.to_bytes(4, "big")
    model = mlx5.build_responder_cqe(rec.qpn, rec.wqe_counter, rec.opcode, rec.byte_count,
                                     rec.imm, rec.syndrome, owner)
    assert model == bytes(b), (model.hex(), bytes(b).hex())
    return bytes(b)


# --- Packets ----------------------------------------------------------------------------------

def response(opcode, destqp, psn, syndrome=0, payload=b"", rng=None):
    ext = {
        Opcode.ACKNOWLEDGE: lambda: (AETH(syndrome=syndrome, msn=rng.getrandbits(24)),),
        Opcode.RDMA_READ_RESPONSE_FIRST: lambda: (AETH(syndrome=syndrome, msn=rng.getrandbits(24)),),
        Opcode.RDMA_READ_RESPONSE_MIDDLE: lambda: (),
        Opcode.RDMA_READ_RESPONSE_LAST: lambda: (AETH(syndrome=syndrome, msn=rng.getrandbits(24)),),
        Opcode.RDMA_READ_RESPONSE_ONLY: lambda: (AETH(syndrome=syndrome, msn=rng.getrandbits(24)),),
        Opcode.ATOMIC_ACKNOWLEDGE: lambda: (AETH(syndrome=syndrome, msn=rng.getrandbits(24)),
                                            AtomicAckETH(orig=rng.getrandbits(64))),
    }[opcode]()
    bth = BTH(opcode=opcode, destqp=destqp, psn=psn, pkey=rng.getrandbits(16),
              ackreq=rng.getrandbits(1))
    return build_packet(bth=bth, ext=ext, payload=payload, sl=rng.getrandbits(4),
                        vl=rng.getrandbits(4), dlid=rng.getrandbits(16), slid=rng.getrandbits(16))


def reseal(body):
    """``body`` (LRH .. pad) with a fresh, good ICRC."""
    return bytes(body) + icrc_bytes(bytes(body))


def beats_of(packet, end_bad=False):
    beats = []
    for offset in range(0, len(packet), WIDTH):
        chunk = packet[offset:offset + WIDTH]
        beats.append({"data": int.from_bytes(chunk, "little"), "start": int(offset == 0),
                      "end": int(offset + WIDTH >= len(packet)), "count": len(chunk),
                      "end_bad": int(end_bad and offset + WIDTH >= len(packet))})
    return beats


# --- Bench ------------------------------------------------------------------------------------

class Bench:
    def __init__(self, dut, rng, *, qp_states, cqs, p_rec=0.5, p_beat=0.7, p_aw=0.7, p_w=0.7,
                 b_delay=8, p_slverr=0.1, wire=True, p_recv=0.5, land_delay=24,
                 timeouts=False, auto_sent=True):
        self.dut = dut
        self.rng = rng
        self.t = 0
        self.qp_states = qp_states
        self.cqs = cqs                  # [(base, log_size, collapsed)]
        self.ref = Reference(dut.num_qps, dut.num_cqs, qp_states)
        self.to_offer = deque()
        self.offer = None
        self.rx = [deque() for _ in range(dut.num_vls)]     # per VL: (qpn or None, beats, Stored)
        self.rx_cur = [None] * dut.num_vls
        self.in_flight = [0] * dut.num_qps                  # packets about a QP not yet ended
        self.last_end = [-1000] * dut.num_qps
        self.outstanding = [0] * dut.num_qps                # accepted and not retired
        self.p_rec, self.p_beat, self.p_aw, self.p_w = p_rec, p_beat, p_aw, p_w
        self.b_delay, self.p_slverr = b_delay, p_slverr
        self.wire = wire
        self.aw = deque()
        self.w = deque()
        self.b_due = deque()
        self.b_cur = None
        self.cq_pi = [0] * dut.num_cqs
        self.cq_addr = 0
        self.retired = 0
        self.resets = deque()
        self.flushes = deque()
        self.ready_low = 0
        self._cache = {}
        self.drive = Driver()
        self.qp_errors = []
        self.retire_cycles = []
        # Receive completions: to offer, offered, taken by the unit (awaiting their CQEs).
        self.p_recv = p_recv
        self.recv_to_offer = deque()
        self.recv_offer = None
        self.recv_taken = deque()
        self.recv_cycles = []           # when each receive CQE's AW and W were both accepted
        self.recv_ready_low = 0
        self.cq_resets = deque()
        self.cqe_log = []               # (cqn, receive) of every CQE, in producer-index order
        # The ResponseWriter's part: stored packets in seq order, the VL passing one, how
        # many have landed (``landed`` is that count modulo 2^16), per cycle.
        self.stored = []
        self.stored_vl = None
        self.landed = 0
        self.landed_hist = []
        self.land_delay = land_delay
        self.decisions = 0
        # Rewinds seen: (cycle, qpn, wqe_index, psn); with ``timeouts``, a rewind the
        # reference did not expect is taken as the timer's.
        self.rewind_log = []
        self.timeouts = timeouts
        # ``sent`` strobes (qpn, psn) still to drive, one per cycle.
        self.auto_sent = auto_sent
        self.sent_due = deque()

    def drive_qp_states(self, ctx):
        """The QP states the bench was made with, on the unit's ``qp_state`` inputs."""
        for q, state in enumerate(self.qp_states):
            ctx.set(self.dut.qp_state[q], state)


    def queue_packet(self, vl, qpn, packet, end_bad=False, holder=None):
        """Queue ``packet`` on VL ``vl``; ``holder`` (a Stored) if the ResponseWriter
        stores it (BTH opcode a READ response or ATOMIC ACKNOWLEDGE)."""
        assert (holder is not None) == (packet[8] in STORED_OPCODES), (packet[8], holder)
        if holder is not None:
            holder.info = (qpn, packet[8], int.from_bytes(packet[17:20], "big"), len(packet))
        self.rx[vl].append((qpn, beats_of(packet, end_bad), holder))
        if qpn is not None and qpn < self.dut.num_qps:
            self.in_flight[qpn] += 1

    def respond(self, vl, q, opcode, psn, syndrome=0, payload=b""):
        """Queue a response on VL ``vl``, applied to the reference; returns whether it
        was accepted."""
        accepted = self.ref.packet(q, opcode, psn % M24, syndrome, len(payload))
        self.queue_packet(vl, q, response(opcode, q, psn % M24, syndrome, payload, self.rng),
                          holder=self.ref.holder)
        return accepted

    def quiet(self, q, cycles=30):
        return self.in_flight[q] == 0 and self.t - self.last_end[q] > cycles

    def idle(self):
        return (self.offer is None and not self.to_offer and not any(self.rx)
                and all(c is None for c in self.rx_cur) and not self.aw and not self.w
                and not self.b_due and self.b_cur is None
                and not any(self.ref.completed) and not self.resets and not self.flushes
                and self.recv_offer is None and not self.recv_to_offer and not self.cq_resets
                and not any(r.writes(self.dut.num_cqs) for r in self.recv_taken)
                and self.decisions == len(self.stored) and not any(self.ref.rewinds)
                and not self.sent_due)

    async def cycle(self, ctx):
        dut, rng, t = self.dut, self.rng, self.t

        # completion records
        if self.offer is None and self.to_offer and rng.random() < self.p_rec:
            self.offer = self.to_offer.popleft()
        self.drive.set(dut.completion.valid, int(self.offer is not None))
        if self.offer is not None and self._cache.get("offer") is not self.offer:
            self._cache["offer"] = self.offer
            self.drive.set(dut.completion.payload, CompletionRecordLayout().const(self.offer.payload()))

        # receive completions
        if self.recv_offer is None and self.recv_to_offer and rng.random() < self.p_recv:
            self.recv_offer = self.recv_to_offer.popleft()
        self.drive.set(dut.receive.valid, int(self.recv_offer is not None))
        if self.recv_offer is not None and self._cache.get("recv_offer") is not self.recv_offer:
            self._cache["recv_offer"] = self.recv_offer
            self.drive.set(dut.receive.payload.as_value(), self.recv_offer.bits())

        # rx beats: at most one per cycle over all VLs when ``wire``
        # (a stored packet starts only while no other VL's stored packet is passing: the
        # ResponseWriter stores one at a time)
        def can_go(v):
            return self.rx_cur[v] is not None or (self.rx[v] and (
                self.rx[v][0][2] is None or self.stored_vl in (None, v)))
        busy = [v for v in range(dut.num_vls) if can_go(v)]
        send = []
        if busy:
            if self.wire:
                if rng.random() < self.p_beat:
                    send.append(rng.choice(busy))
            else:
                send = [v for v in busy if rng.random() < self.p_beat]
                rng.shuffle(send)
        ended = []
        stored_ends = False
        sent = set()
        for v in send:
            if self.rx_cur[v] is None:
                if not can_go(v):
                    continue        # another VL's stored packet started in this cycle
                qpn, beats, holder = self.rx[v].popleft()
                self.rx_cur[v] = [qpn, deque(beats), holder]
                if holder is not None:
                    holder.seq = len(self.stored)
                    holder.delay = rng.randint(0, self.land_delay)
                    self.stored.append(holder)
                    self.stored_vl = v
                    self.drive.set(dut.rx_seq[v], holder.seq % (1 << 16))
            qpn, beats, holder = self.rx_cur[v]
            beat = beats.popleft()
            sent.add(v)
            self.drive.set(dut.rx[v].valid, 1)
            self.drive.set(dut.rx[v].payload, BEAT.const(beat))
            if not beats:
                self.rx_cur[v] = None
                ended.append(qpn)
                stored_ends |= holder is not None
                if holder is not None:
                    holder.ended = t
        for v in set(range(dut.num_vls)) - sent:
            self.drive.set(dut.rx[v].valid, 0)

        # packets sent
        strobe = self.sent_due.popleft() if self.sent_due else None
        self.drive.set(dut.sent.valid, int(strobe is not None))
        if strobe is not None:
            self.drive.set(dut.sent.payload.qpn, strobe[0])
            self.drive.set(dut.sent.payload.psn, strobe[1])
            if not self.auto_sent and strobe[0] < dut.num_qps:
                self.ref.packet_sent(*strobe)

        # QP flush and reset strobes
        flush_q = self.flushes.popleft() if self.flushes else None
        self.drive.set(dut.qp_flush.valid, int(flush_q is not None))
        if flush_q is not None:
            self.drive.set(dut.qp_flush.qpn, flush_q)
        reset_q = self.resets.popleft() if self.resets else None
        self.drive.set(dut.qp_reset.valid, int(reset_q is not None))
        if reset_q is not None:
            self.drive.set(dut.qp_reset.qpn, reset_q)
        cq_reset = self.cq_resets.popleft() if self.cq_resets else None
        self.drive.set(dut.cq_reset.valid, int(cq_reset is not None))
        if cq_reset is not None:
            self.drive.set(dut.cq_reset.qpn, cq_reset)

        # AXI
        awready = int(rng.random() < self.p_aw)
        wready = int(rng.random() < self.p_w)
        self.drive.set(dut.axi.awready, awready)
        self.drive.set(dut.axi.wready, wready)
        if self.b_cur is None and self.b_due and self.b_due[0][0] <= t:
            self.b_cur = self.b_due.popleft()[1]
        self.drive.set(dut.axi.bvalid, int(self.b_cur is not None))
        if self.b_cur is not None:
            self.drive.set(dut.axi.bresp, self.b_cur)
            assert ctx.get(dut.axi.bready)
            if self.b_cur:
                self.ref.counters["cqe_write_errors"] += 1
            self.b_cur = None

        # every stored packet is decided on soon after its end
        late = [h for h in self.stored[self.landed:] if h.decided is None and h.ended is not None
                and t - h.ended > 200]
        assert not late, (t, "no decision", late[0].seq, late[0].info)
        # ``landed``: the stored packets land in seq order, each a random delay after its
        # decision
        while (self.landed < len(self.stored) and self.stored[self.landed].decided is not None
               and t >= self.stored[self.landed].decided + self.stored[self.landed].delay):
            self.landed += 1
        self.drive.set(dut.landed, self.landed % (1 << 16))
        self.landed_hist.append(self.landed)
        self.drive.apply(ctx)

        # outputs
        for v in range(dut.num_vls):
            assert ctx.get(dut.rx[v].ready), (t, "rx not ready")
        # decisions on stored packets: exactly one each, the one the reference expects
        if ctx.get(dut.discard.valid):
            self.decide(t, ctx.get(dut.discard.payload), None)
        if ctx.get(dut.verdict.valid):
            v = dut.verdict.payload
            self.decide(t, ctx.get(v.seq), (ctx.get(v.write), ctx.get(v.addr), ctx.get(v.bytes),
                                             ctx.get(v.offset)))
        if ctx.get(dut.rewind.valid):
            rw = dut.rewind.payload
            q, index, psn = ctx.get(rw.qpn), ctx.get(rw.wqe_index), ctx.get(rw.psn)
            assert q < dut.num_qps, (t, "rewind of an unknown QP", q)
            if not self.ref.rewinds[q] and self.timeouts:
                assert self.ref.due(q, "timeout") == "rewind", (t, "timer rewind not due", q)
            assert self.ref.rewinds[q], (t, "unexpected rewind", q, index, psn)
            expect = self.ref.rewinds[q].popleft()
            assert (index, psn) == expect, (t, "wrong rewind", q, (index, psn), expect)
            self.rewind_log.append((t, q, index, psn))
        comp_ready = ctx.get(dut.completion.ready)
        recv_ready = ctx.get(dut.receive.ready)
        if self.offer is not None and not comp_ready:
            self.ready_low += 1
        if self.recv_offer is not None and not recv_ready:
            self.recv_ready_low += 1
        axi = dut.axi
        if ctx.get(axi.awvalid) and awready:
            assert (ctx.get(axi.awlen), ctx.get(axi.awsize), ctx.get(axi.awburst),
                    ctx.get(axi.awid)) == (0, 6, 1, 0), t
            self.aw.append(ctx.get(axi.awaddr))
        if ctx.get(axi.wvalid) and wready:
            assert ctx.get(axi.wstrb) == (1 << 64) - 1 and ctx.get(axi.wlast) == 1, t
            self.w.append(ctx.get(axi.wdata).to_bytes(64, "little"))
        if ctx.get(dut.qp_error.valid):
            q = ctx.get(dut.qp_error.qpn)
            done = self.ref.completed[q]
            nak = [r for r in done if r.nak_error and not r.qp_error_seen]
            assert nak, (t, "qp_error without a NAKed record", q)
            nak[0].qp_error_seen = True
            self.qp_errors.append(q)
        retiring = None
        if ctx.get(dut.retire.valid):
            q = ctx.get(dut.retire.payload.qpn)
            blocks = ctx.get(dut.retire.payload.blocks)
            assert self.ref.completed[q], (t, "retire of a record the reference did not complete", q)
            retiring = self.ref.completed[q].popleft()
            assert blocks == retiring.wqe_blocks, (t, retiring, blocks)
            # where the QP's PSNs stand after it: 0 for a WQE that sent nothing
            next_psn = (retiring.last_psn + 1) % M24 if retiring.status == SENT else 0
            assert ctx.get(dut.retire.payload.next_psn) == next_psn, (t, retiring)
            assert not retiring.nak_error or retiring.qp_error_seen, (t, "qp_error after retire", retiring)
            if (not retiring.error and retiring.status == SENT
                    and (retiring.opcode == READ or retiring.opcode in ATOMICS)):
                # its CQE was issued at least 2 cycles ago, after its data landed
                data = retiring.data
                assert data is not None and data.seq is not None, (t, "no data", retiring)
                assert self.landed_hist[t - 2] > data.seq, (t, "CQE before its data landed",
                                                            retiring, data.seq)
            self.outstanding[q] -= 1
            self.retired += 1
            self.retire_cycles.append(t)
        # CQEs in the order the writer issued them (their producer indices): a receive one
        # by its opcode, a requester one only with the retire of its record.
        requester_cqe = False
        while self.aw and self.w:
            addr, data = self.aw.popleft(), self.w.popleft()
            if data[63] >> 4 in RECV_OPCODES:
                self.check_recv_cqe(t, addr, data)
                continue
            rec = retiring
            assert rec is not None and rec.write_cqe and not requester_cqe, (
                t, "a requester CQE without its retire", rec, data.hex())
            requester_cqe = True
            pi = self.next_cqe(t, rec.cqn, addr, False)
            log = 0 if self.cqs[rec.cqn][2] else self.cqs[rec.cqn][1]
            expect = cqe_bytes(rec, (pi >> log) & 1)
            assert data == expect, (t, rec, pi, data.hex(), expect.hex())
            self.ref.counters["error_cqes"] += rec.error
        if retiring is not None:
            assert requester_cqe == retiring.write_cqe, (t, "retire and CQE disagree", retiring)
        self.cq_addr = ctx.get(dut.cq_config.addr)

        await ctx.tick()

        if self.recv_offer is not None and recv_ready:
            self.recv_taken.append(self.recv_offer)
            self.recv_offer = None
        if cq_reset is not None:
            self.cq_pi[cq_reset] = 0
        if self.offer is not None and comp_ready:
            rec = self.offer
            self.offer = None
            if rec.qpn < dut.num_qps:
                self.outstanding[rec.qpn] += 1
            self.ref.enqueue(rec)
            if self.auto_sent and rec.status == SENT:
                self.sent_due.append((rec.qpn, rec.last_psn))
                if rec.qpn < dut.num_qps:
                    self.ref.packet_sent(rec.qpn, rec.last_psn)
        for qpn in ended:
            if qpn is not None and qpn < dut.num_qps:
                self.in_flight[qpn] -= 1
                self.last_end[qpn] = t
        if flush_q is not None:
            self.ref.flush(flush_q)
        if reset_q is not None:
            self.ref.qps[reset_q].reset()
        if stored_ends:
            self.stored_vl = None
        cq = self.cqs[self.cq_addr] if self.cq_addr < len(self.cqs) else (0, 0, 0)
        if self._cache.get("cq") != cq:
            self._cache["cq"] = cq
            ctx.set(dut.cq_config.data, CqConfigLayout().const(
                {"base": cq[0], "log_size": cq[1], "collapsed": cq[2]}))
        self.t += 1

    def decide(self, t, seq, verdict):
        """A ``discard`` (``verdict`` None) or a verdict (write, addr, bytes, offset) for
        stored packet ``seq``."""
        candidates = [h for h in self.stored[self.landed:] if h.seq % (1 << 16) == seq]
        assert len(candidates) == 1, (t, "decision for a packet not stored", seq)
        h = candidates[0]
        assert h.decided is None, (t, "second decision", seq)
        h.decided = t
        self.decisions += 1
        if verdict is None:
            assert h.expect in ("discard", "reject"), (t, "discarded", seq, h.expect)
        elif h.expect in ("nowrite", "reject"):
            assert verdict[0] == 0, (t, "written", seq, verdict, h.info)
        else:
            assert h.expect != "discard", (t, "a verdict for a bad packet", seq, verdict)
            assert verdict == (1,) + h.expect[1:], (t, "verdict", seq, verdict, h.expect, h.info)

    def next_cqe(self, t, cqn, addr, receive):
        """Check the address of the next CQE of CQ ``cqn``; returns its producer index."""
        self.cqe_log.append((cqn, receive))
        base, log_size, collapsed = self.cqs[cqn]
        log = 0 if collapsed else log_size
        pi = self.cq_pi[cqn]
        assert addr == base + 64 * (pi % (1 << log)), (t, cqn, hex(addr), pi)
        assert addr == mlx5.cqe_address(base, log_size, collapsed, pi)
        self.cq_pi[cqn] = (pi + 1) % (1 << 16)
        self.b_due.append((t + self.rng.randint(1, self.b_delay), int(self.rng.random() < self.p_slverr) * 2))
        self.ref.counters["cqes_written"] += 1
        return pi

    def check_recv_cqe(self, t, addr, data):
        """A receive CQE: the oldest taken receive record that writes one (those before
        it that write none are passed over)."""
        num_cqs = self.dut.num_cqs
        while self.recv_taken and not self.recv_taken[0].writes(num_cqs):
            self.recv_taken.popleft()
        assert self.recv_taken, (t, "a receive CQE without a record", data.hex())
        rec = self.recv_taken.popleft()
        pi = self.next_cqe(t, rec.cqn, addr, True)
        log = 0 if self.cqs[rec.cqn][2] else self.cqs[rec.cqn][1]
        expect = recv_cqe_bytes(rec, (pi >> log) & 1)
        assert data == expect, (t, rec, pi, data.hex(), expect.hex())
        self.ref.counters["recv_cqes"] += 1
        self.ref.counters["error_cqes"] += rec.opcode == RESP_ERR
        self.recv_cycles.append(t)

    async def drain(self, ctx, limit=20000):
        start = self.t
        while not self.idle():
            await self.cycle(ctx)
            assert self.t - start < limit, (
                "no progress", [len(q) for q in self.ref.completed], self.ref.rewinds,
                self.decisions, len(self.stored), self.offer, len(self.to_offer))
        for _ in range(40):
            await self.cycle(ctx)
        assert not self.recv_taken or not any(r.writes(self.dut.num_cqs) for r in self.recv_taken)
        self.recv_taken.clear()

    async def check_counters(self, ctx):
        for name, value in self.ref.counters.items():
            assert ctx.get(getattr(self.dut, name)) == value, (name, ctx.get(getattr(self.dut, name)), value)


def run(dut, bench_factory, body, vcd=None):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    result = {}

    async def testbench(ctx):
        bench = bench_factory()
        result["bench"] = bench
        await body(ctx, bench)
    sim.add_testbench(testbench)
    if vcd:
        with sim.write_vcd(vcd):
            sim.run()
    else:
        sim.run()
    return result["bench"]


# --- Random traffic ---------------------------------------------------------------------------

class Traffic:
    """Records and responses for the live QPs; junk for everyone."""

    def __init__(self, bench, rng, live_qps, *, p_fatal=0.01, p_nak=0.03, p_rnr=0.015):
        self.bench = bench
        self.rng = rng
        self.live = list(live_qps)
        n = bench.dut.num_qps
        self.next_psn = [rng.choice([rng.getrandbits(24), M24 - rng.randint(1, 40)]) for _ in range(n)]
        self.wqe_index = [rng.getrandbits(16) for _ in range(n)]
        # QP 4 names a CQ the unit does not have: its records complete without CQEs
        self.cqn = [bench.dut.num_cqs if q == 4 else q % bench.dut.num_cqs for q in range(n)]
        # retry limits per QP (new ones at each reset): some give up at the first retransmission
        self.retry_cnt = [rng.choice([0, 1, 7, 7]) for _ in range(n)]
        self.rnr_retry = [rng.choice([0, 1, 7, 7]) for _ in range(n)]
        self.sent = [[] for _ in range(n)]          # SENT records offered, PSN order
        self.killed = [False] * n
        self.p_fatal, self.p_nak, self.p_rnr = p_fatal, p_nak, p_rnr
        self.generated = 0
        self.fatal = 0
        self.flushed = 0
        self.stats = dict.fromkeys(("nak", "rnr", "implicit", "ack_over", "lost_read", "bad_read",
                                    "dup"), 0)

    def vl(self, q):
        return q % self.bench.dut.num_vls

    def new_record(self, q):
        rng = self.rng
        op = rng.choice([WRITE, WRITE_IMM, SEND, SEND_IMM, READ, READ, ATOMIC_CS, ATOMIC_FA])
        blocks = rng.randint(1, 4)
        mtu = rng.choice([1, 1, 1, 2, 3, 5])
        # READs of up to 5 response packets: every beat costs the simulator's ICRC dearly
        nbytes = (8 if op in ATOMICS else
                  rng.choice([0, 1, rng.randint(1, 64), rng.randint(1, 3000)]) if op != READ else
                  rng.choice([0, 1, rng.randint(1, 64), rng.randint(200, 1100)]))
        status = rng.choices([SENT, ERROR, FLUSH], [90, 5, 5])[0]
        if status == SENT:
            npsn = 1 if op in ATOMICS else max(1, -(-nbytes // (128 << mtu)))
            first = self.next_psn[q]
            last = (first + npsn - 1) % M24
            self.next_psn[q] = (last + 1) % M24
        else:
            first, last = rng.getrandbits(24), rng.getrandbits(24)
        rec = Rec(qpn=q, cqn=self.cqn[q], wqe_index=self.wqe_index[q], wqe_blocks=blocks,
                  opcode=op, byte_count=nbytes, first_psn=first, last_psn=last,
                  signaled=int(rng.random() < 0.7), status=status,
                  syndrome=rng.choice(LOCAL_SYNDROMES + (WR_FLUSH_ERR,)),
                  laddr=rng.choice([rng.getrandbits(64), (1 << 64) - rng.randint(1, 600)]),
                  mtu=mtu, retry_cnt=self.retry_cnt[q], rnr_retry=self.rnr_retry[q],
                  ack_timeout=0)
        self.wqe_index[q] = (self.wqe_index[q] + blocks) % (1 << 16)
        if status == SENT:
            self.sent[q].append(rec)
        self.generated += 1
        return rec

    def waiting(self, q):
        """Whether QP q still has records to complete (its responder is not done)."""
        bench = self.bench
        return (not self.killed[q]
                and (bench.ref.qps[q].queue or bench.offer is not None and bench.offer.qpn == q
                     or any(r.qpn == q for r in bench.to_offer)))

    def respond(self, q):
        """Queue the next in-order response(s) of q's responder, if any. Like a real
        responder, it sends nothing after a NAK, RNR NAK or lost response until the
        requester went back (``rewind``)."""
        bench, rng, ref = self.bench, self.rng, self.bench.ref
        qp = ref.qps[q]
        if self.killed[q] or ref.rewinds[q] or not qp.started:
            return
        recs = self.sent[q]
        # the oldest record the acknowledged PSN does not cover; only records the unit took
        i = next((k for k, r in enumerate(recs) if lt(qp.ack, r.last_psn)), None)
        if i is None or not le(recs[i].last_psn, qp.sent):
            return
        r = recs[i]
        vl = self.vl(q)

        def send(opcode, psn, syndrome=0, payload=b""):
            bench.respond(vl, q, opcode, psn, syndrome, payload)
            if qp.nak is not None or qp.flushing:
                self.killed[q] = True
            return not self.killed[q] and not ref.rewinds[q]

        def window():
            """A PSN of r's the responder has not acknowledged."""
            lo = r.first_psn if lt(qp.ack, r.first_psn) else (qp.ack + 1) % M24
            return (lo + rng.randrange((r.last_psn - lo) % M24 + 1)) % M24

        roll = rng.random()
        if roll < self.p_fatal:
            send(Opcode.ACKNOWLEDGE, window(), 0x60 | rng.choice([1, 2, 3]))
            self.killed[q] = True
            self.fatal += 1
            return
        roll -= self.p_fatal
        if roll < self.p_nak:
            self.stats["nak"] += 1
            send(Opcode.ACKNOWLEDGE, window(), 0x60)        # PSN sequence error
            return
        roll -= self.p_nak
        if roll < self.p_rnr:
            self.stats["rnr"] += 1
            psn = window() if rng.random() < 0.3 else (qp.ack + 1) % M24
            send(Opcode.ACKNOWLEDGE, psn, 0x20 | rng.randint(1, 3))
            return
        roll -= self.p_rnr
        if roll < 0.01:
            send(Opcode.ACKNOWLEDGE, r.last_psn, 0x64)      # invalid RD request: counted only
            return
        if r.opcode == READ:
            n = r.read_packets()
            k0 = (qp.ack + 1 - r.first_psn) % M24       # a NAK may have acknowledged a part
            lost = rng.randrange(k0, n - 1) if n - k0 > 1 and rng.random() < 0.2 else None
            for k in range(k0, n):
                op = read_response_opcode(k, n)
                payload = rng.randbytes(r.read_payload_bytes(k))
                psn = (r.first_psn + k) % M24
                if k == lost:
                    self.stats["lost_read"] += 1
                    continue            # lost on the wire: the next one is out of order
                if rng.random() < 0.05:
                    # a bad one at the expected PSN (wrong length or position): not taken
                    self.stats["bad_read"] += 1
                    if payload and rng.random() < 0.5:
                        bad = payload[:-1]
                    else:
                        bad = payload + b"x"
                    bad_op = op if rng.random() < 0.5 else rng.choice(
                        [o for o in STORED_OPCODES[:4] if o != op])
                    if bad_op == Opcode.RDMA_READ_RESPONSE_ONLY or bad == payload:
                        bad_op, bad = op, payload + b"x"
                    if not send(bad_op, psn, 0, bad):
                        return
                if not send(op, psn, 0, payload):
                    return
            if rng.random() < 0.05:
                self.stats["dup"] += 1      # a duplicate: stale
                send(read_response_opcode(n - 1, n), r.last_psn, 0,
                     rng.randbytes(r.read_payload_bytes(n - 1)))
        elif r.opcode in ATOMICS:
            send(Opcode.ATOMIC_ACKNOWLEDGE, r.last_psn)
            if rng.random() < 0.05:
                self.stats["dup"] += 1
                send(Opcode.ATOMIC_ACKNOWLEDGE, r.last_psn)
        else:
            if r.first_psn != r.last_psn and rng.random() < 0.2:
                lo = r.first_psn if lt(qp.ack, r.first_psn) else (qp.ack + 1) % M24
                span = (r.last_psn - lo) % M24
                if span > 0:
                    send(Opcode.ACKNOWLEDGE, (lo + rng.randrange(span)) % M24)
                    return
            j = i
            while (j + 1 < len(recs) and recs[j + 1].opcode not in (READ,) + ATOMICS
                   and le(recs[j + 1].last_psn, qp.sent) and rng.random() < 0.5):
                j += 1
            nxt = recs[j + 1] if j + 1 < len(recs) else None
            if (nxt is not None and le(nxt.last_psn, qp.sent) and rng.random() < 0.15
                    and (nxt.opcode == READ or nxt.opcode in ATOMICS)):
                if rng.random() < 0.5 or qp.gap_seen:
                    # the READ's or atomic's first response acknowledges these (coalesced)
                    self.stats["implicit"] += 1
                    if nxt.opcode == READ:
                        n = nxt.read_packets()
                        send(read_response_opcode(0, n), nxt.first_psn, 0,
                             rng.randbytes(nxt.read_payload_bytes(0)))
                    else:
                        send(Opcode.ATOMIC_ACKNOWLEDGE, nxt.first_psn)
                else:
                    # an ACK covering the READ or atomic: its responses went missing
                    self.stats["ack_over"] += 1
                    send(Opcode.ACKNOWLEDGE, rng.choice([nxt.first_psn, nxt.last_psn]))
                return
            send(Opcode.ACKNOWLEDGE, recs[j].last_psn)

    def junk(self):
        bench, rng, ref = self.bench, self.rng, self.bench.ref
        dut = bench.dut
        n = dut.num_qps
        q = rng.randrange(n)
        qp = ref.qps[q]
        kind = rng.choice(["icrc", "end_bad", "unknown", "reset", "request", "stale", "future",
                           "grh", "pktlen", "syndrome", "long_ack", "stored_icrc"])
        vl = rng.randrange(dut.num_vls)
        psn = rng.getrandbits(24)
        holder = None
        if kind in ("icrc", "end_bad", "stored_icrc"):
            if kind == "stored_icrc":
                op = rng.choice([Opcode.RDMA_READ_RESPONSE_ONLY, Opcode.RDMA_READ_RESPONSE_MIDDLE,
                                 Opcode.ATOMIC_ACKNOWLEDGE])
                payload = (b"" if op == Opcode.ATOMIC_ACKNOWLEDGE
                           else rng.randbytes(rng.randint(0, 90)))
                pkt = response(op, q, (qp.ack + 1) % M24, 0, payload, rng)
                holder = Stored("discard")
            else:
                pkt = response(Opcode.ACKNOWLEDGE, q, (qp.ack + 1) % M24, 0, b"", rng)
            end_bad = kind == "end_bad" or rng.random() < 0.3
            if not end_bad:
                pkt = pkt[:-1] + bytes([pkt[-1] ^ (1 << rng.randrange(8))])
            bench.queue_packet(vl, q, pkt, end_bad=end_bad, holder=holder)
            ref.counters["rx_dropped_icrc"] += 1
            return
        if kind == "unknown":
            q = rng.randrange(n, M24)
            op = rng.choice([Opcode.ACKNOWLEDGE, Opcode.ATOMIC_ACKNOWLEDGE])
            pkt = response(op, q, psn, 0, b"", rng)
            holder = Stored("discard") if op == Opcode.ATOMIC_ACKNOWLEDGE else None
        elif kind == "reset":
            resets = [x for x in range(n) if bench.qp_states[x] == QpState.RESET]
            if not resets:
                return
            q = rng.choice(resets)
            pkt = response(Opcode.ACKNOWLEDGE, q, psn, 0, b"", rng)
        elif kind == "request":
            pkt = build_packet(bth=BTH(opcode=Opcode.SEND_ONLY, destqp=q, psn=(qp.ack + 1) % M24),
                               payload=rng.randbytes(rng.randint(0, 80)))
        elif kind == "stale":
            if not qp.started:
                return
            # behind the reference's ack_psn, which may be ahead of the unit's: same VL as q's
            # responses, so that it is processed after them (and a rewind the reference
            # expects only moves the unit's ack_psn back to the reference's)
            op = rng.choice([Opcode.ACKNOWLEDGE, Opcode.ATOMIC_ACKNOWLEDGE,
                             Opcode.RDMA_READ_RESPONSE_ONLY])
            payload = (rng.randbytes(rng.randint(0, 40)) if op == Opcode.RDMA_READ_RESPONSE_ONLY
                       else b"")
            pkt = response(op, q, (qp.ack - rng.choice([0, 0, 1, 5])) % M24, 0, payload, rng)
            holder = Stored("nowrite") if op != Opcode.ACKNOWLEDGE else None
            vl = self.vl(q)
        elif kind == "future":
            if not qp.started:
                return
            pkt = response(rng.choice([Opcode.ACKNOWLEDGE, Opcode.RDMA_READ_RESPONSE_LAST]), q,
                           (qp.sent + (1 << 20) + rng.randint(0, 99)) % M24, 0, b"", rng)
            holder = Stored("nowrite") if pkt[8] in STORED_OPCODES else None
        elif kind == "grh":
            pkt = build_packet(bth=BTH(opcode=Opcode.ACKNOWLEDGE, destqp=q, psn=(qp.ack + 1) % M24),
                               ext=(AETH(),), grh=bytes(40))
        elif kind == "pktlen":
            body = bytearray(response(Opcode.RDMA_READ_RESPONSE_ONLY, q, (qp.ack + 1) % M24, 0,
                                      rng.randbytes(rng.randint(0, 100)), rng)[:-4])
            words = ((body[4] & 7) << 8 | body[5]) + rng.choice([-1, 1])
            body[4] = (body[4] & 0xF8) | (words >> 8)
            body[5] = words & 0xFF
            pkt = reseal(body)
            holder = Stored("discard")
        elif kind == "syndrome":
            op = rng.choice([Opcode.ACKNOWLEDGE, Opcode.RDMA_READ_RESPONSE_ONLY, Opcode.ATOMIC_ACKNOWLEDGE])
            bad = (0x40 | rng.getrandbits(5) if op == Opcode.ACKNOWLEDGE and rng.random() < 0.5 else
                   0x60 | rng.randint(5, 31) if op == Opcode.ACKNOWLEDGE else
                   rng.choice([0x20, 0x60, 0x80, 0xE0]) | rng.getrandbits(5))
            pkt = response(op, q, (qp.ack + 1) % M24, bad, b"", rng)
            holder = Stored("discard") if op != Opcode.ACKNOWLEDGE else None
        else:   # an ACK opcode with an ATOMIC ACK's length
            body = bytearray(response(Opcode.ATOMIC_ACKNOWLEDGE, q, (qp.ack + 1) % M24, 0, b"", rng)[:-4])
            body[8] = Opcode.ACKNOWLEDGE
            pkt = reseal(body)
        bench.queue_packet(vl, q if q < n else None, pkt, holder=holder)
        ref.counters["rx_dropped_unexpected"] += 1


def random_unit(rng, num_qps, num_cqs, num_vls):
    """The random tests' unit (a short timer tick: RNR waits of a few dozen cycles), its QP
    states (all RTS but QP 2 in ERR and the last in RESET) and random CQs."""
    dut = CompletionUnit(num_qps=num_qps, num_cqs=num_cqs, num_vls=num_vls, addr_width=48,
                         timer_tick=8)
    qp_states = [QpState.RTS] * num_qps
    qp_states[2] = QpState.ERR
    qp_states[num_qps - 1] = QpState.RESET
    return dut, qp_states, random_cqs(rng, num_cqs)


def random_cqs(rng, num_cqs):
    cqs = []
    for c in range(num_cqs):
        log_size = rng.randint(0 if c else 1, 3)
        base = 0x100000 * (c + 1) + 64 * rng.randrange(64)
        cqs.append((base, log_size, int(c == 1 or c == 2 and rng.random() < 0.5)))
    return cqs


async def random_body(ctx, bench, rng, traffic, *, records, p_resp=0.3, p_junk=0.05):
    killed_reset = set()
    while traffic.generated < records or any(traffic.waiting(q) for q in traffic.live):
        if traffic.generated < records and len(bench.to_offer) < 4:
            q = rng.choice(traffic.live)
            if not traffic.killed[q] and bench.outstanding[q] + sum(
                    1 for r in bench.to_offer if r.qpn == q) < 16:
                bench.to_offer.append(traffic.new_record(q))
        if rng.random() < p_resp:
            q = rng.choice(traffic.live)
            if not traffic.killed[q] and sum(len(x) for x in bench.rx) < 6:
                traffic.respond(q)
        if rng.random() < p_junk and sum(len(x) for x in bench.rx) < 6:
            traffic.junk()
        # Now and then the host moves a quiet QP to ERR (qp_flush): it is killed as by a NAK.
        if rng.random() < 0.01:
            q = rng.choice(traffic.live)
            # (and all it completed has retired: the engine may complete later than the
            # reference, a READ's CQE waiting for ``landed``, and the flush would win; and
            # no rewind due: the flush would win over the rewind, or come after it)
            if (not traffic.killed[q] and bench.quiet(q) and not bench.ref.completed[q]
                    and not bench.ref.rewinds[q]):
                bench.flushes.append(q)
                traffic.killed[q] = True
                traffic.flushed += 1
        # A QP killed by a fatal NAK or a flush: once drained and quiet, reset it and start over.
        for q in traffic.live:
            if (traffic.killed[q] and bench.outstanding[q] == 0 and bench.quiet(q)
                    and not any(r.qpn == q for r in bench.to_offer) and bench.offer is None
                    and not bench.ref.completed[q]):
                bench.resets.append(q)
                traffic.killed[q] = False
                traffic.sent[q] = []
                traffic.wqe_index[q] = 0
                traffic.next_psn[q] = rng.getrandbits(24)
                traffic.retry_cnt[q] = rng.choice([0, 1, 7, 7])
                traffic.rnr_retry[q] = rng.choice([0, 1, 7, 7])
                killed_reset.add(q)
        await bench.cycle(ctx)
        assert bench.t < 80000, ("test ran away", bench.ref.rewinds)
    await bench.drain(ctx)
    await bench.check_counters(ctx)
    return killed_reset


async def flood(ctx, bench, traffic):
    """Every VL at once, a 1-beat packet per cycle each: more events than the processor takes.
    NAKs code 4 (invalid RD request) inside the QP's window, so each one the processor sees
    counts as a NAK and changes nothing, and on VL 0 stale ATOMIC ACKNOWLEDGEs now and then
    (unexpected, a discard or a verdict without write); the rest are dropped for a full
    event queue and count as unexpected (a stored one gets its discard)."""
    dut = bench.dut
    q = next(q for q in traffic.live if not traffic.killed[q])
    psn = traffic.next_psn[q]
    traffic.next_psn[q] = (psn + 1) % M24
    rec = Rec(qpn=q, cqn=traffic.cqn[q], wqe_index=traffic.wqe_index[q], wqe_blocks=1, opcode=WRITE,
              byte_count=4, first_psn=psn, last_psn=psn, signaled=1, status=SENT)
    bench.to_offer.append(rec)
    while bench.offer is not None or bench.to_offer:
        await bench.cycle(ctx)
    names = ("naks_received", "rx_dropped_unexpected")
    before = {name: ctx.get(getattr(dut, name)) for name in names}
    count = 60
    for k in range(count):
        if k % dut.num_vls == 0 and k % 3 == 0:
            bench.queue_packet(0, q, response(Opcode.ATOMIC_ACKNOWLEDGE, q, (psn - 1) % M24, 0, b"",
                                              bench.rng), holder=Stored("reject"))
        else:
            bench.queue_packet(k % dut.num_vls, q, response(Opcode.ACKNOWLEDGE, q, psn, 0x64, b"",
                                                            bench.rng))
    bench.wire, bench.p_beat = False, 1.0
    while any(bench.rx) or any(c is not None for c in bench.rx_cur):
        await bench.cycle(ctx)
    for _ in range(30):
        await bench.cycle(ctx)
    delta = {name: ctx.get(getattr(dut, name)) - before[name] for name in names}
    assert sum(delta.values()) == count and delta["naks_received"] > 0, delta
    assert delta["rx_dropped_unexpected"] > 0, delta
    for name in names:
        bench.ref.counters[name] += delta[name]
    bench.wire, bench.p_beat = True, 0.7
    bench.respond(traffic.vl(q), q, Opcode.ACKNOWLEDGE, psn)
    await bench.drain(ctx)
    await bench.check_counters(ctx)


def make_rec(q, op, first, npsn=1, *, cqn=0, status=SENT, signaled=1, index=0, blocks=1, syndrome=1,
             **kwargs):
    """A record; a READ of ``npsn`` packets at MTU 256 has 40 bytes in its last."""
    return Rec(qpn=q, cqn=cqn, wqe_index=index, wqe_blocks=blocks, opcode=op,
               byte_count=256 * (npsn - 1) + 40 if op == READ else 8 * npsn,
               first_psn=first % M24, last_psn=(first + npsn - 1) % M24, signaled=signaled,
               status=status, syndrome=syndrome, laddr=0x1000 * (q + 1) + index, **kwargs)


def full_speed_factory(dut, rng, **options):
    """A :class:`Bench` factory for the throughput measurements: every QP in RTS, two CQs,
    a record and a beat offered every cycle, the AXI slave always ready and never in error;
    ``options``: more Bench arguments."""
    qp_states = [QpState.RTS] * dut.num_qps
    cqs = [(0x10000, 4, 0), (0x20000, 0, 1)]

    def factory():
        return Bench(dut, rng, qp_states=qp_states, cqs=cqs, p_rec=1.0, p_beat=1.0, p_aw=1.0,
                     p_w=1.0, p_slverr=0, **options)
    return factory
