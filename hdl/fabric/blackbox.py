"""A component that stands for another one emitted as its own Verilog module.

A fabric of 8 NICs and 6 switches flattened into one Amaranth design is one huge Verilog
module that Verilator compiles as a whole, instance by instance. :class:`BlackBox` keeps
the interface of the real component (same signature, so ``wiring.connect`` and attribute
access work unchanged) but elaborates to a single ``Instance`` of a module emitted once
on its own (``hdl.emit.to_verilog(component, module)``); built as a
Verilator hierarchical block, that module is compiled once whatever the number of
instances, and its objects are shared by every top built with it
(:mod:`hdl.fabric.separate_modules` makes the black boxes of the simulation tops,
tb/hier_build.py emits and compiles their modules; docs/verilog.md,
Simulation builds).

The Verilog port names are Amaranth's for a top: the signature path joined by ``__``
(``wire_in__2__valid``), plus ``clk`` and ``rst`` of the ``sync`` domain.
"""
from amaranth import ClockSignal, Instance, Module, ResetSignal
from amaranth.lib import wiring
from amaranth.lib.wiring import In

__all__ = ["BlackBox", "port_names"]


def port_names(signature, obj):
    """``{verilog port name: (flow, value)}`` for the ports of ``obj`` (a component with
    ``signature``), named as ``verilog.convert`` names a top's ports; ``flow`` is ``In``
    or ``Out`` as seen from ``obj``."""
    return {"__".join(str(part) for part in path): (member.flow, value)
            for path, member, value in signature.flatten(obj)}


class BlackBox(wiring.Component):
    """An ``Instance`` of Verilog module ``module`` with ``signature`` as its ports.

    ``signature`` is the signature of the component the module was emitted from, e.g.
    ``Nic(...).signature``. Its clock and reset are the ``sync`` domain's.
    """

    def __init__(self, signature, module):
        if not isinstance(module, str) or not module.isidentifier():
            raise ValueError(f"Module name must be a plain Verilog identifier, not {module!r}")
        self.module = module
        super().__init__(signature)

    def elaborate(self, platform):
        m = Module()
        ports = {}
        for name, (flow, value) in port_names(self.signature, self).items():
            ports[("i_" if flow == In else "o_") + name] = value
        m.submodules.instance = Instance(self.module, i_clk=ClockSignal(), i_rst=ResetSignal(),
                                         **ports)
        return m
