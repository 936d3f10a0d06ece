"""The fabric scenarios of ``make sim`` (docs/fabric.md, Scenarios): a DeepEP-style MoE
dispatch/combine step (``moe``) and a KV-cache push under background all-to-all (``kv``)
on :class:`tb.fabric_tb.FabricTB`, what they cost, and the checks that they delivered.

Each cocotb test reads its configuration from ``SCENARIO_CONFIG`` (JSON, the ``config`` of
``scenario_results.json`` as :func:`full_config` makes it), and:

1. brings the fabric up and measures the zero-load 1-hop and 3-hop latency (8-byte inline
   WRITEs from NIC 0, :meth:`FabricTB.measure_latency`);
2. runs the workload (:class:`models.moe.MoePlan` or :class:`models.moe.KvPlan`) with one
   GPU model per NIC: one warp per destination rank, posting on the QP to that rank as
   DeepEP's low-latency kernels do: its WRITEs with ``nvshmemi_ibgda_put_nbi_warp``
   (message ``k`` rings the doorbell when ``(k + 1) % 4 == 0``) and then its signal with
   ``nvshmemi_ibgda_amo_nonfetch_add`` (NVSHMEM's 4-byte masked fetch-add, which always
   rings); a rank waits for its arrivals by polling its signal words in its own memory
   every ``POLL_CYCLES`` cycles, as DeepEP's receivers spin until a word is nonzero;
3. meanwhile samples every link end's data-beat counter (FabricTop's ``*_busy_beats``) every
   ``sample_cycles``, writes ``progress.json`` every ``PROGRESS_CYCLES`` and captures the
   ``pcap_link`` cable (its ``a`` end's output) into ``link.pcap``;
4. after every completion came: reads every switch counter and the NICs' retransmission
   counters, checks the outcome, writes ``scenario_results.json`` and only then fails if a
   check failed.

``launch(config)`` runs one scenario (the ``make sim`` front end, tb/sim.py, calls it).
"""
import hashlib
import json
import os
import time
from pathlib import Path

import cocotb
from cocotb.triggers import ClockCycles, RisingEdge

from hdl.link.signatures import LinkState
from models.moe import (SIGNAL_BYTES, KvPlan, MoePlan, link_names, scenario_config, signal_bytes,
                        signalled_count)
from models.pcap import LinkCapture
from tb.fabric_tb import CLOCK_NS, DROP_COUNTERS, LATENCY_PROBE_BYTES, FabricTB
from tb.nic_pair_tb import SOURCE_BYTES, SOURCE_REGION, TARGET_BYTES, TARGET_REGION

__all__ = ["launch", "full_config", "ScenarioFailed", "REGIONS"]

SCHEMA = 1
POLL_CYCLES = 4                 # a GPU reads its signal words this often
PROGRESS_CYCLES = 1000
LATENCY_TRIALS = 1              # zero load is deterministic (test_fabric checks 3 agree)
WORKLOAD_LIMIT = 200_000        # cycles a rank may wait for its arrivals, and the drain
# Each NIC's memory as the plans use it: the send buffers in the source region, the receive
# buffers in the target region after the latency probe's first 4 KiB (tb/nic_pair_tb.py's
# memory map).
REGIONS = {"send": (SOURCE_REGION, SOURCE_BYTES),
           "receive": (TARGET_REGION + LATENCY_PROBE_BYTES, TARGET_BYTES - LATENCY_PROBE_BYTES)}
RETRANSMISSION_COUNTERS = ("retransmits_nak", "retransmits_timeout", "retransmits_rnr",
                           "packets_resent", "retries_exhausted")


class Message:
    """A WRITE or a signalling atomic on the network, of ``phase`` (dispatch, combine, kv,
    background): its record in the results."""
    __slots__ = ("kind", "phase", "src", "dst", "nbytes", "hops", "posted", "landed")

    def __init__(self, kind, phase, src, dst, nbytes, hops):
        self.kind, self.phase, self.src, self.dst = kind, phase, src, dst
        self.nbytes, self.hops = nbytes, hops
        self.posted = self.landed = None

    def record(self):
        return {"kind": self.kind, "phase": self.phase, "src": self.src, "dst": self.dst,
                "bytes": self.nbytes, "hops": self.hops, "posted": self.posted,
                "landed": self.landed}


class Scenario:
    def __init__(self, dut):
        self.started = time.monotonic()
        self.config = config = json.loads(os.environ["SCENARIO_CONFIG"])
        self.progress_files = [Path("progress.json")]
        if os.environ.get("SCENARIO_PROGRESS"):
            self.progress_files.append(Path(os.environ["SCENARIO_PROGRESS"]))
        if os.environ.get("SCENARIO_RUN_NOTE"):
            Path(os.environ["SCENARIO_RUN_NOTE"]).write_text(os.getcwd())
        self.dut = dut
        self.tb = tb = FabricTB(dut, seed=config["seed"], memory_latency=config["memory_latency"])
        fabric = tb.fabric
        if fabric.nics != config["ranks"]:
            raise ValueError(f"the fabric has {fabric.nics} NICs, the configuration "
                             f"{config['ranks']} ranks")
        self.links = link_names(fabric)
        (self.pcap_name, pcap_link), = link_names(fabric, config["pcap_link"]).items()
        node, port = pcap_link.a
        self.capture = LinkCapture("link.pcap").__enter__()
        monitor = tb.nics[int(node[3:])].wire if node.startswith("nic") else \
            tb.switch_monitor(node, port, "out")
        monitor.capture = self.capture
        self.pcap_monitor = monitor
        self.timing = []                # where the wall time goes: each phase's start
        self.phase = "start-up"
        self.messages = []
        self.failures = []              # what went wrong, for the results and the assertion
        self.signal_errors = []
        self.order_errors = []
        self.ranks = [{"rank": n, "leaf": fabric.leaf_name(fabric.leaf_of(n)),
                       "dispatch_start": None, "dispatch_end": None,
                       "combine_start": None, "combine_end": None}
                      for n in range(fabric.nics)]
        self.phases = {}
        self.utilisation = {end: [] for end in tb.busy_beats()}
        self.warps = []
        self.total_messages = 0         # network messages of the workload, once planned
        self.kv_seen = None             # the cycle kv_dst saw the KV flag
        self.cut = None                 # the cut_link's story (cut_and_restore)

    @property
    def phase(self):
        return self._phase

    @phase.setter
    def phase(self, name):
        """Enter phase ``name`` (shown by the progress line): its first cycle and the wall
        seconds since the scenario began go into the results' ``timing``."""
        if getattr(self, "_phase", None) != name:
            self.timing.append({"phase": name, "cycle": self.tb.loop.cycle,
                                "seconds": round(time.monotonic() - self.started, 2)})
        self._phase = name

    # --- posting ------------------------------------------------------------------------

    def _message(self, kind, phase, src, dst, nbytes, raddr):
        message = Message(kind, phase, src, dst, nbytes, self.tb.fabric.hops(src, dst))

        def landed(cycle):
            message.landed = cycle
        self.tb.nics[dst].await_write(raddr + nbytes, landed)
        self.messages.append(message)
        return message

    def put(self, write, message_idx, always_post=False):
        """A warp's step: DeepEP's ``nvshmemi_ibgda_put_nbi_warp`` of RDMA WRITE ``write``
        (models.moe.Write), its ``message_idx``-th put to that rank."""
        nic, peer = self.tb.nics[write.src], self.tb.nics[write.dst]
        message = self._message(write.kind, write.kind, write.src, write.dst, write.nbytes,
                                write.raddr)
        return lambda: nic.gpu.put_nbi_warp(
            write.dst, laddr=write.laddr, lkey=nic.data_key, raddr=write.raddr,
            rkey=peer.data_key, nbytes=write.nbytes, message_idx=message_idx,
            always_post=always_post, tag=message)

    def signal(self, signal):
        """A warp's step: DeepEP's ``nvshmemi_ibgda_amo_nonfetch_add`` of ``signal``
        (models.moe.Signal)."""
        nic, peer = self.tb.nics[signal.src], self.tb.nics[signal.dst]
        message = self._message("signal", signal.kind, signal.src, signal.dst, SIGNAL_BYTES,
                                signal.address)
        return lambda: nic.gpu.amo_nonfetch_add(signal.dst, raddr=signal.address,
                                                rkey=peer.data_key, value=signal.add, tag=message)

    def start_warps(self, work):
        """One cocotb task per warp: ``work`` lists each warp's steps, run in order."""
        async def warp(steps):
            for step in steps:
                await step()
        self.warps += [cocotb.start_soon(warp(steps)) for steps in work if steps]

    def gpu_write(self, rank, pieces):
        """What the GPU of ``rank`` writes into its own memory (and the mirror)."""
        for address, data in pieces:
            self.tb.nics[rank].memory.write(address, data)

    def store_locally(self, signal):
        """A signal to the rank itself: the GPU stores it into its own word (DeepEP's
        ``st_release_sys_global``)."""
        self.tb.nics[signal.src].memory.write(signal.address, signal_bytes(signal.add))

    async def wait_words(self, rank, words, seen):
        """Poll ``rank``'s memory until every signal word of ``words`` (``{key: address}``)
        is nonzero, calling ``seen(key, word)`` with its bytes as each turns up; returns the
        cycle of the poll that saw the last."""
        memory = self.tb.nics[rank].host.memory
        waiting = dict(words)
        start = self.tb.loop.cycle
        while True:
            for key, address in list(waiting.items()):
                word = memory.read(address, SIGNAL_BYTES)
                if any(word):
                    del waiting[key]
                    seen(key, word)
            if not waiting:
                return self.tb.loop.cycle
            if self.tb.loop.cycle - start > WORKLOAD_LIMIT:
                raise AssertionError(f"rank {rank}: no signal from {sorted(waiting)} after "
                                     f"{WORKLOAD_LIMIT} cycles")
            await ClockCycles(self.dut.clk, POLL_CYCLES)

    def check_arrived(self, rank, pieces, why):
        """At the moment a signal is seen, what it announces must be in memory already."""
        memory = self.tb.nics[rank].host.memory
        for address, data, what in pieces:
            if memory.read(address, len(data)) != data:
                self.order_errors.append(f"rank {rank}: {why} seen at cycle {self.tb.loop.cycle} "
                                         f"before {what} at {address:#x} was complete")

    # --- MoE ----------------------------------------------------------------------------

    async def moe_rank(self, plan, rank):
        for phase in ("dispatch", "combine"):
            if phase == "combine":
                self.phase = "combine"
            self.gpu_write(rank, plan.staging(rank, phase))
            self.gpu_write(rank, plan.local_dispatch(rank) if phase == "dispatch"
                           else plan.local_combine(rank))
            writes = plan.dispatch_writes(rank) if phase == "dispatch" else plan.combine_writes(rank)
            work = []
            for signal in plan.signals(rank, phase):
                if signal.dst == rank:
                    self.store_locally(signal)
                else:
                    work.append([self.put(w, k) for k, w in enumerate(writes[signal.dst])]
                                + [self.signal(signal)])
            self.start_warps(work)

            def seen(source, word, phase=phase):
                # DeepEP's receivers: dispatch decodes the token count, combine sees its flag
                if phase == "dispatch":
                    got, want = signalled_count(word), plan.count(source, rank)
                else:
                    got, want = int.from_bytes(word, "little", signed=True), 1
                if got != want:
                    self.signal_errors.append(f"rank {rank}: {phase} signal of rank {source} "
                                              f"says {got}, expected {want}")
                if phase == "dispatch":
                    pieces = [(plan.dispatch_slot(source, t), plan.dispatch_payload(source, t),
                               f"token {t} of rank {source}")
                              for s, t in plan.received(rank) if s == source]
                else:
                    pieces = [(plan.combine_slot(t, plan.slot_of(rank, t, source)),
                               plan.combine_payload(source, rank, t),
                               f"the combine of token {t} from rank {source}")
                              for t in range(plan.tokens)
                              if source in plan.destinations[(rank, t)]]
                self.check_arrived(rank, pieces, f"the {phase} signal of rank {source}")
            self.ranks[rank][f"{phase}_end"] = await self.wait_words(
                rank, {s: plan.signal_word(phase, s) for s in range(plan.ranks)}, seen)

    async def moe(self):
        c = self.config
        plan = MoePlan(c["ranks"], c["tokens"], c["topk"], c["experts_per_rank"], c["hidden"],
                       c["seed"], regions=REGIONS)
        self.total_messages = sum(
            len(ws) + 1 for r in range(plan.ranks)
            for ws in (*plan.dispatch_writes(r).values(), *plan.combine_writes(r).values()))
        self.phase = "dispatch"
        await self.every_rank_to_its_end([self.moe_rank(plan, r) for r in range(plan.ranks)])
        return plan

    async def every_rank_to_its_end(self, ranks):
        """Run every rank's coroutine to its end, then raise the first rank's
        AssertionError, if any: cocotb fails a test at once when a task it is not awaiting
        yet raises, which would leave no results file to say what went wrong."""
        errors = []

        async def guarded(rank):
            try:
                await rank
            except AssertionError as error:
                errors.append(error)
        await self.tb.all_of(*(guarded(rank) for rank in ranks))
        if errors:
            raise errors[0]

    # --- KV -----------------------------------------------------------------------------

    async def kv(self):
        c = self.config
        plan = KvPlan(c["ranks"], c["kv_src"], c["kv_dst"], c["kv_blocks"], c["kv_block_bytes"],
                      c["background_bytes"], c["background_messages"], c["seed"], regions=REGIONS)
        self.total_messages = plan.kv_blocks + 1 + sum(
            len(ws) for r in plan.background_ranks for ws in plan.background_writes(r).values())
        self.phase = "kv"
        for rank in range(plan.ranks):
            self.gpu_write(rank, plan.staging(rank))
        self.start_warps([[self.put(w, k) for k, w in enumerate(plan.kv_writes())]
                          + [self.signal(plan.kv_signal())]])
        for rank in plan.background_ranks:
            # no signal follows a background warp's puts: its last one always rings
            self.start_warps([[self.put(w, k, always_post=k == len(writes) - 1)
                               for k, w in enumerate(writes)]
                              for writes in plan.background_writes(rank).values()])

        def seen(_, word):
            value = int.from_bytes(word, "little", signed=True)
            if value != plan.kv_blocks:
                self.signal_errors.append(f"KV flag is {value}, expected {plan.kv_blocks}")
            self.check_arrived(plan.kv_dst, [(w.raddr, w.payload, f"KV block {w.index}")
                                             for w in plan.kv_writes()], "the KV flag")
        self.kv_seen = await self.wait_words(plan.kv_dst, {"kv": plan.flag}, seen)
        return plan

    # --- a cable cut ---------------------------------------------------------------------

    async def cut_and_restore(self, workload_start):
        """``cut_at`` cycles into the workload, cut ``cut_link`` both ways; restore it once
        both its ends have left ACTIVE (each saw the silence: docs/link.md, Link failure and
        recovery); record when both are ACTIVE again."""
        tb = self.tb
        (name, link), = link_names(tb.fabric, self.config["cut_link"], option="cut_link").items()
        self.cut = cut = {"link": name, "cable": link.name, "cut": None, "down": None,
                          "restored": None, "up": None}
        await ClockCycles(self.dut.clk, self.config["cut_at"])
        tb.cut(link)
        cut["cut"] = tb.loop.cycle - workload_start
        active = LinkState.ACTIVE.value

        def states():
            every = tb.link_states()
            return every[link.a], every[link.b]
        while any(s == active for s in states()):
            await RisingEdge(self.dut.clk)
        cut["down"] = tb.loop.cycle - workload_start
        tb.cut(link, False)
        self.dut._log.info(f"cable {link.name} cut at workload cycle {cut['cut']}, both ends "
                           f"down at {cut['down']}: restored")
        cut["restored"] = cut["down"]
        while any(s != active for s in states()):
            await RisingEdge(self.dut.clk)
        cut["up"] = tb.loop.cycle - workload_start
        self.dut._log.info(f"cable {link.name}: both ends ACTIVE at workload cycle {cut['up']}")

    # --- measurement --------------------------------------------------------------------

    async def sample(self):
        """Every ``sample_cycles``: the fraction of each link end's beats that carried data."""
        width = self.config["sample_cycles"]
        last = self.tb.busy_beats()
        while True:
            await ClockCycles(self.dut.clk, width)
            now = self.tb.busy_beats()
            for end, value in now.items():
                self.utilisation[end].append(round(((value - last[end]) % (1 << 32)) / width, 4))
            last = now

    async def report_progress(self):
        while True:
            text = json.dumps({"phase": self.phase, "cycle": self.tb.loop.cycle,
                               "done": sum(m.landed is not None for m in self.messages),
                               "total": self.total_messages})
            for path in self.progress_files:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(text)
                tmp.replace(path)
            await ClockCycles(self.dut.clk, PROGRESS_CYCLES)

    def posted_cycles(self):
        """Each message's doorbell: the first doorbell of its QP whose producer index covers
        its WQE (every WQE is one basic block; fewer than 65,536 WQEs per QP)."""
        for nic in self.tb.nics:
            doorbells = nic.doorbell_cycles()
            for qpn, qp in nic.gpu.qps.items():
                rings = doorbells.get(qpn, [])
                k = 0
                for index, _, tag in qp.posted:
                    while k < len(rings) and rings[k][1] <= index:
                        k += 1
                    if isinstance(tag, Message) and k < len(rings):
                        tag.posted = rings[k][0]

    async def latency(self):
        fabric = self.tb.fabric
        out = {}
        hop_cycles = []
        for name, dst in (("hop1", fabric.neighbour(0)), ("hop3", fabric.nics - 1)):
            r = await self.tb.measure_latency(0, dst, LATENCY_TRIALS)
            out[name] = {"src": 0, "dst": dst, "total": r["total"], "nic_a": r["nic_a_to_fetch"],
                         "memory": r["memory"], "nic_a_wire": r["nic_a_to_wire"],
                         "cables": r["wire"], "switches": r["switches"], "nic_b": r["nic_b"],
                         "hops": len(r["hops"]), "route": r["route"], "hop_cycles": r["hops"]}
            hop_cycles += r["hops"]
        out["hop_cycles"] = hop_cycles
        out["trials"] = LATENCY_TRIALS
        return out

    # --- outcome ------------------------------------------------------------------------

    def check_contents(self, plan):
        """(payload errors, signal-word errors) of the final memories against the plan."""
        payload, signals = [], []
        for rank in range(self.config["ranks"]):
            memory = self.tb.nics[rank].host.memory
            for address, data, what in plan.expected(rank):
                if memory.read(address, len(data)) != data:
                    (signals if "signal" in what or "flag" in what else payload).append(
                        f"rank {rank}: {what} at {address:#x} is not what was sent")
        return payload, signals

    async def run(self, workload):
        tb, c = self.tb, self.config
        progress = cocotb.start_soon(self.report_progress())
        await tb.reset()
        await tb.setup(ack_timeout=c["ack_timeout"])
        self.phase = "latency"
        latency = await self.latency()
        tb.stop_wire_monitors(keep=[self.pcap_monitor])
        beats_before = tb.busy_beats()
        sampler = cocotb.start_soon(self.sample())
        workload_start = tb.loop.cycle
        cutter = cocotb.start_soon(self.cut_and_restore(workload_start)) if c["cut_link"] else None
        plan = None
        try:
            plan = await workload()
            for warp in self.warps:
                await warp
            self.phase = "drain"
            await tb.drain(limit=WORKLOAD_LIMIT)
        except AssertionError as error:
            self.failures.append(f"workload: {error}")
        sampler.cancel()
        if cutter is not None and not cutter.done():
            cutter.cancel()
            self.failures.append("cut_link: the workload ended before the cut link recovered")
        workload_end = tb.loop.cycle
        beats = tb.busy_beats()
        self.phase = "counters"
        self.posted_cycles()
        counters = {}

        async def read(name, reader):
            counters[name] = await reader()
        await tb.all_of(read("switch", tb.switch_counters), read("nics", tb.nic_counters))
        switch, nics = counters["switch"], counters["nics"]
        overflows = tb.overflows()
        memories_match = True
        try:
            await tb.check_clean()
        except AssertionError as error:
            memories_match = False
            self.failures.append(f"memories: {error}")
        payload_errors, signal_errors = self.check_contents(plan) if plan else (["no plan"], [])
        self.capture.__exit__(None, None, None)
        results = self.results(latency, switch, nics, overflows, beats_before, beats,
                               workload_start, workload_end)
        results["checks"] = checks = {
            "tokens_intact": not payload_errors and not self.order_errors and plan is not None,
            "signals_counted": not signal_errors and not self.signal_errors and plan is not None,
            "memories_match_model": memories_match,
            "no_overflow": not overflows,
            "cqes_complete": (results["cqes"]["errors"] == 0
                              and results["cqes"]["send_cqes"] == results["cqes"]["posted_wqes"]),
            "messages_landed": all(m.landed is not None for m in self.messages),
            **self.loss_checks(results),
        }
        self.failures += payload_errors[:10] + signal_errors[:10] + self.order_errors[:10] \
            + self.signal_errors[:10] + tb.errors[:10]
        results["failures"] = self.failures
        self.phase = "results"
        results["timing"] = self.timing
        results["wall_seconds"] = round(time.monotonic() - self.started, 1)
        Path("scenario_results.json").write_text(json.dumps(results, indent=1))
        self.phase = "done"
        for path in self.progress_files:
            path.write_text(json.dumps({"phase": "done", "cycle": tb.loop.cycle,
                                        "done": sum(m.landed is not None for m in self.messages),
                                        "total": self.total_messages}))
        progress.cancel()
        self.bench_records(results)
        self.dut._log.info(self.summary(results))
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"checks failed: {', '.join(failed)}\n" + "\n".join(self.failures[:20])

    def loss_checks(self, results):
        """Without a cut nothing is lost: ``no_drops``, ``no_retransmissions``. With one,
        ``drops_only_from_the_cut``: drops only at the cut cable's switch ends, and
        downstream only packets forwarded before the cut truncated them (``drop_end_bad``);
        ``cut_recovered``: both ends went down and came back ACTIVE."""
        if not self.config["cut_link"]:
            return {"no_drops": results["drops"]["total"] == 0,
                    "no_retransmissions": results["retransmissions"]["total"] == 0}
        link = self.tb.fabric.link(self.cut["cable"])
        ends = {f"{node}.p{port}" for node, port in (link.a, link.b)}
        elsewhere = [name for name, count in results["drops"]["by_counter"].items()
                     if count and ".".join(name.split(".")[:2]) not in ends
                     and not name.endswith(".drop_end_bad")]
        self.failures += [f"dropped away from the cut: {name}" for name in elsewhere]
        return {"drops_only_from_the_cut": not elsewhere,
                "cut_recovered": self.cut["up"] is not None}

    def results(self, latency, switch, nics, overflows, beats_before, beats, workload_start,
                workload_end):
        c, fabric = self.config, self.tb.fabric
        network = self.messages
        for r in self.ranks:
            n = r["rank"]
            for phase in ("dispatch", "combine"):
                posted = [m.posted for m in network if m.src == n and m.posted is not None
                          and m.phase == phase]
                r[f"{phase}_start"] = min(posted) if posted else None
            sent = [m for m in network if m.src == n]
            received = [m for m in network if m.dst == n]
            r.update(bytes_sent=sum(m.nbytes for m in sent),
                     bytes_received=sum(m.nbytes for m in received),
                     messages_sent=len(sent), messages_received=len(received),
                     busy_cycles=(beats[(f"nic{n}", 0)] - beats_before[(f"nic{n}", 0)]) % (1 << 32))
        phases = []
        if c["scenario"] == "moe":
            for phase in ("dispatch", "combine"):
                starts = [r[f"{phase}_start"] for r in self.ranks if r[f"{phase}_start"] is not None]
                ends = [r[f"{phase}_end"] for r in self.ranks if r[f"{phase}_end"] is not None]
                phases.append({"name": phase, "start": min(starts, default=None),
                               "end": max(ends) if len(ends) == len(self.ranks) else None})
        else:
            for kind in ("kv", "background"):
                group = [m for m in network if m.phase == kind]
                posted = [m.posted for m in group if m.posted is not None]
                landed = [m.landed for m in group if m.landed is not None]
                end = self.kv_seen if kind == "kv" else \
                    (max(landed) if len(landed) == len(group) and group else None)
                phases.append({"name": kind, "start": min(posted, default=None), "end": end})
        links = []
        for name, link in self.links.items():
            counts = {}
            for end, other, direction in ((link.a, link.b, "ab"), (link.b, link.a, "ba")):
                node, port = end
                if node in fabric.switches:
                    sums = {k: sum(switch[(node, port, vl)][k] for vl in range(self.tb.num_vls))
                            for k in ("packets_out", "bytes_out", "packets_in", "bytes_in",
                                      "credit_stall_cycles")}
                    counts[f"stall_{direction}"] = sums["credit_stall_cycles"]
                    counts[f"packets_{direction}"] = sums["packets_out"]
                    counts[f"bytes_{direction}"] = sums["bytes_out"]
                    reverse = "ba" if direction == "ab" else "ab"
                    counts.setdefault(f"packets_{reverse}", sums["packets_in"])
                    counts.setdefault(f"bytes_{reverse}", sums["bytes_in"])
            links.append({
                "name": name, "cable": link.name, "a": list(link.a), "b": list(link.b),
                "delay": link.delay,
                "credit_stall_cycles": counts.get("stall_ab", 0) + counts.get("stall_ba", 0),
                "packets": counts["packets_ab"] + counts["packets_ba"],
                "bytes": counts["bytes_ab"] + counts["bytes_ba"],
                "packets_ab": counts["packets_ab"], "packets_ba": counts["packets_ba"],
                "bytes_ab": counts["bytes_ab"], "bytes_ba": counts["bytes_ba"],
                "busy_beats_ab": (beats[link.a] - beats_before[link.a]) % (1 << 32),
                "busy_beats_ba": (beats[link.b] - beats_before[link.b]) % (1 << 32),
                "utilisation": self.utilisation[link.a],
                "utilisation_ba": self.utilisation[link.b]})
        drops = {f"{s}.p{p}.vl{vl}.{name}": values[name]
                 for (s, p, vl), values in sorted(switch.items()) for name in DROP_COUNTERS}
        retrans = {nic: {k: values[k] for k in RETRANSMISSION_COUNTERS}
                   for nic, values in nics.items()}
        posted_wqes = sum(len(qp.posted) for nic in self.tb.nics for qp in nic.gpu.qps.values())
        cqe = {k: sum(nic.cqe_counts[k] for nic in self.tb.nics) for k in ("send", "recv", "errors")}
        by_opcode = {}
        for nic in self.tb.nics:
            for name, count in nic.send_cqe_opcodes.items():
                by_opcode[name] = by_opcode.get(name, 0) + count
        return {
            "schema": SCHEMA, "config": c, "latency": latency, "phases": phases,
            "ranks": self.ranks, "messages": [m.record() for m in network], "links": links,
            "sample_cycles": c["sample_cycles"], "workload_start": workload_start,
            "workload_end": workload_end,
            "drops": {"total": sum(drops.values()), "by_counter": drops},
            "overflows": len(overflows),
            "retransmissions": {"total": sum(sum(v.values()) for v in retrans.values()),
                                "by_nic": retrans},
            "cqes": {"posted_wqes": posted_wqes, "send_cqes": cqe["send"],
                     "send_cqes_by_opcode": by_opcode,
                     "receive_cqes": cqe["recv"], "errors": cqe["errors"] + len(self.tb.errors)},
            "nic_counters": nics,
            "cycles": self.tb.loop.cycle,
            "pcap": "link.pcap", "pcap_link": self.pcap_name,
            "cut": self.cut,
        }

    def bench_records(self, results):
        if not os.environ.get("BENCH_RECORDS"):
            return
        from tb.runner import bench_record
        config, cut = results["config"], results["cut"]
        # A run with a cut cable records under fabric.cut.*, beside the same step without it.
        prefix = "fabric.cut." if cut else "fabric."
        for phase in results["phases"]:
            if config["scenario"] == "moe" and phase["end"] is not None:
                bench_record(f"{prefix}moe_{phase['name']}_us",
                             (phase["end"] - phase["start"]) * CLOCK_NS / 1000, "us", config)
        bench_record(f"{prefix}drops", results["drops"]["total"], "packets", config)
        if cut and cut["up"] is not None:
            bench_record("fabric.cut.detect_cycles", cut["down"] - cut["cut"], "cycles", config)
            bench_record("fabric.cut.recovery_cycles", cut["up"] - cut["restored"], "cycles",
                         config)
            bench_record("fabric.cut.packets_resent", sum(
                nic["packets_resent"] for nic in results["retransmissions"]["by_nic"].values()),
                "packets", config)

    def summary(self, results):
        lines = [f"{self.config['scenario']}: {len(self.messages)} messages, "
                 f"{results['cycles']} cycles, checks {results['checks']}"]
        for phase in results["phases"]:
            if phase["end"] is not None:
                lines.append(f"  {phase['name']}: {phase['end'] - phase['start']} cycles")
        return "\n".join(lines)


@cocotb.test()
async def moe(dut):
    """A DeepEP-style MoE dispatch and combine step across the fabric."""
    scenario = Scenario(dut)
    await scenario.run(scenario.moe)


@cocotb.test()
async def kv(dut):
    """A prefill-to-decode KV-cache push under background all-to-all traffic."""
    scenario = Scenario(dut)
    await scenario.run(scenario.kv)


# --- launcher --------------------------------------------------------------------------------

class ScenarioFailed(AssertionError):
    """The scenario ran and a check failed (or it did not finish): ``run_dir`` holds its log
    and, when it got that far, ``scenario_results.json``."""

    def __init__(self, message, run_dir):
        super().__init__(message)
        self.run_dir = run_dir


def full_config(config):
    """schema's ``config`` from the options given: defaults filled, derived keys added,
    everything validated (``ValueError`` naming the option) without building anything."""
    from tb.fabric_top import FABRIC_DEFAULTS
    return scenario_config(config, max_ranks=FABRIC_DEFAULTS["num_qps"])


def fabric_params(config):
    """The fabric a configuration runs on (the same parameter dict as tb/test_fabric.py's
    default, so that both share one build, unless the wire delay differs)."""
    from tb.fabric_top import FABRIC_DEFAULTS
    params = dict(nics_per_leaf=config["nics_per_leaf"], leaves=config["leaves"],
                  spines=config["spines"])
    if config["wire_delay"] != FABRIC_DEFAULTS["wire_delay"]:
        params["wire_delay"] = config["wire_delay"]
    return params


def launch(config, *, progress_file=None, waves=False):
    """Build the fabric for ``config`` (schema's ``config`` without the derived keys; missing
    options take ``models.moe.DEFAULTS``) and run its scenario. Returns the run directory
    (``scenario_results.json``, ``progress.json``, ``link.pcap``, ``test.log``); raises
    :class:`ScenarioFailed` (with ``run_dir``) when the scenario ran and failed, ``ValueError``
    for bad options. ``progress_file``: also write the progress there. ``BENCH_RECORDS`` in
    the environment reaches the simulation (cocotb's runner passes the environment on)."""
    from tb import runner
    from tb.fabric_top import run_fabric
    c = full_config(config)
    text = json.dumps(c, sort_keys=True)
    note = runner.BUILD / "fabric_top" / "scenario_runs" / \
        f"{hashlib.sha1(text.encode()).hexdigest()[:12]}.txt"
    note.parent.mkdir(parents=True, exist_ok=True)
    note.unlink(missing_ok=True)
    env = {"SCENARIO_CONFIG": text, "SCENARIO_RUN_NOTE": str(note)}
    if progress_file:
        env["SCENARIO_PROGRESS"] = str(Path(progress_file).resolve())
    try:
        return run_fabric(module="tb.fabric_scenarios", params=fabric_params(c),
                          testcase=c["scenario"], expect_tests=1, extra_env=env, waves=waves)
    except AssertionError as error:
        run_dir = Path(note.read_text()) if note.exists() else None
        raise ScenarioFailed(str(error), run_dir) from error
