"""Pipelined switch allocator: credit test, output VL pick and one iSLIP iteration, one
registered stage each; short packets to one output back to back on a reserve of credit
(docs/switch.md, Pipelined allocator)."""

from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import or_all
from hdl.link.signatures import FCCL_BITS, vl_index
from hdl.prim.round_robin import next_mask, round_robin_pick, turn_pick

__all__ = ["SwitchAllocator", "ALLOC_STAGES"]

# A head seen in cycle c is a pending match in c + ALLOC_STAGES at the earliest.
ALLOC_STAGES = 3


class SwitchAllocator(wiring.Component):
    """Three-stage allocator of the cut-through switch; the cycle rules are in docs/switch.md.

    ``head_valid`` bit ``(i * ports + o) * num_vls + v``: input i has a packet of
    ``head_blocks[i][o][v]`` blocks heading its queue for output o, VL v. ``match`` bit
    ``i * ports + o``: input i accepts output o in this cycle (stage A), the one grant it has
    (from registers); ``pend`` (registered): a match not started yet, among them every match
    chosen among several grants. Either way the packet goes on VL ``pend_vl[o]`` and starts
    in the cycle the switch raises ``start[i]`` (a ``match`` may start in its own cycle);
    ``start_head`` bit ``(i * ports + o) * num_vls + v`` names the head (o, v) that input i
    starts then (from registers; meaningless for an input with no match). ``counted[o]``:
    the transmitter of o has counted a started packet's blocks in its FCTBS; ``skipped[o]``:
    a started packet for o was skipped unsent (both may come in one cycle).

    ``short_blocks`` (S) and ``short_matches`` (K): a packet of at most S blocks may be
    matched while other matches to its output are uncounted, when it fits in the credit less
    K x S blocks; at most K others are then uncounted (docs/switch.md, Short packets).
    """

    def __init__(self, ports=8, num_vls=2, max_blocks=65, short_blocks=4, short_matches=6):
        if not isinstance(ports, int) or not 2 <= ports <= 16:
            raise ValueError(f"Ports must be an integer from 2 to 16, not {ports!r}")
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 4:
            raise ValueError(f"Data VLs must be an integer from 1 to 4, not {num_vls!r}")
        if not isinstance(max_blocks, int) or not 1 <= max_blocks <= 2047:
            raise ValueError(f"Largest packet must be 1 to 2047 blocks, not {max_blocks!r}")
        if not isinstance(short_blocks, int) or not 1 <= short_blocks <= max_blocks:
            raise ValueError(f"Short packets must be 1 to {max_blocks} blocks, not {short_blocks!r}")
        # Two matches are uncounted beyond the count a request sees, and a third is the quiet
        # match that opens the output to short ones (docs/switch.md).
        if not isinstance(short_matches, int) or not 3 <= short_matches <= 15:
            raise ValueError(f"Uncounted short matches must be 3 to 15, not {short_matches!r}")
        if short_matches * short_blocks > 2047:
            raise ValueError(f"The short-packet reserve {short_matches} x {short_blocks} blocks "
                             f"exceeds 2047")
        self.ports = ports
        self.num_vls = num_vls
        self.max_blocks = max_blocks
        self.short_blocks = short_blocks
        self.short_matches = short_matches
        # Bits of a packet's block count: the credit test compares only these.
        self.blocks_bits = max_blocks.bit_length()
        super().__init__({
            "head_valid": In(ports * ports * num_vls),
            "head_blocks": In(FCCL_BITS).array(ports, ports, num_vls),
            "credit_limit": In(FCCL_BITS).array(ports, num_vls),
            "fctbs": In(FCCL_BITS).array(ports, num_vls),
            "vl_weight": In(8).array(ports, num_vls),
            "in_ready": In(ports),
            "out_ready": In(ports),
            "start": In(ports),
            "counted": In(ports),
            "skipped": In(ports),
            "match": Out(ports * ports),
            "pend": Out(ports * ports),
            "pend_vl": Out(vl_index(num_vls)).array(ports),
            "start_head": Out(ports * ports * num_vls),
            "in_flight": Out(ports),
            "credit_wait": Out(num_vls).array(ports),
        })

    def elaborate(self, platform):
        m = Module()
        P, V = self.ports, self.num_vls
        ones = (1 << P) - 1

        def k(i, o, v):
            return (i * P + o) * V + v

        pend = self.pend
        pend_in = Signal(P)
        pend_out = Signal(P)
        m.d.comb += [
            pend_in.eq(Cat(pend[i * P:(i + 1) * P].any() for i in range(P))),
            pend_out.eq(Cat(Cat(pend[i * P + o] for i in range(P)).any() for o in range(P))),
        ]

        # --- credit view: the transmitter's room less the blocks of the matched packet it has
        # not counted yet. Two registered steps; an output stays out of allocation until
        # both have seen its count (hold and the two cycles after it).
        hold_valid = Signal(P)
        hold_after = [Signal(P, name="hold_after1"), Signal(P, name="hold_after2")]
        hold_vl = [Signal(vl_index(V), name=f"hold_vl{o}") for o in range(P)]
        hold_blocks = [Signal(self.blocks_bits, name=f"hold_blocks{o}") for o in range(P)]
        m.d.sync += [hold_after[0].eq(hold_valid), hold_after[1].eq(hold_after[0])]
        # The IBA test (FCCL - (FCTBS + blocks)) mod 4096 <= 2048 for a packet of fewer than
        # 2**B blocks (B = blocks_bits; the receiver drops longer ones) and space s =
        # FCCL - FCTBS - held is: 2**B <= s <= 2048 (every packet fits), s < 2**B and
        # blocks <= s, or 2048 < s < 2048 + 2**B and blocks >= s - 2048, that is
        # not blocks <= s - 2049. The range and the one B-bit bound to compare against are
        # registered, leaving a single B-bit "<=" per head (one compare, not two, for depth).
        B = self.blocks_bits
        S, K = self.short_blocks, self.short_matches
        fit_all = [Signal(V, name=f"fit_all{o}") for o in range(P)]
        fit_low = [Signal(V, name=f"fit_low{o}") for o in range(P)]
        fit_over = [Signal(V, name=f"fit_over{o}") for o in range(P)]
        bound = [[Signal(B, name=f"bound{o}_{v}") for v in range(V)] for o in range(P)]
        # The short test's space: the room less the reserve K x S, counted as a plain number
        # (the room at most 2047, as a peer's FCCL keeps it; a larger room fails the test).
        # The hold is never set when it applies (below), so it has no `held`.
        short_all = [Signal(V, name=f"short_all{o}") for o in range(P)]
        short_low = [Signal(V, name=f"short_low{o}") for o in range(P)]
        short_bound = [[Signal(B, name=f"short_bound{o}_{v}") for v in range(V)] for o in range(P)]
        for o in range(P):
            for v in range(V):
                room = Signal(FCCL_BITS, name=f"room{o}_{v}")
                held = Signal(FCCL_BITS, name=f"held{o}_{v}")
                space = Signal(FCCL_BITS, name=f"space{o}_{v}")
                space_less1 = Signal(FCCL_BITS, name=f"space_less1_{o}_{v}")
                m.d.sync += [
                    room.eq(self.credit_limit[o][v] - self.fctbs[o][v]),
                    held.eq(Mux(hold_valid[o] & (hold_vl[o] == v), hold_blocks[o], 0)),
                ]
                # Two adders side by side rather than s - 1 after s: s - 1 = room + ~held.
                m.d.comb += [space.eq(room - held), space_less1.eq(room + ~held)]
                low = ~space[B:].any()
                m.d.sync += [
                    fit_all[o][v].eq(~low & (space <= 2048)),
                    fit_low[o][v].eq(low),
                    fit_over[o][v].eq((space[B:] == 2048 >> B) & space[:B].any()),
                    bound[o][v].eq(Mux(low, space[:B], space_less1[:B])),
                ]
                reserved = Signal(FCCL_BITS, name=f"reserved_space{o}_{v}")
                m.d.comb += reserved.eq(room - K * S)
                positive = ~room[-1] & ~reserved[-1]
                m.d.sync += [
                    short_all[o][v].eq(positive & reserved[B:].any()),
                    short_low[o][v].eq(positive & ~reserved[B:].any()),
                    short_bound[o][v].eq(reserved[:B]),
                ]
        matched_out = Signal(P)         # an output matched in the cycle before
        matched_short = Signal(P)       # ... on a grant of the short rule
        matched_small = Signal(P)       # ... to a packet of at most S blocks
        # Per output, the short matches the credit view has not counted (from the second cycle
        # after the match to the second after the transmitter's count) and whether there are
        # none, or at most K - 2 (a request's match adds one and the two cycles before it at
        # most two more: the K others of the short rule; K + 1 with the match itself).
        uncounted = [Signal(range(K + 2), name=f"uncounted{o}") for o in range(P)]
        # Counts (`counted` + `skipped`) of the cycle before and the one before that.
        seen = [[Signal(2, name=f"counts_seen{o}_{n}") for n in range(2)] for o in range(P)]
        none_uncounted = Signal(P, init=ones)
        few_uncounted = Signal(P, init=ones)
        credit_busy = Signal(P)         # no match at all: a long packet is uncounted
        quiet = Signal(P)               # nothing uncounted: any head that fits may be matched
        short_open = Signal(P)          # short packets may be matched on the reserve
        # What a formal proof ties to the transmitters' counts (docs/formal.md): the hold
        # stands for a matched long packet until it is counted, `uncounted` for the short ones.
        self.formal_hold = {"valid": hold_valid, "vl": hold_vl, "blocks": hold_blocks,
                            "matched_out": matched_out, "matched_short": matched_short,
                            "matched_small": matched_small, "uncounted": uncounted,
                            "seen": seen, "hold_after": hold_after}
        m.d.comb += [
            credit_busy.eq(matched_out & ~matched_short | hold_valid | hold_after[0] | hold_after[1]),
            quiet.eq(~credit_busy & ~matched_out & none_uncounted),
            short_open.eq(~credit_busy & few_uncounted),
        ]

        # --- stage E: heads with credit for the whole packet; short heads with it beside the
        # reserve.
        eligible = Signal(P * P * V)
        eligible_short = Signal(P * P * V)
        short = Signal(P * P * V)       # heads that wait for credit only
        for o in range(P):
            for v in range(V):
                for i in range(P):
                    blocks = self.head_blocks[i][o][v]
                    fits = Signal(name=f"fits{i}_{o}_{v}")
                    within = Signal(name=f"within{i}_{o}_{v}")
                    fits_short = Signal(name=f"fits_short{i}_{o}_{v}")
                    m.d.comb += [
                        within.eq(blocks[:B] <= bound[o][v]),
                        fits.eq(~blocks[B:].any() & (fit_all[o][v] | fit_low[o][v] & within
                                                     | fit_over[o][v] & ~within)),
                        fits_short.eq(~blocks[B:].any() & (blocks[:B] <= S) & (
                            short_all[o][v] | short_low[o][v] & (blocks[:B] <= short_bound[o][v]))),
                    ]
                    valid = self.head_valid[k(i, o, v)]
                    m.d.sync += [
                        eligible[k(i, o, v)].eq(valid & fits),
                        eligible_short[k(i, o, v)].eq(valid & fits_short),
                        short[k(i, o, v)].eq(valid & ~fits),
                    ]
                m.d.comb += self.credit_wait[o][v].eq(
                    Cat(short[k(i, o, v)] for i in range(P)).any())

        # --- stage G: among heads whose ports are both available, each output picks a VL
        # (weighted round robin) and grants one input: any eligible head of a quiet output, a
        # short one on the reserve while short matches are uncounted.
        # Not an input matched now (its grant is to an output free now) nor one started in the
        # cycle before (its head tested then may be the packet started): their grants would be
        # dropped, and an output open to short packets again would lose its turn. An input whose
        # grants are all to taken outputs does request: else it may only ever be granted into
        # the cycles its output is taken (docs/switch.md, Which inputs request). Pending now or
        # started in the cycle before = pending or matched in the cycle before, or started then
        # (registers: a level less than the pending matches' OR).
        grant = [Signal(P, name=f"grant{o}") for o in range(P)]
        in_ok = Signal(P)
        matched_in = Signal(P)
        started_in = Signal(P)
        pend_in_before = Signal(P)
        out_free = Signal(P)            # ~out_taken (below), a cycle ahead
        m.d.sync += [started_in.eq(self.start), pend_in_before.eq(pend_in)]
        m.d.comb += in_ok.eq(self.in_ready & ~pend_in_before & ~matched_in & ~started_in & ~Cat(
            (Cat(grant[o][i] for o in range(P)) & out_free).any() for i in range(P)))
        requests = Signal(P * P * V)
        for i in range(P):
            for o in range(P):
                for v in range(V):
                    m.d.comb += requests[k(i, o, v)].eq(
                        (eligible[k(i, o, v)] & quiet[o] | eligible_short[k(i, o, v)] & short_open[o])
                        & in_ok[i] & self.out_ready[o])
        grant_short = Signal(P)         # the grant is on the short rule
        m.d.sync += grant_short.eq(~quiet)
        self.formal_hold.update(grant=grant, grant_short=grant_short)
        vl_ptr = [Signal(vl_index(V), name=f"vl_ptr{o}") for o in range(P)]
        budget = [Signal(8, name=f"vl_budget{o}") for o in range(P)]
        budget_nz = Signal(P)
        grant_mask = [Signal(P, init=ones, name=f"grant_mask{o}") for o in range(P)]
        grant_vl = [Signal(vl_index(V), name=f"grant_vl{o}") for o in range(P)]
        grant_stay = Signal(P)
        for o in range(P):
            vl_any = Signal(V, name=f"vl_any{o}")
            m.d.comb += vl_any.eq(Cat(Cat(requests[k(i, o, v)] for i in range(P)).any()
                                      for v in range(V)))
            stay = Signal(name=f"vl_stay{o}")
            pick = Signal(vl_index(V), name=f"vl_pick{o}")
            m.d.comb += [stay.eq(vl_any.bit_select(vl_ptr[o], 1) & budget_nz[o]),
                         pick.eq(turn_pick(m, vl_any, vl_ptr[o], budget_nz[o], name=f"vl{o}"))]
            per_vl = [round_robin_pick(
                m, Cat(requests[k(i, o, v)] for i in range(P)), grant_mask[o],
                name=f"grant{o}_vl{v}") for v in range(V)]
            m.d.sync += [
                grant[o].eq(Array(per_vl)[pick] if V > 1 else per_vl[0]),
                grant_vl[o].eq(pick),
                grant_stay[o].eq(stay),
            ]

        # --- stage A: each input accepts one grant; the pair becomes a pending match.
        accept_mask = [Signal(P, init=ones, name=f"accept_mask{i}") for i in range(P)]
        match = Signal(P * P)
        matched = Signal(P * P)         # the matches of the cycle before
        direct = Signal(P * P)          # the matches of inputs with one grant: may start now
        m.d.sync += matched.eq(match)
        # The ports matched in the cycle before, registered as such (not ORed from `matched`
        # after the register): a level less in front of `match` and the start (depth).
        matching_out = Cat(Cat(match[i * P + o] for i in range(P)).any() for o in range(P))
        m.d.sync += [
            matched_in.eq(Cat(match[i * P:(i + 1) * P].any() for i in range(P))),
            matched_out.eq(matching_out),
            matched_short.eq(matching_out & grant_short),
        ]
        # An output taken for this cycle's grants: pending, or matched in the cycle before
        # unless both that match and the grant are on the short rule.
        out_taken = Signal(P)
        free = ~(pend_in | matched_in)      # inputs with no pending match and none made before
        m.d.comb += out_taken.eq(pend_out | matched_out & ~(matched_short & grant_short))
        # A grant of cycle c was made before the matches of cycle c, so it may name a port
        # matched since (pending, or matched in c and started at once); such a pick is dropped
        # after the arbiter rather than masked before it, which keeps these flags out of the
        # arbiter's path (depth).
        # An input with one grant accepts it whatever its arbiter's pointer: that match is known
        # from registers (`match`, which the switch may start at once); one chosen among several
        # is pending from the next cycle (the arbiter and the start would not fit one cycle).
        for i in range(P):
            offers = Cat(grant[o][i] for o in range(P))
            pick = round_robin_pick(m, offers, accept_mask[i], name=f"accept{i}")
            free_in = free[i].replicate(P)
            sole = Signal(name=f"sole_offer{i}")
            m.d.comb += [
                sole.eq(Cat(offers == (1 << o) for o in range(P)).any()),
                match[i * P:(i + 1) * P].eq(pick & ~out_taken & free_in),
                direct[i * P:(i + 1) * P].eq(offers & ~out_taken & free_in
                                             & sole.replicate(P)),
            ]
        # `out_taken` of the next cycle, for `in_ok`: the output is matched now to an input with
        # its grant (taken next cycle unless both on the short rule and the match starts now),
        # or pending (taken unless it starts now). Only `start` is late here; an input
        # offered several grants counts as matched to each.
        for o in range(P):
            matching = (grant[o] & free).any() & ~out_taken[o]
            taken_next = matching & ~(grant_short[o] & ~quiet[o])
            taken_unless_started = pend_out[o] | matching
            # A free input starts only a match made now: the one to the output granting it.
            busy = Cat(pend[i * P + o] for i in range(P)) | grant[o] & free
            busy_starts = (self.start & busy).any()
            m.d.sync += out_free[o].eq(~taken_next & ~(taken_unless_started & ~busy_starts))
        started = Cat(self.start[i].replicate(P) for i in range(P))
        m.d.comb += self.match.eq(direct)
        m.d.sync += pend.eq((pend | match) & ~started)
        match_stay = Signal(P)
        pend_vl = [Signal(vl_index(V), name=f"pend_vl{o}") for o in range(P)]
        # Every head's blocks on the VL its output grants, for the hold of the cycle after a
        # match: a match started in its own cycle no longer heads its queue then.
        offered_blocks = [[Signal(self.blocks_bits, name=f"offered_blocks{i}_{o}") for o in range(P)]
                          for i in range(P)]
        offered_small = [Signal(P, name=f"offered_small{i}") for i in range(P)]   # at most S
        for o in range(P):
            # Loaded whenever the output has no pending match (not only on a match: shallower);
            # read only while it has one.
            with m.If(~pend_out[o]):
                m.d.sync += [pend_vl[o].eq(grant_vl[o]), match_stay[o].eq(grant_stay[o])]
            m.d.comb += self.pend_vl[o].eq(Mux(pend_out[o], pend_vl[o], grant_vl[o]))
            for i in range(P):
                offered = Array(self.head_blocks[i][o])[grant_vl[o]] if V > 1 else self.head_blocks[i][o][0]
                m.d.sync += [offered_blocks[i][o].eq(offered),
                             offered_small[i][o].eq(offered <= S)]
        # The head an input starts if it starts now, from registers: its pending match's, else
        # its grant's (where that is a `match`, its only grant).
        for i in range(P):
            for o in range(P):
                for v in range(V):
                    m.d.comb += self.start_head[k(i, o, v)].eq(Mux(
                        pend_in[i], pend[i * P + o] & (pend_vl[o] == v),
                        grant[o][i] & (grant_vl[o] == v)))

        # --- the cycle after a match: iSLIP pointers (first iteration: the only one), the
        # credit hold of a long packet or the count of a short one; the VL budget two cycles
        # later. The matched ports take no part in allocation meanwhile (pend, then the credit
        # hold), so the delay changes no decision, but for short matches back to back.
        for i in range(P):
            row = matched[i * P:(i + 1) * P]
            with m.If(row.any()):
                m.d.sync += accept_mask[i].eq(next_mask(row))
        update = Signal(P)
        update_base = [Signal(8, name=f"vl_budget_base{o}") for o in range(P)]
        settle = Signal(P)
        m.d.sync += [update.eq(0), settle.eq(update)]
        for o in range(P):
            column = Cat(matched[i * P + o] for i in range(P))
            blocks = Signal(self.blocks_bits, name=f"matched_blocks{o}")
            m.d.comb += blocks.eq(or_all([Mux(column[i], offered_blocks[i][o], 0) for i in range(P)]))
            small = matched_small[o]
            m.d.comb += small.eq((column & Cat(offered_small[i][o] for i in range(P))).any())
            # A match started in its own cycle may be counted in the cycle its hold is set: the
            # hold then lasts one cycle (its space is low by the packet for a cycle, never high).
            counted_early = Signal(name=f"counted_early{o}")
            m.d.sync += counted_early.eq((self.counted[o] | self.skipped[o]) & column.any())
            with m.If(self.counted[o] | self.skipped[o] | counted_early):
                m.d.sync += hold_valid[o].eq(0)
            with m.If(column.any()):
                m.d.sync += [
                    grant_mask[o].eq(next_mask(column)),
                    hold_valid[o].eq(~small),
                    hold_vl[o].eq(pend_vl[o]),
                    hold_blocks[o].eq(blocks),
                    vl_ptr[o].eq(pend_vl[o]),
                    update[o].eq(1),
                    update_base[o].eq(Mux(match_stay[o], budget[o],
                                          Array(self.vl_weight[o])[pend_vl[o]])),
                ]
            left = Signal(signed(9), name=f"vl_budget_left{o}")
            with m.If(update[o]):
                m.d.sync += left.eq(update_base[o] - hold_blocks[o])
            with m.If(settle[o]):
                m.d.sync += [budget[o].eq(Mux(left < 0, 0, left)), budget_nz[o].eq(left > 0)]
            # Counts reach the credit view two cycles after `counted`/`skipped` (room, then the
            # test's ranges). A long packet is never uncounted beside short ones, so a count
            # while none are uncounted is its own.
            m.d.sync += [seen[o][0].eq(self.counted[o] + self.skipped[o]),
                         seen[o][1].eq(seen[o][0])]
            after = Signal(range(K + 2), name=f"uncounted_next{o}")
            m.d.comb += after.eq(uncounted[o] + small
                                 - Mux(none_uncounted[o], 0, seen[o][1]))
            m.d.sync += [uncounted[o].eq(after), none_uncounted[o].eq(after == 0),
                         few_uncounted[o].eq(after <= K - 2)]

        m.d.comb += self.in_flight.eq(
            pend_in
            | Cat((eligible | eligible_short)[k(i, 0, 0):k(i, P - 1, V - 1) + 1].any() for i in range(P))
            | Cat(Cat(grant[o][i] for o in range(P)).any() for i in range(P)))
        return m
