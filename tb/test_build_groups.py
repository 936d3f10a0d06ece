"""tb/build_groups.py: the items that share a Verilator build are one group; no other item
is in a group."""
import pytest

from tb.build_groups import BuildGroupScheduling, build_group


@pytest.mark.parametrize("nodeid, group", [
    ("tb/test_nic.py::test_nic[random]", "nic_top"),
    ("tb/test_nic.py::test_nic_random_capture_decodes_in_tshark", "nic_top"),
    ("tb/test_nic_responder.py::test_nic_responder", "nic_top"),
    ("tb/test_nic_pair.py::test_nic_pair[loss]", "nic_pair_top"),
    ("tb/test_switch.py::test_switch[voq_w16-incast]", "switch_top[voq_w16]"),
    ("tb/test_switch.py::test_switch[voq_islip-incast]", "switch_top[voq_islip]"),
    ("tb/test_link.py::test_link[w16_ct1]", "link_pair[w16_ct1]"),
    ("tb/test_link.py::test_link_capture_decodes_in_tshark[w16_ct1]", "link_pair[w16_ct1]"),
    ("tb/test_crc.py::test_crc[w8g1]", None),
    ("tb/test_doorbell_scheduler.py::test_random[64-7-1000]", None),
    ("tb/test_switch.py::test_bad_parameters", None),
])
def test_build_group(nodeid, group):
    assert build_group(nodeid) == group


def test_scheduler_scopes_are_the_groups():
    scheduling = BuildGroupScheduling.__new__(BuildGroupScheduling)
    assert scheduling._split_scope("tb/test_nic.py::test_nic[directed]") == "nic_top"
    assert scheduling._split_scope("tb/test_arith.py::test_sum") == "tb/test_arith.py::test_sum"
