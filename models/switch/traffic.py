"""Traffic generators of the switch model: one per input port, by destination pattern."""

from __future__ import annotations

import math
import random

from models.packet import send_only_wire_bytes, wire_beats

__all__ = ["PATTERNS", "Traffic", "make_traffic"]

PATTERNS = ("uniform", "incast", "permutation", "hotspot")


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
