"""The depth-built arithmetic against Python integers, in Amaranth's simulator:
``hdl.arith.lookahead_sum`` (every operand pair of up to 5 bits with each carry in, and
random and edge operands at the widths the NIC uses).
"""
import itertools
import random

import pytest
from amaranth.hdl import Module, Signal
from amaranth.sim import Simulator

from hdl.arith import lookahead_sum


def run_comb(m, testbench):
    sim = Simulator(m)
    sim.add_testbench(testbench)
    sim.run()


def check_sums(width_a, width_b, cases, carry):
    """``carry``: None for a carry-in signal (each case's third value), else a constant."""
    m = Module()
    a, b, c = Signal(width_a), Signal(width_b), Signal()
    total = lookahead_sum(m, a, b, c if carry is None else carry)
    assert len(total) == max(width_a, width_b) + 1

    async def testbench(ctx):
        for x, y, z in cases:
            ctx.set(a, x)
            ctx.set(b, y)
            ctx.set(c, z)
            want = x + y + (z if carry is None else carry)
            assert ctx.get(total) == want, (width_a, width_b, x, y, z, ctx.get(total))

    run_comb(m, testbench)


@pytest.mark.parametrize("carry", [None, 0, 1])
def test_lookahead_exhaustive(carry):
    for width_a, width_b in itertools.product(range(1, 6), repeat=2):
        check_sums(width_a, width_b,
                   itertools.product(range(1 << width_a), range(1 << width_b), (0, 1)), carry)


@pytest.mark.parametrize("width", [7, 11, 13, 32, 52, 64])
def test_lookahead_wide(width):
    rng = random.Random(width)
    top = (1 << width) - 1
    cases = [(rng.getrandbits(width), rng.getrandbits(width), rng.getrandbits(1))
             for _ in range(400)]
    cases += [(top, 0, 1), (top, top, 1), (0, 0, 0), (top, 1, 0), (1 << (width - 1), top, 0)]
    # Carries that run through every group: x + (2^k - x) for each k.
    cases += [(x, (1 << k) - x, 0) for k in range(1, width) for x in (1, (1 << k) - 1)]
    check_sums(width, width, cases, None)
    check_sums(width, width // 2, [(x, y & ((1 << width // 2) - 1), z) for x, y, z in cases], None)

