"""mlx5 host-visible formats, as NVSHMEM's IBGDA device code writes them.

Everything the GPU and the NIC exchange through memory: the doorbell (the 8 bytes a GPU
thread stores to the UAR), the send queue's doorbell record, WQE segments and CQEs.
Layouts are rdma-core's ``infiniband/mlx5dv.h`` structs (``mlx5_wqe_ctrl_seg``,
``mlx5_wqe_raddr_seg``, ``mlx5_wqe_data_seg``, ``mlx5_wqe_inl_data_seg``,
``mlx5_wqe_atomic_seg``, ``mlx5_cqe64``, ``mlx5_err_cqe``); every multi-byte field is
big-endian. The responder's receive queue uses ``mlx5_wqe_data_seg`` as its WQE and a
doorbell record like the send queue's (``dbrec[MLX5_RCV_DBR]``). docs/nic-formats.md has
the byte tables side by side with NVSHMEM's writers
(``ibgda_write_rdma_write_wqe``, ``ibgda_ring_db``, ``ibgda_update_dbr``, ...).

:func:`parse_wqe` is the reference of the NIC's WQE parser: the segment rules of
docs/nic.md ("WQE fetch and parse") with the syndrome of each format error.
"""

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

WQEBB_BYTES = 64             # a send WQE basic block (MLX5_SEND_WQE_BB)
DS_BYTES = 16                # ds counts 16-byte units (octowords)
MAX_WQE_BLOCKS = 16          # ds is 6 bits: at most ceil(63 / 4) blocks
MAX_GATHER_SEGMENTS = 4      # data segments of a WRITE or SEND (docs/nic.md, Limits: a plan)
MAX_INLINE_BYTES = 256        # NVSHMEM's largest: a warp-combined put of 8-byte T (docs/nic-formats.md)
CQE_BYTES = 64
MAX_MESSAGE_BYTES = 1 << 31

INLINE_SEG = 0x80000000      # MLX5_INLINE_SEG: byte_count bit 31 marks an inline segment


class Opcode(IntEnum):
    """mlx5 send opcodes (``MLX5_OPCODE_*``) the NIC executes."""
    NOP = 0x00
    RDMA_WRITE = 0x08
    RDMA_WRITE_IMM = 0x09
    SEND = 0x0A
    SEND_IMM = 0x0B
    RDMA_READ = 0x10
    ATOMIC_CS = 0x11
    ATOMIC_FA = 0x12
    ATOMIC_MASKED_CS = 0x14
    ATOMIC_MASKED_FA = 0x15
    DUMP = 0x23              # NVSHMEM's IBGDA_MLX5_OPCODE_DUMP


# opmod of a masked atomic: its operand size (NVSHMEM's IBGDA_4/8_BYTE_EXT_AMO_OPMOD >> 24).
EXT_AMO_OPMOD = {4: 0x08, 8: 0x09}

# fm_ce_se (byte 11 of the control segment), mlx5dv.h names.
CTRL_SOLICITED = 0x02            # MLX5_WQE_CTRL_SOLICITED  (1 << 1)
CTRL_CQ_UPDATE = 0x08            # MLX5_WQE_CTRL_CQ_UPDATE  (2 << 2)
CTRL_INITIATOR_SMALL_FENCE = 0x20  # MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE (1 << 5)
CTRL_FENCE = 0x80                # MLX5_WQE_CTRL_FENCE (4 << 5)
FM_MASK = 0xE0                   # fence mode, bits 7..5 (NVSHMEM's ibgda_mlx5_fm_t)


class Syndrome(IntEnum):
    """Error-CQE syndromes (``MLX5_CQE_SYNDROME_*``), as ``hdl/nic/signatures.py``."""
    LOCAL_LENGTH_ERR = 0x01
    LOCAL_QP_OP_ERR = 0x02
    LOCAL_PROT_ERR = 0x04
    WR_FLUSH_ERR = 0x05
    BAD_RESP_ERR = 0x10
    LOCAL_ACCESS_ERR = 0x11
    REMOTE_INVAL_REQ_ERR = 0x12
    REMOTE_ACCESS_ERR = 0x13
    REMOTE_OP_ERR = 0x14
    TRANSPORT_RETRY_EXC_ERR = 0x15
    RNR_RETRY_EXC_ERR = 0x16


class CqeOpcode(IntEnum):
    """CQE opcodes, the high nibble of ``op_own`` (``MLX5_CQE_*``)."""
    REQ = 0x0
    RESP_WR_IMM = 0x1
    RESP_SEND = 0x2
    RESP_SEND_IMM = 0x3
    RESP_SEND_INV = 0x4
    REQ_ERR = 0xD
    RESP_ERR = 0xE
    INVALID = 0xF


def _be(value: int, nbytes: int) -> bytes:
    return (value & ((1 << (8 * nbytes)) - 1)).to_bytes(nbytes, "big")


def _field(buf: bytes, offset: int, nbytes: int) -> int:
    return int.from_bytes(buf[offset:offset + nbytes], "big")


# --- WQE segments ----------------------------------------------------------------------

def ctrl_segment(opcode: int, wqe_index: int, qpn: int, ds: int, *, opmod: int = 0,
                 fm_ce_se: int = 0, imm: int = 0, signature: int = 0) -> bytes:
    """``mlx5_wqe_ctrl_seg`` (16 B): opmod_idx_opcode, qpn_ds, signature, 2 reserved
    bytes, fm_ce_se, imm."""
    opmod_idx_opcode = (opmod & 0xFF) << 24 | (wqe_index & 0xFFFF) << 8 | (opcode & 0xFF)
    qpn_ds = (qpn & 0xFFFFFF) << 8 | (ds & 0x3F)
    return (_be(opmod_idx_opcode, 4) + _be(qpn_ds, 4) + bytes([signature & 0xFF, 0, 0,
                                                              fm_ce_se & 0xFF])
            + _be(imm, 4))


def raddr_segment(raddr: int, rkey: int) -> bytes:
    """``mlx5_wqe_raddr_seg`` (16 B): raddr, rkey, reserved."""
    return _be(raddr, 8) + _be(rkey, 4) + bytes(4)


def data_segment(byte_count: int, lkey: int, addr: int) -> bytes:
    """``mlx5_wqe_data_seg`` (16 B): byte_count, lkey, addr."""
    return _be(byte_count, 4) + _be(lkey, 4) + _be(addr, 8)


def inline_segment(data: bytes) -> bytes:
    """``mlx5_wqe_inl_data_seg``: byte_count | MLX5_INLINE_SEG, the data, zeros to 16 B."""
    seg = _be(len(data) | INLINE_SEG, 4) + bytes(data)
    return seg + bytes(-len(seg) % DS_BYTES)


def atomic_segment(swap_add: int, compare: int = 0) -> bytes:
    """``mlx5_wqe_atomic_seg`` (16 B): swap_add, compare."""
    return _be(swap_add, 8) + _be(compare, 8)


def masked_atomic_segments(opcode: int, nbytes: int, swap_add: int, compare: int = 0,
                           swap_mask: int = 0, compare_mask: int = 0) -> bytes:
    """The atomic segment(s) of a masked atomic, as ``ibgda_device.cuh`` lays them out.

    Masked FA (``swap_mask`` is the field boundary): 4 bytes ``ibgda_atomic_32_masked_fa_seg_t``
    {add_data, field_boundary, 8 reserved}, 8 bytes ``ibgda_atomic_64_masked_fa_seg_t``
    {add_data, field_boundary}. Masked CS: 4 bytes ``ibgda_atomic_32_masked_cs_seg_t``
    {swap_data, compare_data, swap_mask, compare_mask}; 8 bytes two
    ``ibgda_atomic_64_masked_cs_seg_t`` {swap, compare} then {swap_mask, compare_mask}."""
    if nbytes not in EXT_AMO_OPMOD:
        raise ValueError(f"masked atomics are 4 or 8 bytes, not {nbytes}")
    if opcode == Opcode.ATOMIC_MASKED_FA:
        if nbytes == 4:
            return _be(swap_add, 4) + _be(swap_mask, 4) + bytes(8)
        return _be(swap_add, 8) + _be(swap_mask, 8)
    if nbytes == 4:
        return _be(swap_add, 4) + _be(compare, 4) + _be(swap_mask, 4) + _be(compare_mask, 4)
    return _be(swap_add, 8) + _be(compare, 8) + _be(swap_mask, 8) + _be(compare_mask, 8)


def pad_blocks(wqe: bytes) -> bytes:
    """``wqe`` padded with zeros to whole 64-byte basic blocks (at least one)."""
    blocks = max(1, -(-len(wqe) // WQEBB_BYTES))
    return bytes(wqe).ljust(blocks * WQEBB_BYTES, b"\0")


def wqe_blocks(ds: int) -> int:
    """Basic blocks a WQE of ``ds`` occupies; ds 0 counts as one block (docs/nic.md)."""
    return max(1, -(-ds // 4))


class Wqe(NamedTuple):
    data: bytes      # whole basic blocks
    ds: int

    @property
    def blocks(self) -> int:
        return len(self.data) // WQEBB_BYTES


def build_wqe(opcode: int, wqe_index: int, qpn: int, *, fm_ce_se: int = CTRL_CQ_UPDATE,
              imm: int = 0, opmod: int = 0, signature: int = 0,
              raddr: int = 0, rkey: int = 0,
              lkey: int = 0, laddr: int = 0, byte_count: int | None = None,
              inline: bytes | None = None,
              swap_add: int = 0, compare: int = 0, swap_mask: int = 0, compare_mask: int = 0,
              gather: list | None = None, ds: int | None = None) -> Wqe:
    """A well-formed RC WQE as NVSHMEM/libmlx5 lay it out, padded to basic blocks.

    WRITE/SEND: a data segment when ``byte_count`` is given (0 allowed), inline data when
    ``inline`` is given, neither for a 0-byte message. READ: raddr + data segment.
    Atomics: raddr + atomic + data segment (``byte_count`` defaults to 8); masked atomics:
    raddr + :func:`masked_atomic_segments` of the size ``opmod`` names (an ``EXT_AMO_OPMOD``
    value; other opmods build 8-byte segments) + data segment (``byte_count`` defaults to
    that size). NOP: the
    control segment alone (ds 1), or with ``byte_count`` given a 16-byte unit of zeros
    after it (ds 2: ``ibgda_write_nop_wqe``'s form, which leaves that unit unwritten).
    DUMP: a data segment (``byte_count`` defaults to 1, as NVSHMEM posts it).
    ``gather``: WRITE/SEND with these data segments, ``(byte_count, lkey, laddr)`` each.
    ``ds``: write this ds instead of the segments' (a malformed WQE, cut or padded to the
    blocks that ds makes).
    """
    opcode = int(opcode)
    if byte_count is not None and inline is not None:
        raise ValueError("give byte_count (data segment) or inline, not both")
    segs = b""
    if opcode in _WRITES or opcode == Opcode.RDMA_READ or opcode in ATOMIC_OPCODES:
        segs += raddr_segment(raddr, rkey)
    if opcode in _ATOMICS:
        segs += atomic_segment(swap_add, compare)
    if opcode in MASKED_ATOMIC_OPCODES:
        nbytes = 4 if opmod == EXT_AMO_OPMOD[4] else 8
        segs += masked_atomic_segments(opcode, nbytes, swap_add, compare, swap_mask,
                                       compare_mask)
    if opcode in ATOMIC_OPCODES and byte_count is None:
        byte_count = masked_operand_bytes(opcode, opmod)
    if opcode == Opcode.RDMA_READ and byte_count is None:
        raise ValueError("RDMA_READ needs byte_count (its data segment)")
    if opcode == Opcode.DUMP and byte_count is None:
        byte_count = 1
    if opcode == Opcode.NOP:
        segs += bytes(DS_BYTES) if byte_count is not None else b""
    elif inline is not None:
        segs += inline_segment(inline)
    elif gather is not None:
        segs += b"".join(data_segment(*segment) for segment in gather)
    elif byte_count is not None:
        segs += data_segment(byte_count, lkey, laddr)
    if ds is None:
        ds = 1 + len(segs) // DS_BYTES
    ctrl = ctrl_segment(opcode, wqe_index, qpn, ds, opmod=opmod, fm_ce_se=fm_ce_se, imm=imm,
                        signature=signature)
    return Wqe((ctrl + segs)[:wqe_blocks(ds) * WQEBB_BYTES].ljust(wqe_blocks(ds) * WQEBB_BYTES,
                                                                  b"\0"), ds)


# --- WQE parser (reference of the NIC's) --------------------------------------------------

@dataclass(frozen=True)
class ParsedWqe:
    """A parsed WQE, field names as ``WqeDescriptorLayout``; fields of segments the WQE
    does not have are 0. ``format_error`` with ``syndrome`` when a segment rule fails."""
    opcode: int
    opmod: int
    ds: int
    wqe_blocks: int
    fm_ce_se: int
    imm: int
    raddr: int = 0
    rkey: int = 0
    swap_add: int = 0
    compare: int = 0
    swap_mask: int = 0         # masked atomics; masked FA: the field boundary
    compare_mask: int = 0
    has_data: bool = False
    lkey: int = 0
    laddr: int = 0
    byte_count: int = 0
    inline: bool = False
    inline_data: bytes = b""
    # a gather list: every data segment, (byte_count, lkey, laddr); the fields above hold
    # the first's lkey and laddr and the sum of the byte counts
    gather: tuple = ()
    format_error: bool = False
    syndrome: int = 0
    ctrl_wqe_index: int = 0    # the idx the host wrote (the NIC does not use it)
    ctrl_qpn: int = 0          # the qpn the host wrote (the NIC does not use it)

    @property
    def length(self) -> int:
        """Message length in bytes (data segment or inline)."""
        return self.byte_count if (self.has_data or self.inline) else 0

    @property
    def operand_bytes(self) -> int:
        """An atomic's operand size (:func:`masked_operand_bytes`)."""
        return masked_operand_bytes(self.opcode, self.opmod)


_WRITES = (Opcode.RDMA_WRITE, Opcode.RDMA_WRITE_IMM)
_SENDS = (Opcode.SEND, Opcode.SEND_IMM)
_ATOMICS = (Opcode.ATOMIC_CS, Opcode.ATOMIC_FA)
MASKED_ATOMIC_OPCODES = (Opcode.ATOMIC_MASKED_CS, Opcode.ATOMIC_MASKED_FA)
ATOMIC_OPCODES = _ATOMICS + MASKED_ATOMIC_OPCODES
LOCAL_OPCODES = (Opcode.NOP, Opcode.DUMP)     # complete in order, send nothing


def masked_operand_bytes(opcode: int, opmod: int) -> int:
    """Operand size of an atomic WQE: 4 for a masked one with opmod 0x08, else 8."""
    return 4 if opcode in MASKED_ATOMIC_OPCODES and opmod == EXT_AMO_OPMOD[4] else 8


def parse_wqe(wqe: bytes) -> ParsedWqe:
    """Parse one WQE (``wqe`` holds at least its ``wqe_blocks`` basic blocks).

    Rules (docs/nic.md, segment rules), checked in this order:
    ds 0 or an opcode not in :class:`Opcode` -> LOCAL_QP_OP_ERR; inline data longer than
    256 bytes -> LOCAL_LENGTH_ERR (checked before its ds); ds not matching the opcode's
    segments -> LOCAL_QP_OP_ERR; an atomic's data-segment word not 8 (an inline-marked
    segment included) -> LOCAL_LENGTH_ERR; a READ whose data segment is marked inline ->
    LOCAL_QP_OP_ERR. NOP: ds 1 or 2 (the second unit is not read) and opmod 0; DUMP: ds 2,
    opmod 0, a data segment not marked inline; else LOCAL_QP_OP_ERR. Masked atomics: opmod
    0x08 (4 bytes) or 0x09 (8 bytes), else LOCAL_QP_OP_ERR; ds 4 (ctrl, raddr, one atomic
    segment, data), 5 for 8-byte masked CS (two atomic segments); the data-segment word
    must be the operand size (else LOCAL_LENGTH_ERR). The same rules as
    hdl/nic/wqe_fetcher.py (masked atomics: the model only so far, docs/nic-formats.md).
    """
    wqe = bytes(wqe)
    opmod_idx_opcode = _field(wqe, 0, 4)
    qpn_ds = _field(wqe, 4, 4)
    opcode = opmod_idx_opcode & 0xFF
    ds = qpn_ds & 0x3F
    base = dict(opcode=opcode, opmod=opmod_idx_opcode >> 24, ds=ds, wqe_blocks=wqe_blocks(ds),
                fm_ce_se=wqe[11], imm=_field(wqe, 12, 4),
                ctrl_wqe_index=(opmod_idx_opcode >> 8) & 0xFFFF, ctrl_qpn=qpn_ds >> 8)
    if len(wqe) < base["wqe_blocks"] * WQEBB_BYTES:
        raise ValueError(f"WQE of ds {ds} needs {base['wqe_blocks']} blocks, got {len(wqe)} bytes")

    def error(syndrome):
        return ParsedWqe(**base, format_error=True, syndrome=int(syndrome))

    if ds == 0 or opcode not in Opcode._value2member_map_:
        return error(Syndrome.LOCAL_QP_OP_ERR)
    if opcode == Opcode.NOP:
        if ds > 2 or base["opmod"]:
            return error(Syndrome.LOCAL_QP_OP_ERR)
        return ParsedWqe(**base)
    if opcode == Opcode.DUMP and base["opmod"]:
        return error(Syndrome.LOCAL_QP_OP_ERR)
    if opcode in MASKED_ATOMIC_OPCODES and base["opmod"] not in EXT_AMO_OPMOD.values():
        return error(Syndrome.LOCAL_QP_OP_ERR)
    operand_bytes = masked_operand_bytes(opcode, base["opmod"])

    fields = {}
    offset = 16
    if opcode in _WRITES or opcode == Opcode.RDMA_READ or opcode in ATOMIC_OPCODES:
        fields.update(raddr=_field(wqe, offset, 8), rkey=_field(wqe, offset + 8, 4))
        offset += 16
    if opcode in _ATOMICS:
        fields.update(swap_add=_field(wqe, offset, 8), compare=_field(wqe, offset + 8, 8))
        offset += 16
    elif opcode in MASKED_ATOMIC_OPCODES:
        n = operand_bytes
        fields.update(swap_add=_field(wqe, offset, n))
        if opcode == Opcode.ATOMIC_MASKED_FA:
            fields.update(swap_mask=_field(wqe, offset + n, n))
        elif n == 4:
            fields.update(compare=_field(wqe, offset + 4, 4), swap_mask=_field(wqe, offset + 8, 4),
                          compare_mask=_field(wqe, offset + 12, 4))
        else:
            fields.update(compare=_field(wqe, offset + 8, 8), swap_mask=_field(wqe, offset + 16, 8),
                          compare_mask=_field(wqe, offset + 24, 8))
            offset += 16
        offset += 16
    header_ds = offset // DS_BYTES
    if ds < header_ds:          # shorter than its own fixed segments: nothing more to read
        return error(Syndrome.LOCAL_QP_OP_ERR)

    if opcode in _WRITES or opcode in _SENDS:
        if ds == header_ds:
            return ParsedWqe(**base, **fields)
        word = _field(wqe, offset, 4)
        if word & INLINE_SEG:
            n = word & ~INLINE_SEG
            if n > MAX_INLINE_BYTES:
                return error(Syndrome.LOCAL_LENGTH_ERR)
            if ds != header_ds + -(-(4 + n) // DS_BYTES):
                return error(Syndrome.LOCAL_QP_OP_ERR)
            return ParsedWqe(**base, **fields, inline=True, byte_count=n,
                             inline_data=wqe[offset + 4:offset + 4 + n])
        count = ds - header_ds
        if count > MAX_GATHER_SEGMENTS:
            return error(Syndrome.LOCAL_QP_OP_ERR)
        if count > 1:
            segments = tuple((_field(wqe, at, 4), _field(wqe, at + 4, 4), _field(wqe, at + 8, 8))
                             for at in range(offset, offset + DS_BYTES * count, DS_BYTES))
            if any(byte_count & INLINE_SEG for byte_count, _, _ in segments):
                return error(Syndrome.LOCAL_QP_OP_ERR)
            return ParsedWqe(**base, **fields, has_data=True,
                             byte_count=sum(byte_count for byte_count, _, _ in segments),
                             lkey=segments[0][1], laddr=segments[0][2], gather=segments)
    elif ds != header_ds + 1:
        return error(Syndrome.LOCAL_QP_OP_ERR)

    byte_count = _field(wqe, offset, 4)
    if opcode in ATOMIC_OPCODES and byte_count != operand_bytes:    # an inline-marked one too
        return error(Syndrome.LOCAL_LENGTH_ERR)
    if byte_count & INLINE_SEG:                   # a READ's data segment must not be inline
        return error(Syndrome.LOCAL_QP_OP_ERR)
    return ParsedWqe(**base, **fields, has_data=True, byte_count=byte_count,
                     lkey=_field(wqe, offset + 4, 4), laddr=_field(wqe, offset + 8, 8))


def landed_atomic_result(orig: int, nbytes: int) -> bytes:
    """The bytes an atomic's original value lands as at the data segment's address, as
    NVSHMEM reads them (``nvshmemi_ibgda_amo_fetch_impl``: ``ret = READ_ONCE(*(T *)laddr);
    if (sizeof(T) == 4) ret = BSWAP32(ret)``): 8-byte results little-endian (mlx5's
    host-endian 8-byte atomic replies), 4-byte results big-endian."""
    if nbytes == 4:
        return (orig & 0xFFFFFFFF).to_bytes(4, "big")
    return orig.to_bytes(8, "little")


# --- NVSHMEM's atomic posts ---------------------------------------------------------------

NVSHMEM_AMOS = ("INC", "FETCH_INC", "SIGNAL", "SIGNAL_SET", "SWAP", "SET", "SIGNAL_ADD", "ADD",
                "AND", "FETCH_AND", "OR", "FETCH_OR", "XOR", "FETCH_XOR", "FETCH", "FETCH_ADD",
                "COMPARE_SWAP")


def nvshmem_atomic_fields(amo: str, nbytes: int, value: int = 0, compare: int = 0) -> dict:
    """The :func:`build_wqe` fields (opcode, opmod, operands) ``ibgda_write_atomic_wqe``
    (``ibgda_device.cuh``) writes for NVSHMEM operation ``amo`` (``NVSHMEMI_AMO_<amo>``)
    on ``nbytes`` (4 or 8) bytes: ``value`` is its ``val_1``, ``compare`` its ``val_2``.

    INC, ADD, SIGNAL_ADD, FETCH (add 0), XOR (field boundary all ones: no carries) and
    4-byte FETCH_ADD are masked FA; SET, SWAP, SIGNAL(_SET) (swap mask all ones), AND (swap
    mask ~value), OR (swap mask value), all with compare mask 0, and 4-byte COMPARE_SWAP
    (both masks all ones) are masked CS; 8-byte FETCH_ADD and COMPARE_SWAP are the plain
    ATOMIC_FA / ATOMIC_CS."""
    if amo not in NVSHMEM_AMOS or nbytes not in EXT_AMO_OPMOD:
        raise ValueError(f"no NVSHMEM atomic {amo!r} of {nbytes} bytes")
    ones = (1 << (8 * nbytes)) - 1
    value &= ones
    compare &= ones
    base = amo.removeprefix("FETCH_") if amo != "FETCH_ADD" else amo
    if nbytes == 8 and base in ("FETCH_ADD", "COMPARE_SWAP"):
        return dict(opcode=Opcode.ATOMIC_FA if base == "FETCH_ADD" else Opcode.ATOMIC_CS,
                    opmod=0, swap_add=value, compare=compare if base == "COMPARE_SWAP" else 0)
    fields = dict(opcode=Opcode.ATOMIC_MASKED_FA, opmod=EXT_AMO_OPMOD[nbytes], swap_add=value)
    if base == "INC":
        fields.update(swap_add=1)
    elif base in ("SIGNAL", "SIGNAL_SET", "SWAP", "SET"):
        fields.update(opcode=Opcode.ATOMIC_MASKED_CS, swap_mask=ones)
    elif base == "AND":
        fields.update(opcode=Opcode.ATOMIC_MASKED_CS, swap_mask=~value & ones)
    elif base == "OR":
        fields.update(opcode=Opcode.ATOMIC_MASKED_CS, swap_mask=value)
    elif base == "XOR":
        fields.update(swap_mask=ones)
    elif base == "FETCH":
        fields.update(swap_add=0)
    elif base == "COMPARE_SWAP":
        fields.update(opcode=Opcode.ATOMIC_MASKED_CS, compare=compare, swap_mask=ones,
                      compare_mask=ones)
    return fields


def nvshmem_atomic_wqe(amo: str, nbytes: int, wqe_index: int, qpn: int, *, raddr: int,
                       rkey: int, laddr: int, lkey: int, value: int = 0, compare: int = 0,
                       fm_ce_se: int = 0) -> Wqe:
    """The RC WQE ``ibgda_write_atomic_wqe`` writes (:func:`nvshmem_atomic_fields`), its
    data segment naming ``nbytes`` at ``laddr``."""
    fields = nvshmem_atomic_fields(amo, nbytes, value, compare)
    return build_wqe(fields.pop("opcode"), wqe_index, qpn, fm_ce_se=fm_ce_se, raddr=raddr,
                     rkey=rkey, lkey=lkey, laddr=laddr, byte_count=nbytes, **fields)


# --- doorbells ----------------------------------------------------------------------------

def doorbell(qpn: int, pi: int) -> bytes:
    """The 8 bytes ``ibgda_ring_db`` stores to the UAR: the first 8 bytes of a control
    segment with only the producer index (``opmod_idx_opcode = pi << 8``) and the QPN
    (``qpn_ds = qpn << 8``)."""
    return _be((pi & 0xFFFF) << 8, 4) + _be((qpn & 0xFFFFFF) << 8, 4)


def parse_doorbell(data: bytes) -> tuple[int, int]:
    """(qpn, pi) of an 8-byte UAR doorbell write, decoded as the NIC does
    (``DoorbellLayout``: pi = bits 23..8 of opmod_idx_opcode, qpn = bits 31..8 of qpn_ds)."""
    return _field(data, 4, 4) >> 8, (_field(data, 0, 4) >> 8) & 0xFFFF


def doorbell_record(pi: int) -> bytes:
    """The send queue's doorbell record as ``ibgda_update_dbr`` writes it:
    ``HTOBE32(pi & 0xffff)``, the index of the next empty basic block."""
    return _be(pi & 0xFFFF, 4)


# --- CQEs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cqe:
    """The fields of a 64-byte CQE the NIC writes (everything else is zero).

    Layout: rdma-core ``mlx5dv.h`` ``struct mlx5_cqe64`` (``imm_inval_pkey`` @36,
    ``byte_cnt`` @44, ``sop_drop_qpn`` @56, ``wqe_counter`` @60, ``signature`` @62,
    ``op_own`` @63) and, for the error opcodes, ``struct mlx5_err_cqe``
    (``vendor_err_synd`` @54, ``syndrome`` @55, ``s_wqe_opcode_qpn`` @56).

    ``opcode`` is the CQE opcode (op_own >> 4); ``wqe_opcode`` the mlx5 opcode of the WQE
    (bits 31..24 of sop_drop_qpn / s_wqe_opcode_qpn; 0 in receive completions). ``imm``:
    ``imm_inval_pkey``, the immediate as the 32-bit big-endian number it is on the wire
    (rdma-core hands the raw field to ``wc.imm_data``, which is ``__be32``); an error CQE
    has no such field (its bytes 36..51 are reserved) and it packs as zero."""
    opcode: int
    qpn: int
    wqe_counter: int
    wqe_opcode: int
    byte_cnt: int = 0
    syndrome: int = 0
    vendor_err_synd: int = 0
    signature: int = 0
    owner: int = 0
    imm: int = 0

    @property
    def is_error(self) -> bool:
        return self.opcode in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR)

    def pack(self) -> bytes:
        cqe = bytearray(CQE_BYTES)
        if self.is_error:
            cqe[54] = self.vendor_err_synd & 0xFF
            cqe[55] = self.syndrome & 0xFF
        else:
            cqe[36:40] = _be(self.imm, 4)
        cqe[44:48] = _be(self.byte_cnt, 4)
        cqe[56:60] = _be((self.wqe_opcode & 0xFF) << 24 | (self.qpn & 0xFFFFFF), 4)
        cqe[60:62] = _be(self.wqe_counter, 2)
        cqe[62] = self.signature & 0xFF
        cqe[63] = (self.opcode & 0xF) << 4 | (self.owner & 1)
        return bytes(cqe)


def parse_cqe(data: bytes) -> Cqe:
    """Read a 64-byte CQE (``mlx5_cqe64``, or ``mlx5_err_cqe`` when the opcode is an
    error). Only the fields in :class:`Cqe` are read."""
    data = bytes(data)
    if len(data) != CQE_BYTES:
        raise ValueError(f"a CQE is {CQE_BYTES} bytes, got {len(data)}")
    op_own = data[63]
    opcode = op_own >> 4
    error = opcode in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR)
    word = _field(data, 56, 4)
    return Cqe(opcode=opcode, qpn=word & 0xFFFFFF, wqe_counter=_field(data, 60, 2),
               wqe_opcode=word >> 24, byte_cnt=_field(data, 44, 4),
               syndrome=data[55] if error else 0, vendor_err_synd=data[54] if error else 0,
               signature=data[62], owner=op_own & 1, imm=0 if error else _field(data, 36, 4))


def requester_cqe(qpn: int, wqe_counter: int, wqe_opcode: int, byte_cnt: int,
                  owner: int = 0) -> Cqe:
    return Cqe(opcode=CqeOpcode.REQ, qpn=qpn, wqe_counter=wqe_counter & 0xFFFF,
               wqe_opcode=wqe_opcode, byte_cnt=byte_cnt, owner=owner)


def error_cqe(qpn: int, wqe_counter: int, wqe_opcode: int, syndrome: int,
              owner: int = 0) -> Cqe:
    return Cqe(opcode=CqeOpcode.REQ_ERR, qpn=qpn, wqe_counter=wqe_counter & 0xFFFF,
               wqe_opcode=wqe_opcode, syndrome=int(syndrome), owner=owner)


def build_requester_cqe(qpn: int, wqe_counter: int, wqe_opcode: int, byte_cnt: int,
                        owner: int) -> bytes:
    """The 64 bytes of a successful requester CQE (opcode REQ)."""
    return requester_cqe(qpn, wqe_counter, wqe_opcode, byte_cnt, owner).pack()


def build_error_cqe(qpn: int, wqe_counter: int, wqe_opcode: int, syndrome: int,
                    owner: int) -> bytes:
    """The 64 bytes of a requester error CQE (opcode REQ_ERR); a flush is syndrome
    WR_FLUSH_ERR."""
    return error_cqe(qpn, wqe_counter, wqe_opcode, syndrome, owner).pack()


def responder_cqe(qpn: int, wqe_counter: int, opcode: int, byte_cnt: int = 0, imm: int = 0,
                  owner: int = 0) -> Cqe:
    """A receive completion (``struct mlx5_cqe64``): ``opcode`` RESP_WR_IMM, RESP_SEND or
    RESP_SEND_IMM; ``sop_drop_qpn`` = the QPN (bits 31..24 zero); ``wqe_counter`` = the
    receive WQE's counter; ``byte_cnt`` = the message length; ``imm_inval_pkey`` = the
    immediate (RESP_WR_IMM / RESP_SEND_IMM; 0 for RESP_SEND)."""
    opcode = CqeOpcode(opcode)
    if opcode not in (CqeOpcode.RESP_WR_IMM, CqeOpcode.RESP_SEND, CqeOpcode.RESP_SEND_IMM):
        raise ValueError(f"{opcode.name} is not a successful receive completion opcode")
    return Cqe(opcode=opcode, qpn=qpn, wqe_counter=wqe_counter & 0xFFFF, wqe_opcode=0,
               byte_cnt=byte_cnt, owner=owner,
               imm=0 if opcode == CqeOpcode.RESP_SEND else imm)


def responder_error_cqe(qpn: int, wqe_counter: int, syndrome: int, owner: int = 0) -> Cqe:
    """A receive error completion (``struct mlx5_err_cqe``, opcode RESP_ERR): the failed
    receive WQE's counter and ``syndrome``; ``s_wqe_opcode_qpn`` = the QPN."""
    return Cqe(opcode=CqeOpcode.RESP_ERR, qpn=qpn, wqe_counter=wqe_counter & 0xFFFF,
               wqe_opcode=0, syndrome=int(syndrome), owner=owner)


def build_responder_cqe(qpn: int, wqe_counter: int, opcode: int, byte_cnt: int = 0,
                        imm: int = 0, syndrome: int = 0, owner: int = 0) -> bytes:
    """The 64 bytes of a receive completion; ``opcode`` RESP_ERR gives the error form
    with ``syndrome`` (``byte_cnt`` and ``imm`` are then not part of the CQE)."""
    if CqeOpcode(opcode) == CqeOpcode.RESP_ERR:
        return responder_error_cqe(qpn, wqe_counter, syndrome, owner).pack()
    return responder_cqe(qpn, wqe_counter, opcode, byte_cnt, imm, owner).pack()


# --- receive queue --------------------------------------------------------------------

RECV_WQE_BYTES = 16          # one mlx5_wqe_data_seg per receive WQE (docs/nic-responder.md)


def recv_wqe(byte_count: int, lkey: int, addr: int) -> bytes:
    """A receive WQE of one scatter entry: ``struct mlx5_wqe_data_seg`` (16 B: be32
    byte_count, be32 lkey, be64 addr), as libmlx5's ``mlx5_post_recv`` writes it."""
    return data_segment(byte_count, lkey, addr)


def parse_recv_wqe(data: bytes) -> tuple[int, int, int]:
    """(byte_count, lkey, addr) of a 16-byte receive WQE."""
    data = bytes(data)
    if len(data) < RECV_WQE_BYTES:
        raise ValueError(f"a receive WQE is {RECV_WQE_BYTES} bytes, got {len(data)}")
    return _field(data, 0, 4), _field(data, 4, 4), _field(data, 8, 8)


def rq_doorbell_record(head: int) -> bytes:
    """The receive doorbell record as rdma-core writes ``dbrec[MLX5_RCV_DBR]``:
    ``htobe32(head & 0xffff)``, the number of receive WQEs posted (producer index)."""
    return _be(head & 0xFFFF, 4)


def parse_rq_doorbell_record(data: bytes) -> int:
    """The producer index the NIC takes from a receive doorbell record (low 16 bits)."""
    return _field(bytes(data), 0, 4) & 0xFFFF


def make_key(index: int, variant: int) -> int:
    """An mlx5-style memory key: table index << 8 | an 8-bit variant."""
    return (index << 8) | (variant & 0xFF)


def cqe_owner(pi: int, log_size: int) -> int:
    """Owner bit of the CQE written at CQ producer index ``pi``."""
    return (pi >> log_size) & 1


def cqe_address(base: int, log_size: int, collapsed: bool, pi: int) -> int:
    """Where the CQE with producer index ``pi`` goes (entry 0 in collapsed mode)."""
    return base if collapsed else base + CQE_BYTES * (pi % (1 << log_size))
