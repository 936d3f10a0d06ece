"""Lossless credit link: two LinkPorts, A and B, over a testbench-carried cable.

Every test ends with nothing left undelivered and every VL's credits back at
their initial value: B's buffers empty, and A's view of B's free space
(FCCL - FCTBS) equal to B's whole buffer.
"""
import json
import os
import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from models.packet import random_packet
from tb import runner
from tb.beats import CycleLoop, PacketSink, WireChannel
from tb.link_pair_tb import CLOCK_NS, PARAM_SETS, TB, drop_counts, factory, read_port
from tb.link_partner import LinkPartner, LinkState
from tb.link_partner_scenario import assert_abr_zero_in_init, assert_no_overflow, partner_scenario



@cocotb.test()
@cocotb.parametrize(idle=[0.0, 0.3], backpressure=[0.0, 0.5])
async def random_traffic_both_ways(dut, idle, backpressure):
    """Random sizes on every VL in both directions: each packet delivered once, intact, in order."""
    tb = TB(dut, idle=idle, backpressure=backpressure, rng=random.Random(11))
    await tb.bring_up()
    tb.random_traffic(120, sizes=(0, 1500))
    await tb.drain()
    tb.check_delivery()
    tb.check_credits()
    assert sum(drop_counts(tb.dut, "a").values()) + sum(drop_counts(tb.dut, "b").values()) == 0


@cocotb.test()
async def every_size_and_alignment(dut):
    """Every payload size from 0 to past two beats, then a sample up to the MTU."""
    tb = TB(dut, rng=random.Random(12))
    await tb.bring_up()
    sizes = list(range(0, 3 * tb.width + 8, 4)) + [tb.rng.randrange(0, 4097) for _ in range(20)] + [4096]
    for size in sizes:
        vl = tb.rng.randrange(tb.num_vls)
        tb.send("a", vl, random_packet(tb.rng, payload_len=size, vl=vl))
    await tb.drain()
    tb.check_delivery()
    tb.check_credits()


@cocotb.test()
async def vl_weights_share_the_wire(dut):
    """Both VLs backlogged with weights 16 and 48 blocks per turn: the order of packets on the
    wire is exactly the weighted round robin of models/link.py's VlArbiter."""
    from models.ib import Opcode
    from models.link import VlArbiter
    from models.packet import blocks
    tb = TB(dut, rng=random.Random(21))
    weights = [16, 48]
    for v, weight in enumerate(weights):
        getattr(dut, f"a_vl_weight__{v}").value = weight
    await tb.bring_up()
    packets = 30
    for v in range(tb.num_vls):
        for _ in range(packets):
            tb.send("a", v, random_packet(tb.rng, payload_len=256, vl=v, opcode=Opcode.SEND_ONLY))
    await tb.drain()
    tb.check_delivery()
    assert all(tb.port("credit_stall_cycles", "a", v) == 0 for v in range(tb.num_vls)), \
        "credit stalls changed eligibility; the comparison needs a larger buffer"
    on_wire = [packet[0] >> 4 for packet, _, _ in tb.monitor.data_packets]
    arbiter = VlArbiter(weights)
    left = [packets] * tb.num_vls
    expected = []
    while all(left):
        vl = arbiter.pick([n > 0 for n in left])
        arbiter.commit(vl, blocks(len(tb.sent["a", vl][0]) + 2))
        expected.append(vl)
        left[vl] -= 1
    assert on_wire[:len(expected)] == expected, f"wire {on_wire[:len(expected)]} != model {expected}"
    share = expected.count(1) / len(expected)
    assert 0.6 < share < 0.8, f"VL1 got {share:.2f} of the packets with 3x the weight"


@cocotb.test()
async def sink_stalls_hard(dut):
    """The consumer behind B stalls 90% of cycles: credits hold A back, nothing overflows or drops."""
    tb = TB(dut, backpressure=0.9, rng=random.Random(13))
    await tb.bring_up()
    tb.random_traffic(60, sizes=(0, 4096), sides=("a",))
    await tb.drain(limit=400000)
    tb.check_delivery()
    tb.check_credits()
    stalls = sum(tb.port("credit_stall_cycles", "a", v) for v in range(tb.num_vls))
    assert stalls > 0, "a stalled consumer must show up as credit stalls at the sender"


@cocotb.test()
@cocotb.parametrize(rate=[0.1, 0.5])
async def flow_control_packets_lost_or_corrupted(dut, rate):
    """Flow-control packets dropped and corrupted at random: data keeps moving, credits heal exactly."""
    tb = TB(dut, fc_drop=rate / 2, fc_corrupt=rate / 2, rng=random.Random(14))
    await tb.bring_up(limit=100000)
    tb.random_traffic(100, sizes=(0, 2048))
    await tb.drain(limit=600000)
    # Lost flow-control packets are healed by the next one: give it a few periods.
    await tb.loop.run(cycles=4 * tb.params["fc_period"])
    tb.check_delivery()
    tb.check_credits()
    corrupted = sum(channel.fc_corrupted for channel in tb.channels.values())
    counted = tb.port("fc_bad_crc", "a") + tb.port("fc_bad_crc", "b")
    assert corrupted > 0 and counted == corrupted, f"{corrupted} corrupted, {counted} counted"


@cocotb.test()
async def bad_data_packets_dropped_and_counted(dut):
    """Bad VCRC, truncated, overlong, beyond the MTU, invalid VL, marked end-bad: each dropped
    (or, cut through already, delivered marked end-bad) and counted by reason; the rest intact."""
    plan = {}
    rng = random.Random(15)

    def mutate(header):
        kind = rng.choice(WireChannel.MUTATIONS) if rng.random() < 0.3 else None
        if kind:
            plan[kind] = plan.get(kind, 0) + 1
        return kind

    tb = TB(dut, mutate=mutate, rng=random.Random(16))
    await tb.bring_up()
    tb.random_traffic(150, sizes=(0, 1024), sides=("a",))
    await tb.drain()
    await tb.loop.run(cycles=2 * tb.params["fc_period"])
    tb.check_delivery()
    tb.check_credits()
    counts = drop_counts(tb.dut)
    assert set(plan) == set(WireChannel.MUTATIONS), f"plan did not cover every kind: {plan}"
    for kind, injected in plan.items():
        assert counts[kind] == injected, f"{kind}: injected {injected}, counted {counts[kind]}"
    assert counts["overflow"] == 0 and counts["link_down"] == 0 and counts["malformed"] == 0
    marked = sum(bad for side in ("b",) for v in range(tb.num_vls)
                 for _, bad, *_ in tb.sinks[side, v].packets)
    assert marked == tb.port("forwarded_bad", "b")
    assert marked + tb.port("discarded", "b") == sum(
        plan[k] for k in ("vcrc", "truncated", "overlong", "end_bad")), \
        "every stored bad packet is either discarded or delivered marked end-bad"


@cocotb.test()
async def stray_beats_dropped_and_counted(dut):
    """A beat without a start right after a packet's end, an end beat or not: dropped and
    counted as malformed; it reaches no buffer, no verdict and no credit count (ABR and used
    blocks stay exact), and every packet arrives intact."""
    rng = random.Random(22)
    tb = TB(dut, mutate=lambda header: WireChannel.STRAY if rng.random() < 0.3 else None,
            rng=random.Random(23))
    await tb.bring_up()
    tb.random_traffic(80, sizes=(0, 1024), sides=("a",))
    await tb.drain()
    await tb.loop.run(cycles=2 * tb.params["fc_period"])
    tb.check_delivery()
    tb.check_credits()
    strays = tb.channels["a", "b"].strays
    counts = drop_counts(tb.dut)
    assert strays > 0 and counts["malformed"] == strays, f"{strays} stray beats, counts {counts}"
    assert sum(counts.values()) == strays


@cocotb.test()
async def sender_breaking_the_credit_protocol(dut):
    """A cable that delivers packets twice (the copies never covered by credit) into a stalled
    consumer: the overflow flag rises, the excess is dropped and counted, nothing stored is
    overwritten (whatever arrives is a packet that was sent, intact, in order), and the credits
    heal once the flow-control packets resynchronise ABR."""
    rng = random.Random(19)
    stalled = [True]

    def stall():
        while True:
            yield stalled[0]

    tb = TB(dut, mutate=lambda header: WireChannel.DUPLICATE if rng.random() < 0.5 else None,
            rng=random.Random(20))
    tb.loop.checks.remove(tb.check_overflow)
    for v in range(tb.num_vls):
        tb.sinks["b", v].backpressure = stall()
    await tb.bring_up()
    tb.random_traffic(40, sizes=(256, 2048), sides=("a",))
    await tb.loop.run(until=lambda: int(dut.b_overflow.value), limit=100000)
    stalled[0] = False
    await tb.loop.run(until=tb.all_sent, limit=200000)
    await tb.loop.run(cycles=4 * tb.params["fc_period"])
    assert tb.port("drop_overflow", "b") > 0
    assert tb.channels["a", "b"].duplicated
    for v in range(tb.num_vls):
        index = {packet: i for i, packet in enumerate(tb.sent["a", v])}
        positions = [index.get(packet) for packet in tb.delivered("a", v)]
        assert None not in positions, f"vl{v}: a delivered packet was damaged"
        assert positions == sorted(positions), f"vl{v}: packets reordered"
    tb.check_credits()


@cocotb.test()
async def reset_one_end_mid_traffic(dut):
    """B is reset in the middle of traffic: the link re-initialises its credits and resumes."""
    tb = TB(dut, rng=random.Random(17))
    await tb.bring_up()
    tb.random_traffic(80, sizes=(0, 2048))
    await tb.loop.run(cycles=3000)
    dut.b_reset.value = 1
    # B's counters restart with it; so does the count its credit monitor is checked against.
    tb.credit_monitors["b"].packets = [0] * tb.num_vls
    await tb.loop.run(cycles=5)
    dut.b_reset.value = 0
    await tb.wait_active(limit=50000)
    assert tb.port("link_inits", "a") == 1, "A must see B's INIT and re-initialise once"
    recovered_at = tb.loop.cycle
    tb.random_traffic(60, sizes=(0, 2048))
    await tb.loop.run(until=tb.all_sent, limit=400000)
    await tb.loop.run(cycles=20000)
    tb.check_delivery(exact=False)
    # Everything that entered a transmitter after the link came back arrived.
    for (side, vl), source in tb.sources.items():
        late = [tb.sent[side, vl][tag] for tag, cycle in source.start_cycles if cycle > recovered_at]
        delivered = tb.delivered(side, vl)
        assert late, f"{side}->vl{vl}: no traffic after the reset"
        assert all(packet in delivered for packet in late), f"{side}->vl{vl}: lost after recovery"
    tb.check_credits()


@cocotb.test()
@cocotb.parametrize(cut=[("a", "b"), ("a",)])
async def cable_cut_and_restored(dut, cut):
    """The cable is cut under long packets (in the middle of one, as a rule), in both
    directions or from A to B only, and restored once the ports gave up on it: a packet
    caught midway is closed after ``stall_timeout`` cycles without a beat, a port that hears
    no flow-control packet leaves ACTIVE after ``fail_timeout`` cycles of silence outside
    packets, the link comes back by itself, every packet is delivered intact and in order
    but those that lost a beat on the cut cable, and the credits come home exactly
    (docs/link.md)."""
    tb = TB(dut, rng=random.Random(31 + len(cut)))
    await tb.bring_up()
    fail_timeout = 8 * tb.params["fc_period"]
    stall_timeout = 4 * tb.params["fc_period"]
    tb.random_traffic(60, sizes=(1024, 4096))
    await tb.loop.run(cycles=tb.rng.randrange(300, 900))
    cut_at = tb.loop.cycle
    for side in cut:
        tb.channels[side, tb.other(side)].cut = True
    active = LinkState.ACTIVE.value
    deaf = [tb.other(side) for side in cut]        # the ends that hear nothing any more
    left = {}
    await tb.loop.run(until=lambda: left.update(
        {s: tb.loop.cycle for s in ("a", "b") if s not in left and tb.port("state", s) != active})
        or len(left) == 2, limit=2 * fail_timeout)
    for side in deaf:
        detect = left[side] - cut_at
        dut._log.info(f"cut {cut}: {side} left ACTIVE {detect} cycles after the cut")
        # Its last flow-control packet came at most a period and a packet before the cut; a
        # packet the cut caught midway is closed after stall_timeout without a beat (the last
        # one still on the cable at the cut), and the silence counts outside packets only.
        assert fail_timeout - 2 * tb.params["fc_period"] <= detect \
            <= stall_timeout + fail_timeout + tb.params["wire_delay"] + 8, detect
    await tb.loop.run(cycles=2 * fail_timeout)
    assert tb.port("state", "a") != active or tb.port("state", "b") != active, \
        "the link came up over a cut cable"
    # A packet the cut caught midway was closed when its receiver's port left ACTIVE, not
    # when the cable came back: counted as truncated, no consumer waits for its tail.
    for side in cut:
        far = tb.other(side)
        midway = tb.channels[side, far].cut_midway
        assert drop_counts(dut, far)["truncated"] == midway, (drop_counts(dut, far), midway)
        assert not any(tb.sinks[far, v].in_packet for v in range(tb.num_vls))
    restored_at = tb.loop.cycle
    for side in cut:
        tb.channels[side, tb.other(side)].cut = False
    await tb.wait_active(limit=20 * tb.params["fc_period"])
    dut._log.info(f"cut {cut}: both ends ACTIVE {tb.loop.cycle - restored_at} cycles after "
                  f"the cable came back")
    assert tb.port("link_inits", "a") >= 1 and tb.port("link_inits", "b") >= 1
    lost = [kind for channel in tb.channels.values() for kind, _ in channel.mutated]
    assert lost and set(lost) == {WireChannel.CUT}, lost
    assert sum(channel.cut_midway for channel in tb.channels.values()) >= 1, "no packet cut midway"
    await tb.drain(limit=400000)
    tb.check_delivery()
    tb.check_credits()


@cocotb.test()
async def bring_up_cycles(dut):
    """Reset released on both ends to both ACTIVE, with the cadence of docs/link.md: the
    INIT repeats (INIT_REPEATS per VL, one per VL every fc_min_interval cycles) and a few
    round trips; logged as the figure docs/link.md quotes."""
    tb = TB(dut, rng=random.Random(21))
    await tb.bring_up()
    params = tb.params
    # Hearing the first INIT takes at most an interval and a trip, then the repeats (the
    # first may go at once), then NORMAL packets at once on each side.
    bound = (8 + 1) * params["fc_min_interval"] + 8 * params["wire_delay"] + 64
    dut._log.info(f"bring-up: both ends ACTIVE {tb.loop.cycle} cycles after reset "
                  f"(fc_min_interval {params['fc_min_interval']}, wire delay {params['wire_delay']})")
    assert tb.loop.cycle <= bound, f"bring-up took {tb.loop.cycle} cycles, more than {bound}"


@cocotb.test()
@cocotb.parametrize(seed=[1, 2, 3, 4, 5, 6, 7, 8])
async def independent_partner_loses_nothing_at_bring_up(dut, seed):
    """A partner written from docs/link.md alone (tb/link_partner.py) takes B's place:
    random flow-control cadences (1 to 2,000 cycles in INIT, ARMED and ACTIVE), with or
    without its flow-control packets on entering ARMED and ACTIVE, random start times for
    either end, random resets of either end during bring-up, and data sent the moment the
    partner is ACTIVE and the port's credit allows. The port (A) takes every packet: none
    dropped for any reason, each counted as received, intact, in order per VL, its credits
    home; and A goes ACTIVE within ACTIVE_AFTER cycles (tb/link_partner_scenario.py) of the first good NORMAL or data
    packet that reaches it in ARMED. More seeds: tb/test_link_partner_soak.py."""
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
    await partner_scenario(dut, seed)


@cocotb.test()
async def armed_port_goes_active_on_data(dut):
    """The partner arms first (INIT cadence 1) and sends no flow-control packet in ARMED or
    on entering ACTIVE (cadence 2,000), so the first thing of its to reach A in ARMED is
    a data packet: A takes it and goes ACTIVE on it, within ACTIVE_AFTER cycles."""
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
    woken = await partner_scenario(dut, 0, cadences=dict(
        init_cadence=1, armed_cadence=2000, active_cadence=2000, fc_on_entry=False))
    assert woken == "data end", f"A was woken by a {woken}: the test did not test it"


@cocotb.test()
async def armed_timeout_meets_partner_going_active(dut):
    """The one way out of ARMED that is not ACTIVE, the timeout (the peer never answered),
    races the partner going ACTIVE on a NORMAL packet A sent just before it: over a 40-cycle
    cable the partner arms 0 to 100 cycles before A's timeout, its own NORMAL reaches A after it and is
    stale, and it sends data at once. A takes that data in INIT (it was not reset: the
    partner's counts are those of A's own handshake), the partner finishes its packet on
    A's INIT and initialises again, and the link comes up: nothing dropped, every packet
    counted, delivered in order, credits home."""
    params = runner.tb_params()
    width, num_vls = params["width"], params["num_vls"]
    delay = 40                  # the partner's cable: long enough for data to pass A's INIT
    timeout = 4 * params["fc_period"]
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
    dut.b_reset.value = 1
    dut.b_wire_in__valid.value = 0
    for v in range(num_vls):
        getattr(dut, f"a_vl_weight__{v}").value = 16
        getattr(dut, f"a_data_in__{v}__valid").value = 0
        getattr(dut, f"b_data_in__{v}__valid").value = 0
        getattr(dut, f"b_data_out__{v}__ready").value = 0
    rng = random.Random(31)
    took_in_init = 0
    tries = range(0, 2 * delay + 24, 4)
    for early in tries:
        loop = CycleLoop(dut.clk)
        # One INIT per VL, then silence: A arms and, unanswered, times out.
        partner = loop.add(LinkPartner(dut, "a_wire_out", "a_wire_in", width, num_vls,
                                       delay=delay, init_cadence=10 ** 6, armed_cadence=10 ** 6,
                                       active_cadence=64))
        sinks = [loop.add(PacketSink(dut, f"a_data_out__{v}", width)) for v in range(num_vls)]
        for v in range(num_vls):
            for _ in range(6):
                partner.send(v, random_packet(rng, payload_len=rng.randrange(0, 2049), vl=v))
        dut.a_reset.value = 0
        dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(dut.clk)
        dut.rst.value = 0
        partner.running = True
        armed_at = []

        def step(cycle):
            state = read_port(dut, "state", "a")
            if state == LinkState.ARMED and not armed_at:
                armed_at.append(cycle)
            assert_abr_zero_in_init(dut, cycle, num_vls)
            if armed_at and cycle == armed_at[0] + timeout - early and partner.state == LinkState.INIT:
                assert partner.heard_init
                partner.cadence[LinkState.INIT] = 64
                partner.enter(LinkState.ARMED, cycle)

        loop.checks.append(step)
        loop.checks.append(lambda cycle: assert_no_overflow(dut, cycle))

        def done():
            return partner.idle() and all(len(sinks[v].packets) >= len(partner.sent[v])
                                          for v in range(num_vls))

        a_states = []
        loop.checks.append(lambda cycle: a_states.append((cycle, read_port(dut, "state", "a")))
                           if not a_states or a_states[-1][1] != read_port(dut, "state", "a") else None)
        try:
            await loop.run(until=done, limit=3 * timeout)
        except AssertionError as error:
            raise AssertionError(f"{early} cycles early: {error}: A states {a_states}, partner "
                                 f"{[(c, st.name) for c, st in partner.state_log]}, drops "
                                 f"{ {k: n for k, n in drop_counts(dut, 'a').items() if n} }, "
                                 f"sent {[len(partner.sent[v]) for v in range(num_vls)]}, queued "
                                 f"{[len(partner.queue[v]) for v in range(num_vls)]}, delivered "
                                 f"{[len(sinks[v].packets) for v in range(num_vls)]}") from None
        drops = {k: n for k, n in drop_counts(dut, "a").items() if n}
        assert not drops, f"{early} cycles early: A dropped {drops}"
        assert not partner.cut
        for v in range(num_vls):
            assert not sinks[v].errors, sinks[v].errors
            assert [p for p, bad, *_ in sinks[v].packets if not bad] == partner.sent[v]
            assert read_port(dut, "packets_received", "a", v) == len(partner.sent[v])
        took_in_init += any(state == LinkState.INIT for cycle, state in partner.state_log[1:])
        await loop.run(until=lambda: read_port(dut, "state", "a") == LinkState.ACTIVE
                       and partner.state == LinkState.ACTIVE, limit=3 * timeout)
        await loop.run(cycles=64 + 4 * delay + 16)
        for v in range(num_vls):
            assert read_port(dut, "used_blocks", "a", v) == 0
            assert read_port(dut, "abr", "a", v) == partner.fctbs[v]
    dut._log.info(f"the partner went ACTIVE into A's timeout and back to INIT in {took_in_init} "
                  f"of {len(tries)}")
    assert took_in_init, "the race never happened: the test did not test it"


@cocotb.test()
async def capture_decodes(dut):
    """The A->B wire, captured as pcapng, holds the packets sent (checked by tshark in pytest)."""
    from models.pcap import LinkCapture
    path = os.path.join(os.getcwd(), "link_capture.pcapng")
    with LinkCapture(path) as capture:
        tb = TB(dut, capture=capture, rng=random.Random(18))
        await tb.bring_up()
        tb.random_traffic(20, sizes=(0, 512), sides=("a",))
        await tb.drain()
    tb.check_delivery()
    sent = [p for v in range(tb.num_vls) for p in tb.sent["a", v]]
    on_wire = [p[:-2] for p, bad, _ in tb.monitor.data_packets]
    assert sorted(on_wire) == sorted(sent)
    with open(os.path.join(os.getcwd(), "link_capture.json"), "w") as f:
        json.dump([p.hex() for p in on_wire], f)






def param_id(params):
    return f"w{params['width']}_ct{int(params['cut_through'])}"


# Each parameter set is one build; its two items run on one worker (tb/build_groups.py).
@pytest.mark.parametrize("params", PARAM_SETS, ids=param_id)
def test_link(params):
    """Every cocotb test of this module but ``capture_decodes`` (the next item runs it)."""
    runner.run(module="tb.test_link", toplevel="link_pair", factory=factory, params=params,
               test_filter=r"^(?!.*\.capture_decodes$)", label="all_but_capture_decodes")


@pytest.mark.parametrize("params", PARAM_SETS, ids=param_id)
def test_link_capture_decodes_in_tshark(params):
    """``capture_decodes``: the RTL's wire, captured, read back by tshark (without tshark the
    test still runs; only the decoding is skipped)."""
    import shutil
    from models.pcap import tshark_data_mismatches
    run_dir = runner.run(module="tb.test_link", toplevel="link_pair", factory=factory, params=params,
                         testcase="capture_decodes", expect_tests=1)
    packets = [bytes.fromhex(h) for h in json.loads((run_dir / "link_capture.json").read_text())]
    if not shutil.which("tshark"):
        pytest.skip("tshark not installed: apt-get install tshark (CI installs it); the test ran")
    assert not tshark_data_mismatches(run_dir / "link_capture.pcapng", packets)
