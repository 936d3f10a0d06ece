"""The NIC's AXI4-Lite register map: one Python description, used for hardware and docs.

    python -m hdl.nic.register_map > docs/nic-registers.md

:func:`register_map` is the only place where registers, context-table words, offsets,
fields, access and reset values are decided. :class:`hdl.nic.nic_registers.NicRegisters`
builds its decoder, storage and outputs from it, and :func:`render_markdown` writes the
document from it, so the two cannot drift apart (tb/test_nic_registers.py checks the
committed docs/nic-registers.md against a fresh generation).

Layout (byte offsets; every register is one 64-bit word at an 8-byte stride):

- ``0x0000``: global registers (ID, configuration, SLID, SL-to-VL, VL weights, link).
- ``0x1000 .. 0x1FFF``: the UAR page; any 8-byte write is a doorbell.
- ``0x2000 + 8 * k``: read-only counter ``k`` (:func:`counter_words`).
- ``0x4000 + 0x40 * qpn``, ``0x8000 + 0x20 * cqn``, ``0xC000 + 0x20 * index``: the QP, CQ
  and memory-key context tables, one word per group of fields (:data:`QP_WORDS`, ...).

The bases and strides are fixed (they do not depend on the configuration), so a driver can
compute an address without knowing it; entries the NIC does not have are unmapped (SLVERR).
"""
import argparse
import sys
from typing import NamedTuple

from hdl.nic.signatures import COUNTERS, MAX_OUTSTANDING_BLOCKS

__all__ = ["Field", "Register", "ContextWord", "ContextTable", "RegisterMap", "register_map",
           "render_markdown", "check_config", "counter_words", "field_value", "place_fields",
           "register_offset", "context_offset",
           "VERSION", "ID_VALUE", "DEFAULT_VL_WEIGHT", "MAX_ENTRIES", "MAX_VLS",
           "UAR_BASE", "UAR_SIZE", "COUNTER_BASE", "COUNTER_SPACE", "OWN_COUNTERS",
           "QP_BASE", "QP_STRIDE", "CQ_BASE", "CQ_STRIDE", "MKEY_BASE", "MKEY_STRIDE",
           "QP_WORDS", "CQ_WORDS", "MKEY_WORDS", "CONFIG_FIELDS", "LINK_FIELDS",
           "ADDRESS_BITS", "OKAY", "SLVERR"]

# Register map version: bump the low half on additions, the high byte on incompatible moves.
VERSION = 0x0001
ID_VALUE = 0x5446_4E43 << 32 | VERSION      # "TFNC" (tokenfabric NIC) in the high half

MAX_ENTRIES = 256           # QPs, CQs, memory keys: QPN_BITS / CQN_BITS are 8
MAX_VLS = 8                 # the VL weights are 8 bytes of one word

UAR_BASE = 0x1000
UAR_SIZE = 0x1000
COUNTER_BASE = 0x2000
COUNTER_SPACE = 0x1000      # room for 512 counters
QP_BASE = 0x4000
QP_STRIDE = 0x40            # 8 words per QP
CQ_BASE = 0x8000
CQ_STRIDE = 0x20            # 4 words per CQ
MKEY_BASE = 0xC000
MKEY_STRIDE = 0x20          # 4 words per memory key
ADDRESS_BITS = 16           # the map ends below 0xE000

DEFAULT_VL_WEIGHT = 16      # 64-byte blocks per VL turn (the link transmitter's unit)

# AXI responses.
OKAY = 0b00
SLVERR = 0b10

# The register block's own counters, ahead of the datapath's (their offsets do not move
# when a block adds a counter).
OWN_COUNTERS = (
    ("doorbells_partial", "UAR writes whose `wstrb` was not 0xFF (ignored, answered OKAY)"),
    ("register_write_errors", "register writes answered SLVERR (unmapped, read-only, "
                              "out-of-range value, refused QP transition, QP context "
                              "write outside RESET)"),
)


class Field(NamedTuple):
    """``width`` bits at bit ``lo`` of a 64-bit word."""
    name: str
    lo: int
    width: int


class Register(NamedTuple):
    """One 64-bit register; bits outside ``fields`` read 0 and are ignored on write.

    ``access``: ``RO`` read-only (writes answer SLVERR); ``RW`` read back as written.
    ``binding`` tells the hardware what the register is: ``("const",)``, ``("slid",)``,
    ``("sl_to_vl",)``, ``("vl_weight",)``, ``("link",)``, ``("counter", k)`` (input
    ``counters[k]``), ``("own_counter", name)``.
    """
    name: str
    offset: int
    access: str
    reset: int
    fields: tuple
    description: str
    binding: tuple


class ContextWord(NamedTuple):
    """Word ``index`` of a context-table entry; each field is the field of that name of the
    table's record (``signatures.py``), except the QP's ``state``."""
    index: int
    name: str
    fields: tuple
    description: str


class ContextTable(NamedTuple):
    name: str
    base: int
    stride: int
    count: int
    words: tuple
    description: str


class RegisterMap(NamedTuple):
    registers: tuple
    tables: tuple       # QP, CQ, memory key, in that order


CONFIG_FIELDS = (Field("num_qps", 0, 9), Field("num_cqs", 16, 9), Field("num_mkeys", 32, 9),
                 Field("num_vls", 48, 4))
LINK_FIELDS = (Field("link_state", 0, 2), Field("link_inits", 32, 32))

QP_WORDS = (
    ContextWord(0, "state", (Field("state", 0, 3),),
                "Read: the QP's state (0 RESET, 3 RTS, 6 ERR). Write: a transition request "
                "(see QP states)"),
    ContextWord(1, "sq_base", (Field("sq_base", 0, 64),),
                "Byte address of WQE basic block 0; aligned to min(4096, 64 << log_sq_size)"),
    ContextWord(2, "sq_config", (Field("log_sq_size", 0, 4), Field("mtu", 8, 3),
                                 Field("sl", 16, 4), Field("max_outstanding", 24, 7),
                                 Field("log_rq_size", 32, 4), Field("rcqn", 40, 8),
                                 Field("retry_cnt", 48, 3), Field("rnr_retry", 52, 3),
                                 Field("ack_timeout", 56, 5)),
                "Send queue of 2**log_sq_size basic blocks; IBA path MTU code (1 = 256 B .. "
                "5 = 4096 B); service level; WQE basic blocks fetched and not yet completed "
                f"(1..{MAX_OUTSTANDING_BLOCKS}); receive queue of 2**log_rq_size WQEs of 16 bytes; the CQ of receive "
                "completions (< num_cqs); retransmissions allowed after a timeout or sequence "
                "NAK, and after an RNR NAK (7: without limit); local ACK timeout 4.096 us * "
                "2**ack_timeout (0: none)"),
    ContextWord(3, "dest", (Field("dest_qpn", 0, 24), Field("dlid", 32, 16),
                            Field("min_rnr_timer", 48, 5)),
                "Destination QP number and LID (requests from another LID are dropped); the "
                "IBA timer code sent in RNR NAKs"),
    ContextWord(4, "protection", (Field("pd", 0, 24), Field("pkey", 32, 16),
                                  Field("access", 48, 4)),
                "Protection domain (memory keys must match it), partition key, and the remote "
                "rights the QP grants (2 REMOTE_WRITE, 4 REMOTE_READ, 8 REMOTE_ATOMIC)"),
    ContextWord(5, "psn_cq", (Field("sq_psn", 0, 24), Field("cqn", 32, 8),
                              Field("rq_psn", 40, 24)),
                "PSN of the first packet after RESET -> RTS; the QP's send CQ (< num_cqs); the "
                "first request PSN the responder expects after RESET -> RTS"),
    ContextWord(6, "rq_base", (Field("rq_base", 0, 64),),
                "Byte address of receive WQE 0 (`mlx5_wqe_data_seg`, 16 bytes each); aligned "
                "to 16"),
    ContextWord(7, "rq_dbr", (Field("rq_dbr", 0, 64),),
                "Byte address of the receive doorbell record (a big-endian 32-bit counter, the "
                "low 16 bits the receive producer index); aligned to 4"),
)
CQ_WORDS = (
    ContextWord(0, "base", (Field("base", 0, 64),), "Byte address of CQE 0"),
    ContextWord(1, "config", (Field("log_size", 0, 4), Field("collapsed", 8, 1)),
                "2**log_size CQEs of 64 bytes; collapsed: every CQE goes to entry 0"),
)
MKEY_WORDS = (
    ContextWord(0, "key", (Field("key", 0, 32), Field("access", 32, 4), Field("valid", 63, 1)),
                "The key (`index << 8` plus an 8-bit variant: the executor looks key k up at "
                "index `(k >> 8) mod num_mkeys`), access rights (1 LOCAL_WRITE, 2 REMOTE_WRITE, "
                "4 REMOTE_READ, 8 REMOTE_ATOMIC), entry valid"),
    ContextWord(1, "pd", (Field("pd", 0, 24),), "Protection domain"),
    ContextWord(2, "base", (Field("base", 0, 64),), "Start byte address of the region"),
    ContextWord(3, "length", (Field("length", 0, 64),), "Length of the region in bytes"),
)


def field_value(word, fields, name):
    """Python helper: the value of field ``name`` in the 64-bit ``word``."""
    for f in fields:
        if f.name == name:
            return word >> f.lo & ((1 << f.width) - 1)
    raise KeyError(name)


def place_fields(fields, **values):
    """Python helper: a 64-bit word with the named field values."""
    word = 0
    for f in fields:
        word |= (values.get(f.name, 0) & ((1 << f.width) - 1)) << f.lo
    return word


def register_offset(name):
    """Byte offset of the global register or counter ``name`` (the same in every
    configuration)."""
    for reg in register_map().registers:
        if reg.name == name:
            return reg.offset
    raise KeyError(name)


def context_offset(table, index, word):
    """Byte offset of the word named ``word`` of entry ``index`` of context table ``table``
    (``"qp"``, ``"cq"`` or ``"mkey"``)."""
    base, stride, words = {"qp": (QP_BASE, QP_STRIDE, QP_WORDS),
                           "cq": (CQ_BASE, CQ_STRIDE, CQ_WORDS),
                           "mkey": (MKEY_BASE, MKEY_STRIDE, MKEY_WORDS)}[table]
    if not 0 <= index < MAX_ENTRIES:
        raise ValueError(f"Context index must be 0 to {MAX_ENTRIES - 1}, not {index!r}")
    for w in words:
        if w.name == word:
            return base + stride * index + 8 * w.index
    raise KeyError(word)


def counter_words():
    """Every counter in address order: (name, block, what it counts); the register block's
    own first, then :data:`hdl.nic.signatures.COUNTERS` flattened in dict order (input
    ``counters[k - len(OWN_COUNTERS)]``)."""
    own = tuple((name, "NicRegisters", words) for name, words in OWN_COUNTERS)
    return own + tuple((name, block, words) for block, counters in COUNTERS.items()
                       for name, words in counters)


def check_config(num_qps, num_cqs, num_mkeys, num_vls):
    for what, value in (("QPs", num_qps), ("CQs", num_cqs)):
        if not isinstance(value, int) or not 1 <= value <= MAX_ENTRIES:
            raise ValueError(f"Number of {what} must be an integer from 1 to {MAX_ENTRIES}, "
                             f"not {value!r}")
    if (not isinstance(num_mkeys, int) or not 1 <= num_mkeys <= MAX_ENTRIES
            or num_mkeys & (num_mkeys - 1)):
        raise ValueError(f"Number of memory keys must be a power of two from 1 to "
                         f"{MAX_ENTRIES}, not {num_mkeys!r}")
    if not isinstance(num_vls, int) or not 1 <= num_vls <= MAX_VLS:
        raise ValueError(f"Data VLs must be an integer from 1 to {MAX_VLS}, not {num_vls!r}")


def _reset_sl_to_vl(num_vls):
    return sum((sl % num_vls) << 4 * sl for sl in range(16))


def register_map(num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2):
    """The registers (address order) and context tables of a NIC with this configuration."""
    check_config(num_qps, num_cqs, num_mkeys, num_vls)
    regs = [
        Register("id", 0x0000, "RO", ID_VALUE,
                 (Field("version", 0, 16), Field("magic", 32, 32)),
                 f"Identification: 0x54464E43 (\"TFNC\") in [63:32], register-map version in "
                 f"[15:0] (this map: {VERSION:#06x})", ("const",)),
        Register("config", 0x0008, "RO",
                 place_fields(CONFIG_FIELDS, num_qps=num_qps, num_cqs=num_cqs,
                              num_mkeys=num_mkeys, num_vls=num_vls),
                 CONFIG_FIELDS, "Configuration: QPs, CQs, memory keys, data VLs", ("const",)),
        Register("slid", 0x0010, "RW", 0, (Field("slid", 0, 16),),
                 "Source LID of every packet the NIC sends", ("slid",)),
        Register("sl_to_vl", 0x0018, "RW", _reset_sl_to_vl(num_vls),
                 tuple(Field(f"vl_of_sl{sl}", 4 * sl, 4) for sl in range(16)),
                 "VL for packets of SL s in [4s+3:4s]; 15 = no data VL (a WQE on such a QP "
                 "completes with LOCAL_QP_OP_ERR). A write naming a VL >= num_vls other than "
                 "15 answers SLVERR and changes nothing. Reset: SL s -> VL s mod num_vls",
                 ("sl_to_vl",)),
        Register("vl_weights", 0x0020, "RW",
                 sum(DEFAULT_VL_WEIGHT << 8 * v for v in range(num_vls)),
                 tuple(Field(f"weight_vl{v}", 8 * v, 8) for v in range(num_vls)),
                 "Output VL arbitration weight of VL v in [8v+7:8v]: 64-byte blocks per turn "
                 "(at least one packet per turn)", ("vl_weight",)),
        Register("link", 0x0028, "RO", 0, LINK_FIELDS,
                 "Link status: link_state [1:0] as the link port reports it, link_inits "
                 "[63:32] (re-initialisations: times the link went from ACTIVE back to INIT, on "
                 "the peer's INIT packet (the peer was reset) or on a failed link (no flow-control "
                 "packet for fail_timeout cycles); 0 after the first bring-up, wrapping; "
                 "docs/link.md)", ("link",)),
    ]
    for k, (name, block, words) in enumerate(counter_words()):
        binding = (("own_counter", name) if k < len(OWN_COUNTERS)
                   else ("counter", k - len(OWN_COUNTERS)))
        regs.append(Register(name, COUNTER_BASE + 8 * k, "RO", 0, (Field(name, 0, 32),),
                             f"{block}: {words}", binding))
    tables = (
        ContextTable("qp", QP_BASE, QP_STRIDE, num_qps, QP_WORDS,
                     "QP context (QpConfigLayout) and state"),
        ContextTable("cq", CQ_BASE, CQ_STRIDE, num_cqs, CQ_WORDS, "CQ context (CqConfigLayout)"),
        ContextTable("mkey", MKEY_BASE, MKEY_STRIDE, num_mkeys, MKEY_WORDS,
                     "Memory-key table entry (MkeyLayout)"),
    )
    offsets = [r.offset for r in regs]
    assert len(set(offsets)) == len(offsets) and offsets == sorted(offsets)
    assert len(counter_words()) * 8 <= COUNTER_SPACE
    for r in regs:
        assert r.offset % 8 == 0 and (r.offset < UAR_BASE
                                      or COUNTER_BASE <= r.offset < COUNTER_BASE + COUNTER_SPACE)
        assert r.reset == place_fields(r.fields, **{f.name: field_value(r.reset, r.fields, f.name)
                                                    for f in r.fields})
    for t in tables:
        assert t.base + t.stride * MAX_ENTRIES <= 1 << ADDRESS_BITS
        assert len(t.words) * 8 <= t.stride and t.stride & (t.stride - 1) == 0
    return RegisterMap(tuple(regs), tables)


def _fields(fields):
    return ", ".join(f"{f.name} [{f.lo + f.width - 1}:{f.lo}]" if f.width > 1
                     else f"{f.name} [{f.lo}]" for f in fields)


def render_markdown(num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2):
    rmap = register_map(num_qps, num_cqs, num_mkeys, num_vls)
    args = "".join(f" --{opt} {value}" for opt, value, default in (
        ("qps", num_qps, 64), ("cqs", num_cqs, 16), ("mkeys", num_mkeys, 64),
        ("vls", num_vls, 2)) if value != default)
    lines = [
        "# NIC registers (AXI4-Lite)",
        "",
        f"Register map of `NicRegisters(num_qps={num_qps}, num_cqs={num_cqs}, "
        f"num_mkeys={num_mkeys}, num_vls={num_vls})` (`hdl/nic/nic_registers.py`), version "
        f"{VERSION:#06x}.",
        "",
        f"Generated by `python -m hdl.nic.register_map{args}` from `hdl/nic/register_map.py`, "
        f"the same description the hardware is built from; do not edit. "
        f"`tb/test_nic_registers.py` fails when this file and the code disagree.",
        "",
        "## Bus",
        "",
        "- AXI4-Lite slave, **64-bit data** (so a GPU's 8-byte doorbell is one atomic write), "
        "byte addresses; ports `axi__awaddr`, `axi__wdata`, ... (no AWPROT/ARPROT). Address "
        "bits [2:0] are ignored; address bits at or above bit 16 must be 0 (otherwise "
        "unmapped).",
        "- One transaction at a time; a write takes the address and data in either order or "
        "together. When a read and a write are offered in the same cycle they alternate. A "
        "write takes 4 cycles plus the master's ready, a read 4.",
        "- `wstrb` is honoured per byte lane for every writable register and context word (the "
        "bytes not strobed keep their value; the merged word is what is checked and "
        "committed). UAR writes are the exception: only full 8-byte writes count.",
        "- Unmapped addresses (including entries beyond num_qps/num_cqs/num_mkeys and words "
        "beyond an entry's last), writes to `RO` registers, out-of-range values and refused "
        "QP writes (below) answer SLVERR (`0b10`), change nothing and count in "
        "`register_write_errors`. An unmapped read answers SLVERR with data 0.",
        "- Bits outside a register's fields read 0 and are ignored on write.",
        "",
        "## Layout",
        "",
        "| region | address |",
        "|---|---|",
        "| global registers | `0x0000` .. `0x0028` |",
        f"| UAR page (doorbells) | `{UAR_BASE:#06x}` .. `{UAR_BASE + UAR_SIZE - 1:#06x}` |",
        f"| counters | `{COUNTER_BASE:#06x} + 8 * k` |",
        f"| QP contexts | `{QP_BASE:#06x} + {QP_STRIDE:#x} * qpn + 8 * word` |",
        f"| CQ contexts | `{CQ_BASE:#06x} + {CQ_STRIDE:#x} * cqn + 8 * word` |",
        f"| memory keys | `{MKEY_BASE:#06x} + {MKEY_STRIDE:#x} * index + 8 * word` |",
        "",
        "The bases and strides do not depend on the configuration.",
        "",
        "## Doorbells (UAR page)",
        "",
        f"Every 8-byte-aligned write in `{UAR_BASE:#06x}` .. `{UAR_BASE + UAR_SIZE - 1:#06x}` "
        "is a doorbell, as mlx5 maps its doorbell/BlueFlame registers per UAR: the 8 bytes are "
        "the first 8 bytes of the WQE's control segment, big-endian, as NVSHMEM IBGDA writes "
        "them. Byte lanes 0..3 are `opmod_idx_opcode` (big-endian): the producer index is its "
        "bits 23..8, lanes 1 (high byte) and 2. Byte lanes 4..7 are `qpn_ds` (big-endian): the "
        "QP number is its bits 31..8, lanes 4 (high byte), 5 and 6. The other lanes are "
        "ignored. One doorbell `(qpn, pi)` goes to the doorbell scheduler per write, with the "
        "raw 24-bit QPN (the scheduler checks its range). A UAR write whose `wstrb` is not "
        "0xFF is ignored, answered OKAY (a GPU thread cannot handle a bus error) and counted "
        "in `doorbells_partial`. UAR reads return 0, OKAY.",
        "",
        "## Contexts",
        "",
        "QP, CQ and memory-key contexts live in block RAMs (`lib.memory`), written by a "
        "read-modify-write of one 64-bit word of an entry and read by the datapath through "
        "synchronous read ports. The RAMs are not cleared by reset: after power-up or reset "
        "every entry must be programmed before use (memory keys: write every entry, or at "
        "least its `valid` bit, before any QP leaves RESET). Fields are those of "
        "`QpConfigLayout`, `CqConfigLayout` and `MkeyLayout` (`hdl/nic/signatures.py`). "
        "Words beyond an entry's last are unmapped.",
        "",
        "CQ contexts and memory keys may be written at any time; a datapath read port that "
        "holds the entry's address shows the new value from the cycle after the first cycle "
        "of the write response. Changing a CQ or memory key that a running QP uses is the "
        "host's problem (as on mlx5: destroy and recreate it while nothing uses it).",
        "",
    ]
    for table in rmap.tables:
        lines += [
            f"### {table.description}: `{table.base:#06x} + {table.stride:#x} * n`, "
            f"n < {table.count}",
            "",
            "| word | offset | name | fields | description |",
            "|---:|---|---|---|---|",
        ]
        lines += [f"| {w.index} | `+{8 * w.index:#04x}` | `{w.name}` | {_fields(w.fields)} | "
                  f"{w.description} |" for w in table.words]
        lines.append("")
    lines += [
        "## QP states",
        "",
        "A QP is in RESET after reset. Word 0 reads the state; writing it requests a "
        "transition (the merged word's bits [2:0]):",
        "",
        "| from | write | result |",
        "|---|---|---|",
        "| RESET | 0 (RESET) | stays RESET; `qp_reset` strobe (every block clears the QP's "
        "runtime state) |",
        f"| RESET | 3 (RTS) | RTS if the context is valid: `mtu` 1..5, `max_outstanding` 1..{MAX_OUTSTANDING_BLOCKS}, "
        "`cqn` and `rcqn` < num_cqs, `sq_base` aligned to min(4096, 64 << `log_sq_size`), "
        "`rq_base` aligned to 16, `rq_dbr` aligned to 4; otherwise "
        "SLVERR, stays RESET |",
        "| RTS, ERR | 0 (RESET) | RESET and `qp_reset` strobe if the QP is idle (`qp_busy` "
        "low); otherwise SLVERR, unchanged |",
        "| RTS | 6 (ERR) | ERR (the QP's WQEs flush) |",
        "| RTS | 3 (RTS) | unchanged, OKAY |",
        "| ERR | 6 (ERR) | unchanged, OKAY (the datapath may have errored the QP first) |",
        "| RESET | 6 (ERR) | SLVERR, unchanged (nothing to flush) |",
        "| ERR | 3 (RTS) | SLVERR, unchanged (reset the QP first) |",
        "| any | other values | SLVERR, unchanged |",
        "",
        "Words 1.. of a QP context are writable only in RESET (otherwise SLVERR, unchanged). "
        "The datapath moves a QP from RTS to ERR (`qp_error` strobes from the executor, "
        "the completion unit and the responder engine; ignored in RESET and ERR); a host write of the same QP in the "
        "same cycle that changes its state takes precedence. `qp_log_sq_size` and "
        "`qp_max_outstanding` (flip-flop copies for the scheduler) are loaded when word 2 is "
        "written and again on RESET -> RTS, so they match the context whenever the QP is not "
        "in RESET.",
        "",
        "## Counters",
        "",
        "32-bit, free running, wrapping (software takes differences); in bits [31:0] of their "
        "word. The datapath's counters are owned by the block named and only read here "
        "(`counters[k - 2]`); the first two are this block's own.",
        "",
        f"## Registers ({len(rmap.registers)})",
        "",
        "| offset | name | access | reset | fields | description |",
        "|---|---|---|---|---|---|",
    ]
    for r in rmap.registers:
        lines.append(f"| `{r.offset:#06x}` | `{r.name}` | {r.access} | `{r.reset:#x}` | "
                     f"{_fields(r.fields)} | {r.description} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hdl.nic.register_map",
                                     description="Write the NIC register map as Markdown.")
    parser.add_argument("--qps", type=int, default=64)
    parser.add_argument("--cqs", type=int, default=16)
    parser.add_argument("--mkeys", type=int, default=64)
    parser.add_argument("--vls", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        text = render_markdown(args.qps, args.cqs, args.mkeys, args.vls)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
