"""The independent link partner's bring-up (tb/link_partner_scenario.py, in tb/test_link.py) on many more seeds
(``make test-full``): random cadences, entry packets, start times and resets; nothing the
partner sends is ever dropped."""
import os

import cocotb
import pytest
from cocotb.clock import Clock

from tb import runner
from tb.link_pair_tb import CLOCK_NS, PARAM_SETS, factory
from tb.link_partner_scenario import partner_scenario

SEEDS_PER_RUN = 40


@cocotb.test()
async def partner_soak(dut):
    first = int(os.environ["PARTNER_FIRST_SEED"])
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
    for seed in range(first, first + SEEDS_PER_RUN):
        await partner_scenario(dut, seed)


@pytest.mark.full
@pytest.mark.parametrize("first_seed", [100, 200])
@pytest.mark.parametrize("params", PARAM_SETS, ids=lambda p: f"w{p['width']}_ct{int(p['cut_through'])}")
def test_link_partner_soak(params, first_seed):
    runner.run(module="tb.test_link_partner_soak", toplevel="link_pair", factory=factory,
               params=params, extra_env={"PARTNER_FIRST_SEED": str(first_seed)}, expect_tests=1)
