"""ResponseDecoder (hdl/nic/response_decoder.py), the completion unit's receive stages,
alone in Amaranth's simulator.

Real response packets (models/packet.py, with ICRC; tb/completion_unit_tb.py's
``response``) on 2 VLs, at most one beat per cycle over both (as from one link), random
gaps: ACKs (ACK, RNR NAK, NAK codes 0..4), READ responses FIRST/MIDDLE/LAST/ONLY with random
payloads, ATOMIC ACKNOWLEDGEs, and junk: a bad ICRC, ``end_bad``, an unknown QP, request
opcodes, a GRH, a wrong PktLen, reserved AETH syndromes, an ACK with an ATOMIC ACK's length.
Stored opcodes carry the next sequence number on ``rx_seq`` for all their beats. Checked
against a model of docs/nic.md (Response decoder): each VL's events in order with every
field (the payload length from PktLen, pad and headers; 8 for an ATOMIC ACK); each stored
packet without an event gets ``discard`` with its sequence number three cycles after its
end beat; an event is offered ``EVENT_LATENCY`` cycles after its end beat on an idle queue;
``malformed`` and ``rx_dropped_icrc`` count exactly; ``rx.ready`` is always high; nothing is
left at the end. Backpressure: a VL's queue held full takes ``RX_EVENT_DEPTH`` events, drops
the rest as malformed (a stored one is discarded) and then delivers those it kept.
"""
import random
from collections import deque

import pytest

from hdl.nic.response_decoder import RX_EVENT_DEPTH, ResponseDecoder
from models.ib import AETH, BTH, Opcode
from models.packet import build_packet
from tb.amaranth_sim import assert_lint_clean, assert_rejected, simulate
from tb.completion_unit_tb import STORED_OPCODES, beats_of, reseal, response

NUM_QPS = 4
EVENT_LATENCY = 4               # end beat in cycle c: the event is offered from c + 4
READS = (Opcode.RDMA_READ_RESPONSE_FIRST, Opcode.RDMA_READ_RESPONSE_MIDDLE,
         Opcode.RDMA_READ_RESPONSE_LAST, Opcode.RDMA_READ_RESPONSE_ONLY)


def good_packet(rng):
    """A well-formed response and its expected event (seq filled in when driven)."""
    q, psn = rng.randrange(NUM_QPS), rng.getrandbits(24)
    kind = rng.choice(["ack", "read", "read", "atomic"])
    if kind == "ack":
        syndrome = rng.choice([0x00 | rng.getrandbits(5), 0x20 | rng.getrandbits(5),
                               0x60 | rng.randint(0, 4)])
        pkt, opcode, payload_bytes = response(Opcode.ACKNOWLEDGE, q, psn, syndrome, b"", rng), 0x11, 0
    elif kind == "read":
        opcode = rng.choice(READS)
        syndrome = 0 if opcode == Opcode.RDMA_READ_RESPONSE_MIDDLE else rng.getrandbits(5)
        payload = rng.randbytes(rng.choice([0, 1, 3, 60, rng.randint(0, 300)]))
        pkt, payload_bytes = response(opcode, q, psn, syndrome, payload, rng), len(payload)
        syndrome = pkt[20]          # MIDDLE has no AETH: the event carries the byte there
    else:
        syndrome = rng.getrandbits(5)
        pkt, opcode, payload_bytes = (response(Opcode.ATOMIC_ACKNOWLEDGE, q, psn, syndrome, b"", rng),
                                      0x12, 8)
    return pkt, {"qpn": q, "opcode": int(opcode), "psn": psn, "syndrome": syndrome,
                 "payload_bytes": payload_bytes}


def junk_packet(rng):
    """A response the decoder must drop: ``(packet, end_bad, "icrc" or "malformed")``."""
    q, psn = rng.randrange(NUM_QPS), rng.getrandbits(24)
    kind = rng.choice(["icrc", "end_bad", "unknown", "request", "grh", "pktlen", "syndrome",
                       "long_ack"])
    if kind in ("icrc", "end_bad"):
        pkt, _ = good_packet(rng)
        if kind == "icrc":
            pkt = pkt[:-1] + bytes([pkt[-1] ^ (1 << rng.randrange(8))])
        return pkt, kind == "end_bad", "icrc"
    if kind == "unknown":
        pkt = response(rng.choice([Opcode.ACKNOWLEDGE, Opcode.ATOMIC_ACKNOWLEDGE]),
                       rng.randrange(NUM_QPS, 1 << 24), psn, 0, b"", rng)
    elif kind == "request":
        pkt = build_packet(bth=BTH(opcode=Opcode.SEND_ONLY, destqp=q, psn=psn),
                           payload=rng.randbytes(rng.randint(0, 80)))
    elif kind == "grh":
        pkt = build_packet(bth=BTH(opcode=Opcode.ACKNOWLEDGE, destqp=q, psn=psn), ext=(AETH(),),
                           grh=bytes(40))
    elif kind == "pktlen":
        body = bytearray(response(Opcode.RDMA_READ_RESPONSE_ONLY, q, psn, 0,
                                  rng.randbytes(rng.randint(0, 100)), rng)[:-4])
        words = ((body[4] & 7) << 8 | body[5]) + rng.choice([-1, 1])
        body[4] = (body[4] & 0xF8) | (words >> 8)
        body[5] = words & 0xFF
        pkt = reseal(body)
    elif kind == "syndrome":
        op = rng.choice([Opcode.ACKNOWLEDGE, Opcode.RDMA_READ_RESPONSE_ONLY, Opcode.ATOMIC_ACKNOWLEDGE])
        bad = (0x40 | rng.getrandbits(5) if op == Opcode.ACKNOWLEDGE and rng.random() < 0.5 else
               0x60 | rng.randint(5, 31) if op == Opcode.ACKNOWLEDGE else
               rng.choice([0x20, 0x60, 0x80, 0xE0]) | rng.getrandbits(5))
        pkt = response(op, q, psn, bad, b"", rng)
    else:
        body = bytearray(response(Opcode.ATOMIC_ACKNOWLEDGE, q, psn, 0, b"", rng)[:-4])
        body[8] = Opcode.ACKNOWLEDGE
        pkt = reseal(body)
    return pkt, False, "malformed"


class Bench:
    def __init__(self, rng, *, num_vls=2, p_beat=0.7, hold=()):
        self.rng, self.p_beat = rng, p_beat
        self.dut = ResponseDecoder(num_qps=NUM_QPS, num_vls=num_vls)
        self.num_vls = num_vls
        self.hold = set(hold)                   # VLs whose events are not taken
        self.packets = [deque() for _ in range(num_vls)]    # (beats, event, drop)
        self.events = [deque() for _ in range(num_vls)]     # expected, in order
        self.discards = deque()                 # (cycle, seq) expected
        self.offered_at = {}                    # (vl, index) -> earliest cycle, idle queue
        self.seq = 0
        self.icrc = self.malformed = 0
        self.malformed_seen = 0
        self.kept = [0] * num_vls               # events in a held VL's queue

    def queue(self, vl, pkt, event=None, end_bad=False, drop=None):
        self.packets[vl].append((beats_of(pkt, end_bad), event, drop, pkt[8] in STORED_OPCODES))

    async def run(self, ctx, limit=20000):
        dut, rng = self.dut, self.rng
        current = [None] * self.num_vls         # [beats left, event, drop, seq]
        stored_busy = None                      # the VL passing a stored packet
        last_vl = 0
        for t in range(limit):
            # One beat a cycle over all VLs; a stored packet only while no other passes.
            choices = []
            for v in range(self.num_vls):
                if current[v] is None and self.packets[v]:
                    beats, event, drop, stored = self.packets[v][0]
                    if stored and stored_busy is not None:
                        continue
                    choices.append(v)
                elif current[v] is not None:
                    choices.append(v)
            vl = None
            if choices and rng.random() < self.p_beat:
                vl = choices[(choices.index(last_vl) + 1) % len(choices)] if last_vl in choices \
                    else choices[0]
                last_vl = vl
                if current[vl] is None:
                    beats, event, drop, stored = self.packets[vl].popleft()
                    seq = None
                    if stored:
                        seq, self.seq = self.seq, (self.seq + 1) & 0xFFFF
                        stored_busy = vl
                    current[vl] = [deque(beats), event, drop, seq]
            for v in range(self.num_vls):
                beat = current[v][0][0] if v == vl else None
                ctx.set(dut.rx[v].valid, beat is not None)
                if beat is not None:
                    ctx.set(dut.rx[v].payload, beat)
                if current[v] is not None and current[v][3] is not None:
                    ctx.set(dut.rx_seq[v], current[v][3])
                ctx.set(dut.events[v].ready, v not in self.hold)
                assert ctx.get(dut.rx[v].ready), t
            if vl is not None:
                beats, event, drop, seq = current[vl]
                beats.popleft()
                if not beats:
                    self.end(t, vl, event, drop, seq)
                    current[vl] = None
                    if stored_busy == vl:
                        stored_busy = None
            self.check(ctx, t)
            await ctx.tick()
            if not any(self.packets) and current == [None] * self.num_vls and t > self.last + 8:
                break
        assert not any(self.packets) and not self.discards, "not drained"

    def end(self, t, vl, event, drop, seq):
        self.last = t
        if drop == "icrc":
            self.icrc += 1
        elif drop == "malformed":
            self.malformed += 1
        elif vl in self.hold and self.kept[vl] == RX_EVENT_DEPTH:
            drop = "full"
            self.malformed += 1
        else:
            if vl in self.hold:
                self.kept[vl] += 1
            self.events[vl].append(dict(event, seq=seq, at=t + EVENT_LATENCY))
        if drop and seq is not None:
            self.discards.append((t + 3, seq))

    def check(self, ctx, t):
        dut = self.dut
        self.malformed_seen += bin(ctx.get(dut.malformed)).count("1")
        if ctx.get(dut.discard.valid):
            assert self.discards and self.discards[0] == (t, ctx.get(dut.discard.payload)), t
            self.discards.popleft()
        assert not (self.discards and self.discards[0][0] < t), (t, "discard missing")
        for v in range(self.num_vls):
            events = dut.events[v]
            if ctx.get(events.valid) and ctx.get(events.ready):
                assert self.events[v], (t, v, "event nobody sent")
                want = self.events[v].popleft()
                got = {name: ctx.get(getattr(events.payload, name))
                       for name in ("qpn", "opcode", "psn", "syndrome", "payload_bytes")}
                assert got == {k: want[k] for k in got}, (t, v, got, want)
                if want["seq"] is not None:
                    assert ctx.get(events.payload.seq) == want["seq"], t
                assert t >= want["at"], (t, v, "event too early")
            # On a queue that always takes, an event is offered as soon as it can be.
            if v not in self.hold and self.events[v] and self.events[v][0]["at"] == t:
                assert ctx.get(events.valid), (t, v, "event late")

    async def finish(self, ctx):
        for _ in range(8):
            self.malformed_seen += bin(ctx.get(self.dut.malformed)).count("1")
            await ctx.tick()
        assert ctx.get(self.dut.rx_dropped_icrc) == self.icrc
        assert self.malformed_seen == self.malformed
        assert not any(ctx.get(self.dut.events[v].valid) for v in range(self.num_vls))
        assert not any(self.events), "events not delivered"


def mixed(bench, rng, count):
    for _ in range(count):
        vl = rng.randrange(bench.num_vls)
        if rng.random() < 0.7:
            pkt, event = good_packet(rng)
            bench.queue(vl, pkt, event)
        else:
            pkt, end_bad, drop = junk_packet(rng)
            bench.queue(vl, pkt, end_bad=end_bad, drop=drop)


@pytest.mark.parametrize("seed,num_vls", [(1, 2), (2, 1)])
def test_random(seed, num_vls):
    rng = random.Random(seed)
    bench = Bench(rng, num_vls=num_vls)
    mixed(bench, rng, 150)

    async def testbench(ctx):
        await bench.run(ctx)
        await bench.finish(ctx)

    simulate(bench.dut, testbench)


def test_full_queue():
    """VL 0's events not taken: it keeps RX_EVENT_DEPTH of 12 ACKs (and a stored READ
    response behind them is discarded), drops the rest as malformed; once taken, the ones kept
    come in order. Back to back, one beat a cycle."""
    rng = random.Random(4)
    bench = Bench(rng, num_vls=1, p_beat=1, hold=[0])
    for _ in range(12):
        pkt, event = good_packet(rng)
        while event["opcode"] != 0x11:
            pkt, event = good_packet(rng)
        bench.queue(0, pkt, event)
    pkt = response(Opcode.RDMA_READ_RESPONSE_ONLY, 1, 5, 0, b"abc", rng)
    bench.queue(0, pkt, {"qpn": 1, "opcode": 0x10, "psn": 5, "syndrome": 0, "payload_bytes": 3})

    async def testbench(ctx):
        await bench.run(ctx)
        assert bench.malformed == 13 - RX_EVENT_DEPTH
        bench.hold.clear()
        for events in bench.events:
            for event in events:
                event["at"] = 0
        for t in range(RX_EVENT_DEPTH + 4):
            ctx.set(bench.dut.events[0].ready, 1)
            bench.check(ctx, 100000 + t)
            await ctx.tick()
        await bench.finish(ctx)

    simulate(bench.dut, testbench)


@pytest.mark.parametrize("args", [{"num_qps": 0}, {"num_qps": 257}, {"num_vls": 0},
                                  {"num_vls": 16}])
def test_parameters(args):
    assert_rejected(ResponseDecoder, args)


def test_lint(tmp_path):
    assert_lint_clean(ResponseDecoder(num_qps=NUM_QPS, num_vls=2), "response_decoder", tmp_path)
