"""cocotb helpers for simulations of :class:`tb.link_pair.LinkPair`."""
from cocotb.triggers import RisingEdge

from hdl.link.signatures import LinkState

__all__ = ["bring_up", "read_port"]


async def bring_up(dut, loop, *, wire_delay=None, limit=20000):
    """Reset both ends and run ``loop`` until both report the link ACTIVE."""
    if wire_delay is not None:
        dut.wire_delay_cycles.value = wire_delay
    dut.a_reset.value = 0
    dut.b_reset.value = 0
    dut.rst.value = 1
    for _ in range(4):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await wait_active(dut, loop, limit=limit)


async def wait_active(dut, loop, *, limit=20000):
    active = LinkState.ACTIVE.value
    await loop.run(until=lambda: read_port(dut, "state", "a") == active
                   and read_port(dut, "state", "b") == active, limit=limit)


def read_port(dut, name, side, vl=None):
    """A status port of one end, e.g. ``read_port(dut, "fctbs", "a", 0)`` reads ``a_fctbs__0``."""
    return int(getattr(dut, f"{side}_{name}" + (f"__{vl}" if vl is not None else "")).value)
