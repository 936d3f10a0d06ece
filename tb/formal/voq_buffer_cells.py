"""Formal harness: the VOQ buffer's cell and verdict-entry accounting (docs/formal.md,
docs/switch.md "Input buffer"): no cell or entry is lost or handed out twice, free + in use =
all of them, ``no_cell`` never rises, an empty buffer has every cell but the writer's reserved
one free, and every live packet keeps its verdict entry until it finishes.

Around the real ``VoqBuffer`` the harness plays the receiver and the switch: any packets on
any VL (writes only while the VL's room allows one, as the receiver's credits do; a start
only after the previous packet's end beat and verdict, one VL per packet, at most
``max_beats`` beats, as the receiver's MTU check closes longer ones), any verdicts (good,
bad, with the end beat or later), any routes, grants only of non-empty queues while the
reader is free or finishing (with or without discard), any backpressure on ``out``. A
shadow bit per cell (in use: the writer's reserved cell and every cell written and not yet
given back) checks every cell the free list hands out and takes back, and one per verdict
entry (in use: the reserved entry and those of the packets alive) every entry. With ``induction`` the
harness also states the invariants meant to make this inductive (ghost labels of each cell in
use, over the free FIFO's, the queues' and the cell memory's contents; docs/formal.md): they
hold from reset, but their k-induction has not been seen to finish yet.
"""
from amaranth import Array, Cat, Elaboratable, Module, Mux, Signal, Value
from amaranth.lib import data
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.switch.voq_buffer import VoqBuffer
from tb.formal import sby
from tb.formal.fifo_contents import elaborate_now


def popcount(bits):
    return sum(bits[n] for n in range(len(bits)))


class VoqBufferCellsHarness(Elaboratable):
    def __init__(self, *, width=8, num_vls=2, ports=2, share=3, max_beats=4, induction=True,
                 buffer=VoqBuffer):
        self.dut = buffer(width=width, num_vls=num_vls, ports=ports, share=share)
        self.max_beats = max_beats
        # The invariants k-induction needs; a bounded check from reset is faster without them.
        self.induction = induction

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
                     dut.grant_valid, dut.grant_queues, dut.grant_discard, dut.out.ready):
            free(port)

        # The beats' bytes and counts, the verdicts' and routes' credit blocks are 0: the
        # buffer decides nothing from them (it passes them on: to the crossbar, the allocator,
        # the receiver), and constants let Yosys drop those bits from every memory entry.
        m.d.comb += [store.write.data.eq(0), store.write.count.eq(0),
                     store.verdict_blocks.eq(0), dut.route_blocks.eq(0)]

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

        # --- the shadows: which cells and which verdict entries are in use.
        in_use = shadow(m, cells, dut.cells, "cells")
        m.d.comb += Assert(~dut.no_cell)
        packets = Signal(range(dut.cells + 2))  # packets started and not yet finished
        m.d.sync += packets.eq(packets + (write & beat.start) - dut.finishing)
        # Each packet alive holds its own verdict entry, from its start to its finishing
        # cycle (the reserved entry beside them): the reader's is still in use, and a start
        # hands out neither the reader's entry nor the open packet's.
        entries = dut.formal_entries
        entry_in_use = shadow(m, entries, dut.cells, "entries")
        ch = dut.formal_chains
        m.d.comb += [
            Assert(popcount(entry_in_use) == packets + 1),
            Assert(~dut.active | (entry_in_use.bit_select(ch["rd_entry"], 1)
                                  & (ch["rd_entry"] != entries["reserved"]))),
            Assert(~ch["wr_open"] | (entry_in_use.bit_select(ch["wr_entry"], 1)
                                     & (ch["wr_entry"] != entries["reserved"]))),
        ]
        # Empty: every cell is free but the reserved one.
        with m.If((packets == 0) & ~heads_valid.any() & ~dut.active):
            m.d.comb += Assert(popcount(in_use) == 1)

        if self.induction:
            self.chain_invariants(m, in_use, entry_in_use, packets, open_, judged, beats,
                                  packet_vl)

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

    def chain_invariants(self, m, in_use, entry_in_use, packets, open_, judged, beats,
                         packet_vl):
        """What makes the accounting inductive (docs/formal.md): the free lists, the packet
        chains in the cell memory, the queued descriptors and the reader, over ghost labels
        of every cell in use (its packet, its beat in it, its VL)."""
        dut = self.dut
        ch = dut.formal_chains
        cells = dut.formal_cells
        store = dut.store
        n = dut.cells
        write, beat_in = store.write_valid, store.write
        starting = write & beat_in.start
        reserved = cells["reserved"]

        # The cell memory's words, and every queue's entries head first.
        words = []
        for c in range(n):
            port = ch["cell_mem"].read_port(domain="comb")
            m.d.comb += port.addr.eq(c)
            words.append(port.data)
        link = Array(word.next for word in words)

        def contents(queue, depth_used):
            elaborate_now(queue, "formal")
            p = queue.formal_pointers
            depth = queue.depth
            stored = []
            for a in range(depth):
                port = p["storage"].read_port(domain="comb")
                m.d.comb += port.addr.eq(a)
                stored.append(port.data)
            stored = Array(stored)
            r_ptr = p["r_ptr"]

            def wrap(x):
                return Mux(x >= depth, x - depth, x)
            m.d.comb += [
                Assert(queue.level <= depth_used),
                Assert(p["r_ptr_next"] == wrap(r_ptr + 1)),
                Assert(p["w_ptr"] == wrap(r_ptr + queue.level)),
                Assert(queue.r_rdy == (queue.level != 0)),
                Assert(~queue.r_rdy | (queue.r_data == stored[r_ptr])),
            ]
            return [(j < queue.level, stored[wrap(r_ptr + j)]) for j in range(depth_used)]

        free_cell_entries = contents(cells["queue"], n - 1)
        entries = dut.formal_entries
        free_entry_entries = contents(entries["queue"], n - 1)
        layout = ch["descriptor"]
        queued = []         # (queue, index, valid, descriptor view, level)
        for q, queue in enumerate(ch["queues"]):
            for j, (valid, word) in enumerate(contents(queue, dut.num_vls * dut.share)):
                queued.append((q, j, valid, data.View(layout, word), queue.level))

        # Ghost labels of each cell: its packet (the reader's, or the queued one whose head
        # cell is g_head), its beat's position in the packet, its input VL.
        g_rd = [Signal(name=f"g_rd{c}") for c in range(n)]
        g_head = [Signal(dut.cell_bits, name=f"g_head{c}") for c in range(n)]
        g_pos = [Signal(range(self.max_beats), name=f"g_pos{c}") for c in range(n)]
        g_vl = [Signal.like(store.write_vl, name=f"g_vl{c}") for c in range(n)]
        # The latest packet started: its head cell while queued, whether the reader has it,
        # whether it is gone (read out).
        lat_head = Signal(dut.cell_bits)
        lat_rd = Signal()
        lat_gone = Signal(init=1)

        grant = dut.grant_valid
        h = ch["granted_head"]
        finishing = dut.finishing
        lat_rd_next = Signal()
        m.d.comb += lat_rd_next.eq(Mux(lat_rd, ~finishing, grant & ~lat_gone & (h == lat_head)))
        with m.If(starting):
            m.d.sync += [lat_head.eq(reserved), lat_rd.eq(0), lat_gone.eq(0)]
        with m.Else():
            m.d.sync += [lat_rd.eq(lat_rd_next), lat_gone.eq(lat_gone | lat_rd & finishing)]
        for c in range(n):
            with m.If(write & (reserved == c)):
                m.d.sync += [g_vl[c].eq(store.write_vl),
                             g_pos[c].eq(Mux(beat_in.start, 0, beats)),
                             g_rd[c].eq(~beat_in.start & lat_rd_next),
                             g_head[c].eq(Mux(beat_in.start, c, lat_head))]
            with m.Elif(grant & ~g_rd[c] & (g_head[c] == h)):
                m.d.sync += g_rd[c].eq(1)

        W = [Signal(name=f"written{c}") for c in range(n)]     # in use and not reserved
        for c in range(n):
            m.d.comb += W[c].eq(in_use[c] & (reserved != c))
        rd_index, shown = ch["rd_index"], ch["shown"]
        lo_rd = Signal(range(self.max_beats + 1))       # the reader's first beat still held
        m.d.comb += lo_rd.eq(rd_index - shown)

        def same_owner(a, b):
            return (g_rd[a] & g_rd[b]) | (~g_rd[a] & ~g_rd[b] & (g_head[a] == g_head[b]))

        def of_latest(c):
            return ~lat_gone & Mux(lat_rd, g_rd[c], ~g_rd[c] & (g_head[c] == lat_head))

        # --- the free lists: each cell or entry is fresh, free (once in the FIFO) or in use.
        free_list_invariants(m, cells, in_use, free_cell_entries)
        free_list_invariants(m, entries, entry_in_use, free_entry_entries)

        # --- VL v's cells in use are the share its room lacks.
        for v in range(dut.num_vls):
            m.d.comb += Assert(sum(W[c] & (g_vl[c] == v) for c in range(n))
                               == dut.share - ch["room"][v])

        # --- queued descriptors: each heads a packet of its own, the beat 0 in use.
        g_vl_a, g_pos_a, g_rd_a, g_head_a, W_a = (Array(x)
                                                  for x in (g_vl, g_pos, g_rd, g_head, W))
        for k, (q, j, valid, e, level) in enumerate(queued):
            latest = ~lat_gone & ~lat_rd & (e.head == lat_head)
            m.d.comb += Assert(~valid | (W_a[e.head] & ~g_rd_a[e.head]
                                         & (g_head_a[e.head] == e.head) & (g_pos_a[e.head] == 0)
                                         & (g_vl_a[e.head] == e.in_vl)))
            # The latest packet, queued, is the last of the newest queue, with wr_entry.
            m.d.comb += Assert(~(valid & latest) | ((ch["newest_queue"] == q) & (level == j + 1)
                                                    & (e.entry == ch["wr_entry"])
                                                    & (e.in_vl == packet_vl)))
            # Its verdict entry is in use, not the reserved one, not the reader's.
            m.d.comb += Assert(~valid | (entry_in_use.bit_select(e.entry, 1)
                                         & (e.entry != entries["reserved"])
                                         & ~(dut.active & (e.entry == ch["rd_entry"]))))
            for _, _, valid2, e2, _ in queued[k + 1:]:
                m.d.comb += Assert(~(valid & valid2) | ((e.head != e2.head)
                                                        & (e.entry != e2.entry)))
        # The packets alive are the queued ones and the reader's.
        m.d.comb += Assert(packets == sum(valid for _, _, valid, _, _ in queued) + dut.active)

        # Each queued descriptor's head is a cell at beat 0 of a packet not yet granted, and
        # each such cell heads a queued descriptor (counted: no pigeonhole to solve).
        heads = [W[c] & ~g_rd[c] & (g_pos[c] == 0) for c in range(n)]
        m.d.comb += Assert(sum(valid for _, _, valid, _, _ in queued) == sum(heads))
        for c in range(n):
            m.d.comb += Assert(~heads[c] | (g_head[c] == c))

        # --- cells in use: each of a live packet, its beats from the first still held on,
        # linked in order, the latest open packet's last one linked to the reserved cell.
        for c in range(n):
            queued_head = Cat(valid & (e.head == g_head[c]) for _, _, valid, e, _ in queued).any()
            lo = Mux(g_rd[c], lo_rd, 0)
            word = words[c]
            after = word.next
            pred = Cat(W[b] & same_owner(b, c) & (g_pos[b] + 1 == g_pos[c])
                       for b in range(n) if b != c).any()
            m.d.comb += [
                Assert(~W[c] | Mux(g_rd[c],
                                   dut.active & (g_pos[c] >= lo_rd) & (g_vl[c] == ch["rd_in_vl"]),
                                   queued_head & (g_vl[c] == g_vl_a[g_head[c]]))),
                Assert(~(W[c] & (g_pos[c] > lo)) | pred),
                Assert(~(W[c] & of_latest(c)) | (g_pos[c] < beats)),
                Assert(~(W[c] & word.end & of_latest(c)) | ~open_),
                Assert(~(W[c] & ~word.end) | Mux(
                    after == reserved,
                    of_latest(c) & open_ & (g_pos[c] + 1 == beats),
                    W_a[after] & same_owner_dyn(g_rd, g_head, c, after)
                    & (g_pos_a[after] == g_pos[c] + 1))),
            ]
            for b in range(n):
                if b == c:
                    continue
                m.d.comb += Assert(~(W[b] & W[c] & same_owner(b, c)) | (g_pos[b] != g_pos[c]))
                m.d.comb += Assert(~(W[b] & W[c] & same_owner(b, c) & (g_pos[b] + 1 == g_pos[c]))
                                   | (~words[b].end & (words[b].next == c)))

        # --- the reader: the cell shown is its next beat, as the memory holds it; once
        # consumed, the beat's link names the next one (or the reserved cell: it reads the
        # latest packet, open, and has read all that is written).
        shown_cell, beat = ch["shown_cell"], ch["beat"]
        active = dut.active
        nxt = beat.next
        m.d.comb += [
            Assert(~(active & shown) | (W_a[shown_cell] & g_rd_a[shown_cell]
                                        & (g_pos_a[shown_cell] + 1 == rd_index)
                                        & (beat.end == Array(w.end for w in words)[shown_cell])
                                        & (nxt == link[shown_cell]))),
            Assert(~(active & ~shown) | (~beat.end & Mux(
                nxt == reserved,
                lat_rd & open_ & (rd_index == beats),
                W_a[nxt] & g_rd_a[nxt] & (g_pos_a[nxt] == rd_index)))),
        ]
        # --- the writer and the verdicts: the latest packet's beats, its verdict, and the
        # reader waits for it (known low) while it reads it and the verdict is out.
        m.d.comb += [
            Assert(ch["wr_cells"] == beats),
            Assert(ch["wr_open"] == ~judged),
            Assert(~open_ | ~judged),
            Assert(judged | ~lat_gone),
            Assert(~lat_rd | (active & (ch["rd_entry"] == ch["wr_entry"])
                              & (ch["rd_in_vl"] == packet_vl))),
            Assert(lat_gone | (beats != 0)),
            Assert(lat_gone | lat_rd | (W_a[lat_head] & ~g_rd_a[lat_head]
                                        & (g_head_a[lat_head] == lat_head)
                                        & (g_pos_a[lat_head] == 0))),
            Assert(~open_ | ~lat_gone),
            Assert(~active | (rd_index != 0)),
            Assert(~(active & lat_rd & ~judged) | ~ch["known"]),
        ]


def shadow(m, moves, n, name):
    """A shadow bit per index of a free list (``moves``: the buffer's ``formal_cells`` or
    ``formal_entries``), in use from its take to its give, index 0 from reset (the reserved
    one); checks that the list hands out only free indices, takes back only ones in use, never
    runs out, and free + in use = all."""
    in_use = Signal(n, init=1, name=f"{name}_in_use")
    taken, given = moves["taken"], moves["given"]
    m.d.sync += in_use.eq(in_use
                          & ~(moves["give"].replicate(n) & (1 << given))
                          | (moves["take"].replicate(n) & (1 << taken)))
    free_now = Signal(range(2 * n + 1), name=f"{name}_free")
    m.d.comb += [
        free_now.eq(n - moves["fresh"] + moves["free_level"]),
        Assert(~moves["take"] | ~in_use.bit_select(taken, 1)),
        Assert(~moves["give"] | in_use.bit_select(given, 1)),
        Assert(free_now + popcount(in_use) == n),
        Assert(in_use.bit_select(moves["reserved"], 1)),
        Assert(~moves["ran_out"]),
    ]
    return in_use


def free_list_invariants(m, moves, in_use, fifo):
    """Each index below ``fresh`` is in use or in the free FIFO (``fifo``: its entries as
    ``(valid, index)``), never both; the FIFO's entries are distinct."""
    fresh = moves["fresh"]
    n = len(in_use)
    m.d.comb += Assert(fresh <= n)
    for c in range(n):
        in_fifo = Cat(valid & (entry == c) for valid, entry in fifo).any()
        m.d.comb += [Assert((in_use[c] | in_fifo) == (c < fresh)),
                     Assert(~(in_use[c] & in_fifo))]
    for a in range(len(fifo)):
        for b in range(a + 1, len(fifo)):
            m.d.comb += Assert(~fifo[b][0] | (fifo[a][1] != fifo[b][1]))


def same_owner_dyn(g_rd, g_head, c, other):
    """Whether cell ``other`` (a signal) belongs to the packet of cell ``c``."""
    rd, head = Array(g_rd)[other], Array(g_head)[other]
    return Mux(g_rd[c], rd, ~rd & (head == g_head[c]))
