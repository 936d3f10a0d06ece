"""The link demo: two link ports under traffic (``make sim`` runs the fabric scenario,
tb/sim.py; this is the smaller first look at one link).

Ports A and B, joined by a cable of ``--wire-delay`` cycles, exchange random
packets on every VL in both directions while B's consumer on VL 1 stalls at
random. The run prints a progress line, then a summary: throughput per
direction, credit stalls, flow-control packets, drops (must be 0) and the
scoreboard's verdict (every packet delivered once, intact, in order). It
writes build/link_demo/report.{json,md} and a pcapng capture of the A->B wire that
Wireshark/tshark decode; ``--waves`` (or WAVES=1) also writes an FST waveform.

    python -m tb.link_demo --help
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import cocotb
from cocotb.clock import Clock

from tb import runner

OUT = runner.REPO / "build" / "link_demo"
MAX_WIRE_DELAY = 256
CLOCK_NS = 2.5
BUILD = dict(width=64, num_vls=2, mtu=4096, buffer_blocks=192, cut_through=True, fc_period=1024,
             fc_min_interval=64, fc_batch_blocks=64, wire_delay=MAX_WIRE_DELAY, channel="hdl")


@cocotb.test()
async def link_demo(dut):
    from models.packet import parse_packet, random_packet
    from models.pcap import LinkCapture
    from tb.beats import CycleLoop, PacketSink, PacketSource, WireMonitor, backpressure_random
    from tb.link_pair_tb import bring_up, read_port

    params = runner.tb_params()
    options = json.loads(os.environ["LINK_DEMO_OPTIONS"])
    width, num_vls = params["width"], params["num_vls"]
    rng = random.Random(options["seed"])
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
    loop = CycleLoop(dut.clk)
    sources, sinks, sent = {}, {}, {}
    for side in ("a", "b"):
        for v in range(num_vls):
            sources[side, v] = loop.add(PacketSource(dut, f"{side}_data_in__{v}", width))
            stall = options["sink_stall"] if (side, v) == ("b", 1) else 0.0
            sinks[side, v] = loop.add(PacketSink(dut, f"{side}_data_out__{v}", width,
                                                 backpressure_random(random.Random(rng.random()), stall)))
            getattr(dut, f"{side}_vl_weight__{v}").value = 16
            sent[side, v] = []
    captures = contextlib.ExitStack()
    capture = captures.enter_context(LinkCapture(options["pcap"]))
    loop.add(WireMonitor(dut, "a_wire_monitor", width, capture=capture, clock_ns=CLOCK_NS))
    overflow_cycles = []
    loop.checks.append(lambda cycle: overflow_cycles.append(cycle)
                       if int(dut.a_overflow.value) or int(dut.b_overflow.value) else None)

    await bring_up(dut, loop, wire_delay=options["wire_delay"])
    link_up = loop.cycle

    for side in ("a", "b"):
        for _ in range(options["packets"]):
            v = rng.randrange(num_vls)
            packet = random_packet(rng, payload_len=rng.choice(options["sizes"]), vl=v)
            sent[side, v].append(packet)
            sources[side, v].send(packet)
    total = sum(len(p) for p in sent.values())
    started = loop.cycle
    wall = time.time()

    def delivered():
        return sum(len(sink.packets) for sink in sinks.values())

    while delivered() < total:
        await loop.run(cycles=2000)
        if loop.cycle - started > 400 * total + 100000:
            break
        rate = (loop.cycle - started) / max(time.time() - wall, 1e-9)
        print(f"\r  cycle {loop.cycle:>8}  delivered {delivered():>6}/{total}  "
              f"({rate:,.0f} simulated cycles/s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    finished = loop.cycle
    await loop.run(cycles=BUILD["fc_period"] + 2 * options["wire_delay"] + 64)
    captures.close()

    def port(name, side, v=None):
        return read_port(dut, name, side, v)

    directions = []
    for side, far in (("a", "b"), ("b", "a")):
        wrong, missing, payload_bytes = 0, 0, 0
        for v in range(num_vls):
            got = [p for p, bad, *_ in sinks[far, v].packets if not bad]
            want = sent[side, v]
            missing += max(0, len(want) - len(got))
            wrong += sum(g != w for g, w in zip(got, want))
            payload_bytes += sum(len(parse_packet(p).payload) for p in got)
        cycles = finished - started
        directions.append({
            "direction": f"{side.upper()}->{far.upper()}",
            "packets": sum(len(sent[side, v]) for v in range(num_vls)),
            "missing": missing, "corrupted_or_reordered": wrong,
            "throughput": round(payload_bytes / (cycles * width), 4),
            "credit_stall_cycles": [port("credit_stall_cycles", side, v) for v in range(num_vls)],
            "fc_packets_sent_by_receiver": port("fc_packets_sent", far),
            "drops_at_receiver": {reason: port(f"drop_{reason}", far) for reason in (
                "vcrc", "truncated", "overlong", "too_long", "invalid_vl", "malformed",
                "end_bad", "link_down", "overflow")},
            "credits_home": all((port("credit_limit", side, v) - port("fctbs", side, v)) % 4096
                                == params["buffer_blocks"] for v in range(num_vls)),
        })
    report = {
        "scenario": "link demo: two ports, random packets on every VL in both directions",
        "config": {**{k: params[k] for k in ("width", "num_vls", "mtu", "buffer_blocks", "cut_through",
                                               "fc_period", "fc_min_interval", "fc_batch_blocks")},
                   "clock_mhz": 1000 / CLOCK_NS, "wire_delay_cycles": options["wire_delay"],
                   "packets_per_direction": options["packets"], "payload_sizes": options["sizes"],
                   "sink_stall_b_vl1": options["sink_stall"], "seed": options["seed"]},
        "link_up_cycles": link_up,
        "traffic_cycles": finished - started,
        "sim_cycles_per_s": round((finished - started) / max(time.time() - wall, 1e-9)),
        "overflow_cycles": len(overflow_cycles),
        "directions": directions,
    }
    Path(options["report"]).write_text(json.dumps(report, indent=1))
    assert not overflow_cycles, "a receive buffer overflowed"
    for d in directions:
        assert d["missing"] == 0 and d["corrupted_or_reordered"] == 0, d
        assert sum(d["drops_at_receiver"].values()) == 0, d
        assert d["credits_home"], d


def summary(report):
    c = report["config"]
    lines = [
        f"tokenfabric link demo: {c['width']}-byte beats at {c['clock_mhz']:.0f} MHz, "
        f"{c['num_vls']} VLs, {c['buffer_blocks']} blocks of receive buffer per VL, "
        f"wire delay {c['wire_delay_cycles']} cycles, {'cut-through' if c['cut_through'] else 'store-and-forward'}",
        f"link up after {report['link_up_cycles']} cycles; traffic ran {report['traffic_cycles']} cycles "
        f"({report['traffic_cycles'] * 1000 / c['clock_mhz'] / 1000:.1f} us simulated, "
        f"{report['sim_cycles_per_s']:,} cycles/s)",
        "",
        "| direction | packets | throughput (payload / wire) | credit-stall cycles per VL | "
        "FC packets back | drops | lost | corrupted | credits home |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in report["directions"]:
        lines.append(
            f"| {d['direction']} | {d['packets']} | {d['throughput']:.3f} | "
            f"{', '.join(map(str, d['credit_stall_cycles']))} | {d['fc_packets_sent_by_receiver']} | "
            f"{sum(d['drops_at_receiver'].values())} | {d['missing']} | {d['corrupted_or_reordered']} | "
            f"{'yes' if d['credits_home'] else 'NO'} |")
    lines.append("")
    lines.append(f"receive-buffer overflows: {report['overflow_cycles']} cycles (must be 0)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tb.link_demo",
        description="Two credit-linked IBA ports under random traffic in both directions.")
    parser.add_argument("--packets", type=int, default=600, help="packets per direction (default 600)")
    parser.add_argument("--sizes", default="0,64,256,1024,4096",
                        help="payload sizes in bytes to pick from (default 0,64,256,1024,4096)")
    parser.add_argument("--wire-delay", type=int, default=20,
                        help=f"cable + PHY delay in cycles, 0..{MAX_WIRE_DELAY} (default 20)")
    parser.add_argument("--sink-stall", type=float, default=0.3,
                        help="probability B's consumer of VL 1 stalls a cycle (default 0.3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--waves", action="store_true", help="write an FST waveform (also WAVES=1)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, not {args.sizes!r}")
    if not 1 <= args.packets <= 100000:
        parser.error("--packets must be 1 to 100000")
    if any(not 0 <= s <= BUILD["mtu"] for s in sizes):
        parser.error(f"--sizes must lie in 0..{BUILD['mtu']} (the MTU)")
    if not 0 <= args.wire_delay <= MAX_WIRE_DELAY:
        parser.error(f"--wire-delay must be 0..{MAX_WIRE_DELAY}")
    if not 0 <= args.sink_stall < 1:
        parser.error("--sink-stall must be in [0, 1)")

    OUT.mkdir(parents=True, exist_ok=True)
    options = dict(packets=args.packets, sizes=sizes, wire_delay=args.wire_delay,
                   sink_stall=args.sink_stall, seed=args.seed,
                   pcap=str(OUT / "link_a_to_b.pcapng"), report=str(OUT / "report.json"))
    waves = args.waves or bool(int(os.environ.get("WAVES", "0")))
    print("building the link pair (the first build takes about a minute) ...", file=sys.stderr)
    failed = None
    try:
        run_dir = runner.run(module="tb.link_demo", toplevel="link_pair", factory=link_pair,
                               params=BUILD, waves=waves, log_to_file=False,
                               extra_env={"LINK_DEMO_OPTIONS": json.dumps(options),
                                          "COCOTB_LOG_LEVEL": "WARNING",
                                          "GPI_LOG_LEVEL": "WARNING"})
    except AssertionError as error:
        failed, run_dir = error, None
    report_path = Path(options["report"])
    if not report_path.exists():
        print(f"error: the simulation wrote no report ({failed})", file=sys.stderr)
        return 1
    report = json.loads(report_path.read_text())
    text = summary(report)
    (OUT / "report.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {OUT / 'report.md'}, {report_path}, {options['pcap']}")
    if waves and run_dir:
        shutil.copyfile(run_dir / "dump.fst", OUT / "link_demo.fst")
        print(f"waveform: {OUT / 'link_demo.fst'}")
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


def link_pair(**params):
    from tb.link_pair import LinkPair
    return LinkPair(**params)


if __name__ == "__main__":
    sys.exit(main())
