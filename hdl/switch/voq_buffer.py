from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.arith import or_all
from hdl.link.signatures import (
    FCCL_BITS, BeatLayout, StoreSignature, check_width, vl_index,
)
from hdl.switch.head_queue import HeadQueue

__all__ = ["VoqBuffer", "HeadSignature", "QUEUE_MODES", "queue_count"]

QUEUE_MODES = ("voq", "fifo")


def queue_count(ports, num_vls, mode):
    """Queues of one input: one per (output, VL) in VOQ mode, one per VL in FIFO mode."""
    return ports * num_vls if mode == "voq" else num_vls


class HeadSignature(wiring.Signature):
    """The packet at the head of one queue, as the switch allocator sees it: the output
    port and VL it goes to and the credit blocks it needs there."""
    def __init__(self, ports, num_vls):
        super().__init__({
            "valid": Out(1),
            "port": Out(range(ports)),
            "vl": Out(vl_index(num_vls)),
            "blocks": Out(FCCL_BITS),
        })


class VoqBuffer(wiring.Component):
    """Receive buffer of one switch input: a shared cell memory and per-output packet queues.

    Each beat of a packet is a *cell* of one memory, linked to the next cell of its packet
    by a pointer stored with it, so any mix of packets, outputs and VLs shares the memory.
    The receiver writes packets through ``store`` (:class:`StoreSignature`); the start
    beat comes with the switch's routing decision (``route_port``, ``route_vl``: output
    port and output VL, whose number the start beat's LRH.VL is rewritten to;
    ``route_blocks``: the credit blocks its LRH.PktLen asks for downstream) and puts
    a descriptor on that packet's queue at once, so a packet can be granted and leave
    cut-through while its tail is still arriving.

    Queues: with ``mode="voq"`` one per (output port, output VL), so a packet waiting for a
    busy or credit-starved output never holds up packets of this input to other outputs;
    with ``mode="fifo"`` one per output VL, whatever the output (head-of-line blocking, to
    compare against). ``heads[q]`` shows each queue's head packet to the allocator;
    ``arriving[q]`` shows the descriptor being queued in this cycle into queue q while it is
    empty, the cycle before it heads the queue (so the allocator can start on it at once).

    Reading: ``grant_valid``/``grant_queues`` (one-hot; from the allocator, only while the
    reader is free or ``finishing``) start the head packet of that queue. Its beats stream on
    ``out`` (to the crossbar, with ``out_port``/``out_vl``) at one per cycle, never ahead of
    the writer. The end beat waits for the packet's verdict and leaves marked ``end_bad``
    if the packet turned out bad after it started out. A packet already known bad when it
    is granted is not sent: its cells are skipped (``sending`` stays low, so the output is
    free again at once) and counted as discarded; so is a packet granted with
    ``grant_discard`` (its head-of-queue lifetime ran out). Cells go back to the free list as they
    are read; the packet's credit blocks return to the receiver with its end beat, and its
    verdict entry (taken from a free list of its own at its start) goes back then.

    Accounting: every input VL may hold ``share`` cells (the receiver's room), which its
    credits never exceed when the peer follows the protocol, so the memory
    (``num_vls * share`` cells and a few spare) cannot run out; ``no_cell`` (sticky) would
    say it did.

    Latency: a start beat written in cycle t heads its queue in t + 1; granted in cycle
    g, its first beat is on ``out`` in g + 1 (the grant addresses the cell memory
    directly), the cycle after the previous packet's last beat left.
    """

    def __init__(self, *, width, num_vls, ports, share, mode="voq"):
        check_width(width)
        if mode not in QUEUE_MODES:
            raise ValueError(f"Queue mode must be one of {QUEUE_MODES}, not {mode!r}")
        if not 2 <= ports <= 16:
            raise ValueError(f"Ports must be 2 to 16, not {ports!r}")
        if not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        if not 2 <= share <= 16384:
            raise ValueError(f"Cells per VL must be 2 to 16384, not {share!r}")
        self.width = width
        self.num_vls = num_vls
        self.ports = ports
        self.share = share
        self.mode = mode
        # Writes stop at share - 1 cells per VL (receiver keeps one for a closing beat), the
        # writer holds one reserved cell, and a freed cell takes a cycle to be reusable. As
        # many verdict entries: packets alive never outnumber the cells (docs/switch.md).
        self.cells = num_vls * share + 4
        self.cell_bits = (self.cells - 1).bit_length()
        self.num_queues = queue_count(ports, num_vls, mode)
        super().__init__({
            "store": In(StoreSignature(width, num_vls, range(share + 1))),
            "route_port": In(range(ports)),
            "route_vl": In(vl_index(num_vls)),
            "route_blocks": In(FCCL_BITS),
            "heads": Out(HeadSignature(ports, num_vls)).array(self.num_queues),
            "arriving": Out(HeadSignature(ports, num_vls)).array(self.num_queues),
            "grant_valid": In(1),
            "grant_queues": In(self.num_queues),    # one-hot: the queue to start
            "grant_discard": In(1),     # ... to be dropped unsent (its lifetime ran out)
            "out": Out(stream.Signature(BeatLayout(width))),
            "out_port": Out(range(ports)),
            "out_vl": Out(vl_index(num_vls)),
            "active": Out(1),       # a granted packet is being read (or skipped)
            "sending": Out(1),      # ... and it goes to the output out_port
            "finishing": Out(1),    # its last beat leaves in this cycle
            "no_cell": Out(1),
        })

    def queue_of(self, port, vl):
        """Queue index of packets for output ``port`` on output VL ``vl``."""
        return port * self.num_vls + vl if self.mode == "voq" else vl

    def free_list(self, m, name):
        """Indices 0 .. cells - 1 (cells, verdict entries), each free or in use, as a dict of
        signals: ``reserved`` (a register, in use from reset) is the index the next ``take``
        hands out; a take reserves ``taken`` from the next cycle: a never used index, counted
        by ``fresh``, while any are left, else the head of a ``HeadQueue`` of the ones given
        back (``give``, ``given``; reusable from the next cycle). ``ran_out``: a take found
        none. A HeadQueue, not a SyncFIFO: its level and head are registers, so a take
        decides among registers, not through an adder (depth: the receiver's write decision
        takes a cell)."""
        count = self.cells
        queue = m.submodules[name] = HeadQueue(width=self.cell_bits, depth=count)
        signals = {"reserved": Signal(self.cell_bits, name=f"{name}_reserved"),
                   "fresh": Signal(range(count + 1), init=1, name=f"{name}_fresh"),
                   "taken": Signal(self.cell_bits, name=f"{name}_taken"),
                   "take": Signal(name=f"{name}_take"), "ran_out": Signal(name=f"{name}_ran_out"),
                   "give": queue.w_en, "given": queue.w_data, "free_level": queue.level,
                   "queue": queue}
        fresh = signals["fresh"]
        m.d.comb += signals["taken"].eq(Mux(fresh != count, fresh, queue.r_data))
        with m.If(signals["take"]):
            m.d.sync += signals["reserved"].eq(signals["taken"])
            with m.If(fresh != count):
                m.d.sync += fresh.eq(fresh + 1)
            with m.Else():
                m.d.comb += [queue.r_en.eq(1), signals["ran_out"].eq(~queue.r_rdy)]
        return signals

    def elaborate(self, platform):
        m = Module()
        width, num_vls, cells = self.width, self.num_vls, self.cells
        store = self.store

        cell_layout = data.StructLayout({
            "data": 8 * width, "end": 1, "count": range(width + 1), "next": self.cell_bits})
        verdict_layout = data.StructLayout({"bad": 1, "blocks": FCCL_BITS})
        descriptor = data.StructLayout({
            "head": self.cell_bits, "entry": self.cell_bits, "port": range(self.ports),
            "vl": vl_index(num_vls), "in_vl": vl_index(num_vls), "blocks": FCCL_BITS})

        m.submodules.cell_mem = cell_mem = Memory(shape=cell_layout, depth=cells, init=[])
        m.submodules.verdict_mem = verdict_mem = Memory(
            shape=verdict_layout, depth=cells, init=[])
        # A packet's verdict entry is taken at its start and given back when it finishes, so
        # no live packet's entry is reused however long it waits (docs/switch.md, Verdicts).
        free_cells = self.free_list(m, "free_cells")
        free_entries = self.free_list(m, "free_entries")
        queues = []
        for q in range(self.num_queues):
            queue = HeadQueue(width=descriptor.size, depth=cells)
            m.submodules[f"queue{q}"] = queue
            queues.append(queue)
            head = data.View(descriptor, queue.r_data)
            m.d.comb += [
                self.heads[q].valid.eq(queue.r_rdy),
                self.heads[q].port.eq(head.port),
                self.heads[q].vl.eq(head.vl),
                self.heads[q].blocks.eq(head.blocks),
            ]

        # --- writer ----------------------------------------------------------------------
        cell_wp = cell_mem.write_port()
        reserved = free_cells["reserved"]                   # where the next beat goes
        wr_open = Signal()                                  # a packet awaits its verdict
        wr_entry = Signal(self.cell_bits)                   # ... the newest packet's entry
        wr_cells = Signal(16)                               # beats of it written so far
        # Cells each input VL may still fill: a register, since the receiver's write decision
        # reads it (PacketBuffer does the same).
        room = [Signal(range(self.share + 1), init=self.share, name=f"room{v}") for v in range(num_vls)]

        write = store.write_valid
        starting = write & store.write.start
        new_cell = free_cells["taken"]
        m.d.comb += free_cells["take"].eq(write)
        with m.If(free_cells["ran_out"]):
            m.d.sync += self.no_cell.eq(1)

        beat_data = Signal(8 * width)
        m.d.comb += beat_data.eq(store.write.data)
        with m.If(store.write.start):
            # The packet leaves on the output VL: LRH.VL is the high nibble of byte 0.
            m.d.comb += beat_data[4:8].eq(self.route_vl)
        m.d.comb += [
            cell_wp.addr.eq(reserved),
            cell_wp.en.eq(write),
            cell_wp.data.data.eq(beat_data),
            cell_wp.data.end.eq(store.write.end),
            cell_wp.data.count.eq(store.write.count),
            cell_wp.data.next.eq(new_cell),
        ]

        # Each live packet holds a cell in use, so a start finds an entry free by construction
        # (docs/switch.md, Verdicts): nothing to flag.
        m.d.comb += free_entries["take"].eq(starting)
        with m.If(starting):
            m.d.sync += [wr_entry.eq(free_entries["reserved"]), wr_cells.eq(1), wr_open.eq(1)]
        with m.Elif(write):
            m.d.sync += wr_cells.eq(wr_cells + 1)

        entry = Signal(descriptor)
        m.d.comb += [
            entry.head.eq(reserved),
            entry.entry.eq(free_entries["reserved"]),
            entry.port.eq(self.route_port),
            entry.vl.eq(self.route_vl),
            entry.in_vl.eq(store.write_vl),
            entry.blocks.eq(self.route_blocks),
        ]
        target = self.queue_of(self.route_port, self.route_vl)
        for q, queue in enumerate(queues):
            m.d.comb += [
                queue.w_data.eq(entry),
                queue.w_en.eq(starting & (target == q)),
                self.arriving[q].valid.eq(queue.w_en & ~queue.r_rdy),
                self.arriving[q].port.eq(entry.port),
                self.arriving[q].vl.eq(entry.vl),
                self.arriving[q].blocks.eq(entry.blocks),
            ]

        verdict_wp = verdict_mem.write_port()
        m.d.comb += [
            verdict_wp.addr.eq(Mux(starting, free_entries["reserved"], wr_entry)),
            verdict_wp.data.bad.eq(store.verdict_bad),
            verdict_wp.data.blocks.eq(store.verdict_blocks),
            verdict_wp.en.eq(store.verdict_valid),
        ]
        with m.If(store.verdict_valid):
            m.d.sync += wr_open.eq(0)

        # --- reader ----------------------------------------------------------------------
        cell_rp = cell_mem.read_port(transparent_for=())
        # The packet's verdict and whether it is in are registers, formed in the cycle before
        # from the writer's next state and the reader's next packet (depth: no memory read or
        # entry compare in front of the reader's decisions). Each holds, in every cycle,
        # the value a combinational read at rd_entry would give (docs/switch.md).
        verdict_rp = verdict_mem.read_port(transparent_for=(verdict_wp,))
        rd_checked = Signal()       # the known-bad check was made for this packet
        rd_skip = Signal()
        rd_entry = Signal(self.cell_bits)
        rd_index = Signal(16)       # beats read so far (the grant reads the first)
        rd_in_vl = Signal(vl_index(num_vls))
        shown = Signal()            # cell_rp.data holds a beat of this packet not yet consumed
        shown_cell = Signal(self.cell_bits)
        shown_start = Signal()
        beat = cell_rp.data

        known = Signal()            # the packet's verdict is in
        # Only the newest packet can still wait for its verdict, and a packet starting now is
        # never the one being read or granted (it heads its queue a cycle later): the verdict
        # of packet s is out next cycle iff no start, no verdict now, and s is the open one.
        still_open = Signal()
        m.d.comb += still_open.eq(~starting & ~store.verdict_valid & wr_open)
        # The grant is one-hot over the queues: its head is an AND-OR of registers (each queue's
        # head is its read port's data), no index to decode (depth).
        granted = data.View(descriptor, or_all([Mux(self.grant_queues[q], queue.r_data, 0)
                                                for q, queue in enumerate(queues)]))
        # Whether queue q's head is the newest packet: the newest went to q and is alone there
        # (it cannot have left before an older one). From registers, not from the head read
        # out of the queue's memory and an entry compare (depth).
        newest_queue = Signal(range(max(self.num_queues, 2)))
        with m.If(starting):
            m.d.sync += newest_queue.eq(target)
        open_head = Signal(self.num_queues)
        for q, queue in enumerate(queues):
            m.d.comb += open_head[q].eq((newest_queue == q) & (queue.level == 1))
        with m.If(self.grant_valid):
            m.d.comb += verdict_rp.addr.eq(granted.entry)
            m.d.sync += known.eq(~(still_open & (open_head & self.grant_queues).any()))
        with m.Else():
            m.d.comb += verdict_rp.addr.eq(rd_entry)
            m.d.sync += known.eq(~(still_open & (wr_entry == rd_entry)))
        bad = verdict_rp.data.bad
        skip = Signal()
        m.d.comb += skip.eq(Mux(rd_checked, rd_skip, known & bad))
        with m.If(self.active & ~rd_checked):
            m.d.sync += [rd_checked.eq(1), rd_skip.eq(known & bad)]

        out = self.out
        m.d.comb += [
            out.payload.data.eq(beat.data),
            out.payload.start.eq(shown_start),
            out.payload.end.eq(beat.end),
            out.payload.count.eq(beat.count),
            out.payload.end_bad.eq(beat.end & bad),
            out.valid.eq(self.active & shown & ~skip & (~beat.end | known)),
            self.sending.eq(self.active & ~skip),
        ]
        consume = Signal()
        m.d.comb += [
            # A skipped packet, too, ends only once its verdict (and credit count) is in.
            consume.eq(self.active & shown & Mux(skip, ~beat.end | known, out.valid & out.ready)),
            self.finishing.eq(consume & beat.end),
        ]
        written = known | (rd_index < wr_cells)
        issue = Signal()
        m.d.comb += [
            issue.eq(self.active & ~(shown & beat.end) & written & (~shown | consume)),
            cell_rp.en.eq(issue),
            cell_rp.addr.eq(beat.next),
        ]
        with m.If(issue):
            m.d.sync += [shown.eq(1), shown_cell.eq(cell_rp.addr), shown_start.eq(0),
                         rd_index.eq(rd_index + 1)]
        with m.Elif(consume):
            m.d.sync += shown.eq(0)

        m.d.comb += [free_cells["given"].eq(shown_cell), free_cells["give"].eq(consume)]
        m.d.comb += [free_entries["given"].eq(rd_entry), free_entries["give"].eq(self.finishing)]
        # The free lists' moves, for a formal proof's shadow of the cells and entries in use
        # (docs/formal.md): a write takes a cell, a consumed beat gives its cell back; a start
        # takes an entry, a finishing packet gives its entry back.
        self.formal_cells = free_cells
        self.formal_entries = free_entries
        # ... and what its induction states about the free lists, the packet chains in the
        # cell memory, the queued descriptors and the reader (docs/formal.md).
        self.formal_chains = {"queues": queues, "cell_mem": cell_mem,
                              "descriptor": descriptor, "granted_head": granted.head,
                              "wr_entry": wr_entry, "wr_open": wr_open, "wr_cells": wr_cells,
                              "rd_entry": rd_entry, "rd_index": rd_index, "rd_in_vl": rd_in_vl,
                              "shown": shown, "shown_cell": shown_cell, "beat": beat,
                              "known": known, "newest_queue": newest_queue,
                              "consume": consume, "room": room}
        for v in range(num_vls):
            gained = write & (store.write_vl == v)
            lost = consume & (rd_in_vl == v)
            # The write and the read choose among sums of the register (depth, as above).
            m.d.sync += room[v].eq(Mux(gained, Mux(lost, room[v], room[v] - 1),
                                       Mux(lost, room[v] + 1, room[v])))
            m.d.comb += [
                store.room[v].eq(room[v]),
                store.freed_valid[v].eq(self.finishing & (rd_in_vl == v)),
                store.freed_blocks[v].eq(verdict_rp.data.blocks),
            ]
        m.d.comb += [
            store.discarded.eq(self.finishing & skip),
            store.forwarded_bad.eq(self.finishing & ~skip & bad),
        ]

        with m.If(self.finishing):
            m.d.sync += self.active.eq(0)
        with m.If(self.grant_valid):
            for q, queue in enumerate(queues):
                m.d.comb += queue.r_en.eq(self.grant_queues[q])
            # The head cell is read in the grant cycle itself (the port is idle: the reader
            # was free or its last beat is leaving), so a packet follows the previous one
            # out of the same output with no idle cycle between them.
            m.d.comb += [cell_rp.en.eq(1), cell_rp.addr.eq(granted.head)]
            m.d.sync += [
                self.active.eq(1), rd_checked.eq(self.grant_discard),
                rd_skip.eq(self.grant_discard), rd_index.eq(1),
                shown.eq(1), shown_cell.eq(granted.head), shown_start.eq(1),
                rd_entry.eq(granted.entry), rd_in_vl.eq(granted.in_vl),
                self.out_port.eq(granted.port), self.out_vl.eq(granted.vl),
            ]
        return m
