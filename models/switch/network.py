"""The switch model's network: credit-controlled sources, the router, downstream credit
sinks, run cycle by cycle (skipping provably idle cycles); :func:`run_switch` builds one."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

from .router import MAX_DATA_VLS, Router, SwitchPacket
from .stats import SwitchStats, check_lossless
from .traffic import make_traffic

__all__ = ["Network", "run_switch"]


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
