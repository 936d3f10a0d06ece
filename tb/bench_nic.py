"""NIC benchmarks (cocotb, tb/nic_tb.py): doorbell-to-wire latency, message rate, write
bandwidth. Run by ``make bench`` / ``python -m tb.bench --only nic`` through tb/bench.py;
records go to the file named by ``BENCH_RECORDS``. All figures are simulated cycles at
64-byte beats, 400 MHz (docs/performance.md, NIC).

* ``nic.doorbell_to_wire_cycles``: the doorbell's AXI4-Lite write accepted (later of AW and
  W) to the first beat of its packet at the NIC's wire pins, one 8-byte inline RDMA WRITE at
  a time on an idle NIC, counting NIC cycles only: the wait from the WQE fetch's AR to its
  first R beat (the memory latency) is taken out and reported beside it.
* ``nic.msg_rate_wqe_per_cycle``: 8-byte inline RDMA WRITEs posted to every QP by one warp
  per QP, 256 per QP (four times the QP's window), doorbell every 32 WQEs (NVSHMEM's
  batching), one ACK per message: request packets on the wire per cycle, from the first to
  the last. ``.coalesced_acks``: the responder acknowledges every 16 packets. Beside each:
  ``.sustained``, the middle half of the packets (the n/4-th to the 3n/4-th) over the
  cycles between them; ``.to_last_cqe``, the WQEs over the cycles from the first packet to
  the last CQE written; and ``nic.cqe_drain_cycles`` (``.coalesced_acks``), the cycles from
  the last response's first beat at the NIC's wire pins to the last CQE written.
* ``nic.write_bandwidth.64KiB``: 64 KiB RDMA WRITEs (payload read by DMA) from several QPs at
  path MTU 4096: payload bytes on the wire / (cycles x 64 B), first beat to last.
"""
import random
import statistics

import cocotb

from models import mlx5
from tb import runner
from tb.beats import WireMonitor
from tb.nic_tb import CLOCK_NS, DATA_REGION, MEMORY_BYTES, NicTB
from tb.runner import bench_record as record

Op = mlx5.Opcode


def config(tb, **extra):
    params = runner.tb_params()
    return {"width": 64, "clock_mhz": round(1000 / CLOCK_NS), "num_qps": params["num_qps"],
            "num_vls": params["num_vls"], "wire_delay_cycles": params["wire_delay"],
            "memory_latency_cycles": tb.memory_latency, **extra}


@cocotb.test()
async def doorbell_to_wire(dut):
    tb = NicTB(dut, memory_latency=200)
    await tb.reset()
    await tb.setup(qps=4, mtu=5)
    rng = random.Random(5)
    trials = [await tb.timed_inline_write(trial % 4, rng) for trial in range(16)]
    await tb.check_clean()
    nic = [t["nic"] for t in trials]

    def median(key):
        return statistics.median(t[key] for t in trials)
    record("nic.doorbell_to_wire_cycles", median("nic"), "cycles",
           config(tb, operation="RDMA_WRITE inline 8 B", trials=len(nic), min=min(nic),
                  max=max(nic), doorbell_to_ar=median("to_ar"),
                  memory_wait_cycles=median("memory"), total_cycles=median("total"),
                  total_ns=median("total") * CLOCK_NS))


async def message_rate(dut, coalesce_acks):
    qps_count = runner.tb_params()["num_qps"]
    tb = NicTB(dut, memory_latency=200, ack_every=16, coalesce_acks=coalesce_acks)
    await tb.reset()
    qps = await tb.setup(qps=qps_count, cqs=min(qps_count, 16), log_sq_size=8, mtu=5,
                         ring_every=32)
    rng = random.Random(9)
    # Four times each QP's window (63 blocks), so the rate is the sustained one: completions
    # must keep up for the windows to reopen.
    per_qp = 256
    work = []
    for q in qps:
        items = []
        for n in range(per_qp):
            fields = dict(opcode=Op.RDMA_WRITE, inline=rng.randbytes(8),
                          raddr=rng.randrange(0, MEMORY_BYTES - 64), rkey=1,
                          fm_ce_se=mlx5.CTRL_CQ_UPDATE if n % 16 == 15 else 0)
            items.append((q, 1, tb.builder(q, **fields), n))
        work.append(items)
    # The responses (every data packet the NIC receives here) as they reach its pins.
    responses = tb.loop.add(WireMonitor(dut, "nic_wire_in_monitor", 64))
    first = len(tb.wire.data_packets)
    for task in tb.gpu.start_warps(work):
        await task
    await tb.gpu.flush()
    await tb.drain(limit=400_000)
    await tb.check_clean()
    packets = tb.wire.data_packets[first:]
    starts = [start for _, _, start in packets]
    span = starts[-1] - starts[0] + 1
    rate = len(packets) / span
    n = len(packets)
    middle = starts[3 * n // 4] - starts[n // 4]
    last_cqe = tb.cqe_cycles[-1]
    last_response = responses.data_packets[-1][2]
    suffix = ".coalesced_acks" if coalesce_acks else ""
    name = "nic.msg_rate_wqe_per_cycle" + suffix
    counters = await tb.counters()
    common = dict(operation="RDMA_WRITE inline 8 B", wqes=n, ring_every=32, signaled_every=16,
                  acks="one ACK per 16 packets" if coalesce_acks else "one ACK per message",
                  answers_dropped=counters["rx_dropped_unexpected"],
                  packets_resent=counters["packets_resent"])
    record(name, round(rate, 3), "WQE per cycle",
           config(tb, **common, span_cycles=span,
                  messages_per_second=round(rate * 1000 / CLOCK_NS * 1e6)))
    record(name + ".sustained", round((3 * n // 4 - n // 4) / middle, 3), "WQE per cycle",
           config(tb, **common, packets=f"{n // 4} to {3 * n // 4}", span_cycles=middle))
    record(name + ".to_last_cqe", round(n / (last_cqe - starts[0] + 1), 3), "WQE per cycle",
           config(tb, **common, span_cycles=last_cqe - starts[0] + 1))
    record("nic.cqe_drain_cycles" + suffix, last_cqe - last_response, "cycles",
           config(tb, **common, last_response_cycle=last_response, last_cqe_cycle=last_cqe,
                  last_request_cycle=starts[-1]))


@cocotb.test()
async def message_rate_acked(dut):
    """Every message acknowledged (each has AckReq on its only packet)."""
    await message_rate(dut, coalesce_acks=False)


@cocotb.test()
async def message_rate_coalesced(dut):
    """The responder acknowledges every 16 packets, as IB responders may coalesce."""
    await message_rate(dut, coalesce_acks=True)


@cocotb.test()
async def write_bandwidth(dut):
    tb = NicTB(dut, memory_latency=200, ack_every=8)
    await tb.reset()
    qps = await tb.setup(qps=4, mtu=5)
    rng = random.Random(3)
    tb.memory.write(DATA_REGION, rng.randbytes(1 << 20))
    size = 64 * 1024
    work = []
    for q in qps:
        items = []
        for n in range(4):
            fields = dict(opcode=Op.RDMA_WRITE, byte_count=size, lkey=tb.data_key,
                          laddr=DATA_REGION + (q * 4 + n) * size, raddr=rng.randrange(0, MEMORY_BYTES // size) * size,
                          rkey=1, fm_ce_se=mlx5.CTRL_CQ_UPDATE)
            items.append((q, 1, tb.builder(q, **fields), n))
        work.append(items)
    first = len(tb.wire.data_packets)
    beats_before = tb.wire.busy_cycles
    for task in tb.gpu.start_warps(work):
        await task
    await tb.gpu.flush()
    await tb.drain(limit=400_000)
    await tb.check_clean()
    packets = tb.wire.data_packets[first:]
    start = packets[0][2]
    end = packets[-1][2] + (len(packets[-1][0]) + 63) // 64
    payload = size * 4 * len(qps)
    value = payload / ((end - start) * 64)
    r_beats = sum(1 for c in tb.bus.r[1] if start <= c < end)
    record("nic.write_bandwidth.64KiB", round(value, 4), "fraction of wire",
           config(tb, operation="RDMA_WRITE 64 KiB by DMA", messages=4 * len(qps), mtu=4096,
                  packets=len(packets), span_cycles=end - start,
                  wire_busy=round((tb.wire.busy_cycles - beats_before) / (end - start), 4),
                  payload_read_beats_per_cycle=round(r_beats / (end - start), 4)))
