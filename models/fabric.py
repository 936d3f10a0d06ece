"""Topology model of a two-level leaf/spine fabric, and the forwarding tables a subnet
manager computes for it (docs/fabric.md).

:class:`LeafSpine` numbers everything the RTL fabric (tb/fabric_top.py) is built from:

- **NICs** ``0 .. nics - 1``; NIC ``n`` sits on leaf ``n // nics_per_leaf`` and has LID
  ``base_lid + n`` (LID 0 is reserved in InfiniBand).
- **Leaf** ``l`` has ``nics_per_leaf + spines`` ports: port ``k < nics_per_leaf`` goes down
  to NIC ``l * nics_per_leaf + k``, port ``nics_per_leaf + s`` up to spine ``s``.
- **Spine** ``s`` has ``leaves`` ports: port ``l`` goes down to leaf ``l``.
- **Links** (:class:`Link`): one cable per NIC (NIC - leaf) and one per (leaf, spine) pair,
  each with its own one-way wire delay in cycles (cable plus PHY), the same both ways.

Routing (:meth:`LeafSpine.forwarding_tables`) is minimum hop and up/down: a leaf sends a
packet for one of its own NICs straight down, any other up to spine ``dlid mod spines``
(destinations spread over the spines, the same spine from every source: each destination
has one tree); a spine sends it down to the destination's leaf. A path never turns from
down to up, so it has no loop and the channel dependencies no cycle (deadlock-free). A
NIC-to-NIC path crosses 1 switch on the same leaf and 3 otherwise.

Switches have no LID here: the RTL switch has no management port, and the subnet manager
is the testbench writing each switch's forwarding table through its AXI4-Lite registers
(docs/switch-registers.md, ``ft_write``).
"""
from dataclasses import dataclass

__all__ = ["LeafSpine", "Link", "Hop", "MAX_SWITCH_PORTS", "MAX_WIRE_DELAY", "UP", "DOWN"]

MAX_SWITCH_PORTS = 16       # hdl/switch/switch.py: 2..16 ports
MAX_WIRE_DELAY = 4096       # cycles, one way (tb.link_pair.delay_line, NicPairTop's limit)
MAX_LID = 0xBFFF            # top of the unicast LID range
UP, DOWN = "up", "down"


@dataclass(frozen=True)
class Link:
    """A cable between ``a`` and ``b``, each a (node, port) pair; ``a`` is the lower end
    (the NIC, or the leaf of a leaf-spine link). A NIC's only port is 0."""
    a: tuple
    b: tuple
    delay: int      # cycles, one way

    @property
    def name(self):
        return f"{self.a[0]}-{self.b[0]}"


@dataclass(frozen=True)
class Hop:
    """One switch on a path: in at ``in_port``, out at ``out_port``, going ``direction``."""
    switch: str
    in_port: int
    out_port: int
    direction: str


def _check_int(name, value, low, high=None):
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, not {value!r}")


class LeafSpine:
    """A leaf/spine fabric of ``leaves`` leaf switches with ``nics_per_leaf`` NICs each and
    ``spines`` spine switches, every leaf joined to every spine by one link.

    ``wire_delay``: one-way delay of every link in cycles; ``link_delays`` overrides it per
    link, by :attr:`Link.name` (``"nic3-leaf1"``, ``"leaf1-spine0"``).
    """

    def __init__(self, nics_per_leaf=2, leaves=4, spines=2, *, wire_delay=8, link_delays=None,
                 base_lid=1):
        _check_int("nics_per_leaf", nics_per_leaf, 1)
        _check_int("leaves", leaves, 2, MAX_SWITCH_PORTS)
        _check_int("spines", spines, 1)
        _check_int("wire_delay", wire_delay, 1, MAX_WIRE_DELAY)
        _check_int("base_lid", base_lid, 1)
        if nics_per_leaf + spines > MAX_SWITCH_PORTS:
            raise ValueError(f"a leaf has nics_per_leaf + spines ports = {nics_per_leaf + spines}; "
                             f"a switch has at most {MAX_SWITCH_PORTS}")
        if base_lid + nics_per_leaf * leaves - 1 > MAX_LID:
            raise ValueError(f"NIC LIDs {base_lid}.. run past the unicast range (0x{MAX_LID:x})")
        self.nics_per_leaf = nics_per_leaf
        self.leaves = leaves
        self.spines = spines
        self.wire_delay = wire_delay
        self.base_lid = base_lid
        self.nics = nics_per_leaf * leaves
        self.leaf_ports = nics_per_leaf + spines
        self.spine_ports = leaves

        link_delays = dict(link_delays or {})
        links = []
        for n in range(self.nics):
            links.append(((self.nic_name(n), 0), (self.leaf_name(self.leaf_of(n)), self.nic_port(n))))
        for leaf in range(leaves):
            for spine in range(spines):
                links.append(((self.leaf_name(leaf), self.up_port(spine)),
                              (self.spine_name(spine), leaf)))
        self.links = []
        for a, b in links:
            name = f"{a[0]}-{b[0]}"
            delay = link_delays.pop(name, wire_delay)
            _check_int(f"delay of link {name}", delay, 1, MAX_WIRE_DELAY)
            self.links.append(Link(a, b, delay))
        if link_delays:
            raise ValueError(f"link_delays names links this fabric does not have: "
                             f"{', '.join(sorted(link_delays))}")
        self._peer = {}
        for link in self.links:
            self._peer[link.a] = (link.b, link)
            self._peer[link.b] = (link.a, link)

    def __repr__(self):
        return (f"LeafSpine(nics_per_leaf={self.nics_per_leaf}, leaves={self.leaves}, "
                f"spines={self.spines}, wire_delay={self.wire_delay})")

    # --- names and numbers -------------------------------------------------------------------

    @staticmethod
    def nic_name(n):
        return f"nic{n}"

    @staticmethod
    def leaf_name(leaf):
        return f"leaf{leaf}"

    @staticmethod
    def spine_name(spine):
        return f"spine{spine}"

    @property
    def switches(self):
        """Every switch: ``{name: ports}``, leaves first."""
        return {**{self.leaf_name(l): self.leaf_ports for l in range(self.leaves)},
                **{self.spine_name(s): self.spine_ports for s in range(self.spines)}}

    def leaf_of(self, nic):
        self._check_nic(nic)
        return nic // self.nics_per_leaf

    def nic_port(self, nic):
        """The leaf port NIC ``nic`` is cabled to."""
        self._check_nic(nic)
        return nic % self.nics_per_leaf

    def up_port(self, spine):
        """The leaf port that goes up to ``spine``."""
        return self.nics_per_leaf + spine

    def lid(self, nic):
        self._check_nic(nic)
        return self.base_lid + nic

    def nic_of_lid(self, lid):
        nic = lid - self.base_lid
        if not 0 <= nic < self.nics:
            raise ValueError(f"LID {lid:#x} is no NIC of {self!r}")
        return nic

    @property
    def lids(self):
        """Forwarding-table entries each switch needs: a power of two above every LID."""
        size = 2
        while size <= self.base_lid + self.nics - 1:
            size *= 2
        return size

    def spine_for(self, lid):
        """The spine that carries traffic for ``lid`` between leaves: ``lid mod spines``."""
        return lid % self.spines

    def neighbour(self, nic):
        """The next NIC on the same leaf (itself when a leaf has one NIC)."""
        leaf = self.leaf_of(nic)
        return leaf * self.nics_per_leaf + (nic + 1) % self.nics_per_leaf

    def peer(self, node, port):
        """What the cable at (``node``, ``port``) leads to: ((node, port), link)."""
        try:
            return self._peer[(node, port)]
        except KeyError:
            raise ValueError(f"{node} has no port {port}") from None

    def link(self, name):
        for link in self.links:
            if link.name == name:
                return link
        raise ValueError(f"no link {name!r}")

    def _check_nic(self, nic):
        if not isinstance(nic, int) or not 0 <= nic < self.nics:
            raise ValueError(f"NIC must be 0 to {self.nics - 1}, not {nic!r}")

    # --- routing -------------------------------------------------------------------------------

    def out_port(self, switch, lid):
        """The output port ``switch`` forwards DLID ``lid`` to."""
        nic = self.nic_of_lid(lid)
        kind, index = switch.rstrip("0123456789"), int(switch[len(switch.rstrip("0123456789")):])
        if kind == "leaf" and 0 <= index < self.leaves:
            if self.leaf_of(nic) == index:
                return self.nic_port(nic)
            return self.up_port(self.spine_for(lid))
        if kind == "spine" and 0 <= index < self.spines:
            return self.leaf_of(nic)
        raise ValueError(f"no switch {switch!r} in {self!r}")

    def forwarding_tables(self):
        """``{switch: {dlid: output port}}`` for every switch and every NIC LID."""
        return {switch: {self.lid(n): self.out_port(switch, self.lid(n)) for n in range(self.nics)}
                for switch in self.switches}

    def port_direction(self, switch, port):
        """``UP`` when ``port`` of ``switch`` leads to a spine, else ``DOWN``."""
        (node, _), _ = self.peer(switch, port)
        return UP if node.startswith("spine") else DOWN

    def route(self, src, dst):
        """The switches a packet from NIC ``src`` to NIC ``dst`` crosses, following the
        forwarding tables: a list of :class:`Hop`."""
        self._check_nic(dst)
        here, link = self.peer(self.nic_name(src), 0)
        target = self.nic_name(dst)
        lid = self.lid(dst)
        hops = []
        while here[0] != target:
            switch, in_port = here
            if len(hops) > 2 * len(self.switches):
                raise RuntimeError(f"routing loop from NIC {src} to NIC {dst}: {hops}")
            out = self.out_port(switch, lid)
            hops.append(Hop(switch, in_port, out, self.port_direction(switch, out)))
            here, link = self.peer(switch, out)
            if here[0].startswith("nic") and here[0] != target:
                raise RuntimeError(f"NIC {src} to NIC {dst} ends at {here[0]}")
        return hops

    def hops(self, src, dst):
        """Switches on the path: 1 on the same leaf, 3 between leaves (0 to itself)."""
        return len(self.route(src, dst)) if src != dst else 0

    def path_links(self, src, dst):
        """The links a packet from ``src`` to ``dst`` crosses, in order."""
        links = [self.peer(self.nic_name(src), 0)[1]]
        for hop in self.route(src, dst):
            links.append(self.peer(hop.switch, hop.out_port)[1])
        return links

    def path_wire_delay(self, src, dst):
        """Cycles spent on cables from ``src`` to ``dst`` (sum of the one-way link delays)."""
        return sum(link.delay for link in self.path_links(src, dst))

    def ft_entries(self, switch):
        """The (lid, port, valid) writes that program ``switch``: one per NIC LID, and an
        invalid entry for every other LID of the table (the table is not cleared by reset)."""
        table = self.forwarding_tables()[switch]
        return [(lid, table.get(lid, 0), int(lid in table)) for lid in range(self.lids)]
