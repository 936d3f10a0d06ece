"""Simulation top: two link ports, A and B, joined by a cable.

With ``channel="hdl"`` the cable is a delay line in each direction, set at
run time through ``wire_delay_cycles`` from 0 (the ends wired straight
together) to the ``wire_delay`` the top was built with, so one build serves a
whole sweep of cable lengths; for benchmarks and the demo. With
``channel="tb"`` both wires come out as ports and the testbench carries the
beats (and the faults it injects) with a delay of ``wire_delay`` cycles, at
least one: the testbench is itself a register.

Each end has its own reset (``a_reset``, ``b_reset``) on the shared clock, so a
test can reset one end in the middle of traffic. Everything a test checks about
credits and counters is brought out as ports.
"""
from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.link.link_port import LinkPort
from hdl.link.link_receiver import DROP_REASONS
from hdl.link.signatures import BeatLayout, LinkState, WireSignature

__all__ = ["LinkPair", "SIDES", "STATUS_PORTS", "COUNTER_PORTS", "port_members", "expose_port",
           "delay_line"]

SIDES = ("a", "b")

# Per-VL status ports of each side: port name -> (block, attribute) inside the LinkPort.
STATUS_PORTS = {
    "fctbs": ("transmitter", "fctbs"),
    "credit_limit": ("transmitter", "credit_limit"),
    "credit_stall_cycles": ("transmitter", "credit_stall_cycles"),
    "packets_sent": ("transmitter", "packets_sent"),
    "abr": ("receiver", "abr"),
    "fccl": ("receiver", "fccl"),
    "used_blocks": ("receiver", "used_blocks"),
    "packets_received": ("receiver", "packets_received"),
}
COUNTER_PORTS = {
    "fc_packets_sent": ("transmitter", "fc_packets_sent"),
    "tx_discarded_too_long": ("transmitter", "discarded_too_long"),
    "tx_discarded_framing": ("transmitter", "discarded_framing"),
    "tx_cut_overlong": ("transmitter", "cut_overlong"),
    "discarded": ("receiver", "discarded"),
    "forwarded_bad": ("receiver", "forwarded_bad"),
    "fc_received": ("receiver", "fc_received"),
    "fc_bad_crc": ("receiver", "fc_bad_crc"),
    "fc_malformed": ("receiver", "fc_malformed"),
    "fc_ignored": ("receiver", "fc_ignored"),
}


def port_members(prefix, width, num_vls):
    """Top-level members through which a testbench drives and watches one LinkPort:
    ``{prefix}_data_in``/``_data_out`` streams, ``_vl_weight``, state, overflow, link
    inits, the per-VL :data:`STATUS_PORTS`, the :data:`COUNTER_PORTS` and one
    ``_drop_<reason>`` per drop reason."""
    members = {
        f"{prefix}_data_in": In(stream.Signature(BeatLayout(width))).array(num_vls),
        f"{prefix}_data_out": Out(stream.Signature(BeatLayout(width))).array(num_vls),
        f"{prefix}_vl_weight": In(8).array(num_vls),
        f"{prefix}_state": Out(LinkState),
        f"{prefix}_overflow": Out(1),
        f"{prefix}_link_inits": Out(32),
    }
    for name in STATUS_PORTS:
        members[f"{prefix}_{name}"] = Out(32).array(num_vls)
    for name in COUNTER_PORTS:
        members[f"{prefix}_{name}"] = Out(32)
    for reason in DROP_REASONS:
        members[f"{prefix}_drop_{reason}"] = Out(32)
    return members


def expose_port(m, top, prefix, port):
    """Join ``port`` (a LinkPort) to the members :func:`port_members` gave ``top``."""
    def member(name):
        return getattr(top, f"{prefix}_{name}")
    for v in range(port.num_vls):
        wiring.connect(m, wiring.flipped(member("data_in")[v]), port.data_in[v])
        wiring.connect(m, port.data_out[v], wiring.flipped(member("data_out")[v]))
        m.d.comb += port.vl_weight[v].eq(member("vl_weight")[v])
        for name, (block, attr) in STATUS_PORTS.items():
            m.d.comb += member(name)[v].eq(getattr(getattr(port, block), attr)[v])
    for name, (block, attr) in COUNTER_PORTS.items():
        m.d.comb += member(name).eq(getattr(getattr(port, block), attr))
    for reason in DROP_REASONS:
        m.d.comb += member(f"drop_{reason}").eq(getattr(port.receiver.drops, reason))
    m.d.comb += [
        member("state").eq(port.state),
        member("overflow").eq(port.receiver.overflow),
        member("link_inits").eq(port.link_inits),
    ]


def delay_line(m, name, value, cycles):
    """``value`` delayed by a fixed ``cycles`` (0: ``value`` itself): registers for a
    few cycles, a memory ring beyond that."""
    if cycles == 0:
        return value
    if cycles <= 4:
        out = value
        for k in range(cycles):
            stage = Signal(len(value), name=f"{name}_d{k + 1}")
            m.d.sync += stage.eq(out)
            out = stage
        return out
    line = Memory(shape=len(value), depth=cycles, init=[])
    m.submodules[f"{name}_line"] = line
    write, read = line.write_port(), line.read_port(domain="comb")
    position = Signal(range(cycles), name=f"{name}_position")
    m.d.sync += position.eq(Mux(position == cycles - 1, 0, position + 1))
    m.d.comb += [write.addr.eq(position), write.data.eq(value), write.en.eq(1),
                 read.addr.eq(position)]
    return read.data


class LinkPair(wiring.Component):
    def __init__(self, *, width=64, num_vls=2, mtu=4096, buffer_blocks=None, cut_through=False,
                 fc_period=1024, fc_min_interval=64, fc_batch_blocks=64, wire_delay=0,
                 channel="hdl"):
        if channel not in ("hdl", "tb"):
            raise ValueError(f"Channel must be 'hdl' or 'tb', not {channel!r}")
        if not 0 <= wire_delay <= 4096:
            raise ValueError(f"Wire delay must be 0 to 4096 cycles, not {wire_delay!r}")
        self.channel = channel
        self.wire_delay = wire_delay
        self.ports = {
            side: LinkPort(width=width, num_vls=num_vls, mtu=mtu, buffer_blocks=buffer_blocks,
                           cut_through=cut_through, fc_period=fc_period,
                           fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks)
            for side in SIDES
        }
        members = {}
        for side in SIDES:
            members[f"{side}_reset"] = In(1)
            members.update(port_members(side, width, num_vls))
            if channel == "tb":
                members[f"{side}_wire_out"] = Out(WireSignature(width))
                members[f"{side}_wire_in"] = In(WireSignature(width))
            else:
                members[f"{side}_wire_monitor"] = Out(WireSignature(width))
        if channel == "hdl":
            # At least one bit so the port exists in Verilog; a top built with no
            # delay line ignores it.
            members["wire_delay_cycles"] = In(range(max(wire_delay, 1) + 1))
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        for side, port in self.ports.items():
            m.domains += ClockDomain(side)
            m.d.comb += [
                ClockSignal(side).eq(ClockSignal()),
                ResetSignal(side).eq(ResetSignal() | getattr(self, f"{side}_reset")),
            ]
            m.submodules[side] = DomainRenamer(side)(port)
            expose_port(m, self, side, port)
            if self.channel == "tb":
                wiring.connect(m, port.wire_out, wiring.flipped(getattr(self, f"{side}_wire_out")))
                wiring.connect(m, wiring.flipped(getattr(self, f"{side}_wire_in")), port.wire_in)

        if self.channel == "hdl":
            for source, sink in (("a", "b"), ("b", "a")):
                names = list(WireSignature(self.ports[source].width).members)
                sent = Cat(getattr(self.ports[source].wire_out, name) for name in names)
                m.d.comb += Cat(getattr(getattr(self, f"{source}_wire_monitor"), name)
                                for name in names).eq(sent)
                arriving = Signal(len(sent), name=f"{source}_to_{sink}")
                if self.wire_delay:
                    line = Memory(shape=len(sent), depth=self.wire_delay, init=[])
                    m.submodules[f"{source}_to_{sink}_line"] = line
                    write, read = line.write_port(), line.read_port(domain="comb")
                    position = Signal(range(self.wire_delay), name=f"{source}_to_{sink}_position")
                    m.d.sync += position.eq(Mux(position == self.wire_delay - 1, 0, position + 1))
                    back = position - self.wire_delay_cycles
                    m.d.comb += [
                        write.addr.eq(position), write.data.eq(sent), write.en.eq(1),
                        read.addr.eq(Mux(back < 0, back + self.wire_delay, back)),
                        arriving.eq(Mux(self.wire_delay_cycles == 0, sent, read.data)),
                    ]
                else:
                    m.d.comb += arriving.eq(sent)
                m.d.comb += Cat(getattr(self.ports[sink].wire_in, name) for name in names).eq(arriving)
        return m
