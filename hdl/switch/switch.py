from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import or_all
from hdl.axi_lite import AxiLiteSignature
from hdl.link.link_port import LinkPort
from hdl.link.link_receiver import ROUTED_DROP_REASONS
from hdl.link.signatures import (
    FCCL_BITS, LinkState, WireSignature, blocks_of, check_mtu, check_width,
    lrh_pktlen, lrh_wire_bytes, max_wire_bytes, pktlen_wire_bytes, vl_index,
)
from hdl.prim.round_robin import turn_pick
from hdl.switch.allocation_control import AllocationControl
from hdl.switch.crossbar import Crossbar
from hdl.switch.forwarding_table import ForwardingTable
from hdl.switch.islip_allocator import IslipAllocator
from hdl.switch.register_map import HOQ_TICK_CYCLES, check_config
from hdl.switch.switch_allocator import SwitchAllocator
from hdl.switch.switch_registers import SwitchRegisters
from hdl.switch.voq_buffer import QUEUE_MODES, VoqBuffer

__all__ = ["Switch", "HOP_LATENCY_CYCLES", "ALLOCATORS", "DEFAULT_ALLOCATOR"]

ALLOCATORS = ("islip", "pipelined")
# The allocator within the FPGA budget of docs/fpga.md; "islip" (single-cycle, too deep for
# the clock) stays as an ablation for simulation and the model comparison.
DEFAULT_ALLOCATOR = "pipelined"

# Start beat on an input wire to start beat on an output wire, zero load, per allocator
# (docs/switch.md).
HOP_LATENCY_CYCLES = {"islip": 6, "pipelined": 8}


class Switch(wiring.Component):
    """Cut-through InfiniBand-style switch with credit-based lossless ports.

    Per port, a :class:`~hdl.link.link_port.LinkPort` (IBA flow-control packets, link
    initialisation, VCRC checked on the way in and recomputed on the way out) whose
    receiver writes into that input's :class:`~hdl.switch.voq_buffer.VoqBuffer`. On a start
    beat the forwarding table (DLID -> output port, block RAM, one lookup port per input)
    and the SL-to-VL table pick the output and its VL; DLIDs without an entry are dropped
    (``unknown_dlid``), SLs mapped to VL 15 or to no data VL are dropped (``invalid_vl``).

    Allocation, every cycle: a queue head is *eligible* when its input and output are free
    (or freeing in this cycle), both ports are enabled, and the output's credit limit on
    the packet's VL covers the whole packet. Each output picks one VL by weighted round
    robin (``vl_weight`` 64-byte blocks per turn, as the link transmitter counts them) among
    the VLs with eligible packets; iSLIP (one iteration, or ``islip_iterations`` with the
    iSLIP allocator) then matches inputs to outputs on those requests. A matched input
    streams the packet through the crossbar into the output's transmitter, which starts it
    on the wire at once: the packet can leave before its tail has arrived (cut-through),
    and if it then fails its checks it leaves marked end-bad. Cycles in which a packet waits only for credit are counted as
    credit stalls.

    A queued packet is discarded unsent, counted in ``drop_hoq_lifetime`` of its output and
    VL, when it heads its queue longer than ``hoq_lifetime`` or while its output's link is
    down after having been up.

    ``mode="fifo"`` keeps one queue per input and VL instead of one per output and VL, to
    show head-of-line blocking.

    The default ``allocator="pipelined"`` makes these decisions in :class:`SwitchAllocator`'s
    three registered stages instead of in the grant cycle: ports are offered ahead of the end
    of their current packet, a match starts in its own cycle or waits as pending until its
    input is free and its output has no input queued, each output's crossbar ends in a
    :class:`SkidRegister`, and a descriptor entering an empty queue is credit-tested in its
    enqueue cycle (docs/switch.md, Pipelined allocator). ``allocator="islip"`` makes them in
    the grant cycle with :class:`IslipAllocator` (``islip_iterations`` iterations; it applies
    to ``"islip"`` only): two cycles shorter a hop, too deep for the clock (docs/fpga.md), kept
    as an ablation.

    Zero-load hop latency: :data:`HOP_LATENCY_CYCLES` cycles (per allocator) from the start
    beat on an input's ``wire_in`` to the start beat on an output's ``wire_out``.
    """

    def __init__(self, *, ports=8, num_vls=2, width=64, mtu=4096, buffer_blocks=None, lids=1024,
                 mode="voq", islip_iterations=1, allocator=DEFAULT_ALLOCATOR, fc_period=1024,
                 fc_min_interval=64, fc_batch_blocks=64, addr_width=16):
        check_config(ports, num_vls, lids)
        check_width(width)
        check_mtu(mtu)
        if mode not in QUEUE_MODES:
            raise ValueError(f"Switch mode must be one of {QUEUE_MODES}, not {mode!r}")
        if not isinstance(islip_iterations, int) or not 1 <= islip_iterations <= 4:
            raise ValueError(f"iSLIP iterations must be 1 to 4, not {islip_iterations!r}")
        if allocator not in ALLOCATORS:
            raise ValueError(f"Switch allocator must be one of {ALLOCATORS}, not {allocator!r}")
        self.ports = ports
        self.num_vls = num_vls
        self.width = width
        self.mtu = mtu
        self.lids = lids
        self.mode = mode
        self.islip_iterations = islip_iterations
        self.allocator = allocator
        self.hop_latency_cycles = HOP_LATENCY_CYCLES[allocator]
        # Blocks of the largest packet the receiver keeps (it drops longer ones).
        self.max_blocks = blocks_of(max_wire_bytes(mtu))
        self.link_ports = [
            LinkPort(width=width, num_vls=num_vls, mtu=mtu, buffer_blocks=buffer_blocks,
                     cut_through=True, fc_period=fc_period, fc_min_interval=fc_min_interval,
                     fc_batch_blocks=fc_batch_blocks, store="external", routed=True)
            for _ in range(ports)
        ]
        self.buffer_blocks = self.link_ports[0].buffer_blocks
        self.buffers = [
            VoqBuffer(width=width, num_vls=num_vls, ports=ports,
                      share=self.link_ports[0].receiver.buffer_beats, mode=mode)
            for _ in range(ports)
        ]
        self.registers = SwitchRegisters(ports, num_vls, lids=lids, addr_width=addr_width)
        # The pipelined allocation's blocks (attributes: `python -m hdl.fpga --compose` times
        # each alone).
        if allocator == "pipelined":
            self.switch_allocator = SwitchAllocator(ports, num_vls, max_blocks=self.max_blocks)
            self.allocation_control = AllocationControl(ports=ports, num_vls=num_vls,
                                                        width=width, mode=mode)
            self.crossbar = Crossbar(ports=ports, num_vls=num_vls, width=width)
        super().__init__({
            "wire_in": In(WireSignature(width)).array(ports),
            "wire_out": Out(WireSignature(width)).array(ports),
            "axi": In(AxiLiteSignature(addr_width)),
            "link_state": Out(LinkState).array(ports),
            "overflow": Out(1).array(ports),
        })

    def elaborate(self, platform):
        m = Module()
        P, V = self.ports, self.num_vls
        regs = m.submodules.registers = self.registers
        wiring.connect(m, wiring.flipped(self.axi), regs.axi)
        table = m.submodules.forwarding_table = ForwardingTable(P, self.lids)
        m.d.comb += [
            table.write_en.eq(regs.ft_write_en),
            table.write_lid.eq(regs.ft_write_lid),
            table.write_port.eq(regs.ft_write_port),
            table.write_valid.eq(regs.ft_write_valid),
        ]

        rxs, txs = [], []
        sl_to_vl = Array(regs.sl_to_vl)
        for p, (port, buffer) in enumerate(zip(self.link_ports, self.buffers)):
            m.submodules[f"port{p}"] = port
            m.submodules[f"buffer{p}"] = buffer
            rx, tx = port.receiver, port.transmitter
            rxs.append(rx)
            txs.append(tx)
            wiring.connect(m, wiring.flipped(self.wire_in[p]), port.wire_in)
            wiring.connect(m, port.wire_out, wiring.flipped(self.wire_out[p]))
            wiring.connect(m, rx.store, buffer.store)
            for v in range(V):
                m.d.comb += port.vl_weight[v].eq(regs.vl_weight[p][v])
            # Route the start beat: table lookup, SL-to-VL and its credit blocks, all one cycle
            # after the beat was on the wire, when the receiver checks it. SL-to-VL and the
            # blocks are computed when the question comes and registered (depth: they reach
            # the receiver's write decision, the input buffer's queues and the allocator's
            # credit test of an arriving packet in the cycle of the write).
            out_vl = Signal(4, name=f"port{p}_out_vl")
            no_vl = Signal(name=f"port{p}_no_vl")
            route_blocks = Signal(FCCL_BITS, name=f"port{p}_route_blocks")
            m.d.sync += [out_vl.eq(sl_to_vl[rx.route.sl]), no_vl.eq(sl_to_vl[rx.route.sl] >= V),
                         route_blocks.eq(blocks_of(pktlen_wire_bytes(rx.route.pktlen)))]
            m.d.comb += [
                table.lookup[p].lid.eq(rx.route.lid),
                rx.route.unknown.eq(~table.lookup[p].hit),
                rx.route.no_vl.eq(no_vl),
                buffer.route_port.eq(table.lookup[p].port),
                buffer.route_vl.eq(out_vl),
                buffer.route_blocks.eq(route_blocks),
                self.link_state[p].eq(port.state),
                self.overflow[p].eq(rx.overflow | buffer.no_cell),
            ]

        # --- allocation and crossbar -----------------------------------------------------
        enabled = Cat(regs.port_enable)
        hoq_drop = [Signal(name=f"hoq_drop{i}") for i in range(P)]
        if self.allocator == "islip":
            matching, waiting = self._islip_allocation(m, regs, txs, enabled)
        else:
            matching, waiting = self._pipelined_allocation(m, regs, txs, enabled, hoq_drop)

        # Head-of-queue lifetime: every queue head's age, in ticks of HOQ_TICK_CYCLES. An
        # input that is free and has no match under way drops one expired head instead.
        tick_count = Signal(range(HOQ_TICK_CYCLES))
        tick = Signal()
        m.d.sync += tick_count.eq(tick_count + 1)
        m.d.comb += tick.eq(tick_count == HOQ_TICK_CYCLES - 1)
        lifetime = regs.hoq_lifetime
        # An output whose link went down after being up (it failed, or its peer was reset)
        # takes nothing until it is back: the heads queued for it are discarded as expired ones
        # are, so no input waits on a dead output (docs/switch.md, Routing and bad input).
        was_active = Signal(P)
        out_down = Signal(P)
        for p, port in enumerate(self.link_ports):
            active = port.state == LinkState.ACTIVE
            m.d.sync += was_active[p].eq(active)
            with m.If(active):
                m.d.sync += out_down[p].eq(0)
            with m.Elif(was_active[p]):
                m.d.sync += out_down[p].eq(1)
        # One-hot per input: its first expired head (`expired` reads registers only: whether
        # a head's age has reached the lifetime is registered, a cycle late, and cleared as
        # the head changes).
        hoq_select = [Signal(buffer.num_queues, name=f"hoq_select{i}")
                      for i, buffer in enumerate(self.buffers)]
        for i, buffer in enumerate(self.buffers):
            expired = Signal(buffer.num_queues, name=f"hoq_expired{i}")
            for q in range(buffer.num_queues):
                age = Signal(16, name=f"hoq_age{i}_{q}")
                aged = Signal(name=f"hoq_aged{i}_{q}")
                dequeued = buffer.grant_valid & buffer.grant_queues[q]
                with m.If(~buffer.heads[q].valid | dequeued):
                    m.d.sync += [age.eq(0), aged.eq(0)]
                with m.Else():
                    m.d.sync += aged.eq((lifetime != 0) & (age >= lifetime))
                    with m.If(tick & (age != 0xFFFF)):
                        m.d.sync += age.eq(age + 1)
                down = (out_down[q // self.num_vls] if self.mode == "voq" else
                        Array(out_down)[buffer.heads[q].port])
                m.d.comb += [
                    expired[q].eq(buffer.heads[q].valid & (aged | down)),
                    hoq_select[i][q].eq(expired[q] & ~expired[:q].any() if q else expired[q]),
                ]
            # Only from an idle reader (not one finishing in this cycle): the drop, like every
            # grant, feeds the reader's registers, and this keeps it to registers (depth).
            m.d.comb += hoq_drop[i].eq(~buffer.active & enabled[i] & ~matching[i] & expired.any())
            with m.If(hoq_drop[i]):
                m.d.comb += [buffer.grant_valid.eq(1), buffer.grant_discard.eq(1)]
            # The queue is read only with a grant: chosen without waiting for the drop decision.
            with m.If(~matching[i]):
                m.d.comb += buffer.grant_queues.eq(hoq_select[i])
        # --- counters --------------------------------------------------------------------
        for p in range(P):
            rx, tx, buffer = rxs[p], txs[p], self.buffers[p]
            store = rx.store
            for v in range(V):
                counters = regs.counters[p][v]

                def bump(name, amount=1, *, when):
                    counter = getattr(counters, name)
                    with m.If(when):
                        m.d.sync += counter.eq(counter + amount)

                # Registered events, counted a cycle later (a write is the receiver's decision).
                received = Signal(name=f"received{p}_{v}")
                received_bytes = Signal(16, name=f"received{p}_{v}_bytes")
                m.d.sync += [
                    received.eq(store.write_valid & store.write.start & (store.write_vl == v)),
                    received_bytes.eq(lrh_wire_bytes(store.write.data) - 2),
                ]
                bump("packets_in", when=received)
                bump("bytes_in", received_bytes, when=received)
                # A packet handed to the transmitter counts a cycle later (the handshake is the
                # transmitter's decision: its depth ends in these registers).
                egress = self.link_ports[p].data_in[v]
                sent = Signal(name=f"sent{p}_{v}")
                sent_bytes = Signal(16, name=f"sent{p}_{v}_bytes")
                # (The crossbar offers one VL at a time: `taken` is this VL's handshake.)
                m.d.sync += [sent.eq(tx.taken & egress.valid & egress.payload.start),
                             sent_bytes.eq(lrh_wire_bytes(egress.payload.data) - 2)]
                bump("packets_out", when=sent)
                bump("bytes_out", sent_bytes, when=sent)
                bump("credit_stall_cycles", when=waiting[p][v])
                # Discarded heads count at the output and VL they were waiting for.
                hoq_dropped = Signal(name=f"hoq_dropped{p}_{v}")
                m.d.sync += hoq_dropped.eq(Cat(
                    hoq_drop[i] & (hoq_select[i] & Cat(
                        (buffer.heads[q].port == p) & (buffer.heads[q].vl == v)
                        for q in range(buffer.num_queues))).any()
                    for i, buffer in enumerate(self.buffers)).any())
                bump("drop_hoq_lifetime", when=hoq_dropped)
                for k, reason in enumerate(ROUTED_DROP_REASONS):
                    bump(f"drop_{reason}", when=rx.drop_event.reasons[k] & (rx.drop_event.vl == v))
        return m

    def _islip_allocation(self, m, regs, txs, enabled):
        """Single-cycle allocation: credit test, output VL pick and iSLIP on the queue heads,
        the grant starting the packet in the same cycle; a combinational crossbar. Returns the
        inputs matched in this cycle and, per output, the VLs with a head waiting only for
        credit."""
        P, V = self.ports, self.num_vls
        in_free = Signal(P)         # reader idle, or its last beat leaving in this cycle
        for i, buffer in enumerate(self.buffers):
            m.d.comb += in_free[i].eq((~buffer.active | buffer.finishing) & enabled[i])
        out_busy = Signal(P)        # held by a packet that is not finishing in this cycle
        for o in range(P):
            m.d.comb += out_busy[o].eq(Cat(
                buffer.sending & (buffer.out_port == o) & ~buffer.finishing
                for buffer in self.buffers).any())
        # connected[o]: the input that feeds output o (the crossbar select).
        connected = [Signal(range(P), name=f"connected{o}") for o in range(P)]
        buffers = Array(self.buffers)
        for o, tx in enumerate(txs):
            src_valid = Signal(name=f"xbar{o}_valid")
            src_vl = Signal(vl_index(V), name=f"xbar{o}_vl")
            src_payload = Signal.like(self.buffers[0].out.payload, name=f"xbar{o}_payload")
            selected = buffers[connected[o]]
            m.d.comb += [
                src_valid.eq(selected.out.valid & selected.sending & (selected.out_port == o)),
                src_vl.eq(selected.out_vl),
                src_payload.eq(selected.out.payload),
            ]
            for v in range(V):
                m.d.comb += [
                    self.link_ports[o].data_in[v].valid.eq(src_valid & (src_vl == v)),
                    self.link_ports[o].data_in[v].payload.eq(src_payload),
                ]
        for i, buffer in enumerate(self.buffers):
            ready = Array(Array(port.data_in[v].ready for v in range(V)) for port in self.link_ports)
            connected_here = Array(connected)[buffer.out_port] == i
            m.d.comb += buffer.out.ready.eq(ready[buffer.out_port][buffer.out_vl] & connected_here)

        # Downstream space per output and VL, and whether a head packet fits in it.
        space = [[Signal(FCCL_BITS, name=f"space{o}_{v}") for v in range(V)] for o in range(P)]
        for o, tx in enumerate(txs):
            for v in range(V):
                m.d.comb += space[o][v].eq(tx.credit_limit[v] - tx.fctbs[v])

        def fits(room, blocks):
            # IBA: send only if (FCCL - (FCTBS + blocks)) mod 4096 <= 2048.
            return ((room - blocks) & 0xFFF) <= 2048

        # eligible[i][o][v]; waiting[o][v]: some head packet waits only for credit there.
        vl_pick = [Signal(vl_index(V), name=f"vl_pick{o}") for o in range(P)]
        eligible = [[Signal(V, name=f"eligible{i}_{o}") for o in range(P)] for i in range(P)]
        waiting = [Signal(V, name=f"credit_wait{o}") for o in range(P)]
        # Blocks of the packet input i would send to output o on the VL o picks.
        head_blocks = [[Signal(FCCL_BITS, name=f"head_blocks{i}_{o}") for o in range(P)]
                       for i in range(P)]
        wait_terms = {(o, v): [] for o in range(P) for v in range(V)}
        for i, buffer in enumerate(self.buffers):
            ready_terms = {(o, v): [] for o in range(P) for v in range(V)}
            block_terms = {o: [] for o in range(P)}
            for q in range(buffer.num_queues):
                head = buffer.heads[q]
                ok = Signal(name=f"fits{i}_{q}")
                # VOQ: queue q holds one (o, v); FIFO: queue q holds VL q, any output.
                if self.mode == "voq":
                    pairs = [divmod(q, V)]
                    room = space[pairs[0][0]][pairs[0][1]]
                else:
                    pairs = [(o, q) for o in range(P)]
                    room = Array(space[o][q] for o in range(P))[head.port]
                m.d.comb += ok.eq(fits(room, head.blocks))
                for o, v in pairs:
                    here = Signal(name=f"head{i}_{q}_for{o}")
                    m.d.comb += here.eq(head.valid & (head.port == o) & (head.vl == v))
                    ready_terms[o, v].append(here & ok)
                    wait_terms[o, v].append(here & ~ok)
                    block_terms[o].append(Mux(here & (vl_pick[o] == v), head.blocks, 0))
            for o in range(P):
                m.d.comb += [
                    eligible[i][o].eq(
                        Cat(Cat(*ready_terms[o, v]).any() for v in range(V))
                        & (in_free[i] & ~out_busy[o] & enabled[o]).replicate(V)),
                    # At most one queue heads with a packet for (o, v): OR is a mux.
                    head_blocks[i][o].eq(or_all(block_terms[o])),
                ]
        for o in range(P):
            m.d.comb += waiting[o].eq(Cat(Cat(*wait_terms[o, v]).any() for v in range(V)))

        # Each output picks a VL among its eligible ones, weighted round robin.
        vl_any = [Signal(V, name=f"vl_any{o}") for o in range(P)]
        vl_pointer = [Signal(vl_index(V), name=f"vl_pointer{o}") for o in range(P)]
        vl_budget = [Signal(16, name=f"vl_budget{o}") for o in range(P)]
        vl_stay = Signal(P)
        for o in range(P):
            m.d.comb += vl_any[o].eq(or_all([eligible[i][o] for i in range(P)]))
            m.d.comb += [
                vl_stay[o].eq(vl_any[o].bit_select(vl_pointer[o], 1) & (vl_budget[o] != 0)),
                vl_pick[o].eq(turn_pick(m, vl_any[o], vl_pointer[o], vl_budget[o] != 0,
                                        name=f"vl{o}")),
            ]

        m.submodules.allocator = allocator = IslipAllocator(P, self.islip_iterations)
        for i in range(P):
            for o in range(P):
                m.d.comb += allocator.requests[i * P + o].eq(
                    eligible[i][o].bit_select(vl_pick[o], 1))
        m.d.comb += allocator.enable.eq(1)

        # Matched inputs start their packets; matched outputs remember their input.
        for i, buffer in enumerate(self.buffers):
            row = allocator.grant[i * P:(i + 1) * P]
            for o in range(P):
                with m.If(row[o]):
                    queue = buffer.queue_of(o, vl_pick[o]) if self.mode == "voq" else vl_pick[o]
                    m.d.comb += [buffer.grant_valid.eq(1),
                                 buffer.grant_queues.eq(Cat(queue == q
                                                            for q in range(buffer.num_queues)))]
                    m.d.sync += connected[o].eq(i)
        for o in range(P):
            column = Cat(allocator.grant[i * P + o] for i in range(P))
            blocks = Signal(FCCL_BITS, name=f"granted_blocks{o}")
            for i in range(P):
                with m.If(column[i]):
                    m.d.comb += blocks.eq(head_blocks[i][o])
            with m.If(column.any()):
                weight = Array(regs.vl_weight[o])[vl_pick[o]]
                m.d.sync += [
                    vl_pointer[o].eq(vl_pick[o]),
                    vl_budget[o].eq(Mux(vl_stay[o],
                                        Mux(vl_budget[o] > blocks, vl_budget[o] - blocks, 0),
                                        Mux(weight > blocks, weight - blocks, 0))),
                ]
        return allocator.grant_valid, waiting

    def _pipelined_allocation(self, m, regs, txs, enabled, hoq_drop):
        """Allocation by :class:`SwitchAllocator` (three registered stages), its glue to the
        buffers in :class:`AllocationControl` and a :class:`Crossbar` whose outputs are skid
        registers (docs/switch.md, In the switch). Returns the inputs with a match under way
        (the head-of-queue lifetime leaves their heads alone) and, per output, the VLs with a
        head waiting only for credit."""
        P, V = self.ports, self.num_vls
        alloc = m.submodules.allocator = self.switch_allocator
        control = m.submodules.allocation_control = self.allocation_control
        xbar = m.submodules.crossbar = self.crossbar
        m.d.comb += [
            alloc.head_valid.eq(control.head_valid),
            alloc.in_ready.eq(control.in_ready),
            alloc.out_ready.eq(control.out_ready),
            alloc.start.eq(control.start),
            alloc.counted.eq(control.counted),
            alloc.skipped.eq(control.skipped),
            control.pend.eq(alloc.pend),
            control.match.eq(alloc.match),
            control.start_head.eq(alloc.start_head),
            control.queueing.eq(xbar.queueing),
            control.hoq_drop.eq(Cat(hoq_drop)),
            control.enabled.eq(enabled),
            xbar.released.eq(control.released),
        ]
        for o, (port, tx) in enumerate(zip(self.link_ports, txs)):
            # The crossbar's skid register pops on the transmitter's one-bit handshake, not on
            # its per-VL ready (depth).
            egress = xbar.outputs[o]
            m.d.comb += [egress.ready.eq(tx.taken),
                         control.taken[o].eq(tx.taken),
                         control.egress_start[o].eq(egress.payload.beat.start),
                         xbar.starting[o].eq(control.starting[o])]
            for v in range(V):
                m.d.comb += [port.data_in[v].valid.eq(egress.valid & (egress.payload.vl == v)),
                             port.data_in[v].payload.eq(egress.payload.beat),
                             alloc.credit_limit[o][v].eq(tx.credit_limit[v]),
                             alloc.fctbs[o][v].eq(tx.fctbs[v]),
                             alloc.vl_weight[o][v].eq(regs.vl_weight[o][v])]
        for i, buffer in enumerate(self.buffers):
            for q in range(buffer.num_queues):
                wiring.connect(m, buffer.heads[q], control.heads[i][q])
                wiring.connect(m, buffer.arriving[q], control.arriving[i][q])
            for o in range(P):
                for v in range(V):
                    m.d.comb += alloc.head_blocks[i][o][v].eq(control.head_blocks[i][o][v])
            m.d.comb += [
                control.active[i].eq(buffer.active),
                control.sending[i].eq(buffer.sending),
                control.finishing[i].eq(buffer.finishing),
                control.out_port[i].eq(buffer.out_port),
                control.beat_valid[i].eq(buffer.out.valid),
                control.beat_ready[i].eq(buffer.out.ready),
                control.beat_start[i].eq(buffer.out.payload.start),
                control.beat_pktlen[i].eq(lrh_pktlen(buffer.out.payload.data)),
                buffer.grant_valid.eq(control.start[i]),
                buffer.grant_queues.eq(control.start_queues[i]),
                xbar.inputs[i].valid.eq(buffer.out.valid),
                xbar.inputs[i].payload.beat.eq(buffer.out.payload),
                xbar.inputs[i].payload.vl.eq(buffer.out_vl),
                buffer.out.ready.eq(xbar.inputs[i].ready),
            ]
        return alloc.in_flight, alloc.credit_wait
