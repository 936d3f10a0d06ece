"""GatherPacker (hdl/nic/gather_packer.py) in Amaranth's simulator, against a byte
reference: each packet's pieces concatenated from its first piece's start lane.

Packets of 1..4 pieces of random starts and lengths, with garbage in every raw lane
outside a piece, go in with random gaps on both inputs (records and raw beats offered
independently, so a piece's beats may wait for its record) and random ``packed.ready``.
Checked per packet: its packed beats (up to the one with ``last``) number
``ceil((start + total) / 64)`` and hold the concatenation byte for byte in lanes
``start .. start + total - 1``; a packed beat's ``resp`` is SLVERR exactly when one of
the raw beats whose bytes it holds had SLVERR (one random raw beat of 10% of packets). The sweep gives every pair of (piece start, fill) and every
length modulo 64 (a second piece of a two-piece packet). Packets cut from random gather
lists at random MTUs by ``models.nic.gather_pieces``, beats read from a random memory.
Directed: one-piece packets
with both inputs always ready keep their bytes' lanes, one beat per cycle, each in the
cycle it is taken; a spilled last beat costs one cycle.
"""
import random
from collections import deque

import pytest

from hdl.nic.gather_packer import GatherPacker
from models.nic import gather_pieces
from tb.amaranth_sim import Driver, assert_lint_clean, assert_rejected, simulate

WIDTH = 64
MASK = (1 << 8 * WIDTH) - 1


def raw_beats(rng, start, payload, error):
    """The raw beats of a piece: ``payload`` from lane ``start`` of the first, garbage in
    every other lane, ``resp`` 2 (SLVERR) on one beat when ``error``; and per payload byte
    whether its beat had the error."""
    count = (start + len(payload) + WIDTH - 1) // WIDTH
    run = bytearray(rng.randbytes(count * WIDTH))
    run[start:start + len(payload)] = payload
    bad = rng.randrange(count) if error else None
    beats = [(int.from_bytes(run[k * WIDTH:(k + 1) * WIDTH], "little"), 2 if k == bad else 0)
             for k in range(count)]
    return beats, [(start + i) // WIDTH == bad for i in range(len(payload))]


def make_packet(rng, pieces, error=False):
    """``pieces``: (start, length) pairs. Returns (records, beats, expected): the pieces'
    records, their raw beats in order, and (first start, concatenation, per byte whether
    its raw beat had an error)."""
    records, beats, concat, bad_bytes = [], [], bytearray(), []
    bad_piece = rng.randrange(len(pieces)) if error else None
    for index, (start, length) in enumerate(pieces):
        payload = rng.randbytes(length)
        piece_beats, piece_bad = raw_beats(rng, start, payload, index == bad_piece)
        records.append(dict(start=start, bytes=length, beats=len(piece_beats),
                            last=int(index == len(pieces) - 1)))
        beats += piece_beats
        concat += payload
        bad_bytes += piece_bad
    return records, beats, (pieces[0][0], bytes(concat), bad_bytes)


def run(packets, *, seed=0, gap=0.3, ready=0.7, max_cycles=200_000):
    """Feed ``packets`` (:func:`make_packet` results); returns the cycles from the first raw
    beat taken to the last packed beat, and the cycles each packed beat came out."""
    rng = random.Random(seed)
    dut = GatherPacker(piece_depth=8)
    records = deque(r for p in packets for r in p[0])
    beats = deque(b for p in packets for b in p[1])
    expected = deque(p[2] for p in packets)
    result = dict(first_take=None, out_cycles=[])

    async def bench(ctx):
        drive = Driver()
        got, cycle, held = [], 0, None
        while expected:
            record = records[0] if records and rng.random() >= gap else None
            beat = beats[0] if beats and rng.random() >= gap else None
            drive.set(dut.pieces.valid, record is not None)
            if record is not None:
                drive.set(dut.pieces.payload, record)
            drive.set(dut.raw.valid, beat is not None)
            if beat is not None:
                drive.set(dut.raw.payload.data, beat[0])
                drive.set(dut.raw.payload.resp, beat[1])
            out_ready = rng.random() < ready
            drive.set(dut.packed.ready, out_ready)
            drive.apply(ctx)
            # A beat offered and not taken stays, unchanged, lanes outside the run too.
            offered = ctx.get(dut.packed.payload.as_value()) if ctx.get(dut.packed.valid) else None
            if held is not None:
                assert offered == held, f"cycle {cycle}: a packed beat offered changed before it was taken"
            held = None if out_ready else offered
            if record is not None and ctx.get(dut.pieces.ready):
                records.popleft()
            if beat is not None and ctx.get(dut.raw.ready):
                beats.popleft()
                if result["first_take"] is None:
                    result["first_take"] = cycle
            if out_ready and ctx.get(dut.packed.valid):
                result["out_cycles"].append(cycle)
                out = ctx.get(dut.packed.payload)
                got.append((out.data, out.resp))
                if out.last:
                    check(got, *expected.popleft())
                    got = []
            await ctx.tick()
            cycle += 1
            assert cycle < max_cycles, "did not finish"
        assert not got, "packed beats after the last packet"

    def check(got, start, concat, bad_bytes):
        count = (start + len(concat) + WIDTH - 1) // WIDTH
        assert len(got) == count, (start, len(concat), len(got), count)
        run = b"".join(data.to_bytes(WIDTH, "little") for data, _ in got)
        assert run[start:start + len(concat)] == concat, (start, len(concat))
        lanes = [False] * start + bad_bytes
        resps = [2 if any(lanes[k * WIDTH:(k + 1) * WIDTH]) else 0 for k in range(count)]
        assert [resp for _, resp in got] == resps, (start, len(concat))

    simulate(dut, bench)
    return result


def random_packets(rng, count, max_pieces=4, max_length=300, errors=0.1):
    packets = []
    for _ in range(count):
        pieces = [(rng.randrange(WIDTH), rng.randint(1, max_length))
                  for _ in range(rng.randint(1, max_pieces))]
        packets.append(make_packet(rng, pieces, rng.random() < errors))
    return packets


@pytest.mark.parametrize("seed", [1, 2])
def test_random(seed):
    """Random 1..4-piece packets, random gaps and backpressure, raw errors now and then."""
    rng = random.Random(seed)
    run(random_packets(rng, 120), seed=seed)


def test_long_pieces():
    """Pieces up to 4096 bytes (65 raw beats from start 63)."""
    rng = random.Random(3)
    packets = [make_packet(rng, [(63, 4096)]), make_packet(rng, [(1, 4033), (63, 63)]),
               make_packet(rng, [(0, 2048), (17, 1000), (5, 1048)])]
    run(packets, seed=3)


def sweep(starts_per_fill, seed):
    """Two-piece packets: for every fill, ``starts_per_fill`` second-piece starts, and
    every first-piece start and every length modulo 64 of each piece along the way."""
    rng = random.Random(seed)
    packets = []
    for fill in range(WIDTH):
        for start in range(fill % (WIDTH // starts_per_fill), WIDTH, WIDTH // starts_per_fill):
            # The first piece ends at lane fill (mod 64), from a start of its own.
            first_start = (start * 5 + fill) % WIDTH
            first = (fill - first_start) % WIDTH + WIDTH * rng.randrange(2) or WIDTH
            second = (fill * 7 + start * 3) % WIDTH + WIDTH * rng.randrange(2) or WIDTH
            packets.append(make_packet(rng, [(first_start, first), (start, second)]))
    run(packets, seed=seed, gap=0.1, ready=0.9)


def test_sweep():
    """Every fill with 8 second-piece starts (every start over the fills)."""
    sweep(8, seed=4)


@pytest.mark.full
def test_sweep_every_pair():
    """Every (start, fill) pair of a two-piece packet's second piece."""
    sweep(WIDTH, seed=8)


def test_one_piece_rate():
    """One-piece packets with both sides always ready: each raw beat comes out in the cycle
    it is taken (the output register bypassed)."""
    rng = random.Random(5)
    packets = [make_packet(rng, [(rng.randrange(WIDTH), rng.randint(1, 500))]) for _ in range(40)]
    raw_count = sum(len(p[1]) for p in packets)
    result = run(packets, seed=5, gap=0, ready=1.1)
    cycles = result["out_cycles"]
    assert cycles == list(range(result["first_take"], result["first_take"] + raw_count))


def test_spill_costs_one_cycle():
    """Two-piece packets of one raw beat each, both sides always ready: 16 + 16 bytes from
    lane 32 make one packed beat (two cycles a packet); 16 + 40 bytes fill a beat and
    leave 24 over, which go out alone (three cycles a packet)."""
    for second, outs, period in ((16, (2,), 2), (40, (2, 3), 3)):
        rng = random.Random(second)
        packets = [make_packet(rng, [(32, 16), (0, second)]) for _ in range(10)]
        result = run(packets, seed=6, gap=0, ready=1.1)
        t0 = result["first_take"]
        assert result["out_cycles"] == [t0 + out + period * k for k in range(10) for out in outs]


def test_gather_lists_cut_at_mtu():
    """Random gather lists of 1..4 segments (zero-length ones included) in a random memory,
    cut at random MTUs into packets and pieces by the model's ``gather_pieces`` (what the
    executor is to issue): each packet's packed run is the concatenation's bytes."""
    rng = random.Random(10)
    memory = rng.randbytes(1 << 16)
    packets = []
    for _ in range(30):
        segments = [(rng.choice([0, rng.randint(1, 64), rng.randint(1, 3000)]), 0,
                     rng.randrange(len(memory) - 4096)) for _ in range(rng.randint(1, 4))]
        length = sum(count for count, _, _ in segments)
        mtu = 256 << rng.randrange(5)
        for start in range(0, length, mtu):
            pieces = gather_pieces(segments, start, min(mtu, length - start))
            records, beats = [], []
            for index, (laddr, count) in enumerate(pieces):
                words = range(laddr // WIDTH, (laddr + count + WIDTH - 1) // WIDTH)
                records.append(dict(start=laddr % WIDTH, bytes=count, beats=len(words),
                                    last=int(index == len(pieces) - 1)))
                beats += [(int.from_bytes(memory[k * WIDTH:(k + 1) * WIDTH], "little"), 0)
                          for k in words]
            concat = b"".join(memory[laddr:laddr + count] for laddr, count in pieces)
            packets.append((records, beats, (pieces[0][0] % WIDTH, concat, [False] * len(concat))))
    assert any(len(records) > 1 for records, _, _ in packets)
    run(packets, seed=10)


@pytest.mark.parametrize("args", [dict(piece_depth=1), dict(piece_depth=8193),
                                  dict(piece_depth=4.0)])
def test_parameters(args):
    assert_rejected(GatherPacker, args)


def test_lint(tmp_path):
    assert_lint_clean(GatherPacker(), "gather_packer", tmp_path)


def test_record_to_first_beat():
    """A record written in cycle 0 lets its piece's first raw beat in from cycle 3."""
    rng = random.Random(9)
    result = run([make_packet(rng, [(5, 100)])], seed=9, gap=0, ready=1.1)
    assert result["first_take"] == 3
