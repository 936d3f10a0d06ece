"""Adders shallow in 6-input LUTs.

Yosys lowers ``a + b`` to a ripple of carries, and ABC9 (docs/fpga.md) does not rebuild it
into a tree: a 64-bit sum maps 8 LUT levels deep, a 32-bit one 7. Spelled as a parallel
prefix of (generate, propagate) pairs, the same sum maps 5 deep at 64 bits and 4 at 32.
"""
from amaranth import *

__all__ = ["lookahead_sum"]


def _join(low, high):
    """The (generate, propagate) pair of two adjacent bit groups, ``low`` below ``high``."""
    (g_low, p_low), (g_high, p_high) = low, high
    return g_high | p_high & g_low, p_high & p_low


def lookahead_sum(a, b, carry=0):
    """``a + b + carry``, one bit wider than the wider operand (the carry out on top).

    Every bit's carry comes from a Sklansky prefix over the bits below it: in step ``k``
    each bit whose group of ``2**k`` is the upper half of a group of ``2**(k+1)`` joins the
    lower half's total, so a carry passes ``log2(width)`` joins, not ``width``. Above the
    narrower operand the wider one only takes the carry: it and its increment are formed
    beside the low sum and the carry picks one (ABC9 maps a prefix over the zero bits
    deeper)."""
    a, b = Value.cast(a).as_unsigned(), Value.cast(b).as_unsigned()
    if len(a) < len(b):
        a, b = b, a
    low = _prefix_sum(a[:len(b)], b, Value.cast(carry))
    if len(a) == len(b):
        return low
    high = a[len(b):]
    return Cat(low[:len(b)], Mux(low[len(b)], _prefix_sum(high, C(0, len(high)), C(1, 1)),
                                 high))


def _prefix_sum(a, b, carry):
    # Position 0 stands for the carry in; position i + 1 for bit i.
    width = len(a)
    pairs = [(carry, C(0, 1))] + [(a[i] & b[i], a[i] ^ b[i]) for i in range(width)]
    size = 1
    while size < len(pairs):
        pairs = [_join(pairs[(i // size) * size - 1], pair) if (i // size) % 2 else pair
                 for i, pair in enumerate(pairs)]
        size *= 2
    return Cat(*(a[i] ^ b[i] ^ pairs[i][0] for i in range(width)), pairs[width][0])
