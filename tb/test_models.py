"""Tests of the pure-Python golden models (no simulator)."""

import binascii
import random

import pytest

from models import crc


def bitwise_reflected_crc(data: bytes, poly: int, width: int) -> int:
    """Bit-serial CRC written the long way (MSB-first poly, reflecting each byte) as a cross-check."""
    top = 1 << (width - 1)
    mask = (1 << width) - 1
    register = mask
    for byte in data:
        for bit in range(8):  # reflected input: LSB of each byte first
            feedback = bool(register & top) ^ bool((byte >> bit) & 1)
            register = (register << 1) & mask
            if feedback:
                register ^= poly
    reflected = int(f"{register:0{width}b}"[::-1], 2)
    return reflected ^ mask


def test_crc32_known_answer():
    assert crc.crc32(b"123456789") == 0xCBF43926


def test_crc32_matches_zlib():
    rng = random.Random(1)
    for length in range(0, 200, 7):
        data = rng.randbytes(length)
        assert crc.crc32(data) == binascii.crc32(data)


def test_vcrc_matches_bitwise_implementation():
    rng = random.Random(2)
    for length in range(0, 300, 5):
        data = rng.randbytes(length)
        assert crc.vcrc(data) == bitwise_reflected_crc(data, crc.VCRC_POLY, 16)
    assert crc.crc32(b"123456789") == bitwise_reflected_crc(b"123456789", crc.ICRC_POLY, 32)


def test_crc_bytes_go_least_significant_first():
    data = b"123456789"
    assert crc.vcrc_bytes(data) == bytes([crc.vcrc(data) & 0xFF, crc.vcrc(data) >> 8])
    assert crc.icrc_bytes(bytes(20)) == crc.icrc(bytes(20)).to_bytes(4, "little")


def test_icrc_ignores_variant_fields():
    rng = random.Random(3)
    lrh_bth = bytearray(rng.randbytes(8 + 12 + 16))
    lrh_bth[1] = (lrh_bth[1] & ~0b11) | crc.LNH_BTH
    reference = crc.icrc(bytes(lrh_bth))
    changed = bytearray(lrh_bth)
    changed[0] ^= 0xF0  # VL
    changed[8 + 4] ^= 0xFF  # resv8a
    assert crc.icrc(bytes(changed)) == reference
    changed[8 + 5] ^= 0x01  # DestQP is invariant
    assert crc.icrc(bytes(changed)) != reference


def test_icrc_ignores_grh_variant_fields():
    rng = random.Random(4)
    packet = bytearray(rng.randbytes(8 + 40 + 12 + 8))
    packet[1] = (packet[1] & ~0b11) | crc.LNH_GRH
    reference = crc.icrc(bytes(packet))
    changed = bytearray(packet)
    changed[8] ^= 0x0F  # TClass high nibble
    changed[9:12] = bytes(b ^ 0xFF for b in changed[9:12])  # TClass low nibble, FlowLabel
    changed[8 + 7] ^= 0xFF  # HopLmt
    changed[48 + 4] ^= 0xFF  # resv8a, BTH after the GRH
    assert crc.icrc(bytes(changed)) == reference
    changed[8] ^= 0x10  # IPVer is invariant
    assert crc.icrc(bytes(changed)) != reference
