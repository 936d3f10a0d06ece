import warnings

from amaranth.hdl import UnusedElaboratable

# Parameter-validation tests construct components that raise before use; Amaranth would
# report each at interpreter exit.
warnings.filterwarnings("ignore", category=UnusedElaboratable)

# The modules that run first, in this order, under pytest-xdist (the Makefile sends items
# one at a time, --maxschedchunk 1): the slowest start first and the short ones fill the
# other worker around them, so a run ends with short items instead of one worker finishing
# a long one alone. First the modules that build Verilator tops (a build gates every item
# that shares it), then the long runs in Amaranth's simulator; the rest keep pytest's order.
# Only the order depends on this list, never what runs.
FIRST = [
    "test_switch", "test_nic", "test_fabric_moe", "test_nic_pair", "test_link", "test_fpga",
    "test_nic_responder", "test_crc", "test_islip", "test_packet_gateware",
    "test_switch_registers", "test_fabric", "test_emit", "test_headers",
    "test_doorbell_scheduler", "test_response_generator", "test_responder_engine",
    "test_packet_assembler", "test_wqe_executor", "test_response_writer",
    "test_completion_unit", "test_completion_unit_receive", "test_voq_buffer",
]


def pytest_collection_modifyitems(items):
    rank = {module: n for n, module in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(FIRST)))
