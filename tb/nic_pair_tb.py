"""cocotb testbench for :class:`tb.nic_pair_top.NicPairTop`: two NICs, each with its GPU and
memory, RC connections between them.

:class:`NicPairTB` owns the clock (2.5 ns, 400 MHz) and reset; each side (:class:`Side`)
has a :class:`tb.nic_host.NicHost` (registers, ``AxiRam`` memory), a GPU
(:class:`tb.gpu_model.GpuModel`) and the models that predict it:

- ``requester`` (:class:`models.nic.RequesterModel`) turns every WQE the GPU posts into its
  packets at the moment it is posted (posting order is ring order);
- the *other* side's ``responder`` (:class:`models.nic.ResponderModel` in hardware mode,
  the reference of the NIC's responder) takes those packets in order per QP and applies
  them to a mirror of that side's memory, recording its receive completions.

Memory: every byte the GPU writes goes to both the ``AxiRam`` and the mirror
(:class:`MirroredMemory`); the NIC's writes land only in the ``AxiRam``. CQ writes are
decoded as they land and must be the next expected completion of their QP (requester CQEs
from the requester model, receive CQEs from the responder model), with the right owner
bit. :meth:`NicPairTB.check_clean` compares each whole memory outside the CQs with its
mirror byte for byte and checks that every completion came exactly once.
"""
import random
from collections import defaultdict, deque

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from hdl.link.signatures import LinkState
from hdl.nic import register_map as rmap
from models import mlx5
from models.nic import CqContext, Mkey, QpContext, RequesterModel, ResponderModel, mkey_index
from tb import runner
from tb.beats import CycleLoop, WireMonitor
from tb.gpu_model import GpuModel, GpuQp
from tb.nic_host import NicHost
from tb.nic_tb import BusMonitor

__all__ = ["NicPairTB", "Side", "MirroredMemory", "CLOCK_NS", "MEMORY_BYTES", "PD"]

CLOCK_NS = 2.5
MEMORY_BYTES = 1 << 24
PD = 0x1234
LIDS = {"a": 0x21, "b": 0x42}
ALL_RIGHTS = 0xF

# Memory map of each side (bytes).
CQ_REGION = 0x010000            # CQ c at CQ_REGION + c * CQ_STRIDE
CQ_STRIDE = 0x010000
DBR_REGION = 0x100000           # QP q: send DBR at + 64 * q, receive DBR at + 0x8000 + 64 * q
SQ_REGION = 0x200000            # QP q's send ring at SQ_REGION + q * SQ_STRIDE
SQ_STRIDE = 0x010000
RQ_REGION = 0x600000            # QP q's receive ring at RQ_REGION + q * RQ_STRIDE
RQ_STRIDE = 0x001000            # 256 receive WQEs
SOURCE_REGION = 0x800000        # local payload sources and READ targets: only this side writes
SOURCE_BYTES = 0x400000
TARGET_REGION = 0xC00000        # written by the other side: a slice per QP
TARGET_BYTES = 0x400000


class MirroredMemory:
    """The GPU's view of its memory: writes go to the ``AxiRam`` the NIC sees and to the
    mirror the models use; reads come from the mirror."""

    def __init__(self, ram, mirror):
        self.ram = ram
        self.mirror = mirror

    def write(self, address, data):
        self.ram.write(address, data)
        self.mirror[address:address + len(data)] = data

    def read(self, address, length):
        return bytes(self.mirror[address:address + length])


class Side:
    """One NIC, its host and its models. ``peer`` is set once both sides exist."""

    def __init__(self, tb, name):
        dut = tb.dut
        self.tb = tb
        self.name = name
        self.lid = LIDS[name]
        self.clock = dut.clk
        self.host = NicHost(dut, f"{name}_", memory_bytes=MEMORY_BYTES, num_mkeys=tb.num_mkeys)
        self.mirror = bytearray(MEMORY_BYTES)
        self.memory = MirroredMemory(self.host.memory, self.mirror)
        self.host.hook_memory_writes(self._nic_wrote)
        self.bus = tb.loop.add(BusMonitor(dut, bus=f"{name}_", nic=f"{name}_"))
        self.wire = tb.loop.add(WireMonitor(dut, f"{name}_wire_monitor", 64, clock_ns=CLOCK_NS))
        self.wire_in = tb.loop.add(WireMonitor(dut, f"{name}_wire_in_monitor", 64,
                                               clock_ns=CLOCK_NS))
        self.writes = []                       # (cycle, address, bytes) of every NIC write
        self.peer = None
        self.qps, self.cqs = {}, {}
        self.mkeys = {}
        self.requester = None
        self.responder = None
        self.gpu = None
        self.expected = defaultdict(deque)     # (qpn, "send" | "recv") -> completions to come
        self.cq_pi = defaultdict(int)

    async def ring_doorbell(self, data8):
        await self.host.ring_doorbell(data8)

    # --- CQEs ----------------------------------------------------------------------------

    def _nic_wrote(self, address, data):
        self.writes.append((self.tb.loop.cycle, address, len(data)))
        if not CQ_REGION <= address < CQ_REGION + CQ_STRIDE * len(self.cqs):
            return          # payload: compared with the mirror at the end
        errors = self.tb.errors
        cqn = (address - CQ_REGION) // CQ_STRIDE
        cq = self.cqs[cqn]
        if len(data) != 64:
            errors.append(f"{self.name}: {len(data)}-byte write at {address:#x} in CQ {cqn}")
            return
        pi = self.cq_pi[cqn]
        self.cq_pi[cqn] += 1
        want_address = mlx5.cqe_address(cq.base, cq.log_size, cq.collapsed, pi)
        if address != want_address:
            errors.append(f"{self.name}: CQ {cqn} CQE {pi} at {address:#x}, expected "
                          f"{want_address:#x}")
        cqe = mlx5.parse_cqe(data)
        if cqe.owner != mlx5.cqe_owner(pi, 0 if cq.collapsed else cq.log_size):
            errors.append(f"{self.name}: CQ {cqn} CQE {pi} owner bit {cqe.owner}")
        kind = "send" if cqe.opcode in (mlx5.CqeOpcode.REQ, mlx5.CqeOpcode.REQ_ERR) else "recv"
        queue = self.expected[(cqe.qpn, kind)]
        if kind == "send":
            while queue and not (queue[0].signaled or queue[0].status != "SENT"):
                queue.popleft()         # unsignaled WQEs complete silently
        if not queue:
            errors.append(f"{self.name}: unexpected {kind} CQE {cqe}")
            return
        expected = queue.popleft()
        want = expected.cqe(owner=cqe.owner)
        if cqe != want:
            errors.append(f"{self.name}: QP {cqe.qpn} {kind} CQE {cqe}, expected {want}")
        if kind == "send":
            self.gpu.completed(cqe.qpn, cqe.wqe_counter, expected.wqe_blocks)

    def outstanding(self):
        return sum(1 for (_, kind), queue in self.expected.items() for r in queue
                   if kind == "recv" or r.signaled or r.status != "SENT")

    # --- posting ---------------------------------------------------------------------------

    def builder(self, qpn, **wqe):
        """A ``build(index)`` for the GPU model: the WQE's bytes at ring index ``index``.
        Its packets are predicted there and then and handed, in order, to the peer's
        responder model, whose receive completions are expected on the peer."""
        def build(index):
            made = mlx5.build_wqe(wqe["opcode"], index, qpn,
                                  **{k: v for k, v in wqe.items() if k != "opcode"})
            result = self.requester.execute(qpn, index, made.data, self.memory.read)
            self.expected[(qpn, "send")].append(result)
            peer = self.peer
            for packet in result.packets:
                decision = peer.responder.process(packet)
                for completion in decision.completions:
                    peer.expected[(completion.qpn, "recv")].append(completion)
            return made.data
        return build

    def post_receive(self, qpn, length, addr):
        """Post a receive WQE of ``length`` bytes at ``addr`` (the model writes it and the
        doorbell record into the mirror; the same bytes go to the NIC's memory)."""
        ctx = self.qps[qpn]
        pi = self.responder.post_recv(qpn, length, self.data_key, addr)
        slot = ctx.rq_base + mlx5.RECV_WQE_BYTES * (pi % (1 << ctx.log_rq_size))
        self.host.memory.write(slot, bytes(self.mirror[slot:slot + mlx5.RECV_WQE_BYTES]))
        self.host.memory.write(ctx.rq_dbr, bytes(self.mirror[ctx.rq_dbr:ctx.rq_dbr + 4]))
        return pi

    def target(self, qpn):
        """The slice of this side's memory QP ``qpn``'s peer writes into."""
        size = TARGET_BYTES // self.tb.max_qps
        return TARGET_REGION + qpn * size, size


class NicPairTB:
    def __init__(self, dut, *, seed=1, memory_latency=200):
        self.dut = dut
        params = runner.tb_params()
        self.num_qps = params.get("num_qps", 64)
        self.num_cqs = params.get("num_cqs", 16)
        self.num_mkeys = params.get("num_mkeys", 64)
        self.num_vls = params.get("num_vls", 2)
        self.max_qps = 16           # QPs a test may set up (target slices)
        self.rng = random.Random(seed)
        self.errors = []
        self.memory_latency = memory_latency
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
        self.loop = CycleLoop(dut.clk)
        dut.memory_latency.value = memory_latency
        self.sides = {name: Side(self, name) for name in ("a", "b")}
        self.switch = None      # with a switch between the NICs: its register master
        if hasattr(dut, "switch_axil__awvalid"):
            from cocotbext.axi import AxiLiteBus, AxiLiteMaster
            self.switch = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "switch_axil",
                                                               bus_separator="__"),
                                        dut.clk, dut.rst)
        self.a, self.b = self.sides["a"], self.sides["b"]
        self.a.peer, self.b.peer = self.b, self.a
        self.sl_to_vl = [sl % self.num_vls for sl in range(16)]

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        cocotb.start_soon(self.loop.run())
        for side in self.sides.values():
            await side.host.write(rmap.register_offset("slid"), side.lid)
        active = LinkState.ACTIVE.value
        for _ in range(20000):
            if all(int(getattr(self.dut, f"{s}_link_state").value) == active for s in "ab"):
                break
            await RisingEdge(self.dut.clk)
        else:
            raise AssertionError("link did not come up")
        if self.switch is not None:
            from hdl.switch import register_map as switch_map
            ft_write = next(r.offset for r in switch_map.register_map(ports=2)
                            if r.name == "ft_write")
            for port, side in enumerate(self.sides.values()):
                entry = sum(value << lo for (_, lo, _), value in
                            zip(switch_map.FT_FIELDS, (side.lid, port, 1)))
                resp = await self.switch.write(ft_write, entry.to_bytes(4, "little"))
                assert int(resp.resp) == rmap.OKAY, "forwarding-table write refused"

    async def setup(self, qps=8, log_sq_size=8, log_rq_size=8, mtu=None, ring_every=1,
                    shared_recv_cq=True):
        """Connect QP q of A with QP q of B for q < ``qps`` (path MTU ``mtu``, random per
        pair if None), one send CQ per QP, receive completions on the same CQ
        (``shared_recv_cq``) or a CQ of their own; a memory key over each whole memory
        with every right; source regions filled with random bytes."""
        if qps > self.max_qps:
            raise ValueError(f"at most {self.max_qps} QPs")
        cqs = qps if shared_recv_cq else 2 * qps
        psns = {(s, q): self.rng.randrange(1 << 24) for s in "ab" for q in range(qps)}
        mtus = [mtu or self.rng.randrange(1, 6) for _ in range(qps)]
        for side in self.sides.values():
            side.data_key = mlx5.make_key(1, 0x5A)
            key = Mkey(key=side.data_key, base=0, length=MEMORY_BYTES, access=ALL_RIGHTS, pd=PD,
                       valid=1)
            side.mkeys = {mkey_index(key.key, self.num_mkeys): key}
            await side.host.program_mkey(key)
            for c in range(cqs):
                cq = CqContext(cqn=c, base=CQ_REGION + c * CQ_STRIDE, log_size=10,
                               collapsed=False)
                side.cqs[c] = cq
                await side.host.program_cq(cq)
            peer = "b" if side.name == "a" else "a"
            for q in range(qps):
                qp = QpContext(qpn=q, sq_base=SQ_REGION + q * SQ_STRIDE, log_sq_size=log_sq_size,
                               mtu=mtus[q], sl=q % 16, max_outstanding=64, dest_qpn=q,
                               dlid=LIDS[peer], pd=PD, pkey=0xFFFF,
                               sq_psn=psns[(side.name, q)], cqn=q,
                               access=ALL_RIGHTS, rq_psn=psns[(peer, q)], min_rnr_timer=1,
                               rq_base=RQ_REGION + q * RQ_STRIDE, log_rq_size=log_rq_size,
                               rq_dbr=DBR_REGION + 0x8000 + 64 * q,
                               rcqn=q if shared_recv_cq else qps + q)
                side.qps[q] = qp
                await side.host.program_qp(qp)
            side.memory.write(SOURCE_REGION, self.rng.randbytes(1 << 16) * (SOURCE_BYTES >> 16))
        for side in self.sides.values():
            side.requester = RequesterModel(slid=side.lid, sl_to_vl=self.sl_to_vl, qps=side.qps,
                                            cqs=side.cqs,
                                            mkeys={k.key: k for k in side.mkeys.values()},
                                            num_mkeys=self.num_mkeys, num_vls=self.num_vls)
            side.responder = ResponderModel(lid=side.lid, memory=side.mirror, contexts=side.qps,
                                            num_qps=self.num_qps, mkeys=side.mkeys,
                                            num_mkeys=self.num_mkeys, sl_to_vl=self.sl_to_vl)
            side.gpu = GpuModel(side, [GpuQp(qpn=q, sq_base=side.qps[q].sq_base,
                                             log_sq_size=log_sq_size,
                                             dbr_address=DBR_REGION + 64 * q)
                                       for q in range(qps)], ring_every=ring_every)
        return list(range(qps))

    # --- end of test ----------------------------------------------------------------------

    def outstanding(self):
        return sum(side.outstanding() for side in self.sides.values())

    async def cycles(self, n):
        for _ in range(n):
            await RisingEdge(self.dut.clk)

    async def drain(self, limit=300000):
        for _ in range(limit):
            if self.errors or self.outstanding() == 0:
                break
            await RisingEdge(self.dut.clk)
        else:
            raise AssertionError(f"not drained after {limit} cycles: {self.outstanding()} "
                                 "completions outstanding")
        assert not self.errors, "\n".join(self.errors[:10])

    async def check_clean(self):
        """Every completion came; each memory equals its mirror outside the CQs."""
        assert not self.errors, "\n".join(self.errors[:10])
        assert self.outstanding() == 0
        await self.cycles(64)           # the last payload writes land after their ACKs
        for side in self.sides.values():
            cq_end = CQ_REGION + CQ_STRIDE * len(side.cqs)
            actual = side.host.memory.read(0, MEMORY_BYTES)
            for lo, hi in ((0, CQ_REGION), (cq_end, MEMORY_BYTES)):
                if actual[lo:hi] != side.mirror[lo:hi]:
                    first = next(i for i in range(lo, hi) if actual[i] != side.mirror[i])
                    raise AssertionError(
                        f"{side.name}: memory differs from the model from {first:#x}: "
                        f"{actual[first:first + 16].hex()} != {side.mirror[first:first + 16].hex()}")
