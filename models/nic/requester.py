"""The NIC's send side: what it must do with each WQE (docs/nic.md)."""
from collections import defaultdict
from dataclasses import dataclass, field

from models.ib import RETH, AtomicETH, ImmDt, MaskedAtomicETH, Opcode
from models.mlx5 import (ATOMIC_OPCODES, LOCAL_OPCODES, MAX_MESSAGE_BYTES, WQEBB_BYTES, Cqe, Opcode as MlxOpcode,
                         ParsedWqe, Syndrome, CTRL_CQ_UPDATE, CTRL_SOLICITED, error_cqe, parse_wqe,
                         requester_cqe, wqe_blocks)
from models.nic.common import (Access, CompletionStatus, Mkey, QpContext, QpState, VL15,
                               make_packet, mkey_index, psn_add)

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

# BTH opcode of a masked atomic by (mlx5 opcode, operand bytes): docs/nic-formats.md
_MASKED_OPS = {
    (MlxOpcode.ATOMIC_MASKED_CS, 8): Opcode.MASKED_COMPARE_SWAP,
    (MlxOpcode.ATOMIC_MASKED_FA, 8): Opcode.MASKED_FETCH_ADD,
    (MlxOpcode.ATOMIC_MASKED_CS, 4): Opcode.MASKED_COMPARE_SWAP_4,
    (MlxOpcode.ATOMIC_MASKED_FA, 4): Opcode.MASKED_FETCH_ADD_4,
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
                           byte_count=0 if wqe.opcode in LOCAL_OPCODES else wqe.length,
                           laddr=wqe.laddr, mtu=qp.mtu,
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
        # Every data segment with bytes, a gather list's in order: key, PD, range, rights.
        segments = wqe.gather or (((length, wqe.lkey, wqe.laddr),) if wqe.has_data else ())
        for byte_count, lkey, laddr in segments:
            if not byte_count:
                continue
            key = self._mkey(lkey)
            if key is None or not key.valid or key.key != lkey or key.pd != qp.pd:
                return Syndrome.LOCAL_PROT_ERR
            end = laddr + byte_count
            if laddr < key.base or end > key.base + key.length or end > 1 << 64:
                return Syndrome.LOCAL_PROT_ERR
            if ((wqe.opcode == MlxOpcode.RDMA_READ or wqe.opcode in ATOMIC_OPCODES)
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
        if op in LOCAL_OPCODES:
            # NOP, DUMP: nothing on the wire and no PSN (last_psn is the one before
            # first_psn), so the WQE completes once everything before it has.
            consumed = 0
        elif op in _WRITE_OPS:
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
                    payload = _gathered(wqe, start, size, read_memory)
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
        elif op in (MlxOpcode.ATOMIC_MASKED_CS, MlxOpcode.ATOMIC_MASKED_FA):
            opcode = _MASKED_OPS[op, wqe.operand_bytes]
            packets.append(make_packet(**common, opcode=opcode, psn=psn, ackreq=1,
                                       ext=[MaskedAtomicETH(va=wqe.raddr, rkey=wqe.rkey,
                                                            swap_add=wqe.swap_add,
                                                            compare=wqe.compare,
                                                            swap_mask=wqe.swap_mask,
                                                            compare_mask=wqe.compare_mask)]))
            consumed = 1
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


def gather_pieces(segments, start, size):
    """The pieces of message bytes ``start .. start + size - 1`` (a packet's payload) over
    ``segments`` (``(byte_count, lkey, laddr)`` each, in order): ``(laddr, bytes)`` for each
    segment they touch, in order, zero-length segments skipped (docs/nic.md, Gather
    packing)."""
    pieces = []
    offset = 0
    for byte_count, _, laddr in segments:
        low, high = max(start, offset), min(start + size, offset + byte_count)
        if low < high:
            pieces.append((laddr + low - offset, high - low))
        offset += byte_count
    return pieces


def _gathered(wqe, start, size, read_memory):
    """Bytes ``start .. start + size - 1`` of the message: its data segment's, or the
    concatenation of its gather list's segments."""
    segments = wqe.gather or ((wqe.byte_count, wqe.lkey, wqe.laddr),)
    return b"".join(bytes(read_memory(laddr, count))
                    for laddr, count in gather_pieces(segments, start, size))
