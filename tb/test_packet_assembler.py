"""PacketAssembler (hdl/nic/packet_assembler.py) against a Python reference, in Amaranth's simulator.

One testbench drives the assembler cycle by cycle: descriptors and payload beats (in
packet order, ``dma_beats`` per DMA packet, some with RRESP SLVERR/DECERR) offered with
random gaps, random ``ready`` on each VL's ``data_out``. Every packet that comes out is
checked byte for byte against header + payload + zero pad + ICRC (models/crc.py), with
start/end/count on every beat, ``end_bad`` exactly on packets with a failed payload read,
valid and payload held under backpressure, and the packets of each VL in descriptor
order. After each phase ``payload_freed`` has strobed once per payload beat so far and
the counters (``payload_read_errors``, ``bad_descriptors``) are exact.

Elaborating and simulating the 64-byte ICRC logic is slow in pysim (seconds to build,
~10 ms a cycle), so the traffic runs as phases on one simulation, each drained before
the next (:class:`Phase`):

* random: header lengths 20..48 step 4, payload 0..4096 B at source offsets 0..63,
  inline 0..64 B, NONE, ~8 % bad descriptors;
* alignment: every source offset 0..63, with every header length over the run, payloads
  around beat boundaries, no input gaps;
* real headers: packets built with models/ib.py and models/packet.py build_packet, each
  output also parsed with parse_packet (ICRC good, payload intact);
* trickle: descriptors waiting for slow payload beats (a packet starts right after its
  last beat arrives, which must be readable in time);
* bad descriptors: each kind twice between good packets (their DMA beats drained);
* one-beat back to back: one 1-beat packet per cycle, first beat three cycles after the
  descriptor (its two output stages);
* long back to back: multi-beat packets with no idle cycle between them.

A second simulation uses the smallest buffer (65 beats) with an eager payload source
(payload.ready backpressure must occur), two largest packets (65 beats each) and one VL.
Bugs planted once to see them caught: popping on a late packet's first beat, no spill
ICRC register, end_bad missing the end beat's pops, counting beats before the FIFO can
give them, starting without the window beats, popping one beat on the end beat, header
length check, no drain of a dropped packet's beats, the CRC state taking the spilled
ICRC's empty beat.
"""
import random
from collections import deque

import pytest

from hdl.nic.packet_assembler import PacketAssembler, expected_dma_beats
from hdl.nic.signatures import PacketDescriptorLayout, PayloadSource
from models.crc import icrc_bytes
from models.ib import BTH, MASKED_ATOMICS, RETH, AtomicETH, ImmDt, MaskedAtomicETH, Opcode
from models.packet import build_packet, parse_packet
from tb.amaranth_sim import Driver, simulate

WIDTH = 64
_garbage = random.Random(0)     # bytes of source beats outside the payload


def random_header(rng, header_bytes):
    """Random bytes with LRH.LNH = IBA local, so the ICRC masks lie inside them."""
    header = bytearray(rng.randbytes(header_bytes))
    header[1] = header[1] & 0xFC | 0b10
    return bytes(header)


class Descriptor:
    def __init__(self, *, vl, header, payload=b"", source=PayloadSource.NONE, offset=0,
                 dma_beats=None, header_bytes=None, payload_bytes=None, errors=(), good=True,
                 expected=None):
        self.vl = vl
        self.header = header
        self.header_bytes = len(header) if header_bytes is None else header_bytes
        self.payload = payload
        self.payload_bytes = len(payload) if payload_bytes is None else payload_bytes
        self.source = source
        self.offset = offset if source == PayloadSource.DMA else 0
        self.good = good
        self.beats = []             # (data, resp) of the payload buffer
        self.inline = payload if source == PayloadSource.INLINE else b""
        if source == PayloadSource.DMA:
            if dma_beats is None:
                dma_beats = expected_dma_beats(offset, len(payload))
            stream = bytearray(_garbage.randbytes(dma_beats * WIDTH))
            stream[offset:offset + len(payload)] = payload
            for i in range(dma_beats):
                self.beats.append((bytes(stream[i * WIDTH:(i + 1) * WIDTH]),
                                   2 + (i % 2) if i in errors else 0))
        self.dma_beats = dma_beats or 0
        self.bad = any(resp for _, resp in self.beats)
        if expected is None:
            body = header + payload + bytes(-len(payload) % 4)
            expected = body + icrc_bytes(body)
        self.expected = expected

    def value(self):
        """The descriptor as the raw bits of the stream payload (``source`` may be no
        valid PayloadSource)."""
        layout = PacketDescriptorLayout()
        fields = {
            "vl": self.vl,
            "header": int.from_bytes(self.header.ljust(48, b"\0"), "little"),
            "header_bytes": self.header_bytes,
            "payload_bytes": self.payload_bytes,
            "source": PayloadSource.NONE,
            "offset": self.offset,
            "dma_beats": self.dma_beats,
            "inline_data": int.from_bytes(self.inline.ljust(64, b"\0"), "little"),
        }
        raw = layout.const(fields).as_value().value
        source = self.source.value if isinstance(self.source, PayloadSource) else self.source
        return raw | source << layout["source"].offset


def random_payload(rng, source):
    if source == PayloadSource.NONE:
        return b""
    if source == PayloadSource.INLINE:
        return rng.randbytes(rng.randint(0, 64))
    size = rng.choice([rng.randint(0, 130), rng.randint(0, 700), rng.randint(0, 4096), 4096])
    return rng.randbytes(size)


def random_descriptor(rng, num_vls, error_rate=0.03):
    source = rng.choice([PayloadSource.NONE, PayloadSource.INLINE, PayloadSource.DMA,
                         PayloadSource.DMA, PayloadSource.DMA])
    payload = random_payload(rng, source)
    dma_beats = expected_dma_beats(offset := rng.randrange(64), len(payload))
    errors = [i for i in range(dma_beats) if rng.random() < error_rate]
    header = random_header(rng, rng.choice(range(20, 49, 4)))
    return Descriptor(vl=rng.randrange(num_vls), header=header, payload=payload, source=source,
                      offset=offset, errors=errors)


BAD_KINDS = ("vl", "header_odd", "header_long", "header_short", "payload_long", "inline_long",
             "none_payload", "dma_beats", "source")


def bad_descriptor(rng, num_vls, kind=None):
    """A descriptor the assembler must drop (and drain the payload beats of, for DMA)."""
    kind = kind or rng.choice(BAD_KINDS)
    vl, header, source = rng.randrange(num_vls), random_header(rng, 20), PayloadSource.DMA
    payload, offset, extra = rng.randbytes(rng.randint(1, 300)), rng.randrange(64), {}
    if kind == "vl":
        vl = rng.randint(num_vls, 15)
    elif kind == "header_odd":
        extra["header_bytes"] = rng.choice([21, 22, 23, 30, 45])
    elif kind == "header_long":
        extra["header_bytes"] = rng.choice([68, 100, 124])
    elif kind == "header_short":
        extra["header_bytes"] = rng.choice([0, 4, 16])
    elif kind == "payload_long":
        extra["payload_bytes"] = rng.choice([4097, 5000, 8191])
        extra["dma_beats"] = rng.randint(0, 65)
    elif kind == "inline_long":
        source, extra["payload_bytes"] = PayloadSource.INLINE, rng.randint(65, 200)
        payload = payload[:64]
    elif kind == "none_payload":
        source, extra["payload_bytes"] = PayloadSource.NONE, rng.randint(1, 100)
    elif kind == "dma_beats":
        right = expected_dma_beats(offset, len(payload))
        extra["dma_beats"] = rng.choice([right + 1, right - 1, 0])
    elif kind == "source":
        source, extra["payload_bytes"] = 3, 0
        payload = b""
    descriptor = Descriptor(vl=vl, header=header, payload=payload, source=source, offset=offset,
                            good=False, **extra)
    if source == 3:
        descriptor.source = 3
    return descriptor


def real_descriptor(rng, num_vls):
    """A request packet built with models/ib.py: the header is its first bytes."""
    opcode, ext = rng.choice([
        (Opcode.SEND_ONLY, ()),
        (Opcode.SEND_ONLY_WITH_IMMEDIATE, (ImmDt(imm=rng.getrandbits(32)),)),
        (Opcode.RDMA_WRITE_ONLY, (RETH(va=rng.getrandbits(64), rkey=rng.getrandbits(32),
                                       dmalen=rng.randint(0, 4096)),)),
        (Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, (RETH(va=rng.getrandbits(64)), ImmDt(imm=5))),
        (Opcode.RDMA_WRITE_MIDDLE, ()),
        (Opcode.RDMA_READ_REQUEST, (RETH(va=rng.getrandbits(64), dmalen=rng.randint(1, 1 << 20)),)),
        (Opcode.COMPARE_SWAP, (AtomicETH(va=8 * rng.getrandbits(60), swap_add=rng.getrandbits(64),
                                         compare=rng.getrandbits(64)),)),
        (Opcode.FETCH_ADD, (AtomicETH(va=8 * rng.getrandbits(60), swap_add=1),)),
        # a masked atomic: the 64-byte header fills the first beat, the ICRC the next
        (rng.choice(sorted(MASKED_ATOMICS)),
         (MaskedAtomicETH(**{name: rng.getrandbits(bits)
                             for name, bits in MaskedAtomicETH.field_widths().items()}),)),
    ])
    carries = opcode not in (Opcode.RDMA_READ_REQUEST, Opcode.COMPARE_SWAP, Opcode.FETCH_ADD,
                             *MASKED_ATOMICS)
    source = rng.choice([PayloadSource.INLINE, PayloadSource.DMA, PayloadSource.DMA]) if carries \
        else PayloadSource.NONE
    payload = random_payload(rng, source)
    vl = rng.randrange(num_vls)
    packet = build_packet(bth=BTH(opcode=opcode, destqp=rng.getrandbits(24), psn=rng.getrandbits(24),
                                  ackreq=1, se=rng.getrandbits(1)),
                          ext=ext, payload=payload, vl=vl, sl=rng.getrandbits(4),
                          dlid=rng.getrandbits(16), slid=rng.getrandbits(16))
    header_bytes = 20 + sum(h.SIZE for h in ext)
    descriptor = Descriptor(vl=vl, header=packet[:header_bytes], payload=payload, source=source,
                            offset=rng.randrange(64), expected=packet)
    descriptor.real = True
    return descriptor


class Phase:
    """A batch of descriptors and how to drive them; the simulation runs phases one after
    another on one assembler (elaborating the 64-byte ICRC logic takes seconds), each
    drained before the next starts."""

    def __init__(self, name, descriptors, *, desc_rate=0.8, beat_rate=0.8, ready_rate=(0.7, 0.9),
                 prefill=False):
        self.name = name
        self.descriptors = descriptors
        self.desc_rate = desc_rate
        self.beat_rate = beat_rate
        self.ready_rate = ready_rate
        self.prefill = prefill          # all payload beats in before the first descriptor
        self.spans = []                 # (first, last) cycle of each packet, in output order
        self.accepted = []              # cycle each descriptor was accepted
        self.payload_stalls = 0         # cycles a payload beat was offered and not taken


def run(phases, *, num_vls=2, buffer_beats=512, seed=0, max_cycles=20_000):
    rng = random.Random(seed)
    dut = PacketAssembler(num_vls=num_vls, payload_buffer_beats=buffer_beats)

    async def bench(ctx):
        drive = Driver()
        cycle = 0
        totals = {"freed": 0, "beats": 0, "errors": 0, "bad": 0}
        for phase in phases:
            cycle = await run_phase(ctx, drive, phase, cycle, totals)

    async def run_phase(ctx, drive, phase, cycle, totals):
        descriptors = phase.descriptors
        beats = deque(beat for d in descriptors for beat in d.beats)
        totals["beats"] += len(beats)
        totals["errors"] += sum(1 for _, resp in beats if resp)
        totals["bad"] += sum(1 for d in descriptors if not d.good)
        pending = deque(descriptors)
        expected = [deque() for _ in range(num_vls)]
        desc = beat = None
        partial = [bytearray() for _ in range(num_vls)]
        held = [None] * num_vls          # a beat offered and not taken: must stay
        starts = [None] * num_vls
        settle = 0
        end = cycle + max_cycles
        while True:
            prefilling = phase.prefill and beats
            if desc is None and pending and not prefilling and rng.random() < phase.desc_rate:
                desc = pending.popleft()
                drive.set(dut.packet.payload.as_value(), desc.value())
            drive.set(dut.packet.valid, desc is not None)
            if beat is None and beats and (prefilling or rng.random() < phase.beat_rate):
                beat = beats.popleft()
                drive.set(dut.payload.payload, {"data": int.from_bytes(beat[0], "little"),
                                              "resp": beat[1], "last": 0})
            drive.set(dut.payload.valid, beat is not None)
            for v in range(num_vls):
                drive.set(dut.data_out[v].ready, rng.random() < phase.ready_rate[v % len(phase.ready_rate)])
            drive.apply(ctx)

            if desc is not None and ctx.get(dut.packet.ready):
                phase.accepted.append(cycle)
                if desc.good:
                    expected[desc.vl].append(desc)
                desc = None
            if beat is not None:
                if ctx.get(dut.payload.ready):
                    beat = None
                else:
                    phase.payload_stalls += 1
            totals["freed"] += ctx.get(dut.payload_freed)
            for v in range(num_vls):
                port = dut.data_out[v]
                if not ctx.get(port.valid):
                    assert held[v] is None, f"cycle {cycle}: VL {v} dropped valid under backpressure"
                    continue
                out = ctx.get(port.payload)
                now = (out.data, out.start, out.end, out.count, out.end_bad)
                assert held[v] is None or held[v] == now, f"cycle {cycle}: VL {v} beat changed while held"
                if not ctx.get(port.ready):
                    held[v] = now
                    continue
                held[v] = None
                data, start, end_flag, count, end_bad = now
                assert start == (len(partial[v]) == 0), f"cycle {cycle}: VL {v} start flag wrong"
                assert count == WIDTH or end_flag, f"cycle {cycle}: count {count} on a middle beat"
                assert 0 < count <= WIDTH and (end_flag or not end_bad)
                if start:
                    starts[v] = cycle
                partial[v] += data.to_bytes(WIDTH, "little")[:count]
                if end_flag:
                    assert expected[v], f"cycle {cycle}: VL {v} sent a packet nobody asked for"
                    want = expected[v].popleft()
                    got = bytes(partial[v])
                    assert got == want.expected, (
                        f"{phase.name}, cycle {cycle}: VL {v} packet differs (H={want.header_bytes} "
                        f"P={want.payload_bytes} source={want.source} offset={want.offset}): "
                        f"first difference at byte "
                        f"{next((i for i, (a, b) in enumerate(zip(got, want.expected)) if a != b), min(len(got), len(want.expected)))}, "
                        f"lengths {len(got)}/{len(want.expected)}")
                    assert end_bad == want.bad, f"cycle {cycle}: end_bad {end_bad}, expected {want.bad}"
                    if getattr(want, "real", False):
                        parsed = parse_packet(got)
                        assert parsed.icrc_ok and parsed.payload == want.payload
                    phase.spans.append((starts[v], cycle))
                    partial[v].clear()
            done = (desc is None and not pending and beat is None and not beats
                    and not any(expected) and not any(partial))
            settle = settle + 1 if done else 0
            await ctx.tick()
            cycle += 1
            if settle > 3:
                break
            assert cycle < end, f"{phase.name}: did not finish"
        drive.set(dut.packet.valid, 0)
        drive.set(dut.payload.valid, 0)
        drive.apply(ctx)
        assert totals["freed"] == totals["beats"], (
            f"{phase.name}: payload_freed strobed {totals['freed']} times for {totals['beats']} beats")
        assert ctx.get(dut.payload_read_errors) == totals["errors"], phase.name
        assert ctx.get(dut.bad_descriptors) == totals["bad"], phase.name
        return cycle

    simulate(dut, bench)


def random_phase(rng, num_vls, count, **drive):
    descriptors = [bad_descriptor(rng, num_vls) if rng.random() < 0.08 else random_descriptor(rng, num_vls)
                   for _ in range(count)]
    return Phase("random", descriptors, **drive)


def alignment_phase(rng):
    """Every source offset, each with two header lengths (all twelve over the run), DMA
    payloads around beat boundaries."""
    descriptors = []
    for offset in range(64):
        for step in (0, 3):
            header_bytes = 20 + 4 * ((offset + step) % 12)
            payload = rng.randbytes(rng.choice([1, 2, 3, 44, 64 - offset, 65, 127, 128, 130]))
            descriptors.append(Descriptor(vl=rng.randrange(2), header=random_header(rng, header_bytes),
                                          payload=payload, source=PayloadSource.DMA, offset=offset))
    return Phase("alignment", descriptors, desc_rate=1, beat_rate=1, ready_rate=(1, 0.9))


def one_beat_phase(rng):
    """1-beat packets (DMA within one source beat, inline, none), payload buffered first:
    one packet per cycle, the first one three cycles after its descriptor."""
    descriptors = []
    for _ in range(40):
        header_bytes = rng.choice(range(20, 49, 4))
        source = rng.choice([PayloadSource.NONE, PayloadSource.INLINE, PayloadSource.DMA])
        room = WIDTH - 4 - header_bytes
        payload = b"" if source == PayloadSource.NONE else rng.randbytes(rng.randint(0, room))
        offset = min(rng.randrange(WIDTH - len(payload) + 1), 63) if source == PayloadSource.DMA else 0
        descriptors.append(Descriptor(vl=rng.randrange(2), header=random_header(rng, header_bytes),
                                      payload=payload, source=source, offset=offset))
    return Phase("one-beat back to back", descriptors, desc_rate=1, ready_rate=(1,), prefill=True)


def long_phase(rng):
    """Multi-beat packets whose source beats do not outnumber their output beats,
    payload buffered first: no idle cycle between packets."""
    descriptors = []
    while len(descriptors) < 10:
        header_bytes = rng.choice(range(20, 65, 4))
        payload = rng.randbytes(rng.randint(1, 400))
        offset = rng.randrange(64)
        total = header_bytes + len(payload) + (-len(payload) % 4) + 4
        if expected_dma_beats(offset, len(payload)) <= -(-total // WIDTH):
            descriptors.append(Descriptor(vl=rng.randrange(2), header=random_header(rng, header_bytes),
                                          payload=payload, source=PayloadSource.DMA, offset=offset))
    return Phase("long back to back", descriptors, desc_rate=1, ready_rate=(1,), prefill=True)


def trickle_phase(rng):
    """Short DMA packets whose descriptor waits for payload beats arriving slowly: each
    packet starts right after its last beat, which must then be readable in time."""
    descriptors = []
    for _ in range(20):
        payload = rng.randbytes(rng.randint(1, 200))
        descriptors.append(Descriptor(vl=rng.randrange(2), header=random_header(rng, rng.choice(range(20, 49, 4))),
                                      payload=payload, source=PayloadSource.DMA, offset=rng.randrange(64)))
    return Phase("trickle", descriptors, desc_rate=1, beat_rate=0.3, ready_rate=(1,))


def bad_phase(rng, num_vls):
    """Each kind of bad descriptor twice, between good ones."""
    descriptors = []
    for kind in BAD_KINDS * 2:
        descriptors += [bad_descriptor(rng, num_vls, kind), random_descriptor(rng, num_vls)]
    return Phase("bad descriptors", descriptors)


def back_to_back(phase):
    return all(first == last + 1 for (_, last), (first, _) in zip(phase.spans, phase.spans[1:]))


def test_two_vls():
    """Random traffic with bad descriptors, every alignment, real headers, and the
    throughput and latency checks, on one assembler with two VLs."""
    rng = random.Random(1)
    one_beat, long = one_beat_phase(rng), long_phase(rng)
    run([random_phase(rng, 2, 30),
         alignment_phase(rng),
         Phase("real headers", [real_descriptor(rng, 2) for _ in range(16)]),
         trickle_phase(rng),
         bad_phase(rng, 2),
         one_beat, long], seed=1)
    assert all(first == last for first, last in one_beat.spans)
    assert back_to_back(one_beat)
    assert one_beat.spans[0][0] == one_beat.accepted[0] + 3    # descriptor in t, beat out t + 3
    assert back_to_back(long), long.spans


def test_one_vl_small_buffer():
    """The smallest payload buffer with an eager payload source (payload.ready must hold
    it off), two of the largest packets (4096 B from offset 63: 65 beats, the whole
    buffer), one VL, bad descriptors (VL 1 is out of range here)."""
    rng = random.Random(2)
    largest = [Descriptor(vl=0, header=random_header(rng, 48), payload=rng.randbytes(4096),
                          source=PayloadSource.DMA, offset=63) for _ in range(2)]
    phase = random_phase(rng, 1, 20, beat_rate=1.0, desc_rate=0.5, ready_rate=(0.5,))
    phase.descriptors[5:5] = largest
    run([phase], num_vls=1, buffer_beats=65, seed=2)
    assert phase.payload_stalls > 0


def test_parameters():
    with pytest.raises(ValueError):
        PacketAssembler(num_vls=0)
    with pytest.raises(ValueError):
        PacketAssembler(num_vls=16)
    with pytest.raises(ValueError):
        PacketAssembler(payload_buffer_beats=64)
