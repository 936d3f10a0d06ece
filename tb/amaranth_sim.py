"""What the block tests that run in Amaranth's simulator share: running a testbench, the
parameter checks, the Verilator lint of a component's Verilog."""
import gc
import warnings

import pytest
from amaranth.hdl import Const, UnusedElaboratable, Value
from amaranth.sim import Simulator

__all__ = ["simulate", "assert_rejected", "assert_lint_clean"]


def simulate(dut, testbench):
    """Run ``testbench`` (an ``async def testbench(ctx)``) on ``dut`` with one clock until
    it returns. The tests count cycles, never time: the period is arbitrary."""
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(testbench)
    sim.run()


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
    from amaranth.back import verilog
    from hdl.lint import lint_file
    from tb.runner import setup_verilator_env
    setup_verilator_env()
    ports = [Value.cast(port) for _, _, port in dut.signature.flatten(dut)
             if not isinstance(port, Const)]
    path = directory / f"{name}.v"
    path.write_text(verilog.convert(dut, name=name, ports=ports, emit_src=False))
    ok, _, output = lint_file(path)
    assert ok, output[:3000]
