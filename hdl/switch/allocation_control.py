"""Between the pipelined allocator and the input buffers: shows it the queue heads, starts its
matches, offers it the ports ahead of their packets' ends (docs/switch.md, In the switch)."""

from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.arith import or_all
from hdl.link.signatures import BLOCK_BYTES, FCCL_BITS, check_width
from hdl.switch.switch_allocator import ALLOC_STAGES
from hdl.switch.voq_buffer import QUEUE_MODES, HeadSignature, queue_count

__all__ = ["AllocationControl"]


class AllocationControl(wiring.Component):
    """The pipelined switch's glue of :class:`SwitchAllocator`, the ``VoqBuffer`` readers and
    the :class:`Crossbar`; every rule and cycle is in docs/switch.md (In the switch).

    Input i's buffer: ``heads[i][q]``, ``arriving[i][q]`` (its queues), ``active``,
    ``sending``, ``finishing``, ``out_port[i]`` (its reader), ``beat_valid``, ``beat_ready``,
    ``beat_start`` and ``beat_pktlen[i]`` (the handshake of its ``out`` with the crossbar,
    the beat's start flag and LRH.PktLen);
    ``hoq_drop``: it drops its head in this cycle; ``enabled``: the ports' enables.
    From the allocator ``pend``, ``match``, ``start_head``; from the crossbar ``queueing``;
    per output the transmitter's ``taken`` and ``egress_start`` (the crossbar's beat at
    the transmitter is a start beat).

    To the allocator: ``head_valid``/``head_blocks`` (a queue's head, or the descriptor
    entering it while it is empty), ``start`` (input i starts its match in this cycle;
    also the crossbar's), ``in_ready``/``out_ready`` (offers, from registers),
    ``counted`` and ``skipped`` (registers: a start beat was taken; a started packet was
    skipped).
    To the buffers and the crossbar: ``start_queues[i]`` (one-hot: the queue a start
    reads), ``starting[o]`` (the input starting to output o, one-hot or none), ``released`` (input i's packet sends
    no more beats).
    """

    def __init__(self, *, ports, num_vls, width, mode="voq"):
        if not isinstance(ports, int) or not 2 <= ports <= 16:
            raise ValueError(f"Ports must be an integer from 2 to 16, not {ports!r}")
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 4:
            raise ValueError(f"Data VLs must be an integer from 1 to 4, not {num_vls!r}")
        check_width(width)
        if mode not in QUEUE_MODES:
            raise ValueError(f"Queue mode must be one of {QUEUE_MODES}, not {mode!r}")
        self.ports = ports
        self.num_vls = num_vls
        self.width = width
        self.mode = mode
        self.num_queues = queue_count(ports, num_vls, mode)
        P, V, Q = ports, num_vls, self.num_queues
        super().__init__({
            "heads": In(HeadSignature(P, V)).array(P, Q),
            "arriving": In(HeadSignature(P, V)).array(P, Q),
            "active": In(P),
            "sending": In(P),
            "finishing": In(P),
            "out_port": In(range(P)).array(P),
            "beat_valid": In(P),
            "beat_ready": In(P),
            "beat_start": In(P),
            "beat_pktlen": In(11).array(P),
            "hoq_drop": In(P),
            "enabled": In(P),
            "pend": In(P * P),
            "match": In(P * P),
            "start_head": In(P * P * V),
            "queueing": In(P),
            "taken": In(P),
            "egress_start": In(P),
            "head_valid": Out(P * P * V),
            "head_blocks": Out(FCCL_BITS).array(P, P, V),
            "start": Out(P),
            "start_queues": Out(Q).array(P),
            "starting": Out(P).array(P),
            "released": Out(P),
            "in_ready": Out(P),
            "out_ready": Out(P),
            "counted": Out(P),
            "skipped": Out(P),
        })

    def elaborate(self, platform):
        m = Module()
        P, V, width = self.ports, self.num_vls, self.width
        for i in range(P):
            for q in range(self.num_queues):
                head, arriving = self.heads[i][q], self.arriving[i][q]
                # A descriptor entering an empty queue has its credit test (stage E) in its
                # enqueue cycle, one cycle before it heads the queue: the hop stays at 8.
                present = Signal(name=f"present{i}_{q}")
                blocks = Signal(FCCL_BITS, name=f"present_blocks{i}_{q}")
                m.d.comb += [present.eq(head.valid | arriving.valid),
                             blocks.eq(Mux(head.valid, head.blocks, arriving.blocks))]
                if self.mode == "voq":
                    o, v = divmod(q, V)
                    pairs = [(o, v, present)]
                else:
                    port = Mux(head.valid, head.port, arriving.port)
                    pairs = [(o, q, present & (port == o)) for o in range(P)]
                for o, v, valid in pairs:
                    m.d.comb += [self.head_valid[(i * P + o) * V + v].eq(valid),
                                 self.head_blocks[i][o][v].eq(blocks)]

        # An input's packet sends no more beats: its last one is taken, or it is skipped.
        m.d.comb += self.released.eq(self.finishing | self.active & ~self.sending)

        # Beats of the current packet not yet handed to the crossbar: estimated from its
        # credit blocks when it starts, exact from LRH.PktLen once its start beat leaves.
        beat_bytes_log2 = exact_log2(width)
        beats_left = [Signal(16, name=f"beats_left{i}") for i in range(P)]
        near_end = Signal(P)
        near_end_beats = ALLOC_STAGES + 1
        # A packet of at most this many blocks is near its end from its start on.
        near_end_blocks = near_end_beats * width // BLOCK_BYTES
        starts_long = Signal(P)     # the packet input i starts is not near its end
        started = Signal(P)     # the input started a match in the previous cycle
        m.d.sync += started.eq(self.start)
        starting = self.starting
        for i in range(P):
            row = self.pend[i * P:(i + 1) * P] | self.match[i * P:(i + 1) * P]
            # What it starts if it starts: the queue and its output follow the allocator's
            # registers (`start_head`), not the match or the decision to start it (depth).
            heads = self.start_head[i * P * V:(i + 1) * P * V]
            toward = Signal(P, name=f"start_toward{i}")
            select = self.start_queues[i]
            m.d.comb += [
                toward.eq(Cat(heads[o * V:(o + 1) * V].any() for o in range(P))),
                select.eq(heads if self.mode == "voq" else
                          Cat(Cat(heads[o * V + v] for o in range(P)).any() for v in range(V))),
            ]
            # The packet heads its queue: its blocks, for the estimate.
            pending_blocks = Signal(FCCL_BITS, name=f"pending_blocks{i}")
            m.d.comb += [
                pending_blocks.eq(or_all([Mux(select[q], self.heads[i][q].blocks, 0)
                                          for q in range(self.num_queues)])),
                starts_long[i].eq((select & Cat(self.heads[i][q].blocks > near_end_blocks
                                                for q in range(self.num_queues))).any()),
            ]
            m.d.comb += self.start[i].eq(row.any() & (~self.active[i] | self.finishing[i])
                                         & ~(toward & self.queueing).any())
            for o in range(P):
                m.d.comb += starting[o][i].eq(self.start[i] & toward[o])
            handed = self.beat_valid[i] & self.beat_ready[i]
            stored_bytes = self.beat_pktlen[i] * 4    # the VCRC is not stored
            with m.If(self.start[i]):
                m.d.sync += beats_left[i].eq(
                    pending_blocks << (exact_log2(BLOCK_BYTES) - beat_bytes_log2)
                    if width <= BLOCK_BYTES else
                    (pending_blocks + width // BLOCK_BYTES - 1)
                    >> (beat_bytes_log2 - exact_log2(BLOCK_BYTES)))
            with m.Elif(self.hoq_drop[i]):
                # Skipped unsent: the input is offered again once it is idle.
                m.d.sync += beats_left[i].eq(0xFFFF)
            with m.Elif(handed & self.beat_start[i]):
                m.d.sync += beats_left[i].eq(((stored_bytes + width - 1) >> beat_bytes_log2) - 1)
            with m.Elif(handed):
                m.d.sync += beats_left[i].eq(beats_left[i] - 1)
            # A cycle ahead: the ports are offered from registers (below).
            m.d.comb += near_end[i].eq(beats_left[i] <= near_end_beats)

        # Ports are offered from registers (the allocator's stage G starts from them): what
        # held in the cycle before, unless a start or a drop of the port changed it since (a
        # port busy then stays busy, its beats left only fall: the offer is never early). A
        # start of a packet near its end from the start on changes nothing an output's offer
        # depends on: a stream of 1-beat packets is offered every cycle.
        in_idle = Signal(P)
        out_idle = Signal(P)
        dropped = Signal(P)
        started_to = Signal(P)
        m.d.sync += [dropped.eq(self.hoq_drop),
                     started_to.eq(Cat((s & starts_long).any() for s in starting))]
        for i in range(P):
            m.d.sync += in_idle[i].eq(~self.active[i] | near_end[i])
        m.d.comb += self.in_ready.eq(self.enabled & in_idle & ~started & ~dropped)
        for o in range(P):
            m.d.sync += out_idle[o].eq(~Cat(self.sending[i] & (self.out_port[i] == o) & ~near_end[i]
                                            for i in range(P)).any())
            # The transmitter took a start beat (its FCTBS counts the packet from the next
            # cycle); a started packet turned out bad and is skipped unsent (both may happen
            # in one cycle, to two short packets). Registered, so the transmitter's decision
            # ends here (the hold lasts a cycle longer).
            m.d.sync += [
                self.counted[o].eq(self.taken[o] & self.egress_start[o]),
                self.skipped[o].eq(Cat(started[i] & ~self.sending[i] & (self.out_port[i] == o)
                                       for i in range(P)).any()),
            ]
        m.d.comb += self.out_ready.eq(self.enabled & out_idle & ~started_to)
        return m
