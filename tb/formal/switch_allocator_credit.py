"""Formal harness: the pipelined switch allocator starts a packet only when its output VL's
credit covers all of it and every packet started for that output and not yet counted (IBA's
modular rule); a long packet only alone (docs/formal.md, docs/switch.md "Pipelined allocator").

Around the real ``SwitchAllocator`` the harness plays the switch and the output transmitters:
queue heads arrive with any block count and stay until started or discarded (discards only
while the allocator has nothing in flight for that input, the input not ready in the cycle
after, as the switch's head-of-queue drop); ``start`` comes for a matched input at any time;
each transmitter takes its started packets in order (its FCTBS grows by exactly the packet's
blocks, ``counted`` the cycle after) or skips them (``skipped``), one a cycle and beside a take
a skip of the next, in any cycle after the start; the credit limit moves only forward and
stays within the peer's buffer of FCTBS (2047 blocks at most), as a peer's FCCL does.
Everything else is free in every cycle.
"""
from amaranth import Array, Cat, Elaboratable, Module, Mux, Signal
from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cover

from hdl.link.signatures import FCCL_BITS
from hdl.switch.switch_allocator import SwitchAllocator
from tb.formal import sby
from tb.formal.credit import CREDIT_WINDOW, fits


class SwitchAllocatorCreditHarness(Elaboratable):
    def __init__(self, *, ports=2, num_vls=2, max_blocks=3, short_blocks=1, short_matches=2,
                 allocator=SwitchAllocator):
        self.dut = allocator(ports, num_vls, max_blocks=max_blocks, short_blocks=short_blocks,
                             short_matches=short_matches)

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

        # --- the output transmitters: FCTBS; the packets started and not yet counted (owed),
        # in start order, at most K + 1 (asserted); the peer's credit limit.
        S, K = dut.short_blocks, dut.short_matches
        depth = K + 1
        fctbs = [[Signal(FCCL_BITS, name=f"fctbs{o}_{v}") for v in vls] for o in ports]
        limit = [[free(FCCL_BITS, f"limit{o}_{v}") for v in vls] for o in ports]
        limit_before = [[Signal(FCCL_BITS, name=f"limit_before{o}_{v}") for v in vls]
                        for o in ports]
        owed_n = [Signal(range(depth + 1), name=f"owed_n{o}") for o in ports]
        owed_vl = [[Signal(range(V), name=f"owed_vl{o}_{n}") for n in range(depth)] for o in ports]
        owed_blocks = [[Signal(FCCL_BITS, name=f"owed_blocks{o}_{n}") for n in range(depth)]
                       for o in ports]
        counted = Signal(P)
        skipped = Signal(P)
        take = free(P, "take")                              # the transmitter takes the first
        skip = free(P, "skip")                              # ... or it is skipped unsent
        skip_next = free(P, "skip_next")                    # beside a take, the next skipped
        m.d.comb += [dut.counted.eq(counted), dut.skipped.eq(skipped)]
        # Short packets counted or skipped in the cycle before and the two before that: the
        # allocator's view has not seen them (its count of uncounted short matches has them).
        popped_short = [Signal(2, name=f"popped_short{o}") for o in ports]
        seen_short = [[Signal(2, name=f"seen_short{o}_{n}") for n in range(2)] for o in ports]
        popped_long = Signal(P)
        seen_long = [Signal(P, name=f"seen_long{n}") for n in range(2)]
        m.d.sync += [seen_long[0].eq(popped_long), seen_long[1].eq(seen_long[0])]
        for o in ports:
            first = take[o] | skip[o]
            second = take[o] & skip_next[o]
            pops = Signal(range(3), name=f"pops{o}")
            m.d.comb += [Assume(~(take[o] & skip[o])), Assume(~skip_next[o] | take[o]),
                         Assume(~first | (owed_n[o] >= 1)), Assume(~second | (owed_n[o] >= 2)),
                         pops.eq(first + second)]
            m.d.sync += [counted[o].eq(take[o]), skipped[o].eq(skip[o] | second),
                         popped_short[o].eq((first & (owed_blocks[o][0] <= S))
                                            + (second & (owed_blocks[o][1] <= S))),
                         popped_long[o].eq(first & (owed_blocks[o][0] > S)),
                         seen_short[o][0].eq(popped_short[o]),
                         seen_short[o][1].eq(seen_short[o][0])]
            for v in vls:
                m.d.comb += [dut.credit_limit[o][v].eq(limit[o][v]),
                             dut.fctbs[o][v].eq(fctbs[o][v])]
                m.d.sync += limit_before[o][v].eq(limit[o][v])
                # The peer's FCCL: at most its buffer ahead of FCTBS, and only moving forward.
                m.d.comb += Assume((limit[o][v] - fctbs[o][v])[:FCCL_BITS] < CREDIT_WINDOW)
                with m.If(age != 0):
                    m.d.comb += Assume((limit[o][v] - limit_before[o][v])[:FCCL_BITS]
                                       < CREDIT_WINDOW)
                with m.If(take[o] & (owed_vl[o][0] == v)):
                    m.d.sync += fctbs[o][v].eq(fctbs[o][v] + owed_blocks[o][0])

        # --- the rules, checked at every start; the owed queue moves on.
        owed_sum = [[Signal(FCCL_BITS, name=f"owed_sum{o}_{v}") for v in vls] for o in ports]
        owed_long = Signal(P)
        owed_short_n = [Signal(range(depth + 1), name=f"owed_short_n{o}") for o in ports]
        for o in ports:
            here = [owed_n[o] > n for n in range(depth)]
            for v in vls:
                m.d.comb += owed_sum[o][v].eq(sum(Mux(here[n] & (owed_vl[o][n] == v),
                                                      owed_blocks[o][n], 0)
                                                  for n in range(depth)))
            m.d.comb += [
                owed_long[o].eq(Cat(here[n] & (owed_blocks[o][n] > S) for n in range(depth)).any()),
                owed_short_n[o].eq(sum(here[n] & (owed_blocks[o][n] <= S) for n in range(depth))),
            ]
            starting = Cat(start[i] & row[i][o] for i in ports)
            v = dut.pend_vl[o]
            blocks = Signal(FCCL_BITS, name=f"starting_blocks{o}")
            head_there = Signal(name=f"starting_head_valid{o}")
            for i in ports:
                with m.If(starting[i]):
                    m.d.comb += [blocks.eq(Array(head_blocks[i][o])[v]),
                                 head_there.eq(Array(head_valid[i][o])[v])]
            room = Signal(FCCL_BITS, name=f"room{o}")       # limit - FCTBS - owed
            m.d.comb += room.eq(Array(limit[o])[v] - Array(fctbs[o])[v] - Array(owed_sum[o])[v])
            with m.If(starting.any()):
                m.d.comb += [
                    # A long packet alone: none started and uncounted then, none after it.
                    Assert((owed_n[o] == 0) | (blocks <= S) & ~owed_long[o]),
                    Assert((starting & (starting - 1)) == 0),
                    # The packet started is the queue head the allocator tested.
                    Assert(head_there),
                    Assert(fits(room, 0, blocks)),
                ]
            # Reachable: a packet of more than one block starts on exactly its credit; a short
            # packet starts while another is started and uncounted.
            m.d.comb += Cover(starting.any() & (blocks > 1) & (room == blocks))
            m.d.comb += Cover(starting.any() & (owed_n[o] != 0))
            # The owed queue: popped from the front, pushed at the back by a start.
            pops = Signal(range(3), name=f"owed_pops{o}")
            m.d.comb += pops.eq((take[o] | skip[o]) + (take[o] & skip_next[o]))
            kept = owed_n[o] - pops
            for n in range(depth):
                for shift in (1, 2):
                    if n + shift < depth:
                        with m.If(pops == shift):
                            m.d.sync += [owed_vl[o][n].eq(owed_vl[o][n + shift]),
                                         owed_blocks[o][n].eq(owed_blocks[o][n + shift])]
                with m.If(starting.any() & (kept == n)):
                    m.d.sync += [owed_vl[o][n].eq(v), owed_blocks[o][n].eq(blocks)]
            m.d.sync += owed_n[o].eq(kept + starting.any())
            m.d.comb += Assert(owed_n[o] <= K + 1)
        # Invariants that tie the allocator's credit hold and its count of uncounted short
        # matches to the transmitters (proved like the rules; they let the induction start
        # from states the rules leave unconstrained): a long packet uncounted is the hold (from
        # the cycle after the match) and alone; the short ones are the count (from the second
        # cycle after the match to the third after their own); a pending match is its input's
        # valid head; everything started or pending for an output fits its credit together.
        for o in ports:
            v = hold["vl"][o]
            pending = Cat(pend[i * P + o] for i in ports)
            pend_blocks = Signal(FCCL_BITS, name=f"pend_blocks{o}")
            pend_head = Signal(name=f"pend_head_valid{o}")
            for i in ports:
                with m.If(pending[i]):
                    m.d.comb += [pend_blocks.eq(Array(head_blocks[i][o])[dut.pend_vl[o]]),
                                 pend_head.eq(Array(head_valid[i][o])[dut.pend_vl[o]])]
            pend_short = pending.any() & (pend_blocks <= S)
            pend_long = pending.any() & (pend_blocks > S)
            long_out = (owed_long[o] | pend_long
                        | hold["matched_out"][o] & ~hold["matched_small"][o])
            recent = hold["valid"][o] | hold["matched_out"][o] & ~hold["matched_short"][o]
            uncounted = (owed_short_n[o] + pend_short + popped_short[o] + seen_short[o][0]
                         + seen_short[o][1])
            fresh = hold["matched_out"][o] & hold["matched_small"][o]   # not in the count yet
            m.d.comb += [Assert(hold["uncounted"][o] + fresh == uncounted),
                         Assert(uncounted <= K + 1),
                         Assert(~hold["valid"][o] | long_out | popped_long[o])]
            with m.If(long_out):
                m.d.comb += [Assert(recent), Assert(uncounted == 0),
                             Assert(owed_n[o] + pending.any() == 1)]
                with m.If(hold["valid"][o]):
                    m.d.comb += [Assert(v == Mux(pending.any(), dut.pend_vl[o], owed_vl[o][0])),
                                 Assert(hold["blocks"][o] == Mux(pending.any(), pend_blocks,
                                                                 owed_blocks[o][0]))]
            # The counts on their way to the allocator's view are the packets popped.
            m.d.comb += [
                Assert(counted[o] + skipped[o] == popped_short[o] + popped_long[o]),
                Assert(hold["seen"][o][0] == seen_short[o][0] + seen_long[0][o]),
                Assert(hold["seen"][o][1] == seen_short[o][1] + seen_long[1][o]),
            ]
            with m.If(popped_long[o] | seen_long[0][o] | seen_long[1][o]):
                # The count of a long packet: the only packet then.
                m.d.comb += [Assert(hold["uncounted"][o] == 0), Assert(~long_out)]
            with m.If(pending.any()):
                m.d.comb += Assert(pend_head)
            # A grant comes from a request made with no long packet uncounted; one on the
            # quiet rule with nothing uncounted but a match of the cycle before, one on the
            # short rule with at most K - 1 short matches counted (K - 2 then, and the one of
            # the cycle before).
            with m.If(hold["grant"][o].any()):
                m.d.comb += [Assert(~hold["valid"][o]), Assert(~hold["hold_after"][0][o]),
                             Assert(~hold["hold_after"][1][o])]
                with m.If(hold["grant_short"][o]):
                    m.d.comb += Assert(hold["uncounted"][o] <= K - 1)
                with m.Else():
                    m.d.comb += [Assert(hold["uncounted"][o] == 0),
                                 Assert(owed_n[o] + pending.any() <= hold["matched_out"][o])]
            for vv in vls:
                total = owed_sum[o][vv] + Mux(pending.any() & (dut.pend_vl[o] == vv), pend_blocks, 0)
                m.d.comb += Assert(fits(limit[o][vv], fctbs[o][vv], total))
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
