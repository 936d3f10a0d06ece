"""InfiniBand header layouts and constants for the gateware.

IB headers are big-endian on the wire (IBA vol. 1 ch. 7 and 9: the first field
listed is in the most-significant bits of the first byte), while our beats
carry byte 0 of a packet in the low byte lane and ``lib.data`` structs pack
their first field into the least-significant bits. The two orders are
reconciled in one place: every layout here describes a header *read as one
big-endian integer* (first wire byte most significant), so its fields are
listed from the last (least-significant) field of the header to the first,
and :func:`from_wire` / :func:`to_wire` byte-reverse between that integer and
the wire-order bytes of a beat::

    lrh = from_wire(LRH, beat.data[:8 * LRH_BYTES])
    m.d.comb += dlid.eq(lrh.dlid)

The field names are those of the Python codecs in :mod:`models.ib`; reserved
fields are named ``rsvd<bits>`` as IBA names them (``Rsv5`` ...), except
BTH's ``resv8a``, which the ICRC masks and so keeps its IBA name. The
flow-control packet's LPCRC is the one little-endian field: like every IBA
CRC it goes on the wire least-significant byte first, which the layout
records so that the helpers keep its bytes in order.
"""
from amaranth.hdl import Cat, Signal, Value
from amaranth.lib import data, enum

from hdl.arith import lookahead_sum

__all__ = [
    "HeaderLayout", "from_wire", "to_wire", "iba_local_headers",
    "LRH", "GRH", "BTH", "RETH", "AETH", "ATOMIC_ETH", "MASKED_ATOMIC_ETH", "ATOMIC_ACK_ETH",
    "IMMDT",
    "FLOW_CONTROL", "FlowControlOp",
    "LNH_RAW", "LNH_IP_NON_IBA", "LNH_IBA_LOCAL", "LNH_IBA_GLOBAL",
    "LRH_BYTES", "GRH_BYTES", "BTH_BYTES", "RETH_BYTES", "AETH_BYTES", "ATOMIC_ETH_BYTES",
    "MASKED_ATOMIC_ETH_BYTES",
    "ATOMIC_ACK_ETH_BYTES", "IMMDT_BYTES", "FLOW_CONTROL_BYTES", "ICRC_BYTES", "VCRC_BYTES",
    "LPCRC_BYTES", "VL15", "CREDIT_BLOCK_BYTES", "PKTLEN_WORD_BYTES",
]


class HeaderLayout(data.StructLayout):
    """A struct layout over a header read as one big-endian integer.

    ``fields`` go from the least-significant (last on the wire) to the most
    significant (first on the wire). ``little_endian`` names the byte-aligned
    fields whose bytes go on the wire least-significant first (CRCs).
    """
    def __init__(self, fields, *, little_endian=()):
        super().__init__(fields)
        if self.size % 8:
            raise ValueError(f"A header is a whole number of bytes, not {self.size} bits")
        for name in little_endian:
            field = self[name]
            if field.offset % 8 or field.width % 8:
                raise ValueError(f"Little-endian field {name!r} must be byte-aligned")
        self.little_endian = frozenset(little_endian)

    @property
    def size_bytes(self):
        return self.size // 8

    def wire_byte_order(self):
        """For each byte of the struct value (least-significant first), its index on the wire."""
        order = [self.size_bytes - 1 - index for index in range(self.size_bytes)]
        for name in self.little_endian:
            field = self[name]
            first, last = field.offset // 8, (field.offset + field.width) // 8 - 1
            for index in range(first, last + 1):
                order[index] = self.size_bytes - 1 - last + (index - first)
        return order


def _check_width(layout, value):
    value = Value.cast(value)
    if len(value) != layout.size:
        raise ValueError(f"{layout.size_bytes}-byte header needs a {layout.size}-bit value, not {len(value)} bits")
    return value


def from_wire(layout, value):
    """View the wire-order bytes ``value`` (byte 0 in bits 7..0) as a ``layout`` header."""
    value = _check_width(layout, value)
    wire_bytes = [value[8 * index:8 * index + 8] for index in range(layout.size_bytes)]
    return layout(Cat(wire_bytes[index] for index in layout.wire_byte_order()))


def to_wire(layout, view):
    """The wire-order bytes (byte 0 in bits 7..0) of the ``layout`` header ``view``."""
    value = _check_width(layout, view)
    struct_bytes = {wire: value[8 * index:8 * index + 8]
                    for index, wire in enumerate(layout.wire_byte_order())}
    return Cat(struct_bytes[wire] for wire in range(layout.size_bytes))


class FlowControlOp(enum.Enum, shape=4):
    NORMAL = 0
    INIT = 1


# Local Route Header: VL LVer | SL rsvd2 LNH | DLID | rsvd5 PktLen | SLID.
LRH = HeaderLayout({
    "slid": 16, "pktlen": 11, "rsvd5": 5, "dlid": 16,
    "lnh": 2, "rsvd2": 2, "sl": 4, "lver": 4, "vl": 4,
})

# Global Route Header: IPVer TClass FlowLabel | PayLen NxtHdr HopLmt | SGID | DGID.
GRH = HeaderLayout({
    "dgid": 128, "sgid": 128, "hoplmt": 8, "nxthdr": 8, "paylen": 16,
    "flowlabel": 20, "tclass": 8, "ipver": 4,
})

# Base Transport Header: OpCode | SE M PadCnt TVer | P_Key | resv8a | DestQP | AckReq rsvd7 | PSN.
BTH = HeaderLayout({
    "psn": 24, "rsvd7": 7, "ackreq": 1, "destqp": 24, "resv8a": 8,
    "pkey": 16, "tver": 4, "padcnt": 2, "m": 1, "se": 1, "opcode": 8,
})

RETH = HeaderLayout({"dmalen": 32, "rkey": 32, "va": 64})

AETH = HeaderLayout({"msn": 24, "syndrome": 8})

ATOMIC_ETH = HeaderLayout({"compare": 64, "swap_add": 64, "rkey": 32, "va": 64})
# This project's masked-atomic header: AtomicETH, then the masks (docs/nic-formats.md).
MASKED_ATOMIC_ETH = HeaderLayout({"compare_mask": 64, "swap_mask": 64, "compare": 64,
                                  "swap_add": 64, "rkey": 32, "va": 64})

ATOMIC_ACK_ETH = HeaderLayout({"orig": 64})

IMMDT = HeaderLayout({"imm": 32})

# Link flow-control packet: Op FCTBS | VL FCCL | LPCRC (VCRC algorithm over the first 4 bytes).
FLOW_CONTROL = HeaderLayout({
    "lpcrc": 16, "fccl": 12, "vl": 4, "fctbs": 12, "op": FlowControlOp,
}, little_endian=("lpcrc",))

# LRH.LNH: what follows the LRH.
LNH_RAW = 0b00
LNH_IP_NON_IBA = 0b01
LNH_IBA_LOCAL = 0b10   # BTH
LNH_IBA_GLOBAL = 0b11  # GRH, then BTH

LRH_BYTES = LRH.size_bytes
GRH_BYTES = GRH.size_bytes
BTH_BYTES = BTH.size_bytes
RETH_BYTES = RETH.size_bytes
AETH_BYTES = AETH.size_bytes
ATOMIC_ETH_BYTES = ATOMIC_ETH.size_bytes
MASKED_ATOMIC_ETH_BYTES = MASKED_ATOMIC_ETH.size_bytes
ATOMIC_ACK_ETH_BYTES = ATOMIC_ACK_ETH.size_bytes
IMMDT_BYTES = IMMDT.size_bytes
FLOW_CONTROL_BYTES = FLOW_CONTROL.size_bytes
ICRC_BYTES = 4
VCRC_BYTES = 2
LPCRC_BYTES = 2

VL15 = 15                 # subnet management VL: no flow control, never credited
CREDIT_BLOCK_BYTES = 64   # one flow-control credit
PKTLEN_WORD_BYTES = 4     # LRH.PktLen counts these from the LRH through the ICRC


def iba_local_headers(m, *, vl, sl, dlid, slid, opcode, pkey, destqp, psn, header_bytes,
                      payload_bytes, se=0, ackreq=0):
    """The wire bytes of the LRH and BTH of an IBA-local packet (LNH = BTH, no GRH), driven
    combinationally in ``m``: ``header_bytes`` from the LRH through the extension headers,
    ``payload_bytes`` padded to 4 bytes (BTH.PadCnt), LRH.PktLen counting through the
    ICRC."""
    lrh = Signal(LRH)
    bth = Signal(BTH)
    pad = Signal(2)
    m.d.comb += [
        pad.eq(-payload_bytes),
        lrh.vl.eq(vl), lrh.sl.eq(sl), lrh.lnh.eq(LNH_IBA_LOCAL),
        lrh.dlid.eq(dlid), lrh.slid.eq(slid),
        # (header_bytes + payload_bytes + pad + ICRC_BYTES) // 4 as one lookahead sum: the
        # padded payload and the ICRC are whole words.
        lrh.pktlen.eq(lookahead_sum(m, (header_bytes + ICRC_BYTES) // PKTLEN_WORD_BYTES,
                                    payload_bytes[2:], payload_bytes[:2] != 0, name="pktlen")),
        bth.opcode.eq(opcode), bth.se.eq(se), bth.padcnt.eq(pad), bth.pkey.eq(pkey),
        bth.destqp.eq(destqp), bth.ackreq.eq(ackreq), bth.psn.eq(psn),
    ]
    return Cat(to_wire(LRH, lrh), to_wire(BTH, bth))
