"""CompletionUnit (hdl/nic/completion_unit.py) against a Python reference, in Amaranth's simulator.

One testbench drives the unit cycle by cycle. The reference keeps, per QP, the queue of
records the unit accepted, ``sent_psn``/``ack_psn``/``read_psn``/``atomic_psn``, a pending
fatal NAK, the flushing flag, the reliability state (``gap_seen``, both retry counters)
and R's queue (the SENT READ/atomic records whose responses have not all been taken), and
completes head records by the rules of docs/nic.md and docs/nic-reliability.md (as the
unit's docstring states them exactly). Responses are real packets (models/packet.py, with
ICRC), applied to the reference when they are queued for the unit; all packets about one
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

Random test: records for several QPs (WRITE/SEND/READ/atomics, SENT/ERROR/FLUSH, signaled
or not, MTU 256..4096, ``laddr`` near the 2^64 wrap, PSNs near the 2^24 wrap, per-QP
``retry_cnt``/``rnr_retry`` 0, 1 or 7, no local ACK timeout) with random ``valid``; a
responder that answers in PSN order with coalesced and partial ACKs, READ responses
FIRST/MIDDLE/LAST/ONLY of exactly the position's length, its own ATOMIC ACK for an atomic,
a READ's or atomic's first response acknowledging the writes before it; NAKs code 4,
sequence NAKs, RNR NAKs (codes 1-3 with ``timer_tick`` 8) and missing responses: a READ
response lost (the next one is out of order), an ACK covering a READ or atomic, each
rewinding the QP (or exhausting its retries: TRANSPORT/RNR_RETRY_EXC_ERR, ``qp_error``;
or, for the QP in ERR, flushing it), after which the responder answers again from the
rewound WQE; bad READ responses at the expected PSN (wrong length or opcode) and
duplicates, which are not taken; fatal NAKs (codes 1-3) or a host flush (``qp_flush``),
after which the QP is reset once drained and starts again; junk: bad ICRC and end_bad
(also on stored opcodes), unknown QP, QP in RESET, request opcodes, stale (also READ
responses and ATOMIC ACKs) and future PSNs, GRH, wrong PktLen, reserved AETH syndromes, an
ACK with an ATOMIC ACK's length. At most one beat per cycle over all VLs (as from one
link), random gaps. AXI: random AWREADY/WREADY, B answers after random delays, some
SLVERR. Checked: ``rx.ready`` always high; every retire (per QP order, blocks, next_psn) against
the reference, and that the later of its CQE's AW and W was accepted in the retire's
cycle (receive CQEs, tb/test_completion_unit_receive.py, may come between requester
ones); every CQE's address (CQ base, producer index modulo the ring, entry 0 when
collapsed) and all 64 bytes (owner bit included); AXI constants; qp_error before the
retire of the NAKed record; every rewind; every stored packet's decision; READ/atomic
CQEs after their data landed; all counters at the end (``retransmits_*`` and
``retries_exhausted`` included); nothing completes that the reference does not complete.

After the random phase of a multi-VL run, a flood: every VL sends a 1-beat packet every
cycle, more than the processor takes: NAKs code 4 and, on VL 0, stale ATOMIC ACKs;
``rx.ready`` stays high and every packet is either processed or dropped for a full event
queue (unexpected; a stored one then gets its ``discard``).

Directed (one small unit): a full per-QP queue backpressures ``completion``; NAKs code 4;
ACKs covering an atomic do not complete it (only its own ATOMIC ACK does) and, with
``retry_cnt`` 0, exhaust its retries; a READ half answered when the host flushes the QP;
a duplicate ACK; an ACK to a QP with no SENT record yet; a fatal NAK with records before,
at and behind its PSN and records arriving after it, responses while flushing, qp_reset
and a fresh start; a QP in RESET; an unknown QP number. Engine hazards (qp_reset and
qp_flush in the cycle a record is taken). Parameter checks.

Reliability, directed: a sequence NAK behind a half-answered READ rewinds once the READ is
the stuck head, the replayed first response is taken again (``ack_psn`` went back), a
stale NAK (``gap_seen``) does nothing; a lost READ MIDDLE, an ACK covering a READ and one
covering an atomic rewind (the replayed ACK is taken again); a QP in ERR flushes instead;
``retry_cnt`` 0 gives up at once. Timer (``timer_tick`` 16): a stuck head rewinds
``2**ack_timeout`` ticks (1, 2, 3) after it got stuck or after the previous rewind, within
the window of ``timer_window``; after ``retry_cnt`` rewinds the next timeout gives
TRANSPORT_RETRY_EXC_ERR; progress restarts the count; ACKs arriving faster than the
timeout keep it from firing; a QP in ERR flushes at its timeout. RNR: the wait of the
RNR table's ticks, ``rnr_retry`` exhaustion (RNR_RETRY_EXC_ERR), 7 without limit, an RNR
NAK that moves ``ack_psn`` restarts the count.

Throughput (AXI always ready, records offered every cycle, one QP or four in turn): records
are taken at one per cycle while completions run (a record takes no engine operation), and
retire back to back when they complete at once (flushed QPs), but for the one cycle in
SCAN_INTERVAL the busy engine gives to a timer scan (``burst_cycles``); above 0.8 (one QP)
or 0.68 (four) per cycle with an ACK every 16 records per QP.
"""
import random
from collections import deque
from dataclasses import dataclass

import pytest
from amaranth.sim import Simulator

from hdl.link.signatures import BeatLayout
from hdl.nic.completion_unit import (
    RNR_TIMER_TICKS, SCAN_INTERVAL, TIMER_TICK_CYCLES, CompletionUnit,
)
from hdl.nic.signatures import (
    CompletionRecordLayout, CqConfigLayout, QpState, ReceiveCompletionLayout,
)
from models import mlx5
from models.crc import icrc_bytes
from models.ib import AETH, BTH, AtomicAckETH, Opcode
from models.nic import read_response_opcode
from models.packet import build_packet

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
        self.sent = self.ack = self.read = self.atomic = 0
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
                or not (lt(qp.ack, psn) and le(psn, qp.sent))):
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
                 timeouts=False):
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

    def drive_qp_states(self, ctx):
        """The QP states the bench was made with, on the unit's ``qp_state`` inputs."""
        for q, state in enumerate(self.qp_states):
            ctx.set(self.dut.qp_state[q], state)

    def _set(self, ctx, sig, value):
        key = id(sig)
        if self._cache.get(key) != value:
            self._cache[key] = value
            ctx.set(sig, value)

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
                and self.decisions == len(self.stored) and not any(self.ref.rewinds))

    async def cycle(self, ctx):
        dut, rng, t = self.dut, self.rng, self.t

        # completion records
        if self.offer is None and self.to_offer and rng.random() < self.p_rec:
            self.offer = self.to_offer.popleft()
        self._set(ctx, dut.completion.valid, int(self.offer is not None))
        if self.offer is not None and self._cache.get("offer") is not self.offer:
            self._cache["offer"] = self.offer
            ctx.set(dut.completion.payload, CompletionRecordLayout().const(self.offer.payload()))

        # receive completions
        if self.recv_offer is None and self.recv_to_offer and rng.random() < self.p_recv:
            self.recv_offer = self.recv_to_offer.popleft()
        self._set(ctx, dut.receive.valid, int(self.recv_offer is not None))
        if self.recv_offer is not None and self._cache.get("recv_offer") is not self.recv_offer:
            self._cache["recv_offer"] = self.recv_offer
            ctx.set(dut.receive.payload.as_value(), self.recv_offer.bits())

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
                    self._set(ctx, dut.rx_seq[v], holder.seq % (1 << 16))
            qpn, beats, holder = self.rx_cur[v]
            beat = beats.popleft()
            sent.add(v)
            self._set(ctx, dut.rx[v].valid, 1)
            ctx.set(dut.rx[v].payload, BEAT.const(beat))
            if not beats:
                self.rx_cur[v] = None
                ended.append(qpn)
                stored_ends |= holder is not None
                if holder is not None:
                    holder.ended = t
        for v in set(range(dut.num_vls)) - sent:
            self._set(ctx, dut.rx[v].valid, 0)

        # QP flush and reset strobes
        flush_q = self.flushes.popleft() if self.flushes else None
        self._set(ctx, dut.qp_flush.valid, int(flush_q is not None))
        if flush_q is not None:
            self._set(ctx, dut.qp_flush.qpn, flush_q)
        reset_q = self.resets.popleft() if self.resets else None
        self._set(ctx, dut.qp_reset.valid, int(reset_q is not None))
        if reset_q is not None:
            self._set(ctx, dut.qp_reset.qpn, reset_q)
        cq_reset = self.cq_resets.popleft() if self.cq_resets else None
        self._set(ctx, dut.cq_reset.valid, int(cq_reset is not None))
        if cq_reset is not None:
            self._set(ctx, dut.cq_reset.qpn, cq_reset)

        # AXI
        awready = int(rng.random() < self.p_aw)
        wready = int(rng.random() < self.p_w)
        self._set(ctx, dut.axi.awready, awready)
        self._set(ctx, dut.axi.wready, wready)
        if self.b_cur is None and self.b_due and self.b_due[0][0] <= t:
            self.b_cur = self.b_due.popleft()[1]
        self._set(ctx, dut.axi.bvalid, int(self.b_cur is not None))
        if self.b_cur is not None:
            self._set(ctx, dut.axi.bresp, self.b_cur)
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
        self._set(ctx, dut.landed, self.landed % (1 << 16))
        self.landed_hist.append(self.landed)

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
    dut = bench.dut
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


@pytest.mark.parametrize("seed,num_vls,records,wire,num_qps,num_cqs", [
    # Seeds that exercise everything the run checks it exercised (fatal NAKs, flushes,
    # resets, ...): these are rare events, and which seeds give them depends on the unit's
    # timing.
    (11, 2, 220, True, 6, 3),
    (2, 1, 200, True, 6, 3),
    (3, 2, 150, False, 6, 3),
    (13, 1, 250, True, 64, 16),     # the default size: 6-bit QP and 4-bit CQ indices
])
def test_random(seed, num_vls, records, wire, num_qps, num_cqs):
    rng = random.Random(seed)
    dut, qp_states, cqs = random_unit(rng, num_qps, num_cqs, num_vls)
    # a few QPs, the highest numbers among them
    live = sorted({0, 1, 2, 4} | set(range(num_qps - 4, num_qps - 1)))
    stats = {}

    def factory():
        return Bench(dut, rng, qp_states=qp_states, cqs=cqs, wire=wire, p_beat=0.7 if wire else 0.3)

    async def body(ctx, bench):
        bench.drive_qp_states(ctx)
        traffic = Traffic(bench, rng, live, p_fatal=0.02)
        stats["reset"] = await random_body(ctx, bench, rng, traffic, records=records)
        stats["fatal"] = traffic.fatal
        stats["flushed"] = traffic.flushed
        stats.update(traffic.stats)
        if num_vls > 1:
            await flood(ctx, bench, traffic)
    bench = run(dut, factory, body)
    c = bench.ref.counters
    # the run exercised what it is meant to
    assert c["retransmits_nak"] > 0 and c["retransmits_rnr"] > 0, c
    assert len(bench.rewind_log) == c["retransmits_nak"] + c["retransmits_rnr"], bench.rewind_log
    assert stats["lost_read"] + stats["ack_over"] > 0 and stats["implicit"] > 0, stats
    assert stats["bad_read"] > 0 and stats["dup"] > 0, stats
    kinds = [h.expect if isinstance(h.expect, str) else "write" for h in bench.stored]
    assert all(kinds.count(k) > 2 for k in ("discard", "nowrite", "write")), kinds
    assert bench.retired >= records * 0.8, bench.retired
    assert c["acks_received"] > 20 and c["read_responses"] > 20 and c["atomic_acks"] > 5, c
    assert c["naks_received"] > 3 and c["rx_dropped_icrc"] > 2 and c["rx_dropped_unexpected"] > 10, c
    assert c["error_cqes"] > 10 and c["cqe_write_errors"] > 0, c
    assert stats["fatal"] > 0 and stats["flushed"] > 0 and stats["reset"], stats
    assert bench.qp_errors, "no qp_error seen"
    if num_qps > 6:
        return
    # ring CQs wrapped (owner bit toggled) and collapsed ones took several CQEs
    assert any(pi > 2 << log for pi, (_, log, collapsed) in zip(bench.cq_pi, cqs) if not collapsed), cqs
    assert any(pi > 2 for pi, (_, _, collapsed) in zip(bench.cq_pi, cqs) if collapsed), cqs



# --- Directed ---------------------------------------------------------------------------------

def burst_cycles(n):
    """Most cycles from the first to the last of ``n`` back-to-back retires: one per cycle,
    except that the busy engine gives one cycle in SCAN_INTERVAL to a timer scan (the
    unit's promise: each QP's timer is looked at within ``SCAN_INTERVAL * num_qps``
    cycles however busy the engine is)."""
    return n - 1 + -(-n // (SCAN_INTERVAL - 1))


def make_rec(q, op, first, npsn=1, *, cqn=0, status=SENT, signaled=1, index=0, blocks=1, syndrome=1,
             **kwargs):
    """A record; a READ of ``npsn`` packets at MTU 256 has 40 bytes in its last."""
    return Rec(qpn=q, cqn=cqn, wqe_index=index, wqe_blocks=blocks, opcode=op,
               byte_count=256 * (npsn - 1) + 40 if op == READ else 8 * npsn,
               first_psn=first % M24, last_psn=(first + npsn - 1) % M24, signaled=signaled,
               status=status, syndrome=syndrome, laddr=0x1000 * (q + 1) + index, **kwargs)


async def offer(ctx, bench, *recs):
    """Offer ``recs`` in order and wait until the last one was taken."""
    bench.to_offer.extend(recs)
    while bench.offer is not None or bench.to_offer:
        await bench.cycle(ctx)


def send(bench, q, opcode, psn, syndrome=0, *, taken=True, payload=b""):
    """Queue a response on VL 0; the reference must agree that it is accepted (``taken``)."""
    assert bench.respond(0, q, opcode, psn, syndrome, payload) == taken, (q, opcode, psn)


def send_read(bench, rec, k, *, taken=True, vl=0):
    """READ response packet ``k`` of ``rec``, as the responder sends it; ``taken``: whether
    the reference takes its data (it is written)."""
    n = rec.read_packets()
    payload = bench.rng.randbytes(rec.read_payload_bytes(k))
    bench.respond(vl, rec.qpn, read_response_opcode(k, n), rec.first_psn + k, 0, payload)
    assert (bench.ref.holder.expect != "nowrite") == taken, (rec, k, bench.ref.holder.expect)


def test_directed():
    """One small unit (1 VL, 4 QPs): full queue backpressure (QP 0); NAKs code 4 (QP 0);
    ACKs covering an atomic do not complete it and, with ``retry_cnt`` 0, exhaust its
    retries (QP 1); a READ half answered, then qp_flush flushes it and what follows (QP
    1); a coalesced ACK completes records at one per cycle, but for timer scans; ACKs
    before any SENT record, a fatal NAK with records before, at and behind its PSN,
    records arriving after it, responses while flushing, then qp_reset and a fresh start
    (QP 2); a QP in RESET (QP 3)."""
    rng = random.Random(7)
    dut = CompletionUnit(num_qps=4, num_cqs=2, num_vls=1, addr_width=40)
    qp_states = [QpState.RTS, QpState.RTS, QpState.ERR, QpState.RESET]
    cqs = [(0x10000, 2, 0), (0x20040, 0, 1)]

    def factory():
        return Bench(dut, rng, qp_states=qp_states, cqs=cqs, p_rec=1.0, p_beat=1.0)

    async def cycles(ctx, bench, n):
        for _ in range(n):
            await bench.cycle(ctx)

    async def body(ctx, bench):
        ref = bench.ref
        bench.drive_qp_states(ctx)

        # QP 0: 64 records fill its queue; the 65th waits on ready until an ACK frees room.
        base = M24 - 30
        recs = [make_rec(0, WRITE, base + k, signaled=k % 3 == 0, index=k) for k in range(66)]
        bench.to_offer.extend(recs)
        await cycles(ctx, bench, 150)
        assert len(ref.qps[0].queue) == 64 and bench.offer is recs[64], "queue did not fill to 64"
        assert bench.ready_low > 50, bench.ready_low
        for _ in range(3):      # invalid RD request: counted only (others: test_rewind_nak)
            send(bench, 0, Opcode.ACKNOWLEDGE, base + 10, 0x64)
        send(bench, 0, Opcode.ACKNOWLEDGE, base + 40)
        while bench.offer is not None or bench.to_offer:
            await bench.cycle(ctx)
        send(bench, 0, Opcode.ACKNOWLEDGE, base + 65)
        send(bench, 0, Opcode.ACKNOWLEDGE, base + 65, taken=False)     # duplicate: stale
        await bench.drain(ctx)
        assert not ref.qps[0].queue

        # One ACK over 32 signaled records completes them at one per cycle (AXI always ready).
        bench.p_aw = bench.p_w = 1.0
        recs = [make_rec(0, SEND, base + 66 + k, index=66 + k) for k in range(32)]
        await offer(ctx, bench, *recs)
        send(bench, 0, Opcode.ACKNOWLEDGE, base + 97)
        first = len(bench.retire_cycles)
        await bench.drain(ctx)
        burst = bench.retire_cycles[first:]
        assert len(burst) == 32 and burst[-1] - burst[0] <= burst_cycles(32), burst
        bench.p_aw = bench.p_w = 0.7

        # QP 1 (retry_cnt 0: the responses that went missing make it give up): atomic at P,
        # WRITE P+1, READ P+2..P+4, WRITE P+5. ACKs at P and P+1 do not complete the atomic
        # (only its own ATOMIC ACKNOWLEDGE does); they cover it: its retries are exhausted.
        p = 1000
        await offer(ctx, bench, *(make_rec(1, op, psn, n, cqn=1, index=k, retry_cnt=0)
                                  for k, (op, psn, n) in enumerate((
                                      (ATOMIC_FA, p, 1), (WRITE, p + 1, 1), (READ, p + 2, 3),
                                      (WRITE, p + 5, 1)))))
        send(bench, 1, Opcode.ACKNOWLEDGE, p + 1)
        await bench.drain(ctx)
        assert ref.counters["retries_exhausted"] == 1 and bench.qp_errors == [1], bench.qp_errors
        assert not ref.qps[1].queue
        send(bench, 1, Opcode.ATOMIC_ACKNOWLEDGE, p, taken=False)       # flushing
        bench.resets.append(1)
        await cycles(ctx, bench, 3)
        # Again, READ P..P+2 then WRITE P+3, the READ's first response taken. The host
        # moves QP 1 to ERR: both flush; later records too; responses are dropped.
        read = make_rec(1, READ, p, 3, cqn=1)
        await offer(ctx, bench, read, make_rec(1, WRITE, p + 3, cqn=1, index=1))
        send_read(bench, read, 0)
        await bench.drain(ctx)
        bench.flushes.append(1)
        await cycles(ctx, bench, 3)
        send_read(bench, read, 1, taken=False)
        await cycles(ctx, bench, 3)
        await offer(ctx, bench, make_rec(1, WRITE, p + 6, cqn=1))
        send(bench, 1, Opcode.ACKNOWLEDGE, p + 6, taken=False)
        await bench.drain(ctx)
        assert not ref.qps[1].queue
        bench.resets.append(1)
        await cycles(ctx, bench, 3)

        # QP 2: an ERROR record before any SENT one; an ACK then is unexpected.
        await offer(ctx, bench, make_rec(2, SEND, 5, status=ERROR, syndrome=0x04, signaled=0))
        send(bench, 2, Opcode.ACKNOWLEDGE, 4, taken=False)
        await bench.drain(ctx)
        # WRITE 10..12, READ 13, WRITE 14, then NAK remote access error at 13.
        await offer(ctx, bench, make_rec(2, WRITE, 10, 3, signaled=0, blocks=2),
                    make_rec(2, READ, 13, index=2), make_rec(2, WRITE, 14, index=3))
        send(bench, 2, Opcode.ACKNOWLEDGE, 13, 0x62)
        await offer(ctx, bench, make_rec(2, SEND, 15, index=4, signaled=0),
                    make_rec(2, SEND, 16, status=FLUSH, index=5, signaled=0))
        send(bench, 2, Opcode.ACKNOWLEDGE, 15, taken=False)             # flushing
        await bench.drain(ctx)
        assert bench.qp_errors == [1, 2], bench.qp_errors
        assert ref.qps[2].flushing and not ref.qps[2].queue
        bench.resets.append(2)
        await cycles(ctx, bench, 3)
        await offer(ctx, bench, make_rec(2, WRITE, 500, index=0))
        send(bench, 2, Opcode.ACKNOWLEDGE, 500)
        await bench.drain(ctx)
        assert not ref.qps[2].queue and not ref.qps[2].flushing

        # QP 3 is in RESET: everything for it is dropped.
        send(bench, 3, Opcode.ACKNOWLEDGE, 0, taken=False)
        # A QP number the unit does not have.
        bench.queue_packet(0, None, response(Opcode.ACKNOWLEDGE, 200, 0, 0, b"", rng))
        ref.counters["rx_dropped_unexpected"] += 1
        await bench.drain(ctx)
        await bench.check_counters(ctx)
        assert ref.counters["naks_received"] == 4 and ref.counters["rx_dropped_unexpected"] == 8

    run(dut, factory, body)


def test_engine_hazards():
    """Back-to-back operations on one QP in the engine's pipeline (1 VL, 4 QPs, AXI always
    ready): a qp_reset in the cycle a record is taken, and in the cycle after, discards it
    (the reset wins over everything in its cycle, and over what the engine still has in
    flight); a fatal NAK in the middle of six records completes them back to back, the
    five behind it as errors; a qp_flush in the cycle a record is taken flushes it."""
    rng = random.Random(11)
    dut = CompletionUnit(num_qps=4, num_cqs=2, num_vls=1, addr_width=40)
    qp_states = [QpState.RTS] * 4
    cqs = [(0x10000, 3, 0), (0x20000, 0, 1)]

    def factory():
        return Bench(dut, rng, qp_states=qp_states, cqs=cqs, p_rec=1.0, p_beat=1.0,
                     p_aw=1.0, p_w=1.0)

    async def body(ctx, bench):
        ref = bench.ref
        bench.drive_qp_states(ctx)
        for q, delay in ((0, 0), (1, 1)):
            # A record that would wait for its ACK, then a reset in the same cycle as
            # it is taken (delay 0: the reset goes out with the offer) or in the next.
            rec = make_rec(q, WRITE, 100)
            if delay == 0:
                bench.resets.append(q)
                await offer(ctx, bench, rec)
            else:
                await offer(ctx, bench, rec)
                bench.resets.append(q)
            await bench.cycle(ctx)
            assert not ref.qps[q].queue and not ref.qps[q].started
            await offer(ctx, bench, make_rec(q, SEND, 500, index=1))
            send(bench, q, Opcode.ACKNOWLEDGE, 500)
            await bench.drain(ctx)
            assert not ref.qps[q].queue
        # QP 2: a NAK (remote access error) at the second of six records.
        await offer(ctx, bench, *[make_rec(2, WRITE, 10 + k, index=k, cqn=1) for k in range(6)])
        send(bench, 2, Opcode.ACKNOWLEDGE, 11, 0x62)
        first = len(bench.retire_cycles)
        await bench.drain(ctx)
        burst = bench.retire_cycles[first:]
        assert len(burst) == 6 and burst[-1] - burst[0] <= burst_cycles(6), burst
        assert bench.qp_errors == [2], bench.qp_errors
        # QP 3: a flush in the cycle a record is taken.
        bench.flushes.append(3)
        await offer(ctx, bench, make_rec(3, WRITE, 7))
        await bench.drain(ctx)
        assert not ref.qps[3].queue and ref.counters["error_cqes"] == 6
        await bench.check_counters(ctx)

    run(dut, factory, body)


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


def measure_rates(unit, qps, records, ack_every):
    """Records for ``qps`` in turn, offered every cycle, AXI always ready; each QP's records
    acknowledged by a coalesced ACK every ``ack_every`` of them taken, or (``None``) the
    QPs flushed first so that every record completes at once. Returns (records taken per
    cycle while offered, records retired per cycle from the first taken to the last
    retired)."""
    rng = random.Random(5)
    dut = unit(num_qps=8, num_cqs=2, num_vls=1, addr_width=40)
    result = {}

    async def body(ctx, bench):
        bench.drive_qp_states(ctx)
        if ack_every is None:
            bench.flushes.extend(qps)
            for _ in range(len(qps) + 3):
                await bench.cycle(ctx)
        recs = [make_rec(qps[k % len(qps)], WRITE, 100 + k // len(qps), index=k, signaled=1)
                for k in range(records)]
        bench.to_offer.extend(recs)
        start = bench.t
        first_retire = len(bench.retire_cycles)
        taken = 0
        per_qp = dict.fromkeys(qps, 0)
        while bench.offer is not None or bench.to_offer:
            await bench.cycle(ctx)
            now = records - len(bench.to_offer) - (bench.offer is not None)
            for rec in recs[taken:now]:
                per_qp[rec.qpn] += 1
                if ack_every and (per_qp[rec.qpn] % ack_every == 0
                                  or per_qp[rec.qpn] == records // len(qps)):
                    assert bench.ref.packet(rec.qpn, Opcode.ACKNOWLEDGE, rec.last_psn, 0)
                    bench.queue_packet(0, rec.qpn, response(Opcode.ACKNOWLEDGE, rec.qpn,
                                                            rec.last_psn, 0, b"", rng))
            taken = now
        offered = bench.t - start
        await bench.drain(ctx)
        retires = bench.retire_cycles[first_retire:]
        assert len(retires) == records, len(retires)
        await bench.check_counters(ctx)
        result["rates"] = (records / offered, records / (retires[-1] - start + 1))

    run(dut, full_speed_factory(dut, rng), body)
    return result["rates"]


# Records that complete at once retire back to back (``burst_cycles``), after a few cycles
# from the first record taken to its retire (record path, engine, CQE writer).
FLUSHED_RATE = 256 / (burst_cycles(256) + 1 + 8)


@pytest.mark.parametrize("qps,ack_every,min_records,min_retires", [
    ((0,), None, 0.99, FLUSHED_RATE),          # every record completes at once: one QP ...
    ((0, 1, 2, 3), None, 0.99, FLUSHED_RATE),  # ... and several in turn
    ((0,), 16, 0.99, 0.8),              # with coalesced ACKs, which take engine cycles
    ((0, 1, 2, 3), 16, 0.99, 0.68),
])
def test_throughput(qps, ack_every, min_records, min_retires):
    """A record takes no engine operation: records are taken at one per cycle while
    completions run, and completions keep up with them at close to one per cycle (they
    share the engine only with events, and one cycle in SCAN_INTERVAL with a timer scan)."""
    records, retires = measure_rates(CompletionUnit, qps, 256, ack_every)
    assert records >= min_records and retires >= min_retires, (records, retires)


# --- Reliability ------------------------------------------------------------------------------

async def cycles(ctx, bench, n):
    for _ in range(n):
        await bench.cycle(ctx)


async def until(ctx, bench, cond, limit=2000):
    start = bench.t
    while not cond():
        await bench.cycle(ctx)
        assert bench.t - start < limit, "timed out waiting"


def rewinds_of(bench, q):
    return [(index, psn) for _, q_, index, psn in bench.rewind_log if q_ == q]


def reliability_bench(num_qps, qp_states, *, timer_tick=TIMER_TICK_CYCLES, timeouts=False, seed=17):
    rng = random.Random(seed)
    dut = CompletionUnit(num_qps=num_qps, num_cqs=2, num_vls=1, addr_width=48,
                         timer_tick=timer_tick)
    cqs = [(0x10000, 3, 0), (0x20040, 0, 1)]

    def factory():
        return Bench(dut, rng, qp_states=qp_states, cqs=cqs, p_rec=1.0, p_beat=1.0,
                     timeouts=timeouts)
    return dut, factory


def test_rewind_nak():
    """Sequence NAKs and response gaps (1 VL, 4 QPs, no timer): exactly one ``rewind``
    with the head's (qpn, wqe_index, first_psn) once the head is the stuck one; ``ack_psn``
    goes back, so the replayed responses are taken again; a stale NAK after the rewind
    (``gap_seen``) does nothing. QP 0: NAK behind a half-answered READ. QP 1: a READ
    response missing, an ACK covering a READ, an ACK covering an atomic (the replayed ACK
    after it is taken again). QP 2 (ERR): the NAK flushes instead. QP 3 (``retry_cnt``
    0): the NAK exhausts the retries at once (TRANSPORT_RETRY_EXC_ERR, ``qp_error``, the
    rest flushed)."""
    qp_states = [QpState.RTS, QpState.RTS, QpState.ERR, QpState.RTS]
    dut, factory = reliability_bench(4, qp_states)

    async def body(ctx, bench):
        ref = bench.ref
        bench.drive_qp_states(ctx)

        # QP 0: READ 10..11, WRITE 12; the READ's first response, then a NAK at 12.
        a, b = make_rec(0, READ, 10, 2, index=5, blocks=2), make_rec(0, WRITE, 12, index=7)
        await offer(ctx, bench, a, b)
        send_read(bench, a, 0)
        send(bench, 0, Opcode.ACKNOWLEDGE, 12, 0x60)
        await until(ctx, bench, lambda: bench.rewind_log)
        await cycles(ctx, bench, 30)
        assert rewinds_of(bench, 0) == [(5, 10)], bench.rewind_log
        # a stale NAK (sent before the responder saw the replay): no second rewind
        send(bench, 0, Opcode.ACKNOWLEDGE, 10, 0x60)
        await cycles(ctx, bench, 40)
        assert rewinds_of(bench, 0) == [(5, 10)], bench.rewind_log
        # the replay: the READ's first response is taken again
        send_read(bench, a, 0)
        send_read(bench, a, 1)
        send(bench, 0, Opcode.ACKNOWLEDGE, 12)
        await bench.drain(ctx)
        assert not ref.qps[0].queue

        # QP 1: READ 20..22 loses its MIDDLE: the LAST is out of order.
        r = make_rec(1, READ, 20, 3, index=1)
        await offer(ctx, bench, r)
        send_read(bench, r, 0)
        send_read(bench, r, 2, taken=False)
        await until(ctx, bench, lambda: rewinds_of(bench, 1))
        for k in range(3):
            send_read(bench, r, k)
        await bench.drain(ctx)
        # WRITE 23, READ 24: an ACK at 24 covers the READ, whose response went missing
        w, r = make_rec(1, WRITE, 23, index=2), make_rec(1, READ, 24, index=3)
        await offer(ctx, bench, w, r)
        send(bench, 1, Opcode.ACKNOWLEDGE, 24)
        await until(ctx, bench, lambda: len(rewinds_of(bench, 1)) == 2)
        send_read(bench, r, 0)
        await bench.drain(ctx)
        # atomic 25, WRITE 26: an ACK at 26 covers the atomic; after the rewind the replayed
        # ATOMIC ACK and ACK 26 are both taken
        x, w = make_rec(1, ATOMIC_CS, 25, index=4), make_rec(1, WRITE, 26, index=5)
        await offer(ctx, bench, x, w)
        send(bench, 1, Opcode.ACKNOWLEDGE, 26)
        await until(ctx, bench, lambda: len(rewinds_of(bench, 1)) == 3)
        send(bench, 1, Opcode.ATOMIC_ACKNOWLEDGE, 25)
        send(bench, 1, Opcode.ACKNOWLEDGE, 26)
        await bench.drain(ctx)
        assert rewinds_of(bench, 1) == [(1, 20), (3, 24), (4, 25)], bench.rewind_log
        assert not ref.qps[1].queue

        # QP 2 is in ERR: WRITE 30 completes, WRITE 31 and a later one flush.
        await offer(ctx, bench, make_rec(2, WRITE, 30), make_rec(2, WRITE, 31, index=1))
        send(bench, 2, Opcode.ACKNOWLEDGE, 31, 0x60)
        await offer(ctx, bench, make_rec(2, WRITE, 32, index=2))
        await bench.drain(ctx)
        assert not rewinds_of(bench, 2) and ref.qps[2].flushing

        # QP 3 gives up at the first retransmission.
        await offer(ctx, bench, make_rec(3, WRITE, 40, retry_cnt=0), make_rec(3, SEND, 41, index=1))
        send(bench, 3, Opcode.ACKNOWLEDGE, 40, 0x60)
        await bench.drain(ctx)
        assert not rewinds_of(bench, 3) and bench.qp_errors == [3], bench.qp_errors
        await bench.check_counters(ctx)
        c = ref.counters
        assert c["retransmits_nak"] == 4 and c["retries_exhausted"] == 1, c
        assert c["error_cqes"] == 4, c      # QP 2: 2 flushed; QP 3: 0x15 and a flush

    run(dut, factory, body)


# Timer ticks of the timer and RNR tests, in cycles: long against the scan period of 4 QPs
# (a timeout one tick early or late falls outside the window).
TICK = 16


def timer_window(num_qps, ticks):
    """Cycles from the moment a QP's head got stuck (or, for an RNR wait, from its NAK's
    end beat) to its rewind: the engine is idle here, so it scans a QP every cycle in
    turn and reaches each one within ``num_qps`` cycles (busy: ``SCAN_INTERVAL * num_qps``).
    The timer is armed at a scan (stamp = ``now``) and fires at the first scan with ``now
    - stamp >= ticks``: at least ``(ticks - 1) * TICK + 1`` cycles after arming, at most
    ``ticks * TICK`` plus a scan period; plus the scan that armed it, and a few cycles of
    pipeline (issue, X, the strobe's register, the event's queue)."""
    return (ticks - 1) * TICK + 1, ticks * TICK + 2 * num_qps + 6


def test_timer():
    """Local ACK timeout, ``timer_tick`` 16 cycles (1 VL, 4 QPs): a stuck head rewinds
    after 2**ack_timeout ticks (1, 2, 3), each time (window: ``timer_window``); after
    ``retry_cnt`` (2) rewinds the next timeout completes it with TRANSPORT_RETRY_EXC_ERR,
    ``qp_error``, the record behind it flushed (QP 0). Progress (an ACK) restarts the
    retry count (QP 1, ``retry_cnt`` 1, two timeouts with an ACK between). ACKs every 12
    cycles keep the timer (2 ticks: 17 to 32 cycles) from firing (QP 2). QP 3 in ERR
    flushes at its timeout, without a rewind."""
    qp_states = [QpState.RTS, QpState.RTS, QpState.RTS, QpState.ERR]
    dut, factory = reliability_bench(4, qp_states, timer_tick=TICK, timeouts=True)

    async def body(ctx, bench):
        ref = bench.ref
        bench.drive_qp_states(ctx)
        psn = 100
        for n in (1, 2, 3):
            lo, hi = timer_window(4, 1 << n)
            rec = make_rec(0, WRITE, psn, index=n, ack_timeout=n, retry_cnt=2)
            behind = make_rec(0, SEND, psn + 1, index=n + 10, ack_timeout=n, retry_cnt=2)
            await offer(ctx, bench, rec, behind)
            stuck = bench.t - 1         # the cycle it was taken
            for k in range(2):
                await until(ctx, bench, lambda: len(rewinds_of(bench, 0)) == 2 * n - 1 + k)
                t = bench.rewind_log[-1][0]
                assert lo <= t - stuck <= hi, (n, k, t - stuck, lo, hi)
                assert bench.rewind_log[-1][1:] == (0, n, psn)
                stuck = t
            if n < 3:
                # the ACK completes both (and restarts the retry count)
                send(bench, 0, Opcode.ACKNOWLEDGE, psn + 1)
                await bench.drain(ctx)
            else:
                assert ref.due(0, "timeout") == "exhausted"
                retired = len(bench.retire_cycles)
                await bench.drain(ctx)
                assert lo <= bench.retire_cycles[retired] - stuck <= hi + 8
                assert bench.qp_errors == [0], bench.qp_errors
            psn += 2
        assert ref.counters["retransmits_timeout"] == 6 and ref.counters["retries_exhausted"] == 1

        # QP 1: retry_cnt 1, but an ACK between the two timeouts.
        recs = [make_rec(1, WRITE, 200 + k, index=k, ack_timeout=1, retry_cnt=1) for k in range(3)]
        await offer(ctx, bench, *recs)
        await until(ctx, bench, lambda: rewinds_of(bench, 1) == [(0, 200)])
        send(bench, 1, Opcode.ACKNOWLEDGE, 200)
        await until(ctx, bench, lambda: rewinds_of(bench, 1) == [(0, 200), (1, 201)])
        send(bench, 1, Opcode.ACKNOWLEDGE, 202)
        await bench.drain(ctx)

        # QP 2: 12 records, ack_timeout 1, an ACK every 12 cycles.
        recs = [make_rec(2, WRITE, 300 + k, index=k, ack_timeout=1) for k in range(12)]
        await offer(ctx, bench, *recs)
        for k in range(12):
            await cycles(ctx, bench, 12)
            send(bench, 2, Opcode.ACKNOWLEDGE, 300 + k)
        await bench.drain(ctx)
        assert not rewinds_of(bench, 2), bench.rewind_log

        # QP 3 in ERR: its timeout flushes.
        await offer(ctx, bench, make_rec(3, WRITE, 400, ack_timeout=1),
                    make_rec(3, WRITE, 401, index=1))
        stuck = bench.t - 2
        assert ref.due(3, "timeout") == "flush"
        retired = len(bench.retire_cycles)
        await bench.drain(ctx)
        lo, hi = timer_window(4, 2)
        assert lo <= bench.retire_cycles[retired] - stuck <= hi + 8
        assert not rewinds_of(bench, 3)
        await bench.check_counters(ctx)
        assert ref.counters["retransmits_timeout"] == 8, ref.counters

    run(dut, factory, body)


def test_rnr():
    """RNR NAKs, ``timer_tick`` 16 cycles (1 VL, 2 QPs): the rewind comes after the RNR
    table's ticks (codes 1, 2: 3 and 5 ticks; window ``timer_window``); ``rnr_retry`` 2:
    the third RNR NAK completes the head with RNR_RETRY_EXC_ERR, ``qp_error``, the rest
    flushed (QP 0); ``rnr_retry`` 7 never gives up (QP 1, nine RNR NAKs), and an RNR NAK
    further on is progress: its count restarts."""
    qp_states = [QpState.RTS, QpState.RTS]
    dut, factory = reliability_bench(2, qp_states, timer_tick=TICK)

    async def body(ctx, bench):
        ref = bench.ref
        bench.drive_qp_states(ctx)
        recs = [make_rec(0, WRITE, 10 + k, index=k, rnr_retry=2) for k in range(3)]
        await offer(ctx, bench, *recs)
        send(bench, 0, Opcode.ACKNOWLEDGE, 10)
        for k, code in enumerate((1, 2)):
            sent = bench.t
            send(bench, 0, Opcode.ACKNOWLEDGE, 11, 0x20 | code)
            await until(ctx, bench, lambda: len(rewinds_of(bench, 0)) == k + 1)
            lo, hi = timer_window(2, RNR_TIMER_TICKS[code])
            waited = bench.rewind_log[-1][0] - sent
            assert lo <= waited <= hi, (code, waited, lo, hi)
        assert rewinds_of(bench, 0) == [(1, 11), (1, 11)]
        send(bench, 0, Opcode.ACKNOWLEDGE, 11, 0x21)
        await bench.drain(ctx)
        assert bench.qp_errors == [0] and ref.counters["retries_exhausted"] == 1

        recs = [make_rec(1, WRITE, 50 + k, index=k, rnr_retry=7) for k in range(3)]
        await offer(ctx, bench, *recs)
        for k in range(9):
            send(bench, 1, Opcode.ACKNOWLEDGE, 50, 0x21)
            await until(ctx, bench, lambda: len(rewinds_of(bench, 1)) == k + 1)
        assert rewinds_of(bench, 1) == [(0, 50)] * 9
        send(bench, 1, Opcode.ACKNOWLEDGE, 52)
        await bench.drain(ctx)
        # rnr_retry 1 and an RNR NAK that moves ack_psn: not exhausted by the second one
        recs = [make_rec(1, WRITE, 60 + k, index=10 + k, rnr_retry=1) for k in range(3)]
        await offer(ctx, bench, *recs)
        send(bench, 1, Opcode.ACKNOWLEDGE, 60, 0x21)
        await until(ctx, bench, lambda: len(rewinds_of(bench, 1)) == 10)
        send(bench, 1, Opcode.ACKNOWLEDGE, 61, 0x21)     # acknowledges 60: progress
        await until(ctx, bench, lambda: len(rewinds_of(bench, 1)) == 11)
        assert rewinds_of(bench, 1)[-2:] == [(10, 60), (11, 61)]
        send(bench, 1, Opcode.ACKNOWLEDGE, 62)
        await bench.drain(ctx)
        await bench.check_counters(ctx)
        assert ref.counters["retransmits_rnr"] == 2 + 9 + 2 and bench.qp_errors == [0], ref.counters

    run(dut, factory, body)


@pytest.mark.parametrize("kwargs", [
    {"num_qps": 0}, {"num_qps": 257}, {"num_cqs": 0}, {"num_cqs": 300}, {"num_vls": 0},
    {"num_vls": 16}, {"addr_width": 8}, {"addr_width": 65}, {"num_qps": 2.5},
    {"timer_tick": 0}, {"timer_tick": (1 << 16) + 1}, {"timer_tick": 4.0},
])
def test_parameters(kwargs):
    with pytest.raises(ValueError):
        CompletionUnit(**kwargs)
