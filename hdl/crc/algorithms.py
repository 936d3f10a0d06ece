"""The CRC algorithms of the InfiniBand wire format, as ``amaranth.lib.crc`` algorithms.

Both are bit-reflected, so they process each byte least-significant bit first
and their result goes on the wire least-significant byte first.
"""
from amaranth.lib import crc

__all__ = ["VCRC", "ICRC", "LPCRC"]

# Variant CRC: per hop, over LRH .. end of ICRC.
VCRC = crc.Algorithm(crc_width=16, polynomial=0x100B, initial_crc=0xFFFF,
                     reflect_input=True, reflect_output=True, xor_output=0xFFFF)

# Invariant CRC: end to end, over LRH .. end of pad with the variant fields set to ones.
ICRC = crc.catalog.CRC32_ETHERNET

# Link-packet CRC of a flow-control packet: the VCRC algorithm over its first 4 bytes.
LPCRC = VCRC
