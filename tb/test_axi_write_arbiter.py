"""AxiWriteArbiter (hdl/nic/axi_write_arbiter.py) in Amaranth's simulator.

Three writers (IDs 0, 1, 4) issue random bursts; every channel has random delays: each
writer's AW and W run independently (W may come before its AW, or, for the slow writer,
long after it), the slave takes AW and W at random (a W beat that beats its AW to the
slave waits there), answers B after random delays, out of order across IDs, now and then
with SLVERR or with an ID no writer has, and the writers take B at random.

Checked: every burst reaches the slave once with its writer's AW fields, in each writer's
order; the W beats after each AW are exactly that burst's beats (data, strobes, wlast at
its end), so W follows AW order and never interleaves (and the W slot takes from one
writer's registered beats at most in a cycle); each B reaches only the writer
with its ID, in order, with its response; a B with an unknown ID is taken and dropped;
round robin (a waiting writer loses at most one grant per other waiting writer); and all
of it completes (no deadlock when a writer's W trails its AW). Also: a lone writer, one W
beat per cycle with an always-ready slave, parameter checks, Verilator lint.
"""
import random
from collections import deque

import pytest

from hdl.nic.axi_write_arbiter import AxiWriteArbiter
from tb.amaranth_sim import assert_lint_clean, assert_rejected, simulate

IDS = (0, 1, 4)
UNKNOWN_ID = 5
DATA_BYTES = 64


class Writer:
    def __init__(self, index, id_, rng, bursts, *, p_aw, p_w, w_lag):
        self.index, self.rng = index, rng
        self.id = id_
        self.bursts = bursts            # [(addr, len, [(data, strb)])]
        self.aw_next = 0                # next burst to present on AW
        self.aw_wait = 0
        self.w_beats = deque((b, k) for b, burst in enumerate(bursts) for k in range(burst[1] + 1))
        self.aw_accepted_at = {}        # burst -> cycle its AW was taken
        self.p_aw, self.p_w, self.w_lag = p_aw, p_w, w_lag
        self.aw_on = self.w_on = False
        self.b_next = 0
        self.b_expected = deque()       # responses of completed bursts, in order

    def drive(self, ctx, port, t):
        rng = self.rng
        if not self.aw_on and self.aw_next < len(self.bursts) and rng.random() < self.p_aw:
            self.aw_on = True
        if self.aw_on:
            addr, length, _ = self.bursts[self.aw_next]
            ctx.set(port.awid, self.id)
            ctx.set(port.awaddr, addr)
            ctx.set(port.awlen, length)
            ctx.set(port.awsize, 6)
            ctx.set(port.awburst, 1)
        ctx.set(port.awvalid, self.aw_on)
        if not self.w_on and self.w_beats:
            b, k = self.w_beats[0]
            # The slow writer starts a burst's W only w_lag cycles after its AW was taken.
            lagging = (self.w_lag and k == 0
                       and not (b in self.aw_accepted_at and t >= self.aw_accepted_at[b] + self.w_lag))
            if not lagging and rng.random() < self.p_w:
                self.w_on = True
        if self.w_on:
            b, k = self.w_beats[0]
            data, strb = self.bursts[b][2][k]
            ctx.set(port.wdata, data)
            ctx.set(port.wstrb, strb)
            ctx.set(port.wlast, k == self.bursts[b][1])
        ctx.set(port.wvalid, self.w_on)
        self.bready = rng.random() < 0.7
        ctx.set(port.bready, self.bready)

    def sample(self, ctx, port, t):
        if self.aw_on and ctx.get(port.awready):
            self.aw_accepted_at[self.aw_next] = t
            self.aw_next += 1
            self.aw_on = False
        if self.w_on and ctx.get(port.wready):
            self.w_beats.popleft()
            self.w_on = False
        if ctx.get(port.bvalid) and self.bready:
            assert ctx.get(port.bid) == self.id, (t, self.index)
            assert self.b_expected, (t, self.index, "B without a burst")
            assert ctx.get(port.bresp) == self.b_expected.popleft(), (t, self.index)
            self.b_next += 1

    def done(self):
        return self.b_next == len(self.bursts)


def random_bursts(rng, count):
    bursts = []
    for _ in range(count):
        length = rng.choice([0, 0, 1, 3, rng.randrange(16)])
        beats = [(rng.getrandbits(8 * DATA_BYTES), rng.getrandbits(DATA_BYTES)) for _ in range(length + 1)]
        bursts.append((rng.randrange(1 << 20) * 64, length, beats))
    return bursts


def run_arbiter(seed, *, ids=IDS, counts=(25, 25, 10), p_aw=(0.5, 0.3, 0.8), p_w=(0.6, 0.9, 0.5),
                w_lag=(0, 0, 60), p_awready=0.6, p_wready=0.7, limit=20000):
    rng = random.Random(seed)
    n = len(ids)
    dut = AxiWriteArbiter(ids=ids, addr_width=32, data_bytes=DATA_BYTES)
    writers = [Writer(i, ids[i], rng, random_bursts(rng, counts[i]), p_aw=p_aw[i], p_w=p_w[i],
                      w_lag=w_lag[i]) for i in range(n)]
    by_id = {ids[i]: writers[i] for i in range(n)}
    w_cycles = []

    async def testbench(ctx):
        axi = dut.axi
        aw_seen = {i: 0 for i in range(n)}      # bursts per writer reached the slave
        aw_queue = deque()                      # [writer, burst, beats received]
        w_early = deque()                       # W beats ahead of their AW at the slave
        b_due = {id_: deque() for id_ in ids}   # per ID: (due, resp)
        b_cur = None
        lost = {i: 0 for i in range(n)}
        for t in range(limit):
            for i, w in enumerate(writers):
                w.drive(ctx, dut.writers[i], t)
            awready = rng.random() < p_awready
            wready = rng.random() < p_wready
            ctx.set(axi.awready, awready)
            ctx.set(axi.wready, wready)
            if b_cur is None:
                ready_ids = [id_ for id_ in ids if b_due[id_] and b_due[id_][0][0] <= t]
                if rng.random() < 0.02:
                    b_cur = (UNKNOWN_ID, 0)
                elif ready_ids:
                    id_ = rng.choice(ready_ids)
                    b_cur = (id_, b_due[id_].popleft()[1])
            ctx.set(axi.bvalid, b_cur is not None)
            if b_cur is not None:
                ctx.set(axi.bid, b_cur[0])
                ctx.set(axi.bresp, b_cur[1])

            # Round robin among the registered AW requests while the slot can take one.
            held = [register.o for register in dut.aw_registers]
            offering = [i for i in range(n) if ctx.get(held[i].valid)]
            granted = [i for i in range(n) if ctx.get(held[i].valid) and ctx.get(held[i].ready)]
            assert len(granted) <= 1 and all(i in offering for i in granted), t
            if granted:
                for i in offering:
                    if i == granted[0]:
                        lost[i] = 0
                    else:
                        lost[i] += 1
                        assert lost[i] <= n - 1, (t, "round robin: writer passed over", i)
            # The W slot takes from one writer's registered beats at most.
            w_taking = [i for i, register in enumerate(dut.w_registers)
                        if ctx.get(register.o.valid) and ctx.get(register.o.ready)]
            assert len(w_taking) <= 1, t

            if ctx.get(axi.awvalid) and awready:
                id_ = ctx.get(axi.awid)
                assert id_ in by_id, (t, id_)
                w = by_id[id_]
                b = aw_seen[w.index]
                addr, length, _ = w.bursts[b]
                assert (ctx.get(axi.awaddr), ctx.get(axi.awlen), ctx.get(axi.awsize),
                        ctx.get(axi.awburst)) == (addr, length, 6, 1), (t, w.index, b)
                aw_seen[w.index] += 1
                aw_queue.append([w, b, 0])
            if ctx.get(axi.wvalid) and wready:
                w_early.append((ctx.get(axi.wdata), ctx.get(axi.wstrb), ctx.get(axi.wlast)))
                w_cycles.append(t)
            while w_early and aw_queue:
                data, strb, last = w_early.popleft()
                entry = aw_queue[0]
                w, b, k = entry
                assert (data, strb) == w.bursts[b][2][k], (t, "W beat of another burst", w.index, b, k)
                assert last == (k == w.bursts[b][1]), (t, "wlast", w.index, b, k)
                entry[2] += 1
                if last:
                    aw_queue.popleft()
                    resp = 2 if rng.random() < 0.1 else 0
                    w.b_expected.append(resp)
                    b_due[w.id].append((t + rng.randint(1, 30), resp))
            if b_cur is not None:
                bid = b_cur[0]
                if bid in by_id:
                    target = by_id[bid]
                    assert ctx.get(axi.bready) == target.bready, t
                    for other in writers:
                        assert ctx.get(dut.writers[other.index].bvalid) == (other is target), t
                    if target.bready:
                        b_cur = None
                else:
                    assert ctx.get(axi.bready), t
                    assert not any(ctx.get(dut.writers[i].bvalid) for i in range(n)), t
                    b_cur = None
            for i, w in enumerate(writers):
                w.sample(ctx, dut.writers[i], t)
            await ctx.tick()
            if all(w.done() for w in writers):
                break
        else:
            raise AssertionError(("deadlock or too slow", [w.b_next for w in writers],
                                  [w.aw_next for w in writers], [len(w.w_beats) for w in writers]))
        assert not w_early and not aw_queue

    simulate(dut, testbench)
    return w_cycles


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random(seed):
    run_arbiter(seed)


def test_w_long_after_aw():
    """Every writer's W trails its AW by many cycles: nothing deadlocks."""
    run_arbiter(9, counts=(10, 10, 10), p_aw=(1, 1, 1), p_w=(1, 1, 1), w_lag=(40, 5, 80))


def test_one_writer():
    run_arbiter(6, ids=(3,), counts=(30,), p_aw=(0.7,), p_w=(0.7,), w_lag=(0,))


def test_fast_slave():
    """Always-ready slave, eager writers: one W beat per cycle across bursts and writers."""
    w_cycles = run_arbiter(4, counts=(20, 20, 20), p_aw=(1, 1, 1), p_w=(1, 1, 1),
                           w_lag=(0, 0, 0), p_awready=1, p_wready=1)
    assert w_cycles[-1] - w_cycles[0] + 1 == len(w_cycles)


@pytest.mark.parametrize("args", [
    {"ids": ()}, {"ids": (0, 0)}, {"ids": (8,)}, {"ids": (-1,)},
    {"ids": (0, 1), "addr_width": 11}, {"ids": (0, 1), "data_bytes": 48},
])
def test_parameters(args):
    assert_rejected(AxiWriteArbiter, args)


@pytest.mark.parametrize("ids", [(3,), IDS])
def test_lint(tmp_path, ids):
    """Verilator lints the Verilog clean, a lone writer included (no zero-width signals)."""
    assert_lint_clean(AxiWriteArbiter(ids=ids), "axi_write_arbiter", tmp_path)
