from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import lookahead_sum
from hdl.nic.signatures import (
    ATOMIC_ID, ArLayout, AtomicRequestLayout, AtomicResultLayout, AxiWriteSignature,
    RBeatLayout,
)

__all__ = ["AtomicUnit"]

BEAT_BYTES = 64
AXI_BURST_INCR = 0b01


class AtomicUnit(wiring.Component):
    """8-byte read-modify-write for the responder's atomics (docs/nic-responder.md).

    One operation at a time, never overlapped, which is what makes them atomic against
    each other: the 64-byte beat holding the word at ``addr`` is read (``ar``, one beat,
    id ``ATOMIC_ID``), the little-endian word at ``addr mod 64`` taken (``addr``'s low
    three bits are ignored: the engine checks alignment), the new value computed
    (FETCH_ADD: ``orig + swap_add`` mod 2^64; COMPARE_SWAP: ``swap_add`` if
    ``orig == compare``, else ``orig``) and always written back (one beat, id
    ``ATOMIC_ID``, ``wstrb`` only the word's 8 bytes; AW and W offered together), the
    write response awaited, and then the result given: ``orig`` and ``error`` when RRESP
    or BRESP was not OKAY. A failed read writes nothing and returns ``orig`` 0.

    ``r.ready`` and ``bready`` are always high: a beat or write response arriving while
    none is awaited is dropped; ``r.last`` and ``bid`` are not looked at (the
    arbiters route by ID).

    Counters: ``atomics_executed`` (results given, errors included),
    ``atomic_memory_errors`` (results with ``error``).
    """

    def __init__(self, *, addr_width=64):
        if not isinstance(addr_width, int) or not 12 <= addr_width <= 64:
            raise ValueError(f"addr_width must be an integer 12 to 64, not {addr_width!r}")
        self.addr_width = addr_width
        super().__init__({
            "request": In(stream.Signature(AtomicRequestLayout())),
            "result": Out(stream.Signature(AtomicResultLayout())),
            "ar": Out(stream.Signature(ArLayout())),
            "r": In(stream.Signature(RBeatLayout(BEAT_BYTES))),
            "axi": Out(AxiWriteSignature(addr_width, BEAT_BYTES)),
            "atomics_executed": Out(32),
            "atomic_memory_errors": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        request, result, ar, r, axi = self.request, self.result, self.ar, self.r, self.axi

        op = Signal(AtomicRequestLayout())
        orig = Signal(64)
        new = Signal(64)
        aw_done = Signal()
        w_done = Signal()
        fetched_add = lookahead_sum(m, orig, op.swap_add)[:64]
        word = op.addr[3:6]
        beat_addr = Cat(C(0, 6), op.addr[6:self.addr_width])

        m.d.comb += [
            ar.payload.id.eq(ATOMIC_ID),
            ar.payload.addr.eq(beat_addr),
            ar.payload.len.eq(0),
            r.ready.eq(1),
            axi.awid.eq(ATOMIC_ID),
            axi.awaddr.eq(beat_addr),
            axi.awlen.eq(0),
            axi.awsize.eq((BEAT_BYTES - 1).bit_length()),
            axi.awburst.eq(AXI_BURST_INCR),
            axi.wdata.eq(new.replicate(BEAT_BYTES // 8)),
            axi.wstrb.eq(Const(0xFF, BEAT_BYTES) << (word * 8)),
            axi.wlast.eq(1),
            axi.bready.eq(1),
            result.payload.orig.eq(orig),
        ]

        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += request.ready.eq(1)
                with m.If(request.valid):
                    m.d.sync += [op.eq(request.payload), result.payload.error.eq(0)]
                    m.next = "READ"
            with m.State("READ"):
                m.d.comb += ar.valid.eq(1)
                with m.If(ar.ready):
                    m.next = "DATA"
            with m.State("DATA"):
                with m.If(r.valid):
                    with m.If(r.payload.resp != 0):
                        m.d.sync += [orig.eq(0), result.payload.error.eq(1)]
                        m.next = "RESULT"
                    with m.Else():
                        m.d.sync += orig.eq(r.payload.data.word_select(word, 64))
                        m.next = "COMPUTE"
            with m.State("COMPUTE"):
                with m.If(op.fetch_add):
                    m.d.sync += new.eq(fetched_add)
                with m.Else():
                    m.d.sync += new.eq(Mux(orig == op.compare, op.swap_add, orig))
                m.d.sync += [aw_done.eq(0), w_done.eq(0)]
                m.next = "WRITE"
            with m.State("WRITE"):
                m.d.comb += [axi.awvalid.eq(~aw_done), axi.wvalid.eq(~w_done)]
                aw_now = aw_done | axi.awready
                w_now = w_done | axi.wready
                m.d.sync += [aw_done.eq(aw_now), w_done.eq(w_now)]
                with m.If(aw_now & w_now):
                    m.next = "RESPONSE"
            with m.State("RESPONSE"):
                with m.If(axi.bvalid):
                    m.d.sync += result.payload.error.eq(axi.bresp != 0)
                    m.next = "RESULT"
            with m.State("RESULT"):
                m.d.comb += result.valid.eq(1)
                with m.If(result.ready):
                    m.d.sync += self.atomics_executed.eq(self.atomics_executed + 1)
                    with m.If(result.payload.error):
                        m.d.sync += self.atomic_memory_errors.eq(self.atomic_memory_errors + 1)
                    m.next = "IDLE"
        return m
