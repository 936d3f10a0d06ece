"""Longest paths, in LUT levels, of a Yosys JSON netlist mapped to 6-input LUTs.

Pure Python over ``write_json`` output (docs/fpga.md defines the figures): every ``$lut``
is one level, flip-flops and synchronous memory read ports start and end paths, an
asynchronous memory read port costs :func:`async_read_levels`, and module ports start
(inputs) and end (outputs) paths. Paths are classed by their ends: register to register,
input to register, register to output and input to output.
"""
import math
import re

__all__ = ["CLASSES", "async_read_levels", "analyze", "PathError"]

# (start kind, end kind) -> class name, in report order.
CLASSES = {("reg", "reg"): "reg_to_reg", ("in", "reg"): "in_to_reg",
           ("reg", "out"): "reg_to_out", ("in", "out"): "in_to_out"}
_CONSTANTS = {"0", "1", "x", "z"}
_IGNORED = {"$scopeinfo"}


class PathError(Exception):
    """The netlist holds something the analysis cannot time (a loop, an unmapped cell)."""


def async_read_levels(depth):
    """LUT levels of an asynchronous (distributed-RAM) read: one 64-deep LUT RAM, then a
    4:1 multiplexer level (one LUT6) per factor of four beyond it."""
    return 1 + max(0, math.ceil(math.log(depth / 64, 4))) if depth > 64 else 1


def _int(value):
    return int(value, 2) if isinstance(value, str) else int(value)


def _is_ff(cell_type):
    return cell_type.startswith("$_") and ("DFF" in cell_type or "DLATCH" in cell_type)


def _bit_names(module):
    """The most readable name of every net bit: public names before Yosys' own, then short."""
    names = {}
    for name, net in module["netnames"].items():
        rank = (net.get("hide_name", 0), name.count("$"), len(name))
        width = len(net["bits"])
        offset = net.get("offset", 0)
        for k, bit in enumerate(net["bits"]):
            if bit in _CONSTANTS:
                continue
            label = name if width == 1 else f"{name}[{k + offset}]"
            if bit not in names or rank < names[bit][0]:
                names[bit] = (rank, label)
    return {bit: label for bit, (_, label) in names.items()}


def _public(label):
    return "$" not in label


def _memory_ports(cell):
    """``(sync_read_ports, async_read_ports)`` of a ``$mem_v2``: per port, its address and
    data bits."""
    p, c = cell["parameters"], cell["connections"]
    ports, abits, width = _int(p["RD_PORTS"]), _int(p["ABITS"]), _int(p["WIDTH"])
    clocked = _int(p["RD_CLK_ENABLE"])
    sync, asynchronous = [], []
    for k in range(ports):
        entry = (c["RD_ADDR"][k * abits:(k + 1) * abits], c["RD_DATA"][k * width:(k + 1) * width])
        (sync if clocked >> k & 1 else asynchronous).append(entry)
    return sync, asynchronous


def analyze(netlist, top, *, worst=8, boxes=None, port_timing=False):
    """Longest path of each class in module ``top`` of a flattened, LUT-mapped netlist.

    Returns ``{"classes": {class: path or None}, "worst": [path, ...], "cells": {"luts",
    "ffs"}, "memories": [{"name", "depth", "width", "sync_read_ports", "async_read_ports"}]}``;
    a path is ``{"levels", "from", "to", "through", "through_levels"}`` (``through``: the
    named nets on it, start to end; ``through_levels``: the levels at each). ``worst`` lists
    the deepest path into each of the ``worst`` deepest endpoints (one per register, memory
    or port).

    ``boxes``: ``{cell type: timing}`` for black-box cells, each timed by the
    ``port_timing`` of the block it stands for (a block synthesized alone): an input port
    ends a path ``in_to_reg`` levels early, an output port starts one ``reg_to_out`` levels
    in and follows its inputs by ``in_to_out``. ``port_timing``: also return that model of
    this module, ``{"in_to_reg": {port: levels}, "reg_to_out": {port: levels},
    "in_to_out": {output: {input: levels}}}``, the deepest path per port (not per bit)."""
    module = netlist["modules"][top]
    boxes = boxes or {}
    names = _bit_names(module)
    starts = {}         # bit -> (kind, name, levels at the start)
    comb = {}           # driven bit -> [(input bit, levels added), ...]
    ends = []           # (bit, (end kind, end name), levels still to come)
    counts = {"luts": 0, "ffs": 0}
    memories = []

    def drive(bits, sources):
        for bit in bits:
            comb.setdefault(bit, []).extend(sources)

    for port_name, port in module["ports"].items():
        for bit in port["bits"]:
            if bit in _CONSTANTS:
                continue
            if port["direction"] == "input":
                # Per port, a path from an input keeps which one it came from.
                starts[bit] = (("in", port_name) if port_timing else "in", port_name, 0)
            else:
                ends.append((bit, ("out", port_name), 0))

    for cell_name, cell in module["cells"].items():
        kind, conn = cell["type"], cell["connections"]
        if kind in _IGNORED:
            continue
        if kind == "$lut":
            counts["luts"] += 1
            drive(conn["Y"], [(bit, 1) for bit in conn["A"]])
        elif _is_ff(kind):
            counts["ffs"] += 1
            (q,) = conn["Q"]
            register = names.get(q, cell_name)
            starts[q] = ("reg", register, 0)
            for pin, bits in conn.items():
                if pin not in ("Q", "C"):
                    ends.extend((bit, ("reg", f"{register} ({pin})"), 0) for bit in bits)
        elif kind == "$mem_v2":
            memory = cell["parameters"].get("MEMID", cell_name).lstrip("\\")
            sync, asynchronous = _memory_ports(cell)
            memories.append({"name": memory, "depth": _int(cell["parameters"]["SIZE"]),
                             "width": _int(cell["parameters"]["WIDTH"]),
                             "sync_read_ports": len(sync), "async_read_ports": len(asynchronous),
                             "write_ports": _int(cell["parameters"]["WR_PORTS"])})
            for address, data in sync:
                starts.update((bit, ("reg", memory, 0)) for bit in data)
                ends.extend((bit, ("reg", f"{memory} (read address)"), 0) for bit in address)
            levels = async_read_levels(_int(cell["parameters"]["SIZE"]))
            for address, data in asynchronous:
                drive(data, [(bit, levels) for bit in address])
            for pin in ("WR_ADDR", "WR_DATA", "WR_EN", "RD_EN", "RD_SRST", "RD_ARST"):
                ends.extend((bit, ("reg", f"{memory} ({pin})"), 0) for bit in conn.get(pin, ()))
        elif kind.lstrip("\\") in boxes:
            timing = boxes[kind.lstrip("\\")]
            block = cell_name.lstrip("\\")
            for pin, bits in conn.items():
                if pin in timing["in_to_reg"]:
                    inside = timing["in_to_reg"][pin]
                    ends.extend((bit, ("reg", f"{block}.{pin} (then {inside} inside)"), inside)
                                for bit in bits)
            for pin, bits in conn.items():
                if pin in timing["reg_to_out"]:
                    inside = timing["reg_to_out"][pin]
                    starts.update((bit, ("reg", f"{block}.{pin} ({inside} inside)", inside))
                                  for bit in bits if bit not in _CONSTANTS)
                drive(bits, [(bit, levels) for source, levels in
                             timing["in_to_out"].get(pin, {}).items()
                             for bit in conn.get(source, ())])
        else:
            raise PathError(f"{top}: cell {cell_name} of type {kind} is not mapped to LUTs, "
                            f"flip-flops, memories or timed blocks")

    # Per bit and start kind: (levels, the input bit on the deepest path); iterative DFS.
    # A block's output is both a start (its registers) and driven (through it, its inputs).
    best = {}

    def settle(root):
        stack = [(root, False)]
        on_stack = set()
        while stack:
            bit, expanded = stack.pop()
            if bit in best:
                continue
            if bit in _CONSTANTS:
                best[bit] = {}
                continue
            result = {}
            if bit in starts:
                kind, _, levels = starts[bit]
                result[kind] = (levels, None)
            if bit not in comb:
                best[bit] = result      # a start, or undriven: no path starts here
                continue
            if not expanded:
                if bit in on_stack:
                    raise PathError(f"{top}: combinational loop through {names.get(bit, bit)}")
                on_stack.add(bit)
                stack.append((bit, True))
                stack.extend((i, False) for i, _ in comb[bit] if i not in best)
                continue
            on_stack.discard(bit)
            for i, levels in comb[bit]:
                for kind, (lvl, _) in best[i].items():
                    if kind not in result or lvl + levels > result[kind][0]:
                        result[kind] = (lvl + levels, i)
            best[bit] = result

    def trace(bit, kind):
        through, at = [], []
        while True:
            if bit in names and _public(names[bit]) and (not through or through[-1] != names[bit]):
                through.append(names[bit])
                at.append(best[bit][kind][0])
            previous = best[bit][kind][1]
            if previous is None:
                return starts[bit][1], through[::-1], at[::-1]
            bit = previous

    deepest = {}        # class -> path
    per_end = {}        # end name -> deepest path into it
    timing = {"in_to_reg": {}, "reg_to_out": {}, "in_to_out": {}}
    for bit, (end_kind, end_name), still in ends:
        settle(bit)
        for start_kind, (levels, _) in best[bit].items():
            levels += still
            start = start_kind[0] if isinstance(start_kind, tuple) else start_kind
            cls = CLASSES[(start, end_kind)]
            if port_timing:
                if cls == "in_to_reg":
                    table, key = timing["in_to_reg"], start_kind[1]
                elif cls == "reg_to_out":
                    table, key = timing["reg_to_out"], end_name
                elif cls == "in_to_out":
                    table, key = timing["in_to_out"].setdefault(end_name, {}), start_kind[1]
                if cls != "reg_to_reg" and levels > table.get(key, -1):
                    table[key] = levels
            register = register_name(end_name)
            if cls in deepest and deepest[cls]["levels"] >= levels and \
                    per_end.get(register, {"levels": -1})["levels"] >= levels:
                continue
            origin, through, at = trace(bit, start_kind)
            path = {"levels": levels, "class": cls, "from": origin, "to": end_name,
                    "through": through, "through_levels": at}
            if cls not in deepest or levels > deepest[cls]["levels"]:
                deepest[cls] = path
            if levels > per_end.get(register, {"levels": -1})["levels"]:
                per_end[register] = path
    worst_paths = sorted(per_end.values(), key=lambda p: -p["levels"])
    blocks = {}
    for path in worst_paths:
        blocks.setdefault(block_name(path["to"]), path)
    result = {"classes": {cls: deepest.get(cls) for cls in CLASSES.values()},
              "worst": worst_paths[:worst], "blocks": dict(sorted(blocks.items())),
              "cells": counts, "memories": memories}
    if port_timing:
        result["ports"] = timing
    return result


def register_name(name):
    """``receiver.used_blocks[3] (D)`` -> ``receiver.used_blocks``: the register a path names."""
    return re.sub(r"(\[\d+\])?( \(.*\))?$", "", name)


def block_name(name):
    """``port.transmitter.vcrc.state[3] (D)`` -> ``port.transmitter``: the instance, at most
    two levels down, an endpoint belongs to; the top's own registers and ports are ``(top)``."""
    parts = register_name(name).split(".")[:-1]
    return ".".join(parts[:2]) or "(top)"
