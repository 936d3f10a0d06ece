"""Formal harness: the responder never writes a WRITE's payload outside the range of the memory
key its rkey selects, nor past 2^64 (docs/formal.md, docs/nic-responder.md check 4).

The real ``ResponderEngine`` takes any descriptor in any cycle (every field free: opcode, va,
rkey, dmalen, payload, PSN, QP); its memory-key and QP-context tables are free constants read
through synchronous ports as the NIC's tables are; every other input and every ready is free
in every cycle, except that a wait for a receive WQE, the atomic unit or ``dma_idle`` lasts at
most ``max_wait`` cycles (the DMA command and the other outputs may stall for ever). The rule,
written from docs/nic-responder.md: a DMA command with ``bytes`` > 0 for a WRITE FIRST/ONLY
writes ``[va, va + bytes)`` with ``[va, va + dmalen)`` inside ``[base, base + length)`` of the
valid entry at ``(rkey >> 8) mod num_mkeys`` whose key is rkey, whose PD is the QP's, and that
grants REMOTE_WRITE, ending at or below 2^64; a zero-length WRITE writes nothing. With
``continuation``, a MIDDLE/LAST packet writes inside the range its QP's FIRST was checked for.
"""
from amaranth import Array, Elaboratable, Module, Mux, Signal, Value
from amaranth.asserts import AnyConst, AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.nic.responder_engine import (
    NAK, NAK_REMOTE_ACCESS, WRITE_FIRST, WRITE_LAST, WRITE_LAST_IMM, WRITE_MIDDLE, WRITE_ONLY,
    WRITE_ONLY_IMM, ResponderEngine,
)
from hdl.nic.signatures import (
    Access, MkeyLayout, QpConfigLayout, RequestDescriptorLayout, ResponseKind,
)

TOP = 1 << 64           # the first address past memory


class ResponderMkeyRangeHarness(Elaboratable):
    def __init__(self, *, num_qps=1, num_mkeys=2, max_wait=1, continuation=False,
                 engine=ResponderEngine):
        self.dut = engine(num_qps=num_qps, num_mkeys=num_mkeys, num_vls=1)
        self.max_wait = max_wait
        self.continuation = continuation

    def elaborate(self, platform):
        m = Module()
        dut = self.dut
        m.submodules.dut = dut

        def free(port):
            m.d.comb += port.eq(AnySeq(len(Value.cast(port))))

        for port in (dut.request.valid, dut.request.payload, dut.qp_reset.valid, dut.qp_reset.qpn,
                     dut.dma.ready, dut.dma_idle, dut.response.ready, dut.recv_request.ready,
                     dut.recv_result.valid, dut.recv_result.payload, dut.atomic_request.ready,
                     dut.atomic_result.valid, dut.atomic_result.payload,
                     dut.receive_completion.ready, *dut.qp_state, *dut.sl_to_vl):
            free(port)

        # The context tables: constant entries behind synchronous read ports.
        def table(port, layout, entries, name):
            rows = [Signal(layout, name=f"{name}{i}") for i in range(entries)]
            m.d.comb += [row.eq(AnyConst(len(Value.cast(row)))) for row in rows]
            m.d.sync += port.data.eq(Array(rows)[port.addr])
            return rows
        mkeys = table(dut.mkey, MkeyLayout(), dut.num_mkeys, "mkey")
        qps = table(dut.qp_config, QpConfigLayout(), dut.num_qps, "qp")

        # Waits for the neighbours the engine asks end within max_wait cycles.
        for name, waiting in (("recv_request", dut.recv_request.valid & ~dut.recv_request.ready),
                              ("recv_result", dut.recv_result.ready & ~dut.recv_result.valid),
                              ("atomic_request",
                               dut.atomic_request.valid & ~dut.atomic_request.ready),
                              ("atomic_result", dut.atomic_result.ready & ~dut.atomic_result.valid),
                              ("dma_idle", ~dut.dma_idle)):
            waited = Signal(range(self.max_wait + 1), name=f"waited_{name}")
            m.d.sync += waited.eq(Mux(waiting, waited + 1, 0))
            m.d.comb += Assume(~waiting | (waited < self.max_wait))

        # The descriptor the engine took last: each gives exactly one DMA command, before the
        # engine takes the next.
        taken = Signal(RequestDescriptorLayout())
        have = Signal()
        with m.If(dut.request.valid & dut.request.ready):
            m.d.sync += [taken.eq(dut.request.payload), have.eq(1)]
        op = taken.opcode
        write_first = (op == WRITE_FIRST) | (op == WRITE_ONLY) | (op == WRITE_ONLY_IMM)
        write_rest = (op == WRITE_MIDDLE) | (op == WRITE_LAST) | (op == WRITE_LAST_IMM)
        key = Signal(MkeyLayout())
        m.d.comb += key.eq(Array(mkeys)[(taken.rkey >> 8) % dut.num_mkeys])
        qp = Signal(QpConfigLayout())
        m.d.comb += qp.eq(Array(qps)[taken.destqp[:max(dut.num_qps - 1, 1).bit_length()]])
        key_limit = Signal(65)
        m.d.comb += key_limit.eq(key.base + key.length)
        writable = Signal()
        m.d.comb += writable.eq(key.valid & (key.key == taken.rkey) & (key.pd == qp.pd)
                                & ((key.access.as_value() & Access.REMOTE_WRITE.value) != 0)
                                & ((qp.access.as_value() & Access.REMOTE_WRITE.value) != 0))
        reth_end = Signal(65)
        m.d.comb += reth_end.eq(taken.va + taken.dmalen)

        def inside_key(start, end):
            return writable & (start >= key.base) & (end <= key_limit) & (end <= TOP)

        cmd = dut.dma.payload
        cmd_end = Signal(65)
        m.d.comb += cmd_end.eq(cmd.addr + cmd.bytes)
        writes = Signal()
        m.d.comb += writes.eq(dut.dma.valid & (cmd.bytes != 0))

        m.d.comb += Assert(~dut.dma.valid | have)
        with m.If(dut.dma.valid & write_first):
            with m.If(taken.dmalen == 0):
                m.d.comb += Assert(cmd.bytes == 0)
            with m.If(writes):
                m.d.comb += [Assert(cmd.addr == taken.va),
                             Assert(inside_key(taken.va, reth_end)),
                             Assert(cmd_end <= reth_end)]

        if self.continuation:
            # Per QP, the range the last executed WRITE FIRST was checked for.
            qp_bits = max(dut.num_qps - 1, 1).bit_length()
            q = taken.destqp[:qp_bits]
            checked = Array(Signal(name=f"checked{i}") for i in range(dut.num_qps))
            start = Array(Signal(64, name=f"checked_start{i}") for i in range(dut.num_qps))
            end = Array(Signal(65, name=f"checked_end{i}") for i in range(dut.num_qps))
            with m.If(writes & dut.dma.ready & (op == WRITE_FIRST)):
                m.d.sync += [checked[q].eq(1), start[q].eq(taken.va), end[q].eq(reth_end)]
            with m.If(writes & write_rest):
                m.d.comb += [Assert(checked[q]), Assert(cmd.addr >= start[q]),
                             Assert(cmd_end <= end[q])]
            # Reachable: a LAST that fills its message's range to the byte.
            m.d.comb += Cover(writes & (op == WRITE_LAST) & (cmd_end == end[q]))

        # Reachable: a WRITE that ends exactly at its key's end is written, and one that ends at
        # 2^64; one a byte longer than its key is refused (NAK remote access error) though
        # everything else about the key is right.
        m.d.comb += Cover(writes & write_first & (reth_end == key_limit))
        m.d.comb += Cover(writes & write_first & (reth_end == TOP))
        response = dut.response
        refused = Signal()
        m.d.comb += refused.eq(response.valid & (response.payload.kind == ResponseKind.ACK)
                               & (response.payload.syndrome == (NAK | NAK_REMOTE_ACCESS)))
        m.d.comb += Cover(refused & write_first & writable & (taken.va >= key.base)
                          & (reth_end == key_limit + 1) & (reth_end <= TOP))
        return m
