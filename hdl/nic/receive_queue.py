from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from hdl.arith import lookahead_sum
from hdl.nic.signatures import (
    QPN_BITS, RECV_ID, Access, ArLayout, ContextReadSignature, EventSignature, MkeyLayout,
    QpConfigLayout, RBeatLayout, RecvRequestLayout, RecvResultLayout, RecvStatus, Syndrome,
)

__all__ = ["ReceiveQueue"]

BEAT_BYTES = 64
WQE_BYTES = 16


def _be(value, start, n):
    """The big-endian number in bytes ``start .. start + n - 1`` of ``value`` (byte 0 in
    bits 7..0)."""
    return Cat(*(value[8 * (start + n - 1 - i):8 * (start + n - i)] for i in range(n)))


class ReceiveQueue(wiring.Component):
    """Hands out receive WQEs, one request at a time (docs/nic-responder.md).

    Per QP a memory row holds the consumer index ``ci`` and a cached producer index
    ``pi`` (both 16 bits, zero after ``qp_reset``). For a request on QP ``qpn``:

    * ``ci == pi``: the doorbell record is read (one beat, id ``RECV_ID``): the big-endian
      32-bit word at ``rq_dbr`` (its low two address bits ignored: the record is 4-byte
      aligned), whose low 16 bits are the new producer index. ``(pi - ci) mod 2^16`` of 0
      answers EMPTY; above ``2^log_rq_size`` (a record behind ``ci`` or further ahead than
      the ring holds) also answers EMPTY, is not cached (the next request reads the
      record again) and counts in ``recv_wqe_errors``. Otherwise it is cached.
    * The receive WQE ``ci mod 2^log_rq_size`` is read: the 16 bytes at
      ``rq_base + 16 * index`` (``rq_base``'s low four bits ignored), an
      ``mlx5_wqe_data_seg``. It is OK when its lkey names a valid memory-key entry with
      that key, the QP's PD and LOCAL_WRITE, and (unless ``byte_count`` is 0)
      ``[addr, addr + byte_count)`` lies inside ``[base, base + length)`` without
      wrapping 2^64; otherwise ERROR with LOCAL_PROT_ERR. Both consume the WQE
      (``ci += 1``); the result carries ``wqe_counter = ci`` (before the increment), and
      ``addr``/``length`` (``byte_count``) only when OK.
    * A read answered with RRESP other than OKAY gives ERROR with LOCAL_QP_OP_ERR: a
      failed WQE read consumes the WQE, a failed doorbell-record read consumes nothing.
    * A ``qpn`` the unit does not have answers ERROR with LOCAL_QP_OP_ERR and
      ``wqe_counter`` 0, reads nothing; ``qp_reset`` of such a QP is ignored.

    Results leave in request order, one per request; the next request is taken after
    the result. ``r.ready`` is always high: a beat arriving while none is awaited is
    dropped, ``r.last`` is not looked at. A ``qp_reset`` of the QP being served does not
    stop the request, but its indices stay zero (the reset wins over its write-back).
    The QP's context is read when the request is taken and kept for the request.

    Counters, each in the cycle after its event: ``recv_wqes_consumed`` (results that
    consumed a WQE), ``recv_wqe_errors`` (ERROR results, and doorbell records too far
    ahead), ``rq_doorbell_reads`` (doorbell-record reads issued).
    """

    def __init__(self, *, num_qps=64, num_mkeys=64, addr_width=64):
        for name, value, low, high in (("num_qps", num_qps, 1, 1 << QPN_BITS),
                                       ("num_mkeys", num_mkeys, 1, 1 << 24),
                                       ("addr_width", addr_width, 12, 64)):
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer {low} to {high}, not {value!r}")
        self.num_qps = num_qps
        self.num_mkeys = num_mkeys
        self.addr_width = addr_width
        super().__init__({
            "request": In(stream.Signature(RecvRequestLayout())),
            "result": Out(stream.Signature(RecvResultLayout())),
            "qp_config": Out(ContextReadSignature(num_qps, QpConfigLayout())),
            "mkey": Out(ContextReadSignature(num_mkeys, MkeyLayout())),
            "qp_reset": In(EventSignature()),
            "ar": Out(stream.Signature(ArLayout())),
            "r": In(stream.Signature(RBeatLayout(BEAT_BYTES))),
            "recv_wqes_consumed": Out(32),
            "recv_wqe_errors": Out(32),
            "rq_doorbell_reads": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        request, result, ar, r = self.request, self.result, self.ar, self.r

        # Read when a request is taken, written back after its result; transparent, so a
        # qp_reset in the cycle a request is taken is seen by it.
        m.submodules.indices = indices = Memory(shape=32, depth=self.num_qps, init=[])
        write = indices.write_port()
        read = indices.read_port(transparent_for=(write,))

        # Rows not written since power-up read as 0: memories keep their contents through
        # a reset, and a QP's indices must start at 0 whatever ran before.
        unwritten = Signal(self.num_qps, init=(1 << self.num_qps) - 1)
        self.rows_unwritten = unwritten     # for a testbench that presets rows
        row_unwritten = Signal()
        qpn = Signal(QPN_BITS)
        ci = Signal(16)
        pi = Signal(16)
        rq_base = Signal(64)
        log_rq_size = Signal(4)
        rq_dbr = Signal(64)
        pd = Signal(24)
        reset_hit = Signal()            # a qp_reset of this QP after the request was taken
        consume = Signal()
        wqe_addr = Signal(64)
        dbr_pi = Signal(16)
        byte_count = Signal(32)
        lkey = Signal(32)
        addr = Signal(64)

        size = Signal(17)
        m.d.comb += size.eq(Const(1, 17) << log_rq_size)

        # Facts registered a cycle after what they are taken from, so that no state's
        # decision waits for a sum. ci and log_rq_size change only in LOAD: the WQE's index
        # is ready for WQE_ADDR, and the end of the ring ahead of ci for DBR_CHECK. The WQE's
        # fields change only in WQE_R and mkey.data follows lkey: the WQE's end is ready in
        # CHECK, the key's facts and the wrap in RANGE.
        wqe_index = Signal(16)
        ring_end = Signal(17)           # ci + size, not modulo 2^16
        end = Signal(65)
        limit = Signal(65)
        key_ok = Signal()
        above_base = Signal()
        wraps = Signal()                # ending exactly at 2^64 is not a wrap
        empty_wqe = Signal()
        mk = self.mkey.data
        m.d.sync += [
            wqe_index.eq(ci & (size - 1)),
            ring_end.eq(lookahead_sum(m, ci, size[:16], name="ring_end_sum")),
            end.eq(lookahead_sum(m, addr, byte_count, name="end_sum")),
            limit.eq(lookahead_sum(m, mk.base, mk.length, name="limit_sum")),
            key_ok.eq(mk.valid & (mk.key == lkey) & (mk.pd == pd)
                      & ((mk.access.as_value() & Access.LOCAL_WRITE.value) != 0)),
            above_base.eq(addr >= mk.base),
            wraps.eq(end[64] & (end[:64] != 0)),
            empty_wqe.eq(byte_count == 0),
        ]

        # Counters count registered events, a cycle after them: a 32-bit increment is deep
        # enough on its own.
        consumed_event, error_event, dbr_read_event = Signal(), Signal(), Signal()
        m.d.sync += [
            consumed_event.eq(0), error_event.eq(0), dbr_read_event.eq(0),
            self.recv_wqes_consumed.eq(lookahead_sum(m, self.recv_wqes_consumed, consumed_event,
                                                     name="recv_wqes_consumed_next")),
            self.recv_wqe_errors.eq(lookahead_sum(m, self.recv_wqe_errors, error_event,
                                                  name="recv_wqe_errors_next")),
            self.rq_doorbell_reads.eq(lookahead_sum(m, self.rq_doorbell_reads, dbr_read_event,
                                                    name="rq_doorbell_reads_next")),
        ]

        reset_valid = Signal()
        m.d.comb += reset_valid.eq(self.qp_reset.valid & (self.qp_reset.qpn < self.num_qps))
        with m.If(reset_valid & (self.qp_reset.qpn == qpn)):
            m.d.sync += reset_hit.eq(1)

        wb_en = Signal()
        with m.If(write.en):
            m.d.sync += unwritten.eq(unwritten & ~(Const(1, self.num_qps) << write.addr)[:self.num_qps])
        reading_dbr = Signal()      # the AR is the doorbell record's (else the WQE's)
        m.d.comb += [
            write.en.eq(reset_valid | wb_en),
            write.addr.eq(Mux(reset_valid, self.qp_reset.qpn, qpn)),
            write.data.eq(Mux(reset_valid, 0, Cat((ci + consume)[:16], pi))),
            read.addr.eq(request.payload.qpn),
            self.qp_config.addr.eq(Mux(request.ready, request.payload.qpn, qpn)),
            self.mkey.addr.eq((lkey >> 8) % self.num_mkeys),
            r.ready.eq(1),
            ar.payload.id.eq(RECV_ID),
            ar.payload.len.eq(0),
            ar.payload.addr.eq(Cat(C(0, 6), Mux(reading_dbr, rq_dbr, wqe_addr)[6:self.addr_width])),
        ]

        def finish(status, syndrome=None, consumes=False):
            m.d.sync += [result.payload.status.eq(status), consume.eq(consumes)]
            if syndrome is not None:
                m.d.sync += result.payload.syndrome.eq(syndrome)
            m.next = "RESULT"

        cfg = self.qp_config.data
        wqe_addr_sum = lookahead_sum(m, rq_base[4:], wqe_index, name="wqe_addr_sum")
        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += request.ready.eq(1)
                with m.If(request.valid):
                    m.d.sync += [qpn.eq(request.payload.qpn), reset_hit.eq(0),
                                 row_unwritten.eq(unwritten.bit_select(request.payload.qpn, 1))]
                    m.next = "LOAD"
            with m.State("LOAD"):
                m.d.sync += [
                    ci.eq(Mux(row_unwritten, 0, read.data[:16])),
                    pi.eq(Mux(row_unwritten, 0, read.data[16:])),
                    rq_base.eq(cfg.rq_base), log_rq_size.eq(cfg.log_rq_size),
                    rq_dbr.eq(cfg.rq_dbr), pd.eq(cfg.pd),
                    result.payload.eq(0),
                ]
                m.next = "DECIDE"
            with m.State("DECIDE"):
                m.d.sync += result.payload.wqe_counter.eq(ci)
                with m.If(qpn >= self.num_qps):
                    m.d.sync += result.payload.wqe_counter.eq(0)
                    finish(RecvStatus.ERROR, Syndrome.LOCAL_QP_OP_ERR)
                with m.Elif(ci == pi):
                    m.next = "DBR_AR"
                with m.Else():
                    m.next = "WQE_ADDR"
            with m.State("DBR_AR"):
                m.d.comb += [ar.valid.eq(1), reading_dbr.eq(1)]
                with m.If(ar.ready):
                    m.d.sync += dbr_read_event.eq(1)
                    m.next = "DBR_R"
            with m.State("DBR_R"):
                with m.If(r.valid):
                    word = r.payload.data.word_select(rq_dbr[2:6], 32)
                    m.d.sync += dbr_pi.eq(_be(word, 2, 2))
                    with m.If(r.payload.resp != 0):
                        finish(RecvStatus.ERROR, Syndrome.LOCAL_QP_OP_ERR)
                    with m.Else():
                        m.next = "DBR_CHECK"
            with m.State("DBR_CHECK"):
                # (dbr_pi - ci) mod 2^16 is 1 .. size when dbr_pi lies in (ci, ring_end]
                # modulo 2^16: two compares instead of a difference and a compare.
                past_ci = dbr_pi > ci
                to_end = dbr_pi <= ring_end[:16]
                with m.If(dbr_pi == ci):
                    finish(RecvStatus.EMPTY)
                with m.Elif(Mux(ring_end[16], past_ci | to_end, past_ci & to_end)):
                    m.d.sync += pi.eq(dbr_pi)
                    m.next = "WQE_ADDR"
                with m.Else():
                    m.d.sync += error_event.eq(1)
                    finish(RecvStatus.EMPTY)
            with m.State("WQE_ADDR"):
                m.d.sync += wqe_addr.eq(Cat(C(0, 4), wqe_addr_sum[:60]))
                m.next = "WQE_AR"
            with m.State("WQE_AR"):
                m.d.comb += ar.valid.eq(1)
                with m.If(ar.ready):
                    m.next = "WQE_R"
            with m.State("WQE_R"):
                with m.If(r.valid):
                    segment = r.payload.data.word_select(wqe_addr[4:6], 8 * WQE_BYTES)
                    m.d.sync += [
                        byte_count.eq(_be(segment, 0, 4)),
                        lkey.eq(_be(segment, 4, 4)),
                        addr.eq(_be(segment, 8, 8)),
                    ]
                    with m.If(r.payload.resp != 0):
                        finish(RecvStatus.ERROR, Syndrome.LOCAL_QP_OP_ERR, consumes=True)
                    with m.Else():
                        m.next = "KEY"
            with m.State("KEY"):
                # mkey.addr follows lkey: its entry is on mkey.data in the next cycle.
                m.next = "CHECK"
            with m.State("CHECK"):
                # The entry's facts are registered at the end of this cycle.
                m.next = "RANGE"
            with m.State("RANGE"):
                in_range = above_base & (end <= limit) & ~wraps
                with m.If(key_ok & (empty_wqe | in_range)):
                    m.d.sync += [result.payload.addr.eq(addr),
                                 result.payload.length.eq(byte_count)]
                    finish(RecvStatus.OK, consumes=True)
                with m.Else():
                    finish(RecvStatus.ERROR, Syndrome.LOCAL_PROT_ERR, consumes=True)
            with m.State("RESULT"):
                m.d.comb += result.valid.eq(1)
                with m.If(result.ready):
                    m.d.sync += [consumed_event.eq(consume),
                                 error_event.eq(result.payload.status == RecvStatus.ERROR)]
                    m.next = "WRITE_BACK"
            with m.State("WRITE_BACK"):
                # The write port is the reset's in its cycles.
                with m.If(~reset_valid):
                    m.d.comb += wb_en.eq(~reset_hit & (qpn < self.num_qps))
                    m.next = "IDLE"
        return m
