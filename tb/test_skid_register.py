"""SkidRegister and tagged_input (hdl/prim/skid_register.py) in Amaranth's simulator: random
valid on its input and random ready on its output; a scoreboard checks every beat comes out
once, in order, from the cycle after it was taken at the earliest, and that ``i.ready`` and
``o`` depend on registers only (they do not change when the same cycle's ``i.valid``,
``i.payload`` or ``o.ready`` do); ``tagged_input``'s tags come out beside their beat."""
import random
from collections import deque

import pytest

from tb.amaranth_sim import simulate


@pytest.mark.parametrize("seed,p_valid,p_ready", [(1, 0.9, 0.9), (2, 0.5, 0.3), (3, 1.0, 0.6),
                                                  (4, 0.3, 1.0)])
def test_order_and_registered_handshake(seed, p_valid, p_ready):
    from hdl.prim.skid_register import SkidRegister
    dut = SkidRegister(8)
    rng = random.Random(seed)
    sent, got = deque(), []
    cycles = 2000

    async def testbench(ctx):
        taken_at, next_value = {}, 0
        for cycle in range(cycles + 20):
            # What the block shows before this cycle's inputs are set ...
            shown = (ctx.get(dut.i.ready), ctx.get(dut.o.valid), ctx.get(dut.o.payload))
            valid = cycle < cycles and rng.random() < p_valid
            ready = rng.random() < p_ready
            ctx.set(dut.i.valid, valid)
            ctx.set(dut.i.payload, next_value)
            ctx.set(dut.o.ready, ready)
            # ... does not change with them.
            assert (ctx.get(dut.i.ready), ctx.get(dut.o.valid), ctx.get(dut.o.payload)) == shown
            in_ready, out_valid, out_payload = shown
            if out_valid and ready:
                assert sent, f"cycle {cycle}: a beat out that never went in"
                expected = sent.popleft()
                assert out_payload == expected, (cycle, out_payload, expected)
                assert taken_at[expected] < cycle
                got.append(out_payload)
            if valid and in_ready:
                sent.append(next_value)
                taken_at[next_value] = cycle
                next_value = (next_value + 1) & 0xFF
            await ctx.tick()
        assert not sent, f"left undelivered: {list(sent)}"

    simulate(dut, testbench)
    assert len(got) > cycles * min(p_valid, p_ready) * 0.5


def test_full_rate():
    """Valid and ready every cycle: one beat per cycle, each the cycle after it went in."""
    from hdl.prim.skid_register import SkidRegister
    dut = SkidRegister(8)

    async def testbench(ctx):
        ctx.set(dut.o.ready, 1)
        ctx.set(dut.i.valid, 1)
        for cycle in range(50):
            ctx.set(dut.i.payload, cycle)
            assert ctx.get(dut.i.ready)
            if cycle:
                assert ctx.get(dut.o.valid) and ctx.get(dut.o.payload) == cycle - 1
            await ctx.tick()

    simulate(dut, testbench)


def test_tagged_input():
    """``tagged_input``: each beat comes out in order with its tags (functions of the beat,
    worked out as it entered) beside it; the source's ``ready`` is the register's, which
    does not change with the same cycle's input."""
    from amaranth import Module
    from amaranth.lib import stream, wiring
    from amaranth.lib.wiring import In, Out
    from hdl.prim.skid_register import tagged_input

    class Tagged(wiring.Component):
        i: In(stream.Signature(8))
        o: Out(stream.Signature(10))

        def elaborate(self, platform):
            m = Module()
            o = tagged_input(m, "input", self.i, odd=lambda beat: beat[0],
                             high=lambda beat: beat >= 0x80)
            m.d.comb += [self.o.valid.eq(o.valid), self.o.payload.eq(o.payload),
                         o.ready.eq(self.o.ready)]
            return m

    dut = Tagged()
    rng = random.Random(5)
    sent, got = deque(), []

    async def testbench(ctx):
        for cycle in range(1500):
            ready_before = ctx.get(dut.i.ready)
            valid, value = rng.random() < 0.7, rng.randrange(256)
            ctx.set(dut.i.valid, valid)
            ctx.set(dut.i.payload, value)
            ctx.set(dut.o.ready, rng.random() < 0.6)
            assert ctx.get(dut.i.ready) == ready_before
            if ctx.get(dut.o.valid) and ctx.get(dut.o.ready):
                word = ctx.get(dut.o.payload)
                beat, odd, high = word & 0xFF, word >> 8 & 1, word >> 9 & 1
                assert beat == sent.popleft(), cycle
                assert (odd, high) == (beat & 1, int(beat >= 0x80)), (cycle, beat)
                got.append(beat)
            if valid and ready_before:
                sent.append(value)
            await ctx.tick()
        ctx.set(dut.i.valid, 0)
        ctx.set(dut.o.ready, 1)
        for _ in range(3):
            if ctx.get(dut.o.valid):
                assert ctx.get(dut.o.payload) & 0xFF == sent.popleft()
            await ctx.tick()
        assert not sent, f"left undelivered: {list(sent)}"

    simulate(dut, testbench)
    assert len(got) > 500
