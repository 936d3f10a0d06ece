from amaranth import *
from amaranth.utils import exact_log2
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..prim.round_robin import mask_after, next_mask, one_hot_index, round_robin_pick
from .signatures import AXI_ID_BITS, ArLayout, AxiReadSignature, RBeatLayout

__all__ = ["AxiReadArbiter"]

AXI_BURST_INCR = 0b01
AXI_RESP_OKAY = 0b00


class AxiReadArbiter(wiring.Component):
    """Shares one AXI4 read master among the NIC's readers, each with its own ARID.

    Requester ``i`` issues bursts with ``id == i`` (``FETCH_ID``, ``PAYLOAD_ID``, ``RESPONSE_ID``, ``RECV_ID``, ``ATOMIC_ID``); the
    arbiter takes one burst per cycle, round robin, and routes each R beat back by ``rid``.
    AXI keeps beats of one ID in order, so every reader sees its own bursts in the order
    it issued them whatever the interconnect does across IDs. An R beat whose ``rid``
    names no reader (a misbehaving slave) is accepted and dropped, so it cannot wedge
    the channel, and counted in ``bad_rid_beats``.

    Parameters
    ----------
    readers : int
        Number of readers, 1 .. 2**AXI_ID_BITS.
    addr_width : int
        AXI address bits, 12 .. 64.
    data_bytes : int
        AXI data width in bytes (``arsize`` is always the full width).
    """
    def __init__(self, *, readers=2, addr_width=64, data_bytes=64):
        if not isinstance(readers, int) or not 1 <= readers <= 1 << AXI_ID_BITS:
            raise ValueError(f"Readers must be 1 to {1 << AXI_ID_BITS} ({AXI_ID_BITS}-bit AXI "
                             f"IDs), not {readers!r}")
        if not 12 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 12 to 64 bits, not {addr_width!r}")
        if data_bytes not in (4, 8, 16, 32, 64, 128):
            raise ValueError(f"AXI data width must be 4 to 128 bytes, a power of two, not {data_bytes!r}")
        self.readers = readers
        self.data_bytes = data_bytes
        super().__init__({
            "requests": In(stream.Signature(ArLayout())).array(readers),
            "responses": Out(stream.Signature(RBeatLayout(data_bytes))).array(readers),
            "axi": Out(AxiReadSignature(addr_width, data_bytes)),
            "bad_rid_beats": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        axi = self.axi

        # Round robin over requests: a registered AR slot, refilled from the reader
        # after the last one granted.
        mask = Signal(self.readers, init=mask_after(0, self.readers))
        requests = Cat(request.valid for request in self.requests)
        with m.If(~axi.arvalid | axi.arready):
            m.d.sync += axi.arvalid.eq(0)
            pick = round_robin_pick(m, requests, mask, name="ar")
            for i, request in enumerate(self.requests):
                m.d.comb += request.ready.eq(pick[i])
            with m.If(requests.any()):
                chosen = Array(request.payload for request in self.requests)[one_hot_index(pick)]
                m.d.sync += [
                    axi.arvalid.eq(1),
                    axi.arid.eq(chosen.id),
                    axi.araddr.eq(chosen.addr),
                    axi.arlen.eq(chosen.len),
                    mask.eq(next_mask(pick)),
                ]
        m.d.comb += [
            axi.arsize.eq(exact_log2(self.data_bytes)),
            axi.arburst.eq(AXI_BURST_INCR),
        ]

        known = Signal()
        for i, response in enumerate(self.responses):
            m.d.comb += [
                response.valid.eq(axi.rvalid & (axi.rid == i)),
                response.payload.data.eq(axi.rdata),
                response.payload.resp.eq(axi.rresp),
                response.payload.last.eq(axi.rlast),
            ]
            with m.If(axi.rid == i):
                m.d.comb += [known.eq(1), axi.rready.eq(response.ready)]
        with m.If(~known):
            m.d.comb += axi.rready.eq(1)
            with m.If(axi.rvalid):
                m.d.sync += self.bad_rid_beats.eq(self.bad_rid_beats + 1)
        return m
