"""Two NICs back to back under Verilator: each GPU posts RC work to the other's memory
(tb/nic_pair_tb.py). Every test ends with :meth:`tb.nic_pair_tb.NicPairTB.check_clean`:
every WQE and receive completed exactly once with the CQE the models predict, and each
whole memory (outside its CQs) equals the models' byte for byte.
"""
import random

import cocotb
import pytest

from models import mlx5
from tb import runner
from tb.nic_pair_tb import SOURCE_BYTES, SOURCE_REGION, NicPairTB
from tb.wqe_mix import KINDS, RECEIVING_KINDS, wqe_fields

Op = mlx5.Opcode
ATOMIC_AREA = 0x1000            # bytes at the start of each target slice for atomic words


def random_wqe(side, qpn, rng, kinds, limit, cursor):
    """One random, valid WQE's fields from ``side``'s QP ``qpn`` into its peer's target
    slice (``cursor``: the next free offset there, per QP). Returns (kind, fields)."""
    kind = rng.choice(kinds)
    base, size = side.peer.target(qpn)
    length = rng.randrange(0, limit + 1)
    if cursor[qpn] + length + 64 > size:
        cursor[qpn] = ATOMIC_AREA
    raddr = base + cursor[qpn] + rng.randrange(64)
    cursor[qpn] += length + 64
    return kind, wqe_fields(
        kind, rng, length=length, lkey=side.data_key,
        laddr=SOURCE_REGION + rng.randrange(0, SOURCE_BYTES - length - 8), raddr=raddr,
        rkey=side.peer.data_key,
        read_raddr=SOURCE_REGION + rng.randrange(0, SOURCE_BYTES - length),
        atomic_raddr=base + 8 * rng.randrange(ATOMIC_AREA // 8))


async def run_both(tb, work):
    """Post every side's work (one warp per list) at once and wait until all is rung."""
    tasks = [task for side, lists in work.items() for task in side.gpu.start_warps(lists)]
    for task in tasks:
        await task
    for side in work:
        await side.gpu.quiet()


def plan(tb, rng, qps, per_qp, kinds, limit, receive_bytes):
    """Per side, per QP, ``per_qp`` random WQEs, and on the peer one receive WQE for each
    that consumes one (posted before any of them runs). Returns the warps' work lists."""
    work = {}
    for side in tb.sides.values():
        cursor = dict.fromkeys(qps, 0x1000)
        lists = []
        for q in qps:
            items = []
            for _ in range(per_qp):
                kind, fields = random_wqe(side, q, rng, kinds, limit, cursor)
                if kind in RECEIVING_KINDS:
                    base, size = side.peer.target(q)
                    buffer = base + size - receive_bytes * (1 + rng.randrange(4))
                    side.peer.post_receive(q, receive_bytes, buffer)
                blocks = mlx5.build_wqe(fields["opcode"], 0, 0,
                                        **{k: v for k, v in fields.items() if k != "opcode"}).blocks
                items.append((q, blocks, side.builder(q, **fields), kind))
            lists.append(items)
        work[side] = lists
    return work


@cocotb.test()
@cocotb.parametrize(seed=[1, 2])
async def random_both_directions(dut, seed):
    """Random mixes of every operation on 8 QP pairs, both NICs requester and responder at
    once; path MTUs random per pair."""
    rng = random.Random(seed)
    tb = NicPairTB(dut, seed=seed, memory_latency=100)
    await tb.reset()
    qps = await tb.setup(qps=8)
    work = plan(tb, rng, qps, per_qp=24, kinds=KINDS, limit=3000, receive_bytes=4096)
    await run_both(tb, work)
    await tb.drain()
    await tb.check_clean()
    for side in tb.sides.values():
        counters = await side.host.counters()
        for name in ("requests_executed", "duplicate_requests", "seq_naks", "rnr_naks",
                     "access_naks", "invalid_naks", "op_naks", "rx_dropped_qp",
                     "rx_dropped_pkey", "rx_request_icrc_drops", "rx_request_malformed"):
            assert counters[name] == side.responder.counters[name], (side.name, name)


@cocotb.test()
async def atomics_hammer_one_word(dut):
    """Two QPs on each side fetch-and-add the same word of the peer's memory: no update is
    lost (the word ends at its start plus every addend)."""
    rng = random.Random(7)
    tb = NicPairTB(dut, seed=7, memory_latency=150)
    await tb.reset()
    qps = await tb.setup(qps=2, mtu=5)
    work = {}
    for side in tb.sides.values():
        word, _ = side.peer.target(0)
        lists = []
        for q in qps:
            items = []
            for _ in range(40):
                fields = dict(opcode=Op.ATOMIC_FA, lkey=side.data_key, laddr=SOURCE_REGION,
                              raddr=word, rkey=side.peer.data_key,
                              swap_add=rng.getrandbits(40), fm_ce_se=mlx5.CTRL_CQ_UPDATE)
                items.append((q, 1, side.builder(q, **fields), "fa"))
            lists.append(items)
        work[side] = lists
    await run_both(tb, work)
    await tb.drain()
    await tb.check_clean()


PAIR = dict(num_qps=8, num_cqs=16, num_mkeys=8, num_vls=2, mtu=4096, wire_delay=8)
BUILD_ARGS = ["-Wno-UNOPTFLAT"]


def nic_pair_top(**params):
    from tb.nic_pair_top import NicPairTop
    return NicPairTop(**params)


def test_nic_pair():
    runner.run(module="tb.test_nic_pair", toplevel="nic_pair_top", factory=nic_pair_top,
               params=PAIR, build_args=BUILD_ARGS)
