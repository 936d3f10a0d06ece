"""PacketMux (hdl/nic/packet_mux.py) in Amaranth's simulator.

Each input offers random packets (1..8 beats, random data, ``end_bad`` now and then,
some with ``start`` cleared on their first beat: framing is by ``end`` alone) with random
gaps between beats and between packets; the output's ``ready`` is random. Checked: every
packet comes out whole and unchanged (beat by beat, flags included), never interleaved
with another, each input's packets in order; round robin: whenever an input's first beat
is taken, every other input that had a beat waiting has been passed over at most
``inputs - 1`` times in a row; no beat is lost or invented. Directed: all inputs always
busy with the output always ready (strict rotation, a beat every cycle, no bubble
between packets), single-beat packets, one input.
"""
import gc
import random
import warnings
from collections import deque

import pytest
from amaranth.hdl import UnusedElaboratable

from hdl.nic.packet_mux import PacketMux
from tb.amaranth_sim import simulate

WIDTH = 64


def random_packet(rng, tag, max_beats=8):
    beats = []
    count = rng.randint(1, max_beats)
    bad = rng.random() < 0.1
    headless = rng.random() < 0.05
    for index in range(count):
        last = index == count - 1
        beats.append(dict(data=(rng.getrandbits(8 * WIDTH - 32) << 32) | (tag << 8) | index,
                          start=int(index == 0 and not headless), end=int(last),
                          count=rng.randint(1, WIDTH) if last else WIDTH,
                          end_bad=int(last and bad)))
    return beats


def run(*, inputs=2, packets=60, seed=0, gap=0.3, ready=0.7, max_beats=8, max_cycles=20_000):
    rng = random.Random(seed)
    dut = PacketMux(inputs=inputs)
    sources = [deque(random_packet(rng, (i << 16) | k, max_beats) for k in range(packets))
               for i in range(inputs)]
    sent = [list(s) for s in sources]     # what each input offered, in order
    result = dict(cycles=0, beats=0, grants=[], spans=[])

    async def bench(ctx):
        current = [None] * inputs         # beats left of the packet being offered
        offering = [None] * inputs        # the beat on offer (held until taken)
        skipped = [0] * inputs
        received = [[] for _ in range(inputs)]
        partial = None                    # (input, beats so far) of the packet coming out
        cycle = 0
        start_cycle = None
        while True:
            for i in range(inputs):
                if offering[i] is None:
                    if current[i] is None and sources[i] and rng.random() >= gap:
                        current[i] = deque(sources[i].popleft())
                    if current[i] and rng.random() >= gap:
                        offering[i] = current[i].popleft()
                        if not current[i]:
                            current[i] = None
                if offering[i] is not None:
                    ctx.set(dut.inputs[i].payload, offering[i])
                ctx.set(dut.inputs[i].valid, offering[i] is not None)
            ctx.set(dut.output.ready, rng.random() < ready)

            taken = [offering[i] is not None and ctx.get(dut.inputs[i].ready) for i in range(inputs)]
            assert sum(taken) <= 1, f"cycle {cycle}: two inputs taken at once"
            for i in range(inputs):
                if taken[i] and offering[i]["data"] & 0xFF == 0:
                    # A packet's first beat: who else was waiting and is passed over.
                    for j in range(inputs):
                        if j != i and offering[j] is not None:
                            skipped[j] += 1
                            assert skipped[j] <= inputs - 1, (
                                f"cycle {cycle}: input {j} passed over {skipped[j]} times")
                    skipped[i] = 0
                    result["grants"].append(i)
            for i in range(inputs):
                if taken[i]:
                    offering[i] = None

            if ctx.get(dut.output.valid) and ctx.get(dut.output.ready):
                out = ctx.get(dut.output.payload)
                beat = dict(data=out.data, start=out.start, end=out.end, count=out.count,
                            end_bad=out.end_bad)
                tag = (beat["data"] >> 8) & 0xFFFFFF
                source = tag >> 16
                if start_cycle is None:
                    start_cycle = cycle
                result["beats"] += 1
                if partial is None:
                    assert beat["data"] & 0xFF == 0, f"cycle {cycle}: packet does not begin with its first beat"
                    partial = (source, [], cycle)
                assert partial[0] == source, f"cycle {cycle}: input {source} interleaved into input {partial[0]}'s packet"
                partial[1].append(beat)
                if beat["end"]:
                    received[source].append(partial[1])
                    result["spans"].append((partial[2], cycle))
                    partial = None

            await ctx.tick()
            cycle += 1
            if all(len(received[i]) == len(sent[i]) for i in range(inputs)):
                break
            assert cycle < max_cycles, "did not finish"
        for i in range(inputs):
            assert received[i] == sent[i], f"input {i}: packets differ or out of order"
        result["cycles"] = cycle - start_cycle

    simulate(dut, bench)
    return result


@pytest.mark.parametrize("inputs,seed", [(2, 1), (2, 2), (3, 3)])
def test_random(inputs, seed):
    """Random packets, gaps and output backpressure."""
    run(inputs=inputs, seed=seed)


def test_saturated_rotation():
    """Every input always has a packet and the output is always ready: grants rotate
    strictly and a beat leaves every cycle, across packet boundaries."""
    for inputs in (2, 3):
        result = run(inputs=inputs, packets=20, seed=4, gap=0, ready=1.1)
        grants = result["grants"]
        assert grants == [(grants[0] + k) % inputs for k in range(20 * inputs)], grants
        assert result["beats"] == result["cycles"], (result["beats"], result["cycles"])


def test_single_beat_packets():
    result = run(inputs=2, packets=40, seed=5, gap=0, ready=1.1, max_beats=1)
    assert result["beats"] == result["cycles"] == 80
    grants = result["grants"]
    assert grants == [(grants[0] + k) % 2 for k in range(80)], grants


def test_one_input():
    run(inputs=1, packets=30, seed=6)


@pytest.mark.parametrize("args", [dict(inputs=0), dict(inputs=17), dict(inputs=2.0)])
def test_parameters(args):
    # The half-built component would warn, when collected, that it was never elaborated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match="inputs"):
                PacketMux(**args)
        finally:
            gc.collect()
