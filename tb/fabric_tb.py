"""cocotb testbench for :class:`tb.fabric_top.FabricTop`: a leaf/spine fabric of NICs, each
with its GPU and memory, RC connections between NICs across the fabric (docs/fabric.md).

:class:`FabricTB` owns the clock (2.5 ns, 400 MHz) and reset, a register master per
switch, and one :class:`FabricNic` per NIC. It acts as the subnet manager: it computes
the forwarding tables from :class:`models.fabric.LeafSpine` and writes them, with the
SL-to-VL map, through each switch's AXI4-Lite registers, then waits until every link is
ACTIVE.

A :class:`FabricNic` is a :class:`tb.nic_pair_tb.Side` (its :class:`tb.nic_host.NicHost`,
GPU model, requester and responder models, CQE checks) whose QPs lead to different NICs:
QP ``q`` of NIC ``n`` is connected to QP ``n`` of NIC ``q`` (so ``num_qps`` must be at least
the number of NICs; QP ``n`` of NIC ``n`` is unused). Each QP's packets are handed to the
responder model of the NIC it leads to.
"""
import logging
import statistics

import cocotb
from cocotb.triggers import RisingEdge

from hdl.link.signatures import LinkState
from hdl.nic import register_map as rmap
from hdl.nic.signatures import MAX_OUTSTANDING_BLOCKS
from hdl.switch import register_map as switch_map
from models import mlx5
from models.nic import CqContext, Mkey, QpContext, RequesterModel, NicResponderModel, mkey_index
from tb.beats import WireMonitor
from tb.credit_monitor import CreditMonitor
from tb.fabric_top import fabric_of
from tb import nic_pair_tb, runner
from tb.gpu_model import GpuModel, GpuQp
from tb.nic_pair_tb import (ALL_RIGHTS, CLOCK_NS, CQ_REGION, CQ_STRIDE, DBR_REGION,
                            MEMORY_BYTES, PD, RQ_REGION, RQ_STRIDE, SOURCE_BYTES, SOURCE_REGION,
                            SQ_REGION, SQ_STRIDE, Side)
from tb.rc_tb import RcTB

__all__ = ["FabricTB", "FabricNic", "CLOCK_NS"]

# BTH opcodes of RC RDMA WRITE packets (FIRST .. ONLY with immediate).
WRITE_OPCODES = range(0x06, 0x0C)


class FabricNic(Side):
    """NIC ``index`` of the fabric: a :class:`Side` whose peer depends on the QP."""

    def __init__(self, tb, index):
        name = f"nic{index}"
        # Side takes its LID from nic_pair_tb's table of the two sides' LIDs (it has no LID
        # argument): this NIC's is entered there first.
        nic_pair_tb.LIDS[name] = tb.fabric.lid(index)
        super().__init__(tb, name)
        self.index = index
        self.peers = {}                     # qpn -> the FabricNic that QP leads to
        self.rung = []                      # (qpn, producer index) of every doorbell, in order
        self.arrivals = {}                  # end address -> callback(cycle) of awaited writes
        self.cqe_counts = {"send": 0, "recv": 0, "errors": 0}
        self.send_cqe_opcodes = {}          # mlx5 opcode of the WQE -> its requester CQEs

    async def ring_doorbell(self, data8):
        """:meth:`Side.ring_doorbell`, noting which QP and producer index it rang: the
        register master keeps the order, so the ``k``-th entry of :attr:`rung` is the
        ``k``-th UAR write :attr:`bus` stamps (:meth:`doorbell_cycles`)."""
        self.rung.append(mlx5.parse_doorbell(data8))
        await super().ring_doorbell(data8)

    def doorbell_cycles(self):
        """``{qpn: [(cycle, producer index)]}`` of the doorbells rung so far."""
        out = {}
        for (qpn, pi), cycle in zip(self.rung, self.bus.doorbells):
            out.setdefault(qpn, []).append((cycle, pi))
        return out

    def await_write(self, end_address, callback):
        """Call ``callback(cycle)`` when an AXI write of the NIC ends at ``end_address`` (the
        last byte of a message landing)."""
        self.arrivals[end_address] = callback

    def _nic_wrote(self, address, data):
        super()._nic_wrote(address, data)
        callback = self.arrivals.pop(address + len(data), None)
        if callback is not None:
            callback(self.tb.loop.cycle)
        if CQ_REGION <= address < CQ_REGION + CQ_STRIDE * len(self.cqs) and len(data) == 64:
            cqe = mlx5.parse_cqe(data)
            opcode = cqe.opcode
            send = opcode in (mlx5.CqeOpcode.REQ, mlx5.CqeOpcode.REQ_ERR)
            self.cqe_counts["send" if send else "recv"] += 1
            if send:
                name = mlx5.Opcode(cqe.wqe_opcode).name
                self.send_cqe_opcodes[name] = self.send_cqe_opcodes.get(name, 0) + 1
            self.cqe_counts["errors"] += opcode in (mlx5.CqeOpcode.REQ_ERR,
                                                    mlx5.CqeOpcode.RESP_ERR)

    def builder(self, qpn, **wqe):
        """:meth:`Side.builder`, with QP ``qpn``'s peer NIC as the peer: ``build`` runs
        without a pause from start to end, so ``peer`` holds while it runs."""
        build = super().builder(qpn, **wqe)

        def build_for_qp(index):
            self.peer = self.peers[qpn]
            return build(index)
        return build_for_qp

    def target_from(self, other):
        """The slice of this NIC's memory NIC ``other`` writes into (through QP ``other``)."""
        return self.target(other if isinstance(other, int) else other.index)

    def write_mirror(self, address, data):
        self.mirror[address:address + len(data)] = data


class FabricTB(RcTB):
    drain_limit = 50000

    def __init__(self, dut, *, seed=1, memory_latency=200):
        self.params = params = runner.tb_params()
        self.fabric = fabric = fabric_of(params)
        self.num_qps = params.get("num_qps", 8)
        self.num_cqs = params.get("num_cqs", 8)
        self.num_mkeys = params.get("num_mkeys", 8)
        self.num_vls = params.get("num_vls", 2)
        if self.num_qps < fabric.nics or self.num_cqs < fabric.nics:
            raise ValueError(f"{fabric.nics} NICs need num_qps and num_cqs of at least "
                             f"{fabric.nics} (QP q of each NIC leads to NIC q)")
        self.max_qps = max(16, self.num_qps)        # target slices (Side.target)
        super().__init__(dut, seed=seed, memory_latency=memory_latency)
        self.nics = [FabricNic(self, n) for n in range(fabric.nics)]
        from cocotbext.axi import AxiLiteBus, AxiLiteMaster
        self.switches = {name: AxiLiteMaster(AxiLiteBus.from_prefix(dut, f"{name}_axil",
                                                                    bus_separator="__"),
                                             dut.clk, dut.rst)
                         for name in fabric.switches}
        # A line per register access and per reset edge costs more than the access.
        for master in [*self.switches.values(), *(nic.host.axil for nic in self.nics)]:
            master.write_if.log.setLevel(logging.WARNING)
            master.read_if.log.setLevel(logging.WARNING)
        for nic in self.nics:
            nic.host.memory.write_if.log.setLevel(logging.WARNING)
            nic.host.memory.read_if.log.setLevel(logging.WARNING)
        self.sl_to_vl = [sl % self.num_vls for sl in range(16)]
        self._monitors = {}
        self._cut = 0
        dut.link_cut.value = 0
        # The credit rule at every switch transmitter, at its pins (the NICs' own: Side).
        self.credit_monitors = [
            self.loop.add(CreditMonitor(dut, f"{name}_out__{port}", f"{name}_in__{port}", 64,
                                        self.num_vls, name=f"{name} port {port}"))
            for name, ports in fabric.switches.items() for port in range(ports)]

    # --- switch registers ----------------------------------------------------------------------

    @staticmethod
    def _offset(name):
        return SWITCH_OFFSETS[name]

    async def switch_write(self, switch, name, value):
        resp = await self.switches[switch].write(self._offset(name), int(value).to_bytes(4, "little"))
        assert int(resp.resp) == rmap.OKAY, f"{switch}: write of {name} = {value:#x} refused"

    async def switch_read(self, switch, name):
        resp = await self.switches[switch].read(self._offset(name), 4)
        assert int(resp.resp) == rmap.OKAY, f"{switch}: read of {name} refused"
        return int.from_bytes(resp.data, "little")

    @staticmethod
    def ft_word(lid, port, valid):
        return sum(value << lo for (_, lo, _), value in zip(switch_map.FT_FIELDS, (lid, port, valid)))

    async def program_switch(self, switch):
        """What the subnet manager writes into one switch: the SL-to-VL map and every
        forwarding-table entry (invalid ones too: reset does not clear the table)."""
        for sl, vl in enumerate(self.sl_to_vl):
            await self.switch_write(switch, f"sl_to_vl_{sl}", vl)
        for lid, port, valid in self.fabric.ft_entries(switch):
            await self.switch_write(switch, "ft_write", self.ft_word(lid, port, valid))

    async def read_table(self, switch):
        """``{lid: port}`` of the valid entries of ``switch``'s table, read back."""
        table = {}
        for lid in range(self.fabric.lids):
            await self.switch_write(switch, "ft_read_lid", lid)
            word = await self.switch_read(switch, "ft_read_data")
            fields = {name: (word >> lo) & ((1 << width) - 1)
                      for name, lo, width in switch_map.FT_FIELDS}
            if fields["valid"]:
                table[lid] = fields["port"]
        return table

    async def switch_counter(self, switch, port, vl, name):
        return await self.switch_read(switch, f"port{port}_vl{vl}_{name}")

    # --- start-up ------------------------------------------------------------------------------

    @property
    def nodes(self):
        return self.nics

    async def reset(self):
        await super().reset()
        await self.all_of(*(self.program_switch(s) for s in self.switches),
                          *(nic.host.write(rmap.register_offset("slid"), nic.lid)
                            for nic in self.nics))
        await self.links_up()

    def link_states(self):
        """``{(node, port): state}`` of every link end."""
        states = {(nic.name, 0): int(getattr(self.dut, f"{nic.name}_link_state").value)
                  for nic in self.nics}
        for switch, ports in self.fabric.switches.items():
            for port in range(ports):
                states[(switch, port)] = int(getattr(self.dut,
                                                     f"{switch}_link_state__{port}").value)
        return states

    async def links_up(self, limit=20000):
        active = LinkState.ACTIVE.value
        for _ in range(limit):
            if all(s == active for s in self.link_states().values()):
                return
            await RisingEdge(self.dut.clk)
        down = [end for end, s in self.link_states().items() if s != active]
        raise AssertionError(f"links not ACTIVE after {limit} cycles: {down}")

    def cut(self, link, cut=True):
        """Cut (or restore) the cable ``link`` (a :class:`models.fabric.Link`): both ways,
        every beat is lost at its ends' outputs."""
        bit = 1 << self.fabric.links.index(link)
        self._cut = self._cut | bit if cut else self._cut & ~bit
        self.dut.link_cut.value = self._cut

    @staticmethod
    async def all_of(*coroutines):
        tasks = [cocotb.start_soon(c) for c in coroutines]
        for task in tasks:
            await task

    async def setup(self, log_sq_size=6, log_rq_size=4, mtu=5, ack_timeout=0):
        """Connect every pair of NICs (QP q of NIC n with QP n of NIC q, path MTU ``mtu``,
        local ACK timeout code ``ack_timeout``: 0 no timer, else 4.096 us * 2**n), one CQ
        per QP for its send and receive completions, a memory key over each whole memory
        with every right, source regions filled with random bytes. The NICs are programmed
        at the same time."""
        fabric = self.fabric
        psns = {(n, q): self.rng.randrange(1 << 24)
                for n in range(fabric.nics) for q in range(fabric.nics)}
        key = mlx5.make_key(1, 0x5A)
        for nic in self.nics:
            nic.data_key = key
            nic.peers = {q: self.nics[q] for q in range(fabric.nics) if q != nic.index}
            nic.memory.write(SOURCE_REGION, self.rng.randbytes(1 << 16) * (SOURCE_BYTES >> 16))

        async def program(nic):
            mkey = Mkey(key=key, base=0, length=MEMORY_BYTES, access=ALL_RIGHTS, pd=PD, valid=1)
            nic.mkeys = {mkey_index(mkey.key, self.num_mkeys): mkey}
            await nic.host.program_mkey(mkey)
            for q in range(fabric.nics):   # CQ n unused too: Side takes the CQs as 0..len - 1
                cq = CqContext(cqn=q, base=CQ_REGION + q * CQ_STRIDE, log_size=10, collapsed=False)
                nic.cqs[q] = cq
                await nic.host.program_cq(cq)
            for q, peer in nic.peers.items():
                qp = QpContext(qpn=q, sq_base=SQ_REGION + q * SQ_STRIDE, log_sq_size=log_sq_size,
                               mtu=mtu, sl=0, max_outstanding=MAX_OUTSTANDING_BLOCKS, dest_qpn=nic.index,
                               dlid=peer.lid, pd=PD, pkey=0xFFFF, sq_psn=psns[(nic.index, q)],
                               cqn=q, access=ALL_RIGHTS, rq_psn=psns[(q, nic.index)],
                               min_rnr_timer=1, ack_timeout=ack_timeout,
                               rq_base=RQ_REGION + q * RQ_STRIDE,
                               log_rq_size=log_rq_size, rq_dbr=DBR_REGION + 0x8000 + 64 * q,
                               rcqn=q)
                nic.qps[q] = qp
                await nic.host.program_qp(qp)

        await self.all_of(*(program(nic) for nic in self.nics))
        for nic in self.nics:
            nic.requester = RequesterModel(slid=nic.lid, sl_to_vl=self.sl_to_vl, qps=nic.qps,
                                           cqs=nic.cqs, mkeys={k.key: k for k in nic.mkeys.values()},
                                           num_mkeys=self.num_mkeys, num_vls=self.num_vls)
            nic.responder = NicResponderModel(lid=nic.lid, memory=nic.mirror, contexts=nic.qps,
                                           num_qps=self.num_qps, mkeys=nic.mkeys,
                                           num_mkeys=self.num_mkeys, sl_to_vl=self.sl_to_vl)
            if hasattr(nic, "completion"):      # a Side that predicts CQEs with the model
                from models.nic import CompletionModel
                nic.completion = CompletionModel(nic.requester, write_memory=nic.write_mirror)
            nic.gpu = GpuModel(nic, [GpuQp(qpn=q, sq_base=nic.qps[q].sq_base,
                                           log_sq_size=log_sq_size, dbr_address=DBR_REGION + 64 * q,
                                           ibuf=nic.results(q)[0], ibuf_lkey=key)
                                     for q in nic.peers])

    # --- monitors ------------------------------------------------------------------------------

    def switch_monitor(self, switch, port, direction):
        """A :class:`WireMonitor` on the wire into (``"in"``) or out of (``"out"``) ``port`` of
        ``switch``, at the switch's pins; created on first use, recording from then on."""
        key = (switch, port, direction)
        if key not in self._monitors:
            self._monitors[key] = self.loop.add(WireMonitor(
                self.dut, f"{switch}_{direction}__{port}", 64, clock_ns=CLOCK_NS))
        return self._monitors[key]

    def stop_wire_monitors(self, keep=()):
        """Stop every :class:`WireMonitor` but those in ``keep`` (each NIC's own wire out
        and in, the switch monitors): a monitor turns every beat on its wire into bytes in
        Python, which under load costs more simulation speed than the fabric itself."""
        self.loop.models = [m for m in self.loop.models
                            if not isinstance(m, WireMonitor) or any(m is k for k in keep)]

    # --- work ----------------------------------------------------------------------------------

    def inline_write(self, src, dst, data, offset=0):
        """The fields of an 8-byte-or-less inline RDMA WRITE from NIC ``src`` into its slice of
        NIC ``dst``'s memory at ``offset``; returns (qpn, fields, remote address)."""
        target = self.nics[dst]
        base, _ = target.target_from(src)
        raddr = base + offset
        return dst, dict(opcode=mlx5.Opcode.RDMA_WRITE, inline=data, raddr=raddr,
                         rkey=target.data_key, fm_ce_se=mlx5.CTRL_CQ_UPDATE), raddr

    async def post(self, src, qpn, fields, last=True):
        nic = self.nics[src]
        await nic.gpu.post(qpn, 1, nic.builder(qpn, **fields), last=last)

    async def measure_latency(self, src, dst, trials):
        """Zero-load latency of ``trials`` 8-byte inline WRITEs from ``src`` to ``dst``, one at
        a time, each into the first 4 KiB of ``src``'s slice of ``dst``'s memory: medians of
        the split (cycles). ``total``: the doorbell's AXI4-Lite write at ``src`` (the later
        of AW and W) to the AXI write of the last byte in ``dst``'s memory, split into
        ``nic_a_to_fetch`` (doorbell to the WQE read), ``memory`` (its first data beat),
        ``nic_a_to_wire`` (to the WRITE's start beat on ``src``'s wire), ``wire`` (the
        cables), ``switches`` (each hop: start beat into the switch to start beat out,
        ``hops``) and ``nic_b`` (start beat at ``dst``'s pins to the last byte written)."""
        a, b = self.nics[src], self.nics[dst]
        route = self.fabric.route(src, dst)
        monitors = [(self.switch_monitor(h.switch, h.in_port, "in"),
                     self.switch_monitor(h.switch, h.out_port, "out")) for h in route]
        wire = self.fabric.path_wire_delay(src, dst)

        def first_write(packets, mark):
            return next(cycle for packet, _, cycle in packets[mark:] if packet[8] in WRITE_OPCODES)

        rows = []
        for trial in range(trials):
            data = self.rng.randbytes(8)
            qpn, fields, raddr = self.inline_write(src, dst, data, LATENCY_PROBE_OFFSET + 64 * trial)
            marks = (len(a.bus.doorbells), len(a.bus.ar[0]), len(a.bus.r[0]),
                     len(a.wire.data_packets), len(b.wire_in.data_packets), len(b.writes),
                     [(len(i.data_packets), len(o.data_packets)) for i, o in monitors])
            await self.post(src, qpn, fields)
            await self.drain()
            t_db, t_ar, t_r = a.bus.doorbells[marks[0]], a.bus.ar[0][marks[1]], a.bus.r[0][marks[2]]
            t_out = first_write(a.wire.data_packets, marks[3])
            t_in = first_write(b.wire_in.data_packets, marks[4])
            t_landed = next(c for c, address, n in b.writes[marks[5]:]
                            if address <= raddr + 7 < address + n)
            hops = [first_write(o.data_packets, mo) - first_write(i.data_packets, mi)
                    for (i, o), (mi, mo) in zip(monitors, marks[6])]
            assert t_in - t_out == wire + sum(hops), \
                f"wire out to wire in {t_in - t_out} cycles, expected {wire} on cables + {hops}"
            rows.append({"total": t_landed - t_db, "nic_a_to_fetch": t_ar - t_db,
                         "memory": t_r - t_ar, "nic_a_to_wire": t_out - t_r, "wire": wire,
                         "switches": sum(hops), "hops": hops, "nic_b": t_landed - t_in})
        result = {key: statistics.median(r[key] for r in rows)
                  for key in rows[0] if key != "hops"}
        result["hops"] = [statistics.median(r["hops"][k] for r in rows) for k in range(len(route))]
        result["route"] = [f"{h.switch} {h.in_port}->{h.out_port}" for h in route]
        result["trials"] = trials
        return result

    # --- counters ------------------------------------------------------------------------------

    def busy_beats(self):
        """``{(node, port): data beats sent}`` of every link end since reset (FabricTop's
        ``*_busy_beats`` counters; they wrap at 2**32)."""
        out = {(nic.name, 0): int(getattr(self.dut, f"{nic.name}_busy_beats").value)
               for nic in self.nics}
        for switch, ports in self.fabric.switches.items():
            for port in range(ports):
                out[(switch, port)] = int(getattr(self.dut, f"{switch}_busy_beats__{port}").value)
        return out

    async def switch_counters(self):
        """``{(switch, port, vl): {counter: value}}`` of every switch counter. Every read is
        issued at once: each register master pipelines its reads (one after the other, they
        took about 600 cycles of the 8-NIC fabric's run)."""
        out = {(switch, port, vl): {} for switch, ports in self.fabric.switches.items()
               for port in range(ports) for vl in range(self.num_vls)}

        async def read(switch, port, vl, name):
            out[(switch, port, vl)][name] = await self.switch_counter(switch, port, vl, name)
        await self.all_of(*(read(*key, name) for key in out for name in switch_map.COUNTER_NAMES))
        return {key: {name: values[name] for name in switch_map.COUNTER_NAMES}
                for key, values in out.items()}

    async def nic_counters(self):
        """``{nic name: {counter: value}}``, every read issued at once (as the switches')."""
        out = {nic.name: {} for nic in self.nics}
        names = [name for name, _, _ in rmap.counter_words()]

        async def read(nic, name):
            out[nic.name][name] = await nic.host.counter(name)
        await self.all_of(*(read(nic, name) for nic in self.nics for name in names))
        return {nic: {name: values[name] for name in names} for nic, values in out.items()}

    def overflows(self):
        """Switch ports whose receive buffer overflowed."""
        return [(switch, port) for switch, ports in self.fabric.switches.items()
                for port in range(ports)
                if int(getattr(self.dut, f"{switch}_overflow__{port}").value)]

    # --- end of test ---------------------------------------------------------------------------

    async def check_clean(self):
        """:meth:`RcTB.check_clean`, and no switch port overflowed."""
        await super().check_clean()
        overflowed = self.overflows()
        assert not overflowed, f"switch ports overflowed: {overflowed}"

    async def drops(self):
        """``{(switch, port, vl, reason): count}`` of every non-zero drop counter."""
        found = {}
        for switch, ports in self.fabric.switches.items():
            for port in range(ports):
                for vl in range(self.num_vls):
                    for name in DROP_COUNTERS:
                        value = await self.switch_counter(switch, port, vl, name)
                        if value:
                            found[(switch, port, vl, name)] = value
        return found


# The first 4 KiB of each slice of the target region are the latency probe's
# (measure_latency); the scenarios' buffers start after them.
LATENCY_PROBE_OFFSET = 128
LATENCY_PROBE_BYTES = 0x1000
# Register offsets do not depend on the switch's size: the largest map has them all.
SWITCH_OFFSETS = {r.name: r.offset for r in switch_map.register_map(
    ports=switch_map.MAX_PORTS, num_vls=switch_map.MAX_VLS)}
DROP_COUNTERS = tuple(name for name in switch_map.COUNTER_NAMES if name.startswith("drop_"))
