"""Crossbar (hdl/switch/crossbar.py) in Amaranth's simulator, driven by the switch's start rule
(an input starts to an output with no input queued, at most one a cycle): a scoreboard checks
that every output delivers whole packets in the order they were started to it, beats in order,
none lost or duplicated, skipped packets leave no trace, ``inputs[i].ready`` and ``queueing``
depend on registers only, and a packet queued behind another follows it with no idle cycle."""
import random
from collections import deque

import pytest

from tb.amaranth_sim import simulate

PORTS, VLS, WIDTH = 3, 2, 8


def run(seed, cycles, p_valid, p_ready, p_start, p_skip):
    from hdl.switch.crossbar import Crossbar
    dut = Crossbar(ports=PORTS, num_vls=VLS, width=WIDTH)
    rng = random.Random(seed)
    expected = [deque() for _ in range(PORTS)]      # per output: packets started to it, in order
    delivered = [[] for _ in range(PORTS)]

    async def testbench(ctx):
        current = [None] * PORTS        # per input: [output, beats left to offer, packet, index]
        skipping = [False] * PORTS
        packet_id = 0
        for cycle in range(cycles + 400):
            # Registers only: shown before this cycle's inputs are set, unchanged after.
            shown = [ctx.get(dut.inputs[i].ready) for i in range(PORTS)] + [ctx.get(dut.queueing)]
            queueing = shown[-1]
            released, starting = 0, [0] * PORTS
            for i in range(PORTS):
                cur = current[i]
                if skipping[i]:
                    released |= 1 << i
                    skipping[i] = False
                    current[i] = None
                elif cur is not None:
                    valid = rng.random() < p_valid
                    ctx.set(dut.inputs[i].valid, valid)
                    beats = cur[1]
                    ctx.set(dut.inputs[i].payload.beat.data, (cur[2] << 8) | cur[3])
                    ctx.set(dut.inputs[i].payload.beat.start, cur[3] == 0)
                    ctx.set(dut.inputs[i].payload.beat.end, beats == 1)
                    ctx.set(dut.inputs[i].payload.vl, cur[2] % VLS)
                    if valid and shown[i]:
                        cur[3] += 1
                        cur[1] -= 1
                        if cur[1] == 0:
                            released |= 1 << i
                            current[i] = None
                    continue
                else:
                    ctx.set(dut.inputs[i].valid, 0)
                # Free (idle or finishing): start to an output with no input queued.
                if current[i] is None and cycle < cycles and rng.random() < p_start:
                    o = rng.randrange(PORTS)
                    if not (queueing >> o) & 1 and not starting[o]:
                        starting[o] = 1 << i
                        packet_id += 1
                        if rng.random() < p_skip:
                            skipping[i] = True
                        else:
                            expected[o].append(packet_id)
                        current[i] = [o, rng.randint(1, 6), packet_id, 0]
            ctx.set(dut.released, released)
            for o in range(PORTS):
                ctx.set(dut.starting[o], starting[o])
            ready = [rng.random() < p_ready for _ in range(PORTS)]
            for o in range(PORTS):
                ctx.set(dut.outputs[o].ready, ready[o])
            assert [ctx.get(dut.inputs[i].ready) for i in range(PORTS)] + \
                [ctx.get(dut.queueing)] == shown, f"cycle {cycle}: a port depends on this cycle's inputs"
            for o in range(PORTS):
                if ctx.get(dut.outputs[o].valid) and ready[o]:
                    data = ctx.get(dut.outputs[o].payload.beat.data)
                    delivered[o].append((data >> 8, data & 0xFF,
                                         ctx.get(dut.outputs[o].payload.beat.end),
                                         ctx.get(dut.outputs[o].payload.vl)))
            await ctx.tick()

    simulate(dut, testbench)
    for o in range(PORTS):
        beats = delivered[o]
        packets = []
        for packet, index, end, vl in beats:
            if index == 0:
                packets.append(packet)
            assert packets and packets[-1] == packet, f"output {o}: beats of packets interleaved"
            assert vl == packet % VLS
        assert packets == list(expected[o]), f"output {o}: {packets} != {list(expected[o])}"
    return delivered


@pytest.mark.parametrize("seed,p_valid,p_ready,p_start,p_skip", [
    (1, 0.9, 0.9, 0.3, 0.1), (2, 0.5, 0.4, 0.5, 0.2), (3, 1.0, 0.7, 0.2, 0.0),
    (4, 0.7, 1.0, 0.8, 0.3)])
def test_packets_whole_and_in_start_order(seed, p_valid, p_ready, p_start, p_skip):
    delivered = run(seed, 800, p_valid, p_ready, p_start, p_skip)
    assert sum(map(len, delivered)) > 250


def test_queued_packet_follows_with_no_idle_cycle():
    """Valid and ready always, inputs always starting: every output takes a beat every cycle
    once it is busy (a queued input becomes the holder as the holder's last beat goes)."""
    from hdl.switch.crossbar import Crossbar
    dut = Crossbar(ports=2, num_vls=1, width=WIDTH)

    async def testbench(ctx):
        # Both inputs send 3-beat packets to output 0; input 1 starts while input 0 holds it.
        ctx.set(dut.outputs[0].ready, 1)
        left = [0, 0]
        busy = []
        for cycle in range(60):
            queueing = ctx.get(dut.queueing)
            ready = [ctx.get(dut.inputs[i].ready) for i in range(2)]
            released, starting = 0, 0
            for i in range(2):
                ctx.set(dut.inputs[i].valid, left[i] > 0)
                ctx.set(dut.inputs[i].payload.beat.end, left[i] == 1)
                if left[i] and ready[i]:
                    left[i] -= 1
                    released |= (left[i] == 0) << i
                # Idle or finishing, and output 0 has no input queued: start the next packet.
                if not left[i] and not queueing & 1 and not starting:
                    starting, left[i] = 1 << i, 3
            ctx.set(dut.released, released)
            ctx.set(dut.starting[0], starting)
            busy.append(ctx.get(dut.outputs[0].valid))
            await ctx.tick()
        assert all(busy[4:]), busy

    simulate(dut, testbench)
