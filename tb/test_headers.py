"""hdl/ib/headers layouts against the models/ib codecs, byte for byte.

Two sim-only tops: :class:`HeaderDecoder` views one 64-byte wire-order vector
(byte 0 in bits 7..0) through every layout with ``from_wire`` and exposes
every field; :class:`HeaderEncoder` takes every field and packs each layout
to wire order with ``to_wire``. Both are combinational, so the testbench has
no clock: it drives, waits a step, and reads.
"""
import random

import cocotb
import pytest
from amaranth.hdl import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from cocotb.triggers import Timer

import tb.runner
from hdl.ib.headers import (AETH, ATOMIC_ACK_ETH, ATOMIC_ETH, BTH, FLOW_CONTROL, GRH, IMMDT,
                            LRH, MASKED_ATOMIC_ETH, RETH, from_wire, to_wire)
from models import ib
from models.crc import lpcrc

WIRE_BYTES = 64
RANDOM_HEADERS = 200

# Layout name -> (gateware layout, models.ib codec or None for GRH, which the models lack).
HEADERS = {
    "lrh": (LRH, ib.LRH),
    "grh": (GRH, None),
    "bth": (BTH, ib.BTH),
    "reth": (RETH, ib.RETH),
    "aeth": (AETH, ib.AETH),
    "atomic_eth": (ATOMIC_ETH, ib.AtomicETH),
    "masked_atomic_eth": (MASKED_ATOMIC_ETH, ib.MaskedAtomicETH),
    "atomic_ack_eth": (ATOMIC_ACK_ETH, ib.AtomicAckETH),
    "immdt": (IMMDT, ib.ImmDt),
    "flow_control": (FLOW_CONTROL, ib.FlowControl),
}


def field_widths(layout):
    return {name: field.width for name, field in layout}


class HeaderDecoder(wiring.Component):
    """``wire`` in; ``<header>_<field>`` out for every field of every layout."""
    def __init__(self):
        ports = {"wire": In(8 * WIRE_BYTES)}
        for header, (layout, _) in HEADERS.items():
            for name, width in field_widths(layout).items():
                ports[f"{header}_{name}"] = Out(width)
        super().__init__(ports)

    def elaborate(self, platform):
        m = Module()
        for header, (layout, _) in HEADERS.items():
            view = from_wire(layout, self.wire[:layout.size])
            for name in field_widths(layout):
                m.d.comb += getattr(self, f"{header}_{name}").eq(view[name])
        return m


class HeaderEncoder(wiring.Component):
    """``<header>_<field>`` in for every field of every layout; ``<header>_wire`` out per layout."""
    def __init__(self):
        ports = {}
        for header, (layout, _) in HEADERS.items():
            for name, width in field_widths(layout).items():
                ports[f"{header}_{name}"] = In(width)
            ports[f"{header}_wire"] = Out(layout.size)
        super().__init__(ports)

    def elaborate(self, platform):
        m = Module()
        for header, (layout, _) in HEADERS.items():
            packed = Signal(layout)
            for name in field_widths(layout):
                m.d.comb += packed[name].eq(getattr(self, f"{header}_{name}"))
            m.d.comb += getattr(self, f"{header}_wire").eq(to_wire(layout, packed))
        return m


TOPS = {"decoder": HeaderDecoder, "encoder": HeaderEncoder}

# The GRH as IBA vol. 1 draws it, written out here because models/ib has no GRH codec.
GRH_FIELDS_MSB_FIRST = (("ipver", 4), ("tclass", 8), ("flowlabel", 20), ("paylen", 16),
                        ("nxthdr", 8), ("hoplmt", 8), ("sgid", 128), ("dgid", 128))


def grh_pack(fields):
    word = 0
    for name, bits in GRH_FIELDS_MSB_FIRST:
        word = word << bits | fields[name]
    return word.to_bytes(40, "big")


def grh_unpack(buf):
    word, shift, fields = int.from_bytes(buf[:40], "big"), 320, {}
    for name, bits in GRH_FIELDS_MSB_FIRST:
        shift -= bits
        fields[name] = word >> shift & ((1 << bits) - 1)
    return fields


def reference_pack(header, fields):
    """Wire bytes of ``fields`` by the reference codec (reserved fields pack as zero)."""
    codec = HEADERS[header][1]
    if codec is None:
        return grh_pack(fields)
    return codec(**{name: fields[name] for name in codec.field_widths()}).pack()


def reference_unpack(header, buf):
    """Fields (reserved ones left out) of the wire bytes ``buf`` by the reference codec."""
    codec = HEADERS[header][1]
    if codec is None:
        return grh_unpack(buf)
    fields = vars(codec.unpack(buf))
    if codec is ib.FlowControl:
        fields["lpcrc"] = int.from_bytes(buf[4:6], "little")
    return {name: int(value) for name, value in fields.items()}


def random_fields(rng, header):
    """Random values for every field; reserved fields zero, LPCRC right, as the codecs pack them."""
    layout = HEADERS[header][0]
    fields = {name: 0 if name.startswith("rsvd") else rng.getrandbits(width)
              for name, width in field_widths(layout).items()}
    if header == "flow_control":
        fields["op"] = rng.choice(list(ib.FlowControlOp))
        fields["lpcrc"] = lpcrc(reference_pack(header, fields)[:4])
    return fields


class TB:
    """Drives a combinational header top: no clock, a settle step after each drive."""
    SETTLE_NS = 1

    def __init__(self, dut):
        self.dut = dut
        self.rng = random.Random(tb.runner.tb_params()["seed"])

    def port(self, name):
        return getattr(self.dut, name)

    async def settle(self):
        await Timer(self.SETTLE_NS, unit="ns")

    async def decode(self, wire):
        self.dut.wire.value = int.from_bytes(wire, "little")
        await self.settle()

    def decoded(self, header, names):
        return {name: int(self.port(f"{header}_{name}").value) for name in names}

    async def encode(self, header, fields):
        for name, value in fields.items():
            self.port(f"{header}_{name}").value = int(value)
        await self.settle()
        layout = HEADERS[header][0]
        return int(self.port(f"{header}_wire").value).to_bytes(layout.size_bytes, "little")


@cocotb.test()
async def decode_packed_headers(dut):
    """Fields of random headers packed by the codecs, behind random trailing bytes."""
    tb = TB(dut)
    for header, (layout, _) in HEADERS.items():
        for _ in range(RANDOM_HEADERS):
            fields = random_fields(tb.rng, header)
            wire = reference_pack(header, fields)
            await tb.decode(wire + tb.rng.randbytes(WIRE_BYTES - len(wire)))
            assert tb.decoded(header, fields) == fields, f"{header}: {wire.hex()}"


@cocotb.test()
async def decode_random_bytes(dut):
    """Random bytes decode to what the codecs unpack from them (reserved bits ignored)."""
    tb = TB(dut)
    for header in HEADERS:
        for _ in range(RANDOM_HEADERS):
            wire = bytearray(tb.rng.randbytes(WIRE_BYTES))
            if header == "flow_control":  # the codec refuses a bad LPCRC
                wire[4:6] = lpcrc(bytes(wire[:4])).to_bytes(2, "little")
            expected = reference_unpack(header, bytes(wire))
            await tb.decode(bytes(wire))
            assert tb.decoded(header, expected) == expected, f"{header}: {wire.hex()}"


@cocotb.test()
async def encode_random_headers(dut):
    """Random field values pack to the codecs' bytes."""
    tb = TB(dut)
    for header in HEADERS:
        for _ in range(RANDOM_HEADERS):
            fields = random_fields(tb.rng, header)
            expected = reference_pack(header, fields)
            assert await tb.encode(header, fields) == expected, f"{header}: {fields}"


@pytest.mark.parametrize("params", [
    {"top": "decoder", "seed": 1},
    {"top": "encoder", "seed": 2},
], ids=lambda params: params["top"])
def test_headers(params):
    tests = {"decoder": ["decode_packed_headers", "decode_random_bytes"],
             "encoder": ["encode_random_headers"]}[params["top"]]
    tb.runner.run(module="tb.test_headers", toplevel=f"header_{params['top']}",
                  factory=lambda top, seed: TOPS[top](), params=params,
                  testcase=tests, expect_tests=len(tests))
