"""Simulation top: two :class:`hdl.nic.nic.Nic`, A and B, joined by a cable, or with
``through_switch`` by a :class:`hdl.switch.switch.Switch` (A on port 0, B on port 1, its
registers as ``switch_axil__*``, 32-bit AXI4-Lite), each link a cable. The NICs and the
switch are separately built modules (:mod:`tb.hier_build`, Verilator hierarchical blocks):
the NIC is compiled once for both, and shared with the other tops of the same NIC.

Each NIC has its own registers (``a_axil__*``, ``b_axil__*``, for cocotbext-axi's
``AxiLiteMaster``) and its own memory (``a_axi__*``, ``b_axi__*``, for ``AxiRam``), read
requests held ``memory_latency`` cycles (:class:`tb.gateware.axi_read_delay.AxiReadDelay`,
the same latency on both). Each cable is a delay line of ``wire_delay`` cycles each way.
``a_wire_monitor``/``b_wire_monitor`` show what each NIC drives at its own pins, and
``a_wire_in_monitor``/``b_wire_in_monitor`` what reaches them, and
``{side}_ar_fire``/``{side}_ar_id`` each read burst a NIC issues before the memory delay,
so a latency can be split into NIC cycles, memory waits, wire and switch.

Loss: each NIC's outgoing cable starts with a :class:`tb.gateware.wire_fault.WireFault`
(``{side}_fault_rate``, ``{side}_fault_mode``, ``{side}_fault_seed``, ``{side}_fault_cut``
in, ``{side}_faults`` out; rate 0 and no cut, the reset state of the inputs, pass everything
untouched; ``{side}_fault_cut`` loses every beat, a cut cable). The wire monitor
shows the packets before it. ``{side}_rx_drop_{reason}`` are the drop counters of each NIC's
own link receiver (docs/link.md, Drop reasons); with a switch, the packets a fault hit on
the way in are counted by the switch's input port (its registers).
"""
from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteSignature
from hdl.link.link_receiver import DROP_REASONS
from hdl.link.signatures import LinkState, WireSignature
from hdl.nic.nic import NIC_WIDTH
from hdl.nic.signatures import AXI_ID_BITS
from tb.gateware.axi_read_delay import AxiReadDelay
from tb.gateware.wire_fault import RATE_ONE, WireFault
from hdl.fabric.separate_modules import SeparateModules
from tb.hier_build import TEST_NIC
from tb.link_pair import delay_line
from tb.nic_top import BUILD_ARGS, WIRE_FIELDS, attach_memory

__all__ = ["BUILD_ARGS", "NicPairTop", "NIC_SIDES", "PAIR", "SWITCH_LIDS", "nic_pair_top"]

NIC_SIDES = ("a", "b")
SWITCH_LIDS = 256           # forwarding-table entries of the switch


class NicPairTop(wiring.Component):
    def __init__(self, *, num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2, mtu=4096,
                 addr_width=64, wire_delay=8, max_memory_latency=4095, outstanding_reads=128,
                 through_switch=False):
        if not 1 <= wire_delay <= 4096:
            raise ValueError(f"Wire delay must be 1 to 4096 cycles, not {wire_delay!r}")
        self.wire_delay = wire_delay
        self.hier_blocks = SeparateModules()
        self.switch = (self.hier_blocks.black_box("switch", ports=2, num_vls=num_vls, mtu=mtu,
                                                  lids=SWITCH_LIDS)
                       if through_switch else None)
        self.nics = {side: self.hier_blocks.black_box("nic", num_qps=num_qps, num_cqs=num_cqs,
                                                      num_mkeys=num_mkeys, num_vls=num_vls,
                                                      mtu=mtu, addr_width=addr_width)
                     for side in NIC_SIDES}
        self.read_delays = {side: AxiReadDelay(addr_width=addr_width, depth=outstanding_reads,
                                               max_latency=max_memory_latency)
                            for side in NIC_SIDES}
        self.faults = {side: WireFault(width=NIC_WIDTH) for side in NIC_SIDES}
        members = {"memory_latency": In(range(max_memory_latency + 1))}
        if self.switch is not None:
            members["switch_axil"] = In(AxiLiteSignature(16))
        for side in NIC_SIDES:
            members.update({
                f"{side}_axil": In(AxiLiteSignature(16, data_width=64)),
                f"{side}_axi": Out(self.nics[side].signature.members["axi"].signature),
                f"{side}_link_state": Out(LinkState),
                f"{side}_ar_fire": Out(1),
                f"{side}_ar_id": Out(AXI_ID_BITS),
                f"{side}_wire_monitor": Out(WireSignature(NIC_WIDTH)),
                f"{side}_wire_in_monitor": Out(WireSignature(NIC_WIDTH)),
                f"{side}_fault_rate": In(range(RATE_ONE + 1)),
                f"{side}_fault_mode": In(1),
                f"{side}_fault_seed": In(32),
                f"{side}_faults": Out(32),
                f"{side}_fault_cut": In(1),
                **{f"{side}_rx_drop_{reason}": Out(32) for reason in DROP_REASONS},
            })
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()

        def flat(wire):
            return Cat(getattr(wire, name) for name in WIRE_FIELDS)

        sent = {}                   # each NIC's wire_out after its fault injector, flattened
        for side in NIC_SIDES:
            nic = m.submodules[f"nic_{side}"] = self.nics[side]
            delay = m.submodules[f"read_delay_{side}"] = self.read_delays[side]
            fault = m.submodules[f"fault_{side}"] = self.faults[side]
            wiring.connect(m, nic.wire_out, fault.wire_in)
            sent[side] = flat(fault.wire_out)
            m.d.comb += [
                fault.rate.eq(getattr(self, f"{side}_fault_rate")),
                fault.mode.eq(getattr(self, f"{side}_fault_mode")),
                fault.seed.eq(getattr(self, f"{side}_fault_seed")),
                getattr(self, f"{side}_faults").eq(fault.faults),
                fault.cut.eq(getattr(self, f"{side}_fault_cut")),
                *(getattr(self, f"{side}_rx_drop_{reason}").eq(getattr(nic.link_drops, reason))
                  for reason in DROP_REASONS),
            ]
            wiring.connect(m, wiring.flipped(getattr(self, f"{side}_axil")), nic.axil)
            attach_memory(m, nic, getattr(self, f"{side}_axi"), delay, self.memory_latency)
            m.d.comb += [
                getattr(self, f"{side}_link_state").eq(nic.link_state),
                getattr(self, f"{side}_ar_fire").eq(nic.axi.arvalid & delay.up_arready),
                getattr(self, f"{side}_ar_id").eq(nic.axi.arid),
                flat(getattr(self, f"{side}_wire_monitor")).eq(flat(nic.wire_out)),
                flat(getattr(self, f"{side}_wire_in_monitor")).eq(flat(nic.wire_in)),
            ]
        a, b = self.nics["a"], self.nics["b"]
        if self.switch is None:
            m.d.comb += [
                flat(b.wire_in).eq(delay_line(m, "a_to_b", sent["a"], self.wire_delay)),
                flat(a.wire_in).eq(delay_line(m, "b_to_a", sent["b"], self.wire_delay)),
            ]
            return m
        switch = m.submodules.switch = self.switch
        wiring.connect(m, wiring.flipped(self.switch_axil), switch.axi)
        for port, (side, nic) in enumerate(self.nics.items()):
            m.d.comb += [
                flat(switch.wire_in[port]).eq(delay_line(m, f"{side}_to_switch", sent[side],
                                                         self.wire_delay)),
                flat(nic.wire_in).eq(delay_line(m, f"switch_to_{side}",
                                                flat(switch.wire_out[port]), self.wire_delay)),
            ]
        return m


# The two-NIC tests' build (the tests' 16-QP NIC on both sides, 8 cycles of cable).
PAIR = dict(TEST_NIC, wire_delay=8)


def nic_pair_top(**params):
    return NicPairTop(**params)
