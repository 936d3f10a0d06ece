"""Simulation top: one :class:`hdl.switch.switch.Switch` and a host link port on every port.

Port p of the switch is cabled to a host :class:`hdl.link.link_port.LinkPort` (the "NIC
side"): the host's ``wire_out`` reaches the switch's ``wire_in[p]`` and the switch's
``wire_out[p]`` the host's ``wire_in``, each through a fixed delay line of ``wire_delay``
cycles (0: wired straight through). Both ends run the link's INIT / ARMED / ACTIVE
protocol, so the links come up by themselves after reset.

For the ports in ``tb_ports`` the host-to-switch direction goes through the testbench
instead (``host{p}_wire_out`` out, ``switch{p}_wire_in`` in), so a
:class:`tb.beats.WireChannel` can carry the beats and inject faults; the switch-to-host
direction of those ports stays an HDL delay line.

Brought out as ports, per host port p and VL v: the host's packet streams
``host{p}_data_in__{v}`` / ``host{p}_data_out__{v}`` (for :class:`tb.beats.PacketSource` /
:class:`tb.beats.PacketSink`), ``host{p}_vl_weight__{v}``, the host's link state,
overflow flag, credit state and counters (as :class:`tb.link_pair.LinkPair` names them);
and for the switch its AXI4-Lite slave (``axi__*``), ``switch_link_state__{p}``,
``switch_overflow__{p}``, and two wire monitors per port: ``switch{p}_wire_in_monitor``
(the beats as the switch's ``wire_in[p]`` sees them, after the cable) and
``switch{p}_wire_monitor`` (the switch's ``wire_out[p]``, before the cable), so hop latency
is measured at the switch's own pins. ``switch_buffer_blocks`` and ``host_buffer_blocks``
are constants: the receive buffer per VL of a switch input and of a host.
"""
from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteSignature
from hdl.link.link_port import LinkPort
from hdl.link.signatures import LinkState, WireSignature
from hdl.switch.switch import DEFAULT_ALLOCATOR
from tb.link_pair import delay_line, expose_port, port_members

__all__ = ["SwitchTop"]

WIRE_FIELDS = tuple(WireSignature(8).members)


class SwitchTop(wiring.Component):
    def __init__(self, *, ports=4, num_vls=2, width=64, mtu=4096, buffer_blocks=None, lids=1024,
                 mode="voq", islip_iterations=1, allocator=DEFAULT_ALLOCATOR, fc_period=1024,
                 fc_min_interval=64, fc_batch_blocks=64, addr_width=16, wire_delay=2, tb_ports=(),
                 host_buffer_blocks=None, host_cut_through=True):
        from hdl.switch.switch import Switch
        if not 0 <= wire_delay <= 4096:
            raise ValueError(f"Wire delay must be 0 to 4096 cycles, not {wire_delay!r}")
        tb_ports = tuple(tb_ports)
        if any(not 0 <= p < ports for p in tb_ports):
            raise ValueError(f"tb_ports {tb_ports!r} must be switch ports 0 .. {ports - 1}")
        self.ports = ports
        self.num_vls = num_vls
        self.width = width
        self.wire_delay = wire_delay
        self.tb_ports = tb_ports
        self.switch = Switch(ports=ports, num_vls=num_vls, width=width, mtu=mtu,
                             buffer_blocks=buffer_blocks, lids=lids, mode=mode,
                             islip_iterations=islip_iterations, allocator=allocator,
                             fc_period=fc_period,
                             fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks,
                             addr_width=addr_width)
        self.hosts = [LinkPort(width=width, num_vls=num_vls, mtu=mtu,
                               buffer_blocks=host_buffer_blocks, cut_through=host_cut_through,
                               fc_period=fc_period, fc_min_interval=fc_min_interval,
                               fc_batch_blocks=fc_batch_blocks)
                      for _ in range(ports)]

        members = {
            "axi": In(AxiLiteSignature(addr_width)),
            "switch_link_state": Out(LinkState).array(ports),
            "switch_overflow": Out(1).array(ports),
            "switch_buffer_blocks": Out(12),
            "host_buffer_blocks": Out(12),
        }
        for p in range(ports):
            h = f"host{p}"
            members.update(port_members(h, width, num_vls))
            members[f"switch{p}_wire_monitor"] = Out(WireSignature(width))
            members[f"switch{p}_wire_in_monitor"] = Out(WireSignature(width))
            if p in tb_ports:
                members[f"{h}_wire_out"] = Out(WireSignature(width))
                members[f"switch{p}_wire_in"] = In(WireSignature(width))
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        sw = m.submodules.switch = self.switch
        wiring.connect(m, wiring.flipped(self.axi), sw.axi)
        m.d.comb += [
            self.switch_buffer_blocks.eq(self.switch.buffer_blocks),
            self.host_buffer_blocks.eq(self.hosts[0].buffer_blocks),
        ]

        def flat(wire):
            return Cat(getattr(wire, name) for name in WIRE_FIELDS)

        for p, host in enumerate(self.hosts):
            h = f"host{p}"
            m.submodules[h] = host
            m.d.comb += [
                self.switch_link_state[p].eq(sw.link_state[p]),
                self.switch_overflow[p].eq(sw.overflow[p]),
            ]
            expose_port(m, self, h, host)

            # Host -> switch.
            if p in self.tb_ports:
                wiring.connect(m, host.wire_out, wiring.flipped(getattr(self, f"{h}_wire_out")))
                arriving = flat(getattr(self, f"switch{p}_wire_in"))
            else:
                arriving = delay_line(m, f"host{p}_to_switch", flat(host.wire_out), self.wire_delay)
            m.d.comb += [
                flat(sw.wire_in[p]).eq(arriving),
                flat(getattr(self, f"switch{p}_wire_in_monitor")).eq(arriving),
            ]
            # Switch -> host.
            leaving = flat(sw.wire_out[p])
            m.d.comb += [
                flat(getattr(self, f"switch{p}_wire_monitor")).eq(leaving),
                flat(host.wire_in).eq(delay_line(m, f"switch_to_host{p}", leaving, self.wire_delay)),
            ]
        return m
