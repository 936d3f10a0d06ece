from amaranth import *
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import or_all
from hdl.nic.signatures import (
    COUNTERS, EPOCH_BITS, MAX_WQE_BLOCKS, DoorbellLayout, EventSignature, FetchDoneLayout,
    FetchRequestLayout, QpState, RetireLayout, RewindLayout,
)

__all__ = ["DoorbellScheduler"]

INDEX_BITS = 16
HALF_RING = 1 << (INDEX_BITS - 1)


class DoorbellScheduler(wiring.Component):
    """Per-QP producer/fetch/completion indices, doorbell checks and round-robin WQE fetch
    scheduling (docs/nic.md, "Doorbells").

    Per QP: ``db_pi`` (newest accepted doorbell), ``fetch_pi`` (next basic block to fetch),
    ``done_ci`` (next basic block to complete), ``in_flight`` (a fetch request granted and
    not yet answered by ``fetch_done``; offered and not yet accepted counts) and
    ``waiting`` (its last fetch consumed nothing although no doorbell or retire came
    after the state its request was planned on; cleared by an accepted doorbell or a
    retire). Indices compare modulo 2^16. ``epoch`` (``qp_epoch``) counts the QP's rewinds
    modulo 2^EPOCH_BITS; every fetch request carries it. A rewind or skip moves it on only
    if a fetch was granted with the current epoch (in that cycle too); otherwise nothing
    carries the current epoch and keeping it is safe. So a run of skips or rewinds with
    no fetch between them (late acknowledgements retiring rewound WQEs one by one) cannot
    wrap the epoch back onto a fetch still in flight. Below, "``epoch += 1``" means that.

    ``rewind`` (go-back-N, from the completion unit): ``fetch_pi := wqe_index``, ``epoch +=
    1``, ``waiting`` clears; a fetch in flight stays in flight (its ``fetch_done`` still
    comes, with the old epoch, and then only clears ``in_flight``: a ``fetch_done`` whose
    epoch is not the QP's current one never moves ``fetch_pi`` nor sets ``waiting``). Same
    cycle, same QP: the rewind's ``fetch_pi`` wins over a ``fetch_done`` (which still ends
    the fetch in flight; its epoch is compared with the epoch before the rewind), a
    doorbell and a retire apply as usual, ``qp_reset`` wins over the rewind, and the QP
    is masked from that cycle's arbitration (a grant would fetch from the old index with
    the old epoch) and sits out the next one (its plan is from before the rewind, and a
    rewind may move ``fetch_pi`` forward, past blocks completed meanwhile). A request granted before and still offered on ``fetch`` keeps its
    old epoch: it is stale and its descriptors are squashed by the executor.

    Skip: after a rewind the completion unit may still retire the rewound WQEs (late
    acknowledgements of their first transmission) before they are fetched again. While
    the QP is *replaying* (from a rewind until ``fetch_pi`` reaches the ``db_pi`` the
    rewind found: everything before it may have been fetched before the rewind), a
    retire that moves ``done_ci`` past ``fetch_pi`` (with a ``fetch_done`` of the same
    cycle counted) makes the QP go on from ``done_ci``
    (the retired WQEs' ring slots may already hold new WQEs): ``fetch_pi := done_ci``,
    ``epoch += 1``, as a rewind there, and in the next cycle a ``skip`` strobe ``(qpn,
    done_ci, retire.next_psn)`` tells the executor where the QP's PSNs stand (together
    with the new epoch on ``qp_epoch``). A rewind of the QP in the same cycle wins (it
    goes back to a WQE not yet retired, at or past the new ``done_ci``); a grant of the
    QP in that cycle goes out with the old epoch (stale). So a rewound QP never fetches a
    WQE that already retired. Outside replays a retire may pass ``fetch_pi`` too (a WQE of
    a fetch completes before the fetch's ``fetch_done``), which is harmless and no skip.

    Doorbells are checked in the documented order against the QP's indices at the start
    of the cycle (a retire of the same cycle does not yet count for ``doorbells_too_far``).
    ``fetch_done`` and ``retire`` come from the NIC's own blocks and are applied as given;
    ones for a QP number the scheduler does not have are ignored. ``qp_reset`` zeroes the
    QP's indices and flags and wins over every other event of its cycle for that QP,
    including a grant (the QP is masked from arbitration in that cycle). A request already
    offered on ``fetch`` stays offered (a stream may not withdraw it): the register block
    resets only idle QPs, and an offered request makes its QP busy. ``qp_busy``: a fetch in
    flight, or fetched WQE blocks not yet retired (rung, unfetched WQEs do not count).

    Timing (400 MHz, 64 QPs): each QP's eligibility and request size ("plan") is
    recomputed every cycle from its registered indices and registered again; the
    arbiter works on those registered plans, so the 16-bit subtractions (64 x 2) and the
    64-wide round-robin pick sit in different cycles. A plan is one cycle old, and that
    is always safe: within one cycle a QP's pending count and window room only grow
    (doorbells, retires), and what shrinks them (``fetch_done``, waiting) happens only
    while the QP is in flight, when its plan is not eligible. So a request follows the
    documented rules on the QP's state of the cycle before its grant; it may be smaller
    than the newest state would allow, never larger. Only a grant, a reset or a rewind
    (or skip) makes a plan wrong, and the QP then sits out the next arbitration. Tracking an
    eligible bit incrementally instead would need the same subtractions at every event
    port plus forwarding between same-cycle events, for no saving. A doorbell in cycle t
    can be granted in t + 2, offered on ``fetch`` from t + 3; a rewind in cycle t shows
    on ``qp_epoch`` from t + 1, and the QP's refetch (once no fetch of it is in flight)
    can be granted in t + 2, offered from t + 3. QP context fields
    (``qp_log_sq_size``, ``qp_max_outstanding``) are assumed to change only while their
    QP is in RESET.
    """

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

        db_pi = [Signal(INDEX_BITS, name=f"db_pi{q}") for q in range(n)]
        fetch_pi = [Signal(INDEX_BITS, name=f"fetch_pi{q}") for q in range(n)]
        done_ci = [Signal(INDEX_BITS, name=f"done_ci{q}") for q in range(n)]
        epoch = [Signal(EPOCH_BITS, name=f"epoch{q}") for q in range(n)]
        in_flight = Signal(n)
        waiting = Signal(n)
        granted = Signal(n)                 # a fetch went out with the current epoch
        replaying = Signal(n)               # rewound, fetching again what it fetched before
        replay_end = [Signal(INDEX_BITS, name=f"replay_end{q}") for q in range(n)]
        m.d.comb += [self.qp_epoch[q].eq(epoch[q]) for q in range(n)]

        def decode(valid, qpn):
            """One bit per QP: ``valid`` and ``qpn`` names that QP (none for a bad qpn)."""
            vector = Signal(n)
            m.d.comb += vector.eq(Mux(valid & (qpn < n), 1 << qpn[:qp_bits], 0))
            return vector

        def counter(name, enable):
            m.d.sync += getattr(self, name).eq(getattr(self, name) + enable)

        # --- doorbell checks ----------------------------------------------------------------
        db = self.doorbell.p
        db_qp = db.qpn[:qp_bits]
        db_good_qpn = db.qpn < n
        db_state = Array(self.qp_state)[db_qp]
        ahead = Signal(INDEX_BITS)          # pi - db_pi
        span = Signal(INDEX_BITS)           # pi - done_ci
        m.d.comb += [
            ahead.eq(db.pi - Array(db_pi)[db_qp]),
            span.eq(db.pi - Array(done_ci)[db_qp]),
        ]
        bad_qpn = ~db_good_qpn
        not_ready = db_good_qpn & (db_state == QpState.RESET)
        checked = db_good_qpn & (db_state != QpState.RESET)
        duplicate = checked & (ahead == 0)
        backwards = checked & (ahead >= HALF_RING)
        too_far = checked & (ahead != 0) & (ahead < HALF_RING) & \
            (span > (1 << Array(self.qp_log_sq_size)[db_qp]))
        accept = Signal()
        m.d.comb += accept.eq(checked & (ahead != 0) & (ahead < HALF_RING) &
                              (span <= (1 << Array(self.qp_log_sq_size)[db_qp])))
        fire = self.doorbell.valid
        counter("doorbells_bad_qpn", fire & bad_qpn)
        counter("doorbells_not_ready", fire & not_ready)
        counter("doorbells_duplicate", fire & duplicate)
        counter("doorbells_backwards", fire & backwards)
        counter("doorbells_too_far", fire & too_far)
        counter("doorbells_accepted", fire & accept)

        db_hit = decode(fire & accept, db.qpn)
        done_hit = decode(self.fetch_done.valid, self.fetch_done.p.qpn)
        retire_hit = decode(self.retire.valid, self.retire.p.qpn)
        reset_hit = decode(self.qp_reset.valid, self.qp_reset.qpn)
        rewind_hit = decode(self.rewind.valid, self.rewind.p.qpn)
        # A fetch_done of an older epoch answers a fetch from before a rewind: its blocks
        # are not the QP's current stream.
        done_fresh = Signal()
        m.d.comb += done_fresh.eq(
            self.fetch_done.p.epoch == Array(epoch)[self.fetch_done.p.qpn[:qp_bits]])
        fresh_hit = Signal(n)
        m.d.comb += fresh_hit.eq(Mux(done_fresh, done_hit, 0) & ~rewind_hit)

        # One shared adder per event port: the event's QP is selected, not 64 adders built.
        new_fetch_pi = Signal(INDEX_BITS)
        new_done_ci = Signal(INDEX_BITS)
        m.d.comb += [
            new_fetch_pi.eq(Array(fetch_pi)[self.fetch_done.p.qpn[:qp_bits]] +
                            self.fetch_done.p.consumed),
            new_done_ci.eq(Array(done_ci)[self.retire.p.qpn[:qp_bits]] + self.retire.p.blocks),
        ]

        # Skip: the retire moves done_ci past fetch_pi (see the class description).
        retire_qp = self.retire.p.qpn[:qp_bits]
        fetched = Signal(INDEX_BITS)        # the QP's fetch_pi after this cycle's fetch_done
        m.d.comb += fetched.eq(Mux(done_fresh & self.fetch_done.valid &
                                   (self.fetch_done.p.qpn == self.retire.p.qpn),
                                   new_fetch_pi, Array(fetch_pi)[retire_qp]))
        lag = Signal(INDEX_BITS)            # fetch_pi - new done_ci
        m.d.comb += lag.eq(fetched - new_done_ci)
        # Only while a rewound QP fetches again what it had fetched before: in any fetch a
        # WQE may complete and retire before the fetch's own fetch_done moves fetch_pi.
        skip = Signal()
        m.d.comb += skip.eq(self.retire.valid & (self.retire.p.qpn < n) & lag[-1] &
                            replaying.bit_select(retire_qp, 1) &
                            ~(self.rewind.valid & (self.rewind.p.qpn == self.retire.p.qpn)))
        skip_hit = decode(skip, self.retire.p.qpn)
        m.d.sync += [
            self.skip.valid.eq(skip & ~(self.qp_reset.valid &
                                        (self.qp_reset.qpn == self.retire.p.qpn))),
            self.skip.p.qpn.eq(self.retire.p.qpn),
            self.skip.p.wqe_index.eq(new_done_ci),
            self.skip.p.psn.eq(self.retire.p.next_psn),
        ]

        # --- per-QP plans, registered -------------------------------------------------------
        plan_layout = data.StructLayout({
            "eligible": 1, "blocks": range(MAX_WQE_BLOCKS + 1), "first_only": 1})
        plans = [Signal(plan_layout, name=f"plan{q}") for q in range(n)]
        for q in range(n):
            pending = Signal(INDEX_BITS, name=f"pending{q}")
            outstanding = Signal(INDEX_BITS, name=f"outstanding{q}")
            want = Signal(range(MAX_WQE_BLOCKS + 1), name=f"want{q}")
            max_out = self.qp_max_outstanding[q]
            # max_out - outstanding, negative when a first_only fetch overran the window.
            room = Signal(signed(INDEX_BITS + 2), name=f"room{q}")
            m.d.comb += [
                pending.eq(db_pi[q] - fetch_pi[q]),
                outstanding.eq(fetch_pi[q] - done_ci[q]),
                want.eq(Mux(pending > MAX_WQE_BLOCKS, MAX_WQE_BLOCKS, pending)),
                room.eq(max_out - outstanding),
            ]
            idle_qp = (pending != 0) & ~in_flight[q] & ~waiting[q]
            with m.If(~idle_qp):
                m.d.sync += plans[q].eligible.eq(0)
            with m.Elif(room >= want):
                m.d.sync += plans[q].eq(plan_layout.const({"eligible": 1}))
                m.d.sync += plans[q].blocks.eq(want)
            with m.Elif(outstanding == 0):
                m.d.sync += plans[q].eq(plan_layout.const({"eligible": 1, "first_only": 1}))
                m.d.sync += plans[q].blocks.eq(want)
            with m.Elif(room > 0):
                m.d.sync += plans[q].eq(plan_layout.const({"eligible": 1}))
                m.d.sync += plans[q].blocks.eq(room)
            with m.Else():
                m.d.sync += plans[q].eligible.eq(0)

        # --- round-robin grant --------------------------------------------------------------
        touched = Signal(n)                 # QPs granted or reset last cycle
        active = Signal(n)
        m.d.comb += active.eq(Cat((s == QpState.RTS) | (s == QpState.ERR) for s in self.qp_state))
        usable = Signal(n)
        m.d.comb += usable.eq(Cat(p.eligible for p in plans) & ~touched & active &
                              ~(reset_hit | rewind_hit))

        above = Signal(n)                   # QPs after the last granted one
        first_above = Signal(n)
        first_any = Signal(n)
        m.d.comb += [
            first_above.eq((usable & above) & -(usable & above)),
            first_any.eq(usable & -usable),
        ]
        grant = Signal(n)
        load = Signal()
        m.d.comb += [
            load.eq(~self.fetch.valid | self.fetch.ready),
            grant.eq(Mux(load, Mux(first_above != 0, first_above, first_any), 0)),
        ]
        with m.If(grant != 0):
            m.d.sync += above.eq(~(grant | (grant - 1)))

        grant_qpn = Signal(qp_bits)
        m.d.comb += grant_qpn.eq(
            Cat(Cat(grant[q] for q in range(n) if q >> b & 1).any() for b in range(qp_bits)))
        # AND-OR over the one-hot grant: a balanced OR tree, not a 64-deep priority chain.
        chosen = Signal(plan_layout)
        chosen_index = Signal(INDEX_BITS)
        chosen_epoch = Signal(EPOCH_BITS)
        m.d.comb += [
            chosen.eq(or_all(Mux(grant[q], plans[q].as_value(), 0) for q in range(n))),
            chosen_index.eq(or_all(Mux(grant[q], fetch_pi[q], 0) for q in range(n))),
            chosen_epoch.eq(or_all(Mux(grant[q], epoch[q], 0) for q in range(n))),
        ]

        with m.If(grant != 0):
            m.d.sync += [
                self.fetch.valid.eq(1),
                self.fetch.p.qpn.eq(grant_qpn),
                self.fetch.p.wqe_index.eq(chosen_index),
                self.fetch.p.blocks.eq(chosen.blocks),
                self.fetch.p.first_only.eq(chosen.first_only),
                self.fetch.p.epoch.eq(chosen_epoch),
            ]
        with m.Elif(self.fetch.ready):
            m.d.sync += self.fetch.valid.eq(0)
        counter("wqe_fetches", self.fetch.valid & self.fetch.ready)

        # --- per-QP state updates -----------------------------------------------------------
        for q in range(n):
            # Replaying: from a rewind until fetch_pi reaches the doorbell index the rewind
            # found (everything before it may have been fetched before the rewind).
            caught_up = Signal(INDEX_BITS, name=f"caught_up{q}")
            m.d.comb += caught_up.eq(fetch_pi[q] - replay_end[q])
            with m.If(reset_hit[q]):
                m.d.sync += [db_pi[q].eq(0), fetch_pi[q].eq(0), done_ci[q].eq(0), epoch[q].eq(0),
                             replaying[q].eq(0)]
            with m.Else():
                with m.If(rewind_hit[q]):
                    m.d.sync += [replaying[q].eq(1), replay_end[q].eq(db_pi[q])]
                with m.Elif(~caught_up[-1]):
                    m.d.sync += replaying[q].eq(0)
                with m.If(db_hit[q]):
                    m.d.sync += db_pi[q].eq(db.pi)
                # A new epoch only when the current one was handed out (a fetch granted
                # since the last change, this cycle's included): otherwise nothing carries
                # it yet. So a run of skips (late acknowledgements retiring the rewound
                # WQEs one by one) cannot wrap the epoch back to that of a fetch in flight.
                bump = granted[q] | grant[q]
                with m.If(rewind_hit[q]):
                    m.d.sync += fetch_pi[q].eq(self.rewind.p.wqe_index)
                    with m.If(bump):
                        m.d.sync += epoch[q].eq(epoch[q] + 1)
                with m.Elif(skip_hit[q]):
                    m.d.sync += fetch_pi[q].eq(new_done_ci)
                    with m.If(bump):
                        m.d.sync += epoch[q].eq(epoch[q] + 1)
                with m.Elif(fresh_hit[q]):
                    m.d.sync += fetch_pi[q].eq(new_fetch_pi)
                with m.If(retire_hit[q]):
                    m.d.sync += done_ci[q].eq(new_done_ci)

        # A consumed == 0 answer means "wait for more" only if nothing came that the
        # fetch's request was not sized with. The request is planned on the state of the
        # cycle before its grant, so a doorbell or retire from that cycle until the answer
        # (``unseen``) brings blocks or window room it did not have: without this, a retire
        # that freed the window while a too-small fetch was in flight left the QP waiting
        # for a retire that would never come. One in the answer's own cycle cancels the
        # wait below.
        event = Signal(n)
        recent = Signal(n)                  # a doorbell or retire last cycle
        unseen = Signal(n)
        m.d.comb += event.eq(db_hit | retire_hit)
        m.d.sync += [
            recent.eq(event),
            unseen.eq(((unseen & ~grant) | (grant & recent) | (event & (in_flight | grant))) &
                      ~reset_hit),
        ]
        consumed_none = Signal(n)
        m.d.comb += consumed_none.eq(Mux(self.fetch_done.p.consumed == 0, fresh_hit & ~unseen, 0))
        m.d.sync += [
            in_flight.eq((in_flight & ~done_hit | grant) & ~reset_hit),
            waiting.eq((waiting | consumed_none) & ~db_hit & ~retire_hit & ~reset_hit &
                       ~rewind_hit),
            touched.eq(reset_hit | grant | rewind_hit | skip_hit),
            granted.eq((granted | grant) & ~(rewind_hit | skip_hit | reset_hit)),
        ]

        # Rung but unfetched WQEs do not count: a move to RESET drops them without
        # completions, as IBA's transition to RESET does, so a QP whose doorbell cut a WQE
        # on a full ring (it waits for a doorbell that can never be accepted) can be reset.
        m.d.comb += self.qp_busy.eq(
            Cat(fetch_pi[q] != done_ci[q] for q in range(n)) | in_flight)
        return m
