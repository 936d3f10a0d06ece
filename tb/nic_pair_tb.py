"""cocotb testbench for :class:`tb.nic_pair_top.NicPairTop`: two NICs, each with its GPU and
memory, RC connections between them.

:class:`NicPairTB` owns the clock (2.5 ns, 400 MHz) and reset; each side (:class:`Side`)
has a :class:`tb.nic_host.NicHost` (registers, ``AxiRam`` memory), a GPU
(:class:`tb.gpu_model.GpuModel`) and the models that predict it:

- ``requester`` (:class:`models.nic.RequesterModel`) turns every WQE the GPU posts into its
  packets at the moment it is posted (posting order is ring order);
- the *other* side's ``responder`` (:class:`models.nic.NicResponderModel`,
  the reference of the NIC's responder) takes those packets in order per QP and applies
  them to a mirror of that side's memory, recording its receive completions;
- ``completion`` (:class:`models.nic.CompletionModel`) takes the WQE and the responder's
  answers and gives the requester CQEs; it writes READ data and atomic results into this
  side's mirror, as the NIC's ResponseWriter does.

The models see each request once, in order, as if nothing were lost. Loss on the cables
(``NicPairTop``'s fault injectors, :meth:`NicPairTB.set_faults`) must not change any of the
outcomes: the responder executes each request once whatever the retransmissions, so the
checks are outcome based, and hold with or without loss.

Memory: every byte the GPU writes goes to both the ``AxiRam`` and the mirror
(:class:`MirroredMemory`); the NIC's writes land only in the ``AxiRam``. CQ writes are
decoded as they land and must be the next expected completion of their QP (requester CQEs
from the completion model, receive CQEs from the responder model), with the right owner
bit. :meth:`NicPairTB.check_clean` compares each whole memory outside the CQs with its
mirror byte for byte and checks that every completion came exactly once;
:meth:`NicPairTB.check_loss` checks the link drop counters against the injected faults and
the retransmission counters against what was lost.
"""
import dataclasses
import hashlib
from collections import defaultdict, deque

from cocotb.triggers import ClockCycles, RisingEdge

from hdl.link.link_receiver import DROP_REASONS
from hdl.link.signatures import LinkState
from hdl.nic import register_map as rmap
from hdl.nic.signatures import MAX_OUTSTANDING_BLOCKS
from models import mlx5
from models.crc import vcrc_bytes
from models.nic import (CompletionModel, CqContext, Mkey, QpContext, RequesterModel,
                        NicResponderModel, mkey_index)
from tb import runner
from tb.beats import WireMonitor
from tb.credit_monitor import CreditMonitor
from tb.gpu_model import GpuModel, GpuQp
from tb.nic_host import NicHost
from tb.nic_tb import BusMonitor
from tb.rc_tb import CLOCK_NS, RcTB

__all__ = ["NicPairTB", "Side", "MirroredMemory", "CLOCK_NS", "MEMORY_BYTES", "PD", "CORRUPT",
           "DROP", "RATE_ONE"]

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
SOURCE_REGION = 0x800000        # local payload sources and READ sources: written once at setup
SOURCE_BYTES = 0x200000
RESULT_REGION = 0xA00000        # READ targets and atomic results of this side: a slice per QP
RESULT_BYTES = 0x200000
TARGET_REGION = 0xC00000        # written by the other side: a slice per QP
TARGET_BYTES = 0x400000
# Fault injector modes (tb/gateware/wire_fault.py).
CORRUPT, DROP = 0, 1
RATE_ONE = 1 << 16
RESPONSE_OPCODES = range(0x0D, 0x13)    # READ responses, ACKNOWLEDGE, ATOMIC ACKNOWLEDGE


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

    def write_mirror(self, address, data):
        """What the NIC writes by itself (READ data, atomic results): the mirror only."""
        self.mirror[address:address + len(data)] = data


@dataclasses.dataclass
class _Expected:
    """A requester completion the testbench expects without the completion model."""
    wqe_index: int
    wqe_blocks: int
    cqe: object


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
        # The credit rule at the NIC's transmitter, at its pins (whatever the cable does).
        self.credit_monitor = tb.loop.add(CreditMonitor(
            dut, f"{name}_wire_monitor", f"{name}_wire_in_monitor", 64, tb.num_vls,
            name=f"NIC {name}"))
        self.writes = []                       # (cycle, address, bytes) of every NIC write
        self.peer = None
        self.qps, self.cqs = {}, {}
        self.mkeys = {}
        self.requester = None
        self.responder = None
        self.completion = None
        self.gpu = None
        # (qpn, "send") -> models.nic.Completion, (qpn, "recv") -> RecvCompletion, to come
        self.expected = defaultdict(deque)
        self.cq_pi = defaultdict(int)
        self.opcodes = {}                      # (qpn, wqe_index) -> mlx5 opcode

    async def ring_doorbell(self, data8):
        await self.host.ring_doorbell(data8)

    # --- CQEs ----------------------------------------------------------------------------

    def _nic_wrote(self, address, data):
        self.writes.append((self.tb.loop.cycle, address, len(data)))
        if not CQ_REGION <= address < CQ_REGION + CQ_STRIDE * len(self.cqs):
            return          # payload: compared with the mirror at the end
        errors = self.tb.errors
        cycle = self.tb.loop.cycle
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
            while queue and queue[0].cqe is None:
                queue.popleft()         # unsignaled WQEs complete silently
        if not queue:
            errors.append(f"cycle {cycle}: {self.name}: unexpected {kind} CQE {cqe}")
            return
        expected = queue.popleft()
        # The completion model numbers only requester CQEs; the owner bit is checked above.
        want = dataclasses.replace(expected.cqe, owner=cqe.owner) if kind == "send" else \
            expected.cqe(owner=cqe.owner)
        if cqe != want:
            errors.append(f"cycle {cycle}: {self.name}: QP {cqe.qpn} {kind} CQE {cqe}, "
                          f"expected {want}")
        if kind == "send":
            self.gpu.completed(cqe.qpn, cqe.wqe_counter, expected.wqe_blocks)

    def outstanding(self):
        return sum(1 for (_, kind), queue in self.expected.items() for c in queue
                   if kind == "recv" or c.cqe is not None)

    def check_memory(self):
        """The NIC's memory equals the mirror outside the CQs (CQEs are checked as they land)."""
        cq_end = CQ_REGION + CQ_STRIDE * len(self.cqs)
        actual = self.host.memory.read(0, MEMORY_BYTES)
        for lo, hi in ((0, CQ_REGION), (cq_end, MEMORY_BYTES)):
            if actual[lo:hi] != self.mirror[lo:hi]:
                first = next(i for i in range(lo, hi) if actual[i] != self.mirror[i])
                raise AssertionError(
                    f"{self.name}: memory differs from the model from {first:#x}: "
                    f"{actual[first:first + 16].hex()} != {self.mirror[first:first + 16].hex()}")

    def expect_retry_error(self, qpn, syndrome):
        """QP ``qpn`` gives up (retries exhausted): its oldest WQE not yet completed gets an
        error CQE with ``syndrome``, every later one (posted or still to come) a flush. The
        models are told: the QP is in ERR, nothing it had in flight reached the peer (so the
        caller posts the lost WQEs with ``deliver=False``)."""
        queue = self.expected[(qpn, "send")]
        waiting = list(queue) + list(self.completion.outstanding[qpn])
        queue.clear()
        self.completion.reset_qp(qpn)
        self.requester.set_qp_error(qpn)
        for k, item in enumerate(waiting):
            cqe = mlx5.error_cqe(qpn, item.wqe_index, item.opcode if hasattr(item, "opcode")
                                 else self.opcodes[(qpn, item.wqe_index)],
                                 syndrome if k == 0 else mlx5.Syndrome.WR_FLUSH_ERR)
            queue.append(_Expected(item.wqe_index, item.wqe_blocks, cqe))
        self.completion.progress[qpn].flushing = True

    # --- posting ---------------------------------------------------------------------------

    def builder(self, qpn, deliver=True, **wqe):
        """A ``build(index)`` for the GPU model: the WQE's bytes at ring index ``index``.
        Its packets are predicted there and then and handed, in order, to the peer's
        responder model, whose receive completions are expected on the peer, and whose
        answers go to this side's completion model (which writes READ data and atomic
        results into the mirror and predicts the CQEs). ``deliver=False``: the packets
        never reach the peer (a test that loses every one of them)."""
        def build(index):
            made = mlx5.build_wqe(wqe["opcode"], index, qpn,
                                  **{k: v for k, v in wqe.items() if k != "opcode"})
            result = self.requester.execute(qpn, index, made.data, self.memory.read)
            self.opcodes[(qpn, result.wqe_index)] = result.opcode
            done = self.completion.post(result)
            peer = self.peer
            for packet in result.packets if deliver else ():
                decision = peer.responder.process(packet)
                for completion in decision.completions:
                    peer.expected[(completion.qpn, "recv")].append(completion)
                for answer in decision.packets:
                    done += self.completion.receive(answer)
            for completion in done:
                self.expected[(completion.qpn, "send")].append(completion)
            return made.data
        return build

    def post_receive(self, qpn, length, addr, deliver=True):
        """Post a receive WQE of ``length`` bytes at ``addr`` (the model writes it and the
        doorbell record into the mirror; the same bytes go to the NIC's memory). With
        ``deliver=False`` only the model has it: returns a function that gives the NIC its
        WQE and doorbell record later (a receive the responder's model had in time and the
        NIC not: RNR)."""
        ctx = self.qps[qpn]
        pi = self.responder.post_recv(qpn, length, self.data_key, addr)
        slot = ctx.rq_base + mlx5.RECV_WQE_BYTES * (pi % (1 << ctx.log_rq_size))

        def give():
            self.host.memory.write(slot, bytes(self.mirror[slot:slot + mlx5.RECV_WQE_BYTES]))
            self.host.memory.write(ctx.rq_dbr, bytes(self.mirror[ctx.rq_dbr:ctx.rq_dbr + 4]))
        if not deliver:
            return give
        give()
        return pi

    def results(self, qpn):
        """The slice of this side's memory QP ``qpn``'s READs and atomics write into."""
        size = RESULT_BYTES // self.tb.max_qps
        return RESULT_REGION + qpn * size, size

    def target(self, qpn):
        """The slice of this side's memory QP ``qpn``'s peer writes into."""
        size = TARGET_BYTES // self.tb.max_qps
        return TARGET_REGION + qpn * size, size


class NicPairTB(RcTB):
    drain_limit = 300000

    def __init__(self, dut, *, seed=1, memory_latency=200):
        params = runner.tb_params()
        self.num_qps = params.get("num_qps", 64)
        self.num_cqs = params.get("num_cqs", 16)
        self.num_mkeys = params.get("num_mkeys", 64)
        self.num_vls = params.get("num_vls", 2)
        self.max_qps = 16           # QPs a test may set up (target slices)
        super().__init__(dut, seed=seed, memory_latency=memory_latency)
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
        # The injectors' inputs are the testbench's: an earlier test in the same
        # simulation may have left them losing packets.
        for side in self.sides:
            self.set_faults(side, 0)
            self.cut(side, False)

    def traffic_record(self):
        """What the run put on the cables, and when: the cycle now and, per side, the count
        and a digest of the data packets (start cycle, end-bad, bytes) and link packets
        (cycle, bytes) on its wire. Every build of the same design must give the same
        record (tb/test_nic_pair.py, ``test_build_flavours_agree``)."""
        record = {"cycle": self.loop.cycle}
        for name, side in self.sides.items():
            digest = hashlib.sha1()
            for packet, end_bad, cycle in side.wire.data_packets:
                digest.update(f"data {cycle} {int(end_bad)} {packet.hex()}\n".encode())
            for packet, cycle in side.wire.link_packets:
                digest.update(f"link {cycle} {packet.hex()}\n".encode())
            record[name] = {"data_packets": len(side.wire.data_packets),
                            "link_packets": len(side.wire.link_packets),
                            "digest": digest.hexdigest()}
        return record

    @property
    def nodes(self):
        return list(self.sides.values())

    async def reset(self):
        await super().reset()
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
                    shared_recv_cq=True, ack_timeout=5, retry_cnt=7, rnr_retry=7,
                    min_rnr_timer=1, max_outstanding=MAX_OUTSTANDING_BLOCKS):
        """Connect QP q of A with QP q of B for q < ``qps`` (path MTU ``mtu``, random per
        pair if None), one send CQ per QP, receive completions on the same CQ
        (``shared_recv_cq``) or a CQ of their own; a memory key over each whole memory
        with every right; source regions filled with random bytes. Reliability: local ACK
        timeout code ``ack_timeout`` (4.096 us * 2**n; 5: 52,416 cycles; it must exceed
        the time a QP's oldest WQE can wait behind the traffic of every QP on the link,
        or the timer fires without loss), ``retry_cnt``,
        ``rnr_retry`` (7: without limit), and the RNR timer code each responder sends,
        ``min_rnr_timer`` (1: 10 us); ``max_outstanding`` WQE basic blocks in flight per
        QP (at most ``SAVED_ATOMICS`` keeps the atomics a QP has outstanding within what
        the responder can replay if an acknowledge is lost)."""
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
                               mtu=mtus[q], sl=q % 16, max_outstanding=max_outstanding,
                               dest_qpn=q,
                               dlid=LIDS[peer], pd=PD, pkey=0xFFFF,
                               sq_psn=psns[(side.name, q)], cqn=q,
                               access=ALL_RIGHTS, rq_psn=psns[(peer, q)],
                               min_rnr_timer=min_rnr_timer, retry_cnt=retry_cnt,
                               rnr_retry=rnr_retry, ack_timeout=ack_timeout,
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
            side.responder = NicResponderModel(lid=side.lid, memory=side.mirror, contexts=side.qps,
                                            num_qps=self.num_qps, mkeys=side.mkeys,
                                            num_mkeys=self.num_mkeys, sl_to_vl=self.sl_to_vl)
            side.completion = CompletionModel(side.requester, write_memory=side.memory.write_mirror)
            side.gpu = GpuModel(side, [GpuQp(qpn=q, sq_base=side.qps[q].sq_base,
                                             log_sq_size=log_sq_size,
                                             dbr_address=DBR_REGION + 64 * q)
                                       for q in range(qps)], ring_every=ring_every)
        return list(range(qps))

    # --- loss -----------------------------------------------------------------------------

    def set_faults(self, side, rate, mode=CORRUPT, seed=1):
        """Hit each data packet leaving NIC ``side`` ("a" or "b") with probability
        ``rate / 2**16`` (0: none), corrupting it (``CORRUPT``: the next link receiver drops
        it for its VCRC) or dropping it from the wire (``DROP``). ``seed``: the injector's
        random source (taken at its first packet after reset)."""
        getattr(self.dut, f"{side}_fault_rate").value = rate
        getattr(self.dut, f"{side}_fault_mode").value = mode
        getattr(self.dut, f"{side}_fault_seed").value = seed

    def cut(self, side, cut=True):
        """Cut (or restore) the cable out of NIC ``side``: every beat on it is lost."""
        getattr(self.dut, f"{side}_fault_cut").value = int(cut)

    def faults(self, side):
        return int(getattr(self.dut, f"{side}_faults").value)

    def rx_drops(self, side):
        """NIC ``side``'s link receiver's drop counters."""
        return {reason: int(getattr(self.dut, f"{side}_rx_drop_{reason}").value)
                for reason in DROP_REASONS}

    async def switch_drops(self, port):
        """The switch input ``port``'s drop counters, summed over VLs."""
        from hdl.switch import register_map as switch_map
        totals = dict.fromkeys(DROP_REASONS, 0)
        for vl in range(self.num_vls):
            base = (switch_map.COUNTER_BASE + switch_map.COUNTER_PORT_STRIDE * port
                    + switch_map.COUNTER_VL_STRIDE * vl)
            for k, name in enumerate(switch_map.COUNTER_NAMES):
                if name.startswith("drop_") and name[5:] in totals:
                    resp = await self.switch.read(base + 4 * k, 4)
                    totals[name[5:]] += int.from_bytes(resp.data, "little")
        return totals

    def lost_packets(self, side):
        """The data packets NIC ``side`` sent that did not reach the other end intact
        (:meth:`lost_entries`)."""
        wire = self.sides[side].wire.data_packets
        return [wire[k][0] for k in self.lost_entries(side)]

    def lost_entries(self, side):
        """The indices in NIC ``side``'s ``wire.data_packets`` of the data packets it sent
        that did not reach the other end intact:
        what left its pins against what arrived intact at the peer's, in order per service
        level (a cable keeps the order; a switch keeps it per VL, and a VL is a function of
        the SL, but may interleave VLs differently from the sender). A corrupted packet that
        arrives anyway (its VCRC fails, or a cut-through switch marked it end-bad) is not
        intact, so a lost packet is simply one missing from its SL's sequence: no
        look-alike can be taken for it. The LRH's VL (a switch may map it anew) and the
        VCRC (recomputed with it) are left out of the comparison."""
        def key(packet):
            return bytes([packet[0] & 0x0F]) + packet[1:-2]

        def sl(packet):
            return packet[1] >> 4
        arrived = defaultdict(list)
        for packet, end_bad, _ in self.sides[side].peer.wire_in.data_packets:
            if not end_bad and vcrc_bytes(packet[:-2]) == packet[-2:]:
                arrived[sl(packet)].append(key(packet))
        taken = defaultdict(int)
        lost = []
        for index, (packet, _, _) in enumerate(self.sides[side].wire.data_packets):
            sent, level = key(packet), sl(packet)
            queue = arrived[level]
            if taken[level] < len(queue) and queue[taken[level]] == sent:
                taken[level] += 1
            else:
                lost.append(index)
        extra = sum(len(queue) - taken[level] for level, queue in arrived.items())
        assert extra == 0, f"{side}: {extra} packets arrived never sent"
        return lost

    def marks(self):
        """Where each side's record of sent packets stands now: the start of a
        :meth:`recovery_trace` window."""
        return {name: len(side.wire.data_packets) for name, side in self.sides.items()}

    async def watch_counters(self, side, names, log, every=256):
        """Read NIC ``side``'s counters ``names`` every ``every`` cycles until cancelled,
        appending each change to ``log`` as ``(cycle, side, name, value)``: when a
        rewind or a squash happened, to within ``every`` cycles. Off unless started: the
        reads share the AXI4-Lite port with the doorbells."""
        host = self.sides[side].host
        last = {}
        while True:
            for name in names:
                value = await host.counter(name)
                if last.get(name) != value:
                    log.append((self.loop.cycle, side, name, value))
                    last[name] = value
            await ClockCycles(self.dut.clk, every)

    def sent_packets(self, marks, start=0):
        """``{side: [tb.rc_trace.Packet]}``: the headers of the data packets each side sent
        since ``marks`` (:meth:`marks`), each marked lost or not, cycles counted from
        ``start``; after a drained run."""
        from tb import rc_trace
        sent = {}
        for name, side in self.sides.items():
            lost = set(self.lost_entries(name))
            wire = side.wire.data_packets
            sent[name] = [rc_trace.decode(wire[k], name, k in lost, start)
                          for k in range(marks[name], len(wire))]
        return sent

    def recovery_trace(self, sent, timeout_cycles):
        """The loss-recovery events (:func:`tb.rc_trace.trace`) of ``sent``
        (:meth:`sent_packets`): faults, NAKs, resends and their causes, per QP pair."""
        from tb import rc_trace
        return rc_trace.trace(sent, runner.tb_params()["wire_delay"], timeout_cycles)

    async def check_loss(self):
        """After a drained run: every injected fault is one lost packet, counted where the
        cable ends (the peer's link receiver, or the switch's input, as a ``vcrc`` drop
        when corrupted, not at all when dropped); no other drop anywhere (but for the
        corrupted packets a cut-through switch forwarded marked end-bad, which the peer
        counts as ``end_bad`` drops); the retransmission
        counters are zero without loss and, when a request, a READ response or an atomic
        acknowledge was lost, nonzero on the side that had to send again. Returns
        ``{side: (faults, CompletionUnit counters)}``."""
        report = {}
        counters = {name: await side.host.counters() for name, side in self.sides.items()}
        for name, side in self.sides.items():
            faults = self.faults(name)
            mode = int(getattr(self.dut, f"{name}_fault_mode").value)
            lost = self.lost_packets(name)
            assert len(lost) == faults, f"{name}: {faults} faults injected, {len(lost)} lost"
            if self.switch is None:
                drops = self.rx_drops(side.peer.name)
            else:
                drops = await self.switch_drops(0 if name == "a" else 1)
                after = self.rx_drops(side.peer.name)
                end_bad = after.pop("end_bad")
                assert not any(after.values()) and end_bad <= drops["vcrc"], \
                    f"{side.peer.name}: link drops {after}, end_bad {end_bad}"
            want = dict.fromkeys(DROP_REASONS, 0)
            want["vcrc"] = faults if mode == CORRUPT else 0
            assert drops == want, f"{name} -> {side.peer.name}: drops {drops}, expected {want}"
            # Who must send again: the requester of a lost request (this side), or of a
            # lost READ response / atomic acknowledge (the peer). A lost plain ACK may be
            # covered by a later one.
            for packet in lost:
                opcode = packet[8]
                requester = side.peer if opcode in RESPONSE_OPCODES else side
                if opcode != 0x11:
                    report.setdefault(requester.name + "_must_retry", True)
            report[name] = (faults, {k: v for k, v in counters[name].items()
                                     if k.startswith("retr")})
        total_faults = sum(report[n][0] for n in self.sides)
        for name in self.sides:
            resent = sum(v for k, v in counters[name].items() if k.startswith("retransmits_"))
            if total_faults == 0:
                assert resent == 0, f"{name}: retransmissions without loss: {report[name][1]}"
            if report.get(name + "_must_retry"):
                assert resent > 0, f"{name}: lost packets but no retransmission"
        return {n: report[n] for n in self.sides}
