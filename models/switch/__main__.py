"""``python -m models.switch``: one run of the switch model, summarised (docs/models.md)."""

import argparse
import time

import numpy as np

from . import PATTERNS, run_switch
from .router import DEFAULT_VL_WEIGHT


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.switch", description="Cycle-level model of the cut-through switch: one run.")
    parser.add_argument("--ports", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the wire; >= 1 saturates")
    parser.add_argument("--pattern", choices=PATTERNS, default="uniform")
    parser.add_argument("--cycles", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--mode", choices=("voq", "fifo"), default="voq")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--input-speedup", type=int, default=1,
                        help="packets an input may send at once (read ports of its buffer)")
    parser.add_argument("--exclude-self", action="store_true",
                        help="uniform traffic over the other ports only (as make bench runs it)")
    parser.add_argument("--saturate-depth", type=int, default=4,
                        help="packets a saturated source keeps waiting")
    parser.add_argument("--payload", default="2020", help="bytes, or LO:HI for uniform random")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vls", type=int, default=1)
    parser.add_argument("--buffer-blocks", type=int, default=528)
    parser.add_argument("--downstream-blocks", type=int, default=132)
    parser.add_argument("--vl-weights", default=None,
                        help="output VL arbitration weights in 64-byte blocks, W0,W1,... "
                             f"(default {DEFAULT_VL_WEIGHT} each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock-mhz", type=float, default=400.0)
    args = parser.parse_args(argv)
    payload = (tuple(int(x) for x in args.payload.split(":")) if ":" in args.payload
               else int(args.payload))
    extra = {}
    if args.vl_weights:
        extra["vl_weights"] = [int(x) for x in args.vl_weights.split(",")]
    began = time.perf_counter()
    stats, net = run_switch(args.ports, args.pattern, load=args.load, payload=payload,
                            cycles=args.cycles, warmup=args.warmup, mode=args.mode,
                            iterations=args.iterations, width=args.width,
                            input_speedup=args.input_speedup, exclude_self=args.exclude_self,
                            saturate_depth=args.saturate_depth,
                            num_vls=args.vls, sls=tuple(range(args.vls)),
                            buffer_blocks=args.buffer_blocks,
                            downstream_blocks=args.downstream_blocks, seed=args.seed, **extra)
    wall = time.perf_counter() - began
    ns = 1000.0 / args.clock_mhz
    print(f"{args.ports}-port switch, {args.mode}, iSLIP x{args.iterations}, input speed-up "
          f"{args.input_speedup}, {args.vls} VL(s), "
          f"{args.pattern} load {args.load}, payload {args.payload} B, W={args.width} B, "
          f"buffers {args.buffer_blocks} blocks per VL in, {args.downstream_blocks} downstream, "
          f"{args.cycles} cycles (window {stats.start}..{stats.end})")
    print(f"throughput (payload / cycles*W): mean {stats.mean_throughput:.4f}, min "
          f"{min(stats.throughput):.4f}, max {max(stats.throughput):.4f}; wire utilization "
          f"{np.mean(stats.wire_utilization):.4f}")
    print(f"latency start-in to start-out: p50 {stats.latency_p50:.0f} cycles "
          f"({stats.latency_p50 * ns:.1f} ns), p99 {stats.latency_p99:.0f} cycles "
          f"({stats.latency_p99 * ns:.1f} ns) at {args.clock_mhz:g} MHz; zero-load hop "
          f"{net.router.hop_latency} cycles")
    print(f"with source queueing: p50 {stats.total_latency_p50:.0f}, p99 "
          f"{stats.total_latency_p99:.0f} cycles; Jain {stats.jain:.4f}; packets "
          f"{stats.generated} generated, {stats.delivered} delivered, drops {stats.dropped}; "
          f"lossless check passed")
    print(f"simulated {net.now / wall:,.0f} cycles/s ({wall:.2f} s wall)")


if __name__ == "__main__":
    main()
