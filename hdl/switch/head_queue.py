"""FIFO whose head is read through a synchronous (block RAM) read port, so the head is a
register at the same latency as ``lib.fifo.SyncFIFO``'s (docs/switch.md, Input buffer)."""

from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

__all__ = ["HeadQueue"]


class HeadQueue(wiring.Component):
    """First-word-fall-through FIFO with ``SyncFIFO``'s ports and cycle timing.

    A word written in cycle c is ``r_data`` (with ``r_rdy``) from c + 1. ``r_data`` is the
    data of a read port addressed in the cycle before with the next read pointer and
    transparent for the write port, so it comes from no logic. ``r_data`` is meaningless
    while ``r_rdy`` is low. ``level`` and ``r_rdy`` are registers; a write while full is
    ignored (``w_rdy`` low). Reset state empty.
    """

    def __init__(self, *, width, depth):
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"Width must be a positive integer, not {width!r}")
        if not isinstance(depth, int) or depth < 2:
            raise ValueError(f"Depth must be an integer of at least 2, not {depth!r}")
        self.width = width
        self.depth = depth
        super().__init__({
            "w_data": In(width),
            "w_en": In(1),
            "w_rdy": Out(1),
            "r_data": Out(width),
            "r_en": In(1),
            "r_rdy": Out(1),
            "level": Out(range(depth + 1)),
        })

    def elaborate(self, platform):
        m = Module()
        depth = self.depth
        m.submodules.storage = storage = Memory(shape=self.width, depth=depth, init=[])
        write = storage.write_port()
        read = storage.read_port(transparent_for=(write,))

        def step(pointer):
            return Mux(pointer == depth - 1, 0, pointer + 1)

        w_ptr = Signal(range(depth))
        r_ptr = Signal(range(depth))
        r_ptr_next = Signal(range(depth), init=1 % depth)      # r_ptr + 1, kept beside it
        written = Signal()
        taken = Signal()
        m.d.comb += [
            self.w_rdy.eq(self.level != depth),
            written.eq(self.w_en & self.w_rdy),
            taken.eq(self.r_en & self.r_rdy),
            write.addr.eq(w_ptr),
            write.data.eq(self.w_data),
            write.en.eq(written),
            # The head of the next cycle: read now, so r_data is the read port's register.
            read.addr.eq(Mux(taken, r_ptr_next, r_ptr)),
            self.r_data.eq(read.data),
        ]
        with m.If(written):
            m.d.sync += w_ptr.eq(step(w_ptr))
        with m.If(taken):
            m.d.sync += [r_ptr.eq(r_ptr_next), r_ptr_next.eq(step(r_ptr_next))]
        # Its pointers, for a formal proof's invariants over its contents (docs/formal.md).
        self.formal_pointers = {"storage": storage, "w_ptr": w_ptr, "r_ptr": r_ptr,
                                "r_ptr_next": r_ptr_next}
        # The read side's handshake chooses between sums of registers, never feeds a sum.
        level = self.level
        m.d.sync += [
            level.eq(Mux(written, Mux(taken, level, level + 1), Mux(taken, level - 1, level))),
            self.r_rdy.eq(written | self.r_rdy & ~(taken & (level == 1))),
        ]
        return m
