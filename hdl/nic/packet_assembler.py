from amaranth import Array, C, Cat, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.arith import lookahead_sum
from hdl.crc.algorithms import ICRC
from hdl.crc.icrc_engine import variant_masks
from hdl.crc.matrices import advance_columns, data_matrix, rows, xor_nodes, xor_tree
from hdl.ib.headers import LRH, from_wire
from hdl.link.signatures import BeatLayout, vl_index
from hdl.nic.signatures import (MAX_NIC_HEADER_BYTES, DESCRIPTOR_INLINE_BYTES, PacketDescriptorLayout,
                                PayloadSource, RBeatLayout)

__all__ = ["PacketAssembler", "MAX_DMA_BEATS", "MIN_HEADER_BYTES", "expected_dma_beats"]

WIDTH = 64                  # bytes per beat, fixed in this version
MAX_PAYLOAD_BYTES = 4096
MIN_HEADER_BYTES = 20       # LRH + BTH
# Source beats held in registers after the FIFO: an output beat reads two of them, and a
# third keeps the next two ready when a packet's end beat drops two at once (a packet whose
# first beat took none, so its window got one ahead).
WINDOW_BEATS = 3
MAX_DMA_BEATS = (MAX_PAYLOAD_BYTES + WIDTH - 1 + WIDTH - 1) // WIDTH   # 4096 B from offset 63: 65


def expected_dma_beats(offset, payload_bytes):
    """Payload-buffer beats a DMA payload of ``payload_bytes`` from byte ``offset`` takes."""
    return 0 if payload_bytes == 0 else (offset + payload_bytes + WIDTH - 1) // WIDTH


class PacketAssembler(wiring.Component):
    """Turns packet descriptors and their payload beats into packets on the VL streams.

    Payload beats (AXI R, id 1) go into a FIFO of ``payload_buffer_beats`` beats (the
    room the executor reserves), then into a window of three beat registers: each output
    beat is cut from two consecutive source beats. ``payload_freed`` strobes in the cycle after a
    beat leaves the FIFO for the window (a register, so that the executor's reservation
    logic starts from a flip-flop), at most one per cycle, so the executor's reservation
    never exceeds the FIFO; the window's beats are extra room.

    A packet starts once every one of its ``dma_beats`` beats is buffered, then leaves at
    one beat per cycle (only ``data_out`` backpressure stalls it). With the payload source
    byte ``offset`` and the header length ``H``, packet byte ``j >= H`` is source byte
    ``j + offset - H``: each output beat is the window (two source beats) shifted right by
    ``(offset - H) mod 64`` bytes. When ``offset < H`` the first output beat needs only
    source beat 0 (the window's high half), and the window moves on one beat per output
    beat after it; when ``offset >= H`` it moves on one beat per output beat from the
    first. On the end beat, whatever is left of the packet's source beats (at most two)
    is dropped from the window at once, so the next packet can start in the next cycle.
    A packet never waits for the window while its payload is buffered unless a packet
    took more source beats than it sent output beats (``offset >= H`` and the shift
    pulled the payload's tail into an earlier beat): then the next packet may start one
    cycle late if it needs two window beats; the payload input, one beat per cycle,
    could not keep up with such a mix anyway.

    After the payload come zero bytes to a multiple of 4 (BTH.PadCnt, from the header,
    already says how many) and the ICRC (least-significant byte first), which lands in
    one more beat when the padded body fills its last beat. Inline payloads are the
    descriptor's ``inline_data`` taken as source beat 0 at offset 0.

    Bad input:

    * A descriptor that cannot be assembled is dropped, counted in ``bad_descriptors``,
      and for ``source == DMA`` its ``dma_beats`` payload beats are taken from the buffer
      and discarded (the executor reserved them): ``vl >= num_vls``, ``header_bytes`` not
      a multiple of 4 in 20..64, ``payload_bytes > 4096``, INLINE with more than 64
      bytes, NONE with a payload, DMA with ``dma_beats`` not ``ceil((offset +
      payload_bytes) / 64)`` (0 for an empty payload), or an unknown ``source``.
    * A payload beat with RRESP not OKAY is counted in ``payload_read_errors``; the
      packet it belongs to leaves with ``end_bad`` on its end beat.
    * Payload beats beyond the buffer's room (the executor over-reserving) are
      backpressured: ``payload.ready`` is low while the FIFO is full.

    The header goes out as given (LRH.VL included: the descriptor's ``vl`` only picks the
    stream). The AXI ``last`` flag of payload beats is not used: ``dma_beats`` counts
    them. A dropped DMA descriptor's beats leave the window at one per cycle.

    Output stages: each beat, as cut from the window (header, shifted payload, zero pad),
    goes through two registers on its way to ``data_out``. The CRC stage feeds its beat
    (zeros past the body, the ICRC's variant bits as ones) through the full-width data
    matrix into the CRC state; after an end beat of ``k`` body bytes that state is
    ``A^(8·(64-k))`` times the true CRC register, so the output stage multiplies it by the
    inverse, a matrix registered with the beat, and puts the ICRC in its word of the end
    beat (or of the beat after, when the body fills its last beat). The stages move
    together while the output stage is empty or its VL stream takes its beat: a stall on
    one VL holds the beats behind it, as one stream for both VLs did before.

    Latency: a descriptor accepted in cycle t whose payload is already buffered has its
    first beat on ``data_out`` in t + 3 (t + 1 before the output stages); the descriptor
    of the next packet is accepted in the cycle the previous packet's end beat enters the
    CRC stage, so packets follow back to back. The counters count a cycle after their
    event.

    Depth (docs/fpga.md): 6 LUT levels alone. Every next state of the window, the buffer
    count and the packet's counters is chosen by ``sent`` between two outcomes computed
    from registers (the pops if a beat is sent and if not); the end flag and the payload
    lanes' bounds are registered a beat ahead.

    Ports
    -----
    packet : In(stream.Signature(PacketDescriptorLayout()))
    payload : In(stream.Signature(RBeatLayout()))
    payload_freed : Out(1)
    data_out : Out(stream.Signature(BeatLayout(64))).array(num_vls)
    payload_read_errors : Out(32)
    bad_descriptors : Out(32)
    """
    def __init__(self, *, num_vls=2, payload_buffer_beats=512):
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        if not isinstance(payload_buffer_beats, int) or payload_buffer_beats < MAX_DMA_BEATS:
            raise ValueError(f"Payload buffer must hold at least one largest packet's "
                             f"{MAX_DMA_BEATS} beats, not {payload_buffer_beats!r}")
        self.num_vls = num_vls
        self.payload_buffer_beats = payload_buffer_beats
        super().__init__({
            "packet": In(stream.Signature(PacketDescriptorLayout())),
            "payload": In(stream.Signature(RBeatLayout(WIDTH))),
            "payload_freed": Out(1),
            "data_out": Out(stream.Signature(BeatLayout(WIDTH))).array(num_vls),
            "payload_read_errors": Out(32),
            "bad_descriptors": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        beat_bits = 8 * WIDTH

        # --- payload buffer: FIFO, then the window ---
        m.submodules.buffer = buffer = fifo.SyncFIFOBuffered(width=beat_bits + 1,
                                                              depth=self.payload_buffer_beats)
        accepted_in = self.payload.valid & self.payload.ready
        read_error = self.payload.payload.resp != 0
        m.d.comb += [
            buffer.w_data.eq(Cat(self.payload.payload.data, read_error)),
            buffer.w_en.eq(self.payload.valid),
            self.payload.ready.eq(buffer.w_rdy),
        ]
        # The counters count registered events, a cycle after them: a 32-bit sum is deep
        # enough on its own.
        read_error_event = Signal()
        bad_descriptor_event = Signal()
        m.d.sync += [
            read_error_event.eq(accepted_in & read_error),
            self.payload_read_errors.eq(lookahead_sum(m, self.payload_read_errors, read_error_event,
                                                      name="payload_read_errors_next")),
            self.bad_descriptors.eq(lookahead_sum(m, self.bad_descriptors, bad_descriptor_event,
                                                  name="bad_descriptors_next")),
        ]

        # --- the packet being sent ---
        loaded = Signal()           # cur_* hold a good descriptor, sent or waiting for payload
        first = Signal()            # the beat on offer is the start beat
        cur_vl = Signal(vl_index(self.num_vls))
        cur_header = Signal(8 * MAX_NIC_HEADER_BYTES)
        cur_header_bytes = Signal(range(MAX_NIC_HEADER_BYTES + 1))
        cur_inline = Signal()
        cur_inline_data = Signal(8 * DESCRIPTOR_INLINE_BYTES)
        cur_shift = Signal(6)       # (source offset - header_bytes) mod 64
        cur_late = Signal()         # source offset < header_bytes: beat 0 uses one source beat
        cur_need = Signal(range(3)) # window beats needed to start
        dma_left = Signal(range(MAX_DMA_BEATS + 1))  # source beats of this packet still in the buffer
        payload_left = Signal(range(-WIDTH, MAX_NIC_HEADER_BYTES + MAX_PAYLOAD_BYTES + 1))
        payload_fills = Signal()    # payload_left >= 64: the beat is payload up to its last lane
        payload_done = Signal()     # payload_left <= 0: no payload lane in the beat
        body_left = Signal(range(MAX_NIC_HEADER_BYTES + MAX_PAYLOAD_BYTES + 4))  # LRH .. pad, from this beat on
        is_end = Signal()           # body_left <= 60: the ICRC fits in this beat
        bad = Signal()              # a source beat of this packet had a read error
        draining = Signal()
        drain_left = Signal(range(MAX_DMA_BEATS + 1))

        window = [Signal(beat_bits + 1, name=f"window{i}") for i in range(WINDOW_BEATS)]
        window_count = Signal(range(WINDOW_BEATS + 1))
        # Beats written more than a cycle ago and not yet popped from the window: a FIFO
        # entry becomes readable two cycles after its write, so counting it only then
        # guarantees a started packet finds each of its beats in time.
        buffered = Signal(range(self.payload_buffer_beats + WINDOW_BEATS + 2))
        wrote = Signal()
        m.d.sync += wrote.eq(accepted_in)

        can_start = Signal()
        m.d.comb += can_start.eq((buffered >= dma_left) & (window_count >= cur_need))
        offered = Signal()          # a beat of the current packet is on offer to the CRC stage
        m.d.comb += offered.eq(loaded & (~first | can_start))
        out_ready = Signal()        # the output stage's VL stream takes its beat
        beat_ready = Signal()       # the CRC stage takes the beat on offer
        sent = Signal()
        m.d.comb += sent.eq(offered & beat_ready)
        finishing = Signal()
        m.d.comb += finishing.eq(sent & is_end)

        # Source beats the window drops: one per output beat while this packet has some,
        # except on a late packet's first beat; all that are left on the end beat; one per
        # cycle while draining (never while a packet is loaded). Every next state is chosen
        # by `sent` between the outcomes of the two pop counts, both from registers.
        pops_if_sent = Signal(range(3))
        pops_if_idle = Signal(range(3))
        m.d.comb += [
            pops_if_sent.eq(Mux(is_end, dma_left, (dma_left != 0) & (~first | ~cur_late))),
            pops_if_idle.eq(draining & (window_count != 0)),
        ]

        def by_pops(outcome):
            return Mux(sent, Array(outcome(p) for p in range(3))[pops_if_sent],
                       Array(outcome(p) for p in range(3))[pops_if_idle])

        def room(p):        # the window has room for a refill after p pops
            return (window_count < WINDOW_BEATS) | (p != 0)

        refill = Signal()
        m.d.comb += [
            refill.eq(buffer.r_rdy & by_pops(room)),
            buffer.r_en.eq(refill),
        ]
        m.d.sync += [
            self.payload_freed.eq(refill),
            buffered.eq(by_pops(lambda p: buffered + wrote - p)),
            window_count.eq(by_pops(lambda p: window_count - p + (buffer.r_rdy & room(p)))),
        ]
        for index, entry in enumerate(window):
            def moved(p, index=index, entry=entry):
                at = index + p      # the window position that moves here
                if at < WINDOW_BEATS:
                    return Mux(at < window_count, window[at],
                               Mux(at == window_count, buffer.r_data, entry))
                # Past the window (window_count is at most WINDOW_BEATS): only the refill,
                # into a full window's next position. No compare the count's range decides.
                if at == WINDOW_BEATS:
                    return Mux(window_count == WINDOW_BEATS, buffer.r_data, entry)
                return entry
            m.d.sync += entry.eq(by_pops(moved))

        popped_bad = Signal()       # a source beat the sent beat pops had a read error
        m.d.comb += popped_bad.eq(((pops_if_sent != 0) & window[0][-1])
                                  | ((pops_if_sent == 2) & window[1][-1]))

        with m.If(pops_if_idle != 0):
            m.d.sync += drain_left.eq(drain_left - 1)
            with m.If(drain_left == 1):
                m.d.sync += draining.eq(0)

        with m.If(sent):
            m.d.sync += [
                first.eq(0),
                payload_left.eq(payload_left - WIDTH),
                payload_fills.eq(payload_left >= 2 * WIDTH),
                payload_done.eq(payload_left <= WIDTH),
                body_left.eq(body_left - WIDTH),
                is_end.eq(body_left <= 2 * WIDTH - 4),
                dma_left.eq(Array([dma_left, dma_left - 1, dma_left - 2])[pops_if_sent]),
                bad.eq(bad | popped_bad),
            ]
        with m.If(finishing):
            m.d.sync += loaded.eq(0)

        # --- taking the next descriptor ---
        desc = self.packet.payload
        m.d.comb += self.packet.ready.eq((~loaded & ~draining) | finishing)
        source = desc.source
        is_dma = source == PayloadSource.DMA
        source_offset = Mux(is_dma, desc.offset, 0)
        good = Signal()
        m.d.comb += good.eq(
            (desc.vl < self.num_vls)
            & (desc.header_bytes[:2] == 0)
            & (desc.header_bytes >= MIN_HEADER_BYTES) & (desc.header_bytes <= MAX_NIC_HEADER_BYTES)
            & (desc.payload_bytes <= MAX_PAYLOAD_BYTES)
            & ((source == PayloadSource.NONE) & (desc.payload_bytes == 0)
               | (source == PayloadSource.INLINE) & (desc.payload_bytes <= DESCRIPTOR_INLINE_BYTES)
               | is_dma & (desc.dma_beats == Mux(desc.payload_bytes == 0, 0,
                                                 (desc.offset + desc.payload_bytes + WIDTH - 1) >> exact_log2(WIDTH)))))
        accept = Signal()
        m.d.comb += accept.eq(self.packet.valid & self.packet.ready)
        m.d.sync += bad_descriptor_event.eq(accept & ~good)
        # A dropped descriptor's fields are taken too: `loaded` stays low, so they are unused.
        with m.If(accept):
            late = source_offset < desc.header_bytes
            # header + payload bytes against 64 and 60, from the payload's low six bits
            low_sum = desc.payload_bytes[:6] + desc.header_bytes
            payload_high = desc.payload_bytes[6:] != 0
            m.d.sync += [
                loaded.eq(good),
                first.eq(1),
                cur_vl.eq(desc.vl),
                cur_header.eq(desc.header),
                cur_header_bytes.eq(desc.header_bytes),
                cur_inline.eq(source == PayloadSource.INLINE),
                cur_inline_data.eq(desc.inline_data),
                cur_shift.eq(source_offset - desc.header_bytes),
                cur_late.eq(late),
                cur_need.eq(Mux(is_dma & (desc.dma_beats != 0),
                                Mux(late | (desc.dma_beats == 1), 1, 2), 0)),
                dma_left.eq(Mux(is_dma, desc.dma_beats, 0)),
                payload_left.eq(desc.header_bytes + desc.payload_bytes),
                payload_fills.eq(payload_high | (low_sum >= WIDTH)),
                payload_done.eq(0),     # header_bytes >= 20
                body_left.eq((desc.header_bytes + desc.payload_bytes + 3) & ~3),
                is_end.eq(~payload_high & (low_sum <= WIDTH - 4)),
                bad.eq(0),
            ]
            with m.If(~good & is_dma & (desc.dma_beats != 0)):
                m.d.sync += [draining.eq(1), drain_left.eq(desc.dma_beats)]

        # --- the beat on offer ---
        low = Mux(cur_inline, cur_inline_data, window[0][:beat_bits])
        high = Mux(first & cur_late, low, window[1][:beat_bits])
        shifted = Signal(beat_bits)
        m.d.comb += shifted.eq(Cat(low, high).bit_select(Cat(C(0, 3), cur_shift), beat_bits))

        header_end = Signal(range(WIDTH + 1))     # lanes below are header
        payload_end = Signal(range(WIDTH + 1))    # lanes below (and not header) are payload
        m.d.comb += [
            header_end.eq(Mux(first, cur_header_bytes, 0)),
            payload_end.eq(Mux(payload_fills, WIDTH, Mux(payload_done, 0, payload_left[:6]))),
        ]
        ones = Const((1 << WIDTH) - 1, WIDTH)
        header_lanes = ~(ones << header_end)[:WIDTH]
        payload_lanes = (ones << header_end)[:WIDTH] & ~(ones << payload_end)[:WIDTH]
        header_beat = Cat(cur_header, C(0, beat_bits - len(cur_header)))
        body = Signal(beat_bits)
        m.d.comb += body.eq(Cat(
            Mux(header_lanes[lane], header_beat.word_select(lane, 8),
                Mux(payload_lanes[lane], shifted.word_select(lane, 8), 0))
            for lane in range(WIDTH)))

        # The packet's ICRC variant bits (LRH.VL, BTH.resv8a, GRH fields), all in the start beat.
        variant = Signal(beat_bits)
        lnh = from_wire(LRH, cur_header[:8 * LRH.size_bytes]).lnh
        with m.If(first):
            with m.Switch(lnh):
                for kind, packet_mask in variant_masks().items():
                    with m.Default() if kind is None else m.Case(kind):
                        m.d.comb += variant.eq(packet_mask)

        # --- two output stages: the CRC stage, then the beat on data_out with its ICRC ---
        # The CRC stage feeds its beat, zeros past the body, through the full-width data
        # matrix: after an end beat of k body bytes the state holds A^(8·(64-k)) times the
        # true CRC register, and the output stage multiplies it by the registered inverse.
        # What a stage holds of its beat; the ICRC goes into word `icrc_lane` (one-hot).
        stage_layout = data.StructLayout({
            "valid": 1, "data": beat_bits, "start": 1, "end": 1, "end_bad": 1,
            "count": range(WIDTH + 1), "icrc_lane": WIDTH // 4, "vl": vl_index(self.num_vls)})
        crc_beat, out_beat = Signal(stage_layout), Signal(stage_layout)
        crc_variant = Signal(beat_bits)
        crc_has_body = Signal()     # the beat carries body bytes (not the spilled ICRC's beat)
        crc_body_words = Signal(range(WIDTH // 4 + 1))  # 4-byte words of body in the beat
        crc_state = Signal(ICRC.crc_width, init=ICRC.initial_crc)
        crc_fix = Signal(ICRC.crc_width ** 2)   # row-major: bit crc_width·row + column

        for vl, port in enumerate(self.data_out):
            m.d.comb += port.valid.eq(out_beat.valid & (out_beat.vl == vl))
            with m.If(out_beat.vl == vl):
                m.d.comb += out_ready.eq(port.ready)
        out_moves = Signal()        # the output stage takes the CRC stage's beat (or nothing)
        crc_moves = Signal()        # the CRC stage takes the beat on offer (or nothing)
        m.d.comb += [
            out_moves.eq(~out_beat.valid | out_ready),
            crc_moves.eq(~crc_beat.valid | out_moves),
            beat_ready.eq(crc_moves),
        ]

        body_ends = Signal()
        m.d.comb += body_ends.eq((body_left != 0) & (body_left <= WIDTH))
        with m.If(crc_moves):
            m.d.sync += [
                crc_beat.valid.eq(offered),
                crc_beat.data.eq(body),
                crc_beat.start.eq(first),
                crc_beat.end.eq(is_end),
                crc_beat.end_bad.eq(is_end & (bad | popped_bad)),
                crc_beat.count.eq(Mux(is_end, body_left + 4, WIDTH)),
                crc_beat.icrc_lane.eq(Mux(is_end, 1 << body_left[2:6], 0)),
                crc_beat.vl.eq(cur_vl),
                crc_variant.eq(variant),
                crc_has_body.eq(body_left != 0),
                crc_body_words.eq(Mux(body_ends, body_left[2:], WIDTH // 4)),
            ]

        crc_width = ICRC.crc_width
        following = Signal(crc_width)
        data_bits = crc_beat.data | crc_variant
        full_beat = rows(advance_columns(ICRC, 8 * WIDTH), crc_width)
        for row, indices in enumerate(data_matrix(ICRC, WIDTH)):
            name = f"crc_following{row}"
            data_terms = xor_nodes(m, [data_bits[index] for index in indices], 6, name=f"{name}_data")
            # the start beat's source is the initial value, all ones
            carried = xor_nodes(m, [crc_state[column] | crc_beat.start for column in full_beat[row]], 3,
                                name=f"{name}_state")
            m.d.comb += following[row].eq(xor_tree(m, data_terms + carried, name=name))
        with m.If(out_moves):
            m.d.sync += out_beat.eq(crc_beat)
            with m.If(crc_beat.valid & crc_has_body):
                m.d.sync += [
                    crc_state.eq(following),
                    crc_fix.eq(Array(_unpad_matrices())[crc_body_words]),
                ]

        register = Signal(crc_width)
        for row in range(crc_width):
            products = xor_nodes(m, [crc_fix[crc_width * row + column] & crc_state[column]
                                     for column in range(crc_width)], 3, name=f"icrc{row}_state")
            m.d.comb += register[row].eq(xor_tree(m, products, name=f"icrc{row}"))
        icrc = Signal(crc_width)
        m.d.comb += icrc.eq((register[::-1] if ICRC.reflect_output else register) ^ ICRC.xor_output)
        beat_data = Cat(Mux(out_beat.icrc_lane[word], icrc, out_beat.data.word_select(word, 32))
                        for word in range(WIDTH // 4))

        for port in self.data_out:
            m.d.comb += [
                port.payload.data.eq(beat_data),
                port.payload.start.eq(out_beat.start),
                port.payload.end.eq(out_beat.end),
                port.payload.count.eq(out_beat.count),
                port.payload.end_bad.eq(out_beat.end_bad),
            ]
        return m


def _unpad_matrices():
    """``A^-(8·(64 - 4·n))`` by ``n``, the 4-byte words of body in an end beat (index 0
    unused): what undoes the zero bytes the full-width matrix took after the body."""
    crc_width = ICRC.crc_width
    matrices = [C(0, crc_width ** 2)]
    for words in range(1, WIDTH // 4 + 1):
        inverse = _inverse(advance_columns(ICRC, 8 * (WIDTH - 4 * words)), crc_width)
        matrices.append(C(sum((inverse[column] >> row & 1) << (crc_width * row + column)
                              for row in range(crc_width) for column in range(crc_width)),
                          crc_width ** 2))
    return matrices


def _inverse(columns, size):
    """The columns of the inverse of a GF(2) matrix given by its columns (Gauss-Jordan)."""
    rows_ = [sum((columns[column] >> row & 1) << column for column in range(size)) | 1 << (size + row)
             for row in range(size)]
    for pivot in range(size):
        found = next(row for row in range(pivot, size) if rows_[row] >> pivot & 1)
        rows_[pivot], rows_[found] = rows_[found], rows_[pivot]
        for row in range(size):
            if row != pivot and rows_[row] >> pivot & 1:
                rows_[row] ^= rows_[pivot]
    inverse_rows = [row >> size for row in rows_]
    return [sum((inverse_rows[row] >> column & 1) << row for row in range(size))
            for column in range(size)]
