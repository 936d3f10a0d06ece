"""Input buffers of the switch model by name: virtual output queues, or one FIFO per VL
(head-of-line blocking), as the RTL switch's ``mode``."""

from __future__ import annotations

from collections import deque

__all__ = ["BUFFERS", "FifoBuffer", "VoqBuffer"]


class VoqBuffer:
    """One input's virtual output queues: a queue per (output port, output VL)."""

    def __init__(self, num_vls: int):
        self.queues: dict[tuple, deque] = {}
        self.active: set[tuple] = set()         # the keys of the non-empty queues

    def push(self, p) -> None:
        key = (p.out, p.vl)
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = deque()
        queue.append(p)
        self.active.add(key)

    def heads(self) -> list:
        """``(output, vl, packet)`` of every queue's head."""
        queues = self.queues
        return [(o, v, queues[(o, v)][0]) for (o, v) in self.active]

    def pop(self, out: int, vl: int):
        queue = self.queues[(out, vl)]
        p = queue.popleft()
        if not queue:
            self.active.discard((out, vl))
        return p


class FifoBuffer:
    """One input's FIFO per VL: only the oldest packet of a VL may go, whatever its output
    (with one VL, exactly one FIFO per input)."""

    def __init__(self, num_vls: int):
        self.queues = [deque() for _ in range(num_vls)]

    def push(self, p) -> None:
        self.queues[p.vl].append(p)

    def heads(self) -> list:
        return [(q[0].out, v, q[0]) for v, q in enumerate(self.queues) if q]

    def pop(self, out: int, vl: int):
        return self.queues[vl].popleft()


# Router(mode=name) gives each input BUFFERS[name](num_vls).
BUFFERS = {"voq": VoqBuffer, "fifo": FifoBuffer}
