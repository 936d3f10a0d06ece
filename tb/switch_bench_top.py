"""Simulation top for the switch benchmarks: traffic made and checked in gateware.

One :class:`hdl.switch.switch.Switch`; on every port p a host
:class:`hdl.link.link_port.LinkPort` (cabled both ways, ``wire_delay`` cycles each way),
fed by a :class:`tb.gateware.packet_generator.PacketGenerator` and drained by a
:class:`tb.gateware.packet_checker.PacketChecker` (always ready, strictly increasing
PSNs per source and VL, per-source counters). No Python runs per cycle: a benchmark sets the
controls, lets the clock run and reads counters (see tb/bench_switch.py).

Host p has LID ``LID_BASE + p`` (the benchmark programs the forwarding table through
``axi``). Its generator sends SLID ``LID_BASE + p``, SL = VL (``sl_from_vl``), and,
with ``dlid_count`` set, a uniform destination among ``dlid .. dlid + dlid_count - 1``
without its own (``dlid_exclude = p``). The generator's VL picks the host's
``data_in`` stream (by the start beat's LRH.VL); the host's ``data_out`` VLs are merged
packet by packet, round robin, into the checker.

Latency at the switch's own pins, in gateware: on every input wire the start cycle of
each data packet is stored by (input port, PSN mod ``psn_slots``); when the packet's
start beat leaves on an output wire, its SLID and PSN find that stamp and
``start_out - start_in`` goes into the output's histogram (``hist_bins`` one-cycle bins,
the last one catching everything above). ``psn_slots`` must exceed the packets of one
input in flight inside the switch (``2 x buffer_blocks`` per input at 2 VLs / blocks per
packet: 33 packets of 2020 B at 528 blocks).

Ports (P = ports; all inputs are registered before use)
-------------------------------------------------------
axi : the switch's AXI4-Lite slave.
gen_enable : In(P)  per-port generator enable; the other generator controls are shared:
gen_clear, gen_packets, gen_payload_min, gen_payload_max, gen_dlid, gen_dlid_count,
gen_rate, gen_seed (xored with a per-port constant), gen_vl_spread, gen_gap.
gen_sent_packets, gen_sent_bytes, gen_backlog : per port; gen_done : Out(P).
chk_clear : In(1); per port: chk_received_packets, chk_good_packets, chk_good_bytes,
chk_errors (sum of the checker's error counters and stray beats), chk_out_of_order;
chk_source_bytes : Out(48).array(P, P), [output][source].
out_data_beats : Out(32).array(P): data beats on each switch ``wire_out`` since reset.
cycle : Out(32): cycles since reset.
lat_last, lat_max : Out(16).array(P), lat_count : Out(32).array(P): per output, the
latest and largest latency and the number of samples (``lat_clear`` zeroes max/count).
hist_addr : In(range(hist_bins)); hist_data : Out(32): the sum over outputs of bin
``hist_addr`` (two cycles after ``hist_addr`` is set).
switch_link_state, host_state : Out(2).array(P); switch_overflow, host_overflow : Out(P).
"""
from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.axi_lite import AxiLiteSignature
from hdl.link.link_port import LinkPort
from hdl.link.signatures import LinkState, WireSignature
from hdl.switch.switch import DEFAULT_ALLOCATOR
from tb.gateware.packet_checker import ERROR_COUNTERS, PacketChecker
from tb.gateware.packet_generator import PAYLOAD_BITS, PacketGenerator, core_domain, registered

__all__ = ["SwitchBenchTop", "LID_BASE", "GEN_SHARED"]

LID_BASE = 0x10
GEN_SHARED = {"clear": 1, "packets": 32, "payload_min": PAYLOAD_BITS, "payload_max": PAYLOAD_BITS,
              "dlid": 16, "dlid_count": 8, "rate": 16, "seed": 32, "vl_spread": 1, "gap": 16}
WIRE_FIELDS = tuple(WireSignature(8).members)


class SwitchBenchTop(wiring.Component):
    def __init__(self, *, ports=8, num_vls=2, width=64, mtu=4096, buffer_blocks=None, lids=1024,
                 mode="voq", islip_iterations=1, allocator=DEFAULT_ALLOCATOR, fc_period=1024,
                 fc_min_interval=64, fc_batch_blocks=64, addr_width=16, wire_delay=0,
                 host_buffer_blocks=None, hist_bins=4096, psn_slots=256):
        from hdl.switch.switch import Switch
        if ports & (ports - 1):
            raise ValueError("the bench top needs a power-of-two port count (source = SLID bits)")
        if not 0 <= wire_delay <= 4:
            raise ValueError("wire_delay must be 0 to 4 cycles")
        self.ports, self.num_vls, self.width = ports, num_vls, width
        self.wire_delay, self.hist_bins, self.psn_slots = wire_delay, hist_bins, psn_slots
        self.switch = Switch(ports=ports, num_vls=num_vls, width=width, mtu=mtu,
                             buffer_blocks=buffer_blocks, lids=lids, mode=mode,
                             islip_iterations=islip_iterations, allocator=allocator,
                             fc_period=fc_period,
                             fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks,
                             addr_width=addr_width)
        self.hosts = [LinkPort(width=width, num_vls=num_vls, mtu=mtu, buffer_blocks=host_buffer_blocks,
                               cut_through=True, fc_period=fc_period, fc_min_interval=fc_min_interval,
                               fc_batch_blocks=fc_batch_blocks) for _ in range(ports)]
        self.generators = [PacketGenerator(width, num_vls) for _ in range(ports)]
        self.checkers = [PacketChecker(width, ports, per_source=True, psn_vls=1 << (num_vls - 1).bit_length()) for _ in range(ports)]
        P = ports
        members = {
            "axi": In(AxiLiteSignature(addr_width)),
            "gen_enable": In(P),
            **{f"gen_{name}": In(bits) for name, bits in GEN_SHARED.items()},
            "gen_sent_packets": Out(32).array(P),
            "gen_sent_bytes": Out(48).array(P),
            "gen_backlog": Out(16).array(P),
            "gen_done": Out(P),
            "chk_clear": In(1),
            "chk_received_packets": Out(32).array(P),
            "chk_good_packets": Out(32).array(P),
            "chk_good_bytes": Out(48).array(P),
            "chk_errors": Out(32).array(P),
            "chk_out_of_order": Out(32).array(P),
            "chk_source_bytes": Out(48).array(P, P),
            "out_data_beats": Out(32).array(P),
            "cycle": Out(32),
            "lat_clear": In(1),
            "lat_last": Out(16).array(P),
            "lat_max": Out(16).array(P),
            "lat_count": Out(32).array(P),
            "hist_addr": In(range(hist_bins)),
            "hist_data": Out(32),
            "switch_link_state": Out(LinkState).array(P),
            "host_state": Out(LinkState).array(P),
            "switch_overflow": Out(P),
            "host_overflow": Out(P),
            "switch_buffer_blocks": Out(16),
            "host_buffer_blocks": Out(16),
        }
        super().__init__(members)

    def elaborate(self, platform):
        # Everything one level down: only the top module's signals are public (tb.runner.run).
        m = Module()
        m.submodules.core = _Core(self)
        return m


def _flat(wire):
    return Cat(getattr(wire, name) for name in WIRE_FIELDS)


class _Core(Elaboratable):
    def __init__(self, top):
        self.top = top

    def _delay(self, m, name, value):
        for k in range(self.top.wire_delay):
            stage = Signal(len(value), name=f"{name}_d{k + 1}")
            m.d.sync += stage.eq(value)
            value = stage
        return value

    def elaborate(self, platform):
        m = Module()
        top = self.top
        P, V, W = top.ports, top.num_vls, top.width
        sw = m.submodules.switch = top.switch
        wiring.connect(m, wiring.flipped(top.axi), sw.axi)
        core = core_domain(m, "bench_core")
        m.d.comb += [top.switch_buffer_blocks.eq(sw.buffer_blocks),
                     top.host_buffer_blocks.eq(top.hosts[0].buffer_blocks)]

        cycle = Signal(32)
        m.d[core] += cycle.eq(cycle + 1)
        m.d.comb += top.cycle.eq(cycle)
        lat_clear = registered(m, core, top.lat_clear)
        hist_addr = registered(m, core, top.hist_addr)

        for p in range(P):
            host, gen, chk = top.hosts[p], top.generators[p], top.checkers[p]
            m.submodules[f"host{p}"] = host
            m.submodules[f"gen{p}"] = gen
            m.submodules[f"chk{p}"] = chk
            for name in GEN_SHARED:
                m.d.comb += getattr(gen, name).eq(getattr(top, f"gen_{name}"))
            seed = (top.gen_seed ^ ((0x9E3779B1 * (p + 1)) & 0xFFFFFFFF))[:32]
            m.d.comb += [
                gen.seed.eq(Mux(top.gen_seed == 0, 0, seed)),
                gen.enable.eq(top.gen_enable[p]),
                gen.slid.eq(LID_BASE + p),
                gen.dlid_exclude.eq(p),
                gen.sl_from_vl.eq(1),
                gen.vl.eq(0),
                gen.sl.eq(0),
                gen.destqp.eq(0x000100 + p),
                top.gen_sent_packets[p].eq(gen.sent_packets),
                top.gen_sent_bytes[p].eq(gen.sent_bytes),
                top.gen_backlog[p].eq(gen.backlog),
                top.gen_done[p].eq(gen.done),
                chk.clear.eq(top.chk_clear),
                chk.stall_rate.eq(0),
                chk.psn_increasing.eq(1),
                top.chk_received_packets[p].eq(chk.received_packets),
                top.chk_good_packets[p].eq(chk.good_packets),
                top.chk_good_bytes[p].eq(chk.good_bytes),
                top.chk_errors[p].eq(sum(getattr(chk, n) for n in (*ERROR_COUNTERS, "stray_beats"))),
                top.chk_out_of_order[p].eq(chk.out_of_order),
                top.switch_link_state[p].eq(sw.link_state[p]),
                top.host_state[p].eq(host.state),
                top.switch_overflow[p].eq(sw.overflow[p]),
                top.host_overflow[p].eq(host.receiver.overflow),
            ]
            for s in range(P):
                m.d.comb += top.chk_source_bytes[p][s].eq(chk.source_bytes[s])
            for v in range(V):
                m.d.comb += host.vl_weight[v].eq(16)

            # Generator -> host data_in[VL of the packet].
            src = gen.data_out
            held_vl = Signal(4, name=f"gen{p}_vl")
            vl_now = Signal(4, name=f"gen{p}_vl_now")
            m.d.comb += vl_now.eq(Mux(src.payload.start, src.payload.data[4:8], held_vl))
            with m.If(src.valid & src.ready & src.payload.start):
                m.d[core] += held_vl.eq(src.payload.data[4:8])
            for v in range(V):
                m.d.comb += [host.data_in[v].valid.eq(src.valid & (vl_now == v)),
                             host.data_in[v].payload.eq(src.payload)]
            m.d.comb += src.ready.eq(Array(host.data_in[v].ready for v in range(V))[vl_now])

            # Host data_out[0..V-1] -> checker, whole packets, round robin.
            busy = Signal(name=f"merge{p}_busy")
            held = Signal(range(V), name=f"merge{p}_held")
            last = Signal(range(V), name=f"merge{p}_last")
            pick = Signal(range(V), name=f"merge{p}_pick")
            m.d.comb += pick.eq(last)
            for offset in reversed(range(1, V + 1)):
                candidate = (last + offset) % V if V > 1 else C(0, 1)
                with m.If(Array(host.data_out[v].valid for v in range(V))[candidate]):
                    m.d.comb += pick.eq(candidate)
            sel = Signal(range(V), name=f"merge{p}_sel")
            m.d.comb += sel.eq(Mux(busy, held, pick))
            outs = Array(host.data_out)
            m.d.comb += [chk.data_in.valid.eq(outs[sel].valid),
                         chk.data_in.payload.eq(outs[sel].payload)]
            for v in range(V):
                m.d.comb += host.data_out[v].ready.eq(chk.data_in.ready & (sel == v))
            with m.If(chk.data_in.valid & chk.data_in.ready):
                m.d[core] += [busy.eq(~chk.data_in.payload.end), held.eq(sel), last.eq(sel)]

            # Cables.
            m.d.comb += [
                _flat(sw.wire_in[p]).eq(self._delay(m, f"host{p}_to_switch", _flat(host.wire_out))),
                _flat(host.wire_in).eq(self._delay(m, f"switch_to_host{p}", _flat(sw.wire_out[p]))),
            ]

        # --- latency at the switch pins -------------------------------------------------
        slots = top.psn_slots
        slot_bits = exact_log2(slots)
        source_bits = max(1, exact_log2(P))
        psn_beat, psn_byte = divmod(17, W)      # BTH.PSN: packet bytes 17..19 (big-endian)

        def watch(wire, name):
            """(at_psn_beat, start cycle, slid, psn) of the data packet on ``wire``."""
            data_beat = wire.valid & ~wire.link
            index = Signal(range(psn_beat + 2), name=f"{name}_index")
            index_now = Signal.like(index, name=f"{name}_index_now")
            started = Signal(32, name=f"{name}_started")
            started_now = Signal(32, name=f"{name}_started_now")
            slid_kept = Signal(16, name=f"{name}_slid")
            slid_now = Signal(16, name=f"{name}_slid_now")
            m.d.comb += [
                index_now.eq(Mux(wire.start, 0, index)),
                started_now.eq(Mux(wire.start, cycle, started)),
                slid_now.eq(Mux(wire.start, Cat(wire.data[56:64], wire.data[48:56]), slid_kept)),
            ]
            with m.If(data_beat):
                m.d[core] += index.eq(Mux(index_now > psn_beat, index_now, index_now + 1))
                with m.If(wire.start):
                    m.d[core] += [started.eq(cycle), slid_kept.eq(slid_now)]
            byte = lambda k: wire.data[8 * k:8 * k + 8]
            psn = Signal(24, name=f"{name}_psn")
            m.d.comb += psn.eq(Cat(byte(psn_byte + 2), byte(psn_byte + 1), byte(psn_byte)))
            at = Signal(name=f"{name}_at_psn")
            m.d.comb += at.eq(data_beat & (index_now == psn_beat))
            return at, started_now, slid_now, psn

        tables = []
        for i in range(P):
            table = Memory(shape=32, depth=slots, init=[])
            m.submodules[f"stamp{i}"] = table
            at, started, _, psn = watch(sw.wire_in[i], f"in{i}")
            write = table.write_port(domain=core)
            m.d.comb += [write.addr.eq(psn[:slot_bits]), write.data.eq(started), write.en.eq(at)]
            tables.append(table)

        bins = top.hist_bins
        hist_reads = []
        for o in range(P):
            at, started, slid, psn = watch(sw.wire_out[o], f"out{o}")
            source = Signal(source_bits, name=f"out{o}_source")
            m.d.comb += source.eq((slid - LID_BASE)[:source_bits])
            stamps = []
            for i, table in enumerate(tables):
                read = table.read_port(domain="comb")
                m.d.comb += read.addr.eq(psn[:slot_bits])
                stamps.append(read.data)
            latency = Signal(32, name=f"out{o}_latency")
            m.d.comb += latency.eq(started - Array(stamps)[source])
            clipped = Signal(range(bins), name=f"out{o}_bin")
            m.d.comb += clipped.eq(Mux(latency >= bins - 1, bins - 1, latency))
            hist = Memory(shape=32, depth=bins, init=[])
            m.submodules[f"hist{o}"] = hist
            rmw = hist.read_port(domain="comb")
            write = hist.write_port(domain=core)
            m.d.comb += [rmw.addr.eq(clipped), write.addr.eq(clipped),
                         write.data.eq(rmw.data + 1), write.en.eq(at)]
            readback = hist.read_port(domain="comb")
            m.d.comb += readback.addr.eq(hist_addr)
            hist_reads.append(readback.data)
            beats = Signal(32, name=f"out{o}_beats")
            with m.If(sw.wire_out[o].valid & ~sw.wire_out[o].link):
                m.d[core] += beats.eq(beats + 1)
            m.d.comb += top.out_data_beats[o].eq(beats)
            with m.If(at):
                m.d[core] += top.lat_last[o].eq(Mux(latency > 0xFFFF, 0xFFFF, latency))
            with m.If(lat_clear):
                m.d[core] += [top.lat_max[o].eq(0), top.lat_count[o].eq(0)]
            with m.Elif(at):
                m.d[core] += top.lat_count[o].eq(top.lat_count[o] + 1)
                with m.If(latency > top.lat_max[o]):
                    m.d[core] += top.lat_max[o].eq(Mux(latency > 0xFFFF, 0xFFFF, latency))
        m.d[core] += top.hist_data.eq(sum(hist_reads))
        return m
