"""BeatCRC and IcrcEngine against models/crc.

One sim-only top per beat width holds a VCRC and a CRC-32 BeatCRC and an
IcrcEngine of each mode, all tapping one beat stream, so a build serves both
tests: ``beat_crc`` drives random byte strings of every length from 24 bytes
to past 4 KiB, ``icrc_engine`` drives random IB packets with and without GRH.
"""
import random
from dataclasses import dataclass

import cocotb
import pytest
from amaranth.hdl import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from cocotb.clock import Clock
from cocotb.triggers import ReadOnly, RisingEdge

import tb.runner
from hdl.crc.algorithms import ICRC, VCRC
from hdl.crc.beat_crc import BeatCRC
from hdl.crc.icrc_engine import IcrcEngine
from models import crc as reference
from models.ib import LNH_IBA_GLOBAL
from models.packet import build_packet, parse_packet, random_packet

LONGEST = 4200
SHORT_LENGTHS = range(24, 301)
LONG_PACKETS = 12
ENGINE_PACKETS = 150
IDLE_CHANCE = 0.15
EMPTY_BEAT_CHANCE = 0.05


class CrcTop(wiring.Component):
    """One beat stream into BeatCRC(VCRC), BeatCRC(ICRC) and IcrcEngine generate and check."""
    def __init__(self, width, granule):
        self.width = width
        self.granule = granule
        super().__init__({
            "valid": In(1),
            "start": In(1),
            "end": In(1),
            "count": In(range(width + 1)),
            "data": In(8 * width),
            "vcrc": Out(16),
            "vcrc_match": Out(1),
            "crc32": Out(32),
            "crc32_match": Out(1),
            "icrc": Out(32),
            "icrc_ok": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.vcrc = vcrc = BeatCRC(VCRC, self.width, self.granule)
        m.submodules.crc32 = crc32 = BeatCRC(ICRC, self.width, self.granule)
        m.submodules.generator = generator = IcrcEngine(self.width, "generate")
        m.submodules.checker = checker = IcrcEngine(self.width, "check")
        for beat_crc in (vcrc, crc32):
            m.d.comb += [beat_crc.valid.eq(self.valid), beat_crc.start.eq(self.start),
                         beat_crc.count.eq(self.count), beat_crc.data.eq(self.data)]
        for engine in (generator, checker):
            m.d.comb += [engine.valid.eq(self.valid), engine.start.eq(self.start),
                         engine.end.eq(self.end), engine.count.eq(self.count),
                         engine.data.eq(self.data)]
        m.d.comb += [
            self.vcrc.eq(vcrc.crc), self.vcrc_match.eq(vcrc.match),
            self.crc32.eq(crc32.crc), self.crc32_match.eq(crc32.match),
            self.icrc.eq(generator.icrc), self.icrc_ok.eq(checker.icrc_ok),
        ]
        return m


def is_codeword(crc, size, data):
    return len(data) > size and int.from_bytes(data[-size:], "little") == crc(data[:-size])


def flip_bit(data, bit):
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << bit % 8
    return bytes(flipped)


# A codeword's CRC: what `crc` shows exactly when `match` is asserted.
VCRC_OF_CODEWORD = reference.vcrc(b"x" + reference.vcrc_bytes(b"x"))
CRC32_OF_CODEWORD = reference.crc32(b"x" + reference.crc32(b"x").to_bytes(4, "little"))


@dataclass
class Beat:
    data: bytes
    start: bool
    end: bool
    offset: int  # packet bytes up to and including this beat


class TB:
    CLOCK_NS = 10

    def __init__(self, dut):
        self.dut = dut
        params = tb.runner.tb_params()
        self.width = params["width"]
        self.granule = params["granule"]
        self.rng = random.Random(params["seed"])
        Clock(dut.clk, self.CLOCK_NS, unit="ns").start()

    async def reset(self):
        self.dut.valid.value = 0
        self.dut.rst.value = 1
        await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0

    def beats(self, packet):
        for offset in range(0, len(packet), self.width):
            chunk = packet[offset:offset + self.width]
            yield Beat(chunk, offset == 0, offset + self.width >= len(packet), offset + len(chunk))

    def drive(self, valid, data, start, end, count):
        self.dut.valid.value = valid
        self.dut.start.value = start
        self.dut.end.value = end
        self.dut.count.value = count
        self.dut.data.value = int.from_bytes(data + self.rng.randbytes(self.width - len(data)), "little")

    async def idle(self):
        """Cycles with no beat, random junk on the other inputs."""
        while self.rng.random() < IDLE_CHANCE:
            self.drive(0, b"", self.rng.getrandbits(1), self.rng.getrandbits(1),
                       self.rng.randrange(self.width + 1))
            await RisingEdge(self.dut.clk)

    async def send(self, packet, check_beat, empty_beats=False):
        """Drive ``packet`` with random idles; ``check_beat(beat)`` in each beat's cycle.

        ``empty_beats`` adds valid beats of zero bytes inside the packet, which
        BeatCRC takes but a packet stream (count = width but on the end beat) never has.
        """
        for beat in self.beats(packet):
            await self.idle()
            if empty_beats and not beat.start:
                while self.rng.random() < EMPTY_BEAT_CHANCE:
                    self.drive(1, b"", 0, 0, 0)
                    await ReadOnly()
                    check_beat(Beat(b"", False, False, beat.offset - len(beat.data)))
                    await RisingEdge(self.dut.clk)
            self.drive(1, beat.data, beat.start, beat.end, self.width if not beat.end else len(beat.data))
            await ReadOnly()
            check_beat(beat)
            await RisingEdge(self.dut.clk)
        self.dut.valid.value = 0

    def value(self, name):
        return int(getattr(self.dut, name).value)


def beat_crc_streams(rng, granule):
    """(kind, bytes) to drive: for each length, a VCRC codeword, a CRC-32 codeword and a corrupted one."""
    long_lengths = [rng.randrange(301, LONGEST + 1) for _ in range(LONG_PACKETS - 1)] + [LONGEST]
    for index, length in enumerate([*SHORT_LENGTHS, *long_lengths]):
        length -= length % granule
        vcrc_body = rng.randbytes(length - 2)
        vcrc_word = vcrc_body + reference.vcrc_bytes(vcrc_body)
        crc32_body = rng.randbytes(length - 4)
        crc32_word = crc32_body + reference.crc32(crc32_body).to_bytes(4, "little")
        yield "vcrc codeword", vcrc_word
        yield "crc32 codeword", crc32_word
        corrupted = vcrc_word if index % 2 else crc32_word
        yield "corrupted", flip_bit(corrupted, rng.randrange(8 * length))


@cocotb.test()
async def beat_crc(dut):
    """crc equals the model's on every beat; match fires exactly on codewords."""
    tb = TB(dut)
    await tb.reset()
    for kind, stream in beat_crc_streams(tb.rng, tb.granule):
        # Prefix CRCs of every beat cost O(n^2) in the model: long streams are checked at the end beat.
        every_beat = len(stream) <= SHORT_LENGTHS.stop

        def check_beat(beat):
            vcrc, crc32 = tb.value("vcrc"), tb.value("crc32")
            where = f"{kind} of {len(stream)} B, beat ending at byte {beat.offset}"
            assert tb.value("vcrc_match") == (vcrc == VCRC_OF_CODEWORD), where
            assert tb.value("crc32_match") == (crc32 == CRC32_OF_CODEWORD), where
            if beat.end or every_beat:
                prefix = stream[:beat.offset]
                assert vcrc == reference.vcrc(prefix), where
                assert crc32 == reference.crc32(prefix), where
            if beat.end:
                assert tb.value("vcrc_match") == is_codeword(reference.vcrc, 2, stream), where
                assert tb.value("crc32_match") == is_codeword(reference.crc32, 4, stream), where
                assert kind == "corrupted" or tb.value("vcrc_match") or tb.value("crc32_match"), where

        await tb.send(stream, check_beat, empty_beats=True)


def random_ib_packet(rng, payload_len):
    """A random RC packet (LRH .. ICRC), half of them with a GRH, variant fields scrambled.

    Scrambling VL, resv8a and the GRH TClass/FlowLabel/HopLmt after the ICRC
    was computed must leave it valid: those fields are masked to ones.
    """
    packet = random_packet(rng, payload_len=payload_len)
    if rng.getrandbits(1):
        parsed = parse_packet(packet)
        packet = build_packet(lrh=parsed.lrh, grh=rng.randbytes(40), bth=parsed.bth, ext=parsed.ext,
                              payload=parsed.payload)
    scrambled = bytearray(packet)
    scrambled[0] = scrambled[0] & 0x0F | rng.getrandbits(4) << 4
    bth_offset = 8
    if scrambled[1] & 0b11 == LNH_IBA_GLOBAL:
        scrambled[8] = scrambled[8] & 0xF0 | rng.getrandbits(4)
        scrambled[9:12] = rng.randbytes(3)
        scrambled[15] = rng.getrandbits(8)
        bth_offset += 40
    scrambled[bth_offset + 4] = rng.getrandbits(8)
    return bytes(scrambled), variant_bits(scrambled[1] & 0b11 == LNH_IBA_GLOBAL)


def variant_bits(has_grh):
    """Bit indices (byte * 8 + bit) of the fields the ICRC masks."""
    bits = set(range(4, 8))
    bth_offset = 8
    if has_grh:
        bits |= set(range(64, 68)) | set(range(72, 96)) | set(range(120, 128))
        bth_offset += 40
    return bits | set(range(8 * (bth_offset + 4), 8 * (bth_offset + 5)))


@cocotb.test()
async def icrc_engine(dut):
    """IcrcEngine generates the model's ICRC and accepts exactly the packets whose ICRC is right."""
    tb = TB(dut)
    await tb.reset()
    payload_lengths = [tb.rng.randrange(0, 300) for _ in range(ENGINE_PACKETS)] + [4096]
    for payload_len in payload_lengths:
        packet, variant = random_ib_packet(tb.rng, payload_len)
        body, icrc = packet[:-4], int.from_bytes(packet[-4:], "little")
        assert reference.icrc(body) == icrc

        def check_generated(beat):
            if beat.end:
                assert tb.value("icrc") == icrc, f"{len(body)} B"

        await tb.send(body, check_generated)

        flipped = tb.rng.randrange(8 * len(packet))
        truncated = packet[:-tb.rng.randrange(1, 4)]
        for stream, ok in ((packet, True),
                           (flip_bit(packet, flipped), flipped in variant),
                           (truncated, False)):
            def check_checked(beat):
                where = f"{len(stream)} of {len(packet)} B, bit {flipped} flipped"
                assert tb.value("icrc_ok") == (ok and beat.end), where

            await tb.send(stream, check_checked)


# make test runs the link ports' widths (16 bytes with a 2-byte granule, 64 bytes); the
# 8-byte build (25 s of CPU) under make test-full since 2026-12-08.
@pytest.mark.parametrize("params", [
    pytest.param({"width": 8, "granule": 1, "seed": 8}, marks=pytest.mark.full),
    {"width": 16, "granule": 2, "seed": 16},
    {"width": 64, "granule": 1, "seed": 64},
], ids=lambda params: f"w{params['width']}g{params['granule']}")
def test_crc(params):
    tb.runner.run(module="tb.test_crc", toplevel="crc_top",
                  factory=lambda width, granule, seed: CrcTop(width, granule), params=params,
                  expect_tests=2)


@pytest.mark.parametrize("kwargs", [
    {"algorithm": "crc32", "width": 8},
    {"algorithm": VCRC, "width": 12},
    {"algorithm": VCRC, "width": 512},
    {"algorithm": VCRC, "width": 8, "granule": 3},
    {"algorithm": VCRC, "width": 8, "granule": 8},
])
def test_beat_crc_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        BeatCRC(**kwargs)


def test_icrc_engine_rejects_bad_mode():
    with pytest.raises(ValueError):
        IcrcEngine(8, "verify")
