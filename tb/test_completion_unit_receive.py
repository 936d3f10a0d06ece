"""CompletionUnit's receive completions (``receive``, from the responder), in Amaranth's
simulator, on the bench of tb/test_completion_unit.py.

That bench takes the CQEs in the order the writer issues them: one with a receive opcode
must be the CQE of the oldest receive record taken that writes one (records with another
opcode or an unknown CQ are passed over: they write nothing), a requester one must come
with the retire of its record. Each is checked at its CQ's producer index (one index per
CQ, shared by both kinds, entry 0 when collapsed), all 64 bytes against rdma-core's
``mlx5_cqe64`` / ``mlx5_err_cqe`` offsets and against models/mlx5.py's
``build_responder_cqe``; the counters at the end.

Directed: every opcode (immediates only in the ``*_IMM`` CQEs), error CQEs, a ring that
wraps twice (owner bits), a collapsed CQ, records that write nothing, ``cq_reset``,
``receive.ready`` low while the AXI write channels stall; random AW/W backpressure, B
delays and SLVERRs throughout. Random: receive records on the same CQs as the random
requester traffic of test_completion_unit (rewinds, retries exhausted, fatal NAKs, flushes,
resets, junk; READ CQEs waiting for ``landed``), interleaved on each CQ. Fairness: both kinds offered every cycle, AXI always ready: each gets about
half the writer, together one CQE per cycle; receive records alone, one per cycle.
"""
import random

import pytest

from hdl.nic.completion_unit import CompletionUnit
from hdl.nic.signatures import QpState
from tb.completion_unit_tb import (
    RECV_OPCODES, RESP_ERR, RESP_SEND, RESP_SEND_IMM, RESP_WR_IMM, WRITE, Bench, RecvRec,
    Traffic, full_speed_factory, make_rec, random_body, random_unit, run,
)


def random_recv(rng, num_qps, num_cqs, *, p_bad=0.03):
    """A receive record: mostly good, now and then an unknown opcode or CQ."""
    opcode = rng.choice(RECV_OPCODES)
    cqn = rng.randrange(num_cqs)
    if rng.random() < p_bad:
        if rng.random() < 0.5:
            opcode = rng.choice([0, 4, 5, 13, 15])
        else:
            cqn = rng.randrange(num_cqs, 256)
    return RecvRec(qpn=rng.randrange(num_qps), cqn=cqn, opcode=opcode,
                   byte_count=rng.choice([0, 1, rng.getrandbits(32)]), imm=rng.getrandbits(32),
                   wqe_counter=rng.getrandbits(16), syndrome=rng.choice([0x02, 0x04, 0x12, 0x14]))


async def cycles(ctx, bench, n):
    for _ in range(n):
        await bench.cycle(ctx)


def test_receive_directed():
    """Receive records alone (1 VL, 4 QPs, CQ 0 a 4-entry ring, CQ 1 collapsed, CQ 2 an
    8-entry ring), AW/W ready 60 % of cycles, B late, some SLVERR."""
    rng = random.Random(3)
    dut = CompletionUnit(num_qps=4, num_cqs=3, num_vls=1, addr_width=40)
    qp_states = [QpState.RTS] * 4
    cqs = [(0x10000, 2, 0), (0x20040, 3, 1), (0x30000, 3, 0)]

    def factory():
        return Bench(dut, rng, qp_states=qp_states, cqs=cqs, p_aw=0.6, p_w=0.6, b_delay=12,
                     p_slverr=0.2, p_recv=0.8)

    async def body(ctx, bench):
        ref = bench.ref
        # Every opcode, each with an immediate in the record (only *_IMM CQEs carry it),
        # extreme field values; then error CQEs.
        recs = [RecvRec(qpn=q, cqn=2, opcode=op, byte_count=n, imm=imm, wqe_counter=wc)
                for q, op, n, imm, wc in (
                    (0, RESP_WR_IMM, 4096, 0x12345678, 0),
                    (1, RESP_SEND, 0, 0xDEADBEEF, 0xFFFF),
                    (2, RESP_SEND_IMM, 0xFFFFFFFF, 0xFFFFFFFF, 0x8001),
                    (3, RESP_SEND, 1, 0, 7),
                    (255, RESP_WR_IMM, 0, 0x80000001, 1))]
        recs += [RecvRec(qpn=1, cqn=2, opcode=RESP_ERR, byte_count=64, imm=5, wqe_counter=3,
                         syndrome=syn) for syn in (0x02, 0x04, 0x12, 0x14, 0x05)]
        bench.recv_to_offer.extend(recs)
        await bench.drain(ctx)
        assert bench.cq_pi[2] == 10 and ref.counters["error_cqes"] == 5

        # CQ 0 wraps twice (owner 0, 1, 0), CQ 1 (collapsed) takes every CQE at entry 0,
        # records that write nothing in between use no index.
        bench.recv_to_offer.extend(random_recv(rng, 4, 2, p_bad=0) for _ in range(24))
        bench.recv_to_offer.extend(RecvRec(qpn=0, cqn=cqn, opcode=op, imm=9)
                                   for cqn, op in ((0, 0), (0, 4), (1, 13), (0, 15), (3, RESP_SEND),
                                                   (200, RESP_ERR), (255, RESP_WR_IMM)))
        bench.recv_to_offer.extend(random_recv(rng, 4, 2, p_bad=0) for _ in range(8))
        await bench.drain(ctx)
        assert bench.cq_pi[0] > 8 and bench.cq_pi[1] > 4, bench.cq_pi
        assert ref.counters["recv_cqes"] == 10 + 32

        # The host rewrites CQ 0's context: its next CQE is entry 0 with owner 0.
        bench.cq_resets.append(0)
        await cycles(ctx, bench, 2)
        bench.recv_to_offer.append(RecvRec(qpn=2, cqn=0, opcode=RESP_SEND, byte_count=3))
        await bench.drain(ctx)
        assert bench.cq_pi[0] == 1

        # The write channels stall: the receive queue fills and ``ready`` drops; nothing
        # is lost when they resume. The queue and the writer's stages (P, A, O) hold 8 of
        # the 12.
        bench.p_aw = bench.p_w = 0.0
        bench.recv_to_offer.extend(random_recv(rng, 4, 3, p_bad=0) for _ in range(12))
        bench.p_recv = 1.0
        await cycles(ctx, bench, 40)
        assert bench.recv_ready_low > 20 and len(bench.recv_to_offer) == 4, bench.recv_ready_low
        bench.p_aw, bench.p_w = 1.0, 0.3
        await cycles(ctx, bench, 30)
        bench.p_aw, bench.p_w = 0.3, 1.0
        await bench.drain(ctx)
        await bench.check_counters(ctx)
        c = ref.counters
        assert c["recv_cqes"] == 10 + 32 + 1 + 12 and c["cqes_written"] == c["recv_cqes"], c
        assert c["cqe_write_errors"] > 0, c

    run(dut, factory, body)


@pytest.mark.parametrize("seed,num_vls,records,num_qps,num_cqs,p_aw", [
    (23, 2, 160, 6, 3, 0.7),
    (22, 1, 140, 6, 2, 0.4),
])
def test_receive_mixed(seed, num_vls, records, num_qps, num_cqs, p_aw):
    """Receive records on the CQs of random requester traffic (with rewinds, fatal NAKs,
    flushes, resets and junk), AW/W/B backpressure: every CQE exactly once at its CQ's
    index."""
    rng = random.Random(seed)
    dut, qp_states, cqs = random_unit(rng, num_qps, num_cqs, num_vls)
    live = [0, 1, 2, 3, 4]

    def factory():
        bench = Bench(dut, rng, qp_states=qp_states, cqs=cqs, p_aw=p_aw, p_w=p_aw, p_recv=0.08)
        bench.recv_to_offer.extend(random_recv(rng, num_qps, num_cqs) for _ in range(records))
        return bench

    async def body(ctx, bench):
        bench.drive_qp_states(ctx)
        traffic = Traffic(bench, rng, live, p_fatal=0.02)
        await random_body(ctx, bench, rng, traffic, records=records)

    bench = run(dut, factory, body)
    c = bench.ref.counters
    assert c["recv_cqes"] > records * 0.9 and c["cqes_written"] > c["recv_cqes"] + records * 0.4, c
    assert c["cqe_write_errors"] > 0 and c["error_cqes"] > 10, c
    # both kinds on one CQ, interleaved (a receive CQE between two requester ones)
    for cqn in range(num_cqs):
        kinds = [receive for c_, receive in bench.cqe_log if c_ == cqn]
        switches = sum(a != b for a, b in zip(kinds, kinds[1:]))
        assert switches > 10, (cqn, switches)


def writer_shares(requester, receive, n=200):
    """Records offered every cycle, AXI always ready; requester records of flushed QPs
    (they complete at once). Returns (requester CQEs, receive CQEs) per cycle while both
    kinds are offered, or from the start to the last CQE when one kind is."""
    rng = random.Random(9)
    dut = CompletionUnit(num_qps=4, num_cqs=2, num_vls=1, addr_width=40)
    result = {}

    async def body(ctx, bench):
        bench.drive_qp_states(ctx)
        bench.flushes.extend(range(4))
        await cycles(ctx, bench, 8)
        if requester:
            bench.to_offer.extend(make_rec(k % 4, WRITE, 100 + k // 4, cqn=k % 2, index=k)
                                  for k in range(n))
        if receive:
            bench.recv_to_offer.extend(random_recv(rng, 4, 2, p_bad=0) for _ in range(n))
        start = bench.t
        first_retire, first_recv = len(bench.retire_cycles), len(bench.recv_cycles)
        while bench.to_offer and bench.recv_to_offer:
            await bench.cycle(ctx)
        end = bench.t
        while bench.to_offer or bench.recv_to_offer:
            await bench.cycle(ctx)
        await bench.drain(ctx)
        await bench.check_counters(ctx)
        retires = bench.retire_cycles[first_retire:]
        recvs = bench.recv_cycles[first_recv:]
        if requester and receive:
            span = end - start - 10
            result["shares"] = (sum(start + 10 <= t < end for t in retires) / span,
                                sum(start + 10 <= t < end for t in recvs) / span)
        else:
            times = retires or recvs
            share = len(times) / (times[-1] - start + 1)
            result["shares"] = (share, 0.0) if requester else (0.0, share)

    run(dut, full_speed_factory(dut, rng, p_recv=1.0), body)
    return result["shares"]


def test_writer_fairness():
    """Both saturated: each kind gets about half the writer, one CQE per cycle together.
    Alone, receive records are written at one per cycle (the requester's own figures are
    test_completion_unit's throughput test)."""
    requester, receive = writer_shares(True, True)
    assert requester >= 0.45 and receive >= 0.45 and requester + receive >= 0.95, (requester, receive)
    _, receive = writer_shares(False, True)
    assert receive >= 0.95, receive
