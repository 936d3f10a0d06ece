"""IslipAllocator against a Python reference of the same iSLIP rules, cycle by cycle.

Random request matrices (dense, sparse, single-output hotspot) with random ``enable``;
every grant is checked to be a legal matching of the requests, and to equal the
reference's. Fairness: under a full request matrix iSLIP desynchronises into ``ports``
perfect matchings in turn (every input gets every output exactly once per ``ports``
cycles); under one output requested by all inputs the grants rotate round robin.

The reference is the switch model's ``IslipAllocator`` (models/switch/allocators.py), one
copy of the rule for the RTL and the model.
"""
import random
import time

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from models.switch import IslipAllocator
from tb import runner
from tb.beats import CycleLoop

CLOCK_NS = 2.5


# --- Reference: models.switch.IslipAllocator -----------------------------------------------

class IslipReference:
    """:class:`models.switch.IslipAllocator` as a grant vector (bit ``i * ports + o``) per
    cycle. Its ``allocate_masks`` always moves the pointers; a cycle without ``enable``
    restores them."""

    def __init__(self, ports, iterations):
        self.model = IslipAllocator(ports, iterations)
        self.ports = ports

    def allocate(self, requests, enable):
        n = self.ports
        saved = list(self.model.grant_ptr), list(self.model.accept_ptr)
        matched = self.model.allocate_masks([requests >> (i * n) & ((1 << n) - 1) for i in range(n)])
        if not enable:
            self.model.grant_ptr[:], self.model.accept_ptr[:] = saved
        return sum(1 << (i * n + o) for i, o in matched.items())


def check_matching(grant, requests, n, where):
    assert grant & ~requests == 0, f"{where}: grant {grant:#x} outside requests {requests:#x}"
    for i in range(n):
        row = grant >> (i * n) & ((1 << n) - 1)
        assert row & (row - 1) == 0, f"{where}: input {i} granted twice ({row:#x})"
    for o in range(n):
        column = sum(grant >> (i * n + o) & 1 for i in range(n))
        assert column <= 1, f"{where}: output {o} granted {column} times"


def pairs_of(grant, n):
    return {(i, o) for i in range(n) for o in range(n) if grant >> (i * n + o) & 1}


# --- Testbench ---------------------------------------------------------------------------------

class TB:
    """Owns clock and reset; each cycle drives ``requests``/``enable`` and checks ``grant``."""

    def __init__(self, dut, rng=None):
        self.dut = dut
        params = runner.tb_params()
        self.n = params["ports"]
        self.iterations = params["iterations"]
        self.rng = rng or random.Random(1)
        self.ref = IslipReference(self.n, self.iterations)
        self.loop = CycleLoop(dut.clk)
        self.loop.add(self)
        self.source = None          # () -> (requests, enable) for the next edge
        self.driven = None          # what the DUT sees at the next edge
        self.grants = []            # (requests, enable, grant) per checked cycle
        self.cycles = 0
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())

    async def reset(self):
        self.dut.requests.value = 0
        self.dut.enable.value = 0
        self.dut.rst.value = 1
        for _ in range(2):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        self.ref = IslipReference(self.n, self.iterations)
        self.driven = None

    # CycleLoop model: the grant read just after an edge is the one that edge saw.
    def sample(self, cycle):
        if self.driven is None:
            return
        requests, enable = self.driven
        grant = int(self.dut.grant.value)
        valid = int(self.dut.grant_valid.value)
        where = f"cycle {cycle} (requests {requests:#x}, enable {enable})"
        check_matching(grant, requests, self.n, where)
        rows = sum(1 << i for i in range(self.n) if grant >> (i * self.n) & ((1 << self.n) - 1))
        assert valid == rows, f"{where}: grant_valid {valid:#x} != rows of grant {rows:#x}"
        expected = self.ref.allocate(requests, enable)
        assert grant == expected, \
            f"{where}: grant {sorted(pairs_of(grant, self.n))} != reference {sorted(pairs_of(expected, self.n))}"
        self.grants.append((requests, enable, grant))
        self.cycles += 1

    def drive(self, cycle):
        self.driven = self.source()
        self.dut.requests.value = self.driven[0]
        self.dut.enable.value = self.driven[1]

    async def run(self, source, cycles):
        self.source = source
        self.grants = []
        self.drive(self.loop.cycle)
        await self.loop.run(cycles=cycles)
        return self.grants


def random_matrix(rng, n, density):
    return sum(1 << k for k in range(n * n) if rng.random() < density)


def hotspot_matrix(rng, n, output, density):
    return sum(1 << (i * n + output) for i in range(n) if rng.random() < density)


# --- Tests -------------------------------------------------------------------------------------

@cocotb.test()
async def random_requests(dut):
    """Thousands of cycles of dense, sparse and hotspot matrices with random enable."""
    tb = TB(dut, rng=random.Random(21))
    await tb.reset()
    n, rng = tb.n, tb.rng
    kinds = {
        "dense": lambda: random_matrix(rng, n, 0.8),
        "half": lambda: random_matrix(rng, n, 0.5),
        "sparse": lambda: random_matrix(rng, n, 0.1),
        "hotspot": lambda: hotspot_matrix(rng, n, rng.randrange(n), 0.9)
        | random_matrix(rng, n, 0.05),
        "full": lambda: (1 << n * n) - 1,
        "empty": lambda: 0,
    }
    total_grants = 0
    for phase in range(24):
        kind = rng.choice(list(kinds))
        enable_rate = rng.choice([1.0, 0.9, 0.5, 0.1])
        # Hold a matrix for a few cycles sometimes: repeated requests exercise the pointers.
        state = {"left": 0, "requests": 0}

        def source():
            if state["left"] == 0:
                state["left"] = rng.choice([1, 1, 1, 4])
                state["requests"] = kinds[kind]()
            state["left"] -= 1
            return state["requests"], int(rng.random() < enable_rate)
        grants = await tb.run(source, 250)
        total_grants += sum(bin(g).count("1") for _, _, g in grants)
    dut._log.info(f"{tb.cycles} cycles checked against the reference, {total_grants} grants")
    assert total_grants > 0


@cocotb.test()
async def full_load_desynchronises(dut):
    """Full request matrix: after warm-up, every input gets every output once per N cycles."""
    tb = TB(dut)
    await tb.reset()
    n = tb.n
    full = (1 << n * n) - 1
    warm = 4 * n
    grants = await tb.run(lambda: (full, 1), warm + 4 * n)
    steady = grants[warm:]
    for cycle, (_, _, grant) in enumerate(steady):
        assert bin(grant).count("1") == n, f"steady cycle {cycle}: not a perfect matching"
    for start in range(0, len(steady) - n + 1, 1):
        window = [pairs_of(g, n) for _, _, g in steady[start:start + n]]
        seen = [p for pairs in window for p in pairs]
        assert sorted(seen) == [(i, o) for i in range(n) for o in range(n)], \
            f"window at steady cycle {start}: some pair granted twice or never"
    # How quickly it got there (informational).
    first_perfect = next(c for c, (_, _, g) in enumerate(grants) if bin(g).count("1") == n)
    dut._log.info(f"first perfect matching at cycle {first_perfect}")


@cocotb.test()
async def hotspot_rotates(dut):
    """One output requested by every input: grants rotate round robin, one input per cycle."""
    tb = TB(dut)
    await tb.reset()
    n = tb.n
    for output in (0, n - 1, n // 2):
        column = sum(1 << (i * n + output) for i in range(n))
        grants = await tb.run(lambda: (column, 1), 3 * n)
        winners = []
        for _, _, grant in grants:
            pairs = pairs_of(grant, n)
            assert len(pairs) == 1 and next(iter(pairs))[1] == output
            winners.append(next(iter(pairs))[0])
        for a, b in zip(winners, winners[1:]):
            assert b == (a + 1) % n, f"output {output}: input {b} after input {a}: {winners}"
    # Without enable the pointer holds: the same input wins every cycle.
    grants = await tb.run(lambda: (column, 0), n)
    assert len({g for _, _, g in grants}) == 1


@cocotb.test()
async def hotspot_skips_idle_inputs(dut):
    """Some inputs request one output: it serves exactly those, in round-robin order."""
    tb = TB(dut, rng=random.Random(5))
    await tb.reset()
    n, rng = tb.n, tb.rng
    for _ in range(4):
        output = rng.randrange(n)
        active = sorted(rng.sample(range(n), rng.randrange(2, n + 1)))
        column = sum(1 << (i * n + output) for i in active)
        grants = await tb.run(lambda: (column, 1), 2 * len(active))
        winners = [next(iter(pairs_of(g, n)))[0] for _, _, g in grants]
        order = [active[(active.index(winners[0]) + k) % len(active)] for k in range(len(winners))]
        assert winners == order, f"active {active}: {winners}"


# --- pytest launcher ---------------------------------------------------------------------------

def factory(ports, iterations):
    from hdl.switch.islip_allocator import IslipAllocator
    return IslipAllocator(ports=ports, iterations=iterations)


# make test runs the ablation switch's allocator (4 ports, one iteration); the wider and
# iterated ones (66 s of CPU) under make test-full since 2026-12-08.
PARAM_SETS = [dict(ports=4, iterations=1),
              pytest.param(dict(ports=4, iterations=4), marks=pytest.mark.full),
              pytest.param(dict(ports=8, iterations=3), marks=pytest.mark.full)]


@pytest.mark.parametrize("params", PARAM_SETS, ids=lambda p: f"p{p['ports']}i{p['iterations']}")
def test_islip(params):
    t0 = time.monotonic()
    runner.run(module="tb.test_islip", toplevel="islip_allocator", factory=factory, params=params,
               expect_tests=4)
    print(f"islip {params}: {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("kwargs", [dict(ports=1), dict(ports=17), dict(iterations=0),
                                    dict(iterations=5), dict(ports=4.0)])
def test_islip_parameters_validated(kwargs):
    from hdl.switch.islip_allocator import IslipAllocator
    with pytest.raises(ValueError, match="Ports|Iterations"):
        IslipAllocator(**kwargs)


def test_reference_is_a_matching():
    """The reference itself: legal matchings, and maximal after ``ports`` iterations."""
    rng = random.Random(3)
    for n, iterations in ((4, 4), (8, 8)):
        ref = IslipReference(n, iterations)
        for _ in range(300):
            requests = random_matrix(rng, n, rng.random())
            grant = ref.allocate(requests, rng.random() < 0.7)
            check_matching(grant, requests, n, "reference")
            matched_in = {i for i, _ in pairs_of(grant, n)}
            matched_out = {o for _, o in pairs_of(grant, n)}
            for i, o in pairs_of(requests, n):
                assert i in matched_in or o in matched_out, "N iterations must give a maximal matching"
