"""The base of the cocotb testbenches whose NICs talk RC to each other: the NIC pair
(:class:`tb.nic_pair_tb.NicPairTB`) and the fabric (:class:`tb.fabric_tb.FabricTB`).

:class:`RcTB` owns the clock (2.5 ns, 400 MHz), the :class:`tb.beats.CycleLoop`, the random
source and the list of errors the NICs' CQE checks append to, and ends each test: it waits
until every completion the models predicted has come (:meth:`RcTB.drain`), then checks that
nothing is left and that each NIC's memory equals its mirror (:meth:`RcTB.check_clean`). A
subclass gives the :class:`tb.nic_pair_tb.Side` of every NIC as ``nodes`` and the cycles
:meth:`RcTB.drain` waits by default as ``drain_limit``, and adds its own start-up and checks.
"""
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from tb.beats import CycleLoop

__all__ = ["RcTB", "CLOCK_NS"]

CLOCK_NS = 2.5


class RcTB:
    def __init__(self, dut, *, seed, memory_latency):
        self.dut = dut
        self.rng = random.Random(seed)
        self.errors = []
        self.memory_latency = memory_latency
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
        self.loop = CycleLoop(dut.clk)
        dut.memory_latency.value = memory_latency

    async def reset(self):
        """Reset for 4 cycles, then start the cycle loop."""
        self.dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        cocotb.start_soon(self.loop.run())

    def outstanding(self):
        """Completions the models predicted that have not come yet."""
        return sum(node.outstanding() for node in self.nodes)

    async def cycles(self, n):
        for _ in range(n):
            await RisingEdge(self.dut.clk)

    async def drain(self, limit=None):
        """Wait until every predicted completion has come (at most ``limit`` cycles,
        ``drain_limit`` by default), stopping at the first error."""
        if limit is None:
            limit = self.drain_limit
        for _ in range(limit):
            if self.errors or self.outstanding() == 0:
                break
            await RisingEdge(self.dut.clk)
        else:
            raise AssertionError(f"not drained after {limit} cycles: {self.outstanding()} "
                                 "completions outstanding")
        assert not self.errors, "\n".join(self.errors[:10])

    async def check_clean(self):
        """Every completion came; each NIC's memory equals its mirror outside the CQs."""
        assert not self.errors, "\n".join(self.errors[:10])
        assert self.outstanding() == 0
        await self.cycles(64)           # the last payload writes land after their ACKs
        for node in self.nodes:
            node.check_memory()
