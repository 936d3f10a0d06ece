"""tb.credit_monitor.CreditMonitor on hand-made wires, without a simulator: what it accepts,
what it stops at, and when a flow-control packet's credit becomes usable."""
from types import SimpleNamespace

import pytest

from models.ib import LRH, FlowControl, FlowControlOp
from tb.credit_monitor import FC_TO_START_CYCLES, CreditMonitor, CreditViolation

WIDTH = 16
FIELDS = ("valid", "data", "start", "end", "count", "link")


class Wires:
    """Two wires of a fake dut (``out`` and ``in``), set beat by beat."""

    def __init__(self):
        self.dut = SimpleNamespace()
        for wire in ("out", "in"):
            for field in FIELDS:
                setattr(self.dut, f"{wire}__{field}", SimpleNamespace(value=0))

    def idle(self):
        for wire in ("out", "in"):
            getattr(self.dut, f"{wire}__valid").value = 0

    def beat(self, wire, data, *, start, end, count, link):
        for field, value in (("valid", 1), ("data", int.from_bytes(data.ljust(WIDTH, b"\0"), "little")),
                             ("start", start), ("end", end), ("count", count), ("link", link)):
            getattr(self.dut, f"{wire}__{field}").value = value

    def flow_control(self, wire, *, vl, fccl, fctbs=0, op=FlowControlOp.NORMAL, corrupt=False):
        raw = bytearray(FlowControl(op=op, fctbs=fctbs, vl=vl, fccl=fccl).pack())
        if corrupt:
            raw[3] ^= 1
        self.beat(wire, bytes(raw), start=1, end=1, count=FlowControl.SIZE, link=1)

    def data_start(self, *, vl, blocks):
        # PktLen words such that 4 * PktLen + 2 bytes take exactly ``blocks`` 64-byte blocks.
        lrh = LRH(vl=vl, pktlen=16 * blocks - 1).pack()
        self.beat("out", lrh, start=1, end=0, count=0, link=0)


def run(events, *, offsets=(0, 0)):
    """``events``: {cycle: [callable(wires)]}; returns the monitor after the last cycle."""
    wires = Wires()
    monitor = CreditMonitor(wires.dut, "out", "in", WIDTH, 2, name="sender",
                            out_offset=offsets[0], in_offset=offsets[1])
    for cycle in range(max(events) + 1):
        wires.idle()
        for event in events.get(cycle, ()):
            event(wires)
        monitor.sample(cycle)
    return monitor


def grant(vl, fccl, **kwargs):
    return lambda w: w.flow_control("in", vl=vl, fccl=fccl, **kwargs)


def send(vl, blocks):
    return lambda w: w.data_start(vl=vl, blocks=blocks)


K = FC_TO_START_CYCLES


def test_packets_within_credit_pass():
    monitor = run({0: [grant(0, 10)], K: [send(0, 4)], K + 10: [send(0, 6)]})
    assert monitor.packets == [2, 0]
    assert monitor.vls[0].fctbs == 10 and monitor.vls[0].blocks_available() == 0


def test_one_block_over_the_limit_fails():
    with pytest.raises(CreditViolation, match="7 blocks started on VL 0"):
        run({0: [grant(0, 10)], K: [send(0, 4)], K + 10: [send(0, 7)]})


def test_no_credit_before_the_first_flow_control_packet():
    with pytest.raises(CreditViolation):
        run({5: [send(1, 1)]})


def test_credit_is_usable_only_from_seven_cycles_after_it_arrives():
    run({0: [grant(0, 3)], K: [send(0, 3)]})
    with pytest.raises(CreditViolation):
        run({0: [grant(0, 3)], K - 1: [send(0, 3)]})


def test_credit_is_per_vl():
    with pytest.raises(CreditViolation, match="VL 1"):
        run({0: [grant(0, 50)], K: [send(1, 1)]})


def test_a_corrupted_flow_control_packet_grants_nothing():
    with pytest.raises(CreditViolation):
        run({0: [grant(0, 10, corrupt=True)], K: [send(0, 1)]})


def test_limits_wrap_modulo_4096():
    # 70 packets of 64 blocks, each granted just in time: FCTBS and FCCL wrap past 4095.
    events, cycle = {}, 0
    for k in range(70):
        events[cycle] = [grant(0, (64 * (k + 1)) % 4096)]
        events[cycle + K] = [send(0, 64)]
        cycle += K + 1
    monitor = run(events)
    assert monitor.vls[0].fctbs == 64 * 70 % 4096
    with pytest.raises(CreditViolation):
        events[cycle] = [send(0, 1)]
        run(events)


def test_the_senders_init_restarts_its_count():
    monitor = run({0: [grant(0, 10)], K: [send(0, 10)],
                   K + 5: [lambda w: w.flow_control("out", vl=0, fccl=0, fctbs=0,
                                                     op=FlowControlOp.INIT)],
                   K + 6: [grant(0, 8, op=FlowControlOp.INIT)], 2 * K + 6: [send(0, 8)]})
    assert monitor.vls[0].fctbs == 8


def test_a_normal_packet_must_agree_with_the_senders_count():
    run({0: [grant(0, 10)], K: [send(0, 4)],
         K + 5: [lambda w: w.flow_control("out", vl=0, fccl=0, fctbs=4)]})
    with pytest.raises(CreditViolation, match="says FCTBS 5"):
        run({0: [grant(0, 10)], K: [send(0, 4)],
             K + 5: [lambda w: w.flow_control("out", vl=0, fccl=0, fctbs=5)]})


def test_far_end_offsets():
    # A sender seen across a cable of 3 cycles: its starts are seen 3 cycles late, the
    # flow-control packets it receives 3 cycles early.
    run({0: [grant(0, 2)], K + 6: [send(0, 2)]}, offsets=(-3, 3))
    with pytest.raises(CreditViolation):
        run({0: [grant(0, 2)], K + 5: [send(0, 2)]}, offsets=(-3, 3))
