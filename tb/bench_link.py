"""Link benchmarks (cocotb): throughput, zero-load latency, and the credit loop.

Run by ``make bench`` through tb/bench.py, which passes the scenario in
``TB_PARAMS`` and collects the records each test appends to the file named
by ``BENCH_RECORDS``. All figures are
simulated cycles; nanoseconds are cycles times the clock period.
"""
import random

import cocotb
from cocotb.clock import Clock

from models.ib import Opcode
from models.packet import random_packet
from tb import runner
from tb.runner import bench_record as record
from tb.beats import CycleLoop, PacketSink, PacketSource, WireMonitor
from tb.link_pair_tb import bring_up

SEND_ONLY_OVERHEAD = 8 + 12 + 4     # LRH + BTH + ICRC around the payload


class BenchTB:
    def __init__(self, dut):
        self.dut = dut
        self.params = runner.tb_params()
        self.width = self.params["width"]
        self.clock_ns = self.params.get("clock_ns", 2.5)
        cocotb.start_soon(Clock(dut.clk, self.clock_ns, "ns").start())
        self.loop = CycleLoop(dut.clk)
        self.source = self.loop.add(PacketSource(dut, "a_data_in__0", self.width))
        self.sink = self.loop.add(PacketSink(dut, "b_data_out__0", self.width))
        self.monitor = self.loop.add(WireMonitor(dut, "a_wire_monitor", self.width))
        self.rng = random.Random(7)
        self.loop.checks.append(self.check_overflow)
        for side in ("a", "b"):
            for v in range(self.params["num_vls"]):
                getattr(dut, f"{side}_vl_weight__{v}").value = 16
                if (side, v) != ("a", 0):
                    getattr(dut, f"{side}_data_in__{v}__valid").value = 0
                if (side, v) != ("b", 0):
                    getattr(dut, f"{side}_data_out__{v}__ready").value = 1

    def check_overflow(self, cycle):
        assert not int(self.dut.b_overflow.value), f"cycle {cycle}: B's receive buffer overflowed"

    async def start(self, wire_delay):
        await bring_up(self.dut, self.loop, wire_delay=wire_delay)

    def packet(self, payload):
        return random_packet(self.rng, payload_len=payload, vl=0, opcode=Opcode.SEND_ONLY)

    def config(self, **extra):
        keys = ("width", "num_vls", "mtu", "buffer_blocks", "cut_through", "fc_period",
                "fc_min_interval", "fc_batch_blocks")
        config = {key: self.params[key] for key in keys}
        config["clock_mhz"] = round(1000 / self.clock_ns, 3)
        config.update(extra)
        return config

    async def saturate(self, payload, packets, warmup):
        """Offer ``packets`` back to back; throughput over the packets after ``warmup``."""
        for _ in range(packets):
            self.source.send(self.packet(payload))
        await self.loop.run(until=lambda: len(self.sink.packets) == packets, limit=packets * 400 + 20000)
        assert all(not bad for _, bad, *_ in self.sink.packets)
        first_end = self.sink.packets[warmup - 1][3]
        last_end = self.sink.packets[-1][3]
        delivered = (packets - warmup) * payload
        return delivered / ((last_end - first_end) * self.width)


@cocotb.test()
async def throughput(dut):
    """Saturated A->B on one VL, B's consumer always ready, wire delay 0."""
    tb = BenchTB(dut)
    await tb.start(wire_delay=0)
    for payload, packets in tb.params["throughput_sizes"]:
        value = await tb.saturate(payload, packets, warmup=max(2, packets // 10))
        beats = -(-(payload + SEND_ONLY_OVERHEAD + 2) // tb.width)
        record(f"link.throughput.{payload}B", round(value, 4), "fraction of wire", tb.config(
            packet="SEND_ONLY", payload_bytes=payload, wire_delay_cycles=0,
            ceiling=round(payload / (beats * tb.width), 4)))
        tb.sink.packets.clear()


@cocotb.test()
async def throughput_both_ways(dut):
    """4 KiB packets saturating both directions: A->B shares its wire with B's flow-control
    packets for the B->A traffic."""
    tb = BenchTB(dut)
    reverse_source = tb.loop.add(PacketSource(dut, "b_data_in__0", tb.width))
    reverse_sink = tb.loop.add(PacketSink(dut, "a_data_out__0", tb.width))
    await tb.start(wire_delay=0)
    packets = 40
    for _ in range(packets):
        reverse_source.send(tb.packet(4096))
    value = await tb.saturate(4096, packets, warmup=8)
    assert len(reverse_sink.packets) > packets // 2, "the reverse direction must be loaded too"
    record("link.throughput.4096B.both_ways", round(value, 4), "fraction of wire", tb.config(
        packet="SEND_ONLY", payload_bytes=4096, wire_delay_cycles=0, ceiling=round(4096 / (65 * 64), 4)))


@cocotb.test()
async def bringup(dut):
    """Reset released on both ends to both ends ACTIVE (docs/link.md, flow-control
    initialisation), wire delay 0 and the build's longest."""
    tb = BenchTB(dut)
    delay = tb.params["wire_delay"]
    for wire_delay in (0, delay):
        await tb.start(wire_delay=wire_delay)
        record(f"link.bringup_cycles.delay{wire_delay}", tb.loop.cycle, "cycles",
               tb.config(wire_delay_cycles=wire_delay))
        tb.loop.cycle = 0


@cocotb.test()
async def latency(dut):
    """Zero load: start beat into A's transmitter to start beat out of B's receiver, wire delay 0."""
    tb = BenchTB(dut)
    await tb.start(wire_delay=0)
    worst = {"total": 0, "tx": 0, "rx": 0}
    for payload in (0, 64, 256, 1024, 4096):
        tb.source.send(tb.packet(payload))
        await tb.loop.run(until=lambda: len(tb.sink.packets) == 1, limit=5000)
        accepted = tb.source.start_cycles[-1][1]
        on_wire = tb.monitor.data_packets[-1][2]
        delivered = tb.sink.packets[0][2]
        sample = {"total": delivered - accepted, "tx": on_wire - accepted,
                  "rx": delivered - on_wire}
        for key in worst:
            worst[key] = max(worst[key], sample[key])
        tb.sink.packets.clear()
        await tb.loop.run(cycles=50)
    config = tb.config(wire_delay_cycles=0, payloads=[0, 64, 256, 1024, 4096])
    record("link.latency_cycles", worst["total"], "cycles", config)
    record("link.latency_ns", worst["total"] * tb.clock_ns, "ns", config)
    record("link.transmitter_latency_cycles", worst["tx"], "cycles", config)
    record("link.receiver_latency_cycles", worst["rx"], "cycles", config)


@cocotb.test()
async def credit_loop(dut):
    """Saturated 4 KiB packets over cables of increasing delay with this build's buffer."""
    tb = BenchTB(dut)
    for delay in tb.params["sweep_delays"]:
        await tb.start(wire_delay=delay)
        value = await tb.saturate(4096, 40, warmup=8)
        record("link.credit_loop.throughput", round(value, 4), "fraction of wire", tb.config(
            payload_bytes=4096, wire_delay_cycles=delay))
        tb.sink.packets.clear()


@cocotb.test()
async def failure(dut):
    """A cable cut both ways and restored (docs/link.md, Link failure and recovery): cycles from
    the cut to the later end leaving ACTIVE, the cut falling between packets (the idle link's
    flow-control packets only) or inside a 4 KiB packet; and from the cable's return to both
    ends ACTIVE. Needs a build whose cables are the testbench's (``channel="tb"``)."""
    from hdl.link.signatures import LinkState
    from tb.link_pair_tb import CLOCK_NS, TB
    tb = TB(dut, rng=random.Random(5))
    await tb.bring_up()
    active = LinkState.ACTIVE.value
    fc_period = tb.params["fc_period"]
    config = dict(wire_delay_cycles=tb.params["wire_delay"], fc_period=fc_period,
                  stall_timeout=4 * fc_period, fail_timeout=8 * fc_period,
                  clock_mhz=round(1000 / CLOCK_NS, 3))
    channels = list(tb.channels.values())
    for where in ("idle", "mid_packet"):
        await tb.loop.run(cycles=2 * fc_period)
        if where == "mid_packet":
            tb.send("a", 0, random_packet(tb.rng, payload_len=4096, vl=0, opcode=Opcode.SEND_ONLY))
            passing = tb.channels["a", "b"]
            await tb.loop.run(until=lambda: len(passing.passing) >= 8
                              and not passing.passing[-1]["end"], limit=4000)
        cut_at = tb.loop.cycle
        for channel in channels:
            channel.cut = True
        await tb.loop.run(until=lambda: tb.port("state", "a") != active
                          and tb.port("state", "b") != active, limit=3 * 8 * fc_period)
        record(f"link.failure_detect_cycles.{where}", tb.loop.cycle - cut_at, "cycles",
               dict(config, cut=where))
        await tb.loop.run(cycles=64)
        for channel in channels:
            channel.cut = False
        restored_at = tb.loop.cycle
        await tb.wait_active(limit=20 * fc_period)
        if where == "idle":
            record("link.recovery_cycles", tb.loop.cycle - restored_at, "cycles", config)
    await tb.drain()

