"""Cycle-level model of the credit-based link (pure Python, no simulator).

Factored like BookSim so the switch model can reuse the pieces:

- :class:`Channel` -- a delay line, one item (beat or flow-control packet) per cycle.
- :class:`CreditSender` / :class:`CreditReceiver` -- the IBA credit arithmetic of one
  VL: FCTBS and the credit limit at the sender, ABR / capacity / used blocks at the
  receiver, 12-bit counters of 64-byte blocks.
- :class:`FlowControlScheduler` -- when a port's transmitter sends a flow-control
  packet for a VL (``hdl/link/link_transmitter.py``).
- :class:`VlArbiter` -- the transmitter's weighted round robin over eligible VLs.
- :class:`LinkStateMachine` -- flow-control initialisation (``hdl/link/link_port.py``,
  docs/link.md): the states, what each does with the peer's packets, the transitions;
  event by event, not cycle by cycle.
- :class:`PacketBufferModel` -- one VL's receive buffer (``hdl/link/packet_buffer.py``):
  two ``lib.fifo.SyncFIFOBuffered`` (beats, verdicts), store-and-forward or cut-through.
- :class:`Transmitter` / :class:`Receiver` -- one port's halves, built from the above.
- :class:`LinkModel` -- two ports A and B joined by two channels; data A->B (and,
  optionally, a saturating reverse stream B->A), the reverse wire carrying B's
  flow-control packets.
- :func:`min_buffer_for_full_rate` and :func:`credit_loop_cycles` -- the buffer a
  cable length needs, simulated and analytic.

Sizes: a packet is given by its wire bytes ``n`` (LRH .. VCRC, what LRH.PktLen * 4 + 2
says). It takes ``ceil(n / width)`` beats on the wire, ``ceil((n - 2) / width)`` beats
in the receive buffer (the VCRC is stripped) and ``ceil(n / 64)`` credit blocks.

Timing, matching the RTL cycle for cycle (all "cycle t" below is the cycle in which
a block's combinational logic decides; its registers show the result at t + 1):

- transmitter: a start beat accepted at t is in the beat register at t + 1 and in the
  output register (VCRC appended) at t + 2; the rest of the packet follows one beat a
  cycle, the VCRC spilling into one more beat when it must; the next packet or
  flow-control packet can be chosen in the cycle after the last beat was chosen.
  Priority at a packet boundary: flow-control packet, then a data packet (so a
  flow-control packet goes out only between data packets).
- cable: ``wire_delay`` registers (LinkPair's delay line, 0 = wired straight).
- receiver: an input register and the VCRC check's register, so the beat a
  transmitter chose at t is handled at t + 4 + wire_delay: written into the VL's beat
  FIFO, and at the wire end beat the verdict is written and ABR / used blocks are
  updated (visible at the next cycle). :class:`Channel` ``delay`` = 2 (beat and output
  registers) + wire_delay + 2 (input and check registers).
- PacketBuffer: an entry written at c is readable at c + 2 (SyncFIFOBuffered), one
  read per cycle. Store-and-forward starts a packet when its verdict is readable;
  cut-through starts it as soon as the start beat is, the end beat waits for the
  verdict. Reading the end beat releases the packet: used blocks drop the next cycle.
- flow control: the receiver's FCCL is a register (ABR + free blocks of the cycle
  before), the transmitter's decision to send a flow-control packet another
  (:class:`FlowControlScheduler`); the peer's receiver decodes the packet in its check
  stage, reports it on the registered ``flow_control`` port, the transmitter's credit
  limit register takes it one cycle later and its registered credit view a cycle after
  that: a decision at t changes what the sender may start at t + 7 + wire_delay.

Simplifications (said where they matter):

- the link is ACTIVE from cycle 0 with FCTBS = ABR = 0 and the limit = capacity (the
  INIT/ARMED handshake is :class:`LinkStateMachine`, outside the cycle model); every VL's
  flow-control timer starts at
  ``fc_since`` (default 0). Checked against LinkPair under amaranth.sim (width 64,
  4 KiB packets, 132 blocks, store-and-forward; width 8, short packets, credit
  stalls, both buffer modes): the same accept / first-out / last-out cycle for every
  packet and the same credit-stall count, once ``fc_since`` is set to the RTL's timer
  values at ACTIVE (only the phase of the ``fc_min_interval`` batching depends on them);
- no errors: no bad VCRC, no drops, no lost flow-control packets (ABR := FCTBS is
  modelled but is a no-op on a clean wire);
- sources present a packet's beats back to back once it has started (the RTL waits
  for ``valid`` in the middle of a packet); a packet is offered from its cycle on;
- the receive FIFO depth (``buffer_blocks * max(1, 64 // width) + 1`` beats) is
  checked by assertion, as are the credits: occupancy counts a packet's whole blocks
  from its start beat's arrival to its release, which the credit rule must keep
  within the capacity;
- ``buffer_blocks=None`` means an unlimited buffer (no credit check at all), used as
  the reference for the full rate. Real buffers are limited to 2048 blocks by the
  12-bit arithmetic (2047 in the RTL), and the RTL insists on at least one largest
  packet of the MTU (66 blocks for 4096); the model only asks for >= 1 block.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from models.arbiters import turn_pick
from models.packet import CREDIT_BLOCK_BYTES, SEND_ONLY_OVERHEAD, blocks, stored_beats, wire_beats

__all__ = [
    "FCCL_MOD", "FC_BATCH_INTERVAL", "MIN_WIRE_BYTES",
    "Channel", "CreditSender", "CreditReceiver", "FlowControlScheduler", "VlArbiter",
    "LinkStateMachine", "INIT_REPEATS", "ARMED_FC_INTERVAL",
    "Packet", "PacketBufferModel", "Transmitter", "Receiver", "LinkModel", "LinkStats",
    "credit_loop_cycles", "estimate_min_buffer", "min_buffer_for_full_rate",
]

FCCL_MOD = 4096              # FCTBS, FCCL and ABR are 12-bit counters
FCCL_MASK = FCCL_MOD - 1
CREDIT_WINDOW = 2048         # IBA: send if (FCCL - (FCTBS + blocks)) mod 4096 <= 2048
FC_BATCH_INTERVAL = 4        # link_transmitter.FC_BATCH_INTERVAL
ARMED_FC_INTERVAL = 16       # link_transmitter.ARMED_FC_INTERVAL
INIT_REPEATS = 8             # link_port.INIT_REPEATS
MIN_WIRE_BYTES = SEND_ONLY_OVERHEAD            # smallest IBA transport packet on a wire
FC_ITEM = "fc"


# ----------------------------------------------------------------------------- channel

class Channel:
    """A delay line: an item pushed at cycle t pops at cycle t + ``delay``.

    At most one item enters per cycle (a wire carries one beat a cycle). Items must be
    popped in the cycle they are due: call :meth:`pop` every cycle, before :meth:`push`
    when ``delay`` is 0.
    """

    def __init__(self, delay: int):
        if delay < 0:
            raise ValueError(f"delay must be >= 0, not {delay!r}")
        self.delay = delay
        self._line = deque()        # (due cycle, item)
        self._last_push = None

    def push(self, now: int, item) -> None:
        if self._last_push == now:
            raise AssertionError(f"cycle {now}: two items entered a channel in one cycle")
        self._last_push = now
        self._line.append((now + self.delay, item))

    def pop(self, now: int):
        """The item due at ``now``, or None."""
        line = self._line
        if line and line[0][0] <= now:
            due, item = line.popleft()
            assert due == now, f"channel item due at {due} popped at {now}"
            return item
        return None

    def __len__(self):
        return len(self._line)

    def items(self):
        return [item for _, item in self._line]


# ----------------------------------------------------------------------------- credits

class CreditSender:
    """Sender's credit state of one VL: FCTBS (blocks sent) and the peer's limit FCCL."""

    def __init__(self, limit: int = 0):
        self.fctbs = 0
        self.limit = limit & FCCL_MASK

    def blocks_available(self) -> int:
        """Blocks the limit still covers (0 when FCTBS is past it)."""
        room = (self.limit - self.fctbs) & FCCL_MASK
        return room if room <= CREDIT_WINDOW else 0

    def can_send(self, nblocks: int) -> bool:
        """IBA rule: (FCCL - (FCTBS + blocks)) mod 4096 <= 2048."""
        return ((self.limit - self.fctbs - nblocks) & FCCL_MASK) <= CREDIT_WINDOW

    def sent(self, nblocks: int) -> None:
        if not self.can_send(nblocks):
            raise AssertionError(f"sending {nblocks} blocks beyond the credit limit "
                                 f"(FCTBS {self.fctbs}, FCCL {self.limit})")
        self.fctbs = (self.fctbs + nblocks) & FCCL_MASK

    def update(self, fccl: int) -> None:
        """A flow-control packet from the peer: limit := FCCL (absolute, heals losses)."""
        self.limit = fccl & FCCL_MASK


class CreditReceiver:
    """Receiver's credit state of one VL: ABR, capacity and used blocks; FCCL to advertise."""

    def __init__(self, capacity: int):
        if not 1 <= capacity <= CREDIT_WINDOW:
            raise ValueError(f"capacity must be 1 to {CREDIT_WINDOW} blocks, not {capacity!r}")
        self.capacity = capacity
        self.abr = 0
        self.used = 0

    def fccl(self) -> int:
        return (self.abr + self.capacity - self.used) & FCCL_MASK

    def received(self, nblocks: int) -> None:
        self.abr = (self.abr + nblocks) & FCCL_MASK
        self.used += nblocks
        if self.used > self.capacity:
            raise AssertionError(f"receive buffer overflow: {self.used} of {self.capacity} blocks")

    def freed(self, nblocks: int) -> None:
        if nblocks > self.used:
            raise AssertionError(f"freeing {nblocks} blocks, only {self.used} used")
        self.used -= nblocks

    def sync(self, fctbs: int) -> None:
        """A flow-control packet from the sender: ABR := FCTBS."""
        self.abr = fctbs & FCCL_MASK


# ----------------------------------------------------------------------------- scheduling

class FlowControlScheduler:
    """When a transmitter sends a flow-control packet for a VL (link_transmitter.py).

    Per VL a timer ``since`` (cycles since this VL's last flow-control packet, saturating
    at ``fc_period``) and the FCCL it last carried. A VL wants a packet when

    - ``since >= fc_min_interval`` and the advertised FCCL changed (or the link is not
      ACTIVE yet), or
    - ``since >= min(ARMED_FC_INTERVAL, fc_min_interval)`` and the link is ARMED, or
    - ``since >= FC_BATCH_INTERVAL`` and the FCCL advanced by ``fc_batch_blocks`` or more
      ((FCCL - last) mod 4096; ``fc_batch_blocks=None`` turns this rule off, as in the
      RTL before it had it), or
    - ``since == fc_period`` (the refresh that heals lost packets).

    The lowest wanting VL goes first. The transmitter sends it only at a packet
    boundary (flow-control packets go between data packets, ahead of the next one).

    As in the RTL the decision is a register: :meth:`step` decides from this cycle's
    values whether a VL wants a packet in the next one. The timer terms look a cycle
    ahead, so they fire in the cycle they name; the FCCL terms see the advertised FCCL
    one cycle late, and the batch test (itself registered) two. A VL sent in this
    cycle wants none in the next. Call :meth:`choose` (which VL goes, if this is a
    packet boundary), then :meth:`step` with the VL actually sent (or None) and the
    advertised FCCLs of this cycle, once per cycle.
    """

    def __init__(self, num_vls: int, fc_period: int = 1024, fc_min_interval: int = 64,
                 fc_batch_blocks: int | None = 64):
        if not 1 <= fc_min_interval <= fc_period:
            raise ValueError("fc_min_interval must be 1 to fc_period")
        self.num_vls = num_vls
        self.fc_period = fc_period
        self.fc_min_interval = fc_min_interval
        self.fc_batch_blocks = fc_batch_blocks
        self.since = [fc_period] * num_vls     # RTL reset / clear values
        self.last = [0] * num_vls
        self.batch_ready = [False] * num_vls   # registered: (FCCL - last) >= batch
        self.want = [False] * num_vls          # registered: wants a packet this cycle

    def start(self, advertised) -> None:
        """Set the registers as if the timers had been running: a VL wants a packet
        now if its timer and the advertised FCCL say so."""
        for vl in range(self.num_vls):
            since = self.since[vl]
            self.batch_ready[vl] = self._batch(vl, advertised[vl])
            self.want[vl] = (since == self.fc_period
                             or since >= self.fc_min_interval and advertised[vl] != self.last[vl]
                             or since >= FC_BATCH_INTERVAL and self.batch_ready[vl])

    def _batch(self, vl, fccl):
        batch = self.fc_batch_blocks
        return batch is not None and ((fccl - self.last[vl]) & FCCL_MASK) >= batch

    def choose(self):
        for vl in range(self.num_vls):
            if self.want[vl]:
                return vl
        return None

    def step(self, sent_vl, advertised, active: bool = True, armed: bool = False) -> None:
        since, period = self.since, self.fc_period
        armed_interval = min(ARMED_FC_INTERVAL, self.fc_min_interval)
        for vl in range(self.num_vls):
            self.want[vl] = vl != sent_vl and (
                since[vl] >= self.fc_min_interval - 1
                and ((advertised[vl] & FCCL_MASK) != self.last[vl] or not active)
                or armed and since[vl] >= armed_interval - 1
                or since[vl] >= FC_BATCH_INTERVAL - 1 and self.batch_ready[vl]
                or since[vl] >= period - 1)
            self.batch_ready[vl] = self._batch(vl, advertised[vl])
            if vl == sent_vl:
                since[vl] = 0
                self.last[vl] = advertised[vl] & FCCL_MASK
            elif since[vl] != period:
                since[vl] += 1


class LinkStateMachine:
    """One port's flow-control initialisation, event by event (docs/link.md, the state
    table; ``hdl/link/link_port.py``). States 0 INIT, 1 ARMED, 2 ACTIVE, as ``LinkState``.

    Events: :meth:`heard` (a good flow-control packet of the peer, ``init`` for Op INIT),
    :meth:`sent_init` (one of our INIT packets went out on ``vl``), :meth:`data` (a good
    data packet of the peer ended: returns whether it is taken, False meaning dropped as
    ``link_down``), :meth:`armed_for` (cycles spent in ARMED so far), :meth:`quiet_for`
    (cycles in ACTIVE since the peer's last good flow-control packet), :meth:`reset`.
    ``sends()`` says what the port sends now: ``"INIT"``, ``"NORMAL"`` or
    ``"NORMAL+data"``; ``fc_interval`` the cycles between one VL's flow-control packets
    while the link is not ACTIVE; ``abr_held`` whether ABR is held at 0.
    """

    INIT, ARMED, ACTIVE = 0, 1, 2

    def __init__(self, num_vls: int = 2, fc_period: int = 1024, fc_min_interval: int = 64):
        self.num_vls = num_vls
        self.armed_timeout = 4 * fc_period
        self.fail_timeout = 8 * fc_period
        self.fc_min_interval = fc_min_interval
        self.link_inits = 0
        self.reset()

    def reset(self) -> None:
        self.state = self.INIT
        self.since_reset = True         # no ARMED since the reset: data is stale
        self.heard_init = False
        self.repeats = [0] * self.num_vls

    def _enter_init(self, heard: bool) -> None:
        self.state = self.INIT
        self.heard_init = heard
        self.repeats = [0] * self.num_vls

    @property
    def fc_interval(self) -> int:
        if self.state == self.ARMED:
            return min(ARMED_FC_INTERVAL, self.fc_min_interval)
        return self.fc_min_interval

    @property
    def abr_held(self) -> bool:
        return self.state == self.INIT

    def sends(self) -> str:
        return ("INIT", "NORMAL", "NORMAL+data")[self.state]

    def sent_init(self, vl: int) -> None:
        if self.state == self.INIT and self.heard_init:
            self.repeats[vl] = min(self.repeats[vl] + 1, INIT_REPEATS)
            if all(n == INIT_REPEATS for n in self.repeats):
                self.state = self.ARMED
                self.since_reset = False

    def heard(self, init: bool) -> bool:
        """A good flow-control packet of the peer: returns whether it is taken (sets the
        credit limit and ABR); NORMAL packets are ignored in INIT."""
        if init:
            if self.state == self.ACTIVE:       # the peer was reset
                self.link_inits += 1
                self._enter_init(heard=True)
            else:                               # INIT, or ARMED: the peer still initialising
                self.heard_init = True
            return True
        if self.state == self.INIT:
            return False
        if self.state == self.ARMED:
            self.state = self.ACTIVE
        return True

    def data(self) -> bool:
        if self.state == self.INIT:
            return not self.since_reset
        if self.state == self.ARMED:
            self.state = self.ACTIVE
        return True

    def armed_for(self, cycles: int) -> None:
        if self.state == self.ARMED and cycles > self.armed_timeout:
            self._enter_init(heard=False)      # the peer never answered

    def quiet_for(self, cycles: int) -> None:
        if self.state == self.ACTIVE and cycles > self.fail_timeout:
            self.link_inits += 1
            self._enter_init(heard=False)      # the link failed


class VlArbiter:
    """The transmitter's weighted round robin over VLs whose head packet has credit.

    ``weights`` are 64-byte blocks per turn (8-bit in the RTL). The VL holding the turn
    keeps it while it is eligible and has budget left; a turn always lets at least one
    packet through (a packet bigger than the remaining budget still goes, the budget
    then drops to 0). Otherwise the next eligible VL after the pointer wins (the
    pointer's own VL last) and starts a turn with budget ``weight - blocks``. Work
    conserving: an eligible VL is never passed over for an idle one.
    """

    def __init__(self, weights):
        self.weights = list(weights)
        self.pointer = 0
        self.budget = 0

    def pick(self, eligible):
        """The VL to send from, or None. ``eligible[v]``: a head packet with credit."""
        requests = sum(1 << v for v, e in enumerate(eligible) if e)
        return turn_pick(requests, self.pointer, bool(self.budget), len(self.weights))

    def commit(self, vl: int, nblocks: int) -> None:
        """The picked packet (``nblocks`` blocks) goes: update the turn."""
        stay = vl == self.pointer and self.budget != 0
        base = self.budget if stay else self.weights[vl]
        self.budget = base - nblocks if base > nblocks else 0
        self.pointer = vl


# ----------------------------------------------------------------------------- ports

class Packet:
    """One data packet and the cycles it passed the model's points."""
    __slots__ = ("id", "vl", "nbytes", "payload", "offered", "beats", "stored", "blocks",
                 "accepted", "first_out", "last_out")

    def __init__(self, id, vl, nbytes, payload, offered, width):
        if nbytes < MIN_WIRE_BYTES:
            raise ValueError(f"a data packet has at least {MIN_WIRE_BYTES} wire bytes, not {nbytes}")
        self.id = id
        self.vl = vl
        self.nbytes = nbytes
        self.payload = payload
        self.offered = offered
        self.beats = wire_beats(nbytes, width)
        self.stored = stored_beats(nbytes, width)
        self.blocks = blocks(nbytes)
        self.accepted = None    # cycle the transmitter took its start beat (on the wire +1)
        self.first_out = None   # cycle its start beat left the receive buffer
        self.last_out = None    # cycle its end beat left the receive buffer

    @property
    def latency(self):
        """Start beat into the transmitter to start beat out of the receiver (as the bench)."""
        return self.first_out - self.accepted

    def __repr__(self):
        return (f"Packet(id={self.id}, vl={self.vl}, nbytes={self.nbytes}, "
                f"offered={self.offered}, accepted={self.accepted}, out={self.first_out}..{self.last_out})")


class PacketBufferModel:
    """One VL's receive buffer: beat FIFO and verdict FIFO (SyncFIFOBuffered timing).

    ``capacity`` in credit blocks (None: unlimited). The model checks the RTL's
    PacketBuffer depth (``capacity * max(1, 64 // width) + 1`` beats, the last slot
    kept for a closing beat) and the credit invariant: the blocks of the packets held,
    each counted whole from its start beat's arrival until it is released, never
    exceed ``capacity``.
    """

    def __init__(self, *, width: int, capacity: int | None, cut_through: bool):
        self.width = width
        self.capacity = capacity
        self.cut_through = cut_through
        self.depth = None if capacity is None else capacity * max(1, CREDIT_BLOCK_BYTES // width) + 1
        self.beats = deque()        # [ready cycle, packet, is_start, is_end]
        self.verdicts = deque()     # [ready cycle, packet]
        self.forwarding = False
        self.held_blocks = 0
        self.max_held_blocks = 0
        self.max_beats = 0

    def start(self, packet: Packet) -> None:
        self.held_blocks += packet.blocks
        if self.held_blocks > self.max_held_blocks:
            self.max_held_blocks = self.held_blocks
        if self.capacity is not None and self.held_blocks > self.capacity:
            raise AssertionError(f"VL{packet.vl} buffer overflow: {self.held_blocks} blocks held, "
                                 f"capacity {self.capacity}")

    def write(self, now: int, packet: Packet, is_start: bool, is_end: bool) -> None:
        level = len(self.beats)     # entries written before this cycle, not yet read
        if self.depth is not None and self.depth - level <= 1:
            raise AssertionError(f"cycle {now}: VL{packet.vl} beat FIFO full ({level} of {self.depth})")
        self.beats.append((now + 2, packet, is_start, is_end))
        if level + 1 > self.max_beats:
            self.max_beats = level + 1

    def verdict(self, now: int, packet: Packet) -> None:
        self.verdicts.append((now + 2, packet))

    def read(self, now: int, ready) -> Packet | None:
        """One cycle of the reader. ``ready()`` is asked only when a beat is offered.

        Returns the packet released this cycle (its end beat left), else None.
        """
        beats = self.beats
        if not beats or beats[0][0] > now:
            return None
        _, packet, is_start, is_end = beats[0]
        verdict_ready = bool(self.verdicts) and self.verdicts[0][0] <= now
        if not (self.forwarding or verdict_ready or self.cut_through):
            return None
        if is_end and not verdict_ready:
            return None
        if not ready():
            return None
        beats.popleft()
        if is_start:
            packet.first_out = now
        self.forwarding = not is_end
        if not is_end:
            return None
        _, verdict_packet = self.verdicts.popleft()
        assert verdict_packet is packet
        packet.last_out = now
        self.held_blocks -= packet.blocks
        return packet


class Transmitter:
    """Sending half of a port: per-VL packet queues, credits, arbiter, flow control."""

    def __init__(self, *, width: int, num_vls: int, fc_period: int, fc_min_interval: int,
                 fc_batch_blocks: int | None, weights, initial_limit: int | None):
        self.width = width
        self.num_vls = num_vls
        self.check_credits = initial_limit is not None
        self.senders = [CreditSender(initial_limit or 0) for _ in range(num_vls)]
        self.arbiter = VlArbiter(weights)
        self.fc = FlowControlScheduler(num_vls, fc_period, fc_min_interval, fc_batch_blocks)
        self.queues = [deque() for _ in range(num_vls)]
        self.busy = False           # more stored beats of `packet` to send
        self.extra = False          # the VCRC spill beat of `packet` is next
        self.packet = None
        self.beat = 0
        self.credit_stall_cycles = [0] * num_vls
        self.packets_sent = [0] * num_vls
        self.fc_packets_sent = 0
        self.data_beats_sent = 0

    def step(self, now: int, advertised):
        """One cycle: returns the wire item chosen (into the output register), or None.

        ``advertised``: this port's receiver FCCL per VL, as its register shows it this cycle.
        Wire items: ``(packet, wire beat index)`` or ``("fc", vl, fctbs, fccl)``.
        """
        senders, queues = self.senders, self.queues
        busy, current = self.busy, self.packet.vl if self.packet is not None else -1
        eligible = [False] * self.num_vls
        for vl in range(self.num_vls):
            queue = queues[vl]
            if not queue or queue[0].offered > now or (busy and vl == current):
                continue        # no start beat at the head of this VL's stream
            if not self.check_credits or senders[vl].can_send(queue[0].blocks):
                eligible[vl] = True
            else:
                self.credit_stall_cycles[vl] += 1
        fc = self.fc
        sent_fc = None
        item = None
        if self.extra:
            packet = self.packet
            item = (packet, packet.beats - 1)
            self.extra = False
        elif busy:
            packet = self.packet
            item = (packet, self.beat)
            self.beat += 1
            if self.beat == packet.stored:
                self.busy = False
                self.extra = packet.beats > packet.stored
        else:
            fc_vl = fc.choose()
            if fc_vl is not None:
                item = (FC_ITEM, fc_vl, senders[fc_vl].fctbs, advertised[fc_vl] & FCCL_MASK)
                sent_fc = fc_vl
                self.fc_packets_sent += 1
            else:
                vl = self.arbiter.pick(eligible)
                if vl is not None:
                    packet = queues[vl].popleft()
                    self.arbiter.commit(vl, packet.blocks)
                    if self.check_credits:
                        senders[vl].sent(packet.blocks)
                    else:
                        senders[vl].fctbs = (senders[vl].fctbs + packet.blocks) & FCCL_MASK
                    self.packets_sent[vl] += 1
                    packet.accepted = now
                    self.packet = packet
                    item = (packet, 0)
                    self.beat = 1
                    self.busy = packet.stored > 1
                    self.extra = packet.stored == 1 and packet.beats > 1
        if item is not None and item[0] is not FC_ITEM:
            self.data_beats_sent += 1
        fc.step(sent_fc, advertised)
        return item

    def credit_update(self, vl: int, fccl: int) -> None:
        self.senders[vl].update(fccl)


class Receiver:
    """Receiving half of a port: input stage, per-VL buffers and credits."""

    def __init__(self, *, width: int, num_vls: int, buffer_blocks: int | None, cut_through: bool):
        self.width = width
        self.num_vls = num_vls
        self.unlimited = buffer_blocks is None
        self.credits = None if self.unlimited else [CreditReceiver(buffer_blocks) for _ in range(num_vls)]
        self.buffers = [PacketBufferModel(width=width, capacity=buffer_blocks, cut_through=cut_through)
                        for _ in range(num_vls)]
        self.max_used = [0] * num_vls
        self.fc_received = 0
        self.delivered = []

    def fccl(self):
        if self.unlimited:
            return [0] * self.num_vls
        return [credit.fccl() for credit in self.credits]

    def accept(self, now: int, item):
        """The input-register stage of one wire item. Returns ``(vl, fccl)`` of a
        flow-control packet for this port's transmitter (through its 2-cycle path)."""
        if item[0] is FC_ITEM:
            _, vl, fctbs, fccl = item
            self.fc_received += 1
            if not self.unlimited:
                self.credits[vl].sync(fctbs)
            return vl, fccl
        packet, index = item
        buffer = self.buffers[packet.vl]
        if index == 0:
            buffer.start(packet)
        if index < packet.stored:
            buffer.write(now, packet, index == 0, index == packet.stored - 1)
        if index == packet.beats - 1:
            buffer.verdict(now, packet)
            if not self.unlimited:
                credit = self.credits[packet.vl]
                credit.received(packet.blocks)
                if credit.used > self.max_used[packet.vl]:
                    self.max_used[packet.vl] = credit.used
        return None

    def read(self, now: int, ready) -> None:
        """One cycle of every VL's reader; ``ready(vl)`` is the sink's ready."""
        for vl, buffer in enumerate(self.buffers):
            released = buffer.read(now, lambda: ready(vl))
            if released is not None:
                if not self.unlimited:
                    self.credits[vl].freed(released.blocks)
                self.delivered.append(released)


# ----------------------------------------------------------------------------- link

@dataclass
class LinkStats:
    width: int
    cycles: int
    delivered_packets: int
    delivered_payload_bytes: int
    delivered_wire_bytes: int
    throughput: float              # payload bytes / (cycles * width), whole run
    wire_throughput: float         # wire bytes (LRH..VCRC) / (cycles * width), whole run
    credit_stall_cycles: list
    max_occupancy_blocks: list     # whole packets from start arrival to release, per VL
    max_used_blocks: list          # the RTL's used_blocks register, per VL
    fc_packets_sent: dict          # side -> flow-control packets its transmitter sent
    latencies: list = field(repr=False)    # first_out - accepted, per delivered packet
    packets: list = field(repr=False)      # delivered Packet records, in delivery order

    def steady_throughput(self, skip: int | None = None) -> float:
        """Payload throughput between the end beats of delivered packets, skipping the
        first ``skip`` (default a tenth) as the bench does: packets after packet ``skip``
        over the cycles from packet ``skip - 1``'s end to the last one's."""
        packets = self.packets
        if skip is None:
            skip = max(2, len(packets) // 10)
        if len(packets) <= skip:
            raise ValueError("not enough delivered packets to measure")
        span = packets[-1].last_out - packets[skip - 1].last_out
        return sum(p.payload for p in packets[skip:]) / (span * self.width)


class LinkModel:
    """Cycle-level simulation of one link: traffic A->B, B's flow control on the way back.

    Parameters follow the RTL (LinkPair / LinkPort): ``width`` bytes per beat,
    ``num_vls`` data VLs, ``buffer_blocks`` per VL at B (None: unlimited; the RTL
    default is two largest packets, 132 blocks for MTU 4096), ``wire_delay`` cable
    registers each way, ``fc_period``, ``fc_min_interval``, ``fc_batch_blocks`` (None:
    no batch rule), ``cut_through`` (LinkPair's default is store-and-forward),
    ``vl_weights`` (blocks per turn; an int for all VLs).

    Traffic, A->B: ``traffic``, an iterable of ``(cycle offered, vl, wire bytes)`` or
    ``(cycle, vl, wire bytes, payload bytes)``; and/or ``packet_bytes`` for a saturating
    source of fixed-size packets on each VL of ``saturate_vls`` (payload defaults to
    ``packet_bytes - 26``, a SEND_ONLY packet). ``reverse_packet_bytes`` adds a
    saturating B->A stream on VL 0, so B's flow-control packets wait for its packet
    boundaries. B's sink stalls each cycle with probability ``sink_stall``; A's is
    always ready. ``fc_since``: the flow-control timers' values at cycle 0 (cycles since
    each VL's last flow-control packet; an int, a list per VL, or a dict per side
    ``{"a": ..., "b": ...}``): the RTL's depend on how its INIT handshake ended, and
    with small packets they set the phase of the ``fc_min_interval`` batching.
    """

    def __init__(self, *, width: int = 64, num_vls: int = 2, buffer_blocks: int | None = 132,
                 wire_delay: int = 0, fc_period: int = 1024, fc_min_interval: int = 64,
                 fc_batch_blocks: int | None = 64, cut_through: bool = False, vl_weights=16,
                 traffic=None, packet_bytes: int | None = None, saturate_vls=(0,),
                 payload_bytes: int | None = None, reverse_packet_bytes: int | None = None,
                 sink_stall: float = 0.0, seed: int = 0, fc_since=0):
        if width < 8 or width & (width - 1):
            raise ValueError(f"width must be a power of two >= 8, not {width!r}")
        if not 1 <= num_vls <= 15:
            raise ValueError(f"num_vls must be 1 to 15, not {num_vls!r}")
        if wire_delay < 0:
            raise ValueError("wire_delay must be >= 0")
        if isinstance(vl_weights, int):
            vl_weights = [vl_weights] * num_vls
        if len(vl_weights) != num_vls:
            raise ValueError("one weight per VL")
        self.width = width
        self.num_vls = num_vls
        self.buffer_blocks = buffer_blocks
        self.wire_delay = wire_delay
        self.fc_period = fc_period
        self.now = 0
        self.rng = random.Random(seed)
        self.sink_stall = sink_stall
        common = dict(width=width, num_vls=num_vls, fc_period=fc_period,
                      fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks,
                      weights=vl_weights)
        # B's buffers get the A->B traffic; A's (same size) the optional reverse stream.
        self.tx = {side: Transmitter(initial_limit=buffer_blocks, **common) for side in "ab"}
        self.rx = {side: Receiver(width=width, num_vls=num_vls, buffer_blocks=buffer_blocks,
                                  cut_through=cut_through) for side in "ab"}
        for side in "ab":
            # The link just went ACTIVE: the last flow-control packets carried today's FCCL.
            since = fc_since.get(side, 0) if isinstance(fc_since, dict) else fc_since
            since = [since] * num_vls if isinstance(since, int) else list(since)
            self.tx[side].fc.since = [min(s, fc_period) for s in since]
            self.tx[side].fc.last = self.rx[side].fccl()
            self.tx[side].fc.start(self.rx[side].fccl())
        # The receiver's FCCL register: what the transmitter sees is a cycle old.
        self.advertised = {side: self.rx[side].fccl() for side in "ab"}
        self.wire = {side: Channel(wire_delay + 4) for side in "ab"}     # from side's tx
        self.credit_path = {side: Channel(3) for side in "ab"}           # to side's tx view
        self._next_id = 0
        self._offered = 0
        self._pending = sorted(traffic or (), key=lambda t: t[0])
        self._pending_index = 0
        self.packet_bytes = packet_bytes
        self.saturate_vls = tuple(saturate_vls) if packet_bytes is not None else ()
        self.payload_bytes = (payload_bytes if payload_bytes is not None
                              else (packet_bytes - SEND_ONLY_OVERHEAD if packet_bytes else 0))
        self.reverse_packet_bytes = reverse_packet_bytes
        for vl in self.saturate_vls:
            if not 0 <= vl < num_vls:
                raise ValueError(f"no VL {vl}")

    # --- traffic ---
    def _new_packet(self, vl, nbytes, payload, offered):
        if not 0 <= vl < self.num_vls:
            raise ValueError(f"no VL {vl}")
        if self.buffer_blocks is not None and blocks(nbytes) > self.buffer_blocks:
            raise ValueError(f"a {nbytes}-byte packet needs {blocks(nbytes)} blocks, "
                             f"the buffer has {self.buffer_blocks}")
        packet = Packet(self._next_id, vl, nbytes, payload, offered, self.width)
        self._next_id += 1
        return packet

    def offer(self, cycle: int, vl: int, nbytes: int, payload: int | None = None) -> None:
        """Queue a packet on A for VL ``vl`` from ``cycle`` on (in offer order per VL)."""
        if payload is None:
            payload = max(0, nbytes - SEND_ONLY_OVERHEAD)
        self.tx["a"].queues[vl].append(self._new_packet(vl, nbytes, payload, max(cycle, self.now)))
        self._offered += 1

    def _feed(self, now):
        pending = self._pending
        while self._pending_index < len(pending) and pending[self._pending_index][0] <= now:
            entry = pending[self._pending_index]
            self._pending_index += 1
            self.offer(entry[0], entry[1], entry[2], entry[3] if len(entry) > 3 else None)
        queues = self.tx["a"].queues
        for vl in self.saturate_vls:
            while len(queues[vl]) < 2:
                self.offer(now, vl, self.packet_bytes, self.payload_bytes)
        if self.reverse_packet_bytes is not None:
            queue = self.tx["b"].queues[0]
            while len(queue) < 2:
                queue.append(self._new_packet(0, self.reverse_packet_bytes, 0, now))

    # --- simulation ---
    def step(self) -> None:
        now = self.now
        self._feed(now)
        tx, rx, wire, credit_path = self.tx, self.rx, self.wire, self.credit_path
        for side in "ab":
            update = credit_path[side].pop(now)
            if update is not None:
                tx[side].credit_update(*update)
        # Transmitters first: they read their receivers' FCCL registers of this cycle,
        # which hold the credits as they were a cycle ago.
        advertised = self.advertised
        items = {side: tx[side].step(now, advertised[side]) for side in "ab"}
        self.advertised = {side: rx[side].fccl() for side in "ab"}
        for side, peer in (("a", "b"), ("b", "a")):
            arriving = wire[peer].pop(now)
            if arriving is not None:
                report = rx[side].accept(now, arriving)
                if report is not None:
                    credit_path[side].push(now, report)
        stall = self.sink_stall
        if stall:
            rng = self.rng
            rx["b"].read(now, lambda vl: rng.random() >= stall)
        else:
            rx["b"].read(now, lambda vl: True)
        rx["a"].read(now, lambda vl: True)
        for side in "ab":
            if items[side] is not None:
                wire[side].push(now, items[side])
        self.now = now + 1

    def run(self, cycles: int) -> "LinkModel":
        for _ in range(cycles):
            self.step()
        return self

    def idle(self) -> bool:
        """All offered traffic delivered (saturating sources never are)."""
        return (self._pending_index == len(self._pending)
                and len(self.rx["b"].delivered) == self._offered)

    def drain(self, limit: int = 1_000_000) -> "LinkModel":
        """Run until every offered packet is delivered, then long enough for the last
        credits to come home (a flow-control period and two round trips), as tb/test_link."""
        if self.saturate_vls:
            raise ValueError("a saturating source never drains")
        start = self.now
        while not self.idle():
            if self.now - start > limit:
                raise AssertionError(f"not drained after {limit} cycles")
            self.step()
        return self.run(self.fc_period + 4 * self.wire_delay + 64)

    def credits_home(self) -> bool:
        """Every VL's credit back: sender's limit - FCTBS == capacity, used == 0, ABR == FCTBS."""
        if self.buffer_blocks is None:
            return True
        for sender, credit in zip(self.tx["a"].senders, self.rx["b"].credits):
            if ((sender.limit - sender.fctbs) & FCCL_MASK) != self.buffer_blocks:
                return False
            if credit.used != 0 or credit.abr != sender.fctbs:
                return False
        return True

    def stats(self) -> LinkStats:
        packets = self.rx["b"].delivered
        cycles = max(self.now, 1)
        payload = sum(p.payload for p in packets)
        wire_bytes = sum(p.nbytes for p in packets)
        return LinkStats(
            width=self.width,
            cycles=self.now,
            delivered_packets=len(packets),
            delivered_payload_bytes=payload,
            delivered_wire_bytes=wire_bytes,
            throughput=payload / (cycles * self.width),
            wire_throughput=wire_bytes / (cycles * self.width),
            credit_stall_cycles=list(self.tx["a"].credit_stall_cycles),
            max_occupancy_blocks=[b.max_held_blocks for b in self.rx["b"].buffers],
            max_used_blocks=list(self.rx["b"].max_used),
            fc_packets_sent={side: self.tx[side].fc_packets_sent for side in "ab"},
            latencies=[p.latency for p in packets],
            packets=list(packets),
        )


# ----------------------------------------------------------------------------- sizing

def pipeline_cycles(packet_bytes: int, width: int = 64, cut_through: bool = False) -> int:
    """Fixed cycles of the credit loop besides the cable and the flow-control wait.

    From the cycle a packet's start beat is accepted (t) to the cycle the sender's
    limit covers its blocks again, with ``b`` wire beats and ``k`` stored beats, when
    the flow-control packet goes out on a change of FCCL (the minimum interval passed):

    - wire end beat through the beat, output, input and check registers:
      t + 4 + (b - 1); verdict readable 2 cycles later (SyncFIFOBuffered): t + b + 5;
    - release: cut-through reads the end beat then (t + b + 5); store-and-forward
      starts the packet then and reads its end k - 1 cycles later;
    - used blocks drop at release + 1, the FCCL register at release + 2, B's
      transmitter's registered decision at release + 3, + 1 beat register, + 1 output
      register, + 1 A's input register, + 1 A's check register, + 1 flow_control
      register, + 1 the limit register, + 1 the credit view made from it: release + 10
      (plus 2 * wire_delay). The batch rule's own register adds one more
      (:func:`credit_loop_cycles`).
    """
    b = wire_beats(packet_bytes, width)
    k = stored_beats(packet_bytes, width)
    release = b + 5 + (0 if cut_through else k - 1)
    return release + 10


def credit_loop_cycles(wire_delay: int, packet_bytes: int, width: int = 64, *,
                       cut_through: bool = False, fc_min_interval: int = 64,
                       fc_batch_blocks: int | None = 64) -> int:
    """Analytic credit round trip: 2 * wire_delay + pipeline + flow-control wait.

    The flow-control wait is what the scheduler adds when packets are released at
    full rate, one every ``b`` cycles: none when ``b >= fc_min_interval``; one cycle
    (the batch test's register) when the release changes FCCL by at least
    ``fc_batch_blocks`` (sent once 4 cycles passed, and packets are longer than that);
    else up to ``fc_min_interval - b``.
    """
    b = wire_beats(packet_bytes, width)
    if b >= fc_min_interval:
        wait = 0
    elif fc_batch_blocks is not None and blocks(packet_bytes) >= fc_batch_blocks and b >= FC_BATCH_INTERVAL:
        wait = 1
    else:
        wait = max(0, fc_min_interval - b)
    return 2 * wire_delay + pipeline_cycles(packet_bytes, width, cut_through) + wait


def estimate_min_buffer(wire_delay: int, packet_bytes: int, width: int = 64, *,
                        threshold: float = 0.99, **loop_args) -> int:
    """Analytic buffer for full rate: whole packets covering the credit loop.

    A packet's blocks come back ``L = credit_loop_cycles`` after it started and the
    sender needs a whole packet's worth to start the next one, so ``n`` packets of
    buffer sustain ``min(1, n * b / L)`` of the rate: n = ceil(threshold * L / b).
    """
    loop = credit_loop_cycles(wire_delay, packet_bytes, width, **loop_args)
    b = wire_beats(packet_bytes, width)
    n = max(1, math.ceil(threshold * loop / b - 1e-9))
    return n * blocks(packet_bytes)


def _saturated_throughput(buffer_blocks, wire_delay, packet_bytes, width, cycles, **kwargs):
    model = LinkModel(width=width, buffer_blocks=buffer_blocks, wire_delay=wire_delay,
                      packet_bytes=packet_bytes, **kwargs)
    model.run(cycles)
    return model.stats().steady_throughput()


def min_buffer_for_full_rate(wire_delay: int, packet_bytes: int, width: int = 64, *,
                             threshold: float = 0.99, num_vls: int = 2,
                             fc_period: int = 1024, fc_min_interval: int = 64,
                             fc_batch_blocks: int | None = 64, cut_through: bool = False,
                             cycles: int | None = None, max_blocks: int = 2048) -> int:
    """Smallest ``buffer_blocks`` (>= one packet) at which a saturated link (one VL,
    ``packet_bytes`` wire bytes each) reaches ``threshold`` of its unlimited-buffer
    throughput. Binary search over simulations (throughput grows with the buffer).

    ``cycles`` per simulation defaults to enough for the loop to settle plus a long
    window (several flow-control periods). Raises ValueError if ``max_blocks`` is
    not enough.
    """
    kwargs = dict(num_vls=num_vls, fc_period=fc_period, fc_min_interval=fc_min_interval,
                  fc_batch_blocks=fc_batch_blocks, cut_through=cut_through)
    loop = credit_loop_cycles(wire_delay, packet_bytes, width, cut_through=cut_through,
                              fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks)
    if cycles is None:
        cycles = 10 * loop + 4 * fc_period + 200 * wire_beats(packet_bytes, width)
    reference = _saturated_throughput(None, wire_delay, packet_bytes, width, cycles, **kwargs)
    target = threshold * reference

    def good(n):
        return _saturated_throughput(n, wire_delay, packet_bytes, width, cycles, **kwargs) >= target

    low = blocks(packet_bytes)
    if good(low):
        return low
    high = min(max_blocks, max(2 * low, estimate_min_buffer(
        wire_delay, packet_bytes, width, threshold=threshold, cut_through=cut_through,
        fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks)))
    while not good(high):
        if high >= max_blocks:
            raise ValueError(f"{max_blocks} blocks are not enough for wire delay {wire_delay}")
        low, high = high, min(max_blocks, 2 * high)
    # Invariant: good(high), not good(low).
    while high - low > 1:
        middle = (low + high) // 2
        if good(middle):
            high = middle
        else:
            low = middle
    return high
