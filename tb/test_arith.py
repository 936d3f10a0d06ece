"""The depth-built arithmetic against Python integers, in Amaranth's simulator:
``hdl.arith.lookahead_sum`` (every operand pair of up to 5 bits with each carry in, with
``half=`` and stop bits every 6-bit pair, and
random and edge operands at the widths the NIC uses), ``hdl.arith.sum3`` (every triple of
4-bit operands, with and without the extra one, and with a negative constant at 16 bits),
``hdl.arith.or_all`` (1 to 9 values,
its tree's depth), and ``hdl.nic.payload_reads``'
``payload_words`` and ``payload_bursts`` against the burst arithmetic they replace
(``beats = (offset + length + 63) >> 6``, ``page_left = 64 - addr[6:12]``, two bursts when
``beats > page_left``), for every offset and every length up to 4096 on pages' edges.
"""
import itertools
import random

import pytest
from amaranth.hdl import Module, Signal

from hdl.arith import lookahead_sum, or_all, sum3
from hdl.nic.payload_reads import payload_bursts, payload_words
from tb.amaranth_sim import simulate


def check_sums(width_a, width_b, cases, carry):
    """``carry``: None for a carry-in signal (each case's third value), else a constant."""
    m = Module()
    a, b, c = Signal(width_a), Signal(width_b), Signal()
    total = lookahead_sum(m, a, b, c if carry is None else carry)
    assert len(total) == max(width_a, width_b) + 1

    async def testbench(ctx):
        for x, y, z in cases:
            ctx.set(a, x)
            ctx.set(b, y)
            ctx.set(c, z)
            want = x + y + (z if carry is None else carry)
            assert ctx.get(total) == want, (width_a, width_b, x, y, z, ctx.get(total))

    simulate(m, testbench, clock=False)


@pytest.mark.parametrize("carry", [None, 0, 1])
def test_lookahead_exhaustive(carry):
    for width_a, width_b in itertools.product(range(1, 6), repeat=2):
        check_sums(width_a, width_b,
                   itertools.product(range(1 << width_a), range(1 << width_b), (0, 1)), carry)


@pytest.mark.parametrize("plus_one", [False, True])
def test_sum3_exhaustive(plus_one):
    m = Module()
    a, b, c = Signal(4), Signal(4), Signal(4)
    total = sum3(m, a, b, c, 4, plus_one=plus_one)
    assert len(total) == 4

    async def testbench(ctx):
        for x, y, z in itertools.product(range(16), repeat=3):
            ctx.set(a, x)
            ctx.set(b, y)
            ctx.set(c, z)
            assert ctx.get(total) == (x + y + z + plus_one) % 16, (x, y, z, ctx.get(total))

    simulate(m, testbench, clock=False)


def test_sum3_negative_constant():
    """A constant operand is taken modulo 2^width: db - fp - 17 as db + ~fp - 16."""
    m = Module()
    db, fp = Signal(16), Signal(16)
    total = sum3(m, db, ~fp, -16, 16)
    rng = random.Random(3)

    async def testbench(ctx):
        for _ in range(300):
            x, y = rng.getrandbits(16), rng.getrandbits(16)
            ctx.set(db, x)
            ctx.set(fp, y)
            assert ctx.get(total) == (x - y - 17) % (1 << 16), (x, y)

    simulate(m, testbench, clock=False)


@pytest.mark.parametrize("width", [7, 11, 13, 32, 52, 64])
def test_lookahead_wide(width):
    rng = random.Random(width)
    top = (1 << width) - 1
    cases = [(rng.getrandbits(width), rng.getrandbits(width), rng.getrandbits(1))
             for _ in range(400)]
    cases += [(top, 0, 1), (top, top, 1), (0, 0, 0), (top, 1, 0), (1 << (width - 1), top, 0)]
    # Carries that run through every group: x + (2^k - x) for each k.
    cases += [(x, (1 << k) - x, 0) for k in range(1, width) for x in (1, (1 << k) - 1)]
    check_sums(width, width, cases, None)
    check_sums(width, width // 2, [(x, y & ((1 << width // 2) - 1), z) for x, y, z in cases], None)


def reference_bursts(addr, length):
    beats = ((addr % 64) + length + 63) >> 6
    page_left = 64 - (addr >> 6) % 64
    two = beats > page_left
    return {
        "offset": addr % 64, "beats": beats, "n_ar": 2 if two else 1,
        "ar0_addr": addr & ~63, "ar0_len": ((page_left if two else beats) - 1) % 256,
        "ar1_addr": ((addr >> 12) + 1) % (1 << 52) << 12, "ar1_len": (beats - page_left - 1) % 256,
    }


@pytest.mark.parametrize("count", range(1, 10))
def test_or_all(count):
    """The OR of ``count`` 8-bit values, as a tree of ceil(log2(count)) ORs."""
    m = Module()
    values = [Signal(8, name=f"v{i}") for i in range(count)]
    result = Signal(8)
    tree = or_all(values)
    m.d.comb += result.eq(tree)

    def depth(value):
        operands = getattr(value, "operands", ())
        return 1 + max(map(depth, operands)) if operands else 0
    assert depth(tree) == (count - 1).bit_length()
    rng = random.Random(count)

    async def testbench(ctx):
        for _ in range(50):
            words = [rng.choice([0, 1 << rng.randrange(8), rng.getrandbits(8)]) for _ in values]
            for signal, word in zip(values, words):
                ctx.set(signal, word)
            want = 0
            for word in words:
                want |= word
            assert ctx.get(result) == want, words

    simulate(m, testbench, clock=False)


def test_or_all_refuses_nothing():
    with pytest.raises(ValueError, match="at least one"):
        or_all([])


def test_payload_bursts():
    m = Module()
    addr, length = Signal(64), Signal(32)
    beats, beats_less1 = payload_words(m, addr[:6], length)
    bursts = payload_bursts(m, addr, beats, beats_less1)

    async def testbench(ctx):
        rng = random.Random(5)
        lengths = [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 1000, 2048, 4031, 4032, 4033,
                   4095, 4096]
        pages = [0, (1 << 52) - 1, rng.getrandbits(52)]
        cases = [(page << 12 | word << 6 | offset, n) for offset in range(64)
                 for word in (0, 1, 31, 62, 63) for n in lengths for page in pages[:1]]
        cases += [(rng.choice(pages) << 12 | rng.getrandbits(12), rng.randint(1, 4096))
                  for _ in range(800)]
        for a, n in cases:
            ctx.set(addr, a)
            ctx.set(length, n)
            want = reference_bursts(a, n)
            got = {name: ctx.get(getattr(bursts, name)) for name in want}
            assert got == want, (hex(a), n, got, want)
            assert ctx.get(beats_less1) == want["beats"] - 1
        # payload_words counts length modulo 8192, and its words modulo 128.
        for a, n in [(5, 8192 + 100), (0, (1 << 32) - 1), (63, 3 * 8192)]:
            ctx.set(addr, a)
            ctx.set(length, n)
            words = (a % 64 + n + 63) >> 6
            assert (ctx.get(beats), ctx.get(beats_less1)) == (words % 128, (words - 1) % 128)

    simulate(m, testbench, clock=False)


def test_lookahead_half_stops_carries():
    """``half=``: operands with the stop bits cleared and their real half sums given add
    each field on its own (a masked fetch-and-add), every 6-bit operand pair and stop mask."""
    m = Module()
    a, b, stops = Signal(6), Signal(6), Signal(6)
    kept_a, kept_b, half = Signal(6), Signal(6), Signal(6)
    m.d.comb += [kept_a.eq(a & ~stops), kept_b.eq(b & ~stops), half.eq(a ^ b)]
    total = lookahead_sum(m, kept_a, kept_b, half=half)

    async def testbench(ctx):
        for x, y, s in itertools.product(range(64), range(64), (0, 0b000100, 0b100101, 0b111111)):
            ctx.set(a, x)
            ctx.set(b, y)
            ctx.set(stops, s)
            want, low = 0, 0
            for bit in range(6):
                if s >> bit & 1 or bit == 5:
                    width = bit + 1 - low
                    want |= (((x >> low) + (y >> low)) & ((1 << width) - 1)) << low
                    low = bit + 1
            assert ctx.get(total) % 64 == want, (x, y, s)

    simulate(m, testbench, clock=False)
