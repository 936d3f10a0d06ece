"""An IBA link partner written from docs/link.md alone, driving a port's wire from the testbench.

It shares no code with the link port: it keeps its own state (INIT, ARMED, ACTIVE),
sends flow-control packets at a cadence of its own and data packets as soon as its
state and the port's credit allow, and reads the port's flow-control packets from
the wire. It is a model for :class:`tb.beats.CycleLoop` (``sample``, then ``drive``).
"""
from collections import deque

from enum import IntEnum

from models.ib import FlowControl, FlowControlOp
from models.packet import blocks, wire_packet

__all__ = ["LinkPartner", "LinkState", "INIT_REPEATS"]

INIT_REPEATS = 8        # INIT packets per VL after hearing the port's INIT (docs/link.md)
FCCL_MODULUS = 4096


class LinkState(IntEnum):
    """The states of docs/link.md, with the values the port's ``state`` shows."""
    INIT = 0
    ARMED = 1
    ACTIVE = 2


class LinkPartner:
    """One end of a link, facing the port whose wire is ``<out_prefix>`` (what the port
    sends) and ``<in_prefix>`` (what the port receives).

    ``delay``: cycles from a beat leaving one end to the other end taking it, each way.
    ``init_cadence``, ``armed_cadence``, ``active_cadence``: cycles between flow-control
    packets of one VL in each state. ``fc_on_entry``: whether one flow-control packet per
    VL goes at once on entering ARMED and ACTIVE (docs/link.md says a peer should; one
    that does not must lose nothing either). ``armed_timeout``: cycles in ARMED without
    the port's NORMAL packet after which the partner starts over from INIT (docs/link.md:
    the port does so after ``4 * fc_period + 1``). ``buffer_blocks``: the credit the partner
    advertises (it takes no data in these tests, so its FCCL never moves).
    """

    def __init__(self, dut, out_prefix, in_prefix, width, num_vls, *, delay=1,
                 init_cadence=64, armed_cadence=64, active_cadence=1024, fc_on_entry=True,
                 armed_timeout=4096, buffer_blocks=64):
        names = ("valid", "data", "start", "end", "count", "end_bad", "link")
        self.watch = {n: getattr(dut, f"{out_prefix}__{n}") for n in names}
        self.drive_to = {n: getattr(dut, f"{in_prefix}__{n}") for n in names}
        self.width = width
        self.num_vls = num_vls
        self.delay = delay
        self.cadence = {LinkState.INIT: init_cadence, LinkState.ARMED: armed_cadence,
                        LinkState.ACTIVE: active_cadence}
        self.fc_on_entry = fc_on_entry
        self.armed_timeout = armed_timeout
        self.buffer_blocks = buffer_blocks
        self.running = False
        self.queue = {v: deque() for v in range(num_vls)}  # packets (LRH..ICRC) to send
        self.sent = {v: [] for v in range(num_vls)}          # in the order they left
        self.cut = []               # packets cut short by the partner's own reset
        self.current_vl = None      # VL of the data packet going out now
        self.arrivals = deque()     # (due cycle, beat) of the port's beats on their way here
        self.departures = deque()   # (due cycle, beat) of ours on their way to the port
        self.beats = deque()        # beats of the data packet going out now
        self.fc_last = False        # the last thing sent was a flow-control packet
        self.state_log = []         # (cycle, state)
        self.driven = []            # (cycle, "INIT" / "NORMAL" / "data end") on the port's wire
        self.reset()
        self.drive_to["valid"].value = 0

    # --- state --------------------------------------------------------------------------

    def reset(self, cycle=0, cut=True):
        """Back to INIT with every count at zero. On the partner's own reset (``cut``) a data
        packet half sent is cut short (the port drops it as truncated); on the port's INIT
        in ACTIVE it is finished first (docs/link.md)."""
        self.state = LinkState.INIT
        self.entered_at = cycle
        self.heard_init = False
        self.init_repeats = [0] * self.num_vls
        self.fctbs = [0] * self.num_vls
        self.limit = [None] * self.num_vls      # the port's FCCL, once heard
        self.since_fc = [self.cadence[LinkState.INIT]] * self.num_vls
        if self.beats and cut:
            self.cut.append(self.sent[self.current_vl].pop())
            self.beats.clear()
        self.state_log.append((cycle, self.state))

    def enter(self, state, cycle):
        self.state = state
        self.entered_at = cycle
        self.state_log.append((cycle, state))
        # One flow-control packet per VL on entering ARMED or ACTIVE (docs/link.md).
        if self.fc_on_entry:
            self.since_fc = [self.cadence[state]] * self.num_vls

    def send(self, vl, packet):
        self.queue[vl].append(packet)

    def idle(self):
        return not self.beats and not any(self.queue.values())

    # --- the port's flow-control packets --------------------------------------------------

    def heard(self, fc, cycle):
        if fc.vl >= self.num_vls:
            return
        if fc.op == FlowControlOp.INIT:
            if self.state == LinkState.ACTIVE:
                # The port was reset: so are our counts; this INIT counts as heard.
                self.reset(cycle, cut=False)
            self.heard_init = True
            self.limit[fc.vl] = fc.fccl
        elif self.state != LinkState.INIT:     # NORMAL packets are stale in INIT
            self.limit[fc.vl] = fc.fccl
            if self.state == LinkState.ARMED:
                self.enter(LinkState.ACTIVE, cycle)

    def sample(self, cycle):
        if int(self.watch["valid"].value):
            beat = {n: int(s.value) for n, s in self.watch.items()}
            self.arrivals.append((cycle + self.delay - 1, beat))
        while self.arrivals and self.arrivals[0][0] <= cycle:
            _, beat = self.arrivals.popleft()
            if not (self.running and beat["link"]):
                continue
            raw = beat["data"].to_bytes(self.width, "little")[:6]
            if beat["start"] and beat["end"] and beat["count"] == 6 and FlowControl.lpcrc_ok(raw):
                self.heard(FlowControl.unpack(raw), cycle)

    # --- what goes out --------------------------------------------------------------------

    def credit_ok(self, vl, packet):
        """IBA's send rule: the packet's blocks fit under the port's last FCCL (modulo 4096)."""
        if self.limit[vl] is None:
            return False
        need = blocks(len(wire_packet(packet)))
        return (self.limit[vl] - (self.fctbs[vl] + need)) % FCCL_MODULUS <= 2048

    def next_beat(self, cycle):
        for v in range(self.num_vls):
            self.since_fc[v] += 1
        if self.beats:
            return self.beats.popleft()
        due = [v for v in range(self.num_vls) if self.since_fc[v] >= self.cadence[self.state]]
        # A flow-control packet and a data packet that both wait take turns, so that any
        # cadence down to one cycle leaves room for data.
        data_waits = self.state == LinkState.ACTIVE and any(
            self.queue[v] and self.credit_ok(v, self.queue[v][0]) for v in range(self.num_vls))
        if due and not (data_waits and self.fc_last):
            self.fc_last = True
            v = max(due, key=lambda vl: self.since_fc[vl])     # the longest waiting first
            self.since_fc[v] = 0
            op = FlowControlOp.INIT if self.state == LinkState.INIT else FlowControlOp.NORMAL
            if op == FlowControlOp.INIT and self.heard_init:
                self.init_repeats[v] = min(self.init_repeats[v] + 1, INIT_REPEATS)
                if all(n == INIT_REPEATS for n in self.init_repeats):
                    self.enter(LinkState.ARMED, cycle)
            fc = FlowControl(op=op, fctbs=self.fctbs[v], vl=v,
                             fccl=self.buffer_blocks % FCCL_MODULUS).pack()
            return dict(data=int.from_bytes(fc, "little"), start=1, end=1, count=6,
                        end_bad=0, link=1)
        self.fc_last = False
        if self.state != LinkState.ACTIVE:
            return None
        for v in range(self.num_vls):
            if self.queue[v] and self.credit_ok(v, self.queue[v][0]):
                packet = self.queue[v].popleft()
                on_wire = wire_packet(packet)
                self.fctbs[v] = (self.fctbs[v] + blocks(len(on_wire))) % FCCL_MODULUS
                self.sent[v].append(packet)
                self.current_vl = v
                for offset in range(0, len(on_wire), self.width):
                    chunk = on_wire[offset:offset + self.width]
                    end = offset + self.width >= len(on_wire)
                    self.beats.append(dict(data=int.from_bytes(chunk, "little"), start=int(offset == 0),
                                           end=int(end), count=len(chunk) if end else self.width,
                                           end_bad=0, link=0))
                return self.beats.popleft()
        return None

    def drive(self, cycle):
        armed_for = cycle - self.entered_at if self.state == LinkState.ARMED else 0
        if self.running and armed_for > self.armed_timeout:
            self.reset(cycle)       # the port never answered: it was reset again
        beat = self.next_beat(cycle) if self.running else None
        if beat is not None:
            self.departures.append((cycle + self.delay - 1, beat))
        if self.departures and self.departures[0][0] <= cycle:
            _, beat = self.departures.popleft()
            for name, value in beat.items():
                self.drive_to[name].value = value
            self.drive_to["valid"].value = 1
            if beat["link"]:
                fc = FlowControl.unpack(beat["data"].to_bytes(self.width, "little")[:6])
                self.driven.append((cycle, FlowControlOp(fc.op).name))
            elif beat["end"]:
                self.driven.append((cycle, "data end"))
        else:
            self.drive_to["valid"].value = 0
