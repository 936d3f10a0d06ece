"""The simulator's reduction XOR after :func:`tb.pysim_parity.install`: the parity of every
bit of its operand, signed or not, at widths around Python's word sizes."""
import random

import pytest
from amaranth.hdl import Module, Signal, signed
from amaranth.sim import Simulator

from tb.pysim_parity import install


@pytest.mark.parametrize("shape", [1, 7, 63, 64, 65, 512, signed(9), signed(130)])
def test_reduction_xor_is_the_parity(shape):
    assert install(), "this Amaranth's simulator has no _RHSValueCompiler: redo tb/pysim_parity.py"
    operand, parity, low_parity = Signal(shape), Signal(), Signal()
    m = Module()
    m.d.comb += [parity.eq(operand.xor()), low_parity.eq(operand[:-1].xor())]
    width = len(operand)
    rng = random.Random(width)
    values = [0, 1, (1 << width) - 1, 1 << (width - 1)] + [rng.getrandbits(width) for _ in range(40)]

    async def testbench(ctx):
        for raw in values:
            value = raw - (raw >> (width - 1) << width) if operand.shape().signed else raw
            ctx.set(operand, value)
            assert ctx.get(parity) == bin(raw).count("1") % 2, (shape, raw)
            assert ctx.get(low_parity) == bin(raw & ((1 << (width - 1)) - 1)).count("1") % 2

    sim = Simulator(m)
    sim.add_testbench(testbench)
    sim.run()
