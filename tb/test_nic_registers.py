"""NicRegisters (hdl/nic/nic_registers.py) against a Python register model, in Amaranth's
simulator.

The model is built from the same register map as the hardware (hdl/nic/register_map.py)
but decides every answer itself: address decode, byte-strobe merges, SLVERR cases, the QP
state rules (docs/nic.md, docs/nic-registers.md), the context checks on RESET -> RTS, the
doorbell byte order and the block's own counters.

A small AXI4-Lite master drives the slave with random pauses on every channel (AW, W,
B ready, AR, R ready) and checks that B and R hold until taken. Every cycle the bench
records ``doorbell`` and ``qp_reset`` strobes, drives random addresses on every context
read port and, when no host write is settling, checks the data against the model's entry
at the previous cycle's address.

Tests: random register/context/UAR/state traffic with busy toggles, counter changes and
``qp_error`` strobes (two configurations); directed doorbell decode (byte order, partial
strobes, the whole UAR page, back to back); every QP transition incl. each refused one;
``qp_error`` strobes (both at once, same or different QP, ignored in RESET/ERR, the same
cycle as a host write and the cycle before); exact bus timing; the cycle the inputs count
in; parameter checks; and that
docs/nic-registers.md is what the map generates.
"""
import gc
import random
import struct
import warnings
from pathlib import Path

import pytest
from amaranth.hdl import UnusedElaboratable

from hdl.nic import register_map as rmap
from hdl.nic.nic_registers import NUM_COUNTER_INPUTS, NicRegisters
from hdl.nic.register_map import OKAY, SLVERR, field_value, place_fields
from hdl.nic.signatures import MAX_OUTSTANDING_BLOCKS, CqConfigLayout, MkeyLayout, QpConfigLayout
from tb.amaranth_sim import simulate

REPO = Path(__file__).resolve().parent.parent
RESET, RTS, ERR = 0, 3, 6
LAYOUTS = {"qp": QpConfigLayout(), "cq": CqConfigLayout(), "mkey": MkeyLayout()}


# --- Model -------------------------------------------------------------------------------------

def merge(old, data, strb):
    out = 0
    for k in range(8):
        out |= ((data if strb >> k & 1 else old) & 0xFF << 8 * k)
    return out


def field_mask(fields):
    return sum(((1 << f.width) - 1) << f.lo for f in fields)


class Model:
    """What every address should answer, from the register map plus the rules."""

    def __init__(self, dut):
        self.dut = dut
        regs, tables = dut.map
        self.regs = {r.offset: r for r in regs}
        self.values = {r.offset: r.reset for r in regs if r.access == "RW"}
        self.tables = {t.name: t for t in tables}
        self.entries = {t.name: [{f.name: 0 for w in t.words for f in w.fields
                                  if f.name != "state"} for _ in range(t.count)]
                        for t in tables}
        self.state = [RESET] * dut.num_qps
        self.busy = 0
        self.own = {"doorbells_partial": 0, "register_write_errors": 0}
        self.counters = [0] * NUM_COUNTER_INPUTS
        self.link = (0, 0)          # link_state, link_inits as the bench drives them
        self.doorbells = []         # (qpn, pi) in order
        self.resets = []            # qpn of every qp_reset strobe, in order
        self.moves = []             # (qpn, from, to) of every state change

    def decode(self, addr):
        if addr >> rmap.ADDRESS_BITS:
            return None
        a = addr & ~7
        if a in self.regs:
            return ("reg", self.regs[a])
        if rmap.UAR_BASE <= a < rmap.UAR_BASE + rmap.UAR_SIZE:
            return ("uar",)
        for t in self.tables.values():
            if t.base <= a < t.base + t.stride * rmap.MAX_ENTRIES:
                idx, w = divmod(a - t.base, t.stride)
                if idx < t.count and w // 8 < len(t.words):
                    return ("ctx", t, idx, t.words[w // 8])
        return None

    def word_value(self, t, idx, w):
        if w.name == "state":
            return self.state[idx]
        return place_fields(w.fields, **self.entries[t.name][idx])

    def read_value(self, reg):
        kind = reg.binding[0]
        if kind == "const":
            return reg.reset
        if kind == "link":
            return self.link[0] | self.link[1] << 32
        if kind == "counter":
            return self.counters[reg.binding[1]]
        if kind == "own_counter":
            return self.own[reg.binding[1]]
        return self.values[reg.offset]

    def read(self, addr):
        d = self.decode(addr)
        if d is None:
            return SLVERR, 0
        if d[0] == "reg":
            return OKAY, self.read_value(d[1])
        if d[0] == "uar":
            return OKAY, 0
        _, t, idx, w = d
        return OKAY, self.word_value(t, idx, w)

    def write(self, addr, data, strb):
        resp = self._write(addr, data, strb)
        if resp == SLVERR:
            self.own["register_write_errors"] = (self.own["register_write_errors"] + 1) & 0xFFFFFFFF
        return resp

    def _write(self, addr, data, strb):
        d = self.decode(addr)
        if d is None:
            return SLVERR
        if d[0] == "uar":
            if strb == 0xFF:
                b = data.to_bytes(8, "little")
                opmod_idx_opcode, qpn_ds = struct.unpack(">II", b)
                self.doorbells.append((qpn_ds >> 8, opmod_idx_opcode >> 8 & 0xFFFF))
            else:
                self.own["doorbells_partial"] = (self.own["doorbells_partial"] + 1) & 0xFFFFFFFF
            return OKAY
        if d[0] == "reg":
            reg = d[1]
            if reg.access != "RW":
                return SLVERR
            merged = merge(self.values[reg.offset], data, strb) & field_mask(reg.fields)
            if reg.binding[0] == "sl_to_vl":
                for sl in range(16):
                    vl = merged >> 4 * sl & 0xF
                    if vl >= self.dut.num_vls and vl != 15:
                        return SLVERR
            self.values[reg.offset] = merged
            return OKAY
        _, t, idx, w = d
        if w.name == "state":
            before = self.state[idx]
            resp = self.state_write(idx, merge(before, data, strb) & 7)
            if self.state[idx] != before:
                self.moves.append((idx, before, self.state[idx]))
            return resp
        if t.name == "qp" and self.state[idx] != RESET:
            return SLVERR
        merged = merge(self.word_value(t, idx, w), data, strb)
        for f in w.fields:
            self.entries[t.name][idx][f.name] = field_value(merged, w.fields, f.name)
        return OKAY

    def context_ok(self, q):
        e = self.entries["qp"][q]
        align = min(4096, 64 << e["log_sq_size"])
        return (1 <= e["mtu"] <= 5 and 1 <= e["max_outstanding"] <= MAX_OUTSTANDING_BLOCKS
                and e["cqn"] < self.dut.num_cqs and e["rcqn"] < self.dut.num_cqs
                and e["sq_base"] % align == 0 and e["rq_base"] % 16 == 0 and e["rq_dbr"] % 4 == 0)

    def state_write(self, q, want):
        now = self.state[q]
        busy = self.busy >> q & 1
        if want == RESET:
            if now != RESET and busy:
                return SLVERR
            self.state[q] = RESET
            self.resets.append(q)
            return OKAY
        if want == RTS:
            if now == ERR or (now == RESET and not self.context_ok(q)):
                return SLVERR
            self.state[q] = RTS
            return OKAY
        if want == ERR:
            if now == RESET:
                return SLVERR
            self.state[q] = ERR
            return OKAY
        return SLVERR

    def qp_error(self, qpns):
        for q in qpns:
            if q < self.dut.num_qps and self.state[q] == RTS:
                self.state[q] = ERR
                self.moves.append((q, RTS, ERR))

    def raw_entry(self, table, idx):
        layout = LAYOUTS[table]
        return sum(v << layout[name].offset for name, v in self.entries[table][idx].items())


# --- Bench -------------------------------------------------------------------------------------

class Bench:
    """A cycle-stepped AXI4-Lite master with random pauses, strobe recorders and read-port
    checkers around one NicRegisters."""

    def __init__(self, ctx, dut, rng, pauses=True):
        self.ctx, self.dut, self.rng, self.pauses = ctx, dut, rng, pauses
        self.model = Model(dut)
        self.t = 0
        self.doorbells = []         # (cycle, qpn, pi)
        self.resets = []            # (cycle, qpn)
        self.flushes = []           # (cycle, qpn) of every qp_flush strobe
        self.errors_at = {}         # cycle -> qpns strobed on qp_error[0], [1], ...
        self.writing = False
        self.check_from = 0
        self.port_addr = {}         # read port -> addr driven last cycle
        self.port_checks = 0
        self.ports = [("qp", p) for p in dut.qp_read] + [("cq", p) for p in dut.cq_read] + \
                     [("mkey", p) for p in dut.mkey_read]

    def pause(self):
        if not self.pauses or self.rng.random() < 0.5:
            return 0
        return self.rng.randint(1, 4)

    async def step(self):
        ctx, dut = self.ctx, self.dut
        errs = self.errors_at.pop(self.t, ())
        for i in range(len(dut.qp_error)):
            ctx.set(dut.qp_error[i].valid, int(i < len(errs)))
            ctx.set(dut.qp_error[i].qpn, errs[i] if i < len(errs) else 0)
        if ctx.get(dut.doorbell.valid):
            self.doorbells.append((self.t, ctx.get(dut.doorbell.payload.qpn),
                                   ctx.get(dut.doorbell.payload.pi)))
        if ctx.get(dut.qp_reset.valid):
            self.resets.append((self.t, ctx.get(dut.qp_reset.qpn)))
        if ctx.get(dut.qp_flush.valid):
            self.flushes.append((self.t, ctx.get(dut.qp_flush.qpn)))
        settled = not self.writing and self.t >= self.check_from
        for k, (table, port) in enumerate(self.ports):
            if settled and k in self.port_addr:
                got = ctx.get(port.data.as_value())
                want = self.model.raw_entry(table, self.port_addr[k])
                assert got == want, (self.t, table, self.port_addr[k], hex(got), hex(want))
                self.port_checks += 1
            addr = self.rng.randrange(len(self.model.entries[table]))
            ctx.set(port.addr, addr)
            self.port_addr[k] = addr
        await ctx.tick()
        self.t += 1

    async def idle(self, cycles):
        for _ in range(cycles):
            await self.step()

    async def write(self, addr, data, strb=0xFF, expect=None):
        """One AXI4-Lite write; checks the response against the model (or ``expect``)."""
        ctx, axi = self.ctx, self.dut.axi
        want = self.model.write(addr, data, strb)
        if expect is not None:
            assert want == expect, (hex(addr), want, expect)
        self.writing = True
        aw_at, w_at = self.pause(), self.pause()
        aw_done = w_done = False
        n = 0
        while not (aw_done and w_done):
            aw_v = not aw_done and n >= aw_at
            w_v = not w_done and n >= w_at
            ctx.set(axi.awvalid, aw_v)
            ctx.set(axi.awaddr, addr if aw_v else self.rng.getrandbits(self.dut.addr_width))
            ctx.set(axi.wvalid, w_v)
            ctx.set(axi.wdata, data if w_v else self.rng.getrandbits(64))
            ctx.set(axi.wstrb, strb if w_v else self.rng.getrandbits(8))
            aw_hs = aw_v and ctx.get(axi.awready)
            w_hs = w_v and ctx.get(axi.wready)
            assert not ctx.get(axi.bvalid)
            await self.step()
            aw_done |= aw_hs
            w_done |= w_hs
            n += 1
        ctx.set(axi.awvalid, 0)
        ctx.set(axi.wvalid, 0)
        resp = await self._response(axi.bvalid, axi.bready, lambda: ctx.get(axi.bresp))
        self.writing = False
        self.check_from = self.t
        assert resp == want, (hex(addr), hex(data), hex(strb), resp, want)
        return resp

    async def read(self, addr, expect=None):
        """One AXI4-Lite read; checks response and data against the model."""
        ctx, axi = self.ctx, self.dut.axi
        want = self.model.read(addr)
        if expect is not None:
            assert want == expect, (hex(addr), want, expect)
        n, at = 0, self.pause()
        while True:
            v = n >= at
            ctx.set(axi.arvalid, v)
            ctx.set(axi.araddr, addr if v else self.rng.getrandbits(self.dut.addr_width))
            hs = v and ctx.get(axi.arready)
            await self.step()
            n += 1
            if hs:
                break
        ctx.set(axi.arvalid, 0)
        got = await self._response(axi.rvalid, axi.rready,
                                   lambda: (ctx.get(axi.rresp), ctx.get(axi.rdata)))
        assert got == want, (hex(addr), got, want)
        return got

    async def _response(self, valid, ready, sample):
        ctx = self.ctx
        wait = self.pause()
        held = None
        while True:
            r = wait == 0
            ctx.set(ready, r)
            if ctx.get(valid):
                value = sample()
                assert held is None or value == held, "response changed before it was taken"
                held = value
                if r:
                    await self.step()
                    ctx.set(ready, 0)
                    return value
            else:
                assert held is None, "valid fell before the response was taken"
            wait = max(0, wait - 1)
            await self.step()

    def set_busy(self, value):
        self.model.busy = value
        self.ctx.set(self.dut.qp_busy, value)

    def set_counter(self, k, value):
        self.model.counters[k] = value
        self.ctx.set(self.dut.counters[k], value)

    async def strobe_errors(self, qpns):
        """``qp_error`` strobes in the next cycle, with no transaction in flight."""
        self.errors_at[self.t] = tuple(qpns)
        self.model.qp_error(qpns)
        await self.step()

    def check_outputs(self):
        ctx, dut, m = self.ctx, self.dut, self.model
        for q in range(dut.num_qps):
            assert ctx.get(dut.qp_state[q]).value == m.state[q], (q, m.state[q])
            e = m.entries["qp"][q]
            assert ctx.get(dut.qp_log_sq_size[q]) == e["log_sq_size"], q
            assert ctx.get(dut.qp_max_outstanding[q]) == e["max_outstanding"], q
        by_name = {r.name: r.offset for r in m.regs.values()}
        assert ctx.get(dut.slid) == m.values[by_name["slid"]]
        for sl in range(16):
            assert ctx.get(dut.sl_to_vl[sl]) == m.values[by_name["sl_to_vl"]] >> 4 * sl & 0xF
        for v in range(dut.num_vls):
            assert ctx.get(dut.vl_weight[v]) == m.values[by_name["vl_weights"]] >> 8 * v & 0xFF

    def check_strobes(self):
        assert [(q, pi) for _, q, pi in self.doorbells] == self.model.doorbells
        assert [q for _, q in self.resets] == self.model.resets


def run(dut, body, seed=1, pauses=True):
    result = {}

    async def testbench(ctx):
        bench = Bench(ctx, dut, random.Random(seed), pauses)
        ctx.set(dut.axi.bready, 0)
        ctx.set(dut.axi.rready, 0)
        await bench.idle(2)
        await body(bench)
        await bench.idle(3)
        bench.check_outputs()
        bench.check_strobes()
        result["bench"] = bench

    simulate(dut, testbench)
    return result["bench"]


def qp_addr(q, word):
    return rmap.QP_BASE + rmap.QP_STRIDE * q + 8 * word


def cq_addr(c, word):
    return rmap.CQ_BASE + rmap.CQ_STRIDE * c + 8 * word


def mkey_addr(i, word):
    return rmap.MKEY_BASE + rmap.MKEY_STRIDE * i + 8 * word


def qp_words(sq_base=0x10000, log_sq_size=6, mtu=5, sl=0, max_outstanding=MAX_OUTSTANDING_BLOCKS, dest_qpn=0x123,
             dlid=7, pd=1, pkey=0xFFFF, sq_psn=100, cqn=0, log_rq_size=4, rcqn=0,
             min_rnr_timer=12, access=0xE, rq_psn=200, rq_base=0x20000, rq_dbr=0x30000):
    return {1: place_fields(rmap.QP_WORDS[1].fields, sq_base=sq_base),
            2: place_fields(rmap.QP_WORDS[2].fields, log_sq_size=log_sq_size, mtu=mtu, sl=sl,
                            max_outstanding=max_outstanding, log_rq_size=log_rq_size, rcqn=rcqn),
            3: place_fields(rmap.QP_WORDS[3].fields, dest_qpn=dest_qpn, dlid=dlid,
                            min_rnr_timer=min_rnr_timer),
            4: place_fields(rmap.QP_WORDS[4].fields, pd=pd, pkey=pkey, access=access),
            5: place_fields(rmap.QP_WORDS[5].fields, sq_psn=sq_psn, cqn=cqn, rq_psn=rq_psn),
            6: place_fields(rmap.QP_WORDS[6].fields, rq_base=rq_base),
            7: place_fields(rmap.QP_WORDS[7].fields, rq_dbr=rq_dbr)}


async def program_qp(bench, q, **fields):
    for w, value in qp_words(**fields).items():
        await bench.write(qp_addr(q, w), value, expect=OKAY)


def doorbell_word(qpn, pi, opcode=0x08, opmod=0, ds=3):
    """The first 8 bytes of a control segment as a little-endian 64-bit bus word."""
    return int.from_bytes(struct.pack(">II", opmod << 24 | pi << 8 | opcode, qpn << 8 | ds),
                          "little")


# --- Random traffic ----------------------------------------------------------------------------

def random_strb(rng):
    r = rng.random()
    return 0xFF if r < 0.6 else rng.getrandbits(8)


def random_addr(bench):
    """An address from every region, biased to a few QPs so that state sequences happen."""
    rng, m = bench.rng, bench.model
    r = rng.random()
    hot = [0, 1, 2, m.dut.num_qps - 1]
    if r < 0.15:
        return rng.choice(list(m.regs)) | rng.randrange(8)
    if r < 0.2:
        return rng.randrange(0x1000)            # mostly holes of the global page
    if r < 0.25:
        return rmap.COUNTER_BASE + rng.randrange(rmap.COUNTER_SPACE)
    if r < 0.3:
        return rng.randrange(1 << bench.dut.addr_width)
    if r < 0.45:
        return rmap.UAR_BASE + rng.randrange(rmap.UAR_SIZE)
    t = rng.choice(list(m.tables.values()))
    if t.name == "qp":
        idx = rng.choice(hot) if rng.random() < 0.8 else rng.randrange(rmap.MAX_ENTRIES)
    else:
        idx = rng.randrange(t.count + 1) if rng.random() < 0.9 else rng.randrange(rmap.MAX_ENTRIES)
    word = rng.randrange(len(t.words) + 1) if rng.random() < 0.9 else rng.randrange(t.stride // 8)
    return t.base + t.stride * idx + 8 * word


def random_write_data(bench, addr):
    rng, m = bench.rng, bench.model
    d = m.decode(addr)
    if d is None or rng.random() < 0.2:
        return rng.getrandbits(64)
    if d[0] == "uar":
        return doorbell_word(rng.getrandbits(24), rng.getrandbits(16), rng.getrandbits(8),
                             rng.getrandbits(8), rng.getrandbits(8))
    if d[0] == "reg" and d[1].name == "sl_to_vl":
        vls = [rng.choice([rng.randrange(bench.dut.num_vls), 15]) for _ in range(16)]
        if rng.random() < 0.2:
            vls[rng.randrange(16)] = rng.randrange(16)
        return sum(v << 4 * s for s, v in enumerate(vls))
    if d[0] == "ctx" and d[1].name == "qp":
        w = d[3]
        if w.name == "state":
            return rng.choice([RESET, RTS, ERR, RESET, RTS, ERR, rng.getrandbits(64)])
        good = qp_words(sq_base=rng.getrandbits(52) << 12, log_sq_size=rng.randrange(16),
                        mtu=rng.randint(1, 5), max_outstanding=rng.randint(1, 64),
                        cqn=rng.randrange(bench.dut.num_cqs), sl=rng.randrange(16))
        if rng.random() < 0.75:
            return good[w.index] | (rng.getrandbits(64) & ~field_mask(w.fields))
    return rng.getrandbits(64)


@pytest.mark.parametrize("seed,config", [
    (1, {}),
    (2, {"num_qps": 5, "num_cqs": 3, "num_mkeys": 4, "num_vls": 3, "qp_read_ports": 2,
         "cq_read_ports": 2, "mkey_read_ports": 2, "addr_width": 20}),
])
def test_random_traffic(seed, config):
    dut = NicRegisters(**config)

    async def body(bench):
        rng, m = bench.rng, bench.model
        for k in range(NUM_COUNTER_INPUTS):
            bench.set_counter(k, rng.getrandbits(32))
        for n in range(700):
            r = rng.random()
            q = rng.choice([0, 1, 2, dut.num_qps - 1])
            if r < 0.12:
                value = rng.choice([RESET, RTS, ERR, rng.getrandbits(64)])
                await bench.write(qp_addr(q, 0), value, 0xFF if rng.random() < 0.8 else
                                  rng.getrandbits(8))
            elif r < 0.15:
                if m.state[q] == RESET:
                    await program_qp(bench, q, sq_base=rng.getrandbits(52) << 12,
                                     log_sq_size=rng.randrange(16), mtu=rng.randint(1, 5),
                                     max_outstanding=rng.randint(1, 64),
                                     cqn=rng.randrange(dut.num_cqs))
            elif r < 0.45:
                addr = random_addr(bench)
                await bench.write(addr, random_write_data(bench, addr), random_strb(rng))
            elif r < 0.85:
                await bench.read(random_addr(bench))
            elif r < 0.9:
                bench.set_busy(rng.getrandbits(dut.num_qps) if rng.random() < 0.5 else 0)
            elif r < 0.95:
                bench.set_counter(rng.randrange(NUM_COUNTER_INPUTS), rng.getrandbits(32))
            else:
                hot = [0, 1, 2, dut.num_qps - 1, rng.randrange(256)]
                await bench.strobe_errors([rng.choice(hot) for _ in range(rng.randint(1, 3))])
            if n % 50 == 0:
                bench.check_outputs()
            if rng.random() < 0.2:
                await bench.idle(rng.randint(1, 3))
        # The traffic did reach every kind of outcome.
        assert m.own["register_write_errors"] > 20 and m.own["doorbells_partial"] >= 3
        assert len(m.doorbells) > 5 and len(m.resets) > 5
        moves = {(a, b) for _, a, b in m.moves}
        assert {(RESET, RTS), (RTS, ERR), (RTS, RESET), (ERR, RESET)} <= moves, moves
        for k in range(2):
            await bench.read(rmap.COUNTER_BASE + 8 * k)
        assert bench.port_checks > 1000

    run(dut, body, seed)


def test_register_round_trips_and_strobes():
    """Every global register and every context word: full writes, each single byte lane,
    no lanes, read back; RO registers and holes answer SLVERR; counters read back."""
    dut = NicRegisters(num_qps=4, num_cqs=2, num_mkeys=2)

    async def body(bench):
        rng, m = bench.rng, bench.model
        for reg in m.regs.values():
            await bench.read(reg.offset)
            if reg.access == "RO":
                await bench.write(reg.offset, rng.getrandbits(64), expect=SLVERR)
                continue
            value = rng.getrandbits(64)
            if reg.name == "sl_to_vl":
                value &= 0x1111_1111_1111_1111       # VLs 0 and 1 only
            await bench.write(reg.offset, value, expect=OKAY)
            await bench.read(reg.offset)
            for lane in range(8):
                await bench.write(reg.offset | rng.randrange(8), 0xF1 << 8 * lane, 1 << lane,
                                  expect=OKAY)
                await bench.read(reg.offset)
            await bench.write(reg.offset, rng.getrandbits(64), 0, expect=OKAY)
            await bench.read(reg.offset)
        for t in m.tables.values():
            for idx in range(t.count):
                for w in t.words:
                    if w.name == "state":
                        continue
                    addr = t.base + t.stride * idx + 8 * w.index
                    await bench.write(addr, rng.getrandbits(64), expect=OKAY)
                    await bench.read(addr)
                    lane = rng.randrange(8)
                    await bench.write(addr, rng.getrandbits(64), 1 << lane, expect=OKAY)
                    await bench.read(addr)
                await bench.idle(3)     # the read ports see every entry
            # The first word beyond the entry, and the first entry beyond the table.
            if 8 * len(t.words) < t.stride:
                await bench.read(t.base + 8 * len(t.words), expect=(SLVERR, 0))
            await bench.write(t.base + t.stride * t.count, 1, expect=SLVERR)
        for k in range(NUM_COUNTER_INPUTS):
            bench.set_counter(k, rng.getrandbits(32))
        for k in range(len(rmap.OWN_COUNTERS) + NUM_COUNTER_INPUTS):
            await bench.read(rmap.COUNTER_BASE + 8 * k)
        await bench.read(rmap.COUNTER_BASE + 8 * (len(rmap.OWN_COUNTERS) + NUM_COUNTER_INPUTS),
                         expect=(SLVERR, 0))
        bench.model.link = (2, 0xDEADBEEF)
        bench.ctx.set(bench.dut.link_state, 2)
        bench.ctx.set(bench.dut.link_inits, 0xDEADBEEF)
        await bench.read(0x28, expect=(OKAY, 0xDEADBEEF_0000_0002))
        await bench.write(0x28, 0, expect=SLVERR)
        await bench.read(0x30, expect=(SLVERR, 0))
        await bench.read(0x8, expect=(OKAY, 4 | 2 << 16 | 2 << 32 | 2 << 48))
        # A VL beyond num_vls (other than 15) is refused and changes nothing.
        await bench.write(0x18, 0xF, expect=OKAY)
        await bench.write(0x18, 0x2, expect=SLVERR)
        await bench.read(0x18, expect=(OKAY, 0xF))
        await bench.read(rmap.COUNTER_BASE + 8, expect=(OKAY, m.own["register_write_errors"]))

    run(dut, body, seed=3)


def test_reset_values():
    dut = NicRegisters(num_qps=2, num_vls=3)

    async def body(bench):
        ctx = bench.ctx
        assert [ctx.get(dut.sl_to_vl[s]) for s in range(16)] == [s % 3 for s in range(16)]
        assert [ctx.get(dut.vl_weight[v]) for v in range(3)] == [16, 16, 16]
        await bench.read(0x0, expect=(OKAY, 0x5446_4E43_0000_0001))
        await bench.read(0x18)

    run(dut, body)


# --- Doorbells ---------------------------------------------------------------------------------

def test_doorbell_decode():
    """Byte order as NVSHMEM writes it; the whole UAR page; partial strobes ignored, OKAY
    and counted; UAR reads return 0; back-to-back doorbells without pauses."""
    dut = NicRegisters(num_qps=4)

    async def body(bench):
        rng = bench.rng
        # Lanes 0..7 = 0x00 0x12 0x34 0x0a | 0xab 0xcd 0xef 0x03: pi 0x1234, qpn 0xabcdef.
        word = int.from_bytes(bytes([0x00, 0x12, 0x34, 0x0A, 0xAB, 0xCD, 0xEF, 0x03]), "little")
        assert word == doorbell_word(0xABCDEF, 0x1234, 0x0A)
        await bench.write(rmap.UAR_BASE, word, expect=OKAY)
        await bench.idle(1)
        assert [(q, pi) for _, q, pi in bench.doorbells] == [(0xABCDEF, 0x1234)]
        for addr in (rmap.UAR_BASE + 8, rmap.UAR_BASE + 0x803, rmap.UAR_BASE + rmap.UAR_SIZE - 8):
            await bench.write(addr, doorbell_word(rng.getrandbits(24), rng.getrandbits(16),
                                                  rng.getrandbits(8)), expect=OKAY)
            await bench.read(addr, expect=(OKAY, 0))
        for strb in (0x7F, 0xFE, 0x0F, 0xF0, 0x00, 0xBF):
            await bench.write(rmap.UAR_BASE + 8 * rng.randrange(512), doorbell_word(1, 1),
                              strb, expect=OKAY)
        await bench.read(rmap.COUNTER_BASE, expect=(OKAY, 6))
        await bench.read(rmap.COUNTER_BASE + 8, expect=(OKAY, 0))
        # Outside the page: not a doorbell.
        await bench.write(rmap.UAR_BASE - 8, doorbell_word(1, 1), expect=SLVERR)
        await bench.write(rmap.UAR_BASE + rmap.UAR_SIZE, doorbell_word(1, 1), expect=SLVERR)
        # Back to back, no pauses: each doorbell is exactly one valid cycle.
        bench.pauses = False
        before = len(bench.doorbells)
        for k in range(8):
            await bench.write(rmap.UAR_BASE + 8 * k, doorbell_word(k, 0x100 + k))
        await bench.idle(2)
        got = bench.doorbells[before:]
        assert [(q, pi) for _, q, pi in got] == [(k, 0x100 + k) for k in range(8)]
        cycles = [t for t, _, _ in got]
        assert all(b - a == 4 for a, b in zip(cycles, cycles[1:])), cycles

    run(dut, body, seed=4)


# --- QP states ---------------------------------------------------------------------------------

def test_qp_transitions():
    """Every transition the host may write, and each refused one, with qp_busy and
    qp_reset; context writes outside RESET; each RESET -> RTS check on its own."""
    dut = NicRegisters(num_qps=8, num_cqs=4)

    async def body(bench):
        ctx = bench.ctx
        q = 3
        st = qp_addr(q, 0)

        async def state(expect):
            await bench.read(st, expect=(OKAY, expect))
            assert ctx.get(dut.qp_state[q]).value == expect

        await state(RESET)
        await bench.write(st, RTS, expect=SLVERR)          # context all zero: invalid
        await state(RESET)
        # Each check on its own, from a good context.
        bad = [dict(mtu=0), dict(mtu=6), dict(mtu=7), dict(max_outstanding=0),
               dict(max_outstanding=64), dict(max_outstanding=65), dict(max_outstanding=127), dict(cqn=4), dict(cqn=255),
               dict(log_sq_size=0, sq_base=0x1020), dict(log_sq_size=3, sq_base=0x1100),
               dict(log_sq_size=6, sq_base=0x10800), dict(log_sq_size=15, sq_base=0x10800),
               dict(log_sq_size=9, sq_base=0x10000 | 1 << 5), dict(rcqn=4), dict(rcqn=200),
               dict(rq_base=0x20008), dict(rq_base=0x20001), dict(rq_dbr=0x30002)]
        for fields in bad:
            await program_qp(bench, q, **fields)
            await bench.write(st, RTS, expect=SLVERR)
            await state(RESET)
        good = [dict(mtu=1, max_outstanding=1, cqn=3, log_sq_size=0, sq_base=0x40),
                dict(max_outstanding=63),
                dict(log_sq_size=3, sq_base=0x200), dict(log_sq_size=15, sq_base=0x1000),
                dict(rcqn=3, rq_base=0x10, rq_dbr=0x4, log_rq_size=15, access=0)]
        for fields in good:
            await program_qp(bench, q, **fields)
            await bench.write(st, RTS, expect=OKAY)
            await state(RTS)
            bench.check_outputs()
            for w in range(1, 8):                           # context frozen outside RESET
                await bench.write(qp_addr(q, w), 0, expect=SLVERR)
            await bench.write(st, RTS, expect=OKAY)          # RTS -> RTS: no change
            await bench.write(st, RESET, expect=OKAY)
            await state(RESET)
        await bench.write(st, ERR, expect=SLVERR)            # RESET -> ERR
        assert bench.flushes == []
        await bench.write(st, RESET, expect=OKAY)            # RESET -> RESET strobes
        await bench.write(st, RTS, expect=OKAY)
        for v in (1, 2, 4, 5, 7, 0x13):     # not states; 0x13: bits above [2:0] are ignored
            expect = OKAY if v & 7 == RTS else SLVERR
            await bench.write(st, v, expect=expect)
        await state(RTS)
        # Busy: RTS/ERR -> RESET refused; ERR allowed.
        bench.set_busy(1 << q)
        await bench.write(st, RESET, expect=SLVERR)
        await state(RTS)
        await bench.write(st, ERR, expect=OKAY)
        await state(ERR)
        await bench.write(st, ERR, expect=OKAY)              # ERR -> ERR
        # Both host ERR writes flush (the completion unit drains what the QP waits for).
        assert [qpn for _, qpn in bench.flushes] == [q, q]
        await bench.write(st, RTS, expect=SLVERR)            # ERR -> RTS
        await bench.write(st, RESET, expect=SLVERR)
        await bench.write(qp_addr(q, 2), 0, expect=SLVERR)
        await state(ERR)
        bench.set_busy(0xFF & ~(1 << q))                     # other QPs' busy does not matter
        await bench.write(st, RESET, expect=OKAY)
        await state(RESET)
        # A write without byte lane 0 requests the current state.
        await bench.write(st, 0xFFFF_FF00 | RTS, 0xFE, expect=OKAY)
        assert [x for _, x in bench.resets] == bench.model.resets
        # Other QPs untouched; the flip-flop copies follow the context.
        bench.check_outputs()
        await bench.read(rmap.COUNTER_BASE + 8)

    run(dut, body, seed=5)


def test_qp_error_strobes():
    """Strobes move RTS QPs to ERR, both ports at once (same or different QPs); RESET and
    ERR QPs, and QP numbers the NIC lacks, ignore them; a host write in the same cycle; a
    host write or read of the state the cycle after a strobe."""
    dut = NicRegisters(num_qps=6, num_cqs=2)

    async def body(bench):
        ctx = bench.ctx
        for q in range(6):
            await program_qp(bench, q)
        for q in (0, 1, 2, 3):
            await bench.write(qp_addr(q, 0), RTS, expect=OKAY)
        await bench.strobe_errors([0, 1])                    # different QPs at once
        await bench.strobe_errors([2, 2, 2])               # the same QP on all three
        await bench.strobe_errors([4, 200])                  # RESET QP, a QP the NIC lacks
        await bench.strobe_errors([0, 5])                    # ERR QP, RESET QP
        await bench.idle(1)
        bench.check_outputs()
        states = [ctx.get(dut.qp_state[q]).value for q in range(6)]
        assert states == [ERR, ERR, ERR, RTS, RESET, RESET]
        await bench.strobe_errors([3])
        await bench.idle(1)
        assert ctx.get(dut.qp_state[3]).value == ERR

        # Exact timing, no pauses: AW and W handshake in cycle t0, the write commits in
        # t0 + 2 (B in t0 + 3). A strobe in t0 + 2 meets the host write.
        bench.pauses = False
        for q in (0, 1):
            await bench.write(qp_addr(q, 0), RESET, expect=OKAY)
            await bench.write(qp_addr(q, 0), RTS, expect=OKAY)
        t0 = bench.t
        bench.errors_at[t0 + 2] = (0,)                       # host RTS -> RESET wins
        await bench.write(qp_addr(0, 0), RESET, expect=OKAY)
        assert bench.resets[-1] == (t0 + 3, 0)
        t0 = bench.t
        bench.errors_at[t0 + 2] = (1, 1)                     # host RTS -> RTS: the error wins
        await bench.write(qp_addr(1, 0), RTS, expect=OKAY)
        bench.model.qp_error([1])
        t0 = bench.t
        bench.errors_at[t0 + 2] = (0,)                       # RESET -> RTS: the error is ignored
        await bench.write(qp_addr(0, 0), RTS, expect=OKAY)
        await bench.idle(1)
        bench.check_outputs()
        assert ctx.get(dut.qp_state[0]).value == RTS and ctx.get(dut.qp_state[1]).value == ERR
        # A strobe in t0 + 1, the cycle before the commit: the transaction sees ERR.
        t0 = bench.t
        bench.errors_at[t0 + 1] = (0,)
        bench.model.qp_error([0])
        await bench.write(qp_addr(0, 0), RTS, expect=SLVERR)     # ERR -> RTS
        await bench.write(qp_addr(0, 0), RESET, expect=OKAY)
        await bench.write(qp_addr(0, 0), RTS, expect=OKAY)
        t0 = bench.t
        bench.errors_at[t0 + 1] = (0,)
        bench.model.qp_error([0])
        await bench.read(qp_addr(0, 0), expect=(OKAY, ERR))

    run(dut, body, seed=6)


def test_bus_timing():
    """Without pauses: a write's B in the third cycle after its handshake, a read's R too;
    the doorbell and qp_reset strobes in the B cycle; read ports show a write two cycles
    after the commit."""
    dut = NicRegisters(num_qps=2, num_cqs=2, num_mkeys=2)

    async def body(bench):
        ctx, axi = bench.ctx, dut.axi
        ctx.set(axi.bready, 1)
        ctx.set(axi.rready, 1)
        ctx.set(dut.cq_read[0].addr, 1)
        ctx.set(axi.awvalid, 1)
        ctx.set(axi.awaddr, cq_addr(1, 0))
        ctx.set(axi.wvalid, 1)
        ctx.set(axi.wdata, 0x1234_5678_9ABC_DEF0)
        ctx.set(axi.wstrb, 0xFF)
        bench.model.write(cq_addr(1, 0), 0x1234_5678_9ABC_DEF0, 0xFF)
        seen = []
        for n in range(6):
            if n == 1:
                ctx.set(axi.awvalid, 0)
                ctx.set(axi.wvalid, 0)
            seen.append((ctx.get(axi.bvalid), ctx.get(dut.cq_read[0].data.base)))
            await ctx.tick()
        assert [b for b, _ in seen] == [0, 0, 0, 1, 0, 0]
        assert [d for _, d in seen] == [0, 0, 0, 0, 0x1234_5678_9ABC_DEF0, 0x1234_5678_9ABC_DEF0]
        ctx.set(axi.arvalid, 1)
        ctx.set(axi.araddr, cq_addr(1, 0))
        rv = []
        for n in range(5):
            if n == 1:
                ctx.set(axi.arvalid, 0)
            rv.append((ctx.get(axi.rvalid), ctx.get(axi.rdata) if ctx.get(axi.rvalid) else None))
            await ctx.tick()
        assert rv == [(0, None), (0, None), (0, None), (1, 0x1234_5678_9ABC_DEF0), (0, None)]
        bench.port_addr = {}            # the bench did not drive the read ports meanwhile

    run(dut, body, seed=7)


def test_inputs_read_at_commit():
    """The counters, the link status and ``qp_busy`` count as of the commit cycle (t0 + 2
    for a handshake in t0), not the cycle before or after."""
    dut = NicRegisters(num_qps=2, num_cqs=2, num_mkeys=2)

    async def body(bench):
        ctx, axi = bench.ctx, dut.axi
        k = 5
        port = {"counter": dut.counters[k], "link": dut.link_inits, "busy": dut.qp_busy}

        async def transaction(addr, data, name, values):
            """A read (``data`` None) or full write handshaken in t0, with ``values[n]`` on
            input ``name`` in t0 + 1 + n; the response."""
            ctx.set(axi.bready, 1)
            ctx.set(axi.rready, 1)
            if data is None:
                ctx.set(axi.arvalid, 1)
                ctx.set(axi.araddr, addr)
            else:
                bench.model.busy = values[1]
                want = bench.model.write(addr, data, 0xFF)
                bench.writing = True
                ctx.set(axi.awvalid, 1)
                ctx.set(axi.awaddr, addr)
                ctx.set(axi.wvalid, 1)
                ctx.set(axi.wdata, data)
                ctx.set(axi.wstrb, 0xFF)
            got = None
            for n in range(5):
                if n == 1:
                    for valid in (axi.arvalid, axi.awvalid, axi.wvalid):
                        ctx.set(valid, 0)
                if 1 <= n <= len(values):
                    ctx.set(port[name], values[n - 1])
                if ctx.get(axi.rvalid):
                    got = ctx.get(axi.rresp), ctx.get(axi.rdata)
                if ctx.get(axi.bvalid):
                    got = ctx.get(axi.bresp)
                await bench.step()
            if data is not None:
                assert got == want, (got, want)
                bench.writing = False
                bench.check_from = bench.t
            return got

        counter = rmap.COUNTER_BASE + 8 * (len(rmap.OWN_COUNTERS) + k)
        assert await transaction(counter, None, "counter", [1, 2, 3]) == (OKAY, 2)
        assert await transaction(0x28, None, "link", [1, 2, 3]) == (OKAY, 2 << 32)
        await program_qp(bench, 1, cqn=0)
        await bench.write(qp_addr(1, 0), RTS, expect=OKAY)
        # RTS -> RESET: refused while the QP is busy.
        assert await transaction(qp_addr(1, 0), RESET, "busy", [0, 2, 0]) == SLVERR
        assert await transaction(qp_addr(1, 0), RESET, "busy", [2, 0, 2]) == OKAY
        bench.set_busy(0)

    run(dut, body, seed=10, pauses=False)


def test_read_and_write_offered_together():
    """Six writes and six reads offered back to back at once, AR and AW/W valid whenever
    one is pending: the slave alternates (the write first: nothing went before it) and
    each read returns what the writes before it left."""
    dut = NicRegisters(num_qps=2, num_cqs=2, num_mkeys=2)

    async def body(bench):
        ctx, axi, m = bench.ctx, dut.axi, bench.model
        writes = [0x1000 + k for k in range(6)]
        reads = 6
        order, b_want, r_want, b_got, r_got = [], [], [], [], []
        ctx.set(axi.bready, 1)
        ctx.set(axi.rready, 1)
        ctx.set(axi.awaddr, 0x10)
        ctx.set(axi.araddr, 0x10)
        ctx.set(axi.wstrb, 0xFF)
        while len(b_got) < 6 or len(r_got) < reads:
            w_pending = len(order) - order.count("r") < len(writes)
            r_pending = order.count("r") < reads
            ctx.set(axi.awvalid, w_pending)
            ctx.set(axi.wvalid, w_pending)
            ctx.set(axi.arvalid, r_pending)
            if w_pending:
                ctx.set(axi.wdata, writes[order.count("w")])
            if w_pending and ctx.get(axi.awready):
                assert ctx.get(axi.wready)
                b_want.append(m.write(0x10, writes[order.count("w")], 0xFF))
                order.append("w")
            elif r_pending and ctx.get(axi.arready):
                r_want.append(m.read(0x10))
                order.append("r")
            if ctx.get(axi.bvalid):
                b_got.append(ctx.get(axi.bresp))
            if ctx.get(axi.rvalid):
                r_got.append((ctx.get(axi.rresp), ctx.get(axi.rdata)))
            await bench.step()
        ctx.set(axi.awvalid, 0)
        ctx.set(axi.wvalid, 0)
        ctx.set(axi.arvalid, 0)
        assert order == ["w", "r"] * 6, order
        assert b_got == b_want and r_got == r_want
        assert r_want == [(OKAY, w) for w in writes]

    run(dut, body, seed=9)


# --- Configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(num_qps=0), dict(num_qps=257), dict(num_qps=1.5), dict(num_cqs=0), dict(num_cqs=300),
    dict(num_mkeys=0), dict(num_mkeys=48), dict(num_mkeys=512), dict(num_vls=0),
    dict(num_vls=9), dict(qp_read_ports=0), dict(cq_read_ports=9), dict(mkey_read_ports="1"),
    dict(addr_width=15), dict(addr_width=33),
])
def test_parameter_checks(kwargs):
    # A component whose constructor raised would warn, when collected, that it was never
    # elaborated: collect it here with that warning off.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match="must be"):
                NicRegisters(**kwargs)
        finally:
            gc.collect()


def test_extreme_sizes_elaborate():
    """One entry per table and 256 per table both build and answer."""
    for n in (1, 256):
        dut = NicRegisters(num_qps=n, num_cqs=n, num_mkeys=n, num_vls=1)

        async def body(bench):
            await program_qp(bench, n - 1, cqn=0)
            await bench.write(qp_addr(n - 1, 0), RTS, expect=OKAY)
            await bench.read(qp_addr(n - 1, 0), expect=(OKAY, RTS))
            await bench.read(mkey_addr(n - 1, 3))
            await bench.write(mkey_addr(n, 0), 1, expect=SLVERR)

        run(dut, body, seed=8)


def test_offset_helpers():
    assert rmap.register_offset("slid") == 0x10
    assert rmap.register_offset("register_write_errors") == rmap.COUNTER_BASE + 8
    assert rmap.register_offset("doorbells_accepted") == rmap.COUNTER_BASE + 16
    assert rmap.context_offset("qp", 3, "state") == qp_addr(3, 0)
    assert rmap.context_offset("qp", 255, "psn_cq") == qp_addr(255, 5)
    assert rmap.context_offset("cq", 2, "config") == cq_addr(2, 1)
    assert rmap.context_offset("mkey", 7, "length") == mkey_addr(7, 3)
    with pytest.raises(KeyError):
        rmap.register_offset("nope")
    with pytest.raises(KeyError):
        rmap.context_offset("cq", 0, "sq_base")
    with pytest.raises(ValueError):
        rmap.context_offset("qp", 256, "state")


def test_doc_is_generated():
    text = (REPO / "docs" / "nic-registers.md").read_text()
    assert text == rmap.render_markdown(), \
        "docs/nic-registers.md is stale: python -m hdl.nic.register_map > docs/nic-registers.md"
