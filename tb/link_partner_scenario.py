"""The independent link partner's bring-up scenario (tb/link_partner.py against port A of
the link pair), shared by tb/test_link.py and its many-seed soak, tb/test_link_partner_soak.py."""
import random

from cocotb.triggers import RisingEdge

from models.packet import random_packet
from tb import runner
from tb.beats import CycleLoop, PacketSink
from tb.link_pair_tb import drop_counts, read_port
from tb.link_partner import LinkPartner, LinkState

__all__ = ["ACTIVE_AFTER", "partner_scenario", "assert_abr_zero_in_init", "assert_no_overflow"]


# docs/link.md: a good NORMAL or data packet's last beat on wire_in in cycle 0, `state`
# changes in cycle 4; the loop sees the beat it drove one cycle after it drove it and the
# state one cycle after the change.
ACTIVE_AFTER = 6


async def partner_scenario(dut, seed, cadences=None):
    """One seed of the independent partner's bring-up (the clock is running); with
    ``cadences``, those, both ends starting at once and no resets. Returns what woke A
    in ARMED."""
    params = runner.tb_params()
    width, num_vls = params["width"], params["num_vls"]
    rng = random.Random(seed)
    loop = CycleLoop(dut.clk)

    def cadence():
        return rng.choice([1, rng.randint(1, 64), rng.randint(1, 2000)])

    directed = cadences is not None
    if not directed:
        cadences = dict(init_cadence=cadence(), armed_cadence=cadence(),
                        active_cadence=cadence(), fc_on_entry=rng.random() < 0.5)
    partner = loop.add(LinkPartner(dut, "a_wire_out", "a_wire_in", width, num_vls,
                                   delay=params["wire_delay"], **cadences))
    sinks = [loop.add(PacketSink(dut, f"a_data_out__{v}", width)) for v in range(num_vls)]
    for v in range(num_vls):
        getattr(dut, f"a_vl_weight__{v}").value = 16
        getattr(dut, f"a_data_in__{v}__valid").value = 0
        getattr(dut, f"b_data_in__{v}__valid").value = 0
        getattr(dut, f"b_data_out__{v}__ready").value = 0
    dut.b_wire_in__valid.value = 0
    dut.b_reset.value = 1                       # B sits out: the partner is A's peer
    for v in range(num_vls):
        for _ in range(12):
            partner.send(v, random_packet(rng, payload_len=rng.randrange(0, 4097), vl=v))

    # Either end may start late and may be reset while the link comes up, before any data
    # moves (a reset once data flows loses what is in flight by design: docs/link.md). A
    # reset of A only while the partner has heard nothing yet: a NORMAL packet A sent just
    # before its reset, still on the wire, would otherwise bring the partner up into a
    # port that has forgotten it.
    a_start, partner_start = rng.randrange(0, 2000), rng.randrange(0, 2000)
    a_resets = sorted(rng.randrange(a_start, a_start + 3000) for _ in range(rng.randrange(3)))
    partner_resets = sorted(rng.randrange(partner_start, partner_start + 3000)
                            for _ in range(rng.randrange(3)))
    if directed:
        a_start, partner_start, a_resets, partner_resets = 0, 0, [], []
    dut.a_reset.value = 1
    dut.rst.value = 1
    for _ in range(4):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    events = []

    a_states = []               # (cycle, state) of A, for the failure message
    woken = []                  # (cycle, what): a good NORMAL or data packet reached A in ARMED
    wake_delays = []            # (cycles, what) from that to A ACTIVE
    woke = []

    def step(cycle):
        state = read_port(dut, "state", "a")
        if not a_states or a_states[-1][1] != state:
            a_states.append((cycle, state))
        assert_abr_zero_in_init(dut, cycle, num_vls)
        # What the partner drove in the cycle before is on A's wire now.
        while partner.driven and partner.driven[0][0] < cycle:
            _, what = partner.driven.pop(0)
            if what != "INIT" and state == LinkState.ARMED and not woken:
                woken.append((cycle, what))
        if woken and state == LinkState.ARMED and a_states[-1][0] <= woken[0][0]:
            assert cycle - woken[0][0] < ACTIVE_AFTER, \
                f"cycle {cycle}: A still ARMED {cycle - woken[0][0]} cycles after a {woken[0][1]}"
        if state != LinkState.ARMED:
            if woken and state == LinkState.ACTIVE:
                wake_delays.append((cycle - woken[0][0], woken[0][1]))
                woke.append(woken[0][1])
            woken.clear()
        nothing_sent = not any(partner.sent.values())
        reset_a = (bool(a_resets) and cycle >= a_resets[0] and nothing_sent
                   and partner.state == LinkState.INIT and not partner.heard_init)
        dut.a_reset.value = int(cycle < a_start or reset_a)
        if a_resets and cycle >= a_resets[0]:
            events.append((a_resets.pop(0), "A reset" if reset_a else "A reset skipped"))
        partner.running = cycle >= partner_start
        if partner_resets and cycle >= partner_resets[0]:
            partner_resets.pop(0)
            if nothing_sent:
                partner.reset(cycle)
                events.append((cycle, "partner reset"))

    loop.checks.append(step)
    loop.checks.append(lambda cycle: assert_no_overflow(dut, cycle))

    def delivered(v):
        return [p for p, bad, *_ in sinks[v].packets if not bad]

    def done():
        return partner.idle() and all(len(sinks[v].packets) >= len(partner.sent[v])
                                      for v in range(num_vls))

    try:
        await loop.run(until=done, limit=100000)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}: partner {partner.state.name}, A state "
                             f"{read_port(dut, 'state', 'a')}, drops "
                             f"{ {k: n for k, n in drop_counts(dut, 'a').items() if n} }, "
                             f"events {events}, cadences {cadences}, starts A {a_start} partner "
                             f"{partner_start}, A states {a_states[-12:]}, partner states "
                             f"{[(c, int(st)) for c, st in partner.state_log[-12:]]}, credits "
                             + "; ".join(f"vl{v}: partner FCTBS {partner.fctbs[v]} limit "
                                         f"{partner.limit[v]} queued {len(partner.queue[v])} sent "
                                         f"{len(partner.sent[v])}, A ABR {read_port(dut, 'abr', 'a', v)}"
                                         f" FCCL {read_port(dut, 'fccl', 'a', v)} used "
                                         f"{read_port(dut, 'used_blocks', 'a', v)} delivered "
                                         f"{len(sinks[v].packets)}" for v in range(num_vls))) from None
    active_at = next(c for c, state in reversed(partner.state_log) if state == LinkState.ACTIVE)
    a_active_at = next(c for c, state in reversed(a_states) if state == LinkState.ACTIVE)
    dut._log.info(f"seed {seed}: cadences {cadences}, starts A {a_start} partner {partner_start}, "
                  f"events {events}, partner ACTIVE at {active_at}, A ACTIVE at {a_active_at} "
                  f"(woken by {wake_delays}), "
                  f"{sum(len(p) for p in partner.sent.values())} packets")
    assert not partner.cut
    assert read_port(dut, "state", "a") == LinkState.ACTIVE
    drops = {k: n for k, n in drop_counts(dut, "a").items() if n}
    assert not drops, f"A dropped packets the partner sent legally: {drops}"
    for v in range(num_vls):
        assert not sinks[v].errors, sinks[v].errors
        assert delivered(v) == partner.sent[v], f"vl{v}: delivered packets differ from those sent"
        assert read_port(dut, "packets_received", "a", v) == len(partner.sent[v]), \
            f"vl{v}: A counted {read_port(dut, 'packets_received', 'a', v)} packets received"
    # Credits home: the partner's next flow-control packet sets ABR to its FCTBS.
    await loop.run(cycles=cadences["active_cadence"] + 4 * params["wire_delay"] + 16)
    for v in range(num_vls):
        assert read_port(dut, "used_blocks", "a", v) == 0, f"A vl{v} still holds blocks"
        assert read_port(dut, "abr", "a", v) == partner.fctbs[v], \
            f"A vl{v}: ABR {read_port(dut, 'abr', 'a', v)} != partner FCTBS {partner.fctbs[v]}"
    return woke[-1] if woke else None



def assert_abr_zero_in_init(dut, cycle, num_vls):
    """docs/link.md: ABR is 0 throughout INIT, so data taken there is never advertised twice."""
    if read_port(dut, "state", "a") == LinkState.INIT:
        for v in range(num_vls):
            assert read_port(dut, "abr", "a", v) == 0, f"cycle {cycle}: A in INIT with ABR{v} != 0"


def assert_no_overflow(dut, cycle):
    assert not int(dut.a_overflow.value), f"cycle {cycle}: A's receive buffer overflowed"
