"""CqeWriter (hdl/nic/cqe_writer.py), the completion unit's CQE writer, alone in Amaranth's
simulator.

Completed records (``job``, as the engine hands them over) and receive completions
(``receive``) come with random gaps and respect ``ready``; the CQ contexts answer a cycle
after their address as the register file does; ``landed`` moves on slowly; AW and W are
taken at random (tb/axi_write_slave.py), B comes late, some SLVERR. Checked against
models/mlx5.py: every CQE (all 64 bytes, owner bit included) at its CQ's producer index (one
index per CQ, shared by both kinds, entry 0 when collapsed) in each source's order; every
record retires once, in order, with its QPN, blocks and ``next_psn``, in the cycle the later
of its CQE's AW and W moved (at once without a CQE); records that write nothing (not
signaled, an unknown CQ or receive opcode) write nothing; a READ's or atomic's CQE not before
``landed`` has passed its response; a ``cq_reset`` on an idle writer starts its CQ at 0 again;
the counters; and at the end nothing is left (both queues empty, no AW or W pending, every
B taken). Also: idle with no input, one CQE per cycle with AXI always ready, parameters.
"""
import random
from collections import deque

import pytest

from hdl.nic.cqe_writer import CompletedJobLayout, CqeWriter
from hdl.nic.signatures import QPN_BITS, ReceiveCompletionLayout
from models import mlx5
from tb.amaranth_sim import assert_rejected, simulate
from tb.axi_write_slave import AxiWriteSlave

SEQ_BITS = 16
REQ_OPCODES = (mlx5.CqeOpcode.REQ, mlx5.CqeOpcode.REQ_ERR)
RECV_GOOD = (1, 2, 3, 14)          # RESP_WR_IMM, RESP_SEND, RESP_SEND_IMM, RESP_ERR


def pack(layout, fields):
    """The bits of a ``layout`` value with ``fields`` (ints; the rest 0)."""
    value = 0
    for name, number in fields.items():
        field = layout[name]
        value |= (int(number) & ((1 << field.width) - 1)) << field.offset
    return value


def seq_passed(landed, seq):
    """``landed`` (the oldest response not written yet) is after ``seq``: its data is in."""
    return ((landed - seq - 1) & ((1 << SEQ_BITS) - 1)) < 1 << (SEQ_BITS - 1)


class Bench:
    def __init__(self, rng, *, num_cqs, cqs, p_job, p_recv, p_aw, p_w, p_land=0.05):
        self.rng = rng
        self.dut = CqeWriter(num_cqs=num_cqs, addr_width=32)
        self.cqs = cqs                              # per CQ: (base, log_size, collapsed)
        self.p_job, self.p_recv, self.p_land = p_job, p_recv, p_land
        self.slave = AxiWriteSlave(self.dut.axi, rng, base=0, size=1 << 16, bid=0, p_aw=p_aw,
                                   p_w=p_w, b_delay=10, p_slverr=0.1)
        self.pi = [0] * num_cqs
        self.jobs, self.recvs = deque(), deque()    # to offer
        self.retires = deque()                      # jobs offered, not retired
        self.req_cqes = deque()                     # requester CQEs expected, in order
        self.recv_cqes = deque()                    # receive CQEs expected, in order
        self.aws, self.ws = deque(), deque()        # AW addresses, W data not yet paired
        self.paired_at = deque()                    # cycles requester CQEs were both taken
        self.landed = 0
        self.passed_at = {}                         # data_seq -> cycle landed passed it
        self.count = {"cqes": 0, "errors": 0, "recv": 0}

    def add_job(self, *, qpn, cqn, wqe_index, blocks, opcode, byte_count, error=0,
                syndrome=0, signaled=1, wait_data=0, data_seq=0, next_psn=0):
        write_cqe = (error or signaled) and cqn < len(self.cqs)
        self.jobs.append(dict(qpn=qpn, cqn=cqn, wqe_index=wqe_index, wqe_blocks=blocks,
                              opcode=opcode, byte_count=byte_count, error=error,
                              syndrome=syndrome, write_cqe=write_cqe, wait_data=wait_data,
                              data_seq=data_seq, next_psn=next_psn))

    def add_recv(self, *, qpn, cqn, opcode, byte_count=0, imm=0, wqe_counter=0, syndrome=0):
        self.recvs.append(dict(qpn=qpn, cqn=cqn, opcode=opcode, byte_count=byte_count, imm=imm,
                               wqe_counter=wqe_counter, syndrome=syndrome))

    def random_traffic(self, jobs, recvs):
        rng = self.rng
        for n in range(jobs):
            waits = rng.random() < 0.3
            self.add_job(qpn=rng.randrange(1 << QPN_BITS), cqn=rng.randrange(len(self.cqs) + 1),
                         wqe_index=rng.getrandbits(16), blocks=rng.randint(1, 16),
                         opcode=rng.choice([0x08, 0x0A, 0x10, 0x11, 0x12]),
                         byte_count=rng.getrandbits(32), error=rng.random() < 0.2,
                         syndrome=rng.choice([0x05, 0x13, 0x15]), signaled=rng.random() < 0.7,
                         wait_data=waits, data_seq=n // 2 if waits else 0,
                         next_psn=rng.getrandbits(24))
        for _ in range(recvs):
            opcode = rng.choice(RECV_GOOD) if rng.random() < 0.9 else rng.choice([0, 4, 13])
            self.add_recv(qpn=rng.randrange(1 << QPN_BITS), cqn=rng.randrange(len(self.cqs) + 1),
                          opcode=opcode, byte_count=rng.getrandbits(32), imm=rng.getrandbits(32),
                          wqe_counter=rng.getrandbits(16), syndrome=rng.choice([0x02, 0x04]))

    def expect(self, kind, item):
        """The bytes of ``item``'s CQE at its CQ's next producer index, and where."""
        base, log_size, collapsed = self.cqs[item["cqn"]]
        pi = self.pi[item["cqn"]]
        self.pi[item["cqn"]] = (pi + 1) & 0xFFFF
        owner = mlx5.cqe_owner(pi, 0 if collapsed else log_size)
        if kind == "req":
            args = (item["qpn"], item["wqe_index"], item["opcode"])
            cqe = (mlx5.build_error_cqe(*args, item["syndrome"], owner) if item["error"] else
                   mlx5.build_requester_cqe(*args, item["byte_count"], owner))
        else:
            cqe = mlx5.build_responder_cqe(item["qpn"], item["wqe_counter"], item["opcode"],
                                           item["byte_count"], item["imm"], item["syndrome"],
                                           owner)
        return mlx5.cqe_address(base, log_size, collapsed, pi), cqe

    async def run(self, ctx, limit):
        dut, rng = self.dut, self.rng
        for t in range(limit):
            job = self.jobs[0] if self.jobs and rng.random() < self.p_job else None
            recv = self.recvs[0] if self.recvs and rng.random() < self.p_recv else None
            ctx.set(dut.job.valid, job is not None)
            ctx.set(dut.job.payload.as_value(), pack(CompletedJobLayout(), job or {}))
            ctx.set(dut.receive.valid, recv is not None)
            ctx.set(dut.receive.payload.as_value(), pack(ReceiveCompletionLayout(), recv or {}))
            if rng.random() < self.p_land:
                self.landed = (self.landed + 1) & 0xFFFF
            ctx.set(dut.landed, self.landed)
            for seq in range(self.landed):
                self.passed_at.setdefault(seq, t)
            self.slave.drive(ctx, t)
            assert ctx.get(dut.axi.bready) and ctx.get(dut.axi.awlen) == 0
            if job is not None and ctx.get(dut.job.ready):
                self.jobs.popleft()
                self.retires.append(job)
                if job["write_cqe"]:
                    self.req_cqes.append(job)
            if recv is not None and ctx.get(dut.receive.ready):
                self.recvs.popleft()
                known = recv["opcode"] in RECV_GOOD and recv["cqn"] < len(self.cqs)
                if known:
                    self.recv_cqes.append(recv)
            self.check_axi(ctx, t)
            self.check_retire(ctx, t)
            self.slave.respond(ctx, t)
            # The CQ contexts: the entry at the address of this cycle, read next cycle.
            address = ctx.get(dut.cq_config.addr)
            await ctx.tick()
            base, log_size, collapsed = self.cqs[address] if address < len(self.cqs) else (0, 0, 0)
            ctx.set(dut.cq_config.data.as_value(),
                    pack(dut.cq_config.data.shape(),
                         {"base": base, "log_size": log_size, "collapsed": collapsed}))
            if self.done():
                break
        else:
            raise AssertionError(("not drained", len(self.jobs), len(self.recvs),
                                  len(self.retires), len(self.recv_cqes)))
        for _ in range(12):             # B responses in flight, then the counters
            self.slave.drive(ctx, t)
            self.slave.respond(ctx, t)
            await ctx.tick()
            t += 1
        assert not self.slave.b_due and ctx.get(dut.job_level) == 0
        assert not ctx.get(dut.axi.awvalid) and not ctx.get(dut.axi.wvalid)
        assert ctx.get(dut.cqes_written) == self.count["cqes"]
        assert ctx.get(dut.error_cqes) == self.count["errors"]
        assert ctx.get(dut.recv_cqes) == self.count["recv"]
        assert ctx.get(dut.cqe_write_errors) == self.slave.errors

    def check_axi(self, ctx, t):
        aw = self.slave.aw_burst(ctx)
        if aw is not None:
            self.slave.accept_aw(*aw)
            self.aws.append(aw[0])
        beat = self.slave.take_w(ctx)
        if beat is not None:
            assert beat[1] == (1 << 64) - 1 and beat[2], t
            self.ws.append(beat[0])
        while self.aws and self.ws:
            address, cqe = self.aws.popleft(), self.ws.popleft()
            requester = (cqe[63] >> 4) in REQ_OPCODES
            queue = self.req_cqes if requester else self.recv_cqes
            assert queue, (t, "a CQE nobody asked for", cqe.hex())
            item = queue.popleft()
            assert (address, cqe) == self.expect("req" if requester else "recv", item), t
            if requester:
                self.paired_at.append(t)
            self.count["cqes"] += 1
            self.count["errors"] += (cqe[63] >> 4) in (mlx5.CqeOpcode.REQ_ERR,
                                                       mlx5.CqeOpcode.RESP_ERR)
            self.count["recv"] += not requester

    def check_retire(self, ctx, t):
        retire = self.dut.retire
        if not ctx.get(retire.valid):
            return
        assert self.retires, (t, "a retire without a record")
        job = self.retires.popleft()
        assert (ctx.get(retire.payload.qpn), ctx.get(retire.payload.blocks),
                ctx.get(retire.payload.next_psn)) == (job["qpn"], job["wqe_blocks"],
                                                      job["next_psn"]), t
        if job["wait_data"] and not job["error"]:
            assert t >= self.passed_at.get(job["data_seq"], t + 1) + 2, (t, "before its data")
        if job["write_cqe"]:
            assert self.paired_at and self.paired_at.popleft() == t, (t, "retire not with CQE")

    def done(self):
        return not (self.jobs or self.recvs or self.retires or self.recv_cqes or self.aws
                    or self.ws or self.req_cqes)


def run(bench, limit=4000):
    async def testbench(ctx):
        await bench.run(ctx, limit)

    simulate(bench.dut, testbench)


CQS = [(0x1000, 2, 0), (0x2000, 3, 1), (0x3000, 4, 0)]


@pytest.mark.parametrize("seed", [1, 2])
def test_random(seed):
    bench = Bench(random.Random(seed), num_cqs=3, cqs=CQS, p_job=0.6, p_recv=0.4, p_aw=0.6,
                  p_w=0.5)
    bench.random_traffic(80, 60)
    run(bench)


def test_fast():
    """AXI always ready, both kinds on offer every cycle: one CQE per cycle once running."""
    rng = random.Random(5)
    bench = Bench(rng, num_cqs=3, cqs=CQS, p_job=1, p_recv=1, p_aw=1, p_w=1)
    for n in range(30):
        bench.add_job(qpn=n, cqn=n % 3, wqe_index=n, blocks=1, opcode=0x0A, byte_count=n)
        bench.add_recv(qpn=n, cqn=n % 3, opcode=2, byte_count=n, wqe_counter=n)
    run(bench, limit=80)
    assert bench.count["cqes"] == 60


def test_idle_and_cq_reset():
    """Nothing offered: no AW, W or retire. Then a CQ's ring, its context reset (the writer
    idle), the ring again from index 0."""
    bench = Bench(random.Random(7), num_cqs=3, cqs=CQS, p_job=0.8, p_recv=0.8, p_aw=0.7, p_w=0.7)
    dut = bench.dut

    async def testbench(ctx):
        ctx.set(dut.job.valid, 0)
        ctx.set(dut.receive.valid, 0)
        for _ in range(20):
            await ctx.tick()
            assert not (ctx.get(dut.axi.awvalid) or ctx.get(dut.axi.wvalid)
                        or ctx.get(dut.retire.valid))
        for n in range(3):
            bench.add_job(qpn=1, cqn=0, wqe_index=n, blocks=2, opcode=0x08, byte_count=8)
        await bench.run(ctx, 200)
        ctx.set(dut.cq_reset.valid, 1)
        ctx.set(dut.cq_reset.qpn, 0)
        await ctx.tick()
        ctx.set(dut.cq_reset.valid, 0)
        bench.pi[0] = 0
        bench.add_recv(qpn=2, cqn=0, opcode=1, imm=0x1234, wqe_counter=9)
        bench.add_job(qpn=1, cqn=0, wqe_index=3, blocks=1, opcode=0x08, byte_count=8)
        await bench.run(ctx, 200)

    simulate(dut, testbench)


@pytest.mark.parametrize("args", [{"num_cqs": 0}, {"num_cqs": 257}, {"addr_width": 15},
                                  {"addr_width": 65}])
def test_parameters(args):
    assert_rejected(CqeWriter, args)
