"""The IBA credit rule as an Amaranth expression: the one copy the formal harnesses state it
from (docs/link.md, Credits; models.link holds it for the Python models)."""
from hdl.link.signatures import FCCL_BITS
from models.link import CREDIT_WINDOW

__all__ = ["CREDIT_WINDOW", "fits"]


def fits(limit, fctbs, blocks):
    """A packet of ``blocks`` may start: ``(limit - (fctbs + blocks)) mod 4096 <= 2048``."""
    return (limit - fctbs - blocks)[:FCCL_BITS] <= CREDIT_WINDOW
