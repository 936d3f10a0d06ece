"""Formal proofs of the lossless rules (docs/formal.md): each proved by k-induction, each with
a reachable cover, and each shown to fail on a planted one-line bug."""
import functools

import pytest

from tb.formal import sby
from tb.formal.link_receiver_credit import LinkReceiverCreditHarness
from tb.formal.link_transmitter_credit import LinkTransmitterCreditHarness
from tb.formal.responder_mkey_range import ResponderMkeyRangeHarness

TRANSMITTER = "hdl.link.link_transmitter"

# name -> (harness, k); proved in make test, except those in SLOW (below).
PROOFS = {
    "link_transmitter_credit_w8": (functools.partial(LinkTransmitterCreditHarness, width=8,
                                                     mtu=256), 6),
    "link_transmitter_credit_w64": (functools.partial(LinkTransmitterCreditHarness, width=64,
                                                      mtu=4096), 6),
}

# LinkReceiver and its peer: checked for the first k cycles from reset (bmc), not by
# induction (docs/formal.md says why).
RECEIVER_PROOFS = {
    "link_receiver_credit_w64": (functools.partial(LinkReceiverCreditHarness, width=64,
                                                   mtu=256), 8),
}
PROOFS.update(RECEIVER_PROOFS)
BOUNDED = set(RECEIVER_PROOFS)
# Cover depths other than 10: the receiver's buffer fills and drains in 11 cycles.
COVER_DEPTH = {"link_receiver_credit_w64": 12}
# Covers that take over a minute: make formal (and make test-full) only.
FORMAL_ONLY_COVERS = {"link_receiver_credit_w64"}

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
}

RECEIVER = "hdl.link.link_receiver"
PLANTED.update({
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
})


# --- NIC responder: a WRITE never leaves its memory key's range (responder_mkey_range.py) ---
RESPONDER = "hdl.nic.responder_engine"
PROOFS["responder_mkey_range"] = (ResponderMkeyRangeHarness, 10)   # k = 9 does not close
# MIDDLE/LAST packets: bounded, from reset (a FIRST and a LAST fit in 10 cycles).
PROOFS["responder_mkey_range_continuation"] = (
    functools.partial(ResponderMkeyRangeHarness, continuation=True), 10)
BOUNDED.add("responder_mkey_range_continuation")
# Proofs that take minutes: make formal and make test-full only (docs/formal.md).
SLOW = {"responder_mkey_range", "responder_mkey_range_continuation"}
PLANTED.update({
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
})
SLOW_BUGS = {"room_unchecked_after_first"}   # minutes: make formal and make test-full


def _marked(names, slow):
    return [pytest.param(n, marks=pytest.mark.full) if n in slow else n for n in names]


# Bounded depth at which every planted bug shows a counterexample (a start flag inside a
# packet needs 7 cycles: a packet, the flagged beat, two cycles to the wire).
BUG_DEPTH = 10


def proof(name, harness=None, depth=None):
    make, k = PROOFS[name]
    return sby.Proof(name, harness or make, depth=depth or k, cover_depth=COVER_DEPTH.get(name, 10),
                     bounded=name in BOUNDED)


@pytest.mark.parametrize("name", _marked(PROOFS, SLOW))
def test_proved(tmp_path, name):
    status, seconds, log = sby.run(proof(name), tmp_path, "prove")
    assert status == "PASS", f"{name}: {status} after {seconds:.0f} s\n{log[-4000:]}"


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full)
                                  if name in FORMAL_ONLY_COVERS else name for name in PROOFS])
def test_covered(tmp_path, name):
    status, seconds, log = sby.run(proof(name), tmp_path, "cover")
    assert status == "PASS", f"{name}: a cover was not reached ({status})\n{log[-4000:]}"


@pytest.mark.parametrize("bug", _marked(PLANTED, SLOW_BUGS))
def test_planted_bug_is_caught(tmp_path, bug):
    name, module, keyword, component, line, planted_line = PLANTED[bug]
    copy = sby.planted(module, line, planted_line)
    make, _ = PROOFS[name]
    harness = functools.partial(make, **{keyword: getattr(copy, component)})
    status, seconds, log = sby.run(proof(name, harness, BUG_DEPTH), tmp_path, "prove")
    assert status == "FAIL", f"{bug}: the proof of {name} did not fail ({status})"
