"""Bus models for beat streams, shared by the link, switch and NIC testbenches.

All models run off one loop per clock (:class:`CycleLoop`): after each rising
edge every model first *samples* (signals read right after the edge hold the
values the edge saw: a handshake seen now happened at this edge), then
*drives* values for the next edge. One loop instead of a coroutine per model
keeps the Python cost per simulated cycle low.
"""
import random
from collections import deque

from cocotb.triggers import RisingEdge

from hdl.link.signatures import BeatLayout

__all__ = ["BeatCodec", "packet_beats", "CycleLoop", "PacketSource", "PacketSink",
           "WireMonitor", "WireChannel", "idle_never", "idle_random", "backpressure_never",
           "backpressure_random"]


class BeatCodec:
    """Pack and unpack a :class:`BeatLayout` payload vector (fields from the LSB)."""

    def __init__(self, width):
        self.width = width
        layout = BeatLayout(width)
        self.offsets = {name: (field.offset, field.width) for name, field in layout}

    def pack(self, data, start, end, count, end_bad=0):
        value = 0
        for name, field_value in (("data", data), ("start", start), ("end", end),
                                  ("count", count), ("end_bad", end_bad)):
            offset, width = self.offsets[name]
            value |= (int(field_value) & ((1 << width) - 1)) << offset
        return value

    def unpack(self, value):
        return {name: (value >> offset) & ((1 << width) - 1)
                for name, (offset, width) in self.offsets.items()}


def packet_beats(packet, width):
    """Beats of ``packet``: (data as int, start, end, count), byte 0 in the low lane."""
    beats = []
    for offset in range(0, max(len(packet), 1), width):
        chunk = packet[offset:offset + width]
        end = offset + width >= len(packet)
        beats.append((int.from_bytes(chunk, "little"), offset == 0, end,
                      len(chunk) if end else width))
    return beats


# --- idle / backpressure generators: yield True to hold off for this cycle ---

def idle_never():
    while True:
        yield False


def idle_random(rng, probability):
    while True:
        yield rng.random() < probability


backpressure_never = idle_never
backpressure_random = idle_random


class CycleLoop:
    """Runs every model once per clock: sample all, then drive all."""

    def __init__(self, clock):
        self.clock = clock
        self.cycle = 0
        self.models = []
        self.checks = []    # callables run each cycle after sampling (e.g. overflow monitors)

    def add(self, model):
        self.models.append(model)
        return model

    async def run(self, cycles=None, until=None, limit=None):
        """Run ``cycles`` clocks, or until ``until()`` is true (failing after ``limit`` clocks)."""
        done = 0
        while True:
            if cycles is not None and done >= cycles:
                return
            if until is not None and until():
                return
            if limit is not None and done >= limit:
                raise AssertionError(f"condition not met within {limit} cycles (cycle {self.cycle})")
            await RisingEdge(self.clock)
            self.cycle += 1
            done += 1
            for model in self.models:
                model.sample(self.cycle)
            for check in self.checks:
                check(self.cycle)
            for model in self.models:
                model.drive(self.cycle)


class PacketSource:
    """Drives packets into a ``lib.stream`` of :class:`BeatLayout` (``<prefix>__valid`` etc.)."""

    def __init__(self, dut, prefix, width, idle=None):
        self.valid = getattr(dut, f"{prefix}__valid")
        self.ready = getattr(dut, f"{prefix}__ready")
        self.payload = getattr(dut, f"{prefix}__payload")
        self.codec = BeatCodec(width)
        self.width = width
        self.idle = idle or idle_never()
        self.queue = deque()        # (packet, tag, beats)
        self.beats = deque()
        self.current = None
        self.driving = False
        self.start_cycles = []      # (tag, cycle the start beat was accepted)
        self.sent = []              # tags in the order their last beat was accepted
        self.valid.value = 0

    def send(self, packet, tag=None, end_bad=False):
        self.queue.append((bytes(packet), tag, end_bad))

    @property
    def idle_now(self):
        return not self.queue and not self.beats and not self.driving

    def sample(self, cycle):
        if self.driving and int(self.ready.value):
            data, start, end, count = self.beats.popleft()
            tag = self.current[1]
            if start:
                self.start_cycles.append((tag, cycle))
            if end:
                self.sent.append(tag)
                self.current = None
            self.driving = False

    def drive(self, cycle):
        if not self.driving:
            if not self.beats and self.queue:
                self.current = self.queue.popleft()
                self.beats.extend(packet_beats(self.current[0], self.width))
            if self.beats and not next(self.idle):
                data, start, end, count = self.beats[0]
                self.payload.value = self.codec.pack(data, start, end, count,
                                                     end and self.current[2])
                self.driving = True
        self.valid.value = int(self.driving)


class PacketSink:
    """Takes packets from a ``lib.stream`` of :class:`BeatLayout`, with backpressure."""

    def __init__(self, dut, prefix, width, backpressure=None):
        self.valid = getattr(dut, f"{prefix}__valid")
        self.ready = getattr(dut, f"{prefix}__ready")
        self.payload = getattr(dut, f"{prefix}__payload")
        self.codec = BeatCodec(width)
        self.width = width
        self.backpressure = backpressure or backpressure_never()
        self.ready_now = False
        self.partial = bytearray()
        self.in_packet = False
        self.packets = []           # (bytes, end_bad, start cycle, end cycle)
        self.start_cycle = None
        self.errors = []
        self.beats_taken = 0
        self.ready.value = 0

    def sample(self, cycle):
        if not (self.ready_now and int(self.valid.value)):
            return
        beat = self.codec.unpack(int(self.payload.value))
        self.beats_taken += 1
        if beat["start"]:
            if self.in_packet:
                self.errors.append(f"cycle {cycle}: start beat inside a packet")
            self.partial = bytearray()
            self.in_packet = True
            self.start_cycle = cycle
        elif not self.in_packet:
            self.errors.append(f"cycle {cycle}: beat outside a packet")
            return
        count = beat["count"] if beat["end"] else self.width
        self.partial += beat["data"].to_bytes(self.width, "little")[:count]
        if beat["end"]:
            self.packets.append((bytes(self.partial), bool(beat["end_bad"]),
                                 self.start_cycle, cycle))
            self.in_packet = False

    def drive(self, cycle):
        self.ready_now = not next(self.backpressure)
        self.ready.value = int(self.ready_now)


class WireMonitor:
    """Records the beats on a wire (no handshake: a beat is there when ``valid``)."""

    def __init__(self, dut, prefix, width, capture=None, clock_ns=2.5):
        self.signals = {name: getattr(dut, f"{prefix}__{name}")
                        for name in ("valid", "data", "start", "end", "count", "end_bad", "link")}
        self.width = width
        self.capture = capture
        self.clock_ns = clock_ns
        self.partial = bytearray()
        self.data_packets = []      # (bytes incl. VCRC, end_bad, start cycle)
        self.link_packets = []      # (bytes, cycle)
        self.busy_cycles = 0
        self.start_cycle = None

    def sample(self, cycle):
        signals = self.signals
        if not int(signals["valid"].value):
            return
        self.busy_cycles += 1
        end = int(signals["end"].value)
        count = int(signals["count"].value) if end else self.width
        data = int(signals["data"].value).to_bytes(self.width, "little")[:count]
        if int(signals["link"].value):
            self.link_packets.append((data, cycle))
            if self.capture:
                self.capture.link(data, cycle * self.clock_ns)
            return
        if int(signals["start"].value):
            self.partial = bytearray()
            self.start_cycle = cycle
        self.partial += data
        if end:
            packet = bytes(self.partial)
            self.data_packets.append((packet, bool(int(signals["end_bad"].value)), self.start_cycle))
            if self.capture:
                self.capture.data(packet, self.start_cycle * self.clock_ns)

    def drive(self, cycle):
        pass


class WireChannel:
    """A cable carried by the testbench: delay, and faults injected on purpose.

    ``delay`` counts cycles from the sender's register to the receiver's
    (at least 1: this model is itself one register). Flow-control packets are
    dropped or corrupted at random with ``fc_drop`` / ``fc_corrupt``. Data
    packets are altered by ``mutate(packet_bytes) -> kind or None`` (called
    when a packet's start beat passes; the kinds are :attr:`MUTATIONS`); while
    ``cut`` is set every beat is lost. Every altered packet, and every packet
    that lost a beat to a cut, is recorded in ``mutated`` (original bytes,
    without VCRC) so the scoreboard knows not to expect it.
    """

    MUTATIONS = ("vcrc", "truncated", "overlong", "too_long", "invalid_vl", "end_bad")
    # Not a corruption but a protocol violation: the packet arrives twice, and the
    # second copy was never covered by credit.
    DUPLICATE = "duplicate"
    # A cable fault: one beat without a start right after a packet's end (an end beat or
    # not, by a coin), which belongs to no packet.
    STRAY = "stray"
    # The cable is cut (``cut`` set): every beat is lost, a packet's included in part.
    CUT = "cut"

    def __init__(self, dut, source, sink, width, delay=1, rng=None, fc_drop=0.0,
                 fc_corrupt=0.0, mutate=None, invalid_vl=7):
        if delay < 1:
            raise ValueError("a testbench-carried wire has at least one cycle of delay")
        names = ("valid", "data", "start", "end", "count", "end_bad", "link")
        self.src = {n: getattr(dut, f"{source}__{n}") for n in names}
        self.dst = {n: getattr(dut, f"{sink}__{n}") for n in names}
        self.width = width
        self.delay = delay
        self.rng = rng or random.Random(0)
        self.fc_drop = fc_drop
        self.fc_corrupt = fc_corrupt
        self.mutate = mutate
        self.invalid_vl = invalid_vl
        self.line = deque()         # (due cycle, beat dict)
        self.mutated = []           # (kind, original packet without VCRC)
        self.duplicated = []        # packets sent twice (protocol violation)
        self.strays = 0             # stray beats sent after a packet's end
        self.passing = []           # beats of the packet passing now
        self.fc_dropped = 0
        self.fc_corrupted = 0
        self.kind = None            # mutation of the packet passing now
        self.cut = False            # set by a test: the cable loses everything
        self.cut_damaged = False    # the packet passing now lost a beat to the cut ...
        self.cut_passed = False     # ... and one went through
        self.cut_midway = 0         # packets the cut caught in the middle
        self.flip_pending = False
        self.original = bytearray()
        self.driving = False
        self.dst["valid"].value = 0

    def sample(self, cycle):
        if not int(self.src["valid"].value):
            return
        beat = {n: int(s.value) for n, s in self.src.items()}
        if beat["link"]:
            if self.cut:
                return
            if self.rng.random() < self.fc_drop:
                self.fc_dropped += 1
                return
            if self.rng.random() < self.fc_corrupt:
                beat["data"] ^= 1 << self.rng.randrange(48)
                self.fc_corrupted += 1
            self._push(cycle, beat)
            return
        count = beat["count"] if beat["end"] else self.width
        raw = beat["data"].to_bytes(self.width, "little")[:count]
        if beat["start"]:
            self.original = bytearray()
            self.cut_damaged = self.cut_passed = False
            self.kind = self.mutate(raw) if self.mutate else None
            self.flip_pending = self.kind == "vcrc"
            if self.kind == "too_long":
                beat["data"] |= 0x07 << 32 | 0xFF << 40         # LRH.PktLen := 2047 words
            elif self.kind == "invalid_vl":
                beat["data"] = beat["data"] & ~0xF0 | self.invalid_vl << 4
        self.original += raw
        self.cut_damaged |= self.cut
        self.cut_passed |= not self.cut
        kind = self.kind
        if beat["start"]:
            self.passing = []
        self.passing.append(dict(beat))
        if beat["end"]:
            if kind and kind not in (self.DUPLICATE, self.STRAY):
                self.mutated.append((kind, bytes(self.original[:-2])))
            elif self.cut_damaged:
                self.mutated.append((self.CUT, bytes(self.original[:-2])))
                self.cut_midway += self.cut_passed
            self.kind = None
        if self.cut:
            return
        first_lane = 8 if beat["start"] else 0     # past the LRH: only the CRCs can tell
        if kind == "vcrc" and self.flip_pending and count > first_lane:
            lane = self.rng.randrange(first_lane, count)
            beat["data"] ^= 1 << (8 * lane + self.rng.randrange(8))
            self.flip_pending = False
        elif kind == "truncated":
            if not beat["start"]:
                return                              # the tail never arrives
            if beat["end"]:
                beat["count"] = count - 4
            beat["end"] = 1
        elif kind == "overlong" and beat["end"]:
            self._push(cycle, dict(beat, end=0, count=self.width))
            beat = dict(beat, start=0, end=1, count=4, data=0x0BADBEEF)
        elif kind == "end_bad" and beat["end"]:
            beat["end_bad"] = 1
        self._push(cycle, beat)
        if kind == self.STRAY and beat["end"]:
            self.strays += 1
            ends = self.rng.random() < 0.5
            self._push(cycle, dict(beat, start=0, end=int(ends), end_bad=0,
                                   count=self.rng.randrange(1, self.width + 1) if ends else self.width,
                                   data=self.rng.getrandbits(8 * self.width)))
        if kind == self.DUPLICATE and beat["end"]:
            self.duplicated.append(bytes(self.original[:-2]))
            for copy in self.passing:
                self._push(cycle, copy)

    def _push(self, cycle, beat):
        due = max(cycle + self.delay - 1, self.line[-1][0] + 1 if self.line else 0)
        self.line.append((due, beat))

    def drive(self, cycle):
        if self.line and self.line[0][0] <= cycle:
            _, beat = self.line.popleft()
            for name, signal in self.dst.items():
                signal.value = beat[name]
            self.driving = True
        elif self.driving:
            self.dst["valid"].value = 0
            self.driving = False
