"""The switch model's router: input buffers, output VL arbitration, an allocator, the
crossbar and output credits, cycle by cycle (timing and rules: docs/models.md)."""

from __future__ import annotations

from models.link import VlArbiter
from models.packet import blocks, send_only_wire_bytes, wire_beats

from .allocators import ALLOCATORS
from .buffers import BUFFERS
from .routing import ForwardingTable, SlToVl

__all__ = ["DEFAULT_VL_WEIGHT", "MAX_DATA_VLS", "RTL_ALLOCATORS", "Router", "SwitchPacket",
           "stream_to_one_output"]

MAX_DATA_VLS = 15                        # VL15 is never a data VL
DEFAULT_VL_WEIGHT = 16                   # 64-byte blocks per VL turn (portN_vlV_weight)
# The RTL switch's allocators (hdl/switch/switch.py ALLOCATORS) as Router arguments: the
# single-cycle iSLIP is Router's own timing; the pipelined one (the RTL's default) takes
# three allocation cycles, matches ahead and holds its credit view (docs/models.md).
RTL_ALLOCATORS = {"islip": {}, "pipelined": dict(alloc_cycles=3, lookahead=3, credit_hold=True)}


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
    """The switch: input buffers, output VL arbitration, an allocator, crossbar, output
    credits; its timing and rules are in docs/models.md.

    Parameters: ``ports``, ``num_vls`` data VLs, ``mode`` the input buffers by name
    (:data:`BUFFERS`: "voq" or "fifo", as the RTL's), ``allocator`` by name
    (:data:`ALLOCATORS`: "islip") with its ``iterations``, beat ``width``, ``buffer_blocks`` per VL per input,
    ``downstream_blocks`` per VL behind each output (the next hop's receive buffer:
    the switch's initial credit), ``mtu`` (payload bytes), pipeline
    ``ingress_cycles`` / ``alloc_cycles`` / ``egress_cycles`` and ``turnaround_cycles``
    (a port's grants are ``beats + turnaround_cycles`` apart), ``input_speedup`` (packets
    an input may send at once: read ports of its buffer; 1 in the RTL, more only to ask
    what speed-up would buy), ``lookahead`` (a port may be matched while its current
    packet has at most that many beats left to hand over; the match waits for the port,
    one such pending match per port; 0 in the RTL of today), ``credit_hold`` (the pipelined
    allocator's stale credit view: an output's packet of more than ``short_blocks`` blocks is
    matched only with nothing uncounted, one of at most ``short_blocks`` with at most
    ``short_matches`` others uncounted, a packet counted ``count_cycles`` after its start;
    the rule exactly as the RTL's, docs/models.md; ``short_blocks=0``: every packet waits as
    a long one, the allocator before the rule), ``cut_through``,
    ``forwarding`` (:class:`ForwardingTable`, default LID p + 1 -> port p),
    ``sl_to_vl`` (:class:`SlToVl`) and ``vl_weights``: the output VL arbitration weights
    in 64-byte blocks (8 bits, default 16), an int for every output and VL, a list per VL
    for every output, or a list of such lists per output; :meth:`set_vl_weight` changes
    one. Timing and the VL arbitration are in the module docstring.
    """

    def __init__(self, ports: int = 8, num_vls: int = 2, *, mode: str = "voq",
                 allocator: str = "islip", iterations: int = 1, width: int = 64, buffer_blocks: int = 528,
                 downstream_blocks: int = 132, mtu: int = 4096, ingress_cycles: int = 3,
                 alloc_cycles: int = 1, egress_cycles: int = 2, turnaround_cycles: int = 0,
                 input_speedup: int = 1, lookahead: int = 0, credit_hold: bool = False,
                 short_blocks: int = 4, short_matches: int = 6, count_cycles: int = 3,
                 cut_through: bool = True,
                 forwarding: ForwardingTable | None = None,
                 sl_to_vl: SlToVl | None = None, vl_weights=DEFAULT_VL_WEIGHT):
        if not 2 <= ports <= 64:
            raise ValueError(f"ports must be 2 to 64 in the model, not {ports!r}")
        if not 1 <= num_vls <= MAX_DATA_VLS:
            raise ValueError(f"num_vls must be 1 to {MAX_DATA_VLS}, not {num_vls!r}")
        if mode not in BUFFERS:
            raise ValueError(f"mode must be one of {sorted(BUFFERS)}, not {mode!r}")
        if allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {sorted(ALLOCATORS)}, not {allocator!r}")
        if width < 8 or width & (width - 1):
            raise ValueError(f"width must be a power of two >= 8, not {width!r}")
        if min(ingress_cycles, alloc_cycles, egress_cycles, turnaround_cycles) < 0:
            raise ValueError("pipeline latencies must be >= 0")
        if not isinstance(lookahead, int) or not 0 <= lookahead <= 64:
            raise ValueError(f"lookahead must be 0 to 64 beats, not {lookahead!r}")
        if not isinstance(short_blocks, int) or not 0 <= short_blocks <= 2047:
            raise ValueError(f"short_blocks must be 0 to 2047, not {short_blocks!r}")
        if not isinstance(short_matches, int) or not 3 <= short_matches <= 15:
            raise ValueError(f"short_matches must be 3 to 15, not {short_matches!r}")
        if not isinstance(count_cycles, int) or count_cycles < 1:
            raise ValueError(f"count_cycles must be an integer >= 1, not {count_cycles!r}")
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
        self.credit_hold = credit_hold
        self.short_blocks, self.short_matches, self.count_cycles = (
            short_blocks, short_matches, count_cycles)
        # Per output, the matches whose count the allocator's credit view has not seen:
        # [match cycle, cycle from which the view has it, blocks, VL, on the quiet rule].
        self.uncounted = [[] for _ in range(ports)]
        self.allocator = ALLOCATORS[allocator](ports * input_speedup, iterations, outputs=ports)
        self.buffers = [BUFFERS[mode](num_vls) for _ in range(ports)]
        # Output VL arbitration, the link transmitter's weighted round robin per output.
        self.vl_arbiters = [VlArbiter([DEFAULT_VL_WEIGHT] * num_vls) for _ in range(ports)]
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
    def vl_weight(self) -> list:
        """Each output's VL weights (64-byte blocks per turn)."""
        return [arbiter.weights for arbiter in self.vl_arbiters]

    @property
    def hop_latency(self) -> int:
        return self.ingress_cycles + self.alloc_cycles + self.egress_cycles

    def set_vl_weight(self, port: int, vl: int, weight: int) -> None:
        """Output ``port``'s arbitration weight of ``vl``: 64-byte blocks per turn, 0..255
        (the RTL register ``portN_vlV_weight``). Takes effect at the next turn."""
        if not 0 <= weight <= 255:
            raise ValueError(f"VL weight is 8 bits, not {weight!r}")
        self.vl_arbiters[port].weights[vl] = weight

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
        self.buffers[p.src].push(p)
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
        rule = [self._credit_rule(o, t) for o in range(ports)] if self.credit_hold else None
        # Eligible heads: cand[(i, o, v)] is the packet; vl_any[o] a VL bitmask.
        cand = {}
        vl_any = [0] * ports
        next_wake = 1 << 62
        for i in range(ports):
            if in_avail[i] > t:
                if in_avail[i] < next_wake:
                    next_wake = in_avail[i]
                continue
            for o, v, head in self.buffers[i].heads():
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
                if rule is not None and not self._may_match(o, v, head.blocks, rule[o]):
                    next_wake = t + 1        # the view catches up cycle by cycle
                    continue
                cand[(i, o, v)] = head
                vl_any[o] |= 1 << v
        if not cand:
            self.wake = next_wake
            return []
        self.wake = t + 1
        # Output VL arbitration (weighted round robin), then the allocator on the chosen VLs.
        vl_range = range(self.num_vls)
        vl_sel = [-1] * ports
        for o in range(ports):
            mask = vl_any[o]
            if mask:
                vl_sel[o] = self.vl_arbiters[o].pick([mask >> v & 1 for v in vl_range])
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
            p = self.buffers[i].pop(o, v)
            self.queued -= 1
            down_credit[o][v] -= p.blocks
            self.vl_arbiters[o].commit(v, p.blocks)
            p.t_grant = t
            # Matched ahead, the packet starts when both of its ports have freed.
            start = max(t, self.in_slot_busy[i][k], out_busy[o])
            if rule is not None:
                self.uncounted[o].append([t, start + self.count_cycles + 4, p.blocks, v,
                                          rule[o] == "quiet"])
            busy = start + p.beats + hold
            self.in_slot_busy[i][k] = out_busy[o] = busy
            self.in_slot_avail[i][k] = out_avail[o] = max(start + 1, busy - lookahead)
            in_busy[i] = min(self.in_slot_busy[i])
            in_avail[i] = min(self.in_slot_avail[i])
            p.t_out = start + self.alloc_cycles + self.egress_cycles
            p.in_release = start + self.alloc_cycles + p.beats - 1
            granted.append(p)
        return granted

    def _credit_rule(self, o: int, t: int):
        """Which packets output ``o`` may be matched to in cycle ``t`` under the pipelined
        allocator's credit view: "quiet" (any that fits), "short" (short ones on the
        reserve), or None (docs/models.md, the RTL's timing: the view has a count from 4
        cycles after it; the request is a cycle before the match)."""
        seen = [u for u in self.uncounted[o] if u[1] > t]
        self.uncounted[o] = seen
        S, K = self.short_blocks, self.short_matches
        at = {u[0]: u for u in seen}
        if any(u[2] > S for u in seen) or t - 2 in at and at[t - 2][4]:
            return None                      # a long packet, or a quiet match 2 cycles ago
        counted_small = sum(1 for u in seen if u[0] <= t - 3)
        if counted_small == 0 and t - 1 not in at and t - 2 not in at:
            return "quiet"
        if counted_small <= K - 2 and not (t - 1 in at and at[t - 1][4]):
            return "short"
        return None

    def _may_match(self, o: int, v: int, nblocks: int, rule) -> bool:
        """A head of ``nblocks`` for (o, v) under ``rule`` (:meth:`_credit_rule`); on the short
        rule it fits the credit the view sees (the uncounted matches' blocks back) less the
        reserve of K x S blocks."""
        if rule == "quiet":
            return True
        if rule != "short" or nblocks > self.short_blocks:
            return False
        view = self.down_credit[o][v] + sum(u[2] for u in self.uncounted[o] if u[3] == v)
        return nblocks <= view - self.short_matches * self.short_blocks

    def empty(self) -> bool:
        return self.queued == 0


def stream_to_one_output(router: Router, sources, payloads, *, out: int = 0) -> list:
    """Every input of ``sources`` holds SEND_ONLY packets of ``payloads`` (bytes, in order)
    for output ``out`` on VL 0 from cycle 0, and the next hop frees each packet's credit as
    its last beat leaves: the start beat out (``t_out``) and beats of every packet, in the
    order they leave (the short-packet spacing, docs/models.md)."""
    n = 0
    for src in sources:
        for payload in payloads:
            packet = SwitchPacket(n, src, out, router.forwarding.lid_of(out), 0, 0, payload,
                                  router.width, 0)
            if not router.arrive(0, packet):
                raise ValueError(f"packet {n} dropped: {packet.drop}")
            n += 1
    granted, t = [], 0
    while not router.empty():
        if t > 1000 * n:
            raise RuntimeError(f"{n - len(granted)} packets never granted")
        for p in granted:
            if p.t_out + p.beats == t:
                router.credit(t, out, 0, p.blocks)
        granted += router.allocate(t)
        t += 1
    return sorted((p.t_out, p.beats) for p in granted)
