from amaranth import *
from amaranth.lib import data, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

__all__ = ["ForwardingTable", "LookupSignature", "entry_layout", "check_ports", "check_lids"]

LID_BITS = 16


def check_ports(ports):
    if not isinstance(ports, int) or not 2 <= ports <= 16:
        raise ValueError(f"Ports must be an integer from 2 to 16, not {ports!r}")


def check_lids(lids):
    if not isinstance(lids, int) or lids < 2 or lids > 1 << LID_BITS or lids & (lids - 1):
        raise ValueError(f"LIDs must be a power of two from 2 to 65536, not {lids!r}")


def entry_layout(ports):
    """One table entry: the output port and a valid bit (first field in the low bits)."""
    return data.StructLayout({"port": range(ports), "valid": 1})


class LookupSignature(wiring.Signature):
    """One lookup port, seen from the requester (a switch input): it drives ``lid`` and gets
    ``port``/``hit`` one cycle later. The table has ``In(LookupSignature(ports))``."""

    def __init__(self, ports):
        super().__init__({
            "lid": Out(LID_BITS),
            "port": In(range(ports)),
            "hit": In(1),
        })


class ForwardingTable(wiring.Component):
    """Linear forwarding table, DLID -> output port, in block RAM, one lookup port per input.

    ``lids`` entries (a power of two); DLIDs ``lids`` and above are unknown. Each entry has
    a valid bit; every entry is invalid after configuration (the contents are RAM: a reset
    does NOT clear them, software rewrites entries with ``write_valid`` 0 to remove them).

    Lookups: ``lookup[i].lid`` is sampled at a clock edge and ``lookup[i].port`` /
    ``lookup[i].hit`` show its entry during the next cycle (a synchronous block-RAM read, a
    new LID every cycle). ``hit`` is 0 for an invalid entry or a DLID beyond the table;
    ``port`` is 0 whenever ``hit`` is 0.

    Writes: ``write_en`` with ``write_lid``, ``write_port``, ``write_valid`` stores the
    entry at that edge. A write to a LID beyond the table, or naming a port the switch does
    not have, is ignored (nothing written). Read-during-write: a lookup of LID L in the same
    cycle as a write to L returns the OLD entry (read-first: the read ports are not
    transparent); lookups from the next cycle on return the new one. A packet therefore
    goes to either the old or the new port, never to a mix.

    Storage: one :class:`amaranth.lib.memory.Memory` replica per read port, each with the
    shared write port and one synchronous read port (a simple dual-port RAM, the shape every
    FPGA block RAM provides), all written together. ``ports * lids * (bits(ports) + 1)``
    bits in total, e.g. 8 x 1024 x 4 = 32 Kib for 8 ports.
    """

    def __init__(self, ports=8, lids=1024):
        check_ports(ports)
        check_lids(lids)
        self.ports = ports
        self.lids = lids
        self.lid_index_bits = (lids - 1).bit_length()
        super().__init__({
            "write_en": In(1),
            "write_lid": In(LID_BITS),
            "write_port": In(range(ports)),
            "write_valid": In(1),
            "lookup": In(LookupSignature(ports)).array(ports),
        })

    def elaborate(self, platform):
        m = Module()
        bits = self.lid_index_bits
        layout = entry_layout(self.ports)

        def in_table(lid):
            return lid[bits:] == 0 if bits < LID_BITS else C(1, 1)

        port_ok = self.write_port < self.ports if self.ports & (self.ports - 1) else C(1, 1)
        write_ok = Signal()
        m.d.comb += write_ok.eq(self.write_en & in_table(self.write_lid) & port_ok)
        for i in range(self.ports):
            replica = Memory(shape=layout, depth=self.lids, init=[])
            m.submodules[f"replica{i}"] = replica
            wp = replica.write_port()
            rp = replica.read_port()        # not transparent: read-first on a same-LID write
            lookup = self.lookup[i]
            known = Signal(name=f"lookup{i}_in_table")
            m.d.sync += known.eq(in_table(lookup.lid))
            hit = Signal(name=f"lookup{i}_hit")
            m.d.comb += [
                wp.addr.eq(self.write_lid[:bits]),
                wp.data.port.eq(self.write_port),
                wp.data.valid.eq(self.write_valid),
                wp.en.eq(write_ok),
                rp.addr.eq(lookup.lid[:bits]),
                hit.eq(rp.data.valid & known),
                lookup.hit.eq(hit),
                lookup.port.eq(Mux(hit, rp.data.port, 0)),
            ]
        return m
