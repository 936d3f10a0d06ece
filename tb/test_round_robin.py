"""The round robin every block uses (hdl/prim/round_robin.py) in Amaranth's simulator, checked
exhaustively against models.arbiters for up to 6 requests: every request vector from every
pointer, the mask after each pick, the mask at it and the pick's index; and the weighted round
robin's pick from every turn, with and without budget left."""
import pytest
from amaranth import Elaboratable, Module, Signal

from hdl.prim.round_robin import (mask_after, mask_at, next_mask, one_hot_index, round_robin_pick,
                                  turn_pick)
from models.arbiters import round_robin_pick as model_pick
from models.arbiters import turn_pick as model_turn_pick
from tb.amaranth_sim import simulate


class Harness(Elaboratable):
    def __init__(self, n):
        self.n = n
        self.requests = Signal(n)
        self.mask = Signal(n)
        self.pick = Signal(n)
        self.mask_after_pick = Signal(n)
        self.mask_at_pick = Signal(n)
        self.index = Signal(max(1, (n - 1).bit_length()))

    def elaborate(self, platform):
        m = Module()
        pick = round_robin_pick(m, self.requests, self.mask, name="rr")
        m.d.comb += [self.pick.eq(pick), self.mask_after_pick.eq(next_mask(pick)),
                     self.mask_at_pick.eq(mask_at(pick)), self.index.eq(one_hot_index(pick))]
        return m


def thermometer(pointer, n):
    return ((1 << n) - 1) ^ ((1 << pointer) - 1)


@pytest.mark.parametrize("n", range(1, 7))
def test_every_request_vector_from_every_pointer(n):
    dut = Harness(n)
    checked = []

    async def testbench(ctx):
        for pointer in range(n):
            ctx.set(dut.mask, thermometer(pointer, n))
            for requests in range(1 << n):
                ctx.set(dut.requests, requests)
                want = model_pick(requests, pointer, n)
                if want is None:
                    assert ctx.get(dut.pick) == 0, (pointer, requests)
                    continue
                assert ctx.get(dut.pick) == 1 << want, (pointer, requests)
                assert ctx.get(dut.index) == want, (pointer, requests)
                after = ctx.get(dut.mask_after_pick)
                assert after == thermometer((want + 1) % n, n) == mask_after(want, n), (pointer, requests)
                assert ctx.get(dut.mask_at_pick) == thermometer(want, n), (pointer, requests)
                checked.append((pointer, requests))

    simulate(dut, testbench, clock=False)
    assert len(checked) == n * ((1 << n) - 1)


class TurnHarness(Elaboratable):
    def __init__(self, n):
        self.requests = Signal(n)
        self.turn = Signal(range(max(n, 2)))
        self.keep = Signal()
        self.pick = Signal(range(max(n, 2)))

    def elaborate(self, platform):
        m = Module()
        m.d.comb += self.pick.eq(turn_pick(m, self.requests, self.turn, self.keep, name="vl"))
        return m


@pytest.mark.parametrize("n", range(1, 6))
def test_turn_pick_from_every_turn(n):
    dut = TurnHarness(n)
    checked = []

    async def testbench(ctx):
        for turn in range(n):
            ctx.set(dut.turn, turn)
            for keep in (0, 1):
                ctx.set(dut.keep, keep)
                for requests in range(1 << n):
                    ctx.set(dut.requests, requests)
                    want = model_turn_pick(requests, turn, bool(keep), n)
                    assert ctx.get(dut.pick) == (0 if want is None else want), (turn, keep, requests)
                    checked.append(want)

    simulate(dut, testbench, clock=False)
    assert len(checked) == n * 2 * (1 << n)


@pytest.mark.parametrize("k,n", [(-1, 4), (4, 4), (0, 0)])
def test_mask_after_rejects_a_request_out_of_range(k, n):
    with pytest.raises(ValueError, match="is not one of"):
        mask_after(k, n)


def test_model_rejects_a_pointer_out_of_range():
    with pytest.raises(ValueError, match="is not one of"):
        model_pick(1, 3, 3)
