from amaranth import *
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import lookahead_sum, or_all
from hdl.ib.headers import (
    ATOMIC_ETH, ATOMIC_ETH_BYTES, BTH_BYTES, IMMDT, IMMDT_BYTES, LRH_BYTES, MASKED_ATOMIC_ETH,
    MASKED_ATOMIC_ETH_BYTES, RETH, RETH_BYTES, VL15, iba_local_headers, to_wire,
)
from hdl.nic.payload_reads import dma_payload, payload_bursts, payload_read_stage, payload_words
from hdl.nic.wqe_fetcher import sq_block_address
from hdl.nic.signatures import (
    DESCRIPTOR_INLINE_BYTES, EPOCH_BITS, EXT_AMO_OPMOD_4, MAX_GATHER_SEGMENTS, MAX_NIC_HEADER_BYTES,
    MAX_INLINE_BYTES, MAX_MESSAGE_BYTES, PAYLOAD_ID, PSN_BITS,
    Access, ArLayout, CompletionRecordLayout, CompletionStatus, ContextReadSignature,
    DataSegmentLayout, EventSignature, GatherPieceLayout, MkeyLayout, MlxOpcode, PacketDescriptorLayout, PacketSentLayout,
    PayloadSource, QpConfigLayout, QpState, RewindLayout, Syndrome, WqeDescriptorLayout,
)

__all__ = ["WqeExecutor"]

# IBA RC BTH opcodes (IBA table 38). SEND and RDMA WRITE messages take their opcode as
# an offset from the message kind's FIRST opcode.
SEND_FIRST = 0x00
RDMA_WRITE_FIRST = 0x06
RDMA_READ_REQUEST = 0x0C
COMPARE_SWAP = 0x13
FETCH_ADD = 0x14
MIDDLE, LAST, LAST_IMM, ONLY, ONLY_IMM = 1, 2, 3, 4, 5

SOLICITED = 0x02             # fm_ce_se bit: solicited event on the message's last packet
CQ_UPDATE = 0x08             # fm_ce_se bit: write a CQE on success
BEAT_BYTES = 64
MAX_PAYLOAD_BEATS = 4096 // BEAT_BYTES + 1    # a packet's payload words, unaligned
EXT_BYTES = MAX_NIC_HEADER_BYTES - LRH_BYTES - BTH_BYTES


class _JobLayout(data.StructLayout):
    """A checked WQE, as the segmenter walks it: its completion record (status decided),
    whether it emits that record (``resent``: it does not, the WQE was recorded before a
    rewind) and what its packets' headers need."""
    def __init__(self):
        super().__init__({
            "cmp": CompletionRecordLayout(),
            "resent": 1,
            "send": 1, "write": 1, "read": 1, "atomic": 1, "fetch_add": 1,
            "masked": 1, "size4": 1,    # a masked atomic; of 4 bytes
            "local": 1,              # NOP / DUMP: a record and no packet
            "with_imm": 1,           # SEND_IMM / RDMA_WRITE_IMM
            "solicited": 1,          # SE on the last packet
            "inline": 1,             # the payload is the descriptor's inline_data
            "ring_wrap": 1,          # inline data read back from a ring that wraps inside it
            "ring_first_len": 3,     # ... the first burst's beats less one (to the ring's end)
            "ring_rest_len": 3,      # ... the second's, from sq_base
            "sq_base": 64,
            "vl": 4, "sl": 4, "dlid": 16, "dest_qpn": 24, "pkey": 16, "mtu": 3,
            "length": 32, "raddr": 64, "rkey": 32, "imm": 32, "swap_add": 64, "compare": 64,
            "swap_mask": 64, "compare_mask": 64,
            "inline_data": 8 * DESCRIPTOR_INLINE_BYTES,
        })


class _WqeFactsLayout(data.StructLayout):
    """What a WQE descriptor says on its own, registered as it is taken."""
    def __init__(self):
        super().__init__({
            "is_write": 1, "is_send": 1, "is_read": 1, "is_fetch_add": 1, "is_atomic": 1,
            "is_masked": 1, "size4": 1,
            "is_local": 1,                  # NOP / DUMP
            "with_imm": 1,
            "is_list": 1,                   # a gather list (2 to 4 data segments)
            "length": 32,                   # 0 without a data or inline segment
            "end": 65,                      # laddr + byte_count of the segment checked
            "packets_less_one_at": PSN_BITS,    # (length - 1) >> 8
            "empty": 1,                     # length 0
            "fits_mtu": 5,                  # bit k - 1: length <= the MTU of code k
            "qpn_bad": 1,
            "uses_key": 1,                  # the segment checked has bytes
            "inconsistent": 1,
            "bad_length": 1,
            "wqe_end": 16,                  # wqe_index + wqe_blocks
            # Inline data longer than the descriptor carries, read back from the ring: its
            # byte offset in the WQE's first block and the WQE block holding its last byte.
            "ring_inline": 1,
            "inline_offset": 6,
            "inline_last_block": 3,
        })


class _ContextFactsLayout(data.StructLayout):
    """What stage 0 found for a WQE in its contexts and its QP's state (stage 1 decides
    from these registers)."""
    def __init__(self):
        super().__init__({
            "qp": QpConfigLayout(),
            "vl": 4,
            "early_error": 1,               # an error reported before the key's
            "early_syndrome": 8,            # ... and its syndrome
            "key_refused": 1,               # key, PD or local rights do not match
            "room_ok": 1,                   # end <= base + length
            "above_base": 1,                # laddr >= base
            "wraps": 1,                     # end past 2**64
            "packets_less_one": PSN_BITS,   # at the QP's MTU, if it is sent
            "fits": 1,                      # in one packet, if it is sent
            "first_psn": PSN_BITS,
            "recorded": 16,                 # the QP's ``recorded``
            "flushing": 1,                  # the QP is not in RTS or has its error bit
            "stale": 1,                     # epoch differed, or a rewind or skip came since
            # Inline data read back from the ring (``ring_inline``): its address, and the
            # bursts it takes when the ring ends inside it.
            "ring_address": 64,
            "ring_wrap": 1,
            "ring_first_len": 3,
            "ring_rest_len": 3,
        })


class _ItemLayout(data.StructLayout):
    """One packet (or, for a failed or flushed WQE, none) with the payload reads it needs
    and, on a message's first packet, the WQE's completion record (unless suppressed);
    ``resent``: a packet of a WQE whose record was suppressed. A gather list's packet is
    one item per piece, the descriptor and record on its last."""
    def __init__(self):
        super().__init__({
            "desc": PacketDescriptorLayout(),
            "sent_psn": PSN_BITS,   # the last PSN it accounts for: its own, a READ's last
            "has_packet": 1,
            "resent": 1,
            "cmp": CompletionRecordLayout(),
            "has_completion": 1,
            "n_ar": range(3),
            "ar0_addr": 64, "ar0_len": 8,
            "ar1_addr": 64, "ar1_len": 8,
            "reserve": 1,            # reserves the packet's packed beats (its first piece)
            "piece": GatherPieceLayout(),
        })


class _KeyCheckLayout(data.StructLayout):
    """A gather list's later data segment, queued in stage 0 for its key check."""
    def __init__(self):
        super().__init__({"lkey": 32, "laddr": 64, "end": 65, "uses_key": 1})


def _length_facts(m, facts, length, has_length, other_bad, *, name):
    """The statements that register the facts of a message of ``length`` bytes (0 unless
    ``has_length``) into ``facts`` (a :class:`_WqeFactsLayout`), ``bad_length`` with
    ``other_bad``: for a descriptor as it is taken, and for a gather list's sum."""
    counted = Mux(has_length, length, 0)
    length_less_one = lookahead_sum(m, length, C(-1, len(length)), name=f"{name}_less_one")
    return [
        facts.length.eq(counted),
        facts.packets_less_one_at.eq(length_less_one[8:8 + PSN_BITS]),
        facts.empty.eq(counted == 0),
        facts.fits_mtu.eq(Cat(~has_length | (length <= (128 << k)) for k in range(1, 6))),
        facts.bad_length.eq(other_bad | (counted > MAX_MESSAGE_BYTES)),
    ]


class WqeExecutor(wiring.Component):
    """Turns parsed WQEs into IB RC request packet descriptors, payload reads and
    completion records (docs/nic.md, "Execution").

    Pipeline, each stage a register that moves on when the next one takes it:

    0. the WQE descriptor, while its QP context and memory key are read (the read ports
       are addressed by the incoming WQE in the cycle it is accepted, so their data is
       there in the next cycle): what the contexts say (the key check's parts, the VL,
       the packet count at the QP's MTU) and its QP's state (next PSN, ``recorded``,
       whether it flushes, whether the WQE is stale) are registered as it moves to
    1. the check stage, which decides the WQE's status from those registers, sets the
       per-QP next PSN, ``recorded`` and the local error bit, and passes it to
    2. the segmenter, which cuts the message at the path MTU and builds one packet per
       cycle (headers, payload location, AXI bursts, the completion record on the first:
       its PSN range is known from the start);
    3. the read stage, which reserves the packet's beats of the assembler's payload buffer
       and issues its one or two payload bursts;
    4. the output stage: the packet descriptor, and the completion record into a small
       FIFO as the message's first descriptor leaves (so the record always comes after
       it); ``sent`` tells the completion unit, a cycle after each descriptor's handshake,
       the QP and the last PSN of the packet it committed to the wire (its PSN; for a READ
       request, the last PSN its responses take).

    Stage 1 moves on exactly when stage 0 moves up (or is empty), so the QP state stage 0
    registers is exact but for what stage 1 changes in that same cycle, which it takes
    from stage 1 (a WQE of the same QP: its PSNs, ``recorded``, an error); while a WQE
    waits in stage 1, a rewind or skip of its QP makes it stale, and its QP's
    ``qp_state`` is looked at as it was in the cycle before (a QP's epoch changes only
    with a rewind or skip, ``qp_reset`` comes only for an idle QP).

    A failed or flushed WQE goes through the same stages without a packet, so completion
    records and packets come out in WQE order over all QPs. A stream of one-packet WQEs
    runs at one per cycle while the outputs are ready; a packet whose payload crosses
    4 KiB (two bursts) takes two cycles of the read stage. A WQE accepted in cycle t has
    its first burst on ``ar`` in t + 4 at the earliest, its first descriptor on
    ``packet`` in t + 5, its record on ``completion`` one cycle after its first
    descriptor left (the message's other packets follow it; before 2026-12-06 the record
    came after the last) and ``sent`` for each packet one cycle after its descriptor
    left (stage 0 added a cycle on 2026-12-06: t + 3 and t + 4 before).

    A gather list (``segments`` 2 to 4) stays in stage 0 for ``segments`` + 1 cycles: one
    memory key on the read port per cycle, each segment's check registered in parts and
    folded a cycle later (a zero-length segment's not used); its length is the sum of its
    byte counts. The first failing segment's check gives LOCAL_PROT_ERR (after the format,
    length and VL checks). A list's packets are cut into pieces, one per segment each
    touches, two segmenter cycles a piece; each item with bursts writes its piece record
    on ``pieces`` no later than its first burst (docs/nic.md, "Execution", Gather lists).

    Inline data longer than the descriptor's 64 bytes (up to 256) is read back from the
    send queue as the packet's DMA payload: from ``sq_base + 64 * (wqe_index mod
    2**log_sq_size) + 36`` (20 for a SEND), without a key check, in two bursts when the
    ring ends inside it (the rest from ``sq_base``; the WQE fits its ring).

    A NOP or DUMP sends nothing: its ``SENT`` record goes through the stages without a
    packet, with ``byte_count`` 0 and no PSN of its own (``last_psn`` is the one before
    ``first_psn``, the QP's next), so the completion unit completes it once the records
    before it have; a DUMP's data segment only passes the key checks.

    Records: ``byte_count`` is the message length (8 for an atomic) and ``first_psn`` /
    ``last_psn`` its PSNs for ``SENT``; an ``ERROR`` or ``FLUSH`` record has
    ``byte_count``, ``first_psn`` and ``last_psn`` 0 and consumes no PSN; ``syndrome`` is
    0 for ``SENT``. BTH.SE is set only where IBA defines it (the last packet of a SEND
    or RDMA WRITE with immediate), never on a plain RDMA WRITE.

    Bad input with no row in docs/nic.md: a descriptor whose ``qpn`` is not below
    ``num_qps`` is dropped and counted in ``wqe_errors`` (there is no QP to complete it
    on); a WQE of a QP in ``RESET`` is flushed like one in ``ERR``; a descriptor the
    parser should have flagged (unknown opcode; inline data together with a data
    segment, or on a READ, atomic, NOP or DUMP; an atomic or DUMP without a data segment,
    a NOP with one) fails with
    LOCAL_QP_OP_ERR, one with more than 256 inline bytes or an atomic byte count other
    than 8 with LOCAL_LENGTH_ERR, checked right after the parser's own format error; a
    path MTU code outside 1..5, or an SL mapped to a VL this port does not have
    (``num_vls`` .. 15), fails like VL 15 with LOCAL_QP_OP_ERR; ``payload_freed`` with
    no beat reserved is ignored.

    A FETCH_ADD goes out with AtomicETH.CompareData 0: IBA has the responder ignore it,
    and libmlx5 leaves the atomic segment's compare field unwritten (stale ring bytes).

    Go-back-N (docs/nic.md, "Execution"; ``rewind`` and ``qp_epoch`` come from the
    completion unit and the scheduler in the same cycle, the scheduler's epoch changing
    one cycle after its rewind strobe):

    * stage 1 squashes a WQE whose ``epoch`` differed from ``qp_epoch[qpn]`` as it left
      stage 0 or whose QP had a ``rewind`` or ``skip`` since, that cycle included (so
      there is no window: a WQE leaving stage 1 in the rewind's cycle is squashed too). A squashed WQE has no effect at all (no PSN,
      no error bit, no ``qp_error``, no record), and it leaves stage 1 only when the
      segmenter could take it, so the epoch compare stays off the ``wqe.ready`` path.
    * the segmenter registers a rewind of its job's QP (``job_stale``): a SENT job stops
      before its next packet from the cycle after the rewind (the one packet taken in
      the rewind's cycle still goes, and if it is the first, the record with it); a job
      stopped after its first packet has emitted its record, one stopped before has not;
      an ERROR or FLUSH job (no packets) is not stopped, its record goes out. Packets that
      reached the read or output stage go out whole, with their bursts (stale
      duplicates the responder tolerates): at most two packets after the rewind's cycle.
    * ``rewind`` sets the QP's next PSN to ``psn`` (a WQE leaving stage 1 in the same
      cycle is squashed, so nothing competes); ``qp_reset`` wins over a rewind.
    * ``recorded[q]`` (16 bits, 0 after ``qp_reset``): the WQE index just past the newest
      WQE of q committed to a record. Stage 1 decides: a WQE with ``(wqe_index -
      recorded) mod 2^16 >= 2^15`` gets no record (``resent``; its packets count in
      ``packets_resent``), any other sets ``recorded = wqe_index + wqe_blocks`` as it
      leaves stage 1, whatever its status. A SENT job stopped by a rewind before its
      first packet (its record never comes) sets ``recorded`` back to its own
      ``wqe_index`` (it is always the newest WQE of its QP past stage 1, so that is
      exact); the stop happens the cycle after the rewind, long before a fetch of the new
      epoch can reach stage 1. A job stopped after its first packet keeps ``recorded``
      past it: its record is out, with the PSNs the replay gives it again (the replay
      starts at the rewind's WQE and PSN and repeats the same WQEs), so the replayed copy
      is ``resent``; the completion unit takes answers only for PSNs on the wire, so the
      record's unsent PSNs wait for the replay.
    * ``skip`` (the scheduler's, with its epoch already changed in that cycle: a retire
      moved the QP past WQEs it had not fetched again) acts as a rewind to
      ``wqe_index`` (stage 1 squashes by the epoch alone); a rewind of the same QP in the
      same cycle wins over it.
    * ``wqes_squashed`` counts WQEs squashed in stage 1 and SENT jobs stopped;
      ``wqes_executed`` counts SENT records, so a WQE sent again counts once.

    Every counter counts a registered event, so it shows an event a cycle after it.
    """

    def __init__(self, *, num_qps=64, num_mkeys=64, num_vls=2, payload_buffer_beats=512):
        for name, value, low, high in (
                ("num_qps", num_qps, 1, 256),
                ("num_mkeys", num_mkeys, 1, 1 << 24),
                ("num_vls", num_vls, 1, 15),
                ("payload_buffer_beats", payload_buffer_beats, MAX_PAYLOAD_BEATS, 1 << 16)):
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer from {low} to {high}, not {value!r}")
        self.num_qps = num_qps
        self.num_mkeys = num_mkeys
        self.num_vls = num_vls
        self.payload_buffer_beats = payload_buffer_beats
        super().__init__({
            "wqe": In(stream.Signature(WqeDescriptorLayout())),
            "qp_config": Out(ContextReadSignature(num_qps, QpConfigLayout())),
            "mkey": Out(ContextReadSignature(num_mkeys, MkeyLayout())),
            "qp_state": In(QpState).array(num_qps),
            "qp_reset": In(EventSignature()),
            "qp_error": Out(EventSignature()),
            "rewind": In(stream.Signature(RewindLayout(), always_ready=True)),
            "skip": In(stream.Signature(RewindLayout(), always_ready=True)),
            "qp_epoch": In(EPOCH_BITS).array(num_qps),
            "slid": In(16),
            "sl_to_vl": In(4).array(16),
            "ar": Out(stream.Signature(ArLayout())),
            "pieces": Out(stream.Signature(GatherPieceLayout())),
            "payload_freed": In(1),
            "packet": Out(stream.Signature(PacketDescriptorLayout())),
            "sent": Out(stream.Signature(PacketSentLayout(), always_ready=True)),
            "completion": Out(stream.Signature(CompletionRecordLayout())),
            "wqes_executed": Out(32),
            "packets_sent": Out(32),
            "payload_bytes_sent": Out(32),
            "wqe_errors": Out(32),
            "wqes_flushed": Out(32),
            "wqes_squashed": Out(32),
            "packets_resent": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        num_qps = self.num_qps

        # --- per-QP runtime state ----------------------------------------------------------
        next_psn = Array(Signal(PSN_BITS, name=f"next_psn{q}") for q in range(num_qps))
        psn_loaded = Array(Signal(name=f"psn_loaded{q}") for q in range(num_qps))
        # Set with the qp_error strobe: the register block's QP state follows a cycle or
        # two later, and the QP's next WQE must already be flushed.
        local_error = Array(Signal(name=f"local_error{q}") for q in range(num_qps))
        qp_states = Array(state.as_value() for state in self.qp_state)
        recorded = Array(Signal(16, name=f"recorded{q}") for q in range(num_qps))
        qp_epochs = Array(self.qp_epoch)
        rewind = self.rewind.p
        skip = self.skip.p

        # --- stage 0: the WQE while its contexts are read --------------------------------------
        # The context read ports are addressed by the incoming WQE in the cycle it is taken,
        # so their data is there while it is in stage 0; stage 0 registers what the contexts
        # say (the key check's parts, the VL, the PSN arithmetic's inputs) and the per-QP
        # state of its QP, and stage 1 decides from registers.
        r0_valid = Signal()
        r0 = Signal(WqeDescriptorLayout())
        f0 = Signal(_WqeFactsLayout())
        r1_valid = Signal()
        r1 = Signal(WqeDescriptorLayout())
        f1 = Signal(_WqeFactsLayout())
        c1 = Signal(_ContextFactsLayout())
        r1_advance = Signal()
        to_r1 = Signal()
        # A gather list stays in stage 0 while its segments' keys are read, one a cycle
        # (``walking``), and one cycle more while the last one's check is folded in.
        walking = Signal()
        lookups_left = Signal(range(MAX_GATHER_SEGMENTS + 1))
        pending = Signal(data.StructLayout({
            "valid": 1, "uses_key": 1, "key_refused": 1, "room_ok": 1, "above_base": 1,
            "wraps": 1}))                   # the previous segment's check, in parts
        list_key_bad = Signal()             # a segment before ``pending`` failed its check
        list_vl_ok = Signal()               # its VL and MTU checks held (registered in the walk)
        checked = Signal(data.StructLayout({"lkey": 32, "laddr": 64}))    # whose key is checked
        m.d.comb += [
            to_r1.eq(r0_valid & ~walking & (~r1_valid | r1_advance)),
            self.wqe.ready.eq(~r0_valid | (~walking & (~r1_valid | r1_advance))),
        ]

        # Facts of the WQE alone, registered as it is taken.
        w = self.wqe.payload
        w_opcode = w.opcode
        w_is_write = ((w_opcode == MlxOpcode.RDMA_WRITE.value)
                      | (w_opcode == MlxOpcode.RDMA_WRITE_IMM.value))
        w_is_send = (w_opcode == MlxOpcode.SEND.value) | (w_opcode == MlxOpcode.SEND_IMM.value)
        w_is_read = w_opcode == MlxOpcode.RDMA_READ.value
        w_is_masked = ((w_opcode == MlxOpcode.ATOMIC_MASKED_CS.value)
                       | (w_opcode == MlxOpcode.ATOMIC_MASKED_FA.value))
        w_size4 = w_is_masked & (w.opmod == EXT_AMO_OPMOD_4)
        w_is_fetch_add = ((w_opcode == MlxOpcode.ATOMIC_FA.value)
                          | (w_opcode == MlxOpcode.ATOMIC_MASKED_FA.value))
        w_is_atomic = (w_opcode == MlxOpcode.ATOMIC_CS.value) | w_is_fetch_add | w_is_masked
        w_with_imm = ((w_opcode == MlxOpcode.RDMA_WRITE_IMM.value)
                      | (w_opcode == MlxOpcode.SEND_IMM.value))
        w_is_dump = w_opcode == MlxOpcode.DUMP.value
        w_is_local = (w_opcode == MlxOpcode.NOP.value) | w_is_dump
        # A DUMP's data segment is checked (its key) but moves nothing: its length is 0.
        w_has_length = (w.has_data | w.inline) & ~w_is_local
        # The end only counts for a WQE that uses its key, whose length is its byte count.
        w_end = lookahead_sum(m, w.laddr, w.byte_count, name="end_sum")
        w_is_list = w.segments > 1
        # A gather list's later segments, each checked in a cycle of its own (below), and
        # its length, the sum of its byte counts (the fetcher zeroes the segments past
        # ``segments``), in two steps.
        queue = [Signal(_KeyCheckLayout(), name=f"key_queue{i}")
                 for i in range(MAX_GATHER_SEGMENTS - 1)]
        sum_first = Signal(33)
        sum_second = Signal(33)
        total = Signal(34)
        m.d.sync += total.eq(lookahead_sum(m, sum_first, sum_second, name="list_total"))
        # Every sum outside the ``m.If``s below (a condition would gate its wires).
        sums_first = lookahead_sum(m, w.byte_count, w.more_segments[0].byte_count,
                                   name="list_sum_first")
        sums_second = lookahead_sum(m, w.more_segments[1].byte_count,
                                    w.more_segments[2].byte_count, name="list_sum_second")
        queue_ends = [lookahead_sum(m, segment.laddr, segment.byte_count, name=f"list_end{i}")
                      for i, segment in enumerate(w.more_segments)]
        taken_length_facts = _length_facts(
            m, f0, w.byte_count, w_has_length,
            (w.inline & (w.byte_count > MAX_INLINE_BYTES))
            | (w_is_atomic & (w.byte_count != Mux(w_size4, 4, 8))), name="length")
        list_length_facts = _length_facts(m, f0, total, C(1, 1), C(0, 1), name="list_length")
        w_wqe_end = lookahead_sum(m, w.wqe_index, w.wqe_blocks, name="wqe_end")[:16]
        # Inline data past what the descriptor carries is read back from the send queue:
        # it follows the inline segment's byte count, at byte 36 (WRITE) or 20 (SEND).
        w_inline_offset = Mux(w_is_write, 36, 20)
        w_inline_end = lookahead_sum(m, w.byte_count[:9], Mux(w_is_write, 36 - 1, 20 - 1),
                                     name="inline_end")     # its last byte's, in the WQE
        with m.If(self.wqe.valid & self.wqe.ready):
            m.d.sync += [
                r0_valid.eq(1), r0.eq(w),
                f0.is_write.eq(w_is_write), f0.is_send.eq(w_is_send), f0.is_read.eq(w_is_read),
                f0.is_fetch_add.eq(w_is_fetch_add), f0.is_atomic.eq(w_is_atomic),
                f0.is_masked.eq(w_is_masked), f0.size4.eq(w_size4),
                f0.is_local.eq(w_is_local), f0.with_imm.eq(w_with_imm),
                f0.is_list.eq(w_is_list),
                f0.end.eq(w_end),
                f0.qpn_bad.eq(w.qpn >= num_qps),
                f0.uses_key.eq(w.has_data & ~w.inline & (w.byte_count != 0)),
                f0.inconsistent.eq(~(w_is_write | w_is_send | w_is_read | w_is_atomic | w_is_local)
                                   | (w.inline & (w.has_data | w_is_read | w_is_atomic | w_is_local))
                                   | ((w_is_atomic | w_is_dump) & ~w.has_data)
                                   | (w_is_local & ~w_is_dump & w.has_data)),
                f0.wqe_end.eq(w_wqe_end),
                f0.ring_inline.eq(w.inline & (w.byte_count > DESCRIPTOR_INLINE_BYTES)),
                f0.inline_offset.eq(w_inline_offset),
                f0.inline_last_block.eq(w_inline_end[6:9]),
                sum_first.eq(sums_first), sum_second.eq(sums_second),
                walking.eq(w_is_list), lookups_left.eq(w.segments),
                checked.lkey.eq(w.lkey), checked.laddr.eq(w.laddr),
                pending.valid.eq(0), list_key_bad.eq(0),
            ]
            m.d.sync += taken_length_facts
            for i, (entry, segment) in enumerate(zip(queue, w.more_segments)):
                m.d.sync += [
                    entry.lkey.eq(segment.lkey), entry.laddr.eq(segment.laddr),
                    entry.end.eq(queue_ends[i]),
                    entry.uses_key.eq((w.segments > i + 1) & (segment.byte_count != 0)),
                ]
        with m.Elif(to_r1):
            m.d.sync += r0_valid.eq(0)
        with m.If(r0_valid & walking):
            # A gather list's length facts from its sum: the sum is right from the list's
            # second cycle in stage 0, these facts from its third, and it leaves a cycle
            # after its walk, in its fourth at the earliest. Only while it walks, when no WQE
            # is taken and none leaves: a choice by registers.
            m.d.sync += list_length_facts
        read_from = Mux(self.wqe.ready, self.wqe.payload, r0)
        read_from = WqeDescriptorLayout()(read_from)
        # The memory key of the segment checked in the next cycle: the incoming WQE's
        # first, a walking list's next, or the one held.
        key_of = Mux(self.wqe.ready, self.wqe.payload.lkey,
                     Mux(walking, queue[0].lkey, checked.lkey))
        m.d.comb += [
            self.qp_config.addr.eq(read_from.qpn),
            self.mkey.addr.eq((key_of >> 8) % self.num_mkeys),
        ]
        qp0 = self.qp_config.data
        mk = self.mkey.data
        # A gather list's segments checked so far (the walk, below): one failed.
        pending_bad = pending.valid & pending.uses_key & (
            pending.key_refused | ~pending.room_ok | ~pending.above_base | pending.wraps)
        list_bad_now = list_key_bad | pending_bad

        vl0 = Signal(4)
        m.d.comb += vl0.eq(Array(self.sl_to_vl)[qp0.sl])
        no_vl = (vl0 == VL15) | (vl0 >= self.num_vls) | (qp0.mtu < 1) | (qp0.mtu > 5)
        # The errors found before the key's, in the order they are reported.
        early_syndrome = Signal(8)
        with m.If(r0.format_error):
            m.d.comb += early_syndrome.eq(r0.syndrome)
        with m.Elif(f0.inconsistent):
            m.d.comb += early_syndrome.eq(Syndrome.LOCAL_QP_OP_ERR)
        with m.Elif(f0.bad_length):
            m.d.comb += early_syndrome.eq(Syndrome.LOCAL_LENGTH_ERR)
        with m.Elif(list_vl_ok & list_bad_now):
            m.d.comb += early_syndrome.eq(Syndrome.LOCAL_PROT_ERR)
        with m.Else():
            # a path MTU or VL this port lacks
            m.d.comb += early_syndrome.eq(Syndrome.LOCAL_QP_OP_ERR)
        # The memory key rule, in parts that each end in a register: the key, its PD and
        # rights; the range, base <= laddr and end <= base + length, with end not past 2**64.
        local_write = (mk.access.as_value() & Access.LOCAL_WRITE.value) != 0
        key_refused = ((mk.key != checked.lkey) | (mk.pd != qp0.pd) | ~mk.valid
                       | ((f0.is_read | f0.is_atomic) & ~local_write))
        # end <= base + length as the sign of base + length - end: one carry-save layer
        # and one lookahead sum, not a sum and then a compare.
        wide = 66
        addends = [Cat(mk.base, C(0, wide - 64)), Cat(mk.length, C(0, wide - 64)),
                   ~Cat(f0.end, C(0, wide - 65))]
        partial = Signal(wide)
        carries = Signal(wide)
        m.d.comb += [
            partial.eq(addends[0] ^ addends[1] ^ addends[2]),
            carries.eq((addends[0] & addends[1]) | (addends[0] & addends[2])
                       | (addends[1] & addends[2])),
        ]
        room_sum = lookahead_sum(m, partial, Cat(C(0, 1), carries[:wide - 1]), 1, name="room_sum")
        above_base = lookahead_sum(m, checked.laddr, ~mk.base, 1, name="above_base_sum")[64]
        wraps0 = f0.end[64] & (f0.end[:64] != 0)       # ending at 2**64 is fine

        # A gather list's walk: each cycle the segment's check goes into ``pending`` in
        # parts, the next segment moves up (its key read in this cycle), and the one before
        # is folded into ``list_key_bad`` (``list_bad_now``, above); a zero-length segment's
        # check is not used.
        with m.If(r0_valid & walking):
            m.d.sync += [
                pending.valid.eq(1), pending.uses_key.eq(f0.uses_key),
                pending.key_refused.eq(key_refused), pending.room_ok.eq(~room_sum[wide - 1]),
                pending.above_base.eq(above_base), pending.wraps.eq(wraps0),
                lookups_left.eq(lookups_left - 1), walking.eq(lookups_left != 1),
                checked.lkey.eq(queue[0].lkey), checked.laddr.eq(queue[0].laddr),
                f0.end.eq(queue[0].end), f0.uses_key.eq(queue[0].uses_key),
            ]
            m.d.sync += [entry.eq(after) for entry, after in zip(queue, queue[1:] + [0])]
            m.d.sync += [list_key_bad.eq(list_bad_now), list_vl_ok.eq(~no_vl)]
        # The message's packets less one and whether it fits one packet, at the QP's MTU.
        packets_less_one0 = Signal(PSN_BITS)
        fits0 = Signal()
        with m.Switch(qp0.mtu):
            for code in range(1, 6):
                with m.Case(code):
                    m.d.comb += [
                        # A NOP or DUMP takes no PSN: its last is the one before its first.
                        packets_less_one0.eq(Mux(f0.empty, f0.is_local.replicate(PSN_BITS),
                                                 f0.packets_less_one_at >> (code - 1))),
                        fits0.eq(f0.fits_mtu[code - 1]),
                    ]

        # Inline data read back from the ring: where it starts, and whether the ring ends
        # before the WQE block holding its last byte (the rest is at sq_base).
        wqe_block, in_ring = sq_block_address(m, qp0.sq_base, qp0.log_sq_size, r0.wqe_index,
                                              name="inline")
        to_end_less1 = Signal(16)           # the WQE's blocks after its first, to the ring's end
        m.d.comb += to_end_less1.eq(~r0.wqe_index & in_ring)
        ring_wrap0 = f0.ring_inline & (to_end_less1[3:] == 0) & (to_end_less1[:3] < f0.inline_last_block)

        # --- stage 1: the decision, from registers ------------------------------------------
        qp = c1.qp
        vl = c1.vl
        opcode = r1.opcode
        is_write, is_send, is_read, is_fetch_add, is_atomic, with_imm = (
            f1.is_write, f1.is_send, f1.is_read, f1.is_fetch_add, f1.is_atomic, f1.with_imm)
        length, empty, qpn_bad = f1.length, f1.empty, f1.qpn_bad
        error = (c1.early_error | (f1.uses_key & (c1.key_refused | ~c1.room_ok
                                                   | ~c1.above_base | c1.wraps)))
        status = Signal(CompletionStatus)
        syndrome = Signal(8)        # a Syndrome; 0 (none) while the WQE is good
        with m.If(c1.flushing):
            m.d.comb += [status.eq(CompletionStatus.FLUSH), syndrome.eq(Syndrome.WR_FLUSH_ERR)]
        with m.Elif(error):
            m.d.comb += [status.eq(CompletionStatus.ERROR),
                         syndrome.eq(Mux(c1.early_error, c1.early_syndrome,
                                         Syndrome.LOCAL_PROT_ERR))]
        with m.Else():
            m.d.comb += status.eq(CompletionStatus.SENT)
        sent = status == CompletionStatus.SENT

        # A rewind or skip of the QP of a WQE in stage 0 or 1, in this cycle. A QPN's bits
        # above a QP index are compared with 0 on the input alone: for a WQE whose own are
        # not 0 (``qpn_bad``), whether it is stale does not matter.
        qp_bits = max(1, (num_qps - 1).bit_length())

        def hits(qpn):
            return or_all(event.valid & (event.p.qpn[:qp_bits] == qpn[:qp_bits])
                          & (event.p.qpn[qp_bits:] == 0) for event in (self.rewind, self.skip))

        # Go-back-N: the WQE was fetched before a rewind of its QP (docs/nic.md): its epoch
        # differed when it entered stage 1, or a rewind or skip of its QP came since.
        stale = Signal()
        m.d.comb += stale.eq(c1.stale | hits(r1.qpn))
        resent = lookahead_sum(m, r1.wqe_index, ~c1.recorded, 1, name="since_recorded")[15]

        first_psn = c1.first_psn
        packets_less_one = c1.packets_less_one  # the message's packets less one, if it is sent
        fits = c1.fits                          # in one packet, if it is sent
        last_psn = lookahead_sum(m, first_psn, packets_less_one, name="last_psn")[:PSN_BITS]
        after_psn = lookahead_sum(m, first_psn, packets_less_one, 1, name="after_psn")[:PSN_BITS]
        # The words holding a DMA payload: its last packet's (those of the whole message
        # from the current packet on) and a full packet's, the MTU's and one more when the
        # payload does not start on a word.
        source_addr = Mux(f1.ring_inline, c1.ring_address, r1.laddr)
        words, words_less1 = payload_words(m, source_addr[:6], length)
        mtu_words = Signal(7)
        m.d.comb += mtu_words.eq(Const(2, 7) << qp.mtu)
        unaligned = source_addr[:6] != 0

        # --- stage 0 to stage 1 ------------------------------------------------------------
        # The per-QP state of the WQE's QP as stage 1 leaves it: stage 1 moves on in the
        # cycle its WQE moves up (or is empty), and a WQE of the same QP leaving it for the
        # segmenter updates that state in that cycle.
        commit_same = Signal()
        m.d.comb += commit_same.eq(r1_valid & ~qpn_bad & ~stale & (r1.qpn == r0.qpn))
        with m.If(to_r1):
            m.d.sync += [
                r1_valid.eq(1), r1.eq(r0), f1.eq(f0),
                c1.qp.eq(qp0),
                c1.vl.eq(vl0),
                c1.early_error.eq(r0.format_error | f0.inconsistent | f0.bad_length | no_vl
                                  | list_bad_now),
                c1.early_syndrome.eq(early_syndrome),
                c1.key_refused.eq(key_refused),
                c1.room_ok.eq(~room_sum[wide - 1]),
                c1.above_base.eq(above_base),
                c1.wraps.eq(wraps0),
                c1.packets_less_one.eq(packets_less_one0),
                c1.fits.eq(fits0),
                c1.first_psn.eq(Mux(commit_same & sent, after_psn,
                                    Mux(psn_loaded[r0.qpn], next_psn[r0.qpn], qp0.sq_psn))),
                c1.recorded.eq(Mux(commit_same & ~resent, f1.wqe_end, recorded[r0.qpn])),
                c1.flushing.eq((qp_states[r0.qpn] != QpState.RTS.value) | local_error[r0.qpn]
                               | (commit_same & (status == CompletionStatus.ERROR))),
                c1.stale.eq((r0.epoch != qp_epochs[r0.qpn]) | hits(r0.qpn)),
                c1.ring_address.eq(Cat(f0.inline_offset, wqe_block[6:])),
                c1.ring_wrap.eq(ring_wrap0),
                c1.ring_first_len.eq(to_end_less1[:3]),
                c1.ring_rest_len.eq(f0.inline_last_block + ~to_end_less1[:3]),
            ]
        with m.Elif(r1_advance):
            m.d.sync += r1_valid.eq(0)
        with m.Elif(r1_valid):
            # A WQE waiting in stage 1: the QP state as it was in the cycle before, and the
            # rewinds and skips of its QP (an epoch changes only with one of them).
            m.d.sync += [
                c1.flushing.eq(c1.flushing | (qp_states[r1.qpn] != QpState.RTS.value)),
                c1.stale.eq(stale),
            ]

        # --- stage 2: segmenter ------------------------------------------------------------
        j_valid = Signal()
        job = Signal(_JobLayout())
        laddr = Signal(64)
        psn = Signal(PSN_BITS)
        first = Signal()
        # The current packet's facts, set at load and each step from registers, so the
        # packet is built from registers: whether it is the last (its length then the
        # remaining bytes, else the MTU's), its words, and what the next step needs.
        last = Signal()
        has_payload = Signal()              # segmented, length not 0
        mtu_bytes = Signal(range(4096 + 1))
        mtu_beats = Signal(7)
        remaining = Signal(13)              # modulo 8192: the last packet's bytes
        packets_after = Signal(PSN_BITS)    # packets after the current one
        beats = Signal(7)                   # the current packet's words, and one fewer
        beats_less1 = Signal(7)
        rest_beats = Signal(7)              # the words from the current packet's on
        rest_beats_less1 = Signal(7)
        full_beats = Signal(7)              # a packet of the MTU's words
        full_beats_less1 = Signal(7)
        j_out = Signal()
        j_last = Signal()
        job_stale = Signal()                # a rewind of the job's QP came after it loaded
        stop = Signal()                     # drop the rest of a SENT job
        # A gather list's packet is cut into pieces, one per segment it touches, each in
        # two cycles: ``cutting`` registers the piece's length and words, then it is offered
        # as an item. ``laddr`` is then the current segment's next byte and ``beats`` the
        # piece's words; a one-segment job keeps ``piece_last`` and ``packet_start`` set.
        in_list = Signal()
        cutting = Signal()
        piece_last = Signal()               # the piece offered ends its packet
        packet_start = Signal()             # the next piece is its packet's first
        segment_left = Signal(32)           # bytes left in the current segment
        later = Signal(data.ArrayLayout(DataSegmentLayout(), MAX_GATHER_SEGMENTS - 1))
        piece_bytes = Signal(13)
        piece_ends_segment = Signal()
        packet_left = Signal(13)            # the packet's bytes from the piece offered on
        packed_offset = Signal(6)           # the packet's first byte's, in its first word
        packed_beats = Signal(7)            # the packet's packed words, and one fewer
        packed_beats_less1 = Signal(7)
        packet_out = j_out & piece_last
        j_can_load = ~j_valid | (packet_out & j_last)
        r1_to_j = r1_valid & ~qpn_bad & ~stale & j_can_load
        squash = r1_valid & ~qpn_bad & stale & j_can_load
        m.d.comb += r1_advance.eq(r1_valid & (qpn_bad | j_can_load))

        with m.If(r1_to_j):
            m.d.sync += [
                job.cmp.qpn.eq(r1.qpn),
                job.cmp.cqn.eq(qp.cqn),
                job.cmp.wqe_index.eq(r1.wqe_index),
                job.cmp.wqe_blocks.eq(r1.wqe_blocks),
                job.cmp.opcode.eq(opcode),
                job.cmp.byte_count.eq(Mux(sent, length, 0)),
                job.cmp.first_psn.eq(Mux(sent, first_psn, 0)),
                job.cmp.last_psn.eq(Mux(sent, last_psn, 0)),
                job.cmp.signaled.eq((r1.fm_ce_se & CQ_UPDATE) != 0),
                job.cmp.status.eq(status),
                job.cmp.syndrome.eq(Mux(sent, 0, syndrome)),
                job.cmp.laddr.eq(r1.laddr),
                job.cmp.mtu.eq(qp.mtu),
                job.cmp.retry_cnt.eq(qp.retry_cnt),
                job.cmp.rnr_retry.eq(qp.rnr_retry),
                job.cmp.ack_timeout.eq(qp.ack_timeout),
                job.resent.eq(resent),
                job.send.eq(is_send), job.write.eq(is_write), job.read.eq(is_read),
                job.atomic.eq(is_atomic), job.fetch_add.eq(is_fetch_add), job.local.eq(f1.is_local),
                job.masked.eq(f1.is_masked), job.size4.eq(f1.size4),
                job.swap_mask.eq(r1.swap_mask), job.compare_mask.eq(r1.compare_mask),
                job.with_imm.eq(with_imm),
                job.solicited.eq(((r1.fm_ce_se & SOLICITED) != 0) & (is_send | with_imm)),
                job.inline.eq(r1.inline & ~f1.ring_inline),
                job.ring_wrap.eq(c1.ring_wrap),
                job.ring_first_len.eq(c1.ring_first_len),
                job.ring_rest_len.eq(c1.ring_rest_len),
                job.sq_base.eq(qp.sq_base),
                job.vl.eq(vl), job.sl.eq(qp.sl), job.dlid.eq(qp.dlid),
                job.dest_qpn.eq(qp.dest_qpn), job.pkey.eq(qp.pkey), job.mtu.eq(qp.mtu),
                job.length.eq(length), job.raddr.eq(r1.raddr), job.rkey.eq(r1.rkey),
                job.imm.eq(r1.imm), job.swap_add.eq(r1.swap_add), job.compare.eq(Mux(is_fetch_add, 0, r1.compare)),
                job.inline_data.eq(r1.inline_data),
                laddr.eq(source_addr), psn.eq(first_psn), first.eq(1),
                last.eq(~(is_send | is_write) | fits),
                has_payload.eq((is_send | is_write) & ~empty),
                mtu_bytes.eq(Const(128, 13) << qp.mtu),
                mtu_beats.eq(mtu_words),
                remaining.eq(length), packets_after.eq(packets_less_one),
                beats.eq(Mux(fits, words, mtu_words | unaligned)),
                beats_less1.eq(Mux(fits, words_less1, Mux(unaligned, mtu_words, mtu_words - 1))),
                rest_beats.eq(words), rest_beats_less1.eq(words_less1),
                full_beats.eq(mtu_words | unaligned),
                full_beats_less1.eq(Mux(unaligned, mtu_words, mtu_words - 1)),
                in_list.eq(f1.is_list & sent & (is_send | is_write) & ~empty),
                cutting.eq(f1.is_list & sent & (is_send | is_write) & ~empty),
                piece_last.eq(1), packet_start.eq(1),
                segment_left.eq(r1.byte_count), later.eq(r1.more_segments),
            ]
        for q in range(num_qps):
            with m.If(r1_to_j & (r1.qpn == q)):
                with m.If(sent):
                    m.d.sync += [next_psn[q].eq(after_psn), psn_loaded[q].eq(1)]
                with m.If(status == CompletionStatus.ERROR):
                    m.d.sync += local_error[q].eq(1)
                with m.If(~resent):
                    m.d.sync += recorded[q].eq(r1.wqe_index + r1.wqe_blocks)
            # A job stopped before its first packet was the QP's newest WQE past stage 1:
            # its record never comes.
            with m.If(stop & first & ~job.resent & (job.cmp.qpn == q)):
                m.d.sync += recorded[q].eq(job.cmp.wqe_index)
            with m.If(self.rewind.valid & (rewind.qpn == q)):
                m.d.sync += [next_psn[q].eq(rewind.psn), psn_loaded[q].eq(1)]
            with m.Elif(self.skip.valid & (skip.qpn == q)):
                m.d.sync += [next_psn[q].eq(skip.psn), psn_loaded[q].eq(1)]
            # A reset of the QP (only while it is idle) wins over anything else.
            with m.If(self.qp_reset.valid & (self.qp_reset.qpn == q)):
                m.d.sync += [psn_loaded[q].eq(0), local_error[q].eq(0), recorded[q].eq(0)]
        m.d.sync += [
            self.qp_error.valid.eq(r1_to_j & (status == CompletionStatus.ERROR)),
            self.qp_error.qpn.eq(r1.qpn),
        ]

        job_sent = job.cmp.status == CompletionStatus.SENT
        # A list's packet is cut to its end: its pieces' reads all go, or none.
        m.d.comb += stop.eq(j_valid & job_stale & job_sent & packet_start)
        # Registered, so the rewind input stays off the item -> wqe.ready path.
        m.d.sync += job_stale.eq(Mux(r1_to_j, 0, job_stale |
                                     (self.rewind.valid & (rewind.qpn == job.cmp.qpn)) |
                                     (self.skip.valid & (skip.qpn == job.cmp.qpn))))
        segmented = job.send | job.write
        plen = Signal(range(4096 + 1))
        m.d.comb += [
            plen.eq(Mux(segmented, Mux(last, remaining, mtu_bytes), 0)),
            j_last.eq(~job_sent | last),
        ]

        ib_opcode = Signal(8)
        base = Mux(job.write, RDMA_WRITE_FIRST, SEND_FIRST)
        with m.If(job.read):
            m.d.comb += ib_opcode.eq(RDMA_READ_REQUEST)
        with m.Elif(job.atomic):
            # masked: this project's vendor opcodes, 0xC0 (0xE0 for 4 bytes) | IBA's code
            m.d.comb += ib_opcode.eq(Mux(job.fetch_add, FETCH_ADD, COMPARE_SWAP)
                                     | Cat(C(0, 5), job.size4, job.masked, job.masked))
        with m.Elif(first & last):
            m.d.comb += ib_opcode.eq(base + Mux(job.with_imm, ONLY_IMM, ONLY))
        with m.Elif(first):
            m.d.comb += ib_opcode.eq(base)
        with m.Elif(last):
            m.d.comb += ib_opcode.eq(base + Mux(job.with_imm, LAST_IMM, LAST))
        with m.Else():
            m.d.comb += ib_opcode.eq(base + MIDDLE)

        with_reth = job.read | (job.write & first)
        with_immdt = segmented & job.with_imm & last
        header_bytes = Signal(range(MAX_NIC_HEADER_BYTES + 1))
        m.d.comb += header_bytes.eq(
            LRH_BYTES + BTH_BYTES + Mux(with_reth, RETH_BYTES, 0) + Mux(with_immdt, IMMDT_BYTES, 0)
            + Mux(job.masked, MASKED_ATOMIC_ETH_BYTES, Mux(job.atomic, ATOMIC_ETH_BYTES, 0)))

        headers = iba_local_headers(
            m, vl=job.vl, sl=job.sl, dlid=job.dlid, slid=self.slid, opcode=ib_opcode,
            pkey=job.pkey, destqp=job.dest_qpn, psn=psn, header_bytes=header_bytes,
            payload_bytes=plen, se=job.solicited & last, ackreq=last)
        reth = Signal(RETH)
        immdt = Signal(IMMDT)
        atomic_eth = Signal(ATOMIC_ETH)
        masked_eth = Signal(MASKED_ATOMIC_ETH)
        m.d.comb += [
            masked_eth.va.eq(job.raddr), masked_eth.rkey.eq(job.rkey),
            masked_eth.swap_add.eq(job.swap_add), masked_eth.compare.eq(job.compare),
            masked_eth.swap_mask.eq(job.swap_mask), masked_eth.compare_mask.eq(job.compare_mask),
            reth.va.eq(job.raddr), reth.rkey.eq(job.rkey), reth.dmalen.eq(job.length),
            immdt.imm.eq(job.imm),
            atomic_eth.va.eq(job.raddr), atomic_eth.rkey.eq(job.rkey),
            atomic_eth.swap_add.eq(job.swap_add), atomic_eth.compare.eq(job.compare),
        ]
        ext = Signal(8 * EXT_BYTES)
        with m.If(job.masked):
            m.d.comb += ext.eq(to_wire(MASKED_ATOMIC_ETH, masked_eth))
        with m.Elif(job.atomic):
            m.d.comb += ext.eq(to_wire(ATOMIC_ETH, atomic_eth))
        with m.Elif(with_reth):
            m.d.comb += ext.eq(Cat(to_wire(RETH, reth),
                                   Mux(with_immdt, to_wire(IMMDT, immdt), 0)))
        with m.Elif(with_immdt):
            m.d.comb += ext.eq(to_wire(IMMDT, immdt))

        # Payload reads: the 64-byte words holding the packet's bytes, cut at 4 KiB.
        dma = job_sent & ~job.inline & has_payload
        bursts = payload_bursts(m, laddr, beats, beats_less1)

        item = Signal(_ItemLayout())
        m.d.comb += [
            item.desc.vl.eq(job.vl),
            item.desc.header.eq(Cat(headers, ext)),
            item.desc.header_bytes.eq(header_bytes),
            item.desc.payload_bytes.eq(plen),
            # A READ request takes the PSNs of all its responses.
            item.sent_psn.eq(Mux(job.read, job.cmp.last_psn, psn)),
            item.has_packet.eq(job_sent & ~job.local & piece_last),
            item.resent.eq(job.resent),
            item.cmp.eq(job.cmp),
            item.has_completion.eq(first & ~job.resent & piece_last),
            item.reserve.eq(dma & packet_start),
            item.piece.start.eq(laddr[:6]),
            item.piece.bytes.eq(Mux(in_list, piece_bytes, plen)),
            item.piece.beats.eq(beats),
            item.piece.last.eq(piece_last),
        ]
        with m.If(dma):
            m.d.comb += dma_payload(item, bursts)
            with m.If(in_list):
                m.d.comb += [item.desc.offset.eq(packed_offset),
                             item.desc.dma_beats.eq(packed_beats)]
            with m.If(job.ring_wrap):
                m.d.comb += [
                    item.n_ar.eq(2),
                    item.ar0_len.eq(job.ring_first_len),
                    item.ar1_addr.eq(Cat(C(0, 6), job.sq_base[6:])),
                    item.ar1_len.eq(job.ring_rest_len),
                ]
        with m.Elif(job_sent & job.inline & has_payload):
            m.d.comb += [
                item.desc.source.eq(PayloadSource.INLINE),
                item.desc.inline_data.eq(job.inline_data),
            ]

        next_laddr = lookahead_sum(m, laddr, mtu_bytes, name="next_laddr")[:64]
        next_remaining = lookahead_sum(m, remaining, ~mtu_bytes, 1, name="next_remaining")[:13]
        next_psn_of_job = lookahead_sum(m, psn, 0, 1, name="next_psn_of_job")[:PSN_BITS]
        next_packets_after = lookahead_sum(m, packets_after, C(-1, PSN_BITS),
                                           name="next_packets_after")[:PSN_BITS]
        next_rest_beats = lookahead_sum(m, rest_beats, ~mtu_beats, 1, name="next_rest_beats")[:7]
        next_rest_beats_less1 = lookahead_sum(m, rest_beats_less1, ~mtu_beats, 1,
                                              name="next_rest_beats_less1")[:7]
        next_is_last = packets_after == 1
        with m.If(packet_out):
            with m.If(j_last):
                m.d.sync += j_valid.eq(0)
            with m.Else():
                m.d.sync += [
                    laddr.eq(next_laddr),
                    remaining.eq(next_remaining),
                    psn.eq(next_psn_of_job),
                    first.eq(0),
                    last.eq(next_is_last),
                    packets_after.eq(next_packets_after),
                    rest_beats.eq(next_rest_beats), rest_beats_less1.eq(next_rest_beats_less1),
                    beats.eq(Mux(next_is_last, next_rest_beats, full_beats)),
                    beats_less1.eq(Mux(next_is_last, next_rest_beats_less1, full_beats_less1)),
                ]

        # A list's piece: cut (its length the smaller of the segment's and the packet's
        # bytes left, both words computed and one chosen), then offered; the segment moves
        # on as it is taken, to the next one when it ends (a zero-length one is skipped
        # while cutting).
        left = Mux(packet_start, plen, packet_left)
        segment_fits = (segment_left[13:] == 0) & (segment_left[:13] <= left)
        segment_covers = (segment_left[13:] != 0) | (segment_left[:13] >= left)
        segment_words, segment_words_less1 = payload_words(m, laddr[:6], segment_left,
                                                           name="segment_words")
        left_words, left_words_less1 = payload_words(m, laddr[:6], left, name="left_words")
        next_in_segment = lookahead_sum(m, laddr, piece_bytes, name="next_in_segment")[:64]
        segment_rest = lookahead_sum(m, segment_left, ~Cat(piece_bytes, C(0, 19)), 1,
                                     name="segment_rest")[:32]
        packet_rest = lookahead_sum(m, packet_left, ~piece_bytes, 1, name="packet_rest")[:13]
        segment_bits = DataSegmentLayout().size
        next_segment = [laddr.eq(later[0].laddr), segment_left.eq(later[0].byte_count),
                        later.eq(later.as_value()[segment_bits:])]
        with m.If(j_valid & cutting):
            with m.If(segment_left == 0):
                m.d.sync += next_segment
            with m.Else():
                m.d.sync += [
                    cutting.eq(0),
                    piece_bytes.eq(Mux(segment_fits, segment_left[:13], left)),
                    beats.eq(Mux(segment_fits, segment_words, left_words)),
                    beats_less1.eq(Mux(segment_fits, segment_words_less1, left_words_less1)),
                    piece_last.eq(segment_covers),
                    piece_ends_segment.eq(segment_fits),
                    packet_left.eq(left),
                ]
                with m.If(packet_start):
                    m.d.sync += [packed_offset.eq(laddr[:6]), packed_beats.eq(left_words),
                                 packed_beats_less1.eq(left_words_less1)]
        # (a job's last piece is its end: a new job may load in that cycle)
        with m.If(j_out & in_list & ~(piece_last & j_last)):
            m.d.sync += [cutting.eq(1), packet_start.eq(piece_last),
                         packet_left.eq(packet_rest)]
            with m.If(piece_ends_segment):
                m.d.sync += next_segment
            with m.Else():
                m.d.sync += [laddr.eq(next_in_segment), segment_left.eq(segment_rest)]
        with m.If(stop):
            m.d.sync += j_valid.eq(0)
        with m.If(r1_to_j):
            m.d.sync += j_valid.eq(1)

        # --- stage 3: payload reads ----------------------------------------------------------
        d_can_load = Signal()
        p, p_out = payload_read_stage(
            m, layout=_ItemLayout(), item=item, item_valid=j_valid & ~stop & ~cutting,
            item_taken=j_out, beats=Mux(in_list, packed_beats, beats),
            beats_less1=Mux(in_list, packed_beats_less1, beats_less1),
            can_pass=d_can_load, ar=self.ar, ar_id=PAYLOAD_ID,
            buffer_beats=self.payload_buffer_beats, freed=self.payload_freed,
            reserve=item.reserve, pieces=self.pieces)

        # --- stage 4: packet descriptor, completion record ---------------------------------
        m.submodules.completions = completions = fifo.SyncFIFO(
            width=CompletionRecordLayout().size, depth=4)
        d_valid = Signal()
        d = Signal(_ItemLayout())
        completion_room = ~d.has_completion | completions.w_rdy
        d_done = d_valid & completion_room & (~d.has_packet | self.packet.ready)
        m.d.comb += [
            d_can_load.eq(~d_valid | d_done),
            self.packet.valid.eq(d_valid & d.has_packet & completion_room),
            self.packet.payload.eq(d.desc),
            completions.w_en.eq(d_done & d.has_completion),
            completions.w_data.eq(d.cmp),
            self.completion.valid.eq(completions.r_rdy),
            self.completion.payload.eq(completions.r_data),
            completions.r_en.eq(self.completion.ready),
        ]
        with m.If(d_done):
            m.d.sync += d_valid.eq(0)
        with m.If(p_out):
            m.d.sync += [d_valid.eq(1), d.eq(p)]
        m.d.sync += [
            self.sent.valid.eq(d_done & d.has_packet),
            self.sent.payload.qpn.eq(d.cmp.qpn),
            self.sent.payload.psn.eq(d.sent_psn),
        ]

        # --- counters ------------------------------------------------------------------------
        # Each counts its registered events, a cycle after them: a 32-bit sum is deep
        # enough on its own.
        recorded = d_done & d.has_completion
        sent_packet = d_done & d.has_packet
        packet_event, resent_event, executed_event, flushed_event = (
            Signal(name=name) for name in
            ("packet_event", "resent_event", "executed_event", "flushed_event"))
        packet_bytes = Signal(range(4096 + 1))
        squashed_events = Signal(2)
        error_events = Signal(2)
        m.d.sync += [
            packet_event.eq(sent_packet),
            packet_bytes.eq(Mux(sent_packet, d.desc.payload_bytes, 0)),
            resent_event.eq(sent_packet & d.resent),
            executed_event.eq(recorded & (d.cmp.status == CompletionStatus.SENT)),
            flushed_event.eq(recorded & (d.cmp.status == CompletionStatus.FLUSH)),
            squashed_events.eq(squash + stop),
            error_events.eq((recorded & (d.cmp.status == CompletionStatus.ERROR))
                            + (r1_valid & qpn_bad)),
        ]
        for counter, event in (
                (self.packets_sent, packet_event), (self.payload_bytes_sent, packet_bytes),
                (self.packets_resent, resent_event), (self.wqes_executed, executed_event),
                (self.wqes_flushed, flushed_event), (self.wqes_squashed, squashed_events),
                (self.wqe_errors, error_events)):
            m.d.sync += counter.eq(lookahead_sum(m, counter, event, name=f"{counter.name}_next"))

        return m
