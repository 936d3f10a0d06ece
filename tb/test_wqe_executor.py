"""WqeExecutor (hdl/nic/wqe_executor.py) against a Python reference, in Amaranth's simulator.

The reference (``Reference`` below) executes each WQE descriptor as docs/nic.md
"Execution" says: flush, the checks in table order, MTU segmentation, per-QP next PSN, and
gives the packet descriptors (headers built with the codecs of ``models.ib``), the AXI
payload bursts and the completion record. One testbench drives the executor cycle by
cycle: it answers the two context read ports from Python tables (synchronous: the data
of the previous cycle's address), offers WQEs with random gaps, applies random
backpressure on ``packet``, ``completion`` and ``ar``, strobes ``payload_freed`` at
random for beats whose bursts were issued, and plays the register block (a QP goes to
``ERR`` 1-3 cycles after ``qp_error``; ``qp_reset`` with new contexts between batches).

Checked every transfer: packet descriptors byte-exact and in order (each header also
decoded by ``models.packet.parse_packet``), each packet's bursts issued no later than its
descriptor, bursts in order, each piece record on ``pieces`` exact, in order and no later
than its piece's first burst (a gather list's packet: one piece per segment it touches,
``models.nic.gather_pieces``), the payload-buffer reservation (a packet's ``dma_beats`` at
its first burst, minus ``payload_freed``) never above ``payload_buffer_beats``,
completion records exact, in WQE order and after their first packet (the message's other
packets may follow), a ``sent`` strobe with the QP and PSN of each packet in the cycle
after its descriptor's handshake (a READ request's: the READ's last PSN) and at no other
time, one ``qp_error`` per local error;
at the end the counters.

The reference gives each QP's WQEs consecutive ring indices (the bench numbers them:
``wqe_index`` plus ``wqe_blocks`` is the next WQE's), keeps ``recorded`` and expects the
records' reliability fields (``laddr``, ``mtu``, ``retry_cnt``, ``rnr_retry``,
``ack_timeout``); indices restart at 0 after ``qp_reset``, so a ``recorded`` kept over a
reset would suppress records.

Go-back-N (``RewindBench``): the executor between a fetcher and a completion unit that
rewind QPs at random times against random traffic and backpressure on every output;
checked: the packets from the rewound WQE on with the right PSNs (runs of each QP's
packet sequence, at most two stale packets after a rewind), every burst with its
packet, one exact record per WQE in order (none for WQEs before ``recorded``) after the
WQE's first packet, ``sent`` for every packet, ``wqes_squashed`` and ``packets_resent``
exact, and a second run after ``qp_reset``.

Runs: random WQEs of every opcode (NOP and DUMP: a record, no packet, no PSN; the
rewind runs leave them out, since a NOP sent again is invisible to their squash count)
with lengths 0 .. 20 KiB, inline data of 0 .. 256 bytes (past 64 read back from the send
queue: bursts checked slot by slot, rings ending inside the data), unaligned addresses, MTUs
256 .. 4096, PSNs wrapping, and each check of the table failing now and then (several
seeds); directed: every check row with its syndrome (then FLUSH for the QP, other QPs
unaffected), QP reset and PSN reload, RESET state and bad QPN, reservation exactness with
stray ``payload_freed``, throughput (one-packet WQEs at one per cycle, an N-packet
message in N cycles) and the documented latency, parameter checks. A pure-Python test
checks this reference against models/nic/requester.py's RequesterModel on good WQEs, so the two
agree on every header byte.
"""
import gc
import random
import warnings
from collections import deque

import pytest
from amaranth.hdl import UnusedElaboratable

from hdl.nic.signatures import (
    MAX_NIC_HEADER_BYTES, ArLayout, CompletionRecordLayout, GatherPieceLayout, CompletionStatus, MkeyLayout, MlxOpcode,
    PacketDescriptorLayout, PayloadSource, QpConfigLayout, QpState, Syndrome,
    WqeDescriptorLayout,
)
from hdl.nic.wqe_executor import WqeExecutor
from models.ib import BTH, LRH, RETH, AtomicETH, ImmDt, MaskedAtomicETH, Opcode
from models.mlx5 import build_wqe
from models.nic import Access as ModelAccess
from models.nic import Mkey as ModelMkey
from models.nic import QpContext, RequesterModel, gather_pieces
from models.packet import parse_packet
from tb.amaranth_sim import Driver, simulate

NUM_QPS = 8
NUM_MKEYS = 16
NUM_VLS = 2

RTS, ERR, RESET = QpState.RTS.value, QpState.ERR.value, QpState.RESET.value
SENT, ERROR, FLUSH = (CompletionStatus.SENT.value, CompletionStatus.ERROR.value,
                      CompletionStatus.FLUSH.value)
OP = {op.name: op.value for op in MlxOpcode}
LOCAL_OPS = (OP["NOP"], OP["DUMP"])     # a record, no packet, no PSN
MASKED_OPS = (OP["ATOMIC_MASKED_CS"], OP["ATOMIC_MASKED_FA"])
ATOMIC_OPS = (OP["ATOMIC_CS"], OP["ATOMIC_FA"]) + MASKED_OPS


def atomic_bytes(d):
    """An atomic descriptor's operand size: 4 for a masked one of opmod 0x08."""
    return 4 if d["opcode"] in MASKED_OPS and d["opmod"] == 0x08 else 8
LOCAL_WRITE = 1

WQE = WqeDescriptorLayout()
QPC = QpConfigLayout()
MKEY = MkeyLayout()
DESC = PacketDescriptorLayout()
CMP = CompletionRecordLayout()
AR = ArLayout()
PIECE = GatherPieceLayout()


def pack(layout, values):
    word = 0
    for name, field in layout:
        value = int(getattr(values.get(name, 0), "value", values.get(name, 0)))
        word |= (value & ((1 << field.width) - 1)) << field.offset
    return word


def unpack(layout, word):
    return {name: (word >> field.offset) & ((1 << field.width) - 1) for name, field in layout}


def gather(*segments):
    """Descriptor fields of a data segment or gather list: ``(byte_count, lkey, laddr)`` each."""
    (byte_count, lkey, laddr), more = segments[0], segments[1:]
    return dict(has_data=1, segments=len(segments), byte_count=byte_count, lkey=lkey, laddr=laddr,
                more_segments=sum((c | k << 32 | a << 64) << 128 * i
                                  for i, (c, k, a) in enumerate(more)))


def gather_segments(d):
    """A descriptor's data segments, ``(byte_count, lkey, laddr)`` each."""
    if not d["has_data"]:
        return []
    more = d.get("more_segments", 0)
    return [(d["byte_count"], d["lkey"], d["laddr"])] + [
        ((more >> 128 * i) & 0xFFFFFFFF, (more >> (128 * i + 32)) & 0xFFFFFFFF,
         (more >> (128 * i + 64)) & ((1 << 64) - 1)) for i in range(d.get("segments", 1) - 1)]


# --- Reference --------------------------------------------------------------------------------

class Packet:
    def __init__(self, wqe, desc, ars, pieces):
        self.wqe = wqe
        self.desc = desc            # PacketDescriptorLayout fields
        self.ars = ars              # [(addr, len)]
        self.pieces = pieces        # [(GatherPieceLayout fields, index of its first burst)]
        self.pieces_seen = 0
        self.ars_seen = 0
        self.ar_cycles = []


class Expected:
    """What one WQE descriptor should produce."""
    def __init__(self, desc):
        self.desc = desc
        self.packets = []
        self.record = None          # CompletionRecordLayout fields, or None (dropped)
        self.resent = False         # executed without a record (recorded before)
        self.first_packet_cycle = None
        self.last_psn = None        # its last PSN, if it is sent


class QpRuntime:
    def __init__(self):
        self.loaded = False
        self.next_psn = 0
        self.error = False
        self.recorded = 0           # WQE index past the newest recorded WQE
        self.next_index = 0         # the index the bench gives the QP's next WQE


class Reference:
    """The executor's view of the world and the rules it follows."""

    def __init__(self, num_qps, num_mkeys, num_vls, slid, sl_to_vl):
        self.num_qps, self.num_mkeys, self.num_vls = num_qps, num_mkeys, num_vls
        self.slid = slid
        self.sl_to_vl = sl_to_vl
        self.qps = [dict(mtu=1, sl=0, cqn=0, sq_psn=0) for _ in range(num_qps)]
        self.state = [RTS] * num_qps
        self.runtime = [QpRuntime() for _ in range(num_qps)]
        self.mkeys = [dict(valid=0) for _ in range(num_mkeys)]

    def reset_qp(self, q):
        self.runtime[q] = QpRuntime()

    def check(self, d, qp):
        """(status, syndrome) by docs/nic.md's table, plus the executor's own rows."""
        q = d["qpn"]
        op = d["opcode"]
        atomic = op in ATOMIC_OPS
        read = op == OP["RDMA_READ"]
        local = op in LOCAL_OPS
        length = d["byte_count"] if (d["has_data"] or d["inline"]) and not local else 0
        if self.state[q] != RTS or self.runtime[q].error:
            return FLUSH, Syndrome.WR_FLUSH_ERR.value
        if d["format_error"]:
            return ERROR, d["syndrome"]
        if (op not in OP.values() or (d["inline"] and (d["has_data"] or read or atomic or local))
                or ((atomic or op == OP["DUMP"]) and not d["has_data"])
                or (op == OP["NOP"] and d["has_data"])):
            return ERROR, Syndrome.LOCAL_QP_OP_ERR.value
        segments = gather_segments(d)
        if len(segments) > 1:
            length = sum(byte_count for byte_count, _, _ in segments)
        if ((d["inline"] and d["byte_count"] > 256) or (atomic and d["byte_count"] != atomic_bytes(d))
                or length > 1 << 31):
            return ERROR, Syndrome.LOCAL_LENGTH_ERR.value
        vl = self.sl_to_vl[qp["sl"]]
        if vl == 15 or vl >= self.num_vls or not 1 <= qp["mtu"] <= 5:
            return ERROR, Syndrome.LOCAL_QP_OP_ERR.value
        # Every data segment with bytes, a gather list's in order (a DUMP's key covers its
        # data segment's bytes, though it moves none).
        for byte_count, lkey, laddr in segments if not d["inline"] else ():
            if not byte_count:
                continue
            mk = self.mkeys[(lkey >> 8) % self.num_mkeys]
            end = laddr + byte_count
            if not (mk["valid"] and mk["key"] == lkey and mk["pd"] == qp["pd"]):
                return ERROR, Syndrome.LOCAL_PROT_ERR.value
            if not (laddr >= mk["base"] and end <= mk["base"] + mk["length"]
                    and end <= 1 << 64):
                return ERROR, Syndrome.LOCAL_PROT_ERR.value
            if (read or atomic) and not mk["access"] & LOCAL_WRITE:
                return ERROR, Syndrome.LOCAL_PROT_ERR.value
        return SENT, 0

    def execute(self, d):
        exp = Expected(d)
        q = d["qpn"]
        if q >= self.num_qps:
            return exp
        qp = self.qps[q]
        rt = self.runtime[q]
        status, syndrome = self.check(d, qp)
        record = dict(qpn=q, cqn=qp["cqn"], wqe_index=d["wqe_index"],
                      wqe_blocks=d["wqe_blocks"], opcode=d["opcode"],
                      signaled=int(bool(d["fm_ce_se"] & 0x08)), status=status,
                      syndrome=syndrome, byte_count=0, first_psn=0, last_psn=0,
                      laddr=d["laddr"], mtu=qp["mtu"], retry_cnt=qp.get("retry_cnt", 0),
                      rnr_retry=qp.get("rnr_retry", 0), ack_timeout=qp.get("ack_timeout", 0))
        # Before ``recorded`` (sent again after a rewind): no record.
        exp.resent = (d["wqe_index"] - rt.recorded) & 0xFFFF >= 1 << 15
        if not exp.resent:
            exp.record = record
            rt.recorded = (d["wqe_index"] + d["wqe_blocks"]) & 0xFFFF
        if status == ERROR:
            rt.error = True
        if status != SENT:
            return exp

        op = d["opcode"]
        length = d["byte_count"] if (d["has_data"] or d["inline"]) and op not in LOCAL_OPS else 0
        segments = gather_segments(d)
        if len(segments) > 1:
            length = sum(byte_count for byte_count, _, _ in segments)
        mtu = 128 << qp["mtu"]
        psn = rt.next_psn if rt.loaded else qp["sq_psn"]
        npsn = 0 if op in LOCAL_OPS else 1 if length == 0 else -(-length // mtu)
        imm = op in (OP["SEND_IMM"], OP["RDMA_WRITE_IMM"])
        solicited = bool(d["fm_ce_se"] & 0x02) and op in (OP["SEND"], OP["SEND_IMM"],
                                                          OP["RDMA_WRITE_IMM"])
        vl = self.sl_to_vl[qp["sl"]]

        def packet(ib_opcode, ext, plen, first_byte, last, seq_psn):
            pad = -plen % 4
            header_len = LRH.SIZE + BTH.SIZE + sum(h.SIZE for h in ext)
            lrh = LRH(vl=vl, lver=0, sl=qp["sl"], dlid=qp["dlid"],
                      pktlen=(header_len + plen + pad + 4) // 4, slid=self.slid)
            bth = BTH(opcode=ib_opcode, se=int(solicited and last), padcnt=pad, pkey=qp["pkey"],
                      destqp=qp["dest_qpn"], ackreq=int(last), psn=seq_psn)
            header = lrh.pack() + bth.pack() + b"".join(h.pack() for h in ext)
            desc = dict(vl=vl, header=int.from_bytes(header, "little"), header_bytes=len(header),
                        payload_bytes=plen, source=PayloadSource.NONE.value, offset=0,
                        dma_beats=0, inline_data=0)
            ars = []
            pieces = []
            if plen and d["inline"] and plen <= 64:
                desc.update(source=PayloadSource.INLINE.value, inline_data=d["inline_data"])
            elif plen and d["inline"]:
                # Read back from the send queue: the WQE's blocks are ring slots in turn,
                # a burst per run of contiguous slots within a 4 KiB page.
                offset = 36 if op in (OP["RDMA_WRITE"], OP["RDMA_WRITE_IMM"]) else 20
                ring = 1 << qp["log_sq_size"]
                words = (offset + plen - 1) // 64 + 1
                slots = [(qp["sq_base"] + 64 * ((d["wqe_index"] + k) % ring)) % (1 << 64)
                         for k in range(words)]
                desc.update(source=PayloadSource.DMA.value, offset=offset, dma_beats=words)
                for addr in slots:
                    if ars and ars[-1][0] + 64 * (ars[-1][1] + 1) == addr and addr % 4096:
                        ars[-1] = (ars[-1][0], ars[-1][1] + 1)
                    else:
                        ars.append((addr, 0))
            elif plen:
                # A piece per segment the packet's bytes touch (one for one segment), each
                # its words' bursts cut at 4 KiB; the packet's packed words from the first
                # piece's byte.
                cut = gather_pieces(segments, first_byte, plen)
                desc.update(source=PayloadSource.DMA.value, offset=cut[0][0] % 64,
                            dma_beats=(cut[0][0] % 64 + plen - 1) // 64 + 1)
                for k, (addr, size) in enumerate(cut):
                    start, stop = addr // 64, (addr + size - 1) // 64
                    pieces.append((dict(start=addr % 64, bytes=size, beats=stop - start + 1,
                                        last=int(k == len(cut) - 1)), len(ars)))
                    page_end = (start // 64 + 1) * 64 - 1
                    if stop > page_end:
                        ars += [(start * 64, page_end - start),
                                ((page_end + 1) * 64, stop - page_end - 1)]
                    else:
                        ars += [(start * 64, stop - start)]
            if desc["source"] == PayloadSource.DMA.value and not pieces:
                pieces.append((dict(start=desc["offset"], bytes=plen, beats=desc["dma_beats"],
                                    last=1), 0))
            exp.packets.append(Packet(exp, desc, ars, pieces))

        reth = RETH(va=d["raddr"], rkey=d["rkey"], dmalen=length)
        if op in (OP["SEND"], OP["SEND_IMM"], OP["RDMA_WRITE"], OP["RDMA_WRITE_IMM"]):
            base = Opcode.SEND_FIRST if op in (OP["SEND"], OP["SEND_IMM"]) else Opcode.RDMA_WRITE_FIRST
            write = base == Opcode.RDMA_WRITE_FIRST
            for i in range(npsn):
                first, last = i == 0, i == npsn - 1
                if first and last:
                    offset = 5 if imm else 4
                elif first:
                    offset = 0
                elif last:
                    offset = 3 if imm else 2
                else:
                    offset = 1
                ext = ([reth] if write and first else []) + ([ImmDt(imm=d["imm"])] if imm and last else [])
                plen = min(mtu, length - i * mtu)
                packet(base + offset, ext, plen, i * mtu, last, (psn + i) % (1 << 24))
        elif op == OP["RDMA_READ"]:
            packet(Opcode.RDMA_READ_REQUEST, [reth], 0, 0, True, psn)
        elif op in LOCAL_OPS:
            pass
        elif op in MASKED_OPS:
            fa = op == OP["ATOMIC_MASKED_FA"]
            ib = {(False, 8): Opcode.MASKED_COMPARE_SWAP, (True, 8): Opcode.MASKED_FETCH_ADD,
                  (False, 4): Opcode.MASKED_COMPARE_SWAP_4,
                  (True, 4): Opcode.MASKED_FETCH_ADD_4}[fa, atomic_bytes(d)]
            packet(ib, [MaskedAtomicETH(va=d["raddr"], rkey=d["rkey"], swap_add=d["swap_add"],
                                        compare=0 if fa else d["compare"],
                                        swap_mask=d["swap_mask"],
                                        compare_mask=d["compare_mask"])], 0, 0, True, psn)
        else:
            ib = Opcode.COMPARE_SWAP if op == OP["ATOMIC_CS"] else Opcode.FETCH_ADD
            compare = d["compare"] if op == OP["ATOMIC_CS"] else 0     # ignored by FetchAdd
            packet(ib, [AtomicETH(va=d["raddr"], rkey=d["rkey"], swap_add=d["swap_add"],
                                  compare=compare)], 0, 0, True, psn)
        record.update(byte_count=length, first_psn=psn, last_psn=(psn + npsn - 1) % (1 << 24))
        exp.last_psn = record["last_psn"]
        rt.loaded = True
        rt.next_psn = (psn + npsn) % (1 << 24)
        return exp


# --- Testbench --------------------------------------------------------------------------------

class Bench:
    def __init__(self, dut, rng, ref, *, p_wqe=0.8, p_packet=0.7, p_completion=0.7, p_ar=0.7,
                 p_free=0.6, p_piece=0.8):
        self.dut, self.rng, self.ref = dut, rng, ref
        self.p_wqe, self.p_packet, self.p_completion, self.p_ar, self.p_free, self.p_piece = (
            p_wqe, p_packet, p_completion, p_ar, p_free, p_piece)
        self.t = 0
        self.offered = None
        self.inputs = deque()               # (wqe fields, Expected)
        self.packets = deque()
        self.ars = deque()                  # (Packet, index)
        self.pieces = deque()               # (Packet, piece fields, index of its first burst)
        self.list_pieces = 0                # pieces seen of packets of several
        self.records = deque()              # Expected
        self.errors = deque()               # qpn of expected qp_error strobes
        self.to_err = []                    # (cycle, qpn): the register block's reaction
        self.issued_beats = 0               # burst beats not yet freed
        self.reserved = 0                   # reservation as the executor must count it
        self.max_reserved = 0
        self.counts = dict(wqes_executed=0, packets_sent=0, payload_bytes_sent=0,
                           wqe_errors=0, wqes_flushed=0, wqes_squashed=0, packets_resent=0)
        self.addr = (0, 0)
        self.drive = Driver()
        self.reset_strobe = None
        self.accept_cycles = []
        self.packet_cycles = []
        self.record_cycles = []
        self.sent_expect = None     # (qpn, psn) of the previous cycle's packet
        self.free_enabled = True
        self.stray_frees = 0                # payload_freed strobes with no beat reserved


    def submit(self, wqes):
        """Queue ``wqes``; each gets the next WQE index of its QP (after its blocks)."""
        exps = []
        for w in wqes:
            if w["qpn"] < self.ref.num_qps:
                rt = self.ref.runtime[w["qpn"]]
                w = dict(w, wqe_index=rt.next_index)
                rt.next_index = (rt.next_index + w["wqe_blocks"]) & 0xFFFF
            exp = self.ref.execute(w)
            self.inputs.append((w, exp))
            self.packets.extend(exp.packets)
            for pkt in exp.packets:
                self.ars.extend((pkt, i) for i in range(len(pkt.ars)))
                self.pieces.extend((pkt, fields, first) for fields, first in pkt.pieces)
            if exp.record is not None:
                self.records.append(exp)
                status = exp.record["status"]
                self.counts[{SENT: "wqes_executed", ERROR: "wqe_errors",
                             FLUSH: "wqes_flushed"}[status]] += 1
                if status == ERROR:
                    self.errors.append(w["qpn"])
            elif w["qpn"] >= self.ref.num_qps:
                self.counts["wqe_errors"] += 1
            self.counts["packets_sent"] += len(exp.packets)
            self.counts["packets_resent"] += len(exp.packets) if exp.resent else 0
            self.counts["payload_bytes_sent"] += sum(p.desc["payload_bytes"] for p in exp.packets)
            exps.append(exp)
        return exps

    def busy(self):
        return bool(self.inputs or self.offered or self.packets or self.records or self.ars
                    or self.pieces or self.errors)

    async def drain(self, ctx, max_cycles=200_000):
        start = self.t
        while self.busy():
            await self.cycle(ctx)
            assert self.t - start < max_cycles, "no progress"
        for _ in range(4):      # nothing more comes out
            await self.cycle(ctx)

    async def reconfigure(self, ctx, changes):
        """Between batches (executor drained): QP resets with new contexts, states, keys."""
        for q, qp in changes.get("reset", {}).items():
            self.ref.state[q] = RESET
            self.drive.set(self.dut.qp_state[q], RESET)
            self.reset_strobe = q
            await self.cycle(ctx)
            self.ref.reset_qp(q)
            self.ref.qps[q] = qp
            self.ref.state[q] = RTS
        for q, state in changes.get("state", {}).items():
            self.ref.state[q] = state
        for index, entry in changes.get("mkeys", {}).items():
            self.ref.mkeys[index] = entry
        await self.cycle(ctx)

    async def cycle(self, ctx):
        dut, rng, t = self.dut, self.rng, self.t
        ref = self.ref

        # Inputs of this cycle.
        for due, q in list(self.to_err):
            if due <= t:
                ref.state[q] = ERR
                self.to_err.remove((due, q))
        for q in range(dut.num_qps):
            self.drive.set(dut.qp_state[q], ref.state[q])
        self.drive.set(dut.qp_reset.valid, int(self.reset_strobe is not None))
        self.drive.set(dut.qp_reset.qpn, self.reset_strobe or 0)
        self.reset_strobe = None
        qaddr, maddr = self.addr
        # (an address past the table, from a bad QPN, reads zeros)
        qpc = ref.qps[qaddr] if qaddr < len(ref.qps) else {}
        self.drive.set(dut.qp_config.data.as_value(), pack(QPC, qpc))
        self.drive.set(dut.mkey.data.as_value(), pack(MKEY, ref.mkeys[maddr]))
        if self.offered is None and self.inputs and rng.random() < self.p_wqe:
            self.offered = self.inputs.popleft()
        self.drive.set(dut.wqe.valid, int(self.offered is not None))
        if self.offered is not None:
            self.drive.set(dut.wqe.payload.as_value(), pack(WQE, self.offered[0]))
        self.drive.set(dut.packet.ready, int(rng.random() < self.p_packet))
        self.drive.set(dut.completion.ready, int(rng.random() < self.p_completion))
        self.drive.set(dut.ar.ready, int(rng.random() < self.p_ar))
        self.drive.set(dut.pieces.ready, int(rng.random() < self.p_piece))
        freed = int(self.free_enabled and self.issued_beats > 0 and rng.random() < self.p_free)
        stray = not freed and self.stray_frees > 0
        self.stray_frees -= stray
        self.drive.set(dut.payload_freed, int(freed or stray))
        self.drive.apply(ctx)

        # Outputs.
        if ctx.get(dut.wqe.valid) and ctx.get(dut.wqe.ready):
            self.offered = None
            self.accept_cycles.append(t)
        sent_now = None
        if ctx.get(dut.pieces.valid) and ctx.get(dut.pieces.ready):
            assert self.pieces, (t, "unexpected piece")
            pkt, fields, _ = self.pieces.popleft()
            got = unpack(PIECE, ctx.get(dut.pieces.payload.as_value()))
            assert got == fields, (t, pkt.desc, got, fields)
            pkt.pieces_seen += 1
            self.list_pieces += not (fields["last"] and len(pkt.pieces) == 1)
        if ctx.get(dut.ar.valid) and ctx.get(dut.ar.ready):
            assert self.ars, (t, "unexpected AR")
            pkt, index = self.ars.popleft()
            # a piece's record no later than its first burst
            assert sum(first <= index for _, first in pkt.pieces) <= pkt.pieces_seen, (
                t, "burst before its piece record")
            got = unpack(AR, ctx.get(dut.ar.payload.as_value()))
            addr, length = pkt.ars[index]
            assert got == dict(id=1, addr=addr, len=length), (t, got, pkt.ars, pkt.desc)
            if index == 0:
                self.reserved += pkt.desc["dma_beats"]
                self.max_reserved = max(self.max_reserved, self.reserved)
                assert self.reserved <= dut.payload_buffer_beats, (t, self.reserved)
            self.issued_beats += length + 1
            pkt.ars_seen += 1
            pkt.ar_cycles.append(t)
        if ctx.get(dut.packet.valid) and ctx.get(dut.packet.ready):
            assert self.packets, (t, "unexpected packet")
            pkt = self.packets.popleft()
            got = unpack(DESC, ctx.get(dut.packet.payload.as_value()))
            if got["source"] != PayloadSource.INLINE.value:
                got["inline_data"] = pkt.desc["inline_data"] if pkt.desc["source"] == PayloadSource.INLINE.value else 0
            assert got == pkt.desc, (t, pkt.wqe.desc, diff(got, pkt.desc))
            assert pkt.ars_seen == len(pkt.ars), (t, "descriptor before its bursts")
            if got["payload_bytes"] <= 512:
                check_wire(got)
            if pkt.wqe.first_packet_cycle is None:
                pkt.wqe.first_packet_cycle = t
            sent_now = (pkt.wqe.desc["qpn"], sent_psn(got, pkt.wqe.last_psn))
            self.packet_cycles.append(t)
        if ctx.get(dut.completion.valid) and ctx.get(dut.completion.ready):
            assert self.records, (t, "unexpected completion")
            exp = self.records.popleft()
            got = unpack(CMP, ctx.get(dut.completion.payload.as_value()))
            assert got == exp.record, (t, exp.desc, diff(got, exp.record))
            if exp.packets:
                assert exp.first_packet_cycle is not None and exp.first_packet_cycle < t, (
                    t, "record before its first packet")
            self.record_cycles.append(t)
        check_sent(ctx, dut, t, self.sent_expect)
        self.sent_expect = sent_now
        if ctx.get(dut.qp_error.valid):
            assert self.errors, (t, "unexpected qp_error")
            q = self.errors.popleft()
            assert ctx.get(dut.qp_error.qpn) == q, t
            self.to_err.append((t + rng.randint(1, 3), q))
        if freed:
            self.issued_beats -= 1
            self.reserved -= 1

        self.addr = (ctx.get(dut.qp_config.addr), ctx.get(dut.mkey.addr))
        await ctx.tick()
        self.t += 1

    def check_counters(self, ctx):
        for name, value in self.counts.items():
            assert ctx.get(getattr(self.dut, name)) == value % (1 << 32), name


def check_sent(ctx, dut, t, expect):
    """``sent`` strobes with ``expect`` (qpn, psn), or not at all when it is None."""
    got = (ctx.get(dut.sent.p.qpn), ctx.get(dut.sent.p.psn)) if ctx.get(dut.sent.valid) else None
    assert got == expect, (t, "sent", got, expect)


def diff(got, want):
    return {k: (hex(got[k]), hex(want[k])) for k in want if got.get(k) != want[k]}


def check_wire(desc):
    """The header is a real IB packet's: it parses, and PktLen/PadCnt match the payload."""
    header = desc["header"].to_bytes(MAX_NIC_HEADER_BYTES, "little")[:desc["header_bytes"]]
    pad = -desc["payload_bytes"] % 4
    parsed = parse_packet(header + bytes(desc["payload_bytes"] + pad) + bytes(4))
    assert parsed.lrh.vl == desc["vl"]
    assert len(parsed.payload) == desc["payload_bytes"]


def run_bench(dut, body, *, seed=0, **bench_args):
    rng = random.Random(seed)
    sl_to_vl = [rng.randrange(dut.num_vls) for _ in range(16)]
    sl_to_vl[13] = 15                       # an SL with no data VL
    sl_to_vl[14] = dut.num_vls              # one mapped to a VL the port does not have
    ref = Reference(dut.num_qps, dut.num_mkeys, dut.num_vls, slid=rng.getrandbits(16),
                    sl_to_vl=sl_to_vl)
    bench = Bench(dut, rng, ref, **bench_args)

    async def testbench(ctx):
        ctx.set(dut.slid, ref.slid)
        for sl in range(16):
            ctx.set(dut.sl_to_vl[sl], sl_to_vl[sl])
        await body(ctx, bench, rng)
        await bench.drain(ctx)
        bench.check_counters(ctx)

    simulate(dut, testbench)
    return bench


# --- Stimulus ---------------------------------------------------------------------------------

def random_qp(rng, *, mtu=None, sl=None):
    log_sq_size = rng.randrange(16)
    return dict(
        # aligned to min(4096, ring bytes), as RESET -> RTS checks
        sq_base=rng.getrandbits(64) & -min(4096, 64 << log_sq_size), log_sq_size=log_sq_size,
        mtu=(rng.randint(1, 5) if rng.random() < 0.97 else rng.choice([0, 6, 7])) if mtu is None else mtu,
        sl=(rng.randrange(13) if rng.random() < 0.95 else rng.choice([13, 14])) if sl is None else sl,
        max_outstanding=rng.randint(1, 64), dest_qpn=rng.getrandbits(24),
        dlid=rng.getrandbits(16), pd=rng.randint(1, 3), pkey=rng.getrandbits(16),
        sq_psn=rng.choice([rng.getrandbits(24), (1 << 24) - rng.randint(1, 40)]),
        cqn=rng.getrandbits(8), retry_cnt=rng.getrandbits(3), rnr_retry=rng.getrandbits(3),
        ack_timeout=rng.getrandbits(5))


def random_mkeys(rng, num_mkeys):
    mkeys = []
    for index in range(num_mkeys):
        base = rng.choice([rng.getrandbits(48), rng.getrandbits(32) * 4096 - rng.randrange(200)])
        mkeys.append(dict(
            key=(index << 8) | rng.getrandbits(8) if index else 0xFFFF_FF00 | rng.getrandbits(8),
            base=base, length=rng.choice([1 << 20, 1 << 16, 1 << 32]),
            access=rng.choice([15, 15, 15, 14, 7]), pd=rng.randint(1, 3),
            valid=int(rng.random() < 0.9)))
    # Index 0 also holds a key whose index bits wrap (0xFFFFFF % 16 == 15) - keep it findable.
    mkeys[0]["key"] = 0
    return mkeys


def random_length(rng):
    r = rng.random()
    if r < 0.15:
        return 0
    if r < 0.55:
        return rng.randint(1, 200)
    if r < 0.9:
        return rng.randint(200, 5000)
    return rng.randint(5000, 20_000)


def random_wqe(rng, ref, qpn, index, *, p_bad=0.08, p_list=0.03):
    """A random descriptor for ``qpn``: a good one that fits a key of the QP's PD most of
    the time, each check of the table broken now and then; a WRITE or SEND with a data
    segment a gather list with probability ``p_list``."""
    op = rng.choice(list(OP.values()))
    qp = ref.qps[qpn] if qpn < ref.num_qps else {"pd": 0}
    w = {name: 0 for name, _ in WQE}
    w.update(qpn=qpn, wqe_index=index, wqe_blocks=rng.randint(1, 4), opcode=op,
             opmod=0, ds=rng.getrandbits(6), fm_ce_se=rng.choice([0, 0x08, 0x02, 0x0A, 0xFF]),
             imm=rng.getrandbits(32), raddr=rng.getrandbits(64), rkey=rng.getrandbits(32))
    atomic = op in ATOMIC_OPS
    if atomic:
        w.update(swap_add=rng.getrandbits(64), compare=rng.getrandbits(64))
    if op in MASKED_OPS:
        # as the fetcher gives them: opmod 0x08 or 0x09, a masked FA's compare mask 0
        bits = rng.choice([32, 64])         # 4-byte operands are zero-extended
        w.update(opmod=0x08 if bits == 32 else 0x09, swap_add=rng.getrandbits(bits),
                 compare=rng.getrandbits(bits), swap_mask=rng.getrandbits(bits),
                 compare_mask=0 if op == OP["ATOMIC_MASKED_FA"] else rng.getrandbits(bits))
    kind = ("data" if atomic or op in (OP["RDMA_READ"], OP["DUMP"]) else "none" if op == OP["NOP"]
            else rng.choice(["data", "data", "inline", "none"]))
    if kind == "inline":
        # Longer than 64 bytes: read back from the ring, which holds the whole WQE (the
        # doorbell checks keep a WQE within its ring); the descriptor's first 64 bytes
        # are not used then.
        n = rng.choice([rng.randint(0, 64), rng.randint(65, 256), 256])
        header = 36 if op in (OP["RDMA_WRITE"], OP["RDMA_WRITE_IMM"]) else 20
        if (header + n - 1) // 64 >= 1 << qp.get("log_sq_size", 15):
            n = 64
        w.update(inline=1, byte_count=n, inline_data=rng.getrandbits(8 * min(n, 64)))
    elif kind == "data":
        length = (atomic_bytes(w) if atomic else rng.choice([0, 1]) if op == OP["DUMP"]
                  else random_length(rng))
        fitting = [i for i, k in enumerate(ref.mkeys)
                   if k["valid"] and k["pd"] == qp["pd"] and k["length"] >= length
                   and (not (atomic or op == OP["RDMA_READ"]) or k["access"] & LOCAL_WRITE)]
        index_ = rng.choice(fitting) if fitting else rng.randrange(ref.num_mkeys)
        k = ref.mkeys[index_]
        laddr = k.get("base", 0) + rng.randint(0, max(0, k.get("length", 0) - length))
        w.update(has_data=1, byte_count=length, lkey=k.get("key", 0), laddr=laddr % (1 << 64))
    if rng.random() < p_bad:
        bad = rng.choice(["format", "long", "key_missing", "key_variant", "key_pd",
                          "range_low", "range_high", "inconsistent", "inline_long", "atomic_len"])
        if bad == "format":
            w.update(format_error=1, syndrome=rng.choice([0x01, 0x02]))
        elif bad == "long":
            w.update(has_data=1, inline=0, byte_count=(1 << 31) + rng.randint(1, 1000))
        elif bad == "key_missing":
            index_ = rng.randrange(ref.num_mkeys)
            w.update(has_data=1, inline=0, byte_count=w.get("byte_count") or 16,
                     lkey=(index_ << 8) | 0x55)
            ref.mkeys[index_] = dict(ref.mkeys[index_], valid=0)
        elif bad == "key_variant" and w.get("has_data"):
            w["lkey"] ^= 1 << rng.randrange(8)
        elif bad == "key_pd":
            others = [k for k in ref.mkeys if k["valid"] and k["pd"] != qp["pd"]]
            if others:
                k = rng.choice(others)
                w.update(has_data=1, inline=0, byte_count=w.get("byte_count") or 16,
                         lkey=k["key"], laddr=k["base"])
        elif bad == "range_low" and w.get("has_data") and w["byte_count"]:
            w["laddr"] = (w["laddr"] - rng.randint(1 << 20, 1 << 33)) % (1 << 64)
        elif bad == "range_high" and w.get("has_data") and w["byte_count"]:
            w["laddr"] = (w["laddr"] + rng.randint(1 << 20, 1 << 33)) % (1 << 64)
        elif bad == "inconsistent":
            w.update(opcode=rng.choice([0x01, 0x0F, 0x13, 0x14, 0xFF]))
        elif bad == "inline_long":
            w.update(inline=1, has_data=0, byte_count=rng.randint(257, 300))
        elif bad == "atomic_len" and atomic:
            w["byte_count"] = rng.choice([0, 4, 16])
    if kind == "data" and not (atomic or op in (OP["RDMA_READ"], OP["DUMP"])) and rng.random() < p_list:
        # a gather list: 1 to 3 more segments in keys of the QP's PD, some empty, some
        # long enough to span packets, now and then one with a key variant
        more = []
        for _ in range(rng.randint(1, 3)):
            k = ref.mkeys[rng.choice(fitting)] if fitting else ref.mkeys[0]
            more.append((rng.choice([0, rng.randint(1, 300), rng.randint(300, 9000)]),
                         k.get("key", 0) ^ (rng.random() < 0.1) << 3,
                         (k.get("base", 0) + rng.randint(0, 4096)) % (1 << 64)))
        w.update(gather((w["byte_count"], w["lkey"], w["laddr"]), *more))
    return w


# --- Tests ------------------------------------------------------------------------------------

def random_body(batches, wqes_per_batch, **wqe_args):
    async def body(ctx, bench, rng):
        ref = bench.ref
        dut = bench.dut
        initial = {q: random_qp(rng) for q in range(dut.num_qps)}
        for q, qp in initial.items():
            ref.qps[q] = qp
        for i, k in enumerate(random_mkeys(rng, dut.num_mkeys)):
            ref.mkeys[i] = k
        index = [0] * 256
        for batch in range(batches):
            if batch:
                # Reset some QPs (errored ones mostly), new contexts, keys now and then.
                resets = {q: random_qp(rng) for q in range(dut.num_qps)
                          if ref.state[q] != RTS or ref.runtime[q].error or rng.random() < 0.2}
                states = {}
                if rng.random() < 0.3:      # a fatal NAK moved a QP to ERR meanwhile
                    states[rng.randrange(dut.num_qps)] = ERR
                await bench.reconfigure(ctx, {"reset": resets, "state": states})
            wqes = []
            for _ in range(wqes_per_batch):
                qpn = rng.randrange(dut.num_qps) if rng.random() > 0.01 else rng.randrange(dut.num_qps, 256)
                wqes.append(random_wqe(rng, ref, qpn, index[qpn], **wqe_args))
                index[qpn] = (index[qpn] + 1) % (1 << 16)
            bench.submit(wqes)
            await bench.drain(ctx)
    return body


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random(seed):
    dut = WqeExecutor(num_qps=NUM_QPS, num_mkeys=NUM_MKEYS, num_vls=NUM_VLS,
                      payload_buffer_beats=130)
    bench = run_bench(dut, random_body(6, 35), seed=seed)
    assert bench.max_reserved > 65      # the reservation limit was reached and held


def test_gather_lists():
    """Mostly gather lists (1 to 4 segments, zero-length ones among them): each packet's
    pieces, their records and bursts against ``gather_pieces`` cutting the concatenation
    at the MTU."""
    dut = WqeExecutor(num_qps=NUM_QPS, num_mkeys=NUM_MKEYS, num_vls=NUM_VLS,
                      payload_buffer_beats=130)
    bench = run_bench(dut, random_body(4, 30, p_list=1.0), seed=5)
    assert bench.list_pieces > 30


def test_random_other_shape():
    """QP and key counts that are not powers of two (the key index is a true modulo),
    one data VL, the default payload buffer."""
    dut = WqeExecutor(num_qps=3, num_mkeys=5, num_vls=1)
    run_bench(dut, random_body(4, 30), seed=4, p_free=0.9)


def make_wqe(qpn, kind, **fields):
    w = {name: 0 for name, _ in WQE}
    w.update(qpn=qpn, opcode=OP[kind], wqe_blocks=1, fm_ce_se=0x08)
    w.update(fields)
    return w


def directed_world(ref, rng):
    for q in range(ref.num_qps):
        ref.qps[q] = dict(random_qp(rng), mtu=1, sl=0, pd=1)
    ref.mkeys[1] = dict(key=0x101, base=0x10000, length=0x10000, access=15, pd=1, valid=1)
    ref.mkeys[2] = dict(key=0x202, base=0x20000, length=0x1000, access=14, pd=1, valid=1)
    ref.mkeys[3] = dict(key=0x303, base=0x30000, length=0x1000, access=15, pd=2, valid=1)
    ref.mkeys[4] = dict(key=0x404, base=(1 << 64) - 4096, length=8192, access=15, pd=1, valid=1)
    ref.mkeys[5] = dict(key=0x505, base=0x50000, length=0x1000, access=15, pd=1, valid=0)


OP_ERR = Syndrome.LOCAL_QP_OP_ERR.value
LEN_ERR = Syndrome.LOCAL_LENGTH_ERR.value
PROT_ERR = Syndrome.LOCAL_PROT_ERR.value
FLUSH_ERR = Syndrome.WR_FLUSH_ERR.value

# (name, QP context changes, QP state, WQE fields over a good 100-byte SEND, status, syndrome)
CHECK_ROWS = [
    ("parser format error (op)", {}, RTS, dict(format_error=1, syndrome=OP_ERR), ERROR, OP_ERR),
    ("parser format error (length)", {}, RTS, dict(format_error=1, syndrome=LEN_ERR), ERROR, LEN_ERR),
    ("unknown opcode", {}, RTS, dict(opcode=0x01), ERROR, OP_ERR),
    ("inline and a data segment", {}, RTS, dict(inline=1, byte_count=10), ERROR, OP_ERR),
    ("inline READ", {}, RTS, dict(opcode=OP["RDMA_READ"], has_data=0, inline=1, byte_count=8),
     ERROR, OP_ERR),
    ("atomic without data segment", {}, RTS, dict(opcode=OP["ATOMIC_FA"], has_data=0, byte_count=8),
     ERROR, OP_ERR),
    ("inline longer than 256", {}, RTS, dict(has_data=0, inline=1, byte_count=257), ERROR, LEN_ERR),
    ("atomic of 16 bytes", {}, RTS, dict(opcode=OP["ATOMIC_CS"], byte_count=16), ERROR, LEN_ERR),
    ("4-byte masked atomic of 8 bytes", {}, RTS,
     dict(opcode=OP["ATOMIC_MASKED_FA"], opmod=0x08, byte_count=8), ERROR, LEN_ERR),
    ("8-byte masked atomic of 4 bytes", {}, RTS,
     dict(opcode=OP["ATOMIC_MASKED_CS"], opmod=0x09, byte_count=4), ERROR, LEN_ERR),
    ("4-byte masked atomic", {}, RTS, dict(opcode=OP["ATOMIC_MASKED_CS"], opmod=0x08,
                                            byte_count=4), SENT, 0),
    ("masked atomic without LOCAL_WRITE", {}, RTS,
     dict(opcode=OP["ATOMIC_MASKED_FA"], opmod=0x08, lkey=0x202, laddr=0x20000, byte_count=4),
     ERROR, PROT_ERR),
    ("longer than 2^31", {}, RTS, dict(byte_count=(1 << 31) + 1), ERROR, LEN_ERR),
    ("2^31 exactly, missing key", {}, RTS, dict(byte_count=1 << 31, lkey=0x505, laddr=0x50000),
     ERROR, PROT_ERR),
    ("SL maps to VL 15", dict(sl=13), RTS, {}, ERROR, OP_ERR),
    ("SL maps to a VL the port lacks", dict(sl=14), RTS, {}, ERROR, OP_ERR),
    ("MTU code 0", dict(mtu=0), RTS, {}, ERROR, OP_ERR),
    ("MTU code 6", dict(mtu=6), RTS, {}, ERROR, OP_ERR),
    ("key missing", {}, RTS, dict(lkey=0x505, laddr=0x50000), ERROR, PROT_ERR),
    ("key variant differs", {}, RTS, dict(lkey=0x1FF), ERROR, PROT_ERR),
    ("key of another PD", {}, RTS, dict(lkey=0x303, laddr=0x30000), ERROR, PROT_ERR),
    ("below the key's base", {}, RTS, dict(laddr=0xFFFF), ERROR, PROT_ERR),
    ("past the key's end", {}, RTS, dict(laddr=0x20000 - 99), ERROR, PROT_ERR),
    ("ends at the key's end", {}, RTS, dict(laddr=0x20000 - 100), SENT, 0),
    ("wraps past 2^64", {}, RTS, dict(lkey=0x404, laddr=(1 << 64) - 16, byte_count=32),
     ERROR, PROT_ERR),
    ("ends at 2^64", {}, RTS, dict(lkey=0x404, laddr=(1 << 64) - 32, byte_count=32), SENT, 0),
    ("READ without LOCAL_WRITE", {}, RTS, dict(opcode=OP["RDMA_READ"], lkey=0x202, laddr=0x20000),
     ERROR, PROT_ERR),
    ("atomic without LOCAL_WRITE", {}, RTS,
     dict(opcode=OP["ATOMIC_FA"], lkey=0x202, laddr=0x20000, byte_count=8), ERROR, PROT_ERR),
    ("WRITE without LOCAL_WRITE", {}, RTS,
     dict(opcode=OP["RDMA_WRITE"], lkey=0x202, laddr=0x20000), SENT, 0),
    ("READ of 0 bytes needs no key", {}, RTS,
     dict(opcode=OP["RDMA_READ"], lkey=0x505, byte_count=0), SENT, 0),
    ("NOP", {}, RTS, dict(opcode=OP["NOP"], has_data=0, byte_count=0), SENT, 0),
    ("NOP with a data segment", {}, RTS, dict(opcode=OP["NOP"]), ERROR, OP_ERR),
    ("NOP with inline data", {}, RTS, dict(opcode=OP["NOP"], has_data=0, inline=1, byte_count=4),
     ERROR, OP_ERR),
    ("DUMP", {}, RTS, dict(opcode=OP["DUMP"], byte_count=1), SENT, 0),
    ("DUMP needs no LOCAL_WRITE", {}, RTS, dict(opcode=OP["DUMP"], lkey=0x202, laddr=0x20000),
     SENT, 0),
    ("DUMP without a data segment", {}, RTS, dict(opcode=OP["DUMP"], has_data=0), ERROR, OP_ERR),
    ("DUMP, key missing", {}, RTS, dict(opcode=OP["DUMP"], lkey=0x505, laddr=0x50000),
     ERROR, PROT_ERR),
    ("DUMP past the key's end", {}, RTS, dict(opcode=OP["DUMP"], laddr=0x20000 - 99),
     ERROR, PROT_ERR),
    # gather lists: every segment with bytes checked in order; a zero-length one is not
    # looked up; the sum of the byte counts against 2^31 first
    ("gather list of 2", {}, RTS, gather((100, 0x101, 0x10010), (50, 0x202, 0x20000)),
     SENT, 0),
    ("gather list of 4, one empty with a missing key", {}, RTS,
     gather((100, 0x101, 0x10010), (0, 0x505, 0), (7, 0x202, 0x20F00), (1, 0x101, 0x1FFFF)),
     SENT, 0),
    ("gather, key missing in segment 2", {}, RTS,
     gather((100, 0x101, 0x10010), (8, 0x505, 0x50000), (8, 0x101, 0x10000)), ERROR, PROT_ERR),
    ("gather, key variant in segment 4", {}, RTS,
     gather((100, 0x101, 0x10010), (8, 0x101, 0x10000), (8, 0x101, 0x10000), (8, 0x1FF, 0x10000)),
     ERROR, PROT_ERR),
    ("gather, key of another PD in segment 4", {}, RTS,
     gather((1, 0x101, 0x10010), (0, 0x101, 0), (8, 0x101, 0x10000), (8, 0x303, 0x30000)),
     ERROR, PROT_ERR),
    ("gather, past the key's end in segment 3", {}, RTS,
     gather((100, 0x101, 0x10010), (8, 0x202, 0x20000), (100, 0x202, 0x20000 - 99),
            (8, 0x101, 0x10000)), ERROR, PROT_ERR),
    ("gather, below the key's base in segment 2", {}, RTS,
     gather((100, 0x101, 0x10010), (8, 0x202, 0x1FFFF)), ERROR, PROT_ERR),
    ("gather, wraps past 2^64 in segment 3", {}, RTS,
     gather((100, 0x101, 0x10010), (8, 0x202, 0x20000), (32, 0x404, (1 << 64) - 16)),
     ERROR, PROT_ERR),
    ("gather, sum over 2^31 (keys bad too)", {}, RTS,
     gather((1 << 30, 0x505, 0), ((1 << 30) - 1, 0x505, 0), (2, 0x101, 0x10000)), ERROR, LEN_ERR),
    ("gather, sum 2^31 exactly: the keys' turn (segment 1 past its key)", {}, RTS,
     gather((1 << 30, 0x101, 0x10000), (0, 0x101, 0), (1 << 30, 0x505, 0x50000)), ERROR, PROT_ERR),
    ("gather, SL maps to VL 15 before the keys", dict(sl=13), RTS,
     gather((100, 0x101, 0x10010), (8, 0x505, 0x50000)), ERROR, OP_ERR),
    ("QP in ERR", {}, ERR, {}, FLUSH, FLUSH_ERR),
    ("QP in RESET", {}, RESET, {}, FLUSH, FLUSH_ERR),
]


def test_checks():
    """Each check row: its syndrome, one qp_error, no packet; the QP's next WQE flushed
    while another QP's goes out."""
    dut = WqeExecutor(num_qps=4, num_mkeys=8, num_vls=NUM_VLS)

    async def body(ctx, bench, rng):
        ref = bench.ref
        directed_world(ref, rng)
        good = dict(has_data=1, lkey=0x101, laddr=0x10010, byte_count=100)
        qp0 = dict(ref.qps[0])
        for name, qp_changes, state, fields, status, syndrome in CHECK_ROWS:
            qp = dict(qp0, **qp_changes)
            await bench.reconfigure(ctx, {"reset": {0: qp}, "state": {0: state}})
            bad, follow, other = bench.submit([
                make_wqe(0, "SEND", **{**good, **fields}),
                make_wqe(0, "SEND", **good),
                make_wqe(1, "SEND", **good),
            ])
            assert (bad.record["status"], bad.record["syndrome"]) == (status, syndrome), name
            sends = status == SENT and fields.get("opcode") not in LOCAL_OPS
            assert bool(bad.packets) == sends, name
            assert follow.record["status"] == (SENT if status == SENT else FLUSH), name
            assert other.record["status"] == SENT, name
            await bench.drain(ctx)
        dropped, = bench.submit([make_wqe(200, "SEND", **good)])   # no QP 200: dropped, counted
        assert dropped.record is None

    run_bench(dut, body, seed=5)


def test_psn_wrap_and_reset():
    dut = WqeExecutor(num_qps=4, num_mkeys=8, num_vls=NUM_VLS)

    async def body(ctx, bench, rng):
        ref = bench.ref
        directed_world(ref, rng)
        write = dict(has_data=1, lkey=0x101, laddr=0x10003, byte_count=1000)   # 4 packets at 256
        await bench.reconfigure(ctx, {"reset": {2: dict(ref.qps[2], sq_psn=0xFFFFFE)}})
        a, b, c = bench.submit([make_wqe(2, "RDMA_WRITE", **write), make_wqe(2, "RDMA_READ", **write),
                                make_wqe(2, "SEND", has_data=0)])
        wire_psns = [int.from_bytes(p.desc["header"].to_bytes(MAX_NIC_HEADER_BYTES, "little")[17:20], "big")
                     for p in a.packets]
        assert wire_psns == [0xFFFFFE, 0xFFFFFF, 0, 1]
        assert (a.record["first_psn"], a.record["last_psn"]) == (0xFFFFFE, 1)
        assert (b.record["first_psn"], b.record["last_psn"]) == (2, 5)
        assert (c.record["first_psn"], c.record["last_psn"]) == (6, 6)
        # NOPs and a DUMP take no PSN: last_psn is the one before first_psn, across the wrap
        await bench.drain(ctx)
        await bench.reconfigure(ctx, {"reset": {2: dict(ref.qps[2], sq_psn=0)}})
        nop, dump, send, nop2 = bench.submit([
            make_wqe(2, "NOP"), make_wqe(2, "DUMP", has_data=1, lkey=0x101, laddr=0x10000,
                                         byte_count=1),
            make_wqe(2, "SEND", has_data=0), make_wqe(2, "NOP")])
        assert not (nop.packets or dump.packets or nop2.packets)
        assert (nop.record["first_psn"], nop.record["last_psn"]) == (0, 0xFFFFFF)
        assert (dump.record["first_psn"], dump.record["last_psn"]) == (0, 0xFFFFFF)
        assert (send.record["first_psn"], send.record["last_psn"]) == (0, 0)
        assert (nop2.record["first_psn"], nop2.record["last_psn"]) == (1, 0)
        assert dump.record["byte_count"] == 0 and dump.record["status"] == SENT
        await bench.drain(ctx)
        await bench.reconfigure(ctx, {"reset": {2: dict(ref.qps[2], sq_psn=77)}})
        d, = bench.submit([make_wqe(2, "SEND", has_data=0)])
        assert d.record["first_psn"] == 77
        await bench.drain(ctx)

    run_bench(dut, body, seed=6)


def test_reservation_exact():
    """Stray payload_freed strobes are ignored; with nothing freed, a 65-beat buffer holds
    exactly one 65-beat packet's bursts and the next packet waits for room."""
    dut = WqeExecutor(num_qps=4, num_mkeys=8, num_vls=NUM_VLS, payload_buffer_beats=65)

    async def body(ctx, bench, rng):
        ref = bench.ref
        directed_world(ref, rng)
        await bench.reconfigure(ctx, {"reset": {1: dict(ref.qps[1], mtu=5)}})
        bench.p_ar = bench.p_packet = bench.p_completion = 1.0
        bench.stray_frees = 10
        for _ in range(12):
            await bench.cycle(ctx)
        bench.free_enabled = False
        exps = bench.submit([make_wqe(1, "RDMA_WRITE", has_data=1, lkey=0x101, laddr=0x10001,
                                      byte_count=3 * 4096)])
        assert [p.desc["dma_beats"] for p in exps[0].packets] == [65, 65, 65]
        assert all(len(p.ars) == 2 for p in exps[0].packets)
        for _ in range(60):
            await bench.cycle(ctx)
        assert bench.reserved == 65 and len(bench.ars) == 4 and len(bench.packets) == 2
        bench.free_enabled = True
        bench.p_free = 1.0
        await bench.drain(ctx)

    run_bench(dut, body, seed=7)


def test_throughput():
    """All outputs ready: one-packet WQEs at one per cycle; an N-packet message in N cycles."""
    dut = WqeExecutor(num_qps=4, num_mkeys=8, num_vls=NUM_VLS)

    async def body(ctx, bench, rng):
        ref = bench.ref
        directed_world(ref, rng)
        bench.p_wqe = bench.p_ar = bench.p_packet = bench.p_completion = bench.p_free = 1.0
        bench.p_piece = 1.0
        wqes = []
        for i in range(200):
            q = i % 4
            kind = rng.choice(["inline", "dma", "read", "atomic"])
            if kind == "inline":
                n = rng.randint(0, 64)
                wqes.append(make_wqe(q, "SEND", inline=1, byte_count=n, inline_data=rng.getrandbits(8 * n)))
            elif kind == "dma":
                wqes.append(make_wqe(q, "RDMA_WRITE", has_data=1, lkey=0x101,
                                     laddr=0x10000 + 64 * rng.randrange(100), byte_count=rng.randint(1, 64)))
            elif kind == "read":
                wqes.append(make_wqe(q, "RDMA_READ", has_data=1, lkey=0x101, laddr=0x10000,
                                     byte_count=rng.randint(0, 5000)))
            else:
                wqes.append(make_wqe(q, "ATOMIC_FA", has_data=1, lkey=0x101, laddr=0x10008,
                                     byte_count=8, swap_add=rng.getrandbits(64)))
        bench.submit(wqes)
        await bench.drain(ctx)
        cycles = bench.packet_cycles
        assert len(cycles) == 200 and cycles[-1] - cycles[0] + 1 <= 201, cycles[-1] - cycles[0]
        records = bench.record_cycles
        assert records[-1] - records[0] + 1 <= 201
        # Latency as documented: descriptor 5 cycles after the WQE, record 1 after that.
        assert cycles[0] - bench.accept_cycles[0] == 5
        assert records[0] - cycles[0] == 1

        bench.packet_cycles = []
        bench.record_cycles = []
        exps = bench.submit([make_wqe(0, "RDMA_WRITE", has_data=1, lkey=0x101, laddr=0x10000,
                                      byte_count=64 * 256)])
        assert len(exps[0].packets) == 64
        await bench.drain(ctx)
        cycles = bench.packet_cycles
        assert cycles[-1] - cycles[0] + 1 == 64, cycles
        # A message's record comes a cycle after its first packet, not after its last.
        assert bench.record_cycles == [cycles[0] + 1], (bench.record_cycles, cycles[0])

    run_bench(dut, body, seed=8)


# --- Go-back-N ----------------------------------------------------------------------------------

EPOCHS = 16


class Stream:
    """One QP's WQEs as its ring holds them, and everything they must produce: the
    packets in send order (``S``; a rewind to a WQE sends again from its first packet,
    the same packets with the same PSNs) and one record per WQE."""

    def __init__(self, ref, q, wqes):
        self.wqes = wqes
        self.packets = []           # (desc, ars, WQE position, first, last)
        self.first = []             # WQE position -> position of its first packet
        self.records = []
        for i, w in enumerate(wqes):
            exp = ref.execute(w)
            assert exp.record["status"] == SENT and exp.packets and not exp.resent
            self.first.append(len(self.packets))
            self.records.append(exp.record)
            n = len(exp.packets)
            self.packets.extend((p.desc, p.ars, i, k == 0, k == n - 1)
                                for k, p in enumerate(exp.packets))
        self.by_psn = {packet_psn(p[0]): k for k, p in enumerate(self.packets)}
        assert len(self.by_psn) == len(self.packets)


def packet_psn(desc):
    return int.from_bytes(desc["header"].to_bytes(MAX_NIC_HEADER_BYTES, "little")[17:20], "big")


def sent_psn(desc, last_psn):
    """The PSN ``sent`` gives for packet ``desc`` of a WQE whose last PSN is ``last_psn``:
    its own, a READ request's last (its responses take every PSN of the READ)."""
    opcode = desc["header"].to_bytes(MAX_NIC_HEADER_BYTES, "little")[8]
    return last_psn if opcode == Opcode.RDMA_READ_REQUEST else packet_psn(desc)


def packet_dest(desc):
    return int.from_bytes(desc["header"].to_bytes(MAX_NIC_HEADER_BYTES, "little")[13:16], "big")


class RewindBench:
    """The executor between a fetcher, scheduler and completion unit that rewind QPs at
    random times (docs/nic.md, "Execution"). The bench keeps each QP's epoch as the
    scheduler does (``qp_epoch`` one cycle after the rewind strobe), fetches each QP's
    WQEs in ring order tagged with the epoch into a short in-transit queue (so stale
    descriptors reach the executor after a rewind), acknowledges recorded WQEs at random
    and rewinds a QP to its oldest unacknowledged recorded WQE with that record's first
    PSN, as the completion unit does; when the acknowledgements pass the WQE the refetch
    has reached, it skips the QP there now and then (``skip`` with the new epoch in the
    same cycle), as the scheduler does on such a retire.

    Checks, per QP: every packet is one of the QP's packets ``S`` byte for byte (found by
    its PSN), and the packets come in runs of ``S``: each packet the successor of the
    previous one, except the first of a rewind's run, which is the rewound WQE's first
    packet; runs come in rewind order (a later rewind's run ends an earlier one's); at
    most two packets of earlier runs come after a rewind's cycle (those in the read and
    output stages); after the last rewind its run goes to the end of ``S``. A packet
    can fit more than one of these stories (the rewound WQE's first packet is also the
    next packet of the run in progress), so the checker keeps every story that fits
    so far. Each packet's bursts are the next bursts issued, and no
    burst is left without its packet. Records: exactly one per WQE, in ring order,
    exact, after the WQE's first packet went out; ``sent`` a cycle after each packet.
    Counters: ``wqes_squashed`` = WQEs accepted minus executions that sent their last
    packet; ``packets_resent`` = packets of executions that started after the WQE's first
    packet had gone out once (its record was committed then)."""

    def __init__(self, dut, rng, ref, *, p_fetch=0.6, p_packet=0.7, p_completion=0.7,
                 p_ar=0.7, p_free=0.6, p_rewind=0.02, p_ack=0.1, transit=6):
        self.dut, self.rng, self.ref = dut, rng, ref
        self.p_fetch, self.p_packet, self.p_completion = p_fetch, p_packet, p_completion
        self.p_ar, self.p_free, self.p_rewind, self.p_ack = p_ar, p_free, p_rewind, p_ack
        self.transit_max = transit
        self.t = 0
        self.drive = Driver()
        self.addr = (0, 0)
        self.epoch = [0] * dut.num_qps      # the scheduler's epoch registers
        self.counts = dict(wqes_executed=0, packets_sent=0, payload_bytes_sent=0,
                           wqe_errors=0, wqes_flushed=0, wqes_squashed=0, packets_resent=0)
        self.accepted = 0
        self.last_sent = 0                  # executions that sent their WQE's last packet
        self.rewinds = 0
        self.skips = 0
        self.tails = 0                      # packets that fit only as an old run's
        self.jumps = 0
        self.issued_beats = 0
        self.reset_strobe = None


    def load(self, streams):
        """A new phase: ``streams`` {qpn: Stream}."""
        self.streams = streams
        n = self.dut.num_qps
        self.dest = {self.ref.qps[q]["dest_qpn"]: q for q in streams}
        assert len(self.dest) == len(streams)
        self.fetch_pos = dict.fromkeys(streams, 0)
        self.transit = deque()
        self.offered = None
        # Per QP, the stories that fit: (next packet of the current run, first packets of
        # the rewinds whose run has not started, packets after the last rewind not of its run).
        self.stories = {q: {(0, (), 0)} for q in streams}
        self.sent_first = {q: [False] * len(s.wqes) for q, s in streams.items()}
        self.sent_expect = None
        self.run_resent = dict.fromkeys(streams, False)
        self.recs = dict.fromkeys(streams, 0)       # records received
        self.acked = dict.fromkeys(streams, 0)
        self.ars = deque()                          # bursts issued, not yet matched
        assert n >= len(streams)

    def done(self):
        return (not self.transit and self.offered is None
                and all(self.fetch_pos[q] == len(s.wqes) and self.recs[q] == len(s.wqes)
                        and (len(s.packets), (), 0) in self.stories[q]
                        for q, s in self.streams.items()))

    async def run(self, ctx, rewinding_cycles, max_cycles=100_000):
        start = self.t
        while not self.done() or self.t - start < rewinding_cycles:
            await self.cycle(ctx, rewinding=self.t - start < rewinding_cycles)
            assert self.t - start < max_cycles, "no progress"
        for _ in range(6):
            await self.cycle(ctx, rewinding=False)
        assert not self.ars, "bursts without their packet"

    async def cycle(self, ctx, rewinding=True):
        dut, rng, ref, t = self.dut, self.rng, self.ref, self.t
        self.drive.set(dut.qp_reset.valid, int(self.reset_strobe is not None))
        self.drive.set(dut.qp_reset.qpn, self.reset_strobe or 0)
        self.reset_strobe = None
        for q in range(dut.num_qps):
            self.drive.set(dut.qp_epoch[q], self.epoch[q])
        qaddr, maddr = self.addr
        self.drive.set(dut.qp_config.data.as_value(), pack(QPC, ref.qps[qaddr]))
        self.drive.set(dut.mkey.data.as_value(), pack(MKEY, ref.mkeys[maddr]))

        # The fetcher: the next WQE of a random QP, with the QP's epoch.
        waiting = [q for q, s in self.streams.items() if self.fetch_pos[q] < len(s.wqes)]
        if waiting and len(self.transit) < self.transit_max and rng.random() < self.p_fetch:
            q = rng.choice(waiting)
            self.transit.append(dict(self.streams[q].wqes[self.fetch_pos[q]], epoch=self.epoch[q]))
            self.fetch_pos[q] += 1
        if self.offered is None and self.transit:
            self.offered = self.transit.popleft()
        self.drive.set(dut.wqe.valid, int(self.offered is not None))
        if self.offered is not None:
            self.drive.set(dut.wqe.payload.as_value(), pack(WQE, self.offered))

        # The completion unit: acknowledgements, and a rewind to the oldest unacknowledged.
        for q in self.streams:
            if self.acked[q] < self.recs[q] and rng.random() < self.p_ack:
                self.acked[q] += 1
        rewind = None
        owing = [q for q in self.streams if self.acked[q] < self.recs[q]]
        if rewinding and owing and rng.random() < self.p_rewind:
            q = rng.choice(owing)
            h = self.acked[q]
            record = self.streams[q].records[h]
            rewind = (q, h)
            self.drive.set(dut.rewind.p.qpn, q)
            self.drive.set(dut.rewind.p.wqe_index, record["wqe_index"])
            self.drive.set(dut.rewind.p.psn, record["first_psn"])
        self.drive.set(dut.rewind.valid, int(rewind is not None))
        # The scheduler's skip: acknowledgements passed where the refetch stands. It comes
        # with its new epoch in the same cycle (both registered in the scheduler).
        skip = None
        behind = [q for q in owing if self.fetch_pos[q] < self.acked[q]
                  and (rewind is None or rewind[0] != q)]
        if rewinding and behind and rng.random() < 0.3:
            q = rng.choice(behind)
            d = self.acked[q]
            record = self.streams[q].records[d]
            skip = (q, d)
            self.epoch[q] = (self.epoch[q] + 1) % EPOCHS
            self.drive.set(dut.qp_epoch[q], self.epoch[q])
            self.drive.set(dut.skip.p.qpn, q)
            self.drive.set(dut.skip.p.wqe_index, record["wqe_index"])
            self.drive.set(dut.skip.p.psn, record["first_psn"])
        self.drive.set(dut.skip.valid, int(skip is not None))

        self.drive.set(dut.packet.ready, int(rng.random() < self.p_packet))
        self.drive.set(dut.completion.ready, int(rng.random() < self.p_completion))
        self.drive.set(dut.ar.ready, int(rng.random() < self.p_ar))
        self.drive.set(dut.pieces.ready, int(rng.random() < 0.8))
        freed = int(self.issued_beats > 0 and rng.random() < self.p_free)
        self.drive.set(dut.payload_freed, freed)
        self.drive.apply(ctx)

        # Outputs of this cycle (before the rewind takes effect).
        if ctx.get(dut.wqe.valid) and ctx.get(dut.wqe.ready):
            self.offered = None
            self.accepted += 1
        if ctx.get(dut.ar.valid) and ctx.get(dut.ar.ready):
            got = unpack(AR, ctx.get(dut.ar.payload.as_value()))
            assert got["id"] == 1, t
            self.ars.append((got["addr"], got["len"]))
            self.issued_beats += got["len"] + 1
        sent_now = None
        if ctx.get(dut.packet.valid) and ctx.get(dut.packet.ready):
            got = unpack(DESC, ctx.get(dut.packet.payload.as_value()))
            self.take_packet(got)
            q = self.dest[packet_dest(got)]
            i = self.streams[q].packets[self.streams[q].by_psn[packet_psn(got)]][2]
            sent_now = (q, sent_psn(got, self.streams[q].records[i]["last_psn"]))
        check_sent(ctx, dut, t, self.sent_expect)
        self.sent_expect = sent_now
        if ctx.get(dut.completion.valid) and ctx.get(dut.completion.ready):
            got = unpack(CMP, ctx.get(dut.completion.payload.as_value()))
            q = got["qpn"]
            assert q in self.streams and self.recs[q] < len(self.streams[q].records), \
                (t, "unexpected record", got)
            i = self.recs[q]
            want = self.streams[q].records[i]
            assert got == want, (t, "record", diff(got, want))
            assert self.sent_first[q][i], (t, "record before its first packet")
            self.recs[q] += 1
            self.counts["wqes_executed"] += 1
        assert not ctx.get(dut.qp_error.valid), t
        if freed:
            self.issued_beats -= 1

        for event in (rewind, skip):
            if event is None:
                continue
            q, h = event
            self.rewinds += event is rewind
            self.skips += event is skip
            first = self.streams[q].first[h]
            self.stories[q] = {(c, targets + (first,), 0) for c, targets, _ in self.stories[q]}
            self.fetch_pos[q] = h
        self.addr = (ctx.get(dut.qp_config.addr), ctx.get(dut.mkey.addr))
        await ctx.tick()
        if rewind is not None:
            self.epoch[rewind[0]] = (self.epoch[rewind[0]] + 1) % EPOCHS
        self.t += 1

    def take_packet(self, got):
        t = self.t
        q = self.dest.get(packet_dest(got))
        assert q is not None, (t, "packet of no QP", got)
        s = self.streams[q]
        k = s.by_psn.get(packet_psn(got))
        assert k is not None, (t, q, "PSN of no packet", packet_psn(got))
        want, ars, i, first, last = s.packets[k]
        if got["source"] != PayloadSource.INLINE.value:
            got["inline_data"] = want["inline_data"] if want["source"] == PayloadSource.INLINE.value else 0
        assert got == want, (t, q, k, diff(got, want))
        for burst in ars:
            assert self.ars and self.ars.popleft() == burst, (t, q, k, "bursts", burst)
        stories = set()
        for c, targets, tail in self.stories[q]:
            if k == c:                          # the run goes on (an old one: tail)
                if not targets:
                    stories.add((k + 1, (), 0))
                elif tail < 2:
                    stories.add((k + 1, targets, tail + 1))
            for j in (j for j, first in enumerate(targets) if first == k):
                rest = targets[j + 1:]          # a rewind's run starts, ending earlier ones
                if not rest:
                    stories.add((k + 1, (), 0))
                elif tail < 2:
                    stories.add((k + 1, rest, tail + 1))
        assert stories, (t, q, "packet out of its run", k, self.stories[q])
        self.jumps += all(k != c for c, _, _ in self.stories[q])
        self.tails += all(s[1] for s in stories)
        self.stories[q] = stories
        if first:
            # Its record was committed with an earlier execution's first packet.
            self.run_resent[q] = self.sent_first[q][i]
            self.sent_first[q][i] = True
        if self.run_resent[q]:
            self.counts["packets_resent"] += 1
        if last:
            self.last_sent += 1
        self.counts["packets_sent"] += 1
        self.counts["payload_bytes_sent"] += got["payload_bytes"]

    def check_counters(self, ctx):
        self.counts["wqes_squashed"] = self.accepted - self.last_sent
        for name, value in self.counts.items():
            assert ctx.get(getattr(self.dut, name)) == value % (1 << 32), \
                (name, ctx.get(getattr(self.dut, name)), value)


def good_stream(rng, ref, q, count):
    """``count`` WQEs the executor sends for QP ``q`` (every opcode, 0 .. 1200 bytes, so
    up to a few packets at the small MTUs), at consecutive ring positions."""
    wqes, index = [], 0
    while len(wqes) < count:
        w = random_wqe(rng, ref, q, index, p_bad=0)
        if w["has_data"] and w["byte_count"] > 1200:
            w["byte_count"] = rng.randint(0, 1200)
        # A NOP or DUMP sent again has no packet and no record: the bench's squash count
        # could not see it (the NIC-level tests post them).
        if ref.check(w, ref.qps[q])[0] != SENT or w["opcode"] in LOCAL_OPS:
            continue
        wqes.append(w)
        index = (index + w["wqe_blocks"]) & 0xFFFF
    return wqes


def rewind_qps(rng, num_qps, phase):
    return {q: dict(random_qp(rng, mtu=rng.randint(1, 3), sl=rng.randrange(13)),
                    dest_qpn=0x100 * (q + 1) + phase)
            for q in range(num_qps)}


# make test runs the most rewinds (0.06) and the longest transit (10); the two between,
# 15 s each, under make test-full since 2026-12-07.
@pytest.mark.parametrize("seed, p_rewind, transit", [
    pytest.param(11, 0.02, 6, marks=pytest.mark.full), (12, 0.06, 2), (13, 0.03, 10),
    pytest.param(27, 0.03, 6, marks=pytest.mark.full)])
def test_rewind_random(seed, p_rewind, transit):
    """Random WQEs on every QP, rewinds at random times, random backpressure everywhere;
    then every QP reset (recorded and the PSN start over) and a second run."""
    rng = random.Random(seed)
    dut = WqeExecutor(num_qps=4, num_mkeys=NUM_MKEYS, num_vls=NUM_VLS, payload_buffer_beats=130)
    sl_to_vl = [rng.randrange(NUM_VLS) for _ in range(16)]
    ref = Reference(dut.num_qps, NUM_MKEYS, NUM_VLS, slid=rng.getrandbits(16), sl_to_vl=sl_to_vl)
    for i, k in enumerate(random_mkeys(rng, NUM_MKEYS)):
        ref.mkeys[i] = k
    bench = RewindBench(dut, rng, ref, p_rewind=p_rewind, transit=transit)

    async def testbench(ctx):
        ctx.set(dut.slid, ref.slid)
        for sl in range(16):
            ctx.set(dut.sl_to_vl[sl], sl_to_vl[sl])
        for q in range(dut.num_qps):
            ctx.set(dut.qp_state[q], RTS)
        for phase in range(2):
            if phase:
                for q in range(dut.num_qps):
                    bench.reset_strobe = q
                    bench.epoch[q] = 0
                    await bench.cycle(ctx, rewinding=False)
            ref.qps = rewind_qps(rng, dut.num_qps, phase)
            streams = {}
            for q in range(dut.num_qps):
                ref.reset_qp(q)
                streams[q] = Stream(ref, q, good_stream(rng, ref, q, 40))
            bench.load(streams)
            await bench.run(ctx, rewinding_cycles=1500)
        bench.check_counters(ctx)

    simulate(dut, testbench)
    assert bench.rewinds > 10 and bench.jumps > 10 and bench.skips > 2
    assert bench.counts["wqes_squashed"] > 5 and bench.counts["packets_resent"] > 20
    assert bench.tails > 0


@pytest.mark.parametrize("args", [
    dict(num_qps=0), dict(num_qps=257), dict(num_mkeys=0), dict(num_vls=0), dict(num_vls=16),
    dict(payload_buffer_beats=64), dict(payload_buffer_beats=1 << 17), dict(num_qps=4.0),
])
def test_parameters(args):
    # The half-built component would warn, when collected, that it was never elaborated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match=next(iter(args))):
                WqeExecutor(**args)
        finally:
            gc.collect()


def test_reference_matches_requester_model():
    """This file's reference agrees with models/nic/requester.py's RequesterModel (the NIC-level
    tests' reference) on good WQEs (gather lists among them): headers, lengths, inline
    payloads, PSNs, records."""
    rng = random.Random(9)
    sl_to_vl = [rng.randrange(NUM_VLS) for _ in range(16)]
    ref = Reference(NUM_QPS, NUM_MKEYS, NUM_VLS, slid=rng.getrandbits(16), sl_to_vl=sl_to_vl)
    for q in range(NUM_QPS):
        ref.qps[q] = dict(random_qp(rng), mtu=rng.randint(1, 5), sl=rng.randrange(13))
    for i, k in enumerate(random_mkeys(rng, NUM_MKEYS)):
        ref.mkeys[i] = dict(k, valid=1)
    model = RequesterModel(
        ref.slid, sl_to_vl, [QpContext(**qp, qpn=q) for q, qp in enumerate(ref.qps)], [],
        [ModelMkey(key=k["key"], base=k["base"], length=k["length"], access=ModelAccess(k["access"]),
                   pd=k["pd"], valid=True) for k in ref.mkeys], NUM_MKEYS)
    compared = lists = 0
    for index in range(400):
        q = rng.randrange(NUM_QPS)
        w = random_wqe(rng, ref, q, index, p_bad=0, p_list=0.3)
        if w["opcode"] == OP["RDMA_WRITE"]:
            w["fm_ce_se"] &= ~0x02      # the model sets SE on a plain WRITE's last packet
        if ref.check(w, ref.qps[q])[0] != SENT:
            continue
        if w["inline"]:
            # (past 64 bytes the executor reads the ring, not the descriptor: zeros here)
            data = dict(inline=w["inline_data"].to_bytes(64, "little")[:w["byte_count"]]
                        + bytes(max(0, w["byte_count"] - 64)))
        elif w["segments"] > 1:
            data = dict(gather=gather_segments(w))
            lists += 1
        elif w["has_data"]:
            data = dict(byte_count=w["byte_count"], lkey=w["lkey"], laddr=w["laddr"])
        else:
            data = {}
        wqe = build_wqe(w["opcode"], index, q, fm_ce_se=w["fm_ce_se"], imm=w["imm"],
                        raddr=w["raddr"], rkey=w["rkey"], swap_add=w["swap_add"],
                        compare=w["compare"], opmod=w["opmod"], swap_mask=w["swap_mask"],
                        compare_mask=w["compare_mask"], **data)
        result = model.execute(q, index, wqe.data, lambda addr, n: bytes(n))
        exp = ref.execute(dict(w, wqe_blocks=result.wqe_blocks))
        ref.runtime[q].recorded = 0         # (indices here are not consecutive)
        theirs = result.record()
        mine = {k: exp.record[k] for k in theirs}
        assert mine == theirs, (w, mine, theirs)
        assert exp.record["laddr"] == result.laddr
        assert len(exp.packets) == len(result.packets)
        for mine, theirs in zip(exp.packets, result.packets):
            desc = mine.desc
            header = desc["header"].to_bytes(MAX_NIC_HEADER_BYTES, "little")[:desc["header_bytes"]]
            assert theirs[:len(header)] == header, (w, header.hex(), theirs[:48].hex())
            assert len(theirs) == len(header) + desc["payload_bytes"] + (-desc["payload_bytes"] % 4) + 4
            if desc["source"] == PayloadSource.INLINE.value:
                payload = desc["inline_data"].to_bytes(64, "little")[:desc["payload_bytes"]]
                assert theirs[len(header):len(header) + len(payload)] == payload
            compared += 1
    assert compared > 300 and lists > 10
