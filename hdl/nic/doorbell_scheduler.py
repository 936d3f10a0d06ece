"""Per-QP doorbell, fetch and completion indices, doorbell checks and round-robin WQE fetch
scheduling, pipelined for 400 MHz: docs/nic.md, "Doorbells", gives every rule and cycle."""
from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import count_registered, lookahead_sum, named, or_all, sum3
from hdl.nic.signatures import (
    COUNTERS, EPOCH_BITS, MAX_WQE_BLOCKS, DoorbellLayout, EventSignature, FetchDoneLayout,
    FetchRequestLayout, QpState, RetireLayout, RewindLayout,
)
from hdl.prim.round_robin import next_mask, round_robin_pick
from hdl.prim.skid_register import SkidRegister

__all__ = ["DoorbellScheduler"]

INDEX_BITS = 16
WANT_BITS = range(MAX_WQE_BLOCKS + 1)


class DoorbellScheduler(wiring.Component):
    """Doorbells checked in two cycles (read, then check and apply); per-QP plans in two
    (facts of the indices, then the request); a round-robin pick registered a cycle before
    its grant. Skips (a retire past ``fetch_pi`` while replaying) decided in two cycles and
    applied in the third, with the ``skip`` strobe. ``qp_log_sq_size`` and
    ``qp_max_outstanding`` may change only while their QP is in RESET."""

    def __init__(self, num_qps=64):
        if not isinstance(num_qps, int) or not 1 <= num_qps <= 256:
            raise ValueError(f"Number of QPs must be an integer 1 to 256, not {num_qps!r}")
        self.num_qps = num_qps
        members = {
            "doorbell": In(stream.Signature(DoorbellLayout(), always_ready=True)),
            "qp_state": In(QpState).array(num_qps),
            "qp_log_sq_size": In(4).array(num_qps),
            "qp_max_outstanding": In(7).array(num_qps),
            "qp_reset": In(EventSignature()),
            "fetch": Out(stream.Signature(FetchRequestLayout())),
            "fetch_done": In(stream.Signature(FetchDoneLayout(), always_ready=True)),
            "retire": In(stream.Signature(RetireLayout(), always_ready=True)),
            "rewind": In(stream.Signature(RewindLayout(), always_ready=True)),
            "qp_epoch": Out(EPOCH_BITS).array(num_qps),
            "skip": Out(stream.Signature(RewindLayout(), always_ready=True)),
            "qp_busy": Out(num_qps),
        }
        for name, _ in COUNTERS["DoorbellScheduler"]:
            members[name] = Out(32)
        super().__init__(members)

    def elaborate(self, platform):
        m = Module()
        n = self.num_qps
        qp_bits = max(1, (n - 1).bit_length())

        def sign(value):
            return Value.cast(value)[INDEX_BITS - 1]

        def decode(valid, qpn, name):
            """One bit per QP: ``valid`` and ``qpn`` names that QP (none for a bad qpn)."""
            return named(m, Mux(valid & (qpn < n), 1 << qpn[:qp_bits], 0), name, n)

        def same_qp(valid, a, b):
            return valid & (a == b)

        db_pi = [Signal(INDEX_BITS, name=f"db_pi{q}") for q in range(n)]
        fetch_pi = [Signal(INDEX_BITS, name=f"fetch_pi{q}") for q in range(n)]
        done_ci = [Signal(INDEX_BITS, name=f"done_ci{q}") for q in range(n)]
        epoch = [Signal(EPOCH_BITS, name=f"epoch{q}") for q in range(n)]
        replay_end = [Signal(INDEX_BITS, name=f"replay_end{q}") for q in range(n)]
        in_flight = Signal(n)
        waiting = Signal(n)
        granted = Signal(n)                 # a fetch went out with the current epoch
        replaying = Signal(n)               # rewound, fetching again what it fetched before
        touched = Signal(n)                 # fetch_pi, a flag or a grant changed last cycle
        m.d.comb += [self.qp_epoch[q].eq(epoch[q]) for q in range(n)]

        reset, rewind, done, retire = self.qp_reset, self.rewind, self.fetch_done, self.retire
        reset_hit = decode(reset.valid, reset.qpn, "reset_hit")
        rewind_hit = decode(rewind.valid, rewind.p.qpn, "rewind_hit")
        done_hit = decode(done.valid, done.p.qpn, "done_hit")
        retire_hit = decode(retire.valid, retire.p.qpn, "retire_hit")
        # A fetch_done of an older epoch answers a fetch from before a rewind; one beside a
        # rewind is overruled by it.
        fresh = named(m, Cat(done_hit[q] & (done.p.epoch == epoch[q]) & ~rewind_hit[q]
                         for q in range(n)), "fresh")

        # --- doorbells: D0 reads the QP's indices, D1 checks and applies -------------------
        db = self.doorbell.p
        d0_qp = db.qpn[:qp_bits]
        d0_good = db.qpn < n
        d1_valid, d1_good, d1_not_ready = Signal(), Signal(), Signal()
        d1_qp = Signal(qp_bits)
        d1_pi, d1_db = Signal(INDEX_BITS), Signal(INDEX_BITS)
        d1_writes = Signal(n)               # its QP, if in RTS or ERR and not reset in D0
        d1_killed = Signal()                # a qp_reset of the QP in its D0 cycle
        d1_follows = Signal()               # same QP as the doorbell ahead of it
        d1_dup_ahead, d1_back_ahead = Signal(), Signal()
        d1_far_s, d1_far_c = Signal(INDEX_BITS), Signal(INDEX_BITS)
        applied = Signal()                  # the doorbell in D1 sets db_pi this cycle
        applied_last, pi_last = Signal(), Signal(INDEX_BITS)
        log_size = Array(self.qp_log_sq_size)[d0_qp]
        # (pi - done_ci - 1 - 2^log_sq_size) as a carry-save pair (the sum is taken in D1):
        # not negative exactly when the doorbell is too far (docs/nic.md).
        not_done = ~Array(done_ci)[d0_qp]
        not_ring = ~Cat(log_size == i for i in range(INDEX_BITS))
        d0_not_ready = Array(self.qp_state)[d0_qp] == QpState.RESET
        d0_killed = same_qp(reset.valid, reset.qpn, db.qpn)
        m.d.sync += [
            d1_valid.eq(self.doorbell.valid),
            d1_good.eq(d0_good),
            d1_not_ready.eq(d0_not_ready),
            d1_qp.eq(d0_qp),
            d1_pi.eq(db.pi),
            d1_db.eq(Array(db_pi)[d0_qp]),
            d1_writes.eq(Mux(d0_not_ready | d0_killed, 0,
                             decode(self.doorbell.valid, db.qpn, "d0_hit"))),
            d1_killed.eq(d0_killed),
            d1_follows.eq(d1_valid & d1_good & d0_good & (d1_qp == d0_qp)),
            d1_dup_ahead.eq(db.pi == d1_pi),
            d1_back_ahead.eq(sign(lookahead_sum(m, db.pi, ~d1_pi, 1, name="back_ahead"))),
            d1_far_s.eq(db.pi ^ not_done ^ not_ring),
            d1_far_c.eq(Cat(C(1, 1), ((db.pi & not_done) | (db.pi & not_ring) |
                                      (not_done & not_ring))[:INDEX_BITS - 1])),
            applied_last.eq(applied),
            pi_last.eq(d1_pi),
        ]
        # The doorbell ahead of this one set db_pi after this one read it.
        forward = named(m, d1_follows & applied_last, "forward")
        duplicate = named(m, Mux(forward, d1_dup_ahead, d1_pi == d1_db), "duplicate")
        backwards = named(m, Mux(forward, d1_back_ahead,
                             sign(lookahead_sum(m, d1_pi, ~d1_db, 1, name="backwards_sum"))),
                         "backwards")
        too_far = named(m, ~sign(lookahead_sum(m, d1_far_s, d1_far_c, name="too_far_sum")),
                       "too_far")
        checked = d1_valid & d1_good & ~d1_not_ready
        accept = named(m, checked & ~duplicate & ~backwards & ~too_far, "accept")
        m.d.comb += applied.eq(accept & ~d1_killed & ~same_qp(reset.valid, reset.qpn, d1_qp))
        db_write = named(m, Mux(~duplicate & ~backwards & ~too_far, d1_writes, 0), "db_write")
        count_registered(m, self.doorbells_bad_qpn, d1_valid & ~d1_good)
        count_registered(m, self.doorbells_not_ready, d1_valid & d1_good & d1_not_ready)
        count_registered(m, self.doorbells_duplicate, checked & duplicate)
        count_registered(m, self.doorbells_backwards, checked & ~duplicate & backwards)
        count_registered(m, self.doorbells_too_far,
                         checked & ~duplicate & ~backwards & too_far)
        count_registered(m, self.doorbells_accepted, accept)

        # --- skips: S0 reads the retiring QP, S1 decides, S2 applies with the strobe --------
        # A skip of the QP ahead in S2 (applying now, seen by S0) or decided in S2 (seen by
        # S1) sets fetch_pi to the done_ci this retire starts from: the retire then passes
        # fetch_pi if it retires anything.
        r_qp = retire.p.qpn[:qp_bits]
        s1_valid, s1_fresh, s1_forwarded, s1_after, s1_some = (Signal() for _ in range(5))
        s1_qp = Signal(qp_bits)
        s1_fetch, s1_done = Signal(INDEX_BITS), Signal(INDEX_BITS)
        s1_blocks = Signal(WANT_BITS)
        s1_psn = Signal.like(retire.p.next_psn)
        # -blocks, and consumed - blocks for a fresh fetch_done of the QP in the same cycle
        s1_less, s1_less_done = Signal(6), Signal(6)
        s2_base, s2_lag, s2_after = Signal(), Signal(), Signal()
        s2_qp = Signal(qp_bits)
        s2_hit = Signal(n)
        s2_index = Signal(INDEX_BITS)
        s2_psn = Signal.like(retire.p.next_psn)
        decided = named(m, s2_base & (s2_lag | s2_after), "decided")
        skipping = named(m, decided & ~same_qp(rewind.valid, rewind.p.qpn, s2_qp) &
                        ~same_qp(reset.valid, reset.qpn, s2_qp), "skipping")
        forwarded = named(m, skipping & (s2_qp == r_qp), "forwarded")
        m.d.sync += [
            s1_valid.eq(retire.valid & (retire.p.qpn < n) & replaying.bit_select(r_qp, 1) &
                        ~same_qp(rewind.valid, rewind.p.qpn, retire.p.qpn) &
                        ~same_qp(reset.valid, reset.qpn, retire.p.qpn)),
            s1_fresh.eq(same_qp(done.valid, done.p.qpn, retire.p.qpn) &
                        (done.p.epoch == Array(epoch)[r_qp])),
            s1_forwarded.eq(forwarded),
            s1_after.eq(s1_valid & (s1_qp == r_qp)),
            s1_some.eq(retire.p.blocks != 0),
            s1_qp.eq(r_qp),
            s1_fetch.eq(Mux(forwarded, s2_index, Array(fetch_pi)[r_qp])),
            s1_done.eq(Array(done_ci)[r_qp]),
            s1_blocks.eq(retire.p.blocks),
            s1_psn.eq(retire.p.next_psn),
            s1_less.eq(-retire.p.blocks),
            s1_less_done.eq(done.p.consumed - retire.p.blocks),
        ]
        # fetch_pi - (done_ci + blocks) < 0, with or without the same cycle's fetch_done
        # (a skip applying in that cycle overrules it).
        not_done_r = ~s1_done

        def lags(less, name):
            return sign(sum3(m, s1_fetch, not_done_r, Cat(less, less[-1].replicate(10)),
                             INDEX_BITS, plus_one=True, name=name))
        lag = named(m, Mux(s1_fresh & ~s1_forwarded, lags(s1_less_done, "lag_done"),
                       lags(s1_less, "lag")), "lag")
        m.d.sync += [
            s2_base.eq(s1_valid & ~same_qp(rewind.valid, rewind.p.qpn, s1_qp) &
                       ~same_qp(reset.valid, reset.qpn, s1_qp)),
            s2_lag.eq(lag),
            s2_after.eq(s1_after & decided & s1_some),
            s2_qp.eq(s1_qp),
            s2_hit.eq(Mux(s1_valid, 1 << s1_qp, 0)),
            s2_index.eq(lookahead_sum(m, s1_done, s1_blocks, name="skip_index")[:INDEX_BITS]),
            s2_psn.eq(s1_psn),
        ]
        # A rewind or reset of the QP in this cycle wins over the skip where both act.
        skip_hit = named(m, Mux(decided, s2_hit, 0), "skip_hit")
        m.d.sync += [
            self.skip.valid.eq(skipping),
            self.skip.p.qpn.eq(s2_qp),
            self.skip.p.wqe_index.eq(s2_index),
            self.skip.p.psn.eq(s2_psn),
        ]

        # --- plans: P1 registers facts of each QP's indices, P2 the request ----------------
        plan_layout = data.StructLayout({
            "eligible": 1, "blocks": WANT_BITS, "first_only": 1})
        plans = [Signal(plan_layout, name=f"plan{q}") for q in range(n)]
        for q in range(n):
            max_out = self.qp_max_outstanding[q]
            not_fetch = ~fetch_pi[q]
            not_done = ~done_ci[q]
            f_pending = Signal(name=f"f_pending{q}")    # db_pi != fetch_pi
            f_big = Signal(name=f"f_big{q}")            # pending > 16
            f_pend = Signal(5, name=f"f_pend{q}")       # pending mod 32
            f_empty = Signal(name=f"f_empty{q}")        # fetch_pi == done_ci
            f_lag = Signal(name=f"f_lag{q}")            # done_ci past fetch_pi
            f_small = Signal(name=f"f_small{q}")        # outstanding < 128 (if not lagging)
            f_room = Signal(8, name=f"f_room{q}")       # max_out - outstanding, mod 256
            f_all_fit = Signal(name=f"f_all_fit{q}")    # db_pi - done_ci <= max_out
            m.d.sync += [
                f_pending.eq(db_pi[q] != fetch_pi[q]),
                f_big.eq(~sign(sum3(m, db_pi[q], not_fetch, -MAX_WQE_BLOCKS, INDEX_BITS,
                                    name=f"big{q}"))),
                f_pend.eq(lookahead_sum(m, db_pi[q][:5], not_fetch[:5], 1, name=f"pend{q}")),
                f_empty.eq(fetch_pi[q] == done_ci[q]),
                f_lag.eq(sign(lookahead_sum(m, fetch_pi[q], not_done, 1, name=f"lag{q}"))),
                f_small.eq(sign(sum3(m, fetch_pi[q], not_done, -128, INDEX_BITS,
                                     plus_one=True, name=f"small{q}"))),
                f_room.eq(sum3(m, max_out, done_ci[q][:8], not_fetch[:8], 8, plus_one=True,
                               name=f"room{q}")),
                f_all_fit.eq(sign(sum3(m, db_pi[q], not_done, ~Cat(max_out, C(0, 9)),
                                       INDEX_BITS, plus_one=True, name=f"all_fit{q}"))),
            ]
            small = f_small & ~f_lag
            room_sign = f_room[7]
            # room >= min(pending, 16): room >= 16, or all pending blocks fit the window.
            fits = named(m, small & (f_all_fit | (~room_sign & (f_room[4:7] != 0))), f"fits{q}")
            some_room = small & ~room_sign & (f_room[:7] != 0)
            want = Mux(f_big, MAX_WQE_BLOCKS, f_pend)
            state = self.qp_state[q]
            active = (state == QpState.RTS) | (state == QpState.ERR)
            m.d.sync += [
                plans[q].eligible.eq(f_pending & active & ~in_flight[q] & ~waiting[q] &
                                     ~touched[q] & (fits | f_empty | some_room)),
                plans[q].blocks.eq(Mux(fits | f_empty, want, f_room[:5])),
                plans[q].first_only.eq(~fits & f_empty),
            ]

        # --- pick (registered), then grant ----------------------------------------------
        pick = Signal(n)
        rr_mask = Signal(n, init=(1 << n) - 1)      # round robin: from after the last grant
        # The request goes out through a two-entry skid register: a grant needs only its
        # second entry free (a flip-flop), not the fetcher's ``ready`` of the same cycle.
        m.submodules.output = output = SkidRegister(FetchRequestLayout())
        wiring.connect(m, output.o, wiring.flipped(self.fetch))
        load = output.i.ready
        requests = named(m, Cat(p.eligible for p in plans) & ~touched & ~Mux(load, pick, 0),
                        "requests")
        picked = Signal()                   # pick != 0
        m.d.sync += [pick.eq(round_robin_pick(m, requests, rr_mask, name="pick")),
                     picked.eq(requests.any())]
        grant = named(m, Mux(load, pick & ~touched & ~reset_hit, 0), "grant")
        pick_qpn = named(m, Cat(Cat(pick[q] for q in range(n) if q >> b & 1).any()
                            for b in range(qp_bits)), "pick_qpn")
        granting = named(m, load & picked & ~(pick & touched).any() &
                        ~same_qp(reset.valid, reset.qpn, pick_qpn), "granting")
        with m.If(granting):
            m.d.sync += rr_mask.eq(next_mask(pick))
        # AND-OR over the one-hot pick: a balanced OR tree.
        chosen = named(m, or_all(Mux(pick[q], plans[q].as_value(), 0) for q in range(n)),
                      "chosen", len(plans[0].as_value()))
        chosen = plan_layout(chosen)
        m.d.comb += [
            output.i.valid.eq(granting),
            output.i.p.qpn.eq(pick_qpn),
            output.i.p.wqe_index.eq(or_all(Mux(pick[q], fetch_pi[q], 0) for q in range(n))),
            output.i.p.blocks.eq(chosen.blocks),
            output.i.p.first_only.eq(chosen.first_only),
            output.i.p.epoch.eq(or_all(Mux(pick[q], epoch[q], 0) for q in range(n))),
        ]
        count_registered(m, self.wqe_fetches, self.fetch.valid & self.fetch.ready)

        # --- per-QP state -------------------------------------------------------------------
        for q in range(n):
            fetched = lookahead_sum(m, fetch_pi[q], done.p.consumed, name=f"fetched{q}")
            completed = lookahead_sum(m, done_ci[q], retire.p.blocks, name=f"completed{q}")
            caught_up = lookahead_sum(m, fetch_pi[q], ~replay_end[q], 1, name=f"caught_up{q}")
            with m.If(reset_hit[q]):
                m.d.sync += [db_pi[q].eq(0), fetch_pi[q].eq(0), done_ci[q].eq(0), epoch[q].eq(0),
                             replaying[q].eq(0)]
            with m.Else():
                # A skip may move fetch_pi back (a fetch_done after the retire moved it on):
                # from there the QP replays as after a rewind.
                with m.If(rewind_hit[q] | skip_hit[q]):
                    m.d.sync += [replaying[q].eq(1), replay_end[q].eq(db_pi[q])]
                with m.Elif(~sign(caught_up)):
                    m.d.sync += replaying[q].eq(0)
                with m.If(db_write[q]):
                    m.d.sync += db_pi[q].eq(d1_pi)
                # A new epoch only when the current one was handed out (a fetch granted
                # since the last change, this cycle's included).
                with m.If((rewind_hit[q] | skip_hit[q]) & (granted[q] | grant[q])):
                    m.d.sync += epoch[q].eq(epoch[q] + 1)
                with m.If(rewind_hit[q]):
                    m.d.sync += fetch_pi[q].eq(rewind.p.wqe_index)
                with m.Elif(skip_hit[q]):
                    m.d.sync += fetch_pi[q].eq(s2_index)
                with m.Elif(fresh[q]):
                    m.d.sync += fetch_pi[q].eq(fetched[:INDEX_BITS])
                with m.If(retire_hit[q]):
                    m.d.sync += done_ci[q].eq(completed[:INDEX_BITS])

        # consumed == 0 means "wait for more" only if no doorbell or retire came that the
        # request was not planned with: its facts are from two cycles before its grant,
        # and a doorbell counts here from the cycle after it set db_pi.
        db_event = Signal(n)
        event = named(m, db_event | retire_hit, "event")
        recent = Signal(n)                  # an event last cycle
        recent2 = Signal(n)                 # and the cycle before
        unseen = Signal(n)
        m.d.sync += [
            db_event.eq(db_write),
            recent.eq(event),
            recent2.eq(recent),
            unseen.eq(((unseen & ~grant) | (grant & (recent | recent2)) |
                       (event & (in_flight | grant))) & ~reset_hit),
        ]
        consumed_none = named(m, Mux(done.p.consumed == 0, fresh & ~unseen, 0), "consumed_none")
        m.d.sync += [
            in_flight.eq((in_flight & ~done_hit | grant) & ~reset_hit),
            waiting.eq((waiting | consumed_none) & ~event & ~reset_hit & ~rewind_hit),
            touched.eq(reset_hit | grant | rewind_hit | skip_hit | done_hit),
            granted.eq((granted | grant) & ~(rewind_hit | skip_hit | reset_hit)),
        ]

        # Rung but unfetched WQEs do not count (a move to RESET drops them). A register, so
        # that the register file's idle test starts from one: this cycle's busy or grant,
        # everything that can make a QP busy in the next cycle (docs/nic.md, Doorbells).
        m.d.sync += self.qp_busy.eq(
            Cat(fetch_pi[q] != done_ci[q] for q in range(n)) | in_flight | grant)
        return m
