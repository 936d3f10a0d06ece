"""The AXI4-Lite slave handshake shared by the register blocks (switch and NIC).

A register block takes one transaction at a time in an ``m.FSM``: in its idle state it
calls :meth:`AxiLiteHandshake.accept`, which takes a read, or the write address and data
in either order; its own states decode the transaction; then it goes to
``"WRITE_RESP"`` or ``"READ_RESP"`` with ``bresp`` or ``rresp``/``rdata`` set, states
:meth:`AxiLiteHandshake.response_states` defines. Reads and writes offered together
alternate (``prefer_read`` remembers which went last), so neither side can starve.
"""
from amaranth import Signal

__all__ = ["AxiLiteHandshake"]


class AxiLiteHandshake:
    def __init__(self, m, axi):
        self.axi = axi
        self.prefer_read = Signal()     # the last transaction was a write
        self.aw_got = Signal()
        self.w_got = Signal()
        self.bresp = Signal(2)
        self.rresp = Signal(2)
        self.rdata = Signal(len(axi.rdata))
        m.d.comb += [axi.bresp.eq(self.bresp), axi.rresp.eq(self.rresp),
                     axi.rdata.eq(self.rdata)]

    def accept(self, m):
        """In the idle state: drive the ready signals. Returns ``(read, aw_now, w_now,
        write)``: a read is taken this cycle; the write address / data arrive this cycle
        (the caller latches them); the write is complete (address and data both in)."""
        axi = self.axi
        read, aw_now, w_now, write = Signal(), Signal(), Signal(), Signal()
        aw_got, w_got = self.aw_got, self.w_got
        m.d.comb += [
            read.eq(axi.arvalid & ~aw_got & ~w_got
                    & (self.prefer_read | ~(axi.awvalid | axi.wvalid))),
            axi.arready.eq(read),
            axi.awready.eq(~read & ~aw_got),
            axi.wready.eq(~read & ~w_got),
            aw_now.eq(axi.awvalid & ~read & ~aw_got),
            w_now.eq(axi.wvalid & ~read & ~w_got),
            write.eq((aw_got | aw_now) & (w_got | w_now)),
        ]
        with m.If(aw_now):
            m.d.sync += aw_got.eq(1)
        with m.If(w_now):
            m.d.sync += w_got.eq(1)
        return read, aw_now, w_now, write

    def release(self, m):
        """Forget the write address and data (once the write is decoded)."""
        m.d.sync += [self.aw_got.eq(0), self.w_got.eq(0)]

    def response_states(self, m, idle="IDLE"):
        """The ``"WRITE_RESP"`` and ``"READ_RESP"`` states, back to ``idle``."""
        axi = self.axi
        with m.State("WRITE_RESP"):
            m.d.comb += axi.bvalid.eq(1)
            with m.If(axi.bready):
                m.d.sync += self.prefer_read.eq(1)
                m.next = idle
        with m.State("READ_RESP"):
            m.d.comb += axi.rvalid.eq(1)
            with m.If(axi.rready):
                m.d.sync += self.prefer_read.eq(0)
                m.next = idle
