"""Cycle-level model of the cut-through switch (pure Python, no simulator).

The scoreboard the switch RTL (hdl/switch/) is checked against, and a scale model for
configurations too large for RTL simulation. Factored like BookSim:

- :class:`Traffic` -- one generator per input port: a destination pattern (uniform,
  incast, permutation, hotspot), Bernoulli injection at a load given as a fraction of
  the wire (``load >= 1`` is a saturated source, always one packet waiting), packet
  sizes fixed or random. :func:`make_traffic` builds one per port.
- :class:`ForwardingTable` (DLID -> output port) and :class:`SlToVl` (SL -> VL).
- :class:`IslipAllocator` -- iSLIP (McKeown 1999), deterministic; the exact pointer
  rules are below, an RTL allocator is compared with it cycle for cycle.
- :class:`Router` -- N ports: per-input VOQs (one queue per output and output VL) or,
  in ``fifo`` mode, one FIFO per input and output VL (head-of-line blocking; with one VL
  exactly one FIFO per input); the output VL is ``sl_to_vl[SL]``; per-output per-VL
  downstream credits; per-output weighted round robin over VLs, then one iSLIP pass per
  cycle; cut-through; ingress / allocation / egress pipeline latencies.
- :class:`Network` / :func:`run_switch` -- sources with credit-controlled input links,
  the router, downstream credit sinks (draining, stalling at random, or starved for
  given periods); statistics (:class:`SwitchStats`) and losslessness checks
  (:func:`check_lossless`).
- :func:`forward` / :class:`FlowScoreboard` -- the switch's forwarding decision on real
  packet bytes (output port, output VL, VL-rewritten bytes, or a drop reason) and a
  per-flow in-order scoreboard built on it, for testbenches; no timing.

Sizes. A packet is a SEND_ONLY packet of ``payload`` bytes: ``wire_bytes`` =
LRH + BTH + payload padded to 4 + ICRC + VCRC (``payload + 26`` for a multiple of 4),
``ceil(wire_bytes / width)`` beats on a wire, ``ceil(wire_bytes / 64)`` credit blocks
(docs/interfaces.md). Throughput is delivered payload bytes / (cycles x width) per
port, as the architecture brief defines it; ``wire_utilization`` is the fraction of
cycles an output carries a beat.

Timing (all times are cycles; "at t" is the cycle in which something happens). The
defaults are the switch RTL's timing (hdl/switch/switch.py, hdl/switch/voq_buffer.py),
as measured on it (4-port switch, cocotb: zero-load hop 4 cycles for every pair and
size; 4096-byte incast leaves an output back to back with no idle cycle); they stay
parameters to explore other pipelines.

- ``t_in``: the packet's start beat is on the switch's ingress wire; beat k at
  ``t_in + k``. The upstream transmitter (the source) starts a packet only when its
  credit for that VL covers the whole packet (plain block counters: on a clean wire the
  12-bit FCTBS/FCCL arithmetic of docs/link.md is equivalent). The packet's blocks
  occupy the input buffer from ``t_in``. In the RTL the header is checked, the
  forwarding table answers and the descriptor is enqueued at ``t_in + 1``.
- ``ready = t_in + ingress_cycles`` (default 3: the packet heads its VOQ; the receiver
  checks a beat one cycle after its input register, with its VCRC verdict): from this
  cycle the packet, when it heads its queue, may request. Store-and-forward
  (``cut_through=False``) adds ``beats - 1``.
- Allocation at ``t_g`` (``t_grant``) ``>= ready``, combinational within that cycle, in
  two steps (below: output VL arbitration, then iSLIP). A head packet is *eligible* for
  (output o, VL v) when it is ready, heads its queue, the downstream credit of (o, v)
  covers the whole packet, and its input and output o are both free. The grant takes
  the downstream credit at ``t_g``.
- The grant reads the head cell in the same cycle; beat k is handed to the egress
  transmitter at ``t_g + alloc_cycles + k`` (default ``t_g + 1 + k``, when not
  stalled) and is on the egress wire ``egress_cycles`` later (default 2: the
  transmitter's beat register, then its VCRC stage into the wire register):
  ``t_out = t_g + alloc_cycles + egress_cycles`` (defaults 1 + 2 = 3) is the start
  beat on the egress wire, beat k at ``t_out + k`` (never before it arrived:
  ``t_out >= t_in``). Zero-load hop latency (start beat in to start beat out) =
  ``ingress_cycles + alloc_cycles + egress_cycles`` = 3 + 1 + 2 = **6 cycles**.
- The end beat is handed to the transmitter at ``t_g + beats``; in that cycle the input
  and the output are free again and both can be granted again, so a port's
  consecutive grants are ``beats`` cycles apart and back-to-back packets leave an
  output with no idle cycle between them (a stream of 32-beat packets fills the whole
  wire). In the model: held until ``t_g + beats + turnaround_cycles`` (default 0; 1
  would model one idle cycle between packets).
- Matching ahead (``lookahead`` L > 0, a pipelined allocator's plan, docs/switch.md): a
  port may be matched again from the cycle after its last matched packet started, once
  that packet has at most L beats left; the new packet then starts (its ``t_g`` above)
  when both its input and its output have freed, and ``t_grant`` stays the cycle of
  the match. One match may wait per port.
- Cells go back to the input buffer's free list as they are read, and the packet's
  credit blocks are returned with its end beat: they are free from
  ``in_release = t_g + alloc_cycles + beats - 1`` (the cycle the end beat is handed to
  the transmitter, ``t_g + beats`` by default) and the upstream credit returns at
  ``in_release + credit_delay``.
- Downstream: the sink behind each output reads one beat per cycle, in order, never
  ahead of arrival, except in cycles it stalls (``sink_stall`` probability, or the
  ``starve`` periods). A packet's downstream blocks are held from ``t_out`` to
  ``out_release`` (the cycle after its last beat is read) and come back to the switch's
  credit counter at ``out_release + credit_delay``.

Output VL arbitration, exactly (before iSLIP, like the link transmitter's VL arbiter in
hdl/link/link_transmitter.py and :class:`models.link.VlArbiter`). Each output o has a
pointer ``ptr[o]`` (a VL) and a budget ``budget[o]`` in 64-byte blocks, both 0 after
reset, and a weight ``vl_weight[o][v]`` per VL (default 16 blocks, the RTL register
``portN_vlV_weight``; :meth:`Router.set_vl_weight`). Each cycle:

1. ``vl_any[o][v]``: some input has a head packet eligible for (o, v).
2. ``vl_sel[o]``: if ``vl_any[o][ptr[o]]`` and ``budget[o] != 0``, the output *stays* on
   ``ptr[o]``; otherwise the first VL with ``vl_any`` in the order ``ptr + 1, ptr + 2,
   ..., ptr`` (mod ``num_vls``; the pointer's own VL last).
3. iSLIP runs on ``request[i][o]`` = input i has a head packet eligible for
   (o, ``vl_sel[o]``); a matched input sends that packet.
4. Only for a matched output, with the granted packet of ``b`` blocks on VL v:
   ``ptr[o] = v``; ``budget[o] = max(budget[o] - b, 0)`` if it stayed, else
   ``max(vl_weight[o][v] - b, 0)``. An unmatched output keeps its pointer and budget.

A turn always lets at least one packet through; under saturation an output gives its
VLs blocks in proportion to their weights (rounded up to whole packets per turn).

iSLIP, exactly (:class:`IslipAllocator`). ``N_in`` inputs, ``N_out`` outputs, grant
pointers ``g[o]`` and accept pointers ``a[i]``, all 0 after reset. ``request[i]`` is
the set of outputs input i requests this cycle (the router has already left out busy
inputs and outputs). Each cycle, for iteration k = 1 .. ``iterations``:

1. Request: every input not yet matched this cycle requests every output in
   ``request[i]`` not yet matched this cycle.
2. Grant: every unmatched output with requests grants the requesting input that comes
   first in the order ``g[o], g[o] + 1, ..., g[o] + N_in - 1`` (mod N_in).
3. Accept: every input with grants accepts the granting output that comes first in the
   order ``a[i], a[i] + 1, ...`` (mod N_out). The pair is matched.
4. Pointers move only for pairs matched in iteration 1: ``g[o] = (i + 1) mod N_in`` and
   ``a[i] = (o + 1) mod N_out``. An output whose grant was not accepted, and every
   pair matched in a later iteration, leaves its pointers where they were. (Pairs
   matched in iteration 1 take no part in later iterations, so it does not matter
   whether later iterations see the pointers before or after this update.)

The loop stops early when an iteration adds no match. With ``iterations >= N`` the
matching is maximal. Under saturated uniform requests a single iteration
desynchronises the grant pointers within N cycles and then matches every port.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from models.crc import vcrc_bytes
from models.ib import LRH
from models.packet import parse_packet

__all__ = [
    "SEND_ONLY_OVERHEAD", "send_only_wire_bytes", "wire_beats", "blocks",
    "Traffic", "make_traffic", "PATTERNS", "ForwardingTable", "SlToVl", "IslipAllocator",
    "SwitchPacket", "Router", "Network", "SwitchStats", "run_switch", "check_lossless",
    "jain_index", "forward", "FlowScoreboard", "DROP_REASONS", "DEFAULT_VL_WEIGHT",
]

CREDIT_BLOCK_BYTES = 64
SEND_ONLY_OVERHEAD = 8 + 12 + 4 + 2      # LRH + BTH + ICRC + VCRC around a payload
MAX_DATA_VLS = 15                        # VL15 is never a data VL
DEFAULT_VL_WEIGHT = 16                   # 64-byte blocks per VL turn (portN_vlV_weight)
PATTERNS = ("uniform", "incast", "permutation", "hotspot")


def send_only_wire_bytes(payload: int) -> int:
    """Wire bytes (LRH .. VCRC) of a SEND_ONLY packet carrying ``payload`` bytes."""
    return SEND_ONLY_OVERHEAD + payload + (-payload % 4)


def wire_beats(nbytes: int, width: int) -> int:
    return -(-nbytes // width)


def blocks(nbytes: int) -> int:
    """64-byte credit blocks of ``nbytes`` wire bytes."""
    return -(-nbytes // CREDIT_BLOCK_BYTES)


def jain_index(values) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); 1.0 for no or all-zero values."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0 or not np.any(x):
        return 1.0
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


# ----------------------------------------------------------------------------- traffic

class Traffic:
    """The packet generator of one input port.

    ``dests``: destination nodes (ports) chosen uniformly; ``hot`` / ``hot_fraction``:
    with that probability the destination is ``hot`` instead. ``load``: offered load as
    a fraction of the wire (beats per cycle); each cycle a packet is generated with
    probability ``load / mean_beats`` (Bernoulli, drawn as geometric gaps); ``load >= 1``
    is a saturated source, 0 or empty ``dests`` an idle one. ``payload``: bytes, an int
    or ``(lo, hi)`` for a uniform size (a multiple of 4) in that range. ``sls``: service
    levels, one chosen uniformly per packet.
    """

    def __init__(self, port: int, dests, *, load: float = 1.0, payload=2020, sls=(0,),
                 hot: int | None = None, hot_fraction: float = 0.0, width: int = 64,
                 seed: int = 0):
        self.port = port
        self.dests = tuple(dests)
        self.hot = hot
        self.hot_fraction = hot_fraction if hot is not None else 0.0
        self.load = load if (self.dests or hot is not None) else 0.0
        self.sls = tuple(sls)
        self.width = width
        self.rng = random.Random(seed * 1_000_003 + port * 7919 + 1)
        if isinstance(payload, int):
            self.sizes = (payload,)
        else:
            lo, hi = payload
            lo = -(-lo // 4) * 4
            if hi < lo:
                raise ValueError(f"empty payload range {payload!r}")
            self.sizes = tuple(range(lo, hi + 1, 4))
        if min(self.sizes) < 0:
            raise ValueError("payload must be >= 0")
        self.mean_beats = sum(wire_beats(send_only_wire_bytes(s), width)
                              for s in self.sizes) / len(self.sizes)
        self.saturated = self.load >= 1.0
        self.p = 0.0 if self.saturated else self.load / self.mean_beats
        if self.p > 1:
            raise ValueError("load too high for Bernoulli injection")

    @property
    def active(self) -> bool:
        return self.load > 0

    def gap(self) -> int:
        """Cycles from one generation slot to the next packet (>= 1), geometric(p)."""
        p = self.p
        if p >= 1.0:
            return 1
        u = self.rng.random()
        return 1 + int(math.log(1.0 - u) / math.log(1.0 - p))

    def first(self) -> int:
        return self.gap() - 1

    def make(self):
        """(destination node, SL, payload bytes) of the next packet."""
        rng = self.rng
        if self.hot is not None and (not self.dests or rng.random() < self.hot_fraction):
            dest = self.hot
        else:
            dest = self.dests[rng.randrange(len(self.dests))] if len(self.dests) > 1 else self.dests[0]
        sl = self.sls[rng.randrange(len(self.sls))] if len(self.sls) > 1 else self.sls[0]
        size = self.sizes[rng.randrange(len(self.sizes))] if len(self.sizes) > 1 else self.sizes[0]
        return dest, sl, size


def make_traffic(pattern: str, ports: int, *, load: float = 1.0, payload=2020, sls=(0,),
                 width: int = 64, seed: int = 0, target: int = 0, hotspot: int = 0,
                 hot_fraction: float = 0.25, permutation=None,
                 exclude_self: bool = False) -> list[Traffic]:
    """One :class:`Traffic` per input port.

    - ``uniform``: every port (itself too unless ``exclude_self``) equally likely;
    - ``incast``: every port but ``target`` sends to ``target`` (N-1 to 1);
    - ``permutation``: port i always sends to ``permutation[i]`` (default: a random
      derangement drawn from ``seed``);
    - ``hotspot``: ``hot_fraction`` of the packets to ``hotspot``, the rest uniform.
    """
    everyone = list(range(ports))

    def others(i):
        return [d for d in everyone if d != i] if exclude_self else everyone

    common = dict(load=load, payload=payload, sls=sls, width=width, seed=seed)
    if pattern == "uniform":
        return [Traffic(i, others(i), **common) for i in everyone]
    if pattern == "incast":
        if not 0 <= target < ports:
            raise ValueError(f"no port {target}")
        return [Traffic(i, [] if i == target else [target], **common) for i in everyone]
    if pattern == "permutation":
        if permutation is None:
            rng = random.Random(seed)
            while True:
                permutation = everyone[:]
                rng.shuffle(permutation)
                if ports == 1 or all(p != i for i, p in enumerate(permutation)):
                    break
        if sorted(permutation) != everyone:
            raise ValueError(f"not a permutation of {ports} ports: {permutation!r}")
        return [Traffic(i, [permutation[i]], **common) for i in everyone]
    if pattern == "hotspot":
        return [Traffic(i, others(i), hot=hotspot, hot_fraction=hot_fraction, **common)
                for i in everyone]
    raise ValueError(f"pattern must be one of {PATTERNS}, not {pattern!r}")


# ----------------------------------------------------------------------------- tables

class ForwardingTable:
    """DLID -> output port (linear forwarding table). Unknown DLIDs look up as None."""

    def __init__(self, entries=None):
        self.entries: dict[int, int] = {}
        for dlid, port in dict(entries or {}).items():
            self.set(dlid, port)

    @classmethod
    def identity(cls, ports: int, base_lid: int = 1) -> "ForwardingTable":
        """LID ``base_lid + p`` reaches port p."""
        return cls({base_lid + p: p for p in range(ports)})

    def set(self, dlid: int, port: int) -> None:
        if not 0 <= dlid < 0x10000:
            raise ValueError(f"DLID {dlid!r} is not 16 bits")
        self.entries[dlid] = port

    def remove(self, dlid: int) -> None:
        self.entries.pop(dlid, None)

    def lookup(self, dlid: int):
        return self.entries.get(dlid)

    def lid_of(self, port: int) -> int:
        """The lowest DLID that reaches ``port`` (for traffic generators)."""
        lids = [lid for lid, p in self.entries.items() if p == port]
        if not lids:
            raise KeyError(f"no DLID reaches port {port}")
        return min(lids)


class SlToVl:
    """The 16-entry SL-to-VL table; default SL s -> VL s mod ``num_vls``."""

    def __init__(self, num_vls: int = 2, table=None):
        self.table = list(table) if table is not None else [sl % num_vls for sl in range(16)]
        if len(self.table) != 16 or not all(0 <= v <= 15 for v in self.table):
            raise ValueError("SL-to-VL table needs 16 entries of 0..15")

    def lookup(self, sl: int) -> int:
        return self.table[sl]

    def __setitem__(self, sl, vl):
        if not 0 <= vl <= 15:
            raise ValueError("VL is 4 bits")
        self.table[sl] = vl


# ----------------------------------------------------------------------------- functional forwarding

DROP_REASONS = ("unknown_dlid", "invalid_vl", "too_long")


def _with_vl(packet: bytes, vl: int) -> bytes:
    """``packet`` with the LRH VL nibble set to ``vl``; the ICRC masks LRH.VL so it stays
    valid, a trailing VCRC (``len == PktLen * 4 + 2``) is recomputed as a hop does."""
    out = bytearray(packet)
    out[0] = (vl << 4) | (out[0] & 0x0F)
    words = LRH.unpack(bytes(out[:LRH.SIZE])).pktlen
    if words and len(out) == 4 * words + 2:
        out[-2:] = vcrc_bytes(bytes(out[:-2]))
    return bytes(out)


def forward(packet, table: ForwardingTable, sl_to_vl: SlToVl, num_vls: int, *,
            ports: int | None = None, mtu: int | None = None):
    """The switch's forwarding decision on one packet's bytes, no timing.

    ``packet``: LRH .. ICRC, or LRH .. VCRC as on a wire. DLID = LRH bytes 2-3
    (big-endian), SL = high nibble of LRH byte 1, incoming VL = high nibble of byte 0.
    Returns ``(out_port, out_vl, out_bytes)``, ``out_vl = sl_to_vl[SL]`` and ``out_bytes``
    the packet with the LRH VL nibble replaced by ``out_vl`` (the ICRC does not cover
    LRH.VL, so it stays valid; a VCRC, if present, is recomputed), or a drop reason, in
    this order of precedence:

    - ``"too_long"``: only with ``mtu``: the payload (:func:`models.packet.parse_packet`)
      is longer than ``mtu`` bytes;
    - ``"invalid_vl"``: the incoming LRH VL is ``>= num_vls`` (VL15 included), or the SL
      maps to VL 15 or to a VL ``>= num_vls``;
    - ``"unknown_dlid"``: the DLID is not in ``table`` (or, with ``ports``, names a port
      ``>= ports``).
    """
    packet = bytes(packet)
    if len(packet) < LRH.SIZE:
        raise ValueError(f"a packet needs at least the {LRH.SIZE}-byte LRH, got {len(packet)}")
    lrh = LRH.unpack(packet[:LRH.SIZE])
    if mtu is not None and len(parse_packet(packet).payload) > mtu:
        return "too_long"
    out_vl = sl_to_vl.lookup(lrh.sl)
    if lrh.vl >= num_vls or out_vl == 15 or out_vl >= num_vls:
        return "invalid_vl"
    out_port = table.lookup(lrh.dlid)
    if out_port is None or (ports is not None and not 0 <= out_port < ports):
        return "unknown_dlid"
    return out_port, out_vl, _with_vl(packet, out_vl)


def _describe(packet: bytes) -> str:
    try:
        lrh = LRH.unpack(packet[:LRH.SIZE])
        fields = f"VL {lrh.vl} SL {lrh.sl} DLID {lrh.dlid:#06x} SLID {lrh.slid:#06x}"
    except Exception:                              # pragma: no cover - too short to parse
        fields = "unparsable"
    if len(packet) >= LRH.SIZE + 12:
        fields += f" PSN {int.from_bytes(packet[LRH.SIZE + 9:LRH.SIZE + 12], 'big'):#08x}"
    return f"<{len(packet)} B, {fields}, {packet[:24].hex()}..>"


class _Expected:
    __slots__ = ("in_port", "vl", "packet", "ports", "done", "index")

    def __init__(self, in_port, vl, packet, ports, index):
        self.in_port, self.vl, self.packet, self.ports = in_port, vl, packet, set(ports)
        self.done = False
        self.index = index


class FlowScoreboard:
    """In-order, exactly-once scoreboard of a switch's forwarding, per flow.

    A flow is (input port, output port, output VL); the switch keeps each flow in order
    but may interleave flows arbitrarily. ``expect(in_port, packet)`` is called when a
    packet enters the switch: it runs :func:`forward` with the tables *as they are at that
    moment* and either counts an expected drop (``drops[reason]``) or appends the
    rewritten packet to its flow's list. ``deliver(out_port, vl, packet)`` is called for
    every packet leaving an output: it must equal (exact bytes) the oldest outstanding
    packet of one of the flows into (out_port, vl), else AssertionError (the message says
    whether it is a duplicate, a reordering, or unknown). ``check_all_delivered()``
    raises listing every packet still outstanding.

    Forwarding-table rewrites under traffic: for a packet whose DLID is being moved
    from one port to another, ``expect(in_port, packet, ports={old, new})`` accepts it on
    either. It then sits in both flows' lists; a later packet of either flow may overtake
    it (it might be going the other way), after which it can no longer be delivered on
    the overtaken output (that would be a reordering). Delivered on one port, it is gone
    from the other. The drop checks (VL, length) still apply; an unknown DLID is not
    a drop when ``ports`` is given.

    Packets should differ (e.g. by PSN or payload): with two identical packets from
    different inputs heading one flow's lists, the first input's is taken.
    """

    def __init__(self, table: ForwardingTable, sl_to_vl: SlToVl, num_vls: int, *,
                 ports: int | None = None, mtu: int | None = None):
        self.table, self.sl_to_vl, self.num_vls = table, sl_to_vl, num_vls
        self.ports, self.mtu = ports, mtu
        self.flows: dict[tuple, deque] = {}        # (in, out, vl) -> deque of _Expected
        self.drops = {reason: 0 for reason in DROP_REASONS}
        self.expected = 0
        self.delivered = 0
        self._done: dict[tuple, set] = {}          # (out, vl) -> delivered bytes (diagnosis)
        self._into: dict[tuple, dict] = {}         # (out, vl) -> {in: the flow's deque}

    def expect(self, in_port: int, packet, *, ports=None):
        """Register a packet entering ``in_port``; returns :func:`forward`'s result
        (with ``ports``: ``(sorted ports, out_vl, out_bytes)``)."""
        packet = bytes(packet)
        result = forward(packet, self.table, self.sl_to_vl, self.num_vls,
                         ports=self.ports, mtu=self.mtu)
        if ports is not None:
            ports = set(ports)
            if not ports:
                raise ValueError("ports: at least one output port")
            if result == "unknown_dlid" or not isinstance(result, str):
                out_vl = self.sl_to_vl.lookup(packet[1] >> 4)
                result = (tuple(sorted(ports)), out_vl, _with_vl(packet, out_vl))
        if isinstance(result, str):
            self.drops[result] += 1
            return result
        out, out_vl, out_bytes = result
        entry = _Expected(in_port, out_vl, out_bytes, ports if ports is not None else {out},
                          self.expected)
        self.expected += 1
        for o in entry.ports:
            queue = self.flows.get((in_port, o, out_vl))
            if queue is None:
                queue = self.flows[(in_port, o, out_vl)] = deque()
                self._into.setdefault((o, out_vl), {})[in_port] = queue
            queue.append(entry)
        return result

    def deliver(self, out_port: int, vl: int, packet) -> int:
        """A packet left ``out_port`` on ``vl``; returns the input it came from."""
        packet = bytes(packet)
        for i, queue in self._into.get((out_port, vl), {}).items():
            while queue and queue[0].done:
                queue.popleft()
            skipped = []
            for entry in queue:
                if entry.done:
                    continue
                if entry.packet == packet:
                    for other in skipped:              # overtaken: not on this port any more
                        other.ports.discard(out_port)
                        queue.remove(other)
                    queue.remove(entry)
                    entry.done = True
                    self.delivered += 1
                    self._done.setdefault((out_port, vl), set()).add(packet)
                    return i
                if len(entry.ports) > 1:
                    skipped.append(entry)              # may yet go the other way
                    continue
                break
        raise AssertionError(self._diagnose(out_port, vl, packet))

    def _diagnose(self, out_port, vl, packet) -> str:
        what = f"output {out_port} VL {vl}: unexpected packet {_describe(packet)}"
        if packet in self._done.get((out_port, vl), ()):
            return what + ": a duplicate of one already delivered"
        for (i, o, v), queue in self.flows.items():
            live = [e for e in queue if not e.done]
            for k, entry in enumerate(live):
                if entry.packet == packet:
                    if (o, v) == (out_port, vl):
                        return (what + f": out of order in flow input {i} -> output {o} VL "
                                f"{v}, {k} older packet(s) of that flow not delivered yet, "
                                f"the oldest {_describe(live[0].packet)}")
                    return what + f": expected on output {o} VL {v} (from input {i})"
        heads = {i: _describe(next(e for e in q if not e.done).packet)
                 for (i, o, v), q in self.flows.items()
                 if (o, v) == (out_port, vl) and any(not e.done for e in q)}
        return what + f": not expected; heads of the flows into it: {heads or 'none'}"

    def outstanding(self) -> dict:
        """``{(in, out, vl): [packet bytes, ...]}`` of packets not yet delivered (a packet
        with alternative ports is listed under each)."""
        result = {}
        for key, queue in self.flows.items():
            live = [e.packet for e in queue if not e.done]
            if live:
                result[key] = live
        return result

    def check_all_delivered(self) -> None:
        missing = self.outstanding()
        if missing:
            count = len({id(e) for q in self.flows.values() for e in q if not e.done})
            lines = [f"{count} expected packet(s) never delivered:"]
            for (i, o, v), packets in sorted(missing.items()):
                lines.append(f"  input {i} -> output {o} VL {v}: {len(packets)}, first "
                             f"{_describe(packets[0])}")
            raise AssertionError("\n".join(lines))


# ----------------------------------------------------------------------------- allocator

def _rr_pick(mask: int, pointer: int, n: int) -> int:
    """First set bit of ``mask`` in the order pointer, pointer + 1, ... (mod n)."""
    high = mask >> pointer
    if high:
        return pointer + (high & -high).bit_length() - 1
    low = mask & ((1 << pointer) - 1)
    return (low & -low).bit_length() - 1


class IslipAllocator:
    """iSLIP (McKeown 1999) with ``iterations`` request-grant-accept rounds.

    Deterministic; pointer rules in the module docstring. ``allocate`` takes requests as
    a set of ``(input, output)`` pairs or an ``N_in x N_out`` boolean matrix and returns
    ``{input: output}``; ``allocate_masks`` takes one output bitmask per input.
    """

    def __init__(self, ports: int, iterations: int = 1, outputs: int | None = None):
        if ports < 1 or iterations < 1:
            raise ValueError("need at least one port and one iteration")
        self.inputs = ports
        self.outputs = ports if outputs is None else outputs
        self.iterations = iterations
        self.grant_ptr = [0] * self.outputs
        self.accept_ptr = [0] * self.inputs

    def reset(self) -> None:
        self.grant_ptr = [0] * self.outputs
        self.accept_ptr = [0] * self.inputs

    def allocate(self, requests) -> dict[int, int]:
        masks = [0] * self.inputs
        if isinstance(requests, (set, frozenset, list, tuple)) and (
                not requests or isinstance(next(iter(requests)), tuple)):
            for i, o in requests:
                if not (0 <= i < self.inputs and 0 <= o < self.outputs):
                    raise ValueError(f"request {(i, o)} out of range")
                masks[i] |= 1 << o
        else:
            matrix = np.asarray(requests, dtype=bool)
            if matrix.shape != (self.inputs, self.outputs):
                raise ValueError(f"request matrix must be {self.inputs}x{self.outputs}")
            for i in range(self.inputs):
                for o in np.flatnonzero(matrix[i]):
                    masks[i] |= 1 << int(o)
        return self.allocate_masks(masks)

    def allocate_masks(self, masks) -> dict[int, int]:
        n_in, n_out = self.inputs, self.outputs
        grant_ptr, accept_ptr = self.grant_ptr, self.accept_ptr
        # Column view: which inputs request each output.
        column = [0] * n_out
        for i, mask in enumerate(masks):
            while mask:
                low = mask & -mask
                column[low.bit_length() - 1] |= 1 << i
                mask ^= low
        match: dict[int, int] = {}
        matched_in = matched_out = 0
        for iteration in range(self.iterations):
            grants = {}
            for o in range(n_out):
                if matched_out >> o & 1:
                    continue
                requesters = column[o] & ~matched_in
                if requesters:
                    i = _rr_pick(requesters, grant_ptr[o], n_in)
                    grants[i] = grants.get(i, 0) | (1 << o)
            if not grants:
                break
            for i, granted in grants.items():
                o = _rr_pick(granted, accept_ptr[i], n_out)
                match[i] = o
                matched_in |= 1 << i
                matched_out |= 1 << o
                if iteration == 0:
                    accept_ptr[i] = (o + 1) % n_out
                    grant_ptr[o] = (i + 1) % n_in
        return match


# ----------------------------------------------------------------------------- router

class SwitchPacket:
    """One packet and the cycles it passed the model's points (None: not yet)."""
    __slots__ = ("id", "src", "dest", "dlid", "sl", "vl", "out", "payload", "wire_bytes",
                 "beats", "blocks", "gen", "t_in", "ready", "t_grant", "t_out",
                 "in_release", "out_release", "seq", "drop")

    def __init__(self, id, src, dest, dlid, sl, vl, payload, width, gen):
        self.id, self.src, self.dest, self.dlid, self.sl, self.vl = id, src, dest, dlid, sl, vl
        self.payload = payload
        self.wire_bytes = send_only_wire_bytes(payload)
        self.beats = wire_beats(self.wire_bytes, width)
        self.blocks = blocks(self.wire_bytes)
        self.gen = gen
        self.out = self.t_in = self.ready = self.t_grant = self.t_out = None
        self.in_release = self.out_release = self.seq = self.drop = None

    @property
    def latency(self):
        """Start beat in to start beat out (the hop latency)."""
        return self.t_out - self.t_in

    def __repr__(self):
        return (f"SwitchPacket(#{self.id} {self.src}->{self.out} vl{self.vl} {self.wire_bytes}B "
                f"in {self.t_in} grant {self.t_grant} out {self.t_out})")


class Router:
    """The switch: input buffers with VOQs (or FIFOs), iSLIP, crossbar, output credits.

    Parameters: ``ports``, ``num_vls`` data VLs, ``mode`` "voq" or "fifo",
    ``iterations`` of iSLIP, beat ``width``, ``buffer_blocks`` per VL per input,
    ``downstream_blocks`` per VL behind each output (the next hop's receive buffer:
    the switch's initial credit), ``mtu`` (payload bytes), pipeline
    ``ingress_cycles`` / ``alloc_cycles`` / ``egress_cycles`` and ``turnaround_cycles``
    (a port's grants are ``beats + turnaround_cycles`` apart), ``input_speedup`` (packets
    an input may send at once: read ports of its buffer; 1 in the RTL, more only to ask
    what speed-up would buy), ``lookahead`` (a port may be matched while its current
    packet has at most that many beats left to hand over; the match waits for the port,
    one such pending match per port; 0 in the RTL of today), ``cut_through``,
    ``forwarding`` (:class:`ForwardingTable`, default LID p + 1 -> port p),
    ``sl_to_vl`` (:class:`SlToVl`) and ``vl_weights``: the output VL arbitration weights
    in 64-byte blocks (8 bits, default 16), an int for every output and VL, a list per VL
    for every output, or a list of such lists per output; :meth:`set_vl_weight` changes
    one. Timing and the VL arbitration are in the module docstring.
    """

    def __init__(self, ports: int = 8, num_vls: int = 2, *, mode: str = "voq",
                 iterations: int = 1, width: int = 64, buffer_blocks: int = 528,
                 downstream_blocks: int = 132, mtu: int = 4096, ingress_cycles: int = 3,
                 alloc_cycles: int = 1, egress_cycles: int = 2, turnaround_cycles: int = 0,
                 input_speedup: int = 1, lookahead: int = 0, cut_through: bool = True,
                 forwarding: ForwardingTable | None = None,
                 sl_to_vl: SlToVl | None = None, vl_weights=DEFAULT_VL_WEIGHT):
        if not 2 <= ports <= 64:
            raise ValueError(f"ports must be 2 to 64 in the model, not {ports!r}")
        if not 1 <= num_vls <= MAX_DATA_VLS:
            raise ValueError(f"num_vls must be 1 to {MAX_DATA_VLS}, not {num_vls!r}")
        if mode not in ("voq", "fifo"):
            raise ValueError(f"mode must be 'voq' or 'fifo', not {mode!r}")
        if width < 8 or width & (width - 1):
            raise ValueError(f"width must be a power of two >= 8, not {width!r}")
        if min(ingress_cycles, alloc_cycles, egress_cycles, turnaround_cycles) < 0:
            raise ValueError("pipeline latencies must be >= 0")
        if not isinstance(lookahead, int) or not 0 <= lookahead <= 64:
            raise ValueError(f"lookahead must be 0 to 64 beats, not {lookahead!r}")
        if not isinstance(input_speedup, int) or not 1 <= input_speedup <= ports:
            raise ValueError(f"input_speedup must be 1 to ports ({ports}), not {input_speedup!r}")
        largest = blocks(send_only_wire_bytes(mtu))
        for name, value in (("buffer_blocks", buffer_blocks), ("downstream_blocks", downstream_blocks)):
            if not largest <= value <= 2048:
                raise ValueError(f"{name} must hold one largest packet ({largest} blocks for "
                                 f"MTU {mtu}) and fit the 12-bit credits (<= 2048), not {value!r}")
        self.ports, self.num_vls, self.mode, self.width = ports, num_vls, mode, width
        self.buffer_blocks, self.downstream_blocks, self.mtu = buffer_blocks, downstream_blocks, mtu
        self.ingress_cycles, self.alloc_cycles, self.egress_cycles = (
            ingress_cycles, alloc_cycles, egress_cycles)
        self.turnaround_cycles = turnaround_cycles
        self.cut_through = cut_through
        self.forwarding = forwarding if forwarding is not None else ForwardingTable.identity(ports)
        self.sl_to_vl = sl_to_vl if sl_to_vl is not None else SlToVl(num_vls)
        # With speed-up s, input i is s virtual inputs i * s + k of iSLIP, one per read port.
        self.input_speedup = input_speedup
        self.lookahead = lookahead
        self.allocator = IslipAllocator(ports * input_speedup, iterations, outputs=ports)
        # Queues (v is the output VL): VOQ mode: voq[i][(o, v)] with active[i] the
        # non-empty keys; FIFO mode: fifo[i][v].
        self.voq = [dict() for _ in range(ports)]
        self.active = [set() for _ in range(ports)]
        self.fifo = [[deque() for _ in range(num_vls)] for _ in range(ports)]
        # Output VL arbitration: weights, pointer and budget per output.
        self.vl_weight = [[DEFAULT_VL_WEIGHT] * num_vls for _ in range(ports)]
        self.vl_ptr = [0] * ports
        self.vl_budget = [0] * ports
        if isinstance(vl_weights, int):
            vl_weights = [vl_weights] * num_vls
        vl_weights = list(vl_weights)
        if vl_weights and not isinstance(vl_weights[0], int):
            if len(vl_weights) != ports:
                raise ValueError("vl_weights: one list per output port")
        else:
            vl_weights = [vl_weights] * ports
        for o, row in enumerate(vl_weights):
            if len(row) != num_vls:
                raise ValueError(f"vl_weights: one weight per VL ({num_vls}), not {row!r}")
            for v, weight in enumerate(row):
                self.set_vl_weight(o, v, weight)
        self.in_slot_busy = [[0] * input_speedup for _ in range(ports)]  # per read port
        self.in_busy = [0] * ports          # input sending on every read port until (exclusive)
        self.out_busy = [0] * ports         # output held until (exclusive)
        # From when a port may be matched again: its last matched packet has started and
        # has at most `lookahead` beats left (= busy with no lookahead).
        self.in_slot_avail = [[0] * input_speedup for _ in range(ports)]
        self.in_avail = [0] * ports
        self.out_avail = [0] * ports
        self.down_credit = [[downstream_blocks] * num_vls for _ in range(ports)]
        self.queued = 0
        self.wake = 0                       # earliest cycle an allocation can succeed
        self.drops = {"unknown_dlid": 0, "invalid_vl": 0, "too_long": 0}
        # Allocator passes in which a ready head was held back by missing downstream
        # credit, per output and VL. Not the RTL's credit-stall cycle counter: the model
        # skips cycles in which nothing can change.
        self.credit_blocked = [[0] * num_vls for _ in range(ports)]

    @property
    def hop_latency(self) -> int:
        return self.ingress_cycles + self.alloc_cycles + self.egress_cycles

    def set_vl_weight(self, port: int, vl: int, weight: int) -> None:
        """Output ``port``'s arbitration weight of ``vl``: 64-byte blocks per turn, 0..255
        (the RTL register ``portN_vlV_weight``). Takes effect at the next turn."""
        if not 0 <= weight <= 255:
            raise ValueError(f"VL weight is 8 bits, not {weight!r}")
        self.vl_weight[port][vl] = weight

    def arrive(self, t: int, p: SwitchPacket) -> bool:
        """The start beat of ``p`` is on input ``p.src``'s wire at ``t``: look it up and
        queue it (True), or drop it and set ``p.drop`` to the reason (False)."""
        p.t_in = t
        if p.payload > self.mtu:
            p.drop = "too_long"
        elif p.vl >= self.num_vls:
            p.drop = "invalid_vl"
        else:
            out = self.forwarding.lookup(p.dlid)
            if out is None or not 0 <= out < self.ports:
                p.drop = "unknown_dlid"
            else:
                p.out = out
        if p.drop is not None:
            self.drops[p.drop] += 1
            return False
        p.ready = t + self.ingress_cycles + (0 if self.cut_through else p.beats - 1)
        i = p.src
        if self.mode == "voq":
            key = (p.out, p.vl)
            queue = self.voq[i].get(key)
            if queue is None:
                queue = self.voq[i][key] = deque()
            queue.append(p)
            self.active[i].add(key)
        else:
            self.fifo[i][p.vl].append(p)
        self.queued += 1
        if p.ready < self.wake:
            self.wake = p.ready
        return True

    def credit(self, t: int, out: int, vl: int, nblocks: int) -> None:
        """Downstream credit for ``nblocks`` blocks on ``vl`` came back to output ``out``."""
        credit = self.down_credit[out][vl] + nblocks
        if credit > self.downstream_blocks:
            raise AssertionError(f"output {out} VL {vl}: credit {credit} beyond the "
                                 f"downstream buffer's {self.downstream_blocks} blocks")
        self.down_credit[out][vl] = credit
        if t < self.wake:
            self.wake = t

    def _heads(self, i):
        """(output, vl, head packet) of every non-empty queue of input i."""
        if self.mode == "voq":
            voq = self.voq[i]
            return [(o, v, voq[(o, v)][0]) for (o, v) in self.active[i]]
        return [(q[0].out, v, q[0]) for v, q in enumerate(self.fifo[i]) if q]

    def allocate(self, t: int) -> list[SwitchPacket]:
        """One allocator pass at cycle ``t``; returns the granted packets (timed)."""
        if t < self.wake or not self.queued:
            if not self.queued:
                self.wake = 1 << 62
            return []
        ports = self.ports
        out_busy, in_avail, out_avail = self.out_busy, self.in_avail, self.out_avail
        down_credit = self.down_credit
        out_free = 0
        for o in range(ports):
            if out_avail[o] <= t:
                out_free |= 1 << o
        # Eligible heads: cand[(i, o, v)] is the packet; vl_any[o] a VL bitmask.
        cand = {}
        vl_any = [0] * ports
        next_wake = 1 << 62
        for i in range(ports):
            if in_avail[i] > t:
                if in_avail[i] < next_wake:
                    next_wake = in_avail[i]
                continue
            for o, v, head in self._heads(i):
                if head.ready > t:
                    if head.ready < next_wake:
                        next_wake = head.ready
                    continue
                if not out_free >> o & 1:
                    if out_avail[o] < next_wake:
                        next_wake = out_avail[o]
                    continue
                if down_credit[o][v] < head.blocks:
                    self.credit_blocked[o][v] += 1
                    continue                 # a credit return will wake us
                cand[(i, o, v)] = head
                vl_any[o] |= 1 << v
        if not cand:
            self.wake = next_wake
            return []
        self.wake = t + 1
        # Output VL arbitration (weighted round robin), then iSLIP on the chosen VLs.
        num_vls = self.num_vls
        vl_ptr, vl_budget = self.vl_ptr, self.vl_budget
        vl_sel = [-1] * ports
        stay = [False] * ports
        for o in range(ports):
            mask = vl_any[o]
            if not mask:
                continue
            ptr = vl_ptr[o]
            if mask >> ptr & 1 and vl_budget[o]:
                vl_sel[o], stay[o] = ptr, True
            elif num_vls == 1:
                vl_sel[o] = 0
            else:
                vl_sel[o] = _rr_pick(mask, (ptr + 1) % num_vls, num_vls)
        speedup = self.input_speedup
        masks = [0] * (ports * speedup)
        for (i, o, v) in cand:
            if vl_sel[o] == v:
                for k, avail in enumerate(self.in_slot_avail[i]):
                    if avail <= t:
                        masks[i * speedup + k] |= 1 << o
        granted = []
        hold = self.turnaround_cycles
        in_busy, lookahead = self.in_busy, self.lookahead
        for virtual, o in self.allocator.allocate_masks(masks).items():
            i, k = divmod(virtual, speedup)
            v = vl_sel[o]
            if self.mode == "voq":
                queue = self.voq[i][(o, v)]
                p = queue.popleft()
                if not queue:
                    self.active[i].discard((o, v))
            else:
                p = self.fifo[i][v].popleft()
            self.queued -= 1
            b = p.blocks
            down_credit[o][v] -= b
            base = vl_budget[o] if stay[o] else self.vl_weight[o][v]
            vl_budget[o] = base - b if base > b else 0
            vl_ptr[o] = v
            p.t_grant = t
            # Matched ahead, the packet starts when both of its ports have freed.
            start = max(t, self.in_slot_busy[i][k], out_busy[o])
            busy = start + p.beats + hold
            self.in_slot_busy[i][k] = out_busy[o] = busy
            self.in_slot_avail[i][k] = out_avail[o] = max(start + 1, busy - lookahead)
            in_busy[i] = min(self.in_slot_busy[i])
            in_avail[i] = min(self.in_slot_avail[i])
            p.t_out = start + self.alloc_cycles + self.egress_cycles
            p.in_release = start + self.alloc_cycles + p.beats - 1
            granted.append(p)
        return granted

    def empty(self) -> bool:
        return self.queued == 0


# ----------------------------------------------------------------------------- network

class _Source:
    """The upstream transmitter of one input: per-VL queues, credit, one wire."""
    __slots__ = ("traffic", "queues", "credit", "wire_free", "vl_ptr", "backlog", "next_gen",
                 "script")

    def __init__(self, traffic, num_vls, buffer_blocks):
        self.traffic = traffic
        self.queues = [deque() for _ in range(MAX_DATA_VLS + 1)]
        self.credit = [buffer_blocks] * num_vls
        self.wire_free = 0
        self.vl_ptr = 0
        self.backlog = 0
        self.next_gen = traffic.first() if traffic.active and not traffic.saturated else None
        self.script = deque()       # offered packets: (cycle, dest, sl, payload), in order


class Network:
    """Sources -> :class:`Router` -> downstream credit sinks, cycle by cycle.

    ``traffic``: one :class:`Traffic` per port. ``credit_delay``: cycles from a buffer
    freeing blocks to the sender's counter seeing them (flow-control packet, wires).
    ``saturate_depth``: packets a saturated source keeps waiting. Sinks: each cycle a
    sink stalls with probability ``sink_stall``; ``starve`` maps an output port to
    ``(start, end)`` periods (``end=None``: forever) in which its sink reads nothing.
    ``lids``: the DLID of each destination node (default: the forwarding table's).
    """

    def __init__(self, router: Router, traffic, *, credit_delay: int = 8,
                 saturate_depth: int = 4, sink_stall: float = 0.0, starve=None,
                 lids=None, seed: int = 0):
        if len(traffic) != router.ports:
            raise ValueError("one traffic generator per port")
        if credit_delay < 1:
            raise ValueError("credit_delay must be >= 1")
        self.router = router
        self.traffic = list(traffic)
        self.credit_delay = credit_delay
        self.saturate_depth = saturate_depth
        self.sink_stall = sink_stall
        self.starve = {o: sorted((s, math.inf if e is None else e) for s, e in periods)
                       for o, periods in (starve or {}).items()}
        self.lids = list(lids) if lids is not None else [
            router.forwarding.lid_of(p) for p in range(router.ports)]
        self.rng = random.Random(seed ^ 0x5EED)
        self.sources = [_Source(tr, router.num_vls, router.buffer_blocks) for tr in self.traffic]
        self.sink_free = [0] * router.ports
        self.events = []          # heap of (cycle, seq, kind, port, vl, blocks)
        self._event_seq = 0
        self.now = 0
        self.packets: list[SwitchPacket] = []     # every generated packet, by id
        self.delivered: list[SwitchPacket] = []   # in grant order
        self.dropped: list[SwitchPacket] = []
        self._flow_seq = {}
        self.injecting_until = None

    # --- helpers ---
    def _event(self, t, kind, port, vl, nblocks):
        self._event_seq += 1
        heapq.heappush(self.events, (t, self._event_seq, kind, port, vl, nblocks))

    def offer(self, port: int, cycle: int, dest: int, sl: int = 0, payload: int = 2020) -> None:
        """Script a packet: input ``port``'s source gets it at ``cycle`` (>= now, in
        cycle order per port), ahead of generated packets of the same cycle."""
        script = self.sources[port].script
        if cycle < self.now or (script and cycle < script[-1][0]):
            raise ValueError("offer packets in cycle order, not in the past")
        script.append((cycle, dest, sl, payload))

    def _generate(self, src: _Source, t: int, made=None):
        traffic = src.traffic
        dest, sl, payload = traffic.make() if made is None else made
        router = self.router
        p = SwitchPacket(len(self.packets), traffic.port, dest, self.lids[dest], sl,
                         router.sl_to_vl.lookup(sl), payload, router.width, t)
        self.packets.append(p)
        src.queues[p.vl].append(p)
        src.backlog += 1

    def _sink_release(self, o: int, t_out: int, beats: int):
        """Cycle after the sink behind ``o`` read the packet's last beat."""
        t = max(t_out, self.sink_free[o])
        periods = self.starve.get(o)
        stall = self.sink_stall
        if not periods and not stall:
            last = t + beats - 1
        else:
            rng = self.rng
            left = beats
            while True:
                if periods:
                    moved = True
                    while moved:
                        moved = False
                        for s, e in periods:
                            if s <= t < e:
                                t = e
                                moved = True
                    if t == math.inf:
                        self.sink_free[o] = math.inf
                        return math.inf
                if stall and rng.random() < stall:
                    t += 1
                    continue
                left -= 1
                if not left:
                    last = t
                    break
                t += 1
        self.sink_free[o] = last + 1
        return last + 1

    # --- simulation ---
    def step(self, inject: bool = True) -> None:
        t = self.now
        router = self.router
        events = self.events
        while events and events[0][0] <= t:
            _, _, kind, port, vl, nblocks = heapq.heappop(events)
            if kind == 0:
                self.sources[port].credit[vl] += nblocks
            else:
                router.credit(t, port, vl, nblocks)
        num_vls = router.num_vls
        for src in self.sources:
            traffic = src.traffic
            script = src.script
            while script and script[0][0] <= t:
                self._generate(src, t, script.popleft()[1:])
            if inject and traffic.active:
                if traffic.saturated:
                    while src.backlog < self.saturate_depth:
                        self._generate(src, t)
                else:
                    while src.next_gen <= t:
                        self._generate(src, src.next_gen)
                        src.next_gen += traffic.gap()
            if src.backlog and src.wire_free <= t:
                self._send(src, t, num_vls)
        for p in router.allocate(t):
            self._granted(p)
        self.now = t + 1

    def _send(self, src: _Source, t: int, num_vls: int) -> None:
        queues, credit = src.queues, src.credit
        chosen = None
        for k in range(MAX_DATA_VLS + 1):
            v = (src.vl_ptr + k) % (MAX_DATA_VLS + 1)
            q = queues[v]
            if q and (v >= num_vls or credit[v] >= q[0].blocks):
                chosen = v
                break
        if chosen is None:
            return
        p = queues[chosen].popleft()
        src.backlog -= 1
        src.vl_ptr = (chosen + 1) % (MAX_DATA_VLS + 1)
        src.wire_free = t + p.beats
        if chosen < num_vls:
            credit[chosen] -= p.blocks
        if not self.router.arrive(t, p):
            self.dropped.append(p)
            if chosen < num_vls:
                # Stored, then skipped once its end is in: blocks free after the tail.
                p.in_release = t + p.beats
                self._event(p.in_release + self.credit_delay, 0, p.src, chosen, p.blocks)

    def _granted(self, p: SwitchPacket) -> None:
        key = (p.src, p.out, p.vl)
        p.seq = self._flow_seq.get(key, 0)
        self._flow_seq[key] = p.seq + 1
        self.delivered.append(p)
        self._event(p.in_release + self.credit_delay, 0, p.src, p.vl, p.blocks)
        p.out_release = self._sink_release(p.out, p.t_out, p.beats)
        if p.out_release != math.inf:
            self._event(p.out_release + self.credit_delay, 1, p.out, p.vl, p.blocks)

    def next_activity(self, inject: bool = True) -> int:
        """The earliest cycle >= ``now`` at which :meth:`step` can change anything: a
        credit event, an allocation the router could make, a source's wire coming free
        with a packet waiting, or a Bernoulli source's next packet. Cycles before it are
        provably idle, so :meth:`run` jumps over them."""
        t = self.now
        soonest = self.router.wake if self.router.queued else 1 << 62
        if self.events and self.events[0][0] < soonest:
            soonest = self.events[0][0]
        for src in self.sources:
            if src.backlog and src.wire_free < soonest and self._can_send(src):
                soonest = src.wire_free      # (one waiting on credit waits for an event)
            if src.script and src.script[0][0] < soonest:
                soonest = src.script[0][0]
            traffic = src.traffic
            if inject and traffic.active:
                if traffic.saturated:
                    if src.backlog < self.saturate_depth:
                        return t
                elif src.next_gen < soonest:
                    soonest = src.next_gen
        return max(t, soonest)

    def _can_send(self, src: _Source) -> bool:
        num_vls, credit = self.router.num_vls, src.credit
        for v, q in enumerate(src.queues):
            if q and (v >= num_vls or credit[v] >= q[0].blocks):
                return True
        return False

    def run(self, cycles: int, inject: bool = True) -> "Network":
        """Run ``cycles`` cycles (skipping idle ones: the result is the same)."""
        end = self.now + cycles
        while self.now < end:
            self.step(inject)
            self.now = min(end, self.next_activity(inject))
        return self

    def outstanding(self) -> int:
        """Packets generated but neither delivered nor dropped."""
        scripted = sum(len(src.script) for src in self.sources)
        return len(self.packets) + scripted - len(self.delivered) - len(self.dropped)

    def drain(self, limit: int = 1_000_000) -> "Network":
        """Stop the sources and run until every generated packet left the switch."""
        start = self.now
        while self.outstanding():
            if self.now - start > limit:
                raise AssertionError(f"{self.outstanding()} packets not drained after {limit} cycles")
            self.step(inject=False)
            self.now = self.next_activity(False)
        return self

    def stats(self, start: int = 0, end: int | None = None) -> "SwitchStats":
        return SwitchStats.measure(self, start, self.now if end is None else end)


# ----------------------------------------------------------------------------- statistics

def _overlap(a0, a1, b0, b1):
    return max(0, min(a1, b1) - max(a0, b0))


@dataclass
class SwitchStats:
    """Measurements over the window ``[start, end)``.

    ``throughput[o]``: payload of packets whose start beat left output o in the window /
    (window x width). ``wire_utilization[o]``: fraction of window cycles output o
    carried a beat. ``latency``: start beat in to start beat out of those packets;
    ``total_latency``: generation to start beat out (includes the source queue).
    ``input_share[i]``: input i's fraction of the payload delivered in the window;
    ``jain``: Jain's index over the inputs whose generators are active.
    """
    ports: int
    width: int
    start: int
    end: int
    throughput: list
    wire_utilization: list
    offered_load: float
    latency: np.ndarray
    total_latency: np.ndarray
    input_share: list
    input_bytes: list
    jain: float
    generated: int
    delivered: int
    dropped: dict
    mean_throughput: float = field(init=False)
    latency_p50: float = field(init=False)
    latency_p99: float = field(init=False)
    total_latency_p50: float = field(init=False)
    total_latency_p99: float = field(init=False)

    def __post_init__(self):
        self.mean_throughput = float(np.mean(self.throughput))
        lat = self.latency if self.latency.size else np.array([np.nan])
        tot = self.total_latency if self.total_latency.size else np.array([np.nan])
        self.latency_p50, self.latency_p99 = (float(x) for x in np.percentile(lat, [50, 99]))
        self.total_latency_p50, self.total_latency_p99 = (
            float(x) for x in np.percentile(tot, [50, 99]))

    @classmethod
    def measure(cls, net: Network, start: int, end: int) -> "SwitchStats":
        router = net.router
        n, width = router.ports, router.width
        span = max(1, end - start)
        payload_out = [0] * n
        beats_out = [0] * n
        input_bytes = [0] * n
        latency, total = [], []
        for p in net.delivered:
            beats_out[p.out] += _overlap(p.t_out, p.t_out + p.beats, start, end)
            if start <= p.t_out < end:
                payload_out[p.out] += p.payload
                input_bytes[p.src] += p.payload
                latency.append(p.t_out - p.t_in)
                total.append(p.t_out - p.gen)
        delivered = sum(input_bytes)
        active = [i for i in range(n) if net.traffic[i].active]
        offered = float(np.mean([min(1.0, tr.load) for tr in net.traffic]))
        return cls(
            ports=n, width=width, start=start, end=end,
            throughput=[b / (span * width) for b in payload_out],
            wire_utilization=[b / span for b in beats_out],
            offered_load=offered,
            latency=np.asarray(latency, dtype=float),
            total_latency=np.asarray(total, dtype=float),
            input_share=[b / delivered if delivered else 0.0 for b in input_bytes],
            input_bytes=input_bytes,
            jain=jain_index(input_bytes[i] for i in active),
            generated=len(net.packets),
            delivered=len(net.delivered),
            dropped=dict(router.drops),
        )

    def summary(self) -> str:
        return (f"throughput mean {self.mean_throughput:.4f} (per port "
                f"{' '.join(f'{x:.3f}' for x in self.throughput)}), wire utilization mean "
                f"{np.mean(self.wire_utilization):.4f}; latency start-in to start-out p50 "
                f"{self.latency_p50:.0f} p99 {self.latency_p99:.0f} cycles; with source "
                f"queueing p50 {self.total_latency_p50:.0f} p99 {self.total_latency_p99:.0f}; "
                f"Jain {self.jain:.4f}")


# ----------------------------------------------------------------------------- checks

def _max_occupancy(intervals):
    """Max over time of the summed sizes of ``(begin, end, size)`` intervals [begin, end)."""
    points = []
    for begin, end, size in intervals:
        points.append((begin, 1, size))
        points.append((end, 0, -size))          # frees sort before takes at the same cycle
    points.sort()
    level = peak = 0
    for _, _, delta in points:
        level += delta
        if level > peak:
            peak = level
    return peak


def check_lossless(net: Network, *, drained: bool | None = None) -> dict:
    """Check a run from its packet records; raise AssertionError on the first violation.

    - every packet left the switch at most once, and (``drained``, default: when nothing
      is outstanding) every packet not dropped left exactly once;
    - order per (input, output, VL): start beats leave in generation order;
    - no input buffer (per input and VL) ever held more blocks than ``buffer_blocks``
      (a packet holds its blocks from its start beat in to its release), no downstream
      buffer more than ``downstream_blocks`` (start beat out to the sink's release);
    - each wire carries one packet at a time (input and output), and no beat leaves
      before it arrived (``t_out >= t_in``).

    Returns the peak occupancies ``{"input": blocks, "downstream": blocks}``.
    """
    router = net.router
    if drained is None:
        drained = net.outstanding() == 0
    seen = set()
    for p in net.delivered:
        assert p.id not in seen, f"packet {p!r} delivered twice"
        seen.add(p.id)
        assert p.t_out >= p.t_in, f"{p!r} left before it arrived"
        assert p.t_grant >= p.ready, f"{p!r} granted before it was ready"
    dropped = {p.id for p in net.dropped}
    assert not seen & dropped, "a packet both dropped and delivered"
    if drained:
        missing = [p for p in net.packets if p.id not in seen and p.id not in dropped
                   and p.t_in is not None]
        assert not missing, f"{len(missing)} packets lost, e.g. {missing[:3]}"
        unsent = [p for p in net.packets if p.t_in is None]
        assert not unsent, f"{len(unsent)} packets never left their source"
    flows = {}
    for p in sorted(net.delivered, key=lambda p: (p.t_out, p.id)):
        key = (p.src, p.out, p.vl)
        last = flows.get(key)
        assert last is None or p.id > last, f"flow {key} out of order at {p!r}"
        flows[key] = p.id
    by_input, by_down, in_wire, out_wire = {}, {}, {}, {}
    for p in net.delivered:
        by_input.setdefault((p.src, p.vl), []).append((p.t_in, p.in_release, p.blocks))
        by_down.setdefault((p.out, p.vl), []).append((p.t_out, p.out_release, p.blocks))
        in_wire.setdefault(p.src, []).append((p.t_in, p.t_in + p.beats, 1))
        out_wire.setdefault(p.out, []).append((p.t_out, p.t_out + p.beats, 1))
    for p in net.dropped:
        if p.in_release is not None:
            by_input.setdefault((p.src, p.vl), []).append((p.t_in, p.in_release, p.blocks))
        in_wire.setdefault(p.src, []).append((p.t_in, p.t_in + p.beats, 1))
    peak_in = peak_down = 0
    for key, intervals in by_input.items():
        peak = _max_occupancy(intervals)
        assert peak <= router.buffer_blocks, (
            f"input {key[0]} VL {key[1]}: {peak} blocks held, buffer {router.buffer_blocks}")
        peak_in = max(peak_in, peak)
    for key, intervals in by_down.items():
        peak = _max_occupancy(intervals)
        assert peak <= router.downstream_blocks, (
            f"output {key[0]} VL {key[1]}: {peak} blocks downstream, buffer "
            f"{router.downstream_blocks}")
        peak_down = max(peak_down, peak)
    for name, wires in (("input", in_wire), ("output", out_wire)):
        for port, intervals in wires.items():
            assert _max_occupancy(intervals) <= 1, f"{name} wire {port} carries two packets at once"
    return {"input": peak_in, "downstream": peak_down}


# ----------------------------------------------------------------------------- driver

def run_switch(ports: int = 8, pattern: str = "uniform", *, load: float = 1.0, payload=2020,
               cycles: int = 20000, warmup: int | None = None, num_vls: int = 1, sls=(0,),
               seed: int = 0, drain: bool = True, check: bool = True, credit_delay: int = 8,
               sink_stall: float = 0.0, starve=None, saturate_depth: int = 4, target: int = 0,
               hotspot: int = 0, hot_fraction: float = 0.25, permutation=None,
               exclude_self: bool = False, **router_args):
    """Build a :class:`Router` (``router_args``: mode, iterations, width, buffer_blocks,
    downstream_blocks, latencies, ...) and traffic, run ``cycles`` cycles of injection,
    measure over ``[warmup, cycles)`` (default warmup: a tenth), then (``drain``) let
    the switch empty and (``check``) run :func:`check_lossless`.

    Returns ``(stats, network)``.
    """
    router = Router(ports, num_vls, **router_args)
    traffic = make_traffic(pattern, ports, load=load, payload=payload, sls=sls,
                           width=router.width, seed=seed, target=target, hotspot=hotspot,
                           hot_fraction=hot_fraction, permutation=permutation,
                           exclude_self=exclude_self)
    net = Network(router, traffic, credit_delay=credit_delay, sink_stall=sink_stall,
                  starve=starve, saturate_depth=saturate_depth, seed=seed)
    net.run(cycles)
    if warmup is None:
        warmup = cycles // 10
    stats = net.stats(warmup, cycles)
    if drain:
        net.drain()
    if check:
        check_lossless(net, drained=drain)
    return stats, net


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.switch", description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the wire; >= 1 saturates")
    parser.add_argument("--pattern", choices=PATTERNS, default="uniform")
    parser.add_argument("--cycles", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--mode", choices=("voq", "fifo"), default="voq")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--input-speedup", type=int, default=1,
                        help="packets an input may send at once (read ports of its buffer)")
    parser.add_argument("--exclude-self", action="store_true",
                        help="uniform traffic over the other ports only (as make bench runs it)")
    parser.add_argument("--saturate-depth", type=int, default=4,
                        help="packets a saturated source keeps waiting")
    parser.add_argument("--payload", default="2020", help="bytes, or LO:HI for uniform random")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vls", type=int, default=1)
    parser.add_argument("--buffer-blocks", type=int, default=528)
    parser.add_argument("--downstream-blocks", type=int, default=132)
    parser.add_argument("--vl-weights", default=None,
                        help="output VL arbitration weights in 64-byte blocks, W0,W1,... "
                             f"(default {DEFAULT_VL_WEIGHT} each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock-mhz", type=float, default=400.0)
    args = parser.parse_args(argv)
    payload = (tuple(int(x) for x in args.payload.split(":")) if ":" in args.payload
               else int(args.payload))
    extra = {}
    if args.vl_weights:
        extra["vl_weights"] = [int(x) for x in args.vl_weights.split(",")]
    import time
    began = time.perf_counter()
    stats, net = run_switch(args.ports, args.pattern, load=args.load, payload=payload,
                            cycles=args.cycles, warmup=args.warmup, mode=args.mode,
                            iterations=args.iterations, width=args.width,
                            input_speedup=args.input_speedup, exclude_self=args.exclude_self,
                            saturate_depth=args.saturate_depth,
                            num_vls=args.vls, sls=tuple(range(args.vls)),
                            buffer_blocks=args.buffer_blocks,
                            downstream_blocks=args.downstream_blocks, seed=args.seed, **extra)
    wall = time.perf_counter() - began
    ns = 1000.0 / args.clock_mhz
    print(f"{args.ports}-port switch, {args.mode}, iSLIP x{args.iterations}, input speed-up "
          f"{args.input_speedup}, {args.vls} VL(s), "
          f"{args.pattern} load {args.load}, payload {args.payload} B, W={args.width} B, "
          f"buffers {args.buffer_blocks} blocks per VL in, {args.downstream_blocks} downstream, "
          f"{args.cycles} cycles (window {stats.start}..{stats.end})")
    print(f"throughput (payload / cycles*W): mean {stats.mean_throughput:.4f}, min "
          f"{min(stats.throughput):.4f}, max {max(stats.throughput):.4f}; wire utilization "
          f"{np.mean(stats.wire_utilization):.4f}")
    print(f"latency start-in to start-out: p50 {stats.latency_p50:.0f} cycles "
          f"({stats.latency_p50 * ns:.1f} ns), p99 {stats.latency_p99:.0f} cycles "
          f"({stats.latency_p99 * ns:.1f} ns) at {args.clock_mhz:g} MHz; zero-load hop "
          f"{net.router.hop_latency} cycles")
    print(f"with source queueing: p50 {stats.total_latency_p50:.0f}, p99 "
          f"{stats.total_latency_p99:.0f} cycles; Jain {stats.jain:.4f}; packets "
          f"{stats.generated} generated, {stats.delivered} delivered, drops {stats.dropped}; "
          f"lossless check passed")
    print(f"simulated {net.now / wall:,.0f} cycles/s ({wall:.2f} s wall)")


if __name__ == "__main__":
    main()
