"""SwitchRegisters joined to a ForwardingTable, driven through AXI4-Lite by cocotbext-axi.

The sim top (:class:`RegistersTop`) is the switch's control plane as the datapath will
see it: the register block's forwarding-table strobe writes the table, whose lookup ports
(one per switch input) are top-level ports here, as are the SL-to-VL, weight and enable
outputs and the counter inputs.

Checked against a register model built from the register map: forwarding entries
programmed at random and looked up on every read port (unknown and out-of-range DLIDs
miss, removed entries miss, read-during-write gives the old entry), readback through the
shadow, SL-to-VL / weights / enable on the outputs, counters driven by the testbench read
back exactly, byte strobes, SLVERR for unmapped addresses / read-only registers /
out-of-range values with nothing changed, back-to-back and randomly paused transactions.
Every cycle a monitor checks that B and R hold steady until taken and that the table is
written only by accepted ft_write transactions.
"""
import contextlib
import gc
import random
import time
import warnings
from pathlib import Path

import cocotb
import pytest
from amaranth import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge

from hdl.switch import register_map as rmap
from tb import runner

CLOCK_NS = 2.5
TIMEOUT_US = 400       # simulated time per test; every test needs far less
ADDR_WIDTH = 16
REPO = Path(__file__).resolve().parent.parent


# --- Sim top -----------------------------------------------------------------------------------

def make_top(ports, num_vls, lids):
    from hdl.switch.forwarding_table import ForwardingTable, LookupSignature
    from hdl.switch.switch_registers import AxiLiteSignature, CounterSignature, SwitchRegisters

    class RegistersTop(wiring.Component):
        def __init__(self):
            self.regs = SwitchRegisters(ports, num_vls, lids=lids, addr_width=ADDR_WIDTH)
            self.table = ForwardingTable(ports, lids)
            super().__init__({
                "axi": In(AxiLiteSignature(ADDR_WIDTH)),
                "ft_write_en": Out(1),
                "sl_to_vl": Out(4).array(16),
                "vl_weight": Out(8).array(ports, num_vls),
                "port_enable": Out(1).array(ports),
                "hoq_lifetime": Out(16),
                "counters": In(CounterSignature()).array(ports, num_vls),
                "lookup": In(LookupSignature(ports)).array(ports),
            })

        def elaborate(self, platform):
            m = Module()
            regs, table = self.regs, self.table
            m.submodules.regs = regs
            m.submodules.table = table
            wiring.connect(m, wiring.flipped(self.axi), regs.axi)
            m.d.comb += [
                table.write_en.eq(regs.ft_write_en),
                table.write_lid.eq(regs.ft_write_lid),
                table.write_port.eq(regs.ft_write_port),
                table.write_valid.eq(regs.ft_write_valid),
                self.ft_write_en.eq(regs.ft_write_en),
            ]
            m.d.comb += self.hoq_lifetime.eq(regs.hoq_lifetime)
            for sl in range(16):
                m.d.comb += self.sl_to_vl[sl].eq(regs.sl_to_vl[sl])
            for p in range(ports):
                m.d.comb += self.port_enable[p].eq(regs.port_enable[p])
                m.d.comb += [
                    table.lookup[p].lid.eq(self.lookup[p].lid),
                    self.lookup[p].port.eq(table.lookup[p].port),
                    self.lookup[p].hit.eq(table.lookup[p].hit),
                ]
                for v in range(num_vls):
                    m.d.comb += self.vl_weight[p][v].eq(regs.vl_weight[p][v])
                    for name in rmap.COUNTER_NAMES:
                        m.d.comb += getattr(regs.counters[p][v], name).eq(
                            getattr(self.counters[p][v], name))
            return m

    return RegistersTop()


# --- Register model ----------------------------------------------------------------------------

def ft_word(lid, port, valid):
    return lid | port << 16 | valid << 31


class RegisterModel:
    """What every register should read, and what a write should answer, from the map."""

    def __init__(self, ports, num_vls, lids):
        self.ports, self.num_vls, self.lids = ports, num_vls, lids
        self.regs = {r.offset: r for r in rmap.register_map(ports, num_vls, lids)}
        self.by_name = {r.name: r for r in self.regs.values()}
        self.values = {o: r.reset for o, r in self.regs.items() if r.access != "RO"}
        self.table = {}         # lid -> (port, valid), after configuration: all invalid
        self.counters = {}      # (p, v, name) -> value the TB drives

    def write(self, offset, data, strb=0xF):
        """Apply a write; returns the expected response and whether it commits an entry."""
        reg = self.regs.get(offset & ~3)
        if reg is None or reg.access == "RO":
            return rmap.SLVERR, None
        old = self.values[reg.offset]
        merged = 0
        for k in range(4):
            lane = data if strb >> k & 1 else old
            merged |= lane & (0xFF << 8 * k)
        merged &= (1 << reg.width) - 1
        kind = reg.binding[0]
        if kind == "ft_write":
            lid, port, valid = merged & 0xFFFF, merged >> 16 & 0xF, merged >> 31
            if lid >= self.lids or port >= self.ports:
                return rmap.SLVERR, None
            self.values[reg.offset] = ft_word(lid, port, valid)
            self.table[lid] = (port, valid)
            return rmap.OKAY, (lid, port, valid)
        if kind == "ft_read_lid" and merged >= self.lids:
            return rmap.SLVERR, None
        self.values[reg.offset] = merged
        return rmap.OKAY, None

    def read(self, offset):
        reg = self.regs.get(offset & ~3)
        if reg is None:
            return rmap.SLVERR, 0
        kind = reg.binding[0]
        if kind == "const":
            return rmap.OKAY, reg.reset
        if kind == "counter":
            return rmap.OKAY, self.counters.get(reg.binding[1:], 0)
        if kind == "ft_read_data":
            lid = self.values[self.by_name["ft_read_lid"].offset]
            port, valid = self.table.get(lid, (0, 0))
            return rmap.OKAY, ft_word(lid, port, valid)
        return rmap.OKAY, self.values[reg.offset]

    def lookup(self, lid):
        """(hit, port) the forwarding table should answer."""
        port, valid = self.table.get(lid, (0, 0)) if lid < self.lids else (0, 0)
        return (1, port) if valid else (0, 0)

    def unmapped(self, rng, count):
        """Word addresses no register occupies: holes of every region, and random ones."""
        fixed = [0x1C, 0x20, 0x3C, 0x80, 0xFC,
                 rmap.PORT_BASE + 4 * (1 + self.num_vls),                   # past port 0's weights
                 rmap.PORT_BASE + rmap.PORT_STRIDE * self.ports,            # a port we lack
                 rmap.PORT_BASE + rmap.PORT_STRIDE * rmap.MAX_PORTS,
                 rmap.COUNTER_BASE - 4,
                 rmap.COUNTER_BASE + 4 * len(rmap.COUNTER_NAMES),           # after the last counter
                 rmap.COUNTER_BASE + rmap.COUNTER_VL_STRIDE * self.num_vls,  # a VL we lack
                 rmap.COUNTER_BASE + rmap.COUNTER_PORT_STRIDE * self.ports,  # a port we lack
                 (1 << ADDR_WIDTH) - 4]
        out = [a for a in fixed if a not in self.regs]
        while len(out) < count:
            a = rng.randrange(1 << ADDR_WIDTH) & ~3
            if a not in self.regs:
                out.append(a)
        return out


# --- Testbench ---------------------------------------------------------------------------------

class TB:
    """Owns clock, reset, the AXI-Lite master, the counter inputs, the lookup ports and a
    per-cycle monitor."""

    # Module-level state survives between cocotb tests of one simulation (the table RAM is
    # not cleared by reset), so the model does too.
    model = None

    def __init__(self, dut, seed):
        from cocotbext.axi import AxiLiteBus, AxiLiteMaster

        self.dut = dut
        params = runner.tb_params()
        self.ports, self.num_vls, self.lids = params["ports"], params["num_vls"], params["lids"]
        self.rng = random.Random(seed)
        if TB.model is None:
            TB.model = RegisterModel(self.ports, self.num_vls, self.lids)
        self.model = TB.model
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
        bus = AxiLiteBus.from_prefix(dut, "axi", bus_separator="__")
        self.axi = AxiLiteMaster(bus, dut.clk, dut.rst)
        self.lookup_lid = [getattr(dut, f"lookup__{p}__lid") for p in range(self.ports)]
        self.lookup_hit = [getattr(dut, f"lookup__{p}__hit") for p in range(self.ports)]
        self.lookup_port = [getattr(dut, f"lookup__{p}__port") for p in range(self.ports)]
        self.counter_handles = {
            (p, v, name): getattr(dut, f"counters__{p}__{v}__{name}")
            for p in range(self.ports) for v in range(self.num_vls) for name in rmap.COUNTER_NAMES}
        self.strobes = []           # (cycle, lid, port, valid) of every ft_write_en seen
        self.monitoring = False
        self.cycle = 0
        self.errors = []

    async def reset(self):
        for p in range(self.ports):
            self.lookup_lid[p].value = 0
        for key, handle in self.counter_handles.items():
            handle.value = self.model.counters.get(key, 0)
        self.dut.rst.value = 1
        for _ in range(3):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        # Registers return to their reset values; the table RAM keeps its contents.
        m = self.model
        m.values = {o: r.reset for o, r in m.regs.items() if r.access != "RO"}
        if not self.monitoring:
            self.monitoring = True
            cocotb.start_soon(self.monitor())

    async def monitor(self):
        """Each cycle: B/R hold until taken; record table write strobes."""
        dut = self.dut
        held_b = held_r = None
        while True:
            await FallingEdge(dut.clk)
            self.cycle += 1
            if int(dut.ft_write_en.value):
                self.strobes.append(self.cycle)
            bvalid, rvalid = int(dut.axi__bvalid.value), int(dut.axi__rvalid.value)
            b = (int(dut.axi__bresp.value),) if bvalid else None
            r = (int(dut.axi__rdata.value), int(dut.axi__rresp.value)) if rvalid else None
            if held_b is not None and b != held_b:
                self.errors.append(f"cycle {self.cycle}: B changed {held_b} -> {b} before bready")
            if held_r is not None and r != held_r:
                self.errors.append(f"cycle {self.cycle}: R changed {held_r} -> {r} before rready")
            held_b = b if bvalid and not int(dut.axi__bready.value) else None
            held_r = r if rvalid and not int(dut.axi__rready.value) else None

    def check_monitor(self):
        assert not self.errors, self.errors[:5]

    # AXI helpers: check each response against the model.
    async def write(self, offset, value, strb=0xF, expect=None):
        lanes = [k for k in range(4) if strb >> k & 1]
        first, last = lanes[0], lanes[-1]
        data = value.to_bytes(4, "little")[first:last + 1]
        want, _ = self.model.write(offset, value, sum(1 << k for k in range(first, last + 1)))
        resp = await self.axi.write(offset + first, data)
        assert int(resp.resp) == want, \
            f"write {offset:#06x} = {value:#x} strb {strb:#x}: resp {int(resp.resp)}, expected {want}"
        if expect is not None:
            assert want == expect
        return want

    async def read(self, offset):
        resp = await self.axi.read(offset, 4)
        value = int.from_bytes(resp.data, "little")
        want_resp, want = self.model.read(offset)
        assert (int(resp.resp), value) == (want_resp, want), \
            f"read {offset:#06x}: got resp {int(resp.resp)} {value:#x}, expected {want_resp} {want:#x}"
        return value

    def set_counters(self):
        for key, handle in self.counter_handles.items():
            value = self.rng.choice([0, 0xFFFFFFFF, self.rng.getrandbits(32), self.rng.getrandbits(8)])
            self.model.counters[key] = value
            handle.value = value

    async def lookups(self, per_port):
        """Drive ``per_port[p]`` (lists of equal length) on the lookup ports, one LID per
        cycle, and return ``(hit, port)`` per lookup."""
        n = len(per_port[0])
        results = [[] for _ in range(self.ports)]
        await FallingEdge(self.dut.clk)
        for k in range(n + 1):
            if k:
                for p in range(self.ports):
                    results[p].append((int(self.lookup_hit[p].value), int(self.lookup_port[p].value)))
            if k < n:
                for p in range(self.ports):
                    self.lookup_lid[p].value = per_port[p][k]
            await FallingEdge(self.dut.clk)
        return results

    async def check_table(self, lids):
        """Look every LID of ``lids`` up on every read port (each port its own order)."""
        orders = []
        for p in range(self.ports):
            order = list(lids)
            self.rng.shuffle(order)
            orders.append(order)
        results = await self.lookups(orders)
        for p in range(self.ports):
            for lid, got in zip(orders[p], results[p]):
                assert got == self.model.lookup(lid), \
                    f"lookup port {p} LID {lid:#x}: (hit, port) {got}, expected {self.model.lookup(lid)}"

    def pauses(self, rate):
        rng = self.rng

        def gen():
            while True:
                yield rng.random() < rate
        for channel in (self.axi.write_if.aw_channel, self.axi.write_if.w_channel,
                        self.axi.write_if.b_channel, self.axi.read_if.ar_channel,
                        self.axi.read_if.r_channel):
            channel.set_pause_generator(gen() if rate else None)
            if not rate:
                channel.pause = False       # removing the generator leaves its last value


def offset_of(model, name):
    return model.by_name[name].offset


def writable(model):
    return [r for r in model.regs.values() if r.access == "RW"]


def random_value(rng, reg, model):
    kind = reg.binding[0]
    if kind == "ft_read_lid":
        return rng.randrange(model.lids)
    return rng.getrandbits(32)


# --- Tests -------------------------------------------------------------------------------------

@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def identity_and_reset_values(dut):
    """ID, configuration, every register's reset value, and the outputs at reset."""
    tb = TB(dut, seed=1)
    await tb.reset()
    m = tb.model
    assert await tb.read(0x0000) == rmap.ID_VALUE
    assert await tb.read(0x0004) == tb.ports
    assert await tb.read(0x0008) == tb.num_vls
    assert await tb.read(0x000C) == tb.lids
    for reg in m.regs.values():
        if reg.binding[0] != "counter":
            await tb.read(reg.offset)
    for sl in range(16):
        assert int(getattr(dut, f"sl_to_vl__{sl}").value) == sl % tb.num_vls
    for p in range(tb.ports):
        assert int(getattr(dut, f"port_enable__{p}").value) == 1
        for v in range(tb.num_vls):
            assert int(getattr(dut, f"vl_weight__{p}__{v}").value) == rmap.DEFAULT_VL_WEIGHT
    # After configuration every entry is invalid: everything misses, on every port.
    await tb.check_table(range(tb.lids))
    assert not tb.strobes
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def forwarding_table_program_and_lookup(dut):
    """Random entries through AXI-Lite (some rewritten, some removed): every read port sees
    exactly the programmed table; unknown, removed and out-of-range DLIDs miss; the shadow
    reads back every entry; ft_write reads back the last write."""
    tb = TB(dut, seed=2)
    await tb.reset()
    m, rng = tb.model, tb.rng
    ft = offset_of(m, "ft_write")
    lids = rng.sample(range(tb.lids), min(tb.lids, 160)) + [0, tb.lids - 1]
    writes = 0
    for lid in lids:
        await tb.write(ft, ft_word(lid, rng.randrange(tb.ports), 1), expect=rmap.OKAY)
        writes += 1
    for lid in rng.sample(lids, 40):      # rewrites and removals
        await tb.write(ft, ft_word(lid, rng.randrange(tb.ports), int(rng.random() < 0.5)))
        writes += 1
    assert await tb.read(ft) == m.values[ft]
    assert len(tb.strobes) == writes, f"{len(tb.strobes)} table strobes for {writes} writes"
    # Every LID in the table, and DLIDs beyond it (up to 0xFFFF), on every port.
    beyond = []
    if tb.lids < 0x10000:
        beyond = [tb.lids, tb.lids + 1, 0xFFFF, 0x8000 | lids[0]]
        beyond += [rng.randrange(tb.lids, 0x10000) for _ in range(40)]
    await tb.check_table(list(range(tb.lids)) + beyond)
    # Readback through the shadow copy.
    for lid in rng.sample(lids, 30) + rng.sample(range(tb.lids), 10):
        await tb.write(offset_of(m, "ft_read_lid"), lid, expect=rmap.OKAY)
        await tb.read(offset_of(m, "ft_read_data"))
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def forwarding_table_survives_reset(dut):
    """``rst`` does not clear the table (docs/verilog.md): entries written before a reset are
    looked up and read back after it exactly as before; the registers go back to reset."""
    tb = TB(dut, seed=9)
    await tb.reset()
    m, rng = tb.model, tb.rng
    ft = offset_of(m, "ft_write")
    lids = rng.sample(range(tb.lids), min(tb.lids, 24))
    for lid in lids:
        await tb.write(ft, ft_word(lid, rng.randrange(tb.ports), int(rng.random() < 0.8)),
                       expect=rmap.OKAY)
    assert any(m.lookup(lid)[0] for lid in lids)
    await tb.reset()
    await tb.check_table(lids)
    for lid in lids[:8]:
        await tb.write(offset_of(m, "ft_read_lid"), lid, expect=rmap.OKAY)
        await tb.read(offset_of(m, "ft_read_data"))
    await tb.read(ft)                               # the ft_write register itself is reset
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def forwarding_table_rejects_out_of_range(dut):
    """A LID beyond the table or a port the switch lacks: SLVERR, nothing written."""
    tb = TB(dut, seed=3)
    await tb.reset()
    m = tb.model
    ft = offset_of(m, "ft_write")
    await tb.write(ft, ft_word(5, 1, 1), expect=rmap.OKAY)
    before = len(tb.strobes)
    bad = []
    if tb.lids < 0x10000:
        bad += [ft_word(tb.lids, 0, 1), ft_word(0xFFFF, 1, 0), ft_word(tb.lids | 5, 1, 1)]
    if tb.ports < 16:
        bad += [ft_word(7, tb.ports, 1), ft_word(5, 15, 1)]
    for word in bad:
        await tb.write(ft, word, expect=rmap.SLVERR)
    await tb.read(ft)                           # still the last accepted entry
    await tb.write(offset_of(m, "ft_read_lid"), tb.lids, expect=rmap.SLVERR)
    await tb.write(offset_of(m, "ft_read_lid"), 5, expect=rmap.OKAY)
    await tb.read(offset_of(m, "ft_read_data"))
    assert len(tb.strobes) == before, "a rejected write strobed the table"
    await tb.check_table([5, 7, tb.lids - 1])
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def read_during_write_returns_old_entry(dut):
    """Lookups of LID L every cycle while L is rewritten: the lookup in the strobe's cycle
    returns the old entry, the next one the new entry (docs: read-first)."""
    tb = TB(dut, seed=4)
    await tb.reset()
    m, rng = tb.model, tb.rng
    ft = offset_of(m, "ft_write")
    lid = rng.randrange(tb.lids)
    for round_ in range(6):
        old = m.lookup(lid)
        new_port, new_valid = rng.randrange(tb.ports), int(round_ % 3 != 2)
        samples = []            # (ft_write_en, [(hit, port) per port]) at each falling edge

        async def watch():
            while True:
                await FallingEdge(dut.clk)
                samples.append((int(dut.ft_write_en.value),
                                [(int(tb.lookup_hit[p].value), int(tb.lookup_port[p].value))
                                 for p in range(tb.ports)]))
        for p in range(tb.ports):
            tb.lookup_lid[p].value = lid
        watcher = cocotb.start_soon(watch())
        for _ in range(3):
            await RisingEdge(dut.clk)
        await tb.write(ft, ft_word(lid, new_port, new_valid), expect=rmap.OKAY)
        for _ in range(3):
            await RisingEdge(dut.clk)
        watcher.cancel()
        new = m.lookup(lid)
        strobes = [i for i, (en, _) in enumerate(samples) if en]
        assert len(strobes) == 1, f"{len(strobes)} table strobes for one write"
        i = strobes[0]
        # The strobe is high for the cycle after falling edge i; the lookup presented in that
        # cycle reads at the edge that writes, and shows at falling edge i + 1: old. Next: new.
        assert all(r == old for r in samples[i][1]), (samples[i][1], old)
        assert all(r == old for r in samples[i + 1][1]), (samples[i + 1][1], old)
        assert all(r == new for r in samples[i + 2][1]), (samples[i + 2][1], new)
        assert all(r == new for r in samples[-1][1]), (samples[-1][1], new)
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def sl_to_vl_weights_and_enable(dut):
    """Random values into every RW register appear on the outputs and read back; bits
    above a register's width are dropped; byte strobes merge."""
    tb = TB(dut, seed=5)
    await tb.reset()
    m, rng = tb.model, tb.rng
    for reg in writable(m):
        await tb.write(reg.offset, random_value(rng, reg, m), expect=rmap.OKAY)
    for reg in writable(m):
        await tb.read(reg.offset)
    check_outputs(tb)
    # Byte strobes: single bytes into the weights (byte 0 lands, bytes 1..3 are above the
    # 8-bit width and change nothing) and into ft_write (merged word committed).
    for reg in rng.sample(writable(m), min(12, len(writable(m)))):
        value = random_value(rng, reg, m)
        lane = rng.randrange(4)
        await tb.write(reg.offset, value, strb=1 << lane)
        await tb.read(reg.offset)
    ft = offset_of(m, "ft_write")
    lid = rng.randrange(tb.lids)
    await tb.write(ft, ft_word(lid, 1, 1), expect=rmap.OKAY)
    port = tb.ports - 1
    await tb.write(ft, ft_word(0, port, 0), strb=0b0100, expect=rmap.OKAY)     # port byte only
    assert m.table[lid] == (port, 1)
    await tb.write(ft, 0, strb=0b1000, expect=rmap.OKAY)                        # valid byte: remove
    assert m.table[lid] == (port, 0)
    await tb.read(ft)
    await tb.check_table([lid])
    check_outputs(tb)
    tb.check_monitor()


def check_outputs(tb):
    m, dut = tb.model, tb.dut
    for reg in m.regs.values():
        kind = reg.binding[0]
        want = m.values.get(reg.offset)
        if kind == "sl_to_vl":
            got = int(getattr(dut, f"sl_to_vl__{reg.binding[1]}").value)
        elif kind == "vl_weight":
            got = int(getattr(dut, f"vl_weight__{reg.binding[1]}__{reg.binding[2]}").value)
        elif kind == "port_enable":
            got = int(getattr(dut, f"port_enable__{reg.binding[1]}").value)
        elif kind == "hoq_lifetime":
            got = int(dut.hoq_lifetime.value)
        else:
            continue
        assert got == want, f"{reg.name}: output {got:#x}, register {want:#x}"


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def counters_read_back(dut):
    """Every counter input, driven by the testbench, reads back exactly; twice."""
    tb = TB(dut, seed=6)
    await tb.reset()
    m = tb.model
    counters = [r for r in m.regs.values() if r.binding[0] == "counter"]
    for _ in range(2):
        tb.set_counters()
        for reg in counters:
            await tb.read(reg.offset)
    # Counters are read-only.
    for reg in tb.rng.sample(counters, 8):
        await tb.write(reg.offset, 0, expect=rmap.SLVERR)
        await tb.read(reg.offset)
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def unmapped_and_read_only_answer_slverr(dut):
    """Unmapped addresses and read-only registers answer SLVERR and change nothing."""
    tb = TB(dut, seed=7)
    await tb.reset()
    m, rng = tb.model, tb.rng
    for reg in writable(m):
        await tb.write(reg.offset, random_value(rng, reg, m), expect=rmap.OKAY)
    strobes = len(tb.strobes)
    for addr in m.unmapped(rng, 40):
        await tb.write(addr, rng.getrandbits(32), expect=rmap.SLVERR)
        await tb.read(addr)             # SLVERR, data 0
    for name in ("id", "ports", "num_vls", "ft_lids", "ft_read_data"):
        await tb.write(offset_of(m, name), rng.getrandbits(32), expect=rmap.SLVERR)
    for reg in m.regs.values():
        if reg.binding[0] != "counter":
            await tb.read(reg.offset)
    check_outputs(tb)
    assert len(tb.strobes) == strobes
    tb.check_monitor()


@cocotb.test(timeout_time=TIMEOUT_US, timeout_unit="us")
async def back_to_back_and_paused(dut):
    """Many transactions queued at once, without pauses (back to back) and with random
    pauses and backpressure on all five channels; reads and writes concurrently."""
    tb = TB(dut, seed=8)
    await tb.reset()
    m, rng = tb.model, tb.rng
    regs = writable(m)
    constants = [r for r in m.regs.values() if r.binding[0] in ("const", "counter")]
    tb.set_counters()
    for rate in (0.0, 0.3, 0.7):
        tb.pauses(rate)
        # Writes go to a random half of the RW registers; concurrent reads only to the
        # others, to constants and counters, so the order between them does not matter.
        targets = rng.sample(regs, len(regs) // 2)
        others = [r for r in regs if r not in targets] + constants
        writes = []
        for _ in range(60):
            reg = rng.choice(targets + [None])
            if reg is None:
                addr = rng.choice(m.unmapped(rng, 1))
                writes.append((addr, rng.getrandbits(32)))
            else:
                writes.append((reg.offset, random_value(rng, reg, m)))
        reads = [rng.choice(others).offset if rng.random() < 0.85 else rng.choice(m.unmapped(rng, 1))
                 for _ in range(60)]
        expected_w = [m.write(addr, value)[0] for addr, value in writes]
        expected_r = [m.read(addr) for addr in reads]
        t0 = tb.cycle
        wevents = [tb.axi.init_write(addr, value.to_bytes(4, "little")) for addr, value in writes]
        revents = [tb.axi.init_read(addr, 4) for addr in reads]
        for event in wevents + revents:
            await event.wait()
        cycles = tb.cycle - t0
        for (addr, value), event, want in zip(writes, wevents, expected_w):
            assert int(event.data.resp) == want, f"write {addr:#06x}: resp {int(event.data.resp)}"
        for addr, event, (want_resp, want) in zip(reads, revents, expected_r):
            got = (int(event.data.resp), int.from_bytes(event.data.data, "little"))
            assert got == (want_resp, want), f"read {addr:#06x}: {got}, expected {(want_resp, want)}"
        dut._log.info(f"pause rate {rate}: 60 writes + 60 reads in {cycles} cycles "
                      f"({cycles / 120:.1f} cycles per transaction)")
        if rate == 0.0:
            assert cycles <= 120 * 5, f"back-to-back transactions took {cycles} cycles"
    tb.pauses(0)
    for reg in regs:
        await tb.read(reg.offset)
    check_outputs(tb)
    tb.check_monitor()


# --- pytest launchers --------------------------------------------------------------------------

PARAM_SETS = [dict(ports=4, num_vls=2, lids=256), dict(ports=8, num_vls=4, lids=1024)]
COCOTB_TESTS = 9


@pytest.mark.parametrize("params", PARAM_SETS, ids=lambda p: f"p{p['ports']}v{p['num_vls']}")
def test_switch_registers(params):
    t0 = time.monotonic()
    runner.run(module="tb.test_switch_registers", toplevel="switch_registers_top",
               factory=make_top, params=params, expect_tests=COCOTB_TESTS)
    print(f"switch registers {params}: {time.monotonic() - t0:.1f} s")


def test_register_doc_is_generated():
    """docs/switch-registers.md is exactly what the register map generates (8 ports, 2 VLs)."""
    committed = (REPO / "docs" / "switch-registers.md").read_text()
    assert committed == rmap.render_markdown(8, 2), (
        "docs/switch-registers.md is stale: run "
        "`python -m hdl.switch.register_map --ports 8 --vls 2 > docs/switch-registers.md`")


def test_register_map_layout():
    """Fixed strides and a few addresses a driver would hard-code."""
    regs = {r.name: r for r in rmap.register_map(8, 4, 1024)}
    assert regs["id"].offset == 0 and regs["id"].reset >> 16 == 0x5446
    assert regs["ft_write"].offset == 0x10 and regs["ft_read_data"].offset == 0x18
    assert regs["sl_to_vl_15"].offset == 0x7C
    assert regs["port3_ctrl"].offset == 0x160 and regs["port3_vl2_weight"].offset == 0x16C
    assert regs["port3_vl1_drop_vcrc"].offset == 0x1000 + 0x300 + 0x40 + 4 * 5
    assert regs["port7_vl3_drop_unknown_dlid"].offset == 0x1000 + 0x700 + 0xC0 + 4 * 14
    names = [n for n in rmap.COUNTER_NAMES if n.startswith("drop_")]
    from hdl.link.link_receiver import DROP_REASONS
    assert names == [f"drop_{r}" for r in DROP_REASONS] + ["drop_unknown_dlid",
                                                           "drop_hoq_lifetime"]
    assert regs["hoq_lifetime"].offset == 0x1C
    offsets = [r.offset for r in regs.values()]
    assert len(offsets) == len(set(offsets))


@pytest.mark.parametrize("kwargs", [dict(ports=1), dict(ports=17), dict(num_vls=0),
                                    dict(num_vls=5), dict(lids=1000), dict(lids=1 << 17),
                                    dict(addr_width=12), dict(addr_width=33), dict(ports=4.0)])
def test_switch_registers_parameters_validated(kwargs):
    from hdl.switch.switch_registers import SwitchRegisters
    with quiet_unused(), pytest.raises(ValueError, match="Ports|VLs|LIDs|Address width"):
        SwitchRegisters(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(ports=1), dict(ports=17), dict(lids=3), dict(lids=0),
                                    dict(lids=1 << 17), dict(ports=8.0)])
def test_forwarding_table_parameters_validated(kwargs):
    from hdl.switch.forwarding_table import ForwardingTable
    with quiet_unused(), pytest.raises(ValueError, match="Ports|LIDs"):
        ForwardingTable(**kwargs)


@pytest.mark.parametrize("data_width", [16, 48, 128, "32"])
def test_axi_lite_data_width_validated(data_width):
    from hdl.axi_lite import AxiLiteSignature
    with pytest.raises(ValueError, match="data width must be 32 or 64"):
        AxiLiteSignature(16, data_width=data_width)


@contextlib.contextmanager
def quiet_unused():
    """A component whose constructor raised still exists and would warn, when collected,
    that it was never elaborated: collect it here, with that warning ignored."""
    from amaranth.hdl import UnusedElaboratable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            yield
        finally:
            gc.collect()
