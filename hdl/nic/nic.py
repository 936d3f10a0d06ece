from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.fifo import SyncFIFOBuffered
from amaranth.lib.wiring import In, Out

from hdl.axi_lite import AxiLiteSignature
from hdl.link.link_port import LinkPort
from hdl.link.link_receiver import DROP_REASONS
from hdl.link.signatures import LinkState, WireSignature
from hdl.prim.skid_register import SkidRegister

from .atomic_unit import AtomicUnit
from .axi_read_arbiter import AxiReadArbiter
from .axi_write_arbiter import AxiWriteArbiter
from .completion_unit import TIMER_TICK_CYCLES, CompletionUnit
from .dma_writer import DmaWriter
from .doorbell_scheduler import DoorbellScheduler
from .gather_packer import GatherPacker
from .nic_registers import NicRegisters
from .packet_assembler import PacketAssembler
from .packet_mux import PacketMux
from .receive_queue import ReceiveQueue
from .request_receiver import RequestReceiver
from .responder_engine import ResponderEngine
from .response_generator import ResponseGenerator
from .response_writer import ResponseWriter
from .signatures import (ATOMIC_ID, COUNTERS, CQE_ID, DMA_WRITE_ID, FETCH_ID, MAX_GATHER_SEGMENTS,
                         PAYLOAD_ID,
                         READ_DATA_ID, RECV_ID, RESPONSE_ID, AxiReadSignature,
                         AxiWriteSignature, PacketDescriptorLayout)
from .wqe_executor import WqeExecutor
from .wqe_fetcher import WqeFetcher

__all__ = ["Nic", "NIC_WIDTH"]

NIC_WIDTH = 64          # bytes per beat, on the wire and on the AXI4 data bus


class Nic(wiring.Component):
    """The RDMA NIC: as requester (docs/nic.md), doorbells from GPU threads in, mlx5 WQEs
    fetched from memory, InfiniBand RC packets out on one credit-based link port, CQEs
    written back when the responder acknowledges; as responder (docs/nic-responder.md),
    the remote requests executed against memory and answered.

    Parameters
    ----------
    num_qps, num_cqs, num_mkeys : int
        Context table sizes.
    num_vls : int
        Data VLs of the network port.
    mtu : int
        Largest packet the link port takes (bytes of payload, IBA MTU 256 .. 4096).
    addr_width : int
        AXI4 master address bits (GPU/host memory).
    fetch_buffer_blocks, payload_buffer_beats : int
        On-chip buffers that hide the memory latency: WQE basic blocks and payload beats
        that can be in flight from memory at once.
    packet_queue_depth : int
        Packet descriptors between the executor and the assembler. The executor issues a
        packet's payload read before its descriptor and the assembler starts a packet only
        when its payload is in, so this bounds the packets whose reads overlap the memory
        latency: with 4 KiB packets and 200 cycles of latency about 4 must be in flight.
    link_buffer_blocks : int or None
        Receive buffer of the network port, in 64-byte credits (None: the link's default).
    rx_buffer_beats : int
        The responder's receive packet buffer (store and forward, ICRC checked), in beats.
    response_buffer_beats : int
        Payload buffer of the responder's packet assembler (READ response data in flight).
    read_data_buffer_beats : int
        The requester's buffer of received READ responses and atomic acknowledges, whose
        payload is written to local memory once the completion unit takes them.
    timer_tick : int
        Cycles per tick of the retransmission timer (the local ACK timeout is
        ``2**ack_timeout`` ticks; 1638 cycles is IBA's 4.096 us at 400 MHz).

    Ports
    -----
    axil : In(AxiLiteSignature(16, data_width=64))
        Registers and the UAR doorbell page (docs/nic-registers.md).
    axi : Out(AXI4)
        DMA master: WQE fetches (ARID 0), payload reads (ARID 1), READ response payload
        (ARID 2), receive WQEs and doorbell records (ARID 3), atomics (ARID/AWID 4), CQE
        writes (AWID 0), RDMA WRITE and SEND payload (AWID 1), received READ data and
        atomic results (AWID 2).
    wire_out, wire_in : the network link.
    link_state : Out(LinkState)
    link_drops : Out(Signature({reason: Out(32)}))
        The link port's receiver drop counters, one per reason of
        :data:`hdl.link.link_receiver.DROP_REASONS` (docs/link.md, Drop reasons): packets
        lost on the wire in (a bad VCRC, truncated, ...) before the NIC's own receivers.
    """
    def __init__(self, *, num_qps=64, num_cqs=16, num_mkeys=64, num_vls=2, mtu=4096,
                 addr_width=64, fetch_buffer_blocks=256, payload_buffer_beats=512,
                 packet_queue_depth=32, link_buffer_blocks=None, fc_period=1024, fc_min_interval=64,
                 fc_batch_blocks=64, rx_buffer_beats=256, response_buffer_beats=512,
                 read_data_buffer_beats=256, timer_tick=TIMER_TICK_CYCLES):
        if not 12 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 12 to 64 bits, not {addr_width!r}")
        # 3 at least: the queue's room flag (below) relies on a buffered FIFO of 3 or
        # more having room whenever it holds at most depth - 1.
        if not 3 <= packet_queue_depth <= 1024:
            raise ValueError(f"Packet queue depth must be 3 to 1024 descriptors, not "
                             f"{packet_queue_depth!r}")
        self.packet_queue_depth = packet_queue_depth
        self.num_qps = num_qps
        self.num_vls = num_vls
        self.addr_width = addr_width
        self.registers = NicRegisters(num_qps=num_qps, num_cqs=num_cqs, num_mkeys=num_mkeys,
                                      num_vls=num_vls, qp_read_ports=4, cq_read_ports=1,
                                      mkey_read_ports=3)
        self.scheduler = DoorbellScheduler(num_qps=num_qps)
        self.fetcher = WqeFetcher(num_qps=num_qps, buffer_blocks=fetch_buffer_blocks)
        self.executor = WqeExecutor(num_qps=num_qps, num_mkeys=num_mkeys, num_vls=num_vls,
                                    payload_buffer_beats=payload_buffer_beats)
        self.assembler = PacketAssembler(num_vls=num_vls, payload_buffer_beats=payload_buffer_beats)
        # A piece record waits from its first burst until its beats come: at most the
        # pieces of the packets whose reads are issued and not yet in, those of the packet
        # queue, the register after it, the assembler's and the executor's two stages.
        self.gather_packer = GatherPacker(
            piece_depth=MAX_GATHER_SEGMENTS * (packet_queue_depth + 4))
        self.completions = CompletionUnit(num_qps=num_qps, num_cqs=num_cqs, num_vls=num_vls,
                                          addr_width=addr_width, timer_tick=timer_tick)
        self.read_data = ResponseWriter(num_vls=num_vls, buffer_beats=read_data_buffer_beats,
                                        addr_width=addr_width)
        self.receiver = RequestReceiver(num_vls=num_vls, buffer_beats=rx_buffer_beats)
        self.engine = ResponderEngine(num_qps=num_qps, num_mkeys=num_mkeys, num_vls=num_vls)
        self.dma = DmaWriter(buffer_beats=rx_buffer_beats, addr_width=addr_width)
        self.receive_queue = ReceiveQueue(num_qps=num_qps, num_mkeys=num_mkeys,
                                          addr_width=addr_width)
        self.atomics = AtomicUnit(addr_width=addr_width)
        self.responses = ResponseGenerator(num_vls=num_vls,
                                           payload_buffer_beats=response_buffer_beats)
        self.response_assembler = PacketAssembler(num_vls=num_vls,
                                                  payload_buffer_beats=response_buffer_beats)
        self.muxes = [PacketMux(inputs=2) for _ in range(num_vls)]
        self.reads = AxiReadArbiter(readers=5, addr_width=addr_width, data_bytes=NIC_WIDTH)
        self.writes = AxiWriteArbiter(ids=(CQE_ID, DMA_WRITE_ID, READ_DATA_ID, ATOMIC_ID),
                                      addr_width=addr_width, data_bytes=NIC_WIDTH)
        self.port = LinkPort(width=NIC_WIDTH, num_vls=num_vls, mtu=mtu,
                             buffer_blocks=link_buffer_blocks, fc_period=fc_period,
                             fc_min_interval=fc_min_interval, fc_batch_blocks=fc_batch_blocks)
        # The block-boundary registers (docs/nic.md, Block boundaries), blocks of their own
        # so that `python -m hdl.fpga --compose` times each alone.
        self.wqe_register = SkidRegister(self.fetcher.wqe.payload.shape())
        self.packet_register = SkidRegister(PacketDescriptorLayout())
        self.completion_register = SkidRegister(self.executor.completion.payload.shape())
        self.response_register = SkidRegister(self.engine.response.payload.shape())
        self.response_packet_register = SkidRegister(self.responses.packet.payload.shape())
        self.ar_registers = [SkidRegister(self.reads.requests[rid].payload.shape())
                             for rid in range(len(self.reads.requests))]
        self.tx_registers = [SkidRegister(self.assembler.data_out[v].payload.shape())
                             for v in range(num_vls)]
        self.response_tx_registers = [
            SkidRegister(self.response_assembler.data_out[v].payload.shape())
            for v in range(num_vls)]
        axi = {**dict(AxiReadSignature(addr_width, NIC_WIDTH).members),
               **dict(AxiWriteSignature(addr_width, NIC_WIDTH).members)}
        super().__init__({
            "axil": In(AxiLiteSignature(16, data_width=64)),
            "axi": Out(wiring.Signature(axi)),
            "wire_out": Out(WireSignature(NIC_WIDTH)),
            "wire_in": In(WireSignature(NIC_WIDTH)),
            "link_state": Out(LinkState),
            "link_drops": Out(wiring.Signature({reason: Out(32) for reason in DROP_REASONS})),
        })

    def elaborate(self, platform):
        m = Module()
        regs = m.submodules.registers = self.registers
        sched = m.submodules.scheduler = self.scheduler
        fetch = m.submodules.fetcher = self.fetcher
        exe = m.submodules.executor = self.executor
        asm = m.submodules.assembler = self.assembler
        packer = m.submodules.gather_packer = self.gather_packer
        comp = m.submodules.completions = self.completions
        read_data = m.submodules.read_data = self.read_data
        recv = m.submodules.receiver = self.receiver
        engine = m.submodules.engine = self.engine
        dma = m.submodules.dma = self.dma
        rq = m.submodules.receive_queue = self.receive_queue
        atomics = m.submodules.atomics = self.atomics
        resp = m.submodules.responses = self.responses
        resp_asm = m.submodules.response_assembler = self.response_assembler
        reads = m.submodules.reads = self.reads
        writes = m.submodules.writes = self.writes
        port = m.submodules.port = self.port

        wiring.connect(m, wiring.flipped(self.axil), regs.axi)

        # Contexts and QP state.
        wiring.connect(m, fetch.qp_config, regs.qp_read[0])
        wiring.connect(m, exe.qp_config, regs.qp_read[1])
        wiring.connect(m, engine.qp_config, regs.qp_read[2])
        wiring.connect(m, rq.qp_config, regs.qp_read[3])
        wiring.connect(m, exe.mkey, regs.mkey_read[0])
        wiring.connect(m, engine.mkey, regs.mkey_read[1])
        wiring.connect(m, rq.mkey, regs.mkey_read[2])
        wiring.connect(m, comp.cq_config, regs.cq_read[0])
        wiring.connect(m, exe.qp_error, regs.qp_error[0])
        wiring.connect(m, comp.qp_error, regs.qp_error[1])
        wiring.connect(m, engine.qp_error, regs.qp_error[2])
        for q in range(self.num_qps):
            m.d.comb += [
                sched.qp_state[q].eq(regs.qp_state[q]),
                sched.qp_log_sq_size[q].eq(regs.qp_log_sq_size[q]),
                sched.qp_max_outstanding[q].eq(regs.qp_max_outstanding[q]),
                exe.qp_state[q].eq(regs.qp_state[q]),
                comp.qp_state[q].eq(regs.qp_state[q]),
                engine.qp_state[q].eq(regs.qp_state[q]),
            ]
        for block in (sched, exe, comp, engine, rq):
            m.d.comb += [block.qp_reset.valid.eq(regs.qp_reset.valid),
                         block.qp_reset.qpn.eq(regs.qp_reset.qpn)]
        wiring.connect(m, regs.qp_flush, comp.qp_flush)
        wiring.connect(m, regs.cq_reset, comp.cq_reset)
        m.d.comb += [
            regs.qp_busy.eq(sched.qp_busy),
            exe.slid.eq(regs.slid),
            recv.lid.eq(regs.slid),
            resp.slid.eq(regs.slid),
            regs.link_state.eq(port.state),
            regs.link_inits.eq(port.link_inits),
            self.link_state.eq(port.state),
            *(getattr(self.link_drops, reason).eq(getattr(port.receiver.drops, reason))
              for reason in DROP_REASONS),
        ]
        for sl in range(16):
            m.d.comb += [exe.sl_to_vl[sl].eq(regs.sl_to_vl[sl]),
                         engine.sl_to_vl[sl].eq(regs.sl_to_vl[sl])]

        # Requester pipeline.
        wiring.connect(m, regs.doorbell, sched.doorbell)
        wiring.connect(m, sched.fetch, fetch.fetch)
        wiring.connect(m, fetch.fetch_done, sched.fetch_done)
        self._register(m, "wqe_register", self.wqe_register, fetch.wqe, exe.wqe)
        m.submodules.packet_queue = packets = SyncFIFOBuffered(
            width=PacketDescriptorLayout().size, depth=self.packet_queue_depth)
        # The executor sees the queue's room as a flag registered a cycle ahead (at most
        # depth - 1 entries after a write now), so its ``packet.ready`` is a flip-flop. At
        # depth - 1 the buffered FIFO can take one more: its output register is full
        # unless its inner FIFO held nothing a cycle before (then it holds one at most).
        packet_room = Signal(init=1)
        m.d.sync += packet_room.eq(packets.level < self.packet_queue_depth - 1)
        m.d.comb += [
            packets.w_data.eq(exe.packet.payload),
            packets.w_en.eq(exe.packet.valid & packet_room),
            exe.packet.ready.eq(packet_room),
        ]
        # The assembler's ``packet.ready`` is deep (its finishing packet): a skid register
        # keeps it off the queue's read logic.
        packet_register = m.submodules.packet_register = self.packet_register
        m.d.comb += [
            packet_register.i.payload.eq(packets.r_data),
            packet_register.i.valid.eq(packets.r_rdy),
            packets.r_en.eq(packet_register.i.ready),
        ]
        wiring.connect(m, packet_register.o, asm.packet)
        self._register(m, "completion_register", self.completion_register, exe.completion,
                       comp.completion)
        wiring.connect(m, exe.sent, comp.sent)
        wiring.connect(m, comp.retire, sched.retire)
        # Go-back-N: the completion unit rewinds a QP's fetch and execution.
        for block in (sched, exe):
            m.d.comb += [block.rewind.valid.eq(comp.rewind.valid),
                         block.rewind.payload.eq(comp.rewind.payload)]
        # A late acknowledgement retired WQEs a rewind was about to fetch again: the
        # scheduler skips them (their ring slots may hold new WQEs already).
        wiring.connect(m, sched.skip, exe.skip)
        for q in range(self.num_qps):
            m.d.comb += exe.qp_epoch[q].eq(sched.qp_epoch[q])
        # Received READ data and atomic results: stored by the ResponseWriter, written
        # once the completion unit takes their packet.
        wiring.connect(m, comp.verdict, read_data.verdict)
        wiring.connect(m, comp.discard, read_data.discard)
        m.d.comb += comp.landed.eq(read_data.landed)
        m.d.comb += exe.payload_freed.eq(asm.payload_freed)

        # Responder pipeline.
        wiring.connect(m, recv.request, engine.request)
        wiring.connect(m, engine.dma, dma.command)
        wiring.connect(m, dma.source, recv.buffer_read)
        wiring.connect(m, dma.release, recv.release)
        m.d.comb += engine.dma_idle.eq(dma.idle)
        wiring.connect(m, engine.recv_request, rq.request)
        wiring.connect(m, rq.result, engine.recv_result)
        wiring.connect(m, engine.atomic_request, atomics.request)
        wiring.connect(m, atomics.result, engine.atomic_result)
        wiring.connect(m, engine.receive_completion, comp.receive)
        self._register(m, "response_register", self.response_register, engine.response,
                       resp.command)
        self._register(m, "response_packet_register", self.response_packet_register,
                       resp.packet, resp_asm.packet)
        m.d.comb += resp.payload_freed.eq(resp_asm.payload_freed)

        # Memory: reads by ARID, writes by AWID.
        # A packet's payload pieces (a gather list's segments) packed into one run.
        wiring.connect(m, exe.pieces, packer.pieces)
        wiring.connect(m, packer.packed, asm.payload)
        readers = {FETCH_ID: (fetch.ar, fetch.r), PAYLOAD_ID: (exe.ar, packer.raw),
                   RESPONSE_ID: (resp.ar, resp_asm.payload), RECV_ID: (rq.ar, rq.r),
                   ATOMIC_ID: (atomics.ar, atomics.r)}
        for rid, (ar, r) in readers.items():
            self._register(m, f"ar_register{rid}", self.ar_registers[rid], ar, reads.requests[rid])
            wiring.connect(m, reads.responses[rid], r)
        for index, writer in enumerate((comp.axi, dma.axi, read_data.axi, atomics.axi)):
            wiring.connect(m, writer, writes.writers[index])
        for bus, signature in ((reads.axi, AxiReadSignature(self.addr_width, NIC_WIDTH)),
                               (writes.axi, AxiWriteSignature(self.addr_width, NIC_WIDTH))):
            for name, member in signature.members.items():
                outer, inner = getattr(self.axi, name), getattr(bus, name)
                m.d.comb += outer.eq(inner) if member.flow == Out else inner.eq(outer)

        # Network port: received responses to the completion unit, requests to the
        # responder; requester and responder packets share each VL.
        for v in range(self.num_vls):
            mux = m.submodules[f"mux{v}"] = self.muxes[v]
            self._register(m, f"tx_register{v}", self.tx_registers[v], asm.data_out[v],
                           mux.inputs[0])
            self._register(m, f"response_tx_register{v}", self.response_tx_registers[v],
                           resp_asm.data_out[v], mux.inputs[1])
            wiring.connect(m, mux.output, port.data_in[v])
            wiring.connect(m, port.data_out[v], recv.rx[v])
            wiring.connect(m, recv.responses[v], read_data.rx[v])
            wiring.connect(m, read_data.out[v], comp.rx[v])
            m.d.comb += comp.rx_seq[v].eq(read_data.out_seq[v])
            m.d.comb += port.vl_weight[v].eq(regs.vl_weight[v])
        wiring.connect(m, port.wire_out, wiring.flipped(self.wire_out))
        wiring.connect(m, wiring.flipped(self.wire_in), port.wire_in)

        # Counters, in the register map's order.
        index = 0
        blocks = {"DoorbellScheduler": sched, "WqeFetcher": fetch, "WqeExecutor": exe,
                  "PacketAssembler": asm, "CompletionUnit": comp, "RequestReceiver": recv,
                  "ResponderEngine": engine, "DmaWriter": dma, "ReceiveQueue": rq,
                  "AtomicUnit": atomics, "ResponseGenerator": resp, "ResponseWriter": read_data}
        for block_name, counters in COUNTERS.items():
            for name, _ in counters:
                m.d.comb += regs.counters[index].eq(getattr(blocks[block_name], name))
                index += 1
        return m

    @staticmethod
    def _register(m, name, register, source, sink):
        """``source`` to ``sink`` through ``register``, a :class:`SkidRegister`: a cycle
        more, and neither block's handshake reaches the other's logic in a cycle
        (docs/nic.md, Block boundaries)."""
        m.submodules[name] = register
        wiring.connect(m, source, register.i)
        wiring.connect(m, register.o, sink)
