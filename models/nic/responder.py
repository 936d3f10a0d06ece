"""The responder side: the traffic peer the NIC testbenches put on the wire and the NIC's
own responder rule for rule (docs/nic-responder.md)."""
from collections import defaultdict
from dataclasses import dataclass, field

from models.crc import icrc_bytes
from models.ib import (AETH, BTH, LNH_IBA_LOCAL, LRH, MASKED_ATOMICS, RETH, AtomicAckETH, AtomicETH,
                       ImmDt, MaskedAtomicETH, Opcode, atomic_operand_bytes, carries_payload,
                       extension_headers)
from models.mlx5 import (RECV_WQE_BYTES, Cqe, CqeOpcode, Syndrome, parse_recv_wqe,
                         parse_rq_doorbell_record, recv_wqe, responder_cqe, responder_error_cqe,
                         rq_doorbell_record)
from models.nic.common import (Access, ICRC_SIZE, Mkey, NakCode, PSN_MOD, Packet, QpContext,
                               QpState, atomic_new_value, decode_packet, make_packet, mkey_index,
                               psn_add, psn_diff, read_response_opcode)

# --- responder ------------------------------------------------------------------------------------

@dataclass
class ResponderQp:
    """One responder QP. ``peer_qpn``: the requester's QP number (responses' DestQP);
    ``epsn``: the next PSN expected; ``mtu``: path MTU code for READ responses."""
    peer_qpn: int
    epsn: int = 0
    mtu: int = 5
    msn: int = 0
    error: bool = False
    unacked: int = 0
    last_psn: int = 0
    seq_nak_sent: bool = False
    # message in progress: None, "send" or "write"
    in_progress: str | None = None
    write_va: int = 0
    write_left: int = 0
    send_buffer: bytearray = field(default_factory=bytearray)
    received: list = field(default_factory=list)   # (payload, imm or None) per SEND message
    reply_dlid: int = 0
    reply_sl: int = 0
    reply_vl: int = 0
    reply_pkey: int = 0xFFFF


_SEND_LASTS = {Opcode.SEND_LAST, Opcode.SEND_LAST_WITH_IMMEDIATE}
_SEND_ONLYS = {Opcode.SEND_ONLY, Opcode.SEND_ONLY_WITH_IMMEDIATE}
_WRITE_LASTS = {Opcode.RDMA_WRITE_LAST, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE}
_WRITE_ONLYS = {Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE}
ACK_SYNDROME = 0x1F      # ACK, credit field "invalid" (no end-to-end credits)
SAVED_ATOMICS = 4        # executed atomics a responder QP keeps for duplicates


class _Nak(Exception):
    def __init__(self, code):
        self.code = code


@dataclass(frozen=True)
class RecvCompletion:
    """A receive completion (``ReceiveCompletionLayout``): a SEND or WRITE_WITH_IMM
    message that consumed receive WQE ``wqe_counter``, or (``opcode`` RESP_ERR with
    ``syndrome``) a receive WQE that failed. ``imm``: the immediate as the big-endian
    number on the wire (0 without one)."""
    qpn: int
    cqn: int
    opcode: CqeOpcode
    byte_count: int = 0
    imm: int = 0
    wqe_counter: int = 0
    syndrome: int = 0

    def cqe(self, owner: int = 0) -> Cqe:
        """The CQE the completion unit writes for it (models.mlx5 responder CQEs)."""
        if self.opcode == CqeOpcode.RESP_ERR:
            return responder_error_cqe(self.qpn, self.wqe_counter, self.syndrome, owner)
        return responder_cqe(self.qpn, self.wqe_counter, self.opcode, self.byte_count,
                             self.imm, owner)

    def record(self) -> dict:
        """The ``ReceiveCompletionLayout`` fields."""
        return dict(qpn=self.qpn, cqn=self.cqn, opcode=int(self.opcode),
                    syndrome=int(self.syndrome), byte_count=self.byte_count, imm=self.imm,
                    wqe_counter=self.wqe_counter)


@dataclass
class Decision:
    """What the responder did with one packet (:meth:`NicResponderModel.process`).

    ``fate``: the one counter the packet incremented besides ``packets`` and
    ``requests_received`` (e.g. "requests_executed", "invalid_naks", "rx_dropped_qp");
    ``commands``: ``ResponseCommandLayout`` field dicts (``kind`` "ACK"/"READ"/"ATOMIC"),
    ``packets``: those rendered on the wire (LRH .. ICRC, READ payload read at once);
    ``dma``: ``(addr, bytes)`` of the descriptor's one DMA write command (``(0, 0)`` when
    nothing is written; None when the receiver dropped the packet, no descriptor);
    ``writes``: ``(addr, data)`` memory writes in order (payload and atomics);
    ``completions``: :class:`RecvCompletion` made; ``recv_taken``: the receive WQE counter
    consumed (None if none); ``recv_result``: the ReceiveQueue's answer when it was asked
    (``RecvResultLayout`` fields, ``status`` "OK"/"EMPTY"/"ERROR"); ``atomic``: the
    ``AtomicRequestLayout`` fields plus ``orig`` of an executed atomic; ``qp_error``: the
    QP went to ERR (the ``qp_error`` event)."""
    fate: str
    qpn: int | None = None
    psn: int | None = None
    commands: list = field(default_factory=list)
    packets: list = field(default_factory=list)
    dma: tuple | None = None
    writes: list = field(default_factory=list)
    completions: list = field(default_factory=list)
    recv_taken: int | None = None
    recv_result: dict | None = None
    atomic: dict | None = None
    qp_error: bool = False


@dataclass
class _ResponderState:
    """Per-QP state of :class:`NicResponderModel` (reset by RESET -> RTS)."""
    state: QpState = QpState.RTS
    epsn: int = 0
    msn: int = 0
    seq_nak_sent: bool = False
    in_progress: str | None = None     # None, "send" or "write"
    write_va: int = 0                  # WRITE: where the next payload byte goes
    write_left: int = 0                # WRITE: bytes of the RETH length still to come
    write_len: int = 0                 # WRITE: the RETH length (WR_IMM byte_count)
    recv_addr: int = 0                 # SEND: the receive WQE's buffer, its length and
    recv_length: int = 0               # counter, and the bytes received so far
    recv_counter: int = 0
    recv_offset: int = 0
    # the newest SAVED_ATOMICS executed atomics, newest first: (PSN, original value)
    saved_atomics: list = field(default_factory=list)
    rq_ci: int = 0                     # receive queue consumer index (16 bits)
    rq_pi: int = 0                     # the ReceiveQueue's cached producer index


class _Fail(Exception):
    """An execution check failed (step 4): ``counter``, the AETH syndrome, whether the QP
    goes to ERR, and the receive error completion's syndrome (0: none)."""
    def __init__(self, counter, syndrome, fatal=True, recv_syndrome=0):
        self.counter = counter
        self.syndrome = syndrome
        self.fatal = fatal
        self.recv_syndrome = recv_syndrome


_ATOMIC_OPCODES = frozenset({Opcode.COMPARE_SWAP, Opcode.FETCH_ADD}) | MASKED_ATOMICS
_REQUEST_OPCODES = frozenset(range(Opcode.SEND_FIRST, Opcode.RDMA_READ_REQUEST + 1)) | _ATOMIC_OPCODES
_RESPONSE_OPCODES = frozenset(range(Opcode.RDMA_READ_RESPONSE_FIRST, Opcode.ATOMIC_ACKNOWLEDGE + 1))
_HEADER_BYTES = {op: LRH.SIZE + BTH.SIZE + sum(h.SIZE for h in extension_headers(op))
                 for op in _REQUEST_OPCODES}
MAX_PAYLOAD_BYTES = 4096
NAK = 0x60
RNR_NAK = 0x20


class _ResponderMemory:
    """A responder's memory: a ``bytearray`` (or ``memory_bytes`` zeros) at ``base``, or
    ``read(addr, n)`` / ``write(addr, data)`` callables. What an access outside it does is
    the subclass's (:meth:`_outside`)."""

    def __init__(self, lid: int, *, memory: bytearray | None = None,
                 memory_bytes: int | None = None, base: int = 0, read=None, write=None):
        if memory is None and memory_bytes is not None:
            memory = bytearray(memory_bytes)
        if (memory is None) == (read is None or write is None):
            raise ValueError("give memory (or memory_bytes), or both read and write")
        self.lid = lid
        self.memory = memory
        self.base = base
        self._read = read
        self._write = write

    def _outside(self, va: int, n: int):
        raise NotImplementedError

    def _check_range(self, va: int, n: int):
        if self.memory is not None and (va < self.base or va + n > self.base + len(self.memory)):
            self._outside(va, n)

    def read(self, va: int, n: int) -> bytes:
        self._check_range(va, n)
        if self.memory is None:
            return bytes(self._read(va, n))
        return bytes(self.memory[va - self.base:va - self.base + n])

    def write(self, va: int, data: bytes):
        self._check_range(va, len(data))
        if self.memory is None:
            self._write(va, bytes(data))
        else:
            self.memory[va - self.base:va - self.base + len(data)] = data


class ResponderPeer(_ResponderMemory):
    """The remote end of the RC connections (IBA ch. 9.7, responder side), as the
    testbenches put it on the wire.

    ``qps``: ``{responder QPN (the requests' DestQP): ResponderQp}``; more with
    :meth:`add_qp`. With ``peer_qpn`` (a function DestQP -> requester QPN), a packet for
    an unknown QP creates one, expecting that packet's PSN, with path MTU code ``mtu``
    (it must be the requester QP's: READ responses are cut at it). Memory: see
    :class:`_ResponderMemory`; accesses outside it get NAK remote access error.
    ``ack_every``: an ACK for the newest PSN at least every that many SEND/WRITE packets,
    and for every AckReq packet unless ``coalesce_ackreq`` (then only every ``ack_every``
    packets and at :meth:`flush`). Atomics operate on little-endian words of their
    operand size (8 bytes; 4 for the 4-byte masked ones), aligned to it. A packet that does not decode is dropped and counted (``dropped_malformed``).
    The NIC's own responder, rule for rule, is :class:`NicResponderModel`.
    """

    def __init__(self, lid: int, qps: dict | None = None, *, memory: bytearray | None = None,
                 memory_bytes: int | None = None, base: int = 0, read=None, write=None,
                 ack_every: int = 1, coalesce_ackreq: bool = False, peer_qpn=None, mtu: int = 5):
        if ack_every < 1:
            raise ValueError("ack_every must be at least 1")
        super().__init__(lid, memory=memory, memory_bytes=memory_bytes, base=base, read=read,
                         write=write)
        self.qps = dict(qps or {})
        self.peer_qpn = peer_qpn
        self.mtu = mtu
        self.ack_every = ack_every
        self.coalesce_ackreq = coalesce_ackreq
        self.naks = {}
        self.counters = dict.fromkeys(("packets", "dropped_icrc", "dropped_unknown_qp",
                                       "dropped_qp_error", "duplicates", "out_of_sequence",
                                       "acks", "naks", "read_responses", "atomic_acks",
                                       "dropped_malformed"), 0)

    def _outside(self, va: int, n: int):
        raise _Nak(NakCode.REMOTE_ACCESS_ERROR)

    def add_qp(self, qpn: int, peer_qpn: int, epsn: int = 0, mtu: int | None = None) -> ResponderQp:
        """Responder QP ``qpn`` answering requester QP ``peer_qpn``, expecting ``epsn``."""
        qp = ResponderQp(peer_qpn=peer_qpn, epsn=epsn, mtu=self.mtu if mtu is None else mtu)
        self.qps[qpn] = qp
        return qp

    def inject_nak(self, qpn: int, psn: int, code: int):
        """Answer the packet with PSN ``psn`` on responder QP ``qpn`` with NAK ``code``
        (:class:`NakCode`) instead of executing it. Codes 1..3 put the QP in error: later
        packets are dropped."""
        self.naks[(qpn, psn)] = 0x60 | int(code)

    def inject_rnr(self, qpn: int, psn: int, timer: int = 0):
        """Answer ``psn`` with an RNR NAK (the packet is not executed)."""
        self.naks[(qpn, psn)] = 0x20 | (timer & 0x1F)

    # packets out
    def _response(self, qp: ResponderQp, opcode: int, psn: int, ext=(), payload=b"") -> bytes:
        return make_packet(vl=qp.reply_vl, sl=qp.reply_sl, dlid=qp.reply_dlid, slid=self.lid,
                           opcode=opcode, destqp=qp.peer_qpn, psn=psn, pkey=qp.reply_pkey,
                           ext=ext, payload=payload)

    def _ack(self, qp: ResponderQp, psn: int, syndrome: int = ACK_SYNDROME) -> bytes:
        if syndrome >> 5:
            self.counters["naks"] += 1
        else:
            self.counters["acks"] += 1
            qp.unacked = 0
        return self._response(qp, Opcode.ACKNOWLEDGE, psn, ext=[AETH(syndrome=syndrome,
                                                                     msn=qp.msn)])

    def flush(self) -> list:
        """ACKs for every QP with executed, not yet acknowledged packets."""
        return [self._ack(qp, qp.last_psn) for qp in self.qps.values()
                if qp.unacked and not qp.error]

    def receive(self, packet: bytes, end_bad: bool = False) -> list:
        """Process one request packet (LRH .. ICRC); returns the response packets. Never
        raises on a bad packet (``end_bad`` is accepted for the testbenches' sake: this peer
        has no link layer, the ICRC decides)."""
        self.counters["packets"] += 1
        try:
            pkt = decode_packet(packet)
        except ValueError:
            self.counters["dropped_malformed"] += 1
            return []
        if not pkt.icrc_ok:
            self.counters["dropped_icrc"] += 1
            return []
        qpn = pkt.bth.destqp
        qp = self.qps.get(qpn)
        if qp is None and self.peer_qpn is not None:
            qp = self.add_qp(qpn, self.peer_qpn(qpn), pkt.bth.psn)
        if qp is None:
            self.counters["dropped_unknown_qp"] += 1
            return []
        if qp.error:
            self.counters["dropped_qp_error"] += 1
            return []
        qp.reply_dlid, qp.reply_sl, qp.reply_vl = pkt.lrh.slid, pkt.lrh.sl, pkt.lrh.vl
        qp.reply_pkey = pkt.bth.pkey
        psn = pkt.bth.psn
        d = psn_diff(psn, qp.epsn)
        if d < 0:
            self.counters["duplicates"] += 1
            return [self._ack(qp, psn_add(qp.epsn, -1))]
        if d > 0:
            self.counters["out_of_sequence"] += 1
            if qp.seq_nak_sent:
                return []
            qp.seq_nak_sent = True
            return [self._ack(qp, qp.epsn, 0x60 | NakCode.PSN_SEQUENCE_ERROR)]
        qp.seq_nak_sent = False
        nak = self.naks.pop((qpn, psn), None)
        if nak is not None:
            if nak >> 5 == 0b011:
                qp.error = bool(nak & 0x1F)
                qp.seq_nak_sent = not qp.error
            return [self._ack(qp, psn, nak)]
        try:
            return self._execute(qp, pkt)
        except _Nak as e:
            if e.code != NakCode.PSN_SEQUENCE_ERROR:
                qp.error = True
            return [self._ack(qp, psn, 0x60 | e.code)]

    def _execute(self, qp: ResponderQp, pkt: Packet) -> list:
        op = pkt.bth.opcode
        psn = pkt.bth.psn
        mtu = 128 << qp.mtu
        payload = pkt.payload
        ext = {type(h): h for h in pkt.ext}
        if op == Opcode.RDMA_READ_REQUEST:
            return self._read_request(qp, psn, ext[RETH], mtu)
        if op in _ATOMIC_OPCODES:
            return self._atomic(qp, op, psn, pkt.ext[0])
        if op not in _WRITE_OPS_ALL:
            raise _Nak(NakCode.INVALID_REQUEST)
        first = op in _FIRSTS
        last = op in _LASTS
        middle_or_first = not last
        if (qp.in_progress is None) != first:
            raise _Nak(NakCode.INVALID_REQUEST)
        kind = "send" if op <= Opcode.SEND_ONLY_WITH_IMMEDIATE else "write"
        if not first and qp.in_progress != kind:
            raise _Nak(NakCode.INVALID_REQUEST)
        if middle_or_first and len(payload) != mtu:
            raise _Nak(NakCode.INVALID_REQUEST)
        if last and len(payload) > mtu:
            raise _Nak(NakCode.INVALID_REQUEST)
        if op in (Opcode.SEND_LAST, Opcode.SEND_LAST_WITH_IMMEDIATE, Opcode.RDMA_WRITE_LAST,
                  Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE) and not payload:
            raise _Nak(NakCode.INVALID_REQUEST)
        if kind == "write":
            if first:
                reth = ext[RETH]
                if reth.dmalen:
                    self._check_range(reth.va, reth.dmalen)
                qp.write_va, qp.write_left = reth.va, reth.dmalen
            if len(payload) > qp.write_left or (last and len(payload) != qp.write_left):
                raise _Nak(NakCode.INVALID_REQUEST)
            if payload:
                self.write(qp.write_va, payload)
            qp.write_va += len(payload)
            qp.write_left -= len(payload)
        else:
            if first:
                qp.send_buffer = bytearray()
            qp.send_buffer += payload
        qp.in_progress = None if last else kind
        if last:
            qp.msn = (qp.msn + 1) % PSN_MOD
            if kind == "send":
                imm = ext[ImmDt].imm if ImmDt in ext else None
                qp.received.append((bytes(qp.send_buffer), imm))
        qp.epsn = psn_add(psn, 1)
        qp.last_psn = psn
        qp.unacked += 1
        if (pkt.bth.ackreq and not self.coalesce_ackreq) or qp.unacked >= self.ack_every:
            return [self._ack(qp, psn)]
        return []

    def _read_request(self, qp: ResponderQp, psn: int, reth: RETH, mtu: int) -> list:
        if qp.in_progress is not None:
            raise _Nak(NakCode.INVALID_REQUEST)
        data = self.read(reth.va, reth.dmalen) if reth.dmalen else b""
        count = max(1, -(-len(data) // mtu))
        qp.msn = (qp.msn + 1) % PSN_MOD
        qp.unacked = 0
        out = []
        for i in range(count):
            chunk = data[i * mtu:(i + 1) * mtu]
            op = read_response_opcode(i, count)
            ext = [] if op == Opcode.RDMA_READ_RESPONSE_MIDDLE else [AETH(syndrome=ACK_SYNDROME,
                                                                          msn=qp.msn)]
            out.append(self._response(qp, op, psn_add(psn, i), ext=ext, payload=chunk))
        self.counters["read_responses"] += count
        qp.epsn = psn_add(psn, count)
        qp.last_psn = psn_add(psn, count - 1)
        return out

    def _atomic(self, qp: ResponderQp, op: int, psn: int, aeth) -> list:
        n = atomic_operand_bytes(op)
        if qp.in_progress is not None or aeth.va % n:
            raise _Nak(NakCode.INVALID_REQUEST)
        orig = int.from_bytes(self.read(aeth.va, n), "little")
        self.write(aeth.va, atomic_new_value(op, orig, aeth).to_bytes(n, "little"))
        qp.msn = (qp.msn + 1) % PSN_MOD
        qp.unacked = 0
        qp.epsn = psn_add(psn, 1)
        qp.last_psn = psn
        self.counters["atomic_acks"] += 1
        return [self._response(qp, Opcode.ATOMIC_ACKNOWLEDGE, psn,
                               ext=[AETH(syndrome=ACK_SYNDROME, msn=qp.msn),
                                    AtomicAckETH(orig=orig)])]


class NicResponderModel(_ResponderMemory):
    """The NIC's own responder, rule for rule (docs/nic-responder.md): receiver checks,
    P_Key, PSN rules, rkeys, receive queue, NAK codes, QP errors, receive completions and
    the hardware's counters; the reference the responder testbenches check the RTL
    against.

    ``contexts``: :class:`QpContext` by QPN (a dict or a list, read when needed, so tests
    may change fields later); a QP listed there starts in RTS expecting ``rq_psn`` (see
    :meth:`reset_qp`), a QPN not listed is in RESET. ``num_qps``: DestQP at or beyond it is
    dropped (default: no bound). ``mkeys``: the memory-key table by index (a list, or a
    dict ``{index: Mkey}`` with ``num_mkeys`` entries; missing entries are invalid); key
    ``k`` is looked up at ``(k >> 8) % num_mkeys``. ``sl_to_vl``: 16 entries (default VL =
    SL), the VL of the responses; a QP whose SL maps to a VL at or beyond ``num_vls`` (the
    port's data VLs), or whose path MTU code is outside 1..5, drops its requests
    (``rx_dropped_qp``), as hdl/nic/responder_engine.py does. Memory: see
    :class:`_ResponderMemory`; an access outside it raises ValueError (a test whose keys or
    receive queues lie outside the model's memory is misconfigured). See :meth:`process`
    for what each packet does and :attr:`counters` for the names.
    """

    HW_COUNTERS = ("requests_received", "rx_request_icrc_drops", "rx_request_malformed",
                   "requests_executed", "duplicate_requests", "seq_naks", "rnr_naks",
                   "access_naks", "invalid_naks", "op_naks", "rx_dropped_qp", "rx_dropped_pkey",
                   "atomic_replays")
    # The ReceiveQueue's counters (hdl/nic/receive_queue.py).
    RQ_COUNTERS = ("recv_wqes_consumed", "recv_wqe_errors", "rq_doorbell_reads")
    # Model-only: packets that in the NIC leave the request path without a counter of their
    # own, so that every packet is counted exactly once (see :meth:`process`).
    MODEL_COUNTERS = ("packets", "responses_steered", "seq_dropped", "duplicates_dropped")

    def __init__(self, lid: int, *, contexts, memory: bytearray | None = None,
                 memory_bytes: int | None = None, base: int = 0, read=None, write=None,
                 num_qps: int | None = None, mkeys=None, num_mkeys: int | None = None,
                 sl_to_vl=None, num_vls: int = 15):
        super().__init__(lid, memory=memory, memory_bytes=memory_bytes, base=base, read=read,
                         write=write)
        if mkeys is None:
            mkeys = []
        if isinstance(mkeys, dict):
            if num_mkeys is None:
                raise ValueError("a dict of memory keys needs num_mkeys")
            if any(not 0 <= i < num_mkeys for i in mkeys):
                raise ValueError("memory-key indices must be below num_mkeys")
        elif num_mkeys is None:
            num_mkeys = len(mkeys)
        elif num_mkeys != len(mkeys):
            raise ValueError("num_mkeys disagrees with the length of the mkeys list")
        sl_to_vl = list(range(16)) if sl_to_vl is None else list(sl_to_vl)
        if len(sl_to_vl) != 16:
            raise ValueError("sl_to_vl needs 16 entries")
        self.contexts = contexts
        self.num_qps = num_qps
        self.mkeys = mkeys
        self.num_mkeys = num_mkeys
        self.sl_to_vl = sl_to_vl
        self.num_vls = num_vls
        self.responder = {}            # QPN -> _ResponderState (created when first needed)
        self.completions = defaultdict(list)   # CQN -> [RecvCompletion] in order
        self.receive_completions = []          # every RecvCompletion in order
        self.qp_errors = []                    # QPNs in the order their qp_error events happen
        self.last = None                       # the Decision of the latest packet

        self.counters = dict.fromkeys(self.HW_COUNTERS + self.RQ_COUNTERS
                                      + self.MODEL_COUNTERS, 0)

    def _outside(self, va: int, n: int):
        raise ValueError(f"access [{va:#x}, {va + n:#x}) outside the model's memory "
                         f"[{self.base:#x}, {self.base + len(self.memory):#x})")

    def receive(self, packet: bytes, end_bad: bool = False) -> list:
        """The response packets of one request packet: ``process(packet, end_bad).packets``."""
        return self.process(packet, end_bad).packets

    def context(self, qpn: int) -> QpContext | None:
        """The QP's context, or None when the QP has none (RESET)."""
        if isinstance(self.contexts, dict):
            return self.contexts.get(qpn)
        return self.contexts[qpn] if 0 <= qpn < len(self.contexts) else None

    def _qp_state(self, qpn: int) -> _ResponderState | None:
        st = self.responder.get(qpn)
        if st is None:
            ctx = self.context(qpn)
            if ctx is None:
                return None
            st = self.responder[qpn] = _ResponderState(epsn=ctx.rq_psn)
        return st

    def qp_state(self, qpn: int) -> QpState:
        st = self._qp_state(qpn)
        return QpState.RESET if st is None else st.state

    def responder_state(self, qpn: int) -> _ResponderState | None:
        """The QP's responder state (``epsn``, ``msn``, ``rq_ci``, ``in_progress``,
        saved atomic ...), for tests to compare with the hardware's."""
        return self._qp_state(qpn)

    def reset_qp(self, qpn: int, state=QpState.RTS):
        """RESET (then ``state``): ``epsn`` = the context's ``rq_psn`` (read now), MSN 0,
        receive consumer index 0, no message in progress, no saved atomic."""
        state = QpState[state] if isinstance(state, str) else QpState(state)
        ctx = self.context(qpn)
        self.responder[qpn] = _ResponderState(state=state, epsn=0 if ctx is None else ctx.rq_psn)

    def set_state(self, qpn: int, state):
        """Host write of the QP state (a :class:`QpState`, value or name); RESET resets."""
        state = QpState[state] if isinstance(state, str) else QpState(state)
        if state == QpState.RESET:
            self.reset_qp(qpn, QpState.RESET)
        else:
            self._qp_state(qpn).state = state

    def post_recv(self, qpn: int, byte_count: int, lkey: int, addr: int) -> int:
        """Host side: write a receive WQE at the producer index (read from the doorbell
        record) and advance the doorbell record; returns the WQE's counter."""
        ctx = self.context(qpn)
        pi = parse_rq_doorbell_record(self.read(ctx.rq_dbr, 4))
        slot = pi % (1 << ctx.log_rq_size)
        self.write(ctx.rq_base + RECV_WQE_BYTES * slot, recv_wqe(byte_count, lkey, addr))
        self.write(ctx.rq_dbr, rq_doorbell_record(pi + 1))
        return pi

    def _mkey_entry(self, key: int) -> Mkey | None:
        if not self.num_mkeys:
            return None
        index = mkey_index(key, self.num_mkeys)
        if isinstance(self.mkeys, dict):
            return self.mkeys.get(index)
        return self.mkeys[index]

    def _key_ok(self, key: int, pd: int, right: Access, va: int, length: int) -> bool:
        """Key ``key`` valid, equal, of PD ``pd``, with ``right``, covering [va, va+length)."""
        entry = self._mkey_entry(key)
        end = va + length
        return (entry is not None and entry.valid and entry.key == key and entry.pd == pd
                and bool(Access(entry.access) & right) and end <= 1 << 64
                and entry.base <= va and end <= entry.base + entry.length)

    def process(self, packet: bytes, end_bad: bool = False) -> Decision:
        """One packet (LRH .. ICRC, any bytes) through the request receiver
        and the responder engine. Returns (and keeps as :attr:`last`) the
        :class:`Decision`. Never raises on a bad packet. ``end_bad``: the link marked the
        packet's end beat bad (counted as an ICRC drop).

        Every packet increments ``packets`` and exactly one of: ``responses_steered``
        (BTH opcode byte 8 is a response, 0x0D..0x12: the completion unit's),
        ``rx_request_icrc_drops``, ``rx_request_malformed``, or ``requests_received`` and
        then exactly one of ``rx_dropped_qp``, ``rx_dropped_pkey``, ``seq_naks``,
        ``seq_dropped`` (out of sequence after the NAK), ``duplicate_requests`` (of which
        ``atomic_replays`` and ``duplicates_dropped``, a READ failing its checks or an
        atomic not the saved one, are parts), ``requests_executed`` (every in-sequence
        request, as the doc's step 3 counts it; the ones failing step 4 also count in
        ``rnr_naks``, ``access_naks``, ``invalid_naks`` or ``op_naks``, which is then their
        ``fate``).
        """
        self.counters["packets"] += 1
        decision = self._process(bytes(packet), end_bad)
        self.counters[decision.fate] += 1
        decision.packets = [p for c in decision.commands for p in self._render(c)]
        self.last = decision
        return decision

    def _receiver_verdict(self, buf: bytes, end_bad: bool):
        """The request receiver's checks: (counter, None) or (None, fields)."""
        if len(buf) > LRH.SIZE and buf[LRH.SIZE] in _RESPONSE_OPCODES:
            return "responses_steered", None
        if end_bad or len(buf) < ICRC_SIZE or icrc_bytes(buf[:-ICRC_SIZE]) != buf[-ICRC_SIZE:]:
            return "rx_request_icrc_drops", None
        if len(buf) < LRH.SIZE + BTH.SIZE + ICRC_SIZE:
            return "rx_request_malformed", None
        lrh = LRH.unpack(buf)
        bth = BTH.unpack(buf[LRH.SIZE:])
        if (lrh.lnh != LNH_IBA_LOCAL or lrh.dlid != self.lid or bth.tver != 0
                or lrh.pktlen * 4 != len(buf) or bth.opcode not in _REQUEST_OPCODES):
            return "rx_request_malformed", None
        header = _HEADER_BYTES[bth.opcode]
        payload_bytes = len(buf) - header - ICRC_SIZE - bth.padcnt
        if payload_bytes < 0 or payload_bytes > MAX_PAYLOAD_BYTES:
            return "rx_request_malformed", None
        if not carries_payload(bth.opcode) and len(buf) != header + ICRC_SIZE:
            return "rx_request_malformed", None
        ext = {}
        offset = LRH.SIZE + BTH.SIZE
        for cls in extension_headers(bth.opcode):
            ext[cls] = cls.unpack(buf[offset:])
            offset += cls.SIZE
        return None, (lrh, bth, ext, buf[header:header + payload_bytes])

    def _process(self, buf: bytes, end_bad: bool) -> Decision:
        fate, fields = self._receiver_verdict(buf, end_bad)
        if fate is not None:
            return Decision(fate)
        self.counters["requests_received"] += 1
        lrh, bth, ext, payload = fields
        qpn, psn, op = bth.destqp, bth.psn, bth.opcode
        d = Decision("requests_executed", qpn=qpn, psn=psn, dma=(0, 0))
        ctx = self.context(qpn) if self.num_qps is None or qpn < self.num_qps else None
        st = None if ctx is None else self._qp_state(qpn)
        # 1. QP
        if (st is None or st.state != QpState.RTS or lrh.slid != ctx.dlid
                or self.sl_to_vl[ctx.sl] >= self.num_vls or not 1 <= ctx.mtu <= 5):
            d.fate = "rx_dropped_qp"
            return d
        # 2. P_Key
        if ((bth.pkey ^ ctx.pkey) & 0x7FFF) or not ((bth.pkey | ctx.pkey) & 0x8000):
            d.fate = "rx_dropped_pkey"
            return d
        # 3. PSN
        diff = psn_diff(psn, st.epsn)
        if diff > 0:
            if st.seq_nak_sent:
                d.fate = "seq_dropped"
                return d
            st.seq_nak_sent = True
            d.fate = "seq_naks"
            d.commands.append(self._ack_command(ctx, st.epsn, NAK | NakCode.PSN_SEQUENCE_ERROR,
                                                st.msn))
            return d
        if diff < 0:
            d.fate = "duplicate_requests"
            self._duplicate(ctx, st, op, psn, ext, d)
            return d
        st.seq_nak_sent = False
        try:
            self._execute_hw(ctx, st, op, bth, ext, payload, d)
        except _Fail as fail:
            self.counters["requests_executed"] += 1
            d.fate = fail.counter
            d.dma = (0, 0)
            d.commands = [self._ack_command(ctx, psn, fail.syndrome, st.msn)]
            if fail.recv_syndrome:
                self._complete_recv(ctx, st, d, CqeOpcode.RESP_ERR, syndrome=fail.recv_syndrome)
            if fail.fatal:
                st.state = QpState.ERR
                d.qp_error = True
                self.qp_errors.append(qpn)
        return d

    def _duplicate(self, ctx, st, op, psn, ext, d):
        if op <= Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE:
            d.commands.append(self._ack_command(ctx, psn_add(st.epsn, -1), ACK_SYNDROME, st.msn))
        elif op == Opcode.RDMA_READ_REQUEST:
            reth = ext[RETH]
            if (not Access(ctx.access) & Access.REMOTE_READ
                    or (reth.dmalen and not self._key_ok(reth.rkey, ctx.pd, Access.REMOTE_READ,
                                                         reth.va, reth.dmalen))):
                self.counters["duplicates_dropped"] += 1
                return
            d.commands.append(self._read_command(ctx, psn, reth, st.msn))
        elif any(saved == psn for saved, _ in st.saved_atomics):
            self.counters["atomic_replays"] += 1
            orig = next(o for saved, o in st.saved_atomics if saved == psn)
            d.commands.append(self._atomic_command(ctx, psn, st.msn, orig))
        else:
            self.counters["duplicates_dropped"] += 1

    def _execute_hw(self, ctx, st, op, bth, ext, payload, d):
        psn = bth.psn
        mtu = 128 << ctx.mtu
        invalid = _Fail("invalid_naks", NAK | NakCode.INVALID_REQUEST)
        access = _Fail("access_naks", NAK | NakCode.REMOTE_ACCESS_ERROR)
        is_send = op <= Opcode.SEND_ONLY_WITH_IMMEDIATE
        is_write = Opcode.RDMA_WRITE_FIRST <= op <= Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
        first, last = op in _FIRSTS, op in _LASTS
        kind = "send" if is_send else "write" if is_write else None
        # opcode sequence
        if kind is None or first:
            if st.in_progress is not None:
                raise invalid
        elif st.in_progress != kind:
            raise invalid
        # lengths
        n = len(payload)
        if kind is not None:
            if (not last and n != mtu) or n > mtu or (last and not first and n == 0):
                raise invalid
            if is_write:
                left = ext[RETH].dmalen if first else st.write_left
                if n > left or (last and n != left):
                    raise invalid
        if op in _ATOMIC_OPCODES:
            atomic = ext[MaskedAtomicETH if op in MASKED_ATOMICS else AtomicETH]
            n = atomic_operand_bytes(op)
            if atomic.va % n:
                raise invalid
            if not Access(ctx.access) & Access.REMOTE_ATOMIC:
                raise access
            if not self._key_ok(atomic.rkey, ctx.pd, Access.REMOTE_ATOMIC, atomic.va, n):
                raise access
            self._execute_atomic(ctx, st, op, psn, atomic, d)
            return
        if op == Opcode.RDMA_READ_REQUEST:
            reth = ext[RETH]
            if not Access(ctx.access) & Access.REMOTE_READ:
                raise access
            if reth.dmalen and not self._key_ok(reth.rkey, ctx.pd, Access.REMOTE_READ, reth.va,
                                                reth.dmalen):
                raise access
            st.msn = (st.msn + 1) % PSN_MOD
            d.commands.append(self._read_command(ctx, psn, reth, st.msn))
            st.epsn = psn_add(psn, max(1, -(-reth.dmalen // mtu)))
            return
        if is_write and first:
            reth = ext[RETH]
            if not Access(ctx.access) & Access.REMOTE_WRITE:
                raise access
            if reth.dmalen and not self._key_ok(reth.rkey, ctx.pd, Access.REMOTE_WRITE, reth.va,
                                                reth.dmalen):
                raise access
        imm = ext[ImmDt].imm if ImmDt in ext else 0
        takes_wqe = (is_send and first) or (is_write and last and ImmDt in ext)
        if takes_wqe:
            wqe = self._take_recv(ctx, st, d)
            if is_send:
                st.recv_addr, st.recv_length, st.recv_counter = wqe
                st.recv_offset = 0
        if is_send and st.recv_offset + n > st.recv_length:
            raise _Fail("invalid_naks", NAK | NakCode.INVALID_REQUEST,
                        recv_syndrome=Syndrome.LOCAL_LENGTH_ERR)
        # execute
        if is_write:
            if first:
                st.write_va, st.write_left = ext[RETH].va, ext[RETH].dmalen
                st.write_len = st.write_left
            addr = st.write_va
            st.write_va += n
            st.write_left -= n
        else:
            addr = st.recv_addr + st.recv_offset
            st.recv_offset += n
        if n:
            self.write(addr, payload)
            d.writes.append((addr, bytes(payload)))
            d.dma = (addr, n)
        st.in_progress = None if last else kind
        if last:
            st.msn = (st.msn + 1) % PSN_MOD
            if is_send:
                opcode = CqeOpcode.RESP_SEND_IMM if ImmDt in ext else CqeOpcode.RESP_SEND
                self._complete_recv(ctx, st, d, opcode, st.recv_offset, imm)
            elif ImmDt in ext:
                self._complete_recv(ctx, st, d, CqeOpcode.RESP_WR_IMM, st.write_len, imm)
        st.epsn = psn_add(psn, 1)
        if bth.ackreq:
            d.commands.append(self._ack_command(ctx, psn, ACK_SYNDROME, st.msn))

    def _take_recv(self, ctx, st, d) -> tuple:
        """The ReceiveQueue (hdl/nic/receive_queue.py): the next receive WQE as (addr,
        length, counter), consumed; RNR (nothing consumed) or a bad WQE (consumed, QP to
        ERR) raise _Fail.

        The producer index is cached per QP; the doorbell record (its address's low two
        bits ignored) is read only when the cache says empty. A record more than
        2^log_rq_size ahead of the consumer index (or behind it) answers EMPTY, is not
        cached and counts in ``recv_wqe_errors``. The WQE (``rq_base``'s low four bits
        ignored) is OK when its lkey names a valid entry with that key, the QP's PD and
        LOCAL_WRITE and, unless ``byte_count`` is 0, covers ``[addr, addr + byte_count)``
        without wrapping 2^64; otherwise ERROR with LOCAL_PROT_ERR."""
        empty = dict(status="EMPTY", syndrome=0, addr=0, length=0, wqe_counter=0)
        rnr = _Fail("rnr_naks", RNR_NAK | (ctx.min_rnr_timer & 0x1F), fatal=False)
        if st.rq_pi == st.rq_ci:
            self.counters["rq_doorbell_reads"] += 1
            pi = parse_rq_doorbell_record(self.read(ctx.rq_dbr & ~3, 4))
            ahead = (pi - st.rq_ci) % (1 << 16)
            if ahead > 1 << ctx.log_rq_size:
                self.counters["recv_wqe_errors"] += 1
            if ahead == 0 or ahead > 1 << ctx.log_rq_size:
                d.recv_result = empty
                raise rnr
            st.rq_pi = pi
        counter = st.rq_ci
        slot = counter % (1 << ctx.log_rq_size)
        length, lkey, addr = parse_recv_wqe(self.read((ctx.rq_base & ~15) + RECV_WQE_BYTES * slot,
                                                      RECV_WQE_BYTES))
        st.rq_ci = (counter + 1) & 0xFFFF
        self.counters["recv_wqes_consumed"] += 1
        d.recv_taken = counter
        st.recv_counter = counter
        entry = self._mkey_entry(lkey)
        ok = (entry is not None and entry.valid and entry.key == lkey and entry.pd == ctx.pd
              and bool(Access(entry.access) & Access.LOCAL_WRITE)
              and (length == 0 or self._key_ok(lkey, ctx.pd, Access.LOCAL_WRITE, addr, length)))
        if not ok:
            self.counters["recv_wqe_errors"] += 1
            d.recv_result = dict(status="ERROR", syndrome=int(Syndrome.LOCAL_PROT_ERR), addr=0,
                                 length=0, wqe_counter=counter)
            raise _Fail("op_naks", NAK | NakCode.REMOTE_OPERATIONAL_ERROR,
                        recv_syndrome=Syndrome.LOCAL_PROT_ERR)
        d.recv_result = dict(status="OK", syndrome=0, addr=addr, length=length,
                             wqe_counter=counter)
        return addr, length, counter

    def _complete_recv(self, ctx, st, d, opcode, byte_count=0, imm=0, syndrome=0):
        error = opcode == CqeOpcode.RESP_ERR
        c = RecvCompletion(qpn=d.qpn, cqn=ctx.rcqn, opcode=CqeOpcode(opcode),
                           byte_count=0 if error else byte_count,
                           imm=imm if opcode in (CqeOpcode.RESP_WR_IMM, CqeOpcode.RESP_SEND_IMM) else 0,
                           wqe_counter=st.recv_counter, syndrome=int(syndrome))
        d.completions.append(c)
        self.completions[ctx.rcqn].append(c)
        self.receive_completions.append(c)

    def _execute_atomic(self, ctx, st, op, psn, atomic, d):
        n = atomic_operand_bytes(op)
        orig = int.from_bytes(self.read(atomic.va, n), "little")
        data = atomic_new_value(op, orig, atomic).to_bytes(n, "little")
        self.write(atomic.va, data)
        d.writes.append((atomic.va, data))
        st.msn = (st.msn + 1) % PSN_MOD
        st.epsn = psn_add(psn, 1)
        st.saved_atomics = [(psn, orig)] + st.saved_atomics[:SAVED_ATOMICS - 1]
        d.atomic = dict(addr=atomic.va, fetch_add=int(op == Opcode.FETCH_ADD),
                        swap_add=atomic.swap_add, compare=atomic.compare, orig=orig)
        if op in MASKED_ATOMICS:
            d.atomic.update(opcode=op, swap_mask=atomic.swap_mask,
                            compare_mask=atomic.compare_mask)
        d.commands.append(self._atomic_command(ctx, psn, st.msn, orig))

    def _command(self, ctx, kind, psn, msn, **kw) -> dict:
        command = dict(kind=kind, vl=self.sl_to_vl[ctx.sl], sl=ctx.sl, dlid=ctx.dlid,
                       pkey=ctx.pkey, destqp=ctx.dest_qpn, psn=psn, syndrome=ACK_SYNDROME,
                       msn=msn, va=0, length=0, mtu=ctx.mtu, orig=0)
        command.update(kw)
        return command

    def _ack_command(self, ctx, psn, syndrome, msn) -> dict:
        return self._command(ctx, "ACK", psn, msn, syndrome=syndrome)

    def _read_command(self, ctx, psn, reth, msn) -> dict:
        return self._command(ctx, "READ", psn, msn, va=reth.va, length=reth.dmalen)

    def _atomic_command(self, ctx, psn, msn, orig) -> dict:
        return self._command(ctx, "ATOMIC", psn, msn, orig=orig)

    def _render(self, c: dict) -> list:
        """The packets of one response command (READ data read from memory now)."""
        common = dict(vl=c["vl"], sl=c["sl"], dlid=c["dlid"], slid=self.lid, destqp=c["destqp"],
                      pkey=c["pkey"])
        aeth = AETH(syndrome=c["syndrome"], msn=c["msn"])
        if c["kind"] == "ACK":
            return [make_packet(**common, opcode=Opcode.ACKNOWLEDGE, psn=c["psn"], ext=[aeth])]
        if c["kind"] == "ATOMIC":
            return [make_packet(**common, opcode=Opcode.ATOMIC_ACKNOWLEDGE, psn=c["psn"],
                                ext=[aeth, AtomicAckETH(orig=c["orig"])])]
        mtu = 128 << c["mtu"]
        data = self.read(c["va"], c["length"]) if c["length"] else b""
        count = max(1, -(-len(data) // mtu))
        out = []
        for i in range(count):
            op = read_response_opcode(i, count)
            out.append(make_packet(**common, opcode=op, psn=psn_add(c["psn"], i),
                                   ext=[] if op == Opcode.RDMA_READ_RESPONSE_MIDDLE else [aeth],
                                   payload=data[i * mtu:(i + 1) * mtu]))
        return out


_WRITE_OPS_ALL = frozenset(range(Opcode.SEND_FIRST, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE + 1))
_FIRSTS = frozenset({Opcode.SEND_FIRST, Opcode.RDMA_WRITE_FIRST} | _SEND_ONLYS | _WRITE_ONLYS)
_LASTS = frozenset(_SEND_LASTS | _SEND_ONLYS | _WRITE_LASTS | _WRITE_ONLYS)
