"""ResponseWriter (hdl/nic/response_writer.py) against a Python reference, in Amaranth's simulator.

One testbench plays, cycle by cycle: the receiver's response streams (per VL a random mix
of ACKNOWLEDGEs, READ responses of every position with 0 .. 4096 payload bytes and pad,
ATOMIC ACKNOWLEDGEs, other opcodes, now and then end_bad, rarely a READ response longer
than MAX_PACKET_BEATS; random gaps); the completion unit (random ``out`` ready, or always
ready; for each stored packet, seen by its end beat on ``out``, one decision after a
random delay, so verdicts come in random order: discard, verdict without write, a write
of the payload (atomic: the 8-byte value, or the 4 bytes a 4-byte atomic lands) to a random address, a write reaching exactly
to the stored packet's end, or one past it, which must be refused; now and then verdicts
and discards for packets that are not waiting, which must be ignored); and an AXI4 slave
with a byte-array memory (random AWREADY/WREADY, B after random delays, now and then
SLVERR).

Checked: every beat leaves on ``out[v]`` exactly as it came on ``rx[v]``, in order, from
the cycle after ``rx`` took it (the input register), and ``out`` keeps a shown beat until
it moves; ``rx[v].ready`` is high unless the input register holds two beats; a beat of a
packet that is not stored is never held while ``out`` is ready; stored packets never
overlap; ``out_seq`` on every beat of a stored packet is its number in order; every AW carries READ_DATA_ID and is the next burst of the next write
in seq order; the memory ends byte-identical to the reference (payload at the verdict's
address, atomic values byte-reversed, overlapping writes in seq order); ``landed`` only
moves forward, never past a packet whose verdict has not come or whose write has a B
outstanding, and ends past every packet; the counters. The small configurations
(128-beat ring, 2 or 4 slots, slow verdicts) must see the ring full and the slot table
full (the single-VL one with 2 slots: the slot table). Directed: timing (verdict to AW,
B and discard to ``landed``), verdicts that must be ignored and a discard beside a
verdict, a shown start beat keeping its grant, a packet longer than MAX_PACKET_BEATS,
parameter checks, lint.
"""
import random
from collections import deque

import pytest
from amaranth import Value

from hdl.nic.response_writer import ResponseWriter
from hdl.nic.signatures import MAX_PACKET_BEATS, READ_DATA_ID
from tb.amaranth_sim import Driver, assert_lint_clean, assert_rejected, simulate
from tb.axi_write_slave import AxiWriteSlave
from tb.beats import BeatCodec, packet_beats

WIDTH = 64
CODEC = BeatCodec(WIDTH)
SEQ_MOD = 1 << 16
MEM_WINDOW = 1 << 20                 # memory at the top of the address space
MEM_SIZE = 64 << 10
STORED = {0x0D, 0x0E, 0x0F, 0x10, 0x12}
OTHER_OPS = [op for op in range(256) if op not in STORED and op != 0x11]
MAX_STORED = MAX_PACKET_BEATS * WIDTH


def bursts_of(addr, nbytes):
    """AW bursts (addr, len) of a write, as AXI needs them: 64-byte beats, not across 4 KiB."""
    if nbytes == 0:
        return []
    a = addr & ~63
    left = ((addr & 63) + nbytes + 63) // 64
    bursts = []
    while left:
        n = min(left, (4096 - (a & 4095)) // 64)
        bursts.append((a, n - 1))
        a += 64 * n
        left -= n
    return bursts


def make_packet(rng, kind):
    """(bytes, header length, payload length) of one response packet of ``kind``."""
    if kind == "ack":
        opcode, header, payload, size = 0x11, 24, 0, 28
    elif kind == "atomic":
        opcode, header, payload, size = 0x12, 24, 8, 36
    elif kind == "other":
        opcode, header, payload = rng.choice(OTHER_OPS), 20, 0
        size = rng.randint(1, 300)
    else:
        opcode = rng.choice([0x0D, 0x0E, 0x0F, 0x10])
        header = 20 if opcode == 0x0E else 24
        if kind == "long":
            payload = rng.randint(4150, 4400)
        else:
            r = rng.random()
            payload = (0 if r < 0.05 else rng.randint(1, 64) if r < 0.35
                       else rng.randint(3900, 4096) if r < 0.5 else rng.randint(1, 4096))
        size = header + payload + (-payload % 4) + 4
    packet = bytearray(rng.randbytes(size))
    if size > 8:
        packet[8] = opcode
    return bytes(packet), header, payload


def stored_copy(packet):
    """The ring's copy: at most MAX_PACKET_BEATS beats, an atomic's value reversed, and its
    low 4 bytes as on the wire (big-endian) where its ICRC was (bytes 32..35)."""
    copy = bytearray(packet[:MAX_STORED])
    if copy[8] == 0x12:
        copy[24:36] = copy[24:32][::-1] + packet[28:32]
    return bytes(copy)


class Bench:
    def __init__(self, dut, rng, *, packets=300, p_valid=0.7, p_gap=0.1, p_out=1.0, p_aw=0.7,
                 p_w=0.8, b_delay=20, p_slverr=0.05, delay=40, p_long=0.01, p_bogus=0.05,
                 mix=(("ack", 3), ("read", 5), ("atomic", 2), ("other", 1))):
        self.dut, self.rng = dut, rng
        self.drive = Driver()
        self.p_valid, self.p_gap, self.p_out = p_valid, p_gap, p_out
        self.delay, self.p_bogus = delay, p_bogus
        nv = dut.num_vls
        kinds = [k for k, n in mix for _ in range(n)]
        # Per VL: the packets to send, as beats, and what a stored one needs.
        self.queues = []
        self.total_stored = 0
        for _ in range(nv):
            queue = deque()
            for _ in range(packets // nv):
                kind = "long" if rng.random() < p_long else rng.choice(kinds)
                packet, header, payload = make_packet(rng, kind)
                end_bad = rng.random() < 0.03
                beats = packet_beats(packet, WIDTH)
                words = [CODEC.pack(d, s, e, c, end_bad and e) for d, s, e, c in beats]
                stored = len(packet) > 8 and packet[8] in STORED
                self.total_stored += stored
                queue.append({"words": words, "packet": packet, "header": header,
                              "payload": payload, "stored": stored})
            self.queues.append(queue)
        # Per VL: the beats still to offer on rx (word, first of its packet), and those
        # taken on rx and not yet moved on out (the input register's).
        self.to_send = [deque((word, i == 0) for entry in queue
                              for i, word in enumerate(entry["words"])) for queue in self.queues]
        self.registered = [deque() for _ in range(nv)]
        self.beat_index = [0] * nv           # of the packet heading queues[v], on out
        self.offered = [None] * nv           # the beat word on rx[v], held until it moves
        self.shown = [None] * nv             # out[v] shown and not taken last cycle
        self.in_stored = None                # VL of the stored packet moving, if any
        self.seq = 0                         # stored packets whose end beat moved
        self.decisions = []                  # by seq: (due, port, verdict fields, outcome)
        self.pending = []                    # seqs whose decision is not yet issued
        self.issued = {}                     # seq -> cycle its decision was issued
        self.writes = {}                     # seq -> (addr offset, bytes) written
        self.next_cmd = 0                    # the next seq the AW checker looks at
        self.aw_expected = deque()
        self.bursts_left = {}                # seq -> B responses still due
        self.b_done = set()
        self.landed = 0                      # unwrapped
        self.bytes = 0
        self.discarded = 0
        self.base = (1 << dut.addr_width) - MEM_WINDOW
        self.slave = AxiWriteSlave(dut.axi, rng, base=self.base, size=MEM_SIZE,
                                   bid=READ_DATA_ID, p_aw=p_aw, p_w=p_w, b_delay=b_delay,
                                   p_slverr=p_slverr)
        self.ref_mem = bytearray(self.slave.mem)
        self.ring_full = 0
        self.slots_full = 0
        self.t = 0

    # --- the completion unit's decision on a stored packet ----------------------------------
    def decide(self, entry):
        rng = self.rng
        copy = stored_copy(entry["packet"])
        length = len(copy)
        header, payload = entry["header"], entry["payload"]
        r = rng.random()
        fields = {"seq": self.seq % SEQ_MOD, "write": 0, "addr": 0, "bytes": 0, "offset": 0}
        if r < 0.15:
            port, outcome = "discard", None
        elif r < 0.25:
            port, outcome = "verdict", None
            fields.update(addr=rng.getrandbits(64), bytes=rng.randint(0, 4096),
                          offset=rng.randrange(64))
        else:
            port = "verdict"
            offset = header
            if copy[8] == 0x12 and rng.random() < 0.5:
                offset, payload = 32, 4         # a 4-byte atomic's value, big-endian
            if r < 0.32:
                nbytes = min(4096, length - offset)          # to the stored end: written
            elif r < 0.4 and length - offset < 4096:
                nbytes = rng.randint(length - offset + 1, 4096)   # past it: refused
            else:
                nbytes = min(payload, 4096, length - offset)
            fits = offset + nbytes <= length
            if rng.random() < 0.3 and nbytes:           # across a 4 KiB line
                page = rng.randrange(1, MEM_SIZE // 4096)
                off = page * 4096 - rng.randint(1, nbytes)
            else:
                off = rng.randrange(MEM_SIZE - nbytes + 1)
            off = max(0, min(off, MEM_SIZE - nbytes))
            fields.update(write=1, addr=self.base + off, bytes=nbytes, offset=offset)
            outcome = (off, copy[offset:offset + nbytes]) if fits else None
        due = self.t + 1 + rng.randint(0, self.delay)
        self.decisions.append((due, port, fields, outcome))
        self.pending.append(self.seq)

    def bogus(self):
        """A seq that is not waiting for a verdict: one already judged, or one not stored."""
        judged = [s for s in self.issued if self.issued[s] < self.t]
        if judged and self.rng.random() < 0.5:
            return self.rng.choice(judged) % SEQ_MOD
        return (self.seq + self.rng.randint(1, 1000)) % SEQ_MOD

    def drive_verdicts(self):
        dut, rng = self.dut, self.rng
        due = [s for s in self.pending if self.decisions[s][0] <= self.t]
        rng.shuffle(due)
        chosen = {}
        for s in due:
            port = self.decisions[s][1]
            if port not in chosen:
                chosen[port] = s
        for port in ("verdict", "discard"):
            stream = getattr(dut, port)
            if port in chosen:
                s = chosen[port]
                self.pending.remove(s)
                self.issued[s] = self.t
                _, _, fields, outcome = self.decisions[s]
                if outcome is None:
                    self.discarded += 1
                else:
                    self.writes[s] = outcome
                    self.bytes += len(outcome[1])
                self.drive.set(stream.valid, 1)
                self.drive.set(stream.payload, fields if port == "verdict" else fields["seq"])
            elif rng.random() < self.p_bogus:
                seq = self.bogus()
                self.drive.set(stream.valid, 1)
                self.drive.set(stream.payload, {"seq": seq, "write": 1, "addr": self.base,
                                         "bytes": 8, "offset": 0}
                        if port == "verdict" else seq)
            else:
                self.drive.set(stream.valid, 0)

    def check_out(self, ctx, v):
        """out[v] in this cycle: the oldest beat taken on rx[v], kept until it moves; a
        packet that is not stored never held while out is ready."""
        dut, t = self.dut, self.t
        out = dut.out[v]
        out_valid, out_ready = ctx.get(out.valid), ctx.get(out.ready)
        moves = out_valid and out_ready
        word = ctx.get(Value.cast(out.payload)) if out_valid else None
        if self.shown[v] is not None:
            assert out_valid and word == self.shown[v], (t, v, "out dropped a shown beat")
        if out_valid:
            assert self.registered[v] and word == self.registered[v][0], \
                (t, v, "out beat differs from rx")
        self.shown[v] = word if out_valid and not out_ready else None
        if not self.registered[v]:
            return
        entry = self.queues[v][0]
        if not entry["stored"]:
            assert moves or not out_ready, (t, v, "a packet that is not stored waits")
        elif not moves and out_ready:
            if self.beat_index[v]:
                self.ring_full += 1
            elif self.seq - self.landed == dut.slots and self.in_stored is None:
                self.slots_full += 1
        if not moves:
            return
        self.registered[v].popleft()
        if entry["stored"]:
            assert self.in_stored in (None, v), (t, v, "stored packets overlap")
            self.in_stored = v
            assert ctx.get(dut.out_seq[v]) == self.seq % SEQ_MOD, (t, v, "out_seq")
        self.beat_index[v] += 1
        if self.beat_index[v] == len(entry["words"]):
            self.beat_index[v] = 0
            self.queues[v].popleft()
            if entry["stored"]:
                self.in_stored = None
                self.decide(entry)
                self.seq += 1

    # --- one cycle ------------------------------------------------------------------------
    async def cycle(self, ctx):
        dut, rng, t, slave = self.dut, self.rng, self.t, self.slave
        nv = dut.num_vls
        for v in range(nv):
            if self.offered[v] is None and self.to_send[v] and rng.random() < self.p_valid:
                word, first = self.to_send[v][0]
                if not first or rng.random() >= self.p_gap:
                    self.offered[v] = word
                    self.to_send[v].popleft()
            self.drive.set(dut.rx[v].valid, self.offered[v] is not None)
            if self.offered[v] is not None:
                self.drive.set(Value.cast(dut.rx[v].payload), self.offered[v])
            self.drive.set(dut.out[v].ready, rng.random() < self.p_out)
        self.drive_verdicts()
        slave.drive(self.drive, t)
        self.drive.apply(ctx)

        # landed: forward only, never past a packet without its verdict or its B.
        landed = ctx.get(dut.landed)
        step = (landed - self.landed) % SEQ_MOD
        assert step <= self.seq - self.landed, (t, "landed ahead of the stored packets")
        for s in range(self.landed, self.landed + step):
            assert s in self.issued and self.issued[s] < t, (t, s, "landed before its verdict")
            assert self.bursts_left.get(s, 0) == 0 and (s not in self.writes or s in self.b_done
                                                         or not self.writes[s][1]), \
                (t, s, "landed before its B")
        self.landed += step

        # Streams: out[v] shows the beats rx[v] took, in order, from the cycle after each
        # was taken; rx[v].ready is the input register's room: high unless it holds two.
        for v in range(nv):
            rx = dut.rx[v]
            assert ctx.get(rx.ready) == (len(self.registered[v]) < 2), (t, v, "rx.ready")
            self.check_out(ctx, v)
            if self.offered[v] is not None and ctx.get(rx.ready):
                self.registered[v].append(self.offered[v])
                self.offered[v] = None

        # AXI slave: each AW must be the next burst of the next write in seq order.
        burst = slave.aw_burst(ctx)
        if burst is not None:
            assert ctx.get(dut.axi.awid) == READ_DATA_ID, t
            while not self.aw_expected:
                s = self.next_cmd
                assert s in self.issued and self.issued[s] < t, (t, s, "an AW the reference does not have (yet)")
                self.next_cmd += 1
                if s in self.writes:
                    off, payload = self.writes[s]
                    bursts = bursts_of(self.base + off, len(payload))
                    self.bursts_left[s] = len(bursts)
                    self.aw_expected.extend((a, n, s) for a, n in bursts)
            a, n, s = self.aw_expected.popleft()
            assert burst == (a, n), (t, s)
            slave.accept_aw(a, n, tag=s)
        slave.take_w(ctx)
        b = slave.respond(ctx, t)
        if b is not None:
            _, s = b
            self.bursts_left[s] -= 1
            if not self.bursts_left[s]:
                self.b_done.add(s)
        await ctx.tick()
        self.t += 1

    def busy(self):
        return (any(self.queues) or self.pending or self.slave.b_due or self.slave.bursts
                or self.landed < self.seq)

    async def run(self, ctx, limit=200000):
        while self.busy():
            await self.cycle(ctx)
            assert self.t < limit, "no progress"
        for _ in range(8):
            await self.cycle(ctx)
        self.finish(ctx)

    def finish(self, ctx):
        dut = self.dut
        assert self.seq == self.total_stored and self.landed == self.seq
        assert not self.aw_expected and not self.slave.w_pending
        for s in sorted(self.writes):
            off, payload = self.writes[s]
            self.ref_mem[off:off + len(payload)] = payload
        assert self.slave.mem == self.ref_mem
        assert ctx.get(dut.response_bytes_written) == self.bytes
        assert ctx.get(dut.response_write_errors) == self.slave.errors
        assert ctx.get(dut.responses_discarded) == self.discarded


@pytest.mark.parametrize("seed,num_vls,buffer_beats,slots,addr_width,options,full", [
    (1, 2, 256, 16, 64, {}, ()),
    (2, 3, 128, 4, 64, {"delay": 150, "p_out": 0.8}, ("ring", "slots")),
    (3, 1, 128, 2, 32, {"delay": 60, "p_aw": 0.4, "p_w": 0.5}, ("slots",)),
])
def test_random(seed, num_vls, buffer_beats, slots, addr_width, options, full):
    """``full``: the backpressure the run must see (the ring, the slot table)."""
    dut = ResponseWriter(num_vls=num_vls, buffer_beats=buffer_beats, slots=slots,
                         addr_width=addr_width)
    bench = Bench(dut, random.Random(seed), **options)

    async def testbench(ctx):
        await bench.run(ctx)

    simulate(dut, testbench)
    assert ("ring" not in full or bench.ring_full) and ("slots" not in full or bench.slots_full), \
        (bench.ring_full, bench.slots_full)


class Harness:
    """A plain driver for the directed tests: ``out`` always ready, an always-ready AXI
    slave answering every burst's B ``b_delay`` cycles after its last W beat, beats and
    verdicts as the test gives them. ``taken``: the VLs whose ``rx`` took a beat in the
    last cycle."""
    def __init__(self, dut, b_delay=1):
        self.dut, self.b_delay = dut, b_delay
        self.mem = {}
        self.aw = []                         # (cycle, addr, len)
        self.bursts = deque()
        self.b_due = deque()                 # due cycle
        self.b_cycles = []
        self.landed = []                     # by cycle
        self.taken = set()
        self.t = 0

    async def cycle(self, ctx, beats=None, verdict=None, discard=None, not_ready=()):
        """One cycle; ``beats``: {vl: word} offered on ``rx`` now; ``not_ready``: VLs whose
        ``out`` is not ready. Returns the VLs whose beat moved on ``out``."""
        dut, beats = self.dut, beats or {}
        for v in range(dut.num_vls):
            ctx.set(dut.rx[v].valid, v in beats)
            if v in beats:
                ctx.set(Value.cast(dut.rx[v].payload), beats[v])
            ctx.set(dut.out[v].ready, v not in not_ready)
        ctx.set(dut.verdict.valid, verdict is not None)
        if verdict is not None:
            ctx.set(dut.verdict.payload, verdict)
        ctx.set(dut.discard.valid, discard is not None)
        if discard is not None:
            ctx.set(dut.discard.payload, discard)
        ctx.set(dut.axi.awready, 1)
        ctx.set(dut.axi.wready, 1)
        b = bool(self.b_due) and self.b_due[0] <= self.t
        ctx.set(dut.axi.bvalid, b)
        ctx.set(dut.axi.bid, READ_DATA_ID)
        ctx.set(dut.axi.bresp, 0)
        self.taken = {v for v in beats if ctx.get(dut.rx[v].ready)}
        moved = {v for v in range(dut.num_vls)
                 if ctx.get(dut.out[v].valid) and v not in not_ready}
        self.landed.append(ctx.get(dut.landed))
        if ctx.get(dut.axi.awvalid):
            burst = [ctx.get(dut.axi.awaddr), ctx.get(dut.axi.awlen)]
            self.aw.append((self.t, *burst))
            self.bursts.append(burst + [0])
        if ctx.get(dut.axi.wvalid):
            burst = self.bursts[0]
            raw = ctx.get(dut.axi.wdata).to_bytes(WIDTH, "little")
            strobe = ctx.get(dut.axi.wstrb)
            for j in range(WIDTH):
                if strobe >> j & 1:
                    self.mem[burst[0] + 64 * burst[2] + j] = raw[j]
            burst[2] += 1
            if ctx.get(dut.axi.wlast):
                self.bursts.popleft()
                self.b_due.append(self.t + self.b_delay)
        if b:
            self.b_due.popleft()
            self.b_cycles.append(self.t)
        await ctx.tick()
        self.t += 1
        return moved

    async def offer(self, ctx, v, word, **others):
        """Offer ``word`` on ``rx[v]`` until it is taken; returns the VLs that moved on
        ``out`` meanwhile, cycle by cycle."""
        moves = [await self.cycle(ctx, beats={v: word}, **others)]
        while v not in self.taken:
            moves.append(await self.cycle(ctx, beats={v: word}, **others))
        return moves

    async def send(self, ctx, v, packet, **others):
        """Offer ``packet`` on VL ``v`` beat by beat until every beat has moved on ``out``;
        returns the cycle its end beat moved."""
        words = [CODEC.pack(*beat) for beat in packet_beats(packet, WIDTH)]
        moved = 0
        for word in words:
            moved += sum(v in moves for moves in await self.offer(ctx, v, word, **others))
            others = {}
        while moved < len(words):
            moved += v in await self.cycle(ctx)
        return self.t - 1

    async def idle(self, ctx, cycles):
        for _ in range(cycles):
            await self.cycle(ctx)

    def read(self, addr, n):
        return bytes(self.mem.get(addr + i, 0) for i in range(n))


def read_response(rng, payload_bytes, opcode=0x10):
    packet = bytearray(rng.randbytes(24 + payload_bytes + (-payload_bytes % 4) + 4))
    packet[8] = opcode
    return bytes(packet)


def test_timing():
    """Verdict in cycle t: AW valid in t + 4. The B in cycle t: ``landed`` past the
    packet from t + 2 (a stray B before does not count). A discard lands without any B: discard in cycle t, ``landed`` past it
    from t + 5 (command in t + 1, the DmaWriter's release in t + 3)."""
    rng = random.Random(21)
    dut = ResponseWriter(num_vls=2, buffer_beats=128, slots=4)
    h = Harness(dut, b_delay=5)

    async def testbench(ctx):
        packet = read_response(rng, 300)
        end = await h.send(ctx, 0, packet)
        assert ctx.get(dut.out_seq[0]) == 1 and ctx.get(dut.landed) == 0
        h.b_due.append(h.t)            # a stray B: must not count for the write to come
        await h.idle(ctx, 3)
        h.b_cycles.clear()
        verdict_cycle = h.t
        await h.cycle(ctx, verdict={"seq": 0, "write": 1, "addr": 0x10_0000, "bytes": 300,
                                    "offset": 24})
        await h.idle(ctx, 30)
        assert end < verdict_cycle and h.aw[0][0] == verdict_cycle + 4, (verdict_cycle, h.aw)
        assert h.read(0x10_0000, 300) == packet[24:324]
        (b_cycle,) = h.b_cycles
        assert h.landed.index(1) == b_cycle + 2, (b_cycle, h.landed)

        atomic = bytearray(rng.randbytes(36))
        atomic[8] = 0x12
        await h.send(ctx, 1, bytes(atomic))
        discard_cycle = h.t
        await h.cycle(ctx, discard=1)
        await h.idle(ctx, 10)
        assert h.b_cycles == [b_cycle] and h.landed.index(2) == discard_cycle + 5, h.landed
        assert ctx.get(dut.responses_discarded) == 1

    simulate(dut, testbench)


def test_ignored_verdicts():
    """A verdict in the cycle its packet's end beat moves, for a packet not stored, or
    for one already judged is ignored; a discard and a verdict for one packet in one
    cycle: the discard wins; a write past the stored packet (pad and ICRC included) is
    refused. Only the one good write reaches memory."""
    rng = random.Random(22)
    dut = ResponseWriter(num_vls=2, buffer_beats=128, slots=4)
    h = Harness(dut)

    def write(seq, addr, nbytes, offset=24):
        return {"seq": seq, "write": 1, "addr": addr, "bytes": nbytes, "offset": offset}

    async def testbench(ctx):
        first = read_response(rng, 100)
        start, end = (CODEC.pack(*beat) for beat in packet_beats(first, WIDTH))
        await h.offer(ctx, 0, start)
        assert await h.offer(ctx, 0, end) == [{0}]          # the start beat moves on out
        assert await h.cycle(ctx, verdict=write(0, 0x1000, 100)) == {0}     # the end beat
        await h.cycle(ctx, verdict=write(5, 0x2000, 100), discard=7)
        second = read_response(rng, 200, 0x0D)
        await h.send(ctx, 1, second)
        await h.cycle(ctx, verdict=write(0, 0x3000, 100), discard=0)
        await h.idle(ctx, 3)
        await h.cycle(ctx, verdict=write(0, 0x4000, 100))
        await h.cycle(ctx, verdict=write(1, 0x5000, 200))
        third = read_response(rng, 40, 0x0F)           # 24 + 40 + 4: 68 bytes stored
        await h.send(ctx, 0, third)
        await h.cycle(ctx, verdict=write(2, 0x6000, 45))
        await h.idle(ctx, 30)
        assert [(a, n) for _, a, n in h.aw] == [(0x5000, 3)]
        assert h.read(0x5000, 200) == second[24:224] and len(h.mem) == 200
        assert ctx.get(dut.landed) == 3
        assert ctx.get(dut.responses_discarded) == 2
        assert ctx.get(dut.response_bytes_written) == 200

    simulate(dut, testbench)


def test_grant_held():
    """A stored packet's start beat shown on ``out`` that is not ready keeps its grant,
    even when a VL that round robin puts first starts offering one: ``out`` does not
    take back a beat it has shown."""
    rng = random.Random(24)
    dut = ResponseWriter(num_vls=3, buffer_beats=128, slots=4)
    h = Harness(dut)

    def start(opcode):
        return CODEC.pack(*packet_beats(read_response(rng, 4, opcode), WIDTH)[0])

    async def testbench(ctx):
        await h.send(ctx, 0, read_response(rng, 4))           # round robin: VL 1 next
        second, third = start(0x10), start(0x12)
        assert await h.offer(ctx, 2, second, not_ready={2}) == [set()]
        assert ctx.get(dut.out[2].valid)
        assert await h.offer(ctx, 1, third, not_ready={2}) == [set()]
        for _ in range(3):
            assert ctx.get(dut.out[2].valid) and not ctx.get(dut.out[1].valid)
            assert await h.cycle(ctx, not_ready={2}) == set()
        assert await h.cycle(ctx) == {2}
        assert await h.cycle(ctx) == {1}

    simulate(dut, testbench)


def test_too_long():
    """A READ response of 70 beats passes whole but takes only MAX_PACKET_BEATS ring
    beats: a second one behind it, its verdict withheld, fills the 128-beat ring after
    128 - 66 beats and waits (an ACKNOWLEDGE on the other VL passes meanwhile); writes
    from the stored part come out right."""
    rng = random.Random(23)
    dut = ResponseWriter(num_vls=2, buffer_beats=128, slots=4)
    h = Harness(dut)
    long1, long2 = read_response(rng, 4400, 0x0E), read_response(rng, 4400, 0x0E)
    ack = bytearray(rng.randbytes(28))
    ack[8] = 0x11

    async def testbench(ctx):
        await h.send(ctx, 0, long1)
        beats = [CODEC.pack(*beat) for beat in packet_beats(long2, WIDTH)]
        assert len(beats) == 70 > MAX_PACKET_BEATS
        taken = moved = 0
        for _ in range(100):
            moved += 0 in await h.cycle(ctx, beats={0: beats[taken]})
            taken += 0 in h.taken
        # The ring's 62 free beats moved on out; the input register holds two more.
        assert moved == 128 - MAX_PACKET_BEATS and taken == moved + 2
        assert await h.offer(ctx, 1, CODEC.pack(*packet_beats(bytes(ack), WIDTH)[0])) == [set()]
        assert await h.cycle(ctx) == {1}
        await h.cycle(ctx, verdict={"seq": 0, "write": 1, "addr": 0x10000, "bytes": 4096,
                                    "offset": 24})
        while moved < len(beats):
            moved += 0 in await h.cycle(ctx, beats={0: beats[taken]} if taken < len(beats) else {})
            taken += 0 in h.taken
        await h.cycle(ctx, verdict={"seq": 1, "write": 1, "addr": 0x20000, "bytes": 4096,
                                    "offset": 63})
        await h.idle(ctx, 200)
        assert h.read(0x10000, 4096) == long1[24:4120]
        assert h.read(0x20000, 4096) == long2[63:4159]
        assert ctx.get(dut.landed) == 2 and ctx.get(dut.response_bytes_written) == 8192

    simulate(dut, testbench)


@pytest.mark.parametrize("args", [
    {"num_vls": 0}, {"num_vls": 16}, {"buffer_beats": 64}, {"buffer_beats": 192},
    {"buffer_beats": 8192}, {"slots": 1}, {"slots": 12}, {"slots": 512}, {"addr_width": 11},
    {"addr_width": 65},
])
def test_parameters(args):
    assert_rejected(ResponseWriter, args)


def test_lint(tmp_path):
    """Verilator lints the Verilog clean (always-ready ``ready`` members are constants,
    not ports)."""
    dut = ResponseWriter(num_vls=2, buffer_beats=128, slots=4, addr_width=40)
    assert_lint_clean(dut, "response_writer", tmp_path)
