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
    """Read-modify-write of a 4- or 8-byte word for the responder's atomics
    (docs/nic-responder.md).

    One operation at a time, never overlapped, which is what makes them atomic against
    each other: the 64-byte beat holding the word at ``addr`` is read (``ar``, one beat,
    id ``ATOMIC_ID``), the little-endian word at ``addr mod 64`` taken (``addr``'s low
    three bits, two with ``size4``, are ignored: the engine checks alignment), the new
    value computed as ``AtomicRequestLayout`` says (a 4-byte operation works on its half
    of the 8-byte word with the other half's operands 0 and the carry out of its top bit
    stopped) and always written back (one beat, id ``ATOMIC_ID``, ``wstrb`` only the
    word's 8 or 4 bytes; AW and W offered together), the write response awaited, and
    then the result given: ``orig`` (a 4-byte word in its low 32 bits) and ``error`` when
    RRESP or BRESP was not OKAY. A failed read writes nothing and returns ``orig`` 0.

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
        word = op.addr[3:6]
        upper = op.size4 & op.addr[2]       # a 4-byte word in the upper half of its 8
        beat_addr = Cat(C(0, 6), op.addr[6:self.addr_width])

        # The operands placed on the 8-byte word, registered while the read is under way
        # (``op`` is held from the cycle after IDLE; COMPUTE is two cycles later at the
        # earliest), so that COMPUTE starts from registers.
        def placed(value):
            low = value[:32]
            return Mux(op.size4, Mux(op.addr[2], Cat(C(0, 32), low), Cat(low, C(0, 32))), value)
        swap_add, compare = Signal(64), Signal(64)
        swap_mask, compare_mask, boundary = Signal(64), Signal(64), Signal(64)
        add_kept = Signal(64)               # the addend, its boundary bits cleared
        # A lower 4-byte word's carry must not reach the upper half.
        placed_boundary = placed(op.swap_mask) | ((op.size4 & ~op.addr[2]) << 31)
        m.d.sync += [
            swap_add.eq(placed(op.swap_add)), compare.eq(placed(op.compare)),
            swap_mask.eq(placed(op.swap_mask)), compare_mask.eq(placed(op.compare_mask)),
            boundary.eq(placed_boundary), add_kept.eq(placed(op.swap_add) & ~placed_boundary),
        ]
        # Masked add: with the boundary bits cleared in both operands no carry leaves them,
        # and each sum bit adds its own half sum to its carry in (lookahead_sum's ``half``);
        # the read word is registered in those three forms as it arrives.
        orig_kept = Signal(64)
        orig_half = Signal(64)
        masked_sum = lookahead_sum(m, orig_kept, add_kept, half=orig_half)[:64]
        swapped = Mux(((orig ^ compare) & compare_mask).any(), orig,
                      (orig & ~swap_mask) | (swap_add & swap_mask))

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
            axi.wstrb.eq(Mux(op.size4, Const(0xF, BEAT_BYTES) << (op.addr[2:6] * 4),
                             Const(0xFF, BEAT_BYTES) << (word * 8))),
            axi.wlast.eq(1),
            axi.bready.eq(1),
            result.payload.orig.eq(Mux(upper, orig[32:], Mux(op.size4, orig[:32], orig))),
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
                        read = r.payload.data.word_select(word, 64)
                        m.d.sync += [orig.eq(read), orig_kept.eq(read & ~boundary),
                                     orig_half.eq(read ^ swap_add)]
                        m.next = "COMPUTE"
            with m.State("COMPUTE"):
                m.d.sync += new.eq(Mux(op.fetch_add, masked_sum, swapped))
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
