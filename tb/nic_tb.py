"""cocotb testbench for :class:`tb.nic_top.NicTop`: one NIC, GPU memory, a GPU, a responder.

:class:`NicTB` owns the clock (2.5 ns, 400 MHz), the reset, a 64-bit cocotbext-axi
``AxiLiteMaster`` on the NIC's registers and UAR page (the GPU's MMIO writes), an ``AxiRam``
as GPU memory behind the NIC's AXI4 master (reads delayed by ``memory_latency`` cycles in
the top), and one :class:`tb.beats.CycleLoop` with a packet source and sink per VL at the
remote end of the cable, where a :class:`models.nic.ResponderPeer` answers every request.

Scoreboards:

- **Packets**: every WQE a test posts goes through :class:`models.nic.RequesterModel` at the
  moment the GPU writes it (posting order is ring order), which predicts its packets byte
  for byte. Packets arriving at the remote end are matched per QP, in order (the QP is
  known from BTH.DestQP, unique per QP here).
- **CQEs**: every AXI write into a CQ is decoded as it lands; it must be the next expected
  completion of its QP (its WQE index, opcode, byte count or syndrome) with the right
  owner bit for its CQ's producer index. :meth:`NicTB.check_clean` finally asserts that
  every posted WQE completed exactly once and every predicted packet was seen.
- **READ data and atomic results**: each READ response and ATOMIC ACKNOWLEDGE the
  responder sends predicts one write into the NIC's memory (the payload at the WQE's
  ``laddr`` plus its offset, the original value at ``laddr`` as
  :func:`models.mlx5.landed_atomic_result` lays it out); every other
  write outside the CQs is an error, each predicted write must land exactly once, and a
  READ's or atomic's CQE must come after its data.
"""
import dataclasses
import random
from collections import defaultdict, deque

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from hdl.link.signatures import LinkState
from hdl.nic import register_map as rmap
from hdl.nic.signatures import DESCRIPTOR_INLINE_BYTES, MAX_OUTSTANDING_BLOCKS, PAYLOAD_ID
from models import mlx5
from models.ib import Opcode
from models.nic import (CompletionStatus, CqContext, Mkey, QpContext, RequesterModel,
                        ResponderPeer, decode_packet, psn_diff, psn_le)
from models.packet import parse_packet
from models.pcap import LinkCapture
from tb import runner
from tb.beats import CycleLoop, PacketSink, PacketSource, WireMonitor, backpressure_random
from tb.credit_monitor import CreditMonitor
from tb.gpu_model import GpuModel, GpuQp
from tb.nic_host import NicHost

__all__ = ["NicTB", "BusMonitor", "CLOCK_NS", "MEMORY_BYTES", "NIC_LID", "REMOTE_LID"]

CLOCK_NS = 2.5
MEMORY_BYTES = 1 << 24
NIC_LID = 0x21
REMOTE_LID = 0x42
PD = 0x1234

# GPU memory map (bytes).
CQ_REGION = 0x010000            # CQ c at CQ_REGION + c * CQ_STRIDE
CQ_STRIDE = 0x010000            # room for 1024 CQEs
DBR_REGION = 0x100000           # QP q's doorbell record at DBR_REGION + 64 * q
SQ_REGION = 0x200000            # QP q's ring at SQ_REGION + q * SQ_STRIDE
SQ_STRIDE = 0x010000            # 1024 basic blocks
DATA_REGION = 0x800000          # payload sources, the rest of memory
DATA_BYTES = MEMORY_BYTES - DATA_REGION


def _key(result):
    """A WQE result's key in ``NicTB.landing``."""
    return result.qpn, result.wqe_index


def remote_qpn(qpn):
    """The responder-side QP number paired with our QP ``qpn`` (unique, so BTH.DestQP names
    the QP a packet came from)."""
    return 0x100 + qpn


class NicTB(NicHost):
    def __init__(self, dut, *, seed=1, memory_latency=200, backpressure=0.0, ack_every=1,
                 coalesce_acks=False, capture_path=None):
        self.dut = dut
        self.params = params = runner.tb_params()
        self.num_qps = params.get("num_qps", 64)
        self.num_cqs = params.get("num_cqs", 16)
        self.num_mkeys = params.get("num_mkeys", 64)
        self.num_vls = params.get("num_vls", 2)
        self.wire_delay = params["wire_delay"]
        self.rng = random.Random(seed)
        self.clock = dut.clk
        cocotb.start_soon(Clock(dut.clk, CLOCK_NS, "ns").start())
        super().__init__(dut, "", memory_bytes=MEMORY_BYTES, num_mkeys=self.num_mkeys)
        self.hook_memory_writes(self._memory_written)
        self.memory_latency = memory_latency
        dut.memory_latency.value = memory_latency

        self.loop = CycleLoop(dut.clk)
        self.sources, self.sinks = {}, {}
        for v in range(self.num_vls):
            self.sources[v] = self.loop.add(PacketSource(dut, f"remote_data_in__{v}", 64))
            self.sinks[v] = self.loop.add(PacketSink(
                dut, f"remote_data_out__{v}", 64,
                backpressure=backpressure_random(random.Random(self.rng.random()), backpressure)
                if backpressure else None))
            getattr(dut, f"remote_vl_weight__{v}").value = 16
        # ``capture_path``: the NIC's wire as pcapng (models/pcap.py), closed by check_clean.
        self.capture = LinkCapture(capture_path).__enter__() if capture_path else None
        self.wire = self.loop.add(WireMonitor(dut, "nic_wire_monitor", 64, capture=self.capture,
                                              clock_ns=CLOCK_NS))
        # The credit rule at both ends of the cable: the NIC at its pins, the remote port
        # seen across the cable's pure delay.
        self.credit_monitors = [
            self.loop.add(CreditMonitor(dut, "nic_wire_monitor", "nic_wire_in_monitor", 64,
                                        self.num_vls, name="NIC")),
            self.loop.add(CreditMonitor(dut, "nic_wire_in_monitor", "nic_wire_monitor", 64,
                                        self.num_vls, name="remote port",
                                        out_offset=-self.wire_delay, in_offset=self.wire_delay))]
        self.bus = self.loop.add(BusMonitor(dut))
        self.loop.add(_Responder(self))

        self.slid = NIC_LID
        self.sl_to_vl = [sl % self.num_vls for sl in range(16)]
        self.qps, self.cqs, self.mkeys = {}, {}, {}
        self.requester = None
        # With ``coalesce_acks`` the responder acknowledges every ``ack_every`` packets
        # whatever their AckReq, and whatever is left once the wire has been quiet for
        # ACK_FLUSH_CYCLES (as a real responder's coalescing timer would).
        self.responder = ResponderPeer(lid=REMOTE_LID, memory_bytes=MEMORY_BYTES,
                                        ack_every=ack_every, coalesce_ackreq=coalesce_acks)
        self.hold_acks = False      # coalesced ACKs wait for flush_acks, not for a quiet wire
        self.gpu = None
        # qpn -> (packet bytes, required) to come, in order; packets behind a NAK are not
        # required (the NIC may or may not have sent them before the QP went to ERR).
        self.expected_packets = defaultdict(deque)
        self.planned_naks = {}                        # qpn -> (WQE number, NAK code, syndrome)
        self.posted_count = defaultdict(int)          # qpn -> WQEs posted
        self.nak_results = {}                         # qpn -> the NAKed WQE's result
        self.expected_cqes = defaultdict(deque)       # qpn -> (wqe_index, checker)
        self.completed = defaultdict(list)            # qpn -> CQEs seen
        self.cqe_cycles = []                          # the cycle each CQE was written
        self.cq_pi = defaultdict(int)                 # cqn -> CQEs written so far
        # READ data and atomic results to land: address -> (byte, WQE result), and the
        # bytes still to land per WQE (by QP and ring index, unique while it is outstanding:
        # an id() could be a completed WQE's, reused)
        self.expected_bytes = {}
        self.landing = defaultdict(int)
        self.landing_cursor = 0                       # tb/test_nic.py's landing allocator
        self.local_cqes = 0                           # CQEs of NOP and DUMP WQEs
        self.errors = []

    # --- bring-up ---------------------------------------------------------------------

    async def reset(self):
        self.dut.rst.value = 1
        for _ in range(4):
            await RisingEdge(self.clock)
        self.dut.rst.value = 0
        await RisingEdge(self.clock)
        cocotb.start_soon(self.loop.run())
        await self.write(rmap.register_offset("slid"), self.slid)
        await self.wait_link()

    async def wait_link(self, limit=20000):
        active = LinkState.ACTIVE.value
        for _ in range(limit):
            if (int(self.dut.nic_link_state.value) == active
                    and int(self.dut.remote_state.value) == active):
                return
            await RisingEdge(self.clock)
        raise AssertionError("link did not come up")

    # --- a standard setup ---------------------------------------------------------------

    async def setup(self, qps=8, cqs=None, log_sq_size=8, mtu=None, max_outstanding=MAX_OUTSTANDING_BLOCKS,
                    collapsed=False, ring_every=1, mkeys=None):
        """Program ``qps`` QPs (one CQ each unless ``cqs``; path MTU ``mtu``, random per QP
        if None), a memory key over the data region (``mkeys`` replaces it), a GPU model
        over them; returns the list of QP numbers."""
        cqs = cqs or qps
        self.data_key = mlx5.make_key(1, 0x5A)
        for c in range(cqs):
            cq = CqContext(cqn=c, base=CQ_REGION + c * CQ_STRIDE, log_size=0 if collapsed else 10,
                           collapsed=collapsed)
            self.cqs[c] = cq
            await self.program_cq(cq)
        for mkey in mkeys or [Mkey(key=self.data_key, base=DATA_REGION, length=DATA_BYTES,
                                   access=0xF, pd=PD, valid=1)]:
            self.mkeys[mkey.key] = mkey
            await self.program_mkey(mkey)
        for q in range(qps):
            qp = QpContext(qpn=q, sq_base=SQ_REGION + q * SQ_STRIDE, log_sq_size=log_sq_size,
                           mtu=mtu or self.rng.randrange(1, 6), sl=q % 16,
                           max_outstanding=max_outstanding, dest_qpn=remote_qpn(q),
                           dlid=REMOTE_LID, pd=PD, pkey=0xFFFF,
                           sq_psn=self.rng.randrange(1 << 24), cqn=q % cqs)
            self.qps[q] = qp
            await self.program_qp(qp)
            self.responder.add_qp(remote_qpn(q), peer_qpn=q, epsn=qp.sq_psn, mtu=qp.mtu)
        self.requester = RequesterModel(slid=self.slid, sl_to_vl=self.sl_to_vl,
                                        qps=self.qps, cqs=self.cqs, mkeys=self.mkeys,
                                        num_mkeys=self.num_mkeys, num_vls=self.num_vls)
        self.gpu = GpuModel(self, [GpuQp(qpn=q, sq_base=self.qps[q].sq_base,
                                         log_sq_size=log_sq_size, dbr_address=DBR_REGION + 64 * q)
                                   for q in range(qps)], ring_every=ring_every)
        return list(range(qps))

    # --- posting --------------------------------------------------------------------------

    def builder(self, qpn, **wqe):
        """A ``build(index)`` for the GPU model: the WQE's bytes at ring index ``index``; the
        requester model predicts its packets and completion there and then."""
        def build(index):
            made = mlx5.build_wqe(wqe["opcode"], index, qpn,
                                  **{k: v for k, v in wqe.items() if k != "opcode"})
            self.expect(qpn, index, made.data)
            return made.data
        return build

    def builder_many(self, qpn, wqes):
        """A ``build(index)`` for WQEs posted together, one after the other from ``index``
        (one reservation, as NVSHMEM posts a combined put and its NOP): ``wqes`` are
        field dicts as for :meth:`builder`."""
        def build(index):
            data = b""
            for wqe in wqes:
                made = mlx5.build_wqe(wqe["opcode"], index, qpn,
                                      **{k: v for k, v in wqe.items() if k != "opcode"})
                self.expect(qpn, index, made.data)
                data += made.data
                index = (index + made.blocks) % (1 << 16)
            return data
        return build

    def expect(self, qpn, index, wqe_bytes):
        result = self.requester.execute(qpn, index, wqe_bytes, self.memory.read)
        number = self.posted_count[qpn]
        self.posted_count[qpn] += 1
        required = qpn not in self.nak_results
        nak = self.planned_naks.get(qpn)
        if nak and nak[0] == number and result.status == "SENT":
            _, code, syndrome = nak
            self.responder.inject_nak(remote_qpn(qpn), result.first_psn, code)
            self.nak_results[qpn] = result
            self.expected_packets[qpn].append((result.packets[0], True))
            self.expected_packets[qpn].extend((p, False) for p in result.packets[1:])
            result = dataclasses.replace(result, status=CompletionStatus.ERROR,
                                         syndrome=syndrome, byte_count=0)
        else:
            self.expected_packets[qpn].extend((p, required) for p in result.packets)
            if not required:
                result = dataclasses.replace(result, status=CompletionStatus.FLUSH,
                                             syndrome=mlx5.Syndrome.WR_FLUSH_ERR, byte_count=0)
        self.expected_cqes[qpn].append(result)

    def nak_wqe(self, qpn, number, code, syndrome):
        """Have the responder NAK (``code``) the first packet of QP ``qpn``'s WQE number
        ``number`` (in posting order); it completes with ``syndrome`` and the QP's later
        WQEs with flush errors."""
        self.planned_naks[qpn] = (number, code, syndrome)

    def blocks_of(self, **wqe):
        return mlx5.build_wqe(wqe["opcode"], 0, 0,
                              **{k: v for k, v in wqe.items() if k != "opcode"}).blocks

    async def timed_inline_write(self, qpn, rng, size=8):
        """Post one ``size``-byte inline RDMA WRITE on an idle QP ``qpn`` and wait for its
        completion. Returns cycle counts: ``total`` (doorbell accepted -> first beat at the
        NIC's wire pins), ``to_ar`` (doorbell -> the WQE fetch's AR), ``memory`` (that AR ->
        its first R beat; for more than 64 bytes plus the payload read's AR -> first R
        beat, the bytes read back from the ring) and ``nic`` (total without the memory
        waits)."""
        fields = dict(opcode=mlx5.Opcode.RDMA_WRITE, inline=rng.randbytes(size),
                      raddr=rng.randrange(0, MEMORY_BYTES - size), rkey=1,
                      fm_ce_se=mlx5.CTRL_CQ_UPDATE)
        marks = (len(self.wire.data_packets), len(self.bus.doorbells), len(self.bus.ar[0]),
                 len(self.bus.r[0]), len(self.bus.ar[PAYLOAD_ID]), len(self.bus.r[PAYLOAD_ID]))
        await self.gpu.post(qpn, self.blocks_of(**fields), self.builder(qpn, **fields),
                            last=True)
        await self.drain()
        t_db, t_ar = self.bus.doorbells[marks[1]], self.bus.ar[0][marks[2]]
        t_r, t_wire = self.bus.r[0][marks[3]], self.wire.data_packets[marks[0]][2]
        assert t_db < t_ar < t_r < t_wire, (t_db, t_ar, t_r, t_wire)
        memory = t_r - t_ar
        if size > DESCRIPTOR_INLINE_BYTES:
            t_payload_ar, t_payload_r = (self.bus.ar[PAYLOAD_ID][marks[4]],
                                         self.bus.r[PAYLOAD_ID][marks[5]])
            assert t_r < t_payload_ar < t_payload_r < t_wire, (t_r, t_payload_ar, t_payload_r)
            memory += t_payload_r - t_payload_ar
        return {"total": t_wire - t_db, "to_ar": t_ar - t_db, "memory": memory,
                "nic": t_wire - t_db - memory}

    # --- observation ------------------------------------------------------------------

    def _memory_written(self, address, data):
        if not CQ_REGION <= address < CQ_REGION + CQ_STRIDE * max(len(self.cqs), 1):
            for i, value in enumerate(data):
                want = self.expected_bytes.pop(address + i, None)
                if want is None or want[0] != value:
                    self.errors.append(f"NIC wrote {len(data)} bytes at {address:#x}: byte "
                                       f"{address + i:#x} is {value:#04x}, expected "
                                       f"{'nothing' if want is None else hex(want[0])}")
                    return
                self.landing[_key(want[1])] -= 1
            return
        cqn = (address - CQ_REGION) // CQ_STRIDE
        cq = self.cqs.get(cqn)
        if cq is None or len(data) != 64:
            self.errors.append(f"NIC wrote {len(data)} bytes at {address:#x}: no such CQE")
            return
        pi = self.cq_pi[cqn]
        self.cq_pi[cqn] += 1
        expected_address = mlx5.cqe_address(cq.base, cq.log_size, cq.collapsed, pi)
        if address != expected_address:
            self.errors.append(f"CQ {cqn}: CQE {pi} at {address:#x}, expected {expected_address:#x}")
        cqe = mlx5.parse_cqe(data)
        if cqe.owner != mlx5.cqe_owner(pi, 0 if cq.collapsed else cq.log_size):
            self.errors.append(f"CQ {cqn}: CQE {pi} owner bit {cqe.owner}")
        qpn = cqe.qpn
        if not self.expected_cqes.get(qpn):
            self.errors.append(f"unexpected CQE {cqe} (QP {qpn} has nothing outstanding)")
            return
        # Unsignaled WQEs before this one completed silently, their data landed first.
        while self.expected_cqes[qpn] and not self._signals(self.expected_cqes[qpn][0]):
            silent = self.expected_cqes[qpn].popleft()
            if self.landing.pop(_key(silent), 0):
                self.errors.append(f"QP {qpn}: CQE {cqe} before the READ data or atomic "
                                   f"result of unsignaled WQE {silent.wqe_index}")
        if not self.expected_cqes[qpn]:
            self.errors.append(f"unexpected CQE {cqe}")
            return
        result = self.expected_cqes[qpn].popleft()
        if self.landing.pop(_key(result), 0):
            self.errors.append(f"QP {qpn}: CQE {cqe} before its READ data or atomic result")
        if result.opcode in mlx5.LOCAL_OPCODES and result.status == CompletionStatus.SENT:
            # In order: the packets before a NOP or DUMP (PSNs up to its last_psn, the one
            # before its first) were all received, their acknowledgement came first.
            self.local_cqes += 1
            early = [p for p, _ in self.expected_packets[qpn]
                     if psn_le(int.from_bytes(p[17:20], "big"), result.last_psn)]
            if early:
                self.errors.append(f"QP {qpn}: CQE {cqe} of WQE {result.wqe_index} while "
                                   f"{len(early)} packets before it were not received")
        want = result.cqe(owner=cqe.owner)
        if cqe != want:
            self.errors.append(f"QP {qpn}: CQE {cqe}, expected {want}")
        self.completed[qpn].append(cqe)
        self.cqe_cycles.append(self.loop.cycle)
        if self.gpu is not None and qpn in self.gpu.qps:
            self.gpu.completed(qpn, cqe.wqe_counter, result.wqe_blocks)

    @staticmethod
    def _signals(result):
        return result.signaled or result.status != "SENT"

    def on_request(self, packet):
        """A request packet reached the remote end: check it, return the responses."""
        fields = parse_packet(packet)
        qpn = fields.bth.destqp - 0x100
        queue = self.expected_packets.get(qpn)
        if not queue:
            self.errors.append(f"cycle {self.loop.cycle}: unexpected packet for QP {qpn} "
                               f"(PSN {fields.bth.psn:#x}): {packet.hex()}; AR {dict(self.bus.ar)}, "
                               f"doorbells {self.bus.doorbells}, wire {[p[2] for p in self.wire.data_packets]}")
            return []
        want, _ = queue.popleft()
        if packet != want:
            self.errors.append(f"QP {qpn}: packet\n  {packet.hex()}\nexpected\n  {want.hex()}")
        responses = self.responder.receive(packet)
        for response in responses:
            self._expect_landing(qpn, response)
        return responses

    def _expect_landing(self, qpn, response):
        """The local write a READ response or ATOMIC ACKNOWLEDGE to QP ``qpn`` causes."""
        pkt = decode_packet(response)
        opcode, psn = pkt.bth.opcode, pkt.bth.psn
        for r in self.expected_cqes[qpn]:
            if r.status != CompletionStatus.SENT or not (psn_le(r.first_psn, psn)
                                                          and psn_le(psn, r.last_psn)):
                continue
            if opcode == Opcode.ATOMIC_ACKNOWLEDGE:
                address, data = r.laddr, mlx5.landed_atomic_result(pkt.ext[1].orig, r.byte_count)
            elif Opcode.RDMA_READ_RESPONSE_FIRST <= opcode <= Opcode.RDMA_READ_RESPONSE_ONLY:
                address = r.laddr + psn_diff(psn, r.first_psn) * r.mtu_bytes
                data = bytes(pkt.payload)
            else:
                return
            for i, value in enumerate(data):
                self.expected_bytes[address + i] = (value, r)
            self.landing[_key(r)] += len(data)
            return

    def on_response(self, packet):
        """A response packet (from the NIC's responder) reached the remote end."""
        self.errors.append(f"cycle {self.loop.cycle}: unexpected response {packet.hex()}")

    def flush_acks(self):
        """Send the coalesced ACKs the responder holds."""
        for response in self.responder.flush():
            self.sources[0].send(response)

    # --- end of test ----------------------------------------------------------------------

    def outstanding(self):
        packets = sum(required for q in self.expected_packets.values() for _, required in q)
        completions = sum(1 for q in self.expected_cqes.values() for r in q if self._signals(r))
        return packets, completions

    async def cycles(self, n):
        for _ in range(n):
            await RisingEdge(self.clock)

    async def drain(self, limit=200000):
        """Wait (the background loop runs the models) until every predicted packet and
        completion was seen, failing after ``limit`` cycles or at the first error."""
        for _ in range(limit):
            if self.errors or self.outstanding() == (0, 0):
                break
            await RisingEdge(self.clock)
        else:
            packets, completions = self.outstanding()
            raise AssertionError(f"not drained after {limit} cycles: {packets} packets and "
                                 f"{completions} completions outstanding")
        assert not self.errors, "\n".join(self.errors[:10])

    async def check_clean(self):
        assert not self.errors, "\n".join(self.errors[:10])
        packets, completions = self.outstanding()
        assert packets == 0, f"{packets} predicted packets never reached the wire"
        assert completions == 0, f"{completions} WQEs never completed"
        assert not self.expected_bytes, \
            f"{len(self.expected_bytes)} bytes of READ data or atomic results never landed"
        for v in range(self.num_vls):
            assert not self.sinks[v].errors, self.sinks[v].errors[:5]
            assert int(self.dut.remote_overflow.value) == 0
        assert int(self.dut.remote_link_inits.value) == 0, "the link re-initialised"
        if self.capture:
            self.capture.__exit__(None, None, None)
            self.capture = self.wire.capture = None


class BusMonitor:
    """Cycle stamps of what crosses one NIC's buses: doorbell writes into the UAR page
    (the later of the AW and W handshakes), read bursts the NIC issues (``<nic>ar_fire``,
    before the memory delay) and read data beats, both by ARID. ``bus``: the prefix of the
    NIC's AXI ports on the top (``a_`` ...), ``nic``: of its ``ar_fire``/``ar_id`` ports."""

    def __init__(self, dut, bus="", nic="nic_"):
        self.doorbells = []             # cycle
        self.ar = defaultdict(list)     # id -> cycles
        self.r = defaultdict(list)      # id -> cycles of beats
        self._aw = deque()
        self._w = deque()
        self.axil = {name: getattr(dut, f"{bus}axil__{name}")
                     for name in ("awvalid", "awready", "awaddr", "wvalid", "wready")}
        self.axi = {name: getattr(dut, f"{bus}axi__{name}") for name in ("rvalid", "rready", "rid")}
        self.ar_fire = getattr(dut, f"{nic}ar_fire")
        self.ar_id = getattr(dut, f"{nic}ar_id")

    def sample(self, cycle):
        axil, axi = self.axil, self.axi
        if int(axil["awvalid"].value) and int(axil["awready"].value):
            self._aw.append((int(axil["awaddr"].value), cycle))
        if int(axil["wvalid"].value) and int(axil["wready"].value):
            self._w.append(cycle)
        while self._aw and self._w:
            (address, aw_cycle), w_cycle = self._aw.popleft(), self._w.popleft()
            if rmap.UAR_BASE <= address < rmap.UAR_BASE + rmap.UAR_SIZE:
                self.doorbells.append(max(aw_cycle, w_cycle))
        if int(self.ar_fire.value):
            self.ar[int(self.ar_id.value)].append(cycle)
        if int(axi["rvalid"].value) and int(axi["rready"].value):
            self.r[int(axi["rid"].value)].append(cycle)

    def drive(self, cycle):
        pass


ACK_FLUSH_CYCLES = 32
# BTH opcodes of RC responses: READ response FIRST .. ATOMIC ACKNOWLEDGE.
RESPONSE_OPCODES = range(0x0D, 0x13)


class _Responder:
    """The CycleLoop model that hands each packet the remote end received to the responder
    and sends its answers back."""

    def __init__(self, tb):
        self.tb = tb
        self.taken = [0] * tb.num_vls
        self.quiet = 0

    def sample(self, cycle):
        tb = self.tb
        arrived = sum(len(sink.packets) for sink in tb.sinks.values()) - sum(self.taken)
        self.quiet = 0 if arrived else self.quiet + 1
        if self.quiet == ACK_FLUSH_CYCLES and tb.responder.coalesce_ackreq and not tb.hold_acks:
            tb.flush_acks()
        for v, sink in tb.sinks.items():
            while self.taken[v] < len(sink.packets):
                packet, end_bad, _, _ = sink.packets[self.taken[v]]
                self.taken[v] += 1
                if end_bad:
                    tb.errors.append(f"cycle {cycle}: packet arrived end-bad")
                    continue
                if len(packet) > 8 and packet[8] in RESPONSE_OPCODES:
                    tb.on_response(packet)
                    continue
                for response in tb.on_request(packet):
                    tb.sources[v].send(response)

    def drive(self, cycle):
        pass
