"""The switch's tables (DLID to output port, SL to VL) and its forwarding decision on a
packet's bytes, without timing."""

from __future__ import annotations

from models.crc import vcrc_bytes
from models.ib import LRH
from models.packet import parse_packet

__all__ = ["DROP_REASONS", "ForwardingTable", "SlToVl", "forward", "with_vl"]


class ForwardingTable:
    """DLID -> output port (linear forwarding table). Unknown DLIDs look up as None."""

    def __init__(self, entries=None):
        self.entries: dict[int, int] = {}
        for dlid, port in dict(entries or {}).items():
            self.set(dlid, port)

    @classmethod
    def identity(cls, ports: int, base_lid: int = 1) -> "ForwardingTable":
        """LID ``base_lid + p`` reaches port p."""
        return cls({base_lid + p: p for p in range(ports)})

    def set(self, dlid: int, port: int) -> None:
        if not 0 <= dlid < 0x10000:
            raise ValueError(f"DLID {dlid!r} is not 16 bits")
        self.entries[dlid] = port

    def remove(self, dlid: int) -> None:
        self.entries.pop(dlid, None)

    def lookup(self, dlid: int):
        return self.entries.get(dlid)

    def lid_of(self, port: int) -> int:
        """The lowest DLID that reaches ``port`` (for traffic generators)."""
        lids = [lid for lid, p in self.entries.items() if p == port]
        if not lids:
            raise KeyError(f"no DLID reaches port {port}")
        return min(lids)


class SlToVl:
    """The 16-entry SL-to-VL table; default SL s -> VL s mod ``num_vls``."""

    def __init__(self, num_vls: int = 2, table=None):
        self.table = list(table) if table is not None else [sl % num_vls for sl in range(16)]
        if len(self.table) != 16 or not all(0 <= v <= 15 for v in self.table):
            raise ValueError("SL-to-VL table needs 16 entries of 0..15")

    def lookup(self, sl: int) -> int:
        return self.table[sl]

    def __setitem__(self, sl, vl):
        if not 0 <= vl <= 15:
            raise ValueError("VL is 4 bits")
        self.table[sl] = vl




DROP_REASONS = ("unknown_dlid", "invalid_vl", "too_long")


def with_vl(packet: bytes, vl: int) -> bytes:
    """``packet`` with the LRH VL nibble set to ``vl``; the ICRC masks LRH.VL so it stays
    valid, a trailing VCRC (``len == PktLen * 4 + 2``) is recomputed as a hop does."""
    out = bytearray(packet)
    out[0] = (vl << 4) | (out[0] & 0x0F)
    words = LRH.unpack(bytes(out[:LRH.SIZE])).pktlen
    if words and len(out) == 4 * words + 2:
        out[-2:] = vcrc_bytes(bytes(out[:-2]))
    return bytes(out)


def forward(packet, table: ForwardingTable, sl_to_vl: SlToVl, num_vls: int, *,
            ports: int | None = None, mtu: int | None = None):
    """The switch's forwarding decision on one packet's bytes, no timing.

    ``packet``: LRH .. ICRC, or LRH .. VCRC as on a wire. DLID = LRH bytes 2-3
    (big-endian), SL = high nibble of LRH byte 1, incoming VL = high nibble of byte 0.
    Returns ``(out_port, out_vl, out_bytes)``, ``out_vl = sl_to_vl[SL]`` and ``out_bytes``
    the packet with the LRH VL nibble replaced by ``out_vl`` (the ICRC does not cover
    LRH.VL, so it stays valid; a VCRC, if present, is recomputed), or a drop reason, in
    this order of precedence:

    - ``"too_long"``: only with ``mtu``: the payload (:func:`models.packet.parse_packet`)
      is longer than ``mtu`` bytes;
    - ``"invalid_vl"``: the incoming LRH VL is ``>= num_vls`` (VL15 included), or the SL
      maps to VL 15 or to a VL ``>= num_vls``;
    - ``"unknown_dlid"``: the DLID is not in ``table`` (or, with ``ports``, names a port
      ``>= ports``).
    """
    packet = bytes(packet)
    if len(packet) < LRH.SIZE:
        raise ValueError(f"a packet needs at least the {LRH.SIZE}-byte LRH, got {len(packet)}")
    lrh = LRH.unpack(packet[:LRH.SIZE])
    if mtu is not None and len(parse_packet(packet).payload) > mtu:
        return "too_long"
    out_vl = sl_to_vl.lookup(lrh.sl)
    if lrh.vl >= num_vls or out_vl == 15 or out_vl >= num_vls:
        return "invalid_vl"
    out_port = table.lookup(lrh.dlid)
    if out_port is None or (ports is not None and not 0 <= out_port < ports):
        return "unknown_dlid"
    return out_port, out_vl, with_vl(packet, out_vl)
