from amaranth import *
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from .signatures import BLOCK_BYTES, FCCL_BITS, VCRC_BYTES, FlowControlOp, blocks_of, check_mtu, \
    check_width, lrh_wire_bytes, max_wire_bytes

__all__ = ["BeatFacts", "BeatFactsLayout", "MIN_WIRE_BYTES"]

# Smallest IBA transport packet: LRH + BTH + ICRC + VCRC.
MIN_WIRE_BYTES = 8 + 12 + 4 + VCRC_BYTES


class BeatFactsLayout(data.StructLayout):
    """What the link receiver's checks need to know about one beat, besides the beat.

    Start-beat checks (meaningful on a data packet's start beat): ``malformed`` (LRH.PktLen
    below the smallest IBA packet, or the start beat ends inside the LRH), ``invalid_vl``
    (LRH.VL is not one of our data VLs), ``too_long`` (LRH.PktLen beyond the MTU's largest
    packet).

    Where the beat sits in its data packet (LRH.PktLen of the packet's start beat against the
    bytes since that start): ``write`` (it holds bytes of LRH..ICRC, which are stored),
    ``data_end`` (it holds the last of them), ``count`` (how many of its bytes to store:
    all of them before the data end, up to the data end in the beat that holds it);
    ``short`` and ``exact`` (if the packet ends with this beat, it ended before ``PktLen``
    said or exactly there; neither is overlong), ``blocks`` (its credit blocks if it ends
    with this beat: the bytes that arrived, capped at ``PktLen``; up to 64-byte beats an
    end beat of no bytes counts as a full one), ``close_blocks`` (the credit blocks of the
    packet in progress before this beat, capped the same way: what a packet cut short by
    this beat held; up to 64-byte beats with one more full beat, the empty end beat that
    closes it in the buffer).

    Flow-control beats: ``fc_framing`` (a lone start-and-end beat of 6 bytes), ``fc_fields``
    (its VL is one of ours and its Op is NORMAL or INIT).
    """
    def __init__(self, width):
        check_width(width)
        super().__init__({
            "malformed": 1, "invalid_vl": 1, "too_long": 1,
            "write": 1, "data_end": 1, "count": range(width + 1),
            "short": 1, "exact": 1, "blocks": FCCL_BITS, "close_blocks": FCCL_BITS,
            "fc_framing": 1, "fc_fields": 1,
        })


class BeatFacts(wiring.Component):
    """The link receiver's per-beat arithmetic, done while the beat waits in the receiver's
    input register, so that the checks see its results in a register beside the beat.

    Takes each beat as it arrives on the wire (``valid``, ``link``, ``start``, ``end``,
    ``count`` and the first 8 bytes, ``lrh``) and shows its :class:`BeatFactsLayout` on
    ``facts`` two cycles later, when the receiver's check register holds that beat.

    The position in the packet is tracked as ``h - i``, the full beats still to come before
    the one where ``LRH.PktLen`` ends (``i``: beats since the start, ``h``: the beat index
    where the packet ends, counting the VCRC), with flags for its small values kept as
    registers, so that no comparison of a length with a byte count is left to the checks:
    the beat ending a packet at ``PktLen`` is the one at ``i == h`` with ``l + 2`` bytes
    (``l + 2``: the bytes of the packet in that beat; ``l`` a multiple of 4). Beats before
    the end beat are always full, so the bytes since the start are ``i * width``. Past the
    end the count stops at "past": every comparison with ``PktLen`` is settled there.
    """

    def __init__(self, *, width, num_vls, mtu):
        check_width(width)
        check_mtu(mtu)
        self.width = width
        self.num_vls = num_vls
        self.mtu = mtu
        super().__init__({
            "valid": In(1),
            "link": In(1),
            "start": In(1),
            "end": In(1),
            "count": In(range(width + 1)),
            "lrh": In(64),
            "facts": Out(BeatFactsLayout(width)),
        })

    def elaborate(self, platform):
        m = Module()
        width, num_vls = self.width, self.num_vls
        shift = width.bit_length() - 1
        per_beat = max(1, width // BLOCK_BYTES)     # credit blocks in a full beat (wide beats)
        per_block = max(1, BLOCK_BYTES // width)    # beats in a credit block (narrow beats)
        max_beats = (2 ** 11 * 4 + 2) // width + 1  # of the longest PktLen

        # The input register's copy of what the arithmetic needs, and the beat's size: its
        # bytes, and the blocks they begin when the beat starts on a block boundary
        # (``cfull``: all of a full beat's, else ``partial`` of them; wide beats only). A beat
        # of up to 64 bytes is charged a full beat's blocks whatever its count, an end beat
        # of no bytes too: it takes a buffer slot (block boundaries fall between such beats,
        # so the charge never passes the bytes' blocks otherwise).
        valid, link, start, end = Signal(), Signal(), Signal(), Signal()
        count = Signal(range(width + 1))
        lrh = Signal(64)
        nbytes = Signal(range(width + 1))
        cfull = Signal() if per_beat > 1 else C(1)
        partial = Signal(range(per_beat)) if per_beat > 1 else C(0)
        wire_bytes = Mux(self.end, self.count, width)
        wire_blocks = blocks_of(wire_bytes)
        m.d.sync += [
            valid.eq(self.valid), link.eq(self.link), start.eq(self.start), end.eq(self.end),
            count.eq(self.count), lrh.eq(self.lrh),
            nbytes.eq(wire_bytes),
        ]
        if per_beat > 1:
            m.d.sync += [cfull.eq(wire_blocks == per_beat), partial.eq(wire_blocks[:len(partial)])]

        # The packet in progress, as of the next beat: ``ahead`` = h - i, saturating at -1
        # ("past the end"), with flags for ahead > 1, == 1, == 0 and < 0; the end beat's
        # bytes (``tail`` = l + 2), ``l == 0`` (the data end fills the beat before the end
        # beat), the packet's credit blocks (``packet_blocks``), and the blocks of the beats
        # so far and of one more full beat (``done``, ``done_next``; ``phase``: the beats
        # since the last block boundary, narrow beats).
        ahead = Signal(range(-1, max_beats + 1), init=-1)
        ahead_many, ahead_one, ahead_zero, past = Signal(), Signal(), Signal(), Signal(init=1)
        tail = Signal(range(width))
        aligned = Signal()
        packet_blocks = Signal(FCCL_BITS)
        done = Signal(FCCL_BITS)
        done_next = Signal(FCCL_BITS)
        phase = Signal(range(per_block)) if per_block > 1 else C(0)

        # What a formal proof relates to the packet in progress (docs/formal.md).
        self.formal_state = {
            "valid": valid, "link": link, "start": start, "end": end, "count": count,
            "lrh": lrh, "nbytes": nbytes, "ahead": ahead, "ahead_many": ahead_many,
            "ahead_one": ahead_one, "ahead_zero": ahead_zero, "past": past, "tail": tail,
            "aligned": aligned, "packet_blocks": packet_blocks, "done": done,
            "done_next": done_next,
        }

        # The same for a start beat, from its LRH: it is beat 0 of its packet.
        length = lrh_wire_bytes(lrh)
        start_ahead = length[shift:]
        start_tail = length[:shift]
        start_aligned = start_tail == 2
        start_blocks = blocks_of(length)

        # This beat's position: from the LRH on a start beat, else from the registers.
        def pick(on_start, otherwise):
            return Mux(start, on_start, otherwise)
        is_aligned = pick(start_aligned, aligned)
        tail_now = pick(start_tail, tail)
        zero_now = pick(start_ahead == 0, ahead_zero)
        one_now = pick(start_ahead == 1, ahead_one)
        positive_now = pick(start_ahead != 0, ahead_many | ahead_one)
        # The data end (LRH..ICRC, l bytes into the end beat) is in beat h, or in beat
        # h - 1 (filling it) when l == 0.
        last_bytes = Mux(is_aligned, width, tail_now - 2)
        holds_data = Mux(is_aligned, positive_now, pick(1, ~past))
        at_data_end = Mux(is_aligned, one_now, zero_now)
        data_end = at_data_end & (nbytes >= last_bytes)
        # Blocks of the bytes up to the end of this beat, while they are below PktLen.
        arrived_blocks = Mux(cfull, pick(per_beat, done_next), pick(0, done) | partial)
        short = positive_now | (zero_now & (nbytes < tail_now))

        # A packet cut short before its end is closed in the buffer by an empty end beat: up
        # to 64-byte beats it is charged that slot as one more full beat (wider beats hold
        # two blocks or more each, enough for it).
        closing_blocks = done_next if per_beat == 1 else done

        facts = self.facts
        m.d.sync += [
            facts.malformed.eq((length < MIN_WIRE_BYTES) | (end & (count < 8))),
            facts.invalid_vl.eq(lrh[4:8] >= num_vls),
            facts.too_long.eq(length > max_wire_bytes(self.mtu)),
            facts.write.eq(holds_data),
            facts.data_end.eq(data_end),
            facts.count.eq(Mux(data_end, last_bytes, nbytes)),
            facts.short.eq(short),
            facts.exact.eq(zero_now & (nbytes == tail_now)),
            facts.blocks.eq(Mux(short, arrived_blocks, pick(start_blocks, packet_blocks))),
            facts.close_blocks.eq(Mux(past, packet_blocks, closing_blocks)),
            facts.fc_framing.eq(start & end & (count == 6)),
            facts.fc_fields.eq((lrh[20:24] < num_vls) & (lrh[4:8] <= FlowControlOp.INIT.value)),
        ]

        # Advance the position by one data beat.
        with m.If(valid & ~link):
            with m.If(start):
                m.d.sync += [
                    ahead.eq(start_ahead - 1),
                    ahead_many.eq(start_ahead > 2),
                    ahead_one.eq(start_ahead == 2),
                    ahead_zero.eq(start_ahead == 1),
                    past.eq(start_ahead == 0),
                    tail.eq(start_tail),
                    aligned.eq(start_aligned),
                    packet_blocks.eq(start_blocks),
                    done.eq(per_beat),
                    done_next.eq(blocks_of(2 * width)),
                ]
                if per_block > 1:
                    m.d.sync += phase.eq(1)
            with m.Else():
                with m.If(~past):
                    m.d.sync += [
                        ahead.eq(ahead - 1),
                        ahead_many.eq(ahead_many & (ahead != 2)),
                        ahead_one.eq(ahead == 2),
                        ahead_zero.eq(ahead_one),
                        past.eq(ahead_zero),
                    ]
                # A new block begins with the beat after next when that beat starts on a
                # block boundary (every beat, for wide beats).
                m.d.sync += [
                    done.eq(done_next),
                    done_next.eq(done_next + Mux(phase == per_block - 1, per_beat, 0)),
                ]
                if per_block > 1:
                    m.d.sync += phase.eq(Mux(phase == per_block - 1, 0, phase + 1))
        return m
