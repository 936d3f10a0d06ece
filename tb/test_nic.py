"""The NIC's requester side under Verilator: a GPU model posting IBGDA-style, a responder
model answering, every packet and every CQE checked against models/ (tb/nic_tb.py).

Every test ends with :meth:`tb.nic_tb.NicTB.check_clean`: each predicted packet was on
the wire byte for byte and in order per QP, each signaled WQE completed exactly once and
in order per QP, no link overflow and no link re-initialisation.
"""
import json
import os
import random
import shutil

import cocotb
import pytest

from hdl.nic import register_map as rmap
from hdl.nic.signatures import MAX_OUTSTANDING_BLOCKS, RECORD_QUEUE_DEPTH
from models import mlx5
from tb import runner
from tb.nic_tb import DATA_BYTES, DATA_REGION, MEMORY_BYTES, PD, NicTB, remote_qpn
from tb.nic_top import BUILD_ARGS, NIC, nic_top
from tb.wqe_mix import KINDS, wqe_fields

Op = mlx5.Opcode
RTS, ERR, RESET = 3, 6, 0


# READ data and atomic results land in the upper half of the data region, each WQE in a
# range of its own (allocated in turn, wrapping), so that no payload source changes after
# the model read it and no two landings overlap.
SOURCE_BYTES = DATA_BYTES // 2
LANDING_REGION = DATA_REGION + SOURCE_BYTES


def random_wqe(tb, rng, *, small=False):
    """One random, valid WQE's fields (for :meth:`NicTB.builder`)."""
    kind = rng.choice(KINDS)
    limit = 600 if small else rng.choice([64, 600, 5000, 12000])
    length = rng.randrange(0, limit + 1)
    if kind in ("read", "fetch_add", "compare_swap", "nvshmem_atomic"):
        room = max(length, 8)
        if tb.landing_cursor + room > SOURCE_BYTES:
            tb.landing_cursor = 0
        laddr = LANDING_REGION + tb.landing_cursor
        tb.landing_cursor += (room + 63) // 64 * 64 + 64 * rng.randrange(0, 4)
    else:
        laddr = DATA_REGION + rng.randrange(0, SOURCE_BYTES - length - 8)
    return wqe_fields(kind, rng, length=length, lkey=tb.data_key, laddr=laddr,
                      raddr=rng.randrange(0, MEMORY_BYTES - max(length, 8)),   # the responder's
                      rkey=rng.getrandbits(32))


def fill_data(tb, rng):
    tb.memory.write(DATA_REGION, rng.randbytes(1 << 16) * (DATA_BYTES >> 16))


async def post_all(tb, work):
    """Run one warp per work list and wait for all of them."""
    for task in tb.gpu.start_warps(work):
        await task
    await tb.gpu.flush()


# 2026-12-07: +1 for the AR register (the WQE fetch's; the payload read's too for the long
# one), +1 for the register between the assembler and the VL multiplexer, +1 each for the
# registers between the fetcher and the executor and between the packet queue and the
# assembler (docs/nic.md, Block boundaries): 27 and 34 before them all.
NIC_CYCLES = 31
LONG_INLINE_NIC_CYCLES = 38     # measured 38 at the head of 2026-12-07 (34 on 2026-12-06), every trial


@cocotb.test()
async def zero_load_latency(dut):
    """Doorbell to first beat on the wire, one 8-byte inline RDMA WRITE at a time, with
    the split into NIC cycles and memory waits (the fetch's AR issue to its first R beat)."""
    tb = NicTB(dut, memory_latency=200)
    await tb.reset()
    await tb.setup(qps=4, mtu=5)
    rng = random.Random(1)
    nic_cycles = []
    for trial in range(8):
        t = await tb.timed_inline_write(trial % 4, rng)
        assert t["memory"] >= tb.memory_latency
        nic_cycles.append(t["nic"])
        dut._log.info(f"trial {trial}: doorbell -> wire {t['total']} cycles = NIC {t['nic']} "
                      f"(doorbell -> AR {t['to_ar']}) + memory {t['memory']}")
    assert max(nic_cycles) <= NIC_CYCLES, f"NIC cycles {nic_cycles} (budget {NIC_CYCLES})"
    # A warp-combined put of 8-byte T (256 inline bytes, 5 blocks): its bytes are read back
    # from the ring, a second memory wait (docs/nic.md "Inline data from the ring").
    long_cycles = []
    for trial in range(4):
        t = await tb.timed_inline_write(trial % 4, rng, size=256)
        assert t["memory"] >= 2 * tb.memory_latency
        long_cycles.append(t["nic"])
        dut._log.info(f"256-byte inline trial {trial}: doorbell -> wire {t['total']} cycles = "
                      f"NIC {t['nic']} + memory {t['memory']}")
    assert max(long_cycles) <= LONG_INLINE_NIC_CYCLES, \
        f"NIC cycles {long_cycles} (budget {LONG_INLINE_NIC_CYCLES})"
    await tb.check_clean()


@cocotb.test()
@cocotb.parametrize(
    (("ring_every", "backpressure", "collapsed", "seed"),
     [(1, 0.0, False, 1), (4, 0.3, False, 2), (32, 0.0, True, 3)]),
)
async def random_operations(dut, ring_every, backpressure, collapsed, seed):
    """Random mixes of every operation over 16 QPs (path MTU random per QP), posted by 32
    warps, doorbells every 1, 4 or 32 WQEs (DeepEP rings every 4, NVSHMEM batches 32)."""
    rng = random.Random(seed)
    # The first setting also writes the NIC's wire as pcapng, for the tshark check below.
    capture = os.path.join(os.getcwd(), "nic_capture.pcapng") if seed == 1 else None
    tb = NicTB(dut, seed=seed, memory_latency=rng.choice([50, 200]), backpressure=backpressure,
               ack_every=rng.choice([1, 3]), capture_path=capture)
    await tb.reset()
    qps = await tb.setup(qps=16, collapsed=collapsed, ring_every=ring_every)
    fill_data(tb, rng)
    work = [[] for _ in range(32)]
    for n in range(320):
        q = rng.choice(qps)
        fields = random_wqe(tb, rng)
        work[n % 32].append((q, tb.blocks_of(**fields), tb.builder(q, **fields), n))
    await post_all(tb, work)
    await tb.drain(limit=400_000)
    await tb.check_clean()
    if capture:
        with open(os.path.join(os.getcwd(), "nic_capture.json"), "w") as f:
            json.dump([p[:-2].hex() for p, _, _ in tb.wire.data_packets], f)
    counters = await tb.counters()
    assert counters["wqes_parsed"] == 320
    assert counters["wqe_errors"] == counters["wqes_flushed"] == counters["error_cqes"] == 0


@cocotb.test()
async def doorbell_storm(dut):
    """All QPs but 4 (kept in RESET), thousands of doorbells: every WQE rung, plus duplicates, stale and
    out-of-order indices, doorbells for QPs that do not exist or are in RESET, and indices
    beyond the ring. Nothing is lost, nothing runs twice, and every doorbell is counted."""
    rng = random.Random(7)
    tb = NicTB(dut, seed=7, memory_latency=100)
    await tb.reset()
    active = tb.num_qps - 4
    qps = await tb.setup(qps=active, cqs=min(16, active), log_sq_size=6)
    junk = {"duplicate": 0, "bad_qpn": 0, "not_ready": 0, "backwards": 0, "too_far": 0}
    stop = False

    async def chaos():
        while not stop:
            kind = rng.choice(list(junk))
            qp = tb.gpu.qps[rng.choice(qps)]
            if kind == "duplicate" and qp.rung_head:
                data = mlx5.doorbell(qp.qpn, qp.rung_head)
            elif kind == "backwards" and qp.rung_head > 2:
                data = mlx5.doorbell(qp.qpn, qp.rung_head - rng.randrange(1, min(qp.rung_head, 300)))
            elif kind == "bad_qpn":
                data = mlx5.doorbell(rng.choice([tb.num_qps, 255, 0xFFFFFF]), rng.getrandbits(16))
            elif kind == "not_ready":
                data = mlx5.doorbell(rng.randrange(active, tb.num_qps), rng.randrange(1, 10))
            elif kind == "too_far":
                data = mlx5.doorbell(qp.qpn, qp.cons_head + 64 + rng.randrange(1, 1000))
            else:
                continue
            await tb.ring_doorbell(data)
            junk[kind] += 1

    chaos_task = cocotb.start_soon(chaos())
    work = [[] for _ in range(64)]
    for n in range(1500):
        q = rng.choice(qps)
        fields = dict(opcode=Op.RDMA_WRITE, inline=rng.randbytes(rng.choice([4, 8, 16])),
                      raddr=rng.randrange(0, MEMORY_BYTES - 64), rkey=7, fm_ce_se=mlx5.CTRL_CQ_UPDATE)
        work[n % 64].append((q, 1, tb.builder(q, **fields), n))
    await post_all(tb, work)
    stop = True
    await chaos_task
    await tb.drain(limit=400_000)
    await tb.check_clean()
    c = await tb.counters()
    rung = tb.gpu.doorbells_rung
    total = rung + sum(junk.values())
    seen = sum(c[f"doorbells_{k}"] for k in ("accepted", "duplicate", "bad_qpn", "not_ready",
                                             "backwards", "too_far"))
    assert seen == total, f"{seen} doorbells counted of {total} written ({c})"
    assert c["doorbells_bad_qpn"] == junk["bad_qpn"]
    assert c["doorbells_not_ready"] == junk["not_ready"]
    assert c["doorbells_too_far"] == junk["too_far"]
    # The chaos task's stale and repeated indices count as duplicates or backwards, never
    # as accepted twice.
    assert c["doorbells_accepted"] <= rung
    assert c["wqes_parsed"] == 1500
    dut._log.info(f"doorbells: {total} written, counters {c}")


BAD_WQES = {
    # name: (fields, syndrome)
    "unknown_opcode": (dict(opcode=0x13, byte_count=8), mlx5.Syndrome.LOCAL_QP_OP_ERR),
    # NVSHMEM's NOP has ds 1 or 2 and opmod 0; its DUMP ds 2, opmod 0 and a data segment
    # (one QP per row, 16 QPs: a DUMP's opmod is tb/test_wqe_fetcher.py's)
    "nop_ds3": (dict(opcode=Op.NOP, ds=3), mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "nop_opmod": (dict(opcode=Op.NOP, byte_count=0, opmod=0x08), mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "dump_ds1": (dict(opcode=Op.DUMP, ds=1), mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "dump_inline": (dict(opcode=Op.DUMP, inline=b"\x01"), mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "dump_key_not_found": (dict(opcode=Op.DUMP, lkey=(9 << 8) | 1), mlx5.Syndrome.LOCAL_PROT_ERR),
    "inline_too_long": (dict(opcode=Op.RDMA_WRITE, inline=bytes(257)), mlx5.Syndrome.LOCAL_LENGTH_ERR),
    "atomic_length": (dict(opcode=Op.ATOMIC_FA, byte_count=16), mlx5.Syndrome.LOCAL_LENGTH_ERR),
    "key_not_found": (dict(opcode=Op.RDMA_WRITE, byte_count=64, lkey=(9 << 8) | 1),
                      mlx5.Syndrome.LOCAL_PROT_ERR),
    "key_variant": (dict(opcode=Op.RDMA_WRITE, byte_count=64, lkey=(1 << 8) | 0x5B),
                    mlx5.Syndrome.LOCAL_PROT_ERR),
    "other_pd": (dict(opcode=Op.SEND, byte_count=64, lkey=(2 << 8) | 0x5A),
                 mlx5.Syndrome.LOCAL_PROT_ERR),
    "below_region": (dict(opcode=Op.RDMA_WRITE, byte_count=64, laddr=DATA_REGION - 8),
                     mlx5.Syndrome.LOCAL_PROT_ERR),
    "beyond_region": (dict(opcode=Op.RDMA_WRITE, byte_count=4096,
                           laddr=DATA_REGION + DATA_BYTES - 100), mlx5.Syndrome.LOCAL_PROT_ERR),
    "read_without_local_write": (dict(opcode=Op.RDMA_READ, byte_count=64, lkey=(3 << 8) | 0x5A),
                                 mlx5.Syndrome.LOCAL_PROT_ERR),
    "atomic_without_local_write": (dict(opcode=Op.ATOMIC_CS, lkey=(3 << 8) | 0x5A),
                                   mlx5.Syndrome.LOCAL_PROT_ERR),
}
# NVSHMEM's masked atomics (ibgda_write_atomic_wqe) malformed: an opmod it never writes, ds
# one short (an 8-byte masked CS's data segment past the WQE), the data word not the
# operand size; its warp-combined put of 8-byte T (256 inline bytes) with ds one short and
# with 4 bytes more than the limit (a second run of bad_wqes: one QP per row, at most 15
# rows a run)
BAD_NVSHMEM_POSTS = {
    "masked_opmod": (dict(opcode=Op.ATOMIC_MASKED_FA, opmod=0x0A, byte_count=8),
                     mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "masked_cs_ds4": (dict(opcode=Op.ATOMIC_MASKED_CS, opmod=0x09, ds=4),
                      mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "masked_fa4_length": (dict(opcode=Op.ATOMIC_MASKED_FA, opmod=0x08, byte_count=8),
                          mlx5.Syndrome.LOCAL_LENGTH_ERR),
    "masked_cs8_length": (dict(opcode=Op.ATOMIC_MASKED_CS, opmod=0x09, byte_count=4),
                          mlx5.Syndrome.LOCAL_LENGTH_ERR),
    "combined_put_ds18": (dict(opcode=Op.RDMA_WRITE, inline=bytes(256), ds=18, fm_ce_se=0),
                          mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "combined_put_260": (dict(opcode=Op.RDMA_WRITE, inline=bytes(260), fm_ce_se=0),
                         mlx5.Syndrome.LOCAL_LENGTH_ERR),
    "send_inline_ds_long": (dict(opcode=Op.SEND, inline=bytes(100), ds=9),
                            mlx5.Syndrome.LOCAL_QP_OP_ERR),
}


# Gather lists (several data segments, docs/nic.md "Limits") that must fail: five segments,
# an inline-marked one among them, a bad key in segment 2 or 4, a range past its key in
# segment 3 (a zero-length segment before it, not looked up), byte counts summing past 2^31.
# (tb_key below is the QP's data key; key (9 << 8) | 1 has no entry.)
_KEY = (1 << 8) | 0x5A
BAD_GATHER_LISTS = {
    "gather_five": (dict(opcode=Op.SEND, gather=[(8, _KEY, DATA_REGION)] * 5),
                    mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "gather_inline_marked": (dict(opcode=Op.RDMA_WRITE_IMM, gather=[
        (8, _KEY, DATA_REGION), (8, _KEY, DATA_REGION), (mlx5.INLINE_SEG | 8, _KEY, DATA_REGION)]),
        mlx5.Syndrome.LOCAL_QP_OP_ERR),
    "gather_key_2": (dict(opcode=Op.RDMA_WRITE, gather=[
        (64, _KEY, DATA_REGION), (64, (9 << 8) | 1, DATA_REGION)]), mlx5.Syndrome.LOCAL_PROT_ERR),
    "gather_key_4": (dict(opcode=Op.SEND_IMM, gather=[
        (64, _KEY, DATA_REGION), (0, 0, 0), (100, _KEY, DATA_REGION + 999),
        (1, _KEY ^ 1, DATA_REGION)]), mlx5.Syndrome.LOCAL_PROT_ERR),
    "gather_range_3": (dict(opcode=Op.RDMA_WRITE, gather=[
        (64, _KEY, DATA_REGION), (0, (9 << 8) | 1, 0), (100, _KEY, DATA_REGION + DATA_BYTES - 99),
        (8, _KEY, DATA_REGION)]), mlx5.Syndrome.LOCAL_PROT_ERR),
    "gather_over_2g": (dict(opcode=Op.SEND, gather=[
        (1 << 30, _KEY, DATA_REGION), (1 << 30, _KEY, DATA_REGION), (1, _KEY, DATA_REGION)]),
        mlx5.Syndrome.LOCAL_LENGTH_ERR),
}


@cocotb.test()
@cocotb.parametrize(table=["BAD_WQES", "BAD_NVSHMEM_POSTS", "BAD_GATHER_LISTS"])
async def bad_wqes(dut, table):
    """Each bad WQE of ``table`` on its own QP, between good ones, while QP 0 streams good
    traffic: the bad one completes with its syndrome, its QP goes to ERR and flushes every
    later WQE, and every other QP carries on untouched."""
    bad = globals()[table]
    from models.nic import Mkey
    rng = random.Random(11)
    tb = NicTB(dut, seed=11, memory_latency=100)
    await tb.reset()
    key = tb_key = _KEY
    extra = [Mkey(key=key, base=DATA_REGION, length=DATA_BYTES, access=0xF, pd=PD, valid=1),
             Mkey(key=(2 << 8) | 0x5A, base=DATA_REGION, length=DATA_BYTES, access=0xF,
                  pd=PD + 1, valid=1),
             Mkey(key=(3 << 8) | 0x5A, base=DATA_REGION, length=DATA_BYTES, access=0x6,
                  pd=PD, valid=1)]
    qps = await tb.setup(qps=len(bad) + 1, mkeys=extra)
    fill_data(tb, rng)
    work = []
    good = [random_wqe(tb, rng, small=True) for _ in range(60)]
    work.append([(0, tb.blocks_of(**f), tb.builder(0, **f), n) for n, f in enumerate(good)])
    for q, (name, (fields, syndrome)) in zip(qps[1:], bad.items()):
        fields = {"lkey": tb_key, "laddr": DATA_REGION + 256, "raddr": 0x1000, "rkey": 1,
                  "fm_ce_se": mlx5.CTRL_CQ_UPDATE, **fields}
        items = [random_wqe(tb, rng, small=True) for _ in range(2)] + [fields] + \
                [random_wqe(tb, rng, small=True) for _ in range(3)]
        for f in items:
            f["fm_ce_se"] = f.get("fm_ce_se", 0) | mlx5.CTRL_CQ_UPDATE
        work.append([(q, tb.blocks_of(**f), tb.builder(q, **f), name) for f in items])
    await post_all(tb, work)
    await tb.drain()
    await tb.check_clean()
    for q, (name, (fields, syndrome)) in zip(qps[1:], bad.items()):
        cqes = tb.completed[q]
        assert [c.syndrome for c in cqes] == [0, 0, int(syndrome)] + [mlx5.Syndrome.WR_FLUSH_ERR] * 3, \
            (name, cqes)
        assert await tb.read(rmap.context_offset("qp", q, "state")) == ERR, name
    assert await tb.read(rmap.context_offset("qp", 0, "state")) == RTS
    assert len(tb.completed[0]) == sum(1 for f in good if f["fm_ce_se"] & mlx5.CTRL_CQ_UPDATE)
    assert all(c.syndrome == 0 for c in tb.completed[0])
    c = await tb.counters()
    assert c["wqe_errors"] == len(bad)
    assert c["error_cqes"] == 4 * len(bad)


# NVSHMEM's fm_ce_se for the DUMP of a blocking get: CQ update and IBGDA_MLX5_FM_FENCE (2 << 5)
DUMP_FENCED = mlx5.CTRL_CQ_UPDATE | 2 << 5


def nvshmem_post(tb, rng, kind, ibuf):
    """The WQEs NVSHMEM's IBGDA code (ibgda_device.cuh) posts together for ``kind``, as
    field dicts for :meth:`NicTB.builder_many`; the first is a random WQE of the mix when
    ``kind`` names none."""
    put_raddr = rng.randrange(0, MEMORY_BYTES - 256)
    if kind.startswith("combined_put_"):
        # ibgda_write_rdma_write_inl_wqe_combine_warp<T>, sizeof(T) 1, 2, 4 or 8: 32 *
        # sizeof(T) inline bytes at byte 36 (ds 5, 7, 11, 19: ibgda_get_ds_in_inl_combine_warp
        # for RC; 8-byte T spans 5 blocks), no CQ update, then the NOP of ds 1 that carries it
        size = 32 * int(kind[-1])
        return [dict(opcode=Op.RDMA_WRITE, inline=rng.randbytes(size), raddr=put_raddr,
                     rkey=rng.getrandbits(32), fm_ce_se=0),
                dict(opcode=Op.NOP, fm_ce_se=mlx5.CTRL_CQ_UPDATE)]
    if kind == "put_and_nop":
        # ibgda_rma_thread's need_additional_wqe: a put, then ibgda_write_nop_wqe (ds 2)
        first = random_wqe(tb, rng, small=True)
        return [dict(first, fm_ce_se=0), dict(opcode=Op.NOP, byte_count=0,
                                              fm_ce_se=mlx5.CTRL_CQ_UPDATE)]
    if kind in ("blocking_get", "fetching_atomic"):
        # need_immediate_cst: the READ (or the fetching atomic; masked ones are not
        # executed yet, so a plain one here), then ibgda_write_dump_wqe of 1 byte of
        # qp->ibuf with IBGDA_MLX5_FM_FENCE and a CQ update
        while True:
            first = random_wqe(tb, rng, small=True)
            if first["opcode"] in ((Op.RDMA_READ,) if kind == "blocking_get"
                                   else (Op.ATOMIC_FA, Op.ATOMIC_CS)):
                break
        return [dict(first, fm_ce_se=0), dict(opcode=Op.DUMP, byte_count=1, lkey=tb.data_key,
                                              laddr=ibuf, fm_ce_se=DUMP_FENCED)]
    if kind == "cst":
        # ibgda_cst: a DUMP alone, signaled (0 or 1 byte, no fence)
        return [dict(opcode=Op.DUMP, byte_count=rng.choice([0, 1]), lkey=tb.data_key,
                     laddr=ibuf, fm_ce_se=mlx5.CTRL_CQ_UPDATE)]
    return [random_wqe(tb, rng, small=True)]


def counting_wraps(build, blocks, ring, wrapped):
    """``build``, noting in ``wrapped`` each index whose first ``blocks`` blocks cross the
    end of a ring of ``ring`` blocks."""
    def counted(index):
        if index % ring + blocks > ring:
            wrapped.append(index)
        return build(index)
    return counted


@cocotb.test()
async def nvshmem_nop_and_dump(dut):
    """NVSHMEM's NOP (both forms) and DUMP WQEs as its IBGDA code posts them, mixed with
    random traffic over 8 QPs: each completes with its CQE in order (the tb fails a NOP's
    or DUMP's CQE written while a packet before it is still unreceived, or before the data
    of a READ or atomic before it landed), sends nothing, and every QP stays in RTS. The
    warp-combined puts of 4- and 8-byte T (128 and 256 inline bytes, read back from the
    ring) land byte for byte, some of them wrapping around the 32-block ring's end."""
    rng = random.Random(19)
    tb = NicTB(dut, seed=19, memory_latency=100, ack_every=3)
    await tb.reset()
    log_sq_size = 5
    qps = await tb.setup(qps=8, ring_every=4, log_sq_size=log_sq_size)
    fill_data(tb, rng)
    ibuf = DATA_REGION + 64
    kinds = ["combined_put_1", "combined_put_2", "combined_put_4", "combined_put_8",
             "put_and_nop", "blocking_get", "fetching_atomic", "cst", "other", "other"]
    work = [[] for _ in range(16)]
    posted = {}
    wrapped = []
    for n in range(240):
        q = rng.choice(qps)
        kind = rng.choice(kinds)
        items = nvshmem_post(tb, rng, kind, ibuf)
        blocks = sum(tb.blocks_of(**f) for f in items)
        build = tb.builder_many(q, items)
        if kind in ("combined_put_4", "combined_put_8"):
            build = counting_wraps(build, tb.blocks_of(**items[0]), 1 << log_sq_size, wrapped)
        work[n % 16].append((q, blocks, build, n))
        posted[kind] = posted.get(kind, 0) + 1
    await post_all(tb, work)
    await tb.drain(limit=400_000)
    await tb.check_clean()
    for q in qps:
        assert await tb.read(rmap.context_offset("qp", q, "state")) == RTS
    c = await tb.counters()
    assert c["wqe_errors"] == c["wqes_flushed"] == c["error_cqes"] == 0
    assert tb.local_cqes > 100, tb.local_cqes
    assert wrapped, "no long inline put wrapped around its ring"
    dut._log.info(f"posted {posted}; {tb.local_cqes} NOP/DUMP CQEs; "
                  f"{len(wrapped)} long inline puts wrapped the ring")


@cocotb.test()
async def remote_naks(dut):
    """The responder answers one WQE per QP with a NAK (invalid request, remote access
    error, remote operational error): the WQEs before it complete, it gets the matching
    error CQE, its QP goes to ERR and every WQE behind it is flushed; a QP without a NAK
    carries on."""
    rng = random.Random(13)
    tb = NicTB(dut, seed=13, memory_latency=100)
    await tb.reset()
    qps = await tb.setup(qps=4)
    fill_data(tb, rng)
    codes = {1: (1, mlx5.Syndrome.REMOTE_INVAL_REQ_ERR), 2: (2, mlx5.Syndrome.REMOTE_ACCESS_ERR),
             3: (3, mlx5.Syndrome.REMOTE_OP_ERR)}
    work = []
    for q in qps:
        items = [random_wqe(tb, rng, small=True) for _ in range(8)]
        for f in items:
            f["fm_ce_se"] = mlx5.CTRL_CQ_UPDATE
        work.append([(q, tb.blocks_of(**f), tb.builder(q, **f), n) for n, f in enumerate(items)])
    for q, (code, syndrome) in codes.items():
        tb.nak_wqe(q, 4, code, syndrome)
    await post_all(tb, work)
    await tb.drain()
    await tb.check_clean()
    assert len(tb.completed[0]) == 8 and all(c.syndrome == 0 for c in tb.completed[0])
    for q, (code, syndrome) in codes.items():
        assert [c.syndrome for c in tb.completed[q]] == \
            [0] * 4 + [int(syndrome)] + [mlx5.Syndrome.WR_FLUSH_ERR] * 3
        assert await tb.read(rmap.context_offset("qp", q, "state")) == ERR
    assert (await tb.counters())["naks_received"] == 3


@cocotb.test()
async def full_window(dut):
    """A QP's record queue filled to one less than its depth with every ACK held back (all
    its packets on the wire, none answered), then one more WQE posted: a window is one less
    than the completion unit's record queue (docs/nic.md "Completions"), so that WQE waits
    for the window instead of bringing a record the queue refuses. Then the held ACK, one
    cumulative ACK for the last PSN sent, is taken and completes everything, and the rest
    goes on without an answer dropped or a packet sent again."""
    rng = random.Random(17)
    tb = NicTB(dut, seed=17, memory_latency=20, ack_every=1 << 20, coalesce_acks=True)
    tb.hold_acks = True
    await tb.reset()
    qps = await tb.setup(qps=1, mtu=5, max_outstanding=MAX_OUTSTANDING_BLOCKS, ring_every=1 << 20)
    fill_data(tb, rng)

    def writes(count):
        """``count`` 8-byte inline WRITEs of one basic block each."""
        items = []
        for n in range(count):
            fields = dict(opcode=Op.RDMA_WRITE, inline=rng.randbytes(8),
                          raddr=rng.randrange(0, MEMORY_BYTES - 8), rkey=1,
                          fm_ce_se=mlx5.CTRL_CQ_UPDATE if n % 16 == 15 else 0)
            items.append((qps[0], tb.blocks_of(**fields), tb.builder(qps[0], **fields), n))
        return items

    filled = RECORD_QUEUE_DEPTH - 1
    await post_all(tb, [writes(filled)])
    for _ in range(20000):
        if len(tb.wire.data_packets) == filled:
            break
        await tb.cycles(1)
    await tb.cycles(200)
    assert len(tb.wire.data_packets) == filled
    await post_all(tb, [writes(1)])
    await tb.cycles(200)
    tb.hold_acks = False
    tb.flush_acks()
    await post_all(tb, [writes(2 * filled)])
    await tb.drain(limit=20000)
    await tb.check_clean()
    counters = await tb.counters()
    assert counters["rx_dropped_unexpected"] == 0 and counters["packets_resent"] == 0, counters


@cocotb.test()
async def qp_states(dut):
    """Host-side QP state rules: context writes only in RESET, a busy QP cannot be reset,
    an errored and drained QP can be reset and run again from index 0 with a new PSN."""
    rng = random.Random(17)
    tb = NicTB(dut, seed=17, memory_latency=400)
    await tb.reset()
    await tb.setup(qps=2)
    fill_data(tb, rng)
    # Context words are read-only outside RESET.
    await tb.write(rmap.context_offset("qp", 0, "sq_base"), 0, expect_error=True)
    # A QP with work in flight (memory is slow) cannot be reset.
    fields = dict(opcode=Op.RDMA_WRITE, byte_count=4096, lkey=tb.data_key, laddr=DATA_REGION,
                  raddr=0, rkey=1, fm_ce_se=mlx5.CTRL_CQ_UPDATE)
    await tb.gpu.post(0, 1, tb.builder(0, **fields), last=True)
    await tb.cycles(16)     # its fetch granted (docs/nic.md: offered 6 cycles after the doorbell)
    await tb.set_qp_state(0, RESET, expect_error=True)
    await tb.drain()
    # Host moves QP 0 to ERR: its next WQEs are flushed.
    await tb.set_qp_state(0, ERR)
    tb.requester.set_state(0, "ERR")
    for _ in range(3):
        await tb.gpu.post(0, 1, tb.builder(0, **fields), last=True)
    await tb.drain()
    assert [c.syndrome for c in tb.completed[0]] == [0] + [mlx5.Syndrome.WR_FLUSH_ERR] * 3
    # Drained: reset, new context, run again from index 0.
    await tb.set_qp_state(0, RESET)
    qp = tb.qps[0]
    qp.sq_psn = 0xFFFFFE        # wraps within the next message
    await tb.program_qp(qp)
    tb.requester.reset_qp(0)
    tb.responder.add_qp(remote_qpn(0), peer_qpn=0, epsn=qp.sq_psn, mtu=qp.mtu)   # both ends
    tb.gpu.qps[0].__init__(qpn=0, sq_base=qp.sq_base, log_sq_size=qp.log_sq_size,
                           dbr_address=tb.gpu.qps[0].dbr_address)
    for _ in range(4):
        await tb.gpu.post(0, 1, tb.builder(0, **fields), last=True)
    await tb.drain()
    await tb.check_clean()
    assert [c.wqe_counter for c in tb.completed[0][-4:]] == [0, 1, 2, 3]
    # A doorbell for a QP in RESET is ignored and counted.
    await tb.set_qp_state(1, RESET)
    before = await tb.counter("doorbells_not_ready")
    await tb.ring_doorbell(mlx5.doorbell(1, 5))
    assert await tb.counter("doorbells_not_ready") == before + 1
    # Invalid transitions answer SLVERR.
    await tb.set_qp_state(1, 2, expect_error=True)
    await tb.set_qp_state(1, ERR, expect_error=True)


# Items of one build, run on one worker (tb/build_groups.py). The first random mix (seed 1)
# runs in test_nic_random_capture_decodes_in_tshark, which also decodes its wire.
@pytest.mark.parametrize("tests, count", [
    ("random_operations.*seed=[23]", 2),
    ("zero_load_latency|doorbell_storm|bad_wqes|nvshmem_nop_and_dump|remote_naks|full_window|qp_states",
     9),
], ids=["random", "directed"])
def test_nic(tests, count):
    runner.run(module="tb.test_nic", toplevel="nic_top", factory=nic_top, params=NIC,
               test_filter=tests, expect_tests=count, build_args=BUILD_ARGS)


def test_nic_random_capture_decodes_in_tshark():
    """The first random operation mix, its wire captured as pcapng and read back by tshark:
    every request packet decodes with the LRH/BTH fields it was sent with. Without tshark
    the mix still runs; only the decoding is skipped."""
    from models.pcap import tshark_data_mismatches
    run_dir = runner.run(module="tb.test_nic", toplevel="nic_top", factory=nic_top, params=NIC,
                         test_filter="random_operations.*seed=1", expect_tests=1,
                         build_args=BUILD_ARGS)
    packets = [bytes.fromhex(h) for h in json.loads((run_dir / "nic_capture.json").read_text())]
    assert len(packets) > 300
    if not shutil.which("tshark"):
        pytest.skip("tshark not installed: apt-get install tshark (CI installs it); the mix ran")
    assert not tshark_data_mismatches(run_dir / "nic_capture.pcapng", packets)
