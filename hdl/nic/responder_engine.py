import operator
from functools import reduce

from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.nic.signatures import (
    PSN_BITS, Access, AtomicRequestLayout, AtomicResultLayout, ContextReadSignature,
    DmaWriteLayout, EventSignature, MkeyLayout, QpConfigLayout, QpState, RecvCqeOpcode,
    ReceiveCompletionLayout, RecvRequestLayout, RecvResultLayout, RecvStatus,
    RequestDescriptorLayout, ResponseCommandLayout, ResponseKind, Syndrome,
)

__all__ = ["ResponderEngine", "ACK_SYNDROME", "RNR_NAK", "NAK", "NAK_PSN_SEQUENCE",
           "NAK_INVALID_REQUEST", "NAK_REMOTE_ACCESS", "NAK_REMOTE_OPERATIONAL"]

# AETH syndromes: an ACK with the credit field "invalid" (no end-to-end credits), the RNR
# NAK type (| timer code) and the NAK type (| code).
ACK_SYNDROME = 0x1F
RNR_NAK = 0x20
NAK = 0x60
NAK_PSN_SEQUENCE = 0
NAK_INVALID_REQUEST = 1
NAK_REMOTE_ACCESS = 2
NAK_REMOTE_OPERATIONAL = 3
# Executed atomics whose results a QP keeps for duplicates (IBA: as many as the requester
# may have outstanding; a requester that keeps more in flight, and loses an acknowledge,
# cannot get the older ones answered and runs out of retries).
SAVED_ATOMICS = 4

# BTH opcodes of RC requests (IBA table 38).
SEND_FIRST, SEND_MIDDLE, SEND_LAST, SEND_LAST_IMM, SEND_ONLY, SEND_ONLY_IMM = range(0x00, 0x06)
(WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST, WRITE_LAST_IMM, WRITE_ONLY,
 WRITE_ONLY_IMM) = range(0x06, 0x0C)
READ_REQUEST = 0x0C
COMPARE_SWAP = 0x13
FETCH_ADD = 0x14

FIRSTS = (SEND_FIRST, SEND_ONLY, SEND_ONLY_IMM, WRITE_FIRST, WRITE_ONLY, WRITE_ONLY_IMM)
LASTS = (SEND_LAST, SEND_LAST_IMM, SEND_ONLY, SEND_ONLY_IMM,
         WRITE_LAST, WRITE_LAST_IMM, WRITE_ONLY, WRITE_ONLY_IMM)

# Message in progress on a QP.
NONE, IN_SEND, IN_WRITE = 0, 1, 2


class _RowLayout(data.StructLayout):
    """A QP's row in the state memory; after ``qp_reset`` the row reads as all zero but
    ``epsn``, which is the context's ``rq_psn``."""
    def __init__(self):
        super().__init__({
            "epsn": PSN_BITS,
            "msn": 24,
            "prog": 2,              # NONE, IN_SEND, IN_WRITE
            "va": 64,               # the message's next byte: WRITE target / receive buffer
            "left": 32,             # WRITE: RETH bytes not yet written; SEND: buffer room
            "count": 32,            # bytes of the message so far
            "wqe": 16,              # SEND: wqe_counter of the receive WQE taken
            "seq_nak": 1,           # PSN sequence NAK sent since the last in-sequence packet
            "err": 1,               # this engine sent qp_error (the QP state follows later)
            # The newest SAVED_ATOMICS executed atomics, newest first.
            "atom_valid": data.ArrayLayout(1, SAVED_ATOMICS),
            "atom_psn": data.ArrayLayout(PSN_BITS, SAVED_ATOMICS),
            "atom_orig": data.ArrayLayout(64, SAVED_ATOMICS),
        })


def _one_of(value, options):
    return Cat(value == option for option in options).any()


class ResponderEngine(wiring.Component):
    """Per-QP responder state, every transport and protection check and the decision for
    each request descriptor (docs/nic-responder.md, "Responder engine: the checks, in
    order" and "Memory ordering").

    One descriptor at a time, through a state machine: accept (IDLE), present the QP,
    memory-key and state-row addresses (LOOKUP), register the checks (CHECK), decide
    (DECIDE), then possibly wait for a receive WQE (RECV_*), for ``dma_idle`` (READ,
    atomic) and the atomic unit (ATOMIC_*), and finally offer the descriptor's outputs
    together (ISSUE: the DMA command, at most one response, at most one receive
    completion; each leaves on its own handshake) and write the QP's row back. A
    descriptor that waits for nothing outside takes 5 cycles plus the outputs' back
    pressure. Receive-WQE and atomic round trips and ``dma_idle`` waits stall every QP
    (descriptors are handled strictly in order).

    The per-QP state is one row of a memory (``_RowLayout``); a bit per QP marks rows
    reset since they were last written, which read as zero with ``epsn`` = the context's
    ``rq_psn``. A ``qp_reset`` for the QP of the descriptor in progress, from its CHECK
    cycle on, keeps that descriptor's row from being written (its outputs still go out).

    Choices beyond the document:

    - Check 1 also drops (``rx_dropped_qp``) a QP whose SL maps to a VL this port lacks
      (``sl_to_vl[sl] >= num_vls``), whose path MTU code is outside 1..5, or to which
      this engine sent ``qp_error`` since its last reset (``qp_state`` follows later).
    - Out-of-sequence packets dropped after the first NAK are not counted; a duplicate
      of an opcode that is not a SEND, WRITE, READ or atomic is dropped (counted in
      ``duplicate_requests``); an in-sequence packet with such an opcode is an invalid
      request.
    - Every in-sequence packet clears the sequence-NAK flag, NAKed ones included.
    - A SEND/WRITE ONLY with a payload above the MTU is an invalid request, as a LAST.
      The QP's rights and the memory key are checked on a WRITE's FIRST/ONLY (the key
      for the RETH's whole range; a range ending at exactly 2^64 is allowed), so a
      message under way finishes if the host takes the right away meanwhile.
    - ``requests_executed`` counts every in-sequence request that reaches the execution
      checks, NAKed and RNR-NAKed ones too (as models.nic counts it); a failing one is
      also counted by its NAK's counter. Duplicates count in ``duplicate_requests`` only.
    - Responses carry the QP's MSN after the packet: an executed READ's responses and
      an atomic's acknowledgement the incremented MSN, duplicates and NAKs the current
      one; ``mtu`` is the QP's MTU code in every response command. A duplicate READ
      waits for ``dma_idle`` too.
    - A receive result with a status other than OK or EMPTY is treated as ERROR.
      Receive error completions carry ``byte_count`` 0 and the WQE's ``wqe_counter``
      (the WQE of the message under way when a SEND MIDDLE/LAST overflows it).
    - An atomic result with ``error``: NAK remote operational error, QP to ERR
      (``op_naks``); nothing is saved for duplicates.
    - ``dma_idle`` must be low from the cycle after a command with ``bytes`` > 0 is
      taken until its writes have their responses. The engine first looks at it five
      cycles after the cycle that took its previous command, so an ``idle`` that
      drops up to four cycles late is still safe.
    """

    def __init__(self, *, num_qps=64, num_mkeys=64, num_vls=2):
        for name, value, low, high in (("num_qps", num_qps, 1, 256),
                                       ("num_mkeys", num_mkeys, 1, 1 << 24),
                                       ("num_vls", num_vls, 1, 15)):
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer from {low} to {high}, not {value!r}")
        self.num_qps = num_qps
        self.num_mkeys = num_mkeys
        self.num_vls = num_vls
        super().__init__({
            "request": In(stream.Signature(RequestDescriptorLayout())),
            "qp_config": Out(ContextReadSignature(num_qps, QpConfigLayout())),
            "mkey": Out(ContextReadSignature(num_mkeys, MkeyLayout())),
            "qp_state": In(QpState).array(num_qps),
            "qp_reset": In(EventSignature()),
            "qp_error": Out(EventSignature()),
            "sl_to_vl": In(4).array(16),
            "dma": Out(stream.Signature(DmaWriteLayout())),
            "dma_idle": In(1),
            "response": Out(stream.Signature(ResponseCommandLayout())),
            "recv_request": Out(stream.Signature(RecvRequestLayout())),
            "recv_result": In(stream.Signature(RecvResultLayout())),
            "atomic_request": Out(stream.Signature(AtomicRequestLayout())),
            "atomic_result": In(stream.Signature(AtomicResultLayout())),
            "receive_completion": Out(stream.Signature(ReceiveCompletionLayout())),
            "requests_executed": Out(32),
            "duplicate_requests": Out(32),
            "seq_naks": Out(32),
            "rnr_naks": Out(32),
            "access_naks": Out(32),
            "invalid_naks": Out(32),
            "op_naks": Out(32),
            "rx_dropped_qp": Out(32),
            "rx_dropped_pkey": Out(32),
            "atomic_replays": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        num_qps = self.num_qps
        qp_bits = max(num_qps - 1, 1).bit_length()
        row_layout = _RowLayout()

        d = Signal(RequestDescriptorLayout())
        q = d.destqp[:qp_bits]
        cfg = self.qp_config.data
        mk = self.mkey.data

        m.submodules.rows = rows = Memory(shape=row_layout, depth=num_qps, init=[])
        row_write = rows.write_port()
        row_read = rows.read_port()
        m.d.comb += [
            self.qp_config.addr.eq(d.destqp),
            self.mkey.addr.eq((d.rkey >> 8) % self.num_mkeys),
            row_read.addr.eq(d.destqp),
        ]

        def onehot(index, en):
            return Mux(en, (Const(1, num_qps) << index)[:num_qps], 0)

        # Memories keep their contents through a reset, so every row starts fresh.
        fresh = Signal(num_qps, init=(1 << num_qps) - 1)
        killed = Signal()           # a qp_reset of this descriptor's QP after its row was read

        # --- opcode classes (from the descriptor register) ---------------------------------
        op = d.opcode
        is_send = op <= SEND_ONLY_IMM
        is_write = (op >= WRITE_FIRST) & (op <= WRITE_ONLY_IMM)
        is_read = op == READ_REQUEST
        is_atomic = (op == COMPARE_SWAP) | (op == FETCH_ADD)
        is_data = is_send | is_write
        first = _one_of(op, FIRSTS)
        last = _one_of(op, LASTS)
        send_imm = (op == SEND_LAST_IMM) | (op == SEND_ONLY_IMM)
        write_imm = (op == WRITE_LAST_IMM) | (op == WRITE_ONLY_IMM)
        needs_wqe = (is_send & first) | write_imm

        # --- CHECK: the checks on the contexts and the row, registered ----------------------
        row_now = Signal(row_layout)
        with m.If(fresh.bit_select(q, 1)):
            m.d.comb += row_now.epsn.eq(cfg.rq_psn)
        with m.Else():
            m.d.comb += row_now.eq(row_read.data)

        vl = Signal(4)
        m.d.comb += vl.eq(Array(self.sl_to_vl)[cfg.sl])
        qp_states = Array(state.as_value() for state in self.qp_state)
        qp_ok = ((d.destqp < num_qps) & (qp_states[q] == QpState.RTS.value)
                 & (d.slid == cfg.dlid) & (vl < self.num_vls)
                 & (cfg.mtu >= 1) & (cfg.mtu <= 5) & ~row_now.err)
        pkey_ok = (d.pkey[:15] == cfg.pkey[:15]) & (d.pkey[15] | cfg.pkey[15])
        psn_diff = Signal(PSN_BITS)
        m.d.comb += psn_diff.eq(d.psn - row_now.epsn)

        prog = row_now.prog
        seq_err = ((is_data & first & (prog != NONE))
                   | (is_data & ~first & (prog == NONE))
                   | (is_send & ~first & (prog == IN_WRITE))
                   | (is_write & ~first & (prog == IN_SEND))
                   | ((is_read | is_atomic) & (prog != NONE))
                   | ~(is_data | is_read | is_atomic))
        mtu_bytes = Signal(range((128 << 7) + 1))
        m.d.comb += mtu_bytes.eq(Const(128, 8) << cfg.mtu)
        pl = d.payload_bytes
        length_err = is_data & ((~last & (pl != mtu_bytes)) | (last & (pl > mtu_bytes))
                                | (last & ~first & (pl == 0)))
        write_room = Mux(first, d.dmalen, row_now.left)
        write_len_err = is_write & ((pl > write_room) | (last & (pl != write_room)))
        align_err = is_atomic & (d.va[:3] != 0)

        need = Signal(4)
        with m.If(is_write & first):
            m.d.comb += need.eq(Access.REMOTE_WRITE.value)
        with m.Elif(is_read):
            m.d.comb += need.eq(Access.REMOTE_READ.value)
        with m.Elif(is_atomic):
            m.d.comb += need.eq(Access.REMOTE_ATOMIC.value)
        right_err = (need != 0) & ((cfg.access.as_value() & need) == 0)
        key_applies = (is_write & first & (d.dmalen != 0)) | (is_read & (d.dmalen != 0)) | is_atomic
        end = Signal(65)
        limit = Signal(65)
        m.d.comb += [end.eq(d.va + Mux(is_atomic, 8, d.dmalen)), limit.eq(mk.base + mk.length)]
        wraps = end[64] & (end[:64] != 0)
        key_ok = (mk.valid & (mk.key == d.rkey) & (mk.pd == cfg.pd)
                  & ((mk.access.as_value() & need) != 0)
                  & (d.va >= mk.base) & (end <= limit) & ~wraps)

        read_psns = Signal(PSN_BITS)
        m.d.comb += read_psns.eq(Mux(d.dmalen == 0, 1, ((d.dmalen - 1) >> (cfg.mtu + 7)) + 1))

        row = Signal(row_layout)            # the row as read, for the decision
        new_row = Signal(row_layout)        # the row to write back
        # A duplicate atomic is answered from its saved result, if it is still kept.
        saved_hit = Signal(SAVED_ATOMICS)
        saved_orig = Signal(64)
        m.d.comb += [
            saved_hit.eq(Cat(row.atom_valid[i] & (row.atom_psn[i] == d.psn)
                             for i in range(SAVED_ATOMICS))),
            # PSNs are distinct, so at most one hits.
            saved_orig.eq(reduce(operator.or_, (Mux(saved_hit[i], row.atom_orig[i], 0)
                                                for i in range(SAVED_ATOMICS)))),
        ]
        f_qp_ok = Signal()
        f_pkey_ok = Signal()
        f_equal = Signal()
        f_behind = Signal()
        f_invalid = Signal()
        f_access = Signal()
        f_read_ok = Signal()                # a duplicate READ passes its rights checks
        f_read_psns = Signal(PSN_BITS)
        min_rnr_timer = Signal(5)

        # Registered outputs of the decision.
        cmd = Signal(DmaWriteLayout())
        resp = Signal(ResponseCommandLayout())
        comp = Signal(ReceiveCompletionLayout())
        rres = Signal(RecvResultLayout())
        dma_pending = Signal()
        resp_pending = Signal()
        comp_pending = Signal()
        row_pending = Signal()
        error_pending = Signal()

        counters = {name: getattr(self, name) for name in (
            "requests_executed", "duplicate_requests", "seq_naks", "rnr_naks", "access_naks",
            "invalid_naks", "op_naks", "rx_dropped_qp", "rx_dropped_pkey", "atomic_replays")}
        count = {name: Signal(name=f"count_{name}") for name in counters}
        for name, counter in counters.items():
            with m.If(count[name]):
                m.d.sync += counter.eq(counter + 1)

        def respond(kind, psn, syndrome, msn):
            return [resp_pending.eq(1), resp.kind.eq(kind), resp.psn.eq(psn),
                    resp.syndrome.eq(syndrome), resp.msn.eq(msn)]

        def nak(code, counter):
            """An in-sequence packet fails an execution check: NAK, QP to ERR."""
            m.d.comb += count[counter].eq(1)
            m.d.sync += respond(ResponseKind.ACK, d.psn, NAK | code, row.msn)
            m.d.sync += [error_pending.eq(1), new_row.err.eq(1)]

        def complete_error(syndrome, wqe):
            m.d.sync += [comp_pending.eq(1), comp.opcode.eq(RecvCqeOpcode.RESP_ERR),
                         comp.syndrome.eq(syndrome), comp.wqe_counter.eq(wqe)]

        # Execution of an in-sequence SEND/WRITE packet (after its receive WQE, if any).
        # ``rres`` is the receive WQE a SEND FIRST/ONLY just took.
        took_buffer = is_send & first
        exec_va = Mux(took_buffer, rres.addr, Mux(is_write & first, d.va, row.va))
        exec_room = Mux(took_buffer, rres.length, Mux(is_write & first, d.dmalen, row.left))
        exec_count = Signal(32)
        exec_msn = Signal(24)
        m.d.comb += [exec_count.eq(Mux(first, 0, row.count) + pl),
                     exec_msn.eq(row.msn + last)]
        send_too_long = is_send & (pl > exec_room)

        def execute():
            m.d.sync += [
                cmd.addr.eq(Mux(pl != 0, exec_va, 0)),
                cmd.bytes.eq(pl),
                new_row.va.eq(exec_va + pl),
                new_row.left.eq(exec_room - pl),
                new_row.count.eq(exec_count),
                new_row.prog.eq(Mux(last, NONE, Mux(is_send, IN_SEND, IN_WRITE))),
                new_row.epsn.eq(d.psn + 1),
                new_row.msn.eq(exec_msn),
            ]
            with m.If(took_buffer):
                m.d.sync += new_row.wqe.eq(rres.wqe_counter)
            with m.If(d.ackreq):
                m.d.sync += respond(ResponseKind.ACK, d.psn, ACK_SYNDROME, exec_msn)
            with m.If(last & (is_send | write_imm)):
                m.d.sync += [
                    comp_pending.eq(1),
                    comp.opcode.eq(Mux(write_imm, RecvCqeOpcode.RESP_WR_IMM,
                                       Mux(send_imm, RecvCqeOpcode.RESP_SEND_IMM,
                                           RecvCqeOpcode.RESP_SEND))),
                    comp.byte_count.eq(exec_count),
                    comp.imm.eq(Mux(write_imm | send_imm, d.imm, 0)),
                    comp.wqe_counter.eq(Mux(write_imm | took_buffer, rres.wqe_counter, row.wqe)),
                ]

        issuing = Signal()
        with m.FSM() as fsm:
            with m.State("IDLE"):
                m.d.comb += self.request.ready.eq(1)
                with m.If(self.request.valid):
                    m.d.sync += [d.eq(self.request.payload), killed.eq(0)]
                    m.next = "LOOKUP"

            with m.State("LOOKUP"):
                m.next = "CHECK"

            with m.State("CHECK"):
                m.d.sync += [
                    row.eq(row_now),
                    new_row.eq(row_now),
                    f_qp_ok.eq(qp_ok),
                    f_pkey_ok.eq(pkey_ok),
                    f_equal.eq(psn_diff == 0),
                    f_behind.eq(psn_diff[-1]),
                    f_invalid.eq(seq_err | length_err | write_len_err | align_err),
                    f_access.eq(right_err | (key_applies & ~key_ok)),
                    f_read_ok.eq(~right_err & (~key_applies | key_ok)),
                    f_read_psns.eq(read_psns),
                    min_rnr_timer.eq(cfg.min_rnr_timer),
                    cmd.eq(0),
                    cmd.src_beat.eq(d.buffer_beat),
                    cmd.src_offset.eq(d.header_bytes),
                    cmd.release_beats.eq(d.beats),
                    resp.eq(0),
                    resp.vl.eq(vl),
                    resp.sl.eq(cfg.sl),
                    resp.dlid.eq(cfg.dlid),
                    resp.pkey.eq(cfg.pkey),
                    resp.destqp.eq(cfg.dest_qpn),
                    resp.mtu.eq(cfg.mtu),
                    comp.eq(0),
                    comp.qpn.eq(d.destqp),
                    comp.cqn.eq(cfg.rcqn),
                    dma_pending.eq(1),
                    resp_pending.eq(0),
                    comp_pending.eq(0),
                    row_pending.eq(0),
                    error_pending.eq(0),
                ]
                m.next = "DECIDE"

            with m.State("DECIDE"):
                read_response = [resp.va.eq(d.va), resp.length.eq(d.dmalen)]
                m.next = "ISSUE"
                with m.If(~f_qp_ok):
                    m.d.comb += count["rx_dropped_qp"].eq(1)
                with m.Elif(~f_pkey_ok):
                    m.d.comb += count["rx_dropped_pkey"].eq(1)
                with m.Elif(~f_equal & ~f_behind):
                    with m.If(~row.seq_nak):
                        m.d.comb += count["seq_naks"].eq(1)
                        m.d.sync += respond(ResponseKind.ACK, row.epsn, NAK | NAK_PSN_SEQUENCE,
                                            row.msn)
                        m.d.sync += [new_row.seq_nak.eq(1), row_pending.eq(1)]
                with m.Elif(f_behind):
                    m.d.comb += count["duplicate_requests"].eq(1)
                    with m.If(is_data):
                        m.d.sync += respond(ResponseKind.ACK, row.epsn - 1, ACK_SYNDROME, row.msn)
                    with m.Elif(is_read & f_read_ok):
                        m.d.sync += respond(ResponseKind.READ, d.psn, ACK_SYNDROME, row.msn)
                        m.d.sync += read_response
                        m.next = "WAIT_IDLE"
                    with m.Elif(is_atomic & saved_hit.any()):
                        m.d.comb += count["atomic_replays"].eq(1)
                        m.d.sync += respond(ResponseKind.ATOMIC, d.psn, ACK_SYNDROME, row.msn)
                        m.d.sync += resp.orig.eq(saved_orig)
                with m.Else():
                    m.d.comb += count["requests_executed"].eq(1)
                    m.d.sync += [new_row.seq_nak.eq(0), row_pending.eq(1)]
                    with m.If(f_invalid):
                        nak(NAK_INVALID_REQUEST, "invalid_naks")
                    with m.Elif(f_access):
                        nak(NAK_REMOTE_ACCESS, "access_naks")
                    with m.Elif(needs_wqe):
                        m.next = "RECV_REQUEST"
                    with m.Elif(is_read):
                        m.d.sync += respond(ResponseKind.READ, d.psn, ACK_SYNDROME, row.msn + 1)
                        m.d.sync += read_response
                        m.d.sync += [new_row.epsn.eq(d.psn + f_read_psns),
                                     new_row.msn.eq(row.msn + 1)]
                        m.next = "WAIT_IDLE"
                    with m.Elif(is_atomic):
                        m.next = "WAIT_IDLE"
                    with m.Elif(send_too_long):
                        nak(NAK_INVALID_REQUEST, "invalid_naks")
                        complete_error(Syndrome.LOCAL_LENGTH_ERR, row.wqe)
                    with m.Else():
                        execute()

            with m.State("RECV_REQUEST"):
                m.d.comb += [self.recv_request.valid.eq(1),
                             self.recv_request.payload.qpn.eq(d.destqp)]
                with m.If(self.recv_request.ready):
                    m.next = "RECV_WAIT"

            with m.State("RECV_WAIT"):
                m.d.comb += self.recv_result.ready.eq(1)
                with m.If(self.recv_result.valid):
                    m.d.sync += rres.eq(self.recv_result.payload)
                    m.next = "RECV_DECIDE"

            with m.State("RECV_DECIDE"):
                m.next = "ISSUE"
                with m.If(rres.status == RecvStatus.EMPTY):
                    m.d.comb += count["rnr_naks"].eq(1)
                    m.d.sync += respond(ResponseKind.ACK, d.psn, RNR_NAK | min_rnr_timer, row.msn)
                with m.Elif(rres.status != RecvStatus.OK):
                    nak(NAK_REMOTE_OPERATIONAL, "op_naks")
                    complete_error(rres.syndrome, rres.wqe_counter)
                with m.Elif(send_too_long):
                    nak(NAK_INVALID_REQUEST, "invalid_naks")
                    complete_error(Syndrome.LOCAL_LENGTH_ERR, rres.wqe_counter)
                with m.Else():
                    execute()

            # READ and atomics: every earlier payload write has its response.
            with m.State("WAIT_IDLE"):
                with m.If(self.dma_idle):
                    m.next = "ISSUE"
                    with m.If(is_atomic):
                        m.next = "ATOMIC_REQUEST"

            with m.State("ATOMIC_REQUEST"):
                m.d.comb += [
                    self.atomic_request.valid.eq(1),
                    self.atomic_request.payload.addr.eq(d.va),
                    self.atomic_request.payload.fetch_add.eq(op == FETCH_ADD),
                    self.atomic_request.payload.swap_add.eq(d.swap_add),
                    self.atomic_request.payload.compare.eq(d.compare),
                ]
                with m.If(self.atomic_request.ready):
                    m.next = "ATOMIC_WAIT"

            with m.State("ATOMIC_WAIT"):
                m.d.comb += self.atomic_result.ready.eq(1)
                result = self.atomic_result.payload
                with m.If(self.atomic_result.valid):
                    m.next = "ISSUE"
                    with m.If(result.error):
                        nak(NAK_REMOTE_OPERATIONAL, "op_naks")
                    with m.Else():
                        m.d.sync += respond(ResponseKind.ATOMIC, d.psn, ACK_SYNDROME, row.msn + 1)
                        m.d.sync += [
                            resp.orig.eq(result.orig),
                            new_row.epsn.eq(d.psn + 1),
                            new_row.msn.eq(row.msn + 1),
                            new_row.atom_valid.eq(Cat(1, row.atom_valid.as_value()[:-1])),
                            new_row.atom_psn.eq(Cat(d.psn, row.atom_psn.as_value()[:-PSN_BITS])),
                            new_row.atom_orig.eq(Cat(result.orig, row.atom_orig.as_value()[:-64])),
                        ]

            with m.State("ISSUE"):
                m.d.comb += issuing.eq(1)
                dma_left = dma_pending & ~self.dma.ready
                resp_left = resp_pending & ~self.response.ready
                comp_left = comp_pending & ~self.receive_completion.ready
                m.d.sync += [dma_pending.eq(dma_left), resp_pending.eq(resp_left),
                             comp_pending.eq(comp_left), row_pending.eq(0),
                             error_pending.eq(0)]
                with m.If(~dma_left & ~resp_left & ~comp_left):
                    m.next = "IDLE"

        # --- outputs ---------------------------------------------------------------------------
        m.d.comb += [
            self.dma.valid.eq(issuing & dma_pending),
            self.dma.payload.eq(cmd),
            self.response.valid.eq(issuing & resp_pending),
            self.response.payload.eq(resp),
            self.receive_completion.valid.eq(issuing & comp_pending),
            self.receive_completion.payload.eq(comp),
            self.qp_error.valid.eq(issuing & error_pending),
            self.qp_error.qpn.eq(d.destqp),
            row_write.addr.eq(d.destqp),
            row_write.data.eq(new_row),
            row_write.en.eq(issuing & row_pending & ~killed),
        ]

        # --- qp_reset ------------------------------------------------------------------------
        reset_valid = self.qp_reset.valid & (self.qp_reset.qpn < num_qps)
        # Until CHECK, a reset shows in ``fresh``; from CHECK on, the row is already read.
        with m.If(self.qp_reset.valid & (self.qp_reset.qpn == d.destqp)
                  & ~fsm.ongoing("IDLE") & ~fsm.ongoing("LOOKUP")):
            m.d.sync += killed.eq(1)
        m.d.sync += fresh.eq((fresh & ~onehot(q, row_write.en))
                             | onehot(self.qp_reset.qpn[:qp_bits], reset_valid))
        return m
