"""Formal proofs of the lossless rules (docs/formal.md): each proved by k-induction (or, where
marked bounded, checked for every input sequence of its depth from reset), each with a
reachable cover, and each shown to fail on a planted one-line bug."""
import dataclasses
import functools

import pytest

from tb.formal import sby
from tb.formal.link_receiver_credit import LinkReceiverCreditHarness
from tb.formal.link_transmitter_credit import LinkTransmitterCreditHarness
from tb.formal.responder_mkey_range import ResponderMkeyRangeHarness
from tb.formal.switch_allocator_credit import SwitchAllocatorCreditHarness
from tb.formal.voq_buffer_cells import VoqBufferCellsHarness

TRANSMITTER = "hdl.link.link_transmitter"
RECEIVER = "hdl.link.link_receiver"
ALLOCATOR = "hdl.switch.switch_allocator"
VOQ_BUFFER = "hdl.switch.voq_buffer"
RESPONDER = "hdl.nic.responder_engine"
BOUNDED = {"mode": "bmc"}       # every state reachable within the depth from reset, no induction

# name -> (harness, depth: k of the k-induction or the bound, sby.Proof's other options).
PROOFS = {
    "link_transmitter_credit_w8": (functools.partial(LinkTransmitterCreditHarness, width=8,
                                                     mtu=256), 6, {}),
    "link_transmitter_credit_w64": (functools.partial(LinkTransmitterCreditHarness, width=64,
                                                      mtu=4096), 6, {}),
    # LinkReceiver and its peer, with invariants over its buffers' contents (k = 2 does
    # not close: the check register's facts are free in its first cycle); its buffer fills
    # and drains in 11 cycles.
    "link_receiver_credit_w64": (functools.partial(LinkReceiverCreditHarness, width=64,
                                                   mtu=256), 3, {"cover_depth": 12}),
    # The switch's egress credit check: SwitchAllocator, 2 and 3 ports, 2 VLs, packets of up
    # to 3 blocks, short ones of 1 block with 3 uncounted beside (a reserve of 3 blocks) and
    # of up to 2 blocks (6 blocks).
    "switch_allocator_credit_2p": (functools.partial(SwitchAllocatorCreditHarness, ports=2,
                                                     num_vls=2, max_blocks=3, short_blocks=1,
                                                     short_matches=3), 6, {}),
    "switch_allocator_credit_3p": (functools.partial(SwitchAllocatorCreditHarness, ports=3,
                                                     num_vls=2, max_blocks=3, short_blocks=2,
                                                     short_matches=3), 6, {}),
    # The VOQ buffer's cell accounting: 2 ports, 2 VLs, 2 cells per VL (8 cells), packets of
    # up to 4 beats; bounded, memories mapped to registers. Without the invariants meant for
    # its induction (not yet closed) to 8 and 9 cycles, with them to 5.
    "voq_buffer_cells_bmc8": (functools.partial(VoqBufferCellsHarness, ports=2, num_vls=2,
                                                share=2, max_beats=4, induction=False), 8,
                              {**BOUNDED, "script": ("memory_map", "opt -fast")}),
    "voq_buffer_cells_bmc9": (functools.partial(VoqBufferCellsHarness, ports=2, num_vls=2,
                                                share=2, max_beats=4, induction=False), 9,
                              {**BOUNDED, "script": ("memory_map", "opt -fast")}),
    "voq_buffer_cells_invariants_bmc5": (functools.partial(VoqBufferCellsHarness, ports=2,
                                                           num_vls=2, share=2, max_beats=4), 5,
                                         {**BOUNDED, "script": ("memory_map", "opt -fast")}),
    # The NIC responder: a WRITE never leaves its memory key's range. FIRST/ONLY by
    # induction (k = 9 does not close); MIDDLE/LAST bounded (a FIRST and a LAST fit in 10
    # cycles).
    "responder_mkey_range": (ResponderMkeyRangeHarness, 10, {}),
    "responder_mkey_range_continuation": (
        functools.partial(ResponderMkeyRangeHarness, continuation=True), 10, BOUNDED),
}
# What takes minutes runs in make formal and make test-full only (pytest mark "full").
SLOW_PROOFS = {"link_receiver_credit_w64", "voq_buffer_cells_bmc9",
               "voq_buffer_cells_invariants_bmc5", "responder_mkey_range",
               "responder_mkey_range_continuation", "switch_allocator_credit_3p"}
# One cover per harness: voq_buffer_cells_bmc8's stands for the other two VoqBuffer checks.
COVERS = [name for name in PROOFS
          if name not in ("voq_buffer_cells_bmc9", "voq_buffer_cells_invariants_bmc5")]
SLOW_COVERS = {"link_receiver_credit_w64"}

# name -> (proof it breaks, module, the harness keyword that takes the component, the
# component's class in the module, the line as it is, the line with the bug)
PLANTED = {
    # A head one block larger than the room passes the credit test.
    "credit_one_block_short": ("link_transmitter_credit_w8", TRANSMITTER, "transmitter", "LinkTransmitter",
        "credit_ok[v].eq(Cat(view_sel[v][k] & (over[v][k] ^ _less_than(blocks_less1[v][:bits], lim[v][k]))",
        "credit_ok[v].eq(Cat(view_sel[v][k] & (over[v][k] ^ _less_than(blocks_less1[v][:bits], lim[v][k] + 1))"),
    # FCTBS counts a packet one block short.
    "fctbs_one_block_short": ("link_transmitter_credit_w8", TRANSMITTER, "transmitter", "LinkTransmitter",
        "m.d.sync += [register.eq(_sum(counts[k + 1], blocks_less1[v], 0))",
        "m.d.sync += [register.eq(_sum(counts[k], blocks_less1[v], 0))"),
    # A start flag inside a packet goes on the wire as a new, uncounted packet.
    "start_flag_inside_a_packet": ("link_transmitter_credit_w8", TRANSMITTER, "transmitter", "LinkTransmitter",
        'fields["start"].eq(beat.start & ~busy), fields["end"].eq(last),',
        'fields["start"].eq(beat.start), fields["end"].eq(last),'),
    # FCCL advertises one block more than ABR + free blocks.
    "fccl_one_block_too_many": ("link_receiver_credit_w64", RECEIVER, "receiver", "LinkReceiver",
        "m.d.sync += self.fccl[v].eq(abr + self.buffer_blocks - used)",
        "m.d.sync += self.fccl[v].eq(abr + self.buffer_blocks + 1 - used)"),
    # A packet leaving the buffer returns one block short.
    "release_one_block_short": ("link_receiver_credit_w64", RECEIVER, "receiver", "LinkReceiver",
        "m.d.sync += used.eq(used - freed_blocks[v])",
        "m.d.sync += used.eq(used - freed_blocks[v] + 1)"),
    # A packet cut short adds a block less to ABR and used than its release gives back.
    "cut_short_one_block_short": ("link_receiver_credit_w64", RECEIVER, "receiver", "LinkReceiver",
        "return Mux(terminate, base + f.close_blocks, base + f.blocks)",
        "return Mux(terminate, base + f.close_blocks - 1, base + f.blocks)"),
    # An overlong packet's data end is not remembered as stored: its end beat closes it a
    # second time.
    "overlong_packet_ends_twice": ("link_receiver_credit_w64", RECEIVER, "receiver",
        "LinkReceiver",
        "m.d.sync += [stored_any.eq(1), end_stored.eq(f.data_end | w.end)]",
        "m.d.sync += [stored_any.eq(1), end_stored.eq(w.end)]"),
    # A head one block larger than the registered bound passes stage E's credit test.
    "allocator_credit_one_block_short": ("switch_allocator_credit_2p", ALLOCATOR, "allocator",
        "SwitchAllocator",
        "within.eq(blocks[:B] <= bound[o][v]),",
        "within.eq(blocks[:B] <= bound[o][v] + 1),"),
    # The output rejoins allocation one cycle before its credit view has seen the count.
    "allocator_hold_ends_a_cycle_early": ("switch_allocator_credit_2p", ALLOCATOR, "allocator",
        "SwitchAllocator",
        "credit_busy.eq(matched_out & ~matched_short | hold_valid | hold_after[0] | hold_after[1]),",
        "credit_busy.eq(matched_out & ~matched_short | hold_valid | hold_after[0]),"),
    # The short-packet reserve one short packet too small: K - 1 uncounted beside, not K.
    "allocator_reserve_one_packet_short": ("switch_allocator_credit_3p", ALLOCATOR, "allocator",
        "SwitchAllocator",
        "m.d.comb += reserved.eq(room - K * S)",
        "m.d.comb += reserved.eq(room - (K - 1) * S)"),
    # A count reaches the uncounted short matches a cycle before the credit view has it.
    "allocator_short_count_a_cycle_early": ("switch_allocator_credit_2p", ALLOCATOR, "allocator",
        "SwitchAllocator",
        "- Mux(none_uncounted[o], 0, seen[o][1]))",
        "- Mux(none_uncounted[o], 0, seen[o][0]))"),
    # A packet skipped unsent (known bad, or dropped) does not give its cells back.
    "voq_discard_keeps_its_cells": ("voq_buffer_cells_bmc8", VOQ_BUFFER, "buffer", "VoqBuffer",
        'm.d.comb += [free_cells["given"].eq(shown_cell), free_cells["give"].eq(consume)]',
        'm.d.comb += [free_cells["given"].eq(shown_cell), free_cells["give"].eq(consume & ~skip)]'),
    # The free lists hand out their head without removing it: the next take gets it again.
    "voq_free_cell_handed_out_twice": ("voq_buffer_cells_bmc8", VOQ_BUFFER, "buffer",
        "VoqBuffer",
        'm.d.comb += [queue.r_en.eq(1), signals["ran_out"].eq(~queue.r_rdy)]',
        'm.d.comb += [queue.r_en.eq(0), signals["ran_out"].eq(~queue.r_rdy)]'),
    # A packet gives its verdict entry back when it is granted, not when it finishes: a
    # start may take it while the packet is still read.
    "voq_verdict_entry_freed_at_grant": ("voq_buffer_cells_bmc8", VOQ_BUFFER, "buffer",
        "VoqBuffer",
        'm.d.comb += [free_entries["given"].eq(rd_entry), free_entries["give"].eq(self.finishing)]',
        'm.d.comb += [free_entries["given"].eq(granted.entry), free_entries["give"].eq(self.grant_valid)]'),
    # A start does not take its verdict entry from the free list: every packet gets entry 0.
    "voq_verdict_entry_not_taken": ("voq_buffer_cells_bmc8", VOQ_BUFFER, "buffer", "VoqBuffer",
        'm.d.comb += free_entries["take"].eq(starting)',
        'm.d.comb += free_entries["take"].eq(0)'),
    # A range one byte past the key's end passes the range compare.
    "key_end_one_byte_over": ("responder_mkey_range", RESPONDER, "engine", "ResponderEngine",
        "not_end = ~Cat(end, C(0, 1))",
        "not_end = ~Cat((end - 1)[:65], C(0, 1))"),
    # The request's end loses its carry into bit 64: a range ending at 2^64 reads as ending at 0.
    "end_carry_dropped": ("responder_mkey_range", RESPONDER, "engine", "ResponderEngine",
        "m.d.sync += [end.eq(end_now), wraps.eq(end_now[64] & (end_now[:64] != 0))]",
        "m.d.sync += [end.eq(end_now[:64]), wraps.eq(end_now[64] & (end_now[:64] != 0))]"),
    # A range wrapping 2^64 passes when the key's own limit lies past 2^64.
    "wrap_check_removed": ("responder_mkey_range", RESPONDER, "engine", "ResponderEngine",
        "& (d.va >= mk.base) & in_limit & ~wraps)",
        "& (d.va >= mk.base) & in_limit)"),
    # A range starting a byte below the key's base passes.
    "base_one_byte_under": ("responder_mkey_range", RESPONDER, "engine", "ResponderEngine",
        "& (d.va >= mk.base) & in_limit & ~wraps)",
        "& (d.va + 1 >= mk.base) & in_limit & ~wraps)"),
    # MIDDLE/LAST packets are not checked against the room their FIRST left.
    "room_unchecked_after_first": ("responder_mkey_range_continuation", RESPONDER, "engine",
        "ResponderEngine",
        "write_len_err = is_write & (pl_gt_room | (last & ~pl_eq_room))",
        "write_len_err = is_write & first & (pl_gt_room | (last & ~pl_eq_room))"),
}
# make test keeps the quickest planted bug of each proof (each a few seconds); the others,
# 7 to 24 s each (95 s of make test on 2026-12-07), run in make formal and make test-full.
SLOW_BUGS = {"room_unchecked_after_first", "release_one_block_short", "cut_short_one_block_short",
             "overlong_packet_ends_twice", "allocator_reserve_one_packet_short",
             "voq_free_cell_handed_out_twice", "voq_verdict_entry_freed_at_grant",
             "voq_verdict_entry_not_taken",
             "key_end_one_byte_over", "end_carry_dropped",
             "wrap_check_removed"}

# Bounded depth at which every planted bug shows a counterexample (a start flag inside a
# packet needs 7 cycles: a packet, the flagged beat, two cycles to the wire).
BUG_DEPTH = 10


def proof(name, harness=None, depth=None):
    make, k, options = PROOFS[name]
    return sby.Proof(name, harness or make, depth=depth or k, **{"cover_depth": 10, **options})


def _marked(names, slow):
    return [pytest.param(name, marks=pytest.mark.full) if name in slow else name
            for name in names]


@pytest.mark.parametrize("name", _marked(PROOFS, SLOW_PROOFS))
def test_proved(tmp_path, name):
    status, seconds, log = sby.run(proof(name), tmp_path, "prove")
    assert status == "PASS", f"{name}: {status} after {seconds:.0f} s\n{log[-4000:]}"


@pytest.mark.parametrize("name", _marked(COVERS, SLOW_COVERS))
def test_covered(tmp_path, name):
    status, seconds, log = sby.run(proof(name), tmp_path, "cover")
    assert status == "PASS", f"{name}: a cover was not reached ({status})\n{log[-4000:]}"


@pytest.mark.parametrize("bug", _marked(PLANTED, SLOW_BUGS))
def test_planted_bug_is_caught(tmp_path, bug):
    name, module, keyword, component, line, planted_line = PLANTED[bug]
    copy = sby.planted(module, line, planted_line)
    harness = functools.partial(PROOFS[name][0], **{keyword: getattr(copy, component)})
    # A counterexample from reset within BUG_DEPTH cycles (what fails a proof's base case),
    # without the induction step beside it.
    planted_proof = dataclasses.replace(proof(name, harness, BUG_DEPTH), **BOUNDED)
    status, seconds, log = sby.run(planted_proof, tmp_path, "prove")
    assert status == "FAIL", f"{bug}: the proof of {name} did not fail ({status})"
