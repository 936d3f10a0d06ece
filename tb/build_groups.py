"""Which pytest items share a Verilator build, and a pytest-xdist scheduler that runs each
such group on one worker (tb/conftest.py, the Makefile's --dist loadgroup).

A build is elaborated and verilated in one process (minutes for the NIC); a second worker
that needs the same build waits for it, idle. With its items on one worker, the other
worker runs other items meanwhile. pytest-xdist's own loadgroup reads ``xdist_group``
marks, but with pytest 9.2 its worker-side renaming of node ids (``item._nodeid``) no
longer takes effect, so the groups are named here, from the node ids.
"""
from xdist.scheduler import LoadScopeScheduling

__all__ = ["build_group", "BuildGroupScheduling"]

# Test modules whose items all run on one build (test_fabric_moe: make test's two on the
# reduced fabric; its full items, on the default fabric, share their own build).
ONE_BUILD = {"test_nic": "nic_top", "test_nic_responder": "nic_top",
             "test_nic_pair": "nic_pair_top", "test_fabric_moe": "fabric_top"}
# Test modules whose items name their build first in their parameters ("voq_w16-incast").
BUILD_IN_PARAMETERS = {"test_switch": "switch_top", "test_link": "link_pair"}


def build_group(nodeid):
    """The build ``nodeid``'s item shares with others, or None."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    if module in ONE_BUILD:
        return ONE_BUILD[module]
    if module in BUILD_IN_PARAMETERS and name.endswith("]") and "[" in name:
        build = name[name.index("[") + 1:-1].split("-")[0]
        return f"{BUILD_IN_PARAMETERS[module]}[{build}]"
    return None


class BuildGroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a build's items as one scope and every other item a
    scope of its own, handed out in collection order (with --no-loadscope-reorder)."""

    def _split_scope(self, nodeid):
        return build_group(nodeid) or nodeid
