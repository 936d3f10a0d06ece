"""Switch benchmarks (cocotb): zero-load hop latency, saturation throughput, latency against
load, incast.

Run by ``make bench`` / ``python -m tb.bench --only switch`` through tb/bench.py on
:class:`tb.switch_bench_top.SwitchBenchTop`: packet generators and checkers in gateware on
every host port, latency stamped and histogrammed in gateware at the switch's own pins, so
no Python runs per cycle while traffic flows (``Clock(impl="gpi")``, ``Timer`` waits,
counters read at the ends of a window). Records go to the file named by
``BENCH_RECORDS``; the scenario comes in ``TB_PARAMS``. All figures are simulated cycles.

Definitions (docs/performance.md, Switch):

* throughput: payload bytes the checkers accepted as good in the window /
  (window cycles x beat width), per output port, averaged over the ports;
* latency: start beat on the switch's ``wire_in`` to start beat on its ``wire_out``;
* incast utilization: data beats on the target's ``wire_out`` / window cycles, with all
  senders backlogged; Jain's index over the payload bytes per source at the target.
"""
import json
import os
import time

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge, Timer

from hdl.link.signatures import LinkState
from tb import runner
from tb.runner import bench_record as record
from tb.switch_bench_top import GEN_SHARED, LID_BASE

OVERHEAD = 8 + 12 + 4 + 2           # LRH + BTH + ICRC + VCRC around a SEND_ONLY payload
# The histogram memories keep their contents through a reset (each cocotb test resets the
# design): bins above the largest latency any test of this run has seen are still zero.
_HIST_TOP = [0]


def jain(values):
    values = list(values)
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


def percentile(hist, q):
    """The smallest latency with at least ``q`` of the samples at or below it."""
    total = sum(hist)
    if not total:
        return None
    need = q * total
    running = 0
    for latency, count in enumerate(hist):
        running += count
        if running >= need:
            return latency
    return len(hist) - 1


class SwitchBench:
    def __init__(self, dut):
        self.dut = dut
        self.params = {**runner.tb_params(), **json.loads(os.environ.get("BENCH_SETTINGS", "{}"))}
        self.ports = self.params["ports"]
        self.width = self.params["width"]
        self.clock_ns = self.params.get("clock_ns", 2.5)
        Clock(dut.clk, self.clock_ns, "ns", impl="gpi").start()

    def wire_beats(self, payload):
        return -(-(payload + OVERHEAD) // self.width)

    def config(self, **extra):
        p = self.params
        config = {"ports": self.ports, "width": self.width, "clock_mhz": round(1000 / self.clock_ns, 3),
                  "num_vls": p["num_vls"], "mtu": p["mtu"], "mode": p["mode"],
                  "allocator": p["allocator"], "islip_iterations": p["islip_iterations"],
                  "buffer_blocks": self.switch_blocks, "downstream_blocks": self.host_blocks,
                  "wire_delay_cycles": p["wire_delay"], "fc_period": p["fc_period"],
                  "fc_min_interval": p["fc_min_interval"], "fc_batch_blocks": p["fc_batch_blocks"],
                  "packet": "SEND_ONLY", "vl_weights": 16}
        config.update(extra)
        return config

    def get(self, name, *index):
        suffix = "".join(f"__{k}" for k in index)
        return int(getattr(self.dut, f"{name}{suffix}").value)

    def gen(self, **values):
        for name, value in values.items():
            getattr(self.dut, f"gen_{name}").value = value

    async def cycles(self, n):
        if n > 1:
            await Timer((n - 1) * self.clock_ns, "ns")
        await RisingEdge(self.dut.clk)

    async def start(self):
        from cocotbext.axi import AxiLiteBus, AxiLiteMaster
        dut = self.dut
        self.gen(enable=0, **{name: 0 for name in GEN_SHARED})
        dut.gen_enable.value = 0
        dut.chk_clear.value = 0
        dut.lat_clear.value = 0
        dut.hist_addr.value = 0
        dut.rst.value = 1
        await self.cycles(4)
        dut.rst.value = 0
        await self.cycles(4)
        axi = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "axi", bus_separator="__"), dut.clk, dut.rst)
        for p in range(self.ports):
            await axi.write_dword(0x10, (LID_BASE + p) | p << 16 | 1 << 31)
        active = LinkState.ACTIVE.value
        waited = 0
        while not all(self.get("switch_link_state", p) == active and self.get("host_state", p) == active
                      for p in range(self.ports)):
            assert waited < 20000, "links did not come up"
            await self.cycles(100)
            waited += 100
        self.switch_blocks = self.get("switch_buffer_blocks")
        self.host_blocks = self.get("host_buffer_blocks")
        await self.cycles(50)

    async def pulse(self, name):
        getattr(self.dut, name).value = 1
        await self.cycles(1)
        getattr(self.dut, name).value = 0
        await self.cycles(3)

    async def read_hist(self, top):
        """Histogram bins 0..top (summed over outputs); hist_data is two registers behind."""
        dut = self.dut
        values = []
        for j in range(top + 3):
            dut.hist_addr.value = min(j, top)
            await RisingEdge(dut.clk)
            values.append(int(dut.hist_data.value))
        return values[2:top + 3]

    def lat_top(self):
        now = max(self.get("lat_max", o) for o in range(self.ports))
        _HIST_TOP[0] = min(self.params["hist_bins"] - 1, max(_HIST_TOP[0], now))
        return _HIST_TOP[0]

    def snapshot(self):
        P = self.ports
        return {
            "cycle": self.get("cycle"),
            "good_bytes": [self.get("chk_good_bytes", o) for o in range(P)],
            "good_packets": [self.get("chk_good_packets", o) for o in range(P)],
            "beats": [self.get("out_data_beats", o) for o in range(P)],
            "source_bytes": [[self.get("chk_source_bytes", o, s) for s in range(P)] for o in range(P)],
            "errors": [self.get("chk_errors", o) for o in range(P)],
            "overflow": self.get("switch_overflow") | self.get("host_overflow"),
            "lat_count": [self.get("lat_count", o) for o in range(P)],
        }

    async def window(self, cycles, latency=True):
        """Counters and the latency histogram over ``cycles`` cycles of whatever traffic runs."""
        hist0 = await self.read_hist(self.lat_top()) if latency else []
        before = self.snapshot()
        wall = time.perf_counter()
        await self.cycles(cycles)
        wall = time.perf_counter() - wall
        after = self.snapshot()
        hist1 = await self.read_hist(self.lat_top()) if latency else []
        hist = [b - (hist0[k] if k < len(hist0) else 0) for k, b in enumerate(hist1)]
        span = after["cycle"] - before["cycle"]
        delta = {key: [a - b for a, b in zip(after[key], before[key])]
                 for key in ("good_bytes", "good_packets", "beats", "lat_count")}
        delta["source_bytes"] = [[a - b for a, b in zip(ra, rb)]
                                 for ra, rb in zip(after["source_bytes"], before["source_bytes"])]
        order = [self.get("chk_out_of_order", o) for o in range(self.ports)]
        assert not any(after["errors"]), (f"checker errors per output: {after['errors']} "
                                          f"(out of order {order})")
        assert not after["overflow"], f"receive buffer overflow: {after['overflow']:#x}"
        throughput = [b / (span * self.width) for b in delta["good_bytes"]]
        utilization = [b / span for b in delta["beats"]]
        return {"span": span, "wall": wall, "throughput": throughput, "utilization": utilization,
                "hist": hist, "delta": delta,
                "p50": percentile(hist, 0.50), "p99": percentile(hist, 0.99),
                "samples": sum(hist)}

    async def stop_and_drain(self, limit=200_000):
        self.dut.gen_enable.value = 0
        await self.cycles(10)
        waited = 0
        while True:
            sent = sum(self.get("gen_sent_packets", p) for p in range(self.ports))
            got = sum(self.get("chk_good_packets", p) for p in range(self.ports))
            if got >= sent:
                break
            assert waited < limit, f"{sent - got} packets never delivered"
            await self.cycles(500)
            waited += 500
        errors = [self.get("chk_errors", p) for p in range(self.ports)]
        assert not any(errors), errors
        return sent

    async def clear(self):
        self.gen(clear=1)
        self.dut.chk_clear.value = 1
        await self.cycles(1)
        self.gen(clear=0)
        self.dut.chk_clear.value = 0
        await self.cycles(3)

    async def uniform(self, payload, rate=0, mask=None, seed=0x5EED, vl_spread=1):
        """Every port sends to a uniform other port (saturated at ``rate`` 0)."""
        self.gen(payload_min=payload, payload_max=payload, dlid=LID_BASE, dlid_count=self.ports,
                 rate=rate, seed=seed, vl_spread=vl_spread, packets=0, gap=0)
        await self.clear()
        self.dut.gen_enable.value = (1 << self.ports) - 1 if mask is None else mask


def payload_param(params):
    return params.get("payload", 2020)


@cocotb.test()
async def hop_latency(dut):
    """Zero load: one packet at a time from every input to every output."""
    tb = SwitchBench(dut)
    await tb.start()
    P = tb.ports
    before = await tb.read_hist(tb.lat_top())
    worst, best, samples = 0, None, {}
    payloads = tb.params.get("latency_payloads", [256])
    for payload in payloads:
        for i in range(P):
            for o in range(P):
                tb.gen(payload_min=payload, payload_max=payload, dlid=LID_BASE + o, dlid_count=0,
                       rate=0, packets=1, vl_spread=0, gap=0)
                await tb.clear()
                count = tb.get("lat_count", o)
                dut.gen_enable.value = 1 << i
                waited = 0
                while tb.get("lat_count", o) == count:
                    assert waited < 2000, f"{i}->{o}: no packet"
                    await tb.cycles(20)
                    waited += 20
                dut.gen_enable.value = 0
                latency = tb.get("lat_last", o)
                samples[(payload, i, o)] = latency
                worst = max(worst, latency)
                best = latency if best is None else min(best, latency)
                await tb.cycles(tb.wire_beats(payload) + 40)
    # The histogram saw exactly these samples (checks its read-out as well).
    hist = await tb.read_hist(tb.lat_top())
    hist = [b - (before[k] if k < len(before) else 0) for k, b in enumerate(hist)]
    expected = {}
    for latency in samples.values():
        expected[latency] = expected.get(latency, 0) + 1
    got = {k: v for k, v in enumerate(hist) if v}
    assert got == expected, f"histogram {got} != samples {expected}"
    config = tb.config(payloads=payloads, pairs=f"all {P}x{P} (input, output), self included",
                       load="one packet in the switch at a time")
    dut._log.info(f"hop latency: min {best}, max {worst} cycles over {len(samples)} samples")
    record("switch.hop_latency_cycles", worst, "cycles", config)
    record("switch.hop_latency_ns", worst * tb.clock_ns, "ns", config)
    record("switch.hop_latency_min_cycles", best, "cycles", config)


async def saturate(dut, one_vl=False):
    tb = SwitchBench(dut)
    await tb.start()
    payload = payload_param(tb.params)
    warmup, cycles = tb.params.get("warmup", 20000), tb.params.get("cycles", 60000)
    await tb.uniform(payload, vl_spread=0 if one_vl else 1)
    await tb.cycles(warmup)
    result = await tb.window(cycles)
    sent = await tb.stop_and_drain()
    mean = sum(result["throughput"]) / tb.ports
    name = "uniform_fifo" if tb.params["mode"] == "fifo" else "uniform"
    ceiling = payload / (tb.wire_beats(payload) * tb.width)     # back to back, no idle cycle
    config = tb.config(traffic="uniform over the other ports, saturated", payload_bytes=payload,
                       sls=[0] if one_vl else [0, 1], warmup_cycles=warmup, window_cycles=result["span"],
                       ceiling=round(ceiling, 4),
                       per_port=[round(x, 4) for x in result["throughput"]],
                       wire_utilization=round(sum(result["utilization"]) / tb.ports, 4),
                       latency_p50=result["p50"], latency_p99=result["p99"])
    tag = tb.params.get("record_tag", "") + (".one_vl" if one_vl else "")
    record(f"switch.saturation_throughput.{name}{tag}", round(mean, 4), "fraction of wire", config)
    if one_vl:
        return
    rate = result["span"] / result["wall"]
    record("switch.sim_cycles_per_s" + (".fifo" if tb.params["mode"] == "fifo" else "") + tag,
           round(rate), "cycles/s",
           tb.config(traffic="uniform saturated", payload_bytes=payload, mode=tb.params["mode"],
                     build="Verilator, top module public only, GPI clock"))
    dut._log.info(f"{name}: throughput {mean:.4f} per port {result['throughput']}, p50 "
                  f"{result['p50']} p99 {result['p99']}, {sent} packets, {rate:,.0f} cycles/s")


@cocotb.test()
async def saturation(dut):
    """Uniform saturated traffic: every input always has a packet, destinations uniform
    among the other ports, VL (= SL) alternating packet by packet."""
    await saturate(dut)


@cocotb.test()
async def saturation_one_vl(dut):
    """The same with every packet on VL 0: a host's generator feeds both VLs in turn, so
    with two VLs it waits whenever the next packet's VL has no credit at the switch input
    even if the other VL has; with one VL that source-side coupling is gone."""
    await saturate(dut, one_vl=True)


@cocotb.test()
async def load_sweep(dut):
    """Latency (p50, p99) against offered load, uniform traffic, Bernoulli arrivals."""
    tb = SwitchBench(dut)
    await tb.start()
    payload = payload_param(tb.params)
    beats = tb.wire_beats(payload)
    warmup, cycles = tb.params.get("sweep_warmup", 5000), tb.params.get("sweep_cycles", 20000)
    points = []
    for load in tb.params.get("loads", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]):
        rate = 0 if load >= 1 else round(65536 * load / beats)
        await tb.uniform(payload, rate=rate, seed=0x5EED + int(load * 100))
        await tb.cycles(warmup)
        result = await tb.window(cycles)
        mean = sum(result["throughput"]) / tb.ports
        point = {"load": load, "rate": rate, "p50": result["p50"], "p99": result["p99"],
                 "samples": result["samples"], "throughput": round(mean, 4),
                 "wire_utilization": round(sum(result["utilization"]) / tb.ports, 4)}
        points.append(point)
        dut._log.info(f"load {load}: {point}")
        await tb.stop_and_drain()
    config = tb.config(traffic="uniform over the other ports, Bernoulli arrivals "
                       "(rate = 65536 x load / beats per cycle; load 1.0 saturated)",
                       payload_bytes=payload, sls=[0, 1], warmup_cycles=warmup, window_cycles=cycles)
    load80 = [p for p in points if abs(p["load"] - 0.8) < 1e-9]
    if load80:
        record("switch.p99_latency_cycles.load80", load80[0]["p99"], "cycles",
               {**config, "load": 0.8, "p50": load80[0]["p50"], "samples": load80[0]["samples"]})
    record("switch.latency_vs_load", points, "cycles", config)


@cocotb.test()
async def incast(dut):
    """Every port but ``target`` sends to ``target``, saturated."""
    tb = SwitchBench(dut)
    await tb.start()
    payload = payload_param(tb.params)
    target = 0
    warmup, cycles = tb.params.get("warmup", 20000), tb.params.get("incast_cycles", 40000)
    tb.gen(payload_min=payload, payload_max=payload, dlid=LID_BASE + target, dlid_count=0, rate=0,
           vl_spread=1, packets=0, gap=0, seed=0x1CA5)
    await tb.clear()
    dut.gen_enable.value = ((1 << tb.ports) - 1) & ~(1 << target)
    await tb.cycles(warmup)
    result = await tb.window(cycles)
    await tb.stop_and_drain()
    shares = [result["delta"]["source_bytes"][target][s] for s in range(tb.ports) if s != target]
    utilization = result["utilization"][target]
    config = tb.config(traffic=f"{tb.ports - 1} to 1 (all ports to port {target}), saturated",
                       payload_bytes=payload, sls=[0, 1], warmup_cycles=warmup,
                       window_cycles=result["span"],
                       ceiling=1.0,
                       payload_throughput=round(result["throughput"][target], 4),
                       bytes_per_input=shares, latency_p50=result["p50"], latency_p99=result["p99"])
    record("switch.incast.utilization", round(utilization, 4), "fraction of cycles", config)
    record("switch.incast.jain", round(jain(shares), 5), "index", config)
    dut._log.info(f"incast: utilization {utilization:.4f}, "
                  f"shares {shares}, Jain {jain(shares):.5f}")
