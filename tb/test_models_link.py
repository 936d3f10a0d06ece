"""Tests of the pure-Python credit-link model (models/link.py); no simulator."""

import random

import pytest

from models.link import (
    ARMED_FC_INTERVAL, FCCL_MOD, INIT_REPEATS, Channel, CreditReceiver, CreditSender,
    FlowControlScheduler, LinkModel, LinkStateMachine, VlArbiter,
    credit_loop_cycles, estimate_min_buffer, min_buffer_for_full_rate,
)
from models.packet import blocks, send_only_wire_bytes, stored_beats, wire_beats

MTU_PACKET = send_only_wire_bytes(4096)     # 4122: LRH + BTH + 4096 + ICRC + VCRC


def test_sizes():
    assert MTU_PACKET == 4122
    assert wire_beats(MTU_PACKET, 64) == 65
    assert stored_beats(MTU_PACKET, 64) == 65
    assert blocks(MTU_PACKET) == 65
    # 64 bytes of LRH..ICRC: the VCRC spills into a second wire beat, not a stored one.
    assert (wire_beats(66, 64), stored_beats(66, 64)) == (2, 1)


def test_channel_delay():
    channel = Channel(3)
    channel.push(0, "x")
    assert [channel.pop(now) for now in range(1, 4)] == [None, None, "x"]
    channel.push(5, "y")
    with pytest.raises(AssertionError):
        channel.push(5, "z")


@pytest.mark.parametrize("start", [0, 4000, 4095, 2047, 2048])
def test_credit_arithmetic_wraps(start):
    capacity = 100
    sender, receiver = CreditSender(), CreditReceiver(capacity)
    sender.fctbs = receiver.abr = start
    sender.update(receiver.fccl())
    assert sender.blocks_available() == capacity
    assert sender.can_send(capacity) and not sender.can_send(capacity + 1)
    sent = 0
    while sender.can_send(7):
        sender.sent(7)
        receiver.received(7)
        sent += 7
    assert sent == 98 and sender.blocks_available() == 2
    assert sender.fctbs == (start + 98) % FCCL_MOD == receiver.abr
    receiver.freed(98)
    sender.update(receiver.fccl())
    assert sender.blocks_available() == capacity and receiver.used == 0
    with pytest.raises(AssertionError):
        sender.sent(capacity + 1)


def test_credit_rule_is_the_iba_window():
    sender = CreditSender(limit=10)
    sender.fctbs = 4090                      # 16 blocks below the limit, across the wrap
    assert sender.blocks_available() == 16
    assert sender.can_send(16) and not sender.can_send(17)
    sender.fctbs = 20                        # past the limit: nothing available
    assert sender.blocks_available() == 0 and not sender.can_send(1)
    sender.limit = (20 + 2048) % FCCL_MOD    # the largest window the rule allows
    assert sender.can_send(2048)


def test_receiver_overflow_and_sync():
    receiver = CreditReceiver(10)
    receiver.received(10)
    with pytest.raises(AssertionError):
        receiver.received(1)
    receiver.sync(4000)
    assert receiver.fccl() == (4000 + 10 - 11) % FCCL_MOD


def test_flow_control_schedule():
    fc = FlowControlScheduler(2, fc_period=100, fc_min_interval=10, fc_batch_blocks=64)
    fc.since, fc.last = [0, 0], [5, 5]
    sent = []
    for now in range(250):
        advertised = [5 + (now >= 3), 5 + 70 * (now >= 40)]
        vl = fc.choose()
        if vl is not None:
            sent.append((now, vl))
        fc.step(vl, advertised)
    # VL0: change at 3, reported after the min interval; then refreshes every period + 1.
    # VL1: a 70-block jump at 40 goes out in the next cycle (the decision is a register
    # and sees FCCL a cycle late); then refreshes.
    assert sent == [(10, 0), (41, 1), (111, 0), (142, 1), (212, 0), (243, 1)]


def test_flow_control_batch_rule():
    # A jump of a batch goes out FC_BATCH_INTERVAL after the last packet, not after the
    # minimum interval; the batch test is registered on top of the decision: 2 cycles.
    fc = FlowControlScheduler(1, fc_period=100, fc_min_interval=30, fc_batch_blocks=64)
    fc.since, fc.last = [0], [0]
    for now in range(100):
        if fc.choose() is not None:
            break
        fc.step(None, [70 if now >= 1 else 0])
    assert now == 4
    fc.since, fc.last, fc.want, fc.batch_ready = [0], [0], [False], [False]
    for now in range(100):
        if fc.choose() is not None:
            break
        fc.step(None, [70 if now >= 10 else 0])
    assert now == 12


def test_flow_control_no_batch_rule():
    fc = FlowControlScheduler(1, fc_period=100, fc_min_interval=30, fc_batch_blocks=None)
    fc.since, fc.last = [0], [0]
    for now in range(100):
        if fc.choose() is not None:
            break
        fc.step(None, [70])
    assert now == 30      # a big change still waits for the minimum interval


def test_arbiter_weights_and_one_packet_minimum():
    arbiter = VlArbiter([1, 3])
    order = []
    for _ in range(12):
        vl = arbiter.pick([True, True])
        arbiter.commit(vl, 1)
        order.append(vl)
    assert order == [1, 1, 1, 0] * 3
    # A packet bigger than the weight still goes, one per turn.
    arbiter = VlArbiter([1, 1])
    picks = []
    for _ in range(4):
        vl = arbiter.pick([True, True])
        arbiter.commit(vl, 5)
        picks.append(vl)
    assert picks == [1, 0, 1, 0]
    # Work conserving: an idle VL never holds the others up.
    assert arbiter.pick([False, True]) == 1 and arbiter.pick([False, False]) is None


def test_throughput_mtu_packets_big_buffer():
    model = LinkModel(width=64, buffer_blocks=2047, packet_bytes=MTU_PACKET, wire_delay=4).run(30000)
    stats = model.stats()
    ceiling = 4096 / (65 * 64)
    # Only the periodic flow-control refreshes of A's own receiver take wire beats.
    assert ceiling * 0.995 < stats.steady_throughput() <= ceiling
    assert stats.credit_stall_cycles == [0, 0]
    assert max(stats.max_occupancy_blocks) <= 2047


def test_zero_load_latency():
    for cut_through, expected in ((False, 65 + 3), (True, 4)):
        model = LinkModel(traffic=[(10, 0, MTU_PACKET)], cut_through=cut_through, wire_delay=7)
        model.drain()
        (packet,) = model.stats().packets
        assert packet.accepted == 10
        # + wire_delay (7) + the transmitter's beat register + the receiver's check register.
        assert packet.latency == expected + 7 + 2
        assert packet.last_out - packet.first_out == 64


@pytest.mark.parametrize("cut_through", [False, True])
@pytest.mark.parametrize("width", [8, 64])
def test_never_overflows_with_sink_stalls(cut_through, width):
    buffer_blocks = 70
    model = LinkModel(width=width, num_vls=2, buffer_blocks=buffer_blocks, wire_delay=9,
                      cut_through=cut_through, sink_stall=0.6, seed=3,
                      packet_bytes=send_only_wire_bytes(1024), saturate_vls=(0, 1),
                      fc_min_interval=16, fc_period=256)
    model.run(8000)     # the model asserts occupancy <= capacity and FIFO room every cycle
    stats = model.stats()
    assert stats.delivered_packets > 20
    assert all(0 < held <= buffer_blocks for held in stats.max_occupancy_blocks)
    assert all(used <= buffer_blocks for used in stats.max_used_blocks)
    assert all(stall > 0 for stall in stats.credit_stall_cycles)


@pytest.mark.parametrize("cut_through", [False, True])
def test_all_credits_return(cut_through):
    rng = random.Random(5)
    traffic, cycle = [], 0
    for _ in range(300):
        cycle += rng.randrange(0, 30)
        traffic.append((cycle, rng.randrange(3), send_only_wire_bytes(rng.randrange(0, 1025))))
    model = LinkModel(num_vls=3, buffer_blocks=40, wire_delay=13, cut_through=cut_through,
                      traffic=traffic, sink_stall=0.3, seed=1, fc_period=512, fc_min_interval=32,
                      reverse_packet_bytes=send_only_wire_bytes(256))
    model.drain()
    stats = model.stats()
    assert stats.delivered_packets == len(traffic)
    for vl in range(3):
        delivered = [p for p in stats.packets if p.vl == vl]
        assert [p.id for p in delivered] == sorted(p.id for p in delivered)   # in order per VL
    assert model.credits_home()
    for sender, credit in zip(model.tx["a"].senders, model.rx["b"].credits):
        assert (sender.limit - sender.fctbs) % FCCL_MOD == 40
        assert credit.used == 0 and credit.abr == sender.fctbs


def test_arbiter_splits_bandwidth_by_weight():
    packet = send_only_wire_bytes(128)          # 154 bytes: 3 blocks
    model = LinkModel(num_vls=2, buffer_blocks=None, vl_weights=[6, 18],
                      packet_bytes=packet, saturate_vls=(0, 1)).run(20000)
    per_vl = [sum(p.nbytes for p in model.stats().packets if p.vl == vl) for vl in range(2)]
    assert per_vl[1] / per_vl[0] == pytest.approx(3, rel=0.02)


def test_credit_stall_limits_throughput_as_the_loop_says():
    # Store-and-forward, RTL default buffer (132 blocks = 2 packets), no cable:
    # 2 packets per credit loop of 144 cycles instead of per 130 (137 before the VCRC
    # and flow-control decisions were pipelined: + 2 data, + 4 flow control; 143 before
    # the transmitter's credit view was registered from its limit register).
    loop = credit_loop_cycles(0, MTU_PACKET, 64)
    assert loop == 144
    stats = LinkModel(buffer_blocks=132, packet_bytes=MTU_PACKET).run(20000).stats()
    assert stats.steady_throughput() == pytest.approx(2 * 4096 / (loop * 64), rel=0.005)
    assert stats.credit_stall_cycles[0] > 0


def test_min_buffer_grows_with_wire_delay():
    packet = send_only_wire_bytes(256)          # 282 bytes: 5 blocks, 5 beats
    delays = (0, 32, 64, 128)
    sizes = [min_buffer_for_full_rate(d, packet, 64, cycles=6000) for d in delays]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert sizes[0] >= blocks(packet)
    slope = (sizes[-1] - sizes[0]) / (delays[-1] - delays[0])
    assert 1.7 <= slope <= 2.3                  # ~2 blocks per cycle of delay at width 64
    for d, size in zip(delays, sizes):
        assert abs(size - estimate_min_buffer(d, packet, 64)) <= 2 * blocks(packet)


def test_min_buffer_mtu_packets():
    # Whole packets of 65 blocks: 2 cover the cut-through loop of 79 cycles, 5 the
    # store-and-forward loop of 271 cycles over a 64-cycle cable.
    assert min_buffer_for_full_rate(0, MTU_PACKET, 64, cut_through=True, cycles=8000) == 130
    assert min_buffer_for_full_rate(64, MTU_PACKET, 64, cycles=8000) == 325


def bring_to_armed(port, num_vls=2):
    port.heard(init=True)
    for _ in range(INIT_REPEATS):
        for vl in range(num_vls):
            port.sent_init(vl)
    return port


def test_state_machine_arms_after_init_repeats_and_goes_active_on_data():
    port = LinkStateMachine(num_vls=2, fc_min_interval=64)
    for _ in range(INIT_REPEATS):
        port.sent_init(0)       # before the peer's INIT was heard: no repeats count
    assert port.state == port.INIT and port.sends() == "INIT" and port.fc_interval == 64
    port.heard(init=True)
    for _ in range(INIT_REPEATS):
        port.sent_init(0)
    assert port.state == port.INIT, "every VL repeats INIT_REPEATS times"
    for _ in range(INIT_REPEATS):
        port.sent_init(1)
    assert port.state == port.ARMED and port.sends() == "NORMAL" and port.fc_interval == 16
    assert not port.abr_held
    assert port.data() is True and port.state == port.ACTIVE and port.sends() == "NORMAL+data"


@pytest.mark.parametrize("fc_min_interval", [8, 16, 64])
def test_state_machine_armed_cadence(fc_min_interval):
    port = bring_to_armed(LinkStateMachine(fc_min_interval=fc_min_interval))
    assert port.fc_interval == min(ARMED_FC_INTERVAL, fc_min_interval)


def test_state_machine_normal_packets_and_init_in_armed():
    port = LinkStateMachine()
    assert port.heard(init=False) is False and port.state == port.INIT, "NORMAL is stale in INIT"
    bring_to_armed(port)
    assert port.heard(init=True) is True and port.state == port.ARMED, "the peer still initialising"
    assert port.heard(init=False) is True and port.state == port.ACTIVE
    assert port.link_inits == 0


def test_state_machine_data_dropped_only_in_the_init_after_reset():
    port = LinkStateMachine(fc_period=1024)
    assert port.data() is False and port.abr_held, "stale: sent to our earlier life"
    bring_to_armed(port)
    port.armed_for(4 * 1024)
    assert port.state == port.ARMED
    port.armed_for(4 * 1024 + 1)
    assert port.state == port.INIT and not port.heard_init and port.abr_held
    assert port.data() is True and port.state == port.INIT, "sent against this life's credit"
    port.reset()
    assert port.data() is False


def test_state_machine_init_in_active_is_the_peers_reset():
    port = bring_to_armed(LinkStateMachine())
    port.heard(init=False)
    assert port.state == port.ACTIVE
    assert port.heard(init=True) is True
    assert port.state == port.INIT and port.heard_init and port.link_inits == 1
    assert port.data() is True, "no reset of ours: nothing stale"
    bring_to_armed(port)
    assert port.state == port.ARMED


def test_flow_control_scheduler_armed_cadence():
    fc = FlowControlScheduler(1, fc_period=1024, fc_min_interval=64)
    sent = []
    for now in range(100):
        vl = fc.choose()
        if vl is not None:
            sent.append(now)
        fc.step(vl, [0], active=False, armed=True)
    # The decision is a register (the first goes at 1), and the timer counts from the
    # cycle after a packet: a cadence of N puts N + 1 cycles between one VL's packets.
    assert sent[:4] == [1 + k * (ARMED_FC_INTERVAL + 1) for k in range(4)]


def test_state_machine_silence_in_active_is_a_failed_link():
    port = bring_to_armed(LinkStateMachine(fc_period=512))
    port.quiet_for(10 ** 6)
    assert port.state == port.ARMED, "only ACTIVE watches for silence (ARMED has its timeout)"
    port.heard(init=False)
    port.quiet_for(8 * 512)
    assert port.state == port.ACTIVE
    port.quiet_for(8 * 512 + 1)
    assert port.state == port.INIT and not port.heard_init and port.link_inits == 1
    assert port.data() is True, "no reset of ours: nothing stale"
    port.heard(init=True)
    bring_to_armed(port)
    assert port.state == port.ARMED
