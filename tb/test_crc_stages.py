"""AlignedCRC and CRCCheckStage (the link's pipelined VCRC) against models/crc, in
Amaranth's simulator: random messages of every end-beat alignment, the generator's CRC on
the last beat, the checker's verdict the cycle after it, corrupted codewords rejected."""
import random

import pytest
from amaranth.hdl import Cat, Module, Signal

from hdl.crc.algorithms import ICRC, VCRC
from hdl.crc.aligned_crc import AlignedCRC, advance_and_seed, align
from hdl.crc.crc_check_stage import CRCCheckStage
from tb.amaranth_sim import assert_rejected, simulate


def chunks(message, width):
    return [message[offset:offset + width] for offset in range(0, len(message), width)] or [b""]


@pytest.mark.parametrize("algorithm,width", [(VCRC, 8), (VCRC, 16), (ICRC, 8)])
def test_crc_stages(algorithm, width):
    generator, checker = AlignedCRC(algorithm, width), CRCCheckStage(algorithm, width)
    m = Module()
    m.submodules.generator, m.submodules.checker = generator, checker
    data, count = Signal(8 * width), Signal(range(width + 1))
    start, valid = Signal(), Signal()
    m.d.comb += [
        generator.data.eq(align(data, count, width)),
        Cat(generator.advance, generator.seed).eq(Cat(*advance_and_seed(algorithm, count, start, width))),
        generator.valid.eq(valid),
        checker.data.eq(data), checker.count.eq(count), checker.start.eq(start),
        checker.valid.eq(valid), checker.keep.eq(Cat(lane < count for lane in range(width))),
    ]
    software = algorithm(8)
    crc_bytes = algorithm.crc_width // 8
    rng = random.Random(width)

    async def testbench(ctx):
        for length in list(range(3 * width + 1)) + [rng.randrange(200) for _ in range(10)]:
            message = bytes(rng.randrange(256) for _ in range(length))
            beats = chunks(message, width)
            if len(beats[-1]) == width and rng.random() < 0.5:
                beats.append(b"")       # an empty end beat
            for index, beat in enumerate(beats):
                ctx.set(data, int.from_bytes(beat, "little"))
                ctx.set(count, len(beat))
                ctx.set(start, index == 0)
                ctx.set(valid, 1)
                if index == len(beats) - 1:
                    assert ctx.get(generator.crc) == software.compute(message), length
                await ctx.tick()
            codeword = bytearray(message + software.compute(message).to_bytes(crc_bytes, "little"))
            bad = rng.random() < 0.4
            if bad:
                codeword[rng.randrange(len(codeword))] ^= 1 << rng.randrange(8)
            beats = chunks(bytes(codeword), width)
            for index, beat in enumerate(beats):
                # Bytes past the count are junk; the checker must mask them.
                junk = rng.getrandbits(8 * (width - len(beat))) << (8 * len(beat))
                ctx.set(data, int.from_bytes(beat, "little") | junk)
                ctx.set(count, len(beat))
                ctx.set(start, index == 0)
                ctx.set(valid, 1)
                await ctx.tick()
                ctx.set(valid, 0)
            assert ctx.get(checker.match) == (not bad), (length, bad)
            await ctx.tick()

    simulate(m, testbench)


@pytest.mark.parametrize("component", [AlignedCRC, CRCCheckStage])
@pytest.mark.parametrize("args", [dict(algorithm=VCRC, width=12), dict(algorithm=VCRC, width=4),
                                  dict(algorithm="VCRC", width=16)])
def test_crc_stages_reject_bad_parameters(component, args):
    assert_rejected(component, args)
