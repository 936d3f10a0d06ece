from amaranth import *
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import count_registered, lookahead_sum

from hdl.nic.signatures import (
    DESCRIPTOR_INLINE_BYTES, EXT_AMO_OPMOD_4, EXT_AMO_OPMOD_8, FETCH_ID, MAX_GATHER_SEGMENTS,
    MAX_INLINE_BYTES, MAX_WQE_BLOCKS, QPN_BITS, WQEBB_BYTES, ArLayout,
    ContextReadSignature, FetchDoneLayout, FetchRequestLayout, MlxOpcode, QpConfigLayout,
    RBeatLayout, Syndrome, WqeDescriptorLayout,
)

__all__ = ["WqeFetcher", "sq_block_address"]


def _be(block, start, n):
    """The big-endian number in bytes ``start .. start + n - 1`` of ``block`` (byte 0 in
    bits 7..0)."""
    return Cat(*(block[8 * (start + n - 1 - i):8 * (start + n - i)] for i in range(n)))


def _segment(block, start):
    return block[8 * start:8 * (start + 16)]


def sq_block_address(m, sq_base, log_sq_size, position, *, name):
    """``(address, in_ring)``: the byte address of send-queue block ``position`` (16 bits,
    taken modulo the ring of 2**log_sq_size blocks), and ``in_ring``, bit i set for
    i < log_sq_size, driven combinationally in ``m``. ``sq_base`` must be aligned to
    min(4096, ring bytes), as RESET -> RTS checks: then a ring of up to 64 blocks lies
    within one 4 KiB page and the index's bits 0..5 are ORed into the base, and its bits
    6..15 reach into the base's bits 12..21 only, whose carry out chooses between the
    upper bits and their increment, formed beside it."""
    in_ring = Signal(16, name=f"{name}_in_ring")     # at most 15 bits: bit 15 never
    m.d.comb += in_ring.eq(Cat(log_sq_size > i for i in range(15)))
    index = position & in_ring
    page_low = lookahead_sum(m, sq_base[12:22], index[6:], name=f"{name}_page_low")
    upper = sq_base[22:]
    upper_next = lookahead_sum(m, upper, 0, 1, name=f"{name}_page_upper_next")
    address = Signal(64, name=f"{name}_block_address")
    m.d.comb += address.eq(Cat(C(0, 6), sq_base[6:12] | index[:6], page_low[:10],
                               Mux(page_low[10], upper_next[:len(upper)], upper)))
    return address, in_ring


class _WqeFactsLayout(data.StructLayout):
    """What a WQE's format checks make of its first block (``WqeFetcher._facts``)."""
    def __init__(self):
        super().__init__({
            "ok": 1,
            "syndrome": Syndrome,       # when not ok
            "has_raddr": 1,
            "has_atomic": 1,
            "has_data": 1,
            "has_inline": 1,
            "data_at": 3,               # data segment at byte 16, 32, 48, 64 (1, 2, 3, 4)
            "segments": range(MAX_GATHER_SEGMENTS + 1),     # data segments
            # a gather list's later segments in the second block, at byte 0 and 16: their
            # inline marks are checked as the parser takes that block
            "check_second": 2,
            "inline_len": range(MAX_INLINE_BYTES + 1),
            # the bytes the descriptor carries: inline_len up to 64, else none (the
            # executor reads longer data back from the ring)
            "carried_len": range(DESCRIPTOR_INLINE_BYTES + 1),
        })


class WqeFetcher(wiring.Component):
    """Reads mlx5 WQE basic blocks for fetch requests and parses them into WQE descriptors
    (docs/nic.md, "WQE fetch and parse").

    Issue stage: a request is held while its QP's context is read (``qp_config``, one
    cycle), then its blocks go out as INCR bursts (``ar``, id ``FETCH_ID``), one per cycle,
    each cut at the ring's end (the next one starts at ``sq_base``) and at 4 KiB
    boundaries. The first burst waits until the block buffer has room for all the
    fetch's blocks and reserves them, so every R beat is accepted at once (``r.ready`` is
    always 1) and the shared R channel never waits on the parser. Blocks are read modulo
    the ring whatever their count (a fetch longer than the ring reads blocks again). R
    beats are taken in request order; ``r.last`` is not looked at. A request with
    ``blocks`` 0 or above 16, or a ``qpn`` of a QP the NIC does not have, reads nothing
    and finishes with ``consumed`` 0. ``sq_base`` must be aligned to min(4096, ring
    bytes), as RESET -> RTS checks: the addresses and cuts are formed on that premise.

    Parser: walks the buffered blocks in fetch order, one block per cycle (blocks go back
    to the buffer as they are popped). A WQE's first block gives its length
    (``ceil(ds / 4)`` blocks, ds 0 or a block read with RRESP not OKAY counts as one); a
    WQE longer than what is left of the fetch is dropped with the rest of the fetch; a
    whole WQE becomes one descriptor in the cycle of its last block, registered on
    ``wqe``. With ``first_only`` the blocks after the first WQE are dropped. Dropped blocks
    count in ``wqe_blocks_refetched`` (every block fetched and not consumed is read again
    later). ``fetch_done`` pulses in the cycle after a fetch's last block was handled (it
    does not wait for the last descriptor to be taken). The request's ``epoch`` (the QP's
    rewind count, docs/nic.md "Doorbells") is copied into every descriptor of the fetch
    and into its ``fetch_done``; the fetcher itself never looks at it. The four counters
    count registered events, a cycle after them.

    Descriptor fields: multi-byte fields hold the numeric value of the big-endian bytes in
    memory; ``imm`` is the big-endian value of control-segment bytes 12..15, so sending it
    most significant byte first puts those bytes on the wire unchanged. ``wqe_index`` is
    the fetch position of the WQE's first block (mod 2^16), not the control segment's copy.
    ``inline_data`` holds ``byte_count`` bytes, the rest zero, for up to 64 bytes; for
    65 to 256 it is zero (the executor reads the data back from the ring). ``segments`` is
    the WQE's data segments: 1 for one, 2 to 4 for a WRITE's or SEND's gather list (ds up to
    6 or 5, so within its first two blocks), whose later segments are in ``more_segments``
    (zero past ``segments``). A WQE with a format error
    carries only its control-segment fields (opcode, opmod, ds, fm_ce_se, imm), all
    segment fields zero; one whose first block was read with an error carries none (its
    contents are unknown) and is one block long.
    """

    def __init__(self, *, num_qps=64, buffer_blocks=256):
        if not isinstance(num_qps, int) or not 1 <= num_qps <= 1 << QPN_BITS:
            raise ValueError(f"QPs must be an integer 1 to {1 << QPN_BITS}, not {num_qps!r}")
        if not isinstance(buffer_blocks, int) or not MAX_WQE_BLOCKS <= buffer_blocks <= 4096:
            raise ValueError(f"Buffer blocks must be an integer {MAX_WQE_BLOCKS} to 4096 "
                             f"(a fetch of {MAX_WQE_BLOCKS} blocks must fit), "
                             f"not {buffer_blocks!r}")
        self.num_qps = num_qps
        self.buffer_blocks = buffer_blocks
        super().__init__({
            "fetch": In(stream.Signature(FetchRequestLayout())),
            "qp_config": Out(ContextReadSignature(num_qps, QpConfigLayout())),
            "ar": Out(stream.Signature(ArLayout())),
            "r": In(stream.Signature(RBeatLayout(WQEBB_BYTES))),
            "wqe": Out(stream.Signature(WqeDescriptorLayout())),
            "fetch_done": Out(stream.Signature(FetchDoneLayout(), always_ready=True)),
            "wqe_blocks_fetched": Out(32),
            "wqes_parsed": Out(32),
            "wqe_blocks_refetched": Out(32),
            "fetch_read_errors": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        # Each block is stored with its format checks as a WQE's first block, made as it
        # arrives, so the parser only chooses between fields.
        block_layout = data.StructLayout({"data": 8 * WQEBB_BYTES, "bad": 1,
                                          "facts": _WqeFactsLayout()})
        # In flight between the two halves: every issued fetch (in order) and every block
        # read. The info queue is as deep as the buffer so one-block fetches can fill it.
        m.submodules.info = info = fifo.SyncFIFOBuffered(
            width=FetchRequestLayout().size, depth=self.buffer_blocks)
        m.submodules.blocks = blocks = fifo.SyncFIFOBuffered(
            width=block_layout.size, depth=self.buffer_blocks)
        free = Signal(range(self.buffer_blocks + 1), init=self.buffer_blocks)
        release = Signal()
        self._issue(m, info, free, release)

        arriving = Signal(_WqeFactsLayout())
        self._facts(m, arriving, self.r.payload.data)
        m.d.comb += [
            self.r.ready.eq(1),
            blocks.w_en.eq(self.r.valid),
            blocks.w_data.eq(Cat(self.r.payload.data, self.r.payload.resp != 0, arriving)),
        ]
        count_registered(m, self.wqe_blocks_fetched, self.r.valid)
        count_registered(m, self.fetch_read_errors, self.r.valid & (self.r.payload.resp != 0))

        self._parse(m, info, blocks, block_layout, release)
        return m

    def _issue(self, m, info, free, release):
        fetch, ar, cfg = self.fetch, self.ar, self.qp_config.data
        held = Signal()
        req = Signal(FetchRequestLayout())
        blocks_less_one = Signal(4)     # of the held request, for the reservation
        # The next burst: its ring position (only the bits below log_sq_size count), whether
        # one is still to be requested, and how many blocks are left after it.
        at = Signal(16)
        requesting = Signal()
        left_less_one = Signal(4)
        first = Signal()                # the fetch has not reserved yet

        # sq_base is aligned to min(4096, ring bytes) (RESET -> RTS checks it), so a larger
        # ring than 64 blocks starts and ends on page boundaries: the next boundary,
        # whichever it is, is the first position after ``at`` whose bits below
        # min(log_sq_size, 6) are zero.
        burst_address, in_ring = sq_block_address(m, cfg.sq_base, cfg.log_sq_size, at,
                                                  name="sq")
        to_boundary_less_one = Signal(6)
        m.d.comb += to_boundary_less_one.eq(~at[:6] & in_ring[:6])
        last_burst = Signal()
        m.d.comb += last_burst.eq(left_less_one <= to_boundary_less_one)

        # at_least[k] is free >= k, kept beside free so the first burst's room check is a
        # selection by the request's block count.
        at_least = Signal(MAX_WQE_BLOCKS + 1, init=(1 << (MAX_WQE_BLOCKS + 1)) - 1)
        room = Signal()
        m.d.comb += room.eq(info.w_rdy & at_least.bit_select(req.blocks, 1))
        m.d.comb += [
            ar.valid.eq(held & requesting & (~first | room)),
            ar.payload.id.eq(FETCH_ID),
            ar.payload.addr.eq(burst_address),
            ar.payload.len.eq(Mux(last_burst, left_less_one, to_boundary_less_one[:4])),
        ]
        fire = Signal()
        m.d.comb += fire.eq(ar.valid & ar.ready)
        # A rejected request (nothing to request from the start) only queues its empty fetch.
        empty = Signal()
        m.d.comb += empty.eq(held & first & ~requesting & info.w_rdy)
        finish = Signal()
        m.d.comb += finish.eq((fire & last_burst) | empty)
        take = Signal()                 # the fetch's first burst reserves all its blocks
        m.d.comb += take.eq(fire & first)
        self._count_free(m, free, at_least, req.blocks, blocks_less_one, take=take,
                         release=release)
        m.d.comb += [
            info.w_en.eq(take | empty),
            info.w_data.eq(req),
            fetch.ready.eq(~held | finish),
            # The context is read in the accept cycle; holding the address keeps it current.
            self.qp_config.addr.eq(Mux(fetch.ready, fetch.payload.qpn, req.qpn)),
        ]
        with m.If(fire):
            m.d.sync += first.eq(0)
            with m.If(last_burst):
                m.d.sync += requesting.eq(0)
            with m.Else():
                # Cut at the boundary: the next burst starts on it.
                m.d.sync += [
                    at.eq(Cat(C(0, 6), at[6:] + 1)),
                    left_less_one.eq(left_less_one + ~to_boundary_less_one[:4]),
                ]
        with m.If(finish):
            m.d.sync += held.eq(0)
        with m.If(fetch.valid & fetch.ready):
            p = fetch.payload
            ok = (p.blocks != 0) & (p.blocks <= MAX_WQE_BLOCKS) & (p.qpn < self.num_qps)
            m.d.sync += [
                held.eq(1), first.eq(1), at.eq(p.wqe_index),
                req.eq(p), req.blocks.eq(Mux(ok, p.blocks, 0)),
                requesting.eq(ok), left_less_one.eq(p.blocks - 1), blocks_less_one.eq(p.blocks - 1),
            ]

    @staticmethod
    def _count_free(m, free, at_least, blocks, blocks_less_one, *, take, release):
        """``free -= blocks`` on ``take``, ``+= 1`` on ``release``, and ``at_least`` with it:
        every outcome is formed from registers and the strobes only choose between them."""
        width = len(free)
        minus = lookahead_sum(m, free, ~Cat(blocks, C(0, width - len(blocks))), 1,
                              name="free_taken")
        minus_plus_one = lookahead_sum(m, free, ~Cat(blocks_less_one,
                                                     C(0, width - len(blocks_less_one))), 1,
                                       name="free_taken_released")
        plus_one = lookahead_sum(m, free, 1, name="free_released")
        with m.If(take):
            m.d.sync += free.eq(Mux(release, minus_plus_one[:width], minus[:width]))
        with m.Elif(release):
            m.d.sync += free.eq(plus_one[:width])

        # free >= k for every k a next at_least can ask: k - 1 + blocks at most.
        limit = 2 * MAX_WQE_BLOCKS
        free_at_least = Signal(limit + 1)
        m.d.comb += free_at_least.eq(Cat(C(1, 1), *(free >= k for k in range(1, limit + 1))))
        taken, taken_released = Signal.like(at_least), Signal.like(at_least)
        for k in range(MAX_WQE_BLOCKS + 1):
            # free - blocks (+ 1) >= k: free >= k + blocks (- 1).
            with m.Switch(blocks):
                for b in range(MAX_WQE_BLOCKS + 1):
                    with m.Case(b):
                        m.d.comb += [taken[k].eq(free_at_least[k + b]),
                                     taken_released[k].eq(free_at_least[max(k + b - 1, 0)])]
        released = Cat(C(1, 1), at_least[:-1])
        with m.If(take):
            m.d.sync += at_least.eq(Mux(release, taken_released, taken))
        with m.Elif(release):
            m.d.sync += at_least.eq(released)

    def _parse(self, m, info, blocks, block_layout, release):
        wqe = self.wqe
        cur = data.View(FetchRequestLayout(), info.r_data)
        head = data.View(block_layout, blocks.r_data)

        # Where the head block is in its fetch: its first block (the fetch's own fields
        # hold then), or as the registers below say.
        fetch_start = Signal(init=1)
        remaining_after_start = Signal(range(MAX_WQE_BLOCKS + 1))   # from the head on
        index_after_start = Signal(16)                  # fetch position (mod 2^16)
        consumed = Signal(range(MAX_WQE_BLOCKS + 1))
        dropping = Signal()                             # the rest of the fetch is dropped
        in_wqe = Signal()                               # the head is a later block of a WQE
        blocks_after = Signal(range(MAX_WQE_BLOCKS))    # of that WQE, after the head
        wqe_blocks = Signal(range(MAX_WQE_BLOCKS + 1))
        consumed_with_wqe = Signal(range(MAX_WQE_BLOCKS + 1))       # consumed + wqe_blocks
        wqe_index = Signal(16)
        read_err = Signal()                             # a later block of the WQE was bad
        block0 = Signal(8 * WQEBB_BYTES)
        facts0 = Signal(_WqeFactsLayout())

        remaining = Signal(range(MAX_WQE_BLOCKS + 1))
        m.d.comb += remaining.eq(Mux(fetch_start, cur.blocks, remaining_after_start))
        head_index = Signal(16)
        m.d.comb += head_index.eq(Mux(fetch_start, cur.wqe_index, index_after_start))
        next_index = lookahead_sum(m, head_index, 0, 1, name="next_index")

        ds = head.data[56:62]
        single = Signal()                               # the WQE at the head is one block
        m.d.comb += single.eq(head.bad | (ds <= 4))
        head_blocks = Signal(range(MAX_WQE_BLOCKS + 1))
        m.d.comb += head_blocks.eq(Mux(single, 1, (ds + 3) >> 2))
        at_start = Signal()
        m.d.comb += at_start.eq(~dropping & ~in_wqe)
        fits = Signal()                                 # ceil(ds / 4) <= remaining
        m.d.comb += fits.eq(single | (ds <= Cat(C(0, 2), remaining)))
        emit = Signal()
        m.d.comb += emit.eq(Mux(at_start, single, ~dropping & (blocks_after == 0)))
        pop = Signal()
        m.d.comb += pop.eq(info.r_rdy & (cur.blocks != 0) & blocks.r_rdy &
                           (~emit | ~wqe.valid | wqe.ready))
        empty_fetch = Signal()
        m.d.comb += empty_fetch.eq(info.r_rdy & (cur.blocks == 0))
        last = Signal()
        m.d.comb += last.eq(remaining == 1)
        m.d.comb += [
            blocks.r_en.eq(pop),
            release.eq(pop),
            info.r_en.eq(empty_fetch | (pop & last)),
        ]

        desc = Signal(WqeDescriptorLayout())
        facts = Signal(_WqeFactsLayout())
        m.d.comb += facts.eq(Mux(at_start, head.facts, facts0))
        self._fields(m, desc, facts,
                     block0=Mux(at_start, head.data, block0), block1=head.data,
                     bad0=at_start & head.bad, bad_later=~at_start & (read_err | head.bad))
        m.d.comb += [
            desc.qpn.eq(cur.qpn),
            desc.epoch.eq(cur.epoch),
            desc.wqe_index.eq(Mux(at_start, head_index, wqe_index)),
            desc.wqe_blocks.eq(Mux(at_start, 1, wqe_blocks)),
        ]

        count_registered(m, self.wqes_parsed, wqe.valid & wqe.ready)
        refetched = Signal()
        m.d.comb += refetched.eq(pop & (dropping | (at_start & ~fits)))
        count_registered(m, self.wqe_blocks_refetched, refetched)

        consumed_now = Signal(range(MAX_WQE_BLOCKS + 1))   # after this pop
        m.d.comb += consumed_now.eq(Mux(emit, Mux(at_start, consumed + 1, consumed_with_wqe),
                                        consumed))
        with m.If(wqe.valid & wqe.ready):
            m.d.sync += wqe.valid.eq(0)
        m.d.sync += self.fetch_done.valid.eq(0)
        with m.If(pop):
            m.d.sync += [fetch_start.eq(0), remaining_after_start.eq(remaining - 1),
                         index_after_start.eq(next_index)]
            with m.If(dropping | (at_start & ~fits)):
                m.d.sync += dropping.eq(1)
            with m.Elif(emit):
                m.d.sync += [wqe.valid.eq(1), wqe.payload.eq(desc), in_wqe.eq(0),
                             consumed.eq(consumed_now), dropping.eq(cur.first_only)]
            with m.Elif(at_start):
                m.d.sync += [in_wqe.eq(1), blocks_after.eq(head_blocks - 2),
                             wqe_blocks.eq(head_blocks), consumed_with_wqe.eq(consumed + head_blocks),
                             wqe_index.eq(head_index), block0.eq(head.data), facts0.eq(head.facts),
                             read_err.eq(0)]
            with m.Else():
                m.d.sync += [blocks_after.eq(blocks_after - 1), read_err.eq(read_err | head.bad)]
            with m.If(last):
                m.d.sync += [
                    fetch_start.eq(1), consumed.eq(0), dropping.eq(0), in_wqe.eq(0),
                    self.fetch_done.valid.eq(1),
                    self.fetch_done.payload.qpn.eq(cur.qpn),
                    self.fetch_done.payload.consumed.eq(consumed_now),
                    self.fetch_done.payload.epoch.eq(cur.epoch),
                ]
        with m.If(empty_fetch):
            m.d.sync += [
                self.fetch_done.valid.eq(1),
                self.fetch_done.payload.qpn.eq(cur.qpn),
                self.fetch_done.payload.consumed.eq(0),
                self.fetch_done.payload.epoch.eq(cur.epoch),
            ]

    @staticmethod
    def _facts(m, facts, block0):
        """The format checks of the WQE whose first block is ``block0`` (docs/nic.md's
        segment table), into ``facts``."""
        opmod = block0[0:8]
        opcode = block0[24:32]
        ds = block0[56:62]
        word16 = _be(block0, 16, 4)
        word32 = _be(block0, 32, 4)
        word48 = _be(block0, 48, 4)

        ok, syndrome = facts.ok, facts.syndrome
        has_raddr, has_atomic = facts.has_raddr, facts.has_atomic
        has_data, has_inline = facts.has_data, facts.has_inline
        data_at, inline_len = facts.data_at, facts.inline_len
        # Not ok unless a rule below says so; an error is LOCAL_QP_OP_ERR unless it says so.
        m.d.comb += syndrome.eq(Syndrome.LOCAL_QP_OP_ERR)

        def data_or_inline(at, word, base):
            # ``base``: ds of the WQE without its data (the empty form); its data segments
            # (a gather list: up to four) from byte 16 * at on.
            length = word[:31]
            segments = (length[:9] + 4 + 15) >> 4
            # The segment's first word is part of the WQE only when ds goes beyond the base.
            with m.If(ds == base):
                m.d.comb += ok.eq(1)
            with m.Elif((ds > base) & word[31]):
                with m.If(length > MAX_INLINE_BYTES):
                    m.d.comb += syndrome.eq(Syndrome.LOCAL_LENGTH_ERR)
                with m.Elif(ds == base + segments):
                    m.d.comb += [ok.eq(1), has_inline.eq(1), inline_len.eq(length),
                                 facts.carried_len.eq(Mux(length <= DESCRIPTOR_INLINE_BYTES,
                                                          length, 0))]
            with m.Elif((ds > base) & (ds <= base + MAX_GATHER_SEGMENTS)):
                # Segment s (0 first) is in the list when ds > base + s; none inline-marked.
                marked_first = []
                for s in range(1, MAX_GATHER_SEGMENTS):
                    position = 16 * (at + s)
                    if position < WQEBB_BYTES:
                        marked_first.append((ds > base + s) & block0[8 * position + 7])
                    else:
                        second = (position - WQEBB_BYTES) // 16
                        m.d.comb += facts.check_second[second].eq(ds > base + s)
                m.d.comb += [ok.eq(~Cat(*marked_first).any()), has_data.eq(1), data_at.eq(at),
                             facts.segments.eq(ds - base)]

        with m.Switch(opcode):
            with m.Case(MlxOpcode.RDMA_WRITE, MlxOpcode.RDMA_WRITE_IMM):
                m.d.comb += has_raddr.eq(1)
                data_or_inline(2, word32, 2)
            with m.Case(MlxOpcode.SEND, MlxOpcode.SEND_IMM):
                data_or_inline(1, word16, 1)
            with m.Case(MlxOpcode.RDMA_READ):
                m.d.comb += [has_raddr.eq(1), has_data.eq(1), data_at.eq(2), facts.segments.eq(1),
                             ok.eq((ds == 3) & ~word32[31])]
            with m.Case(MlxOpcode.ATOMIC_CS, MlxOpcode.ATOMIC_FA):
                m.d.comb += [has_raddr.eq(1), has_atomic.eq(1), has_data.eq(1), data_at.eq(3),
                             facts.segments.eq(1)]
                with m.If((ds == 4) & (word48 != 8)):
                    m.d.comb += syndrome.eq(Syndrome.LOCAL_LENGTH_ERR)
                m.d.comb += ok.eq((ds == 4) & (word48 == 8))
            # NVSHMEM's masked atomics: the opmod is the operand size; an 8-byte masked CS
            # has a second atomic segment (ds 5), its data segment the next block's first,
            # whose word the parser checks (``_fields``).
            with m.Case(MlxOpcode.ATOMIC_MASKED_CS, MlxOpcode.ATOMIC_MASKED_FA):
                size4 = opmod == EXT_AMO_OPMOD_4
                two = (opcode == MlxOpcode.ATOMIC_MASKED_CS) & (opmod == EXT_AMO_OPMOD_8)
                shape = (size4 | (opmod == EXT_AMO_OPMOD_8)) & (ds == Mux(two, 5, 4))
                word_ok = two | (word48 == Mux(size4, 4, 8))
                m.d.comb += [has_raddr.eq(1), has_atomic.eq(1), has_data.eq(1),
                             data_at.eq(Mux(two, 4, 3)), facts.segments.eq(1),
                             ok.eq(shape & word_ok)]
                with m.If(shape):
                    m.d.comb += syndrome.eq(Syndrome.LOCAL_LENGTH_ERR)
            # NVSHMEM's two forms, ds 2 (ibgda_write_nop_wqe: the second unit unwritten)
            # and ds 1 (ending a warp-combined put); opmod 0 as it writes them.
            with m.Case(MlxOpcode.NOP):
                m.d.comb += ok.eq(((ds == 1) | (ds == 2)) & (opmod == 0))
            with m.Case(MlxOpcode.DUMP):
                m.d.comb += [has_data.eq(1), data_at.eq(1), facts.segments.eq(1),
                             ok.eq((ds == 2) & ~word16[31] & (opmod == 0))]

    @staticmethod
    def _fields(m, desc, facts, *, block0, block1, bad0, bad_later):
        """The descriptor fields of the WQE whose first two blocks are ``block0`` and
        ``block1``, the first's format checks ``facts``."""
        opcode = block0[24:32]
        ds = block0[56:62]
        raddr_at = _segment(block0, 16)
        ok, syndrome = facts.ok, facts.syndrome
        has_raddr, has_atomic = facts.has_raddr, facts.has_atomic
        has_data, has_inline = facts.has_data, facts.has_inline
        data_at, inline_len = facts.data_at, facts.inline_len

        good = Signal()
        segment = Signal(128)
        with m.Switch(data_at):
            for at in (1, 2, 3):
                with m.Case(at):
                    m.d.comb += segment.eq(_segment(block0, 16 * at))
            with m.Case(4):
                m.d.comb += segment.eq(_segment(block1, 0))
        # An 8-byte masked CS's data segment is in its second block: its word checked here.
        word_bad = (data_at == 4) & (_be(block1, 0, 4) != 8)
        # A gather list's segments in the second block must not be inline-marked.
        marked_second = ((facts.check_second[0] & block1[7])
                         | (facts.check_second[1] & block1[8 * 16 + 7]))
        m.d.comb += good.eq(ok & ~word_bad & ~marked_second & ~bad0 & ~bad_later)
        # Inline data runs on from the first block into the second.
        both = Cat(block0, block1)
        window = Mux(opcode[1], both[8 * 20:8 * (20 + DESCRIPTOR_INLINE_BYTES)],
                     both[8 * 36:8 * (36 + DESCRIPTOR_INLINE_BYTES)])
        inline_data = Cat(*(Mux(k < facts.carried_len, window[8 * k:8 * (k + 1)], 0)
                            for k in range(DESCRIPTOR_INLINE_BYTES)))

        with m.If(~bad0):
            m.d.comb += [
                desc.opcode.eq(opcode),
                desc.opmod.eq(block0[0:8]),
                desc.ds.eq(ds),
                desc.fm_ce_se.eq(block0[88:96]),
                desc.imm.eq(_be(block0, 12, 4)),
            ]
        with m.If(good):
            with m.If(has_raddr):
                m.d.comb += [desc.raddr.eq(_be(raddr_at, 0, 8)), desc.rkey.eq(_be(raddr_at, 8, 4))]
            with m.If(has_atomic):
                masked = opcode[2]              # 0x14, 0x15; the plain ones are 0x11, 0x12
                size4 = block0[0:8] == EXT_AMO_OPMOD_4
                # Masked FA {add, field boundary}; CS {swap, compare, swap mask, compare
                # mask}: the k-th operand of 4 or 8 bytes (an 8-byte CS's masks are its
                # second atomic segment, bytes 48..63).
                def operand(k):
                    return Mux(size4, _be(block0, 32 + 4 * k, 4), _be(block0, 32 + 8 * k, 8))
                with m.If(~masked):
                    m.d.comb += [desc.swap_add.eq(_be(block0, 32, 8)),
                                 desc.compare.eq(_be(block0, 40, 8))]
                with m.Elif(opcode == MlxOpcode.ATOMIC_MASKED_FA):
                    m.d.comb += [desc.swap_add.eq(operand(0)), desc.swap_mask.eq(operand(1))]
                with m.Else():
                    m.d.comb += [desc.swap_add.eq(operand(0)), desc.compare.eq(operand(1)),
                                 desc.swap_mask.eq(operand(2)), desc.compare_mask.eq(operand(3))]
            with m.If(has_data):
                m.d.comb += [
                    desc.has_data.eq(1),
                    desc.segments.eq(facts.segments),
                    desc.byte_count.eq(_be(segment, 0, 4)),
                    desc.lkey.eq(_be(segment, 4, 4)),
                    desc.laddr.eq(_be(segment, 8, 8)),
                ]
                # A gather list's later segments follow the first (at byte 32 of a WRITE,
                # 16 of a SEND), into the second block.
                for s in range(1, MAX_GATHER_SEGMENTS):
                    later = Mux(data_at == 2, _segment(both, 16 * (2 + s)),
                                _segment(both, 16 * (1 + s)))
                    with m.If(facts.segments > s):
                        m.d.comb += [
                            desc.more_segments[s - 1].byte_count.eq(_be(later, 0, 4)),
                            desc.more_segments[s - 1].lkey.eq(_be(later, 4, 4)),
                            desc.more_segments[s - 1].laddr.eq(_be(later, 8, 8)),
                        ]
            with m.If(has_inline):
                m.d.comb += [desc.inline.eq(1), desc.byte_count.eq(inline_len),
                             desc.inline_data.eq(inline_data)]
        with m.Else():
            m.d.comb += [desc.format_error.eq(1), desc.syndrome.eq(syndrome)]
            with m.If(ok & word_bad):
                m.d.comb += desc.syndrome.eq(Syndrome.LOCAL_LENGTH_ERR)
            with m.If(bad0 | bad_later):
                m.d.comb += desc.syndrome.eq(Syndrome.LOCAL_QP_OP_ERR)
