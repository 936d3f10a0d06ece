"""ReceiveQueue (hdl/nic/receive_queue.py) against a Python reference, in Amaranth's simulator.

The bench plays the unit's neighbours cycle by cycle:

* QP contexts and the memory-key table as Python dicts behind the synchronous read ports
  (``data`` is the entry at the previous cycle's ``addr``);
* a request source (a presented request is held until taken) and a result sink with
  random ``ready`` (a presented result must stay, unchanged, until taken);
* a memory answering ``ar`` (id ``RECV_ID``, one beat) with random ``ar.ready``, a random
  latency and injected SLVERR/DECERR (random data with them); the beat carries memory as
  it is when the beat is delivered. Stray R beats arrive while no request is in flight
  (they must be dropped);
* a "host" that posts receive WQEs (``mlx5_wqe_data_seg``, big-endian) into the rings
  and, now and then, writes the doorbell record (``htobe32(head & 0xffff)``, sometimes
  with junk in the high half, sometimes a bogus value behind ``ci`` or too far ahead,
  later corrected); it only reuses a ring slot the unit has consumed (by the results);
* ``qp_reset`` at random times, also of the QP being served (the reset wins over the
  request's write-back) and of QPs the unit does not have; the host starts that QP over.

The reference keeps ``ci``/``pi`` per QP; per request it names the reads it expects
(the doorbell record only when the cached ``pi`` is used up, then the WQE at
``ci mod size``), checks every AR (address, id, length) and, from the bytes the memory
delivered, computes the result; it checks every result and all counters at the end.

Directed: every WQE check by hand (key variant, invalid entry, PD, LOCAL_WRITE, below /
above / straddling the region, wrapping 2^64, ending exactly at 2^64, zero length with a
bad range and with a bad key, an lkey whose index aliases modulo the table); read errors
on the doorbell record and on a WQE; doorbell records behind and too far ahead; the
doorbell record read only when needed; ring wrap; index wrap at 2^16; a QP the unit
does not have; addresses cut to a narrower AXI address; parameter checks.
"""
import gc
import random
import warnings
from collections import deque

import pytest
from amaranth.hdl import UnusedElaboratable

from hdl.nic.receive_queue import ReceiveQueue
from hdl.nic.signatures import RECV_ID, MkeyLayout, QpConfigLayout, RecvResultLayout
from models.mlx5 import data_segment, make_key
from tb.amaranth_sim import Driver, simulate

OK, EMPTY, ERROR = 0, 1, 2
QP_OP, PROT = 0x02, 0x04
LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ = 1, 2, 4
M64 = 1 << 64
RESULT_FIELDS = [(name, f.offset, f.width) for name, f in RecvResultLayout()]


class Probed(ReceiveQueue):
    """The unit with its index memory in reach of the testbench (to start near 2^16)."""

    def elaborate(self, platform):
        m = super().elaborate(platform)
        self.indices = m.submodules["indices"]
        return m


class Memory:
    def __init__(self, rng):
        self.rng = rng
        self.beats = {}

    def beat(self, addr):
        if addr not in self.beats:
            self.beats[addr] = bytearray(self.rng.randbytes(64))
        return self.beats[addr]

    def write(self, addr, data):
        for k, byte in enumerate(data):
            a = (addr + k) % M64
            self.beat(a & ~63)[a % 64] = byte


class Qp:
    def __init__(self, rq_base, log_rq_size, rq_dbr, pd):
        self.rq_base, self.log_rq_size, self.rq_dbr, self.pd = rq_base, log_rq_size, rq_dbr, pd
        self.size = 1 << log_rq_size

    def slot(self, index):
        return ((self.rq_base & ~15) + 16 * (index % self.size)) % M64

    def const(self):
        return QpConfigLayout().const({"rq_base": self.rq_base, "log_rq_size": self.log_rq_size,
                                       "rq_dbr": self.rq_dbr, "pd": self.pd,
                                       "sq_base": 0x1234000, "pkey": 0xFFFF})


def mkey_entry(key, base, length, access, pd, valid=1):
    return dict(key=key, base=base, length=length, access=access, pd=pd, valid=valid)


class Reference:
    def __init__(self, num_qps, num_mkeys, qps, mkeys):
        self.num_qps, self.num_mkeys = num_qps, num_mkeys
        self.qps, self.mkeys = qps, mkeys
        self.state = {q: (0, 0) for q in range(num_qps)}
        self.consumed = self.errors = self.dbr_reads = 0

    def check(self, qp, byte_count, lkey, addr):
        mk = self.mkeys.get((lkey >> 8) % self.num_mkeys)
        if mk is None or not mk["valid"] or mk["key"] != lkey or mk["pd"] != qp.pd:
            return False
        if not mk["access"] & LOCAL_WRITE:
            return False
        end = addr + byte_count
        return byte_count == 0 or (mk["base"] <= addr and end <= mk["base"] + mk["length"]
                                   and end <= M64)

    def request(self, qpn):
        """A generator: yields the beat address of each read it expects and is sent
        (data, resp) for it; returns (result fields, the QP's new (ci, pi) or None)."""
        if qpn >= self.num_qps:
            self.errors += 1
            return dict(status=ERROR, syndrome=QP_OP, addr=0, length=0, wqe_counter=0), None
        qp = self.qps[qpn]
        ci, pi = self.state[qpn]
        base = dict(syndrome=0, addr=0, length=0, wqe_counter=ci)
        if ci == pi:
            dbr = qp.rq_dbr & ~3
            self.dbr_reads += 1
            data, resp = yield dbr & ~63
            if resp:
                self.errors += 1
                return dict(base, status=ERROR, syndrome=QP_OP), None
            new = int.from_bytes(data[dbr % 64:dbr % 64 + 4], "big") & 0xFFFF
            ahead = (new - ci) % (1 << 16)
            if ahead == 0:
                return dict(base, status=EMPTY), None
            if ahead > qp.size:
                self.errors += 1
                return dict(base, status=EMPTY), None
            pi = new
        at = qp.slot(ci)
        data, resp = yield at & ~63
        self.consumed += 1
        after = ((ci + 1) % (1 << 16), pi)
        if resp:
            self.errors += 1
            return dict(base, status=ERROR, syndrome=QP_OP), after
        seg = data[at % 64:at % 64 + 16]
        byte_count = int.from_bytes(seg[0:4], "big")
        lkey = int.from_bytes(seg[4:8], "big")
        addr = int.from_bytes(seg[8:16], "big")
        if self.check(qp, byte_count, lkey, addr):
            return dict(base, status=OK, addr=addr, length=byte_count), after
        self.errors += 1
        return dict(base, status=ERROR, syndrome=PROT), after


class Pending:
    def __init__(self, qpn, gen):
        self.qpn, self.gen = qpn, gen
        self.expect = None          # beat address of the next read
        self.result = None
        self.after = None
        self.reset_hit = False
        self.step(None)

    def step(self, value):
        try:
            self.expect = self.gen.send(value) if value is not None else next(self.gen)
        except StopIteration as stop:
            self.expect = None
            self.result, self.after = stop.value


class Host:
    """Posts receive WQEs and writes doorbell records. ``wqe_maker(rng, qpn, index)``
    gives the 16 bytes of a new WQE."""

    def __init__(self, bench, rng, wqe_maker, *, p_post=0.1, p_dbr=0.3, p_junk=0.1,
                 p_bogus=0.03):
        self.bench, self.rng, self.wqe_maker = bench, rng, wqe_maker
        self.p_post, self.p_dbr, self.p_junk, self.p_bogus = p_post, p_dbr, p_junk, p_bogus
        self.head = {q: 0 for q in bench.qps}

    def write_dbr(self, qpn, value):
        self.bench.mem.write(self.bench.qps[qpn].rq_dbr & ~3, value.to_bytes(4, "big"))

    def step(self):
        rng, bench = self.rng, self.bench
        if rng.random() >= self.p_post + self.p_dbr:
            return
        qpn = rng.choice(list(bench.qps))
        qp = bench.qps[qpn]
        ci = bench.ref.state[qpn][0]
        if rng.random() < self.p_post / (self.p_post + self.p_dbr):
            if (self.head[qpn] - ci) % (1 << 16) < qp.size:
                bench.mem.write(qp.slot(self.head[qpn]), self.wqe_maker(rng, qpn, self.head[qpn]))
                self.head[qpn] = (self.head[qpn] + 1) % (1 << 16)
            return
        if rng.random() < self.p_bogus:
            value = rng.choice([(ci - 1) % (1 << 16), (ci + qp.size + 1) % (1 << 16),
                                (ci + rng.randrange(qp.size + 1, 1 << 16)) % (1 << 16)])
            bench.bogus_written += 1
        else:
            value = self.head[qpn]
        if rng.random() < self.p_junk:
            value |= rng.randrange(1, 1 << 16) << 16
        self.write_dbr(qpn, value)

    def reset(self, qpn):
        if qpn in self.head:
            self.head[qpn] = 0
            self.write_dbr(qpn, 0)


class Bench:
    def __init__(self, dut, rng, qps, mkeys, *, p_req=0.5, p_ar=0.6, latency=(0, 25),
                 p_gap=0.0, p_err=0.03, p_res=0.6, p_reset=0.0, p_stray=0.05):
        self.dut, self.rng = dut, rng
        self.qps, self.mkeys = qps, mkeys
        self.mem = Memory(rng)
        self.ref = Reference(dut.num_qps, dut.num_mkeys, qps, mkeys)
        self.p_req, self.p_ar, self.latency, self.p_gap = p_req, p_ar, latency, p_gap
        self.p_err, self.p_res, self.p_reset, self.p_stray = p_err, p_res, p_reset, p_stray
        self.host = None
        self.results = []           # (qpn, result fields)
        self.bogus_written = 0
        self.resets_in_flight = 0
        self.stray = 0
        self.amask = (1 << dut.addr_width) - 1
        self.cfg_consts = {q: qp.const() for q, qp in qps.items()}
        self.mkey_consts = {i: MkeyLayout().const(e) for i, e in mkeys.items()}

    async def run(self, ctx, requests, *, serial=False, max_cycles=200_000):
        """``requests``: an iterable of QPNs, or a callable giving the next one (or None);
        ``serial``: ask for the next one only once the last result is taken."""
        dut, rng = self.dut, self.rng
        source = requests if callable(requests) else (lambda it=iter(requests): next(it, None))
        presented = None
        exhausted = False
        pending = None
        beat = None                 # (deliver at, beat address, resp) owed
        cfg_addr = mkey_addr = 0
        last_result = last_ar = None
        drive = Driver()
        for t in range(max_cycles):
            drive.set(dut.qp_config.data, self.cfg_consts.get(cfg_addr, QpConfigLayout().const({})))
            drive.set(dut.mkey.data, self.mkey_consts.get(mkey_addr, MkeyLayout().const({})))
            if self.host:
                self.host.step()

            reset = None
            if rng.random() < self.p_reset:
                reset = rng.randrange(min(256, dut.num_qps + 2))
            drive.set(dut.qp_reset.valid, reset is not None)
            drive.set(dut.qp_reset.qpn, reset or 0)

            if (presented is None and not exhausted and rng.random() < self.p_req
                    and (pending is None or not serial)):
                presented = source()
                exhausted = presented is None
            drive.set(dut.request.valid, presented is not None)
            drive.set(dut.request.payload.qpn, presented or 0)

            drive.set(dut.ar.ready, rng.random() < self.p_ar)
            r_valid = False
            if beat is not None and beat[0] <= t:
                r_valid = True
                data, resp = bytes(self.mem.beat(beat[1])), beat[2]
                if resp:
                    data = rng.randbytes(64)
            elif pending is None and rng.random() < self.p_stray:
                r_valid = True
                data, resp = rng.randbytes(64), rng.choice([0, 2])
                self.stray += 1
            drive.set(dut.r.valid, r_valid)
            if r_valid:
                drive.set(dut.r.payload, {"data": int.from_bytes(data, "little"), "resp": resp,
                                        "last": 1})
            res_ready = rng.random() < self.p_res
            drive.set(dut.result.ready, res_ready)
            drive.apply(ctx)

            # --- what happened in this cycle ---
            assert ctx.get(dut.r.ready) == 1, t
            if reset is not None and reset < dut.num_qps:
                if pending is not None and pending.qpn == reset:
                    pending.reset_hit = True
                    self.resets_in_flight += 1
                self.ref.state[reset] = (0, 0)
                if self.host:
                    self.host.reset(reset)
            if presented is not None and ctx.get(dut.request.ready):
                assert pending is None, (t, "request taken before the last result")
                pending = Pending(presented, self.ref.request(presented))
                presented = None
            if ctx.get(dut.ar.valid):
                ar = (ctx.get(dut.ar.payload.id), ctx.get(dut.ar.payload.addr),
                      ctx.get(dut.ar.payload.len))
                assert last_ar is None or last_ar == ar, (t, "AR changed", last_ar, ar)
                last_ar = ar
                assert pending is not None and pending.expect is not None and beat is None, \
                    (t, "unexpected AR", hex(ar[1]))
                if ctx.get(dut.ar.ready):
                    assert ar == (RECV_ID, pending.expect & self.amask, 0), \
                        (t, hex(ar[1]), hex(pending.expect))
                    resp = rng.choice([2, 3]) if rng.random() < self.p_err else 0
                    beat = (t + 1 + rng.randint(*self.latency), pending.expect, resp)
                    last_ar = None
            else:
                assert last_ar is None, (t, "AR withdrawn")
            if r_valid and beat is not None and beat[0] <= t:
                beat = None
                pending.step((data, resp))
            if ctx.get(dut.result.valid):
                got = ctx.get(dut.result.payload.as_value())
                assert last_result is None or last_result == got, (t, "result changed")
                last_result = got
                assert pending is not None and pending.result is not None and beat is None, \
                    (t, "result before its reads")
                if res_ready:
                    fields = {n: (got >> o) & ((1 << w) - 1) for n, o, w in RESULT_FIELDS}
                    assert fields == pending.result, (t, pending.qpn, fields, pending.result)
                    if pending.after is not None and not pending.reset_hit:
                        self.ref.state[pending.qpn] = pending.after
                    self.results.append((pending.qpn, fields))
                    pending = last_result = None
            else:
                assert last_result is None, (t, "result withdrawn")

            cfg_addr = ctx.get(dut.qp_config.addr)
            mkey_addr = ctx.get(dut.mkey.addr)
            await ctx.tick()
            if exhausted and pending is None and presented is None:
                break
        else:
            raise AssertionError("requests did not finish")
        for _ in range(3):
            await ctx.tick()
        assert ctx.get(dut.recv_wqes_consumed) == self.ref.consumed
        assert ctx.get(dut.recv_wqe_errors) == self.ref.errors
        assert ctx.get(dut.rq_doorbell_reads) == self.ref.dbr_reads


# --- Memory keys and WQEs ---------------------------------------------------------------------

NUM_MKEYS = 16
PD_A, PD_B = 0x123456, 0x000042
TOP = M64 - 4096


def mkey_table():
    """Index: entry. Keys ``make_key(index, variant)``."""
    return {
        1: mkey_entry(make_key(1, 0x11), 0x10_0000, 0x1_0000, LOCAL_WRITE | REMOTE_WRITE, PD_A),
        2: mkey_entry(make_key(2, 0x22), 0x7000, 0x1000, LOCAL_WRITE, PD_A),
        3: mkey_entry(make_key(3, 0x33), 0x20_0000, 0x1000, REMOTE_WRITE | REMOTE_READ, PD_A),
        4: mkey_entry(make_key(4, 0x44), 0x30_0000, 0x1000, LOCAL_WRITE, PD_A, valid=0),
        5: mkey_entry(make_key(5, 0x55), 0x40_0000, 0x2000, LOCAL_WRITE, PD_B),
        6: mkey_entry(make_key(6, 0x66), TOP, 4096, LOCAL_WRITE, PD_A),      # ends at 2^64
        7: mkey_entry(make_key(7, 0x77), TOP, 8192, LOCAL_WRITE, PD_A),      # limit past 2^64
        8: mkey_entry(make_key(8, 0x88), 0, 1 << 40, LOCAL_WRITE | REMOTE_READ, PD_B),
    }


# kind: (lkey, addr, byte_count, OK or the ERROR syndrome for a QP in PD_A), by hand.
def wqe_kinds(rng):
    return {
        "good": (make_key(1, 0x11), 0x10_0000 + rng.randrange(0x8000), rng.randrange(1, 0x8000), OK),
        "whole": (make_key(1, 0x11), 0x10_0000, 0x1_0000, OK),
        "at_end": (make_key(2, 0x22), 0x7FF0, 0x10, OK),
        "zero_out_of_range": (make_key(2, 0x22), 0x1, 0, OK),
        "to_2_64": (make_key(6, 0x66), M64 - 16, 16, OK),
        "variant": (make_key(1, 0x12), 0x10_0000, 16, PROT),
        "invalid": (make_key(4, 0x44), 0x30_0000, 16, PROT),
        "pd": (make_key(5, 0x55), 0x40_0000, 16, PROT),
        "no_local_write": (make_key(3, 0x33), 0x20_0000, 16, PROT),
        "below": (make_key(2, 0x22), 0x6FFF, 2, PROT),
        "above": (make_key(2, 0x22), 0x8000, 1, PROT),
        "straddle": (make_key(2, 0x22), 0x7FF0, 0x11, PROT),
        "wrap": (make_key(7, 0x77), M64 - 16, 32, PROT),
        "huge": (make_key(1, 0x11), 0x10_0000, 0xFFFF_FFFF, PROT),
        "zero_bad_key": (make_key(3, 0x33), 0x20_0000, 0, PROT),
        "no_entry": (make_key(9, 0x99), 0, 16, PROT),
        "alias": (make_key(1 + NUM_MKEYS, 0x11), 0x10_0000, 16, PROT),   # index 17 -> entry 1
    }


def random_wqe(rng, pd, p_bad=0.2):
    """A WQE for a QP of PD ``pd``: mostly good, else one of the bad kinds (for a PD_B
    QP the PD_A keys are bad too)."""
    kinds = wqe_kinds(rng)
    if pd == PD_B:
        good = [(make_key(5, 0x55), 0x40_0000 + rng.randrange(0x1000), rng.randrange(0x1000)),
                (make_key(8, 0x88), rng.randrange(1 << 39), rng.randrange(1 << 31))]
        bad = [kinds[k][:3] for k in ("good", "whole", "at_end", "to_2_64", "no_entry")]
    else:
        good = [kinds[k][:3] for k in ("good", "good", "good", "whole", "at_end",
                                        "zero_out_of_range", "to_2_64")]
        bad = [v[:3] for v in kinds.values() if v[3] != OK]
    lkey, addr, byte_count = rng.choice(bad if rng.random() < p_bad else good)
    return data_segment(byte_count, lkey, addr)


def random_qps(rng, num_qps, count):
    qps = {}
    for qpn in rng.sample(range(num_qps), count):
        log = rng.choice([0, 1, 2, 3, 5])
        base = 0x100_0000 + 0x1_0000 * qpn + 16 * rng.randrange(4) + rng.choice([0, 0, 7])
        dbr = 0x200_0000 + 0x100 * qpn + 4 * rng.randrange(16) + rng.choice([0, 0, 3])
        qps[qpn] = Qp(base, log, dbr, rng.choice([PD_A, PD_A, PD_A, PD_B]))
    return qps


def poke_indices(ctx, dut, qpn, ci, pi):
    ctx.set(dut.indices.data[qpn], ci | pi << 16)
    ctx.set(dut.rows_unwritten, ctx.get(dut.rows_unwritten) & ~(1 << qpn))


# --- Tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed, num_qps, nqps, fast", [
    (1, 64, 4, False), (2, 8, 8, False), (3, 256, 3, True), (4, 64, 2, False),
])
def test_random(seed, num_qps, nqps, fast):
    rng = random.Random(seed)
    qps = random_qps(rng, num_qps, nqps)
    dut = ReceiveQueue(num_qps=num_qps, num_mkeys=NUM_MKEYS)
    kwargs = dict(p_req=1.0, p_ar=1.0, latency=(0, 0), p_res=1.0) if fast else {}
    bench = Bench(dut, rng, qps, mkey_table(), p_reset=0.003, **kwargs)
    # The host posts about as fast as the unit consumes, so the queues run dry now and then.
    rate = 0.1 if fast else 0.04 * max(nqps, 4) / 4
    bench.host = Host(bench, rng, lambda rng, q, i: random_wqe(rng, qps[q].pd), p_post=rate,
                      p_dbr=rate / 2)
    qpns = list(qps)
    # Mostly the unit's QPs, a few it does not have (the latter only if num_qps < 256).
    bad = [q for q in range(num_qps, 256)][:2]
    requests = [rng.choice(qpns + bad) if rng.random() < 0.05 else rng.choice(qpns)
                for _ in range(400 if fast else 200)]

    async def body(ctx):
        await bench.run(ctx, requests)

    simulate(dut, body)
    statuses = [f["status"] for _, f in bench.results]
    syndromes = [f["syndrome"] for _, f in bench.results if f["status"] == ERROR]
    assert statuses.count(OK) > 30 and statuses.count(EMPTY) > 20, statuses
    assert PROT in syndromes and QP_OP in syndromes
    assert bench.bogus_written > 0 and bench.ref.dbr_reads < len(requests)


def test_resets_and_strays():
    rng = random.Random(11)
    qps = random_qps(rng, 4, 2)
    dut = ReceiveQueue(num_qps=4, num_mkeys=NUM_MKEYS)
    bench = Bench(dut, rng, qps, mkey_table(), p_reset=0.03, p_stray=0.2, p_req=0.9)
    bench.host = Host(bench, rng, lambda rng, q, i: random_wqe(rng, qps[q].pd, 0.1), p_post=0.4)
    requests = [rng.choice(list(qps)) for _ in range(200)]

    async def body(ctx):
        await bench.run(ctx, requests)

    simulate(dut, body)
    assert bench.resets_in_flight > 5 and bench.stray > 20


def run_directed(qp, steps, *, start=None, p_err=0.0, latency=(0, 5), addr_width=64):
    """``steps``: callables (bench) -> None run before each request of QP 0 (posting WQEs,
    writing the record); returns the results."""
    rng = random.Random(5)
    dut = Probed(num_qps=2, num_mkeys=NUM_MKEYS, addr_width=addr_width)
    bench = Bench(dut, rng, {0: qp}, mkey_table(), p_err=p_err, latency=latency, p_stray=0)
    bench.host = Host(bench, rng, None, p_post=0, p_dbr=0)
    steps = deque(steps)
    if start is not None:
        bench.ref.state[0] = start

    def source():
        if not steps:
            return None
        steps.popleft()(bench)
        return 0

    async def body(ctx):
        if start is not None:
            poke_indices(ctx, dut, 0, *start)
        await bench.run(ctx, source, serial=True)

    simulate(dut, body)
    return bench


def post(qp, index, lkey, addr, byte_count):
    return lambda bench: bench.mem.write(qp.slot(index), data_segment(byte_count, lkey, addr))


def dbr(qp, value):
    return lambda bench: bench.mem.write(qp.rq_dbr & ~3, value.to_bytes(4, "big"))


def both(*fs):
    def run(bench):
        for f in fs:
            f(bench)
    return run


def nothing(bench):
    pass


def test_wqe_checks_by_hand():
    rng = random.Random(3)
    kinds = wqe_kinds(rng)
    qp = Qp(0x5000_0000, 5, 0x6000_0008, PD_A)
    steps, want = [], []
    for i, (name, (lkey, addr, byte_count, outcome)) in enumerate(kinds.items()):
        steps.append(both(post(qp, i, lkey, addr, byte_count), dbr(qp, i + 1)))
        if outcome == OK:
            want.append((name, OK, 0, addr, byte_count, i))
        else:
            want.append((name, ERROR, PROT, 0, 0, i))
    bench = run_directed(qp, steps)
    got = [(name, f["status"], f["syndrome"], f["addr"], f["length"], f["wqe_counter"])
           for name, (_, f) in zip(kinds, bench.results)]
    assert got == want
    assert bench.ref.dbr_reads == len(kinds)


def test_doorbell_record_only_when_needed():
    qp = Qp(0x5000_0040, 3, 0x6000_003C, PD_A)      # record in the last word of its beat
    lkey, addr = make_key(1, 0x11), 0x10_0000
    steps = [post(qp, i, lkey, addr + i, 8) for i in range(8)]
    steps = [both(steps[0], steps[1], steps[2], dbr(qp, 3))] + [nothing] * 3 + [
        both(steps[3], dbr(qp, 4 | 0xABCD_0000)),      # junk in the high half
        nothing,                                        # used up: EMPTY
        both(dbr(qp, 0x1_0000 | 4)),                    # low half still 4: EMPTY
    ]
    bench = run_directed(qp, steps)
    got = [(f["status"], f["wqe_counter"]) for _, f in bench.results]
    assert got == [(OK, 0), (OK, 1), (OK, 2), (EMPTY, 3), (OK, 3), (EMPTY, 4), (EMPTY, 4)]
    # Reads: the first request, the fourth (empty), the fifth, the sixth, the seventh.
    assert bench.ref.dbr_reads == 5
    assert [f["addr"] for _, f in bench.results if f["status"] == OK] == [addr, addr + 1,
                                                                          addr + 2, addr + 3]


def test_bogus_doorbell_records():
    qp = Qp(0x5000_0000, 2, 0x6000_0000, PD_A)     # 4 WQEs
    lkey, addr = make_key(1, 0x11), 0x10_0000
    steps = [
        dbr(qp, 5),                                 # too far ahead: EMPTY, counted, not cached
        dbr(qp, 0xFFFF),                            # behind: EMPTY, counted
        both(*(post(qp, i, lkey, addr, 1) for i in range(4)), dbr(qp, 4)),  # exactly full
        nothing, nothing, nothing,
        dbr(qp, 4),                                 # equal: EMPTY, not counted
        dbr(qp, 3),                                 # behind again
    ]
    bench = run_directed(qp, steps)
    got = [(f["status"], f["wqe_counter"]) for _, f in bench.results]
    assert got == [(EMPTY, 0), (EMPTY, 0), (OK, 0), (OK, 1), (OK, 2), (OK, 3), (EMPTY, 4),
                   (EMPTY, 4)]
    assert bench.ref.errors == 3 and bench.ref.dbr_reads == 5


def test_ring_and_index_wrap():
    qp = Qp(0x5000_0000, 2, 0x6000_0000, PD_A)     # 4 WQEs
    lkey = make_key(1, 0x11)
    start = (0xFFFE, 0xFFFE)
    steps = []
    for n in range(6):
        index = (0xFFFE + n) % (1 << 16)
        steps.append(both(post(qp, index, lkey, 0x10_0000 + n, 1),
                          dbr(qp, (index + 1) % (1 << 16))))
    bench = run_directed(qp, steps, start=start)
    got = [(f["status"], f["wqe_counter"], f["addr"]) for _, f in bench.results]
    assert got == [(OK, (0xFFFE + n) % (1 << 16), 0x10_0000 + n) for n in range(6)]
    # A record 4 ahead across the wrap is accepted, 5 ahead is not.
    start = (0xFFFE, 0xFFFE)
    steps = [dbr(qp, 3), both(*(post(qp, (0xFFFE + n) % (1 << 16), lkey, 0x10_0000, 1)
                                for n in range(4)), dbr(qp, 2))]
    bench = run_directed(qp, steps, start=start)
    assert [f["status"] for _, f in bench.results] == [EMPTY, OK]
    assert bench.ref.errors == 1


def test_stale_rows_read_as_zero():
    """Index rows left in the memory from before a reset (memories are not cleared) read
    as 0 until the row is written: the first request of a QP takes WQE 0."""
    qp = Qp(0x5000_0000, 2, 0x6000_0000, PD_A)
    lkey = make_key(1, 0x11)
    steps = [both(post(qp, 0, lkey, 0x10_0000, 1), dbr(qp, 1)), nothing]
    rng = random.Random(5)
    dut = Probed(num_qps=2, num_mkeys=NUM_MKEYS)
    bench = Bench(dut, rng, {0: qp}, mkey_table(), p_err=0.0, latency=(0, 5), p_stray=0)
    bench.host = Host(bench, rng, None, p_post=0, p_dbr=0)
    steps = deque(steps)

    def source():
        if not steps:
            return None
        steps.popleft()(bench)
        return 0

    async def body(ctx):
        ctx.set(dut.indices.data[0], 0x0007_0005)      # stale ci 5, pi 7
        await bench.run(ctx, source, serial=True)

    simulate(dut, body)
    assert [(f["status"], f["wqe_counter"]) for _, f in bench.results] == [(OK, 0), (EMPTY, 1)]


def test_narrow_addresses():
    # Ring and record beyond a 40-bit AXI address: the reads are cut to 40 bits.
    qp = Qp((1 << 40) + 0x5000_0000, 1, (5 << 40) + 0x6000_0004, PD_A)
    lkey = make_key(1, 0x11)
    steps = [both(post(qp, 0, lkey, 0x10_0000, 1), post(qp, 1, lkey, 0x10_0001, 1),
                  dbr(qp, 2)), nothing, nothing]
    bench = run_directed(qp, steps, addr_width=40)
    assert [(f["status"], f["addr"]) for _, f in bench.results] == \
        [(OK, 0x10_0000), (OK, 0x10_0001), (EMPTY, 0)]


def test_read_errors():
    qp = Qp(0x5000_0000, 3, 0x6000_0000, PD_A)
    lkey = make_key(1, 0x11)

    # Every read of requests 1 (the record) and 3 (the WQE) fails.
    rng = random.Random(9)
    dut = ReceiveQueue(num_qps=1, num_mkeys=NUM_MKEYS)
    bench = Bench(dut, rng, {0: qp}, mkey_table(), p_err=0.0, p_stray=0)
    for i in range(3):
        bench.mem.write(qp.slot(i), data_segment(4, lkey, 0x10_0000))
    bench.mem.write(qp.rq_dbr, (3).to_bytes(4, "big"))
    outcomes = []

    async def body(ctx):
        for p_err in (1.0, 0.0, 1.0, 0.0):
            # With p_err 1 both reads of a request fail; the record read comes first.
            bench.p_err = p_err
            await bench.run(ctx, [0])
            outcomes.append(bench.results[-1][1])

    simulate(dut, body)
    got = [(f["status"], f["syndrome"], f["wqe_counter"]) for f in outcomes]
    # 1: record read fails, nothing consumed; 2: OK WQE 0; 3: cached pi, WQE read fails,
    # WQE 1 consumed; 4: OK WQE 2.
    assert got == [(ERROR, QP_OP, 0), (OK, 0, 0), (ERROR, QP_OP, 1), (OK, 0, 2)]
    assert (bench.ref.errors, bench.ref.consumed, bench.ref.dbr_reads) == (2, 3, 2)


def test_unknown_qp():
    rng = random.Random(4)
    qp = Qp(0x5000_0000, 1, 0x6000_0000, PD_A)
    dut = ReceiveQueue(num_qps=2, num_mkeys=NUM_MKEYS)
    bench = Bench(dut, rng, {1: qp}, mkey_table(), p_stray=0)

    async def body(ctx):
        await bench.run(ctx, [2, 255, 1, 3])

    simulate(dut, body)
    got = [(q, f["status"], f["syndrome"], f["wqe_counter"]) for q, f in bench.results]
    assert got[0] == (2, ERROR, QP_OP, 0) and got[1] == (255, ERROR, QP_OP, 0)
    assert got[3] == (3, ERROR, QP_OP, 0)
    assert bench.ref.errors >= 3 and bench.ref.dbr_reads == 1


@pytest.mark.parametrize("kwargs", [
    dict(num_qps=0), dict(num_qps=257), dict(num_qps=2.0), dict(num_mkeys=0),
    dict(num_mkeys=1 << 25), dict(addr_width=11), dict(addr_width=65),
])
def test_parameters(kwargs):
    # A component whose constructor raised would warn, when collected, that it was never
    # elaborated: collect it here with that warning off.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match="must be"):
                ReceiveQueue(**kwargs)
        finally:
            gc.collect()
