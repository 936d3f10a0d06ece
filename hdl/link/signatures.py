"""Beat-level interfaces shared by the link, switch and NIC blocks.

A packet travels as beats of ``width`` bytes, byte 0 of the packet in the low
byte lane (bits 7..0), as AXI-Stream does. ``count`` is the number of valid
bytes on the ``end`` beat (``width`` on every other beat).

Inside a block packets are ``lib.stream`` streams of :class:`BeatLayout`
carrying LRH..ICRC (no VCRC). On the wire (:class:`WireSignature`) there is no
ready: a cable cannot push back. The link transmitter appends the VCRC, the
receiver checks and strips it.
"""
from amaranth.lib import data, wiring
from amaranth.lib.wiring import Out

__all__ = ["BeatLayout", "WireSignature", "check_width"]


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
