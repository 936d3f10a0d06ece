"""Long random soaks of the link (``make test-full``): everything at once, many seeds.

Random sizes both ways on every VL, source idles, consumer stalls, lost and
corrupted flow-control packets and every kind of bad data packet together;
every good packet delivered once, intact, in order, every bad one counted,
every credit home.
"""
import os
import random

import cocotb
import pytest

from tb import runner
from tb.beats import WireChannel
from tb.link_pair_tb import PARAM_SETS, TB, drop_counts, factory


@cocotb.test()
async def soak(dut):
    seed = int(os.environ["SOAK_SEED"])
    packets = int(os.environ["SOAK_PACKETS"])
    rng = random.Random(seed)
    injected = {}

    def mutate(header):
        if rng.random() >= 0.05:
            return None
        kind = rng.choice(WireChannel.MUTATIONS)
        injected[kind] = injected.get(kind, 0) + 1
        return kind

    tb = TB(dut, rng=random.Random(seed + 1), fc_drop=0.05, fc_corrupt=0.05, mutate=mutate,
            idle=rng.choice([0.0, 0.2]), backpressure=rng.choice([0.0, 0.3, 0.6]))
    await tb.bring_up(limit=100000)
    tb.random_traffic(packets, sizes=(0, 4096))
    await tb.drain(limit=400 * packets + 100000)
    await tb.loop.run(cycles=4 * tb.params["fc_period"])
    tb.check_delivery()
    tb.check_credits()
    counts = drop_counts(tb.dut, "b")
    for kind, number in injected.items():
        assert counts[kind] == number, f"{kind}: injected {number}, counted {counts[kind]}"
    dut._log.info(f"seed {seed}: {packets} packets, {sum(injected.values())} bad, "
                  f"{tb.loop.cycle} cycles")


@pytest.mark.full
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("params", PARAM_SETS, ids=lambda p: f"w{p['width']}_ct{int(p['cut_through'])}")
def test_link_soak(params, seed):
    runner.run(module="tb.test_link_soak", toplevel="link_pair", factory=factory, params=params,
               extra_env={"SOAK_SEED": str(seed), "SOAK_PACKETS": "3000"}, expect_tests=1)
