"""Formal harness: the pipelined switch allocator starts a packet only when its output VL's
credit covers all of it (IBA's modular rule), one packet per output and per input at a time
(docs/formal.md, docs/switch.md "Pipelined allocator").

Around the real ``SwitchAllocator`` the harness plays the switch and the output transmitters:
queue heads arrive with any block count and stay until started or discarded (discards only
while the allocator has nothing in flight for that input, the input not ready in the cycle
after, as the switch's head-of-queue drop); ``start`` comes for a matched input at any time;
each transmitter takes a started packet (its FCTBS grows by exactly the packet's blocks,
``counted`` the cycle after) or skips it, in any cycle after the start; the credit limit moves only forward and stays within the peer's buffer of FCTBS
(2047 blocks at most), as a peer's FCCL does. Everything else is free in every cycle.
"""
from amaranth import Array, Cat, Elaboratable, Module, Mux, Signal
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.link.signatures import FCCL_BITS
from hdl.switch.switch_allocator import SwitchAllocator
from tb.formal import sby
from tb.formal.credit import CREDIT_WINDOW, fits


class SwitchAllocatorCreditHarness(Elaboratable):
    def __init__(self, *, ports=2, num_vls=2, max_blocks=3, allocator=SwitchAllocator):
        self.dut = allocator(ports, num_vls, max_blocks=max_blocks)

    def elaborate(self, platform):
        m = Module()
        dut = self.dut
        sby.add_elaborated(m, dut, platform)
        hold = dut.formal_hold
        P, V = dut.ports, dut.num_vls
        ports, vls = range(P), range(V)

        def free(width, name):
            s = Signal(width, name=name)
            m.d.comb += s.eq(AnySeq(width))
            return s

        in_ready = free(P, "in_ready")
        m.d.comb += [dut.in_ready.eq(in_ready), dut.out_ready.eq(AnySeq(P))]
        for o in ports:
            for v in vls:
                m.d.comb += dut.vl_weight[o][v].eq(AnySeq(8))

        # Cycles since reset (saturating): the values of the cycle before exist from 1 on.
        age = Signal(2)
        with m.If(age != 3):
            m.d.sync += age.eq(age + 1)

        pend, match = dut.pend, dut.match
        row = [Signal(P, name=f"row{i}") for i in ports]     # input i's match or pending match
        for i in ports:
            m.d.comb += row[i].eq(pend[i * P:(i + 1) * P] | match[i * P:(i + 1) * P])

        # --- the switch: start only a matched input.
        start = free(P, "start_free")
        m.d.comb += dut.start.eq(start)
        for i in ports:
            m.d.comb += Assume(~start[i] | row[i].any())

        # --- queue heads: any arrival; a head stays until started or discarded.
        head_valid = [[[Signal(name=f"head_valid{i}_{o}_{v}") for v in vls] for o in ports]
                      for i in ports]
        head_blocks = [[[Signal(FCCL_BITS, name=f"head_blocks{i}_{o}_{v}") for v in vls]
                        for o in ports] for i in ports]
        discard = free(P, "discard")                        # the head-of-queue drop of input i
        discard_queue = [free(range(P * V), f"discard_queue{i}") for i in ports]
        drops = [Signal(P * V, name=f"drops{i}") for i in ports]
        # The switch skips a dropped packet as an active read whose beats left it sets to
        # unknown, so the input is not ready in the cycle after a drop (the heads tested in
        # the drop cycle are stale then).
        dropped_before = Signal(P)
        m.d.sync += dropped_before.eq(Cat(drops[i].any() for i in ports))
        m.d.comb += Assume((in_ready & dropped_before) == 0)
        for i in ports:
            for o in ports:
                for v in vls:
                    k = (i * P + o) * V + v
                    m.d.comb += [dut.head_valid[k].eq(head_valid[i][o][v]),
                                 dut.head_blocks[i][o][v].eq(head_blocks[i][o][v])]
                    started = start[i] & row[i][o] & (dut.pend_vl[o] == v)
                    dropped = discard[i] & ~dut.in_flight[i] & (discard_queue[i] == o * V + v)
                    m.d.comb += drops[i][o * V + v].eq(dropped)
                    with m.If(started | dropped | ~head_valid[i][o][v]):
                        m.d.sync += [head_valid[i][o][v].eq(AnySeq(1)),
                                     head_blocks[i][o][v].eq(AnySeq(FCCL_BITS))]

        # --- the output transmitters: FCTBS, the started packet not yet counted (owed), the
        # peer's credit limit.
        fctbs = [[Signal(FCCL_BITS, name=f"fctbs{o}_{v}") for v in vls] for o in ports]
        limit = [[free(FCCL_BITS, f"limit{o}_{v}") for v in vls] for o in ports]
        limit_before = [[Signal(FCCL_BITS, name=f"limit_before{o}_{v}") for v in vls]
                        for o in ports]
        owed = Signal(P)
        owed_vl = [Signal(range(V), name=f"owed_vl{o}") for o in ports]
        owed_blocks = [Signal(FCCL_BITS, name=f"owed_blocks{o}") for o in ports]
        counted = Signal(P)
        take = free(P, "take")                              # the transmitter takes it
        skip = free(P, "skip")                              # ... or it is skipped unsent
        m.d.comb += dut.counted.eq(counted)
        m.d.sync += counted.eq(owed & (take | skip))
        for o in ports:
            for v in vls:
                m.d.comb += [dut.credit_limit[o][v].eq(limit[o][v]),
                             dut.fctbs[o][v].eq(fctbs[o][v])]
                m.d.sync += limit_before[o][v].eq(limit[o][v])
                # The peer's FCCL: at most its buffer ahead of FCTBS, and only moving forward.
                m.d.comb += Assume((limit[o][v] - fctbs[o][v])[:FCCL_BITS] < CREDIT_WINDOW)
                with m.If(age != 0):
                    m.d.comb += Assume((limit[o][v] - limit_before[o][v])[:FCCL_BITS]
                                       < CREDIT_WINDOW)
                with m.If(owed[o] & take[o] & (owed_vl[o] == v)):
                    m.d.sync += fctbs[o][v].eq(fctbs[o][v] + owed_blocks[o])
            with m.If(owed[o] & (take[o] | skip[o])):
                m.d.sync += owed[o].eq(0)

        # --- the rules, checked at every start.
        for o in ports:
            starting = Cat(start[i] & row[i][o] for i in ports)
            v = dut.pend_vl[o]
            blocks = Signal(FCCL_BITS, name=f"starting_blocks{o}")
            head_there = Signal(name=f"starting_head_valid{o}")
            for i in ports:
                with m.If(starting[i]):
                    m.d.comb += [blocks.eq(Array(head_blocks[i][o])[v]),
                                 head_there.eq(Array(head_valid[i][o])[v])]
            room = Signal(FCCL_BITS, name=f"room{o}")       # limit - FCTBS - uncounted
            m.d.comb += room.eq(Array(limit[o])[v] - Array(fctbs[o])[v]
                                - Mux(owed[o] & (owed_vl[o] == v), owed_blocks[o], 0))
            with m.If(starting.any()):
                m.d.comb += [
                    # One packet per output at a time: none started and uncounted, none beside.
                    Assert(~owed[o]),
                    Assert((starting & (starting - 1)) == 0),
                    # The packet started is the queue head the allocator tested.
                    Assert(head_there),
                    Assert(fits(room, 0, blocks)),
                ]
                m.d.sync += [owed[o].eq(1), owed_vl[o].eq(v), owed_blocks[o].eq(blocks)]
            # Reachable: a packet of more than one block starts on exactly its credit.
            m.d.comb += Cover(starting.any() & (blocks > 1) & (room == blocks))
        # Invariants that tie the allocator's credit hold to the transmitters (proved like the
        # rules; they let the induction start from states the rules leave unconstrained):
        # a match not yet counted is the hold (from the cycle after the match); a pending
        # match is its input's valid head and fits; a started packet not yet counted fits.
        for o in ports:
            v = hold["vl"][o]
            recent = hold["valid"][o] | hold["matched_out"][o]
            pending = Cat(pend[i * P + o] for i in ports)
            pend_blocks = Signal(FCCL_BITS, name=f"pend_blocks{o}")
            pend_head = Signal(name=f"pend_head_valid{o}")
            for i in ports:
                with m.If(pending[i]):
                    m.d.comb += [pend_blocks.eq(Array(head_blocks[i][o])[dut.pend_vl[o]]),
                                 pend_head.eq(Array(head_valid[i][o])[dut.pend_vl[o]])]
            with m.If(owed[o]):
                m.d.comb += [Assert(recent), Assert(~pending.any()),
                             Assert(fits(Array(limit[o])[owed_vl[o]],
                                         Array(fctbs[o])[owed_vl[o]], owed_blocks[o]))]
                with m.If(hold["valid"][o]):
                    m.d.comb += [Assert(v == owed_vl[o]), Assert(hold["blocks"][o] == owed_blocks[o])]
            with m.If(pending.any()):
                m.d.comb += [Assert(recent), Assert(pend_head),
                             Assert(fits(Array(limit[o])[dut.pend_vl[o]],
                                         Array(fctbs[o])[dut.pend_vl[o]], pend_blocks))]
                with m.If(hold["valid"][o]):
                    m.d.comb += [Assert(v == dut.pend_vl[o]), Assert(hold["blocks"][o] == pend_blocks)]
        # A match (stage A) comes from a grant made while its input and output were ready.
        ready_before = Signal(2 * P)
        m.d.sync += ready_before.eq(Cat(in_ready, dut.out_ready))
        for i in ports:
            for o in ports:
                m.d.comb += Assert(~match[i * P + o] | (ready_before[i] & ready_before[P + o]))
        for i in ports:
            # An input has one match at a time (a match, or a pending one, never both).
            m.d.comb += Assert((row[i] & (row[i] - 1)) == 0)
            m.d.comb += Assert(~(pend[i * P:(i + 1) * P].any() & match[i * P:(i + 1) * P].any()))
        for o in ports:
            column = Cat(row[i][o] for i in ports)
            m.d.comb += Assert((column & (column - 1)) == 0)
        return m
