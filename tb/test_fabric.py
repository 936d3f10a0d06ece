"""A leaf/spine fabric of real NICs and switches under Verilator (tb/fabric_top.py,
tb/fabric_tb.py, docs/fabric.md): links up and forwarding tables programmed by the
testbench as a subnet manager, 8-byte inline RDMA WRITEs from every NIC to a NIC on
another leaf and to its leaf neighbour, and the zero-load latency of 1-hop and 3-hop
paths, split into NIC, memory, wire and per-switch cycles.
"""
import json
import os

import cocotb
import pytest

from hdl.switch.switch import DEFAULT_ALLOCATOR, HOP_LATENCY_CYCLES
from tb.fabric_tb import CLOCK_NS, FabricTB

SWITCH_HOP_BUDGET = 8           # cycles, docs/switch.md


def far_nic(fabric, n):
    """A NIC on another leaf: same position, half the leaves on (at least the next leaf)."""
    return (n + fabric.nics_per_leaf * max(1, fabric.leaves // 2)) % fabric.nics


@cocotb.test()
async def links_up_and_tables_programmed(dut):
    """After start-up every link end is ACTIVE and every switch holds the table the model
    computes (read back through ft_read_lid/ft_read_data) and the SL-to-VL map."""
    tb = FabricTB(dut)
    await tb.reset()
    states = tb.link_states()
    assert len(states) == 2 * len(tb.fabric.links)
    tables = tb.fabric.forwarding_tables()
    for switch in tb.switches:
        assert await tb.read_table(switch) == tables[switch], switch
        for sl, vl in enumerate(tb.sl_to_vl):
            assert await tb.switch_read(switch, f"sl_to_vl_{sl}") == vl
    dut._log.info(f"{len(states)} link ends ACTIVE at cycle {tb.loop.cycle}; "
                  f"{len(tables)} forwarding tables of {tb.fabric.lids} entries programmed")


@cocotb.test()
async def inline_writes_land(dut):
    """Every NIC writes 8 bytes inline to a NIC on another leaf and 8 to its leaf neighbour,
    all at once: every byte lands where the models say, every completion comes, nothing is
    dropped, and each switch forwarded what the routes predict."""
    tb = FabricTB(dut, memory_latency=100)
    await tb.reset()
    await tb.setup()
    fabric = tb.fabric
    landed = []

    async def send(src, dst, offset):
        data = tb.rng.randbytes(8)
        qpn, fields, raddr = tb.inline_write(src, dst, data, offset)
        await tb.post(src, qpn, fields)
        landed.append((dst, raddr, data))

    jobs = []
    for n in range(fabric.nics):
        jobs.append(send(n, far_nic(fabric, n), 0))
        if fabric.neighbour(n) != n:
            jobs.append(send(n, fabric.neighbour(n), 64))
    await tb.all_of(*jobs)
    await tb.drain()
    await tb.check_clean()
    for dst, raddr, data in landed:
        assert tb.nics[dst].host.memory.read(raddr, 8) == data
    assert await tb.drops() == {}
    # packets out of each switch port: the WRITEs and their ACKs along the routes
    expected = {}
    for src in range(fabric.nics):
        for dst in {far_nic(fabric, src), fabric.neighbour(src)} - {src}:
            for a, b in ((src, dst), (dst, src)):           # WRITE, then its ACK
                for hop in fabric.route(a, b):
                    key = (hop.switch, hop.out_port)
                    expected[key] = expected.get(key, 0) + 1
    for (switch, port), count in sorted(expected.items()):
        sent = sum([await tb.switch_counter(switch, port, vl, "packets_out")
                    for vl in range(tb.num_vls)])
        assert sent == count, f"{switch} port {port}: {sent} packets out, routes say {count}"
    dut._log.info(f"{len(landed)} WRITEs landed, {sum(expected.values())} packets forwarded "
                  f"as routed, no drops")


@cocotb.test()
async def zero_load_latency(dut):
    """Doorbell at NIC 0 to the last byte in the remote memory for an 8-byte inline WRITE
    to its leaf neighbour (1 switch) and to a NIC on another leaf (3 switches), and each
    switch's hop (start beat in to start beat out). Prints the split."""
    tb = FabricTB(dut, memory_latency=200)
    await tb.reset()
    await tb.setup()
    fabric = tb.fabric
    src = 0
    results = {1: await tb.measure_latency(src, fabric.neighbour(src), trials=3),
               3: await tb.measure_latency(src, fabric.nics - 1, trials=3)}
    await tb.check_clean()
    lines = [f"zero-load latency, 8-byte inline RDMA WRITE, memory latency "
             f"{tb.memory_latency} cycles, {CLOCK_NS} ns/cycle, fabric {fabric!r}",
             f"{'path':>6} {'total':>6} {'ns':>7} {'nicA':>5} {'mem':>5} {'nicA>w':>6} "
             f"{'wire':>5} {'sw':>4} {'nicB':>5}  hops (cycles, switch in -> out)"]
    for hops, r in results.items():
        lines.append(f"{hops}-hop  {r['total']:>6} {r['total'] * CLOCK_NS:>7.1f} "
                     f"{r['nic_a_to_fetch']:>5} {r['memory']:>5} {r['nic_a_to_wire']:>6} "
                     f"{r['wire']:>5} {r['switches']:>4} {r['nic_b']:>5}  "
                     + ", ".join(f"{name}: {c}" for name, c in zip(r["route"], r["hops"])))
    dut._log.info("\n" + "\n".join(lines))
    print("\n".join(lines), flush=True)
    with open("fabric_latency.json", "w") as out:
        json.dump({"clock_ns": CLOCK_NS, "memory_latency": tb.memory_latency,
                   "fabric": repr(fabric), "paths": results}, out, indent=1)
    every_hop = [c for r in results.values() for c in r["hops"]]
    assert len(results[1]["hops"]) == 1 and len(results[3]["hops"]) == 3
    assert max(every_hop) <= SWITCH_HOP_BUDGET, every_hop
    # Every switch of the fabric has the default allocator and so its hop (docs/switch.md).
    assert set(every_hop) == {HOP_LATENCY_CYCLES[DEFAULT_ALLOCATOR]}, every_hop
    # The NIC parts are the same on both paths: the difference is two switches and two cables.
    one, three = results[1], results[3]
    assert three["total"] - one["total"] == (three["switches"] - one["switches"]) + \
        (three["wire"] - one["wire"]), (one, three)
    if os.environ.get("BENCH_RECORDS"):
        from tb.runner import bench_record
        for hops, r in results.items():
            bench_record(f"fabric.hop{hops}_latency_ns", r["total"] * CLOCK_NS, "ns",
                         {"fabric": repr(fabric), "memory_latency": tb.memory_latency,
                          "clock_ns": CLOCK_NS, "operation": "RDMA_WRITE inline 8 B",
                          **{k: v for k, v in r.items()}})


# --- pytest launchers ------------------------------------------------------------------------
# Both are marked full: a first build (emit the NIC and switch modules, verilate and compile
# them as hierarchical blocks) takes 6 to 7 minutes on 2 cores, a re-run 38 s
# (docs/fabric.md, Build).

SMALL = dict(nics_per_leaf=2, leaves=2, spines=1)      # 4 NICs, 2 leaves of 3 ports, 1 spine


def run(params):
    from tb.fabric_top import run_fabric
    run_fabric(module="tb.test_fabric", params=params)


@pytest.mark.full
def test_fabric():
    run({})         # tb/fabric_top.py FABRIC_DEFAULTS: 8 NICs, 4 leaves, 2 spines of 4 ports


@pytest.mark.full
def test_fabric_small():
    run(SMALL)
