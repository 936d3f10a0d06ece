from amaranth import *
from amaranth.lib import data, fifo, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import bits_for

from ..prim.round_robin import mask_after, next_mask, one_hot_index, round_robin_pick
from ..prim.skid_register import SkidRegister
from .signatures import AXI_ID_BITS, AxiWriteSignature

__all__ = ["AxiWriteArbiter"]

ORDER_DEPTH = 8     # bursts granted on AW whose W beats have not all passed


class AxiWriteArbiter(wiring.Component):
    """Shares one AXI4 write master among the NIC's writers (CQE writes, the DMA writer,
    the atomic unit), each with its own AWID.

    AW: each writer's AW is taken into a :class:`SkidRegister` of its own (its ``awready``
    a flip-flop), and the round robin grants one registered request per cycle into a
    registered AW slot, so no writer's ``awvalid`` reaches another's ``awready`` (docs/nic.md,
    Block boundaries); an AW is in the slot two cycles after its handshake at the earliest.
    The writer's AW fields, ``awid`` included, pass through unchanged. W beats too are
    taken into a skid register per writer (``wready`` a flip-flop, so the downstream
    WREADY reaches no writer's logic in a cycle), and a beat is in the W slot two cycles
    after its handshake at the earliest. Each grant queues the writer's index,
    and W beats pass only from the writer at the head of that queue, up to its ``wlast``:
    W follows AW order without interleaving, as AXI4 requires. A writer's W does not wait
    for the downstream AWREADY (its AW may still sit in the slot), so a slave that waits
    for W before taking AW cannot deadlock it; a writer whose W comes long after its AW
    holds only the W channel, and AW grants go on until the order queue is full. B is
    routed by ``bid`` to the writer ``i`` with ``ids[i] == bid``; a B whose ``bid`` names
    no writer (a misbehaving slave) is accepted and dropped so it cannot wedge the channel.

    Parameters
    ----------
    ids : tuple of int
        Distinct AXI IDs, each below ``2**AXI_ID_BITS``; writer ``i`` uses ``ids[i]``.
    addr_width : int
        AXI address bits, 12 .. 64.
    data_bytes : int
        AXI data width in bytes, a power of two from 4 to 128.
    """
    def __init__(self, *, ids, addr_width=64, data_bytes=64):
        ids = tuple(ids)
        if not ids:
            raise ValueError("At least one writer ID is needed")
        for id_ in ids:
            if not isinstance(id_, int) or not 0 <= id_ < 1 << AXI_ID_BITS:
                raise ValueError(f"Writer IDs must be integers from 0 to {(1 << AXI_ID_BITS) - 1}, not {id_!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"Writer IDs must be distinct, not {ids!r}")
        if not isinstance(addr_width, int) or not 12 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 12 to 64 bits, not {addr_width!r}")
        if data_bytes not in (4, 8, 16, 32, 64, 128):
            raise ValueError(f"AXI data width must be 4 to 128 bytes, a power of two, not {data_bytes!r}")
        self.ids = ids
        super().__init__({
            "writers": In(AxiWriteSignature(addr_width, data_bytes)).array(len(ids)),
            "axi": Out(AxiWriteSignature(addr_width, data_bytes)),
        })
        aw_layout = data.StructLayout({"awid": AXI_ID_BITS, "awaddr": addr_width, "awlen": 8,
                                       "awsize": 3, "awburst": 2})
        # The writers' registered AW requests and W beats: their ``o`` is what the round
        # robin and the W slot see.
        self.aw_registers = [SkidRegister(aw_layout) for _ in ids]
        w_layout = data.StructLayout({"wdata": 8 * data_bytes, "wstrb": data_bytes, "wlast": 1})
        self.w_registers = [SkidRegister(w_layout) for _ in ids]

    def elaborate(self, platform):
        m = Module()
        axi, writers, n = self.axi, self.writers, len(self.ids)
        # Writer indices at least one bit wide: a lone writer must not leave zero-width
        # signals in the Verilog.
        index_bits = bits_for(n - 1)
        m.submodules.order = order = fifo.SyncFIFO(width=index_bits, depth=ORDER_DEPTH)

        # AW: each writer's request registered, then the first valid one after the last
        # one granted wins the free slot.
        held = []
        for i, (writer, register) in enumerate(zip(writers, self.aw_registers)):
            m.submodules[f"aw_register{i}"] = register
            m.d.comb += [register.i.valid.eq(writer.awvalid), writer.awready.eq(register.i.ready)]
            m.d.comb += [register.i.payload[name].eq(getattr(writer, name))
                         for name in register.i.payload.shape().members]
            held.append(register.o)
        mask = Signal(n, init=mask_after(0, n))
        requests = Cat(request.valid for request in held)
        pick = round_robin_pick(m, requests, mask, name="aw")
        granted = one_hot_index(pick)
        aw_free = (~axi.awvalid | axi.awready) & order.w_rdy
        for i, request in enumerate(held):
            m.d.comb += request.ready.eq(aw_free & pick[i])
        with m.If(axi.awready):
            m.d.sync += axi.awvalid.eq(0)
        with m.If(aw_free & requests.any()):
            chosen = Array(request.payload for request in held)[granted]
            m.d.sync += [
                axi.awvalid.eq(1),
                axi.awid.eq(chosen.awid),
                axi.awaddr.eq(chosen.awaddr),
                axi.awlen.eq(chosen.awlen),
                axi.awsize.eq(chosen.awsize),
                axi.awburst.eq(chosen.awburst),
                mask.eq(next_mask(pick)),
            ]
            m.d.comb += [order.w_en.eq(1), order.w_data.eq(granted)]

        # W: the head writer's registered beats through a registered W slot.
        beats = []
        for i, (writer, register) in enumerate(zip(writers, self.w_registers)):
            m.submodules[f"w_register{i}"] = register
            m.d.comb += [register.i.valid.eq(writer.wvalid), writer.wready.eq(register.i.ready)]
            m.d.comb += [register.i.payload[name].eq(getattr(writer, name))
                         for name in register.i.payload.shape().members]
            beats.append(register.o)
        w_free = ~axi.wvalid | axi.wready
        head = order.r_data
        for i, beat in enumerate(beats):
            m.d.comb += beat.ready.eq(order.r_rdy & w_free & (head == i))
        with m.If(axi.wready):
            m.d.sync += axi.wvalid.eq(0)
        current = Array(beat.payload for beat in beats)[head]
        current_valid = Array(beat.valid for beat in beats)[head]
        with m.If(order.r_rdy & w_free & current_valid):
            m.d.sync += [
                axi.wvalid.eq(1),
                axi.wdata.eq(current.wdata),
                axi.wstrb.eq(current.wstrb),
                axi.wlast.eq(current.wlast),
            ]
            m.d.comb += order.r_en.eq(current.wlast)

        # B: by ID.
        m.d.comb += axi.bready.eq(1)
        for i, (writer, id_) in enumerate(zip(writers, self.ids)):
            m.d.comb += [
                writer.bvalid.eq(axi.bvalid & (axi.bid == id_)),
                writer.bid.eq(axi.bid),
                writer.bresp.eq(axi.bresp),
            ]
            with m.If(axi.bid == id_):
                m.d.comb += axi.bready.eq(writer.bready)
        return m
