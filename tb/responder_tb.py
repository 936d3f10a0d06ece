"""cocotb testbench for the NIC's responder: :class:`tb.nic_top.NicTop` with the Python side of
the cable as the requester.

:class:`ResponderTB` is a :class:`tb.nic_tb.NicTB` whose remote end sends hand-made request
packets (valid, hostile, malformed, fuzzed) into the NIC. Each packet also goes, in the
same order, through :class:`models.nic.NicResponderModel` (the reference of
docs/nic-responder.md) working on a mirror of the NIC's memory; the model says which
responses must come back (compared byte for byte, in order per QP), which receive CQEs
the NIC must write, and how the memory must end. :meth:`check_responder` waits for all
of it, then compares the NIC's whole memory outside the CQs with the mirror and every
responder counter with the model's.
"""
from collections import defaultdict, deque

from cocotb.triggers import RisingEdge

from hdl.nic.signatures import MAX_OUTSTANDING_BLOCKS
from models import mlx5
from models.nic import CqContext, QpContext, NicResponderModel, make_packet, mkey_index
from tb.nic_tb import CQ_REGION, CQ_STRIDE, MEMORY_BYTES, NIC_LID, REMOTE_LID, NicTB

__all__ = ["ResponderTB", "RESPONDER_COUNTERS", "REQUESTER_QPN", "RQ_REGION", "RQ_DBR_REGION"]

RQ_REGION = 0x400000            # QP q's receive queue at RQ_REGION + 0x1000 * q
RQ_DBR_REGION = 0x180000        # QP q's receive doorbell record at + 64 * q
RESPONDER_COUNTERS = (
    "requests_received", "rx_request_icrc_drops", "rx_request_malformed", "requests_executed",
    "duplicate_requests", "seq_naks", "rnr_naks", "access_naks", "invalid_naks", "op_naks",
    "rx_dropped_qp", "rx_dropped_pkey", "atomic_replays", "recv_wqes_consumed",
    "recv_wqe_errors", "rq_doorbell_reads")


def REQUESTER_QPN(q):
    """The remote requester's QP number talking to the NIC's QP ``q``."""
    return 0x300 + q


class ResponderTB(NicTB):
    def __init__(self, dut, *, seed=1, memory_latency=100):
        super().__init__(dut, seed=seed, memory_latency=memory_latency)
        self.mirror = bytearray(MEMORY_BYTES)
        self.model = None
        self.pending = defaultdict(deque)       # requester QPN -> responses to come, in order
        self.recv_pending = defaultdict(deque)  # CQN -> receive completions to come
        self.next_psn = {}                      # NIC QP -> the next PSN the requester uses

    # --- set-up ---------------------------------------------------------------------------

    def host_write(self, address, data):
        """A write by the NIC's host: into the NIC's memory and the model's mirror."""
        self.memory.write(address, data)
        self.mirror[address:address + len(data)] = data

    async def setup_responder(self, qps, *, mkeys, mtu=3, access=0xE, access_of=None,
                              log_rq_size=6, cqs=2):
        """NIC QPs ``0 .. qps - 1`` in RTS, answering the remote requester QPs
        :func:`REQUESTER_QPN`, with remote rights ``access`` (``access_of``: per QP
        exceptions), path MTU code ``mtu`` and a
        receive queue each; receive completions on CQ ``q % cqs``. ``mkeys``: the memory
        keys (:class:`models.nic.Mkey`) to program."""
        for c in range(cqs):
            cq = CqContext(cqn=c, base=CQ_REGION + c * CQ_STRIDE, log_size=10)
            self.cqs[c] = cq
            await self.program_cq(cq)
        table = {}
        for key in mkeys:
            table[mkey_index(key.key, self.num_mkeys)] = key
            self.mkeys[key.key] = key
            await self.program_mkey(key)
        for q in range(qps):
            psn = self.rng.randrange(1 << 24)
            qp = QpContext(qpn=q, sq_base=0x200000 + 0x10000 * q, log_sq_size=6, mtu=mtu,
                           sl=q % 16, max_outstanding=MAX_OUTSTANDING_BLOCKS, dest_qpn=REQUESTER_QPN(q),
                           dlid=REMOTE_LID, pd=0x1234, pkey=0xFFFF, sq_psn=0, cqn=q % cqs,
                           access=(access_of or {}).get(q, access), rq_psn=psn,
                           min_rnr_timer=3,
                           rq_base=RQ_REGION + 0x1000 * q, log_rq_size=log_rq_size,
                           rq_dbr=RQ_DBR_REGION + 64 * q, rcqn=q % cqs)
            self.qps[q] = qp
            self.next_psn[q] = psn
            await self.program_qp(qp)
        self.model = NicResponderModel(lid=NIC_LID, memory=self.mirror, contexts=self.qps,
                                    num_qps=self.num_qps, mkeys=table, num_mkeys=self.num_mkeys,
                                    sl_to_vl=self.sl_to_vl, num_vls=self.num_vls)

    async def reset_qps(self, qpns):
        """The host moves each QP to RESET and back to RTS (a QP an error left in ERR runs
        again), with an empty receive queue (doorbell record 0); the model alike; the
        requester restarts at the QP's ``rq_psn``."""
        for q in qpns:
            self.host_write(self.qps[q].rq_dbr, mlx5.rq_doorbell_record(0))
            await self.set_qp_state(q, 0)
            await self.set_qp_state(q, 3)
            self.model.reset_qp(q)
            self.next_psn[q] = self.qps[q].rq_psn

    def post_receive(self, qpn, length, lkey, addr):
        """The NIC's host posts a receive WQE on QP ``qpn`` (model and memory alike)."""
        qp = self.qps[qpn]
        pi = self.model.post_recv(qpn, length, lkey, addr)
        slot = qp.rq_base + mlx5.RECV_WQE_BYTES * (pi % (1 << qp.log_rq_size))
        self.memory.write(slot, bytes(self.mirror[slot:slot + mlx5.RECV_WQE_BYTES]))
        self.memory.write(qp.rq_dbr, bytes(self.mirror[qp.rq_dbr:qp.rq_dbr + 4]))

    # --- requests -------------------------------------------------------------------------

    def request(self, q, opcode, *, psn=None, payload=b"", ext=(), ackreq=1, **overrides):
        """A request packet from the remote requester to the NIC's QP ``q`` (at the QP's
        next PSN unless ``psn``; that PSN then moves on); ``overrides`` replace any
        :func:`models.nic.make_packet` argument."""
        qp = self.qps[q]
        if psn is None:
            psn = self.next_psn[q]
            self.next_psn[q] = (psn + 1) % (1 << 24)
        fields = dict(vl=self.sl_to_vl[qp.sl], sl=qp.sl, dlid=NIC_LID, slid=REMOTE_LID,
                      opcode=opcode, destqp=q, psn=psn, pkey=0xFFFF, ackreq=ackreq, ext=ext,
                      payload=payload)
        fields.update(overrides)
        return make_packet(**fields)

    def send(self, packet, *, end_bad=False, arrives_as=...):
        """Send ``packet`` into the NIC on the VL its LRH names (VL 0 if the port lacks it:
        a QP's packets share one VL, so they stay in order); the model predicts what the
        responder does with it. ``arrives_as``: what the link delivers to the responder
        when that is not the packet itself (a packet longer than its LRH.PktLen is cut
        there by the sending link port), None for nothing; ``end_bad`` packets are dropped
        by the NIC's link port."""
        vl = packet[0] >> 4 if packet else 0
        vl = vl if vl < self.num_vls else 0
        arrives = None if end_bad else packet if arrives_as is ... else arrives_as
        decision = None
        if arrives is not None:
            decision = self.model.process(arrives)
            for response in decision.packets:
                destqp = int.from_bytes(response[13:16], "big")
                self.pending[destqp].append(response)
            for completion in decision.completions:
                self.recv_pending[completion.cqn].append(completion)
        self.sources[vl].send(packet, end_bad=end_bad)
        return decision

    def on_response(self, packet):
        destqp = int.from_bytes(packet[13:16], "big")
        queue = self.pending.get(destqp)
        if not queue:
            self.errors.append(f"unexpected response for QP {destqp:#x}: {packet.hex()}")
            return
        want = queue.popleft()
        if packet != want:
            self.errors.append(f"QP {destqp:#x}: response\n  {packet.hex()}\nexpected\n  {want.hex()}")

    def _memory_written(self, address, data):
        if not CQ_REGION <= address < CQ_REGION + CQ_STRIDE * max(len(self.cqs), 1):
            return              # payload: compared with the mirror at the end
        cqn = (address - CQ_REGION) // CQ_STRIDE
        cq = self.cqs[cqn]
        pi = self.cq_pi[cqn]
        self.cq_pi[cqn] += 1
        if address != mlx5.cqe_address(cq.base, cq.log_size, cq.collapsed, pi):
            self.errors.append(f"CQ {cqn}: CQE {pi} at {address:#x}")
        cqe = mlx5.parse_cqe(data)
        if not self.recv_pending[cqn]:
            self.errors.append(f"CQ {cqn}: unexpected CQE {cqe}")
            return
        want = self.recv_pending[cqn].popleft().cqe(owner=mlx5.cqe_owner(pi, cq.log_size))
        if cqe != want:
            self.errors.append(f"CQ {cqn}: CQE {cqe}, expected {want}")

    # --- end of test ----------------------------------------------------------------------

    def responder_outstanding(self):
        return (sum(len(q) for q in self.pending.values())
                + sum(len(q) for q in self.recv_pending.values())
                + sum(0 if s.idle_now else 1 for s in self.sources.values()))

    async def check_responder(self, limit=200000, quiet=300):
        """Wait until every predicted response and receive CQE came and ``quiet`` more
        cycles passed (nothing unexpected follows), then compare the whole memory outside
        the CQs and every responder counter with the model."""
        for _ in range(limit):
            if self.errors or self.responder_outstanding() == 0:
                break
            await RisingEdge(self.clock)
        else:
            raise AssertionError(f"{self.responder_outstanding()} responses, CQEs or packets "
                                 "outstanding")
        await self.cycles(quiet)
        assert not self.errors, "\n".join(self.errors[:10])
        cq_end = CQ_REGION + CQ_STRIDE * len(self.cqs)
        actual = self.memory.read(0, MEMORY_BYTES)
        for lo, hi in ((0, CQ_REGION), (cq_end, MEMORY_BYTES)):
            if actual[lo:hi] != self.mirror[lo:hi]:
                first = next(i for i in range(lo, hi) if actual[i] != self.mirror[i])
                raise AssertionError(f"memory differs from the model from {first:#x}: "
                                     f"{actual[first:first + 16].hex()} != "
                                     f"{self.mirror[first:first + 16].hex()}")
        counters = await self.counters()
        wrong = {name: (counters[name], self.model.counters[name]) for name in RESPONDER_COUNTERS
                 if counters[name] != self.model.counters[name]}
        assert not wrong, f"counters (NIC, model): {wrong}"
        for v in range(self.num_vls):
            assert not self.sinks[v].errors, self.sinks[v].errors[:5]
        assert int(self.dut.remote_overflow.value) == 0
