"""Packs a packet's payload pieces (its gather list's segments, each read as its own bursts)
into one contiguous run of beats, so the PacketAssembler takes a gathered packet as it takes
a one-segment one (docs/nic.md, Gather packing)."""
from amaranth import C, Cat, Module, Mux, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.nic.signatures import GatherPieceLayout, RBeatLayout

__all__ = ["GatherPacker"]

WIDTH = 64                      # bytes per beat


class GatherPacker(wiring.Component):
    """Turns raw payload beats, piece by piece, into packed beats (docs/nic.md, Gather
    packing: the record contract, the packed run, ``resp``, timing, depth).

    ``pieces`` takes one record per piece (:class:`GatherPieceLayout`) as the piece's
    first burst issues; up to ``piece_depth`` records wait in a FIFO. ``raw`` takes each
    piece's ``beats`` beats in the records' order; a packet's pieces (to the one with
    ``last``) leave on ``packed`` as one run of bytes from its first piece's ``start``.
    Each raw beat is rotated so its first byte lands on lane ``fill`` and merged into the
    partial beat (lanes below ``fill`` kept); a packet's only piece bypasses the output
    register while it is empty, so one-segment packets take no extra cycle.

    Ports
    -----
    pieces : In(stream.Signature(GatherPieceLayout()))
    raw : In(stream.Signature(RBeatLayout(64)))
    packed : Out(stream.Signature(RBeatLayout(64)))
    """

    def __init__(self, *, piece_depth=8):
        if not isinstance(piece_depth, int) or not 2 <= piece_depth <= 8192:
            raise ValueError(f"piece_depth must be an integer from 2 to 8192, not {piece_depth!r}")
        self.piece_depth = piece_depth
        super().__init__({
            "pieces": In(stream.Signature(GatherPieceLayout())),
            "raw": In(stream.Signature(RBeatLayout(WIDTH))),
            "packed": Out(stream.Signature(RBeatLayout(WIDTH))),
        })

    def elaborate(self, platform):
        m = Module()
        # pieces.ready is a flag registered a cycle ahead (the executor's first burst waits on
        # it: depth): room if at most piece_depth - 1 records are held after this cycle's
        # write. One more entry than piece_depth, so that the buffered FIFO's inner part has
        # room whenever the flag is up (docs/nic.md, Gather packing).
        m.submodules.records = records = fifo.SyncFIFOBuffered(
            width=GatherPieceLayout().size, depth=self.piece_depth + 1)
        record_room = Signal(init=1)
        record_write = self.pieces.valid & record_room
        m.d.comb += [records.w_data.eq(self.pieces.payload),
                     records.w_en.eq(record_write),
                     self.pieces.ready.eq(record_room)]
        m.d.sync += record_room.eq(records.level + record_write < self.piece_depth)
        head = GatherPieceLayout()(records.r_data)

        # The piece whose raw beats come in now.
        held = Signal()
        beats_left = Signal(7)
        last_beat = Signal()            # beats_left == 1
        last_piece = Signal()           # of its packet
        alone = Signal()                # its packet's only piece
        shift = Signal(6)               # raw lane = packed lane + shift, mod 64
        tail = Signal(7)                # lanes its last raw beat ends at, 1 .. 64
        size = Signal(7)                # bytes the next raw beat brings, 1 .. 64
        end_fill = Signal(6)            # fill after its last raw beat
        packet_start = Signal(init=1)   # the next piece loaded starts a packet
        # The partial beat: packed bytes in lanes 0 .. fill - 1.
        fill = Signal(6)
        partial = Signal(8 * WIDTH)
        partial_resp = Signal(2)
        flush = Signal()                # partial holds a packet's last bytes, to go out alone

        # The output register and a skid register behind it, so that raw.ready and every
        # register but these two see a register, not packed.ready (depth); a packet's only
        # piece bypasses them while they are empty.
        out = Signal(RBeatLayout(WIDTH))
        out_valid = Signal()
        skid = Signal(RBeatLayout(WIDTH))
        skid_valid = Signal()
        raw, packed = self.raw, self.packed
        final = last_beat & last_piece
        bypass = held & alone & ~out_valid
        m.d.comb += [
            raw.ready.eq(held & ~flush & ~skid_valid),
            packed.valid.eq(Mux(bypass, raw.valid, out_valid)),
            packed.payload.data.eq(Mux(bypass, raw.payload.data, out.data)),
            packed.payload.resp.eq(Mux(bypass, raw.payload.resp, out.resp)),
            packed.payload.last.eq(Mux(bypass, final, out.last)),
        ]
        take = raw.valid & raw.ready

        data = raw.payload.data
        shifted = Signal(8 * WIDTH)
        m.d.comb += shifted.eq(Cat(data, data).bit_select(Cat(C(0, 3), shift), 8 * WIDTH))
        merged = Signal(8 * WIDTH)
        for lane in range(WIDTH - 1):
            m.d.comb += merged.word_select(lane, 8).eq(
                Mux(lane < fill, partial.word_select(lane, 8), shifted.word_select(lane, 8)))
        # fill is at most 63: the last lane is always the raw beat's.
        m.d.comb += merged.word_select(WIDTH - 1, 8).eq(shifted.word_select(WIDTH - 1, 8))
        reach = Signal(7)
        m.d.comb += reach.eq(fill + size)
        full = reach[6]                 # the merged beat's last lane is filled
        spill = final & full & (end_fill != 0)

        # A beat for the registers: the bytes over a packet's end, a merged beat, or a
        # bypassed one that packed.ready holds back. It goes to the output register if that
        # is free after this cycle, else to the skid register; raw.ready and the flush wait
        # while the skid register is full.
        beat = Signal(RBeatLayout(WIDTH))
        emit = Signal()
        flushing = flush & ~skid_valid
        resp = partial_resp | raw.payload.resp
        with m.If(flushing):
            m.d.comb += [emit.eq(1), beat.data.eq(partial), beat.resp.eq(partial_resp),
                         beat.last.eq(1)]
            m.d.sync += [flush.eq(0), partial_resp.eq(0)]
        with m.Else():
            # A held-back bypassed beat keeps its payload as offered, lanes outside the run too.
            m.d.comb += [emit.eq(take & (full | final) & ~(bypass & packed.ready)),
                         beat.data.eq(Mux(bypass, raw.payload.data, merged)), beat.resp.eq(resp),
                         beat.last.eq(final & ~spill)]
        # packed.ready only in the registers' enables (depth): the output register is free
        # after this cycle, or it keeps its beat and a new one goes behind it. The skid
        # register is full only while the output register is.
        free_after = ~out_valid | packed.ready
        with m.If(free_after):
            m.d.sync += [out_valid.eq(skid_valid | emit), out.eq(Mux(skid_valid, skid, beat)),
                         skid_valid.eq(0)]
        with m.Elif(emit):
            m.d.sync += [skid_valid.eq(1), skid.eq(beat)]
        with m.If(take):
            m.d.sync += [fill.eq(reach[:6]),
                         partial.eq(Mux(full, shifted, merged)),
                         partial_resp.eq(Mux(full, Mux(reach[:6] != 0, raw.payload.resp, 0), resp)),
                         flush.eq(spill)]
            with m.If(final & ~spill):
                m.d.sync += partial_resp.eq(0)
            with m.If(~last_beat):
                m.d.sync += [beats_left.eq(beats_left - 1),
                             last_beat.eq(beats_left == 2),
                             size.eq(Mux(beats_left == 2, tail, WIDTH))]

        load = records.r_rdy & (~held | (take & last_beat))
        m.d.comb += records.r_en.eq(load)
        with m.If(take & last_beat):
            m.d.sync += held.eq(0)
        with m.If(load):
            start_fill = Mux(packet_start, head.start, end_fill)
            end = (head.start + head.bytes)[:6]
            m.d.sync += [held.eq(1),
                         beats_left.eq(head.beats),
                         last_beat.eq(head.beats == 1),
                         last_piece.eq(head.last),
                         alone.eq(packet_start & head.last),
                         packet_start.eq(head.last),
                         shift.eq(head.start - start_fill),
                         end_fill.eq(start_fill + head.bytes[:6]),
                         tail.eq(Mux(end == 0, WIDTH, end)),
                         size.eq(Mux(head.beats == 1, head.bytes[:7], WIDTH - head.start))]
            with m.If(packet_start):
                m.d.sync += fill.eq(head.start)
        return m
