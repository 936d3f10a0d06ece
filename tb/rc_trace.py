"""A trace of RC loss recovery between two NICs, read from the packets at their pins.

The NIC pair's wire monitors (:class:`tb.beats.WireMonitor`) already record every data
packet each NIC sends and receives, with its cycle, and :meth:`tb.nic_pair_tb.NicPairTB.lost_entries`
tells which of them the fault injectors destroyed. :func:`trace` turns a window of those
records into the events of recovery, per QP pair (QP q of A talks to QP q of B):

- ``fault``: a packet lost on a cable, what it was (request or ACK/NAK, opcode, PSN) and,
  for a request, the next request of the same QP with a later PSN (it exposes the gap to
  the responder; none means only the requester's timer can find it);
- ``nak``: a NAK the responder sent, and what the requester's completion unit does with
  it, modelled on its rules (docs/nic-reliability.md, and ``CompletionUnit``'s docstring):
  ``lost``; ``dropped`` when its PSN is not in ``(ack_psn, wire_psn]``, where
  ``wire_psn`` is the highest PSN the requester sent on the QP (the unit takes an answer
  for p only in ``(ack_psn, sent_psn]`` and not past ``wire_psn``; the executor emits a
  WQE's record with its first packet, so ``sent_psn``, the newest record's last PSN, is
  never below ``wire_psn`` and the wire bound decides); ``ignored`` after a NAK or timeout
  resend without progress since (``gap_seen``); else ``taken``;
- ``resend``: the requester sending again, seen as a request whose PSN is below the
  highest it sent on that QP and not the successor of the one it sent last: the PSN it
  resumed from, the message that PSN starts, and the cause: ``NAK`` when a sequence NAK
  was taken since the QP's previous resend, ``timeout`` when the timer's reference lies
  at least ``timeout_cycles`` back, else ``skip`` (no rewind of the completion unit: the
  doorbell scheduler's skip, docs/nic.md, which also restarts the QP's PSNs). The
  timer's reference is the latest of the QP's last progress (an answer taken that moved
  its acknowledged PSN forward), its previous resend and its last packet sent: progress
  and a rewind stop the timer and the next scan arms it again on a stuck head, and a
  scan restarts it when a packet of the QP went out since the QP's previous scan. A rewind that sent nothing before the next
  one is not on the wire: :func:`counter_events` merges the NIC's counters, read while
  the traffic runs, into the trace for that.

The packet trace is derived after the run from what the monitors recorded, so it costs
nothing while simulating; the counter reads do (and share the register port with the
doorbells, so a run with them is not cycle-identical to one without). The cycles are
those at the NICs' pins (the NIC decides a few cycles after a packet arrives and before
its first packet leaves).
"""
import dataclasses

from models.ib import AETH, BTH, LRH, Opcode
from models.nic.common import NakCode, psn_add, psn_lt

__all__ = ["Packet", "Event", "trace", "counter_events", "decode", "table", "summary",
           "packet_log"]

# Opcodes that begin a request message (the WQE's first PSN).
MESSAGE_FIRST = {Opcode.SEND_FIRST, Opcode.SEND_ONLY, Opcode.SEND_ONLY_WITH_IMMEDIATE,
                 Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY,
                 Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, Opcode.RDMA_READ_REQUEST,
                 Opcode.COMPARE_SWAP, Opcode.FETCH_ADD}
RESPONSES = range(Opcode.RDMA_READ_RESPONSE_FIRST, Opcode.ATOMIC_ACKNOWLEDGE + 1)


@dataclasses.dataclass(frozen=True)
class Packet:
    """One data packet at a NIC's pins: ``sender`` ("a" or "b"), the QP pair, the BTH
    opcode and PSN, AckReq, the AETH syndrome (ACKNOWLEDGE and atomic acknowledge only),
    ``lost`` when a fault destroyed it on the cable."""
    cycle: int
    sender: str
    qp: int
    opcode: int
    psn: int
    ackreq: bool
    syndrome: int | None
    lost: bool

    @property
    def is_request(self):
        return self.opcode not in RESPONSES

    @property
    def nak(self):
        """The NAK code (``NakCode``), RNR as ``"RNR"``, or None for an ACK or request."""
        if self.syndrome is None:
            return None
        kind = self.syndrome >> 5
        return {1: "RNR", 3: self.syndrome & 0x1F}.get(kind)

    def describe(self):
        name = Opcode(self.opcode).name if self.opcode in Opcode._value2member_map_ else \
            f"opcode {self.opcode:#04x}"
        text = f"{name} PSN {self.psn:#08x}"
        if self.ackreq:
            text += " AckReq"
        nak = self.nak
        if nak is not None:
            text += f" NAK {NakCode(nak).name if nak in NakCode._value2member_map_ else nak}"
        return text


def decode(entry, sender, lost, start=0):
    """A :class:`Packet` from a wire monitor record ``(bytes, end_bad, cycle)``, its cycle
    counted from ``start``."""
    data, _, cycle = entry
    cycle -= start
    bth = BTH.unpack(data[LRH.SIZE:])
    syndrome = None
    if bth.opcode in (Opcode.ACKNOWLEDGE, Opcode.ATOMIC_ACKNOWLEDGE):
        syndrome = AETH.unpack(data[LRH.SIZE + BTH.SIZE:]).syndrome
    return Packet(cycle=cycle, sender=sender, qp=bth.destqp, opcode=bth.opcode, psn=bth.psn,
                  ackreq=bool(bth.ackreq), syndrome=syndrome, lost=lost)


@dataclasses.dataclass
class Event:
    """One line of the trace. ``kind`` is ``fault``, ``nak``, ``resend`` or ``counter``;
    ``requester`` the side whose send queue the event concerns; ``detail`` says what
    happened, ``cause`` why (a NAK: taken, lost or why dropped; a resend: NAK, timeout or
    skip); ``timer_since``, for a resend, the timer's reference (see the module)."""
    cycle: int
    kind: str
    requester: str
    qp: int | None
    psn: int | None
    detail: str
    cause: str = ""
    timer_since: int | None = None


def _message_starts(requests):
    """First PSN -> (message number on its QP, cycle first sent), per QP."""
    starts = {}
    for p in requests:
        if p.opcode in MESSAGE_FIRST:
            per_qp = starts.setdefault(p.qp, {})
            per_qp.setdefault(p.psn, (len(per_qp), p.cycle))
    return starts


def trace(sent, wire_delay, timeout_cycles):
    """The recovery events of a window of WRITE/SEND traffic, in cycle order. ``sent``: for
    each side ("a", "b"), the :class:`Packet` list it sent in the window, in order. An
    answer reaches the requester's pins ``wire_delay`` cycles after it left the
    responder's; the requester's view (progress, NAKs taken) uses that cycle, every event
    the sender's. ``timeout_cycles``: the least time the local ACK timer can take to fire."""
    events = []
    for requester, responder in (("a", "b"), ("b", "a")):
        requests = [p for p in sent[requester] if p.is_request]
        answers = [p for p in sent[responder] if not p.is_request]
        starts = _message_starts(requests)
        # The requester's view, per QP: highest (the completion unit's ``wire_psn``) and
        # last PSN sent, acknowledged PSN, last progress, last restart, ``gap_seen``, and
        # whether a sequence NAK was taken since the last restart.
        highest, last_sent, acked = {}, {}, {}
        last_progress, last_restart, gap_seen, nak_taken = {}, {}, set(), set()
        last_packet = {}
        timeline = sorted([(p.cycle, 1, p) for p in requests]
                          + [(p.cycle + wire_delay, 0, p) for p in answers],
                          key=lambda item: (item[0], item[1]))
        for index, (cycle, is_request, p) in enumerate(timeline):
            q = p.qp
            if not is_request:
                nak = p.nak
                if p.lost:
                    events.append(Event(p.cycle, "fault", requester, q, p.psn,
                                        f"{responder}->{requester} {p.describe()}"))
                    if nak is not None:
                        events.append(Event(p.cycle, "nak", requester, q, p.psn,
                                            f"{responder} sends {p.describe()}", cause="lost"))
                    continue
                # The completion unit drops an answer outside (ack_psn, wire_psn].
                inside = (q in highest and (q not in acked or psn_lt(acked[q], p.psn))
                          and not psn_lt(highest[q], p.psn))
                if nak is not None:
                    if not inside:
                        newest = f"{highest[q]:#08x}" if q in highest else "none"
                        cause = f"dropped: past wire_psn {newest}"
                    elif nak == 0 and q in gap_seen:
                        cause = "ignored: gap_seen"
                    else:
                        cause = "taken"
                    events.append(Event(p.cycle, "nak", requester, q, p.psn,
                                        f"{responder} sends {p.describe()}", cause=cause))
                if not inside:
                    continue
                if nak == 0 and q not in gap_seen:
                    nak_taken.add(q)
                # An ACK acknowledges its PSN, a NAK the one before.
                now_acked = psn_add(p.psn, -1) if nak is not None else p.psn
                if q not in acked or psn_lt(acked[q], now_acked):
                    acked[q] = now_acked
                    last_progress[q] = cycle
                    gap_seen.discard(q)
                continue
            if p.lost:
                # The responder sees the gap only at a later packet past the lost one.
                later = next((r for c, r_is, r in timeline[index + 1:]
                              if r_is and r.qp == q and psn_lt(p.psn, r.psn)), None)
                after = (f"next request past it on QP {q} at {later.cycle}: {later.describe()}"
                         if later else f"no request past it on QP {q}")
                events.append(Event(cycle, "fault", requester, q, p.psn,
                                    f"{requester}->{responder} {p.describe()}; {after}"))
            # A restart: the PSNs stop counting up one by one, below the highest sent.
            if q in highest and not psn_lt(highest[q], p.psn) \
                    and p.psn != psn_add(last_sent[q], 1):
                message, first_sent = starts[q].get(p.psn, (None, None))
                since = max(last_progress.get(q, 0), last_restart.get(q, 0),
                            last_packet.get(q, 0))
                if q in nak_taken:
                    cause = "NAK"
                elif cycle - since >= timeout_cycles:
                    cause = "timeout"
                else:
                    cause = "skip"
                where = (f"message {message} of QP {q} (first sent at {first_sent})"
                         if message is not None else "not a message start")
                acknowledged = f"{acked[q]:#08x}" if q in acked else "nothing"
                events.append(Event(cycle, "resend", requester, q, p.psn,
                                    f"from {where}; highest sent {highest[q]:#08x}, "
                                    f"acknowledged {acknowledged}",
                                    cause=cause, timer_since=since))
                last_restart[q] = cycle
                nak_taken.discard(q)
                if cause != "skip":
                    # A rewind of the completion unit (a skip is the scheduler's alone).
                    gap_seen.add(q)
                    acked[q] = psn_add(p.psn, -1)
            if q not in highest or psn_lt(highest[q], p.psn):
                highest[q] = p.psn
            last_sent[q] = p.psn
            last_packet[q] = cycle
    events.sort(key=lambda e: e.cycle)
    return events


def counter_events(log):
    """:class:`Event` ``counter`` lines from a counter log of ``(cycle, side, name, value)``
    (:meth:`tb.nic_pair_tb.NicPairTB.watch_counters`), to merge into a trace: a rewind that
    sent nothing shows only there."""
    return [Event(cycle, "counter", side, None, None, f"{name} = {value}")
            for cycle, side, name, value in log]


def summary(events):
    """Counts of the trace: faults, NAKs sent (and why each was not acted on), restarts by
    cause."""
    counts = {"faults": 0}
    for e in events:
        if e.kind == "fault":
            counts["faults"] += 1
        elif e.kind == "nak":
            key = "naks " + e.cause.split(":")[0]
            counts[key] = counts.get(key, 0) + 1
        elif e.kind == "resend":
            key = "resends " + e.cause
            counts[key] = counts.get(key, 0) + 1
    return counts


def table(events):
    """The trace as a Markdown table."""
    lines = ["| cycle | event | requester | QP | PSN | cause | timer since (cycles before) | what |",
             "|---|---|---|---|---|---|---|---|"]
    for e in events:
        since = "" if e.timer_since is None else f"{e.timer_since:,} ({e.cycle - e.timer_since:,})"
        qp = "" if e.qp is None else e.qp
        psn = "" if e.psn is None else f"{e.psn:#08x}"
        lines.append(f"| {e.cycle:,} | {e.kind} | {e.requester} | {qp} | {psn} | {e.cause} | "
                     f"{since} | {e.detail} |")
    return "\n".join(lines)


def packet_log(sent):
    """Every packet of ``sent`` (as for :func:`trace`), one a line in cycle order: the raw
    material of a trace, to follow one QP by ``grep``."""
    packets = sorted((p for side in sent.values() for p in side), key=lambda p: p.cycle)
    return "".join(f"{p.cycle} {p.sender} QP {p.qp} {p.describe()}"
                   f"{' LOST' if p.lost else ''}\n" for p in packets)
