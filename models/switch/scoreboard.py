"""Per-flow, in-order, exactly-once scoreboard of a switch's forwarding, for testbenches."""

from __future__ import annotations

from collections import deque

from models.ib import LRH

from .routing import DROP_REASONS, ForwardingTable, SlToVl, forward, with_vl

__all__ = ["FlowScoreboard"]


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
                result = (tuple(sorted(ports)), out_vl, with_vl(packet, out_vl))
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
