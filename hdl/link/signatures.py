"""Beat-level interfaces shared by the link, switch and NIC blocks.

A packet travels as beats of ``width`` bytes, byte 0 of the packet in the low
byte lane (bits 7..0), as AXI-Stream does. ``count`` is the number of valid
bytes on the ``end`` beat (``width`` on every other beat).

Inside a block packets are ``lib.stream`` streams of :class:`BeatLayout`
carrying LRH..ICRC (no VCRC). On the wire (:class:`WireSignature`) there is no
ready: a cable cannot push back. The link transmitter appends the VCRC, the
receiver checks and strips it.
"""
from amaranth import Cat
from amaranth.lib import data, enum, wiring
from amaranth.lib.wiring import In, Out

__all__ = [
    "BeatLayout", "WireSignature", "FlowControlSignature", "StoreSignature", "RouteSignature",
    "StoredBeatLayout", "vl_index", "LinkState", "FlowControlOp", "check_width", "check_mtu",
    "max_wire_bytes", "blocks_of", "lrh_pktlen", "lrh_wire_bytes", "pktlen_wire_bytes",
    "FCCL_BITS", "BLOCK_BYTES", "VCRC_BYTES", "ICRC_BYTES", "MAX_HEADER_BYTES",
]


def vl_index(num_vls):
    """Shape of a VL number among ``num_vls`` data VLs: at least one bit, so that a
    one-VL design still has a real signal (a zero-width one becomes ``[-1:0]`` in Verilog)."""
    return range(max(num_vls, 2))


def check_width(width):
    if not isinstance(width, int) or width < 8 or width > 256 or width & (width - 1):
        raise ValueError(f"Beat width must be a power of two from 8 to 256 bytes, not {width!r}")


class BeatLayout(data.StructLayout):
    """One beat of a packet inside a block.

    ``end_bad`` on the end beat marks a packet that a cut-through stage found
    corrupt after it had already started forwarding it (IBA's EBP delimiter).
    """
    def __init__(self, width):
        check_width(width)
        super().__init__({
            "data": 8 * width,
            "start": 1,
            "end": 1,
            "count": range(width + 1),
            "end_bad": 1,
        })


class WireSignature(wiring.Signature):
    """One direction of a link, seen from the sending end.

    ``link`` marks a link (flow-control) packet rather than a data packet, as
    IBA's SLP/SDP start delimiters do on a real lane.
    """
    def __init__(self, width):
        check_width(width)
        self.width = width
        super().__init__({
            "valid": Out(1),
            "data": Out(8 * width),
            "start": Out(1),
            "end": Out(1),
            "count": Out(range(width + 1)),
            "end_bad": Out(1),
            "link": Out(1),
        })


class LinkState(enum.Enum, shape=2):
    """Link flow-control state of a port (IBA LinkInitialize / LinkArm / LinkActive).

    INIT: send flow-control init packets (Op 1), accept no data.
    ARMED: the peer's init was heard and ours sent; send normal flow-control
    packets and no data (the peer may not have heard us yet), but take the
    peer's data: it sends only once it heard us.
    ACTIVE: the peer's normal flow-control packet (or data) was heard; data flows.
    """
    INIT = 0
    ARMED = 1
    ACTIVE = 2


class FlowControlOp(enum.Enum, shape=4):
    NORMAL = 0
    INIT = 1


FCCL_BITS = 12      # FCTBS, FCCL and ABR are 12-bit counters of 64-byte blocks
BLOCK_BYTES = 64
VCRC_BYTES = 2
# Largest headers a data packet can carry: LRH + GRH + BTH + AtomicETH (RETH + ImmDt is smaller).
MAX_HEADER_BYTES = 8 + 40 + 12 + 28
ICRC_BYTES = 4


def max_wire_bytes(mtu):
    """Longest packet on the wire (LRH .. VCRC) for a path MTU."""
    return MAX_HEADER_BYTES + mtu + ICRC_BYTES + VCRC_BYTES


def check_mtu(mtu):
    if mtu not in (256, 512, 1024, 2048, 4096):
        raise ValueError(f"MTU must be one of the IBA MTUs 256, 512, 1024, 2048, 4096, not {mtu!r}")


def blocks_of(nbytes):
    """Credit blocks a packet of ``nbytes`` (LRH .. VCRC) occupies; works on ints and Values."""
    return (nbytes + BLOCK_BYTES - 1) >> 6


def lrh_pktlen(beat_data):
    """LRH.PktLen of the start beat: 4-byte words, LRH .. ICRC (11 bits)."""
    # LRH bytes 4..5: rsvd(5) PktLen(11), big-endian.
    return Cat(beat_data[40:48], beat_data[32:35])


def lrh_wire_bytes(beat_data):
    """LRH.PktLen (4-byte words, LRH .. ICRC) of the start beat, as bytes on the wire incl. VCRC."""
    return pktlen_wire_bytes(lrh_pktlen(beat_data))


def pktlen_wire_bytes(pktlen):
    """A packet's bytes on the wire incl. VCRC, from its LRH.PktLen (4-byte words, LRH .. ICRC)."""
    return pktlen * 4 + VCRC_BYTES


class FlowControlSignature(wiring.Signature):
    """A flow-control packet's fields, as a receiver reports one and a transmitter takes one."""
    def __init__(self):
        super().__init__({
            "valid": Out(1),
            "op": Out(FlowControlOp),
            "vl": Out(4),
            "fctbs": Out(FCCL_BITS),
            "fccl": Out(FCCL_BITS),
        })


class StoredBeatLayout(data.StructLayout):
    """A beat as a receive buffer stores it: :class:`BeatLayout` without ``end_bad`` (a
    stored packet's verdict comes separately)."""
    def __init__(self, width):
        check_width(width)
        super().__init__({"data": 8 * width, "start": 1, "end": 1, "count": range(width + 1)})


class StoreSignature(wiring.Signature):
    """A link receiver's packet store, seen from the receiver (which writes it).

    Per cycle at most one beat (``write_*``, no backpressure: the credit protocol and
    ``room`` guarantee space) and at most one verdict (``verdict_*``: the packet in
    progress is complete, bad or good, and held ``verdict_blocks`` credit blocks). Every
    stored packet ends with a beat marked ``end``; its verdict may come with that beat
    or later, always before the next packet's start beat.

    The store answers with ``room[vl]`` (beats it can still take on that VL),
    ``freed_valid[vl]``/``freed_blocks[vl]`` (a packet of that VL left the store: its
    credit blocks are free again), and two strobes the receiver counts: ``discarded``
    (a packet known bad was dropped without being forwarded) and ``forwarded_bad`` (a
    packet that had started out cut-through turned out bad and left marked end-bad).
    """
    def __init__(self, width, num_vls, room_shape):
        super().__init__({
            "write_valid": Out(1),
            "write_vl": Out(vl_index(num_vls)),
            "write": Out(StoredBeatLayout(width)),
            "verdict_valid": Out(1),
            "verdict_vl": Out(vl_index(num_vls)),
            "verdict_bad": Out(1),
            "verdict_blocks": Out(FCCL_BITS),
            "room": In(room_shape).array(num_vls),
            "freed_valid": In(1).array(num_vls),
            "freed_blocks": In(FCCL_BITS).array(num_vls),
            "discarded": In(1),
            "forwarded_bad": In(1),
        })


class RouteSignature(wiring.Signature):
    """A routed receiver's question to the switch, seen from the receiver.

    ``lid`` and ``sl`` (the DLID and SL of the start beat on the receiver's wire input,
    one cycle before the receiver's checks see that beat) go to a synchronous
    forwarding-table lookup and SL-to-VL mapping, and ``pktlen`` (its LRH.PktLen) to the
    switch's count of the credit blocks it needs downstream;
    in the next cycle the switch answers for that start beat: ``unknown`` (the DLID has
    no valid entry) and ``no_vl`` (the packet's SL maps to no data VL). Either one
    drops the packet at its start.
    """
    def __init__(self):
        super().__init__({
            "lid": Out(16),
            "sl": Out(4),
            "pktlen": Out(11),
            "unknown": In(1),
            "no_vl": In(1),
        })
