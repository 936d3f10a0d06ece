"""``make bench``: run the performance scenarios, write build/bench/results.json.

Each scenario is a cocotb module run under Verilator by :func:`tb.runner.run`;
its tests append ``{"name", "value", "unit", "config"}`` records that this
script gathers. Names are documented in docs/performance.md. The credit-loop
sweep also writes build/bench/link_buffer_sweep.{json,png}.
"""
import argparse
import json
import sys
import time
from pathlib import Path

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
    from models.link import credit_loop_cycles, min_buffer_for_full_rate, send_only_wire_bytes
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT / "results.json")
    args = parser.parse_args(argv)
    started = time.time()
    records = link_benchmarks()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    width = max(len(r["name"]) for r in records)
    for r in records:
        print(f"{r['name']:<{width}}  {r['value']!s:>8} {r['unit']}")
    print(f"wrote {args.out} ({len(records)} records) in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
