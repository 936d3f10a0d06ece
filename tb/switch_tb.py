"""cocotb testbench for :class:`tb.switch_top.SwitchTop`: a switch with a host on every port.

:class:`SwitchTB` owns the clock (2.5 ns, 400 MHz), the reset, a cocotbext-axi
``AxiLiteMaster`` on the switch's registers, and one :class:`tb.beats.CycleLoop` that runs
in the background from reset on (so AXI transactions and traffic overlap freely) with a
:class:`PacketSource` / :class:`PacketSink` per (host port, VL), a monitor on both sides of
every switch port, and a :class:`WireChannel` for each testbench-carried port.

Every packet a test sends is registered with a :class:`models.switch.FlowScoreboard`
(using the testbench's mirror of the forwarding and SL-to-VL tables, updated by the
programming helpers); every packet a host sink takes goes to ``scoreboard.deliver``, so a
lost, duplicated, reordered, corrupted or misrouted packet fails at once or at
:meth:`SwitchTB.check_clean`. Packets a host receives marked end-bad are recorded in
``bad_delivered`` instead (a cut-through hop found them corrupt: they are dropped).
"""
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from hdl.link.link_receiver import DROP_REASONS
from hdl.link.signatures import LinkState
from hdl.switch import register_map as rmap
from models.crc import icrc_bytes
from models.packet import random_packet
from models.switch import FlowScoreboard, ForwardingTable, SlToVl
from tb import runner
from tb.beats import (CycleLoop, PacketSink, PacketSource, WireChannel, WireMonitor,
                      backpressure_random, idle_random)
from tb.credit_monitor import CreditMonitor

__all__ = ["SwitchTB", "CLOCK_NS", "host_lid", "bursty_backpressure", "WireBeatMonitor"]

CLOCK_NS = 2.5
LID_BASE = 0x10


def host_lid(port):
    """The LID of the host on switch port ``port`` (programmed by :meth:`SwitchTB.program_hosts`)."""
    return LID_BASE + port


def bursty_backpressure(rng, probability, mean_burst=40):
    """Stall in bursts: each cycle a non-stalled sink starts a stall with ``probability /
    mean_burst``; a stall lasts a geometric number of cycles of mean ``mean_burst``. Roughly
    ``probability`` of the cycles stalled, in long runs: the switch's output runs out of
    credit."""
    start = probability / mean_burst / max(1e-9, 1 - probability)
    stalled = False
    while True:
        if stalled:
            stalled = rng.random() >= 1 / mean_burst
        else:
            stalled = rng.random() < start
        yield stalled


class Switchable:
    """A backpressure generator that can be changed while it runs: ``gen.set(other)``,
    ``gen.hold(True)`` (never ready) / ``gen.hold(False)`` (always ready)."""

    def __init__(self, inner=None):
        self.inner = inner

    def set(self, inner):
        self.inner = inner

    def hold(self, stalled):
        def const():
            while True:
                yield stalled
        self.inner = const()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.inner) if self.inner is not None else False


class WireBeatMonitor(WireMonitor):
    """A :class:`WireMonitor` that also keeps, per cycle, whether a data beat was on the
    wire (``data_beat_cycles``: the cycles with one) and each data packet's VL and start
    cycle, for utilization and latency."""

    def __init__(self, dut, prefix, width, **kwargs):
        super().__init__(dut, prefix, width, **kwargs)
        self.data_beat_cycles = []
        self.valid_signal = self.signals["valid"]
        self.link_signal = self.signals["link"]

    def sample(self, cycle):
        if not int(self.valid_signal.value):
            return
        if not int(self.link_signal.value):
            self.data_beat_cycles.append(cycle)
        super().sample(cycle)

    def data_beats_between(self, start, end):
        """Data beats on the wire in cycles ``start <= c < end``."""
        import bisect
        return (bisect.bisect_left(self.data_beat_cycles, end)
                - bisect.bisect_left(self.data_beat_cycles, start))


def packet_key(packet):
    """(SLID, DestQP) of a packet (LRH .. ICRC or .. VCRC): unique per packet in these tests,
    and within a 16-byte first beat."""
    return int.from_bytes(packet[6:8], "big"), int.from_bytes(packet[13:16], "big")


class SwitchTB:
    def __init__(self, dut, *, seed=1, idle=0.0, backpressure=0.0, mutate=None, invalid_vl=None):
        self.dut = dut
        self.params = params = runner.tb_params()
        self.ports = params.get("ports", 4)
        self.num_vls = params.get("num_vls", 2)
        self.width = params.get("width", 64)
        self.mtu = params.get("mtu", 4096)
        self.mode = params.get("mode", "voq")
        self.wire_delay = params.get("wire_delay", 2)
        self.fc_period = params.get("fc_period", 1024)
        self.tb_ports = tuple(params.get("tb_ports", ()))
        self.rng = random.Random(seed)
        self.seq = 0
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
        from cocotbext.axi import AxiLiteBus, AxiLiteMaster
        self.axi = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "axi", bus_separator="__"),
                                 dut.clk, dut.rst)
        self.loop = CycleLoop(dut.clk)
        self.sources, self.sinks, self.backpressure = {}, {}, {}
        for p in range(self.ports):
            for v in range(self.num_vls):
                self.sources[p, v] = self.loop.add(PacketSource(
                    dut, f"host{p}_data_in__{v}", self.width,
                    idle=idle_random(random.Random(self.rng.random()), idle)))
                gen = self.backpressure[p, v] = Switchable(
                    backpressure_random(random.Random(self.rng.random()), backpressure)
                    if backpressure else None)
                self.sinks[p, v] = self.loop.add(PacketSink(
                    dut, f"host{p}_data_out__{v}", self.width, backpressure=gen))
                getattr(dut, f"host{p}_vl_weight__{v}").value = rmap.DEFAULT_VL_WEIGHT
        self.egress = [self.loop.add(WireBeatMonitor(dut, f"switch{p}_wire_monitor", self.width))
                       for p in range(self.ports)]
        self.ingress = [self.loop.add(WireBeatMonitor(dut, f"switch{p}_wire_in_monitor", self.width))
                        for p in range(self.ports)]
        self.channels = {
            p: self.loop.add(WireChannel(
                dut, f"host{p}_wire_out", f"switch{p}_wire_in", self.width,
                delay=max(1, self.wire_delay), rng=random.Random(self.rng.random()),
                mutate=mutate, invalid_vl=self.num_vls if invalid_vl is None else invalid_vl))
            for p in self.tb_ports}
        # The credit rule at every sender: the switch's transmitters at its pins, the hosts'
        # seen across their pure-delay cables (a testbench-carried cable may lose beats, so
        # its host is watched at its own wire out).
        self.credit_monitors = []
        for p in range(self.ports):
            out, into = f"switch{p}_wire_monitor", f"switch{p}_wire_in_monitor"
            self.credit_monitors.append(self.loop.add(CreditMonitor(
                dut, out, into, self.width, self.num_vls, name=f"switch port {p}")))
            host_out = (dict(out_prefix=f"host{p}_wire_out") if p in self.tb_ports else
                        dict(out_prefix=into, out_offset=-self.wire_delay))
            self.credit_monitors.append(self.loop.add(CreditMonitor(
                dut, in_prefix=out, in_offset=self.wire_delay, width=self.width,
                num_vls=self.num_vls, name=f"host {p}", **host_out)))
        # Mirrors of the switch's tables (what the scoreboard forwards with).
        self.table = ForwardingTable()
        self.sl_to_vl = SlToVl(self.num_vls)
        self.scoreboard = FlowScoreboard(self.table, self.sl_to_vl, self.num_vls,
                                         ports=self.ports, mtu=self.mtu)
        self.sent = {key: [] for key in self.sources}         # packets handed to each source
        self.expectations = {key: [] for key in self.sources}  # (expect, ports) per packet
        self.started = {key: 0 for key in self.sources}       # start beats already registered
        self.taken = {key: 0 for key in self.sinks}           # sink packets already scored
        self.bad_delivered = []                                # (port, vl, packet) marked end-bad
        self.delivered = []                                    # (cycle, port, vl, packet)
        # Hosts whose deliveries a test accounts for itself (e.g. packets the switch may
        # discard on purpose): collected here instead of being scored.
        self.unscored_ports = set()
        self.unscored = []                                     # (cycle, port, vl, packet)
        self.errors = []
        self.ft_writes = []                                    # (cycle, lid, port, valid)
        self.loop.checks.append(self._check)
        self.loop_task = None

    # --- running ------------------------------------------------------------------------

    def _check(self, cycle):
        # Register packets with the scoreboard in the order their start beats enter the host
        # transmitters (= the order on the wire into the switch, across the host's VLs).
        for key, source in self.sources.items():
            starts = source.start_cycles
            while self.started[key] < len(starts):
                tag, _ = starts[self.started[key]]
                self.started[key] += 1
                expect, ports = self.expectations[key][tag]
                if expect:
                    self.scoreboard.expect(key[0], self.sent[key][tag], ports=ports)
        for key, sink in self.sinks.items():
            packets = sink.packets
            while self.taken[key] < len(packets):
                packet, bad, start, end = packets[self.taken[key]]
                self.taken[key] += 1
                if bad:
                    self.bad_delivered.append((key[0], key[1], packet))
                    continue
                if key[0] in self.unscored_ports:
                    self.unscored.append((end, key[0], key[1], packet))
                    continue
                self.delivered.append((end, key[0], key[1], packet))
                try:
                    self.scoreboard.deliver(key[0], key[1], packet)
                except AssertionError as error:
                    self.errors.append(f"cycle {cycle}: {error}")
            if sink.errors:
                self.errors.extend(f"host{key[0]} vl{key[1]}: {e}" for e in sink.errors)
                sink.errors.clear()
        if cycle % 64 == 0:
            self.check_overflow(cycle)

    def check_overflow(self, cycle=None):
        cycle = self.loop.cycle if cycle is None else cycle
        for p in range(self.ports):
            if int(getattr(self.dut, f"switch_overflow__{p}").value):
                self.errors.append(f"by cycle {cycle}: switch port {p} receive buffer overflowed")
            if int(getattr(self.dut, f"host{p}_overflow").value):
                self.errors.append(f"by cycle {cycle}: host {p} receive buffer overflowed")

    def raise_errors(self):
        if self.errors:
            errors, self.errors = self.errors, []
            raise AssertionError("\n".join(errors[:20]))

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        if self.loop_task is None:
            self.loop_task = cocotb.start_soon(self.loop.run())

    async def run(self, cycles=None, until=None, limit=None, what="condition"):
        """Let the background loop run ``cycles`` clocks, or until ``until()`` (failing after
        ``limit`` clocks); raises the first scoreboard or monitor error as soon as it occurs."""
        start = self.loop.cycle
        while True:
            self.raise_errors()
            if cycles is not None and self.loop.cycle - start >= cycles:
                return
            if until is not None and until():
                return
            if limit is not None and self.loop.cycle - start >= limit:
                raise AssertionError(f"{what} not met within {limit} cycles "
                                     f"(cycle {self.loop.cycle})\n{self.status()}")
            await RisingEdge(self.dut.clk)

    def signal(self, name):
        return int(getattr(self.dut, name).value)

    def all_active(self):
        active = LinkState.ACTIVE.value
        return all(self.signal(f"switch_link_state__{p}") == active
                   and self.signal(f"host{p}_state") == active for p in range(self.ports))

    async def bring_up(self, limit=20000, program=True):
        """Reset, wait until every switch port and every host port is ACTIVE, then (with
        ``program``) give every host its LID in the forwarding table."""
        await self.reset()
        await self.run(until=self.all_active, limit=limit, what="all links ACTIVE")
        self.up_cycle = self.loop.cycle
        if program:
            await self.program_hosts()

    # --- programming --------------------------------------------------------------------

    async def write(self, offset, value):
        resp = await self.axi.write(offset, int(value).to_bytes(4, "little"))
        assert int(resp.resp) == rmap.OKAY, f"AXI write {offset:#06x} <- {value:#x}: {resp.resp!r}"

    async def read(self, offset):
        resp = await self.axi.read(offset, 4)
        assert int(resp.resp) == rmap.OKAY, f"AXI read {offset:#06x}: {resp.resp!r}"
        return int.from_bytes(resp.data, "little")

    async def set_route(self, lid, port, valid=True):
        """Forwarding-table entry DLID ``lid`` -> ``port`` (``valid=False`` removes it)."""
        await self.write(0x0010, lid | port << 16 | int(valid) << 31)
        self.ft_writes.append((self.loop.cycle, lid, port, int(valid)))
        if valid:
            self.table.set(lid, port)
        else:
            self.table.remove(lid)

    async def program_hosts(self):
        for p in range(self.ports):
            await self.set_route(host_lid(p), p)

    async def set_sl_to_vl(self, sl, vl):
        await self.write(rmap.SL_TO_VL_BASE + 4 * sl, vl)
        self.sl_to_vl[sl] = vl

    async def set_switch_weight(self, port, vl, weight):
        await self.write(rmap.PORT_BASE + rmap.PORT_STRIDE * port + 4 + 4 * vl, weight)

    def set_host_weight(self, port, vl, weight):
        getattr(self.dut, f"host{port}_vl_weight__{vl}").value = weight

    async def counters(self, port, vl):
        """Every counter of (port, VL), read over AXI: ``{name: value}``."""
        base = rmap.COUNTER_BASE + rmap.COUNTER_PORT_STRIDE * port + rmap.COUNTER_VL_STRIDE * vl
        return {name: await self.read(base + 4 * k) for k, name in enumerate(rmap.COUNTER_NAMES)}

    async def all_counters(self):
        return {(p, v): await self.counters(p, v)
                for p in range(self.ports) for v in range(self.num_vls)}

    def host_drops(self, port):
        return {reason: self.signal(f"host{port}_drop_{reason}") for reason in DROP_REASONS}

    # --- traffic ------------------------------------------------------------------------

    def make_packet(self, src, dst_lid, *, payload_len, vl=0, sl=0, opcode=None):
        """A random packet from host ``src`` to ``dst_lid``, on input VL ``vl`` with SL
        ``sl``; SLID = the source's LID, DestQP and PSN = a sequence number unique in the
        test (so every packet differs)."""
        self.seq += 1
        packet = bytearray(random_packet(self.rng, payload_len=payload_len, vl=vl,
                                         opcode=opcode, dlid=dst_lid, slid=host_lid(src),
                                         destqp=self.seq & 0xFFFFFF, psn=self.seq & 0xFFFFFF))
        packet[1] = (sl << 4) | (packet[1] & 0x0F)
        packet[-4:] = icrc_bytes(bytes(packet[:-4]))
        return bytes(packet)

    def send(self, src, packet, *, expect=True, ports=None):
        """Queue ``packet`` at host ``src`` on the VL its LRH names. With ``expect`` the
        scoreboard is told when the host transmitter takes its start beat (the order in
        which packets of different VLs go on the wire is only known then), with the tables
        as they are at that moment; ``ports``: it may leave on any of these."""
        vl = packet[0] >> 4
        self.sources[src, vl].send(packet, tag=len(self.sent[src, vl]))
        self.sent[src, vl].append(packet)
        self.expectations[src, vl].append((expect, ports))

    def all_sent(self):
        return all(source.idle_now for source in self.sources.values())

    def nothing_outstanding(self):
        """Every source empty and every expected packet delivered."""
        return (self.all_sent() and self.scoreboard.delivered >= self.scoreboard.expected
                and not self.scoreboard.outstanding())

    async def drain(self, limit=200000):
        """Run until every source is empty and the scoreboard expects nothing more, then let
        the last credits come home (a flow-control period and a round trip)."""
        check = [0]

        def done():
            check[0] += 1
            if not self.all_sent():
                return False
            if self.scoreboard.delivered < self.scoreboard.expected:
                return False
            return check[0] % 16 == 0 and self.nothing_outstanding()
        await self.run(until=done, limit=limit, what="drain")
        await self.run(cycles=self.fc_period + 4 * self.wire_delay + 128)

    # --- checks -------------------------------------------------------------------------

    def switch_fctbs(self, port, vl, since=0):
        """Blocks the switch sent on output ``port``, VL ``vl``, from the egress monitor:
        its transmitter's FCTBS (mod 4096), counted from cycle ``since`` (the link's last
        initialisation)."""
        total = 0
        for packet, _, start in self.egress[port].data_packets:
            if packet[0] >> 4 == vl and start >= since:
                words = ((packet[4] & 0x7) << 8) | packet[5]
                total += -(-(4 * words + 2) // 64)
        return total % 4096

    def check_credits(self, since=None):
        """``since``: {port: a cycle after its link last re-initialised}."""
        since = since or {}
        # Each credit monitor checked every packet its sender started (it watched the right
        # wires): the hosts' transmitters count theirs, the egress monitors the switch's.
        for p in range(self.ports):
            switch_side, host = self.credit_monitors[2 * p:2 * p + 2]
            assert host.packets == [self.signal(f"host{p}_packets_sent__{v}")
                                    for v in range(self.num_vls)], (p, host.packets)
            assert switch_side.packets == [
                sum(packet[0] >> 4 == v for packet, _, _ in self.egress[p].data_packets)
                for v in range(self.num_vls)], (p, switch_side.packets)
        switch_blocks = self.signal("switch_buffer_blocks")
        for p in range(self.ports):
            for v in range(self.num_vls):
                used = self.signal(f"host{p}_used_blocks__{v}")
                assert used == 0, f"host {p} VL {v} still holds {used} blocks"
                available = (self.signal(f"host{p}_credit_limit__{v}")
                             - self.signal(f"host{p}_fctbs__{v}")) % 4096
                assert available == switch_blocks, (
                    f"host {p} -> switch VL {v}: {available} blocks of credit after drain, "
                    f"expected the switch input's {switch_blocks}")
                abr = self.signal(f"host{p}_abr__{v}")
                fctbs = self.switch_fctbs(p, v, since.get(p, 0))
                assert abr == fctbs, (f"switch -> host {p} VL {v}: host ABR {abr} != blocks "
                                      f"the switch sent {fctbs}")

    def check_clean(self):
        """Everything delivered exactly once, no receive buffer overflowed anywhere, every
        credit back home, every link still ACTIVE."""
        self.raise_errors()
        assert self.all_sent(), "sources still hold packets"
        self.scoreboard.check_all_delivered()
        self.check_overflow()
        self.raise_errors()
        assert self.all_active(), "a link left ACTIVE"
        for p in range(self.ports):
            assert self.signal(f"host{p}_link_inits") == 0, f"host {p} re-initialised its link"
        self.check_credits()

    def status(self):
        lines = [f"scoreboard: expected {self.scoreboard.expected} delivered "
                 f"{self.scoreboard.delivered} drops {self.scoreboard.drops}"]
        for p in range(self.ports):
            per_vl = ", ".join(
                f"vl{v}: queued {len(self.sources[p, v].queue)} sent "
                f"{self.signal(f'host{p}_packets_sent__{v}')} rcvd "
                f"{self.signal(f'host{p}_packets_received__{v}')} credit "
                f"{(self.signal(f'host{p}_credit_limit__{v}') - self.signal(f'host{p}_fctbs__{v}')) % 4096}"
                f" used {self.signal(f'host{p}_used_blocks__{v}')}"
                for v in range(self.num_vls))
            lines.append(f"port {p}: switch state {self.signal(f'switch_link_state__{p}')} host "
                         f"state {self.signal(f'host{p}_state')} {per_vl}")
        missing = self.scoreboard.outstanding()
        if missing:
            lines.append("outstanding: " + ", ".join(f"{k}: {len(v)}" for k, v in sorted(missing.items())))
        return "\n".join(lines)
