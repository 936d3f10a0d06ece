"""AtomicUnit (hdl/nic/atomic_unit.py) against a Python reference, in Amaranth's simulator.

The bench plays the unit's neighbours cycle by cycle: a request source (a presented
request is held until taken), a result sink with random ``ready`` (the stream rule is
checked: a presented result stays, unchanged, until taken), and a memory with AXI read
(``ar``/``r``) and write (AW/W/B) channels: random ``ar.ready``/``awready``/``wready``, a
random latency before the R beat and the B response, and injected SLVERR/DECERR on reads
and writes (a write answered with an error leaves memory unchanged). Every AR/AW/W is
checked when taken: IDs, one beat, full-width size, INCR, the beat address holding the
word, ``wstrb`` exactly the word's 8 (or 4) bytes, ``wlast``. The bench also checks that one
operation at a time is in the memory (no AR before the previous result, no write before
the read data, no write after a failed read, the result only after B).

The reference applies each request to its own copy of the words, in order, with the
errors the memory injected for that request; results (``orig``, ``error``), the final
memory and the counters are compared. Random: FETCH_ADD and COMPARE_SWAP (equal and
unequal compares, wrap-around adds) on a few words sharing beats; masked ones (random
field boundaries, swap and compare masks) of 8 and 4 bytes mixed with them on the same
words, 4-byte ones on both halves of a word. Directed: read error,
write error, both kinds on each word position of a beat, zero-latency memory,
addresses cut to a narrower AXI address.
"""
import gc
import random
import warnings
from collections import deque

import pytest
from amaranth.hdl import UnusedElaboratable

from hdl.nic.atomic_unit import AtomicUnit
from hdl.nic.signatures import ATOMIC_ID, AtomicRequestLayout
from models.nic import masked_fetch_add
from tb.amaranth_sim import simulate

M64 = (1 << 64) - 1
REQUEST = AtomicRequestLayout()


class Memory:
    """Byte-addressed memory (64-byte beats, created with random bytes when first read)."""

    def __init__(self, rng):
        self.rng = rng
        self.beats = {}

    def beat(self, addr):
        assert addr % 64 == 0
        if addr not in self.beats:
            self.beats[addr] = bytearray(self.rng.randbytes(64))
        return self.beats[addr]

    def word(self, addr, nbytes=8):
        return int.from_bytes(self.beat(addr & ~63)[addr % 64:addr % 64 + nbytes], "little")


def full(op):
    """An operation as the bench keeps it: (addr, fetch_add, swap_add, compare, read_err,
    write_err, size4, swap_mask, compare_mask); a six-field one is IBA's FetchAdd (no
    field boundary) or CmpSwap (both masks all ones)."""
    if len(op) == 9:
        return op
    mask = 0 if op[1] else M64
    return (*op, 0, mask, mask)


def apply(op, orig):
    """The reference: the word an operation leaves (masked semantics, docs/nic-formats.md)."""
    _, fetch_add, swap_add, compare, _, _, size4, swap_mask, compare_mask = op
    bits = 32 if size4 else 64
    ones = (1 << bits) - 1
    if fetch_add:
        return masked_fetch_add(orig, swap_add & ones, swap_mask & ones, bits)
    if (orig ^ compare) & compare_mask & ones:
        return orig
    return (orig & ~swap_mask | swap_add & swap_mask) & ones


class Bench:
    def __init__(self, dut, ops, *, rng, p_req=0.6, p_ar=0.6, p_aw=0.6, p_w=0.6, p_res=0.6,
                 latency=(0, 20), b_latency=(0, 10)):
        self.dut, self.rng = dut, rng
        self.ops = deque(full(op) for op in ops)     # see full()
        self.p = dict(req=p_req, ar=p_ar, aw=p_aw, w=p_w, res=p_res)
        self.latency, self.b_latency = latency, b_latency
        self.mem = Memory(rng)
        self.ref = {}               # the reference's words, by address (set by run)
        self.results = []
        self.amask = (1 << dut.addr_width) - 1

    def reference(self, op):
        addr, read_err, write_err, size4 = op[0], op[4], op[5], op[6]
        if read_err:
            return 0, 1
        word = addr & ~7
        shift = 8 * (addr % 8) if size4 else 0
        ones = (1 << (32 if size4 else 64)) - 1
        orig = self.ref[word] >> shift & ones
        if not write_err:
            self.ref[word] = self.ref[word] & ~(ones << shift) | apply(op, orig) << shift
        return orig, int(write_err)

    async def run(self, ctx, max_cycles=100_000):
        dut, rng, p = self.dut, self.rng, self.p
        presented = None
        current = None              # the operation taken and not yet answered
        phase = None                # "ar", "r", "write", "b", "result"
        r_at = None                 # (cycle, beat address, resp) of the R beat owed
        aw = w = None
        b_at = None
        last_result = None
        executed = errors = 0
        for t in range(max_cycles):
            if presented is None and self.ops and rng.random() < p["req"]:
                presented = self.ops.popleft()
            ctx.set(dut.request.valid, presented is not None)
            if presented is not None:
                addr, fetch_add, swap_add, compare, _, _, size4, swap_mask, compare_mask = presented
                ctx.set(dut.request.payload, REQUEST.const(
                    {"addr": addr, "fetch_add": fetch_add, "swap_add": swap_add,
                     "compare": compare, "size4": size4, "swap_mask": swap_mask,
                     "compare_mask": compare_mask}))
            ctx.set(dut.ar.ready, rng.random() < p["ar"])
            r_valid = r_at is not None and r_at[0] <= t
            ctx.set(dut.r.valid, r_valid)
            if r_valid:
                data = int.from_bytes(self.mem.beat(r_at[1]), "little")
                if r_at[2]:
                    data = int.from_bytes(rng.randbytes(64), "little")
                ctx.set(dut.r.payload, {"data": data, "resp": r_at[2], "last": 1})
            ctx.set(dut.axi.awready, rng.random() < p["aw"])
            ctx.set(dut.axi.wready, rng.random() < p["w"])
            b_valid = b_at is not None and b_at[0] <= t
            ctx.set(dut.axi.bvalid, b_valid)
            ctx.set(dut.axi.bid, ATOMIC_ID)
            ctx.set(dut.axi.bresp, b_at[1] if b_valid else 0)
            res_ready = rng.random() < p["res"]
            ctx.set(dut.result.ready, res_ready)

            assert ctx.get(dut.r.ready) and ctx.get(dut.axi.bready), t
            if presented is not None and ctx.get(dut.request.ready):
                assert current is None, (t, "request taken while one is in progress")
                current, presented, phase = presented, None, "ar"
            if ctx.get(dut.ar.valid):
                assert phase == "ar", (t, "AR outside the read phase", phase)
                if ctx.get(dut.ar.ready):
                    assert ctx.get(dut.ar.payload.id) == ATOMIC_ID
                    assert ctx.get(dut.ar.payload.len) == 0
                    assert ctx.get(dut.ar.payload.addr) == current[0] & ~63 & self.amask, t
                    resp = rng.choice([2, 3]) if current[4] else 0
                    r_at = (t + 1 + rng.randint(*self.latency), current[0] & ~63, resp)
                    phase = "r"
            if r_valid:
                phase = "result" if r_at[2] else "write"
                r_at = None
            if ctx.get(dut.axi.awvalid):
                assert phase == "write" and aw is None, (t, "AW outside the write phase", phase)
                if ctx.get(dut.axi.awready):
                    aw = (ctx.get(dut.axi.awid), ctx.get(dut.axi.awaddr), ctx.get(dut.axi.awlen),
                          ctx.get(dut.axi.awsize), ctx.get(dut.axi.awburst))
                    assert aw == (ATOMIC_ID, current[0] & ~63 & self.amask, 0, 6, 1), (t, aw)
            if ctx.get(dut.axi.wvalid):
                assert phase == "write" and w is None, (t, "W outside the write phase", phase)
                if ctx.get(dut.axi.wready):
                    w = (ctx.get(dut.axi.wdata), ctx.get(dut.axi.wstrb), ctx.get(dut.axi.wlast))
                    assert w[1] == (0xF if current[6] else 0xFF) << (current[0] % 64), (t, hex(w[1]))
                    assert w[2] == 1, t
            if phase == "write" and aw is not None and w is not None:
                resp = rng.choice([2, 3]) if current[5] else 0
                if not resp:
                    at, size = current[0] % 64, 4 if current[6] else 8
                    self.mem.beat(current[0] & ~63)[at:at + size] = \
                        (w[0] >> (8 * at)).to_bytes(64, "little")[:size]
                b_at = (t + 1 + rng.randint(*self.b_latency), resp)
                aw = w = None
                phase = "b"
            if b_valid:
                assert phase == "b", (t, "B not awaited")
                b_at = None
                phase = "result"
            if ctx.get(dut.result.valid):
                raw = (ctx.get(dut.result.payload.orig), ctx.get(dut.result.payload.error))
                assert phase == "result", (t, "result before the operation ended", phase)
                assert last_result is None or last_result == raw, (t, "result changed")
                last_result = raw
                if res_ready:
                    want = self.reference(current)
                    assert raw == want, (t, current, raw, want)
                    self.results.append(raw)
                    executed += 1
                    errors += raw[1]
                    current = phase = last_result = None
            else:
                assert last_result is None, (t, "result withdrawn")
            await ctx.tick()
            if current is None and presented is None and not self.ops:
                break
        else:
            raise AssertionError("operations did not finish")
        for addr, word in self.ref.items():
            assert self.mem.word(addr) == word, (hex(addr), self.mem.word(addr), word)
        assert ctx.get(dut.atomics_executed) == executed
        assert ctx.get(dut.atomic_memory_errors) == errors


def plan(rng, words, n, p_err=0.1, p_hit=0.5):
    """``n`` random operations on the words ``words`` (address: initial value); a
    COMPARE_SWAP compares with the value its word will hold (a hit) with ``p_hit``.
    Returns the operations and the number of hits."""
    shadow = dict(words)
    ops, hits = [], 0
    for _ in range(n):
        addr = rng.choice(list(words))
        fetch_add = rng.random() < 0.5
        swap_add = rng.choice([1, M64, rng.randrange(1 << 64), rng.randrange(16)])
        read_err = rng.random() < p_err
        write_err = not read_err and rng.random() < p_err
        compare = shadow[addr] if rng.random() < p_hit else rng.randrange(1 << 64)
        if not read_err:
            orig = shadow[addr]
            hits += not fetch_add and orig == compare
            new = (orig + swap_add) & M64 if fetch_add else (swap_add if orig == compare else orig)
            if not write_err:
                shadow[addr] = new
        ops.append((addr, fetch_add, swap_add, compare, read_err, write_err))
    return ops, hits


def run(rng, ops, words=(), addr_width=64, **kwargs):
    dut = AtomicUnit(addr_width=addr_width)
    bench = Bench(dut, ops, rng=rng, **kwargs)
    for addr, value in dict(words).items():
        bench.mem.beat(addr & ~63)[addr % 64:addr % 64 + 8] = value.to_bytes(8, "little")
        bench.ref[addr] = value

    async def body(ctx):
        await bench.run(ctx)

    simulate(dut, body)
    assert len(bench.results) == len(ops)
    return bench


# A few words, some sharing a beat (first and last word of one), one at the top of memory.
ADDRS = [0x1000, 0x1008, 0x1038, 0x2040, (1 << 64) - 8]


@pytest.mark.parametrize("seed, fast", [(1, False), (2, False), (3, True)])
def test_random(seed, fast):
    rng = random.Random(seed)
    words = {a: rng.choice([0, M64, M64 - 3, rng.randrange(1 << 64)]) for a in ADDRS}
    ops, hits = plan(rng, words, 300)
    misses = sum(1 for op in ops if not op[1] and not op[4]) - hits
    assert hits > 20 and misses > 20
    kwargs = dict(p_req=1, p_ar=1, p_aw=1, p_w=1, p_res=1, latency=(0, 0),
                  b_latency=(0, 0)) if fast else {}
    bench = run(rng, ops, words, **kwargs)
    assert any(r[1] for r in bench.results) and not all(r[1] for r in bench.results)


def test_directed_errors():
    rng = random.Random(7)
    words = {0x40 + 8 * k: 1000 + k for k in range(8)}
    ops = []
    for k in range(8):
        addr = 0x40 + 8 * k
        ops += [
            (addr, 1, 5, 0, True, False),               # read error: nothing written
            (addr, 1, 5, 0, False, True),               # write error: orig, memory unchanged
            (addr, 0, 77, 1000 + k, True, False),        # CS hit, read error
            (addr, 0, 77, 1000 + k, False, True),        # CS hit, write error
            (addr, 0, 77, 1000 + k, False, False),       # CS hit
            (addr, 0, 99, 1000 + k, False, False),       # CS miss (word is 77)
            (addr, 1, M64, 0, False, False),             # FA wraps: 76
        ]
    bench = run(rng, ops, words)
    want = []
    for k in range(8):
        want += [(0, 1), (1000 + k, 1), (0, 1), (1000 + k, 1), (1000 + k, 0), (77, 0), (77, 0)]
    assert bench.results == want
    assert all(bench.mem.word(a) == 76 for a in words)


def test_narrow_addresses():
    # Addresses beyond a 40-bit AXI address are cut to it (the engine keeps them in range).
    rng = random.Random(9)
    words = {0x1008: 5, (1 << 40) + 0x1010: 6}
    ops = [(a, 1, 1, 0, False, False) for a in words] * 3
    bench = run(rng, ops, words, addr_width=40)
    assert [r[0] for r in bench.results] == [5, 6, 6, 7, 7, 8]


def test_zero_latency_back_to_back():
    rng = random.Random(8)
    words = {0x80: 0}
    ops = [(0x80, 1, 1, 0, False, False)] * 50
    bench = run(rng, ops, words, p_req=1, p_ar=1, p_aw=1, p_w=1, p_res=1, latency=(0, 0),
                b_latency=(0, 0))
    assert [r[0] for r in bench.results] == list(range(50))
    assert bench.mem.word(0x80) == 50


@pytest.mark.parametrize("addr_width", [11, 65, 32.0])
def test_parameters(addr_width):
    # A component whose constructor raised would warn, when collected, that it was never
    # elaborated: collect it here with that warning off.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match="must be"):
                AtomicUnit(addr_width=addr_width)
        finally:
            gc.collect()


def masked_plan(rng, words, n, p_err=0.05):
    """``n`` operations on the 8-byte ``words``: plain and masked, 8- and 4-byte (either
    half), random operands and masks; compares that match on their mask half the time."""
    shadow = dict(words)
    ops = []
    for _ in range(n):
        word = rng.choice(list(words))
        size4 = rng.random() < 0.5
        addr = word + (rng.choice([0, 4]) if size4 else 0)
        bits = 32 if size4 else 64
        ones = (1 << bits) - 1
        fetch_add = rng.random() < 0.5
        swap_add = rng.choice([1, ones, rng.getrandbits(bits)])
        swap_mask = rng.choice([0, ones, rng.getrandbits(bits), 0x8080_8080_8080_8080 & ones])
        compare_mask = rng.choice([0, ones, rng.getrandbits(bits)])
        shift = 8 * (addr % 8)
        orig = shadow[word] >> shift & ones
        compare = orig ^ (0 if rng.random() < 0.5 else rng.getrandbits(bits))
        read_err = rng.random() < p_err
        write_err = not read_err and rng.random() < p_err
        op = (addr, fetch_add, swap_add, compare, read_err, write_err, int(size4), swap_mask,
              compare_mask)
        if not (read_err or write_err):
            shadow[word] = shadow[word] & ~(ones << shift) | apply(op, orig) << shift
        ops.append(op)
    return ops


@pytest.mark.parametrize("seed", [4, 5])
def test_masked_random(seed):
    rng = random.Random(seed)
    words = {a: rng.getrandbits(64) for a in ADDRS}
    ops = masked_plan(rng, words, 300) + plan(rng, words, 40)[0]
    rng.shuffle(ops)
    run(rng, ops, words)


def test_masked_directed():
    """A carry stopped at a field boundary; a 4-byte add that wraps without touching the
    other half; 4-byte AND/OR as masked compare-swap, as NVSHMEM posts them."""
    rng = random.Random(6)
    words = {0x100: 0x0000_00FF_FFFF_FFFF, 0x108: 0x1111_1111_FFFF_FFFF}
    ops = [
        (0x100, 1, 1, 0, False, False, 0, 0x8000_0000, 0),          # carry stops at bit 31
        (0x108, 1, 1, 0, False, False, 1, 0, 0),                    # low half wraps to 0
        (0x10C, 0, 0x0F0F_0F0F, 0, False, False, 1, ~0x0F0F_0F0F & 0xFFFF_FFFF, 0),  # AND
        (0x10C, 0, 0xA000_0000, 0, False, False, 1, 0xA000_0000, 0),  # OR
    ]
    bench = run(rng, ops, words)
    assert [r[0] for r in bench.results] == [0x0000_00FF_FFFF_FFFF, 0xFFFF_FFFF, 0x1111_1111,
                                             0x0101_0101]
    assert bench.mem.word(0x100) == 0x0000_00FF_0000_0000
    assert bench.mem.word(0x108) == 0xA101_0101_0000_0000
