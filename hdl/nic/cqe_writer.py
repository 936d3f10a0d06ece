"""The completion unit's CQE writer: completed records and receive completions become mlx5
CQEs, one a cycle (docs/nic.md, "CQE writer")."""
from amaranth import Cat, Const, Module, Mux, Signal, Value
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.arith import count_registered, lookahead_sum
from hdl.nic.signatures import (
    PSN_BITS, QPN_BITS, RESPONSE_SEQ_BITS, AxiWriteSignature, ContextReadSignature,
    CqConfigLayout, EventSignature, ReceiveCompletionLayout, RecvCqeOpcode, RetireLayout,
)

__all__ = ["CqeWriter", "CompletedJobLayout", "JOB_DEPTH"]

WIDTH = 64                  # bytes per AXI data beat: one CQE per beat
JOB_DEPTH = 8               # completed records waiting for their CQE write
RECEIVE_DEPTH = 4           # receive completions waiting for the CQE writer
CQE_OPCODE_REQ = 0x0
CQE_OPCODE_REQ_ERR = 0xD


class CompletedJobLayout(data.StructLayout):
    """A completed record on its way from the engine to the CQE writer."""
    def __init__(self):
        super().__init__({
            "qpn": QPN_BITS, "cqn": 8, "wqe_index": 16, "wqe_blocks": range(17),
            "opcode": 8, "byte_count": 32, "error": 1, "syndrome": 8, "write_cqe": 1,
            "wait_data": 1, "data_seq": RESPONSE_SEQ_BITS, "next_psn": PSN_BITS,
        })


class _CqeLayout(data.StructLayout):
    """A job of the writer, from the engine (a completed WQE, retired once written) or
    from the responder (a receive completion); fields hold the CQE's values."""
    def __init__(self):
        super().__init__({
            "requester": 1, "qpn": QPN_BITS, "cqn": 8, "wqe_counter": 16,
            "wqe_blocks": range(17), "write_cqe": 1, "error": 1, "cqe_opcode": 4,
            "wqe_opcode": 8, "byte_count": 32, "imm": 32, "syndrome": 8,
            "next_psn": PSN_BITS,
        })


def _big_endian(value, nbytes):
    value = Value.cast(value)
    return [value[8 * (nbytes - 1 - k):8 * (nbytes - k)] for k in range(nbytes)]


class CqeWriter(wiring.Component):
    """P (CQ context and producer index) -> A (the CQE, its entry) -> O (AXI AW/W), with
    the engine's jobs and the responder's in turn; ports and timing in docs/nic.md."""

    def __init__(self, *, num_cqs=16, addr_width=64):
        if not isinstance(num_cqs, int) or not 1 <= num_cqs <= 256:
            raise ValueError(f"CQs must be 1 to 256, not {num_cqs!r}")
        if not isinstance(addr_width, int) or not 16 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 16 to 64 bits, not {addr_width!r}")
        self.num_cqs = num_cqs
        self.addr_width = addr_width
        super().__init__({
            "job": In(stream.Signature(CompletedJobLayout())),
            "job_level": Out(range(JOB_DEPTH + 1)),
            "receive": In(stream.Signature(ReceiveCompletionLayout())),
            "landed": In(RESPONSE_SEQ_BITS),
            "cq_reset": In(EventSignature()),     # ``qpn`` carries the CQ number
            "cq_config": Out(ContextReadSignature(num_cqs, CqConfigLayout())),
            "retire": Out(stream.Signature(RetireLayout(), always_ready=True)),
            "axi": Out(AxiWriteSignature(addr_width, WIDTH)),
            "cqes_written": Out(32),
            "error_cqes": Out(32),
            "recv_cqes": Out(32),
            "cqe_write_errors": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        axi = self.axi

        m.submodules.jobs = jobs = fifo.SyncFIFOBuffered(
            width=CompletedJobLayout().size, depth=JOB_DEPTH)
        m.d.comb += [
            jobs.w_data.eq(self.job.payload),
            jobs.w_en.eq(self.job.valid),
            self.job.ready.eq(jobs.w_rdy),
            self.job_level.eq(jobs.level),
        ]
        m.submodules.receives = receives = fifo.SyncFIFOBuffered(
            width=ReceiveCompletionLayout().size, depth=RECEIVE_DEPTH)
        m.d.comb += [
            receives.w_data.eq(self.receive.payload),
            receives.w_en.eq(self.receive.valid),
            self.receive.ready.eq(receives.w_rdy),
        ]
        job_head = CompletedJobLayout()(jobs.r_data)
        from_engine = Signal(_CqeLayout())
        m.d.comb += [
            from_engine.requester.eq(1),
            from_engine.qpn.eq(job_head.qpn),
            from_engine.cqn.eq(job_head.cqn),
            from_engine.wqe_counter.eq(job_head.wqe_index),
            from_engine.wqe_blocks.eq(job_head.wqe_blocks),
            from_engine.write_cqe.eq(job_head.write_cqe),
            from_engine.error.eq(job_head.error),
            from_engine.cqe_opcode.eq(Mux(job_head.error, CQE_OPCODE_REQ_ERR, CQE_OPCODE_REQ)),
            from_engine.wqe_opcode.eq(job_head.opcode),
            from_engine.byte_count.eq(Mux(job_head.error, 0, job_head.byte_count)),
            from_engine.syndrome.eq(Mux(job_head.error, job_head.syndrome, 0)),
            from_engine.next_psn.eq(job_head.next_psn),
        ]
        recv_head = ReceiveCompletionLayout()(receives.r_data)
        recv_opcode = recv_head.opcode.as_value()
        recv_error = recv_opcode == RecvCqeOpcode.RESP_ERR.value
        recv_imm = ((recv_opcode == RecvCqeOpcode.RESP_WR_IMM.value)
                    | (recv_opcode == RecvCqeOpcode.RESP_SEND_IMM.value))
        recv_known = recv_error | recv_imm | (recv_opcode == RecvCqeOpcode.RESP_SEND.value)
        from_responder = Signal(_CqeLayout())
        m.d.comb += [
            from_responder.qpn.eq(recv_head.qpn),
            from_responder.cqn.eq(recv_head.cqn),
            from_responder.wqe_counter.eq(recv_head.wqe_counter),
            from_responder.write_cqe.eq(recv_known & (recv_head.cqn < self.num_cqs)),
            from_responder.error.eq(recv_error),
            from_responder.cqe_opcode.eq(recv_opcode),
            from_responder.byte_count.eq(Mux(recv_error, 0, recv_head.byte_count)),
            from_responder.imm.eq(Mux(recv_imm, recv_head.imm, 0)),
            from_responder.syndrome.eq(Mux(recv_error, recv_head.syndrome, 0)),
        ]
        # A READ's or atomic's CQE waits until the ResponseWriter has written the data of
        # its last response (``landed``, registered here, has passed that response's
        # sequence number): the sign of ``landed - data_seq - 1``, registered for the head
        # job and good in the next cycle if the head stays (no read in between; ``landed``
        # only moves on), so that the choice of the next job starts from flip-flops.
        landed = Signal(RESPONSE_SEQ_BITS)
        m.d.sync += landed.eq(self.landed)
        landed_gap = lookahead_sum(m, landed, ~job_head.data_seq, name="landed_gap")
        head_landed = Signal()          # the head of the cycle before had landed
        head_read = Signal()            # ... and was read in that cycle
        m.d.sync += [
            head_landed.eq(jobs.r_rdy & ~landed_gap[RESPONSE_SEQ_BITS - 1]),
            head_read.eq(jobs.r_en),
        ]
        job_ready = jobs.r_rdy & (~job_head.wait_data | (head_landed & ~head_read))
        # Round robin: after an engine job, a waiting receive completion goes first.
        responder_turn = Signal()
        take_receive = receives.r_rdy & (~job_ready | responder_turn)
        head = Signal(_CqeLayout())
        m.d.comb += head.eq(Mux(take_receive, from_responder, from_engine))

        p_valid = Signal()
        p_job = Signal(_CqeLayout())
        a_valid = Signal()
        a_job = Signal(_CqeLayout())
        a_base = Signal(64)
        a_entry = Signal(16)
        a_cqe = Signal(8 * WIDTH)
        o_valid = Signal()
        o_job = Signal(_CqeLayout())
        aw_pending = Signal()
        w_pending = Signal()
        awaddr = Signal(self.addr_width)
        wdata = Signal(8 * WIDTH)
        m.d.comb += [
            axi.awid.eq(0), axi.awaddr.eq(awaddr), axi.awlen.eq(0),
            axi.awsize.eq((WIDTH - 1).bit_length()), axi.awburst.eq(0b01),
            axi.awvalid.eq(aw_pending),
            axi.wdata.eq(wdata), axi.wstrb.eq((1 << WIDTH) - 1), axi.wlast.eq(1),
            axi.wvalid.eq(w_pending),
            axi.bready.eq(1),
        ]
        aw_fire = aw_pending & axi.awready
        w_fire = w_pending & axi.wready
        o_done = o_valid & (~aw_pending | axi.awready) & (~w_pending | axi.wready)
        o_free = ~o_valid | o_done
        a_move = a_valid & o_free
        p_move = p_valid & (~a_valid | a_move)
        load_p = (job_ready | receives.r_rdy) & (~p_valid | p_move)
        m.d.comb += [
            jobs.r_en.eq(load_p & ~take_receive),
            receives.r_en.eq(load_p & take_receive),
            # The context answers a cycle later: address the job that P holds next cycle.
            self.cq_config.addr.eq(Mux(load_p, head.cqn, p_job.cqn)),
        ]
        with m.If(load_p):
            m.d.sync += [p_valid.eq(1), p_job.eq(head), responder_turn.eq(~take_receive)]
        with m.Elif(p_move):
            m.d.sync += p_valid.eq(0)

        # CQ producer indices, read like the CQ context: for the job that P holds next cycle.
        m.submodules.producer = producer = Memory(shape=16, depth=self.num_cqs, init=[])
        pi_write = producer.write_port()
        pi_read = producer.read_port(transparent_for=(pi_write,))
        m.d.comb += pi_read.addr.eq(self.cq_config.addr)
        cq = self.cq_config.data
        # A CQ is fresh after a reset or a host write to its context (``cq_reset``): its
        # producer index reads as 0 until the next CQE is written. P looks its job's CQ up
        # in the flags, which a CQE written in the cycle before has already cleared.
        cq_fresh = Signal(self.num_cqs, init=(1 << self.num_cqs) - 1)
        pi_fresh = cq_fresh.bit_select(p_job.cqn, 1)
        cq_written = Mux(pi_write.en, 1 << pi_write.addr, 0)
        cq_cleared = Mux(self.cq_reset.valid & (self.cq_reset.qpn < self.num_cqs),
                         1 << self.cq_reset.qpn[:max(self.num_cqs - 1, 1).bit_length()], 0)
        m.d.sync += cq_fresh.eq((cq_fresh & ~cq_written) | cq_cleared)
        pi = Mux(pi_fresh, 0, pi_read.data)
        pi_next = lookahead_sum(m, pi_read.data, 1, name="pi_next")[:16]
        log_size = Mux(cq.collapsed, 0, cq.log_size)
        entry = pi & ((Const(1, 17) << log_size) - 1)
        owner = (pi >> log_size)[0]
        cqe_bytes = [Const(0, 8)] * WIDTH
        cqe_bytes[36:40] = _big_endian(p_job.imm, 4)
        cqe_bytes[44:48] = _big_endian(p_job.byte_count, 4)
        cqe_bytes[55] = p_job.syndrome
        cqe_bytes[56:60] = _big_endian(Cat(p_job.qpn, Const(0, 16), p_job.wqe_opcode), 4)
        cqe_bytes[60:62] = _big_endian(p_job.wqe_counter, 2)
        cqe_bytes[63] = Cat(owner, Const(0, 3), p_job.cqe_opcode)
        with m.If(p_move):
            m.d.sync += [a_valid.eq(1), a_job.eq(p_job), a_base.eq(cq.base), a_entry.eq(entry),
                         a_cqe.eq(Cat(*cqe_bytes))]
        with m.Elif(a_move):
            m.d.sync += a_valid.eq(0)
        m.d.comb += [
            pi_write.addr.eq(p_job.cqn),
            pi_write.data.eq(Mux(pi_fresh, 1, pi_next)),
            pi_write.en.eq(p_move & p_job.write_cqe),
        ]

        cqe_address = lookahead_sum(m, a_base, Cat(Const(0, 6), a_entry), name="cqe_address")
        with m.If(aw_fire):
            m.d.sync += aw_pending.eq(0)
        with m.If(w_fire):
            m.d.sync += w_pending.eq(0)
        with m.If(o_done):
            m.d.sync += o_valid.eq(0)
        with m.If(a_move):
            m.d.sync += [
                o_valid.eq(1), o_job.eq(a_job),
                aw_pending.eq(a_job.write_cqe), w_pending.eq(a_job.write_cqe),
                awaddr.eq(cqe_address), wdata.eq(a_cqe),
            ]

        m.d.comb += [
            self.retire.valid.eq(o_done & o_job.requester),
            self.retire.payload.qpn.eq(o_job.qpn),
            self.retire.payload.blocks.eq(o_job.wqe_blocks),
            self.retire.payload.next_psn.eq(o_job.next_psn),
        ]
        for counter, event in ((self.cqes_written, o_done & o_job.write_cqe),
                               (self.error_cqes, o_done & o_job.write_cqe & o_job.error),
                               (self.recv_cqes, o_done & o_job.write_cqe & ~o_job.requester),
                               (self.cqe_write_errors, axi.bvalid & (axi.bresp != 0))):
            count_registered(m, counter, event)
        return m
