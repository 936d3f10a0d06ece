"""What the block tests that run in Amaranth's simulator share: running a testbench, driving
inputs, the parameter checks, the Verilator lint of a component's Verilog."""
import gc
import warnings

import pytest
from amaranth.hdl import Cat, Const, UnusedElaboratable, Value, ValueCastable
from amaranth.sim import Simulator

__all__ = ["simulate", "Driver", "assert_rejected", "assert_lint_clean"]


def simulate(dut, testbench, *, clock=True, background=()):
    """Run ``testbench`` (an ``async def testbench(ctx)``) on ``dut`` with one clock (none for
    a combinational ``dut``: ``clock=False``) until it returns, with the ``background``
    testbenches (bus models) beside it. The tests count cycles, never time: the period is
    arbitrary."""
    sim = Simulator(dut)
    if clock:
        sim.add_clock(1e-8)
    sim.add_testbench(testbench)
    for process in background:
        sim.add_testbench(process, background=True)
    sim.run()


class Driver:
    """A testbench's inputs, applied together by :meth:`apply`: the simulator settles the
    design once per ``apply`` instead of once per ``ctx.set``, which is most of a large
    block's simulation time. Only changed values are applied."""

    def __init__(self):
        self._applied = {}
        self._pending = {}

    def set(self, signal, value):
        """Drive ``signal`` (a value or a value-castable such as an enum-shaped field) with
        ``value`` from the next :meth:`apply` on."""
        if isinstance(signal, ValueCastable):
            value = signal.shape().const(value)
        value = Const.cast(value).value
        signal = Value.cast(signal)
        # Payload fields are fresh slices on every access: key a slice by what it selects.
        # Every keyed value stays referenced here, so no id is reused while it is a key.
        key = ((id(signal.value), signal.start, signal.stop) if hasattr(signal, "stop")
               else id(signal))
        value &= (1 << len(signal)) - 1
        if self._applied.get(key, (None, None))[1] != value:
            self._pending[key] = (signal, value)
        else:
            self._pending.pop(key, None)

    def apply(self, ctx):
        """Apply every value set since the last call, in one step of the design."""
        if not self._pending:
            return
        signals, packed, offset = [], 0, 0
        for key, (signal, value) in self._pending.items():
            signals.append(signal)
            packed |= value << offset
            offset += len(signal)
            self._applied[key] = (signal, value)
        self._pending.clear()
        ctx.set(Cat(*signals), packed)


def assert_rejected(component_class, args):
    """``component_class(**args)`` must raise ``ValueError``."""
    # The half-built component would warn, when collected, that it was never elaborated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError):
                component_class(**args)
        finally:
            gc.collect()


def assert_lint_clean(dut, name, directory):
    """Verilator lints ``dut``'s Verilog (module ``name``, written into ``directory``)
    clean. The ports are listed by hand: members that are constants (an always-ready
    ``ready``) are not ports."""
    from hdl.emit import to_verilog
    from hdl.lint import lint_file, setup_verilator_env
    setup_verilator_env()
    ports = [Value.cast(port) for _, _, port in dut.signature.flatten(dut)
             if not isinstance(port, Const)]
    path = directory / f"{name}.v"
    path.write_text(to_verilog(dut, name, ports=ports))
    ok, _, output = lint_file(path)
    assert ok, output[:3000]
