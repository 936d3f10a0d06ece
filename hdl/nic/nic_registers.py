
from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.arith import or_all
from hdl.axi_lite import AxiLiteHandshake, AxiLiteSignature
from hdl.nic.register_map import (ADDRESS_BITS, LINK_FIELDS, MAX_ENTRIES, OKAY, OWN_COUNTERS,
                                  SLVERR, UAR_BASE, UAR_SIZE, register_map)
from hdl.nic.signatures import (COUNTERS, MAX_OUTSTANDING_BLOCKS, ContextReadSignature,
                                CqConfigLayout, DoorbellLayout, EventSignature, MkeyLayout,
                                QpConfigLayout, QpState)

__all__ = ["NicRegisters"]

NUM_COUNTER_INPUTS = sum(len(counters) for counters in COUNTERS.values())
MAX_READ_PORTS = 8


def _region(table):
    """(first address bit of the entry index, first bit above the region) of a table."""
    lo = table.stride.bit_length() - 1
    return lo, (table.stride * MAX_ENTRIES).bit_length() - 1


def _raw_field(entry, layout, name):
    field = layout[name]
    return entry.as_value()[field.offset:field.offset + Shape.cast(field.shape).width]


class NicRegisters(wiring.Component):
    """The NIC's control and status registers, context tables and UAR page behind an
    AXI4-Lite slave with 64-bit data.

    Registers, context words, offsets and fields come from
    :func:`hdl.nic.register_map.register_map` (docs/nic-registers.md is generated from the
    same description). The slave serves one transaction at a time: after AR, or AW and W
    (any order), one cycle presents the entry's index to the context RAMs and decodes the
    address into one-hot flip-flops (reading and checking the registers only the slave
    changes), the next checks what depends on the entry, the QP state and the inputs and
    commits (RAM write port, registers, strobes), then B or R. Writes merge ``wstrb`` per
    byte into the current word (a read-modify-write of the entry for context words).

    - ``doorbell``: one valid cycle per full (``wstrb`` 0xFF) UAR write, the cycle after
      its commit; nothing can hold it (``always_ready``).
    - ``qp_read``/``cq_read``/``mkey_read``: synchronous read ports on the context RAMs
      (data = the entry at the previous cycle's ``addr``; a host write shows from the
      second cycle after its commit).
    - ``qp_state``, ``qp_log_sq_size``, ``qp_max_outstanding``: flip-flops per QP.
      ``qp_reset`` strobes (registered) in the cycle the QP's state becomes RESET;
      ``qp_flush`` when the host writes ERR to a QP in RTS or ERR (the completion unit
      then flushes everything the QP still waits for, so a QP whose responses never come
      can still be drained and reset). ``cq_reset`` strobes (its ``qpn`` field carrying the
      CQ number) for every host write to a CQ context word: a (re)programmed CQ starts
      again at producer index 0.
    - ``qp_error[i]``: a strobe moves its QP from RTS to ERR; several strobes in one cycle
      may name the same or different QPs.
    - ``slid``, ``sl_to_vl``, ``vl_weight``: the global registers.
    - ``counters[k]``: the datapath's counters, :data:`hdl.nic.signatures.COUNTERS`
      flattened in dict order.
    """

    def __init__(self, *, num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2, qp_read_ports=3,
                 cq_read_ports=1, mkey_read_ports=1, addr_width=16):
        self.map = register_map(num_qps, num_cqs, num_mkeys, num_vls)   # validates those
        for what, value in (("QP", qp_read_ports), ("CQ", cq_read_ports),
                            ("memory-key", mkey_read_ports)):
            if not isinstance(value, int) or not 1 <= value <= MAX_READ_PORTS:
                raise ValueError(f"{what} read ports must be an integer from 1 to "
                                 f"{MAX_READ_PORTS}, not {value!r}")
        if not isinstance(addr_width, int) or not ADDRESS_BITS <= addr_width <= 32:
            raise ValueError(f"Address width must be an integer from {ADDRESS_BITS} to 32 "
                             f"(the register map needs {ADDRESS_BITS} bits), not {addr_width!r}")
        self.num_qps = num_qps
        self.num_cqs = num_cqs
        self.num_mkeys = num_mkeys
        self.num_vls = num_vls
        self.addr_width = addr_width
        super().__init__({
            "axi": In(AxiLiteSignature(addr_width, data_width=64)),
            "doorbell": Out(stream.Signature(DoorbellLayout(), always_ready=True)),
            "qp_read": In(ContextReadSignature(num_qps, QpConfigLayout())).array(qp_read_ports),
            "cq_read": In(ContextReadSignature(num_cqs, CqConfigLayout())).array(cq_read_ports),
            "mkey_read": In(ContextReadSignature(num_mkeys, MkeyLayout())).array(mkey_read_ports),
            "qp_state": Out(QpState).array(num_qps),
            "qp_log_sq_size": Out(4).array(num_qps),
            "qp_max_outstanding": Out(7).array(num_qps),
            "qp_error": In(EventSignature()).array(3),
            "qp_reset": Out(EventSignature()),
            "qp_flush": Out(EventSignature()),
            "cq_reset": Out(EventSignature()),     # ``qpn`` carries the CQ number
            "qp_busy": In(num_qps),
            "slid": Out(16),
            "sl_to_vl": Out(4).array(16),
            "vl_weight": Out(8).array(num_vls),
            "link_state": In(2),
            "link_inits": In(32),
            "counters": In(32).array(NUM_COUNTER_INPUTS),
        })

    def elaborate(self, platform):
        m = Module()
        axi = self.axi
        qp_table, cq_table, mkey_table = self.map.tables

        # --- The current transaction ------------------------------------------------------
        addr = Signal(self.addr_width)
        is_write = Signal()
        w_data = Signal(64)
        w_strb = Signal(8)
        a = addr[:ADDRESS_BITS]
        high_ok = addr[ADDRESS_BITS:] == 0 if self.addr_width > ADDRESS_BITS else C(1, 1)
        word = a[3:]

        def strobed(current):
            """``current`` with the byte lanes that ``w_strb`` selects taken from ``w_data``."""
            return Cat(Mux(w_strb[k], w_data.word_select(k, 8), current.word_select(k, 8))
                       for k in range(8))

        # --- Context RAMs: one write port (host RMW), one host read port, the datapath's ---
        tables = {}
        for table, layout, ports in ((qp_table, QpConfigLayout(), self.qp_read),
                                     (cq_table, CqConfigLayout(), self.cq_read),
                                     (mkey_table, MkeyLayout(), self.mkey_read)):
            idx_lo, region_hi = _region(table)
            index = a[idx_lo:region_hi]
            mem = Memory(shape=layout, depth=table.count, init=[])
            m.submodules[f"{table.name}_mem"] = mem
            wp = mem.write_port()
            host = mem.read_port()
            for port in ports:
                rp = mem.read_port()
                m.d.comb += [rp.addr.eq(port.addr), port.data.eq(rp.data)]
            m.d.comb += [host.addr.eq(index), wp.addr.eq(index)]
            tables[table.name] = {
                "table": table, "layout": layout, "wp": wp, "cur": host.data,
                "hit": high_ok & (a[region_hi:] == table.base >> region_hi),
                "index": index, "word": a[3:idx_lo],
                "entry_ok": index < table.count if table.count < MAX_ENTRIES else C(1, 1),
            }

        # --- Global registers ------------------------------------------------------------
        def field_mask(reg):
            return sum(((1 << f.width) - 1) << f.lo for f in reg.fields)

        store = {}
        merged = {}
        for reg in self.map.registers:
            if reg.access == "RW":
                store[reg.name] = Signal(64, init=reg.reset, name=f"reg_{reg.name}")
                merged[reg.name] = Signal(64, name=f"merged_{reg.name}")
                m.d.comb += merged[reg.name].eq(strobed(store[reg.name]) & field_mask(reg))
        m.d.comb += self.slid.eq(store["slid"])
        for sl in range(16):
            m.d.comb += self.sl_to_vl[sl].eq(store["sl_to_vl"].word_select(sl, 4))
        for v in range(self.num_vls):
            m.d.comb += self.vl_weight[v].eq(store["vl_weights"].word_select(v, 8))
        own = {name: Signal(32, name=name) for name, _ in OWN_COUNTERS}
        link_status = Signal(64)
        link_inputs = {"link_state": self.link_state, "link_inits": self.link_inits}
        for f in LINK_FIELDS:
            m.d.comb += link_status[f.lo:f.lo + f.width].eq(link_inputs[f.name])

        def read_value(reg):
            kind = reg.binding[0]
            if kind == "const":
                return C(reg.reset, 64)
            if kind == "link":
                return link_status
            if kind == "counter":
                return self.counters[reg.binding[1]]
            if kind == "own_counter":
                return own[reg.binding[1]]
            return store[reg.name]

        def held(reg):
            """The register's value changes only in EXEC (it is not an input)."""
            return reg.binding[0] not in ("link", "counter")

        def write_ok(reg):
            if reg.access != "RW":
                return C(0, 1)
            if reg.binding[0] == "sl_to_vl":
                return Cat((merged[reg.name].word_select(s, 4) < self.num_vls)
                           | (merged[reg.name].word_select(s, 4) == 15) for s in range(16)).all()
            return C(1, 1)

        # --- Decode, a cycle ahead of the commit -----------------------------------------
        # In FETCH, while the context RAMs read the entry, the address is decoded into one-hot
        # picks and the held registers are read and checked, into flip-flops: EXEC then starts
        # from those, the RAM data and the inputs, without the address decode in front of its
        # multiplexers (AND-OR over the picks). ``addr``, ``w_data`` and ``w_strb`` hold from
        # IDLE to the response; the inputs (counters, link status, ``qp_busy``) are still read
        # in EXEC.
        regs = self.map.registers
        hits = {reg.name: high_ok & (word == reg.offset >> 3) for reg in regs}
        hits["uar"] = high_ok & (a >= UAR_BASE) & (a < UAR_BASE + UAR_SIZE)
        for name, t in tables.items():
            for w in t["table"].words:
                hits[name, w.index] = t["hit"] & t["entry_ok"] & (t["word"] == w.index)
        # EXEC's picks: the inputs it reads, the RW registers, the UAR page, the context words.
        pick = {}
        for key in ([r.name for r in regs if not held(r) or r.access == "RW"] + ["uar"]
                    + [key for key in hits if isinstance(key, tuple)]):
            pick[key] = Signal(name=f"pick_{key}" if isinstance(key, str)
                               else f"pick_{key[0]}_w{key[1]}")
            m.d.sync += pick[key].eq(hits[key])
        held_value = Signal(64)     # the held register addressed, or 0
        refused = Signal()          # SLVERR for the address or value alone
        m.d.sync += [
            held_value.eq(or_all(Mux(hits[r.name], read_value(r), 0)
                                 for r in regs if held(r))),
            refused.eq(~Cat(hits.values()).any()
                       | is_write & Cat(hits[r.name] & ~write_ok(r) for r in regs).any()),
        ]

        # --- Context words -----------------------------------------------------------------
        reads = []                  # (pick, value) of every context word but the QP state
        for name, t in tables.items():
            cur, layout = t["cur"], t["layout"]
            # The entry with the picked word's fields merged from w_data/w_strb.
            entry = t["entry"] = Signal(layout, name=f"{name}_entry")
            m.d.comb += entry.eq(cur)
            for w in t["table"].words:
                if w.name == "state":
                    continue
                value = Signal(64, name=f"{name}_w{w.index}")
                for f in w.fields:
                    m.d.comb += value[f.lo:f.lo + f.width].eq(_raw_field(cur, layout, f.name))
                new = strobed(value)
                with m.If(pick[name, w.index]):
                    for f in w.fields:
                        m.d.comb += _raw_field(entry, layout, f.name).eq(new[f.lo:f.lo + f.width])
                reads.append((pick[name, w.index], value))
            t["written"] = Cat(pick[name, w.index] for w in t["table"].words
                               if w.name != "state").any()

        # --- QP state --------------------------------------------------------------------
        qp = tables["qp"]
        qpn = qp["index"]
        qp_busy_now = self.qp_busy.bit_select(qpn, 1)
        state_we = Signal()                 # the host changes QP qpn's state to state_new
        state_new = Signal(QpState)
        # Load QP qpn's flip-flop copies from the entry (the RAM's, when the state is written).
        copies_we = Signal()
        copied_word = Cat(pick["qp", w.index] for w in qp_table.words
                          if any(f.name in ("log_sq_size", "max_outstanding") for f in w.fields))
        m.d.sync += [self.qp_reset.valid.eq(0), self.qp_flush.valid.eq(0),
                     self.cq_reset.valid.eq(0)]

        def errored(state, q):
            """A ``qp_error`` strobe moves QP ``q``, in ``state``, to ERR this cycle."""
            return Cat(e.valid & (e.qpn == q) for e in self.qp_error).any() & (
                state == QpState.RTS.value)

        for q in range(self.num_qps):
            with m.If(state_we & (qpn == q)):
                m.d.sync += self.qp_state[q].eq(state_new)
            with m.Elif(errored(self.qp_state[q].as_value(), q)):
                m.d.sync += self.qp_state[q].eq(QpState.ERR)
            with m.If(copies_we & (qpn == q)):
                m.d.sync += [self.qp_log_sq_size[q].eq(qp["entry"].log_sq_size),
                             self.qp_max_outstanding[q].eq(qp["entry"].max_outstanding)]
        # QP qpn's state in EXEC, looked up in FETCH (where only qp_error changes states).
        qp_state_now = Signal(QpState)
        state_then = Array(s.as_value() for s in self.qp_state)[qpn]
        m.d.sync += qp_state_now.eq(Mux(errored(state_then, qpn), QpState.ERR, state_then))
        now = qp_state_now.as_value()

        cur_qp = qp["cur"]
        align_bits = Mux(cur_qp.log_sq_size >= 6, 12, cur_qp.log_sq_size + 6)
        context_ok = Signal()
        m.d.comb += context_ok.eq(
            (cur_qp.mtu >= 1) & (cur_qp.mtu <= 5)
            & (cur_qp.max_outstanding >= 1) & (cur_qp.max_outstanding <= MAX_OUTSTANDING_BLOCKS)
            & (cur_qp.cqn < self.num_cqs if self.num_cqs < MAX_ENTRIES else C(1, 1))
            & (cur_qp.rcqn < self.num_cqs if self.num_cqs < MAX_ENTRIES else C(1, 1))
            & ((cur_qp.sq_base[:12] & ((C(1, 13) << align_bits) - 1)[:12]) == 0)
            & (cur_qp.rq_base[:4] == 0) & (cur_qp.rq_dbr[:2] == 0))

        error = Signal()            # the transaction answers SLVERR

        def state_write():
            """A host write to a QP's state word (docs/nic-registers.md, QP states)."""
            want = Mux(w_strb[0], w_data[:3], now)
            with m.Switch(want):
                with m.Case(QpState.RESET):
                    with m.If((now == QpState.RESET.value) | ~qp_busy_now):
                        m.d.comb += [state_we.eq(1), state_new.eq(QpState.RESET)]
                        m.d.sync += [self.qp_reset.valid.eq(1), self.qp_reset.qpn.eq(qpn)]
                    with m.Else():
                        m.d.comb += error.eq(1)
                with m.Case(QpState.RTS):
                    with m.If(now == QpState.RESET.value):
                        with m.If(context_ok):
                            m.d.comb += [state_we.eq(1), state_new.eq(QpState.RTS),
                                         copies_we.eq(1)]
                        with m.Else():
                            m.d.comb += error.eq(1)
                    with m.Elif(now == QpState.ERR.value):
                        m.d.comb += error.eq(1)
                with m.Case(QpState.ERR):
                    with m.If(now == QpState.RTS.value):
                        m.d.comb += [state_we.eq(1), state_new.eq(QpState.ERR)]
                    with m.If(now != QpState.RESET.value):
                        m.d.sync += [self.qp_flush.valid.eq(1), self.qp_flush.qpn.eq(qpn)]
                    with m.Else():
                        m.d.comb += error.eq(1)
                with m.Default():
                    m.d.comb += error.eq(1)

        # A read is refused only when unmapped, and then picks nothing: its data is 0.
        value = Signal(64)
        m.d.comb += value.eq(or_all(
            [held_value, Mux(pick["qp", 0], now, 0)]
            + [Mux(pick[r.name], read_value(r), 0) for r in regs if not held(r)]
            + [Mux(p, word_value, 0) for p, word_value in reads]))

        # --- AXI4-Lite slave, one transaction at a time ----------------------------------
        bus = AxiLiteHandshake(m, axi)
        bresp, rresp, rdata = bus.bresp, bus.rresp, bus.rdata
        m.d.sync += self.doorbell.valid.eq(0)

        with m.FSM(name="axi"):
            with m.State("IDLE"):
                take_read, aw_now, w_now, write_in = bus.accept(m)
                with m.If(take_read):
                    m.d.sync += [addr.eq(axi.araddr), is_write.eq(0)]
                    m.next = "FETCH"
                with m.If(aw_now):
                    m.d.sync += addr.eq(axi.awaddr)
                with m.If(w_now):
                    m.d.sync += [w_data.eq(axi.wdata), w_strb.eq(axi.wstrb)]
                with m.If(write_in):
                    m.d.sync += is_write.eq(1)
                    m.next = "FETCH"

            with m.State("FETCH"):
                # The context RAMs' host port reads the addressed entry.
                bus.release(m)
                m.next = "EXEC"

            with m.State("EXEC"):
                m.d.comb += error.eq(refused)
                with m.If(is_write):
                    for reg in regs:
                        if reg.access == "RW":
                            with m.If(pick[reg.name] & ~refused):
                                m.d.sync += store[reg.name].eq(merged[reg.name])
                    with m.If(pick["uar"]):
                        with m.If(w_strb == 0xFF):
                            m.d.sync += [
                                self.doorbell.valid.eq(1),
                                self.doorbell.payload.pi.eq(Cat(w_data[16:24], w_data[8:16])),
                                self.doorbell.payload.qpn.eq(
                                    Cat(w_data[48:56], w_data[40:48], w_data[32:40])),
                            ]
                        with m.Else():
                            m.d.sync += own["doorbells_partial"].eq(
                                own["doorbells_partial"] + 1)
                    with m.If(pick["qp", 0]):
                        state_write()
                    for name, t in tables.items():
                        # A QP's context is writable only in RESET.
                        writable = now == QpState.RESET.value if name == "qp" else C(1, 1)
                        with m.If(t["written"]):
                            with m.If(writable):
                                m.d.comb += [t["wp"].en.eq(1), t["wp"].data.eq(t["entry"])]
                                if name == "cq":
                                    m.d.sync += [self.cq_reset.valid.eq(1),
                                                 self.cq_reset.qpn.eq(t["index"])]
                                if name == "qp":
                                    m.d.comb += copies_we.eq(copied_word.any())
                            with m.Else():
                                m.d.comb += error.eq(1)

                    m.d.sync += bresp.eq(Mux(error, SLVERR, OKAY))
                    with m.If(error):
                        m.d.sync += own["register_write_errors"].eq(
                            own["register_write_errors"] + 1)
                    m.next = "WRITE_RESP"
                with m.Else():
                    m.d.sync += [rdata.eq(value), rresp.eq(Mux(refused, SLVERR, OKAY))]
                    m.next = "READ_RESP"

            bus.response_states(m)
        return m
