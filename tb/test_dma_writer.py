"""DmaWriter (hdl/nic/dma_writer.py) against a Python reference, in Amaranth's simulator.

One testbench plays, cycle by cycle: the receive buffer (a ring of random beats behind
the synchronous read port; beats are handed out to commands in ring order and refilled
with fresh random bytes as soon as they are released, so a read after its release shows
up as wrong data), the responder engine (random commands with random gaps: lengths
0 .. 4096, random destination alignment, 4 KiB crossings, source offsets, source beats
given modulo the ring, now and then a malformed length > 4096), and an AXI4 slave with a
byte-array memory (random AWREADY/WREADY, B after random delays, now and then SLVERR;
W beats may arrive before their AW is accepted and wait in the slave).

Checked: every AW burst exactly as the reference splits the command (64-byte aligned,
INCR, size 6, ID ``awid``, at most 64 beats, never across 4 KiB) and presented no later
than its first W beat; every W beat's strobe and strobed bytes, and ``wlast`` at the
burst's end; the memory byte-exact at the end (untouched bytes included); releases in
command order with the command's count; ``idle`` low whenever a command is unreleased or
a burst unanswered, and high within two cycles otherwise; the counters. Also a 32-bit
address instance and one with the ResponseWriter's AWID (``READ_DATA_ID``). Directed: no B at all until the end (releases still come, idle stays low, AW
within its bound ahead of W); a slow AW with a fast W (W waits for its AW); B responses
with nothing outstanding (ignored but counted if not OKAY); one W per cycle with an
always-ready slave and commands back to back, bounded only by the source reads when the
alignments differ; parameter checks.
"""
import random
from collections import deque

import pytest

from hdl.nic.dma_writer import AW_AHEAD, DmaWriter
from hdl.nic.signatures import DMA_WRITE_ID, READ_DATA_ID
from tb.amaranth_sim import assert_lint_clean, assert_rejected, simulate
from tb.axi_write_slave import AxiWriteSlave

MEM_WINDOW = 1 << 20                 # memory at the top of the address space, below the wrap
MEM_SIZE = 16 << 10
BEAT = 64


def ceil_beats(n):
    return (n + BEAT - 1) // BEAT


def mem_base(dut):
    return (1 << dut.addr_width) - MEM_WINDOW


def expected_writes(cmd, payload):
    """The reference: AW bursts [(addr, len)] and W beats [(strobe, {lane: byte}, last)]."""
    addr, nbytes = cmd["addr"], cmd["bytes"]
    if not 0 < nbytes <= 4096:
        return [], []
    start = addr & ~63
    beats = ceil_beats((addr & 63) + nbytes)
    bursts, beat_list = [], []
    a, left = start, beats
    while left:
        n = min(left, (4096 - (a & 4095)) // BEAT)
        bursts.append((a, n - 1))
        for k in range(n):
            base = a + k * BEAT
            lanes = {j: payload[base + j - addr] for j in range(BEAT)
                     if addr <= base + j < addr + nbytes}
            strobe = sum(1 << j for j in lanes)
            beat_list.append((strobe, lanes, k == n - 1))
        a += n * BEAT
        left -= n
    return bursts, beat_list


class Bench:
    def __init__(self, dut, rng, *, p_cmd=0.7, p_aw=0.7, p_w=0.8, b_delay=20, p_slverr=0.05,
                 hold_b=False, lengths="mixed"):
        self.dut, self.rng = dut, rng
        self.p_cmd = p_cmd
        self.lengths = lengths
        nb = dut.buffer_beats
        self.buf = bytearray(rng.randbytes(nb * BEAT))
        self.alloc = 0                      # next buffer beat to hand out
        self.free = nb
        self.base = mem_base(dut)
        self.slave = AxiWriteSlave(dut.axi, rng, base=self.base, size=MEM_SIZE, bid=dut.awid,
                                   p_aw=p_aw, p_w=p_w, b_delay=b_delay, p_slverr=p_slverr,
                                   hold_b=hold_b)
        self.ref_mem = bytearray(self.slave.mem)
        self.offer = None                   # command on the port
        self.unreleased = deque()           # release counts of accepted commands
        self.bursts_expected = 0            # AW bursts of accepted commands
        self.aw_expected = deque()
        self.w_expected = deque()
        self.aw_count = 0
        self.w_bursts_started = 0
        self.w_in_burst = False
        self.b_done = 0
        self.bytes = 0
        self.read_data = 0
        self.not_busy_for = 0
        self.t = 0
        self.w_cycles = []
        self.accepted = 0

    # --- engine side ------------------------------------------------------------------
    def make_command(self):
        rng, nb = self.rng, self.dut.buffer_beats
        if self.lengths == "mixed":
            r = rng.random()
            if r < 0.08:
                nbytes = 0
            elif r < 0.12:
                nbytes = rng.randint(4097, 8191)
            elif r < 0.4:
                nbytes = rng.randint(1, 200)
            elif r < 0.6:
                nbytes = rng.randint(3900, 4096)
            else:
                nbytes = rng.randint(1, 4096)
            src_offset = rng.randrange(64)
        else:
            nbytes, src_offset = self.lengths(rng)
        writes = 0 < nbytes <= 4096
        nsrc = ceil_beats(src_offset + nbytes) if writes else 0
        release = min(66, nsrc + rng.randint(0, 1)) if writes else rng.randint(0, 3)
        if release > self.free:
            return None
        if writes:
            if rng.random() < 0.3:      # force a 4 KiB crossing
                page = rng.randrange(1, MEM_SIZE // 4096)
                off = page * 4096 - rng.randint(1, nbytes)
            else:
                off = rng.randrange(MEM_SIZE - nbytes + 1)
            off = max(0, min(off, MEM_SIZE - nbytes))
        else:
            off = rng.randrange(MEM_SIZE)
        src_beat = self.alloc
        for i in range(release):
            b = (self.alloc + i) % nb
            self.buf[b * BEAT:(b + 1) * BEAT] = rng.randbytes(BEAT)
        self.alloc = (self.alloc + release) % nb
        self.free -= release
        cmd = {"addr": self.base + off, "bytes": nbytes,
               "src_beat": src_beat + nb * rng.randrange(4096 // nb), "src_offset": src_offset,
               "release_beats": release}
        payload = bytes(self.buf[((src_beat + (src_offset + i) // BEAT) % nb) * BEAT
                                 + (src_offset + i) % BEAT] for i in range(nbytes)) if writes else b""
        return cmd, payload

    def accept(self, cmd, payload):
        bursts, beats = expected_writes(cmd, payload)
        self.aw_expected.extend(bursts)
        self.w_expected.extend(beats)
        self.bursts_expected += len(bursts)
        self.unreleased.append(cmd["release_beats"])
        if bursts:
            off = cmd["addr"] - self.base
            self.ref_mem[off:off + cmd["bytes"]] = payload
            self.bytes += cmd["bytes"]
        self.accepted += 1

    # --- one cycle ----------------------------------------------------------------------
    async def cycle(self, ctx, more=True):
        dut, rng, t, slave = self.dut, self.rng, self.t, self.slave
        if self.offer is None and more and rng.random() < self.p_cmd:
            self.offer = self.make_command()
        ctx.set(dut.command.valid, self.offer is not None)
        if self.offer is not None:
            ctx.set(dut.command.payload, self.offer[0])
        ctx.set(dut.source.data, self.read_data)
        slave.drive(ctx, t)

        busy = bool(self.unreleased) or self.b_done < self.bursts_expected
        idle = ctx.get(dut.idle)
        if busy:
            assert not idle, (t, "idle while a command or burst is in progress")
            self.not_busy_for = 0
        else:
            self.not_busy_for += 1
            assert idle or self.not_busy_for <= 2, (t, "not idle with nothing in progress")

        addr = ctx.get(dut.source.addr)
        self.read_data = int.from_bytes(self.buf[addr * BEAT:(addr + 1) * BEAT], "little")

        if ctx.get(dut.release.valid):
            count = ctx.get(dut.release.payload)
            assert self.unreleased, (t, "release without a command")
            assert count == self.unreleased.popleft(), (t, "release out of order")
            self.free += count

        burst = slave.aw_burst(ctx)
        if burst is not None:
            assert (ctx.get(dut.axi.awid), ctx.get(dut.axi.awsize), ctx.get(dut.axi.awburst)) \
                == (dut.awid, 6, 1), t
            assert self.aw_expected, (t, "AW burst the reference does not have", burst)
            assert burst == self.aw_expected.popleft(), (t, burst)
            a, n = burst
            assert a % 64 == 0 and n < 64 and (a & 4095) + (n + 1) * 64 <= 4096, (t, burst)
            slave.accept_aw(a, n)
            self.aw_count += 1
        beat = slave.take_w(ctx)
        if beat is not None:
            if not self.w_in_burst:
                shown = ctx.get(dut.axi.awvalid) and not slave.awready
                presented = self.aw_count + (1 if shown else 0)
                assert self.w_bursts_started < presented, (t, "W before its AW")
                self.w_bursts_started += 1
            raw, strobe, last = beat
            self.w_in_burst = not last
            assert self.w_expected, (t, "W beat the reference does not have")
            e_strobe, lanes, e_last = self.w_expected.popleft()
            assert (strobe, last) == (e_strobe, e_last), (t, hex(strobe), hex(e_strobe), last)
            assert all(raw[j] == v for j, v in lanes.items()), (t, "W data")
            self.w_cycles.append(t)
        if slave.respond(ctx, t) is not None:
            self.b_done += 1

        if self.offer is not None and ctx.get(dut.command.ready):
            self.accept(*self.offer)
            self.offer = None
        await ctx.tick()
        self.t += 1

    async def run(self, ctx, commands, limit=30000):
        while self.accepted < commands:
            await self.cycle(ctx)
            assert self.t < limit, "commands not accepted"
        start = self.t
        while (self.unreleased or self.b_done < self.bursts_expected or self.slave.b_due
               or self.w_expected):
            await self.cycle(ctx, more=False)
            assert self.t - start < limit, "no progress"
        for _ in range(4):
            await self.cycle(ctx, more=False)
        assert ctx.get(self.dut.idle)
        assert not self.aw_expected and not self.slave.w_pending and not self.slave.bursts
        assert self.slave.mem == self.ref_mem
        assert ctx.get(self.dut.dma_bytes_written) == self.bytes
        assert ctx.get(self.dut.dma_write_errors) == self.slave.errors


def lengths_up_to(max_bytes):
    """A ``lengths`` for :class:`Bench`: 1 .. ``max_bytes`` bytes from source offset 0 .. 63."""
    def lengths(rng):
        return rng.randint(1, max_bytes), rng.randrange(64)
    return lengths


def run_commands(bench, commands):
    """Simulate ``bench`` until ``commands`` commands are accepted and done (:meth:`Bench.run`)."""
    async def testbench(ctx):
        await bench.run(ctx, commands)

    simulate(bench.dut, testbench)


@pytest.mark.parametrize("seed,buffer_beats,addr_width,awid", [
    (1, 128, 64, DMA_WRITE_ID), (2, 128, 64, DMA_WRITE_ID), (3, 256, 64, DMA_WRITE_ID),
    (4, 128, 32, DMA_WRITE_ID), (9, 128, 64, READ_DATA_ID),
])
def test_random(seed, buffer_beats, addr_width, awid):
    """The last case is the ResponseWriter's instance: every AW carries its ``awid``."""
    dut = DmaWriter(buffer_beats=buffer_beats, addr_width=addr_width, awid=awid)
    run_commands(Bench(dut, random.Random(seed)), 60)


def test_short_commands():
    """Many small writes: every alignment, AW/W/B all slow, commands back to back."""
    bench = Bench(DmaWriter(buffer_beats=64), random.Random(7), p_cmd=1.0, p_aw=0.5, p_w=0.5,
                  lengths=lengths_up_to(130))
    run_commands(bench, 150)


def test_stray_b():
    """B responses with no burst outstanding are taken and change nothing but the error
    count; traffic afterwards is unaffected."""
    dut = DmaWriter(buffer_beats=128)
    bench = Bench(dut, random.Random(12))

    async def testbench(ctx):
        ctx.set(dut.axi.bvalid, 1)
        for resp in (2, 0, 3):
            ctx.set(dut.axi.bresp, resp)
            assert ctx.get(dut.axi.bready)
            await ctx.tick()
            assert ctx.get(dut.idle)
        ctx.set(dut.axi.bvalid, 0)
        bench.slave.errors = 2          # the two stray responses that were not OKAY
        await bench.run(ctx, 20)

    simulate(dut, testbench)


def test_slow_aw():
    """AW taken rarely, W always: W beats of a burst start only once its AW is presented."""
    bench = Bench(DmaWriter(buffer_beats=64), random.Random(8), p_cmd=1.0, p_aw=0.1, p_w=1.0,
                  lengths=lengths_up_to(300))
    run_commands(bench, 60)


def test_no_b_until_end():
    """Write responses withheld: releases still come (the buffer is not held for B),
    ``idle`` stays low, and AW stays at most ``AW_AHEAD`` bursts ahead of W."""
    dut = DmaWriter(buffer_beats=128)
    bench = Bench(dut, random.Random(11), p_cmd=1.0, p_aw=1.0, p_w=1.0, hold_b=True,
                  lengths=lengths_up_to(700))

    async def testbench(ctx):
        for _ in range(400):
            await bench.cycle(ctx)
            assert bench.aw_count - bench.w_bursts_started <= AW_AHEAD + 1
        assert bench.accepted > 20 and len(bench.unreleased) <= 5
        assert bench.b_done == 0 and len(bench.slave.b_due) >= bench.accepted - 12
        bench.slave.hold_b = False
        await bench.run(ctx, bench.accepted)

    simulate(dut, testbench)


@pytest.mark.parametrize("aligned,max_bytes", [(True, 4096), (False, 4096), (False, 300)])
def test_throughput(aligned, max_bytes):
    """An always-ready slave, commands back to back: one W beat per cycle; with different
    source and destination alignment a command may need one source beat more than it has
    W beats, and the single read port then bounds it."""
    bench = Bench(DmaWriter(buffer_beats=256), random.Random(5), p_cmd=1.0, p_aw=1.0, p_w=1.0,
                  b_delay=1, p_slverr=0, lengths=lengths_up_to(max_bytes))
    if aligned:
        # Same byte offset in source and destination beats: as many reads as W beats.
        make = bench.make_command

        def make_aligned():
            made = make()
            if made is not None:
                cmd, _ = made
                addr = (cmd["addr"] & ~63) | cmd["src_offset"]
                cmd["addr"] = addr - 64 if addr + cmd["bytes"] > bench.base + MEM_SIZE else addr
            return made
        bench.make_command = make_aligned
    commands = []
    accept = bench.accept

    def record(cmd, payload):
        commands.append(cmd)
        accept(cmd, payload)
    bench.accept = record

    run_commands(bench, 30)
    beats = len(bench.w_cycles)
    span = bench.w_cycles[-1] - bench.w_cycles[0] + 1
    cost = sum(max(ceil_beats(c["src_offset"] + c["bytes"]), ceil_beats((c["addr"] & 63) + c["bytes"]))
               for c in commands)
    if aligned:
        assert span == beats, (span, beats)
    assert span <= cost, (span, cost, beats)


@pytest.mark.parametrize("args", [
    {"buffer_beats": 100}, {"buffer_beats": 32}, {"buffer_beats": 8192}, {"addr_width": 11},
    {"addr_width": 65}, {"awid": 8}, {"awid": -1}, {"awid": "2"},
])
def test_parameters(args):
    assert_rejected(DmaWriter, args)


def test_lint(tmp_path):
    """Verilator lints the Verilog clean (ports listed by hand: the always-ready
    ``release.ready`` is a constant, not a port)."""
    assert_lint_clean(DmaWriter(buffer_beats=64, addr_width=40), "dma_writer", tmp_path)
