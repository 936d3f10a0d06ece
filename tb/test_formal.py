"""Formal proofs of the lossless rules (docs/formal.md): each proved by k-induction, each with
a reachable cover, and each shown to fail on a planted one-line bug."""
import functools

import pytest

from tb.formal import sby
from tb.formal.link_receiver_credit import LinkReceiverCreditHarness
from tb.formal.link_transmitter_credit import LinkTransmitterCreditHarness

TRANSMITTER = "hdl.link.link_transmitter"

# name -> (harness, k); every entry is proved in make test (each takes seconds).
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


# Bounded depth at which every planted bug shows a counterexample (a start flag inside a
# packet needs 7 cycles: a packet, the flagged beat, two cycles to the wire).
BUG_DEPTH = 10


def proof(name, harness=None, depth=None):
    make, k = PROOFS[name]
    return sby.Proof(name, harness or make, depth=depth or k, cover_depth=COVER_DEPTH.get(name, 10),
                     bounded=name in BOUNDED)


@pytest.mark.parametrize("name", PROOFS)
def test_proved(tmp_path, name):
    status, seconds, log = sby.run(proof(name), tmp_path, "prove")
    assert status == "PASS", f"{name}: {status} after {seconds:.0f} s\n{log[-4000:]}"


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full)
                                  if name in FORMAL_ONLY_COVERS else name for name in PROOFS])
def test_covered(tmp_path, name):
    status, seconds, log = sby.run(proof(name), tmp_path, "cover")
    assert status == "PASS", f"{name}: a cover was not reached ({status})\n{log[-4000:]}"


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught(tmp_path, bug):
    name, module, keyword, component, line, planted_line = PLANTED[bug]
    copy = sby.planted(module, line, planted_line)
    make, _ = PROOFS[name]
    harness = functools.partial(make, **{keyword: getattr(copy, component)})
    status, seconds, log = sby.run(proof(name, harness, BUG_DEPTH), tmp_path, "prove")
    assert status == "FAIL", f"{bug}: the proof of {name} did not fail ({status})"
