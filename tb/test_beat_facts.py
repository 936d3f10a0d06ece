"""BeatFacts (hdl/link/beat_facts.py) in Amaranth's simulator, against the byte arithmetic it
replaces: bytes received since the start against LRH.PktLen, beat by beat.

Random beat streams on every beat width: packets of every PktLen class (0, below the minimum,
around beat and block boundaries, up to 2047 words) that end early, exactly, or run a few
beats past PktLen, with end beats of every count (0 included), flow-control beats in
between and inside packets, idle cycles, and stray beats with no start. Every fact is
checked where the receiver uses it.
"""
import random

import pytest

from hdl.link.beat_facts import MIN_WIRE_BYTES, BeatFacts
from hdl.link.signatures import blocks_of, max_wire_bytes
from tb.amaranth_sim import simulate

MTU = 4096
NUM_VLS = 2


def lrh(rng, pktlen):
    value = rng.getrandbits(64)
    value &= ~(0x07 << 32 | 0xFF << 40)
    return value | (pktlen >> 8) << 32 | (pktlen & 0xFF) << 40


def stream(rng, width, packets):
    """(valid, link, start, end, count, lrh) per cycle."""
    beats = []
    for _ in range(packets):
        roll = rng.random()
        if roll < 0.1:
            beats.append((1, 1, 1, 1, rng.choice([6, 6, 5, width]), rng.getrandbits(64)))
            continue
        if roll < 0.15:
            beats.append((1, 0, 0, rng.getrandbits(1), rng.randrange(width + 1), rng.getrandbits(64)))
            continue
        pktlen = rng.choice([0, 1, 5, 6, 7, rng.randrange(2048), rng.randrange(2048),
                             rng.randrange(6, 80), 2047,
                             (rng.randrange(1, 40) * width) // 4 + rng.choice([-1, 0, 1])])
        pktlen = max(0, min(2047, pktlen))
        nbytes = max(1, pktlen * 4 + 2 + rng.choice([0, 0, 0, -1, -4, 1, 4, -width, width,
                                                     rng.randrange(-40, 40)]))
        if rng.random() < 0.05:
            nbytes = pktlen * 4 + 2 + rng.randrange(1, 4) * width
        header = lrh(rng, pktlen)
        full, last = divmod(nbytes, width)
        counts = [width] * full + ([last] if last else [])
        if rng.random() < 0.05:
            counts[-1] = 0 if len(counts) > 1 else counts[-1]
        for index, count in enumerate(counts):
            start, end = index == 0, index == len(counts) - 1
            beats.append((1, 0, int(start), int(end), count if end else rng.randrange(width + 1),
                          header if start else rng.getrandbits(64)))
            if rng.random() < 0.1:
                beats.append((0, 0, 0, 0, 0, 0))
            if not end and rng.random() < 0.01:
                beats.append((1, 1, 1, 1, 6, rng.getrandbits(64)))      # cuts the packet short
                break
    return beats


def expected_facts(width, beats):
    """Per beat, the facts the receiver uses, from byte counts (None where it uses none)."""
    out = []
    received = expected = None
    in_packet = False
    for valid, link, start, end, count, header in beats:
        facts = {}
        if valid and link:
            facts["fc_framing"] = int(start and end and count == 6)
            facts["fc_fields"] = int((header >> 20 & 15) < NUM_VLS and (header >> 4 & 15) <= 1)
        if valid and (link or start) and in_packet:
            # Up to 64-byte beats, the empty end beat that closes the packet is charged too.
            facts["close_blocks"] = blocks_of(min(received + (width if width <= 64 else 0),
                                                  expected))
        if valid and not link:
            nbytes = count if end else width
            if start:
                pktlen = (header >> 32 & 7) << 8 | header >> 40 & 0xFF
                expected, received = pktlen * 4 + 2, 0
                facts["malformed"] = int(expected < MIN_WIRE_BYTES or (end and count < 8))
                facts["invalid_vl"] = int((header >> 4 & 15) >= NUM_VLS)
                facts["too_long"] = int(expected > max_wire_bytes(MTU))
                in_packet = True
            if in_packet:
                left = max(expected - 2 - received, 0)
                facts["write"] = int(left != 0)
                facts["data_end"] = int(left != 0 and nbytes >= left)
                if left:
                    facts["count"] = min(nbytes, left)
                after = received + nbytes
                if end:
                    facts["short"] = int(after < expected)
                    facts["exact"] = int(after == expected)
                    # Up to 64-byte beats, an end beat of no bytes takes a slot: charged.
                    charged = received + width if width <= 64 and nbytes == 0 else after
                    facts["blocks"] = blocks_of(min(charged, expected))
                received = after
                in_packet = not end
        if valid and link:
            in_packet = False
        out.append(facts)
    return out


@pytest.mark.parametrize("width", [8, 16, 64, 128, 256])
def test_beat_facts_match_byte_arithmetic(width):
    rng = random.Random(width)
    beats = stream(rng, width, 600)
    want = expected_facts(width, beats)
    dut = BeatFacts(width=width, num_vls=NUM_VLS, mtu=MTU)
    mismatches = []

    async def testbench(ctx):
        for cycle in range(len(beats) + 2):
            if cycle < len(beats):
                valid, link, start, end, count, header = beats[cycle]
                ctx.set(dut.valid, valid)
                ctx.set(dut.link, link)
                ctx.set(dut.start, start)
                ctx.set(dut.end, end)
                ctx.set(dut.count, count)
                ctx.set(dut.lrh, header)
            else:
                ctx.set(dut.valid, 0)
            if cycle >= 2:
                got = ctx.get(dut.facts)
                for name, value in want[cycle - 2].items():
                    if getattr(got, name) != value:
                        mismatches.append((cycle - 2, beats[cycle - 2][:5], name,
                                           getattr(got, name), value))
            await ctx.tick()

    simulate(dut, testbench)
    assert not mismatches, mismatches[:10]
