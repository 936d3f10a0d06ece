"""Cycle-level model of the cut-through switch, factored like BookSim (docs/models.md):
traffic, tables, allocators and input buffers by name, router, network, statistics."""

from .allocators import ALLOCATORS, IslipAllocator
from .buffers import BUFFERS, FifoBuffer, VoqBuffer
from .network import Network, run_switch
from .router import (DEFAULT_VL_WEIGHT, MAX_DATA_VLS, RTL_ALLOCATORS, Router, SwitchPacket,
                     stream_to_one_output)
from .routing import DROP_REASONS, ForwardingTable, SlToVl, forward
from .scoreboard import FlowScoreboard
from .stats import SwitchStats, check_lossless, jain_index
from .traffic import PATTERNS, Traffic, make_traffic

__all__ = [
    "ALLOCATORS", "BUFFERS", "DEFAULT_VL_WEIGHT", "DROP_REASONS", "MAX_DATA_VLS", "PATTERNS",
    "RTL_ALLOCATORS",
    "FifoBuffer", "FlowScoreboard", "ForwardingTable", "IslipAllocator", "Network", "Router",
    "SlToVl", "SwitchPacket", "SwitchStats", "Traffic", "VoqBuffer", "check_lossless",
    "forward", "jain_index", "make_traffic", "run_switch", "stream_to_one_output",
]
