"""Simulation top: one :class:`hdl.nic.nic.Nic`, its memory port, and the far end of its cable.

The NIC is a separately built module (:mod:`tb.hier_build`, a Verilator hierarchical block),
shared with every other top that uses a NIC of the same parameters.

- ``axil__*``: the NIC's 64-bit AXI4-Lite slave (registers, UAR page), for cocotbext-axi's
  ``AxiLiteMaster`` (the GPU's MMIO writes).
- ``axi__*``: the NIC's AXI4 master, for cocotbext-axi's ``AxiRam`` (GPU memory). Read
  requests pass through :class:`tb.gateware.axi_read_delay.AxiReadDelay`, which holds each
  one for ``memory_latency`` cycles (a port: set at run time).
- The NIC's wire goes through a fixed delay line of ``wire_delay`` cycles each way to a
  plain :class:`hdl.link.link_port.LinkPort`, the remote end, whose packet streams and
  state come out as ``remote_*`` ports (:func:`tb.link_pair.port_members`); a Python
  responder model answers there.
- ``nic_wire_monitor`` is the NIC's ``wire_out`` at its own pins (before the cable),
  ``nic_wire_in_monitor`` its ``wire_in`` (after the cable), and
  ``nic_ar_fire``/``nic_ar_id`` mark each read burst the NIC issues (before the memory
  delay), so a latency can be split into NIC cycles and memory waits.
"""
from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteSignature
from hdl.link.link_port import LinkPort
from hdl.link.signatures import LinkState, WireSignature
from hdl.nic.nic import NIC_WIDTH
from hdl.nic.signatures import AXI_ID_BITS
from tb.gateware.axi_read_delay import AR_MEMBERS, AxiReadDelay
from hdl.fabric.separate_modules import SeparateModules
from tb.hier_build import TEST_NIC
from tb.link_pair import delay_line, expose_port, port_members

__all__ = ["BUILD_ARGS", "NIC", "NicTop", "attach_memory", "nic_top"]

WIRE_FIELDS = tuple(WireSignature(8).members)


def attach_memory(m, nic, axi, delay, latency):
    """Join ``nic``'s AXI4 master to the top's ``axi`` member, its read requests through
    ``delay`` (an :class:`AxiReadDelay`) holding each for ``latency`` cycles."""
    for name, member in nic.signature.members["axi"].signature.members.items():
        if name in AR_MEMBERS or name in ("arvalid", "arready"):
            continue
        outer, inner = getattr(axi, name), getattr(nic.axi, name)
        m.d.comb += outer.eq(inner) if member.flow == Out else inner.eq(outer)
    for name in AR_MEMBERS:
        m.d.comb += [getattr(delay, f"up_{name}").eq(getattr(nic.axi, name)),
                     getattr(axi, name).eq(getattr(delay, f"down_{name}"))]
    m.d.comb += [
        delay.up_arvalid.eq(nic.axi.arvalid),
        nic.axi.arready.eq(delay.up_arready),
        axi.arvalid.eq(delay.down_arvalid),
        delay.down_arready.eq(axi.arready),
        delay.latency.eq(latency),
    ]


class NicTop(wiring.Component):
    def __init__(self, *, num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2, mtu=4096,
                 addr_width=64, fetch_buffer_blocks=256, payload_buffer_beats=512,
                 wire_delay=2, max_memory_latency=4095, outstanding_reads=128):
        if not 0 <= wire_delay <= 4096:
            raise ValueError(f"Wire delay must be 0 to 4096 cycles, not {wire_delay!r}")
        self.num_vls = num_vls
        self.wire_delay = wire_delay
        self.hier_blocks = SeparateModules()
        self.nic = self.hier_blocks.black_box(
            "nic", num_qps=num_qps, num_cqs=num_cqs, num_mkeys=num_mkeys, num_vls=num_vls,
            mtu=mtu, addr_width=addr_width, fetch_buffer_blocks=fetch_buffer_blocks,
            payload_buffer_beats=payload_buffer_beats)
        self.remote = LinkPort(width=NIC_WIDTH, num_vls=num_vls, mtu=mtu)
        self.read_delay = AxiReadDelay(addr_width=addr_width, depth=outstanding_reads,
                                       max_latency=max_memory_latency)
        members = {
            "axil": In(AxiLiteSignature(16, data_width=64)),
            "axi": Out(self.nic.signature.members["axi"].signature),
            "memory_latency": In(range(max_memory_latency + 1)),
            "nic_link_state": Out(LinkState),
            "nic_ar_fire": Out(1),          # the NIC issued a read burst this cycle ...
            "nic_ar_id": Out(AXI_ID_BITS),  # ... with this ARID (before the memory delay)
            "nic_wire_monitor": Out(WireSignature(NIC_WIDTH)),
            "nic_wire_in_monitor": Out(WireSignature(NIC_WIDTH)),
            **port_members("remote", NIC_WIDTH, num_vls),
        }
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        nic = m.submodules.nic = self.nic
        remote = m.submodules.remote = self.remote
        delay = m.submodules.read_delay = self.read_delay

        wiring.connect(m, wiring.flipped(self.axil), nic.axil)
        attach_memory(m, nic, self.axi, delay, self.memory_latency)
        m.d.comb += [
            self.nic_link_state.eq(nic.link_state),
            self.nic_ar_fire.eq(nic.axi.arvalid & delay.up_arready),
            self.nic_ar_id.eq(nic.axi.arid),
        ]

        expose_port(m, self, "remote", remote)

        def flat(wire):
            return Cat(getattr(wire, name) for name in WIRE_FIELDS)

        leaving = flat(nic.wire_out)
        m.d.comb += [
            flat(self.nic_wire_monitor).eq(leaving),
            flat(remote.wire_in).eq(delay_line(m, "nic_to_remote", leaving, self.wire_delay)),
            flat(nic.wire_in).eq(delay_line(m, "remote_to_nic", flat(remote.wire_out),
                                            self.wire_delay)),
            flat(self.nic_wire_in_monitor).eq(flat(nic.wire_in)),
        ]
        return m


# The tests' NIC (16 QPs, the one every test top builds: compiled once, tb/hier_build.py);
# the message-rate benchmark builds the default 64.
NIC = dict(**TEST_NIC, wire_delay=2)
# Verilator sees word-level loops (UNOPTFLAT) where the link transmitter's credit check
# reads the start beat whose ready it drives; Amaranth checks the netlist bit by bit and
# finds none.
BUILD_ARGS = ["-Wno-UNOPTFLAT"]


def nic_top(**params):
    return NicTop(**params)
