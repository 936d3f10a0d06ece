"""Two NICs back to back under Verilator: each GPU posts RC work to the other's memory
(tb/nic_pair_tb.py). Every test ends with :meth:`tb.nic_pair_tb.NicPairTB.check_clean`:
every WQE and receive completed exactly once with the CQE the models predict, and each
whole memory (outside its CQs, READ data and atomic results included) equals the models'
byte for byte.

Loss (docs/nic-reliability.md): the cables' fault injectors corrupt or drop data packets
at random; the outcome must be the same as without loss, and
:meth:`tb.nic_pair_tb.NicPairTB.check_loss` ties the link drop counters to the injected
faults and the retransmission counters to what was lost. ``lossy_mix`` runs the cases in
``LOSS_CASES`` (JSON ``[[rate, mode, seed, per_qp], ...]``; a few by default, more under
the ``full`` marker, and through a switch). Directed: the sequence NAK for a message still
being sent (its first packet lost), an RNR NAK retried until the receive WQE comes, RNR
retries exhausted, transport retries exhausted (every packet of one direction lost), and
the atomics hammer under loss.
"""
import json
import os
import random

import cocotb
import pytest

from models import mlx5
from hdl.link.signatures import LinkState
from hdl.nic import register_map as rmap
from hdl.nic.signatures import MAX_OUTSTANDING_BLOCKS
from hdl.nic.responder_engine import SAVED_ATOMICS
from tb import runner
from tb.nic_pair_tb import CORRUPT, DROP, RATE_ONE, SOURCE_BYTES, SOURCE_REGION, NicPairTB
from tb.nic_pair_top import BUILD_ARGS, PAIR, nic_pair_top
from tb.wqe_mix import KINDS, RECEIVING_KINDS, wqe_fields

Op = mlx5.Opcode
ATOMIC_AREA = 0x1000            # bytes at the start of each target slice for atomic words


def random_wqe(side, qpn, rng, kinds, limit, cursor, result_cursor):
    """One random, valid WQE's fields from ``side``'s QP ``qpn`` into its peer's target
    slice (``cursor``: the next free offset there, per QP). READs and atomics land in the
    QP's own result slice (``result_cursor``, per QP), never in the payload sources:
    a source changing under a WRITE would make its bytes depend on timing. Returns (kind,
    fields)."""
    kind = rng.choice(kinds)
    base, size = side.peer.target(qpn)
    length = rng.randrange(0, limit + 1)
    if cursor[qpn] + length + 64 > size:
        cursor[qpn] = ATOMIC_AREA
    raddr = base + cursor[qpn] + rng.randrange(64)
    cursor[qpn] += length + 64
    laddr = SOURCE_REGION + rng.randrange(0, SOURCE_BYTES - length - 8)
    if kind in ("read", "fetch_add", "compare_swap", "nvshmem_atomic"):
        rbase, rsize = side.results(qpn)
        if result_cursor[qpn] + length + 72 > rsize:
            result_cursor[qpn] = 0
        laddr = rbase + result_cursor[qpn] + 8 * rng.randrange(8)
        result_cursor[qpn] += length + 72
    return kind, wqe_fields(
        kind, rng, length=length, lkey=side.data_key, laddr=laddr, raddr=raddr,
        rkey=side.peer.data_key,
        read_raddr=SOURCE_REGION + rng.randrange(0, SOURCE_BYTES - length),
        atomic_raddr=base + 8 * rng.randrange(ATOMIC_AREA // 8))


async def run_both(tb, work):
    """Post every side's work (one warp per list) at once and wait until all is rung."""
    tasks = [task for side, lists in work.items() for task in side.gpu.start_warps(lists)]
    for task in tasks:
        await task
    for side in work:
        await side.gpu.flush()


def plan(tb, rng, qps, per_qp, kinds, limit, receive_bytes):
    """Per side, per QP, ``per_qp`` random WQEs, and on the peer one receive WQE for each
    that consumes one (posted before any of them runs). Each QP's last WQE is signaled,
    as the one a quiet waits for: completions come in order, so its CQE tells that the
    unsignaled WQEs before it are done (an unsignaled last READ could otherwise still be
    in flight when the test checks memory). Returns the warps' work lists."""
    work = {}
    for side in tb.sides.values():
        cursor = dict.fromkeys(qps, 0x1000)
        result_cursor = dict.fromkeys(qps, 0)
        lists = []
        for q in qps:
            items = []
            for n in range(per_qp):
                kind, fields = random_wqe(side, q, rng, kinds, limit, cursor, result_cursor)
                if n == per_qp - 1:
                    fields["fm_ce_se"] |= mlx5.CTRL_CQ_UPDATE
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
    await tb.check_loss()
    for side in tb.sides.values():
        counters = await side.host.counters()
        for name in ("requests_executed", "duplicate_requests", "seq_naks", "rnr_naks",
                     "access_naks", "invalid_naks", "op_naks", "rx_dropped_qp",
                     "rx_dropped_pkey", "rx_request_icrc_drops", "rx_request_malformed"):
            assert counters[name] == side.responder.counters[name], (side.name, name)
    with open(f"traffic_seed{seed}.json", "w") as f:        # in the run directory
        json.dump(tb.traffic_record(), f)


# NVSHMEM's adding operations (ibgda_write_atomic_wqe): what each adds to the word.
NVSHMEM_ADDS = {"FETCH_ADD": None, "ADD": None, "SIGNAL_ADD": None, "INC": 1, "FETCH": 0}


async def hammer(tb, rng, per_qp=40, max_outstanding=MAX_OUTSTANDING_BLOCKS, nvshmem_bytes=None):
    """Two QPs on each side fetch-and-add the same word of the peer's memory, each atomic's
    original value to a slot of its own. No update is lost or applied twice: the returned
    values chain, each QP's in its own order, from the word's start to its end (start plus
    every addend). The models execute the QPs one after the other, the NICs interleave
    them, so the original values the mirror got are replaced by the ones checked here.
    ``nvshmem_bytes`` (4 or 8): the atomics are NVSHMEM's adding operations on a word of
    that size, posted as ``ibgda_write_atomic_wqe`` posts them (``NVSHMEM_ADDS``: masked FA
    and, for 8-byte FETCH_ADD, the plain one, mixed on the word), each result landing as
    NVSHMEM reads it (a 4-byte one big-endian)."""
    qps = await tb.setup(qps=2, mtu=5, max_outstanding=max_outstanding)
    nbytes = nvshmem_bytes or 8
    modulus = 1 << (8 * nbytes)
    order = "big" if nbytes == 4 else "little"      # models.mlx5.landed_atomic_result
    work, slots = {}, {}
    for side in tb.sides.values():
        word, _ = side.peer.target(0)
        lists = []
        for q in qps:
            items = []
            base, _ = side.results(q)
            for n in range(per_qp):
                addend = rng.getrandbits(40 if nbytes == 8 else 24)
                fields = dict(opcode=Op.ATOMIC_FA, swap_add=addend)
                if nvshmem_bytes:
                    amo = rng.choice(sorted(NVSHMEM_ADDS))
                    addend = addend if NVSHMEM_ADDS[amo] is None else NVSHMEM_ADDS[amo]
                    fields = dict(mlx5.nvshmem_atomic_fields(amo, nbytes, addend),
                                  byte_count=nbytes)
                slots[(side.name, q, n)] = (base + 8 * n, addend)
                fields.update(lkey=side.data_key, laddr=base + 8 * n, raddr=word,
                              rkey=side.peer.data_key, fm_ce_se=mlx5.CTRL_CQ_UPDATE)
                items.append((q, 1, side.builder(q, **fields), "fa"))
            lists.append(items)
        work[side] = lists
    start = {side.name: int.from_bytes(side.peer.memory.read(side.peer.target(0)[0], nbytes),
                                       "little")
             for side in tb.sides.values()}
    await run_both(tb, work)
    await tb.drain(limit=2_000_000)
    for side in tb.sides.values():
        memory = side.host.memory
        origs = {(q, n): int.from_bytes(memory.read(slots[(side.name, q, n)][0], nbytes), order)
                 for q in qps for n in range(per_qp)}
        # Each QP's atomics run in its order; search the interleavings (an addend of 0 can
        # leave two QPs seeing the same value) for one whose values chain.
        todo, seen, value = [(tuple(0 for _ in qps), start[side.name])], set(), None
        while todo:
            taken, at = todo.pop()
            if all(t == per_qp for t in taken):
                value = at
                break
            for k, q in enumerate(qps):
                if taken[k] < per_qp and origs[(q, taken[k])] == at:
                    after = taken[:k] + (taken[k] + 1,) + taken[k + 1:]
                    if after not in seen:
                        seen.add(after)
                        todo.append((after, (at + slots[(side.name, q, taken[k])][1]) % modulus))
        assert value is not None, f"{side.name}: the returned values do not chain"
        word = side.peer.target(0)[0]
        assert int.from_bytes(side.peer.host.memory.read(word, nbytes), "little") == value
        for (q, n), orig in origs.items():      # the interleaving the NICs chose
            side.memory.write_mirror(slots[(side.name, q, n)][0], orig.to_bytes(nbytes, order))
    await tb.check_clean()


@cocotb.test()
async def atomics_hammer_one_word(dut):
    """Two QPs on each side fetch-and-add one word of the peer's memory (:func:`hammer`)."""
    tb = NicPairTB(dut, seed=7, memory_latency=150)
    await tb.reset()
    await hammer(tb, random.Random(7))
    await tb.check_loss()


@cocotb.test()
@cocotb.parametrize(nbytes=[8, 4])
async def nvshmem_atomics_hammer_one_word(dut, nbytes):
    """:func:`hammer` with NVSHMEM's adding operations as NVSHMEM posts them: masked
    fetch-and-adds (and 8-byte plain FETCH_ADD) of two QPs a side on one word."""
    tb = NicPairTB(dut, seed=9, memory_latency=150)
    await tb.reset()
    await hammer(tb, random.Random(9 + nbytes), per_qp=24, nvshmem_bytes=nbytes)
    await tb.check_loss()


@cocotb.test()
async def atomics_hammer_under_loss(dut):
    """The hammer with 1 in 50 packets corrupted both ways: lost requests and lost
    acknowledgements are sent again, duplicates replayed, nothing added twice."""
    tb = NicPairTB(dut, seed=8, memory_latency=150)
    await tb.reset()
    tb.set_faults("a", 1311, CORRUPT, seed=81)
    tb.set_faults("b", 1311, CORRUPT, seed=82)
    # At most SAVED_ATOMICS atomics in flight per QP: the responder can replay any of them
    # whose acknowledge is lost (docs/nic-responder.md, limits).
    await hammer(tb, random.Random(8), max_outstanding=SAVED_ATOMICS)
    report = await tb.check_loss()
    dut._log.info(f"hammer under loss: {report}")


def loss_cases():
    default = [[65, CORRUPT, 1, 24], [1311, DROP, 3, 24]]
    return [tuple(c) for c in json.loads(os.environ.get("LOSS_CASES", "null")) or default]


@cocotb.test()
@cocotb.parametrize(case=loss_cases())
async def lossy_mix(dut, case):
    """Random mixes of every operation on 8 QP pairs both ways, with data packets
    corrupted or dropped at random on both cables (``LOSS_CASES``: rate / 2**16, mode,
    seed, WQEs per QP)."""
    rate, mode, seed, per_qp = case
    rng = random.Random(seed)
    tb = NicPairTB(dut, seed=seed, memory_latency=100)
    await tb.reset()
    tb.set_faults("a", rate, mode, seed=2 * seed + 1)
    tb.set_faults("b", rate, mode, seed=2 * seed + 2)
    # A short timeout (4: 26,208 cycles) so that lost tails recover quickly, but longer
    # than a WQE waits behind the others' traffic here; at most SAVED_ATOMICS atomics in
    # flight per QP, so that the responder can replay any whose acknowledge is lost.
    qps = await tb.setup(qps=8, ack_timeout=4, max_outstanding=SAVED_ATOMICS)
    work = plan(tb, rng, qps, per_qp=per_qp, kinds=KINDS, limit=3000, receive_bytes=4096)
    await run_both(tb, work)
    await tb.drain(limit=3_000_000)
    await tb.check_clean()
    report = await tb.check_loss()
    for side in tb.sides.values():
        counters = await side.host.counters()
        # Duplicates, sequence NAKs and replays depend on what was lost; what executes
        # does not.
        for name in ("requests_executed", "access_naks", "invalid_naks", "op_naks",
                     "rx_dropped_qp", "rx_dropped_pkey", "rx_request_malformed"):
            assert counters[name] == side.responder.counters[name], (side.name, name)
        # A corrupted request the link port had started to pass on arrives marked
        # end-bad (its VCRC is checked at its end): dropped by the responder.
        assert counters["rx_request_icrc_drops"] <= tb.faults(side.peer.name), side.name
    dut._log.info(f"rate {rate}/65536 mode {mode} seed {seed}: {report}, "
                  f"{tb.loop.cycle} cycles")


@cocotb.test()
async def cable_cut_and_restored(dut):
    """The cable between the NICs is cut both ways in the middle of random traffic and
    restored once both links went down (docs/link.md, Link failure and recovery): the links
    re-initialise by themselves and RC retransmission recovers what the cut lost. Every WQE
    completes without error, every memory equals the models', each link re-initialised
    once, and the requesters retransmitted."""
    rng = random.Random(9)
    tb = NicPairTB(dut, seed=9, memory_latency=100)
    await tb.reset()
    qps = await tb.setup(qps=4, ack_timeout=4, max_outstanding=SAVED_ATOMICS)
    work = plan(tb, rng, qps, per_qp=12, kinds=KINDS, limit=3000, receive_bytes=4096)
    posting = cocotb.start_soon(run_both(tb, work))
    await tb.cycles(1500)
    for side in tb.sides:
        tb.cut(side)
    active = LinkState.ACTIVE.value
    for waited in range(30000):
        if all(int(getattr(dut, f"{side}_link_state").value) != active for side in tb.sides):
            break
        await tb.cycles(1)
    else:
        raise AssertionError("a link stayed ACTIVE over a cut cable")
    dut._log.info(f"both links down {waited} cycles after the cut")
    await tb.cycles(200)
    for side in tb.sides:
        tb.cut(side, False)
    await posting
    await tb.drain(limit=3_000_000)
    await tb.check_clean()
    resent = 0
    for side in tb.sides.values():
        assert await side.host.read(rmap.register_offset("link")) >> 32 == 1, side.name
        counters = await side.host.counters()
        resent += sum(v for k, v in counters.items() if k.startswith("retransmits_"))
    assert resent > 0, "nothing was lost on the cut cable"
    dut._log.info(f"cable cut and restored: {resent} retransmissions, {tb.loop.cycle} cycles")


@cocotb.test()
@cocotb.parametrize(mode=[CORRUPT, DROP])
async def nak_for_message_in_flight(dut, mode):
    """One QP, one 64 KiB WRITE (16 packets of 4 KiB, about 1,040 cycles on the wire),
    its first packet lost: B's sequence NAK comes back while A is still sending the
    message (past the last PSN A's completion unit knew of when records came with a
    message's last packet, issue 18). A rewinds on that NAK, not on the timer
    (``ack_timeout`` 4: 26,214 cycles), and every byte lands."""
    tb = NicPairTB(dut, seed=14, memory_latency=100)
    await tb.reset()
    await tb.setup(qps=1, mtu=5, ack_timeout=4)
    a, b = tb.a, tb.b
    base, _ = b.target(0)
    tb.set_faults("a", RATE_ONE, mode, seed=3)       # every packet, until the first is hit
    await a.gpu.post(0, 1, a.builder(0, opcode=Op.RDMA_WRITE, byte_count=64 * 1024,
                                     lkey=a.data_key, laddr=SOURCE_REGION, raddr=base + 0x1000,
                                     rkey=b.data_key, fm_ce_se=mlx5.CTRL_CQ_UPDATE), last=True)
    for _ in range(2000):
        if tb.faults("a"):
            break
        await tb.cycles(1)
    tb.set_faults("a", 0, mode, seed=3)
    await tb.drain(limit=200000)
    await tb.check_clean()
    await tb.check_loss()
    assert tb.faults("a") == 1 and tb.lost_entries("a") == [0], tb.lost_entries("a")
    counters = await a.host.counters()
    seen = {name: counters[name] for name in ("naks_received", "rx_dropped_unexpected",
                                              "retransmits_nak", "retransmits_timeout")}
    assert seen == dict(naks_received=1, rx_dropped_unexpected=0, retransmits_nak=1,
                        retransmits_timeout=0), seen


@cocotb.test()
async def rnr_send_before_receive(dut):
    """A SEND whose receive WQE the responder does not have yet is RNR NAKed, and sent
    again after each RNR wait (rnr_retry 7: without limit; RNR timer code 1, 10 us); once
    the receive WQE is posted, it completes, and everything behind it."""
    tb = NicPairTB(dut, seed=11, memory_latency=100)
    await tb.reset()
    await tb.setup(qps=1, mtu=3, min_rnr_timer=1, rnr_retry=7)
    a, b = tb.a, tb.b
    base, size = b.target(0)
    give = b.post_receive(0, 1000, base + size - 1024, deliver=False)
    await a.gpu.post(0, 1, a.builder(0, opcode=Op.SEND, byte_count=700, lkey=a.data_key,
                                     laddr=SOURCE_REGION + 64, fm_ce_se=mlx5.CTRL_CQ_UPDATE))
    await a.gpu.post(0, 1, a.builder(0, opcode=Op.RDMA_WRITE, byte_count=300, lkey=a.data_key,
                                     laddr=SOURCE_REGION + 4096, raddr=base + 0x2000,
                                     rkey=b.data_key, fm_ce_se=mlx5.CTRL_CQ_UPDATE), last=True)
    await tb.cycles(40000)                   # about ten RNR waits
    assert tb.outstanding() == 3, "completed before its receive WQE was there"
    counters = await a.host.counters()
    assert counters["retransmits_rnr"] >= 3, counters["retransmits_rnr"]
    assert counters["retries_exhausted"] == 0
    give()
    await tb.drain()
    await tb.check_clean()
    assert (await b.host.counters())["rnr_naks"] >= 3


@cocotb.test()
async def rnr_retries_exhausted(dut):
    """rnr_retry 1 and a receive WQE that never comes: the SEND completes with
    RNR_RETRY_EXC_ERR, the QP goes to ERR, the WQE behind it and a later one are flushed;
    the other QP is unaffected."""
    tb = NicPairTB(dut, seed=12, memory_latency=100)
    await tb.reset()
    await tb.setup(qps=2, mtu=3, min_rnr_timer=1, rnr_retry=1)
    a, b = tb.a, tb.b
    base, _ = b.target(0)
    await a.gpu.post(0, 1, a.builder(0, opcode=Op.SEND, byte_count=100, lkey=a.data_key,
                                     laddr=SOURCE_REGION, fm_ce_se=mlx5.CTRL_CQ_UPDATE))
    # Behind the SEND, out of sequence at the responder until it gives up: never executed.
    await a.gpu.post(0, 1, a.builder(0, deliver=False, opcode=Op.RDMA_WRITE, byte_count=64,
                                     lkey=a.data_key, laddr=SOURCE_REGION, raddr=base + 0x2000,
                                     rkey=b.data_key, fm_ce_se=0), last=True)
    a.expect_retry_error(0, mlx5.Syndrome.RNR_RETRY_EXC_ERR)
    other, _ = b.target(1)
    await a.gpu.post(1, 1, a.builder(1, opcode=Op.RDMA_WRITE, byte_count=64, lkey=a.data_key,
                                     laddr=SOURCE_REGION, raddr=other + 0x2000, rkey=b.data_key,
                                     fm_ce_se=mlx5.CTRL_CQ_UPDATE), last=True)
    await tb.drain(limit=200000)
    await a.gpu.post(0, 1, a.builder(0, opcode=Op.SEND, inline=b"late",
                                     fm_ce_se=mlx5.CTRL_CQ_UPDATE), last=True)
    await tb.drain()
    await tb.check_clean()
    counters = await a.host.counters()
    assert counters["retries_exhausted"] == 1 and counters["retransmits_rnr"] == 1


@cocotb.test()
async def transport_retries_exhausted(dut):
    """Every data packet from A lost (rate 2**16), retry_cnt 2, ack_timeout 1: after two
    timeouts and rewinds A's first WQE completes with TRANSPORT_RETRY_EXC_ERR, the rest
    and a later one are flushed."""
    tb = NicPairTB(dut, seed=13, memory_latency=100)
    await tb.reset()
    await tb.setup(qps=1, mtu=3, retry_cnt=2, ack_timeout=1)
    tb.set_faults("a", RATE_ONE, CORRUPT, seed=5)
    a, b = tb.a, tb.b
    base, _ = b.target(0)
    for n in range(3):
        await a.gpu.post(0, 1, a.builder(0, deliver=False, opcode=Op.RDMA_WRITE,
                                         byte_count=600, lkey=a.data_key,
                                         laddr=SOURCE_REGION + 1024 * n, raddr=base + 0x2000,
                                         rkey=b.data_key, fm_ce_se=mlx5.CTRL_CQ_UPDATE),
                         last=n == 2)
    a.expect_retry_error(0, mlx5.Syndrome.TRANSPORT_RETRY_EXC_ERR)
    await tb.drain(limit=200000)
    await a.gpu.post(0, 1, a.builder(0, deliver=False, opcode=Op.SEND, inline=b"late",
                                     fm_ce_se=mlx5.CTRL_CQ_UPDATE), last=True)
    await tb.drain()
    await tb.check_clean()
    counters = await a.host.counters()
    assert counters["retransmits_timeout"] == 2 and counters["retries_exhausted"] == 1
    assert tb.faults("a") == len(tb.lost_packets("a")) > 0
    assert tb.rx_drops("b")["vcrc"] == tb.faults("a")


# make test runs two items over one build (on one worker: tb/build_groups.py); the
# second random seed and the atomics hammer under loss (about 370 s) run under ``full``.
@pytest.mark.parametrize("tests, count", [
    ("random_both_directions/seed=1|atomics_hammer_one_word|nvshmem_atomics_hammer|rnr_", 6),
    ("lossy_mix|transport_retries_exhausted|nak_for_message_in_flight|cable_cut",
     4 + len(loss_cases())),
    pytest.param("random_both_directions/seed=2|atomics_hammer_under_loss", 2,
                 marks=pytest.mark.full),
], ids=["random", "loss", "more"])
def test_nic_pair(tests, count):
    runner.run(module="tb.test_nic_pair", toplevel="nic_pair_top", factory=nic_pair_top,
               params=PAIR, build_args=BUILD_ARGS, test_filter=tests, expect_tests=count)


@pytest.mark.full
def test_build_flavours_agree():
    """One seed of the random pair test on the private build (every test's) and on the
    public one (cocotb's --public-flat-rw: every internal signal a VPI variable, the NIC's
    C++ five times larger): the same cycles and the same traffic on both cables. A
    synchronous design must not behave differently with how Verilator was asked to build
    it; a difference is a combinational path or multiple driver that evaluation order
    exposes, or a testbench sampling at the wrong moment. Full only: the public build
    compiles about 164 MB of C++."""
    records = {}
    for public in (False, True):
        run_dir = runner.run(module="tb.test_nic_pair", toplevel="nic_pair_top",
                             factory=nic_pair_top, params=PAIR, build_args=BUILD_ARGS,
                             test_filter="random_both_directions/seed=1", expect_tests=1,
                             public=public)
        records["public" if public else "private"] = json.loads(
            (run_dir / "traffic_seed1.json").read_text())
    assert records["private"] == records["public"], records


# Longer and more lossy runs: 1/1000, 1/50 and 1/10, corrupted and dropped, more seeds.
LONG_CASES = [[rate, mode, seed, 48] for seed, (rate, mode) in enumerate(
    [(65, CORRUPT), (65, DROP), (1311, CORRUPT), (1311, DROP), (6554, CORRUPT),
     (6554, DROP)], start=20)]


@pytest.mark.full
def test_nic_pair_lossy_long():
    runner.run(module="tb.test_nic_pair", toplevel="nic_pair_top", factory=nic_pair_top,
               params=PAIR, build_args=BUILD_ARGS, test_filter="lossy_mix", expect_tests=len(LONG_CASES),
               extra_env={"LOSS_CASES": json.dumps(LONG_CASES)})


@pytest.mark.full
def test_nic_pair_through_switch_lossy():
    """A second Verilator build (the pair through a switch): the loss cases once."""
    runner.run(module="tb.test_nic_pair", toplevel="nic_pair_top", factory=nic_pair_top,
               params={**PAIR, "through_switch": True}, build_args=BUILD_ARGS,
               test_filter="lossy_mix", expect_tests=len(loss_cases()))
