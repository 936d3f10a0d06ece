"""PacketGenerator and PacketChecker (tb/gateware) under Verilator.

A tiny simulation top joins them: generator -> fault injector -> checker, or,
with ``capture`` set, generator -> the ``tap`` port, where a Python
:class:`tb.beats.PacketSink` collects the packets for :func:`models.packet.parse_packet`.

* ``random_traffic``: phases of random payload ranges, gaps, checker stall rates
  and VL spreading; every packet good, counts and bytes exact; at gap 0 and no
  stalls the stream is back to back (one beat per cycle).
* ``generator_matches_models``: captured packets parse with the Python models:
  ICRC right, PktLen, DLID/SLID/VL/SL/DestQP, SEND_ONLY, PSN in sequence, payload
  equal to ``payload_bytes``; ICRCs that spill into one more beat are covered.
* ``error_injection``: a payload bit, an ICRC bit, a PktLen bit, end_bad and a
  dropped packet on a chosen packet each move exactly their counter.
* ``random_destinations``: ``dlid_count`` / ``dlid_exclude`` spread DLIDs uniformly
  over the destinations but the excluded one, ``sl_from_vl`` puts the VL in the SL,
  and ``rate`` offers the requested load (Bernoulli arrivals).
* ``psn_increasing``: with dropped packets, the checker's strictly-increasing PSN
  mode counts no error, and its per-source counters add up; the +1 mode counts the
  gap (test_checker_psn_modes checks repeated and earlier PSNs, in Amaranth's simulator).
* ``saturated_speed``: 100k cycles of saturated traffic with no Python per
  cycle; logs simulated cycles per wall-second (in ``speed.json`` of the run
  directory too, and printed by the pytest launcher).
"""
import json
import random
import time

import cocotb
import pytest
from amaranth import C, Cat, DomainRenamer, Elaboratable, Module, Mux, Signal, Value
from amaranth.lib import stream, wiring
from amaranth.lib.fifo import SyncFIFOBuffered
from amaranth.lib.wiring import In, Out
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge, Timer

from hdl.link.signatures import BeatLayout
from models.packet import parse_packet
from tb import runner
from tb.beats import CycleLoop, PacketSink, backpressure_random
from tb.gateware.packet_checker import ERROR_COUNTERS, PacketChecker
from tb.gateware.packet_generator import (OVERHEAD_BYTES, PacketGenerator, core_domain, payload_bytes,
                                          registered)

CLOCK_NS = 2.5
NUM_VLS = 2
SOURCES = 16

# inject_kind values of the sim top, and the checker counter each one moves.
INJECT = {"payload": (1, "bad_payload"), "icrc": (2, "bad_icrc"), "drop": (3, "out_of_order"),
          "end_bad": (4, "end_bad"), "pktlen": (5, "bad_length")}


# --- Simulation top ----------------------------------------------------------------------------

class GatewareTop(wiring.Component):
    """Generator -> injector -> checker; ``capture`` sends the generator to ``tap`` instead.

    The generator's ports appear as ``gen_<name>``, the checker's as ``chk_<name>``.
    ``inject_kind`` (1 payload bit, 2 ICRC bit, 3 drop, 4 end_bad, 5 PktLen bit)
    alters the packet whose index, counted at the injector since reset
    (``inject_seen`` so far), is ``inject_packet``. The top's own inputs are
    registered and ``tap`` comes out of a small FIFO, so no input of the Verilated
    model reaches the generator's or checker's logic combinationally (see
    :func:`tb.gateware.packet_generator.core_domain`).
    """

    def __init__(self, width, num_vls=NUM_VLS, sources=SOURCES):
        self.width = width
        self.generator = PacketGenerator(width, num_vls)
        self.checker = PacketChecker(width, sources, per_source=True)
        members = {}
        for prefix, block, skip in (("gen", self.generator, "data_out"), ("chk", self.checker, "data_in")):
            for name, member in block.signature.members.items():
                if name != skip:
                    members[f"{prefix}_{name}"] = member
        members.update({
            "capture": In(1),
            "tap": Out(stream.Signature(BeatLayout(width))),
            "inject_kind": In(3),
            "inject_packet": In(32),
            "inject_seen": Out(32),
        })
        super().__init__(members)

    def elaborate(self, platform):
        # Everything below one level: only the top module's signals are public (tb.runner.run).
        m = Module()
        m.submodules.core = _TopCore(self)
        return m


class _TopCore(Elaboratable):
    def __init__(self, top):
        self.top = top

    def elaborate(self, platform):
        m = Module()
        top = self.top
        width = top.width
        m.submodules.generator = gen = top.generator
        m.submodules.checker = chk = top.checker
        for prefix, block, skip in (("gen", gen, "data_out"), ("chk", chk, "data_in")):
            for name, member in block.signature.members.items():
                if name == skip:
                    continue
                outer, inner = getattr(top, f"{prefix}_{name}"), getattr(block, name)
                pairs = list(zip(outer, inner)) if member.dimensions else [(outer, inner)]
                for o, i in pairs:
                    m.d.comb += i.eq(o) if member.flow == In else o.eq(i)

        core = core_domain(m, "top_core")
        capture = registered(m, core, top.capture)
        inject_kind = registered(m, core, top.inject_kind)
        inject_packet = registered(m, core, top.inject_packet)
        m.submodules.tap_fifo = tap_fifo = DomainRenamer(core)(
            SyncFIFOBuffered(width=len(Value.cast(gen.data_out.payload)), depth=4))
        m.d.comb += [
            tap_fifo.w_data.eq(gen.data_out.payload),
            tap_fifo.w_en.eq(gen.data_out.valid & capture),
            top.tap.payload.eq(tap_fifo.r_data),
            top.tap.valid.eq(tap_fifo.r_rdy),
            tap_fifo.r_en.eq(top.tap.ready),
        ]

        src = gen.data_out
        beat = src.payload
        checking = ~capture
        # Which packet is passing, and which of its beats.
        index_kept = Signal(32)
        beat_kept = Signal(16)
        index = Mux(beat.start, top.inject_seen, index_kept)
        beat_index = Mux(beat.start, 0, beat_kept)
        passing = src.valid & src.ready & checking
        with m.If(passing):
            m.d[core] += beat_kept.eq(beat_index + 1)
            with m.If(beat.start):
                m.d[core] += [top.inject_seen.eq(top.inject_seen + 1), index_kept.eq(top.inject_seen)]
        target = Signal()
        m.d.comb += target.eq(index == inject_packet)
        kind = inject_kind
        flip = Signal(8 * width)
        payload_beat, payload_lane = divmod(20, width)     # first payload byte
        with m.If(target):
            with m.If((kind == 1) & (beat_index == payload_beat)):
                m.d.comb += flip.eq(1 << 8 * payload_lane)
            with m.If((kind == 2) & beat.end):             # last byte of the ICRC
                m.d.comb += flip.eq((C(1, 8 * width + 8) << Cat(C(0, 3), beat.count)) >> 8)
            with m.If((kind == 5) & beat.start):           # LRH byte 5 bit 0: PktLen's LSB
                m.d.comb += flip.eq(1 << 40)
        drop = target & (kind == 3)

        m.d.comb += [
            chk.data_in.valid.eq(src.valid & checking & ~drop),
            chk.data_in.payload.eq(beat),
            chk.data_in.payload.data.eq(beat.data ^ flip),
            chk.data_in.payload.end_bad.eq(beat.end_bad | (target & (kind == 4) & beat.end)),
            src.ready.eq(Mux(capture, tap_fifo.w_rdy, drop | chk.data_in.ready)),
        ]
        return m


# --- Testbench ---------------------------------------------------------------------------------

CHECKER_COUNTERS = ("received_packets", "good_packets", "good_bytes", *ERROR_COUNTERS,
                    "stray_beats", "beats", "first_start_cycle", "last_end_cycle", "cycle")


class TB:
    def __init__(self, dut):
        self.dut = dut
        self.width = runner.tb_params()["width"]
        # The clock toggled from C (GPI), not a Python coroutine: two Python wake-ups per cycle
        # would cap the saturated run at a few ten thousand cycles per second.
        Clock(dut.clk, CLOCK_NS, "ns", impl="gpi").start()

    async def reset(self):
        dut = self.dut
        defaults = dict(enable=0, clear=0, packets=0, payload_min=0, payload_max=0, dlid=0x0101,
                        slid=0x0005, vl=0, sl=0, vl_spread=0, destqp=0x000123, gap=0,
                        dlid_count=0, dlid_exclude=0, rate=0, seed=0, sl_from_vl=0)
        self.gen(**defaults)
        dut.chk_stall_rate.value = 0
        dut.chk_psn_increasing.value = 0
        dut.chk_clear.value = 0
        dut.capture.value = 0
        dut.tap__ready.value = 0
        dut.inject_kind.value = 0
        dut.inject_packet.value = 0
        dut.rst.value = 1
        for _ in range(3):
            await RisingEdge(dut.clk)
        dut.rst.value = 0
        await RisingEdge(dut.clk)

    def gen(self, **values):
        for name, value in values.items():
            getattr(self.dut, f"gen_{name}").value = value

    def generator_status(self):
        return {name: int(getattr(self.dut, f"gen_{name}").value)
                for name in ("sent_packets", "sent_bytes", "done")}

    def checker(self):
        return {name: int(getattr(self.dut, f"chk_{name}").value) for name in CHECKER_COUNTERS}

    async def clear(self):
        """Zero the counters. Control inputs act a cycle late (they are registered), and a value
        read right after an edge is the one that edge saw: wait until the zeros show."""
        self.gen(clear=1)
        self.dut.chk_clear.value = 1
        await RisingEdge(self.dut.clk)
        self.gen(clear=0)
        self.dut.chk_clear.value = 0
        for _ in range(3):
            await RisingEdge(self.dut.clk)

    async def wait(self, condition, limit, step=512):
        """Poll ``condition`` every ``step`` cycles; no Python runs in between."""
        waited = 0
        while not condition():
            assert waited < limit, f"condition not met within {limit} cycles"
            await Timer(step * CLOCK_NS, "ns")
            await RisingEdge(self.dut.clk)
            waited += step + 1

    async def send(self, packets, limit):
        """Clear, send ``packets`` with the generator settings in force, and wait for the checker."""
        await self.clear()
        self.gen(packets=packets, enable=1)
        await self.wait(lambda: self.generator_status()["done"], limit)
        self.gen(enable=0)
        await self.wait(lambda: self.checker()["received_packets"] >= packets, limit=2000, step=16)
        return self.generator_status(), self.checker()


def beats_of(payload, width):
    return -(-(payload + OVERHEAD_BYTES) // width)


@cocotb.test()
async def random_traffic(dut):
    """Random sizes, gaps, stalls and VL spreading: every packet good, counts exact."""
    tb = TB(dut)
    await tb.reset()
    rng = random.Random(11)
    width = tb.width
    ranges = [(0, 0), (4, 4), (0, 64), (0, 512), (60, 68), (256, 2048), (4096, 4096), (0, 4096),
              (8164, 8164)]
    total = 0
    for phase in range(14):
        low, high = ranges[phase] if phase < len(ranges) else rng.choice(ranges)
        gap = 0 if phase < len(ranges) else rng.choice([0, 1, 7])
        stall = 0 if phase % 2 == 0 else rng.choice([20, 128, 192])
        mean_beats = beats_of((low + high) // 2, width)
        packets = max(20, min(600, 30000 // mean_beats))
        tb.gen(payload_min=low, payload_max=high, gap=gap, slid=0x40 + phase,
               vl_spread=rng.randrange(2), vl=rng.randrange(NUM_VLS), dlid=rng.getrandbits(16))
        dut.chk_stall_rate.value = stall
        limit = packets * (mean_beats * 256 // (256 - stall) + gap + 4) * 3 + 4000
        sent, seen = await tb.send(packets, limit)
        where = f"phase {phase} payload {low}..{high} gap {gap} stall {stall}"
        assert sent["sent_packets"] == packets, where
        for name in ERROR_COUNTERS + ("stray_beats",):
            assert seen[name] == 0, f"{where}: {name} = {seen[name]} ({seen})"
        assert seen["received_packets"] == seen["good_packets"] == packets, f"{where}: {seen}"
        assert seen["good_bytes"] == sent["sent_bytes"], f"{where}: {seen} {sent}"
        assert low * packets <= seen["good_bytes"] <= high * packets, where
        span = seen["last_end_cycle"] - seen["first_start_cycle"] + 1
        if stall == 0 and gap == 0:
            assert seen["beats"] == span, f"{where}: {seen['beats']} beats in {span} cycles: not back to back"
        elif stall == 0:
            assert seen["beats"] + gap * (packets - 1) == span, f"{where}: gap not honoured"
        total += packets
        dut._log.info(f"{where}: {packets} packets, {seen['good_bytes']} payload bytes, "
                      f"{seen['beats']} beats in {span} cycles")
    dut._log.info(f"{total} packets checked in gateware")


@cocotb.test()
async def generator_matches_models(dut):
    """The generator's packets, captured in Python, parse with models.packet."""
    tb = TB(dut)
    await tb.reset()
    width = tb.width
    rng = random.Random(3)
    loop = CycleLoop(dut.clk)
    sink = loop.add(PacketSink(dut, "tap", width, backpressure=backpressure_random(rng, 0.3)))
    dut.capture.value = 1
    fields = dict(dlid=0xBEEF, slid=0x1234, vl=1, sl=9, destqp=0xABCDEF)
    expected_vls = []
    spills = 0
    psns = []
    sent_bytes = 0
    # Payload ranges: small ones hit every ICRC position in the last beat (and its spill).
    for spread, low, high, packets, gap in ((0, 0, 600, 160, 0), (1, 0, 2 * width, 80, 2),
                                            (0, 4096, 4096, 4, 0)):
        await tb.clear()
        tb.gen(payload_min=low, payload_max=high, packets=packets, gap=gap, vl_spread=spread,
               enable=1, **fields)
        first = len(sink.packets)
        await loop.run(until=lambda: len(sink.packets) == first + packets,
                       limit=packets * (beats_of(high, width) + gap + 2) * 4 + 2000)
        tb.gen(enable=0)
        await loop.run(cycles=2)            # a value read right after an edge is the one it saw
        status = tb.generator_status()
        assert status["sent_packets"] == packets and status["done"]
        sent_bytes += status["sent_bytes"]
        expected_vls += [(k % NUM_VLS) if spread else fields["vl"] for k in range(packets)]
        for packet, _, _, _ in sink.packets[first:]:
            parsed = parse_packet(packet)
            assert low <= len(parsed.payload) <= high and len(parsed.payload) % 4 == 0
            spills += (len(packet) - 4) % width == 0
    assert not sink.errors, sink.errors
    assert len(set(len(p) for p, *_ in sink.packets)) > 50, "payload lengths should vary"
    for number, (packet, end_bad, _, _) in enumerate(sink.packets):
        parsed = parse_packet(packet)
        where = f"packet {number} ({len(packet)} bytes)"
        assert not end_bad, where
        assert parsed.icrc_ok, f"{where}: ICRC wrong"
        assert parsed.lrh.pktlen * 4 == len(packet), where
        assert (parsed.lrh.dlid, parsed.lrh.slid, parsed.lrh.sl) == (fields["dlid"], fields["slid"], fields["sl"]), where
        assert parsed.lrh.vl == expected_vls[number], where
        assert parsed.lrh.lnh == 0b10 and parsed.grh is None, where
        assert parsed.bth.opcode == 0x04 and parsed.bth.destqp == fields["destqp"], where
        assert parsed.bth.pkey == 0xFFFF and parsed.bth.padcnt == 0, where
        assert parsed.payload == payload_bytes(parsed.bth.psn, parsed.lrh.slid, len(parsed.payload)), \
            f"{where}: payload differs from payload_bytes"
        psns.append(parsed.bth.psn)
    assert psns == list(range(len(sink.packets))), "PSN must count 0, 1, 2, ... from reset"
    assert sent_bytes == sum(len(p) - OVERHEAD_BYTES for p, *_ in sink.packets)
    assert spills > 0, "no packet had its ICRC spill into one more beat"
    dut._log.info(f"{len(sink.packets)} packets parsed with models.packet, {spills} with a spilled ICRC")


@cocotb.test()
async def error_injection(dut):
    """Each injected fault moves exactly its own counter, once."""
    tb = TB(dut)
    await tb.reset()
    tb.gen(payload_min=4, payload_max=300, gap=1)
    dut.chk_stall_rate.value = 40
    packets = 12
    for name, (kind, counter) in INJECT.items():
        target = int(dut.inject_seen.value) + 5
        dut.inject_packet.value = target
        dut.inject_kind.value = kind
        await tb.clear()
        tb.gen(packets=packets, enable=1)
        await tb.wait(lambda: tb.generator_status()["done"], 20000, step=64)
        tb.gen(enable=0)
        arriving = packets - (name == "drop")
        await tb.wait(lambda: tb.checker()["received_packets"] >= arriving, 2000, step=16)
        await Timer(50 * CLOCK_NS, "ns")
        await RisingEdge(dut.clk)
        dut.inject_kind.value = 0
        seen = tb.checker()
        assert int(dut.inject_seen.value) == target - 5 + packets
        assert seen["received_packets"] == arriving, f"{name}: {seen}"
        assert seen[counter] == 1, f"{name}: {counter} = {seen[counter]} ({seen})"
        for other in ERROR_COUNTERS:
            if other != counter:
                assert seen[other] == 0, f"{name}: {other} = {seen[other]} ({seen})"
        assert seen["good_packets"] == arriving - 1, f"{name}: {seen}"
        dut._log.info(f"inject {name}: {counter} = 1, good {seen['good_packets']} of {arriving}")


@cocotb.test()
async def random_destinations(dut):
    """dlid_count / dlid_exclude, sl_from_vl, and the offered load of ``rate``."""
    tb = TB(dut)
    await tb.reset()
    width = tb.width
    loop = CycleLoop(dut.clk)
    sink = loop.add(PacketSink(dut, "tap", width))
    dut.capture.value = 1
    base, count, exclude, packets = 0x0200, 5, 2, 800
    await tb.clear()
    tb.gen(payload_min=0, payload_max=64, packets=packets, dlid=base, dlid_count=count,
           dlid_exclude=exclude, vl_spread=1, sl_from_vl=1, seed=0x1234567, enable=1)
    await loop.run(until=lambda: len(sink.packets) == packets, limit=packets * 20 + 2000)
    tb.gen(enable=0)
    hits = {}
    for packet, end_bad, _, _ in sink.packets:
        parsed = parse_packet(packet)
        assert parsed.icrc_ok and not end_bad
        assert parsed.lrh.sl == parsed.lrh.vl
        hits[parsed.lrh.dlid] = hits.get(parsed.lrh.dlid, 0) + 1
    wanted = [base + k for k in range(count) if k != exclude]
    assert sorted(hits) == wanted, f"DLIDs {sorted(hits)}, wanted {wanted}"
    for dlid, n in hits.items():       # 200 expected each; 5 sigma is about 60
        assert abs(n - packets / len(wanted)) < 60, f"DLID {dlid:#x}: {n} of {packets} ({hits})"
    # Exclude beyond the count: every destination; count 1: always the base.
    for count, exclude, wanted in ((3, 7, [base, base + 1, base + 2]), (1, 5, [base])):
        await tb.clear()
        first = len(sink.packets)
        tb.gen(packets=60, dlid_count=count, dlid_exclude=exclude, enable=1)
        await loop.run(until=lambda: len(sink.packets) == first + 60, limit=5000)
        tb.gen(enable=0)
        seen = sorted({parse_packet(p).lrh.dlid for p, *_ in sink.packets[first:]})
        assert seen == wanted, f"count {count} exclude {exclude}: {seen}"
    dut._log.info(f"random DLIDs: {hits}")

    # Offered load: Bernoulli arrivals at rate = 65536 * load / beats, measured at the checker.
    dut.capture.value = 0
    await loop.run(cycles=8)
    payload = 256
    beats = beats_of(payload, width)
    for load in (0.1, 0.5, 0.9):
        tb.gen(payload_min=payload, payload_max=payload, packets=0, dlid_count=0, vl_spread=0,
               sl_from_vl=0, rate=round(65536 * load / beats), seed=0xC0FFEE + beats)
        await tb.clear()
        tb.gen(enable=1)
        cycles = 40_000
        await Timer(cycles * CLOCK_NS, "ns")
        await RisingEdge(dut.clk)
        seen = tb.checker()
        tb.gen(enable=0)
        measured = seen["beats"] / cycles
        assert abs(measured - load) < 0.03, f"load {load}: {measured:.3f} of the beats"
        assert seen["good_packets"] == seen["received_packets"]
        dut._log.info(f"rate for load {load}: {measured:.3f} of the beats, backlog "
                      f"{int(dut.gen_backlog.value)}")
        await Timer(3000 * CLOCK_NS, "ns")
        await RisingEdge(dut.clk)
    tb.gen(rate=0)


@cocotb.test()
async def psn_increasing(dut):
    """Dropped packets: no error in the strictly-increasing mode, one gap in the +1 mode;
    per-source counters."""
    tb = TB(dut)
    await tb.reset()
    kind, _ = INJECT["drop"]
    tb.gen(payload_min=4, payload_max=200, gap=0, slid=0x0037)
    packets = 30
    for increasing, expected_errors in ((1, 0), (0, 1)):
        dut.chk_psn_increasing.value = increasing
        dut.inject_packet.value = int(dut.inject_seen.value) + 7
        dut.inject_kind.value = kind
        await tb.clear()
        tb.gen(packets=packets, enable=1)
        await tb.wait(lambda: tb.generator_status()["done"], 20000, step=64)
        tb.gen(enable=0)
        await tb.wait(lambda: tb.checker()["received_packets"] >= packets - 1, 2000, step=16)
        await Timer(50 * CLOCK_NS, "ns")
        await RisingEdge(dut.clk)
        dut.inject_kind.value = 0
        seen = tb.checker()
        assert seen["out_of_order"] == expected_errors, f"increasing={increasing}: {seen}"
        assert seen["good_packets"] == packets - 1 - expected_errors, seen
        source = 0x37 % SOURCES
        per_source = [int(getattr(dut, f"chk_source_packets__{s}").value) for s in range(SOURCES)]
        assert per_source[source] == seen["good_packets"], per_source
        assert int(getattr(dut, f"chk_source_bytes__{source}").value) == seen["good_bytes"]
        assert sum(per_source) == per_source[source], per_source
    dut.chk_psn_increasing.value = 0


@cocotb.test()
async def saturated_speed(dut):
    """100k cycles of saturated generator -> checker; logs simulated cycles per wall-second."""
    tb = TB(dut)
    await tb.reset()
    cycles = 100_000
    tb.gen(payload_min=256, payload_max=4096, gap=0, packets=0)
    await tb.clear()
    tb.gen(enable=1)
    wall = time.perf_counter()
    await Timer(cycles * CLOCK_NS, "ns")
    wall = time.perf_counter() - wall
    await RisingEdge(dut.clk)
    tb.gen(enable=0)
    await Timer(3000 * CLOCK_NS, "ns")
    await RisingEdge(dut.clk)
    seen, sent = tb.checker(), tb.generator_status()
    for name in ERROR_COUNTERS + ("stray_beats",):
        assert seen[name] == 0, f"{name} = {seen[name]}"
    assert seen["good_packets"] == sent["sent_packets"] and seen["good_bytes"] == sent["sent_bytes"]
    span = seen["last_end_cycle"] - seen["first_start_cycle"] + 1
    assert seen["beats"] == span, f"{seen['beats']} beats in {span} cycles: not back to back"
    wire = (seen["good_bytes"] + OVERHEAD_BYTES * seen["good_packets"]) / (span * tb.width)
    payload = seen["good_bytes"] / (span * tb.width)
    rate = cycles / wall
    result = {"width": tb.width, "cycles": cycles, "wall_s": round(wall, 3),
              "cycles_per_s": round(rate), "packets": seen["good_packets"],
              "payload_bytes": seen["good_bytes"], "beat_utilisation": round(wire, 4),
              "payload_fraction": round(payload, 4)}
    with open("speed.json", "w") as f:
        json.dump(result, f)
    dut._log.info(f"saturated {tb.width}-byte beats: {cycles} cycles in {wall:.3f} s wall = "
                  f"{rate:,.0f} simulated cycles/s; {seen['good_packets']} packets, "
                  f"bytes {wire:.4f} of the beats, payload {payload:.4f}")


# --- pytest launcher ---------------------------------------------------------------------------

def factory(width):
    return GatewareTop(width)


# make test runs the 64-byte build the benches use; the 16-byte one (25 s of CPU) under make
# test-full since 2026-12-08.
@pytest.mark.parametrize("width", [64, pytest.param(16, marks=pytest.mark.full)])
def test_packet_gateware(width):
    t0 = time.monotonic()
    test_dir = runner.run(module="tb.test_packet_gateware", toplevel="packet_gateware_top",
                          factory=factory, params={"width": width}, expect_tests=6)
    speed = json.loads((test_dir / "speed.json").read_text())
    print(f"packet gateware width {width}: {time.monotonic() - t0:.1f} s; {speed}")


@pytest.mark.parametrize("kwargs", [dict(width=12), dict(num_vls=0), dict(num_vls=16)])
def test_generator_parameters_validated(kwargs):
    with pytest.raises(ValueError):
        PacketGenerator(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(width=4), dict(sources=3), dict(sources=0), dict(sources=512),
                                    dict(psn_vls=3)])
def test_checker_parameters_validated(kwargs):
    with pytest.raises(ValueError):
        PacketChecker(**kwargs)


def test_payload_reference():
    """payload_bytes: word n of the packet is x_n, payload word k is x_{k+5}; prefixes agree."""
    from tb.gateware.packet_generator import SEED_ZERO, payload_seed, xorshift32
    x = payload_seed(7, 9)
    for _ in range(5):
        x = xorshift32(x)
    assert payload_bytes(7, 9, 4) == x.to_bytes(4, "little")
    assert payload_bytes(7, 9, 400)[:100] == payload_bytes(7, 9, 100)
    assert payload_bytes(7, 9, 64) != payload_bytes(8, 9, 64) != payload_bytes(7, 10, 64)
    assert payload_seed(0xE667, 0x6A09) == SEED_ZERO     # the one seed xorshift could not leave


def _pysim_checker(packets, width=32, **kwargs):
    """Feed ``packets`` (bytes) back to back through a PacketChecker in Amaranth's simulator."""
    from tb.amaranth_sim import simulate

    mode = kwargs.pop("psn_increasing", 0)
    dut = PacketChecker(width, sources=4, **kwargs)
    result = {}

    async def bench(ctx):
        ctx.set(dut.psn_increasing, mode)
        await ctx.tick().repeat(4)
        for packet in packets:
            chunks = [packet[k:k + width] for k in range(0, len(packet), width)]
            for n, chunk in enumerate(chunks):
                ctx.set(dut.data_in.valid, 1)
                ctx.set(dut.data_in.payload, {"data": int.from_bytes(chunk, "little"),
                                              "start": n == 0, "end": n == len(chunks) - 1,
                                              "count": len(chunk), "end_bad": 0})
                await ctx.tick()
            ctx.set(dut.data_in.valid, 0)
            await ctx.tick()
        await ctx.tick().repeat(4)
        result.update({name: ctx.get(getattr(dut, name)) for name in
                       ("received_packets", "good_packets", *ERROR_COUNTERS)})

    simulate(dut, bench)
    assert result["received_packets"] == len(packets), result
    return result


def _send_only(psn, slid=0x21, vl=0):
    from models.ib import BTH
    from models.packet import build_packet
    return build_packet(bth=BTH(opcode=0x04, pkey=0xFFFF, destqp=1, psn=psn),
                        payload=payload_bytes(psn, slid, 8), dlid=3, slid=slid, vl=vl)


def test_checker_psn_modes():
    """The checker's PSN modes on hand-made PSN sequences (Amaranth's simulator, width 32):
    +1 steps, or strictly increasing in a 2^23 window (gaps allowed; repeats, earlier
    PSNs and jumps of 2^23 or more counted)."""
    psns = [5, 6, 9, 9, 8, 0x40, 0x40 + (1 << 23) + 1, 0x41]
    # +1 mode: all but 6 wrong. Increasing: 9 after 6 fine, the repeated 9 and the earlier 8
    # wrong, 0x40 fine, 0x40 + 2^23 + 1 is 2^23 ahead (outside the window): wrong; the tracker
    # follows every packet, and 0x41 is 2^23 - 1 after that one (mod 2^24): fine.
    packets = [_send_only(psn) for psn in psns]
    for mode, errors in {0: 6, 1: 3}.items():
        result = _pysim_checker(packets, psn_increasing=mode)
        assert result["out_of_order"] == errors, f"mode {mode}: {result}"
        assert result["good_packets"] == len(psns) - errors, f"mode {mode}: {result}"


def test_checker_psn_per_vl():
    """``psn_vls=2``: one PSN tracker per (source, VL), as order holds behind a switch."""
    packets = [_send_only(psn, vl=vl) for vl, psn in ((0, 1), (1, 0), (0, 3), (1, 2), (1, 2))]
    assert _pysim_checker(packets, psn_increasing=1, psn_vls=2)["out_of_order"] == 1   # the repeat
    assert _pysim_checker(packets, psn_increasing=1)["out_of_order"] == 3
