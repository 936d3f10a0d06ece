"""AxiReadArbiter (Amaranth simulator) and the simulation-only AxiReadDelay.

The arbiter: two readers issue random bursts under random AR backpressure; every burst
reaches the AR channel exactly once with its reader's ID, in each reader's order, and
neither reader waits more than one grant when both ask (round robin). R beats come back
interleaved across IDs with random gaps and reader backpressure; each reader gets exactly
its own beats, in order; beats with an unknown RID are dropped and counted.

The delay: every request leaves ``max(latency, MIN_LATENCY)`` cycles after it was
accepted (when the RAM is ready and nothing queues ahead of it), in order, and a full queue pushes back.
"""
import random

import pytest

from hdl.nic.axi_read_arbiter import AxiReadArbiter
from tb.gateware.axi_read_delay import MIN_LATENCY, AxiReadDelay
from tb.amaranth_sim import simulate


def run(dut, testbench, *processes):
    simulate(dut, testbench, background=processes)


@pytest.mark.parametrize("seed,readers", [(1, 2), (2, 2), (3, 5), (4, 8)])
def test_arbiter_random(seed, readers):
    rng = random.Random(seed)
    dut = AxiReadArbiter(readers=readers, addr_width=32, data_bytes=64)
    bursts = {i: [(rng.randrange(1 << 26) * 64, rng.randrange(4)) for _ in range(60)]
              for i in range(readers)}
    issued = []                 # (id, addr, len) in AR order
    received = {i: [] for i in range(readers)}
    r_queue = []                # (rid, data, last) the slave will return
    bad_rid = readers if readers < 8 else None

    async def testbench(ctx):
        pending = {i: list(bursts[i]) for i in range(readers)}
        streak = dict.fromkeys(range(readers), 0)
        bad_sent = 0
        for cycle in range(3000 * readers // 2):
            for i in range(readers):
                request = dut.requests[i]
                if pending[i]:
                    addr, length = pending[i][0]
                    ctx.set(request.valid, 1)
                    ctx.set(request.payload, {"id": i, "addr": addr, "len": length})
                else:
                    ctx.set(request.valid, 0)
            ar_ready = rng.random() < 0.7
            ctx.set(dut.axi.arready, ar_ready)
            # Slave R side: random gaps, interleaved IDs, an occasional bad RID.
            if r_queue and rng.random() < 0.8:
                rid, data, last = r_queue[0]
                ctx.set(dut.axi.rvalid, 1)
                ctx.set(dut.axi.rid, rid)
                ctx.set(dut.axi.rdata, data)
                ctx.set(dut.axi.rlast, last)
            else:
                ctx.set(dut.axi.rvalid, 0)
            for i in range(readers):
                ctx.set(dut.responses[i].ready, rng.random() < 0.8)
            took = [ctx.get(dut.requests[i].ready) and bool(pending[i]) for i in range(readers)]
            assert sum(took) <= 1
            for i in range(readers):
                if took[i]:
                    pending[i].pop(0)
                    streak[i] = 0
                elif pending[i] and any(took):
                    streak[i] += 1
                    assert streak[i] < readers, "round robin: a waiting reader was passed over"
            if ctx.get(dut.axi.arvalid) and ar_ready:
                burst = (ctx.get(dut.axi.arid), ctx.get(dut.axi.araddr), ctx.get(dut.axi.arlen))
                assert ctx.get(dut.axi.arsize) == 6 and ctx.get(dut.axi.arburst) == 1
                issued.append(burst)
                for beat in range(burst[2] + 1):
                    r_queue.append((burst[0], rng.getrandbits(512), beat == burst[2]))
                if bad_rid is not None and rng.random() < 0.05:
                    r_queue.append((bad_rid, 0, 1))
                    bad_sent += 1
            if ctx.get(dut.axi.rvalid) and ctx.get(dut.axi.rready):
                rid, data, last = r_queue.pop(0)
                if rid < readers:
                    assert ctx.get(dut.responses[rid].valid)
                    assert ctx.get(dut.responses[rid].payload.data) == data
                    received[rid].append((data, last))
                assert not any(ctx.get(dut.responses[i].valid) for i in range(readers) if i != rid)
            await ctx.tick()
        assert not any(pending.values()) and not r_queue
        assert ctx.get(dut.bad_rid_beats) == bad_sent

    run(dut, testbench)
    for i in range(readers):
        mine = [(a, n) for rid, a, n in issued if rid == i]
        assert mine == bursts[i]
        assert len(received[i]) == sum(n + 1 for _, n in bursts[i])


def test_reader_count_checked():
    for readers in (0, 9, 2.0):
        with pytest.raises(ValueError, match="Readers must be 1 to 8"):
            AxiReadArbiter(readers=readers)


@pytest.mark.parametrize("latency", [0, 1, 7, 100])
def test_read_delay(latency):
    rng = random.Random(latency)
    dut = AxiReadDelay(addr_width=32, depth=8, max_latency=255)
    accepted, released = [], []

    async def testbench(ctx):
        ctx.set(dut.latency, latency)
        sent = 0
        for cycle in range(latency * 4 + 400):
            offer = sent < 50 and rng.random() < 0.6
            ctx.set(dut.up_arvalid, offer)
            ctx.set(dut.up_araddr, sent * 64)
            ready = rng.random() < 0.9
            ctx.set(dut.down_arready, ready)
            if offer and ctx.get(dut.up_arready):
                accepted.append((sent * 64, cycle))
                sent += 1
            if ctx.get(dut.down_arvalid) and ready:
                released.append((ctx.get(dut.down_araddr), cycle))
            await ctx.tick()

    run(dut, testbench)
    assert [a for a, _ in released] == [a for a, _ in accepted]
    # The queue itself takes 2 cycles: that is the shortest latency the block gives.
    expected = max(latency, MIN_LATENCY)
    delays = [b - a for (_, a), (_, b) in zip(accepted, released)]
    assert min(delays) == expected
    # Only RAM backpressure or a request queued behind a later-due one adds to it.
    assert sum(d == expected for d in delays) >= len(delays) // 2
