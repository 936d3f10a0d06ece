"""HeadQueue (hdl/switch/head_queue.py) in Amaranth's simulator against ``lib.fifo.SyncFIFO``'s
timing: random writes and reads (full and empty included); a scoreboard checks every word comes
out once, in order, from the cycle after it was written, that ``r_rdy``, ``level`` and ``w_rdy``
are what a first-word-fall-through FIFO shows, and that ``r_data``, ``r_rdy`` and ``level``
depend on registers only (they do not change with the same cycle's inputs)."""
import random
from collections import deque

import pytest

from tb.amaranth_sim import assert_rejected, simulate


@pytest.mark.parametrize("depth,seed,p_write,p_read", [
    (2, 1, 0.6, 0.5), (3, 2, 0.9, 0.3), (5, 3, 0.4, 0.9), (16, 4, 0.7, 0.6), (7, 5, 1.0, 1.0)])
def test_against_a_fifo(depth, seed, p_write, p_read):
    from hdl.switch.head_queue import HeadQueue
    dut = HeadQueue(width=8, depth=depth)
    rng = random.Random(seed)
    held = deque()
    written_at = {}
    cycles = 3000
    counts = {"read": 0, "full": 0}

    async def testbench(ctx):
        value = 0
        for cycle in range(cycles + 2 * depth + 2):
            shown = (ctx.get(dut.r_rdy), ctx.get(dut.r_data), ctx.get(dut.level))
            write = cycle < cycles and rng.random() < p_write
            read = rng.random() < p_read or cycle >= cycles
            ctx.set(dut.w_en, write)
            ctx.set(dut.w_data, value)
            ctx.set(dut.r_en, read)
            assert (ctx.get(dut.r_rdy), ctx.get(dut.r_data), ctx.get(dut.level)) == shown
            r_rdy, r_data, level = shown
            assert level == len(held), (cycle, level, len(held))
            assert r_rdy == bool(held), (cycle, r_rdy)
            assert ctx.get(dut.w_rdy) == (len(held) < depth), cycle
            took = r_rdy and read
            if r_rdy:
                assert r_data == held[0], (cycle, r_data, held[0])
                assert written_at[held[0]] < cycle
            if write and len(held) < depth:
                held.append(value)
                written_at[value] = cycle
                value = (value + 1) & 0xFF
            elif write:
                counts["full"] += 1
            if took:
                held.popleft()
                counts["read"] += 1
            await ctx.tick()
        assert not held, f"left undelivered: {list(held)}"

    simulate(dut, testbench)
    assert counts["read"] > cycles * min(p_write, p_read) * 0.5
    if depth <= 3 and p_write > p_read:
        assert counts["full"], "the full case was never reached"


@pytest.mark.parametrize("kwargs", [dict(width=0, depth=4), dict(width=8, depth=1),
                                    dict(width=8, depth=2.5)])
def test_parameters_validated(kwargs):
    from hdl.switch.head_queue import HeadQueue
    assert_rejected(HeadQueue, kwargs)
