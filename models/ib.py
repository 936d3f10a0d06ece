"""InfiniBand header codecs (IBA vol. 1, ch. 7 and 9).

Headers are big-endian on the wire exactly as the IBA spec draws them: the first field listed
is in the most-significant bits of byte 0. Reserved fields pack as zero and are ignored on
unpack. The one little-endian exception is the flow-control packet's LPCRC, which like every
IBA CRC goes on the wire least-significant byte first.
"""

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, TypeVar

from models.crc import lpcrc

# Link Next Header values (LRH.LNH).
LNH_RAW = 0b00
LNH_IP_NON_IBA = 0b01
LNH_IBA_LOCAL = 0b10  # BTH follows the LRH
LNH_IBA_GLOBAL = 0b11  # GRH, then BTH


HeaderT = TypeVar("HeaderT", bound="_Header")


class _Header:
    """Big-endian bit-field header; `_LAYOUT` lists (field name or None for reserved, bits), MSB first."""

    _LAYOUT: ClassVar[tuple[tuple[str | None, int], ...]]
    _FIELD_BYTES: ClassVar[int]
    SIZE: ClassVar[int]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        total_bits = sum(bits for _, bits in cls._LAYOUT)
        assert total_bits % 8 == 0, cls
        cls._FIELD_BYTES = total_bits // 8
        if "SIZE" not in cls.__dict__:  # a header with a trailer (FlowControl) sets its own
            cls.SIZE = cls._FIELD_BYTES

    @classmethod
    def field_widths(cls) -> dict[str, int]:
        """Named fields and their widths in bits, in wire order."""
        return {name: bits for name, bits in cls._LAYOUT if name is not None}

    def pack(self) -> bytes:
        word = 0
        for name, bits in self._LAYOUT:
            value = 0 if name is None else getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < (1 << bits):
                raise ValueError(f"{type(self).__name__}.{name}={value!r} does not fit in {bits} bits")
            word = (word << bits) | value
        return word.to_bytes(self._FIELD_BYTES, "big")

    @classmethod
    def unpack(cls: type[HeaderT], buf: bytes) -> HeaderT:
        if len(buf) < cls.SIZE:
            raise ValueError(f"{cls.__name__} needs {cls.SIZE} bytes, got {len(buf)}")
        word = int.from_bytes(buf[: cls._FIELD_BYTES], "big")
        shift = cls._FIELD_BYTES * 8
        values = {}
        for name, bits in cls._LAYOUT:
            shift -= bits
            if name is not None:
                values[name] = (word >> shift) & ((1 << bits) - 1)
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class LRH(_Header):
    """Local Route Header. `pktlen` counts 4-byte words from the LRH through the ICRC."""

    vl: int = 0
    lver: int = 0
    sl: int = 0
    lnh: int = LNH_IBA_LOCAL
    dlid: int = 0
    pktlen: int = 0
    slid: int = 0

    _LAYOUT = (("vl", 4), ("lver", 4), ("sl", 4), (None, 2), ("lnh", 2),
               ("dlid", 16), (None, 5), ("pktlen", 11), ("slid", 16))


@dataclass(frozen=True, kw_only=True)
class BTH(_Header):
    """Base Transport Header."""

    opcode: int = 0
    se: int = 0
    m: int = 0
    padcnt: int = 0
    tver: int = 0
    pkey: int = 0xFFFF  # default partition, full membership
    resv8a: int = 0
    destqp: int = 0
    ackreq: int = 0
    psn: int = 0

    _LAYOUT = (("opcode", 8), ("se", 1), ("m", 1), ("padcnt", 2), ("tver", 4), ("pkey", 16),
               ("resv8a", 8), ("destqp", 24), ("ackreq", 1), (None, 7), ("psn", 24))


@dataclass(frozen=True, kw_only=True)
class RETH(_Header):
    """RDMA Extended Transport Header."""

    va: int = 0
    rkey: int = 0
    dmalen: int = 0

    _LAYOUT = (("va", 64), ("rkey", 32), ("dmalen", 32))


@dataclass(frozen=True, kw_only=True)
class AETH(_Header):
    """ACK Extended Transport Header."""

    syndrome: int = 0
    msn: int = 0

    _LAYOUT = (("syndrome", 8), ("msn", 24))


@dataclass(frozen=True, kw_only=True)
class AtomicETH(_Header):
    """Atomic Extended Transport Header."""

    va: int = 0
    rkey: int = 0
    swap_add: int = 0
    compare: int = 0

    _LAYOUT = (("va", 64), ("rkey", 32), ("swap_add", 64), ("compare", 64))


@dataclass(frozen=True, kw_only=True)
class MaskedAtomicETH(_Header):
    """This project's extended atomic header (44 B): AtomicETH, then the two masks.

    Carries mlx5's masked atomics (docs/nic-formats.md, "Masked atomics on the wire"): masked
    compare-and-swap uses every field; masked fetch-and-add carries the addend in
    ``swap_add`` and the field boundary in ``swap_mask`` (``compare``, ``compare_mask`` 0).
    4-byte operands sit in the low 32 bits of each field."""

    va: int = 0
    rkey: int = 0
    swap_add: int = 0
    compare: int = 0
    swap_mask: int = 0
    compare_mask: int = 0

    _LAYOUT = (("va", 64), ("rkey", 32), ("swap_add", 64), ("compare", 64),
               ("swap_mask", 64), ("compare_mask", 64))


@dataclass(frozen=True, kw_only=True)
class AtomicAckETH(_Header):
    """Atomic ACK Extended Transport Header."""

    orig: int = 0

    _LAYOUT = (("orig", 64),)


@dataclass(frozen=True, kw_only=True)
class ImmDt(_Header):
    """Immediate data."""

    imm: int = 0

    _LAYOUT = (("imm", 32),)


class FlowControlOp(IntEnum):
    NORMAL = 0
    INIT = 1


@dataclass(frozen=True, kw_only=True)
class FlowControl(_Header):
    """Link flow-control packet (6 B): Op/FCTBS/VL/FCCL big-endian, then LPCRC LSB first.

    `pack()` appends the LPCRC; `unpack()` raises ValueError when it is wrong.
    """

    op: int = FlowControlOp.NORMAL
    fctbs: int = 0
    vl: int = 0
    fccl: int = 0

    _LAYOUT = (("op", 4), ("fctbs", 12), ("vl", 4), ("fccl", 12))
    SIZE = 6  # 4 bytes of fields covered by the LPCRC, then the LPCRC

    def pack(self) -> bytes:
        fields_bytes = super().pack()
        return fields_bytes + lpcrc(fields_bytes).to_bytes(2, "little")

    @classmethod
    def unpack(cls, buf: bytes) -> "FlowControl":
        if not cls.lpcrc_ok(buf):
            raise ValueError(f"FlowControl packet {bytes(buf[: cls.SIZE]).hex()} has a bad LPCRC")
        return super().unpack(buf)

    @classmethod
    def lpcrc_ok(cls, buf: bytes) -> bool:
        if len(buf) < cls.SIZE:
            raise ValueError(f"FlowControl needs {cls.SIZE} bytes, got {len(buf)}")
        covered = bytes(buf[: cls._FIELD_BYTES])
        return int.from_bytes(buf[cls._FIELD_BYTES : cls.SIZE], "little") == lpcrc(covered)


class Opcode(IntEnum):
    """BTH opcodes of the Reliable Connection transport (IBA table 38), and this project's
    masked atomics in the manufacturer-specific range 0xC0..0xFF (docs/nic-formats.md):
    0xC0 | the IBA atomic's code for 8-byte operands, 0xE0 | it for 4-byte ones."""

    SEND_FIRST = 0x00
    SEND_MIDDLE = 0x01
    SEND_LAST = 0x02
    SEND_LAST_WITH_IMMEDIATE = 0x03
    SEND_ONLY = 0x04
    SEND_ONLY_WITH_IMMEDIATE = 0x05
    RDMA_WRITE_FIRST = 0x06
    RDMA_WRITE_MIDDLE = 0x07
    RDMA_WRITE_LAST = 0x08
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RDMA_WRITE_ONLY = 0x0A
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    RDMA_READ_REQUEST = 0x0C
    RDMA_READ_RESPONSE_FIRST = 0x0D
    RDMA_READ_RESPONSE_MIDDLE = 0x0E
    RDMA_READ_RESPONSE_LAST = 0x0F
    RDMA_READ_RESPONSE_ONLY = 0x10
    ACKNOWLEDGE = 0x11
    ATOMIC_ACKNOWLEDGE = 0x12
    COMPARE_SWAP = 0x13
    FETCH_ADD = 0x14
    MASKED_COMPARE_SWAP = 0xD3
    MASKED_FETCH_ADD = 0xD4
    MASKED_COMPARE_SWAP_4 = 0xF3
    MASKED_FETCH_ADD_4 = 0xF4


MASKED_ATOMICS = frozenset({Opcode.MASKED_COMPARE_SWAP, Opcode.MASKED_FETCH_ADD,
                            Opcode.MASKED_COMPARE_SWAP_4, Opcode.MASKED_FETCH_ADD_4})
MASKED_FETCH_ADDS = frozenset({Opcode.MASKED_FETCH_ADD, Opcode.MASKED_FETCH_ADD_4})


def atomic_operand_bytes(opcode: int) -> int:
    """Operand size of an atomic request opcode: 4 for the 4-byte masked ones, else 8."""
    return 4 if opcode in (Opcode.MASKED_COMPARE_SWAP_4, Opcode.MASKED_FETCH_ADD_4) else 8


_EXTENSION_HEADERS: dict[Opcode, tuple[type[_Header], ...]] = {
    Opcode.SEND_FIRST: (),
    Opcode.SEND_MIDDLE: (),
    Opcode.SEND_LAST: (),
    Opcode.SEND_LAST_WITH_IMMEDIATE: (ImmDt,),
    Opcode.SEND_ONLY: (),
    Opcode.SEND_ONLY_WITH_IMMEDIATE: (ImmDt,),
    Opcode.RDMA_WRITE_FIRST: (RETH,),
    Opcode.RDMA_WRITE_MIDDLE: (),
    Opcode.RDMA_WRITE_LAST: (),
    Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE: (ImmDt,),
    Opcode.RDMA_WRITE_ONLY: (RETH,),
    Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE: (RETH, ImmDt),
    Opcode.RDMA_READ_REQUEST: (RETH,),
    Opcode.RDMA_READ_RESPONSE_FIRST: (AETH,),
    Opcode.RDMA_READ_RESPONSE_MIDDLE: (),
    Opcode.RDMA_READ_RESPONSE_LAST: (AETH,),
    Opcode.RDMA_READ_RESPONSE_ONLY: (AETH,),
    Opcode.ACKNOWLEDGE: (AETH,),
    Opcode.ATOMIC_ACKNOWLEDGE: (AETH, AtomicAckETH),
    Opcode.COMPARE_SWAP: (AtomicETH,),
    Opcode.FETCH_ADD: (AtomicETH,),
    **{op: (MaskedAtomicETH,) for op in MASKED_ATOMICS},
}

_NO_PAYLOAD = frozenset({Opcode.RDMA_READ_REQUEST, Opcode.ACKNOWLEDGE,
                         Opcode.ATOMIC_ACKNOWLEDGE, Opcode.COMPARE_SWAP, Opcode.FETCH_ADD,
                         *MASKED_ATOMICS})


def extension_headers(opcode: int) -> tuple[type[_Header], ...]:
    """Header classes that follow the BTH for `opcode`, in wire order."""
    try:
        return _EXTENSION_HEADERS[Opcode(opcode)]
    except ValueError:
        raise ValueError(f"opcode {opcode:#04x} is not a supported RC opcode") from None


def carries_payload(opcode: int) -> bool:
    """Whether packets with `opcode` may carry payload (requests without data and ACKs do not)."""
    extension_headers(opcode)  # reject unsupported opcodes
    return Opcode(opcode) not in _NO_PAYLOAD
