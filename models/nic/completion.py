"""The NIC's completion unit: CQE writes in order, NAKs, retries and flushes
(docs/nic.md, docs/nic-reliability.md)."""
from collections import defaultdict, deque
from dataclasses import dataclass, replace

from models.ib import AETH, Opcode
from models.mlx5 import (ATOMIC_OPCODES, Cqe, Opcode as MlxOpcode, Syndrome, cqe_address, cqe_owner,
                         error_cqe, landed_atomic_result)
from models.nic.common import (CompletionStatus, NakCode, Packet, QpState, decode_packet, psn_add,
                               psn_diff, psn_le, psn_lt, read_response_opcode)
from models.nic.requester import RequesterModel, WqeResult

# --- completion unit ----------------------------------------------------------------------------

NAK_CODE_SYNDROME = {1: Syndrome.REMOTE_INVAL_REQ_ERR, 2: Syndrome.REMOTE_ACCESS_ERR,
                     3: Syndrome.REMOTE_OP_ERR}




@dataclass(frozen=True)
class Completion:
    """One WQE leaving the outstanding table: ``retire(qpn, wqe_blocks)``, after writing
    ``cqe`` (owner bit set) at ``address`` of CQ ``cqn`` when ``cqe`` is not None."""
    qpn: int
    wqe_index: int
    wqe_blocks: int
    cqn: int
    cqe: Cqe | None
    address: int | None

    @property
    def data(self) -> bytes | None:
        return None if self.cqe is None else self.cqe.pack()


_RESPONSES = frozenset({Opcode.ACKNOWLEDGE, Opcode.ATOMIC_ACKNOWLEDGE,
                        Opcode.RDMA_READ_RESPONSE_FIRST, Opcode.RDMA_READ_RESPONSE_MIDDLE,
                        Opcode.RDMA_READ_RESPONSE_LAST, Opcode.RDMA_READ_RESPONSE_ONLY})
_ATOMIC_MLX = ATOMIC_OPCODES


# IBA RNR NAK timer field (AETH bits 4..0) -> the wait in microseconds (IBA table 45).
RNR_TIMER_US = (655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280,
                1920, 2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440,
                81920, 122880, 163840, 245760, 327680, 491520)
RNR_RETRY_UNLIMITED = 7


@dataclass
class Rewind:
    """A ``rewind`` strobe (``RewindLayout``) and why: "nak" (sequence NAK or a gap in the
    responses), "timeout" or "rnr"."""
    qpn: int
    wqe_index: int
    psn: int
    cause: str


@dataclass
class _QpProgress:
    """The completion unit's per-QP PSN and retry state (hdl/nic/completion_unit.py)."""
    has_sent: bool = False
    ack_psn: int = 0         # newest acknowledged PSN
    sent_psn: int = 0        # last PSN of the newest SENT record
    on_wire: bool = False    # a packet was sent since reset
    wire_psn: int = 0        # the highest PSN sent (``packet_sent``)
    read_psn: int = 0        # newest READ response LAST/ONLY
    atomic_psn: int = 0      # newest ATOMIC ACKNOWLEDGE
    nak: tuple | None = None  # (psn, syndrome) of a fatal NAK not yet applied
    flushing: bool = False
    rewind_pending: bool = False
    gap_seen: bool = False   # rewound since the last progress: more NAKs/gaps are echoes
    rnr_pending: bool = False
    rnr_code: int = 0
    retries_used: int = 0
    rnr_used: int = 0


class CompletionModel:
    """The NIC's completion unit (docs/nic.md, "Completions"; the PSN and retry rules of
    hdl/nic/completion_unit.py, docs/nic-reliability.md).

    Give it every :class:`WqeResult` in WQE order per QP (:meth:`post`; a WQE sent again
    after a rewind is not posted again: the executor emits no second record), every
    request packet as it goes on the wire (:meth:`packet_sent`, or ``post(...,
    on_wire=True)``: all of the WQE's packets at once) and every packet that arrives
    (:meth:`receive`); ``post`` and ``receive`` return the :class:`Completion` list they
    cause, in order. What depends on time is driven from outside: :meth:`timer_expired`
    (the local ACK timeout fired) and :meth:`rnr_wait_over`. Every ``rewind`` strobe the
    NIC would emit is appended to :attr:`rewinds`.

    A response for QP q at PSN p is taken only if q has had a SENT record since its reset,
    is not flushing, ``ack_psn < p <= sent_psn`` and p is not after ``wire_psn``, the
    highest PSN q has sent (the executor emits a record with its message's first packet,
    so a record's later PSNs may not be on the wire yet); else it is dropped and counted
    (``rx_dropped_unexpected``, or ``rx_dropped_icrc``). Then:

    - ACK: ``ack_psn = p``; if p covers R's first PSN (R below: its responses went
      missing), a rewind unless ``gap_seen``.
    - fatal NAK (codes 1..3; at R's first PSN instead if R, below, begins before p: its
      data never came): records ending before p complete, the one holding p gets the
      NAK's error, the rest and every later one are flushed, ``requester.set_qp_error``.
    - NAK PSN sequence error: ``ack_psn = p - 1``; a rewind unless one already happened
      since the last progress (``gap_seen``: this NAK answers packets sent before it).
    - RNR NAK: ``ack_psn = p - 1``; the QP waits (:meth:`rnr_wait_over`) and then rewinds.
    - NAK codes 4..: counted only.
    - READ response / ATOMIC ACKNOWLEDGE: these refer to R, the QP's oldest outstanding
      SENT READ or atomic WQE whose responses have not all been taken. Taken only if R is
      a READ (atomic), p is ``ack_psn + 1`` inside R or R's first PSN (then it also
      acknowledges everything before R), the opcode is the one p's position in R needs
      (:func:`read_response_opcode`) and the payload is the position's length (MTU, or the
      rest; atomic: the AtomicAckETH). Taken: the payload goes to ``write_memory`` at
      ``R.laddr + (p - R.first_psn) * MTU`` (atomic: the original value at ``R.laddr``,
      as :func:`models.mlx5.landed_atomic_result` lays out its ``byte_count`` bytes), ``ack_psn = p``, LAST/ONLY: ``read_psn = p`` and R
      has all its responses, atomic: ``atomic_psn = p``. Not taken with ``ack_psn + 1 < p`` (a
      response went missing): like a sequence NAK, without moving ``ack_psn``. Otherwise
      dropped (``rx_dropped_unexpected``). ``read_responses`` / ``atomic_acks`` count the
      taken ones and the gaps.

    ``ack_psn`` moving forward is progress: the retry counts and ``gap_seen`` clear. A
    SENT head completes: READ when ``last_psn <= read_psn``, atomic when ``last_psn <=
    atomic_psn`` (only its own acknowledge), others when ``last_psn <= ack_psn``.

    Rewind, when the head cannot complete: in a QP in ERR or flushing, everything
    outstanding flushes instead; with the retries used up (``retry_cnt``; RNR:
    ``rnr_retry``, 7 without limit) the head completes with TRANSPORT_RETRY_EXC_ERR
    (RNR_RETRY_EXC_ERR), the QP goes to ERR and the rest flush; else a :class:`Rewind`
    to the head's first PSN, ``ack_psn = read_psn = atomic_psn = first_psn - 1``, one
    retry used, ``gap_seen``, pending NAK and RNR cleared. ``counters`` uses the
    CompletionUnit names.
    """

    def __init__(self, requester: RequesterModel, write_memory=None):
        self.requester = requester
        self.write_memory = write_memory
        self.cq_pi = defaultdict(int)
        self.outstanding = defaultdict(deque)
        # Per QP, in WQE order, the SENT READ and atomic WQEs whose responses have not all
        # been taken: R is the first (the engine's second queue, ``reads``).
        self.awaiting_responses = defaultdict(deque)
        self.progress = defaultdict(_QpProgress)
        self.rewinds = []
        self.counters = dict.fromkeys(
            ("acks_received", "naks_received", "read_responses", "atomic_acks", "cqes_written",
             "error_cqes", "rx_dropped_icrc", "rx_dropped_unexpected", "retransmits_nak",
             "retransmits_timeout", "retransmits_rnr", "retries_exhausted"), 0)

    def post(self, result: WqeResult, on_wire: bool = True) -> list:
        """The executor's record of ``result``; ``on_wire``: all its packets were sent
        too (else :meth:`packet_sent` tells each)."""
        self.outstanding[result.qpn].append(result)
        if result.status == CompletionStatus.SENT and on_wire and result.packets:
            self.packet_sent(result.qpn, result.last_psn)
        if result.status == CompletionStatus.SENT:
            if result.opcode == MlxOpcode.RDMA_READ or result.opcode in _ATOMIC_MLX:
                self.awaiting_responses[result.qpn].append(result)
            st = self.progress[result.qpn]
            if not st.has_sent:
                st.has_sent = True
                st.ack_psn = st.read_psn = st.atomic_psn = psn_add(result.first_psn, -1)
            st.sent_psn = result.last_psn
        out = []
        self._advance(result.qpn, out)
        return out

    def packet_sent(self, qpn: int, psn: int):
        """A request packet of QP ``qpn`` went on the wire (the executor's ``sent``), ``psn``
        the last PSN it accounts for (its own; a READ request's: the READ's last PSN):
        ``wire_psn`` moves to it unless it is a resend below it."""
        st = self.progress[qpn]
        if not st.on_wire or psn_lt(st.wire_psn, psn):
            st.wire_psn = psn
        st.on_wire = True

    def flush_qp(self, qpn: int) -> list:
        """The QP went to ERR (host write): everything outstanding, and every record
        posted from now on, completes with a flush error."""
        self.progress[qpn].flushing = True
        out = []
        self._advance(qpn, out)
        return out

    def reset_qp(self, qpn: int):
        """RESET: the QP's outstanding table and PSN state are cleared, no completions."""
        self.progress[qpn] = _QpProgress()
        self.outstanding[qpn].clear()
        self.awaiting_responses[qpn].clear()

    def head(self, qpn: int) -> WqeResult | None:
        """The oldest WQE of the QP not yet completed (H), or None."""
        queue = self.outstanding[qpn]
        return queue[0] if queue else None

    def responses_for(self, qpn: int) -> WqeResult | None:
        """R: the oldest outstanding SENT READ or atomic WQE of the QP whose responses have
        not all been taken, or None."""
        waiting = self.awaiting_responses[qpn]
        return waiting[0] if waiting else None

    def timer_expired(self, qpn: int) -> list:
        """The local ACK timeout fired for the QP (its head is a SENT WQE that has waited
        ``2**ack_timeout`` ticks without progress, a rewind or a packet of the QP sent):
        rewind, or give up."""
        return self._retry(qpn, "timeout")

    def rnr_wait_over(self, qpn: int) -> list:
        """The wait an RNR NAK asked for is over: rewind, or give up."""
        st = self.progress[qpn]
        if not st.rnr_pending:
            raise ValueError(f"QP {qpn} waits for no RNR timer")
        return self._retry(qpn, "rnr")

    def rnr_wait_ns(self, qpn: int) -> int:
        """How long the pending RNR NAK of the QP asked to wait (its AETH timer code)."""
        return 1000 * RNR_TIMER_US[self.progress[qpn].rnr_code]

    def _retry(self, qpn: int, cause: str) -> list:
        out = []
        head = self.head(qpn)
        if head is not None and head.status == CompletionStatus.SENT:
            self._rewind(qpn, cause, out)
        self._advance(qpn, out)
        return out

    def _complete(self, result: WqeResult, out: list, syndrome: int = 0):
        # Completion is in WQE order, so a READ or atomic that completes (by a flush or an
        # error) before its responses came is R.
        waiting = self.awaiting_responses[result.qpn]
        if waiting and waiting[0] is result:
            waiting.popleft()
        cqe = None
        address = None
        if syndrome:
            cqe = error_cqe(result.qpn, result.wqe_index, result.opcode, syndrome)
        elif result.writes_cqe:
            cqe = result.cqe()
        if cqe is not None:
            cq = self.requester.cqs[result.cqn]
            pi = self.cq_pi[result.cqn]
            log_size = 0 if cq.collapsed else cq.log_size
            cqe = replace(cqe, owner=cqe_owner(pi, log_size))
            address = cqe_address(cq.base, cq.log_size, cq.collapsed, pi)
            self.cq_pi[result.cqn] = pi + 1
            self.counters["cqes_written"] += 1
            self.counters["error_cqes"] += cqe.is_error
        out.append(Completion(result.qpn, result.wqe_index, result.wqe_blocks, result.cqn,
                              cqe, address))

    def _rewind(self, qpn: int, cause: str, out: list):
        """Go back to the head H (a SENT WQE that cannot complete)."""
        st = self.progress[qpn]
        head = self.outstanding[qpn][0]
        st.rewind_pending = False
        if st.flushing or self.requester.state[qpn] != QpState.RTS:
            st.flushing = True          # the flush happens in _advance
            st.rnr_pending = False
            return
        if cause == "rnr":
            exhausted = head.rnr_retry != RNR_RETRY_UNLIMITED and st.rnr_used >= head.rnr_retry
            syndrome = Syndrome.RNR_RETRY_EXC_ERR
        else:
            exhausted = st.retries_used >= head.retry_cnt
            syndrome = Syndrome.TRANSPORT_RETRY_EXC_ERR
        st.rnr_pending = False
        if exhausted:
            self.counters["retries_exhausted"] += 1
            self._complete(self.outstanding[qpn].popleft(), out, syndrome)
            st.flushing = True
            self.requester.set_qp_error(qpn)
            return
        if cause == "rnr":
            st.rnr_used += 1
        else:
            st.retries_used += 1
        self.counters[f"retransmits_{cause}"] += 1
        self.rewinds.append(Rewind(qpn, head.wqe_index, head.first_psn, cause))
        st.ack_psn = st.read_psn = st.atomic_psn = psn_add(head.first_psn, -1)
        st.gap_seen = True

    def _advance(self, qpn: int, out: list):
        queue = self.outstanding[qpn]
        st = self.progress[qpn]
        while queue:
            head = queue[0]
            if st.flushing or head.status == CompletionStatus.FLUSH:
                self._complete(queue.popleft(), out, Syndrome.WR_FLUSH_ERR)
                continue
            if head.status == CompletionStatus.ERROR:
                self._complete(queue.popleft(), out, head.syndrome)
                continue
            if st.nak is not None:
                psn, syndrome = st.nak
                if psn_lt(head.last_psn, psn):
                    self._complete(queue.popleft(), out)
                else:
                    self._complete(queue.popleft(), out, syndrome)
                    st.nak = None
                    st.flushing = True
                    self.requester.set_qp_error(qpn)
                continue
            if head.opcode == MlxOpcode.RDMA_READ:
                done = psn_le(head.last_psn, st.read_psn)
            elif head.opcode in _ATOMIC_MLX:
                done = psn_le(head.last_psn, st.atomic_psn)
            else:
                done = psn_le(head.last_psn, st.ack_psn)
            if not done:
                if st.rewind_pending:
                    self._rewind(qpn, "nak", out)
                    continue
                return
            self._complete(queue.popleft(), out)
            if psn_lt(st.read_psn, head.last_psn):
                st.read_psn = head.last_psn
            if psn_lt(st.atomic_psn, head.last_psn):
                st.atomic_psn = head.last_psn
        st.rewind_pending = st.rnr_pending = False

    def _acknowledge(self, st: _QpProgress, psn: int):
        """``ack_psn = psn``; moving forward is progress."""
        if psn_lt(st.ack_psn, psn):
            st.retries_used = st.rnr_used = 0
            st.gap_seen = False
        st.ack_psn = psn

    def _drop(self) -> list:
        self.counters["rx_dropped_unexpected"] += 1
        return []

    def _response_fits(self, st: _QpProgress, head: WqeResult | None, opcode: int, psn: int,
                       pkt: Packet) -> bool:
        """Whether a READ response / ATOMIC ACKNOWLEDGE at ``psn`` is the one R (``head``)
        needs next (in order or at R's first PSN; opcode for the position, payload
        length)."""
        if head is None:
            return False
        in_order = (psn == psn_add(st.ack_psn, 1) and psn_le(head.first_psn, psn)
                    and psn_le(psn, head.last_psn))
        if not (in_order or psn == head.first_psn):
            return False
        if opcode == Opcode.ATOMIC_ACKNOWLEDGE:
            return head.opcode in _ATOMIC_MLX and not pkt.payload
        if head.opcode != MlxOpcode.RDMA_READ:
            return False
        count = psn_diff(head.last_psn, head.first_psn) + 1
        i = psn_diff(psn, head.first_psn)
        length = min(head.mtu_bytes, head.byte_count - i * head.mtu_bytes)
        return opcode == read_response_opcode(i, count) and len(pkt.payload) == length

    def receive(self, packet: bytes) -> list:
        try:
            pkt = decode_packet(packet)
        except ValueError:
            return self._drop()
        if not pkt.icrc_ok:
            self.counters["rx_dropped_icrc"] += 1
            return []
        opcode = pkt.bth.opcode
        if opcode not in _RESPONSES:
            return self._drop()
        qpn, psn = pkt.bth.destqp, pkt.bth.psn
        aeth = pkt.ext[0].syndrome if pkt.ext and isinstance(pkt.ext[0], AETH) else None
        kind = None if aeth is None else aeth >> 5
        if opcode == Opcode.ACKNOWLEDGE:
            if not (kind in (0b000, 0b001) or (kind == 0b011 and aeth & 0x1F <= 4)):
                return self._drop()
        elif aeth is not None and kind != 0b000:
            return self._drop()
        st = self.progress.get(qpn)
        if (st is None or not st.has_sent or st.flushing or st.nak is not None
                or self.requester.state[qpn] == QpState.RESET
                or not (psn_lt(st.ack_psn, psn) and psn_le(psn, st.sent_psn))
                or not st.on_wire or not psn_le(psn, st.wire_psn)):
            return self._drop()
        out = []
        if opcode == Opcode.ACKNOWLEDGE:
            if kind == 0b000:
                self.counters["acks_received"] += 1
                seen = st.gap_seen
                self._acknowledge(st, psn)
                r = self.responses_for(qpn)
                if r is not None and psn_le(r.first_psn, psn):
                    st.rewind_pending |= not seen
            else:
                self.counters["naks_received"] += 1
                code = aeth & 0x1F
                if kind == 0b001:
                    self._acknowledge(st, psn_add(psn, -1))
                    st.rnr_pending = True
                    st.rnr_code = code
                elif code in NAK_CODE_SYNDROME:
                    # past R, whose data never came: the error lands on R
                    r = self.responses_for(qpn)
                    if r is not None and psn_lt(r.first_psn, psn):
                        psn = r.first_psn
                    self._acknowledge(st, psn_add(psn, -1))
                    st.nak = (psn, NAK_CODE_SYNDROME[code])
                elif code == NakCode.PSN_SEQUENCE_ERROR:
                    # gap_seen as it was before this NAK: an echo of the loss already
                    # rewound may itself move ack_psn (back to where the rewind took it from)
                    seen = st.gap_seen
                    self._acknowledge(st, psn_add(psn, -1))
                    st.rewind_pending |= not seen
        else:
            atomic = opcode == Opcode.ATOMIC_ACKNOWLEDGE
            head = self.responses_for(qpn)
            if self._response_fits(st, head, opcode, psn, pkt):
                self.counters["atomic_acks" if atomic else "read_responses"] += 1
                if atomic:
                    data = landed_atomic_result(pkt.ext[1].orig, head.byte_count)
                    addr = head.laddr
                else:
                    data = pkt.payload
                    addr = head.laddr + psn_diff(psn, head.first_psn) * head.mtu_bytes
                if self.write_memory is not None and data:
                    self.write_memory(addr, data)
                self._acknowledge(st, psn)
                if psn == head.last_psn:
                    self.awaiting_responses[qpn].popleft()
                if atomic:
                    st.atomic_psn = psn
                elif opcode in (Opcode.RDMA_READ_RESPONSE_LAST, Opcode.RDMA_READ_RESPONSE_ONLY):
                    st.read_psn = psn
            elif psn_lt(psn_add(st.ack_psn, 1), psn):
                self.counters["atomic_acks" if atomic else "read_responses"] += 1
                st.rewind_pending |= not st.gap_seen
            else:
                return self._drop()
        self._advance(qpn, out)
        return out


def expected_cqes(results, nak: tuple[int, int] | None = None) -> list:
    """The CQEs (owner 0) one QP's WQEs complete with, in order, when every request is
    acknowledged, or when the responder NAKs ``nak = (psn, code)`` with a fatal code.

    ``results``: that QP's :class:`WqeResult` list in WQE order. Unsignaled successes
    give no CQE and are left out.
    """
    cqes = []
    errored = False
    for r in results:
        if errored:
            cqes.append(error_cqe(r.qpn, r.wqe_index, r.opcode, Syndrome.WR_FLUSH_ERR))
            continue
        if (nak is not None and r.status == CompletionStatus.SENT
                and psn_le(r.first_psn, nak[0]) and psn_le(nak[0], r.last_psn)):
            cqes.append(error_cqe(r.qpn, r.wqe_index, r.opcode, NAK_CODE_SYNDROME[nak[1]]))
            errored = True
            continue
        if r.writes_cqe:
            cqes.append(r.cqe())
        errored = r.status != CompletionStatus.SENT
    return cqes
