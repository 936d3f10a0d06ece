from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteHandshake, AxiLiteSignature
from hdl.switch.forwarding_table import LID_BITS, entry_layout
from hdl.switch.register_map import (COUNTER_NAMES, FT_FIELDS, OKAY, SLVERR, address_bits,
                                     register_map)

__all__ = ["SwitchRegisters", "CounterSignature"]


class CounterSignature(wiring.Signature):
    """One (port, VL)'s counters, seen from the datapath that counts them:
    :data:`hdl.switch.register_map.COUNTER_NAMES`, 32 bits each."""

    def __init__(self):
        super().__init__({name: Out(32) for name in COUNTER_NAMES})


def _field(value, name):
    for field, lo, width in FT_FIELDS:
        if field == name:
            return value[lo:lo + width]
    raise KeyError(name)


class SwitchRegisters(wiring.Component):
    """The switch's control and status registers behind an AXI4-Lite slave.

    Every register, its offset, width, access and reset value comes from
    :func:`hdl.switch.register_map.register_map` (docs/switch-registers.md is generated from
    the same list). Outputs, all registered (they change at the edge that completes a write,
    one cycle before the write response):

    - ``ft_write_en`` (one-cycle strobe) with ``ft_write_lid``/``ft_write_port``/
      ``ft_write_valid``: the forwarding-table write port, to be joined to
      :class:`hdl.switch.forwarding_table.ForwardingTable`'s ``write_*``. The strobe is high
      in the cycle of the write response's ``bvalid``: lookups issued from the next cycle
      on see the new entry. A shadow copy (one more block RAM of ``lids`` entries, written
      by the same strobe) answers ``ft_read_data``, so readback never disturbs the lookups.
    - ``sl_to_vl[sl]`` (4 bits, 15 = drop), ``vl_weight[port][vl]`` (8 bits, 64-byte blocks
      per turn, as :class:`hdl.link.link_transmitter.LinkTransmitter` takes them),
      ``port_enable[port]``, ``hoq_lifetime`` (units of ``HOQ_TICK_CYCLES`` cycles, 0 = off).

    ``counters[port][vl]`` (:class:`CounterSignature`) are inputs, read when a read
    transaction addresses them (one 32-bit value per read; no snapshot across words).

    The slave serves one transaction at a time: AW and W in any order (or together), the
    write in the following cycle, then B; AR, the read in the following cycle, then R. A
    write takes at least 3 cycles, a read 2, plus the master's ready. When AR and AW/W are
    offered together, reads and writes alternate. ``wstrb`` is honoured per byte lane.
    Unmapped addresses, writes to read-only registers and out-of-range values (a LID beyond
    the table, a port the switch does not have) answer SLVERR and change nothing. Address
    bits [1:0] are ignored.
    """

    def __init__(self, ports=8, num_vls=2, *, lids=1024, addr_width=16):
        self.registers = register_map(ports, num_vls, lids)     # validates the configuration
        need = address_bits(self.registers)
        if not isinstance(addr_width, int) or not need <= addr_width <= 32:
            raise ValueError(f"Address width must be an integer from {need} to 32 (the register "
                             f"map needs {need} bits), not {addr_width!r}")
        self.ports = ports
        self.num_vls = num_vls
        self.lids = lids
        self.addr_width = addr_width
        super().__init__({
            "axi": In(AxiLiteSignature(addr_width)),
            "ft_write_en": Out(1),
            "ft_write_lid": Out(LID_BITS),
            "ft_write_port": Out(range(ports)),
            "ft_write_valid": Out(1),
            "sl_to_vl": Out(4).array(16),
            "vl_weight": Out(8).array(ports, num_vls),
            "port_enable": Out(1).array(ports),
            "hoq_lifetime": Out(16),
            "counters": In(CounterSignature()).array(ports, num_vls),
        })

    def elaborate(self, platform):
        m = Module()
        axi = self.axi
        lid_bits = (self.lids - 1).bit_length()

        # --- Storage and outputs, from the register map ----------------------------------
        store = {}
        for reg in self.registers:
            if reg.access in ("RW", "RWS"):
                store[reg.name] = Signal(reg.width, init=reg.reset, name=f"reg_{reg.name}")
            kind = reg.binding[0]
            if kind == "sl_to_vl":
                m.d.comb += self.sl_to_vl[reg.binding[1]].eq(store[reg.name])
            elif kind == "vl_weight":
                m.d.comb += self.vl_weight[reg.binding[1]][reg.binding[2]].eq(store[reg.name])
            elif kind == "port_enable":
                m.d.comb += self.port_enable[reg.binding[1]].eq(store[reg.name])
            elif kind == "hoq_lifetime":
                m.d.comb += self.hoq_lifetime.eq(store[reg.name])
        ft_write = store["ft_write"]
        ft_read_lid = store["ft_read_lid"]
        m.d.comb += [
            self.ft_write_lid.eq(_field(ft_write, "lid")),
            self.ft_write_port.eq(_field(ft_write, "port")),
            self.ft_write_valid.eq(_field(ft_write, "valid")),
        ]
        m.d.sync += self.ft_write_en.eq(0)      # a strobe; the write state raises it

        # Shadow copy of the forwarding table for readback (transparent: a read in the
        # cycle after a write sees it).
        shadow = Memory(shape=entry_layout(self.ports), depth=self.lids, init=[])
        m.submodules.ft_shadow = shadow
        swp = shadow.write_port()
        srp = shadow.read_port(transparent_for=(swp,))
        m.d.comb += [
            swp.addr.eq(self.ft_write_lid[:lid_bits]),
            swp.data.port.eq(self.ft_write_port),
            swp.data.valid.eq(self.ft_write_valid),
            swp.en.eq(self.ft_write_en),
            srp.addr.eq(ft_read_lid[:lid_bits]),
        ]
        ft_read_data = Signal(32)
        m.d.comb += [
            _field(ft_read_data, "lid").eq(ft_read_lid),
            _field(ft_read_data, "port").eq(srp.data.port),
            _field(ft_read_data, "valid").eq(srp.data.valid),
        ]

        def read_value(reg):
            kind = reg.binding[0]
            if kind == "const":
                return C(reg.reset, 32)
            if kind == "ft_read_data":
                return ft_read_data
            if kind == "counter":
                _, p, v, name = reg.binding
                return getattr(self.counters[p][v], name)
            return store[reg.name]

        def lid_ok(lid):
            return lid < self.lids if self.lids < 1 << LID_BITS else C(1, 1)

        # --- AXI4-Lite slave, one transaction at a time ----------------------------------
        word_bits = self.addr_width - 2
        aw_word = Signal(word_bits)
        w_data = Signal(32)
        w_strb = Signal(4)
        ar_word = Signal(word_bits)
        bus = AxiLiteHandshake(m, axi)
        bresp, rresp, rdata = bus.bresp, bus.rresp, bus.rdata

        with m.FSM(name="axi"):
            with m.State("IDLE"):
                take_read, aw_now, w_now, write_in = bus.accept(m)
                with m.If(take_read):
                    m.d.sync += ar_word.eq(axi.araddr[2:])
                    m.next = "READ"
                with m.If(aw_now):
                    m.d.sync += aw_word.eq(axi.awaddr[2:])
                with m.If(w_now):
                    m.d.sync += [w_data.eq(axi.wdata), w_strb.eq(axi.wstrb)]
                with m.If(write_in):
                    m.next = "WRITE"

            with m.State("WRITE"):
                bus.release(m)
                m.d.sync += bresp.eq(OKAY)
                with m.Switch(aw_word):
                    for reg in self.registers:
                        with m.Case(reg.offset >> 2):
                            if reg.access == "RO":
                                m.d.sync += bresp.eq(SLVERR)
                                continue
                            current = store[reg.name]
                            lanes = (reg.width + 7) // 8
                            merged = Signal(reg.width, name=f"merged_{reg.name}")
                            m.d.comb += merged.eq(Cat(*(
                                Mux(w_strb[k], w_data.word_select(k, 8),
                                    current.as_unsigned().shift_right(8 * k)[:8])
                                for k in range(lanes)))[:reg.width])
                            kind = reg.binding[0]
                            if kind == "ft_write":
                                value = Cat(_field(merged, "lid"), _field(merged, "port"),
                                            C(0, 11), _field(merged, "valid"))
                                ok = lid_ok(_field(merged, "lid"))
                                if self.ports < 16:
                                    ok = ok & (_field(merged, "port") < self.ports)
                                with m.If(ok):
                                    m.d.sync += [current.eq(value), self.ft_write_en.eq(1)]
                                with m.Else():
                                    m.d.sync += bresp.eq(SLVERR)
                            elif kind == "ft_read_lid":
                                with m.If(lid_ok(merged)):
                                    m.d.sync += current.eq(merged)
                                with m.Else():
                                    m.d.sync += bresp.eq(SLVERR)
                            else:
                                m.d.sync += current.eq(merged)
                    with m.Default():
                        m.d.sync += bresp.eq(SLVERR)
                m.next = "WRITE_RESP"

            with m.State("READ"):
                m.d.sync += [rdata.eq(0), rresp.eq(SLVERR)]
                with m.Switch(ar_word):
                    for reg in self.registers:
                        with m.Case(reg.offset >> 2):
                            m.d.sync += [rdata.eq(read_value(reg)), rresp.eq(OKAY)]
                m.next = "READ_RESP"

            bus.response_states(m)
        return m
