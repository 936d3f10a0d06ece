"""RequestReceiver (hdl/nic/request_receiver.py) against a Python reference, in Amaranth's simulator.

One testbench drives the receiver cycle by cycle. Packets are real (models/nic/
``make_packet``, models/packet.py ``build_packet`` for a GRH); the reference
(:func:`judge`) applies the table of docs/nic-responder.md, "Receive", to the bytes and
end_bad flag of each request packet on its own, and :func:`expected_descriptor` decodes
its headers with models/ib.py. Per VL the receiver must keep request order, so each
descriptor is matched against the oldest kept request of the VL its LRH names; kept
packets sit back to back in the ring in descriptor order (dropped ones take no room), so
``buffer_beat`` is checked against the running sum of ``beats``. A consumer takes
descriptors (random ready), reads every beat of each kept packet through ``buffer_read``
at a random pace and compares it byte for byte, then releases the packet's beats in
random chunks. Responses go out per VL byte-exact (flags too) against their own queue.
Counters are checked at the end.

Random test (2 and 3 VLs): every request opcode with random payload sizes (0 .. 4096
bytes), responses interleaved on the same VLs (some end_bad: passed on as they are), bad
ICRCs, end_bad, malformed mutations, random rx gaps, random request/response backpressure,
and a consumer that sometimes stalls long enough to bring the ring close to full.

Directed (one each): LNH with a GRH, DLID, TVer, PktLen short and long, non-request
opcodes (reserved, UC), too short for the headers (WRITE FIRST, atomic, masked atomic),
payload > 4096, READ, atomic and masked atomic with payload, a masked atomic's PadCnt, PadCnt beyond the payload (SEND, READ), longer than
MAX_PACKET_BEATS, bad ICRC, end_bad; each dropped and counted once, with a response on
the other VL alongside, and the good packet after it kept where the dropped one began;
a stray non-start beat discarded. A full ring holds rx off and loses nothing; a 127-beat
packet arriving with 96 beats free is taken whole and dropped, only MAX_PACKET_BEATS
beats of it counting against the ring; a request stream that is not ready holds rx off
after DESCRIPTOR_DEPTH one-beat requests (and two more in the input register). Throughput: one beat per cycle back to back
(long packets, one-beat packets, two VLs alternating under round robin, every other
packet dropped). Parameter checks.
"""
import random
from collections import deque

import pytest
from amaranth import Value

from hdl.nic.request_receiver import DESCRIPTOR_DEPTH, RequestReceiver
from hdl.nic.signatures import MAX_PACKET_BEATS
from models.crc import icrc_bytes
from models.ib import BTH, LRH, extension_headers
from models.nic import make_packet
from models.packet import build_packet
from tb.beats import BeatCodec, packet_beats
from tb.amaranth_sim import simulate

WIDTH = 64
CODEC = BeatCodec(WIDTH)
LID = 0x1234
MASKED_ATOMICS = [0xD3, 0xD4, 0xF3, 0xF4]       # docs/nic-formats.md
IBA_REQUEST_OPS = list(range(0x00, 0x0D)) + [0x13, 0x14]
REQUEST_OPS = IBA_REQUEST_OPS + MASKED_ATOMICS
RESPONSE_OPS = list(range(0x0D, 0x13))
NO_PAYLOAD = {0x0C, 0x13, 0x14, *MASKED_ATOMICS}
DESCRIPTOR_FIELDS = ("vl", "sl", "slid", "opcode", "se", "ackreq", "pkey", "destqp", "psn", "va",
                     "rkey", "dmalen", "swap_add", "compare", "swap_mask", "compare_mask", "imm",
                     "header_bytes", "payload_bytes", "beats")


# --- Reference ---------------------------------------------------------------------------------

def judge(pkt, end_bad=False, lid=LID):
    """'keep', 'icrc' or 'malformed' by the spec table, ICRC first."""
    n = len(pkt)
    if end_bad or n < 4 or icrc_bytes(pkt[:-4]) != pkt[-4:]:
        return "icrc"
    if n < 24 or n > MAX_PACKET_BEATS * WIDTH:
        return "malformed"
    lrh, bth = LRH.unpack(pkt), BTH.unpack(pkt[8:20])
    if (lrh.lnh != 2 or lrh.dlid != lid or bth.tver != 0 or lrh.pktlen * 4 != n
            or bth.opcode not in REQUEST_OPS):
        return "malformed"
    header = 20 + sum(cls.SIZE for cls in extension_headers(bth.opcode))
    if n < header + 4 + bth.padcnt or n - header - 4 - bth.padcnt > 4096:
        return "malformed"
    if bth.opcode in NO_PAYLOAD and n != header + 4:
        return "malformed"
    return "keep"


def expected_descriptor(pkt):
    lrh, bth = LRH.unpack(pkt), BTH.unpack(pkt[8:20])
    fields = dict.fromkeys(DESCRIPTOR_FIELDS, 0)
    fields.update(vl=lrh.vl, sl=lrh.sl, slid=lrh.slid, opcode=bth.opcode, se=bth.se,
                  ackreq=bth.ackreq, pkey=bth.pkey, destqp=bth.destqp, psn=bth.psn)
    offset = 20
    for cls in extension_headers(bth.opcode):
        header = cls.unpack(pkt[offset:])
        fields.update({name: getattr(header, name) for name in cls.field_widths()})
        offset += cls.SIZE
    fields.update(header_bytes=offset, payload_bytes=len(pkt) - offset - 4 - bth.padcnt,
                  beats=-(-len(pkt) // WIDTH))
    return fields


# --- Packets -----------------------------------------------------------------------------------

def random_header(rng, cls):
    return cls(**{name: rng.getrandbits(bits) for name, bits in cls.field_widths().items()})


def request(rng, vl, opcode=None, payload_len=None, lid=LID):
    if opcode is None:
        # masked atomics now and then: the mix stays mostly long packets, which fill the ring
        opcode = rng.choice(MASKED_ATOMICS if rng.random() < 0.05 else IBA_REQUEST_OPS)
    if payload_len is None:
        # Mostly short: the simulated ICRC costs milliseconds per beat.
        payload_len = 0 if opcode in NO_PAYLOAD else rng.choice(
            [rng.randrange(0, 48)] * 4 + [rng.randrange(0, 300)] * 4 + [rng.randrange(0, 1500),
                                                                       rng.choice([4095, 4096])])
    return make_packet(vl=vl, sl=rng.getrandbits(4), dlid=lid, slid=rng.getrandbits(16),
                       opcode=opcode, destqp=rng.getrandbits(24), psn=rng.getrandbits(24),
                       pkey=rng.getrandbits(16), se=rng.getrandbits(1),
                       ackreq=rng.getrandbits(1),
                       ext=[random_header(rng, cls) for cls in extension_headers(opcode)],
                       payload=rng.randbytes(payload_len))


def response(rng, vl):
    return make_packet(vl=vl, sl=0, dlid=LID, slid=rng.getrandbits(16),
                       opcode=rng.choice(RESPONSE_OPS), destqp=rng.getrandbits(24),
                       psn=rng.getrandbits(24), payload=rng.randbytes(rng.randrange(0, 400)))


def reseal(pkt, **changes):
    """``pkt`` with header bytes changed (offset: byte value) and its ICRC recomputed."""
    body = bytearray(pkt[:-4])
    for offset, value in changes.items():
        body[int(offset[1:])] = value
    return bytes(body) + icrc_bytes(bytes(body))


def with_pktlen(pkt, words):
    body = bytearray(pkt[:-4])
    body[4] = (body[4] & 0xF8) | (words >> 8)
    body[5] = words & 0xFF
    return bytes(body) + icrc_bytes(bytes(body))


def mutate(rng, pkt):
    """A random way to make a request malformed (or not: judge decides)."""
    kind = rng.randrange(5)
    if kind == 0:
        return reseal(pkt, b2=pkt[2] ^ 0x40)                       # DLID
    if kind == 1:
        return with_pktlen(pkt, len(pkt) // 4 + rng.choice([-1, 1]))
    if kind == 2:
        return reseal(pkt, b9=pkt[9] | rng.randrange(1, 16))         # TVer
    if kind == 3:
        return reseal(pkt, b8=rng.choice([0x15, 0x1F, 0x24, 0x64, 0xFF]))  # not an RC request
    cut = rng.randrange(20, 48)                                      # short: truncated headers
    body = pkt[:cut] + bytes(-cut % 4)
    return with_pktlen(body + icrc_bytes(body), (len(body) + 4) // 4)


# --- Bench -------------------------------------------------------------------------------------

class Bench:
    def __init__(self, dut, rng, *, p_gap=0.2, p_request_ready=0.7, p_response_ready=0.8,
                 p_read=0.8, p_stall=0.0, stall_cycles=(100, 600)):
        self.dut = dut
        self.rng = rng
        self.num_vls = len(dut.rx)
        self.depth = dut.buffer_read.signature.depth
        self.p_gap = p_gap
        self.p_request_ready = p_request_ready
        self.p_response_ready = p_response_ready
        self.p_read = p_read
        self.p_stall = p_stall
        self.stall_cycles = stall_cycles
        self.t = 0
        self.sources = [deque() for _ in range(self.num_vls)]      # beats (packed)
        self.offered = [None] * self.num_vls
        self.kept = [deque() for _ in range(self.num_vls)]         # (descriptor, bytes)
        self.responses = [deque() for _ in range(self.num_vls)]    # expected response beats
        self.counts = {"requests_received": 0, "rx_request_icrc_drops": 0,
                       "rx_request_malformed": 0}
        self.ring_next = 0
        self.descriptors = 0
        self.descriptor_vls = []
        self.jobs = deque()             # (buffer_beat, beats, bytes) to read and release
        self.reading = None             # [buffer_beat, beats, bytes, next index, verified]
        self.pending_read = None        # (expected beat bytes) for the addr set last cycle
        self.to_release = 0
        self.stall = 0
        self.most_held = 0              # most beats of kept packets not yet released

    def send(self, vl, pkt, end_bad=False, raw_beats=None):
        """Queue ``pkt`` on ``vl`` and its expected fate."""
        beats = raw_beats or [CODEC.pack(d, s, e, c, end_bad and e)
                              for d, s, e, c in packet_beats(pkt, WIDTH)]
        self.sources[vl].extend(beats)
        if raw_beats is not None:
            return None
        if pkt[8] in RESPONSE_OPS:
            self.responses[vl].extend(beats)
            return "response"
        fate = judge(pkt, end_bad)
        if fate == "keep":
            self.counts["requests_received"] += 1
            self.kept[vl].append((expected_descriptor(pkt), pkt))
        else:
            self.counts["rx_request_icrc_drops" if fate == "icrc" else "rx_request_malformed"] += 1
        return fate

    def idle(self):
        return (not any(self.sources) and all(o is None for o in self.offered)
                and not any(self.kept) and not any(self.responses) and not self.jobs
                and self.reading is None and self.pending_read is None)

    async def cycle(self, ctx):
        dut, rng = self.dut, self.rng
        # Drive.
        for v in range(self.num_vls):
            if self.offered[v] is None and self.sources[v] and rng.random() >= self.p_gap:
                self.offered[v] = self.sources[v].popleft()
            ctx.set(dut.rx[v].valid, self.offered[v] is not None)
            if self.offered[v] is not None:
                ctx.set(Value.cast(dut.rx[v].payload), self.offered[v])
            ctx.set(dut.responses[v].ready, rng.random() < self.p_response_ready)
        ctx.set(dut.request.ready, rng.random() < self.p_request_ready)
        self.consumer(ctx)
        self.most_held = max(self.most_held, self.to_release + sum(job[1] for job in self.jobs)
                             + (self.reading[1] if self.reading else 0))

        # Sample the handshakes of this edge.
        for v in range(self.num_vls):
            if self.offered[v] is not None and ctx.get(dut.rx[v].ready):
                self.offered[v] = None
            if ctx.get(dut.responses[v].valid) and ctx.get(dut.responses[v].ready):
                beat = ctx.get(Value.cast(dut.responses[v].payload))
                assert self.responses[v], (self.t, v, "unexpected response beat")
                assert beat == self.responses[v].popleft(), (self.t, v, "response beat differs")
        if ctx.get(dut.request.valid) and ctx.get(dut.request.ready):
            self.descriptor(ctx.get(dut.request.payload))
        await ctx.tick()
        self.t += 1

    def descriptor(self, got):
        vl = got.vl
        assert vl < self.num_vls and self.kept[vl], (self.t, "descriptor for nothing", vl)
        want, pkt = self.kept[vl].popleft()
        fields = {name: int(getattr(got, name)) for name in DESCRIPTOR_FIELDS}
        assert fields == want, (self.t, {k: (fields[k], want[k]) for k in want if fields[k] != want[k]})
        assert got.buffer_beat == self.ring_next, (self.t, got.buffer_beat, self.ring_next)
        self.ring_next = (self.ring_next + want["beats"]) % self.depth
        self.descriptors += 1
        self.descriptor_vls.append(vl)
        self.jobs.append([int(got.buffer_beat), want["beats"], pkt, 0])

    def consumer(self, ctx):
        dut, rng = self.dut, self.rng
        if self.pending_read is not None:
            data = ctx.get(dut.buffer_read.data).to_bytes(WIDTH, "little")
            want = self.pending_read
            assert data[:len(want)] == want, (self.t, "stored beat differs")
            self.pending_read = None
        ctx.set(dut.release.valid, 0)
        if self.to_release:         # beats already read, freed beside the next reads
            chunk = rng.randint(1, min(self.to_release, MAX_PACKET_BEATS))
            ctx.set(dut.release.valid, 1)
            ctx.set(dut.release.payload, chunk)
            self.to_release -= chunk
        if self.stall:
            self.stall -= 1
            return
        if self.reading is None and self.jobs:
            self.reading = self.jobs.popleft()
            if rng.random() < self.p_stall:
                self.stall = rng.randint(*self.stall_cycles)
                return
        if self.reading is not None and rng.random() < self.p_read:
            start, beats, pkt, index = self.reading
            ctx.set(dut.buffer_read.addr, (start + index) % self.depth)
            self.pending_read = pkt[index * WIDTH:(index + 1) * WIDTH]
            self.reading[3] += 1
            if self.reading[3] == beats:
                self.to_release += beats
                self.reading = None

    async def drain(self, ctx, limit=100000):
        for _ in range(limit):
            if self.idle() and not self.to_release:
                break
            await self.cycle(ctx)
        else:
            raise AssertionError(f"not drained: {[len(s) for s in self.sources]} sources, "
                                 f"{[len(k) for k in self.kept]} kept, "
                                 f"{[len(r) for r in self.responses]} responses")
        for _ in range(4):      # last release and counters settle
            await self.cycle(ctx)

    def check_counters(self, ctx):
        for name, value in self.counts.items():
            assert ctx.get(getattr(self.dut, name)) == value, (name, ctx.get(getattr(self.dut, name)), value)


def run(dut, body):

    async def testbench(ctx):
        ctx.set(dut.lid, LID)
        await body(ctx)

    simulate(dut, testbench)


# --- Tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_vls, seed, packets", [(2, 3, 100), (3, 5, 80)])
def test_random(num_vls, seed, packets):
    rng = random.Random(seed)
    dut = RequestReceiver(num_vls=num_vls, buffer_beats=256)
    fates = {}
    done = []

    async def body(ctx):
        bench = Bench(dut, rng, p_stall=0.08)
        for _ in range(packets):
            v = rng.randrange(num_vls)
            roll = rng.random()
            if roll < 0.25:
                pkt, end_bad = response(rng, v), rng.random() < 0.1
            else:
                pkt, end_bad = request(rng, v), False
                if roll < 0.30:
                    pkt = bytearray(pkt)
                    pkt[rng.randrange(len(pkt))] ^= 1 << rng.randrange(8)
                    pkt = bytes(pkt)
                elif roll < 0.33:
                    end_bad = True
                elif roll < 0.42:
                    pkt = mutate(rng, pkt)
            fate = bench.send(v, pkt, end_bad)
            fates[fate] = fates.get(fate, 0) + 1
            while sum(len(s) for s in bench.sources) > 600:
                await bench.cycle(ctx)
        await bench.drain(ctx)
        bench.check_counters(ctx)
        assert bench.descriptors == bench.counts["requests_received"]
        assert bench.most_held > 256 - 32, bench.most_held      # the ring came close to full
        done.append(True)

    run(dut, body)
    assert done
    assert fates.get("keep", 0) > packets // 3 and fates.get("response", 0) > 10
    assert fates.get("icrc", 0) >= 3 and fates.get("malformed", 0) >= 3, fates


def directed_cases(rng):
    """(name, packet, end_bad, fate) for each way a request is dropped."""
    grh = build_packet(bth=BTH(opcode=0x04, destqp=5, psn=1), payload=b"grh!", dlid=LID,
                       grh=bytes(range(40)))
    long_send = request(rng, 0, 0x04, MAX_PACKET_BEATS * WIDTH)     # > MAX_PACKET_BEATS beats
    send = request(rng, 0, 0x04, 100)
    bad_icrc = bytearray(send)
    bad_icrc[-1] ^= 0x80
    return [
        ("lnh_grh", grh, False, "malformed"),
        ("dlid", reseal(send, b3=send[3] ^ 1), False, "malformed"),
        ("tver", reseal(send, b9=send[9] | 1), False, "malformed"),
        ("pktlen_short", with_pktlen(send, len(send) // 4 - 1), False, "malformed"),
        ("pktlen_long", with_pktlen(send, len(send) // 4 + 1), False, "malformed"),
        ("opcode_reserved", reseal(send, b8=0x15), False, "malformed"),
        ("opcode_uc", reseal(send, b8=0x24), False, "malformed"),
        ("short_write_first", reseal_short(send, 0x06, 32), False, "malformed"),
        ("short_atomic", reseal_short(send, 0x13, 44), False, "malformed"),
        ("payload_4100", request(rng, 0, 0x04, 4100), False, "malformed"),
        ("read_with_payload", with_payload(rng, 0x0C, 4), False, "malformed"),
        ("atomic_with_payload", with_payload(rng, 0x14, 8), False, "malformed"),
        # a masked atomic: 68 bytes, its ICRC in the second beat
        ("short_masked_atomic", reseal_short(send, 0xD3, 64), False, "malformed"),
        ("masked_atomic_with_payload", with_payload(rng, 0xF3, 4), False, "malformed"),
        ("masked_atomic_padcnt", reseal(request(rng, 0, 0xD4), b9=0x10), False, "malformed"),
        ("padcnt_beyond_payload", reseal(request(rng, 0, 0x00, 0), b9=0x30), False, "malformed"),
        ("read_padcnt", reseal(request(rng, 0, 0x0C), b9=0x10), False, "malformed"),
        ("too_long", long_send, False, "malformed"),
        ("bad_icrc", bytes(bad_icrc), False, "icrc"),
        ("end_bad", send, True, "icrc"),
    ]


def reseal_short(pkt, opcode, length):
    """A packet of ``length`` bytes (ICRC included) with ``opcode``: headers cut short."""
    body = bytearray(pkt[:length - 4])
    body[8] = opcode
    body[9] &= 0xCF         # PadCnt 0
    return with_pktlen(bytes(body) + bytes(4), length // 4)


def with_payload(rng, opcode, n):
    """A READ or atomic request carrying ``n`` payload bytes."""
    good = request(rng, 0, opcode)
    body = good[:-4] + rng.randbytes(n)
    return with_pktlen(body + icrc_bytes(body), (len(body) + 4) // 4)


def test_directed():
    """Every drop case alone on VL 0 (with responses alongside on VL 1): dropped, counted
    once in its counter, and the next good packet is stored where the dropped one began."""
    rng = random.Random(3)
    dut = RequestReceiver(num_vls=2, buffer_beats=256)
    cases = directed_cases(rng)
    done = []

    async def body(ctx):
        bench = Bench(dut, rng, p_gap=0.1, p_request_ready=0.9)
        for name, pkt, end_bad, fate in cases:
            assert judge(pkt, end_bad) == fate, name     # the case is what it says
            before = dict(bench.counts)
            ring = bench.ring_next
            assert bench.send(0, pkt, end_bad) == fate
            bench.send(1, response(rng, 1))
            bench.send(0, request(rng, 0))
            await bench.drain(ctx)
            bench.check_counters(ctx)
            counter = "rx_request_icrc_drops" if fate == "icrc" else "rx_request_malformed"
            assert bench.counts[counter] == before[counter] + 1, name
            assert bench.descriptors == bench.counts["requests_received"], name
            assert bench.ring_next != ring, name      # kept where the dropped one began
        # A stray non-start beat on an idle VL is discarded without effect.
        before = dict(bench.counts)
        stray = CODEC.pack(0xDEAD, 0, 1, 4)
        bench.send(0, b"", raw_beats=[stray, stray])
        bench.send(0, request(rng, 0, 0x13))
        await bench.drain(ctx)
        bench.check_counters(ctx)
        assert bench.counts["requests_received"] == before["requests_received"] + 1
        done.append(True)

    run(dut, body)
    assert done


def test_full_ring_backpressure():
    """A consumer that reads nothing for a long time: the ring fills, rx.ready drops, every
    packet is kept once the consumer runs; nothing is lost."""
    rng = random.Random(4)
    dut = RequestReceiver(num_vls=2, buffer_beats=256)
    done = []

    async def body(ctx):
        bench = Bench(dut, rng, p_gap=0.0, p_request_ready=1.0)
        bench.stall = 600
        for _ in range(5):
            for v in range(2):
                bench.send(v, request(rng, v, 0x0A, 2000))
        waited = 0
        for _ in range(500):
            await bench.cycle(ctx)
            if any(bench.offered[v] is not None and not ctx.get(dut.rx[v].ready) for v in range(2)):
                waited += 1
        assert waited > 100        # held off, not dropped
        assert bench.counts["requests_received"] == 10
        await bench.drain(ctx)
        bench.check_counters(ctx)
        assert bench.descriptors == 10
        done.append(True)

    run(dut, body)
    assert done


def test_too_long_not_stored():
    """With 96 beats of the ring free and the consumer stalled, a 127-beat packet is taken
    whole (only its first MAX_PACKET_BEATS beats stored), dropped as malformed, and the
    packet after it is kept where it began."""
    rng = random.Random(7)
    dut = RequestReceiver(num_vls=1, buffer_beats=256)
    done = []

    async def body(ctx):
        bench = Bench(dut, rng, p_gap=0.0, p_request_ready=1.0)
        bench.stall = 10 ** 6
        for _ in range(5):
            bench.send(0, request(rng, 0, 0x0A, 2000))              # 32 beats each
        too_long = request(rng, 0, 0x04, 8100)
        assert len(too_long) > 126 * WIDTH
        assert bench.send(0, too_long) == "malformed"
        bench.send(0, request(rng, 0, 0x0C))
        for _ in range(5 * 32 + 127 + 10):
            await bench.cycle(ctx)
        assert not bench.sources[0] and bench.offered[0] is None
        bench.check_counters(ctx)
        assert bench.descriptors == 6
        bench.stall = 0
        await bench.drain(ctx)
        done.append(True)

    run(dut, body)
    assert done


def test_descriptor_backpressure():
    """A request stream that is never ready: one-beat requests stop at the descriptor
    queue's depth (plus the ring), rx.ready drops, nothing is lost."""
    rng = random.Random(5)
    dut = RequestReceiver(num_vls=1, buffer_beats=256)
    done = []

    async def body(ctx):
        bench = Bench(dut, rng, p_gap=0.0, p_request_ready=0.0)
        for _ in range(3 * DESCRIPTOR_DEPTH):
            bench.send(0, request(rng, 0, 0x0C))
        for _ in range(200):
            await bench.cycle(ctx)
        # DESCRIPTOR_DEPTH kept, two more in the input register (its head and skid entry).
        assert sum(len(s) for s in bench.sources) + (bench.offered[0] is not None) \
            == 3 * DESCRIPTOR_DEPTH - DESCRIPTOR_DEPTH - 2
        bench.p_request_ready = 0.5
        await bench.drain(ctx)
        bench.check_counters(ctx)
        assert bench.descriptors == 3 * DESCRIPTOR_DEPTH
        done.append(True)

    run(dut, body)
    assert done


@pytest.mark.parametrize("kind", ["long", "one_beat", "two_vls", "with_drops"])
def test_throughput(kind):
    """rx always valid, consumer and request always ready: one beat per cycle back to back."""
    rng = random.Random(6)
    num_vls = 2 if kind == "two_vls" else 1
    dut = RequestReceiver(num_vls=num_vls, buffer_beats=256)
    done = []

    async def body(ctx):
        bench = Bench(dut, rng, p_gap=0.0, p_request_ready=1.0, p_response_ready=1.0,
                      p_read=1.0)
        for i in range(12):
            for v in range(num_vls):
                if kind == "one_beat":
                    pkt = request(rng, v, rng.choice([0x0C, 0x13, 0x14, 0x04]), 0)
                elif kind == "with_drops" and i % 2:
                    pkt = reseal(request(rng, v, 0x04, 200), b3=0)      # wrong DLID
                else:
                    pkt = request(rng, v, 0x0A, rng.randrange(300, 700))
                bench.send(v, pkt)
        beats = sum(len(s) for s in bench.sources)
        start = bench.t
        while any(bench.sources) or any(o is not None for o in bench.offered):
            await bench.cycle(ctx)
        cycles = bench.t - start
        assert cycles <= beats + 2, (kind, cycles, beats)
        await bench.drain(ctx)
        bench.check_counters(ctx)
        if kind == "two_vls":       # both always offer: round robin alternates
            order = bench.descriptor_vls
            assert all(a != b for a, b in zip(order, order[1:])), order
        done.append(True)

    run(dut, body)
    assert done


def test_parameters():
    for bad in [dict(num_vls=0), dict(num_vls=16), dict(num_vls=1.5),
                dict(buffer_beats=128), dict(buffer_beats=384), dict(buffer_beats=8192)]:
        with pytest.raises(ValueError):
            RequestReceiver(**bad)
