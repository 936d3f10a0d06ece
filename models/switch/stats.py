"""Statistics of a switch-model run, and the losslessness checks on its packet records."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["SwitchStats", "check_lossless", "jain_index"]


def jain_index(values) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); 1.0 for no or all-zero values."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0 or not np.any(x):
        return 1.0
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


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
    def measure(cls, net, start: int, end: int) -> "SwitchStats":
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


def check_lossless(net, *, drained: bool | None = None) -> dict:
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
