"""Building and parsing whole InfiniBand data packets.

A packet here is LRH .. ICRC (what travels inside a block); `wire_packet` appends the VCRC
(what travels on a link). Headers are big-endian, the payload is padded with zeros to a
4-byte multiple (BTH.PadCnt says how many), ICRC and VCRC are least-significant byte first.
"""

import random
from dataclasses import dataclass, replace

from models.crc import GRH_SIZE, icrc, icrc_bytes, vcrc, vcrc_bytes
from models.ib import (BTH, LNH_IBA_GLOBAL, LNH_IBA_LOCAL, LRH, MASKED_ATOMICS, Opcode,
                       carries_payload, extension_headers)

CREDIT_BLOCK_BYTES = 64
ICRC_SIZE = 4
VCRC_SIZE = 2
MAX_PKTLEN_WORDS = (1 << 11) - 1


SEND_ONLY_OVERHEAD = 8 + 12 + ICRC_SIZE + VCRC_SIZE   # LRH + BTH + ICRC + VCRC around a payload


def blocks(nbytes: int) -> int:
    """Credit blocks (64 B) that `nbytes` occupy, rounded up."""
    return -(-nbytes // CREDIT_BLOCK_BYTES)


def wire_beats(nbytes: int, width: int) -> int:
    """Beats a packet of `nbytes` wire bytes (LRH .. VCRC) takes on a `width`-byte wire."""
    return -(-nbytes // width)


def stored_beats(nbytes: int, width: int) -> int:
    """Beats it takes in a receive buffer (LRH .. ICRC, the VCRC stripped)."""
    return -(-(nbytes - VCRC_SIZE) // width)


def send_only_wire_bytes(payload: int) -> int:
    """Wire bytes of a SEND_ONLY packet (LRH, BTH, payload padded to 4, ICRC, VCRC)."""
    return SEND_ONLY_OVERHEAD + payload + (-payload % 4)


def _pad_count(payload_len: int) -> int:
    return -payload_len % 4


def build_packet(*, bth: BTH, ext=(), payload: bytes = b"", lrh: LRH | None = None,
                 grh: bytes | None = None, vl: int = 0, lver: int = 0, sl: int = 0,
                 dlid: int = 0, slid: int = 0) -> bytes:
    """LRH .. ICRC with LRH.PktLen, LRH.LNH, BTH.PadCnt and the ICRC filled in.

    Give either `lrh` (its pktlen/lnh are overwritten) or the LRH fields as keywords.
    `ext` must be the extension headers `bth.opcode` calls for, in order.
    """
    expected = extension_headers(bth.opcode)
    if tuple(type(header) for header in ext) != expected:
        raise ValueError(f"opcode {bth.opcode:#04x} needs extension headers "
                         f"{[cls.__name__ for cls in expected]}, got {[type(h).__name__ for h in ext]}")
    if payload and not carries_payload(bth.opcode):
        raise ValueError(f"opcode {Opcode(bth.opcode).name} carries no payload")
    if grh is not None and len(grh) != GRH_SIZE:
        raise ValueError(f"GRH must be {GRH_SIZE} bytes, got {len(grh)}")

    padcnt = _pad_count(len(payload))
    transport = (replace(bth, padcnt=padcnt).pack()
                 + b"".join(header.pack() for header in ext)
                 + payload + bytes(padcnt))
    grh_bytes = grh or b""
    pktlen = (LRH.SIZE + len(grh_bytes) + len(transport) + ICRC_SIZE) // 4
    if pktlen > MAX_PKTLEN_WORDS:
        raise ValueError(f"packet of {pktlen} words exceeds LRH.PktLen's {MAX_PKTLEN_WORDS}")
    if lrh is None:
        lrh = LRH(vl=vl, lver=lver, sl=sl, dlid=dlid, slid=slid)
    lnh = LNH_IBA_GLOBAL if grh is not None else LNH_IBA_LOCAL
    header = replace(lrh, pktlen=pktlen, lnh=lnh).pack()
    packet = header + grh_bytes + transport
    return packet + icrc_bytes(packet)


def wire_packet(packet: bytes) -> bytes:
    """`packet` (LRH .. ICRC) with its VCRC appended, as it goes on a link."""
    return packet + vcrc_bytes(packet)


@dataclass(frozen=True)
class ParsedPacket:
    lrh: LRH
    grh: bytes | None
    bth: BTH
    ext: tuple
    payload: bytes  # without pad
    icrc_ok: bool
    vcrc_ok: bool | None  # None when the buffer had no VCRC


def parse_packet(buf: bytes) -> ParsedPacket:
    """Parse LRH .. ICRC, or LRH .. VCRC: LRH.PktLen tells which one `buf` holds.

    Raises ValueError on a malformed packet (length disagreeing with PktLen, headers that
    do not fit, unsupported LNH or opcode); CRC errors are reported, not raised.
    """
    buf = bytes(buf)
    lrh = LRH.unpack(buf)
    packet_len = lrh.pktlen * 4
    if len(buf) == packet_len:
        vcrc_ok = None
    elif len(buf) == packet_len + VCRC_SIZE:
        vcrc_ok = int.from_bytes(buf[packet_len:], "little") == vcrc(buf[:packet_len])
    else:
        raise ValueError(f"LRH.PktLen says {packet_len} bytes (+2 with VCRC), buffer has {len(buf)}")

    if lrh.lnh not in (LNH_IBA_LOCAL, LNH_IBA_GLOBAL):
        raise ValueError(f"LNH {lrh.lnh:#04b}: only IBA transport packets are supported")
    offset = LRH.SIZE
    grh = None
    if lrh.lnh == LNH_IBA_GLOBAL:
        grh = buf[offset : offset + GRH_SIZE]
        offset += GRH_SIZE
    body_end = packet_len - ICRC_SIZE

    bth = BTH.unpack(buf[offset:body_end])
    offset += BTH.SIZE
    ext = []
    for header_class in extension_headers(bth.opcode):
        ext.append(header_class.unpack(buf[offset:body_end]))
        offset += header_class.SIZE
    payload_end = body_end - bth.padcnt
    if payload_end < offset:
        raise ValueError(f"PadCnt {bth.padcnt} runs into the headers")
    return ParsedPacket(
        lrh=lrh, grh=grh, bth=bth, ext=tuple(ext),
        payload=buf[offset:payload_end],
        icrc_ok=int.from_bytes(buf[body_end:packet_len], "little") == icrc(buf[:body_end]),
        vcrc_ok=vcrc_ok,
    )


def _random_fields(rng: random.Random, header_class, **fixed):
    values = {name: rng.getrandbits(bits) for name, bits in header_class.field_widths().items()}
    return header_class(**{**values, **fixed})


def random_packet(rng: random.Random, *, payload_len: int, vl: int = 0,
                  opcode: int | None = None, dlid: int | None = None, slid: int | None = None,
                  destqp: int | None = None, psn: int | None = None) -> bytes:
    """A random RC packet (LRH .. ICRC) with the extension headers its opcode needs.

    Fields left as None are random; the VL defaults to data VL 0 because a fabric may have
    only one. Without an `opcode`, one that can carry `payload_len` bytes is drawn.
    Use `wire_packet` to add the VCRC.
    """
    if opcode is None:
        # RC's own opcodes only: the masked atomics are this project's vendor extension
        candidates = [op for op in Opcode if op not in MASKED_ATOMICS
                      and (payload_len == 0 or carries_payload(op))]
        opcode = rng.choice(candidates)

    def pick(value, bits):
        return rng.getrandbits(bits) if value is None else value

    lrh = LRH(vl=vl, lver=0, sl=rng.getrandbits(4), dlid=pick(dlid, 16), slid=pick(slid, 16))
    bth = _random_fields(rng, BTH, opcode=opcode, tver=0, resv8a=0,
                         destqp=pick(destqp, 24), psn=pick(psn, 24))
    ext = tuple(_random_fields(rng, header_class) for header_class in extension_headers(opcode))
    return build_packet(lrh=lrh, bth=bth, ext=ext, payload=rng.randbytes(payload_len))
