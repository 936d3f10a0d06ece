"""Reference models of both ends of an RC connection, for the NIC testbenches.

* :class:`RequesterModel` is what the NIC's send side must do with each WQE
  (docs/nic.md: segment rules, executor checks, MTU segmentation, PSNs): it returns the
  request packets (LRH .. ICRC, byte-exact), the completion status and the CQE expected.
* :class:`CompletionModel` is the NIC's completion unit: it takes the requester's results
  in WQE order and the responses coming back, and gives the CQE writes (address, bytes,
  owner bit) in the order the NIC must make them, with NAK error and flush handling.
* :class:`ResponderPeer` is the remote RC responder the testbench puts on the wire: it
  checks ICRC, PSNs and opcode sequences, executes requests against its memory, and
  answers with (coalesced) ACKs, READ responses, ATOMIC ACKNOWLEDGEs and injected NAKs.
* :class:`NicResponderModel` is the exact reference of the NIC's own responder
  (docs/nic-responder.md): receiver checks, P_Key, PSN rules, rkeys, receive queue, NAK
  codes, QP errors, receive completions and the hardware's counters.

Packets are built with models.ib's header codecs; the ICRC is computed with zlib (the
same CRC-32 as models.crc.icrc, whose masks are applied here) so that the responder
keeps up with thousands of packets per second.
"""

import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum, IntFlag

from models.crc import icrc_bytes
from models.ib import (AETH, BTH, LNH_IBA_LOCAL, LRH, RETH, AtomicAckETH, AtomicETH, ImmDt,
                       Opcode, carries_payload, extension_headers)
from models.mlx5 import (MAX_MESSAGE_BYTES, RECV_WQE_BYTES, WQEBB_BYTES, Cqe, CqeOpcode,
                         Opcode as MlxOpcode, ParsedWqe, Syndrome, CTRL_CQ_UPDATE,
                         CTRL_SOLICITED, cqe_address, cqe_owner, error_cqe, parse_recv_wqe,
                         parse_rq_doorbell_record, parse_wqe, recv_wqe, requester_cqe,
                         responder_cqe, responder_error_cqe, rq_doorbell_record, wqe_blocks)

PSN_MOD = 1 << 24
VL15 = 15
ICRC_SIZE = 4


# --- contexts (mirrors of hdl/nic/signatures.py records) -----------------------------------

class QpState(IntEnum):
    RESET = 0
    RTS = 3
    ERR = 6


class Access(IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


class CompletionStatus(str, Enum):
    """``CompletionStatus``; compares equal to its name ("SENT", ...); ``code`` is the
    value in ``hdl/nic/signatures.py``."""
    SENT = "SENT"
    ERROR = "ERROR"
    FLUSH = "FLUSH"

    @property
    def code(self) -> int:
        return ("SENT", "ERROR", "FLUSH").index(self.value)


@dataclass
class QpContext:
    """``QpConfigLayout`` (same fields, same order), plus the QP's number."""
    sq_base: int = 0
    log_sq_size: int = 6
    mtu: int = 5
    sl: int = 0
    max_outstanding: int = 64
    dest_qpn: int = 0
    dlid: int = 0
    pd: int = 0
    pkey: int = 0xFFFF
    sq_psn: int = 0
    cqn: int = 0
    # responder side (docs/nic-responder.md)
    access: Access = Access(0)
    rq_psn: int = 0
    min_rnr_timer: int = 0
    rq_base: int = 0
    log_rq_size: int = 0
    rq_dbr: int = 0
    rcqn: int = 0
    # requester reliability (docs/nic-reliability.md)
    retry_cnt: int = 7
    rnr_retry: int = 7
    ack_timeout: int = 0
    qpn: int = 0

    @property
    def mtu_bytes(self) -> int:
        return 128 << self.mtu


@dataclass
class CqContext:
    """``CqConfigLayout`` (same fields, same order), plus the CQ's number."""
    base: int = 0
    log_size: int = 0
    collapsed: bool = False
    cqn: int = 0


QpConfig = QpContext
CqConfig = CqContext


@dataclass
class Mkey:
    """``MkeyLayout``; the entry for key ``k`` is at index ``(k >> 8) % num_mkeys``."""
    key: int = 0
    base: int = 0
    length: int = 0
    access: Access = Access(0)
    pd: int = 0
    valid: bool = False


def mkey_index(key: int, num_mkeys: int) -> int:
    return (key >> 8) % num_mkeys


def qp_context_ok(qp: QpContext, num_cqs: int) -> bool:
    """Whether RESET -> RTS accepts this context (docs/nic.md, "Contexts and QP states")."""
    ring_bytes = WQEBB_BYTES << qp.log_sq_size
    return (1 <= qp.mtu <= 5 and 1 <= qp.max_outstanding <= 64 and qp.cqn < num_cqs
            and qp.sq_base % min(4096, ring_bytes) == 0)


# --- PSNs and packets -----------------------------------------------------------------------

def read_response_opcode(i: int, count: int) -> int:
    """The opcode of RDMA READ response packet ``i`` of ``count``."""
    if count == 1:
        return Opcode.RDMA_READ_RESPONSE_ONLY
    if i == 0:
        return Opcode.RDMA_READ_RESPONSE_FIRST
    if i == count - 1:
        return Opcode.RDMA_READ_RESPONSE_LAST
    return Opcode.RDMA_READ_RESPONSE_MIDDLE


def psn_add(psn: int, n: int) -> int:
    return (psn + n) % PSN_MOD


def psn_diff(a: int, b: int) -> int:
    """a - b modulo 2^24 as a signed number in [-2^23, 2^23)."""
    d = (a - b) % PSN_MOD
    return d - PSN_MOD if d >= PSN_MOD // 2 else d


def psn_le(a: int, b: int) -> bool:
    return psn_diff(a, b) <= 0


def psn_lt(a: int, b: int) -> bool:
    return psn_diff(a, b) < 0


def _icrc(body: bytes) -> bytes:
    """ICRC of LRH .. pad of an IBA-local packet: CRC-32 with LRH.VL and BTH.resv8a as ones."""
    crc = zlib.crc32(bytes([body[0] | 0xF0]))
    crc = zlib.crc32(body[1:12], crc)
    crc = zlib.crc32(b"\xff", crc)
    crc = zlib.crc32(body[13:], crc)
    return crc.to_bytes(4, "little")


def make_packet(*, vl: int, sl: int, dlid: int, slid: int, opcode: int, destqp: int, psn: int,
                pkey: int = 0xFFFF, se: int = 0, ackreq: int = 0, ext=(),
                payload: bytes = b"") -> bytes:
    """LRH .. ICRC of an IBA-local RC packet (same bytes as models.packet.build_packet)."""
    padcnt = -len(payload) % 4
    transport = (BTH(opcode=opcode, se=se, m=0, padcnt=padcnt, tver=0, pkey=pkey, resv8a=0,
                     destqp=destqp, ackreq=ackreq, psn=psn).pack()
                 + b"".join(h.pack() for h in ext) + payload + bytes(padcnt))
    pktlen = (LRH.SIZE + len(transport) + ICRC_SIZE) // 4
    body = LRH(vl=vl, lver=0, sl=sl, lnh=LNH_IBA_LOCAL, dlid=dlid, pktlen=pktlen,
               slid=slid).pack() + transport
    return body + _icrc(body)


@dataclass(frozen=True)
class Packet:
    """A received packet, decoded (what the responder and completion model look at)."""
    lrh: LRH
    bth: BTH
    ext: tuple
    payload: bytes
    icrc_ok: bool


def decode_packet(buf: bytes) -> Packet:
    """Decode LRH .. ICRC (no VCRC). Raises ValueError on a malformed packet."""
    buf = bytes(buf)
    lrh = LRH.unpack(buf)
    if lrh.pktlen * 4 != len(buf):
        raise ValueError(f"LRH.PktLen says {lrh.pktlen * 4} bytes, packet has {len(buf)}")
    body = buf[:-ICRC_SIZE]
    if lrh.lnh == LNH_IBA_LOCAL:
        icrc_ok = _icrc(body) == buf[-ICRC_SIZE:]
        offset = LRH.SIZE
    else:
        raise ValueError(f"LNH {lrh.lnh:#04b}: only IBA-local packets are modelled")
    bth = BTH.unpack(body[offset:])
    offset += BTH.SIZE
    ext = []
    for cls in extension_headers(bth.opcode):
        ext.append(cls.unpack(body[offset:]))
        offset += cls.SIZE
    end = len(body) - bth.padcnt
    if end < offset:
        raise ValueError("PadCnt runs into the headers")
    return Packet(lrh, bth, tuple(ext), body[offset:end], icrc_ok)


# --- requester --------------------------------------------------------------------------------

_WRITE_OPS = {
    # (first, middle, last, only) BTH opcodes per mlx5 opcode
    MlxOpcode.RDMA_WRITE: (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
                           Opcode.RDMA_WRITE_LAST, Opcode.RDMA_WRITE_ONLY),
    MlxOpcode.RDMA_WRITE_IMM: (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
                               Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
                               Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE),
    MlxOpcode.SEND: (Opcode.SEND_FIRST, Opcode.SEND_MIDDLE, Opcode.SEND_LAST, Opcode.SEND_ONLY),
    MlxOpcode.SEND_IMM: (Opcode.SEND_FIRST, Opcode.SEND_MIDDLE, Opcode.SEND_LAST_WITH_IMMEDIATE,
                         Opcode.SEND_ONLY_WITH_IMMEDIATE),
}


@dataclass
class WqeResult:
    """What the NIC does with one WQE: ``CompletionRecordLayout`` plus the packets
    (byte_count, PSNs and laddr are 0 unless SENT, as the executor's record has them)."""
    qpn: int
    cqn: int
    wqe_index: int
    wqe_blocks: int
    opcode: int                 # mlx5 opcode as written in the control segment
    status: CompletionStatus
    syndrome: int = 0
    packets: list = field(default_factory=list)   # LRH .. ICRC, in send order
    vl: int = 0
    first_psn: int = 0
    last_psn: int = 0
    byte_count: int = 0
    signaled: bool = False
    laddr: int = 0              # where READ data / the atomic's original value go
    mtu: int = 5                # the QP's path MTU code (mtu_bytes = 128 << mtu)
    retry_cnt: int = 7          # the QP's retry limits and ACK timeout, for the reliability
    rnr_retry: int = 7          # engine (docs/nic-reliability.md)
    ack_timeout: int = 0
    wqe: ParsedWqe | None = None

    @property
    def mtu_bytes(self) -> int:
        return 128 << self.mtu

    def cqe(self, owner: int = 0) -> Cqe:
        """The CQE this WQE completes with if nothing goes wrong remotely."""
        counter = self.wqe_index & 0xFFFF
        if self.status == CompletionStatus.SENT:
            return requester_cqe(self.qpn, counter, self.opcode, self.byte_count, owner)
        syndrome = Syndrome.WR_FLUSH_ERR if self.status == CompletionStatus.FLUSH else self.syndrome
        return error_cqe(self.qpn, counter, self.opcode, syndrome, owner)

    @property
    def writes_cqe(self) -> bool:
        return self.signaled or self.status != CompletionStatus.SENT

    def record(self) -> dict:
        """The ``CompletionRecordLayout`` fields."""
        return dict(qpn=self.qpn, cqn=self.cqn, wqe_index=self.wqe_index & 0xFFFF,
                    wqe_blocks=self.wqe_blocks, opcode=self.opcode, byte_count=self.byte_count,
                    first_psn=self.first_psn, last_psn=self.last_psn, signaled=int(self.signaled),
                    status=self.status.code, syndrome=int(self.syndrome), laddr=self.laddr,
                    mtu=self.mtu, retry_cnt=self.retry_cnt, rnr_retry=self.rnr_retry,
                    ack_timeout=self.ack_timeout)


class RequesterModel:
    """The NIC's send side, WQE by WQE (docs/nic.md, "Execution" and "Packets").

    ``qps``, ``cqs``: contexts by QP/CQ number (a list, or a dict that is read when
    needed, so contexts may be added or changed later). ``mkeys``: the memory-key table as
    a list indexed like the NIC's (entry ``(key >> 8) % len``), or a dict ``{key: Mkey}``;
    give ``num_mkeys`` with a dict to model the NIC's table of that size exactly (a later
    key at the same index replaces an earlier one), without it a dict is looked up by the
    exact key. QPs start in RTS with their next PSN at ``sq_psn``. ``num_vls``: data VLs
    of the port (an SL mapped to VL ``num_vls`` .. 15 fails like VL 15).
    """

    def __init__(self, slid: int, sl_to_vl, qps, cqs, mkeys, num_mkeys: int | None = None,
                 num_vls: int = 15):
        if len(sl_to_vl) != 16:
            raise ValueError("sl_to_vl needs 16 entries")
        if not mkeys:
            raise ValueError("the memory-key table needs at least one entry")
        self.slid = slid
        self.num_vls = num_vls
        self.sl_to_vl = list(sl_to_vl)
        self.qps = qps
        self.cqs = cqs
        if isinstance(mkeys, dict) and num_mkeys is not None:
            table = [Mkey() for _ in range(num_mkeys)]
            for key in mkeys.values():
                table[mkey_index(key.key, num_mkeys)] = key
            mkeys = table
        self.mkeys = mkeys
        self.state = defaultdict(lambda: QpState.RTS)
        self.next_psn = {}

    def next_psn_of(self, qpn: int) -> int:
        """The PSN the next packet of QP ``qpn`` will carry."""
        if qpn not in self.next_psn:
            self.next_psn[qpn] = self.qps[qpn].sq_psn
        return self.next_psn[qpn]

    def _mkey(self, lkey: int) -> Mkey | None:
        if isinstance(self.mkeys, dict):
            return self.mkeys.get(lkey)
        return self.mkeys[mkey_index(lkey, len(self.mkeys))]

    def reset_qp(self, qpn: int, state: QpState = QpState.RTS):
        """RESET (then ``state``, RTS by default): the next PSN restarts at ``sq_psn``
        (read from the context now)."""
        self.state[qpn] = QpState(state)
        self.next_psn[qpn] = self.qps[qpn].sq_psn

    def set_state(self, qpn: int, state):
        """Set a QP's state (a :class:`QpState`, its value or its name, e.g. "ERR");
        RESET also restarts the PSN."""
        state = QpState[state] if isinstance(state, str) else QpState(state)
        if state == QpState.RESET:
            self.reset_qp(qpn, QpState.RESET)
        else:
            self.state[qpn] = state

    def set_qp_error(self, qpn: int):
        """RTS -> ERR (host write or fatal NAK): every later WQE is flushed."""
        self.state[qpn] = QpState.ERR

    def fetch_and_execute(self, qpn: int, wqe_index: int, read_memory, **kwargs) -> WqeResult:
        """Read the WQE at ``wqe_index`` from the QP's ring (wrapping) and execute it."""
        qp = self.qps[qpn]
        size = 1 << qp.log_sq_size

        def block(i):
            return bytes(read_memory(qp.sq_base + WQEBB_BYTES * ((wqe_index + i) % size),
                                     WQEBB_BYTES))
        first = block(0)
        blocks = wqe_blocks(first[7] & 0x3F)
        data = first + b"".join(block(i) for i in range(1, blocks))
        return self.execute(qpn, wqe_index, data, read_memory, **kwargs)

    def execute(self, qpn: int, wqe_index: int, wqe_bytes: bytes, read_memory, *,
                fetch_error: bool = False) -> WqeResult:
        """Execute one WQE; ``read_memory(addr, n) -> bytes`` supplies DMA payload.
        ``fetch_error``: a block of the WQE was read with RRESP not OKAY. A QP in ERR (or
        RESET, which a doorbell cannot reach) flushes the WQE."""
        qp = self.qps[qpn]
        wqe = parse_wqe(wqe_bytes)
        result = WqeResult(qpn=qpn, cqn=qp.cqn, wqe_index=wqe_index & 0xFFFF,
                           wqe_blocks=wqe.wqe_blocks, opcode=wqe.opcode,
                           status=CompletionStatus.SENT, signaled=bool(wqe.fm_ce_se & CTRL_CQ_UPDATE),
                           byte_count=wqe.length, laddr=wqe.laddr, mtu=qp.mtu,
                           retry_cnt=qp.retry_cnt, rnr_retry=qp.rnr_retry,
                           ack_timeout=qp.ack_timeout, wqe=wqe)
        if self.state[qpn] != QpState.RTS:
            result.status = CompletionStatus.FLUSH
            result.syndrome = Syndrome.WR_FLUSH_ERR
            result.byte_count = result.laddr = 0
            return result
        syndrome = self._check(qp, wqe, fetch_error)
        if syndrome:
            result.status = CompletionStatus.ERROR
            result.syndrome = syndrome
            result.byte_count = result.laddr = 0
            self.state[qpn] = QpState.ERR
            return result
        self._packets(qpn, qp, wqe, result, read_memory)
        return result

    def _check(self, qp: QpContext, wqe: ParsedWqe, fetch_error: bool) -> int:
        if fetch_error:
            return Syndrome.LOCAL_QP_OP_ERR
        if wqe.format_error:
            return wqe.syndrome
        length = wqe.length
        if length > MAX_MESSAGE_BYTES:
            return Syndrome.LOCAL_LENGTH_ERR
        vl = self.sl_to_vl[qp.sl]
        if vl == VL15 or vl >= self.num_vls or not 1 <= qp.mtu <= 5:
            return Syndrome.LOCAL_QP_OP_ERR
        if wqe.has_data and length:
            key = self._mkey(wqe.lkey)
            if key is None or not key.valid or key.key != wqe.lkey or key.pd != qp.pd:
                return Syndrome.LOCAL_PROT_ERR
            end = wqe.laddr + length
            if wqe.laddr < key.base or end > key.base + key.length or end > 1 << 64:
                return Syndrome.LOCAL_PROT_ERR
            if (wqe.opcode in (MlxOpcode.RDMA_READ, MlxOpcode.ATOMIC_CS, MlxOpcode.ATOMIC_FA)
                    and not Access(key.access) & Access.LOCAL_WRITE):
                return Syndrome.LOCAL_PROT_ERR
        return 0

    def _packets(self, qpn, qp, wqe, result, read_memory):
        mtu = qp.mtu_bytes
        vl = self.sl_to_vl[qp.sl]
        psn = self.next_psn_of(qpn)
        length = wqe.length
        common = dict(vl=vl, sl=qp.sl, dlid=qp.dlid, slid=self.slid, destqp=qp.dest_qpn,
                      pkey=qp.pkey)
        packets = []
        op = wqe.opcode
        if op in _WRITE_OPS:
            first_op, middle_op, last_op, only_op = _WRITE_OPS[op]
            count = max(1, -(-length // mtu))
            is_write = op in (MlxOpcode.RDMA_WRITE, MlxOpcode.RDMA_WRITE_IMM)
            # IBA: SE only on SEND and RDMA WRITE with immediate (a plain WRITE raises no event)
            solicited = int(bool(wqe.fm_ce_se & CTRL_SOLICITED) and op != MlxOpcode.RDMA_WRITE)
            for i in range(count):
                start = i * mtu
                size = min(mtu, length - start)
                if wqe.inline:
                    payload = wqe.inline_data[start:start + size]
                elif size:
                    payload = bytes(read_memory(wqe.laddr + start, size))
                else:
                    payload = b""
                last = i == count - 1
                opcode = (only_op if count == 1 else first_op if i == 0
                          else last_op if last else middle_op)
                ext = []
                if is_write and i == 0:
                    ext.append(RETH(va=wqe.raddr, rkey=wqe.rkey, dmalen=length))
                if last and op in (MlxOpcode.RDMA_WRITE_IMM, MlxOpcode.SEND_IMM):
                    ext.append(ImmDt(imm=wqe.imm))
                packets.append(make_packet(**common, opcode=opcode, psn=psn_add(psn, i),
                                           se=solicited if last else 0, ackreq=int(last),
                                           ext=ext, payload=payload))
            consumed = count
        elif op == MlxOpcode.RDMA_READ:
            packets.append(make_packet(**common, opcode=Opcode.RDMA_READ_REQUEST, psn=psn,
                                       ackreq=1, ext=[RETH(va=wqe.raddr, rkey=wqe.rkey,
                                                           dmalen=length)]))
            consumed = max(1, -(-length // mtu))
        else:
            # FETCH_ADD: the compare field goes out as 0 (libmlx5 leaves it unwritten)
            compare = wqe.compare if op == MlxOpcode.ATOMIC_CS else 0
            opcode = Opcode.COMPARE_SWAP if op == MlxOpcode.ATOMIC_CS else Opcode.FETCH_ADD
            packets.append(make_packet(**common, opcode=opcode, psn=psn, ackreq=1,
                                       ext=[AtomicETH(va=wqe.raddr, rkey=wqe.rkey,
                                                      swap_add=wqe.swap_add, compare=compare)]))
            consumed = 1
        result.packets = packets
        result.vl = vl
        result.first_psn = psn
        result.last_psn = psn_add(psn, consumed - 1)
        self.next_psn[qpn] = psn_add(psn, consumed)


# --- completion unit ----------------------------------------------------------------------------

NAK_CODE_SYNDROME = {1: Syndrome.REMOTE_INVAL_REQ_ERR, 2: Syndrome.REMOTE_ACCESS_ERR,
                     3: Syndrome.REMOTE_OP_ERR}


class NakCode(IntEnum):
    """AETH NAK codes (syndrome 0b011_ccccc)."""
    PSN_SEQUENCE_ERROR = 0
    INVALID_REQUEST = 1
    REMOTE_ACCESS_ERROR = 2
    REMOTE_OPERATIONAL_ERROR = 3


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
_READ_RESPONSES = _RESPONSES - {Opcode.ACKNOWLEDGE, Opcode.ATOMIC_ACKNOWLEDGE}
_ATOMIC_MLX = (MlxOpcode.ATOMIC_CS, MlxOpcode.ATOMIC_FA)


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
    after a rewind is not posted again: the executor emits no second record) and every
    packet that arrives (:meth:`receive`); both return the :class:`Completion` list they
    cause, in order. What depends on time is driven from outside: :meth:`timer_expired`
    (the local ACK timeout fired) and :meth:`rnr_wait_over`. Every ``rewind`` strobe the
    NIC would emit is appended to :attr:`rewinds`.

    A response for QP q at PSN p is taken only if q has had a SENT record since its reset,
    is not flushing, and ``ack_psn < p <= sent_psn``; else it is dropped and counted
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
      ``R.laddr + (p - R.first_psn) * MTU`` (atomic: the original value, 8 bytes
      little-endian, at ``R.laddr``), ``ack_psn = p``, LAST/ONLY: ``read_psn = p`` and R
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

    def post(self, result: WqeResult) -> list:
        self.outstanding[result.qpn].append(result)
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
        ``2**ack_timeout`` ticks without progress): rewind, or give up."""
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
                or not (psn_lt(st.ack_psn, psn) and psn_le(psn, st.sent_psn))):
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
                    data, addr = pkt.ext[1].orig.to_bytes(8, "little"), head.laddr
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


_REQUEST_OPCODES = frozenset(range(Opcode.SEND_FIRST, Opcode.RDMA_READ_REQUEST + 1)) | {
    Opcode.COMPARE_SWAP, Opcode.FETCH_ADD}
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
    packets and at :meth:`flush`). Atomics operate on little-endian 64-bit words, 8-byte
    aligned. A packet that does not decode is dropped and counted (``dropped_malformed``).
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
        if op in (Opcode.COMPARE_SWAP, Opcode.FETCH_ADD):
            return self._atomic(qp, op, psn, ext[AtomicETH])
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

    def _atomic(self, qp: ResponderQp, op: int, psn: int, aeth: AtomicETH) -> list:
        if qp.in_progress is not None or aeth.va % 8:
            raise _Nak(NakCode.INVALID_REQUEST)
        orig = int.from_bytes(self.read(aeth.va, 8), "little")
        if op == Opcode.FETCH_ADD:
            new = (orig + aeth.swap_add) % (1 << 64)
        else:
            new = aeth.swap_add if orig == aeth.compare else orig
        self.write(aeth.va, new.to_bytes(8, "little"))
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
        if op in (Opcode.COMPARE_SWAP, Opcode.FETCH_ADD):
            atomic = ext[AtomicETH]
            if atomic.va % 8:
                raise invalid
            if not Access(ctx.access) & Access.REMOTE_ATOMIC:
                raise access
            if not self._key_ok(atomic.rkey, ctx.pd, Access.REMOTE_ATOMIC, atomic.va, 8):
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
        orig = int.from_bytes(self.read(atomic.va, 8), "little")
        if op == Opcode.FETCH_ADD:
            new = (orig + atomic.swap_add) % (1 << 64)
        else:
            new = atomic.swap_add if orig == atomic.compare else orig
        data = new.to_bytes(8, "little")
        self.write(atomic.va, data)
        d.writes.append((atomic.va, data))
        st.msn = (st.msn + 1) % PSN_MOD
        st.epsn = psn_add(psn, 1)
        st.saved_atomics = [(psn, orig)] + st.saved_atomics[:SAVED_ATOMICS - 1]
        d.atomic = dict(addr=atomic.va, fetch_add=int(op == Opcode.FETCH_ADD),
                        swap_add=atomic.swap_add, compare=atomic.compare, orig=orig)
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
