"""The switch's AXI4-Lite register map: one Python description, used for hardware and docs.

    python -m hdl.switch.register_map --ports 8 --vls 2 > docs/switch-registers.md

:func:`register_map` is the only place where registers, offsets, widths, access and reset
values are decided. :class:`hdl.switch.switch_registers.SwitchRegisters` builds its
decoder, storage and outputs from it, and :func:`render_markdown` writes the document from
it, so the two cannot drift apart (tb/test_switch_registers.py checks the committed
docs/switch-registers.md against a fresh generation).

Layout (byte offsets; every register is one 32-bit word, fields from bit 0):

- ``0x0000`` global: ID/version, configuration, forwarding-table window.
- ``0x0040 + 4 * sl``: SL-to-VL table, 16 entries of 4 bits (VL 15 = drop).
- ``0x0100 + 0x20 * port``: per-port control and one VL arbitration weight per VL.
- ``0x1000 + 0x100 * port + 0x40 * vl + 4 * k``: read-only counter ``k`` of
  :data:`COUNTER_NAMES` for (port, VL).

The strides are fixed (they do not depend on ``ports`` or ``num_vls``), so a driver can
compute an address without knowing the configuration; registers of ports or VLs the
switch does not have are unmapped (SLVERR).
"""
import argparse
import sys
from typing import NamedTuple

from hdl.link.link_receiver import DROP_REASONS

__all__ = ["Register", "register_map", "render_markdown", "COUNTER_NAMES", "COUNTER_WORDS",
           "ID_VALUE", "VERSION", "DEFAULT_VL_WEIGHT", "FT_FIELDS", "check_config",
           "PORT_BASE", "PORT_STRIDE", "COUNTER_BASE", "COUNTER_PORT_STRIDE",
           "COUNTER_VL_STRIDE", "SL_TO_VL_BASE", "HOQ_TICK_CYCLES", "MAX_PORTS", "MAX_VLS", "OKAY", "SLVERR"]

# Register map version: bump the low half on additions, the high byte on incompatible moves.
VERSION = 0x0001
ID_VALUE = 0x5446_0000 | VERSION        # "TF" in the high half

MAX_PORTS = 16
MAX_VLS = 4

SL_TO_VL_BASE = 0x0040
PORT_BASE = 0x0100
PORT_STRIDE = 0x20                      # ctrl + up to MAX_VLS weights
COUNTER_BASE = 0x1000
COUNTER_VL_STRIDE = 0x40                # 16 words: up to 16 counters per (port, VL)
COUNTER_PORT_STRIDE = COUNTER_VL_STRIDE * MAX_VLS

DEFAULT_VL_WEIGHT = 16                  # 64-byte blocks per VL turn (link transmitter's unit)
HOQ_TICK_CYCLES = 16                    # unit of the head-of-queue lifetime

# AXI responses.
OKAY = 0b00
SLVERR = 0b10

# Forwarding-table window fields (ft_write, ft_read_data): (name, low bit, width).
FT_FIELDS = (("lid", 0, 16), ("port", 16, 4), ("valid", 31, 1))

# Per-port per-VL counters, in address order: (name, what it counts).
COUNTER_WORDS = (
    ("packets_in", "data packets accepted into this input port's buffer on this VL, at "
                   "their start beat (good, or dropped later, e.g. for a bad VCRC; a packet "
                   "rejected at its start beat counts only in its drop counter)"),
    ("packets_out", "data packets sent on this output port on this VL"),
    ("bytes_in", "bytes of those packets, LRH through ICRC (4 x LRH.PktLen)"),
    ("bytes_out", "bytes of those packets, LRH through ICRC (4 x LRH.PktLen)"),
    ("credit_stall_cycles", "cycles in which some input had a packet for this output port "
                            "and VL at the head of a queue that waited because the downstream "
                            "credit did not cover it"),
    *((f"drop_{reason}", f"input packets dropped (or, cut through, marked end-bad) "
                         f"for reason `{reason}` (docs/link.md, Drop reasons)")
      for reason in DROP_REASONS),
    ("drop_unknown_dlid", "input packets dropped because their DLID missed the forwarding "
                          "table (beyond the table or an invalid entry)"),
    ("drop_hoq_lifetime", "packets for this output port and VL discarded unsent because they "
                          "headed their queue for longer than `hoq_lifetime` (IBA HOQLife), or "
                          "while the output's link was down after having been up (it failed or "
                          "its peer was reset: docs/link.md)"),
)
COUNTER_NAMES = tuple(name for name, _ in COUNTER_WORDS)
assert len(COUNTER_NAMES) * 4 <= COUNTER_VL_STRIDE


class Register(NamedTuple):
    """One 32-bit register. ``width`` bits from bit 0 are implemented; the bits above read 0
    and are ignored on write.

    ``access``: ``RO`` read-only (writes answer SLVERR and change nothing); ``RW`` stored,
    read back as written; ``RWS`` like ``RW``, and a write also commits (see description).
    ``binding`` tells the hardware what the register is: ``("const",)``,
    ``("ft_write",)``, ``("ft_read_lid",)``, ``("ft_read_data",)``, ``("sl_to_vl", sl)``,
    ``("port_enable", port)``, ``("vl_weight", port, vl)``, ``("hoq_lifetime",)``,
    ``("counter", port, vl, name)``.
    """
    name: str
    offset: int
    width: int
    access: str
    reset: int
    description: str
    binding: tuple


def check_config(ports, num_vls, lids):
    if not isinstance(ports, int) or not 2 <= ports <= MAX_PORTS:
        raise ValueError(f"Ports must be an integer from 2 to {MAX_PORTS}, not {ports!r}")
    if not isinstance(num_vls, int) or not 1 <= num_vls <= MAX_VLS:
        raise ValueError(f"Data VLs must be an integer from 1 to {MAX_VLS}, not {num_vls!r}")
    if (not isinstance(lids, int) or lids < 2 or lids > 65536 or lids & (lids - 1)):
        raise ValueError(f"Forwarding-table LIDs must be a power of two from 2 to 65536, "
                         f"not {lids!r}")


def _fields(fields):
    return ", ".join(f"{name} [{lo + width - 1}:{lo}]" if width > 1 else f"{name} [{lo}]"
                     for name, lo, width in fields)


def register_map(ports=8, num_vls=2, lids=1024):
    """The register list for a switch of ``ports`` ports and ``num_vls`` data VLs whose
    forwarding table has ``lids`` entries, in address order."""
    check_config(ports, num_vls, lids)
    ft = _fields(FT_FIELDS)
    regs = [
        Register("id", 0x0000, 32, "RO", ID_VALUE, f"Identification: 0x5446 (\"TF\") in [31:16], "
                 f"register-map version in [15:0] (this map: {VERSION:#06x})", ("const",)),
        Register("ports", 0x0004, 5, "RO", ports, "Number of switch ports", ("const",)),
        Register("num_vls", 0x0008, 3, "RO", num_vls, "Number of data VLs", ("const",)),
        Register("ft_lids", 0x000C, 17, "RO", lids,
                 "Forwarding-table entries: DLIDs 0 .. ft_lids - 1 are programmable, DLIDs at "
                 "or beyond it always miss (drop_unknown_dlid)", ("const",)),
        Register("ft_write", 0x0010, 32, "RWS", 0,
                 f"Forwarding-table write: {ft}. A write stores the entry for `lid` (output "
                 f"`port`, `valid` 0 removes it) in the forwarding table and its shadow copy; "
                 f"the table write happens in the cycle in which the write response (bvalid) "
                 f"rises; a lookup presented in that cycle still gets the old entry, later ones the "
                 f"new entry. `lid` >= "
                 f"ft_lids or `port` >= ports: SLVERR, nothing written. Reads return the last "
                 f"value written (bits 30:20 always 0)", ("ft_write",)),
        Register("ft_read_lid", 0x0014, 16, "RW", 0,
                 "Forwarding-table readback: the LID that ft_read_data shows (>= ft_lids: "
                 "SLVERR, unchanged)", ("ft_read_lid",)),
        Register("ft_read_data", 0x0018, 32, "RO", 0,
                 f"Forwarding-table readback: the entry of LID ft_read_lid, {ft}, read from a "
                 f"shadow copy of the table that every ft_write also writes",
                 ("ft_read_data",)),
        Register("hoq_lifetime", 0x001C, 16, "RW", 0,
                 f"Head-of-queue lifetime (IBA HOQLife), in units of {HOQ_TICK_CYCLES} cycles; "
                 f"0 = unlimited. A packet that heads its queue (waiting for its output, its VL's "
                 f"turn or downstream credit) for longer than this is discarded without being "
                 f"sent and counted in its output's drop_hoq_lifetime, so that a dead or "
                 f"credit-starved output cannot hold an input's buffer, and with it the input's "
                 f"other flows, for ever", ("hoq_lifetime",)),
    ]
    for sl in range(16):
        regs.append(Register(
            f"sl_to_vl_{sl}", SL_TO_VL_BASE + 4 * sl, 4, "RW", sl % num_vls,
            f"VL for packets of SL {sl}; 15 = drop (a VL >= num_vls other than 15 is also "
            f"not a data VL: dropped as invalid_vl)", ("sl_to_vl", sl)))
    for p in range(ports):
        base = PORT_BASE + PORT_STRIDE * p
        regs.append(Register(f"port{p}_ctrl", base, 1, "RW", 1,
                             f"Port {p} control: enable [0] (0: the port takes no new packets)",
                             ("port_enable", p)))
        for v in range(num_vls):
            regs.append(Register(
                f"port{p}_vl{v}_weight", base + 4 + 4 * v, 8, "RW", DEFAULT_VL_WEIGHT,
                f"Port {p} output VL arbitration weight of VL {v}: 64-byte blocks per turn "
                f"(at least one packet per turn)", ("vl_weight", p, v)))
    for p in range(ports):
        for v in range(num_vls):
            base = COUNTER_BASE + COUNTER_PORT_STRIDE * p + COUNTER_VL_STRIDE * v
            for k, (name, words) in enumerate(COUNTER_WORDS):
                regs.append(Register(f"port{p}_vl{v}_{name}", base + 4 * k, 32, "RO", 0,
                                     f"Port {p} VL {v}: {words}", ("counter", p, v, name)))
    offsets = [r.offset for r in regs]
    assert len(set(offsets)) == len(offsets) and offsets == sorted(offsets)
    assert all(r.offset % 4 == 0 and 1 <= r.width <= 32 and r.reset >> r.width == 0 for r in regs)
    return regs


def address_bits(regs):
    """Smallest AXI address width that reaches every register."""
    return max(r.offset for r in regs).bit_length()


def render_markdown(ports=8, num_vls=2, lids=1024):
    regs = register_map(ports, num_vls, lids)
    lines = [
        "# Switch registers (AXI4-Lite)",
        "",
        f"Register map of `SwitchRegisters(ports={ports}, num_vls={num_vls}, lids={lids})` "
        f"(`hdl/switch/switch_registers.py`), version {VERSION:#06x}.",
        "",
        f"Generated by `python -m hdl.switch.register_map --ports {ports} --vls {num_vls}"
        f"{'' if lids == 1024 else f' --lids {lids}'}` from `hdl/switch/register_map.py`, the "
        f"same description the hardware is built from; do not edit. "
        f"`tb/test_switch_registers.py` fails when this file and the code disagree.",
        "",
        "## Bus",
        "",
        "- AXI4-Lite slave, 32-bit data, byte addresses; ports `axi__awaddr`, `axi__wdata`, ... "
        "(no AWPROT/ARPROT). Address bits [1:0] are ignored.",
        "- One transaction at a time; a write takes the address and data in either order or "
        "together. When a read and a write are offered in the same cycle they alternate.",
        "- `wstrb` is honoured per byte lane for every writable register (the bytes not strobed "
        "keep their value; for `ft_write` the merged word is what is committed).",
        "- Unmapped addresses (including registers of ports or VLs this configuration does not "
        "have), writes to `RO` registers and writes of out-of-range values answer SLVERR "
        "(`0b10`) and change nothing; an unmapped read returns 0.",
        "- Bits above a register's width read 0 and are ignored on write.",
        "- Access: `RO` read-only, `RW` read/write, `RWS` read/write and the write commits an "
        "action.",
        "",
        "## Layout",
        "",
        "| region | address |",
        "|---|---|",
        "| global | `0x0000` .. `0x001C` |",
        f"| SL-to-VL | `{SL_TO_VL_BASE:#06x} + 4 * sl` |",
        f"| port control and VL weights | `{PORT_BASE:#06x} + {PORT_STRIDE:#x} * port` "
        f"(+0 ctrl, +4 + 4 * vl weight) |",
        f"| counters | `{COUNTER_BASE:#06x} + {COUNTER_PORT_STRIDE:#x} * port + "
        f"{COUNTER_VL_STRIDE:#x} * vl + 4 * k` |",
        "",
        "The strides do not depend on the configuration. Counter `k`:",
        "",
        "| k | counter | counts |",
        "|---:|---|---|",
    ]
    lines += [f"| {k} | `{name}` | {words} |" for k, (name, words) in enumerate(COUNTER_WORDS)]
    lines += [
        "",
        "Counters are 32-bit, free running, wrapping (software takes differences); the "
        "switch datapath owns them, this block only reads them. Input counters "
        "(`packets_in`, `bytes_in`, `drop_*`) count on the VL the arriving packet's LRH "
        "names, and on VL 0 when that is not a data VL (`drop_invalid_vl`, and "
        "`drop_malformed`/`drop_link_down` of such packets); a packet whose SL maps to VL 15 "
        "counts as `drop_invalid_vl` on its arriving VL. Output counters (`packets_out`, "
        "`bytes_out`, `credit_stall_cycles`) count on the output VL, `sl_to_vl[SL]`.",
        "",
        f"## Registers ({len(regs)}; address bits needed: {address_bits(regs)})",
        "",
        "| offset | name | width | access | reset | description |",
        "|---|---|---:|---|---|---|",
    ]
    for r in regs:
        lines.append(f"| `{r.offset:#06x}` | `{r.name}` | {r.width} | {r.access} | "
                     f"`{r.reset:#x}` | {r.description} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hdl.switch.register_map",
                                     description="Write the switch register map as Markdown.")
    parser.add_argument("--ports", type=int, default=8)
    parser.add_argument("--vls", type=int, default=2)
    parser.add_argument("--lids", type=int, default=1024)
    args = parser.parse_args(argv)
    try:
        text = render_markdown(args.ports, args.vls, args.lids)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
