"""ResponseGenerator (hdl/nic/response_generator.py) with a real PacketAssembler, in
Amaranth's simulator.

The generator's descriptors go straight into a PacketAssembler (its ``payload_freed``
back to the generator, as in the NIC); the testbench plays the memory: it takes the
generator's AR bursts (random ``ready``), answers each after a latency with its beats
(random gaps, in order, as one AXI ID does) into the assembler's payload input, and takes
the packets from the assembler's VL streams under random backpressure.

Every packet is compared byte for byte (ICRC included) with ``models.nic.make_packet``
built from the command as models/nic/responder.py's NicResponderModel builds its responses
(``_ack``, ``_read_request``, ``_atomic``: opcodes, PSNs, AETH on FIRST/LAST/ONLY, MTU
cuts, payload from memory), in order per VL. Also checked: every burst has id 2, stays
inside a 4 KiB page and reads the words the packets need; the assembler never refuses a
payload beat (the reservation never exceeds its buffer); the counters at the end.

Runs: random commands of every kind (READ lengths 0 .. 20 KiB around MTU multiples,
every MTU, unaligned addresses, 4 KiB crossings, PSN wrap, ACKs, RNR NAKs, NAKs,
atomics) with bad commands mixed in, on two VLs with a 512-beat buffer and on one VL with
the smallest buffer (65 beats); directed: one-packet commands back to back, and the
throughput of a 64 KiB READ at MTU 4096 and a 16 KiB READ at MTU 256 with a memory latency
of 200 cycles (wire busy >= 0.95 from the first beat; at MTU 4096 also the packet bytes).
"""
import gc
import random
import warnings
from collections import deque

import pytest
from amaranth import Elaboratable, Module
from amaranth.hdl import UnusedElaboratable
from amaranth.lib import wiring

from hdl.nic.packet_assembler import PacketAssembler
from hdl.nic.response_generator import ResponseGenerator
from hdl.nic.signatures import RESPONSE_ID, ResponseCommandLayout
from models.ib import AETH, AtomicAckETH, Opcode
from models.nic import make_packet, psn_add, read_response_opcode
from tb.amaranth_sim import Driver, simulate

CMD = ResponseCommandLayout()
ACK, READ, ATOMIC = 0, 1, 2
MEMORY_BYTES = 1 << 16          # memory repeats every 64 KiB of the 2^64 address space
SLID = 0x1234
WIDTH = 64


def pack(layout, values):
    word = 0
    for name, field in layout:
        word |= (int(values.get(name, 0)) & ((1 << field.width) - 1)) << field.offset
    return word


class Memory:
    def __init__(self, rng):
        blob = rng.randbytes(MEMORY_BYTES)
        self.blob = blob + blob

    def read(self, addr, n):
        assert n <= MEMORY_BYTES
        start = addr % MEMORY_BYTES
        return self.blob[start:start + n]


def expected_packets(cmd, memory):
    """The response packets for ``cmd``, as models/nic/responder.py's NicResponderModel builds them."""
    def response(opcode, psn, ext=(), payload=b""):
        return make_packet(vl=cmd["vl"], sl=cmd["sl"], dlid=cmd["dlid"], slid=SLID, opcode=opcode,
                           destqp=cmd["destqp"], psn=psn, pkey=cmd["pkey"], ext=ext,
                           payload=payload)

    aeth = AETH(syndrome=cmd["syndrome"], msn=cmd["msn"])
    if cmd["kind"] == ACK:
        return [response(Opcode.ACKNOWLEDGE, cmd["psn"], [aeth])]
    if cmd["kind"] == ATOMIC:
        return [response(Opcode.ATOMIC_ACKNOWLEDGE, cmd["psn"], [aeth, AtomicAckETH(orig=cmd["orig"])])]
    mtu = 128 << cmd["mtu"]
    length = cmd["length"]
    count = max(1, -(-length // mtu))
    out = []
    for i in range(count):
        chunk = memory.read(cmd["va"] + i * mtu, min(mtu, length - i * mtu)) if length else b""
        op = read_response_opcode(i, count)
        ext = [] if op == Opcode.RDMA_READ_RESPONSE_MIDDLE else [aeth]
        out.append(response(op, psn_add(cmd["psn"], i), ext, chunk))
    return out


def random_command(rng, num_vls, bad_rate=0.0):
    kind = rng.choice([ACK, ACK, READ, READ, READ, ATOMIC])
    mtu = rng.randint(1, 5)
    mtu_bytes = 128 << mtu
    syndrome = rng.choice([0x1F, 0x00, 0x20 | rng.randrange(32), 0x60 | rng.randrange(5),
                           rng.randrange(256)])
    # Long READs are few: every wire beat costs the simulator the assembler's ICRC logic.
    length = rng.choice([0, rng.randint(1, 64), rng.randint(1, 20 * 1024) if rng.random() < 0.3 else 0,
                         min(mtu_bytes * rng.randint(1, 3), 4096) + rng.choice([-1, 0, 1]),
                         rng.randint(1, min(3 * mtu_bytes, 4096))])
    va = rng.choice([rng.randrange(1 << 64), rng.randrange(1 << 20),
                     (rng.randrange(1 << 52) << 12) - rng.randint(1, 200),
                     (1 << 64) - rng.randint(1, 8192)])
    psn = rng.choice([rng.randrange(1 << 24), (1 << 24) - rng.randint(1, 8)])
    cmd = dict(kind=kind, vl=rng.randrange(num_vls), sl=rng.randrange(16), dlid=rng.randrange(1 << 16),
               pkey=rng.randrange(1 << 16), destqp=rng.randrange(1 << 24), psn=psn, syndrome=syndrome,
               msn=rng.randrange(1 << 24), va=va, length=min(length, 20 * 1024), mtu=mtu,
               orig=rng.randrange(1 << 64))
    if rng.random() < bad_rate:
        fault = rng.choice(["kind", "vl", "mtu"])
        if fault == "kind":
            cmd["kind"] = 3
        elif fault == "vl":
            cmd["vl"] = rng.randint(num_vls, 15)
        else:
            cmd.update(kind=READ, mtu=rng.choice([0, 6, 7]))
        cmd["bad"] = True
    return cmd


class Top(Elaboratable):
    def __init__(self, num_vls, buffer_beats):
        self.gen = ResponseGenerator(num_vls=num_vls, payload_buffer_beats=buffer_beats)
        self.asm = PacketAssembler(num_vls=num_vls, payload_buffer_beats=buffer_beats)

    def elaborate(self, platform):
        m = Module()
        m.submodules.gen = self.gen
        m.submodules.asm = self.asm
        wiring.connect(m, self.gen.packet, self.asm.packet)
        m.d.comb += self.gen.payload_freed.eq(self.asm.payload_freed)
        return m


class Phase:
    """A batch of commands and how to drive them; phases run one after another on one
    design (elaboration of the assembler's ICRC logic takes seconds), each drained
    before the next starts."""

    def __init__(self, name, commands, *, cmd_rate=0.7, ar_rate=0.8, beat_rate=0.8,
                 ready_rate=0.8, latency=(5, 40)):
        self.name = name
        self.commands = commands
        self.cmd_rate = cmd_rate
        self.ar_rate = ar_rate
        self.beat_rate = beat_rate
        self.ready_rate = ready_rate
        self.latency = latency
        self.spans = []             # (start cycle, end cycle) of each packet, in output order
        self.accepted = []          # cycle each command was accepted


def run(phases, *, num_vls=2, buffer_beats=512, seed=0, max_cycles=40_000):
    rng = random.Random(seed)
    memory = Memory(rng)
    top = Top(num_vls, buffer_beats)
    gen, asm = top.gen, top.asm
    totals = dict(acks=0, naks=0, reads=0, atomics=0, bad=0)

    async def bench(ctx):
        ctx.set(gen.slid, SLID)
        drive = Driver()
        cycle = 0
        for phase in phases:
            cycle = await run_phase(ctx, drive, phase, cycle)
        assert ctx.get(gen.acks_sent) == totals["acks"]
        assert ctx.get(gen.naks_sent) == totals["naks"]
        assert ctx.get(gen.read_response_packets) == totals["reads"]
        assert ctx.get(gen.atomic_responses) == totals["atomics"]
        assert ctx.get(gen.bad_commands) == totals["bad"]
        assert ctx.get(asm.bad_descriptors) == 0

    async def run_phase(ctx, drive, phase, cycle):
        pending = deque(phase.commands)
        expected = [deque() for _ in range(num_vls)]
        reads = deque()             # (due cycle, address of each beat)
        wanted = deque()            # 64-byte words the packets need, in order
        cmd = None
        beat = None
        partial = [bytearray() for _ in range(num_vls)]
        starts = [None] * num_vls
        settle = 0
        end = cycle + max_cycles
        while True:
            if cmd is None and pending and rng.random() < phase.cmd_rate:
                cmd = pending.popleft()
                drive.set(gen.command.payload.as_value(), pack(CMD, cmd))
            drive.set(gen.command.valid, cmd is not None)
            drive.set(gen.ar.ready, rng.random() < phase.ar_rate)
            if beat is None and reads and reads[0][0] <= cycle and rng.random() < phase.beat_rate:
                addr = reads[0][1].popleft()
                if not reads[0][1]:
                    reads.popleft()
                beat = addr
                drive.set(asm.payload.payload, {"data": int.from_bytes(memory.read(addr, WIDTH), "little"),
                                              "resp": 0, "last": 0})
            drive.set(asm.payload.valid, beat is not None)
            for v in range(num_vls):
                drive.set(asm.data_out[v].ready, rng.random() < phase.ready_rate)
            drive.apply(ctx)

            if cmd is not None and ctx.get(gen.command.ready):
                phase.accepted.append(cycle)
                if cmd.get("bad"):
                    totals["bad"] += 1
                else:
                    packets = expected_packets(cmd, memory)
                    expected[cmd["vl"]].extend(packets)
                    if cmd["kind"] == READ:
                        totals["reads"] += len(packets)
                        mtu = 128 << cmd["mtu"]
                        for i in range(len(packets)):
                            n = min(mtu, cmd["length"] - i * mtu)
                            if n > 0:
                                first = (cmd["va"] + i * mtu) % (1 << 64)
                                wanted.extend((first // 64 + k) * 64 % (1 << 64)
                                              for k in range((first % 64 + n + 63) // 64))
                    elif cmd["kind"] == ATOMIC:
                        totals["atomics"] += 1
                    elif cmd["syndrome"] >> 5:
                        totals["naks"] += 1
                    else:
                        totals["acks"] += 1
                cmd = None
            if ctx.get(gen.ar.valid) and ctx.get(gen.ar.ready):
                ar = ctx.get(gen.ar.payload)
                assert ar.id == RESPONSE_ID
                assert ar.addr % 64 == 0
                assert ar.addr // 4096 == (ar.addr + 64 * ar.len) // 4096, f"burst {ar.addr:#x}+{ar.len} crosses 4 KiB"
                addrs = deque(ar.addr + 64 * k for k in range(ar.len + 1))
                for addr in addrs:
                    assert wanted and wanted.popleft() == addr, f"cycle {cycle}: read {addr:#x} not needed next"
                reads.append((cycle + rng.randint(*phase.latency), addrs))
            if beat is not None:
                assert ctx.get(asm.payload.ready), f"cycle {cycle}: payload buffer full (over-reserved)"
                beat = None
            for v in range(num_vls):
                port = asm.data_out[v]
                if not (ctx.get(port.valid) and ctx.get(port.ready)):
                    continue
                out = ctx.get(port.payload)
                assert out.start == (len(partial[v]) == 0)
                assert not out.end_bad
                if out.start:
                    starts[v] = cycle
                partial[v] += out.data.to_bytes(WIDTH, "little")[:out.count]
                if out.end:
                    assert expected[v], f"cycle {cycle}: VL {v} sent a packet nobody asked for"
                    want = expected[v].popleft()
                    got = bytes(partial[v])
                    assert got == want, (
                        f"{phase.name}, cycle {cycle}: VL {v} packet differs at byte "
                        f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
                        f", lengths {len(got)}/{len(want)}\n got {got[:40].hex()}\nwant {want[:40].hex()}")
                    phase.spans.append((starts[v], cycle))
                    partial[v].clear()
            done = (cmd is None and not pending and beat is None and not reads and not wanted
                    and not any(expected) and not any(partial))
            settle = settle + 1 if done else 0
            await ctx.tick()
            cycle += 1
            if settle > 3:
                break
            assert cycle < end, f"{phase.name}: did not finish ({sum(map(len, expected))} packets left)"
        drive.set(gen.command.valid, 0)
        drive.set(asm.payload.valid, 0)
        drive.apply(ctx)
        return cycle

    simulate(top, bench)


def busy_fraction(phase):
    """Wire beats over cycles from the first start beat to the last end beat."""
    beats = sum(last - first + 1 for first, last in phase.spans)
    return beats / (phase.spans[-1][1] - phase.spans[0][0] + 1)


# The long READs are long enough for their throughput to be the steady state's, past the
# 200-cycle read latency: 8 packets of 4096 bytes (on 2026-12-06 the wire busy every cycle
# from first to last beat, 0.99 of it bytes of the packets), and 16 of 256. They were 64 and
# 16 KiB: 154 s of make test on 2026-12-06.
PACKETS_AT_4096 = 8


def test_random_two_vls():
    """Random commands of every kind, bad ones mixed in, random backpressure everywhere;
    then one-packet commands back to back and the long READs' throughput."""
    rng = random.Random(1)
    short = Phase("one-packet back to back",
                  [dict(random_command(rng, 2), kind=rng.choice([ACK, ATOMIC]), vl=0) for _ in range(30)]
                  + [dict(random_command(rng, 2), kind=READ, vl=0, length=rng.randint(0, 16))
                     for _ in range(10)],
                  cmd_rate=1, ar_rate=1, beat_rate=1, ready_rate=1, latency=(3, 3))
    long = [Phase(f"{length // 1024} KiB READ, MTU {128 << mtu}",
                  [dict(random_command(rng, 2), kind=READ, vl=1, mtu=mtu, length=length,
                        va=rng.randrange(1 << 64))],
                  cmd_rate=1, ar_rate=1, beat_rate=1, ready_rate=1, latency=(200, 200))
            for mtu, length in ((5, 4096 * PACKETS_AT_4096), (1, 4096))]
    commands = [random_command(rng, 2, bad_rate=0.05) for _ in range(60)]
    for index, fault in enumerate([dict(kind=3), dict(vl=2), dict(vl=15), dict(kind=READ, mtu=0),
                                   dict(kind=READ, mtu=6), dict(kind=READ, mtu=7)]):
        commands.insert(10 * index + 5, dict(random_command(rng, 2), bad=True, **fault))
    run([Phase("random", commands),
         short, *long], seed=1)
    # ACKs and atomic ACKs: one packet a cycle, each one beat.
    ack_spans = short.spans[:30]
    assert all(a == b for a, b in ack_spans)
    assert all(b[0] == a[0] + 1 for a, b in zip(ack_spans, ack_spans[1:])), ack_spans
    for phase in long:
        assert busy_fraction(phase) >= 0.95, (phase.name, busy_fraction(phase))
    # FIRST and LAST carry an AETH, MIDDLE packets none; every payload its 4-byte ICRC.
    bytes_4096 = 2 * 24 + (PACKETS_AT_4096 - 2) * 20 + PACKETS_AT_4096 * (4096 + 4)
    first, last = long[0].spans[0][0], long[0].spans[-1][1]
    assert bytes_4096 / (WIDTH * (last - first + 1)) >= 0.95


def test_one_vl_small_buffer():
    """The smallest payload buffer (one largest packet's 65 beats): reads wait for room,
    the assembler must never be handed more beats than it holds."""
    rng = random.Random(2)
    commands = [random_command(rng, 1, bad_rate=0.05) for _ in range(25)]
    commands += [dict(random_command(rng, 1), kind=READ, mtu=5, length=4096 * 2, va=(rng.randrange(1 << 40) << 6) + 63)]
    run([Phase("small buffer", commands, ar_rate=1, beat_rate=1, ready_rate=0.6)],
        num_vls=1, buffer_beats=65, seed=2)


@pytest.mark.parametrize("args", [
    dict(num_vls=0), dict(num_vls=16), dict(payload_buffer_beats=64),
    dict(payload_buffer_beats=1 << 17), dict(packet_queue_depth=1), dict(num_vls=2.0),
])
def test_parameters(args):
    # The half-built component would warn, when collected, that it was never elaborated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match=next(iter(args))):
                ResponseGenerator(**args)
        finally:
            gc.collect()
