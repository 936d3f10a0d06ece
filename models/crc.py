"""Reference CRCs of the InfiniBand wire format, table-driven and independent of amaranth.lib.crc.

Both CRCs are bit-reflected, so the CRC register's least-significant byte is the one that goes
on the wire first: `vcrc_bytes` / `icrc_bytes` return the CRC little-endian, unlike the headers,
which are big-endian.
"""

VCRC_POLY = 0x100B
ICRC_POLY = 0x04C11DB7

LRH_SIZE = 8
GRH_SIZE = 40
LNH_GRH = 0b11
LNH_BTH = 0b10  # LNH bit 1 set means a BTH follows (IBA local or global transport)


def _reflect(value: int, width: int) -> int:
    return int(f"{value:0{width}b}"[::-1], 2)


def _reflected_table(poly: int, width: int) -> tuple[int, ...]:
    reflected_poly = _reflect(poly, width)
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ reflected_poly if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_VCRC_TABLE = _reflected_table(VCRC_POLY, 16)
_ICRC_TABLE = _reflected_table(ICRC_POLY, 32)


def _reflected_crc(table: tuple[int, ...], mask: int, data: bytes) -> int:
    crc = mask  # init all ones
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ mask  # final XOR all ones


def vcrc(data: bytes) -> int:
    """CRC-16 (poly 0x100B, reflected, init/xorout 0xFFFF) over LRH .. end of ICRC."""
    return _reflected_crc(_VCRC_TABLE, 0xFFFF, data)


def lpcrc(first4: bytes) -> int:
    """Link-packet CRC: the VCRC algorithm over the first 4 bytes of a flow-control packet."""
    if len(first4) != 4:
        raise ValueError(f"LPCRC covers exactly 4 bytes, got {len(first4)}")
    return vcrc(first4)


def crc32(data: bytes) -> int:
    """Ethernet CRC-32 (reflected 0x04C11DB7, init/xorout 0xFFFFFFFF)."""
    return _reflected_crc(_ICRC_TABLE, 0xFFFFFFFF, data)


def icrc_masked(packet: bytes) -> bytes:
    """`packet` (LRH .. end of pad) with the fields a switch or router may change set to ones.
    Any bytes are accepted: a field past the end of a short (malformed) packet is skipped."""
    masked = bytearray(packet)

    def ones(index, mask=0xFF):
        if index < len(masked):
            masked[index] |= mask
    ones(0, 0xF0)  # LRH.VL
    lnh = masked[1] & 0b11 if len(masked) > 1 else 0
    bth_offset = LRH_SIZE
    if lnh == LNH_GRH:
        grh = LRH_SIZE
        ones(grh, 0x0F)  # TClass high nibble (low nibble of byte 0 after IPVer)
        for i in (1, 2, 3):
            ones(grh + i)  # TClass low nibble + FlowLabel
        ones(grh + 7)  # HopLmt
        bth_offset += GRH_SIZE
    if lnh & LNH_BTH:
        ones(bth_offset + 4)  # BTH.resv8a
    return bytes(masked)


def icrc(packet: bytes) -> int:
    """Invariant CRC over LRH .. end of pad, variant fields replaced by ones."""
    return crc32(icrc_masked(packet))


def vcrc_bytes(data: bytes) -> bytes:
    return vcrc(data).to_bytes(2, "little")


def icrc_bytes(packet: bytes) -> bytes:
    return icrc(packet).to_bytes(4, "little")
