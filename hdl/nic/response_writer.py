from amaranth import *
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.arith import lookahead_sum, named
from hdl.ib.headers import AETH, BTH, LRH
from hdl.link.signatures import BeatLayout, vl_index
from hdl.prim.round_robin import mask_after, next_mask, one_hot_index, round_robin_pick
from hdl.prim.skid_register import tagged_input

from .dma_writer import DmaWriter, command_bursts
from .signatures import (
    MAX_PACKET_BEATS, READ_DATA_ID, RESPONSE_SEQ_BITS, RX_BUFFER_BEAT_BITS, AxiWriteSignature,
    DmaWriteLayout, ResponseVerdictLayout,
)

__all__ = ["ResponseWriter", "MAX_SLOTS"]

WIDTH = 64                  # bytes per beat
MAX_SLOTS = 256
# BTH opcodes of the responses that are stored (IBA table 38): READ response FIRST,
# MIDDLE, LAST, ONLY, and ATOMIC ACKNOWLEDGE.
READ_FIRST, READ_ONLY = 0x0D, 0x10
ATOMIC_ACKNOWLEDGE = 0x12
OPCODE_BYTE = LRH.size_bytes                                  # BTH's first byte
ORIG_BYTE = LRH.size_bytes + BTH.size_bytes + AETH.size_bytes  # AtomicAckETH: 24
ORIG_BYTES = 8
# Where the stored copy of an ATOMIC ACKNOWLEDGE keeps the original value's low 4 bytes in
# wire order (big-endian, as a 4-byte atomic's result lands): over its ICRC, which nobody
# reads from the ring.
ORIG_WORD4_BYTE = ORIG_BYTE + ORIG_BYTES
MAX_STORED_BYTES = MAX_PACKET_BEATS * WIDTH
MIN_BUFFER_BEATS = 1 << (MAX_PACKET_BEATS - 1).bit_length()     # 128


class _PacketLayout(data.StructLayout):
    """Where a stored packet lies in the ring, written when its end beat is taken."""
    def __init__(self, beat_bits):
        super().__init__({
            "start": beat_bits,
            "beats": range(MAX_PACKET_BEATS + 1),
            "length": range(MAX_STORED_BYTES + 1),      # bytes stored
        })


class _WriteLayout(data.StructLayout):
    """The part of a verdict kept until its packet's command goes out, with the AW
    bursts (:func:`command_bursts`) it gives if it writes."""
    def __init__(self, addr_width):
        super().__init__({"addr": addr_width, "bytes": range(4096 + 1), "offset": 6,
                          "bursts": 2})


class ResponseWriter(wiring.Component):
    """Writes RDMA READ response payload and ATOMIC ACKNOWLEDGE original values into the
    requester's memory, on the completion unit's word (docs/nic.md, "READ response data").

    It sits between ``RequestReceiver.responses[v]`` and ``CompletionUnit.rx[v]``.

    **Pass-through.** Every beat of every VL goes from ``rx[v]`` to ``out[v]`` unchanged
    (flags too), in order, through an input register (:func:`tagged_input`, two entries):
    ``rx[v].ready`` is a flip-flop, high unless the register holds two beats, and a beat
    taken in cycle c is offered from c + 1 (the opcode's kind decoded as it entered).
    From the register, ``out[v].valid = valid & allow`` and the register's head moves
    when ``allow & out[v].ready``. ``allow`` does not look at ``out[v].ready``, and once it
    has shown a beat it stays high until the beat moves: the stream rules hold with any
    consumer (the completion unit is always ready).

    **Storing.** A packet whose start beat carries BTH opcode 0x0D..0x10 (READ response
    FIRST, MIDDLE, LAST, ONLY) or 0x12 (ATOMIC ACKNOWLEDGE), at byte 8 of the start beat,
    is also stored whole, LRH .. ICRC as on the wire, in a ring of ``buffer_beats`` 64-byte
    beats, one beat per cycle as it passes. Only one packet is stored at a time: VLs are
    taken round robin at packet boundaries, and a stored kind's start beat waits (in the
    input register, ``allow`` low) while another VL's stored packet is passing, while the
    ring has no free beat, or while ``slots`` stored packets have not landed; each
    further beat waits while the ring is full. Nothing is dropped for space, and waiting
    holds only the stored kinds: an ACKNOWLEDGE (0x11), any other opcode, the rest of such
    a packet, and a non-start beat outside any packet pass as soon as they head the input
    register (``allow`` = 1). The link's framing is trusted (a VL's beats from a start to
    an end are one packet). For an ATOMIC ACKNOWLEDGE the
    stored copy has bytes 24..31 of its start beat (the AtomicAckETH original value,
    big-endian on the wire) reversed, so that a verdict writing them puts the value in
    memory little-endian, in host order, and at bytes 32..35 (``ORIG_WORD4_BYTE``, where
    its ICRC was) the wire's bytes 28..31, the value's low 4 bytes big-endian: a 4-byte
    atomic's result as NVSHMEM reads it. ``end_bad`` and the ICRC are not looked at: the
    packet is stored, and the completion unit sends ``discard`` for it. A stored kind
    longer than ``MAX_PACKET_BEATS`` beats (not possible from a well-behaved link) passes
    whole, but only its first ``MAX_PACKET_BEATS`` beats are stored: its stored length
    is ``MAX_PACKET_BEATS * 64`` bytes (4224), so every verdict fits (``offset`` < 64,
    ``bytes`` <= 4096) and writes from the stored beats.

    **Sequence numbers.** Each stored packet gets the next ``seq`` (RESPONSE_SEQ_BITS,
    wrapping; 0 after reset), shown on every ``out_seq[v]`` from before its start beat
    until its end beat has moved (it changes in the cycle after a stored packet's end
    beat moves, and at no other time). The completion unit samples it on a stored
    packet's end beat; on other packets it is meaningless.

    **Verdicts.** Every stored packet then needs exactly one verdict, from ``discard``
    (its ``seq``) or ``verdict`` (``write``: write ``bytes`` bytes found ``offset`` bytes
    into the stored packet to ``addr``; else discard it). Both are always ready, one per
    cycle each, in any order across packets, at the earliest in the cycle after the
    packet's end beat moved. A verdict or discard for a ``seq`` that is not a stored
    packet waiting for its verdict (in the cycle its end beat moves, already judged, or
    not stored at all) is ignored; a discard and a verdict for the same ``seq`` in one
    cycle: the discard wins. A write whose ``offset + bytes`` exceeds the stored length
    is refused: treated as a discard.

    **Writing.** Packets are dealt with in ``seq`` order: once the oldest one not yet
    dealt with has its verdict, it gives one command to an internal :class:`DmaWriter`
    (AWID ``READ_DATA_ID``): ``bytes`` bytes from the packet's first ring beat, byte
    ``offset``, to ``addr`` (``bytes`` = 0 for a discard, a refused write or a write of
    nothing), releasing the packet's ring beats. The command is offered in the cycle
    after the verdict arrives (if the packet's turn has come), one per cycle; an idle
    DmaWriter takes it at once and shows AW three cycles later: verdict in cycle t, AW
    valid in t + 4, W beats from about the cycle after. The DmaWriter releases the ring
    beats as soon as it has read them (the payload waits for W in its queue), not at B.
    ``axi`` is the DmaWriter's port (INCR bursts of full 64-byte beats with strobes,
    split at 4 KiB; B always ready, routed by ID, so in order).

    **Landed.** ``landed`` is the ``seq`` of the oldest stored packet whose command has
    not completed: a command completes when the DmaWriter has released its beats and every
    B of its bursts (0, 1 or 2: :func:`command_bursts`) has come, and the commands
    before it have completed. The completion unit may treat ``seq`` as landed when
    ``(landed - seq - 1) mod 2**16 < 2**15``. ``landed`` steps one command per cycle, in
    the second cycle after the event that completed it (last B or release in cycle t:
    ``landed`` past it in cycle t + 2; a discard in cycle t is released in t + 3 and
    landed in t + 5 if nothing is ahead of it). A B counts only while an accepted AW
    burst is unanswered, so a stray B cannot land anything early.

    **Counters.** ``response_bytes_written``: bytes written (counted as the DmaWriter's
    ``dma_bytes_written``: a command's bytes in the cycle after its last W beat is taken);
    ``response_write_errors``: B responses not OKAY (the DmaWriter's
    ``dma_write_errors``, stray ones included, in the cycle after the B); ``responses_discarded``: stored packets whose command writes
    nothing because of a discard, a verdict with ``write`` = 0 or a refused write (a
    write of 0 bytes is not a discard), counted in the cycle after the command is taken
    (a registered event; it counted in the command's own cycle before 2026-12-06).

    A ring beat is taken from a packet's beat until the DmaWriter has read it for the
    packet's command (after the verdict); a slot from a packet's start beat until it
    has landed.

    **Depth** (docs/fpga.md). Every port keeps the timing above; inside, the decisions read
    registers: the ring's beats in use (its top bit is "full"), whether the next beat is
    stored, the packets not landed kept apart from the one whose end beat moved in the
    cycle before (``ended``, which the slot test and the verdict hit also look at), the
    head's command itself (formed in the cycle before from the slot tables, or from the
    verdict arriving for the head after this cycle), its fit (the head slot's, or that
    arriving verdict's: two flip-flops and which applies, chosen as the command leaves),
    and per slot whether its packet waits for a verdict, whether its verdict writes and
    whether the write fits. A verdict's fit to its packet is found as it arrives, split
    at bit 6: compares of bytes' and length's 64-byte parts, the low parts where those
    are equal (2026-12-06; one carry-save layer and a lookahead sum before).

    Resources: the ring (``buffer_beats`` x 512 bits, one write and one read port), two
    ``slots``-entry tables read asynchronously (packet place: ~26 bits, read at the
    verdict's slot, the head's and the next; verdict: ``addr_width`` + 21 bits, read at
    the head's and the next), a ``slots`` x 2-bit FIFO of burst counts, four bits per
    slot, the head's command, and the DmaWriter (three 4-deep job queues and a 4-beat
    data queue).

    Parameters
    ----------
    num_vls : int
        Data VLs, 1..15.
    buffer_beats : int
        Ring size in 64-byte beats: a power of two from 128 (it must hold one packet of
        ``MAX_PACKET_BEATS`` beats, which has its verdict only after its end beat) to
        ``2 ** RX_BUFFER_BEAT_BITS``.
    slots : int
        Stored packets that may be waiting for their verdict, write or B at once: a
        power of two from 2 to ``MAX_SLOTS``.
    addr_width : int
        AXI address bits, 12 .. 64 (a verdict's ``addr`` is cut to them).
    """
    def __init__(self, *, num_vls=2, buffer_beats=256, slots=16, addr_width=64):
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"num_vls must be an integer from 1 to 15, not {num_vls!r}")
        # A packet's verdict comes after its end beat, so the ring must hold a whole one.
        if (not isinstance(buffer_beats, int) or buffer_beats < MAX_PACKET_BEATS
                or buffer_beats > 1 << RX_BUFFER_BEAT_BITS or buffer_beats & (buffer_beats - 1)):
            raise ValueError(f"buffer_beats must be a power of two from {MIN_BUFFER_BEATS} to "
                             f"{1 << RX_BUFFER_BEAT_BITS}, not {buffer_beats!r}")
        if (not isinstance(slots, int) or not 2 <= slots <= MAX_SLOTS
                or slots & (slots - 1)):
            raise ValueError(f"slots must be a power of two from 2 to {MAX_SLOTS}, not {slots!r}")
        if not isinstance(addr_width, int) or not 12 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 12 to 64 bits, not {addr_width!r}")
        self.num_vls = num_vls
        self.buffer_beats = buffer_beats
        self.slots = slots
        self.addr_width = addr_width
        beat = BeatLayout(WIDTH)
        super().__init__({
            "rx": In(stream.Signature(beat)).array(num_vls),
            "out": Out(stream.Signature(beat)).array(num_vls),
            "out_seq": Out(RESPONSE_SEQ_BITS).array(num_vls),
            "discard": In(stream.Signature(RESPONSE_SEQ_BITS, always_ready=True)),
            "verdict": In(stream.Signature(ResponseVerdictLayout(), always_ready=True)),
            "landed": Out(RESPONSE_SEQ_BITS),
            "axi": Out(AxiWriteSignature(addr_width, WIDTH)),
            "response_bytes_written": Out(32),
            "response_write_errors": Out(32),
            "responses_discarded": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        num_vls, depth, slots = self.num_vls, self.buffer_beats, self.slots
        beat_bits = exact_log2(depth)
        slot_bits = exact_log2(slots)
        packet_layout = _PacketLayout(beat_bits)
        write_layout = _WriteLayout(self.addr_width)

        m.submodules.ring = ring = memory.Memory(shape=8 * WIDTH, depth=depth, init=[])
        ring_w = ring.write_port()
        ring_r = ring.read_port(domain="sync")
        m.submodules.dma = dma = DmaWriter(buffer_beats=depth, addr_width=self.addr_width,
                                           awid=READ_DATA_ID)
        wiring.connect(m, dma.axi, wiring.flipped(self.axi))
        m.d.comb += [
            ring_r.addr.eq(dma.source.addr),
            dma.source.data.eq(ring_r.data),
            self.response_bytes_written.eq(dma.dma_bytes_written),
            self.response_write_errors.eq(dma.dma_write_errors),
        ]

        seq = Signal(RESPONSE_SEQ_BITS)     # the packet being stored, or the next one
        seq_slot = seq[:slot_bits]
        landed = self.landed
        for v in range(num_vls):
            m.d.comb += self.out_seq[v].eq(seq)

        # The ring's beats in use (written, not yet released: 0 .. depth) are a register
        # whose top bit says the ring is full.
        write_ptr = Signal(beat_bits)
        used = Signal(beat_bits + 1)
        room = ~used[beat_bits]
        # Whether a stored packet's end beat moved in the cycle before, and its slot: the
        # facts that look at it take it from this register, a cycle late.
        ended = Signal()
        ended_slot = Signal(slot_bits)
        # A new packet needs a slot (seq - landed < slots): a packet's slot entries may be
        # read until it has landed. Kept as the packets not landed but the one that ended
        # in the cycle before (0 .. slots), plus ``ended``.
        unlanded = Signal(slot_bits + 1)
        slot_free = ~unlanded[slot_bits] & ~(ended & (unlanded == slots - 1))

        # --- Ingress: pass-through, and one stored packet at a time ---------------------
        busy = Signal()                     # a stored packet's beats are being taken
        current = Signal(vl_index(num_vls))
        rr_mask = Signal(num_vls, init=mask_after(0, num_vls))   # after the VL granted last
        beats_before = Signal(range(MAX_PACKET_BEATS + 1))   # saturates: not stored beyond
        # Whether the next beat taken is stored (~busy | beats_before < MAX_PACKET_BEATS).
        stores = Signal(init=1)
        packet_start = Signal(beat_bits)
        # A stored kind's start beat offered on ``out`` but not taken (its ``out`` not
        # ready) keeps the grant, so that its valid stays up until it moves.
        hold = Signal()
        held = Signal(vl_index(num_vls))

        index = named(m, Mux(busy, beats_before, 0), "index")
        index_plus1 = named(m, Mux(busy, beats_before + 1, 1), "index_plus1")
        pending = Signal(num_vls)
        rr_grant = one_hot_index(round_robin_pick(m, pending, rr_mask, name="vl"))
        rr_granted = pending.any()
        grant = Mux(hold, held, rr_grant)
        go = ~busy & (hold | rr_granted) & room & slot_free

        taken = Signal(num_vls)             # a stored packet's beat moves on VL v
        # Each VL's part of what a taken beat writes, chosen by VL afterwards: its stored
        # length if it is the end beat, and bytes 24..31 of the start beat (an ATOMIC
        # ACKNOWLEDGE's original value, reversed into host order).
        lengths, origs = [], []
        # Input registers, which decode the opcode as a beat enters.
        def opcode(beat):
            return beat.data[8 * OPCODE_BYTE:8 * OPCODE_BYTE + 8]
        def is_atomic_ack(beat):
            return opcode(beat) == ATOMIC_ACKNOWLEDGE
        def is_stored(beat):
            return (((opcode(beat) >= READ_FIRST) & (opcode(beat) <= READ_ONLY))
                    | is_atomic_ack(beat))
        inputs = [tagged_input(m, f"input{v}", self.rx[v], stored=is_stored, atomic=is_atomic_ack)
                  for v in range(num_vls)]
        for v in range(num_vls):
            rx, out = inputs[v], self.out[v]
            beat_in = rx.payload.beat
            passing = Signal(name=f"passing{v}")     # inside a packet that is not stored
            ours = busy & (current == v)
            starts = beat_in.start & ~ours & ~passing & rx.payload.stored
            allow = Signal(name=f"allow{v}")
            with m.If(ours):
                m.d.comb += allow.eq(~stores | room)
            with m.Elif(starts):
                m.d.comb += allow.eq(go & (grant == v))
            with m.Else():
                m.d.comb += allow.eq(1)
            m.d.comb += [
                pending[v].eq(rx.valid & starts),
                out.valid.eq(rx.valid & allow),
                out.payload.eq(beat_in),
                rx.ready.eq(allow & out.ready),
                taken[v].eq(rx.valid & rx.ready & (ours | starts)),
            ]
            with m.If(rx.valid & rx.ready & ~ours & ~starts & (beat_in.start | passing)):
                m.d.sync += passing.eq(~beat_in.end)
            # index * 64 + count, the count's top bit added to the index.
            count = beat_in.count
            lengths.append(named(m, Mux(stores, Cat(count[:6], Mux(count[6], index_plus1, index)),
                                    MAX_STORED_BYTES), f"length{v}"))
            # bytes 24..35: the original value reversed into host order, then its low 4
            # bytes as on the wire
            orig = beat_in.data[8 * ORIG_BYTE:8 * (ORIG_WORD4_BYTE + 4)]
            orig_host = Cat(*(orig[8 * i:8 * i + 8] for i in reversed(range(ORIG_BYTES))),
                            orig[8 * (ORIG_BYTES - 4):8 * ORIG_BYTES])
            origs.append(named(m, Mux(~busy & rx.payload.atomic, orig_host, orig), f"orig{v}"))

        select = Mux(busy, current, grant)
        beat = BeatLayout(WIDTH)(Array(Value.cast(inputs[v].payload.beat)
                                       for v in range(num_vls))[select])
        take = taken.any()
        m.d.sync += hold.eq(go & pending.bit_select(grant, 1) & ~take)
        m.d.sync += held.eq(grant)

        first = ~busy
        m.d.comb += [
            ring_w.addr.eq(write_ptr),
            ring_w.data.eq(Cat(beat.data[:8 * ORIG_BYTE], Array(origs)[select],
                               beat.data[8 * (ORIG_WORD4_BYTE + 4):])),
            ring_w.en.eq(take & stores),
        ]
        # Sums of registers, chosen by the ingress handshake afterwards.
        write_ptr_next = lookahead_sum(m, write_ptr, 0, 1, name="write_ptr_next")[:beat_bits]
        with m.If(take & stores):
            m.d.sync += write_ptr.eq(write_ptr_next)
        with m.If(take):
            m.d.sync += [
                busy.eq(~beat.end),
                beats_before.eq(Mux(stores, index_plus1, index)),
                stores.eq(beat.end | (stores & (index < MAX_PACKET_BEATS - 1))),
            ]
            with m.If(first):
                m.d.sync += [current.eq(select),
                             rr_mask.eq(next_mask(Cat(select == v for v in range(num_vls)))),
                             packet_start.eq(write_ptr)]

        # The ring's use: less what the DmaWriter releases (a register of it), plus the
        # beat stored now; both outcomes summed from registers, then chosen.
        released = Signal(range(MAX_PACKET_BEATS + 1))
        m.d.comb += released.eq(Mux(dma.release.valid, dma.release.payload, 0))
        not_released = named(m, ~Cat(released, C(0, beat_bits + 1 - len(released))), "not_released")
        freed = lookahead_sum(m, used, not_released, 1, name="freed")[:beat_bits + 1]
        # used - released + 1 = used + ~released + 2: a carry-save layer, then one sum.
        two = C(2, beat_bits + 1)
        freed1_s = named(m, used ^ not_released ^ two, "freed1_s")
        freed1_c = named(m, (used & not_released) | (used & two) | (not_released & two), "freed1_c")
        freed_plus1 = lookahead_sum(m, freed1_s, Cat(C(0, 1), freed1_c[:beat_bits]),
                                    name="freed_plus1")[:beat_bits + 1]
        m.d.sync += used.eq(Mux(take & stores, freed_plus1, freed))

        # Where each stored packet lies, by seq, written as its end beat moves.
        m.submodules.packets = packets = memory.Memory(shape=packet_layout, depth=slots, init=[])
        packets_w = packets.write_port()
        ends = take & beat.end
        m.d.comb += [
            packets_w.addr.eq(seq_slot),
            packets_w.en.eq(ends),
            packets_w.data.start.eq(Mux(first, write_ptr, packet_start)),
            packets_w.data.beats.eq(Mux(stores, index_plus1, index)),
            packets_w.data.length.eq(Array(lengths)[select]),
        ]
        seq_next = lookahead_sum(m, seq, 0, 1, name="seq_next")[:RESPONSE_SEQ_BITS]
        with m.If(ends):
            m.d.sync += seq.eq(seq_next)
        m.d.sync += [ended.eq(ends), ended_slot.eq(seq_slot)]

        # --- Verdicts: by slot, a judged flag, the write flag and the write itself ---------
        head = Signal(RESPONSE_SEQ_BITS)    # the oldest stored packet without its command
        head_slot, head_upper = head[:slot_bits], head[slot_bits:]
        head_plus1 = Signal(RESPONSE_SEQ_BITS, init=1)
        next_slot = head_plus1[:slot_bits]
        head_upper_plus1 = Signal(RESPONSE_SEQ_BITS - slot_bits, init=1)    # head_upper + 1
        awaiting = Signal(slots)    # the slot's packet ended (before ``ended``), no verdict yet
        judged = Signal(slots)      # ... has its verdict and no command yet
        writes = Signal(slots)      # ... and the verdict writes
        fit = Signal(slots)         # ... and fits the stored packet
        m.submodules.verdicts = verdicts = memory.Memory(shape=write_layout, depth=slots, init=[])
        verdicts_w = verdicts.write_port()

        def slot_bit(bits, slot):
            """Bit ``slot`` of a per-slot vector, as a multiplexer (a shifter maps deeper)."""
            return Array(bits[k] for k in range(slots))[slot]

        def waits(slot):
            """Whether the slot's packet has ended and has no verdict yet."""
            return slot_bit(awaiting, slot) | (ended & (slot == ended_slot))

        def hit(stream_, number, name):
            """The slot a verdict input names, if its packet is waiting for a verdict. The
            packets waiting are head .. head + slots - 1, so one in a slot below head's has
            head's upper bits plus one."""
            slot, upper = number[:slot_bits], number[slot_bits:]
            in_window = Mux(slot < head_slot, upper == head_upper_plus1, upper == head_upper)
            valid = named(m, stream_.valid & waits(slot) & in_window, name)
            return valid, slot

        verdict = self.verdict.payload
        verdict_valid, verdict_slot = hit(self.verdict, verdict.seq, "verdict_hit")
        discard_valid, discard_slot = hit(self.discard, self.discard.payload, "discard_hit")
        # Whether the write fits the stored packet, offset + bytes <= length, split at bit
        # 6 (the offset lies below it): the verdict's own low sum gives a carry into the
        # beats; bytes' beats (plus that carry) against length's are compares of two
        # operands, and where they are equal the low parts decide.
        packets_v = packets.read_port(domain="comb")
        m.d.comb += packets_v.addr.eq(verdict_slot)
        length = packets_v.data.length
        low = lookahead_sum(m, verdict.offset, verdict.bytes[:6], name="fit_low")
        carry, rest = low[6], low[:6]
        bytes_hi, length_hi = verdict.bytes[6:13], length[6:13]
        not_length_hi = named(m, ~length_hi, "fit_not_length_hi")
        above = lookahead_sum(m, bytes_hi, not_length_hi, name="fit_above")[7]       # >
        at_least = lookahead_sum(m, bytes_hi, not_length_hi, 1, name="fit_at_least")[7]
        equal = bytes_hi == length_hi
        bytes_hi_plus1 = lookahead_sum(m, bytes_hi, 0, 1, name="fit_bytes_hi_plus1")[:7]
        equal_less1 = bytes_hi_plus1 == length_hi
        rest_above = lookahead_sum(m, rest, ~length[:6], name="fit_rest_above")[6]
        fits = named(m, ~Mux(carry, at_least | (equal_less1 & rest_above),
                         above | (equal & rest_above)), "fits")
        m.d.comb += [
            verdicts_w.addr.eq(verdict_slot),
            verdicts_w.en.eq(verdict_valid),
            verdicts_w.data.addr.eq(verdict.addr[:self.addr_width]),
            verdicts_w.data.bytes.eq(verdict.bytes),
            verdicts_w.data.offset.eq(verdict.offset),
            verdicts_w.data.bursts.eq(command_bursts(m, verdict.addr, verdict.bytes)),
        ]

        # --- Commands, oldest packet first ------------------------------------------------
        # The head's command is a register, formed in the cycle before from its slot's
        # entries (head's, or the next slot's if the head moves on) or from the verdict
        # arriving for it.
        command = dma.command
        head_judged = Signal()          # judged[head_slot]
        head_writes = Signal()          # writes[head_slot]
        head_verdict = Signal()         # the verdict arrived for the head: its fit applies
        head_fits = Signal()            # ... that fit
        head_slot_fits = Signal()       # else fit[head_slot]
        head_command = Signal(DmaWriteLayout())
        head_bursts = Signal(2)         # command_bursts of the head's command
        # Burst counts of commands given and not landed: at most ``slots`` of them.
        m.submodules.landing = landing = fifo.SyncFIFO(width=2, depth=slots)
        head_fit = named(m, Mux(head_verdict, head_fits, head_slot_fits), "head_fit")
        m.d.comb += [
            command.valid.eq(head_judged & landing.w_rdy),
            command.payload.eq(head_command),
            command.payload.bytes.eq(Mux(head_fit, head_command.bytes, 0)),
            landing.w_data.eq(Mux(head_fit, head_bursts, 0)),
            landing.w_en.eq(command.valid & command.ready),
        ]
        dispatch = named(m, command.valid & command.ready, "dispatch")

        packets_h, packets_n = packets.read_port(domain="comb"), packets.read_port(domain="comb")
        verdicts_h, verdicts_n = verdicts.read_port(domain="comb"), verdicts.read_port(domain="comb")
        m.d.comb += [packets_h.addr.eq(head_slot), verdicts_h.addr.eq(head_slot),
                     packets_n.addr.eq(next_slot), verdicts_n.addr.eq(next_slot)]

        def after(bits):
            """A slot's bit of the head after this cycle (the next slot's if it moves on)."""
            return Mux(dispatch, slot_bit(bits, next_slot), slot_bit(bits, head_slot))

        # A verdict or discard for the head after this cycle: its number, and the head's
        # packet waiting (the same as a hit on its slot, without the window's compares).
        waits_head = named(m, waits(head_slot), "waits_head")
        waits_next = named(m, waits(next_slot), "waits_next")

        def for_head_after(stream_, number, name):
            return named(m, stream_.valid & Mux(dispatch, (number == head_plus1) & waits_next,
                                            (number == head) & waits_head), name)

        verdict_after = for_head_after(self.verdict, verdict.seq, "verdict_after")
        discard_after = for_head_after(self.discard, self.discard.payload, "discard_after")
        place = packet_layout(Mux(dispatch, packets_n.data, packets_h.data))
        judgement = write_layout(Mux(dispatch, verdicts_n.data, verdicts_h.data))
        writes_after = named(m, Mux(discard_after, 0, Mux(verdict_after, verdict.write,
                                                      after(writes))),
                            "writes_after")
        m.d.sync += [
            head_judged.eq(after(judged) | verdict_after | discard_after),
            head_writes.eq(writes_after),
            head_verdict.eq(verdict_after),
            head_fits.eq(fits),
            head_slot_fits.eq(after(fit)),
            head_command.addr.eq(Mux(verdict_after, verdict.addr[:self.addr_width],
                                     judgement.addr)),
            head_command.bytes.eq(Mux(writes_after, Mux(verdict_after, verdict.bytes,
                                                        judgement.bytes), 0)),
            head_command.src_beat.eq(place.start),
            head_command.src_offset.eq(Mux(verdict_after, verdict.offset, judgement.offset)),
            head_command.release_beats.eq(place.beats),
            head_bursts.eq(Mux(writes_after, Mux(verdict_after, verdicts_w.data.bursts,
                                                 judgement.bursts), 0)),
        ]
        head_plus2 = lookahead_sum(m, head_plus1, 0, 1, name="head_plus2")[:RESPONSE_SEQ_BITS]
        with m.If(dispatch):
            m.d.sync += [head.eq(head_plus1), head_plus1.eq(head_plus2)]
            with m.If(head_slot == slots - 1):
                m.d.sync += head_upper_plus1.eq(head_upper_plus1 + 1)
        # Counted a cycle after the command is taken: a registered event, then the sum.
        discarded = Signal()
        m.d.sync += [
            discarded.eq(dispatch & ~(head_writes & head_fit)),
            self.responses_discarded.eq(lookahead_sum(m, self.responses_discarded, discarded,
                                                      name="responses_discarded_next")),
        ]
        for k in range(slots):
            with m.If(ended & (ended_slot == k)):
                m.d.sync += awaiting[k].eq(1)
            with m.If(dispatch & (head_slot == k)):
                m.d.sync += judged[k].eq(0)
            with m.If(verdict_valid & (verdict_slot == k)):
                m.d.sync += [awaiting[k].eq(0), judged[k].eq(1), writes[k].eq(verdict.write),
                             fit[k].eq(fits)]
            with m.If(discard_valid & (discard_slot == k)):
                m.d.sync += [awaiting[k].eq(0), judged[k].eq(1), writes[k].eq(0)]

        # --- Landing: a command is done once released and its B responses are all in ---
        axi = self.axi
        unanswered = Signal(range(2 * slots + 1))   # AW bursts accepted, B not yet come
        answers = Signal(range(2 * slots + 1))      # B responses not yet matched to commands
        releases = Signal(range(slots + 1))         # releases not yet matched to commands
        answer = named(m, axi.bvalid & axi.bready & (unanswered != 0), "answer")
        pop = named(m, landing.r_rdy & (releases != 0) & (answers >= landing.r_data), "pop")
        m.d.comb += landing.r_en.eq(pop)
        m.d.sync += unanswered.eq(unanswered + (axi.awvalid & axi.awready) - answer)
        # The B responses left with and without the oldest command's, summed beforehand.
        answers_popped = named(m, answers - landing.r_data, "answers_popped")
        with m.If(pop):
            m.d.sync += answers.eq(answers_popped + answer)
        with m.Else():
            m.d.sync += answers.eq(answers + answer)
        with m.If(dma.release.valid & ~pop):
            m.d.sync += releases.eq(releases + 1)
        with m.Elif(pop & ~dma.release.valid):
            m.d.sync += releases.eq(releases - 1)
        landed_next = lookahead_sum(m, landed, 0, 1, name="landed_next")[:RESPONSE_SEQ_BITS]
        with m.If(pop):
            m.d.sync += landed.eq(landed_next)
        with m.If(ended & ~pop):
            m.d.sync += unlanded.eq(unlanded + 1)
        with m.Elif(pop & ~ended):
            m.d.sync += unlanded.eq(unlanded - 1)
        return m
