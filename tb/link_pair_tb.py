"""cocotb helpers for simulations of :class:`tb.link_pair.LinkPair`: the ``TB`` class (both
ends' sources, sinks and cables, delivery and credit checks) and the pair's builds."""
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from hdl.link.signatures import LinkState
from models.packet import random_packet
from tb import runner
from tb.beats import (CycleLoop, PacketSink, PacketSource, WireChannel, WireMonitor,
                      backpressure_random, idle_random)
from tb.credit_monitor import CreditMonitor

__all__ = ["TB", "CLOCK_NS", "PARAM_SETS", "bring_up", "drop_counts", "factory", "read_port",
           "wait_active"]


async def bring_up(dut, loop, *, wire_delay=None, limit=20000):
    """Reset both ends and run ``loop`` until both report the link ACTIVE."""
    if wire_delay is not None:
        dut.wire_delay_cycles.value = wire_delay
    dut.a_reset.value = 0
    dut.b_reset.value = 0
    dut.rst.value = 1
    for _ in range(4):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await wait_active(dut, loop, limit=limit)


async def wait_active(dut, loop, *, limit=20000):
    active = LinkState.ACTIVE.value
    await loop.run(until=lambda: read_port(dut, "state", "a") == active
                   and read_port(dut, "state", "b") == active, limit=limit)


def read_port(dut, name, side, vl=None):
    """A status port of one end, e.g. ``read_port(dut, "fctbs", "a", 0)`` reads ``a_fctbs__0``."""
    return int(getattr(dut, f"{side}_{name}" + (f"__{vl}" if vl is not None else "")).value)


CLOCK_NS = 2.5


class TB:
    def __init__(self, dut, *, rng=None, fc_drop=0.0, fc_corrupt=0.0, mutate=None,
                 idle=0.0, backpressure=0.0, capture=None):
        self.dut = dut
        self.params = params = runner.tb_params()
        self.width = params["width"]
        self.num_vls = params["num_vls"]
        self.rng = rng or random.Random(1)
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
        self.loop = CycleLoop(dut.clk)
        self.sources, self.sinks = {}, {}
        for side in ("a", "b"):
            for v in range(self.num_vls):
                self.sources[side, v] = self.loop.add(PacketSource(
                    dut, f"{side}_data_in__{v}", self.width,
                    idle=idle_random(random.Random(self.rng.random()), idle)))
                self.sinks[side, v] = self.loop.add(PacketSink(
                    dut, f"{side}_data_out__{v}", self.width,
                    backpressure=backpressure_random(random.Random(self.rng.random()),
                                                     backpressure)))
                getattr(dut, f"{side}_vl_weight__{v}").value = 16
        self.monitor = self.loop.add(WireMonitor(dut, "a_wire_out", self.width, capture=capture,
                                                 clock_ns=CLOCK_NS))
        self.channels = {
            (src, dst): self.loop.add(WireChannel(
                dut, f"{src}_wire_out", f"{dst}_wire_in", self.width, delay=params["wire_delay"],
                rng=random.Random(self.rng.random()), fc_drop=fc_drop, fc_corrupt=fc_corrupt,
                mutate=mutate if src == "a" else None, invalid_vl=self.num_vls))
            for src, dst in (("a", "b"), ("b", "a"))
        }
        # The credit rule at both senders, at their own pins (the cables may lose or corrupt
        # flow-control packets on the way: what counts is what arrived).
        self.credit_monitors = {side: self.loop.add(CreditMonitor(
            dut, f"{side}_wire_out", f"{side}_wire_in", self.width, self.num_vls,
            name=f"port {side}")) for side in ("a", "b")}
        self.sent = {key: [] for key in self.sources}
        self.loop.checks.append(self.check_overflow)

    def check_overflow(self, cycle):
        for side in ("a", "b"):
            assert not int(getattr(self.dut, f"{side}_overflow").value), \
                f"cycle {cycle}: receive buffer of {side} overflowed"

    def port(self, name, side, vl=None):
        return read_port(self.dut, name, side, vl)

    async def bring_up(self, limit=20000):
        await bring_up(self.dut, self.loop, limit=limit)

    async def wait_active(self, limit=20000):
        await wait_active(self.dut, self.loop, limit=limit)

    def send(self, side, vl, packet):
        self.sources[side, vl].send(packet, tag=len(self.sent[side, vl]))
        self.sent[side, vl].append(packet)

    def random_traffic(self, count, sizes=(0, 4096), sides=("a", "b")):
        for _ in range(count):
            side = self.rng.choice(sides)
            vl = self.rng.randrange(self.num_vls)
            size = self.rng.randrange(sizes[0], sizes[1] + 1)
            self.send(side, vl, random_packet(self.rng, payload_len=size, vl=vl))

    def delivered(self, side, vl):
        """Packets the far end delivered intact (a packet marked end-bad counts as dropped)."""
        return [p for p, bad, *_ in self.sinks[self.other(side), vl].packets if not bad]

    @staticmethod
    def other(side):
        return "b" if side == "a" else "a"

    def all_sent(self):
        return all(source.idle_now for source in self.sources.values())

    def expected(self, side, vl):
        lost = {p for _, p in self.channels[side, self.other(side)].mutated}
        return [p for p in self.sent[side, vl] if p not in lost]

    def all_delivered(self):
        return all(len(self.delivered(side, vl)) >= len(self.expected(side, vl))
                   for side, vl in self.sent)

    def status(self):
        lines = []
        for side in ("a", "b"):
            per_vl = ", ".join(
                f"vl{v}: sent {self.port('packets_sent', side, v)} rcvd {self.port('packets_received', side, v)}"
                f" fctbs {self.port('fctbs', side, v)} limit {self.port('credit_limit', side, v)}"
                f" abr {self.port('abr', side, v)} used {self.port('used_blocks', side, v)}"
                f" queued {len(self.sources[side, v].queue)}"
                f" delivered {len(self.sinks[side, v].packets)}"
                for v in range(self.num_vls))
            drops = {k: n for k, n in drop_counts(self.dut, side).items() if n}
            lines.append(f"{side}: state {self.port('state', side)} {per_vl} drops {drops}")
        return "\n".join(lines)

    async def drain(self, limit=200000):
        try:
            await self.loop.run(until=lambda: self.all_sent() and self.all_delivered(), limit=limit)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.status()}") from None
        # Let the last credits come home: one flow-control period and a round trip.
        await self.loop.run(cycles=self.params["fc_period"] + 4 * self.params["wire_delay"] + 64)

    def check_delivery(self, exact=True):
        for side, vl in self.sent:
            got = self.delivered(side, vl)
            want = self.expected(side, vl)
            assert not self.sinks[self.other(side), vl].errors, self.sinks[self.other(side), vl].errors
            if exact:
                assert len(got) == len(want), f"{side}->vl{vl}: {len(got)} delivered, {len(want)} expected"
                for index, (g, w) in enumerate(zip(got, want)):
                    assert g == w, f"{side}->vl{vl}: packet {index} differs"
            else:
                # After a reset only packets in flight may be lost: what arrives is in order, once.
                position = 0
                for g in got:
                    while position < len(want) and want[position] != g:
                        position += 1
                    assert position < len(want), f"{side}->vl{vl}: unexpected or reordered packet"
                    position += 1

    def check_credits(self):
        # Each credit monitor checked every packet its transmitter started (it watched the
        # right wire).
        for side, monitor in self.credit_monitors.items():
            assert monitor.packets == [self.port("packets_sent", side, v)
                                       for v in range(self.num_vls)], (side, monitor.packets)
        blocks = self.params["buffer_blocks"]
        for side in ("a", "b"):
            far = self.other(side)
            for v in range(self.num_vls):
                assert self.port("used_blocks", far, v) == 0, f"{far} vl{v} still holds blocks"
                available = (self.port("credit_limit", side, v) - self.port("fctbs", side, v)) % 4096
                assert available == blocks, \
                    f"{side}->{far} vl{v}: {available} blocks of credit after drain, expected {blocks}"
                assert self.port("abr", far, v) == self.port("fctbs", side, v), \
                    f"{far} vl{v}: ABR {self.port('abr', far, v)} != FCTBS {self.port('fctbs', side, v)}"


def drop_counts(dut, side="b"):
    from hdl.link.link_receiver import DROP_REASONS
    return {reason: read_port(dut, f"drop_{reason}", side) for reason in DROP_REASONS}


PARAM_SETS = [
    dict(width=64, num_vls=2, mtu=4096, buffer_blocks=160, cut_through=False,
         fc_period=1024, fc_min_interval=64, wire_delay=3, channel="tb"),
    dict(width=16, num_vls=2, mtu=4096, buffer_blocks=140, cut_through=True,
         fc_period=512, fc_min_interval=32, wire_delay=1, channel="tb"),
]


def factory(**params):
    from tb.link_pair import LinkPair
    return LinkPair(**params)
