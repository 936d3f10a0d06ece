"""DoorbellScheduler (hdl/nic/doorbell_scheduler.py) against a Python reference, in Amaranth's
simulator.

The reference keeps every QP's ``db_pi``, ``fetch_pi``, ``done_ci``, in-flight and waiting
flags and applies docs/nic.md's doorbell checks and scheduling rules to them. It mirrors the
scheduler's pipeline stage by stage (docs/nic.md, "Pipeline (400 MHz)": a doorbell read
(D0) and checked (D1) a cycle later, against the doorbell ahead of it when that one was
for the same QP; plans from the facts of the previous cycle's indices (P1) and this
cycle's flags (P2); a QP touched last cycle has no plan and is not picked; a pick
registered and granted in the next cycle unless its QP was touched or is reset; round
robin after the last grant while the output's second entry is free; request offered from
one cycle after its grant, through a two-entry skid register; skips read
(S0), decided (S1) and applied (S2); counters two cycles after their event), so every
cycle is checked exactly: ``fetch`` valid and payload, ``qp_busy``, ``qp_epoch``,
``skip``, all seven counters. Independently of that timing, every grant is checked
against the state of the grant cycle (the QP is in RTS or ERR and eligible by the rules,
``blocks`` within its pending blocks and its window, ``first_only`` only with nothing
outstanding; a grant of a QP whose ``done_ci`` a retire moved past ``fetch_pi`` only
while its skip is on its way, which makes it stale), and fairness: a QP that stays
eligible sees at most ``num_qps`` grants to others.

The reference also keeps each QP's epoch: ``fetch.epoch`` and ``qp_epoch`` are checked
every cycle, a ``fetch_done`` of an older epoch (or beside a rewind) leaves ``fetch_pi``,
a rewind sets ``fetch_pi``, bumps the epoch (a grant in its cycle goes out stale), clears
the wait and touches the QP.

Random runs: doorbells (accepted, duplicate, stale, backwards, too far, random, bad QPN,
QPs in RESET), a fetch consumer with random ``ready`` that answers each accepted request
after a random delay with ``consumed`` in 0..blocks (0 included) and the request's epoch,
retires of random sizes up to the furthest block fetched (so after a rewind a retire can
pass ``fetch_pi``: a skip, checked to happen), rewinds
to a random block from ``done_ci`` on (past the blocks a retire of the same cycle frees)
(and to QP numbers the scheduler lacks), QPs moving RTS -> ERR -> RESET (with
``qp_reset``, when idle) -> RTS with a new random context, everything possibly in the
same cycle for the same QP. Rewinds and stale fetch dones are checked to happen;
``fetch_pi`` lags ``done_ci`` only while a skip is on its way.
Directed: the window limit, ``first_only`` and a window overrun by it, waiting after
``consumed == 0`` until an accepted doorbell or a retire, the 16-bit index wrap-around,
the ERR state, all events in one cycle for one QP (``qp_reset`` wins), rewinds (stale
fetch done, the wait, beside a fetch done, a grant and a reset, the epoch wrapping),
skips (a retire past ``fetch_pi``: the ``skip`` strobe with the retire's PSN; none beside
a rewind or a reset, none when a fetch done of the cycle covers the retire), parameter
checks. The reference checks ``skip`` every cycle.
"""
import random

import pytest

from hdl.nic.doorbell_scheduler import DoorbellScheduler
from hdl.nic.signatures import COUNTERS, EPOCH_BITS, QpState
from tb.amaranth_sim import Driver, simulate

MASK = 0xFFFF
EPOCH_MASK = (1 << EPOCH_BITS) - 1
COUNTER_NAMES = [name for name, _ in COUNTERS["DoorbellScheduler"]]
ACTIVE = (QpState.RTS, QpState.ERR)


# --- Reference --------------------------------------------------------------------------------

class Qp:
    def __init__(self):
        self.state = QpState.RESET
        self.log_sq_size = 6
        self.max_out = 64
        self.recent = self.recent2 = self.db_event = False
        self.replay_end = 0
        self.busy_out = False       # qp_busy: the cycle before's busy or grant (a register)
        self.clear()

    def clear(self):
        """What ``qp_reset`` clears."""
        self.db = self.fp = self.dc = 0
        self.epoch = 0
        self.granted = False        # a fetch went out with the current epoch
        self.in_flight = False
        self.waiting = False
        self.replaying = False      # rewound, fetching again up to replay_end
        # A doorbell or retire the request in flight was not planned with.
        self.unseen = False

    @property
    def pending(self):
        return (self.db - self.fp) & MASK

    @property
    def outstanding(self):
        return (self.fp - self.dc) & MASK

    @property
    def busy(self):
        return self.fp != self.dc or self.in_flight


def rules(db, fp, dc, max_out):
    """docs/nic.md's request for these indices as ``(blocks, first_only)``, or None when
    there is none (flags and state aside)."""
    pending, outstanding = (db - fp) & MASK, (fp - dc) & MASK
    if pending == 0:
        return None
    want = min(pending, 16)
    if max_out - outstanding >= want:
        return (want, 0)
    if outstanding == 0:
        return (want, 1)
    if outstanding < max_out:
        return (max_out - outstanding, 0)
    return None


def plan(qp):
    """The rules on ``qp``'s state now, its flags included."""
    if qp.in_flight or qp.waiting:
        return None
    return rules(qp.db, qp.fp, qp.dc, qp.max_out)


def verdict(n, qpn, pi, db, dc, state, log_sq_size):
    """The counter a doorbell goes to, in docs/nic.md's order."""
    if qpn >= n:
        return "doorbells_bad_qpn"
    if state == QpState.RESET:
        return "doorbells_not_ready"
    if pi == db:
        return "doorbells_duplicate"
    if (pi - db) & MASK >= 1 << 15:
        return "doorbells_backwards"
    if (pi - dc) & MASK > 1 << log_sq_size:
        return "doorbells_too_far"
    return "doorbells_accepted"


class Inputs:
    """What the bench drives in one cycle."""
    __slots__ = ("doorbell", "fetch_done", "retire", "reset", "rewind", "ready")

    def __init__(self, doorbell=None, fetch_done=None, retire=None, reset=None, rewind=None,
                 ready=True):
        self.doorbell = doorbell        # (qpn, pi)
        self.fetch_done = fetch_done    # (qpn, consumed[, epoch]): the QP's epoch if not given
        self.retire = retire            # (qpn, blocks[, next_psn])
        self.reset = reset              # qpn
        self.rewind = rewind            # (qpn, wqe_index)
        self.ready = ready


class Reference:
    """The scheduler, cycle by cycle, stage by stage (docs/nic.md, "Doorbells")."""

    def __init__(self, n):
        self.n = n
        self.qps = [Qp() for _ in range(n)]
        self.facts = [(0, 0, 0, 64)] * n  # P1: (db, fp, dc, max_out) of the previous cycle
        self.plans = [None] * n         # P2: the request from those facts and this cycle's flags
        self.touched = set()            # QPs granted, answered, reset, rewound, skipped last cycle
        self.pick = None                # the QP picked last cycle, granted in this one if free
        self.last = None                # last granted QP
        self.doorbell = None            # in D1: the doorbell of the previous cycle, as read
        self.applied = None             # (qpn, pi) of the doorbell that set db_pi last cycle
        self.s1 = None                  # a retire's skip check, read (S0) last cycle
        self.s2 = None                  # (qpn, wqe_index, psn): a skip decided (S1) last cycle
        self.out = None                 # (qpn, wqe_index, blocks, first_only) offered on fetch
        self.out_epoch = None           # and its epoch
        self.behind = None              # (request, epoch) in the output's second entry
        self.stale_dones = 0            # fetch_done of an old epoch seen
        self.skip = None                # (qpn, wqe_index, psn) on ``skip``
        self.skips = 0
        self.stale_grants = 0           # grants between a retire past fetch_pi and its skip
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.counted = []               # this cycle's events: they show two cycles later
        self.passed = [0] * n           # grants to others while this QP stayed eligible
        self.grants = 0

    def skip_pending(self, q):
        """A skip of ``q`` decided or being decided: ``fetch_pi`` may lag ``done_ci``."""
        return (self.s1 is not None and self.s1["qpn"] == q) or \
            (self.s2 is not None and self.s2[0] == q)

    def step(self, ins, t):
        """One clock edge; returns the request the consumer accepted in this cycle, if any."""
        n, qps = self.n, self.qps
        for name in self.counted:
            self.counters[name] += 1
        self.counted = []
        reset_q = ins.reset if ins.reset is not None and ins.reset < n else None
        rewind_q = ins.rewind[0] if ins.rewind is not None and ins.rewind[0] < n else None
        done_q = ins.fetch_done[0] if ins.fetch_done is not None and ins.fetch_done[0] < n \
            else None
        retire_q = ins.retire[0] if ins.retire is not None and ins.retire[0] < n else None

        # Grant (last cycle's pick) and the next pick.
        load = self.behind is None
        grant = None
        if load and self.pick is not None and self.pick not in self.touched \
                and self.pick != reset_q:
            grant = self.pick
        usable = [q for q in range(n) if self.plans[q] is not None and q not in self.touched
                  and not (load and q == self.pick)]
        above = [q for q in usable if self.last is not None and q > self.last]
        pick = (above or usable)[0] if usable else None
        accepted = self.out if self.out is not None and ins.ready else None
        if accepted is not None:
            self.counted.append("wqe_fetches")
            self.accepted_epoch = self.out_epoch

        # The documented rules, on this cycle's state, whatever the pipelining.
        eligible = {q for q in range(n) if qps[q].state in ACTIVE and plan(qps[q]) is not None}
        if grant is not None:
            qp = qps[grant]
            blocks, first_only = self.plans[grant]
        if grant is not None and qp.outstanding >= 1 << 15:
            # A retire passed fetch_pi: the skip on its way makes this request stale.
            assert self.skip_pending(grant), (t, "granted a QP behind done_ci", grant)
            self.stale_grants += 1
            self.grants += 1
            request = (grant, qp.fp, blocks, first_only)
            request_epoch = qp.epoch
        elif grant is not None:
            assert grant in eligible, (t, "granted a QP the rules make ineligible", grant)
            assert 1 <= blocks <= min(16, qp.pending), (t, grant, blocks, qp.pending)
            if first_only:
                assert qp.outstanding == 0, (t, grant)
            else:
                assert qp.outstanding + blocks <= qp.max_out, (t, grant, "window overrun")
            self.grants += 1
            request = (grant, qp.fp, blocks, first_only)
            request_epoch = qp.epoch
        for q in range(n):
            if q in eligible and grant is not None and grant != q:
                self.passed[q] += 1
                assert self.passed[q] <= n, (t, f"QP {q} eligible through {n + 1} grants to others")
            elif q not in eligible or grant == q:
                self.passed[q] = 0

        # P2 from last cycle's facts and this cycle's flags; P1 from this cycle's indices.
        plans = []
        for q, qp in enumerate(qps):
            ok = qp.state in ACTIVE and not qp.in_flight and not qp.waiting \
                and q not in self.touched
            plans.append(rules(*self.facts[q]) if ok else None)
        self.plans = plans
        self.facts = [(qp.db, qp.fp, qp.dc, qp.max_out) for qp in qps]

        # Doorbells: D1 checks the one read last cycle (the one ahead of it forwarded).
        db_write = None
        applied = None
        if self.doorbell is not None:
            d = self.doorbell
            base = d["db"]
            if self.applied is not None and d["qpn"] == self.applied[0]:
                base = self.applied[1]
            name = verdict(n, d["qpn"], d["pi"], base, d["dc"], d["state"], d["log_sq_size"])
            self.counted.append(name)
            if name == "doorbells_accepted" and not d["killed"]:
                db_write, db_write_pi = d["qpn"], d["pi"]
                if d["qpn"] != reset_q:
                    applied = (d["qpn"], d["pi"])
        self.applied = applied
        self.doorbell = None
        if ins.doorbell is not None:
            qpn, pi = ins.doorbell
            qp = qps[qpn] if qpn < n else Qp()
            self.doorbell = dict(qpn=qpn, pi=pi, db=qp.db, dc=qp.dc, state=qp.state,
                                 log_sq_size=qp.log_sq_size, killed=qpn == ins.reset)

        # fetch_done: an older epoch's answer, or one beside a rewind, leaves fetch_pi.
        fresh = consumed_none = False
        done_epoch = None
        if done_q is not None:
            consumed = ins.fetch_done[1]
            done_epoch = ins.fetch_done[2] if len(ins.fetch_done) > 2 else qps[done_q].epoch
            fresh = done_epoch == qps[done_q].epoch and done_q != rewind_q
            self.stale_dones += done_epoch != qps[done_q].epoch
            consumed_none = consumed == 0 and fresh and not qps[done_q].unseen

        # Skips: S2 applies the one decided last cycle, S1 decides, S0 reads this retire. A
        # skip of the same QP applying (seen by S0) or decided (seen by S1) ahead of a
        # retire is where its fetch_pi stands.
        decided = self.s2
        skip = decided if decided is not None and decided[0] not in (rewind_q, reset_q) \
            else None
        if skip is not None:
            self.skips += 1
        self.s2 = None
        if self.s1 is not None and self.s1["qpn"] not in (rewind_q, reset_q):
            r = self.s1
            done = (r["dc"] + r["blocks"]) & MASK
            if r["after"] and decided is not None:
                lag = r["blocks"] != 0
            else:
                fetched = r["fp"] + (r["consumed"] if r["fresh"] else 0)
                lag = (fetched - done) & MASK >= 1 << 15
            if lag:
                self.s2 = (r["qpn"], done, r["psn"])
        after = self.s1 is not None
        ahead = self.s1["qpn"] if after else None
        self.s1 = None
        if retire_q is not None and retire_q not in (rewind_q, reset_q) \
                and qps[retire_q].replaying:
            qp = qps[retire_q]
            forwarded = skip is not None and skip[0] == retire_q
            same = done_q == retire_q and done_epoch == qp.epoch and not forwarded
            self.s1 = dict(qpn=retire_q, fp=skip[1] if forwarded else qp.fp, dc=qp.dc,
                           blocks=ins.retire[1], psn=ins.retire[2] if len(ins.retire) > 2 else 0,
                           fresh=same, consumed=ins.fetch_done[1] if same else 0,
                           after=ahead == retire_q)

        # Per-QP state, every next value from this cycle's.
        for q, qp in enumerate(qps):
            granting = grant == q
            qp.busy_out = qp.busy or granting
            event = qp.db_event or retire_q == q
            rewound, skipped = rewind_q == q, skip is not None and skip[0] == q
            unseen = ((qp.unseen and not granting) or (granting and (qp.recent or qp.recent2))
                      or (event and (qp.in_flight or granting)))
            waiting = (qp.waiting or (done_q == q and consumed_none)) and not event \
                and not rewound
            in_flight = (qp.in_flight and done_q != q) or granting
            granted = (qp.granted or granting) and not (rewound or skipped)
            if rewound or skipped:
                qp.replaying, qp.replay_end = True, qp.db
            elif (qp.fp - qp.replay_end) & MASK < 1 << 15:
                qp.replaying = False
            if (rewound or skipped) and (qp.granted or granting):
                qp.epoch = (qp.epoch + 1) & EPOCH_MASK
            if rewound:
                qp.fp = ins.rewind[1]
            elif skipped:
                qp.fp = skip[1]
            elif done_q == q and fresh:
                qp.fp = (qp.fp + ins.fetch_done[1]) & MASK
            if retire_q == q:
                qp.dc = (qp.dc + ins.retire[1]) & MASK
            if db_write == q:
                qp.db = db_write_pi
            qp.unseen, qp.waiting, qp.in_flight, qp.granted = unseen, waiting, in_flight, granted
            qp.recent2, qp.recent = qp.recent, event
            qp.db_event = db_write == q and reset_q != q
        if grant is not None:
            self.last = grant
        if reset_q is not None:
            qps[reset_q].clear()
        self.touched = {q for q in (reset_q, grant, rewind_q, skip and skip[0], done_q)
                        if q is not None}
        self.skip = skip
        self.pick = pick

        granted = (request, request_epoch) if grant is not None else None
        if self.out is None or ins.ready:
            self.out, self.out_epoch = self.behind or granted or (None, None)
            self.behind = None
        elif granted is not None:
            self.behind = granted
        return accepted


# --- Bench ------------------------------------------------------------------------------------

class Bench:
    def __init__(self, dut, ctx):
        self.dut = dut
        self.ctx = ctx
        self.n = dut.num_qps
        self.ref = Reference(self.n)
        self.t = 0
        self.drive = Driver()
        self.db_qpn, self.db_pi = dut.doorbell.p.qpn, dut.doorbell.p.pi
        self.done_qpn, self.done_consumed = dut.fetch_done.p.qpn, dut.fetch_done.p.consumed
        self.done_epoch = dut.fetch_done.p.epoch
        self.rewind_qpn, self.rewind_index = dut.rewind.p.qpn, dut.rewind.p.wqe_index
        self.retire_qpn, self.retire_blocks = dut.retire.p.qpn, dut.retire.p.blocks
        self.retire_psn = dut.retire.p.next_psn

    def configure(self, q, state=None, log_sq_size=None, max_out=None):
        """Context/state inputs of QP ``q``; they take effect in the next cycle driven."""
        qp = self.ref.qps[q]
        if state is not None:
            qp.state = state
            self.drive.set(self.dut.qp_state[q], state)
        if log_sq_size is not None:
            qp.log_sq_size = log_sq_size
            self.drive.set(self.dut.qp_log_sq_size[q], log_sq_size)
        if max_out is not None:
            qp.max_out = max_out
            self.drive.set(self.dut.qp_max_outstanding[q], max_out)

    def check_outputs(self):
        ctx, dut, ref, t = self.ctx, self.dut, self.ref, self.t
        valid = ctx.get(dut.fetch.valid)
        assert valid == (ref.out is not None), (t, "fetch.valid", valid, ref.out)
        if valid:
            p = dut.fetch.p
            got = (ctx.get(p.qpn), ctx.get(p.wqe_index), ctx.get(p.blocks), ctx.get(p.first_only))
            assert got == ref.out, (t, "fetch request", got, ref.out)
            assert ctx.get(p.epoch) == ref.out_epoch, (t, "fetch epoch")
        for q, qp in enumerate(ref.qps):
            assert ctx.get(dut.qp_epoch[q]) == qp.epoch, (t, "qp_epoch", q)
        skip = ctx.get(dut.skip.valid)
        assert skip == (ref.skip is not None), (t, "skip.valid", ref.skip)
        if skip:
            p = dut.skip.p
            got = (ctx.get(p.qpn), ctx.get(p.wqe_index), ctx.get(p.psn))
            assert got == ref.skip, (t, "skip", got, ref.skip)
        busy = ctx.get(dut.qp_busy)
        expected = sum(1 << q for q, qp in enumerate(ref.qps) if qp.busy_out)
        assert busy == expected, (t, "qp_busy", hex(busy), hex(expected))
        for name in COUNTER_NAMES:
            assert ctx.get(getattr(dut, name)) == ref.counters[name], \
                (t, name, ctx.get(getattr(dut, name)), ref.counters[name])

    async def cycle(self, ins=None):
        """Check the outputs, drive ``ins`` for one cycle; returns the request accepted in it."""
        ins = ins or Inputs()
        dut = self.dut
        self.check_outputs()
        self.drive.set(dut.doorbell.valid, int(ins.doorbell is not None))
        if ins.doorbell is not None:
            self.drive.set(self.db_qpn, ins.doorbell[0])
            self.drive.set(self.db_pi, ins.doorbell[1])
        self.drive.set(dut.fetch_done.valid, int(ins.fetch_done is not None))
        if ins.fetch_done is not None:
            self.drive.set(self.done_qpn, ins.fetch_done[0])
            self.drive.set(self.done_consumed, ins.fetch_done[1])
            q = ins.fetch_done[0]
            self.drive.set(self.done_epoch, ins.fetch_done[2] if len(ins.fetch_done) > 2
                      else self.ref.qps[q].epoch if q < self.n else 0)
        self.drive.set(dut.rewind.valid, int(ins.rewind is not None))
        if ins.rewind is not None:
            self.drive.set(self.rewind_qpn, ins.rewind[0])
            self.drive.set(self.rewind_index, ins.rewind[1])
        self.drive.set(dut.retire.valid, int(ins.retire is not None))
        if ins.retire is not None:
            self.drive.set(self.retire_qpn, ins.retire[0])
            self.drive.set(self.retire_blocks, ins.retire[1])
            self.drive.set(self.retire_psn, ins.retire[2] if len(ins.retire) > 2 else 0)
        self.drive.set(dut.qp_reset.valid, int(ins.reset is not None))
        if ins.reset is not None:
            self.drive.set(dut.qp_reset.qpn, ins.reset)
        self.drive.set(dut.fetch.ready, int(ins.ready))
        self.drive.apply(self.ctx)
        await self.ctx.tick()
        accepted = self.ref.step(ins, self.t)
        self.t += 1
        return accepted


def run_bench(num_qps, body):
    dut = DoorbellScheduler(num_qps)

    async def testbench(ctx):
        await body(Bench(dut, ctx))

    simulate(dut, testbench)


# --- Random traffic ---------------------------------------------------------------------------

def random_pi(rng, qp):
    """A doorbell index of a random kind for ``qp``."""
    kind = rng.random()
    ring = 1 << qp.log_sq_size
    room = (qp.dc + ring - qp.db) & MASK if qp.state in ACTIVE else 0
    if kind < 0.45 and 0 < room < 1 << 15:
        return (qp.db + rng.randint(1, min(room, 40))) & MASK          # accepted
    if kind < 0.6:
        return qp.db                                                    # duplicate
    if kind < 0.75:
        return (qp.db - rng.randint(1, 1 << 15)) & MASK                 # stale / backwards
    if kind < 0.9:
        return (qp.dc + ring + rng.randint(1, 300)) & MASK              # too far (mostly)
    return rng.getrandbits(16)


class Traffic:
    """Host, fetch consumer, completion unit and register block, all random."""

    def __init__(self, bench, rng, *, doorbell_rate=0.4, ready_rate=0.7, retire_rate=0.35,
                 state_rate=0.02, max_delay=8, zero_rate=0.15, rewind_rate=0.03):
        self.bench = bench
        self.rng = rng
        self.doorbell_rate = doorbell_rate
        self.ready_rate = ready_rate
        self.retire_rate = retire_rate
        self.state_rate = state_rate
        self.max_delay = max_delay
        self.zero_rate = zero_rate
        self.rewind_rate = rewind_rate
        self.fetches = []               # (due cycle, request, epoch) accepted, not yet answered
        self.requests = []
        # Per QP, the furthest fetch_pi reached: the completion unit holds records up to
        # there, so it may retire up to it and rewind to any WQE from done_ci on.
        self.high = [0] * bench.n
        self.rewinds = 0

    def random_context(self, q):
        rng = self.rng
        self.bench.configure(q, log_sq_size=rng.choice([2, 3, 4, 5, 6, 8, 12]),
                             max_out=rng.choice([1, 2, 3, 5, 8, 13, 16, 17, 32, 64]))

    def inputs(self):
        bench, rng, ref = self.bench, self.rng, self.bench.ref
        n, t = bench.n, bench.t
        ins = Inputs(ready=rng.random() < self.ready_rate)

        if rng.random() < self.doorbell_rate:
            if rng.random() < 0.05:
                qpn = rng.randrange(n, 1 << 24)
                ins.doorbell = (qpn, rng.getrandbits(16))
            else:
                q = rng.randrange(n)
                ins.doorbell = (q, random_pi(rng, ref.qps[q]))

        due = [f for f in self.fetches if f[0] <= t]
        if due:
            f = rng.choice(due)
            self.fetches.remove(f)
            qpn, _, blocks, _ = f[1]
            qp = ref.qps[qpn]
            epoch = f[2]
            # Nothing consumed only while a retire or a doorbell can still end the wait.
            can_wait = qp.outstanding or (qp.dc + (1 << qp.log_sq_size) - qp.db) & MASK
            r = rng.random()
            low = 0 if can_wait else 1
            consumed = (low if r < self.zero_rate else blocks if r < 0.65
                        else rng.randint(low, blocks))
            ins.fetch_done = (qpn, consumed, epoch)

        owed = [(self.high[q] - qp.dc) & MASK for q, qp in enumerate(ref.qps)]
        if rng.random() < self.retire_rate:
            owing = [q for q in range(n) if owed[q]]
            if owing:
                q = rng.choice(owing)
                ins.retire = (q, rng.randint(1, min(16, owed[q])), rng.getrandbits(24))

        if rng.random() < self.rewind_rate:
            owing = [q for q in range(n) if owed[q]]
            if rng.random() < 0.05:
                ins.rewind = (rng.randrange(n, 256), rng.getrandbits(16))    # no such QP
            elif owing:
                q = rng.choice(owing)
                # Not retired, even by a retire of this cycle.
                low = ins.retire[1] if ins.retire is not None and ins.retire[0] == q else 0
                if low < owed[q]:
                    ins.rewind = (q, (ref.qps[q].dc + rng.randint(low, owed[q] - 1)) & MASK)
                    self.rewinds += 1

        if rng.random() < self.state_rate:
            q = rng.randrange(n)
            qp = ref.qps[q]
            offered = any(r is not None and r[0] == q
                          for r in (ref.out, ref.behind and ref.behind[0]))
            if qp.state == QpState.RTS and rng.random() < 0.3:
                bench.configure(q, state=QpState.ERR)
            elif qp.state in ACTIVE and not qp.busy and not offered:
                bench.configure(q, state=QpState.RESET)
                ins.reset = q
            elif qp.state == QpState.RESET:
                if rng.random() < 0.5:
                    self.random_context(q)
                else:
                    bench.configure(q, state=QpState.RTS)
        return ins

    async def run(self, cycles):
        bench, rng = self.bench, self.rng
        for q in range(bench.n):
            self.random_context(q)
            bench.configure(q, state=rng.choice([QpState.RTS] * 4 + [QpState.ERR, QpState.RESET]))
        for _ in range(cycles):
            ins = self.inputs()
            accepted = await bench.cycle(ins)
            if accepted is not None:
                self.requests.append(accepted)
                self.fetches.append((bench.t + rng.randint(0, self.max_delay), accepted,
                                     bench.ref.accepted_epoch))
            for q, qp in enumerate(bench.ref.qps):
                if q == ins.reset:
                    self.high[q] = 0
                elif 0 < (qp.fp - self.high[q]) & MASK < 1 << 15:
                    self.high[q] = qp.fp
                assert (qp.fp - qp.dc) & MASK < 1 << 15 or bench.ref.skip_pending(q), \
                    (bench.t, q, "done_ci past fetch_pi with no skip on its way")


def counters_never_hit(ref):
    return [name for name in COUNTER_NAMES if ref.counters[name] == 0]


# The 64-QP pipeline is the slowest of the scheduler's sizes in Amaranth's simulator (143 s
# for 1,000 cycles in make test on 2026-12-06): its runs are under make test-full, and make
# test runs the 13-QP size (not a power of two) and 1; 5 (26 s) under make test-full since
# 2026-12-07, and the 13-QP run's second half (it took 54 CPU-s of make test that day).
@pytest.mark.parametrize("num_qps, seed, cycles", [
    pytest.param(64, 7, 1000, marks=pytest.mark.full),
    pytest.param(64, 1, 2500, marks=pytest.mark.full),
    pytest.param(64, 2, 1500, marks=pytest.mark.full),
    pytest.param(5, 3, 4000, marks=pytest.mark.full),
    pytest.param(13, 5, 3000, marks=pytest.mark.full),
    (1, 4, 3000),
    (13, 5, 1500),
])
def test_random(num_qps, seed, cycles):
    rng = random.Random(seed)

    async def body(bench):
        traffic = Traffic(bench, rng)
        await traffic.run(cycles)
        ref = bench.ref
        assert not counters_never_hit(ref), ("counters never hit", counters_never_hit(ref))
        assert ref.grants > cycles // 50
        assert any(r[3] for r in traffic.requests) or num_qps == 1, "no first_only request"
        assert any(r[2] < 16 and not r[3] and r[2] < ref.qps[r[0]].max_out for r in traffic.requests)
        assert traffic.rewinds > cycles // 300 and ref.stale_dones > 0
        assert ref.skips > 0

    run_bench(num_qps, body)


# 97 s in make test on 2026-12-06: under make test-full.
@pytest.mark.full
@pytest.mark.parametrize("seed", [6])
def test_random_heavy(seed):
    """Every QP busy: doorbells nearly every cycle, the consumer always ready and quick, so
    arbitration among many eligible QPs (fairness) is exercised."""
    rng = random.Random(seed)

    async def body(bench):
        traffic = Traffic(bench, rng, doorbell_rate=0.9, ready_rate=0.95, retire_rate=0.9,
                          state_rate=0.005, max_delay=2, zero_rate=0.05)
        await traffic.run(2500)
        assert bench.ref.grants > 600

    run_bench(16, body)


# --- Directed ---------------------------------------------------------------------------------

async def run_for(bench, cycles, ins=None):
    """``cycles`` cycles with ``ins`` repeated (fresh each time); returns the accepted requests."""
    got = []
    for _ in range(cycles):
        r = await bench.cycle(ins() if ins else None)
        if r is not None:
            got.append(r)
    return got


async def next_request(bench, limit=10):
    got = await run_for(bench, 1)
    for _ in range(limit):
        if got:
            return got[0]
        got = await run_for(bench, 1)
    raise AssertionError(f"no request within {limit} cycles")


async def start(bench, q, *, log_sq_size=6, max_out=64, state=QpState.RTS):
    bench.configure(q, state=state, log_sq_size=log_sq_size, max_out=max_out)
    await run_for(bench, 1)


def test_window_limit():
    async def body(bench):
        await start(bench, 0, max_out=6)
        await bench.cycle(Inputs(doorbell=(0, 20)))
        assert await next_request(bench) == (0, 0, 16, 1)       # outstanding 0: alone
        await bench.cycle(Inputs(fetch_done=(0, 4)))
        assert await next_request(bench) == (0, 4, 2, 0)        # window 6 - 4
        await bench.cycle(Inputs(fetch_done=(0, 2)))
        assert await run_for(bench, 10) == []                   # window full
        await bench.cycle(Inputs(retire=(0, 3)))
        assert await next_request(bench) == (0, 6, 3, 0)
        await bench.cycle(Inputs(fetch_done=(0, 3), retire=(0, 3)))
        assert await next_request(bench) == (0, 9, 3, 0)        # 6 - (9 - 6)
        await bench.cycle(Inputs(fetch_done=(0, 3)))
        await bench.cycle(Inputs(retire=(0, 3)))
        assert await next_request(bench) == (0, 12, 3, 0)       # pending 8, room 3
        await bench.cycle(Inputs(fetch_done=(0, 3), retire=(0, 6)))
        assert await next_request(bench) == (0, 15, 5, 0)       # pending 5 fits
        await run_for(bench, 2)                                 # counters count a cycle late
        assert bench.ref.counters["wqe_fetches"] == 6

    run_bench(2, body)


def test_first_only_overrunning_the_window():
    async def body(bench):
        await start(bench, 1, max_out=4)
        await bench.cycle(Inputs(doorbell=(1, 12)))
        assert await next_request(bench) == (1, 0, 12, 1)
        await bench.cycle(Inputs(fetch_done=(1, 10)))           # one WQE of 10 blocks
        assert await run_for(bench, 10) == []                   # outstanding 10 > 4
        await bench.cycle(Inputs(retire=(1, 7)))                # outstanding 3 < 4
        assert await next_request(bench) == (1, 10, 1, 0)
        await bench.cycle(Inputs(fetch_done=(1, 1), retire=(1, 3)))
        assert await next_request(bench) == (1, 11, 1, 0)       # pending 1, room 3
        await bench.cycle(Inputs(fetch_done=(1, 1)))
        assert await run_for(bench, 5) == []

    run_bench(2, body)


def test_waiting_after_nothing_consumed():
    async def body(bench):
        await start(bench, 0)
        await bench.cycle(Inputs(doorbell=(0, 3)))
        assert await next_request(bench) == (0, 0, 3, 0)
        await bench.cycle(Inputs(fetch_done=(0, 0)))            # WQE extends past the doorbell
        assert bench.ref.qps[0].waiting
        assert await run_for(bench, 10, lambda: Inputs(doorbell=(0, 3))) == []   # duplicates
        await bench.cycle(Inputs(doorbell=(0, 0xFFFF)))         # backwards: still waiting
        assert await run_for(bench, 5) == []
        await bench.cycle(Inputs(doorbell=(0, 5)))              # accepted: fetch again
        assert await next_request(bench) == (0, 0, 5, 0)
        await bench.cycle(Inputs(fetch_done=(0, 3)))
        assert await next_request(bench) == (0, 3, 2, 0)
        await bench.cycle(Inputs(fetch_done=(0, 0)))            # WQE past the window, say
        assert await run_for(bench, 10) == []
        await bench.cycle(Inputs(retire=(0, 3)))                # a retire ends the wait
        assert await next_request(bench) == (0, 3, 2, 0)
        # consumed == 0 in the cycle an accepted doorbell counts (two cycles after it
        # arrives): no wait.
        await bench.cycle(Inputs(doorbell=(0, 8)))
        await bench.cycle(Inputs())
        await bench.cycle(Inputs(fetch_done=(0, 0)))
        assert not bench.ref.qps[0].waiting
        assert await next_request(bench) == (0, 3, 5, 0)
        # ... and in the cycle of a retire.
        await bench.cycle(Inputs(fetch_done=(0, 0), retire=(0, 0)))
        assert await next_request(bench) == (0, 3, 5, 0)
        await bench.cycle(Inputs(fetch_done=(0, 5)))
        assert await run_for(bench, 5) == []

    run_bench(1, body)


def test_nothing_consumed_after_a_retire_it_did_not_see():
    """A fetch sized by a window that a retire widened while it was in flight (a 1-block
    request for a 2-block WQE) consumes nothing: the QP must not wait for another retire
    (none may come: every WQE before it has retired). Same for a retire in the cycle
    before the grant, which the request's plan does not include yet."""
    async def body(bench):
        await start(bench, 0, max_out=4)
        await bench.cycle(Inputs(doorbell=(0, 3)))
        assert await next_request(bench) == (0, 0, 3, 0)
        await bench.cycle(Inputs(fetch_done=(0, 3)))            # 3 blocks outstanding
        await bench.cycle(Inputs(doorbell=(0, 5)))              # a 2-block WQE behind them
        assert await next_request(bench) == (0, 3, 1, 0)        # room for 1 block only
        await bench.cycle(Inputs(retire=(0, 3)))                # in flight: all retired
        await bench.cycle(Inputs(fetch_done=(0, 0)))
        assert not bench.ref.qps[0].waiting
        assert await next_request(bench) == (0, 3, 2, 0)
        await bench.cycle(Inputs(fetch_done=(0, 2)))
        await bench.cycle(Inputs(retire=(0, 2)))
        # The retire in the cycle before the grant (its plan's facts are from the cycle
        # before that): 3 outstanding again, then a retire of 1 block right before a
        # 1-block request is granted.
        await bench.cycle(Inputs(doorbell=(0, 8)))
        assert await next_request(bench) == (0, 5, 3, 0)
        await bench.cycle(Inputs(fetch_done=(0, 3)))
        await bench.cycle(Inputs(doorbell=(0, 10)))
        while bench.ref.pick is None:
            assert bench.t < 200
            await bench.cycle(Inputs())
        await bench.cycle(Inputs(retire=(0, 1)))
        request = await next_request(bench)
        assert request[:2] == (0, 8), request
        await bench.cycle(Inputs(fetch_done=(0, 0)))
        assert await next_request(bench) is not None
        assert not bench.ref.qps[0].waiting

    run_bench(1, body)


# About 12,000 cycles to walk the ring to 0xFFF0 (112 s in make test on 2026-12-06): under
# make test-full.
@pytest.mark.full
def test_wrap_around_doorbell_checks():
    """Doorbell checks across 0xFFFF -> 0: reached by running the ring through once."""
    async def body(bench):
        await start(bench, 0, log_sq_size=15, max_out=64)
        # Walk db_pi/fetch_pi/done_ci to 0xFFF0 in four doorbells, fetching 16 blocks at a time.
        for target in (0x4000, 0x8000, 0xC000, 0xFFF0):
            await bench.cycle(Inputs(doorbell=(0, target)))
            while bench.ref.qps[0].dc != target:
                assert bench.t < 30_000, "no progress"
                ins = Inputs()
                qp = bench.ref.qps[0]
                if qp.in_flight and bench.ref.out is None:
                    ins.fetch_done = (0, 16 if qp.pending >= 16 else qp.pending)
                if qp.outstanding:
                    ins.retire = (0, min(16, qp.outstanding))
                await bench.cycle(ins)
            await run_for(bench, 3)
        qp = bench.ref.qps[0]
        assert (qp.db, qp.fp, qp.dc) == (0xFFF0, 0xFFF0, 0xFFF0)
        await bench.cycle(Inputs(doorbell=(0, 0x7FF0)))         # 0x8000 ahead: backwards
        await bench.cycle(Inputs(doorbell=(0, 0x7FF1)))         # 0x8001 ahead: backwards
        await bench.cycle(Inputs(doorbell=(0, 0x0010)))         # 0x20 ahead: accepted
        assert await next_request(bench) == (0, 0xFFF0, 16, 0)
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        assert await next_request(bench) == (0, 0x0000, 16, 0)
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        await bench.cycle(Inputs(doorbell=(0, 0xFFFF)))         # backwards across the wrap
        await bench.cycle(Inputs(doorbell=(0, 0x7FF1)))         # 0x8001 past done_ci: too far
        await bench.cycle(Inputs(doorbell=(0, 0x7FF0)))         # exactly the ring: accepted
        assert await next_request(bench) == (0, 0x0010, 16, 0)
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        assert await run_for(bench, 6) == [(0, 0x0020, 16, 0)]  # window 64 - 48
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        assert await run_for(bench, 6) == []                    # window full
        await run_for(bench, 2)                                 # counters count a cycle late
        c = bench.ref.counters
        assert (c["doorbells_backwards"], c["doorbells_too_far"], c["doorbells_accepted"]) == (3, 1, 6)

    run_bench(1, body)


def test_err_and_reset_states():
    async def body(bench):
        await start(bench, 0, state=QpState.ERR)
        await start(bench, 1, state=QpState.RESET)
        await bench.cycle(Inputs(doorbell=(1, 4)))              # RESET: not ready
        await bench.cycle(Inputs(doorbell=(0, 4)))              # ERR: accepted, fetched
        assert await next_request(bench) == (0, 0, 4, 0)
        await bench.cycle(Inputs(doorbell=(2, 4)))              # no such QP
        await bench.cycle(Inputs(doorbell=(0xFFFFFF, 4)))
        await run_for(bench, 3)                                 # checked, then counted
        c = bench.ref.counters
        assert (c["doorbells_not_ready"], c["doorbells_accepted"], c["doorbells_bad_qpn"]) == (1, 1, 2)
        # A QP leaving RTS/ERR for RESET is not granted even with its plan ready.
        await bench.cycle(Inputs(fetch_done=(0, 2)))
        bench.configure(0, state=QpState.RESET)
        assert await run_for(bench, 5) == []
        assert bench.ref.qps[0].busy
        # fetch_done / retire for QPs the scheduler does not have are ignored.
        await bench.cycle(Inputs(fetch_done=(2, 3), retire=(7, 1)))
        await run_for(bench, 2)

    run_bench(2, body)


def test_everything_in_one_cycle():
    """Doorbell, fetch done, retire and (separately) reset for one QP in one cycle, while the
    QP is also being granted; and requests held under backpressure."""
    async def body(bench):
        await start(bench, 0)
        await start(bench, 1)
        await bench.cycle(Inputs(doorbell=(0, 10)))
        await bench.cycle(Inputs(doorbell=(1, 10), ready=False))
        await run_for(bench, 6, lambda: Inputs(ready=False))    # QP 0's request held
        assert bench.ref.out == (0, 0, 10, 0)
        # A doorbell sets db_pi in the cycle after it arrives: then with the rest.
        assert await bench.cycle(Inputs(doorbell=(0, 20))) == (0, 0, 10, 0)
        assert bench.ref.out == (1, 0, 10, 0)                   # then QP 1's is loaded
        got = await bench.cycle(Inputs(fetch_done=(0, 5), retire=(0, 2)))
        assert got == (1, 0, 10, 0)
        qp = bench.ref.qps[0]
        assert (qp.db, qp.fp, qp.dc, qp.in_flight) == (20, 5, 2, False)
        assert await next_request(bench) == (0, 5, 15, 0)
        # qp_reset with all other events for the same QP: the reset wins.
        await bench.cycle(Inputs(doorbell=(0, 30)))
        await bench.cycle(Inputs(fetch_done=(0, 0), retire=(0, 3), reset=0))
        qp = bench.ref.qps[0]
        assert (qp.db, qp.fp, qp.dc, qp.in_flight, qp.waiting) == (0, 0, 0, False, False)
        # A reset in the cycle the QP would be granted keeps it from the grant.
        await bench.cycle(Inputs(doorbell=(0, 4)))
        while bench.ref.pick != 0:
            assert bench.t < 200
            await bench.cycle(Inputs())
        await bench.cycle(Inputs(reset=0))
        assert bench.ref.out is None or bench.ref.out[0] != 0
        assert await run_for(bench, 8) == []

    run_bench(2, body)


def test_rewind():
    """Rewinds: fetch_pi and the epoch, a stale fetch_done (fetch_pi stays, the fetch ends),
    the wait cleared, a rewind beside a fresh fetch_done (the rewind wins) and in the
    cycle of a grant (the request goes out stale), done_ci past fetch_pi (a skip, two
    cycles after the retire; an empty window), the epoch wrapping, qp_reset clearing it."""
    async def body(bench):
        ref = bench.ref
        qp = ref.qps[0]
        await start(bench, 0, max_out=40)
        await start(bench, 1)
        await bench.cycle(Inputs(doorbell=(0, 40)))
        assert await next_request(bench) == (0, 0, 16, 0) and ref.accepted_epoch == 0
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        assert await next_request(bench) == (0, 16, 16, 0)
        await bench.cycle(Inputs(rewind=(0, 4)))                # that fetch still in flight
        assert (qp.fp, qp.epoch, qp.in_flight) == (4, 1, True)
        assert await run_for(bench, 5) == []
        await bench.cycle(Inputs(fetch_done=(0, 16, 0)))        # stale: fetch_pi stays
        assert (qp.fp, qp.in_flight) == (4, False) and ref.stale_dones == 1
        assert await next_request(bench) == (0, 4, 16, 0) and ref.accepted_epoch == 1
        await bench.cycle(Inputs(fetch_done=(0, 0)))            # fresh, nothing consumed: waits
        assert qp.waiting
        assert await run_for(bench, 4) == []
        await bench.cycle(Inputs(rewind=(0, 2)))                # ends the wait
        assert not qp.waiting and qp.epoch == 2
        assert await next_request(bench) == (0, 2, 16, 0) and ref.accepted_epoch == 2
        # Beside a fresh fetch_done the rewind's fetch_pi wins; the fetch has ended.
        await bench.cycle(Inputs(fetch_done=(0, 16, 2), rewind=(0, 3)))
        assert (qp.fp, qp.epoch, qp.in_flight) == (3, 3, False)
        assert await next_request(bench) == (0, 3, 16, 0) and ref.accepted_epoch == 3
        # A stale consumed == 0 answer does not make the QP wait.
        await bench.cycle(Inputs(rewind=(0, 3)))
        await bench.cycle(Inputs(fetch_done=(0, 0, 3)))
        assert not qp.waiting and qp.fp == 3
        # A rewind in the cycle the QP is granted: the request goes out with the old epoch
        # (stale), and the epoch moves on.
        while ref.pick != 0:
            assert bench.t < 500
            await bench.cycle(Inputs())
        await bench.cycle(Inputs(rewind=(0, 5)))
        assert ref.out == (0, 3, 16, 0) and (ref.out_epoch, qp.epoch) == (4, 5)
        await run_for(bench, 1)
        await bench.cycle(Inputs(fetch_done=(0, 16, 4)))        # stale
        assert (qp.fp, qp.in_flight) == (5, False)
        # (no fetch went out with epoch 5 yet: a rewind now would keep it)
        assert await next_request(bench) == (0, 5, 16, 0) and ref.accepted_epoch == 5
        # Retired past fetch_pi after a rewind (late acknowledgements): skip to done_ci.
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        await bench.cycle(Inputs(retire=(0, 12)))
        await bench.cycle(Inputs(rewind=(0, 12)))
        assert await next_request(bench) == (0, 12, 16, 0)
        bench.configure(0, max_out=8)                                 # (while in flight)
        await bench.cycle(Inputs(retire=(0, 9, 0x123456)))            # done_ci 21 > fetch_pi 12
        assert (qp.fp, qp.epoch) == (12, 6)
        await run_for(bench, 2)                                       # decided, applied
        assert (qp.fp, qp.epoch, ref.skip) == (21, 7, (0, 21, 0x123456))
        await bench.cycle(Inputs(fetch_done=(0, 16, 6)))              # stale
        assert ref.skip is None and qp.fp == 21
        await bench.cycle(Inputs(doorbell=(0, 60)))
        assert await next_request(bench) == (0, 21, 16, 1) and ref.accepted_epoch == 7
        await bench.cycle(Inputs(fetch_done=(0, 16)))
        assert await run_for(bench, 6) == []                          # window 8 full
        skips = ref.skips
        await bench.cycle(Inputs(retire=(0, 10)))                     # done_ci 31 <= 37: no skip
        assert await next_request(bench) == (0, 37, 2, 0)             # window 8 - 6
        assert ref.skips == skips
        # A retire past fetch_pi beside a rewind (to a WQE at or past the new done_ci):
        # the rewind wins, no skip; beside a reset: the reset wins.
        await bench.cycle(Inputs(rewind=(0, 31)))
        await bench.cycle(Inputs(fetch_done=(0, 2, 7)))               # stale
        await bench.cycle(Inputs(retire=(0, 4), rewind=(0, 36)))      # done_ci 35 > 31
        assert (qp.fp, qp.dc) == (36, 35)
        await run_for(bench, 1)                                       # (before a pick)
        await bench.cycle(Inputs(rewind=(0, 35)))
        await bench.cycle(Inputs(retire=(0, 1)))                      # done_ci 36 > 35: skip
        await run_for(bench, 2)
        assert ref.skip == (0, 36, 0) and qp.fp == 36
        assert ref.skips == skips + 1                                 # none beside the rewind
        assert await next_request(bench) == (0, 36, 16, 1) and ref.accepted_epoch == qp.epoch
        await bench.cycle(Inputs(rewind=(0, 36)))
        skips = ref.skips
        await bench.cycle(Inputs(retire=(0, 1), reset=0))
        assert (qp.fp, qp.dc, qp.epoch) == (0, 0, 0)
        await run_for(bench, 3)
        assert ref.skips == skips
        # Rewinds with no fetch between them keep the epoch (nothing carries the current
        # one), so a run of them cannot wrap it onto a fetch still in flight; a reset
        # clears it.
        for _ in range(20):
            await bench.cycle(Inputs(rewind=(0, 0)))
        assert qp.epoch == 0
        await bench.cycle(Inputs(rewind=(1, 0)))
        assert ref.qps[1].epoch == 0
        await bench.cycle(Inputs(rewind=(1, 0), reset=1))             # the reset wins
        assert (ref.qps[1].epoch, ref.qps[1].fp) == (0, 0)
        await run_for(bench, 3)

    run_bench(2, body)


@pytest.mark.parametrize("num_qps", [0, 257, -1, 64.0, "64"])
def test_bad_parameters(num_qps):
    with pytest.raises(ValueError):
        DoorbellScheduler(num_qps)
