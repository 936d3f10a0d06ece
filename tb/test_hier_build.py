"""hdl/fabric/separate_modules.py and tb/hier_build.py: module names, the modules a top
declares, the Verilator inputs.
Pure Python (no simulator): elaborates no component, only builds signatures."""
import pytest

from hdl.fabric import separate_modules
from tb import hier_build


def test_module_name_is_the_hardware_not_the_spelling():
    explicit = dict(hier_build.TEST_NIC, fetch_buffer_blocks=256, payload_buffer_beats=512)
    assert separate_modules.module_name("nic", hier_build.TEST_NIC) == \
        separate_modules.module_name("nic", explicit)
    assert separate_modules.module_name("nic", hier_build.TEST_NIC) != \
        separate_modules.module_name("nic", dict(hier_build.TEST_NIC, num_qps=8))
    assert separate_modules.module_name("nic", {}) != separate_modules.module_name("switch", {})


@pytest.mark.parametrize("kind, kwargs, message", [
    ("router", {}, "Unknown module kind 'router'"),
    ("nic", dict(num_ports=2), "nic: unknown parameters num_ports"),
])
def test_bad_specs_are_refused(kind, kwargs, message):
    with pytest.raises(ValueError, match=message):
        separate_modules.module_name(kind, kwargs)


def test_a_top_declares_each_module_once():
    """Both NICs of the pair are one module, the switch another; the black boxes have the
    real components' signatures."""
    from hdl.nic.nic import Nic
    from tb.nic_pair_top import NicPairTop
    top = NicPairTop(**hier_build.TEST_NIC, through_switch=True)
    nic = separate_modules.module_name("nic", hier_build.TEST_NIC)
    assert sorted(separate_modules.modules_of(top)) == sorted(
        [nic, separate_modules.module_name("switch", dict(ports=2, lids=256))])
    assert {box.module for box in top.nics.values()} == {nic}
    ports = [(path, member.flow, member.shape)
             for path, member in Nic(**hier_build.TEST_NIC).signature.members.flatten()
             if member.is_port]
    assert [(path, member.flow, member.shape)
            for path, member in top.nics["a"].signature.members.flatten()
            if member.is_port] == ports
    assert separate_modules.modules_of(object()) == {}


def test_hier_config_and_inputs(tmp_path):
    path = hier_build.hier_config(["tf_b", "tf_a"], tmp_path / "blocks.vlt")
    assert path.read_text() == ('`verilator_config\nhier_block -module "tf_a"\n'
                                'hier_block -module "tf_b"\n')
    assert hier_build.build_inputs({}, tmp_path) == ([], [])
