from amaranth import *
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.arith import lookahead_sum
from .signatures import (
    AXI_ID_BITS, DMA_WRITE_ID, MAX_PACKET_BEATS, AxiWriteSignature, ContextReadSignature,
    DmaWriteLayout,
)

__all__ = ["DmaWriter", "command_bursts"]

BEAT_BYTES = 64
PAGE_BEATS = 4096 // BEAT_BYTES     # an AXI burst may not cross 4 KiB
MAX_WRITE_BYTES = 4096
MAX_BEATS = (BEAT_BYTES - 1 + MAX_WRITE_BYTES + BEAT_BYTES - 1) // BEAT_BYTES   # 65
QUEUE_DEPTH = 4                     # commands decoded ahead of each of the three engines
DATA_DEPTH = 4                      # source beats read ahead of the realigner
AW_AHEAD = 4                        # bursts AW may present before their first W beat
MAX_OUTSTANDING = 255               # bursts presented on AW and not yet answered on B

AXI_BURST_INCR = 0b01
AXI_RESP_OKAY = 0b00


def command_bursts(m, addr, nbytes, *, name="bursts"):
    """The AW bursts (and so B responses) a command of ``nbytes`` bytes to ``addr`` gives:
    none if it writes nothing (0 or more than 4096 bytes), two if it crosses a 4 KiB line,
    else one. For a block that must know when a command's writes have all been answered.
    Combinational logic in ``m``, outside any ``m.If`` (:func:`lookahead_sum`)."""
    writes = (nbytes != 0) & (nbytes <= MAX_WRITE_BYTES)
    # addr[:12] + nbytes > 4096 is the carry out of addr[:12] + nbytes + (2**14 - 4097):
    # a carry-save layer (a constant third operand), then one lookahead sum.
    line, nbytes = addr[:12], Value.cast(nbytes)[:14]
    bias = C((1 << 14) - (MAX_WRITE_BYTES + 1), 14)
    partial = Signal(14, name=f"{name}_s")
    carries = Signal(14, name=f"{name}_c")
    m.d.comb += [partial.eq(line ^ nbytes ^ bias),
                 carries.eq((line & nbytes) | (line & bias) | (nbytes & bias))]
    crosses = lookahead_sum(m, partial, Cat(C(0, 1), carries[:13]), name=name)[14]
    return Mux(writes, 1 + crosses, 0)


class _ReadJob(data.StructLayout):
    def __init__(self, beat_bits):
        super().__init__({
            "src_beat": beat_bits,
            "beats": range(MAX_BEATS + 1),
            "writes": 1,                            # 0: release only
            "release": range(MAX_PACKET_BEATS + 1),
        })


# Beat counts are kept less one, so that the decode needs no rounding up and the last
# beat is a count of 0.
class _BurstJob(data.StructLayout):
    def __init__(self, addr_width):
        super().__init__({
            "beat_addr": addr_width - 6,
            "first_less1": range(PAGE_BEATS),       # beats of the burst before the 4 KiB line
            "crosses": 1,                           # a second burst from the next line
            "second_less1": range(PAGE_BEATS),
            "next_line": addr_width - 12,           # the line after the first burst's
        })


class _WriteJob(data.StructLayout):
    def __init__(self):
        super().__init__({
            "dst_less1": range(MAX_BEATS),
            "first_less1": range(PAGE_BEATS),
            "src_beats": range(MAX_BEATS + 1),
            "src_less1": range(MAX_BEATS),
            "shift": 6,                             # (src_offset - dest offset) mod 64
            "prime": 1,                             # src_offset >= dest offset: one source beat leads
            "head": 6,                              # first written byte lane
            "tail": 6,                              # last written byte lane
            "bytes": range(MAX_WRITE_BYTES + 1),
        })


class DmaWriter(wiring.Component):
    """Writes payload bytes from a receive buffer to memory (AXI4, AWID ``awid``),
    realigned to any byte address, and frees the buffer in order.

    Three engines work off one command each, decoded at acceptance into three queues: the
    reader walks the command's source beats through ``source`` into a small queue and
    releases the command's beats once the last one is read (the payload then lives in the
    queue, so the buffer need not wait for the write response); the AW engine presents the
    command's bursts (split at 4 KiB, so at most two), up to ``AW_AHEAD`` bursts before
    their data; the realigner joins consecutive source beats through a funnel shifter into
    destination beats with exact strobes, one W beat per cycle. A destination beat ``k``
    takes bytes of source beats ``k`` and ``k + 1`` when the payload sits later in its
    source beat than in its destination beat (``prime``: the first source beat is loaded
    before any output, in the cycle of the previous command's last W beat when the queue
    holds it), else of ``k - 1`` and ``k``. So commands follow each other without a gap,
    and the only limit is the one read port: a command takes at most one source beat more
    than it has W beats. A burst's W beats start once its AW is presented (not necessarily
    accepted: AXI lets a slave wait for W before AWREADY).

    ``idle`` covers commands from the cycle after their handshake (not one still offered
    on ``command``) until their release and the B of their last burst.
    ``dma_bytes_written`` counts a command's bytes in the cycle after its last W beat is
    taken, ``dma_write_errors`` a B response other than OKAY in the cycle after it.

    A command with ``bytes`` > 4096 writes nothing and only releases its beats, like
    ``bytes`` = 0; ``release_beats`` is passed on as given. ``bid`` is not looked at (the
    write arbiter routes B by ID); a B response while no burst is outstanding is accepted
    and otherwise ignored, except that a non-OKAY one still counts in ``dma_write_errors``.

    Parameters
    ----------
    buffer_beats : int
        Beats of the receive buffer ring (power of two, 64 .. 4096).
    addr_width : int
        AXI address bits, 12 .. 64.
    awid : int
        AXI ID of every burst: ``DMA_WRITE_ID`` for the responder's payload,
        ``READ_DATA_ID`` in the requester's :class:`ResponseWriter`.
    """
    def __init__(self, *, buffer_beats=256, addr_width=64, awid=DMA_WRITE_ID):
        if (not isinstance(buffer_beats, int) or not 64 <= buffer_beats <= 4096
                or buffer_beats & (buffer_beats - 1)):
            raise ValueError(f"Buffer beats must be a power of two from 64 to 4096, not {buffer_beats!r}")
        if not isinstance(addr_width, int) or not 12 <= addr_width <= 64:
            raise ValueError(f"AXI address width must be 12 to 64 bits, not {addr_width!r}")
        if not isinstance(awid, int) or not 0 <= awid < 1 << AXI_ID_BITS:
            raise ValueError(f"AWID must be an integer from 0 to {(1 << AXI_ID_BITS) - 1}, not {awid!r}")
        self.buffer_beats = buffer_beats
        self.addr_width = addr_width
        self.awid = awid
        super().__init__({
            "command": In(stream.Signature(DmaWriteLayout())),
            "source": Out(ContextReadSignature(buffer_beats, unsigned(8 * BEAT_BYTES))),
            "release": Out(stream.Signature(range(MAX_PACKET_BEATS + 1), always_ready=True)),
            "axi": Out(AxiWriteSignature(addr_width, BEAT_BYTES)),
            "idle": Out(1),
            "dma_bytes_written": Out(32),
            "dma_write_errors": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        axi = self.axi
        beat_bits = exact_log2(self.buffer_beats)
        read_layout, burst_layout, write_layout = (
            _ReadJob(beat_bits), _BurstJob(self.addr_width), _WriteJob())

        m.submodules.read_jobs = read_jobs = fifo.SyncFIFO(width=read_layout.size, depth=QUEUE_DEPTH)
        m.submodules.burst_jobs = burst_jobs = fifo.SyncFIFO(width=burst_layout.size, depth=QUEUE_DEPTH)
        m.submodules.write_jobs = write_jobs = fifo.SyncFIFO(width=write_layout.size, depth=QUEUE_DEPTH)
        # Source beats read ahead, in order. The realigner sees the first two: the second
        # lets a command that starts with a source beat of its own load it while the
        # previous command takes its last beat.
        m.submodules.beats = beats = memory.Memory(shape=8 * BEAT_BYTES, depth=DATA_DEPTH, init=[])
        beats_w = beats.write_port()
        beats_r0 = beats.read_port(domain="comb")
        beats_r1 = beats.read_port(domain="comb")
        beats_level = Signal(range(DATA_DEPTH + 1))
        beats_pop = Signal(2)
        m.d.comb += [beats_r1.addr.eq(beats_r0.addr + 1), beats_w.data.eq(self.source.data)]
        m.d.sync += [
            beats_w.addr.eq(beats_w.addr + beats_w.en),
            beats_r0.addr.eq(beats_r0.addr + beats_pop),
            beats_level.eq(beats_level + beats_w.en - beats_pop),
        ]
        beat0, beat1 = beats_r0.data, beats_r1.data

        # --- Command decode ----------------------------------------------------------------
        # The counts below hold for the commands that write (1 .. 4096 bytes); only those
        # reach the burst and write queues, and the reader looks at ``writes`` first.
        cmd = self.command.payload
        writes = (cmd.bytes != 0) & (cmd.bytes <= MAX_WRITE_BYTES)
        head = cmd.addr[:6]
        dst_less1 = Signal(range(MAX_BEATS))
        src_beats = Signal(range(MAX_BEATS + 1))
        src_less1 = Signal(range(MAX_BEATS))
        last_in_line = Signal(13)       # the last byte's offset from the first byte's 4 KiB line
        crosses = last_in_line[12]
        m.d.comb += [
            dst_less1.eq((head + cmd.bytes - 1) >> 6),
            src_beats.eq((cmd.src_offset + cmd.bytes + BEAT_BYTES - 1) >> 6),
            src_less1.eq((cmd.src_offset + cmd.bytes - 1) >> 6),
            last_in_line.eq(cmd.addr[:12] + cmd.bytes - 1),
        ]
        next_line = lookahead_sum(m, cmd.addr[12:self.addr_width], 1, name="next_line")
        read_job = data.View(read_layout, read_jobs.w_data)
        burst_job = data.View(burst_layout, burst_jobs.w_data)
        write_job = data.View(write_layout, write_jobs.w_data)
        m.d.comb += [
            read_job.src_beat.eq(cmd.src_beat[:beat_bits]),
            read_job.beats.eq(src_beats),
            read_job.writes.eq(writes),
            read_job.release.eq(cmd.release_beats),
            burst_job.beat_addr.eq(cmd.addr[6:self.addr_width]),
            # A crossing command's first burst ends at the line: 64 - addr[6:12] beats.
            burst_job.first_less1.eq(Mux(crosses, ~cmd.addr[6:12], dst_less1)),
            burst_job.crosses.eq(crosses),
            burst_job.second_less1.eq(last_in_line[6:12]),
            burst_job.next_line.eq(next_line),
            write_job.dst_less1.eq(dst_less1),
            write_job.first_less1.eq(burst_job.first_less1),
            write_job.src_beats.eq(src_beats),
            write_job.src_less1.eq(src_less1),
            write_job.shift.eq(cmd.src_offset - head),
            write_job.prime.eq(cmd.src_offset >= head),
            write_job.head.eq(head),
            write_job.tail.eq(last_in_line[:6]),
            write_job.bytes.eq(cmd.bytes),
        ]
        # Ready does not look at the payload: every queue must have room.
        m.d.comb += [
            self.command.ready.eq(read_jobs.w_rdy & burst_jobs.w_rdy & write_jobs.w_rdy),
            read_jobs.w_en.eq(self.command.valid & self.command.ready),
            burst_jobs.w_en.eq(read_jobs.w_en & writes),
            write_jobs.w_en.eq(read_jobs.w_en & writes),
        ]

        # --- Reader ------------------------------------------------------------------------
        rd_active = Signal()
        rd_addr = Signal(beat_bits)
        rd_left = Signal(range(MAX_BEATS + 1))
        rd_last = Signal()          # rd_left == 1
        rd_release = Signal(range(MAX_PACKET_BEATS + 1))
        in_flight = Signal()        # a read issued last cycle: its data arrives now
        m.d.comb += [
            self.source.addr.eq(rd_addr),
            beats_w.en.eq(in_flight),
        ]
        # The read port cannot be held: read only with room for the data that is coming.
        issue = Signal()
        m.d.comb += issue.eq(rd_active & (beats_level + in_flight < DATA_DEPTH))
        last_read = issue & rd_last
        m.d.sync += [in_flight.eq(issue), self.release.valid.eq(0)]
        with m.If(issue):
            m.d.sync += [rd_addr.eq(rd_addr + 1), rd_left.eq(rd_left - 1), rd_last.eq(rd_left == 2)]
        with m.If(last_read):
            # Released the cycle its last beat arrives: the beat is captured at this edge.
            m.d.sync += [
                rd_active.eq(0),
                self.release.valid.eq(1),
                self.release.payload.eq(rd_release),
            ]
        rd_job = data.View(read_layout, read_jobs.r_data)
        # A release-only job waits for a cycle without a release; a write job follows the
        # previous one's last read without a gap.
        with m.If(read_jobs.r_rdy & (~rd_active | (last_read & rd_job.writes))):
            m.d.comb += read_jobs.r_en.eq(1)
            m.d.sync += [
                rd_active.eq(rd_job.writes),
                rd_addr.eq(rd_job.src_beat),
                rd_left.eq(rd_job.beats),
                rd_last.eq(rd_job.beats == 1),
                rd_release.eq(rd_job.release),
            ]
            with m.If(~rd_job.writes):
                m.d.sync += [self.release.valid.eq(1), self.release.payload.eq(rd_job.release)]

        # --- AW ----------------------------------------------------------------------------
        ahead = Signal(range(AW_AHEAD + 1))             # bursts presented, W not started
        outstanding = Signal(range(MAX_OUTSTANDING + 1))  # bursts presented, B not received
        aw_active = Signal()
        aw_addr = Signal(self.addr_width - 6)           # the next burst's beat address
        aw_less1 = Signal(range(PAGE_BEATS))            # ... and its AWLEN
        aw_crosses = Signal()                           # a second burst follows
        aw_second_less1 = Signal(range(PAGE_BEATS))
        aw_next_line = Signal(self.addr_width - 6)      # the second burst's beat address
        present = Signal()
        m.d.comb += present.eq(aw_active & (~axi.awvalid | axi.awready)
                               & (ahead != AW_AHEAD) & (outstanding != MAX_OUTSTANDING))
        m.d.comb += [
            axi.awid.eq(self.awid),
            axi.awsize.eq(exact_log2(BEAT_BYTES)),
            axi.awburst.eq(AXI_BURST_INCR),
        ]
        with m.If(axi.awready):
            m.d.sync += axi.awvalid.eq(0)
        with m.If(present):
            m.d.sync += [
                axi.awvalid.eq(1),
                axi.awaddr.eq(aw_addr << 6),
                axi.awlen.eq(aw_less1),
                aw_addr.eq(aw_next_line),
                aw_less1.eq(aw_second_less1),
                aw_crosses.eq(0),
            ]
            with m.If(~aw_crosses):
                m.d.sync += aw_active.eq(0)
        aw_job = data.View(burst_layout, burst_jobs.r_data)
        with m.If(burst_jobs.r_rdy & (~aw_active | (present & ~aw_crosses))):
            m.d.comb += burst_jobs.r_en.eq(1)
            m.d.sync += [
                aw_active.eq(1),
                aw_addr.eq(aw_job.beat_addr),
                aw_less1.eq(aw_job.first_less1),
                aw_crosses.eq(aw_job.crosses),
                aw_second_less1.eq(aw_job.second_less1),
                aw_next_line.eq(Cat(C(0, 6), aw_job.next_line)),
            ]

        # --- Realigner and W ---------------------------------------------------------------
        # Which beat ends a burst or the command, and whether a beat takes a source beat,
        # are facts kept beside the counts, so that a step waits for no compare of them.
        w_active = Signal()
        prime = Signal()            # the command's first source beat is still to be loaded
        shift = Signal(6)
        first = Signal()            # next beat is the command's first
        w_head = Signal(6)
        w_tail = Signal(6)
        dst_left = Signal(range(MAX_BEATS))         # W beats of the command after the next
        last_beat = Signal()                        # dst_left == 0
        burst_left = Signal(range(PAGE_BEATS))      # beats of the burst after the next
        burst_end = Signal()                        # burst_left == 0
        starting = Signal()                         # the next beat starts a burst
        src_left = Signal(range(MAX_BEATS + 1))
        consume = Signal()                          # src_left != 0
        w_bytes = Signal(range(MAX_WRITE_BYTES + 1))
        prev = Signal(8 * BEAT_BYTES)
        beat_bytes = Signal(range(MAX_WRITE_BYTES + 1))   # counted when the W beat is taken

        step = Signal()
        load_prime = Signal()
        m.d.comb += [
            step.eq(w_active & ~prime & (~axi.wvalid | axi.wready)
                    & (~consume | (beats_level != 0)) & (~starting | (ahead != 0))),
            load_prime.eq(w_active & prime & (beats_level != 0)),
        ]
        ones = Const((1 << BEAT_BYTES) - 1, BEAT_BYTES)
        head_mask = Mux(first, (ones << w_head)[:BEAT_BYTES], ones)
        tail_mask = Mux(last_beat, ones >> (w_tail ^ (BEAT_BYTES - 1)), ones)
        funnel = Cat(prev, beat0).bit_select(Cat(C(0, 3), shift), 8 * BEAT_BYTES)

        def take_source():
            m.d.comb += beats_pop.eq(1)
            m.d.sync += [prev.eq(beat0), src_left.eq(src_left - 1), consume.eq(src_left != 1)]

        with m.If(axi.wready):
            m.d.sync += axi.wvalid.eq(0)
        with m.If(step):
            m.d.sync += [
                axi.wvalid.eq(1),
                axi.wdata.eq(funnel),
                axi.wstrb.eq(head_mask & tail_mask),
                axi.wlast.eq(burst_end),
                beat_bytes.eq(Mux(last_beat, w_bytes, 0)),
                dst_left.eq(dst_left - 1),
                last_beat.eq(dst_left == 1),
                starting.eq(burst_end),
                first.eq(0),
            ]
            with m.If(burst_end):
                # At most two bursts: the next one is the rest of the command.
                m.d.sync += [burst_left.eq(dst_left - 1), burst_end.eq(dst_left == 1)]
            with m.Else():
                m.d.sync += [burst_left.eq(burst_left - 1), burst_end.eq(burst_left == 1)]
            with m.If(consume):
                take_source()
            with m.If(last_beat):
                m.d.sync += w_active.eq(0)
        with m.If(load_prime):
            take_source()
            m.d.sync += prime.eq(0)

        w_job = data.View(write_layout, write_jobs.r_data)
        with m.If(write_jobs.r_rdy & (~w_active | (step & last_beat))):
            # The new command's first source beat is the first queued one, or the second
            # if the old command takes a beat this cycle: load it at once.
            taken = w_active & consume
            prime_now = w_job.prime & Mux(taken, beats_level >= 2, beats_level != 0)
            m.d.comb += write_jobs.r_en.eq(1)
            m.d.sync += [
                w_active.eq(1),
                prime.eq(w_job.prime & ~prime_now),
                shift.eq(w_job.shift),
                first.eq(1),
                w_head.eq(w_job.head),
                w_tail.eq(w_job.tail),
                dst_left.eq(w_job.dst_less1),
                last_beat.eq(w_job.dst_less1 == 0),
                burst_left.eq(w_job.first_less1),
                burst_end.eq(w_job.first_less1 == 0),
                starting.eq(1),
                src_left.eq(Mux(prime_now, w_job.src_less1, w_job.src_beats)),
                consume.eq(~prime_now | (w_job.src_less1 != 0)),
                w_bytes.eq(w_job.bytes),
            ]
            with m.If(prime_now):
                m.d.comb += beats_pop.eq(taken + 1)
                m.d.sync += prev.eq(Mux(taken, beat1, beat0))

        m.d.sync += ahead.eq(ahead + present - (step & starting))

        # --- B, counters, idle -------------------------------------------------------------
        m.d.comb += axi.bready.eq(1)
        m.d.sync += outstanding.eq(outstanding + present - (axi.bvalid & (outstanding != 0)))
        # Counters count registered events, a cycle after them: a 32-bit sum is deep enough
        # on its own.
        bytes_event = Signal(range(MAX_WRITE_BYTES + 1))
        error_event = Signal()
        m.d.sync += [
            bytes_event.eq(Mux(axi.wvalid & axi.wready, beat_bytes, 0)),
            error_event.eq(axi.bvalid & (axi.bresp != AXI_RESP_OKAY)),
            self.dma_bytes_written.eq(lookahead_sum(m, self.dma_bytes_written, bytes_event,
                                                    name="dma_bytes_written_next")),
            self.dma_write_errors.eq(lookahead_sum(m, self.dma_write_errors, error_event,
                                                   name="dma_write_errors_next")),
        ]

        m.d.comb += self.idle.eq(~read_jobs.r_rdy & ~rd_active & ~in_flight & ~self.release.valid
                                 & ~burst_jobs.r_rdy & ~aw_active & ~axi.awvalid
                                 & ~write_jobs.r_rdy & ~w_active & ~axi.wvalid & (beats_level == 0)
                                 & (outstanding == 0))
        return m
