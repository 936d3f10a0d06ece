from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteHandshake
from hdl.nic.register_map import (ADDRESS_BITS, COUNTER_BASE, COUNTER_SPACE, LINK_FIELDS,
                                  MAX_ENTRIES, OKAY, OWN_COUNTERS, SLVERR, UAR_BASE, UAR_SIZE,
                                  register_map)
from hdl.nic.signatures import (COUNTERS, MAX_OUTSTANDING_BLOCKS, ContextReadSignature,
                                CqConfigLayout, DoorbellLayout, EventSignature, MkeyLayout,
                                QpConfigLayout, QpState)

__all__ = ["NicRegisters", "AxiLite64Signature"]

NUM_COUNTER_INPUTS = sum(len(counters) for counters in COUNTERS.values())
MAX_READ_PORTS = 8


class AxiLite64Signature(wiring.Signature):
    """AXI4-Lite with 64-bit data, seen from the master (a slave has
    ``In(AxiLite64Signature(...))``); the member names of
    :class:`hdl.switch.switch_registers.AxiLiteSignature`. No AWPROT/ARPROT."""

    def __init__(self, addr_width):
        self.addr_width = addr_width
        super().__init__({
            "awaddr": Out(addr_width), "awvalid": Out(1), "awready": In(1),
            "wdata": Out(64), "wstrb": Out(8), "wvalid": Out(1), "wready": In(1),
            "bresp": In(2), "bvalid": In(1), "bready": Out(1),
            "araddr": Out(addr_width), "arvalid": Out(1), "arready": In(1),
            "rdata": In(64), "rresp": In(2), "rvalid": In(1), "rready": Out(1),
        })


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
    (any order), one cycle presents the entry's index to the context RAMs, the next
    decodes, checks and commits (RAM write port, registers, strobes), then B or R. Writes
    merge ``wstrb`` per byte into the current word (a read-modify-write of the entry for
    context words).

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
            "axi": In(AxiLite64Signature(addr_width)),
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

        def context_words(t):
            """Per word index: (read value, entry with that word merged from w_data/w_strb)."""
            cur, layout = t["cur"], t["layout"]
            out = {}
            for w in t["table"].words:
                if w.name == "state":
                    continue
                value = Signal(64, name=f"{t['table'].name}_w{w.index}")
                for f in w.fields:
                    m.d.comb += value[f.lo:f.lo + f.width].eq(_raw_field(cur, layout, f.name))
                merged = Cat(Mux(w_strb[k], w_data.word_select(k, 8), value.word_select(k, 8))
                             for k in range(8))
                entry = Signal(layout, name=f"{t['table'].name}_w{w.index}_next")
                m.d.comb += entry.eq(cur)
                for f in w.fields:
                    m.d.comb += _raw_field(entry, layout, f.name).eq(merged[f.lo:f.lo + f.width])
                out[w.index] = (value, entry)
            return out

        words = {name: context_words(t) for name, t in tables.items()}

        # --- Global registers ------------------------------------------------------------
        store = {}
        for reg in self.map.registers:
            if reg.access == "RW":
                store[reg.name] = Signal(64, init=reg.reset, name=f"reg_{reg.name}")
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

        def field_mask(reg):
            return sum(((1 << f.width) - 1) << f.lo for f in reg.fields)

        # --- QP state --------------------------------------------------------------------
        qp = tables["qp"]
        qpn = qp["index"]
        qp_state_now = Array(s.as_value() for s in self.qp_state)[qpn]
        qp_busy_now = self.qp_busy.bit_select(qpn, 1)
        state_we = Signal()                 # the host changes QP qpn's state to state_new
        state_new = Signal(QpState)
        copies_we = Signal()                # load QP qpn's flip-flop copies from copies_src
        copies_src = Signal(QpConfigLayout())
        m.d.sync += [self.qp_reset.valid.eq(0), self.qp_flush.valid.eq(0),
                     self.cq_reset.valid.eq(0)]
        for q in range(self.num_qps):
            errored = Cat(e.valid & (e.qpn == q) for e in self.qp_error).any()
            with m.If(state_we & (qpn == q)):
                m.d.sync += self.qp_state[q].eq(state_new)
            with m.Elif(errored & (self.qp_state[q] == QpState.RTS)):
                m.d.sync += self.qp_state[q].eq(QpState.ERR)
            with m.If(copies_we & (qpn == q)):
                m.d.sync += [self.qp_log_sq_size[q].eq(copies_src.log_sq_size),
                             self.qp_max_outstanding[q].eq(copies_src.max_outstanding)]

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
            now = qp_state_now
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
                                         copies_we.eq(1), copies_src.eq(cur_qp)]
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
                value = Signal(64)      # read data
                in_regs = high_ok & ((a < UAR_BASE) | ((a >= COUNTER_BASE)
                                                       & (a < COUNTER_BASE + COUNTER_SPACE)))
                in_uar = high_ok & (a >= UAR_BASE) & (a < UAR_BASE + UAR_SIZE)
                with m.If(in_regs):
                    with m.Switch(word):
                        for reg in self.map.registers:
                            with m.Case(reg.offset >> 3):
                                m.d.comb += value.eq(read_value(reg))
                                if reg.access != "RW":
                                    m.d.comb += error.eq(is_write)
                                    continue
                                current = store[reg.name]
                                merged = Signal(64, name=f"merged_{reg.name}")
                                m.d.comb += merged.eq(Cat(
                                    Mux(w_strb[k], w_data.word_select(k, 8),
                                        current.word_select(k, 8)) for k in range(8))
                                    & field_mask(reg))
                                ok = C(1, 1)
                                if reg.binding[0] == "sl_to_vl":
                                    ok = Cat((merged.word_select(s, 4) < self.num_vls)
                                             | (merged.word_select(s, 4) == 15)
                                             for s in range(16)).all()
                                with m.If(is_write):
                                    with m.If(ok):
                                        m.d.sync += current.eq(merged)
                                    with m.Else():
                                        m.d.comb += error.eq(1)
                        with m.Default():
                            m.d.comb += error.eq(1)
                with m.Elif(in_uar):
                    with m.If(is_write):
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
                for name, t in tables.items():
                    with m.Elif(t["hit"] & high_ok & t["entry_ok"]):
                        with m.Switch(t["word"]):
                            for w in t["table"].words:
                                with m.Case(w.index):
                                    if w.name == "state":
                                        m.d.comb += value.eq(qp_state_now)
                                        with m.If(is_write):
                                            state_write()
                                        continue
                                    read, entry = words[name][w.index]
                                    m.d.comb += value.eq(read)
                                    writable = (qp_state_now == QpState.RESET.value
                                                if name == "qp" else C(1, 1))
                                    with m.If(is_write):
                                        with m.If(writable):
                                            m.d.comb += [t["wp"].en.eq(1), t["wp"].data.eq(entry)]
                                            if name == "cq":
                                                m.d.sync += [self.cq_reset.valid.eq(1),
                                                             self.cq_reset.qpn.eq(t["index"])]
                                            if name == "qp" and any(
                                                    f.name in ("log_sq_size", "max_outstanding")
                                                    for f in w.fields):
                                                m.d.comb += [copies_we.eq(1),
                                                             copies_src.eq(entry)]
                                        with m.Else():
                                            m.d.comb += error.eq(1)
                            with m.Default():
                                m.d.comb += error.eq(1)
                with m.Else():
                    m.d.comb += error.eq(1)

                with m.If(is_write):
                    m.d.sync += bresp.eq(Mux(error, SLVERR, OKAY))
                    with m.If(error):
                        m.d.sync += own["register_write_errors"].eq(
                            own["register_write_errors"] + 1)
                    m.next = "WRITE_RESP"
                with m.Else():
                    m.d.sync += [rdata.eq(Mux(error, 0, value)),
                                 rresp.eq(Mux(error, SLVERR, OKAY))]
                    m.next = "READ_RESP"

            bus.response_states(m)
        return m
