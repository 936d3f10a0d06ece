"""What `make sim` makes of a fabric scenario's results: figures, table, report files, plots.

Input is the ``scenario_results.json`` dict that tb/fabric_scenarios.py writes (its keys
are described in docs/sim.md); nothing here imports cocotb or builds anything, so the
report can be regenerated from a saved results file and tested alone (tb/test_sim.py).

- :func:`derive`: the figures (per-hop and NIC-to-NIC latency with its breakdown, per-rank
  phase times and bandwidth, message latency percentiles, per-link credit stalls and
  utilisation, drops, retransmissions, CQE counts) and every check that failed;
- :func:`summary`: the terminal table (markdown, also the body of report.md);
- :func:`write_report`: report.md, report.json and the PNG plots into a directory.

``python -m tb.sim_report RESULTS.json [--out DIR]`` rebuilds the report from a saved file.

Times in the results are simulated cycles; ``config.clock_ns`` converts them. The wire
rate of a NIC is ``beat_bytes`` per cycle (64 B at 400 MHz: 25.6 GB/s).
"""
import json
import math
from pathlib import Path

__all__ = ["derive", "summary", "write_report", "plot_latency", "plot_utilisation",
           "percentile", "busy_span", "LATENCY_PARTS"]

# NIC-to-NIC latency split (the zero-load probe's keys) into the parts the report names.
LATENCY_PARTS = {
    "NIC logic": ("nic_a", "nic_a_wire", "nic_b"),
    "memory wait": ("memory",),
    "cables": ("cables",),
    "switches": ("switches",),
}
PLOTS = {"latency": "message_latency.png", "utilisation": "link_utilisation.png"}


def percentile(values, fraction):
    """Nearest-rank percentile: the smallest value with at least ``fraction`` of the values
    at or below it (p100 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def busy_span(intervals):
    """Cycles covered by the union of ``(start, end)`` intervals."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


def _path_figures(probe, clock_ns):
    parts = {name: sum(probe[key] for key in keys) for name, keys in LATENCY_PARTS.items()}
    dominant = max(parts, key=parts.get)
    return {
        "src": probe["src"], "dst": probe["dst"], "hops": probe["hops"],
        "cycles": probe["total"], "ns": probe["total"] * clock_ns,
        "parts_cycles": parts,
        "parts_share": {name: value / probe["total"] for name, value in parts.items()},
        "parts_sum_cycles": sum(parts.values()),
        "dominant": dominant,
        "probe_cycles": {key: probe[key] for keys in LATENCY_PARTS.values() for key in keys},
        "route": probe.get("route"),
        "switch_hop_cycles": probe.get("hop_cycles"),
    }


def _landed(messages):
    """The messages with both a doorbell and a landing cycle (a failed run may lack some)."""
    return [m for m in messages if m.get("posted") is not None and m.get("landed") is not None]


def _group(message):
    """A message's latency group: its kind, and for a signal the phase it closes."""
    kind, phase = message["kind"], message.get("phase")
    return f"{kind} ({phase})" if phase and phase != kind else kind


def _groups_in_order(messages):
    """The latency groups of ``messages`` by phase (in the order each began), the data
    messages of a phase before its signals."""
    began, order = {}, {}
    for m in messages:
        phase = m.get("phase") or m["kind"]
        began[phase] = min(began.get(phase, m["posted"]), m["posted"])
    for m in messages:
        phase = m.get("phase") or m["kind"]
        order[_group(m)] = (began[phase], m["kind"] != phase, _group(m))
    return sorted(order, key=order.get)


def _rank_figures(results, clock_ns, wire_bytes_per_cycle, workload_cycles):
    by_src = {}
    for m in _landed(results["messages"]):
        by_src.setdefault(m["src"], []).append(m)
    rows = []
    for r in results["ranks"]:
        sent = by_src.get(r["rank"], [])
        payload = sum(m["bytes"] for m in sent)
        in_flight = busy_span((m["posted"], m["landed"]) for m in sent)
        row = {"rank": r["rank"], "leaf": r.get("leaf"),
               "bytes_sent": r["bytes_sent"], "bytes_received": r["bytes_received"],
               "messages_sent": r["messages_sent"], "messages_received": r["messages_received"],
               "message_bytes_sent": payload, "in_flight_cycles": in_flight}
        for phase in ("dispatch", "combine"):
            if r.get(f"{phase}_start") is not None and r.get(f"{phase}_end") is not None:
                cycles = r[f"{phase}_end"] - r[f"{phase}_start"]
                row[f"{phase}_cycles"] = cycles
                row[f"{phase}_us"] = cycles * clock_ns / 1000
        # Bandwidth while the NIC had a message of its own in flight (doorbell .. last byte
        # landed): the waits for other ranks between phases do not dilute it.
        # None: the rank sent nothing (the KV receiver).
        rate = payload / in_flight if in_flight else None
        row["gbytes_per_s"] = rate / clock_ns if rate is not None else None
        row["wire_fraction"] = rate / wire_bytes_per_cycle if rate is not None else None
        if r.get("busy_cycles") is not None and workload_cycles:
            row["busy_cycles"] = r["busy_cycles"]
            row["wire_busy_fraction"] = r["busy_cycles"] / workload_cycles
        rows.append(row)
    return rows


def _message_figures(messages, clock_ns):
    groups, sizes = {}, {}
    for m in _landed(messages):
        key = (_group(m), m["hops"])
        groups.setdefault(key, []).append(m["landed"] - m["posted"])
        sizes[key] = sizes.get(key, 0) + m["bytes"]
    order = {group: k for k, group in enumerate(_groups_in_order(_landed(messages)))}
    rows = []
    for (kind, hops), latencies in sorted(groups.items(), key=lambda item: (order[item[0][0]],
                                                                             item[0][1])):
        row = {"kind": kind, "hops": hops, "count": len(latencies),
               "min_cycles": min(latencies), "p50_cycles": percentile(latencies, 0.5),
               "p99_cycles": percentile(latencies, 0.99), "max_cycles": max(latencies),
               "bytes": sizes[kind, hops]}
        for key in ("min", "p50", "p99", "max"):
            row[f"{key}_us"] = row[f"{key}_cycles"] * clock_ns / 1000
        rows.append(row)
    return rows


def _link_figures(links):
    rows = []
    for link in links:
        row = {"name": link["name"], "cable": link.get("cable"), "a": link.get("a"),
               "b": link.get("b"), "credit_stall_cycles": link["credit_stall_cycles"],
               "packets": link["packets"], "bytes": link["bytes"]}
        # "utilisation" is a -> b (NIC to leaf, leaf to spine: up), "utilisation_ba" down.
        for direction, key in (("up", "utilisation"), ("down", "utilisation_ba")):
            samples = link.get(key)
            if samples is not None:
                row[f"{direction}_mean_utilisation"] = sum(samples) / len(samples) if samples else 0.0
                row[f"{direction}_peak_utilisation"] = max(samples, default=0.0)
        rows.append(row)
    return rows


# The scenario's checks that a line of _failures already explains when they fail.
EXPLAINED_CHECKS = {"no_drops": "drops", "no_overflow": "overflows",
                    "no_retransmissions": "retransmissions", "cqes_complete": "cqes"}


def _failures(results, figures):
    """Every check that failed, as one line each (empty: the run passed)."""
    failed, explained = [], set()
    drops = results["drops"]
    # With a cut cable, loss is the point: the scenario's drops_only_from_the_cut and
    # cut_recovered judge it.
    cut = bool(results["config"].get("cut_link"))
    if drops["total"] and not cut:
        where = ", ".join(f"{k} {v}" for k, v in sorted(drops.get("by_counter", {}).items()) if v)
        failed.append(f"{drops['total']} packets dropped (must be 0)" + (f": {where}" if where else ""))
        explained.add("drops")
    retransmissions = results["retransmissions"]
    if retransmissions["total"] and not cut:
        where = ", ".join(f"{nic}.{k} {v}" for nic, counters in sorted(
            retransmissions.get("by_nic", {}).items()) for k, v in sorted(counters.items()) if v)
        failed.append(f"{retransmissions['total']} retransmissions on a fault-free run "
                      f"(must be 0)" + (f": {where}" if where else ""))
        explained.add("retransmissions")
    if results.get("overflows"):
        failed.append(f"{results['overflows']} receive-buffer overflows (must be 0)")
        explained.add("overflows")
    cqes = results["cqes"]
    if cqes["send_cqes"] != cqes["posted_wqes"]:
        failed.append(f"{cqes['send_cqes']} send CQEs for {cqes['posted_wqes']} posted WQEs")
        explained.add("cqes")
    if cqes.get("errors"):
        failed.append(f"{cqes['errors']} CQEs with an error status")
        explained.add("cqes")
    for name, passed in results.get("checks", {}).items():
        if not passed and EXPLAINED_CHECKS.get(name) not in explained:
            failed.append(f"scenario check failed: {name.replace('_', ' ')}")
    unfinished = [p["name"] for p in results.get("phases", []) if p.get("end") is None]
    if unfinished:
        failed.append(f"phase{'s' if len(unfinished) > 1 else ''} did not finish: "
                      f"{', '.join(unfinished)}")
    # The scenario's own reasons (which token, which memory), a few of them.
    failed += [f"scenario: {reason}" for reason in results.get("failures", [])[:10]]
    for name in ("hop1", "hop3"):
        path = figures["paths"].get(name)
        if path and path["parts_sum_cycles"] != path["cycles"]:
            failed.append(f"{name} latency parts add up to {path['parts_sum_cycles']} cycles, "
                          f"not its total {path['cycles']}")
    return failed


def _phase_figures(phase, clock_ns):
    done = phase.get("start") is not None and phase.get("end") is not None
    cycles = phase["end"] - phase["start"] if done else None
    return {**phase, "cycles": cycles, "us": cycles * clock_ns / 1000 if done else None}


# The scenario's phases (results["timing"]) grouped into the parts of a run's wall time.
WALL_PARTS = {"start-up": "start-up", "latency": "latency probe", "dispatch": "workload",
              "combine": "workload", "kv": "workload", "drain": "workload",
              "counters": "counters"}


def wall_split(timing):
    """``{part: wall seconds}`` of a run from its phase starts (``results["timing"]``):
    start-up (reset, tables, links, QPs), latency probe, workload (to the last completion),
    counters (the switches' and NICs' read at the end); the results' own writing is not in
    it."""
    split = {}
    for this, following in zip(timing, timing[1:]):
        part = WALL_PARTS[this["phase"]]
        split[part] = split.get(part, 0) + following["seconds"] - this["seconds"]
    return split


def derive(results):
    """Every figure the report shows, from a ``scenario_results.json`` dict."""
    config = results["config"]
    clock_ns = config["clock_ns"]
    wire_bytes_per_cycle = config["beat_bytes"]
    phases = results.get("phases", [])
    if results.get("workload_start") is not None and results.get("workload_end") is not None:
        workload = results["workload_end"] - results["workload_start"]
    else:
        ends = [p["end"] for p in phases if p.get("end") is not None]
        starts = [p["start"] for p in phases if p.get("start") is not None]
        workload = max(ends) - min(starts) if ends and starts else 0
    latency = results["latency"]
    hops = latency["hop_cycles"]
    figures = {
        "clock_ns": clock_ns,
        "clock_mhz": 1000 / clock_ns,
        "wire_gbytes_per_s": wire_bytes_per_cycle / clock_ns,
        "hop": {"count": len(hops), "min_cycles": min(hops), "max_cycles": max(hops),
                "median_cycles": percentile(hops, 0.5),
                "median_ns": percentile(hops, 0.5) * clock_ns},
        "paths": {name: _path_figures(latency[name], clock_ns)
                  for name in ("hop1", "hop3") if name in latency},
        "phases": [_phase_figures(p, clock_ns) for p in phases],
        "workload_cycles": workload,
        "workload_us": workload * clock_ns / 1000,
        "ranks": _rank_figures(results, clock_ns, wire_bytes_per_cycle, workload),
        "messages": _message_figures(results["messages"], clock_ns),
        "messages_not_landed": len(results["messages"]) - len(_landed(results["messages"])),
        "links": _link_figures(results["links"]),
        "drops": results["drops"]["total"],
        "retransmissions": results["retransmissions"]["total"],
        "overflows": results.get("overflows", 0),
        "cut": results.get("cut"),
        "cqes": dict(results["cqes"]),
        "scenario_checks": dict(results.get("checks", {})),
        "simulation": {"cycles": results["cycles"], "us": results["cycles"] * clock_ns / 1000,
                       "wall_seconds": results.get("wall_seconds"),
                       "cycles_per_second": (results["cycles"] / results["wall_seconds"]
                                             if results.get("wall_seconds") else None),
                       "wall_split": wall_split(results.get("timing", []))},
    }
    figures["failures"] = _failures(results, figures)
    return figures


# --- text ------------------------------------------------------------------------------------

def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _headline(config):
    fabric = (f"{config['ranks']} ranks on {config['leaves']} leaves x {config['nics_per_leaf']} "
              f"NICs, {config['spines']} spine{'s' if config['spines'] > 1 else ''}")
    if config["scenario"] == "moe":
        experts = config["ranks"] * config["experts_per_rank"]
        what = (f"MoE step: {config['tokens']} tokens per rank, top-{config['topk']} of {experts} "
                f"experts ({config['experts_per_rank']} per rank), hidden {config['hidden']} "
                f"(dispatch {config['dispatch_bytes']:,} B, combine {config['combine_bytes']:,} B "
                f"per token)")
    else:
        what = (f"KV-cache transfer: rank {config['kv_src']} -> rank {config['kv_dst']}, "
                f"{config['kv_blocks']} blocks of {config['kv_block_bytes']:,} B, background "
                f"all-to-all on the other ranks")
    return f"tokenfabric {what}; {fabric}"


def clock_evidence():
    """What synthesis shows for the clock the nanoseconds assume (docs/fpga.md)."""
    from hdl.fpga import clock_evidence as evidence
    bench = Path(__file__).resolve().parent.parent / "build" / "bench" / "results.json"
    return evidence(json.loads(bench.read_text()) if bench.exists() else [])


def summary(results, figures):
    """The terminal summary (markdown tables), also the body of report.md."""
    config = results["config"]
    clock_ns = figures["clock_ns"]
    sim = figures["simulation"]
    split = "".join(f", {part} {seconds:.1f} s" if seconds < 10 else f", {part} {seconds:,.0f} s"
                    for part, seconds in sim["wall_split"].items())
    speed = (f" in {sim['wall_seconds']:,.0f} s wall ({sim['cycles_per_second']:,.0f} cycles/s"
             f"{split})" if sim["wall_seconds"] else "")
    lines = [
        _headline(config),
        f"wire delay {config['wire_delay']} cycles ({config['wire_delay'] * clock_ns:.1f} ns) per "
        f"cable, memory latency {config['memory_latency']} cycles "
        f"({config['memory_latency'] * clock_ns:.1f} ns), {config['beat_bytes']}-byte beats at "
        f"{figures['clock_mhz']:.0f} MHz ({figures['wire_gbytes_per_s']:.1f} GB/s per wire), "
        f"seed {config['seed']}",
        f"simulated {sim['cycles']:,} cycles ({sim['us']:.1f} us){speed}",
        f"clock: {clock_evidence()}",
        "",
    ]
    hop = figures["hop"]
    spread = ("every one the same" if hop["min_cycles"] == hop["max_cycles"]
              else f"min {hop['min_cycles']}, max {hop['max_cycles']}")
    lines += [
        f"Switch hop (start beat in to start beat out, zero load): {hop['median_cycles']} cycles = "
        f"{hop['median_ns']:.1f} ns, median of {hop['count']} hops measured ({spread})",
        "",
        "NIC-to-NIC latency at zero load (8-byte inline RDMA WRITE: doorbell at NIC A to the "
        "last byte in NIC B's memory), cycles (share)",
        "",
    ]
    rows = []
    for path in figures["paths"].values():
        parts = [f"{path['parts_cycles'][name]} ({path['parts_share'][name]:.0%})"
                 for name in LATENCY_PARTS]
        rows.append([f"{path['hops']} hop{'s' if path['hops'] > 1 else ''}, NIC {path['src']} -> "
                     f"{path['dst']}", f"{path['cycles']} = {path['ns']:.1f} ns", *parts,
                     path["dominant"]])
    lines += _table(["path", "total", *LATENCY_PARTS, "dominated by"], rows)
    if "hop1" in figures["paths"] and "hop3" in figures["paths"]:
        one, three = figures["paths"]["hop1"], figures["paths"]["hop3"]
        extra = three["cycles"] - one["cycles"]
        lines += ["", f"{three['hops'] - one['hops']} more hops cost {extra} cycles "
                      f"({extra * clock_ns:.1f} ns): "
                      f"{three['parts_cycles']['switches'] - one['parts_cycles']['switches']} in "
                      f"switches, {three['parts_cycles']['cables'] - one['parts_cycles']['cables']} "
                      f"on cables"]

    lines += ["", "Per rank (GB/s: bytes of its own messages over the cycles it had one in "
                  "flight; wire busy: cycles its outgoing wire carried a beat, over the workload)",
              ""]
    has_moe = results["config"]["scenario"] == "moe"
    header = ["rank", "leaf", *(["dispatch (us)", "combine (us)"] if has_moe else []),
              "sent (KiB)", "received (KiB)", "GB/s", "of wire", "wire busy"]
    rows = []
    for r in figures["ranks"]:
        phase_cells = ([f"{r['dispatch_us']:.2f}" if "dispatch_us" in r else "-",
                        f"{r['combine_us']:.2f}" if "combine_us" in r else "-"] if has_moe else [])
        rows.append([r["rank"], r["leaf"], *phase_cells, f"{r['bytes_sent'] / 1024:,.1f}",
                     f"{r['bytes_received'] / 1024:,.1f}",
                     *([f"{r['gbytes_per_s']:.2f}", f"{r['wire_fraction']:.0%}"]
                       if r["gbytes_per_s"] is not None else ["-", "-"]),
                     f"{r['wire_busy_fraction']:.0%}" if "wire_busy_fraction" in r else "-"])
    lines += _table(header, rows)

    if figures["phases"]:
        lines += ["", "Phases (whole fabric, first doorbell to the last rank done): " + ", ".join(
            f"{p['name']} {p['us']:.2f} us ({p['cycles']:,} cycles)" if p["cycles"] is not None
            else f"{p['name']} did not finish" for p in figures["phases"])]

    lines += ["", "Message latency (doorbell to last byte landed), cycles (us)", ""]
    lines += _table(["kind", "hops", "messages", "p50", "p99", "max"], [
        [m["kind"], m["hops"], m["count"], *(f"{m[f'{k}_cycles']:,} ({m[f'{k}_us']:.2f})"
                                              for k in ("p50", "p99", "max"))]
        for m in figures["messages"]])

    if figures["messages_not_landed"]:
        lines += ["", f"{figures['messages_not_landed']} messages never landed (not in the table)"]

    def utilisation(link, direction):
        if f"{direction}_mean_utilisation" not in link:
            return "-"
        return (f"{link[f'{direction}_mean_utilisation']:.0%} / "
                f"{link[f'{direction}_peak_utilisation']:.0%}")

    lines += ["", f"Links, both directions (utilisation: mean / peak over "
                  f"{results.get('sample_cycles')}-cycle windows of the workload; up is NIC -> "
                  f"leaf and leaf -> spine; credit stalls at both ends, every VL)", ""]
    lines += _table(["link", "packets", "MiB", "credit-stall cycles", "util up", "util down"], [
        [link["name"] + (f" ({link['cable']})" if link.get("cable") else ""),
         f"{link['packets']:,}", f"{link['bytes'] / 2**20:.2f}",
         f"{link['credit_stall_cycles']:,}", utilisation(link, "up"), utilisation(link, "down")]
        for link in figures["links"]])

    cut = figures["cut"]
    if cut:
        story = [f"cut at workload cycle {cut['cut']:,}" if cut["cut"] is not None else "never cut",
                 f"both ends down at {cut['down']:,}, the cable restored"
                 if cut["down"] is not None else "an end stayed ACTIVE",
                 f"both ends ACTIVE again at {cut['up']:,}" if cut["up"] is not None
                 else "the link did not come back"]
        lines += ["", f"Cable {cut['link']} ({cut['cable']}): " + "; ".join(story)]
    cqes = figures["cqes"]
    cqe_ok = cqes["send_cqes"] == cqes["posted_wqes"] and not cqes.get("errors")

    def loss_verdict(count):
        if cut:
            return "the cut's (judged below)"
        return "ok" if not count else "FAILED (must be 0)"
    checks = [
        ["drops", figures["drops"], loss_verdict(figures["drops"])],
        ["retransmissions", figures["retransmissions"], loss_verdict(figures["retransmissions"])],
        ["receive-buffer overflows", figures["overflows"],
         "ok" if not figures["overflows"] else "FAILED (must be 0)"],
        ["CQEs", f"{cqes['send_cqes']} send for {cqes['posted_wqes']} posted WQEs, "
                 f"{cqes.get('receive_cqes', 0)} receive, {cqes.get('errors', 0)} errors",
         "ok" if cqe_ok else "FAILED"],
        # The scenario's own checks; those the rows above already show, only when they failed.
        *[[name.replace("_", " "), "yes" if passed else "no", "ok" if passed else "FAILED"]
          for name, passed in figures["scenario_checks"].items()
          if not passed or name not in EXPLAINED_CHECKS],
    ]
    lines += ["", "Checks", ""]
    lines += _table(["check", "value", "verdict"], checks)
    lines += ["", "PASSED: every check held" if not figures["failures"] else
              "FAILED: " + "; ".join(figures["failures"])]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_latency(results, path):
    """Histogram of message latency (doorbell to landed, us) per kind (signals per phase), one
    series per hop count."""
    plt = _pyplot()
    clock_ns = results["config"]["clock_ns"]
    messages = _landed(results["messages"])
    kinds = _groups_in_order(messages)
    columns = min(2, max(1, len(kinds)))
    rows = -(-max(1, len(kinds)) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.3 * rows), squeeze=False)
    for ax in axes.flat[len(kinds):]:
        ax.set_visible(False)
    for ax, kind in zip(axes.flat, kinds):
        by_hops = {}
        for m in messages:
            if _group(m) == kind:
                by_hops.setdefault(m["hops"], []).append((m["landed"] - m["posted"]) * clock_ns / 1000)
        every = [v for values in by_hops.values() for v in values]
        low, high = min(every), max(every)
        bins = [low + (high - low) * i / 30 for i in range(31)] if high > low else [low - 0.01, low + 0.01]
        for hops, values in sorted(by_hops.items()):
            ax.hist(values, bins=bins, histtype="step", linewidth=1.5,
                    label=f"{hops} hop{'s' if hops > 1 else ''} ({len(values)})")
        ax.set_title(f"{kind} messages", fontsize=10)
        ax.set_xlabel("doorbell to last byte landed (us)")
        ax.set_ylabel("messages")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_utilisation(results, path):
    """Per-link utilisation over time, one row per cable, up (a -> b) and down (b -> a) side
    by side; time 0 is the workload's start, phase starts marked."""
    plt = _pyplot()
    clock_ns = results["config"]["clock_ns"]
    window_us = results["sample_cycles"] * clock_ns / 1000
    links = results["links"]
    origin = results.get("workload_start")
    if origin is None:
        origin = min((p["start"] for p in results.get("phases", []) if p.get("start") is not None),
                     default=0)
    directions = [(title, key) for title, key in (
        ("up: NIC -> leaf, leaf -> spine", "utilisation"),
        ("down: leaf -> NIC, spine -> leaf", "utilisation_ba")) if any(key in l for l in links)]
    windows = max((len(link.get(key) or []) for link in links for _, key in directions), default=0)
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions) + 1.5,
                                                          max(2.6, 1.2 + 0.28 * len(links))),
                             squeeze=False, sharey=True, layout="constrained")
    for ax, (title, key) in zip(axes[0], directions):
        grid = [list(link.get(key) or []) + [0.0] * (windows - len(link.get(key) or []))
                for link in links]
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0,
                          vmax=1, extent=(0, windows * window_us, len(links) - 0.5, -0.5))
        ax.set_title(title, fontsize=10)
        ax.set_yticks(range(len(links)))
        ax.set_yticklabels([link["name"] for link in links], fontsize=8)
        ax.set_xlabel(f"simulated time since the workload began (us; "
                      f"{results['sample_cycles']}-cycle windows)", fontsize=9)
        for phase in results.get("phases", []):
            if phase.get("start") is None:
                continue
            start = (phase["start"] - origin) * clock_ns / 1000
            ax.axvline(start, color="white", linewidth=0.8, linestyle="--")
            ax.text(start, len(links) - 0.6, f" {phase['name']}", fontsize=8, color="white",
                    va="bottom")
    fig.colorbar(image, ax=list(axes[0]), label="busy (fraction of cycles)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- files -----------------------------------------------------------------------------------

def write_report(results, out_dir, *, files=None):
    """Write report.md, report.json and the plots into ``out_dir``; return the figures.

    ``files``: other files of the run to list in the report (name -> path), e.g. the pcap.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = derive(results)
    plot_latency(results, out_dir / PLOTS["latency"])
    plot_utilisation(results, out_dir / PLOTS["utilisation"])
    listed = {"report": str(out_dir / "report.md"), "figures": str(out_dir / "report.json"),
              **{name: str(out_dir / file) for name, file in PLOTS.items()}, **(files or {})}
    text = summary(results, figures)
    plots = [
        "", "## Plots", "",
        f"![message latency by kind and hop count]({PLOTS['latency']})", "",
        f"![per-link utilisation over time]({PLOTS['utilisation']})", "",
        "## Files", "",
        *_table(["what", "path"], [[name, f"`{path}`"] for name, path in listed.items()]),
    ]
    (out_dir / "report.md").write_text("# make sim report\n\n" + text + "\n" + "\n".join(plots) + "\n")
    (out_dir / "report.json").write_text(json.dumps(
        {"config": results["config"], "figures": figures, "passed": not figures["failures"],
         "files": listed}, indent=1))
    return figures


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="python -m tb.sim_report",
                                     description="Rebuild make sim's report from a results file.")
    parser.add_argument("results", type=Path, help="a scenario_results.json")
    parser.add_argument("--out", type=Path, default=Path("build/sim"),
                        help="output directory (default build/sim)")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    figures = write_report(results, args.out)
    print(summary(results, figures))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
