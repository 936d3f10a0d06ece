"""What both ends of an RC connection share in the models: QP, CQ and memory-key
contexts, PSN arithmetic and the packets (built and decoded, ICRC by zlib)."""
import zlib
from dataclasses import dataclass
from enum import Enum, IntEnum, IntFlag

from models.ib import (BTH, LNH_IBA_LOCAL, LRH, MASKED_FETCH_ADDS, Opcode, atomic_operand_bytes,
                       extension_headers)
from models.mlx5 import WQEBB_BYTES

PSN_MOD = 1 << 24
VL15 = 15
ICRC_SIZE = 4
# A QP's window of WQE basic blocks fetched and not yet completed: one less than the NIC's
# completion record queue (docs/nic.md, "Completions").
MAX_OUTSTANDING_BLOCKS = 63


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
    max_outstanding: int = MAX_OUTSTANDING_BLOCKS
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
    return (1 <= qp.mtu <= 5 and 1 <= qp.max_outstanding <= MAX_OUTSTANDING_BLOCKS and qp.cqn < num_cqs
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

def masked_fetch_add(orig: int, add: int, field_boundary: int, nbits: int) -> int:
    """MFetchAdd: ``orig + add`` where a set bit ``i`` of ``field_boundary`` stops the carry
    out of bit ``i``, so each field adds on its own, modulo its width (the ConnectX
    extended-atomics pseudo-code; all ones: XOR)."""
    result, carry = 0, 0
    for i in range(nbits):
        total = carry + (orig >> i & 1) + (add >> i & 1)
        result |= (total & 1) << i
        carry = total >> 1 & ~(field_boundary >> i) & 1
    return result


def atomic_new_value(opcode: int, orig: int, header) -> int:
    """The value an atomic request (BTH ``opcode``, its AtomicETH or MaskedAtomicETH
    ``header``) leaves in memory whose original value is ``orig``.

    FetchAdd: ``orig + swap_add`` (mod 2^64); CmpSwap: ``swap_add`` if ``orig == compare``;
    masked FA: :func:`masked_fetch_add` with ``swap_mask`` as the field boundary; masked CS
    (MskCmpSwap): if ``orig`` and ``compare`` agree on ``compare_mask``, the bits of
    ``swap_mask`` take ``swap_add``'s. 4-byte operands: the fields' low 32 bits."""
    nbits = 8 * atomic_operand_bytes(opcode)
    ones = (1 << nbits) - 1
    if opcode == Opcode.FETCH_ADD:
        return (orig + header.swap_add) & ones
    if opcode == Opcode.COMPARE_SWAP:
        return header.swap_add if orig == header.compare else orig
    if opcode in MASKED_FETCH_ADDS:
        return masked_fetch_add(orig, header.swap_add & ones, header.swap_mask & ones, nbits)
    if (orig ^ header.compare) & header.compare_mask & ones:
        return orig
    return (orig & ~header.swap_mask | header.swap_add & header.swap_mask) & ones


class NakCode(IntEnum):
    """AETH NAK codes (syndrome 0b011_ccccc)."""
    PSN_SEQUENCE_ERROR = 0
    INVALID_REQUEST = 1
    REMOTE_ACCESS_ERROR = 2
    REMOTE_OPERATIONAL_ERROR = 3
