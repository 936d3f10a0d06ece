"""AXI4-Lite as the register blocks (switch and NIC) see it: the signature and the slave
handshake they share.

A register block takes one transaction at a time in an ``m.FSM``: in its idle state it
calls :meth:`AxiLiteHandshake.accept`, which takes a read, or the write address and data
in either order; its own states decode the transaction; then it goes to
``"WRITE_RESP"`` or ``"READ_RESP"`` with ``bresp`` or ``rresp``/``rdata`` set, states
:meth:`AxiLiteHandshake.response_states` defines. Reads and writes offered together
alternate (``prefer_read`` remembers which went last), so neither side can starve.
"""
from amaranth import Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

__all__ = ["AxiLiteSignature", "AxiLiteHandshake"]


class AxiLiteSignature(wiring.Signature):
    """AXI4-Lite with ``data_width``-bit data (32, or 64 for the NIC, so that a GPU's 8-byte
    doorbell is one write), seen from the master (a slave has ``In(AxiLiteSignature(...))``).
    No AWPROT/ARPROT: the slaves ignore protection."""

    def __init__(self, addr_width, data_width=32):
        if data_width not in (32, 64):
            raise ValueError(f"AXI4-Lite data width must be 32 or 64, not {data_width!r}")
        self.addr_width = addr_width
        self.data_width = data_width
        super().__init__({
            "awaddr": Out(addr_width), "awvalid": Out(1), "awready": In(1),
            "wdata": Out(data_width), "wstrb": Out(data_width // 8), "wvalid": Out(1),
            "wready": In(1),
            "bresp": In(2), "bvalid": In(1), "bready": Out(1),
            "araddr": Out(addr_width), "arvalid": Out(1), "arready": In(1),
            "rdata": In(data_width), "rresp": In(2), "rvalid": In(1), "rready": Out(1),
        })


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
