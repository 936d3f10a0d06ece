"""hdl.arith.lookahead_sum against Python's sum, in Amaranth's simulator: every operand
pair of small widths (equal and unequal, with and without the carry in), random ones at
the widths the NIC uses, and an operand without bits."""
import itertools
import random

import pytest
from amaranth import Module, Signal
from amaranth.sim import Simulator

from hdl.arith import lookahead_sum


def check(width_a, width_b, pairs):
    a, b, carry = Signal(width_a), Signal(width_b), Signal()
    total = Signal(max(width_a, width_b) + 1)
    m = Module()
    m.d.comb += total.eq(lookahead_sum(a, b, carry))

    async def testbench(ctx):
        for x, y, c in pairs:
            ctx.set(a, x)
            ctx.set(b, y)
            ctx.set(carry, c)
            assert ctx.get(total) == x + y + c, (width_a, width_b, x, y, c)

    sim = Simulator(m)
    sim.add_testbench(testbench)
    sim.run()


@pytest.mark.parametrize("width_a,width_b", [(1, 1), (4, 4), (5, 3), (2, 6), (7, 1)])
def test_exhaustive(width_a, width_b):
    check(width_a, width_b, itertools.product(range(1 << width_a), range(1 << width_b), (0, 1)))


@pytest.mark.parametrize("width_a,width_b", [(64, 64), (64, 32), (60, 16), (32, 13), (52, 1)])
def test_random(width_a, width_b):
    rng = random.Random(width_a * 100 + width_b)
    edges = [0, 1, (1 << width_a) - 1]
    pairs = [(rng.choice(edges + [rng.randrange(1 << width_a)] * 3),
              rng.choice([0, 1, (1 << width_b) - 1, rng.randrange(1 << width_b)]),
              rng.randrange(2)) for _ in range(2000)]
    check(width_a, width_b, pairs)


def test_no_bits():
    """An operand of no bits is 0: the DmaWriter's next 4 KiB line at 12 address bits."""
    assert lookahead_sum(Signal(0), 1).shape().width == 2
    check(0, 3, [(0, y, c) for y in range(8) for c in (0, 1)])
