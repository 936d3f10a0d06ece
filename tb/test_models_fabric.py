"""models/fabric.py: the leaf/spine topology and its forwarding tables (no simulator)."""
import itertools

import pytest

from models.fabric import DOWN, UP, LeafSpine

SIZES = [(2, 4, 2), (2, 2, 1), (1, 2, 1), (4, 3, 3), (3, 8, 4), (8, 16, 8)]


@pytest.mark.parametrize("npl,leaves,spines", SIZES)
def test_every_pair_reachable_with_minimum_hops(npl, leaves, spines):
    fabric = LeafSpine(npl, leaves, spines)
    assert fabric.nics == npl * leaves
    for src, dst in itertools.permutations(range(fabric.nics), 2):
        route = fabric.route(src, dst)
        same_leaf = fabric.leaf_of(src) == fabric.leaf_of(dst)
        assert len(route) == (1 if same_leaf else 3), (src, dst, route)
        assert fabric.hops(src, dst) == len(route)
        # the path ends at the destination's cable
        last = route[-1]
        (node, port), _ = fabric.peer(last.switch, last.out_port)
        assert (node, port) == (fabric.nic_name(dst), 0)
        # a packet never leaves by the port it came in on
        assert all(h.in_port != h.out_port for h in route)
    assert fabric.hops(0, 0) == 0


@pytest.mark.parametrize("npl,leaves,spines", SIZES)
def test_up_then_down(npl, leaves, spines):
    fabric = LeafSpine(npl, leaves, spines)
    for src, dst in itertools.permutations(range(fabric.nics), 2):
        directions = [h.direction for h in fabric.route(src, dst)]
        assert directions == sorted(directions, key=lambda d: d == DOWN), directions
        assert directions[-1] == DOWN
        # no switch is crossed twice
        switches = [h.switch for h in fabric.route(src, dst)]
        assert len(set(switches)) == len(switches)
    # a spine only ever sends down
    for switch, table in fabric.forwarding_tables().items():
        if switch.startswith("spine"):
            assert all(fabric.port_direction(switch, p) == DOWN for p in table.values())


def test_default_fabric_numbers():
    fabric = LeafSpine()
    assert (fabric.nics, fabric.leaf_ports, fabric.spine_ports) == (8, 4, 4)
    assert [fabric.lid(n) for n in range(8)] == list(range(1, 9))
    assert fabric.lids == 16
    assert fabric.switches == {"leaf0": 4, "leaf1": 4, "leaf2": 4, "leaf3": 4,
                               "spine0": 4, "spine1": 4}
    assert len(fabric.links) == 8 + 4 * 2
    assert fabric.leaf_of(5) == 2 and fabric.nic_port(5) == 1 and fabric.neighbour(5) == 4
    # NIC 0 (LID 1) to NIC 7 (LID 8, leaf 3): up to spine 8 % 2 = 0, down to leaf 3, port 1
    assert [(h.switch, h.in_port, h.out_port, h.direction) for h in fabric.route(0, 7)] == [
        ("leaf0", 0, 2, UP), ("spine0", 0, 3, DOWN), ("leaf3", 2, 1, DOWN)]
    assert [(h.switch, h.in_port, h.out_port) for h in fabric.route(0, 1)] == [("leaf0", 0, 1)]
    assert fabric.path_wire_delay(0, 7) == 4 * 8
    assert fabric.path_wire_delay(0, 1) == 2 * 8
    entries = fabric.ft_entries("leaf1")
    assert len(entries) == 16 and entries[0] == (0, 0, 0)
    assert entries[3] == (3, 0, 1) and entries[4] == (4, 1, 1)      # NICs 2, 3: down
    assert entries[1] == (1, 3, 1) and entries[2] == (2, 2, 1)      # LID 1 odd: spine 1


@pytest.mark.parametrize("npl,leaves,spines", SIZES)
def test_destinations_spread_over_spines(npl, leaves, spines):
    fabric = LeafSpine(npl, leaves, spines)
    per_spine = {s: set() for s in range(spines)}
    for src, dst in itertools.permutations(range(fabric.nics), 2):
        route = fabric.route(src, dst)
        if len(route) == 3:
            spine = int(route[1].switch[len("spine"):])
            assert spine == fabric.lid(dst) % spines      # one tree per destination
            per_spine[spine].add(dst)
    if leaves > 1:
        counts = [len(d) for d in per_spine.values()]
        assert max(counts) - min(counts) <= 1, counts     # destinations evenly spread
        assert all(counts) or fabric.nics < spines


def test_per_link_delays():
    fabric = LeafSpine(wire_delay=5, link_delays={"leaf0-spine1": 40, "nic7-leaf3": 2})
    assert fabric.link("leaf0-spine1").delay == 40
    assert fabric.link("nic7-leaf3").delay == 2
    assert fabric.link("nic0-leaf0").delay == 5
    # NIC 0 -> NIC 7 (LID 8) goes over spine 0: 5 + 5 + 5 + 2
    assert fabric.path_wire_delay(0, 7) == 17
    # NIC 0 -> NIC 6 (LID 7) over spine 1: 5 + 40 + 5 + 5
    assert fabric.path_wire_delay(0, 6) == 55


@pytest.mark.parametrize("kwargs,match", [
    (dict(nics_per_leaf=0), "nics_per_leaf"),
    (dict(leaves=1), "leaves"),
    (dict(leaves=17), "leaves"),
    (dict(spines=0), "spines"),
    (dict(nics_per_leaf=15, spines=2), "at most 16"),
    (dict(nics_per_leaf=2.0), "integer"),
    (dict(leaves=True), "integer"),
    (dict(wire_delay=0), "wire_delay"),
    (dict(wire_delay=5000), "wire_delay"),
    (dict(link_delays={"leaf0-spine9": 3}), "leaf0-spine9"),
    (dict(link_delays={"nic0-leaf0": 0}), "nic0-leaf0"),
    (dict(base_lid=0), "base_lid"),
    (dict(base_lid=0xBFFF), "unicast"),
])
def test_invalid_sizes_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LeafSpine(**kwargs)


def test_invalid_queries_rejected():
    fabric = LeafSpine()
    with pytest.raises(ValueError, match="NIC must be"):
        fabric.lid(8)
    with pytest.raises(ValueError, match="no NIC"):
        fabric.out_port("leaf0", 9)
    with pytest.raises(ValueError, match="no switch"):
        fabric.out_port("spine2", 1)
    with pytest.raises(ValueError, match="no port"):
        fabric.peer("leaf0", 4)
