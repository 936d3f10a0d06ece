"""Simulation top of a leaf/spine fabric (:class:`models.fabric.LeafSpine`): every NIC
with its own memory port and registers, every leaf and spine switch with its registers,
each link a cable of its own wire delay (docs/fabric.md).

Build time decides the structure. The NIC and the switch (one per switch size;
:func:`module_specs`) are separately built modules (:mod:`hdl.fabric.separate_modules`): emitted once each
as Verilog modules of their own, instantiated through :class:`hdl.fabric.blackbox.BlackBox`,
built by Verilator as hierarchical blocks, so each is verilated and compiled once, as a
library all its instances share; the NIC is the same module as the other test tops'.
``separate_modules=False`` builds the same top from the real components, flattened, for
comparison; ``run_fabric(hierarchical=False)`` keeps the modules but lets Verilator compile
them as one design (far bigger C++: docs/fabric.md).

Ports of the top (prefix ``nic<n>_`` for NIC ``n``, ``<switch>_`` for ``leaf<l>`` and
``spine<s>``):

- ``nic<n>_axil__*``: the NIC's 64-bit AXI4-Lite slave (registers, UAR page);
  ``nic<n>_axi__*``: its AXI4 master for an ``AxiRam``, read requests held
  ``memory_latency`` cycles (one port for all NICs) by
  :class:`tb.gateware.axi_read_delay.AxiReadDelay`; ``nic<n>_ar_fire``/``nic<n>_ar_id``:
  each read burst before that delay; ``nic<n>_link_state``; ``nic<n>_wire_monitor`` and
  ``nic<n>_wire_in_monitor``: the NIC's own wire out and in at its pins (the names
  :class:`tb.nic_host.NicHost` and :class:`tb.nic_tb.BusMonitor` expect);
  ``nic<n>_busy_beats``: data beats the NIC has sent since reset (32 bits, wrapping).
- ``<switch>_axil__*``: the switch's 32-bit AXI4-Lite slave (docs/switch-registers.md);
  ``<switch>_link_state__<p>``, ``<switch>_overflow__<p>``; ``<switch>_in__<p>__*`` and
  ``<switch>_out__<p>__*``: the wire into and out of each port at the switch's pins, for
  hop latencies; ``<switch>_busy_beats__<p>``: data beats each port has sent since reset
  (for per-link utilisation, read once per sample window).

- ``link_cut``: one bit per cable, in the order of ``models.fabric.LeafSpine.links``: while
  a bit is set, that cable loses every beat both ways at its ends' outputs (a cut cable:
  flow-control packets and the middle of a packet included; beats already on the cable
  still arrive).

Every cable is a :func:`tb.link_pair.delay_line` of its link's delay, each way.
"""
from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteSignature
from hdl.link.signatures import LinkState, WireSignature
from hdl.nic.signatures import AXI_ID_BITS
from models.fabric import LeafSpine
from hdl.fabric import separate_modules
from tb import hier_build

__all__ = ["FabricTop", "FABRIC_DEFAULTS", "fabric_of", "module_specs", "fabric_top",
           "run_fabric"]

NIC_WIDTH = 64
SWITCH_ADDR_WIDTH = 16

# Parameters of the top. The NIC is the tests' (hier_build.TEST_NIC: 16 QPs), the one the
# other test tops build, so that its compiled objects are shared (ccache).
FABRIC_DEFAULTS = dict(nics_per_leaf=2, leaves=4, spines=2, wire_delay=8, link_delays=None,
                       **hier_build.TEST_NIC, max_memory_latency=1023, outstanding_reads=64,
                       separate_modules=True)


def fabric_of(params):
    """The :class:`LeafSpine` a parameter dict describes."""
    p = {**FABRIC_DEFAULTS, **params}
    return LeafSpine(p["nics_per_leaf"], p["leaves"], p["spines"], wire_delay=p["wire_delay"],
                     link_delays=p["link_delays"])


def module_specs(params):
    """``{role: (kind, constructor kwargs)}`` of the components the top instantiates:
    ``"nic"``, and ``"switch_<P>p"`` for each switch size."""
    p = {**FABRIC_DEFAULTS, **params}
    fabric = fabric_of(p)
    specs = {"nic": ("nic", dict(num_qps=p["num_qps"], num_cqs=p["num_cqs"],
                                 num_mkeys=p["num_mkeys"], num_vls=p["num_vls"], mtu=p["mtu"],
                                 addr_width=p["addr_width"]))}
    for ports in sorted(set(fabric.switches.values())):
        specs[f"switch_{ports}p"] = ("switch", dict(
            ports=ports, num_vls=p["num_vls"], mtu=p["mtu"], lids=fabric.lids,
            addr_width=SWITCH_ADDR_WIDTH))
    return specs


def _flat(wire):
    return Cat(getattr(wire, name) for name in WireSignature(8).members)


def _cable(wire, cut):
    """The beats ``wire`` puts on its cable: none while ``cut``."""
    return Cat(wire.valid & ~cut if name == "valid" else getattr(wire, name)
               for name in WireSignature(8).members)


# Data beats each link end has sent since reset (wraps): the scenario reads them once per
# sample window for per-link utilisation (reading every wire every cycle from Python would
# cost about half the simulation speed).
BUSY_COUNTER_BITS = 32


def _count_busy_beats(m, wire, counter):
    m.d.sync += counter.eq(counter + (wire.valid & ~wire.link))


class FabricTop(wiring.Component):
    def __init__(self, **params):
        unknown = set(params) - set(FABRIC_DEFAULTS)
        if unknown:
            raise ValueError(f"Unknown fabric parameters: {', '.join(sorted(unknown))}")
        p = self.params = {**FABRIC_DEFAULTS, **params}
        self.fabric = fabric = fabric_of(p)
        if not 1 <= p["max_memory_latency"] < 1 << 16:
            raise ValueError(f"max_memory_latency must be 1 to 65535, not {p['max_memory_latency']!r}")
        specs = module_specs(p)
        if p["separate_modules"]:
            self.hier_blocks = separate_modules.SeparateModules()

            def make(role):
                kind, kwargs = specs[role]
                return self.hier_blocks.black_box(kind, **kwargs)
        else:
            def make(role):
                return separate_modules.component(*specs[role])
        self.nics = [make("nic") for _ in range(fabric.nics)]
        self.switches = {name: make(f"switch_{ports}p") for name, ports in fabric.switches.items()}
        from tb.gateware.axi_read_delay import AxiReadDelay
        self.read_delays = [AxiReadDelay(addr_width=p["addr_width"], depth=p["outstanding_reads"],
                                         max_latency=p["max_memory_latency"])
                            for _ in range(fabric.nics)]
        axi = self.nics[0].signature.members["axi"].signature
        members = {"memory_latency": In(range(p["max_memory_latency"] + 1)),
                   "link_cut": In(len(fabric.links))}
        for n in range(fabric.nics):
            members.update({
                f"nic{n}_axil": In(AxiLiteSignature(16, data_width=64)),
                f"nic{n}_axi": Out(axi),
                f"nic{n}_link_state": Out(LinkState),
                f"nic{n}_ar_fire": Out(1),
                f"nic{n}_ar_id": Out(AXI_ID_BITS),
                f"nic{n}_wire_monitor": Out(WireSignature(NIC_WIDTH)),
                f"nic{n}_wire_in_monitor": Out(WireSignature(NIC_WIDTH)),
                f"nic{n}_busy_beats": Out(BUSY_COUNTER_BITS),
            })
        for name, ports in fabric.switches.items():
            members.update({
                f"{name}_axil": In(AxiLiteSignature(SWITCH_ADDR_WIDTH)),
                f"{name}_link_state": Out(LinkState).array(ports),
                f"{name}_overflow": Out(1).array(ports),
                f"{name}_in": Out(WireSignature(NIC_WIDTH)).array(ports),
                f"{name}_out": Out(WireSignature(NIC_WIDTH)).array(ports),
                f"{name}_busy_beats": Out(BUSY_COUNTER_BITS).array(ports),
            })
        super().__init__(members)

    def elaborate(self, platform):
        from tb.link_pair import delay_line
        from tb.nic_top import attach_memory

        m = Module()
        fabric = self.fabric
        ends = {}       # (node, port) -> (wire_out, wire_in) at that end's pins
        for n, nic in enumerate(self.nics):
            m.submodules[f"nic{n}"] = nic
            delay = m.submodules[f"read_delay{n}"] = self.read_delays[n]
            wiring.connect(m, wiring.flipped(getattr(self, f"nic{n}_axil")), nic.axil)
            attach_memory(m, nic, getattr(self, f"nic{n}_axi"), delay, self.memory_latency)
            m.d.comb += [
                getattr(self, f"nic{n}_link_state").eq(nic.link_state),
                getattr(self, f"nic{n}_ar_fire").eq(nic.axi.arvalid & delay.up_arready),
                getattr(self, f"nic{n}_ar_id").eq(nic.axi.arid),
                _flat(getattr(self, f"nic{n}_wire_monitor")).eq(_flat(nic.wire_out)),
                _flat(getattr(self, f"nic{n}_wire_in_monitor")).eq(_flat(nic.wire_in)),
            ]
            ends[(fabric.nic_name(n), 0)] = (nic.wire_out, nic.wire_in)
            _count_busy_beats(m, nic.wire_out, getattr(self, f"nic{n}_busy_beats"))
        for name, switch in self.switches.items():
            m.submodules[name] = switch
            wiring.connect(m, wiring.flipped(getattr(self, f"{name}_axil")), switch.axi)
            for port in range(fabric.switches[name]):
                m.d.comb += [
                    getattr(self, f"{name}_link_state")[port].eq(switch.link_state[port]),
                    getattr(self, f"{name}_overflow")[port].eq(switch.overflow[port]),
                    _flat(getattr(self, f"{name}_in")[port]).eq(_flat(switch.wire_in[port])),
                    _flat(getattr(self, f"{name}_out")[port]).eq(_flat(switch.wire_out[port])),
                ]
                ends[(name, port)] = (switch.wire_out[port], switch.wire_in[port])
                _count_busy_beats(m, switch.wire_out[port], getattr(self, f"{name}_busy_beats")[port])
        for index, link in enumerate(fabric.links):
            (a_out, a_in), (b_out, b_in) = ends[link.a], ends[link.b]
            cut = self.link_cut[index]
            m.d.comb += [
                _flat(b_in).eq(delay_line(m, f"{link.name}_down", _cable(a_out, cut), link.delay)),
                _flat(a_in).eq(delay_line(m, f"{link.name}_up", _cable(b_out, cut), link.delay)),
            ]
        return m


def fabric_top(**params):
    """The runner's factory (tb/runner.py)."""
    return FabricTop(**params)


def run_fabric(*, module, params, hierarchical=True, **kwargs):
    """Build and run ``module``'s cocotb tests on the fabric top (:func:`tb.runner.run`),
    its separately built modules each a hierarchical block unless ``hierarchical`` is
    False."""
    from tb import runner
    from tb.nic_top import BUILD_ARGS
    return runner.run(module=module, toplevel="fabric_top", factory=fabric_top, params=params,
                      hierarchical=hierarchical,
                      build_args=[*BUILD_ARGS, *kwargs.pop("build_args", ())], **kwargs)
