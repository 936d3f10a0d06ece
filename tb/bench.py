"""``make bench``: run the performance scenarios, write build/bench/results.json.

Each scenario is a cocotb module run under Verilator by :func:`tb.runner.run`;
its tests append ``{"name", "value", "unit", "config"}`` records that this
script gathers. Names are documented in docs/performance.md. The credit-loop
sweep also writes build/bench/link_buffer_sweep.{json,png}; the switch's load
sweep build/bench/switch_latency_vs_load.{json,png}.

``--only link`` / ``--only switch`` / ``--only nic`` / ``--only fabric`` / ``--only fpga``
(``make fpga``: synthesis, docs/fpga.md) runs one group
(``make bench BENCH_ARGS="--only switch"``); with ``--only``, the records of the other
groups already in the output file are kept.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from hdl.switch.switch import DEFAULT_ALLOCATOR
from tb import runner

OUT = runner.REPO / "build" / "bench"

LINK = dict(width=64, num_vls=2, mtu=4096, cut_through=True, fc_period=1024, fc_min_interval=64,
            fc_batch_blocks=64, channel="hdl")
SWEEP_DELAYS = [0, 16, 32, 64, 128, 256]
# 4 KiB packets take 65 blocks: 2, 3, 5, 9 and 13 packets' worth.
SWEEP_BUFFERS = [136, 200, 328, 584, 840]
FULL_RATE = 0.99    # of the best throughput measured anywhere in the sweep


def link_pair(**params):
    from tb.link_pair import LinkPair
    return LinkPair(**{k: v for k, v in params.items()
                       if k not in ("throughput_sizes", "sweep_delays", "clock_ns")})


def run_link(testcase, **params):
    params = {**LINK, **params}
    records = OUT / "records" / f"{testcase}_{runner.param_tag(params)}.json"
    records.parent.mkdir(parents=True, exist_ok=True)
    records.unlink(missing_ok=True)
    runner.run(module="tb.bench_link", toplevel="link_pair", factory=link_pair, params=params,
               testcase=testcase, expect_tests=1, extra_env={"BENCH_RECORDS": str(records)})
    return json.loads(records.read_text())


def link_benchmarks():
    records = []
    records += run_link("throughput", buffer_blocks=192, wire_delay=0,
                        throughput_sizes=[[64, 400], [256, 200], [1024, 80], [4096, 40]])
    # Both ways, B's flow-control packets wait behind B's own 4 KiB packets: the credit loop
    # grows by a packet time, so this runs on the sweep's 5-packet build (at wire delay 0).
    records += run_link("throughput_both_ways", buffer_blocks=328, wire_delay=max(SWEEP_DELAYS))
    records += run_link("latency", buffer_blocks=192, wire_delay=0)
    records += run_link("bringup", buffer_blocks=328, wire_delay=max(SWEEP_DELAYS))
    # Cables carried by the testbench, so that they can be cut.
    records += run_link("failure", buffer_blocks=192, wire_delay=8, channel="tb")
    sweep = []
    for blocks in SWEEP_BUFFERS:
        sweep += run_link("credit_loop", buffer_blocks=blocks, wire_delay=max(SWEEP_DELAYS),
                          sweep_delays=SWEEP_DELAYS)
    records += buffer_table(sweep)
    return records


def buffer_table(sweep):
    """Smallest buffer reaching full rate at each delay, from the sweep's measurements
    (None: no buffer tried was enough)."""
    by_delay = {}
    for record in sweep:
        config = record["config"]
        by_delay.setdefault(config["wire_delay_cycles"], {})[config["buffer_blocks"]] = record["value"]
    # Full rate: what the link reaches when the buffer is no limit (the best point measured).
    ceiling = max(value for points in by_delay.values() for value in points.values())
    table = []
    for delay, points in sorted(by_delay.items()):
        enough = [blocks for blocks, value in sorted(points.items()) if value >= FULL_RATE * ceiling]
        table.append({"wire_delay_cycles": delay, "min_buffer_blocks": enough[0] if enough else None,
                      "throughput_by_buffer": points})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "link_buffer_sweep.json").write_text(json.dumps(table, indent=1))
    plot_sweep(table)
    config = {**{k: LINK[k] for k in ("width", "num_vls", "mtu", "cut_through", "fc_period",
                                      "fc_min_interval", "fc_batch_blocks")},
              "clock_mhz": 400.0, "payload_bytes": 4096, "full_rate": FULL_RATE,
              "buffers_tried": SWEEP_BUFFERS}
    records = [{"name": f"link.min_buffer_blocks.delay{row['wire_delay_cycles']}",
                "value": row["min_buffer_blocks"], "unit": "blocks",
                "config": {**config, "wire_delay_cycles": row["wire_delay_cycles"]}} for row in table]
    return records + model_buffer_table(config)


def model_buffer_table(config):
    """The same question answered by models/link.py, at block resolution instead of a few builds."""
    from models.link import credit_loop_cycles, min_buffer_for_full_rate
    from models.packet import send_only_wire_bytes
    packet = send_only_wire_bytes(4096)
    model = {k: LINK[k] for k in ("num_vls", "fc_period", "fc_min_interval", "fc_batch_blocks",
                                  "cut_through")}
    records = []
    for delay in SWEEP_DELAYS:
        loop = credit_loop_cycles(delay, packet, LINK["width"], cut_through=LINK["cut_through"],
                                  fc_min_interval=LINK["fc_min_interval"],
                                  fc_batch_blocks=LINK["fc_batch_blocks"])
        blocks = min_buffer_for_full_rate(delay, packet, LINK["width"], threshold=FULL_RATE, **model)
        extra = {**config, "wire_delay_cycles": delay, "credit_loop_cycles": loop, "source": "models/link.py"}
        extra.pop("buffers_tried")
        records.append({"name": f"link.model.min_buffer_blocks.delay{delay}", "value": blocks,
                        "unit": "blocks", "config": extra})
    return records


def plot_sweep(table):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for blocks in SWEEP_BUFFERS:
        xs = [row["wire_delay_cycles"] for row in table]
        ys = [row["throughput_by_buffer"].get(blocks) for row in table]
        ax.plot(xs, ys, marker="o", label=f"{blocks} blocks ({blocks * 64 // 1024} KiB)")
    ax.set_xlabel("wire delay, one way (cycles at 400 MHz)")
    ax.set_ylabel("throughput (fraction of wire)")
    ax.set_title("4 KiB packets: receive buffer per VL vs. cable length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "link_buffer_sweep.png", dpi=110)


# --- switch (tb/bench_switch.py on tb/switch_bench_top.py) ----------------------------------

SWITCH = dict(ports=8, num_vls=2, width=64, mtu=4096, buffer_blocks=None, lids=1024, mode="voq",
              islip_iterations=1, allocator=DEFAULT_ALLOCATOR, fc_period=1024, fc_min_interval=64,
              fc_batch_blocks=64,
              addr_width=16, wire_delay=0, host_buffer_blocks=None, hist_bins=16384, psn_slots=256)
SWITCH_PAYLOAD = 2020               # 2046 bytes on the wire: 32 beats of 64 B, 32 credit blocks
SWITCH_LARGE_BUFFER = 2047          # blocks per input VL (the link maximum) for the second saturation figure
SWITCH_RUN = dict(payload=SWITCH_PAYLOAD, warmup=20000, cycles=60000, sweep_warmup=5000,
                  sweep_cycles=20000, incast_cycles=40000, latency_payloads=[0, 256, 4096],
                  loads=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])


def switch_bench_top(**params):
    from tb.switch_bench_top import SwitchBenchTop
    return SwitchBenchTop(**params)


def run_switch(testcase, expect_tests, run=None, **params):
    """One build per hardware parameter set; the run settings travel in BENCH_SETTINGS
    (they are merged into the testbench's parameters) so that they never cause a rebuild."""
    params = {**SWITCH, **params}
    settings = {**SWITCH_RUN, **(run or {})}
    tag = runner.param_tag(params)
    records = OUT / "records" / f"switch_{testcase or 'all'}_{tag}.json"
    records.parent.mkdir(parents=True, exist_ok=True)
    records.unlink(missing_ok=True)
    began = time.time()
    runner.run(module="tb.bench_switch", toplevel="switch_bench_top", factory=switch_bench_top,
               params=params, testcase=testcase, expect_tests=expect_tests,
               extra_env={"BENCH_RECORDS": str(records), "BENCH_SETTINGS": json.dumps(settings)})
    print(f"switch bench {testcase or 'all'} {tag}: {time.time() - began:.0f} s (build included)",
          flush=True)
    return json.loads(records.read_text())


def switch_benchmarks():
    records = []
    # Default build (132-block input buffers, VOQ): every scenario.
    records += run_switch(None, 5)
    # Saturation with a larger input buffer, and the FIFO (head-of-line) switch.
    records += run_switch("saturation", 1, run={"record_tag": f".buffer{SWITCH_LARGE_BUFFER}"},
                          buffer_blocks=SWITCH_LARGE_BUFFER)
    records += run_switch("saturation", 1, mode="fifo")
    records += switch_model_records(records)
    plot_switch_sweep(records)
    return records


def switch_model(load, *, mode="voq", buffer_blocks=132, downstream_blocks=132, pattern="uniform",
                 cycles=160000, warmup=80000, sls=(0, 1)):
    from models.switch import RTL_ALLOCATORS, run_switch as model_run
    stats, net = model_run(SWITCH["ports"], pattern, load=load, payload=SWITCH_PAYLOAD,
                           cycles=cycles, warmup=warmup, num_vls=SWITCH["num_vls"], sls=sls,
                           mode=mode, iterations=SWITCH["islip_iterations"], width=SWITCH["width"],
                           buffer_blocks=buffer_blocks, downstream_blocks=downstream_blocks,
                           exclude_self=True, **RTL_ALLOCATORS[SWITCH["allocator"]])
    return stats, net


def switch_model_records(rtl):
    """models/switch/ on the configurations the RTL was measured with."""
    by_name = {r["name"]: r for r in rtl}
    records = []
    base = {"source": "models/switch/", "traffic": "uniform over the other ports",
            "sls": [0, 1], "cycles": 160000, "warmup": 80000}
    for name, kwargs in (("uniform", {}), (f"uniform.buffer{SWITCH_LARGE_BUFFER}",
                                           {"buffer_blocks": SWITCH_LARGE_BUFFER}),
                         ("uniform_fifo", {"mode": "fifo"}), ("uniform.one_vl", {"sls": (0,)})):
        rtl_record = by_name.get(f"switch.saturation_throughput.{name}")
        blocks = rtl_record["config"]["buffer_blocks"] if rtl_record else kwargs.get("buffer_blocks", 132)
        down = rtl_record["config"]["downstream_blocks"] if rtl_record else 132
        kwargs = {**kwargs, "buffer_blocks": blocks, "downstream_blocks": down}
        stats, net = switch_model(1.0, **kwargs)
        kwargs["sls"] = list(kwargs.get("sls", (0, 1)))
        records.append({"name": f"switch.model.saturation_throughput.{name}",
                        "value": round(stats.mean_throughput, 4), "unit": "fraction of wire",
                        "config": {**base, **SWITCH, **kwargs, "payload_bytes": SWITCH_PAYLOAD,
                                   "wire_utilization": round(sum(stats.wire_utilization) / len(stats.wire_utilization), 4),
                                   "latency_p50": round(stats.latency_p50, 1),
                                   "latency_p99": round(stats.latency_p99, 1)}})
        if name == "uniform":
            records.append({"name": "switch.model.hop_latency_cycles", "value": net.router.hop_latency,
                            "unit": "cycles", "config": {**base, **SWITCH, **kwargs}})
    sweep = []
    for load in SWITCH_RUN["loads"]:
        stats, _ = switch_model(load, cycles=40000, warmup=10000)
        sweep.append({"load": load, "p50": round(stats.latency_p50, 1), "p99": round(stats.latency_p99, 1),
                      "throughput": round(stats.mean_throughput, 4)})
    records.append({"name": "switch.model.latency_vs_load", "value": sweep, "unit": "cycles",
                    "config": {**base, **SWITCH, "buffer_blocks": 132, "downstream_blocks": 132,
                               "payload_bytes": SWITCH_PAYLOAD, "cycles": 40000, "warmup": 10000}})
    p80 = [p for p in sweep if abs(p["load"] - 0.8) < 1e-9][0]
    records.append({"name": "switch.model.p99_latency_cycles.load80", "value": p80["p99"],
                    "unit": "cycles", "config": records[-1]["config"]})
    stats, _ = switch_model(1.0, pattern="incast", cycles=40000, warmup=10000)
    records.append({"name": "switch.model.incast.utilization",
                    "value": round(stats.wire_utilization[0], 4), "unit": "fraction of cycles",
                    "config": {**base, **SWITCH, "traffic": "7 to 1", "buffer_blocks": 132,
                               "downstream_blocks": 132, "payload_bytes": SWITCH_PAYLOAD}})
    records.append({"name": "switch.model.incast.jain", "value": round(stats.jain, 5),
                    "unit": "index", "config": records[-1]["config"]})
    return records


def plot_switch_sweep(records):
    by_name = {r["name"]: r for r in records}
    rtl = by_name.get("switch.latency_vs_load")
    model = by_name.get("switch.model.latency_vs_load")
    if not rtl:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "switch_latency_vs_load.json").write_text(json.dumps(
        {"rtl": rtl, "model": model}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    loads = [p["load"] for p in rtl["value"]]
    ax.plot(loads, [p["p50"] for p in rtl["value"]], "o-", color="C0", label="RTL p50")
    ax.plot(loads, [p["p99"] for p in rtl["value"]], "s-", color="C3", label="RTL p99")
    if model:
        ax.plot([p["load"] for p in model["value"]], [p["p50"] for p in model["value"]], "o--",
                color="C0", alpha=0.5, label="model p50")
        ax.plot([p["load"] for p in model["value"]], [p["p99"] for p in model["value"]], "s--",
                color="C3", alpha=0.5, label="model p99")
    config = rtl["config"]
    ax.set_yscale("log")
    ax.set_xlabel("offered load (fraction of the wire per input)")
    ax.set_ylabel("start beat in -> start beat out (cycles, 2.5 ns)")
    ax.set_title(f"{config['ports']}-port switch, uniform, {config['payload_bytes']} B payloads, "
                 f"{config['buffer_blocks']} blocks/VL", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "switch_latency_vs_load.png", dpi=110)
    docs = runner.REPO / "docs" / "img"
    docs.mkdir(parents=True, exist_ok=True)
    fig.savefig(docs / "switch_latency_vs_load.png", dpi=110)


# The message-rate benchmark spreads over every QP: the default 64.
NIC = dict(num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2, mtu=4096, wire_delay=2)


def nic_benchmarks():
    from tb.nic_top import BUILD_ARGS, nic_top
    records = []
    for testcase in ("doorbell_to_wire", "message_rate_acked", "message_rate_coalesced",
                     "write_bandwidth"):
        path = OUT / "records" / f"nic_{testcase}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        runner.run(module="tb.bench_nic", toplevel="nic_top", factory=nic_top, params=NIC,
                   testcase=testcase, expect_tests=1, build_args=BUILD_ARGS,
                   extra_env={"BENCH_RECORDS": str(path)})
        records += json.loads(path.read_text())
    records += nic_pair_benchmarks()
    return records


def nic_pair_benchmarks():
    """Two NICs back to back (the build the two-NIC tests use), then through a switch."""
    from tb.nic_pair_top import BUILD_ARGS, PAIR, nic_pair_top
    records = []
    runs = [(PAIR, "e2e_write_latency"), (PAIR, "write_bandwidth"), (PAIR, "read_bandwidth"),
            (PAIR, "goodput_under_loss"), ({**PAIR, "through_switch": True}, "e2e_write_latency")]
    for params, testcase in runs:
        path = OUT / "records" / f"nic_pair_{testcase}_{runner.param_tag(params)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        runner.run(module="tb.bench_nic_pair", toplevel="nic_pair_top", factory=nic_pair_top,
                   params=params, testcase=testcase, expect_tests=1, build_args=BUILD_ARGS,
                   extra_env={"BENCH_RECORDS": str(path)})
        records += json.loads(path.read_text())
    return records


# --- fabric (tb/test_fabric.py's zero-load probe, the scenario behind `make sim`) ------------

# The cut of fabric_benchmarks: make sim's default step, leaf 0's spine-0 cable.
SPINE_CUT = {"ack_timeout": 3, "cut_link": "leaf0.p2", "cut_at": 500}


def fabric_benchmarks():
    """On the default fabric (8 NICs, 4 leaves, 2 spines): the zero-load 1-hop and 3-hop
    NIC-to-NIC latencies (tb/test_fabric.py zero_load_latency: fabric.hop1_latency_ns,
    fabric.hop3_latency_ns) and the default MoE step of `make sim` (tb/fabric_scenarios.py:
    fabric.moe_dispatch_us, fabric.moe_combine_us, fabric.drops), and the same step with
    leaf 0's cable to spine 0 cut 500 cycles in and restored once both ends went down
    (fabric.cut.*: the phases, drops, detect and recovery cycles, packets resent; docs/fabric.md,
    A cut cable). All share one build."""
    from tb import fabric_scenarios
    from tb.fabric_top import run_fabric
    records = []
    path = OUT / "records" / "fabric_zero_load_latency.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    run_fabric(module="tb.test_fabric", params={}, testcase="zero_load_latency",
               expect_tests=1, extra_env={"BENCH_RECORDS": str(path)})
    records += json.loads(path.read_text())
    for name, config in (("fabric_moe", {}), ("fabric_moe_spine_cut", SPINE_CUT)):
        path = OUT / "records" / f"{name}.json"
        path.unlink(missing_ok=True)
        # launch() passes the environment on to the simulation.
        os.environ["BENCH_RECORDS"] = str(path)
        try:
            fabric_scenarios.launch(config)
        finally:
            del os.environ["BENCH_RECORDS"]
        records += json.loads(path.read_text())
    return records



def fpga_benchmarks():
    """hdl/fpga.py on every registered top; also writes build/fpga/report.md."""
    from hdl import fpga
    return fpga.records(fpga.run_all(out=runner.REPO / "build" / "fpga",
                                     verilog_dir=runner.REPO / "build" / "verilog"))


GROUPS = {"link": "link_benchmarks", "switch": "switch_benchmarks", "nic": "nic_benchmarks",
          "fabric": "fabric_benchmarks", "fpga": "fpga_benchmarks"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT / "results.json")
    parser.add_argument("--only", choices=sorted(GROUPS), action="append",
                        help="run only this group of benchmarks (repeatable)")
    args = parser.parse_args(argv)
    started = time.time()
    groups = args.only or list(GROUPS)
    records = []
    for group in groups:
        records += globals()[GROUPS[group]]()
    if args.only and args.out.exists():
        prefixes = tuple(f"{g}." for g in groups)
        kept = [r for r in json.loads(args.out.read_text()) if not r["name"].startswith(prefixes)]
        records = kept + records
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    width = max(len(r["name"]) for r in records)
    for r in records:
        print(f"{r['name']:<{width}}  {r['value']!s:>8} {r['unit']}")
    print(f"wrote {args.out} ({len(records)} records) in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
