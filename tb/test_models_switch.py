"""Tests of the pure-Python switch model (models/switch/); no simulator.

Small cycle counts and fixed seeds: the whole file runs in well under a minute on one core.
"""

import itertools
import random

import numpy as np
import pytest

from models.crc import icrc
from models.ib import BTH, LRH, Opcode
from models.link import VlArbiter
from models.packet import (blocks, build_packet, parse_packet, random_packet,
                           send_only_wire_bytes, wire_beats, wire_packet)
from models.switch import (
    RTL_ALLOCATORS, FlowScoreboard, ForwardingTable, IslipAllocator, Network, Router, SlToVl,
    SwitchPacket, Traffic, check_lossless, forward, jain_index, make_traffic, run_switch,
    stream_to_one_output,
)
from models.switch.__main__ import main

PAYLOAD = 2020          # 2046 wire bytes: 32 beats of 64 B, 32 credit blocks
# Back-to-back packets leave a port with no idle cycle between them, so a port carries
# up to 32 beats in 32 cycles: at most this much payload per cycle and wire byte.
CEILING = PAYLOAD / (32 * 64)


# ----------------------------------------------------------------------------- iSLIP

def is_matching(match, requests):
    outputs = list(match.values())
    return len(set(outputs)) == len(outputs) and all((i, o) in requests for i, o in match.items())


def is_maximal(match, requests):
    used_out = set(match.values())
    return not any(i not in match and o not in used_out for i, o in requests)


def test_sizes():
    assert send_only_wire_bytes(PAYLOAD) == 2046
    assert wire_beats(2046, 64) == 32 and blocks(2046) == 32
    assert send_only_wire_bytes(2022) == 2050          # padded to 4: one more beat


def test_islip_pointer_rules_by_hand():
    alloc = IslipAllocator(4, iterations=1)
    # Inputs 0 and 1 both want outputs 0 and 1; all pointers 0.
    # Grant: out0 -> in0, out1 -> in0 (both from pointer 0). Accept: in0 takes out0.
    # Out1's grant is not accepted: its pointer stays; in1 is left unmatched (1 iteration).
    assert alloc.allocate({(0, 0), (0, 1), (1, 0), (1, 1)}) == {0: 0}
    assert alloc.grant_ptr == [1, 0, 0, 0] and alloc.accept_ptr == [1, 0, 0, 0]
    # Next cycle: out0 (pointer 1) grants in1, out1 (pointer 0) grants in0;
    # in0 accepts out1 (its pointer is 1), in1 accepts out0: desynchronised.
    assert alloc.allocate({(0, 0), (0, 1), (1, 0), (1, 1)}) == {0: 1, 1: 0}
    assert alloc.grant_ptr == [2, 1, 0, 0] and alloc.accept_ptr == [2, 1, 0, 0]

    # Second-iteration matches move no pointer.
    alloc = IslipAllocator(4, iterations=2)
    assert alloc.allocate({(0, 0), (0, 1), (1, 0), (1, 1)}) == {0: 0, 1: 1}
    assert alloc.grant_ptr == [1, 0, 0, 0] and alloc.accept_ptr == [1, 0, 0, 0]


def test_islip_set_and_matrix_agree_and_match_validly():
    rng = random.Random(1)
    for n, iterations in ((4, 1), (8, 1), (8, 3), (16, 4)):
        a, b = IslipAllocator(n, iterations), IslipAllocator(n, iterations)
        for _ in range(200):
            requests = {(i, o) for i in range(n) for o in range(n) if rng.random() < 0.3}
            matrix = np.zeros((n, n), dtype=bool)
            for i, o in requests:
                matrix[i, o] = True
            match = a.allocate(requests)
            assert b.allocate(matrix) == match
            assert is_matching(match, requests)
            assert a.grant_ptr == b.grant_ptr and a.accept_ptr == b.accept_ptr


@pytest.mark.parametrize("n", [4, 8, 16])
def test_islip_with_n_iterations_is_maximal(n):
    rng = random.Random(n)
    alloc = IslipAllocator(n, iterations=n)
    for _ in range(300):
        density = rng.choice([0.1, 0.3, 0.6])
        requests = {(i, o) for i in range(n) for o in range(n) if rng.random() < density}
        match = alloc.allocate(requests)
        assert is_matching(match, requests) and is_maximal(match, requests)


def test_islip_one_iteration_is_nearly_maximal():
    rng = random.Random(7)
    alloc = IslipAllocator(8, iterations=1)
    found = best = 0
    for _ in range(500):
        requests = {(i, o) for i in range(8) for o in range(8) if rng.random() < 0.3}
        found += len(alloc.allocate(requests))
        best += len(IslipAllocator(8, iterations=8).allocate(requests))
    assert found >= 0.8 * best


@pytest.mark.parametrize("n", [4, 8, 16])
def test_islip_desynchronises_under_full_load(n):
    """All N^2 requests every cycle: within N cycles every cycle is a full permutation
    and the pointers are all different (McKeown's desynchronisation)."""
    alloc = IslipAllocator(n, iterations=1)
    everything = {(i, o) for i in range(n) for o in range(n)}
    sizes = [len(alloc.allocate(everything)) for _ in range(3 * n)]
    assert sizes[0] == 1
    assert all(size == n for size in sizes[n:])
    assert sorted(alloc.grant_ptr) == list(range(n))


def test_islip_grants_round_robin_to_one_output():
    alloc = IslipAllocator(8)
    order = [alloc.allocate({(i, 3) for i in (1, 2, 5, 6)}) for _ in range(8)]
    assert [next(iter(m)) for m in order] == [1, 2, 5, 6, 1, 2, 5, 6]


# ----------------------------------------------------------------------------- tables, traffic

def test_tables():
    table = ForwardingTable.identity(4)
    assert [table.lookup(lid) for lid in (0, 1, 4, 5)] == [None, 0, 3, None]
    table.set(0x1234, 2)
    assert table.lookup(0x1234) == 2 and table.lid_of(2) == 3
    with pytest.raises(ValueError):
        table.set(1 << 16, 0)
    sl2vl = SlToVl(2)
    assert [sl2vl.lookup(sl) for sl in range(4)] == [0, 1, 0, 1]
    sl2vl[3] = 15
    assert sl2vl.lookup(3) == 15


def test_traffic_patterns():
    incast = make_traffic("incast", 8, target=5)
    assert [t.dests for t in incast if t.port != 5] == [(5,)] * 7
    assert not incast[5].active
    perm = make_traffic("permutation", 8, seed=3)
    dests = [t.dests[0] for t in perm]
    assert sorted(dests) == list(range(8)) and all(d != i for i, d in enumerate(dests))
    hot = make_traffic("hotspot", 8, hotspot=2, hot_fraction=0.5, load=0.5)
    picks = [hot[0].make()[0] for _ in range(4000)]
    assert 0.5 < picks.count(2) / 4000 < 0.6            # 0.5 + 0.5 / 8
    with pytest.raises(ValueError):
        make_traffic("tornado", 8)


def test_bernoulli_load_is_a_fraction_of_the_wire():
    traffic = Traffic(0, [1], load=0.3, payload=(0, 4000), seed=5)
    cycles, beats, t = 200_000, 0, traffic.first()
    while t < cycles:
        beats += wire_beats(send_only_wire_bytes(traffic.make()[2]), 64)
        t += traffic.gap()
    assert beats / cycles == pytest.approx(0.3, rel=0.05)


# ----------------------------------------------------------------------------- router

def test_parameters_are_validated():
    with pytest.raises(ValueError, match="ports"):
        Router(1)
    with pytest.raises(ValueError, match="mode"):
        Router(4, mode="crossbar")
    with pytest.raises(ValueError, match="buffer_blocks"):
        Router(4, buffer_blocks=32)                  # less than one 4 KiB packet
    for speedup in (0, 5, 1.5):
        with pytest.raises(ValueError, match="input_speedup"):
            Router(4, input_speedup=speedup)
    with pytest.raises(ValueError, match="lookahead"):
        Router(4, lookahead=-1)


@pytest.mark.parametrize("cut_through", [True, False])
def test_zero_load_latency_every_pair(cut_through):
    router = Router(4, 1, cut_through=cut_through)
    net = Network(router, make_traffic("uniform", 4, load=0))
    cycle = 0
    for i, o in itertools.product(range(4), range(4)):
        net.offer(i, cycle, o, payload=PAYLOAD)
        cycle += 100
    net.run(cycle + 100)
    check_lossless(net)
    assert router.hop_latency == 6
    expected = router.hop_latency + (0 if cut_through else 31)
    assert [p.latency for p in net.delivered] == [expected] * 16
    assert [(p.src, p.out) for p in net.delivered] == list(itertools.product(range(4), range(4)))


@pytest.mark.parametrize("speedup", [1, 2, 3])
def test_input_speedup_sends_to_that_many_outputs_at_once(speedup):
    """Input 0 holds one packet for each of outputs 1..3: with speed-up s it starts s of
    them in the first allocation, the next ones as its read ports free (beats later)."""
    router = Router(4, 1, input_speedup=speedup, iterations=speedup)
    packets = [SwitchPacket(n, 0, out, out + 1, 0, 0, PAYLOAD, 64, 0) for n, out in
               enumerate((1, 2, 3))]
    for p in packets:
        assert router.arrive(0, p)
    grants = {}
    for t in range(3, 200):
        for p in router.allocate(t):
            grants[p.out] = t
    assert sorted(grants.values()) == [3 + 32 * (k // speedup) for k in range(3)]
    assert router.empty()


def test_input_speedup_never_gives_an_output_two_packets_at_once():
    stats, net = run_switch(4, "uniform", load=1.0, payload=PAYLOAD, cycles=8000,
                            warmup=1000, input_speedup=2, iterations=2, buffer_blocks=132)
    by_output = {}
    for p in net.delivered:
        by_output.setdefault(p.out, []).append(p)
    for packets in by_output.values():
        packets.sort(key=lambda p: p.t_grant)
        assert all(b.t_grant >= a.t_grant + a.beats for a, b in zip(packets, packets[1:]))


def test_voq_uniform_saturation_8_ports():
    """iSLIP (one iteration) with VOQs: > 96 % of what the ports can carry (every cycle
    a beat), about 0.96 of the wire as payload, once the input buffers (2048 blocks =
    64 packets) have filled."""
    stats, net = run_switch(8, "uniform", load=1.0, payload=PAYLOAD, cycles=140_000,
                            warmup=70_000, buffer_blocks=2048, drain=False, check=False)
    assert stats.mean_throughput > 0.96 * CEILING, stats.summary()
    assert min(stats.throughput) > 0.92 * CEILING, stats.summary()
    assert stats.jain > 0.99
    check_lossless(net, drained=False)


@pytest.mark.parametrize("ports, low, high", [(8, 0.57, 0.66), (16, 0.55, 0.63)])
def test_fifo_head_of_line_limit(ports, low, high):
    """One FIFO per input: uniform saturated traffic approaches 2 - sqrt(2) = 0.586."""
    stats, _ = run_switch(ports, "uniform", load=1.0, payload=PAYLOAD, cycles=24_000,
                          warmup=4000, mode="fifo", drain=False)
    wire = float(np.mean(stats.wire_utilization))
    assert low < wire < high, stats.summary()


def test_incast_seven_to_one():
    stats, net = run_switch(8, "incast", target=0, load=1.0, payload=PAYLOAD, cycles=20_000,
                            warmup=2000)
    assert stats.wire_utilization[0] >= 0.999, stats.summary()    # every cycle
    assert stats.throughput[0] == pytest.approx(CEILING, rel=0.01)
    assert stats.jain >= 0.99
    shares = [stats.input_share[i] for i in range(1, 8)]
    assert max(abs(s - 1 / 7) for s in shares) < 0.01
    assert stats.dropped == {"unknown_dlid": 0, "invalid_vl": 0, "too_long": 0}
    assert len(net.delivered) == len(net.packets)       # drained, nothing lost


def _blocked_output_run(mode, blocked):
    """4 ports: inputs 0..2 first send 3 packets each to output 3, then saturate a
    permutation among outputs 0..2. Output 3's sink is starved until cycle 15000."""
    router = Router(4, 1, mode=mode)
    traffic = make_traffic("permutation", 4, permutation=[1, 2, 0, 3], payload=PAYLOAD)
    traffic[3] = Traffic(3, [], load=0)
    net = Network(router, traffic, starve={3: [(0, 15_000)]} if blocked else None)
    for i in range(3):
        for k in range(3):
            net.offer(i, 0, 3, payload=PAYLOAD)
    net.run(15_000)
    stats = net.stats(1000, 15_000)
    net.drain()
    check_lossless(net)
    return stats


def test_blocked_output_does_not_slow_other_outputs_with_voqs():
    free = _blocked_output_run("voq", blocked=False)
    blocked = _blocked_output_run("voq", blocked=True)
    for o in range(3):
        assert blocked.wire_utilization[o] > 0.99
        assert blocked.throughput[o] == pytest.approx(free.throughput[o], rel=0.01)
    # With one FIFO per input the same blocked output stalls everyone behind it.
    fifo = _blocked_output_run("fifo", blocked=True)
    assert max(fifo.wire_utilization[:3]) < 0.05


@pytest.mark.parametrize("mode", ["voq", "fifo"])
def test_random_traffic_lossless_in_order(mode):
    """Random sizes, two VLs, hotspot traffic, random sink stalls and a starved period:
    every packet delivered exactly once, in order per (input, output, VL), no buffer
    over its capacity, and everything drains."""
    stats, net = run_switch(6, "hotspot", hotspot=2, hot_fraction=0.3, load=0.7,
                            payload=(0, 4096), num_vls=2, sls=(0, 1, 2, 3), cycles=12_000,
                            mode=mode, sink_stall=0.2, starve={4: [(2000, 6000)]},
                            buffer_blocks=200, downstream_blocks=80, seed=11, iterations=2)
    peaks = check_lossless(net)
    assert stats.generated == len(net.delivered) > 500
    assert peaks["input"] > 66 and peaks["downstream"] > 66     # the buffers were used
    flows = {(p.src, p.out, p.vl) for p in net.delivered}
    assert {vl for _, _, vl in flows} == {0, 1}


def test_losslessness_check_catches_violations():
    _, net = run_switch(4, "uniform", load=0.5, payload=(0, 1024), cycles=3000, seed=2)
    flow = {}
    for p in net.delivered:
        flow.setdefault((p.src, p.out, p.vl), []).append(p)
    a, b = next(ps for ps in flow.values() if len(ps) >= 2)[:2]
    a.id, b.id = b.id, a.id                         # b generated first but left second
    with pytest.raises(AssertionError, match="order"):
        check_lossless(net)
    a.id, b.id = b.id, a.id
    check_lossless(net)
    net.delivered.remove(a)
    with pytest.raises(AssertionError, match="lost"):
        check_lossless(net, drained=True)
    net.delivered.append(a)
    net.router.buffer_blocks = 1
    with pytest.raises(AssertionError, match="blocks held"):
        check_lossless(net)


def test_bad_packets_dropped_and_counted_others_unaffected():
    router = Router(4, 2)
    router.sl_to_vl[5] = 15                               # SL 5 -> VL15: not a data VL
    net = Network(router, make_traffic("uniform", 4, load=0), lids=[1, 2, 3, 99])
    for k in range(20):
        net.offer(0, 40 * k, k % 4, sl=0, payload=512)       # every 4th: DLID 99 unknown
        net.offer(1, 40 * k, 2, sl=5 if k % 5 == 0 else 1, payload=512)
        net.offer(2, 40 * k, 1, payload=5000 if k == 7 else 256)
    net.run(2000).drain()
    check_lossless(net)
    assert router.drops == {"unknown_dlid": 5, "invalid_vl": 4, "too_long": 1}
    assert len(net.delivered) == 60 - 10
    assert all(p.out == net.router.forwarding.lookup(p.dlid) for p in net.delivered)


def test_forwarding_table_rewritten_under_traffic():
    router = Router(4, 1)
    net = Network(router, make_traffic("uniform", 4, load=0.6, payload=(0, 2048), seed=4))
    net.run(3000)
    router.forwarding.set(1, 3)                           # LID 1: port 0 -> port 3
    net.run(3000).drain()
    check_lossless(net)
    to_lid1 = [p for p in net.delivered if p.dlid == 1]
    assert {p.out for p in to_lid1 if p.t_in < 3000} == {0}
    assert {p.out for p in to_lid1 if p.t_in >= 3000} == {3}


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == 1.0
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([]) == 1.0


def test_cli(capsys):
    main(["--ports", "4", "--load", "0.8", "--pattern", "uniform", "--cycles", "3000"])
    out = capsys.readouterr().out
    assert "throughput" in out and "p99" in out and "lossless check passed" in out


# ----------------------------------------------------------------------------- timing, VL arbitration

def test_hop_latency_6_and_back_to_back_grants_beats_apart():
    router = Router(4, 1)
    assert (router.ingress_cycles, router.alloc_cycles, router.egress_cycles,
            router.turnaround_cycles, router.hop_latency) == (3, 1, 2, 0, 6)
    net = Network(router, make_traffic("uniform", 4, load=0))
    for _ in range(4):
        net.offer(0, 10, 2, payload=PAYLOAD)          # back to back on input 0's wire
    net.offer(1, 10, 3, payload=PAYLOAD)              # alone on another pair
    net.run(400)
    check_lossless(net)
    first = [p for p in net.delivered if p.src == 0]
    alone = next(p for p in net.delivered if p.src == 1)
    assert alone.t_in == 10 and alone.ready == 13 and alone.t_grant == 13
    assert alone.t_out == 16 and alone.latency == 6
    assert first[0].latency == 6
    assert [b.t_grant - a.t_grant for a, b in zip(first, first[1:])] == [32, 32, 32]
    assert [b.t_out - a.t_out for a, b in zip(first, first[1:])] == [32, 32, 32]
    # The input buffer frees a packet's blocks (and returns its credit) in the cycle its
    # end beat is handed to the egress transmitter: grant + 1 + 31, when the port frees.
    assert [p.in_release - p.t_grant for p in first] == [32] * 4
    assert first[-1].in_release == router.in_busy[0]


@pytest.mark.parametrize("allocator", RTL_ALLOCATORS)
def test_rtl_allocator_timing_has_the_rtl_hop(allocator):
    """The model's timing of each RTL allocator (RTL_ALLOCATORS) has that switch's zero-load
    hop (hdl/switch/switch.py HOP_LATENCY_CYCLES), measured through the model."""
    from hdl.switch.switch import ALLOCATORS, HOP_LATENCY_CYCLES
    assert set(RTL_ALLOCATORS) == set(ALLOCATORS)
    router = Router(4, 1, **RTL_ALLOCATORS[allocator])
    net = Network(router, make_traffic("uniform", 4, load=0))
    net.offer(0, 10, 2, payload=PAYLOAD)
    net.run(200)
    check_lossless(net)
    assert [p.latency for p in net.delivered] == [HOP_LATENCY_CYCLES[allocator]]


def test_incast_4096_back_to_back_with_no_idle_cycle():
    """As measured on the RTL (4 ports): 4096-byte packets into one output leave it
    back to back, start to start = the packet's beats, every cycle busy."""
    stats, net = run_switch(4, "incast", target=0, load=1.0, payload=4096, cycles=20_000,
                            warmup=2000)
    beats = wire_beats(send_only_wire_bytes(4096), 64)
    assert beats == 65
    out = sorted((p for p in net.delivered if 2000 <= p.t_out < 20_000), key=lambda p: p.t_out)
    assert {b.t_out - a.t_out for a, b in zip(out, out[1:])} == {beats}
    assert stats.wire_utilization[0] >= 0.999, stats.summary()


@pytest.mark.parametrize("turnaround", [0, 1, 3])
def test_pipeline_latencies_are_parameters(turnaround):
    router = Router(4, 1, ingress_cycles=4, alloc_cycles=2, egress_cycles=3,
                    turnaround_cycles=turnaround)
    net = Network(router, make_traffic("uniform", 4, load=0))
    for _ in range(3):
        net.offer(0, 0, 1, payload=PAYLOAD)
    net.run(400)
    check_lossless(net)
    lat = [p.latency for p in net.delivered]
    assert lat[0] == 9 == router.hop_latency
    # A port's grants are beats + turnaround_cycles apart (turnaround idle cycles on the
    # egress wire between back-to-back packets).
    gaps = [32 + turnaround] * 2
    assert [b.t_grant - a.t_grant for a, b in zip(net.delivered, net.delivered[1:])] == gaps
    assert [b.t_out - a.t_out for a, b in zip(net.delivered, net.delivered[1:])] == gaps
    # Blocks free when the end beat is handed to the transmitter: grant + alloc + beats - 1.
    assert [p.in_release - p.t_grant for p in net.delivered] == [2 + 32 - 1] * 3


@pytest.mark.parametrize("lookahead", [0, 3, 8])
def test_lookahead_matches_the_next_packet_while_the_current_one_leaves(lookahead):
    """Inputs 0 and 1 each hold a packet for output 2: the second is matched `lookahead`
    beats before the first one's end and still starts right after it, back to back."""
    router = Router(4, 1, lookahead=lookahead)
    for n, src in enumerate((0, 1)):
        assert router.arrive(0, SwitchPacket(n, src, 2, 3, 0, 0, PAYLOAD, 64, 0))
    granted = []
    for t in range(3, 200):
        granted += router.allocate(t)
    first, second = sorted(granted, key=lambda p: p.t_grant)
    assert first.t_grant == 3 and second.t_grant == 3 + 32 - lookahead
    assert second.t_out == first.t_out + 32


def test_lookahead_keeps_uniform_saturation():
    """Matching ahead costs no throughput: a pending match holds both of its ports."""
    def saturation(lookahead):
        stats, _ = run_switch(8, "uniform", load=1.0, payload=PAYLOAD, cycles=40_000,
                              warmup=10_000, num_vls=2, sls=(0, 1), buffer_blocks=132,
                              exclude_self=True, alloc_cycles=3, lookahead=lookahead)
        return stats.mean_throughput
    assert abs(saturation(4) - saturation(0)) < 0.01


def _two_vl_run(weights, payload):
    """Input 1 saturates VL 0, input 2 saturates VL 1, both into output 0."""
    router = Router(4, 2, vl_weights=[list(weights)] + [[16, 16]] * 3)
    traffic = [Traffic(0, [], load=0), Traffic(1, [0], sls=(0,), payload=payload),
               Traffic(2, [0], sls=(1,), payload=payload), Traffic(3, [], load=0)]
    net = Network(router, traffic)
    net.run(20_000)
    net.drain()
    check_lossless(net)
    by_vl = [sum(p.blocks for p in net.delivered if p.vl == v and 2000 <= p.t_grant < 20_000)
             for v in (0, 1)]
    return net, by_vl


def test_output_wrr_48_16_gives_3_to_1_blocks():
    # 996 B payload: 1022 wire bytes, 16 blocks: a VL0 turn is 3 packets, a VL1 turn 1.
    net, by_vl = _two_vl_run((48, 16), 996)
    assert by_vl[0] / by_vl[1] == pytest.approx(3.0, rel=0.02)
    order = [p.vl for p in sorted(net.delivered, key=lambda p: p.t_grant)][:16]
    assert order == [1, 0, 0, 0] * 4          # reset: pointer 0, budget 0 -> VL 1 first
    # The grant order is the link transmitter's arbiter's, packet for packet.
    arb = VlArbiter([48, 16])
    for p in sorted(net.delivered, key=lambda p: p.t_grant)[:200]:
        assert arb.pick([True, True]) == p.vl
        arb.commit(p.vl, p.blocks)
    # Equal weights share equally; a turn lets at least one packet through, so 32-block
    # packets with weights 48:16 go 2:1 (48 -> 16 -> 0 is two packets).
    _, by_vl = _two_vl_run((16, 16), 996)
    assert by_vl[0] / by_vl[1] == pytest.approx(1.0, rel=0.02)
    _, by_vl = _two_vl_run((48, 16), PAYLOAD)
    assert by_vl[0] / by_vl[1] == pytest.approx(2.0, rel=0.02)


def test_vl_weights_validated_and_settable():
    router = Router(4, 2)
    assert router.vl_weight == [[16, 16]] * 4
    router.set_vl_weight(2, 1, 200)
    assert router.vl_weight[2] == [16, 200] and router.vl_weight[1] == [16, 16]
    with pytest.raises(ValueError):
        router.set_vl_weight(0, 0, 256)
    with pytest.raises(ValueError):
        Router(4, 2, vl_weights=[16, 16, 16])
    assert Router(4, 3, vl_weights=8).vl_weight == [[8, 8, 8]] * 4


def test_vl_chosen_per_output_before_islip():
    """Output VL arbitration happens before iSLIP: once output 0 picked VL 1, only the
    input with a VL 1 head for output 0 requests it, even though input 0 (VL 0) is
    first in the grant pointer's order."""
    router = Router(4, 2)
    net = Network(router, make_traffic("uniform", 4, load=0))
    net.offer(0, 0, 0, sl=0, payload=PAYLOAD)
    net.offer(1, 0, 0, sl=1, payload=PAYLOAD)
    net.run(200)
    first, second = sorted(net.delivered, key=lambda p: p.t_grant)
    assert (first.src, first.vl, second.src, second.vl) == (1, 1, 0, 0)
    assert second.t_grant - first.t_grant == 32


# ----------------------------------------------------------------------------- forward, scoreboard

def _packet(dlid, sl=0, vl=0, psn=0, payload=b"x" * 40):
    return build_packet(bth=BTH(opcode=Opcode.SEND_ONLY, destqp=5, psn=psn), payload=payload,
                        vl=vl, sl=sl, dlid=dlid, slid=0x77)


def _tables():
    table = ForwardingTable({0x10: 0, 0x11: 1, 0x12: 2, 0x13: 3})
    sl2vl = SlToVl(2)                      # SL s -> VL s % 2
    sl2vl[7] = 15                          # drop
    sl2vl[8] = 3                           # not a data VL of a 2-VL switch
    return table, sl2vl


def test_forward_rewrites_vl_and_keeps_the_icrc_valid():
    table, sl2vl = _tables()
    packet = _packet(0x12, sl=1, vl=0, psn=9)
    port, vl, out = forward(packet, table, sl2vl, 2)
    assert (port, vl) == (2, 1)
    assert out[0] >> 4 == 1 and out[0] & 0xF == packet[0] & 0xF and out[1:] == packet[1:]
    parsed = parse_packet(out)
    assert parsed.icrc_ok and parsed.lrh.vl == 1 and parsed.lrh.dlid == 0x12
    assert int.from_bytes(out[-4:], "little") == icrc(out[:-4])
    # On a wire with its VCRC: the VCRC is recomputed, as a hop does.
    port, vl, out = forward(wire_packet(packet), table, sl2vl, 2)
    parsed = parse_packet(out)
    assert parsed.icrc_ok and parsed.vcrc_ok and parsed.lrh.vl == 1
    # Random packets: DLID and SL read from the right bits.
    rng = random.Random(3)
    for _ in range(50):
        p = random_packet(rng, payload_len=rng.randrange(0, 300), vl=rng.randrange(2),
                          dlid=0x10 + rng.randrange(4))
        lrh = LRH.unpack(p[:8])
        result = forward(p, table, sl2vl, 2)
        if lrh.sl in (7, 8):
            assert result == "invalid_vl"
        else:
            port, vl, out = result
            assert port == lrh.dlid - 0x10 and vl == lrh.sl % 2 and parse_packet(out).icrc_ok


def test_forward_drop_reasons():
    table, sl2vl = _tables()
    assert forward(_packet(0x99), table, sl2vl, 2) == "unknown_dlid"
    assert forward(_packet(0x10, sl=7), table, sl2vl, 2) == "invalid_vl"      # SL -> VL15
    assert forward(_packet(0x10, sl=8), table, sl2vl, 2) == "invalid_vl"      # SL -> VL3
    assert forward(_packet(0x10, vl=2), table, sl2vl, 2) == "invalid_vl"      # incoming VL
    assert forward(_packet(0x10, vl=15), table, sl2vl, 2) == "invalid_vl"
    assert forward(_packet(0x99, sl=7), table, sl2vl, 2) == "invalid_vl"      # VL first
    assert forward(_packet(0x13), table, sl2vl, 2, ports=3) == "unknown_dlid"
    big = _packet(0x10, payload=bytes(300))
    assert forward(big, table, sl2vl, 2, mtu=256) == "too_long"
    assert forward(big, table, sl2vl, 2, mtu=512)[0] == 0


def test_scoreboard_in_order_and_interleaved_flows_accepted():
    table, sl2vl = _tables()
    sb = FlowScoreboard(table, sl2vl, 2)
    a = [sb.expect(0, _packet(0x12, sl=0, psn=k))[2] for k in range(3)]      # 0 -> 2 VL0
    b = [sb.expect(1, _packet(0x12, sl=0, psn=100 + k))[2] for k in range(3)]  # 1 -> 2 VL0
    c = [sb.expect(0, _packet(0x12, sl=1, psn=200 + k))[2] for k in range(2)]  # 0 -> 2 VL1
    assert sb.expect(0, _packet(0x99)) == "unknown_dlid"
    assert sb.expect(1, _packet(0x10, sl=7)) == "invalid_vl"
    assert sb.drops == {"unknown_dlid": 1, "invalid_vl": 1, "too_long": 0}
    assert sb.deliver(2, 1, c[0]) == 0
    assert sb.deliver(2, 0, b[0]) == 1
    assert sb.deliver(2, 0, a[0]) == 0
    assert sb.deliver(2, 0, a[1]) == 0
    assert sb.deliver(2, 0, b[1]) == 1
    for pkt in (b[2], c[1], a[2]):
        sb.deliver(2, pkt[0] >> 4, pkt)
    sb.check_all_delivered()
    assert sb.delivered == sb.expected == 8


def test_scoreboard_rejects_reorder_duplicate_wrong_port_and_reports_missing():
    table, sl2vl = _tables()
    sb = FlowScoreboard(table, sl2vl, 2)
    a = [sb.expect(0, _packet(0x11, psn=k))[2] for k in range(3)]
    with pytest.raises(AssertionError, match="out of order"):
        sb.deliver(1, 0, a[1])
    sb.deliver(1, 0, a[0])
    with pytest.raises(AssertionError, match="duplicate"):
        sb.deliver(1, 0, a[0])
    with pytest.raises(AssertionError, match="expected on output 1 VL 0"):
        sb.deliver(3, 0, a[1])
    with pytest.raises(AssertionError, match="not expected"):
        sb.deliver(1, 0, _packet(0x11, psn=77))
    with pytest.raises(AssertionError, match="not expected"):   # VL not rewritten
        sb.deliver(1, 0, _packet(0x11, sl=2, vl=1, psn=1))
    sb.deliver(1, 0, a[1])
    with pytest.raises(AssertionError, match=r"1 expected packet\(s\) never delivered") as err:
        sb.check_all_delivered()
    assert "input 0 -> output 1 VL 0" in str(err.value)


def test_scoreboard_tolerates_a_dlid_moving_between_ports():
    table, sl2vl = _tables()
    sb = FlowScoreboard(table, sl2vl, 2)
    x = sb.expect(0, _packet(0x11, psn=1))[2]                 # surely old port 1
    table.set(0x11, 3)
    y = sb.expect(0, _packet(0x11, psn=2), ports={1, 3})[2]   # old or new
    z = sb.expect(0, _packet(0x11, psn=3))[2]                 # surely new port 3
    w = sb.expect(0, _packet(0x12, psn=4))[2]
    # z on port 3 overtakes y: y may only go to port 1 now.
    assert sb.deliver(3, 0, z) == 0
    with pytest.raises(AssertionError):
        sb.deliver(3, 0, y)
    sb.deliver(1, 0, x)
    sb.deliver(1, 0, y)
    sb.deliver(2, 0, w)
    sb.check_all_delivered()
    # Delivered on one of its ports, it is gone from the other.
    sb.expect(0, _packet(0x11, psn=5), ports={1, 3})
    v = sb.expect(0, _packet(0x11, psn=6), ports={1, 3})[2]
    sb.deliver(3, 0, sb.flows[(0, 3, 0)][0].packet)
    sb.deliver(3, 0, v)
    sb.check_all_delivered()
    with pytest.raises(AssertionError, match="duplicate"):
        sb.deliver(3, 0, v)


def test_scoreboard_accepts_what_the_model_switch_delivers():
    """Give every packet of a random two-VL model run real bytes: expecting each at its
    start beat in and delivering each at its start beat out passes the scoreboard."""
    stats, net = run_switch(4, "uniform", load=0.9, payload=(0, 1024), num_vls=2,
                            sls=(0, 1, 2, 3), cycles=4000, seed=5, sink_stall=0.1)
    router = net.router
    sb = FlowScoreboard(router.forwarding, router.sl_to_vl, router.num_vls)
    wire = {p.id: _packet(p.dlid, sl=p.sl, vl=p.vl, psn=p.id, payload=bytes(p.payload))
            for p in net.packets}
    events = [(p.t_in, 0, p.id, p) for p in net.packets] + \
             [(p.t_out, 1, p.id, p) for p in net.delivered]
    for _, kind, _, p in sorted(events, key=lambda e: e[:3]):
        if kind == 0:
            sb.expect(p.src, wire[p.id])
        else:
            out = wire[p.id]
            assert sb.deliver(p.out, p.vl, out) == p.src
    sb.check_all_delivered()
    assert sb.delivered == len(net.delivered) > 200


def _one_output_gaps(sizes, **router_args):
    """Gaps (start to start less the beats) of 3 inputs' streams of ``sizes``-block packets
    into one output, 64-byte beats, the pipelined allocator's timing."""
    router = Router(4, 1, alloc_cycles=3, lookahead=3, **router_args)
    out = stream_to_one_output(router, (1, 2, 3), [64 * size - 32 for size in sizes])
    return [b[0] - a[0] - a[1] for a, b in zip(out, out[1:])]


@pytest.mark.parametrize("size", [1, 2, 4, 5, 20])
def test_credit_hold_short_packets_back_to_back_long_ones_wait(size):
    """With the credit hold (the pipelined allocator's stale credit view), a packet of more
    than short_blocks waits until its predecessor's count is in the view: count_cycles after
    its start, and 4 more; short ones go back to back on the reserve once the stream runs.
    Without the hold the model is optimistic: back to back whatever the size."""
    gaps = _one_output_gaps([size] * 8, credit_hold=True)
    router = Router(4, 1, credit_hold=True)
    wait = max(0, router.count_cycles + 4 - size)       # one beat per block
    assert gaps[1:] == [0 if size <= router.short_blocks else wait] * (len(gaps) - 1)
    assert set(_one_output_gaps([size] * 8)) == {0}
    # The allocator before the short-packet rule: every packet waits as a long one.
    assert set(_one_output_gaps([size] * 8, credit_hold=True, short_blocks=0)[1:]) == {wait}


def test_credit_hold_random_short_traffic_lossless():
    """Uniform traffic of short packets with the hold and the reserve: lossless and in order
    (check_lossless), the downstream credit never below zero (Router.credit)."""
    stats, _ = run_switch(4, "uniform", load=1.0, payload=96, cycles=6000, num_vls=2,
                          sls=(0, 1), buffer_blocks=132, exclude_self=True, alloc_cycles=3,
                          lookahead=3, credit_hold=True)
    assert stats.mean_throughput > 0


@pytest.mark.parametrize("kwargs", [dict(short_blocks=-1), dict(short_blocks=2048),
                                    dict(short_matches=2), dict(short_matches=16),
                                    dict(count_cycles=0)])
def test_credit_hold_parameters_validated(kwargs):
    with pytest.raises(ValueError):
        Router(4, credit_hold=True, **kwargs)
