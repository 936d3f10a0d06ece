import warnings

import pytest
from amaranth.hdl import UnusedElaboratable

from tb.pysim_parity import install as install_fast_parity

# Parameter-validation tests construct components that raise before use; Amaranth would
# report each at interpreter exit.
warnings.filterwarnings("ignore", category=UnusedElaboratable)

# Amaranth's simulator: reduction XORs (the CRCs) by int.bit_count(), not through a string.
install_fast_parity()

# How pytest-xdist shares the items between its workers (the Makefile's --dist loadgroup,
# --no-loadscope-reorder): the items of one Verilator build run on one worker, one after
# the other (tb/build_groups.py), so that no worker sits idle waiting for a build another
# is making; every other item goes on its own to whichever worker is free.
#
# The modules that run first, in this order: the slowest start first and the short ones
# fill the other worker around them, so a run ends with short items instead of one worker
# finishing a long one alone. First the modules that build Verilator tops, the NIC's first
# (nic_top emits and compiles the NIC module that the fabric and pair tops share: they come
# after the switch, link and synthesis items, so as not to wait for it), then the long runs
# in Amaranth's simulator; the rest keep pytest's order. Only the order depends on this
# list, never what runs.
FIRST = [
    "test_nic", "test_nic_responder", "test_switch", "test_link", "test_fpga",
    "test_fabric_moe", "test_nic_pair",
    "test_crc", "test_islip", "test_packet_gateware",
    "test_switch_registers", "test_fabric", "test_emit", "test_headers",
    "test_doorbell_scheduler", "test_response_generator", "test_responder_engine",
    "test_packet_assembler", "test_wqe_executor", "test_response_writer",
    "test_completion_unit", "test_completion_unit_receive", "test_voq_buffer",
]


def pytest_collection_modifyitems(items):
    rank = {module: n for n, module in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(FIRST)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        from tb.build_groups import BuildGroupScheduling
        return BuildGroupScheduling(config, log)
    return None
