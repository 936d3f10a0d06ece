"""The cut-through switch (hdl/switch/switch.py) with a host link port on every port.

Sim top :class:`tb.switch_top.SwitchTop`, testbench :class:`tb.switch_tb.SwitchTB`: every
packet is checked by :class:`models.switch.FlowScoreboard` (delivered exactly once,
intact, in order per (input, output, VL), on the port and VL the tables say), every test
ends with :meth:`SwitchTB.check_clean` (nothing outstanding, no receive buffer overflowed,
every credit home, every link still ACTIVE).

Builds (each Verilator build costs a minute or two, so few): ``voq`` (4 ports, 2 VLs,
64-byte beats, VOQs, 2-cycle cables, host 0's wire to the switch carried by the testbench
for fault injection) runs every test; ``fifo`` (FIFO mode, one VL, 16-byte beats) runs the head-of-line
demonstration and random traffic on 3 ports with a 2048-byte MTU, which shortens its
build. Each has the default, pipelined allocator; ``voq_islip`` and ``fifo_islip`` run the
same tests with the single-cycle ``allocator="islip"`` (``voq_islip`` with 16-byte beats, for
a shorter build).
"""
import math
import random

import cocotb
import pytest

from hdl.link.signatures import LinkState
from hdl.switch.switch import DEFAULT_ALLOCATOR, HOP_LATENCY_CYCLES
from models.ib import Opcode
from models.switch import RTL_ALLOCATORS, Router, jain_index, stream_to_one_output
from tb import runner
from tb.beats import WireChannel
from tb.switch_tb import CLOCK_NS, SwitchTB, bursty_backpressure, host_lid, packet_key

LATENCY_BUDGET = 8          # cycles, start beat in to start beat out (issue 3: at most 8)


def allocator():
    return runner.tb_params().get("allocator", DEFAULT_ALLOCATOR)


def design_latency():
    return HOP_LATENCY_CYCLES[allocator()]


def log(dut, text):
    dut._log.info(text)


# --- zero-load latency -----------------------------------------------------------------------

@cocotb.test()
async def zero_load_latency(dut):
    """One packet at a time, every input to every other output, both VLs, three sizes:
    start beat on the switch's wire_in[p] to start beat on its wire_out[q] <= 8 cycles."""
    tb = SwitchTB(dut, seed=1)
    await tb.bring_up()
    latencies = {}
    for p in range(tb.ports):
        for q in range(tb.ports):
            if p == q:
                continue
            for vl in range(tb.num_vls):
                for size in (0, 256, 2020):
                    packet = tb.make_packet(p, host_lid(q), payload_len=size, vl=vl, sl=vl)
                    n_in, n_out = len(tb.ingress[p].data_packets), len(tb.egress[q].data_packets)
                    tb.send(p, packet)
                    await tb.run(until=tb.nothing_outstanding, limit=2000,
                                 what=f"delivery {p}->{q}")
                    got_in = tb.ingress[p].data_packets[n_in:]
                    got_out = tb.egress[q].data_packets[n_out:]
                    assert len(got_in) == 1 and len(got_out) == 1, (got_in, got_out)
                    assert packet_key(got_in[0][0]) == packet_key(got_out[0][0])
                    latencies[p, q, vl, size] = got_out[0][2] - got_in[0][2]
                    await tb.run(cycles=8)
    worst = max(latencies.values())
    best = min(latencies.values())
    pairs = {(p, q): max(l for (a, b, _, _), l in latencies.items() if (a, b) == (p, q))
             for p in range(tb.ports) for q in range(tb.ports) if p != q}
    log(dut, "zero-load hop latency (start beat in -> start beat out), cycles, worst per pair: "
        + ", ".join(f"{p}->{q}: {l}" for (p, q), l in sorted(pairs.items())))
    log(dut, f"SWITCH_HOP_LATENCY max {worst} cycles = {worst * CLOCK_NS:.1f} ns at "
        f"{1000 / CLOCK_NS:.0f} MHz (min {best}; design {design_latency()}, budget {LATENCY_BUDGET})")
    assert worst <= LATENCY_BUDGET, f"hop latency {worst} cycles > budget {LATENCY_BUDGET}: {latencies}"
    assert worst <= design_latency(), f"hop latency {worst} cycles > the documented {design_latency()}"
    await tb.drain()
    tb.check_clean()


# --- uniform random traffic ------------------------------------------------------------------

def random_size(rng, mtu=4096):
    return rng.choice((rng.randrange(0, 257), rng.randrange(0, min(1536, mtu) + 1),
                       rng.randrange(0, mtu + 1)))


@cocotb.test()
async def uniform_random_traffic(dut):
    """Every host sends random sizes on random VLs and SLs to uniformly random other hosts
    while every host's consumer stalls in long random bursts (the switch's outputs run out of
    downstream credit): each packet delivered exactly once, intact, in order per (input,
    output, VL); no receive buffer overflows; everything drains when the sources stop; the
    switch's packets/bytes in/out counters equal what the hosts sent and received."""
    tb = SwitchTB(dut, seed=2)
    rng = random.Random(22)
    for key, gen in tb.backpressure.items():
        gen.set(bursty_backpressure(random.Random(rng.random()), 0.35, mean_burst=60))
    await tb.bring_up()
    per_port = 70
    for k in range(per_port):
        for p in range(tb.ports):
            q = rng.choice([o for o in range(tb.ports) if o != p])
            vl, sl = rng.randrange(tb.num_vls), rng.randrange(16)
            tb.send(p, tb.make_packet(p, host_lid(q), payload_len=random_size(rng, tb.mtu), vl=vl, sl=sl))
    await tb.drain(limit=400000)
    tb.check_clean()
    log(dut, f"uniform random: {tb.scoreboard.delivered} packets delivered in {tb.loop.cycle} cycles")
    counters = await tb.all_counters()
    stalls = 0
    for (p, v), c in counters.items():
        sent = tb.sent[p, v]
        got = [pkt for _, q, w, pkt in tb.delivered if (q, w) == (p, v)]
        assert c["packets_in"] == len(sent), f"port {p} VL {v} packets_in {c['packets_in']} != {len(sent)}"
        assert c["bytes_in"] == sum(map(len, sent)), f"port {p} VL {v} bytes_in"
        assert c["packets_out"] == len(got), f"port {p} VL {v} packets_out {c['packets_out']} != {len(got)}"
        assert c["bytes_out"] == sum(map(len, got)), f"port {p} VL {v} bytes_out"
        drops = {name: n for name, n in c.items() if name.startswith("drop_") and n}
        assert not drops, f"port {p} VL {v} dropped {drops}"
        stalls += c["credit_stall_cycles"]
    assert stalls > 0, "stalled consumers must show up as credit stalls at the switch's outputs"
    log(dut, f"uniform random: {stalls} credit-stall cycles over all outputs")


# --- incast ----------------------------------------------------------------------------------

INCAST_UTILIZATION = 0.99


@cocotb.test()
async def incast(dut):
    """Every other host sends back to back to host 0 (N-1 to 1, 2020-byte payloads, 32 beats):
    nothing lost, output 0's wire carries a data beat in >= 99% of the cycles while all
    inputs are backlogged, and the inputs share it fairly (Jain index, per-input shares)."""
    tb = SwitchTB(dut, seed=3)
    await tb.bring_up()
    target, senders, per_sender = 0, list(range(1, tb.ports)), 50
    for k in range(per_sender):
        for p in senders:
            tb.send(p, tb.make_packet(p, host_lid(target), payload_len=2020, vl=0, sl=0))
    # Backlogged until the first sender has handed its last packet to its link.
    await tb.run(until=lambda: any(not tb.sources[p, 0].queue for p in senders), limit=100000)
    end = tb.loop.cycle
    out = tb.egress[target]
    first = out.data_beat_cycles[0]
    start = first + 300                        # past the start-up transient
    assert end - start > 1000, f"window too short: {start}..{end}"
    beats = out.data_beats_between(start, end)
    utilization = beats / (end - start)
    share = {p: 0 for p in senders}
    for packet, bad, cycle in out.data_packets:
        if start <= cycle < end:
            share[int.from_bytes(packet[6:8], "big") - host_lid(0)] += 1
    jain = jain_index(share.values())
    total = sum(share.values())
    packet_beats = math.ceil((2020 + 26) / tb.width)
    log(dut, f"SWITCH_INCAST {len(senders)}:1 cycles {start}..{end}: output busy {utilization:.4f} "
        f"of cycles (data beats {beats}; one {packet_beats}-beat packet per {packet_beats + 1} cycles "
        f"would be {packet_beats / (packet_beats + 1):.4f}); packets per input {share}, "
        f"Jain {jain:.4f}")
    await tb.drain()
    tb.check_clean()
    assert jain >= 0.99, f"unfair incast: {share}, Jain {jain:.4f}"
    for p, n in share.items():
        assert abs(n / total - 1 / len(senders)) <= 0.05, f"input {p} got {n} of {total} packets"
    assert utilization >= INCAST_UTILIZATION, (
        f"incast output busy {utilization:.4f} of cycles, required {INCAST_UTILIZATION}")


# --- short packets to one output ------------------------------------------------------------

SHORT_BLOCKS = (1, 2, 4)        # SEND_ONLY packets of these many 64-byte blocks


def short_payload(blocks):
    """A SEND_ONLY payload whose packet (26 bytes of headers and CRCs) takes ``blocks``."""
    return 64 * blocks - 32


def model_gaps(tb, blocks, per_sender, senders):
    """The switch model's spacing of one stream (docs/models.md): every sender holds its
    packets from the start; cycles between one start beat out and the next less the first
    packet's beats, sorted (the pipelined allocator's credit hold and short-packet rule)."""
    router = Router(tb.ports, 1, width=tb.width, **RTL_ALLOCATORS[allocator()])
    out = stream_to_one_output(router, senders, [short_payload(blocks)] * per_sender)
    return sorted(b[0] - a[0] - a[1] for a, b in zip(out, out[1:]))


@cocotb.test()
async def short_packets(dut):
    """Hosts 1..3 each send a stream of 1-, 2- and then 4-block packets to host 0: output 0's
    start beats are as far apart as the switch model says for such a stream (the median gap;
    with the pipelined allocator: back to back, the short-packet rule of docs/switch.md; the
    cycles the transmitter spends on flow-control packets and waits for credit aside). Then
    behind 4-block ones a 40-block one from each: all delivered, no receive buffer overrun
    (check_clean)."""
    tb = SwitchTB(dut, seed=5)
    await tb.bring_up()
    senders, per_sender, out = list(range(1, tb.ports)), 24, tb.egress[0]
    for blocks in SHORT_BLOCKS:
        mark = len(out.data_packets)
        for _ in range(per_sender):
            for p in senders:
                tb.send(p, tb.make_packet(p, host_lid(0), payload_len=short_payload(blocks),
                                          opcode=Opcode.SEND_ONLY))
        await tb.drain()
        beats = math.ceil((64 * blocks - 6) / tb.width)
        starts = [cycle for _, _, cycle in out.data_packets[mark:]]
        gaps = sorted(b - a - beats for a, b in zip(starts, starts[1:]))
        model = model_gaps(tb, blocks, per_sender, senders)
        log(dut, f"SWITCH_SHORT {blocks}-block packets ({beats} beats), {len(senders)} inputs to 1: "
            f"gaps (start to start less the beats) median {gaps[len(gaps) // 2]}, "
            f"mean {sum(gaps) / len(gaps):.2f}; model median {model[len(model) // 2]}, "
            f"mean {sum(model) / len(model):.2f}")
        assert len(starts) == per_sender * len(senders)
        assert gaps[len(gaps) // 2] == model[len(model) // 2], (gaps, model)
    # A long packet behind short ones waits for their counts, then starts with its credit.
    mark = len(out.data_packets)
    for p in senders:
        for payload in (short_payload(4),) * 3 + (short_payload(40),):
            tb.send(p, tb.make_packet(p, host_lid(0), payload_len=payload, opcode=Opcode.SEND_ONLY))
    await tb.drain()
    assert len(out.data_packets) - mark == 4 * len(senders)
    tb.check_clean()


# --- head-of-line blocking -------------------------------------------------------------------

@cocotb.test()
async def head_of_line(dut):
    """Host 0's consumer stops taking anything: its buffer fills, switch output 0 runs out
    of credit, and the packets for it that are left wait in the switch's inputs. Behind
    them, the same inputs send a permutation (1->2, 2->3, 3->1) on the same VL. With VOQs
    that traffic keeps the rate it has alone (measured first, without the blocked output);
    in FIFO mode it is stuck behind the blocked heads (head-of-line blocking). Then host 0
    consumes again and everything drains."""
    tb = SwitchTB(dut, seed=4)
    voq = tb.mode == "voq"
    await tb.bring_up()
    blocked = 0
    senders = [p for p in range(tb.ports) if p != blocked]
    perm = {p: senders[(k + 1) % len(senders)] for k, p in enumerate(senders)}

    def flows(count):
        for k in range(count):
            for p in senders:
                tb.send(p, tb.make_packet(p, host_lid(perm[p]), payload_len=2020, vl=0, sl=0))

    async def measure(cycles):
        start = tb.loop.cycle
        await tb.run(cycles=cycles)
        end = tb.loop.cycle
        for p in senders:
            assert tb.sources[p, 0].queue, f"input {p} ran dry inside the window"
        return {q: tb.egress[q].data_beats_between(start, end) / (end - start) for q in senders}

    # Alone: the rate the permutation gets with nothing blocked.
    flows(60)
    await tb.run(cycles=400)
    alone = await measure(1200)
    await tb.drain()

    # Blocked: 12 packets per input for host 0 (more than its buffer holds), then the flows.
    for v in range(tb.num_vls):
        tb.backpressure[blocked, v].hold(True)
    for k in range(12):
        for p in senders:
            tb.send(p, tb.make_packet(p, host_lid(blocked), payload_len=256, vl=0, sl=0))
    flows(120)
    # Until host 0's buffer is full and output 0 waits for credit: the inputs' readers share
    # their time with the permutation's long packets, so narrow beats take longer.
    await tb.run(cycles=1000 * max(1, 64 // tb.width))
    stall_before = (await tb.counters(blocked, 0))["credit_stall_cycles"]
    t0 = tb.loop.cycle
    rates = await measure(2000)
    stall = (await tb.counters(blocked, 0))["credit_stall_cycles"] - stall_before
    waited = tb.loop.cycle - t0
    reached = sum(1 for pkt, _, _ in tb.egress[blocked].data_packets)
    log(dut, f"SWITCH_HOL mode {tb.mode}: output {blocked} blocked (credit stalls {stall} of "
        f"{waited} cycles, {reached} packets reached host {blocked}); the permutation's outputs "
        f"busy " + ", ".join(f"{q}: {rates[q]:.3f} (alone {alone[q]:.3f})" for q in senders)
        + f"; back to back would be {32 / 33:.3f}")
    assert stall >= 0.9 * waited, "output 0 should wait for credit all along"
    if voq:
        for q in senders:
            assert rates[q] >= 0.9 * alone[q], (
                f"VOQ: output {q} slowed from {alone[q]:.3f} to {rates[q]:.3f} by the blocked output")
    else:
        for q in senders:
            assert alone[q] > 0.3, f"FIFO: output {q} only {alone[q]:.3f} busy with nothing blocked"
            assert rates[q] <= 0.05, f"FIFO: output {q} at {rates[q]:.3f}, expected it stuck behind the blocked heads"
    for v in range(tb.num_vls):
        tb.backpressure[blocked, v].hold(False)
    await tb.drain(limit=400000)
    tb.check_clean()


# --- head-of-queue lifetime ------------------------------------------------------------------

@cocotb.test()
async def hoq_lifetime(dut):
    """A dead output must not hold other flows for ever. Host 0 stops taking anything; every
    other host first sends 10 packets to it, which fill host 0's buffer and then the inputs'
    VL 0 buffers, then a permutation of the other hosts on the same VL. Without a lifetime
    the permutation would wait behind the stuck packets for as long as host 0 is dead. With
    ``hoq_lifetime`` set, each stuck head is discarded after the lifetime: the permutation is
    delivered exactly once and in order while host 0 is still dead, and every packet sent to
    host 0 is either delivered (once it takes packets again) or counted in output 0's
    ``drop_hoq_lifetime``, never both, never neither."""
    from hdl.switch.register_map import HOQ_TICK_CYCLES
    tb = SwitchTB(dut, seed=7)
    await tb.bring_up()
    lifetime_ticks = 32
    await tb.write(0x1C, lifetime_ticks)
    dead = 0
    tb.unscored_ports.add(dead)
    senders = [p for p in range(tb.ports) if p != dead]
    perm = {p: senders[(k + 1) % len(senders)] for k, p in enumerate(senders)}
    for v in range(tb.num_vls):
        tb.backpressure[dead, v].hold(True)
    to_dead = 0
    for k in range(10):
        for p in senders:
            tb.send(p, tb.make_packet(p, host_lid(dead), payload_len=2020, vl=0, sl=0),
                    expect=False)
            to_dead += 1
    for k in range(20):
        for p in senders:
            tb.send(p, tb.make_packet(p, host_lid(perm[p]), payload_len=2020, vl=0, sl=0))
    before = tb.loop.cycle
    await tb.run(until=tb.nothing_outstanding, limit=200000, what="the permutation behind a dead output")
    took = tb.loop.cycle - before
    dropped = (await tb.counters(dead, 0))["drop_hoq_lifetime"]
    others = 0
    for p in senders:
        for v in range(tb.num_vls):
            others += (await tb.counters(p, v))["drop_hoq_lifetime"]
    assert others == 0, f"{others} packets discarded at outputs that were not dead"
    assert dropped > 0, "nothing was discarded for the dead output"
    # Host 0 comes back: what it had buffered (and what is still queued for it) arrives.
    for v in range(tb.num_vls):
        tb.backpressure[dead, v].hold(False)
    await tb.run(cycles=20000)
    await tb.drain()
    dropped = (await tb.counters(dead, 0))["drop_hoq_lifetime"]
    reached = len(tb.unscored)
    log(dut, f"HOQ lifetime {lifetime_ticks} x {HOQ_TICK_CYCLES} cycles: the permutation "
        f"({len(senders) * 20} packets) delivered in {took} cycles with output {dead} dead; "
        f"of {to_dead} packets for it {reached} were delivered, {dropped} discarded")
    assert reached + dropped == to_dead, (
        f"{to_dead} sent to host {dead}: {reached} delivered + {dropped} discarded")
    keys = [packet_key(pkt) for _, _, _, pkt in tb.unscored]
    assert len(keys) == len(set(keys)), "a packet for host 0 arrived twice"
    tb.check_clean()


# --- bad input -------------------------------------------------------------------------------

def same_packet(a, b):
    """Whether ``a`` and ``b`` are the same packet up to one flipped bit (a bad-VCRC
    mutation) and the VL nibble, over their common length (truncated / overlong ones)."""
    n = min(len(a), len(b))
    if n < 24:
        return False
    flips = sum(bin(x ^ y).count("1") for x, y in zip(a[1:n], b[1:n]))
    return flips <= 1 and (a[0] & 0x0F) == (b[0] & 0x0F)


@cocotb.test()
async def bad_input(dut):
    """Through host 0's testbench-carried wire: bad VCRC, truncated, overlong, beyond the MTU,
    invalid VL, marked end-bad; from several hosts: unknown DLIDs (unprogrammed, and beyond
    the table) and an SL mapped to VL 15. Each is dropped and counted by reason in the right
    (port, VL) counter over AXI; the other flows are delivered exactly once. A bad VCRC on a
    packet already cut through leaves marked end-bad and the host's receiver drops it (its
    end_bad drop counter counts it); a bad VCRC found before the packet could leave is
    dropped in the switch and never appears on the output wire."""
    plan = {}

    def mutate(first_beat):
        return plan.get(packet_key(first_beat))

    tb = SwitchTB(dut, seed=5, mutate=mutate)
    assert 0 in tb.tb_ports, "this test needs host 0's wire carried by the testbench"
    rng = random.Random(55)
    await tb.bring_up()
    await tb.set_sl_to_vl(15, 15)
    want = {}       # (port, vl, counter) -> count

    def count(port, vl, name):
        want[port, vl, name] = want.get((port, vl, name), 0) + 1

    # Phase 1: mixed traffic; host 0's packets include 3 of every mutation.
    kinds = [kind for kind in WireChannel.MUTATIONS for _ in range(3)]
    host0 = [True] * len(kinds) + [False] * 40
    rng.shuffle(host0)
    k = 0
    for bad in host0:
        q = rng.randrange(1, tb.ports)
        vl = rng.randrange(tb.num_vls)
        packet = tb.make_packet(0, host_lid(q), payload_len=rng.randrange(0, 1025), vl=vl, sl=vl)
        if bad:
            kind = kinds[k]
            k += 1
            plan[packet_key(packet)] = kind
            count(0, 0 if kind == "invalid_vl" else vl, f"drop_{kind}")
            tb.send(0, packet, expect=False)
        else:
            tb.send(0, packet)
    for p in range(tb.ports):
        for lid in (0x300 + p, 0x2000 + p):       # never programmed; beyond the 1024-entry table
            vl = rng.randrange(tb.num_vls)
            tb.send(p, tb.make_packet(p, lid, payload_len=rng.randrange(0, 513), vl=vl, sl=vl))
            count(p, vl, "drop_unknown_dlid")
        q = (p + 1) % tb.ports
        tb.send(p, tb.make_packet(p, host_lid(q), payload_len=100, vl=0, sl=15))
        count(p, 0, "drop_invalid_vl")
    for p in range(1, tb.ports):
        for _ in range(25):
            q = rng.choice([o for o in range(tb.ports) if o != p])
            vl = rng.randrange(tb.num_vls)
            tb.send(p, tb.make_packet(p, host_lid(q), payload_len=rng.randrange(0, 1025),
                                      vl=vl, sl=vl))
    await tb.drain()

    # Phase 2: a long packet on an idle output whose VCRC fails after it started out.
    late = tb.make_packet(0, host_lid(1), payload_len=2020, vl=1, sl=1)
    plan[packet_key(late)] = "vcrc"
    count(0, 1, "drop_vcrc")
    host1_end_bad = tb.signal("host1_drop_end_bad")
    tb.send(0, late, expect=False)
    await tb.drain()
    on_wire = [(bad, pkt) for pkt, bad, _ in tb.egress[1].data_packets if same_packet(pkt, late)]
    assert on_wire and on_wire[0][0], f"cut-through packet with a bad VCRC left unmarked: {on_wire}"
    assert tb.signal("host1_drop_end_bad") == host1_end_bad + 1, "host 1 did not drop it as end-bad"

    # Phase 3: a bad VCRC known before the packet could leave (its output busy): dropped here.
    big = tb.make_packet(2, host_lid(3), payload_len=4096, vl=0, sl=0)
    tb.send(2, big)
    await tb.run(until=lambda: len(tb.egress[3].partial) >= 16
                 and packet_key(tb.egress[3].partial) == packet_key(big),
                 limit=2000, what="the long packet on output 3")
    early = tb.make_packet(0, host_lid(3), payload_len=200, vl=0, sl=0)
    plan[packet_key(early)] = "vcrc"
    count(0, 0, "drop_vcrc")
    tb.send(0, early, expect=False)
    await tb.drain()
    assert not any(same_packet(pkt, early) for pkt, _, _ in tb.egress[3].data_packets), \
        "a packet whose VCRC failed before it was granted left the switch"
    tb.check_clean()

    # Counters.
    mutated = tb.channels[0].mutated
    assert len(mutated) == len(plan), f"{len(plan)} mutations planned, {len(mutated)} made"
    counters = await tb.all_counters()
    got = {(p, v, name): n for (p, v), c in counters.items() for name, n in c.items()
           if name.startswith("drop_") and n}
    assert got == want, f"drop counters over AXI {sorted(got.items())} != expected {sorted(want.items())}"
    marked = [(q, pkt) for q in range(tb.ports) for pkt, bad, _ in tb.egress[q].data_packets if bad]
    originals = [original for _, original in mutated]
    intact = [(q, pkt[:24].hex(), len(pkt), packet_key(pkt)) for q, pkt in marked
              if not any(same_packet(pkt, original) for original in originals)]
    assert not intact, f"intact packets left marked end-bad: {intact}; planned {plan}"
    host_end_bad = sum(tb.signal(f"host{q}_drop_end_bad") for q in range(tb.ports))
    assert host_end_bad == len(marked), f"{len(marked)} marked packets left the switch, hosts dropped {host_end_bad}"
    forwarded_bad = sum(tb.signal(f"host{q}_forwarded_bad") for q in range(tb.ports))
    assert forwarded_bad == len(tb.bad_delivered)
    for q in range(tb.ports):
        other = {r: n for r, n in tb.host_drops(q).items() if n and r != "end_bad"}
        assert not other, f"host {q} dropped {other}"
    log(dut, f"bad input: switch drops {sorted(got.items())}; {len(marked)} left marked end-bad "
        f"(cut through already), dropped by the hosts")


# --- forwarding-table rewrite under traffic ---------------------------------------------------

@cocotb.test()
async def forwarding_table_rewrite(dut):
    """Three DLIDs move between two ports each, a dozen times, while every host sends to them
    and to each other: every packet arrives exactly once, at the old or the new port
    (FlowScoreboard alternatives), in order per flow; and every packet that entered the
    switch clearly before (after) a rewrite went to the old (new) port."""
    tb = SwitchTB(dut, seed=6)
    rng = random.Random(66)
    await tb.bring_up()
    moving = {0x40: ((2, 3), (0, 1)), 0x41: ((0, 1), (2, 3)), 0x42: ((1, 3), (0, 2))}
    where = {}
    for lid, (cands, _) in moving.items():
        await tb.set_route(lid, cands[0])
        where[lid] = cands[0]
    for k in range(120):
        for p in range(tb.ports):
            lids = [lid for lid, (_, senders) in moving.items() if p in senders]
            vl = rng.randrange(tb.num_vls)
            size = rng.randrange(0, 1025)
            if rng.random() < 0.6:
                lid = rng.choice(lids)
                tb.send(p, tb.make_packet(p, lid, payload_len=size, vl=vl, sl=vl),
                        ports=moving[lid][0])
            else:
                q = rng.choice([o for o in range(tb.ports) if o != p])
                tb.send(p, tb.make_packet(p, host_lid(q), payload_len=size, vl=vl, sl=vl))
    for _ in range(12):
        await tb.run(cycles=rng.randrange(60, 200))
        lid = rng.choice(list(moving))
        cands = moving[lid][0]
        where[lid] = cands[1] if where[lid] == cands[0] else cands[0]
        await tb.set_route(lid, where[lid])
    await tb.drain(limit=400000)
    tb.check_clean()

    # Timing: which port each moving-DLID packet should have taken, from its ingress cycle.
    ingress = {packet_key(pkt): cycle for p in range(tb.ports)
               for pkt, _, cycle in tb.ingress[p].data_packets}
    egress = {packet_key(pkt): q for q in range(tb.ports) for pkt, _, _ in tb.egress[q].data_packets}
    margin, checked, ambiguous, used = 8, 0, 0, {lid: set() for lid in moving}
    for p in range(tb.ports):
        for v in range(tb.num_vls):
            for pkt in tb.sent[p, v]:
                lid = int.from_bytes(pkt[2:4], "big")
                if lid not in moving:
                    continue
                t = ingress[packet_key(pkt)]
                history = [(c, port) for c, l, port, _ in tb.ft_writes if l == lid]
                if any(abs(c - t) <= margin for c, _ in history):
                    ambiguous += 1
                    continue
                port = [port for c, port in history if c < t][-1]
                assert egress[packet_key(pkt)] == port, (
                    f"DLID {lid:#x} from host {p} entered at cycle {t}: went to port "
                    f"{egress[packet_key(pkt)]}, the table said {port} (writes {history})")
                used[lid].add(port)
                checked += 1
    assert all(len(ports) == 2 for ports in used.values()), f"a DLID never moved: {used}"
    log(dut, f"forwarding-table rewrite: {len(tb.ft_writes)} writes, {checked} moving-DLID packets "
        f"on the port in force, {ambiguous} within {margin} cycles of a rewrite (either port)")


# --- link failure --------------------------------------------------------------------------

@cocotb.test()
async def cable_cut_mid_packet(dut):
    """Host 0's cable into the switch is cut while a long packet of its leaves through output
    1 cut-through. Switch port 0 closes the packet after ``stall_timeout`` cycles without a
    beat (docs/link.md): it leaves end-bad, counted as truncated at port 0, host 1 drops it,
    and output 1 is free again while the cable is still cut, so host 2's packets waiting
    behind it are delivered. Port 0 then takes its link for failed; host 1's link stays up
    (its silence counts outside packets only). While port 0 is down, packets queued for it
    are discarded and counted, and their input's other flows keep moving. The cable back, the link re-initialises by
    itself and host 0's later packets arrive; credits come home."""
    tb = SwitchTB(dut, seed=7)
    assert 0 in tb.tb_ports, "this test needs host 0's wire carried by the testbench"
    await tb.bring_up()
    channel = tb.channels[0]
    stall_timeout, fail_timeout = 4 * tb.fc_period, 8 * tb.fc_period
    long = tb.make_packet(0, host_lid(1), payload_len=4096, vl=0, sl=0)
    tb.send(0, long, expect=False)
    await tb.run(until=lambda: len(channel.passing) >= 8 and not channel.passing[-1]["end"],
                 limit=2000)
    channel.cut = True
    cut_at = tb.loop.cycle
    host1_drops = tb.host_drops(1)
    delivered = tb.scoreboard.delivered
    for _ in range(4):
        tb.send(2, tb.make_packet(2, host_lid(1), payload_len=256, vl=0, sl=0))
    await tb.run(until=lambda: tb.scoreboard.delivered == delivered + 4,
                 limit=stall_timeout + 4000, what="host 2's packets behind the cut one")
    waited = tb.loop.cycle - cut_at
    log(dut, f"cable cut mid-packet: output 1 free and host 2's packets delivered {waited} "
        f"cycles after the cut (stall_timeout {stall_timeout})")
    assert waited > stall_timeout, "delivered past a packet still open"
    # What left of it: the beats that came before the cut (the VL nibble rewritten), then
    # the VCRC.
    on_wire = [(len(packet) - 2, bad) for packet, bad, _ in tb.egress[1].data_packets
               if len(packet) > 24 and packet[1:-2] == long[1:len(packet) - 2]]
    assert len(on_wire) == 1 and on_wire[0][1] and on_wire[0][0] < len(long), \
        f"the cut packet left as {on_wire} (bytes, end-bad): a part marked end-bad wanted"
    # Host 1 drops it as end-bad, or, when its own stall timeout closed the packet first
    # (the two timers run a hop apart), as truncated and the late end beat as malformed.
    dropped = {k: n - host1_drops[k] for k, n in tb.host_drops(1).items() if n != host1_drops[k]}
    assert dropped in ({"end_bad": 1}, {"truncated": 1, "malformed": 1}), \
        f"host 1 dropped {dropped}, not the cut packet"
    assert (await tb.counters(0, 0))["drop_truncated"] == 1
    assert channel.cut_midway == 1 and [kind for kind, _ in channel.mutated] == [WireChannel.CUT]
    await tb.run(until=lambda: tb.signal("switch_link_state__0") != LinkState.ACTIVE.value,
                 limit=fail_timeout + 100, what="port 0 taking its link for failed")
    log(dut, f"port 0 left ACTIVE {tb.loop.cycle - cut_at} cycles after the cut")
    assert all(tb.signal(f"host{p}_link_inits") == 0 for p in range(1, tb.ports)), \
        "a link whose peer only paused inside a packet was taken for failed"
    # While port 0 is down, what is queued for it is discarded and counted, and the input
    # that queued it keeps serving its other outputs.
    discarded = [(await tb.counters(0, v))["drop_hoq_lifetime"] for v in range(tb.num_vls)]
    delivered = tb.scoreboard.delivered
    for k in range(6):
        vl = k % tb.num_vls
        tb.send(2, tb.make_packet(2, host_lid(0), payload_len=512, vl=vl, sl=vl), expect=False)
        tb.send(2, tb.make_packet(2, host_lid(3), payload_len=512, vl=vl, sl=vl))
    await tb.run(until=lambda: tb.all_sent() and tb.scoreboard.delivered == delivered + 6,
                 limit=20000, what="host 2's packets past the dead output")
    await tb.run(cycles=64)
    now = [(await tb.counters(0, v))["drop_hoq_lifetime"] for v in range(tb.num_vls)]
    assert [n - d for n, d in zip(now, discarded)] == [3, 3], (discarded, now)
    assert tb.signal("switch_link_state__0") != LinkState.ACTIVE.value, "port 0 came back early"
    assert not tb.egress[0].data_packets or all(
        start < cut_at for _, _, start in tb.egress[0].data_packets), "a packet left on port 0"

    channel.cut = False
    restored_at = tb.loop.cycle
    await tb.run(until=tb.all_active, limit=20 * tb.fc_period, what="the link back")
    log(dut, f"cable back: every link ACTIVE {tb.loop.cycle - restored_at} cycles later")
    assert tb.signal("host0_link_inits") == 1, "host 0 heard the switch port's INIT once"
    since = tb.loop.cycle
    rng = random.Random(77)
    for _ in range(40):
        p = rng.randrange(tb.ports)
        q = rng.choice([o for o in range(tb.ports) if o != p])
        vl = rng.randrange(tb.num_vls)
        tb.send(p, tb.make_packet(p, host_lid(q), payload_len=rng.randrange(0, 2049), vl=vl,
                                  sl=vl))
    await tb.drain()
    tb.raise_errors()
    tb.scoreboard.check_all_delivered()
    tb.check_overflow()
    assert tb.all_active()
    tb.check_credits(since={0: since})


# --- launchers -------------------------------------------------------------------------------

BUILDS = {
    "voq": dict(ports=4, num_vls=2, width=64, mtu=4096, buffer_blocks=None, lids=1024, mode="voq",
                islip_iterations=1, fc_period=1024, fc_min_interval=64, fc_batch_blocks=64,
                wire_delay=2, tb_ports=[0]),
    # The classic case, one FIFO per input (one VL); 3 ports, 16-byte beats and a 2048-byte
    # MTU keep the build short, and cover the narrow datapath and a single VL.
    "fifo": dict(ports=3, num_vls=1, width=16, mtu=2048, buffer_blocks=None, lids=1024, mode="fifo",
                 islip_iterations=1, fc_period=1024, fc_min_interval=64, fc_batch_blocks=64,
                 wire_delay=2, tb_ports=[0]),
}
# The single-cycle iSLIP allocator, an ablation (docs/switch.md): the fifo build as it is, the
# voq build with 16-byte beats (its C++ compiles in a fraction of the time; the allocator's
# cycles do not depend on the beat width; the MTU and so the buffers stay as the tests need).
BUILDS["voq_islip"] = dict(BUILDS["voq"], width=16, allocator="islip")
BUILDS["fifo_islip"] = dict(BUILDS["fifo"], allocator="islip")
# make test runs the VOQ switch's checks on 16-byte beats too: the 64-byte build's C++ takes
# most of make test's switch time, and its datapath is in make test through the fabric
# (tb/test_fabric_moe.py). Every check runs on the 64-byte build in make test-full.
BUILDS["voq_w16"] = dict(BUILDS["voq"], width=16)

TESTS = [
    ("voq", "zero_load_latency"),
    ("voq", "uniform_random_traffic"),
    ("voq", "incast"),
    ("voq", "head_of_line"),
    ("voq", "bad_input"),
    ("voq", "forwarding_table_rewrite"),
    ("voq", "hoq_lifetime"),
    ("voq", "cable_cut_mid_packet"),
    ("voq", "short_packets"),
    ("fifo", "head_of_line"),
    ("fifo", "uniform_random_traffic"),
]
# Every rule holds for both allocators. The iSLIP builds, an ablation, run under make
# test-full only: make test checks iSLIP alone against the model (tb/test_islip.py).


def switch_test(build, testcase, full):
    """One test on one build; a build's tests run on one worker (tb/build_groups.py)."""
    return pytest.param(build, testcase, id=f"{build}-{testcase}",
                        marks=[pytest.mark.full] if full else [])


# voq_w16 first: the most tests on one build, so it starts first (tb/conftest.py). The
# voq and fifo builds run under make test-full (the fifo build cost 82 s of make test on
# 2026-12-06; FIFO mode stays in make test through tb/test_voq_buffer.py's fifo runs, the
# switch model's head-of-line tests and the one-VL FIFO switch's lint).
# short_packets (the pipelined allocator's short-packet rule, docs/switch.md) runs under make
# test-full only (33 s of simulation on 2026-12-07); make test checks the rule on the allocator
# alone against the model (tb/test_switch_allocator.py).
TESTS = [switch_test("voq_w16", testcase, testcase == "short_packets")
         for build, testcase in TESTS if build == "voq"] + [
    switch_test(f"{build}_islip", testcase, True) for build, testcase in TESTS] + [
    switch_test(build, testcase, True) for build, testcase in TESTS]


def factory(**params):
    from tb.switch_top import SwitchTop
    return SwitchTop(**params)


@pytest.mark.parametrize("build,testcase", TESTS)
def test_switch(build, testcase):
    runner.run(module="tb.test_switch", toplevel="switch_top", factory=factory,
               params=BUILDS[build], testcase=testcase, expect_tests=1)
