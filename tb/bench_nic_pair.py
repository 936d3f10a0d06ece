"""Benchmarks between two NICs back to back (cocotb, tb/nic_pair_tb.py). Run by ``make
bench`` / ``python -m tb.bench --only nic`` through tb/bench.py; records go to the file
named by ``BENCH_RECORDS``. Simulated cycles at 64-byte beats, 400 MHz
(docs/performance.md, NIC).

* ``nic.e2e_write_latency_ns`` (NIC - switch - NIC) and ``.back_to_back``: the doorbell's
  AXI4-Lite write at NIC A (the later of AW and W) to the write that lands the last payload
  byte in NIC B's memory, for one 8-byte inline RDMA WRITE at a time, with the split: NIC A
  before and after its WQE fetch, the memory latency of that fetch, cables, the switch,
  NIC B.
* ``nic.write_bandwidth.64KiB.nic_to_nic``: 64 KiB RDMA WRITEs from A into B's memory
  (B's responder writes them by DMA): payload bytes on A's wire / (cycles x 64 B).
* ``nic.read_bandwidth.64KiB``: 64 KiB RDMA READs by A from B's memory: READ response
  payload bytes on B's wire / (cycles x 64 B).
* ``nic.goodput_under_loss.1e-3``: 64 KiB RDMA WRITEs from A to B, first without loss,
  then with 1 in 1000 data packets corrupted on both cables (B's link drops them, go-back-N
  sends them again): message bytes completed per cycle (first request packet on A's wire
  to the last CQE) under loss, as a fraction of the loss-free figure measured the same
  way on the same QPs; with the faults injected and the retransmissions counted. With
  ``RC_TRACE`` set to a path, the lossy phase's recovery trace (:mod:`tb.rc_trace`: every
  fault, NAK and resend with its cause) is written there, from the wire monitors (the
  run stays cycle-identical); with ``RC_TRACE_COUNTERS`` set as well, merged with the
  changes of A's ``TRACED_COUNTERS``, read every 256 cycles (the reads share the register
  port with the doorbells, so the run's cycles change).
"""
import os
import random
import statistics
from pathlib import Path

import cocotb

from hdl.nic.completion_unit import TIMER_TICK_CYCLES
from models import mlx5
from tb import rc_trace, runner
from tb.bench_nic import config
from tb.nic_pair_tb import CLOCK_NS, SOURCE_REGION, NicPairTB
from tb.runner import bench_record as record

Op = mlx5.Opcode


@cocotb.test()
async def e2e_write_latency(dut):
    tb = NicPairTB(dut, memory_latency=200)
    await tb.reset()
    await tb.setup(qps=2, mtu=5)
    a, b = tb.a, tb.b
    wire = runner.tb_params()["wire_delay"]
    cables = 2 if tb.switch is not None else 1
    rng = random.Random(4)
    trials = []
    for trial in range(12):
        q = trial % 2
        target, _ = b.target(q)
        raddr = target + 64 * trial
        fields = dict(opcode=Op.RDMA_WRITE, inline=rng.randbytes(8), raddr=raddr,
                      rkey=b.data_key, fm_ce_se=mlx5.CTRL_CQ_UPDATE)
        marks = (len(a.bus.doorbells), len(a.bus.ar[0]), len(a.bus.r[0]),
                 len(a.wire.data_packets), len(b.wire_in.data_packets), len(b.writes))
        await a.gpu.post(q, 1, a.builder(q, **fields), last=True)
        await tb.drain()
        t_db, t_ar, t_r = a.bus.doorbells[marks[0]], a.bus.ar[0][marks[1]], a.bus.r[0][marks[2]]
        t_out = a.wire.data_packets[marks[3]][2]
        t_in = b.wire_in.data_packets[marks[4]][2]
        t_landed = next(c for c, address, n in b.writes[marks[5]:]
                        if address <= raddr + 7 < address + n)
        trials.append({"total": t_landed - t_db, "nic_a_to_fetch": t_ar - t_db,
                       "memory": t_r - t_ar, "nic_a_to_wire": t_out - t_r,
                       "switch": t_in - t_out - cables * wire, "nic_b": t_landed - t_in})
    await tb.check_clean()

    def median(key):
        return statistics.median(t[key] for t in trials)
    total = median("total")
    name = "nic.e2e_write_latency_ns" + ("" if tb.switch is not None else ".back_to_back")
    record(name, total * CLOCK_NS, "ns",
           config(tb, operation="RDMA_WRITE inline 8 B", trials=len(trials),
                  topology="NIC - switch - NIC" if tb.switch is not None else
                  "two NICs back to back",
                  total_cycles=total, nic_a_doorbell_to_fetch_cycles=median("nic_a_to_fetch"),
                  memory_wait_cycles=median("memory"),
                  nic_a_wqe_to_wire_cycles=median("nic_a_to_wire"),
                  wire_cycles=cables * wire, switch_cycles=median("switch"),
                  nic_b_wire_to_memory_cycles=median("nic_b"),
                  nic_cycles=median("nic_a_to_fetch") + median("nic_a_to_wire") + median("nic_b"),
                  note="B's memory write counts when the testbench memory takes its W beat"))


def bulk_work(tb, kind, size, qps, per_qp):
    """A's GPU work (a warp per QP, for ``GpuModel.start_warps``): ``per_qp`` signaled
    ``kind`` ("write" or "read") messages of ``size`` bytes on each of ``qps`` QPs. Message
    ``n`` of QP ``q`` uses A's source region at ``(q * per_qp + n) * size``: a WRITE from
    there into the ``n``-th ``size`` of B's target slice for ``q``, a READ into there from
    the same place in B's source region."""
    a, b = tb.a, tb.b
    work = []
    for q in range(qps):
        target, _ = b.target(q)
        items = []
        for n in range(per_qp):
            local = SOURCE_REGION + (q * per_qp + n) * size
            if kind == "write":
                fields = dict(opcode=Op.RDMA_WRITE, raddr=target + n * size)
            else:
                fields = dict(opcode=Op.RDMA_READ, raddr=local)
            items.append((q, 1, a.builder(q, **fields, byte_count=size, lkey=a.data_key,
                                          laddr=local, rkey=b.data_key,
                                          fm_ce_se=mlx5.CTRL_CQ_UPDATE), n))
        work.append(items)
    return work


async def bulk(tb, kind, size=64 * 1024, qps=4, per_qp=4):
    """``per_qp`` messages of ``size`` bytes on each of ``qps`` QPs from A to B; returns the
    payload fraction of the wire that carried the payload (A's for WRITE, B's for READ)."""
    await tb.reset()
    await tb.setup(qps=qps, mtu=5)
    a, b = tb.a, tb.b
    work = bulk_work(tb, kind, size, qps, per_qp)
    wire = a.wire if kind == "write" else b.wire
    first = len(wire.data_packets)
    for task in a.gpu.start_warps(work):
        await task
    await a.gpu.flush()
    await tb.drain(limit=1_000_000)
    await tb.check_clean()
    opcodes = range(0x06, 0x0C) if kind == "write" else range(0x0D, 0x11)
    packets = [p for p in wire.data_packets[first:] if p[0][8] in opcodes]
    start = packets[0][2]
    end = packets[-1][2] + (len(packets[-1][0]) + 63) // 64
    payload = size * qps * per_qp
    return payload / ((end - start) * 64), len(packets), end - start


async def record_bandwidth(dut, kind, name, operation):
    """Record :func:`bulk`'s figure for ``kind`` as ``name``."""
    tb = NicPairTB(dut, memory_latency=200)
    value, packets, span = await bulk(tb, kind)
    record(name, round(value, 4), "fraction of wire",
           config(tb, operation=operation, messages=16, mtu=4096,
                  topology="two NICs back to back", packets=packets, span_cycles=span))


@cocotb.test()
async def write_bandwidth(dut):
    await record_bandwidth(dut, "write", "nic.write_bandwidth.64KiB.nic_to_nic",
                           "RDMA_WRITE 64 KiB, DMA at both ends")


@cocotb.test()
async def read_bandwidth(dut):
    await record_bandwidth(dut, "read", "nic.read_bandwidth.64KiB", "RDMA_READ 64 KiB")


async def goodput_phase(tb, rounds=4, qps=4, per_qp=4, size=64 * 1024):
    """``rounds`` x ``per_qp`` signaled 64 KiB WRITEs on each QP from A to B, on QPs set up
    already; returns (message bytes per cycle, cycles) from A's first request packet of the
    phase to its last CQE."""
    a = tb.a
    first_packet = len(a.wire.data_packets)
    total = 0
    for _ in range(rounds):
        work = bulk_work(tb, "write", size, qps, per_qp)
        for task in a.gpu.start_warps(work):
            await task
        total += size * qps * per_qp
    await a.gpu.flush()
    await tb.drain(limit=3_000_000)
    start = a.wire.data_packets[first_packet][2]
    end = max(cycle for cycle, address, _ in a.writes if address < 0x100000)   # CQ region
    return total / (end - start), end - start


ROUNDS = 16


# A's counters the trace follows over time: NAKs taken and dropped, rewinds by cause, what
# they cost.
TRACED_COUNTERS = ("naks_received", "rx_dropped_unexpected", "retransmits_nak",
                   "retransmits_timeout", "wqes_squashed", "packets_resent")
ACK_TIMEOUT = 4                 # 2**4 ticks of 1,638 cycles: 65.5 us


def write_trace(tb, marks, counter_log, path):
    """Write the lossy phase's recovery trace (:meth:`NicPairTB.recovery_trace`, the packets
    sent since ``marks``, merged with the changes of A's ``TRACED_COUNTERS`` but
    ``packets_resent`` in ``counter_log``) to ``path`` as a Markdown table, cycles from the
    phase's first packet, with its counts; every packet's headers to ``path`` +
    ``.packets``."""
    start = tb.a.wire.data_packets[marks["a"]][2]
    sent = tb.sent_packets(marks, start)
    # A timeout fires 2**n ticks after a scan armed it, at a tick: at least 2**n - 1 ticks.
    events = tb.recovery_trace(sent, ((1 << ACK_TIMEOUT) - 1) * TIMER_TICK_CYCLES)
    counters = [(cycle - start, side, name, value) for cycle, side, name, value in counter_log
                if name != "packets_resent"]
    merged = sorted(events + rc_trace.counter_events(counters), key=lambda e: e.cycle)
    Path(path).write_text(f"{rc_trace.summary(events)}\n\n{rc_trace.table(merged)}\n")
    Path(path + ".packets").write_text(rc_trace.packet_log(sent))


@cocotb.test()
async def goodput_under_loss(dut):
    tb = NicPairTB(dut, memory_latency=200)
    # An injector takes its seed at its first packet after reset: give it now, loss off.
    seeds = {"a": 3, "b": 4}
    for side, seed in seeds.items():
        tb.set_faults(side, 0, seed=seed)
    await tb.reset()
    await tb.setup(qps=4, mtu=5, ack_timeout=ACK_TIMEOUT)
    # 16 MiB a phase: about 4,000 request packets and as many ACKs, so about 8 losses.
    clean, clean_cycles = await goodput_phase(tb, rounds=ROUNDS)
    await tb.check_clean()
    before = await tb.a.host.counters()
    faults_before = tb.faults("a") + tb.faults("b")
    for side, seed in seeds.items():
        tb.set_faults(side, 66, seed=seed)              # 66 / 65536 = 1.0e-3
    marks = tb.marks()
    trace_path = os.environ.get("RC_TRACE")
    counter_log = []
    watch = None
    if trace_path and os.environ.get("RC_TRACE_COUNTERS"):
        watch = cocotb.start_soon(tb.watch_counters("a", TRACED_COUNTERS, counter_log))
    lossy, lossy_cycles = await goodput_phase(tb, rounds=ROUNDS)
    await tb.check_clean()
    if watch is not None:
        watch.cancel()
    if trace_path:
        write_trace(tb, marks, counter_log, trace_path)
    after = await tb.a.host.counters()
    faults = tb.faults("a") + tb.faults("b") - faults_before
    assert faults > 0, "nothing was lost: the lossy phase would measure no loss"
    resent = {k: after[k] - before[k] for k in ("retransmits_nak", "retransmits_timeout",
                                                "retransmits_rnr", "packets_resent")}
    record("nic.goodput_under_loss.1e-3", round(lossy / clean, 4), "fraction of loss-free",
           config(tb, operation=f"RDMA_WRITE 64 KiB, {ROUNDS * 16} messages per phase", mtu=4096,
                  topology="two NICs back to back", loss="1/1000 data packets corrupted "
                  "on both cables", ack_timeout_us=65.5, loss_free_bytes_per_cycle=round(clean, 2),
                  lossy_bytes_per_cycle=round(lossy, 2), loss_free_cycles=clean_cycles,
                  lossy_cycles=lossy_cycles, faults_injected=faults, **resent))
