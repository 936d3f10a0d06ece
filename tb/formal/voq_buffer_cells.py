"""Formal harness: the VOQ buffer's cell accounting (docs/formal.md, docs/switch.md "Input
buffer"): no cell is lost or handed out twice, free + in use = all cells, ``no_cell`` never
rises, and an empty buffer has every cell but the writer's reserved one free.

Around the real ``VoqBuffer`` the harness plays the receiver and the switch: any packets on
any VL (writes only while the VL's room allows one, as the receiver's credits do; a start
only after the previous packet's end beat and verdict, one VL per packet, at most
``max_beats`` beats, as the receiver's MTU check closes longer ones), any verdicts (good,
bad, with the end beat or later), any routes, grants only of non-empty queues while the
reader is free or finishing (with or without discard), any backpressure on ``out``. A
shadow bit per cell (in use: the writer's reserved cell and every cell written and not yet
given back) checks every cell the free list hands out and takes back.
"""
from amaranth import Array, Cat, Elaboratable, Module, Mux, Signal, Value
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.switch.voq_buffer import VoqBuffer
from tb.formal import sby


def popcount(bits):
    return sum(bits[n] for n in range(len(bits)))


class VoqBufferCellsHarness(Elaboratable):
    def __init__(self, *, width=8, num_vls=2, ports=2, share=3, max_beats=4, buffer=VoqBuffer):
        self.dut = buffer(width=width, num_vls=num_vls, ports=ports, share=share)
        self.max_beats = max_beats

    def elaborate(self, platform):
        m = Module()
        dut = self.dut
        sby.add_elaborated(m, dut, platform)
        cells = dut.formal_cells
        store = dut.store
        vls = range(dut.num_vls)

        def free(port):
            m.d.comb += port.eq(AnySeq(len(Value.cast(port))))

        for port in (store.write_valid, store.write.start, store.write.end,
                     store.verdict_valid, store.verdict_bad, dut.route_port, dut.route_vl,
                     dut.route_blocks,
                     dut.grant_valid, dut.grant_queues, dut.grant_discard, dut.out.ready):
            free(port)

        # The beats' bytes and counts and the verdicts' credit blocks are 0: the buffer
        # decides nothing from them (it passes them on: to the crossbar, the allocator, the
        # receiver), and constants let Yosys drop those bits from every memory entry.
        m.d.comb += [store.write.data.eq(0), store.write.count.eq(0),
                     store.verdict_blocks.eq(0)]

        # --- the receiver: one packet at a time, within the VL's room.
        open_ = Signal()                # a packet started and its end beat not yet written
        judged = Signal(init=1)         # the last packet's verdict is in
        packet_vl = Signal.like(store.write_vl)
        beats = Signal(range(self.max_beats + 1))
        write, beat = store.write_valid, store.write
        start_vl = Signal.like(store.write_vl)      # a packet's VL, free at its start
        free(start_vl)
        m.d.comb += [store.write_vl.eq(Mux(beat.start, start_vl, packet_vl)),
                     store.verdict_vl.eq(packet_vl),
                     Assume(~write | (Array(store.room)[store.write_vl] != 0))]
        with m.If(write & beat.start):
            m.d.comb += Assume(~open_ & judged)
            m.d.sync += [open_.eq(~beat.end), judged.eq(0), packet_vl.eq(start_vl),
                         beats.eq(1)]
        with m.Elif(write):
            m.d.comb += Assume(open_ & (beats < self.max_beats))
            m.d.sync += [open_.eq(~beat.end), beats.eq(beats + 1)]
        with m.If(store.verdict_valid):
            # With the end beat or later, once per packet, before the next start.
            m.d.comb += Assume(Mux(write & beat.start, beat.end,
                                   ~judged & (~open_ | write & beat.end)))
            m.d.sync += judged.eq(1)
        # The grant names one queue.
        select = dut.grant_queues
        m.d.comb += Assume((select & (select - 1)) == 0)

        # --- the switch: grants only of a non-empty queue while the reader is free or finishing.
        heads_valid = Cat(head.valid for head in dut.heads)
        m.d.comb += Assume(~dut.grant_valid | ((heads_valid & select).any() &
                                               (~dut.active | dut.finishing)))

        # --- the shadow: which cells are in use.
        in_use = Signal(dut.cells, init=1)      # cell 0 is the writer's first reserved cell
        taken = cells["taken"]
        given = cells["given"]
        after = Signal(dut.cells)
        m.d.comb += after.eq(in_use
                             & ~(cells["give"].replicate(dut.cells) & (1 << given))
                             | (cells["take"].replicate(dut.cells) & (1 << taken)))
        m.d.sync += in_use.eq(after)
        packets = Signal(range(dut.cells + 2))  # packets started and not yet finished
        m.d.sync += packets.eq(packets + (write & beat.start) - dut.finishing)

        free_now = Signal(range(2 * dut.cells + 1))
        m.d.comb += free_now.eq(dut.cells - cells["fresh"] + cells["free_level"])
        m.d.comb += [
            # The free list hands out only cells not in use, takes back only cells in use.
            Assert(~cells["take"] | ~in_use.bit_select(taken, 1)),
            Assert(~cells["give"] | in_use.bit_select(given, 1)),
            # Free + in use = all cells.
            Assert(free_now + popcount(in_use) == dut.cells),
            Assert(in_use.bit_select(cells["reserved"], 1)),
            Assert(~dut.no_cell),
        ]
        # Empty: every cell is free but the reserved one.
        with m.If((packets == 0) & ~heads_valid.any() & ~dut.active):
            m.d.comb += Assert(popcount(in_use) == 1)

        # Reachable: every VL's share full, then all drained; a packet discarded.
        full = Signal()
        m.d.comb += full.eq(Cat(store.room[v] == 0 for v in vls).all())
        was_full = Signal()
        with m.If(full):
            m.d.sync += was_full.eq(1)
        m.d.comb += [Cover(full),
                     Cover(was_full & (packets == 0) & (popcount(in_use) == 1)),
                     Cover(store.discarded)]
        return m
