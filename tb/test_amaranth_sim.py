"""tb.amaranth_sim.Driver: a cycle's inputs applied together, in one step of the design."""
from amaranth import Elaboratable, Module, Signal
from amaranth.lib import data, enum

from tb.amaranth_sim import Driver, simulate


class Colour(enum.Enum, shape=2):
    NONE = 0
    RED = 1
    BLUE = 2


class Adder(Elaboratable):
    def __init__(self):
        self.a = Signal(4)
        self.b = Signal(8)
        self.colour = Signal(Colour)
        self.pair = Signal(data.StructLayout({"x": 3, "y": 5}))
        self.total = Signal(16)
        self.summed = Signal(16)

    def elaborate(self, platform):
        m = Module()
        m.d.comb += self.total.eq(self.a + self.b + self.colour.as_value()
                                  + self.pair.x + self.pair.y)
        m.d.sync += self.summed.eq(self.total)
        return m


def test_inputs_apply_together_and_only_when_changed():
    dut = Adder()

    async def testbench(ctx):
        drive = Driver()
        drive.set(dut.a, 3)
        drive.set(dut.b, 0x1FF)                 # wider than the port: only 8 bits are driven
        drive.set(dut.colour, Colour.BLUE)
        drive.set(dut.pair, {"x": 5, "y": 17})
        assert ctx.get(dut.total) == 0          # nothing applied before apply()
        drive.apply(ctx)
        assert ctx.get(dut.total) == 3 + 0xFF + 2 + 5 + 17
        await ctx.tick()
        assert ctx.get(dut.summed) == 3 + 0xFF + 2 + 5 + 17
        # A payload field is a fresh slice on every access: keyed by what it selects.
        drive.set(dut.pair.x, 5)                # unchanged: not applied again
        drive.set(dut.a, 4)
        drive.set(dut.a, 3)                     # back to the applied value: nothing pending
        drive.apply(ctx)
        assert ctx.get(dut.total) == 3 + 0xFF + 2 + 5 + 17
        drive.set(dut.pair.x, 1)
        drive.apply(ctx)
        assert ctx.get(dut.pair.x) == 1 and ctx.get(dut.pair.y) == 17
        assert ctx.get(dut.total) == 3 + 0xFF + 2 + 1 + 17

    simulate(dut, testbench)
