"""Switch and VoqBuffer parameters: every bad value is refused with a ValueError naming it."""
import pytest

from hdl.switch.switch import Switch
from hdl.switch.voq_buffer import VoqBuffer


@pytest.mark.parametrize("kwargs,words", [
    (dict(ports=1), "Ports"),
    (dict(ports=17), "Ports"),
    (dict(num_vls=0), "VLs"),
    (dict(num_vls=5), "VLs"),
    (dict(width=48), "Beat width"),
    (dict(mtu=8192), "MTU"),
    (dict(mtu=128), "MTU"),
    (dict(buffer_blocks=10), "Receive buffer"),
    (dict(buffer_blocks=4096), "Receive buffer"),
    (dict(lids=1000), "LIDs"),
    (dict(mode="oq"), "mode"),
    (dict(islip_iterations=0), "iSLIP"),
    (dict(islip_iterations=5), "iSLIP"),
    (dict(allocator="wavefront"), "allocator"),
    (dict(fc_period=8), "Flow-control period"),
    (dict(addr_width=8), "Address width"),
])
def test_switch_rejects(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Switch(**kwargs)


def test_switch_defaults():
    switch = Switch(ports=2)
    assert (switch.num_vls, switch.width, switch.mtu, switch.buffer_blocks, switch.mode,
            switch.allocator, switch.hop_latency_cycles) == (2, 64, 4096, 132, "voq", "pipelined", 8)


@pytest.mark.parametrize("kwargs,words", [
    (dict(mode="oq"), "Queue mode"),
    (dict(ports=1), "Ports"),
    (dict(num_vls=16), "VLs"),
    (dict(share=1), "Cells per VL"),
    (dict(width=3), "Beat width"),
])
def test_voq_buffer_rejects(kwargs, words):
    config = dict(width=8, num_vls=2, ports=3, share=24)
    config.update(kwargs)
    with pytest.raises(ValueError, match=words):
        VoqBuffer(**config)


@pytest.mark.parametrize("block,kwargs,words", [
    ("crossbar", dict(ports=1), "Ports"),
    ("crossbar", dict(ports=17), "Ports"),
    ("crossbar", dict(num_vls=0), "VLs"),
    ("crossbar", dict(width=24), "Beat width"),
    ("allocation_control", dict(ports=17), "Ports"),
    ("allocation_control", dict(num_vls=5), "VLs"),
    ("allocation_control", dict(width=4), "Beat width"),
    ("allocation_control", dict(mode="oq"), "Queue mode"),
])
def test_pipelined_blocks_reject(block, kwargs, words):
    from hdl.switch.allocation_control import AllocationControl
    from hdl.switch.crossbar import Crossbar
    config = dict(ports=4, num_vls=2, width=16)
    config.update(kwargs)
    with pytest.raises(ValueError, match=words):
        {"crossbar": Crossbar, "allocation_control": AllocationControl}[block](**config)
