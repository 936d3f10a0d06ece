
from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.arith import lookahead_sum, named, or_all
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
# This project's masked atomics (docs/nic-formats.md): 8-byte CS, FA, 4-byte CS, FA. Every
# atomic opcode has bit 2 set for fetch-and-add; the masked ones have bit 7, the 4-byte ones
# bits 7 and 5.
MASKED_ATOMICS = (0xD3, 0xD4, 0xF3, 0xF4)

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

    Pipelining (docs/fpga.md budget, 6 LUT levels): what the descriptor alone says
    (opcode classes, the payload against every MTU and the RETH length, its sums) is
    registered as it is taken; its end and a READ's next PSN for each MTU in LOOKUP; in
    CHECK every fact that needs the contexts or the row is registered, the key's range
    as one three-operand compare (no limit sum first), the PSN against both possible
    expected PSNs, and what an executed SEND/WRITE writes (address, next byte, room left,
    bytes so far); a SEND FIRST/ONLY's receive WQE replaces those in RECV_WAIT. DECIDE
    and RECV_DECIDE only choose between registers. The counters count registered events,
    a cycle after the event; every other port is cycle-identical to the unpipelined engine.

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
        pl = d.payload_bytes

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

        # --- ACCEPT: facts of the descriptor alone, registered with it ----------------------
        # Each state's decision reads registers, never a sum: what the descriptor says is
        # worked out as it is taken, what needs the contexts or the row in CHECK.
        p = self.request.payload
        p_op = p.opcode
        p_pl = p.payload_bytes
        p_first = _one_of(p_op, FIRSTS)
        p_is_write = (p_op >= WRITE_FIRST) & (p_op <= WRITE_ONLY_IMM)
        p_is_read = p_op == READ_REQUEST
        p_is_atomic = _one_of(p_op, (COMPARE_SWAP, FETCH_ADD) + MASKED_ATOMICS)
        p_size4 = p_op[7] & p_op[5]
        p_dmalen_nonzero = p.dmalen != 0
        minus_pl = named(m, ~Cat(p_pl, C(0, 32 - len(p_pl))), "minus_pl_ones")
        facts = {
            "is_send": (p_op <= SEND_ONLY_IMM, 1),
            "is_write": (p_is_write, 1),
            "is_read": (p_is_read, 1),
            "is_atomic": (p_is_atomic, 1),
            "first": (p_first, 1),
            "last": (_one_of(p_op, LASTS), 1),
            "send_imm": ((p_op == SEND_LAST_IMM) | (p_op == SEND_ONLY_IMM), 1),
            "write_imm": ((p_op == WRITE_LAST_IMM) | (p_op == WRITE_ONLY_IMM), 1),
            "destqp_ok": (p.destqp < num_qps, 1),
            "pl_nonzero": (p_pl != 0, 1),
            # The message's MTU is known only in CHECK: the payload against every MTU.
            "pl_eq_mtu": (Cat(p_pl == (128 << k) for k in range(8)), 8),
            "pl_gt_mtu": (Cat(p_pl > (128 << k) for k in range(8)), 8),
            "pl_eq_dmalen": (p_pl == p.dmalen, 1),
            "align_err": (p_is_atomic & ((p.va[:2] != 0) | (~p_size4 & p.va[2])), 1),
            "key_applies": (((p_is_write & p_first) | p_is_read) & p_dmalen_nonzero
                            | p_is_atomic, 1),
            "need": (Mux(p_is_write & p_first, Access.REMOTE_WRITE.value,
                         Mux(p_is_read, Access.REMOTE_READ.value,
                             Mux(p_is_atomic, Access.REMOTE_ATOMIC.value, 0))), 4),
            "va_pl": (lookahead_sum(m, p.va, p_pl, name="va_pl_sum")[:64], 64),
            # dmalen - payload; its carry out says payload <= dmalen.
            "dmalen_pl": (lookahead_sum(m, p.dmalen, minus_pl, 1, name="dmalen_pl_sum"), 33),
            "not_pl": (minus_pl, 32),
            "minus_pl": (lookahead_sum(m, 0, minus_pl, 1, name="minus_pl_sum")[:32], 32),
            "psn1": (lookahead_sum(m, p.psn, 0, 1, name="psn1_sum")[:PSN_BITS], PSN_BITS),
            # dmalen - 1, or 0 for 0: a READ's PSNs are this >> (MTU bits) + 1.
            "dmalen_less1": (Mux(p_dmalen_nonzero,
                                 lookahead_sum(m, p.dmalen, C(-1, 32), name="dmalen_less1_sum")[:32],
                                 0), 32),
            "end_dmalen": (lookahead_sum(m, p.va, p.dmalen, name="end_dmalen_sum"), 65),
            "end_atomic": (lookahead_sum(m, p.va, Mux(p_size4, 4, 8), name="end_atomic_sum"), 65),
        }
        f = {name: Signal(width, name=f"d_{name}") for name, (_, width) in facts.items()}
        is_send, is_write, is_read, is_atomic = f["is_send"], f["is_write"], f["is_read"], f["is_atomic"]
        first, last, send_imm, write_imm = f["first"], f["last"], f["send_imm"], f["write_imm"]
        is_data = is_send | is_write
        write_first = is_write & first
        took_buffer = is_send & first
        needs_wqe = took_buffer | write_imm
        need = f["need"]

        # --- LOOKUP: second facts of the descriptor, registered every cycle ----------------
        end = Signal(65)            # the byte after the request's range
        wraps = Signal()            # ending exactly at 2^64 is not a wrap
        # The QP's next PSN after an executed READ, for each valid MTU (1..5).
        read_epsns = [Signal(PSN_BITS, name=f"read_epsn_mtu{k}") for k in range(8)]
        end_now = named(m, Mux(is_atomic, f["end_atomic"], f["end_dmalen"]), "end_now")
        m.d.sync += [end.eq(end_now), wraps.eq(end_now[64] & (end_now[:64] != 0))]
        for k in range(1, 6):
            m.d.sync += read_epsns[k].eq(lookahead_sum(m, d.psn, f["dmalen_less1"] >> (k + 7), 1,
                                                       name=f"read_epsn_sum{k}")[:PSN_BITS])

        # Whether this QP's row reads as fresh in the next cycle, for CHECK: the row is
        # written only in ISSUE, so after LOOKUP only a reset can have changed its bit.
        fresh_q = Signal()
        reset_valid = Signal()
        m.d.comb += reset_valid.eq(self.qp_reset.valid & (self.qp_reset.qpn < num_qps))
        reset_here = reset_valid & (self.qp_reset.qpn[:qp_bits] == q)
        m.d.sync += [fresh.eq((fresh & ~onehot(q, row_write.en))
                              | onehot(self.qp_reset.qpn[:qp_bits], reset_valid)),
                     fresh_q.eq(fresh.bit_select(q, 1) | reset_here)]

        # --- CHECK: the checks on the contexts and the row, registered ----------------------
        read = row_read.data
        row_now = Signal(row_layout)
        with m.If(fresh_q):
            m.d.comb += row_now.epsn.eq(cfg.rq_psn)
        with m.Else():
            m.d.comb += row_now.eq(read)

        vl = Signal(4)
        m.d.comb += vl.eq(Array(self.sl_to_vl)[cfg.sl])
        rts = Signal(num_qps)
        m.d.comb += rts.eq(Cat(state == QpState.RTS for state in self.qp_state))
        qp_ok = (f["destqp_ok"] & rts.bit_select(q, 1)
                 & (d.slid == cfg.dlid) & (vl < self.num_vls)
                 & (cfg.mtu >= 1) & (cfg.mtu <= 5) & ~row_now.err)
        pkey_ok = (d.pkey[:15] == cfg.pkey[:15]) & (d.pkey[15] | cfg.pkey[15])
        # The PSN against the expected one, both ways the expected one may come.
        behind_cfg = lookahead_sum(m, d.psn, ~cfg.rq_psn, 1, name="behind_cfg_sum")[PSN_BITS - 1]
        behind_row = lookahead_sum(m, d.psn, ~read.epsn, 1, name="behind_row_sum")[PSN_BITS - 1]
        equal = Mux(fresh_q, d.psn == cfg.rq_psn, d.psn == read.epsn)
        behind = Mux(fresh_q, behind_cfg, behind_row)

        prog = row_now.prog
        seq_err = ((is_data & first & (prog != NONE))
                   | (is_data & ~first & (prog == NONE))
                   | (is_send & ~first & (prog == IN_WRITE))
                   | (is_write & ~first & (prog == IN_SEND))
                   | ((is_read | is_atomic) & (prog != NONE))
                   | ~(is_data | is_read | is_atomic))
        pl_eq_mtu = f["pl_eq_mtu"].bit_select(cfg.mtu, 1)
        pl_gt_mtu = f["pl_gt_mtu"].bit_select(cfg.mtu, 1)
        length_err = is_data & ((~last & ~pl_eq_mtu) | (last & pl_gt_mtu)
                                | (last & ~first & ~f["pl_nonzero"]))
        # The room a SEND or WRITE packet writes into: a WRITE FIRST/ONLY's dmalen, else
        # what the row has left (a SEND FIRST/ONLY's receive WQE replaces it in RECV_WAIT).
        left_pl = lookahead_sum(m, read.left, f["not_pl"], 1, name="left_pl_sum")
        pl_gt_left = Mux(fresh_q, f["pl_nonzero"], ~left_pl[32])
        pl_eq_left = Mux(fresh_q, ~f["pl_nonzero"], read.left == pl)
        pl_gt_room = Mux(first, ~f["dmalen_pl"][32], pl_gt_left)
        pl_eq_room = Mux(first, f["pl_eq_dmalen"], pl_eq_left)
        write_len_err = is_write & (pl_gt_room | (last & ~pl_eq_room))

        right_err = (need != 0) & ((cfg.access.as_value() & need) == 0)
        # end <= base + length as the carry out of base + length + ~end + 1 (66 bits): the
        # three operands reduced to two first, so no sum is formed before the compare.
        base = Cat(mk.base, C(0, 2))
        length = Cat(mk.length, C(0, 2))
        not_end = ~Cat(end, C(0, 1))
        room_s = named(m, base ^ length ^ not_end, "key_room_s")
        room_c = named(m, (base & length) | (base & not_end) | (length & not_end), "key_room_c")
        in_limit = lookahead_sum(m, room_s, Cat(C(0, 1), room_c[:65]), 1,
                                 name="key_room_sum")[66]
        key_ok = (mk.valid & (mk.key == d.rkey) & (mk.pd == cfg.pd)
                  & ((mk.access.as_value() & need) != 0)
                  & (d.va >= mk.base) & in_limit & ~wraps)

        # What an executed SEND or WRITE writes, for the row's message so far.
        row_va_pl = lookahead_sum(m, read.va, pl, name="row_va_pl_sum")[:64]
        row_count_pl = lookahead_sum(m, read.count, pl, name="row_count_pl_sum")[:32]
        msn1 = Mux(fresh_q, 1, lookahead_sum(m, read.msn, 0, 1, name="msn1_sum")[:24])
        epsn_less1 = Mux(fresh_q, lookahead_sum(m, cfg.rq_psn, C(-1, PSN_BITS),
                                                name="rq_psn_less1_sum")[:PSN_BITS],
                         lookahead_sum(m, read.epsn, C(-1, PSN_BITS),
                                       name="epsn_less1_sum")[:PSN_BITS])

        row = Signal(row_layout)            # the row as read, for the decision
        new_row = Signal(row_layout)        # the row to write back
        f_qp_ok = Signal()
        f_pkey_ok = Signal()
        f_equal = Signal()
        f_behind = Signal()
        f_invalid = Signal()
        f_access = Signal()
        f_read_ok = Signal()                # a duplicate READ passes its rights checks
        f_saved_hit = Signal(SAVED_ATOMICS) # a duplicate atomic's saved result, if still kept
        f_read_epsn = Signal(PSN_BITS)
        f_msn1 = Signal(24)                 # the row's MSN + 1
        f_epsn_less1 = Signal(PSN_BITS)
        min_rnr_timer = Signal(5)
        # An executed SEND/WRITE packet: its address (0 for no payload), the message's
        # next byte and room left after it, the bytes so far, and whether it overflows.
        x_addr = Signal(64)
        x_va = Signal(64)
        x_left = Signal(32)
        x_count = Signal(32)
        x_too_long = Signal()

        # PSNs are distinct, so at most one hits.
        saved_orig = Signal(64)
        m.d.comb += saved_orig.eq(or_all(Mux(f_saved_hit[i], row.atom_orig[i], 0)
                                         for i in range(SAVED_ATOMICS)))

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

        # Counters count registered events, a cycle after them: a 32-bit increment is deep
        # enough on its own.
        counters = {name: getattr(self, name) for name in (
            "requests_executed", "duplicate_requests", "seq_naks", "rnr_naks", "access_naks",
            "invalid_naks", "op_naks", "rx_dropped_qp", "rx_dropped_pkey", "atomic_replays")}
        count = {name: Signal(name=f"count_{name}") for name in counters}
        for name, counter in counters.items():
            event = Signal(name=f"{name}_event")
            m.d.sync += [event.eq(count[name]),
                         counter.eq(lookahead_sum(m, counter, event, name=f"{name}_next"))]

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
        exec_msn = Mux(last, f_msn1, row.msn)
        send_too_long = is_send & x_too_long

        def execute():
            m.d.sync += [
                cmd.addr.eq(x_addr),
                cmd.bytes.eq(pl),
                new_row.va.eq(x_va),
                new_row.left.eq(x_left),
                new_row.count.eq(x_count),
                new_row.prog.eq(Mux(last, NONE, Mux(is_send, IN_SEND, IN_WRITE))),
                new_row.epsn.eq(f["psn1"]),
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
                    comp.byte_count.eq(x_count),
                    comp.imm.eq(Mux(write_imm | send_imm, d.imm, 0)),
                    comp.wqe_counter.eq(Mux(write_imm | took_buffer, rres.wqe_counter, row.wqe)),
                ]

        # A SEND FIRST/ONLY's receive WQE, as it arrives: where the packet goes.
        rr = self.recv_result.payload
        wqe_left_pl = lookahead_sum(m, rr.length, f["not_pl"], 1, name="wqe_left_pl_sum")
        wqe_va_pl = lookahead_sum(m, rr.addr, pl, name="wqe_va_pl_sum")[:64]

        issuing = Signal()
        with m.FSM() as fsm:
            with m.State("IDLE"):
                m.d.comb += self.request.ready.eq(1)
                with m.If(self.request.valid):
                    m.d.sync += [d.eq(self.request.payload), killed.eq(0)]
                    m.d.sync += [f[name].eq(value) for name, (value, _) in facts.items()]
                    m.next = "LOOKUP"

            with m.State("LOOKUP"):
                m.next = "CHECK"

            with m.State("CHECK"):
                m.d.sync += [
                    row.eq(row_now),
                    new_row.eq(row_now),
                    f_qp_ok.eq(qp_ok),
                    f_pkey_ok.eq(pkey_ok),
                    f_equal.eq(equal),
                    f_behind.eq(behind),
                    f_invalid.eq(seq_err | length_err | write_len_err | f["align_err"]),
                    f_access.eq(right_err | (f["key_applies"] & ~key_ok)),
                    f_read_ok.eq(~right_err & (~f["key_applies"] | key_ok)),
                    f_saved_hit.eq(Cat(row_now.atom_valid[i] & (row_now.atom_psn[i] == d.psn)
                                       for i in range(SAVED_ATOMICS))),
                    f_read_epsn.eq(Array(read_epsns)[cfg.mtu]),
                    f_msn1.eq(msn1),
                    f_epsn_less1.eq(epsn_less1),
                    min_rnr_timer.eq(cfg.min_rnr_timer),
                    x_addr.eq(Mux(f["pl_nonzero"], Mux(write_first, d.va, row_now.va), 0)),
                    x_va.eq(Mux(write_first, f["va_pl"], Mux(fresh_q, pl, row_va_pl))),
                    x_left.eq(Mux(write_first, f["dmalen_pl"][:32],
                                  Mux(fresh_q, f["minus_pl"], left_pl[:32]))),
                    x_count.eq(Mux(first | fresh_q, pl, row_count_pl)),
                    x_too_long.eq(pl_gt_room),
                    cmd.eq(0),
                    cmd.src_beat.eq(d.buffer_beat),
                    # mod 64: a masked atomic's 64-byte header, with no payload after it
                    cmd.src_offset.eq(d.header_bytes[:6]),
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
                        m.d.sync += respond(ResponseKind.ACK, f_epsn_less1, ACK_SYNDROME, row.msn)
                    with m.Elif(is_read & f_read_ok):
                        m.d.sync += respond(ResponseKind.READ, d.psn, ACK_SYNDROME, row.msn)
                        m.d.sync += read_response
                        m.next = "WAIT_IDLE"
                    with m.Elif(is_atomic & f_saved_hit.any()):
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
                        m.d.sync += respond(ResponseKind.READ, d.psn, ACK_SYNDROME, f_msn1)
                        m.d.sync += read_response
                        m.d.sync += [new_row.epsn.eq(f_read_epsn), new_row.msn.eq(f_msn1)]
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
                    m.d.sync += rres.eq(rr)
                    with m.If(took_buffer):
                        m.d.sync += [x_addr.eq(Mux(f["pl_nonzero"], rr.addr, 0)),
                                     x_va.eq(wqe_va_pl),
                                     x_left.eq(wqe_left_pl[:32]),
                                     x_too_long.eq(~wqe_left_pl[32])]
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
                    self.atomic_request.payload.fetch_add.eq(d.opcode[2]),
                    self.atomic_request.payload.size4.eq(d.opcode[7] & d.opcode[5]),
                    self.atomic_request.payload.swap_add.eq(d.swap_add),
                    self.atomic_request.payload.compare.eq(d.compare),
                    # IBA FetchAdd: no field boundary; CmpSwap: the whole word, both masks.
                    self.atomic_request.payload.swap_mask.eq(
                        Mux(d.opcode[7], d.swap_mask, Mux(d.opcode[2], 0, C(-1, 64)))),
                    self.atomic_request.payload.compare_mask.eq(
                        Mux(d.opcode[7], d.compare_mask, Mux(d.opcode[2], 0, C(-1, 64)))),
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
                        m.d.sync += respond(ResponseKind.ATOMIC, d.psn, ACK_SYNDROME, f_msn1)
                        m.d.sync += [
                            resp.orig.eq(result.orig),
                            new_row.epsn.eq(f["psn1"]),
                            new_row.msn.eq(f_msn1),
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
        # Until CHECK, a reset shows in ``fresh``; from CHECK on, the row is already read.
        with m.If(self.qp_reset.valid & (self.qp_reset.qpn == d.destqp)
                  & ~fsm.ongoing("IDLE") & ~fsm.ongoing("LOOKUP")):
            m.d.sync += killed.eq(1)
        return m
