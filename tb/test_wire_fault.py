"""WireFault (tb/gateware/wire_fault.py) in Amaranth's simulator.

Against a Python reference (:class:`FaultModel`), beat for beat: random data packets
(every end-beat alignment, 26 bytes to a few beats) with flow-control beats and idle
cycles between them, on 64- and 16-byte wires; rate and mode changed at random, also in
the middle of packets (only the start beat's mode counts); a seed port value and seed 0
(the default seed). Checked every cycle: the output beat (or its absence), and the fault
counter. Also: rate 0 passes everything untouched; rate 2**16 hits every packet; the hit
fraction at 2**14 is within 4 sigma of 1/4; flow-control beats are never touched, and
bytes 0..7 (the LRH) never.

Through two link ports (A -> WireFault -> B, B -> A straight), 64-byte beats: with
corruption, B counts exactly the injected faults as ``vcrc`` drops and delivers every other
packet intact and in order; with whole packets dropped from the wire, B counts no drop,
delivers the rest, and after the traffic the credits are exact again (A's
``credit_limit - fctbs`` is B's whole buffer, B's ABR equals A's FCTBS): the FCTBS in A's
flow-control packets resynchronises B's ABR (docs/link.md).
"""
import gc
import random
import warnings

import pytest
from amaranth import *
from amaranth.hdl import UnusedElaboratable
from amaranth.lib import wiring

from hdl.link.link_port import LinkPort
from hdl.link.signatures import LinkState
from tb.amaranth_sim import simulate
from tb.gateware.wire_fault import (BYTES, CORRUPT, DEFAULT_SEED, DROP, FIRST_BYTE, RATE_ONE,
                                    WireFault, xorshift32)

FIELDS = ("valid", "data", "start", "end", "count", "end_bad", "link")


class FaultModel:
    """What WireFault does, beat by beat."""

    def __init__(self, width, seed):
        self.width = width
        self.seed = seed or DEFAULT_SEED
        self.state = 0
        self.faults = 0
        self.dropping = False
        self.corrupt_at = None      # packet byte still to corrupt, and its XOR value
        self.offset = 0

    def step(self, beat, rate, mode):
        """``beat``: a dict of FIELDS (valid 1) or None; returns the beat that leaves."""
        if beat is None:
            return None
        if beat["link"]:
            return dict(beat)
        out = dict(beat)
        if beat["start"]:
            draw = xorshift32(self.state or self.seed)
            self.state = draw
            self.offset = 0
            hit = (draw & 0xFFFF) < rate
            self.faults += hit
            self.dropping = hit and mode == DROP
            self.corrupt_at = ((FIRST_BYTE + (draw >> 16 & 0xF), (draw >> 20 & 0xFF) | 1)
                               if hit and mode == CORRUPT else None)
        if self.corrupt_at is not None:
            byte, value = self.corrupt_at
            if self.offset <= byte < self.offset + self.width:
                out["data"] ^= value << 8 * (byte - self.offset)
                self.corrupt_at = None
        self.offset += self.width
        dropped = self.dropping
        if beat["end"]:
            self.dropping = False
            self.corrupt_at = None
        return None if dropped else out


def wire_beats(packet, width, link=False):
    beats = []
    for offset in range(0, len(packet), width):
        chunk = packet[offset:offset + width]
        end = offset + width >= len(packet)
        beats.append(dict(valid=1, data=int.from_bytes(chunk, "little"), start=int(offset == 0),
                          end=int(end), count=len(chunk) if end else width, end_bad=0,
                          link=int(link)))
    return beats


def stimulus(rng, width, packets, *, rate=None, mode=None, lengths=(26, 300)):
    """Per cycle: (beat or None, rate, mode). Random rate and mode unless given."""
    cycles = []
    r = rate if rate is not None else rng.choice([0, 1 << 13, 1 << 15, RATE_ONE])
    md = mode if mode is not None else rng.randrange(2)
    for _ in range(packets):
        if rng.random() < 0.3:
            cycles.append((wire_beats(rng.randbytes(8), width, link=True)[0], r, md))
        for _ in range(rng.choice([0, 0, 1, 3])):
            cycles.append((None, r, md))
        beats = wire_beats(rng.randbytes(rng.randrange(*lengths)), width)
        for k, beat in enumerate(beats):
            if rate is None and rng.random() < 0.2:
                r = rng.choice([0, 1 << 13, 1 << 15, RATE_ONE])
            if mode is None and rng.random() < 0.2:
                md = rng.randrange(2)
            cycles.append((beat, r, md))
    return cycles


def run(width, cycles, seed):
    dut = WireFault(width=width)
    model = FaultModel(width, seed)
    log = {"out": [], "faults": 0}

    async def testbench(ctx):
        ctx.set(dut.seed, seed)
        for beat, rate, mode in cycles:
            ctx.set(dut.rate, rate)
            ctx.set(dut.mode, mode)
            for name in FIELDS:
                ctx.set(getattr(dut.wire_in, name), beat[name] if beat else 0)
            want = model.step(beat, rate, mode)
            got = ({name: ctx.get(getattr(dut.wire_out, name)) for name in FIELDS}
                   if ctx.get(dut.wire_out.valid) else None)
            assert got == want, f"beat {len(log['out'])}: {got} != {want}"
            log["out"].append(got)
            await ctx.tick()
            assert ctx.get(dut.faults) == model.faults
        log["faults"] = ctx.get(dut.faults)

    simulate(dut, testbench)
    return log


@pytest.mark.parametrize("width", [64, 16])
@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF])
def test_against_model(width, seed):
    rng = random.Random(seed * 7 + width)
    cycles = stimulus(rng, width, 300, lengths=(26, 4 * width + 1))
    log = run(width, cycles, seed)
    assert 0 < log["faults"] < 300


@pytest.mark.parametrize("width", [64, 16])
def test_rate_zero_passes_everything(width):
    cycles = stimulus(random.Random(3), width, 200, rate=0, mode=CORRUPT)
    log = run(width, cycles, 5)
    assert log["out"] == [beat and dict(beat) for beat, _, _ in cycles]
    assert log["faults"] == 0


@pytest.mark.parametrize("mode", [CORRUPT, DROP])
def test_rate_one_hits_every_packet(mode):
    width = 64
    cycles = stimulus(random.Random(4), width, 200, rate=RATE_ONE, mode=mode)
    log = run(width, cycles, 9)
    assert log["faults"] == 200
    for (beat, _, _), out in zip(cycles, log["out"]):
        if beat is None:
            assert out is None
        elif beat["link"]:
            assert out == beat                              # flow control untouched
        elif mode == DROP:
            assert out is None
        else:
            diff = (out["data"] ^ beat["data"]).to_bytes(width, "little")
            changed = [k for k in range(width) if diff[k]]
            if beat["start"]:
                assert len(changed) == 1 and FIRST_BYTE <= changed[0] < FIRST_BYTE + BYTES
            else:
                assert not changed


def test_hit_fraction():
    """2000 one-beat packets at rate 2**14: about a quarter hit, and the byte and value
    choices spread over their whole ranges."""
    width = 64
    rng = random.Random(6)
    cycles = [(wire_beats(rng.randbytes(40), width)[0], 1 << 14, CORRUPT) for _ in range(2000)]
    log = run(width, cycles, 12345)
    n, p = 2000, 0.25
    assert abs(log["faults"] - n * p) < 4 * (n * p * (1 - p)) ** 0.5
    lanes, values = set(), set()
    for (beat, _, _), out in zip(cycles, log["out"]):
        diff = (out["data"] ^ beat["data"]).to_bytes(width, "little")
        for k in range(width):
            if diff[k]:
                lanes.add(k)
                values.add(diff[k])
    assert lanes == set(range(FIRST_BYTE, FIRST_BYTE + BYTES))
    assert len(values) > 64


def test_width_checked():
    # The half-built component would warn, when collected, that it was never elaborated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError):
                WireFault(width=12)
        finally:
            gc.collect()


# --- through two link ports ------------------------------------------------------------------

class FaultyLink(wiring.Component):
    """Link port A -> WireFault -> link port B; B -> A straight."""

    def __init__(self):
        kw = dict(width=64, num_vls=1, mtu=256, cut_through=False, fc_period=128,
                  fc_min_interval=16, fc_batch_blocks=8)
        self.a, self.b = LinkPort(**kw), LinkPort(**kw)
        self.fault = WireFault(width=64)
        super().__init__({})

    def elaborate(self, platform):
        m = Module()
        m.submodules.a, m.submodules.b, m.submodules.fault = self.a, self.b, self.fault
        wiring.connect(m, self.a.wire_out, self.fault.wire_in)
        wiring.connect(m, self.fault.wire_out, self.b.wire_in)
        wiring.connect(m, self.b.wire_out, self.a.wire_in)
        return m


def lrh_packet(rng, payload_bytes):
    """An IBA-local packet's bytes as the link sees them (LRH.PktLen right; the link does not
    check the transport headers or the ICRC)."""
    length = 8 + 12 + payload_bytes + 4
    lrh = bytes([0x00, 0x02, 0x00, 0x01, (length // 4) >> 8, (length // 4) & 0xFF, 0x00, 0x02])
    return lrh + rng.randbytes(length - 8)


@pytest.mark.parametrize("mode", [CORRUPT, DROP])
def test_through_link_ports(mode):
    rng = random.Random(10 + mode)
    top = FaultyLink()
    a, b, fault = top.a, top.b, top.fault
    packets = [lrh_packet(rng, 4 * rng.randrange(0, 64)) for _ in range(60)]
    result = {}

    async def testbench(ctx):
        ctx.set(a.vl_weight[0], 16)
        ctx.set(b.vl_weight[0], 16)
        ctx.set(fault.seed, 77)
        ctx.set(fault.mode, mode)
        ctx.set(fault.rate, 1 << 14)
        ctx.set(b.data_out[0].ready, 1)
        for _ in range(3000):
            if ctx.get(a.state) == LinkState.ACTIVE and ctx.get(b.state) == LinkState.ACTIVE:
                break
            await ctx.tick()
        else:
            raise AssertionError("link did not come up")
        beats = [beat for p in packets for beat in wire_beats(p, 64)]
        received, partial = [], bytearray()
        sent_starts = 0
        idle = 0
        for _ in range(30000):
            if beats:
                beat = beats[0]
                ctx.set(a.data_in[0].valid, 1)
                ctx.set(a.data_in[0].payload, {"data": beat["data"], "start": beat["start"],
                                               "end": beat["end"], "count": beat["count"],
                                               "end_bad": 0})
            else:
                ctx.set(a.data_in[0].valid, 0)
            fire_in = beats and ctx.get(a.data_in[0].ready)
            out = b.data_out[0]
            fire_out = ctx.get(out.valid)
            if fire_out:
                payload = ctx.get(out.payload)
                partial += payload.data.to_bytes(64, "little")[:payload.count if payload.end
                                                                 else 64]
                if payload.end:
                    received.append(bytes(partial))
                    partial = bytearray()
            await ctx.tick()
            if fire_in:
                sent_starts += beats.pop(0)["start"]
            idle = idle + 1 if not beats else 0
            if idle > 600:              # several flow-control periods after the last packet
                break
        result.update(received=received, faults=ctx.get(fault.faults),
                      vcrc=ctx.get(b.receiver.drops.vcrc),
                      drops=sum(ctx.get(getattr(b.receiver.drops, r))
                                for r in ("truncated", "overlong", "too_long", "invalid_vl",
                                          "malformed", "end_bad", "link_down", "overflow")),
                      limit=ctx.get(a.transmitter.credit_limit[0]),
                      fctbs=ctx.get(a.transmitter.fctbs[0]), abr=ctx.get(b.receiver.abr[0]),
                      used=ctx.get(b.receiver.used_blocks[0]), sent=sent_starts)

    simulate(top, testbench)
    r = result
    assert r["sent"] == len(packets)
    assert 5 < r["faults"] < len(packets) - 5
    assert len(r["received"]) == len(packets) - r["faults"]
    # in order, intact: a subsequence of what was sent
    it = iter(packets)
    assert all(any(p == q for q in it) for p in r["received"])
    assert r["drops"] == 0
    assert r["vcrc"] == (r["faults"] if mode == CORRUPT else 0)
    assert r["used"] == 0
    assert (r["limit"] - r["fctbs"]) % 4096 == b.buffer_blocks
    assert r["abr"] == r["fctbs"]
