"""SwitchAllocator in Amaranth's simulator: queues, readers and transmitters modelled in Python
around it, a match started in its own cycle or later; every new or pending match must be a legal
matching of queued heads, every packet must start
with downstream credit for all of it (checked where the transmitter counts it), and every packet
must be matched in the end."""
import random
from collections import deque

import pytest

from tb.amaranth_sim import assert_rejected, simulate

DOWNSTREAM_BLOCKS = 132


def run(ports, num_vls, *, seed, cycles, load, returns_after, max_blocks=65,
        downstream=DOWNSTREAM_BLOCKS, sizes=(1, 2, 3, 8, 32, 65), skip_rate=0.05):
    from hdl.switch.switch_allocator import SwitchAllocator
    dut = SwitchAllocator(ports=ports, num_vls=num_vls, max_blocks=max_blocks)
    rng = random.Random(seed)
    P, V = ports, num_vls
    queues = {(i, o, v): deque() for i in range(P) for o in range(P) for v in range(V)}
    limit = {(o, v): downstream for o in range(P) for v in range(V)}
    fctbs = {(o, v): 0 for o in range(P) for v in range(V)}
    returns = []                    # (cycle, (o, v), blocks): downstream frees them
    in_busy = [0] * P               # reader busy until (exclusive)
    out_busy = [0] * P
    takes = [deque() for _ in range(P)]     # per output, in start order: (from cycle, v, blocks,
    #                                         skipped unsent): the transmitter counts the packet
    stats = {"matched": 0, "queued": 0}

    async def testbench(ctx):
        for cycle in range(cycles + 20000):
            if cycle < cycles:
                for i in range(P):
                    if rng.random() < load:
                        o, v = rng.randrange(P), rng.randrange(V)
                        queues[i, o, v].append(rng.choice(sizes))
                        stats["queued"] += 1
            elif not any(queues.values()) and not ctx.get(dut.pend) and not ctx.get(dut.match):
                break
            for when, key, blocks in [r for r in returns if r[0] == cycle]:
                limit[key] = (limit[key] + blocks) & 0xFFF
            pend = ctx.get(dut.pend)
            match = ctx.get(dut.match)
            assert not pend & match, f"cycle {cycle}: a match already pending"
            pend |= match           # a match may start in its own cycle
            counted = skipped = 0
            for o in range(P):
                # One start beat a cycle, in order; beside it a skip of the next packet.
                if takes[o] and takes[o][0][0] <= cycle and not takes[o][0][3]:
                    when, v, blocks, _ = takes[o].popleft()
                    # The transmitter's own test: the packet must fit in what is left.
                    room = (limit[o, v] - (fctbs[o, v] + blocks)) & 0xFFF
                    assert room <= 2048, (f"cycle {cycle}: output {o} VL {v} sends {blocks} "
                                          f"blocks with FCCL {limit[o, v]} FCTBS {fctbs[o, v]}")
                    # FCTBS counts it in the cycle `counted` says so.
                    fctbs[o, v] = (fctbs[o, v] + blocks) & 0xFFF
                    returns.append((cycle + rng.randrange(*returns_after), (o, v), blocks))
                    counted |= 1 << o
                if takes[o] and takes[o][0][0] <= cycle and takes[o][0][3]:
                    takes[o].popleft()
                    skipped |= 1 << o
            start = 0
            starting = {}
            for i in range(P):
                row = pend >> (i * P) & ((1 << P) - 1)
                assert row & (row - 1) == 0, f"cycle {cycle}: input {i} matched twice"
                if not row:
                    continue
                o = row.bit_length() - 1
                v = ctx.get(dut.pend_vl[o])
                assert queues[i, o, v], f"cycle {cycle}: {i}->{o} VL {v} matched with no packet"
                if in_busy[i] <= cycle and out_busy[o] <= cycle and rng.random() < 0.8:
                    start |= 1 << i
                    starting[i] = o, v
            for o in range(P):
                column = [i for i in range(P) if pend >> (i * P + o) & 1]
                assert len(column) <= 1, f"cycle {cycle}: output {o} matched to {column}"
            ctx.set(dut.start, start)
            ctx.set(dut.counted, counted)
            ctx.set(dut.skipped, skipped)
            valid = 0
            for (i, o, v), q in queues.items():
                if q:
                    valid |= 1 << ((i * P + o) * V + v)
                ctx.set(dut.head_blocks[i][o][v], q[0] if q else rng.randrange(1 << 12))
            ctx.set(dut.head_valid, valid)
            for o in range(P):
                for v in range(V):
                    ctx.set(dut.credit_limit[o][v], limit[o, v])
                    ctx.set(dut.fctbs[o][v], fctbs[o, v])
                    ctx.set(dut.vl_weight[o][v], 16)
            # Ready a few cycles ahead of free, as the switch predicts it (sometimes wrongly).
            ctx.set(dut.in_ready, sum(1 << i for i in range(P) if in_busy[i] <= cycle + 3))
            ctx.set(dut.out_ready, sum(1 << o for o in range(P)
                                       if out_busy[o] <= cycle + 3 and rng.random() < 0.95))
            await ctx.tick()
            for i, (o, v) in starting.items():
                blocks = queues[i, o, v].popleft()
                in_busy[i] = out_busy[o] = cycle + 1 + blocks
                takes[o].append((cycle + 1 + rng.choice([0, 0, 1, 3]), v, blocks,
                                 rng.random() < skip_rate))
                stats["matched"] += 1
        assert not any(queues.values()), "packets never matched"
        assert stats["matched"] == stats["queued"] > 0

    simulate(dut, testbench)
    return stats


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.full)])
def test_random_load_credit_safe_and_complete(seed):
    """Mixed sizes, tight downstream credit (returns 10-300 cycles after a packet is counted)."""
    run(4, 2, seed=seed, cycles=1500, load=0.08, returns_after=(10, 300))


def test_credit_for_one_packet_at_a_time():
    """Downstream room for about one packet, returned at once: every allocation waits for the
    previous packet's count, the tightest case for the credit hold."""
    run(2, 1, seed=4, cycles=1500, load=0.2, returns_after=(1, 3), downstream=40,
        sizes=(1, 2, 20, 39, 40))


def test_one_vl_heavy_load():
    run(3, 1, seed=3, cycles=1500, load=0.3, returns_after=(1, 40))


@pytest.mark.parametrize("kwargs", [dict(ports=1), dict(ports=17), dict(num_vls=0),
                                    dict(num_vls=5), dict(max_blocks=0), dict(max_blocks=2048),
                                    dict(short_blocks=0), dict(short_blocks=66),
                                    dict(short_matches=2), dict(short_matches=16),
                                    dict(max_blocks=2047, short_blocks=200, short_matches=15)])
def test_parameters_validated(kwargs):
    from hdl.switch.switch_allocator import SwitchAllocator
    assert_rejected(SwitchAllocator, kwargs)


def stream_starts(sizes, *, inputs=3, count_after=3, **params):
    """Inputs 1..``inputs`` each queue the packets of ``sizes`` (blocks) for output 0 on VL 0,
    downstream credit ample; a packet starts as soon as its ports are free (64-byte beats: a
    port is busy a cycle per block), the transmitter counts it ``count_after`` cycles after its
    start (the switch: the crossbar's skid register, the transmitter's beat register, the
    registered count); ``params``: the allocator's. Returns the start cycles at output 0,
    their blocks and inputs, in order."""
    from hdl.switch.switch_allocator import SwitchAllocator
    P = inputs + 1
    dut = SwitchAllocator(ports=P, num_vls=1, max_blocks=65, **params)
    queues = [deque(sizes if i else ()) for i in range(P)]
    in_busy = [0] * P
    out_busy = 0
    counts = deque()                # cycles at which the transmitter counts a started packet
    starts = []

    async def testbench(ctx):
        nonlocal out_busy
        fctbs = 0
        for o in range(P):
            ctx.set(dut.credit_limit[o][0], 2000)
            ctx.set(dut.vl_weight[o][0], 255)
        for cycle in range(40 * len(sizes) * inputs + 100):
            pend = ctx.get(dut.pend) | ctx.get(dut.match)
            counted = 0
            if counts and counts[0][0] == cycle:
                fctbs += counts.popleft()[1]
                counted = 1
            start = 0
            for i in range(P):
                if pend >> (i * P) & 1 and in_busy[i] <= cycle and out_busy <= cycle:
                    start |= 1 << i
                    blocks = queues[i][0]           # leaves its queue after this cycle
                    starts.append((cycle, blocks, i))
                    in_busy[i] = out_busy = cycle + blocks
                    counts.append((cycle + count_after, blocks))
            ctx.set(dut.start, start)
            ctx.set(dut.counted, counted)
            ctx.set(dut.fctbs[0][0], fctbs)
            valid = 0
            for i in range(P):
                if queues[i]:
                    valid |= 1 << (i * P)
                ctx.set(dut.head_blocks[i][0][0], queues[i][0] if queues[i] else 0)
            ctx.set(dut.head_valid, valid)
            # Offered ahead as the switch offers a port: 3 beats before it frees.
            ctx.set(dut.in_ready, sum(1 << i for i in range(P) if in_busy[i] <= cycle + 3))
            ctx.set(dut.out_ready, (1 << P) - 1 if out_busy <= cycle + 3 else ~1 & ((1 << P) - 1))
            await ctx.tick()
            for i in range(P):
                if start >> i & 1:
                    queues[i].popleft()
            if not any(queues) and not counts:
                break
        assert not any(queues), "packets never started"

    simulate(dut, testbench)
    return starts


def spacing(starts):
    """Cycles between one start and the next, start beat to start beat, less the first
    packet's beats (0: back to back)."""
    return [b[0] - a[0] - a[1] for a, b in zip(starts, starts[1:])]


def model_starts(sizes, *, inputs=3):
    """The switch model's figure for :func:`stream_starts`: the pipelined allocator's timing
    (``RTL_ALLOCATORS["pipelined"]``) with its credit hold and short-packet rule; each
    packet's start beat out and beats (= blocks at 64-byte beats), in order."""
    from models.switch import RTL_ALLOCATORS, Router, stream_to_one_output
    router = Router(inputs + 1, 1, **RTL_ALLOCATORS["pipelined"])
    return stream_to_one_output(router, range(1, inputs + 1), [64 * size - 32 for size in sizes])


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6])
def test_short_packets_to_one_output_as_the_model_says(size):
    """Three inputs stream packets of one size into one output: packets of at most
    short_blocks (4) blocks leave back to back once the stream runs, longer ones wait for
    their predecessor's count (5 blocks: gaps of 2 cycles after its 5 beats); the RTL's gaps,
    start to start less the packet's beats, are the model's to the stream's end."""
    rtl = spacing(stream_starts([size] * 8))
    model = spacing(model_starts([size] * 8))
    assert rtl == model, f"RTL {rtl}\nmodel {model}"
    short = size <= 4
    assert (max(model[1:]) == 0) == short, model


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6])
def test_inputs_served_in_turn(size):
    """Three inputs stream packets of one size into one output: served in turn to the end, as
    the model serves them (1 2 3 1 2 3 ...). Until 2026-12-07 the 2-block stream starved one
    input (1 2 3 2 3 ... 2 3, then input 1's others alone): an input whose grant was dropped
    sat out the next requests, in step with the output's pending cycles (docs/switch.md,
    Which inputs request)."""
    order = [i for _, _, i in stream_starts([size] * 8)]
    assert order == [1, 2, 3] * 8, order


def test_long_packet_behind_short_ones_waits_for_them():
    """Short packets, then a 20-block one, then short ones again: the long one starts only
    after every short packet before it is counted, and nothing starts while it is uncounted;
    the credit test of :func:`run` with room for just the long packet and the reserve."""
    starts = stream_starts([1, 1, 1, 20, 1, 1])
    long_at = next(n for n, (_, blocks, _) in enumerate(starts) if blocks == 20)
    before, (start, _, _), after = starts[long_at - 1], starts[long_at], starts[long_at + 1]
    # The packet before it is counted 3 cycles after its start, the view has it 4 later.
    assert start >= before[0] + 3 + 4
    assert after[0] >= start + 20
    run(3, 1, seed=5, cycles=1500, load=0.3, returns_after=(1, 20), downstream=40,
        sizes=(1, 1, 2, 4, 30))
