from amaranth import *
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from hdl.arith import lookahead_sum
from hdl.ib.headers import (
    AETH, AETH_BYTES, ATOMIC_ACK_ETH, ATOMIC_ACK_ETH_BYTES, BTH_BYTES, LRH_BYTES,
    iba_local_headers, to_wire,
)
from hdl.nic.packet_assembler import MAX_DMA_BEATS
from hdl.nic.payload_reads import dma_payload, payload_bursts, payload_read_stage, payload_words
from hdl.nic.signatures import (
    PSN_BITS, RESPONSE_ID, ArLayout, PacketDescriptorLayout, PayloadSource,
    ResponseCommandLayout, ResponseKind,
)

__all__ = ["ResponseGenerator"]

# IBA RC BTH opcodes of responses (IBA table 38).
READ_RESPONSE_FIRST = 0x0D
READ_RESPONSE_MIDDLE = 0x0E
READ_RESPONSE_LAST = 0x0F
READ_RESPONSE_ONLY = 0x10
ACKNOWLEDGE = 0x11
ATOMIC_ACKNOWLEDGE = 0x12

# The longest response header: LRH + BTH + AETH + AtomicAckETH.
RESPONSE_HEADER_BYTES = LRH_BYTES + BTH_BYTES + AETH_BYTES + ATOMIC_ACK_ETH_BYTES
OPCODE_BYTE = LRH_BYTES                  # BTH.OpCode: the first BTH byte
SYNDROME_BYTE = LRH_BYTES + BTH_BYTES    # AETH.Syndrome: the first AETH byte


class _QueuedLayout(data.StructLayout):
    """A packet descriptor as the queue holds it: responses never carry inline data and
    their headers are shorter than the requester's, so only these fields are stored."""
    def __init__(self):
        super().__init__({
            "vl": 4,
            "header": 8 * RESPONSE_HEADER_BYTES,
            "header_bytes": range(RESPONSE_HEADER_BYTES + 1),
            "payload_bytes": range(4096 + 1),
            "source": PayloadSource,
            "offset": 6,
            "dma_beats": range(MAX_DMA_BEATS + 1),
        })


class _ItemLayout(data.StructLayout):
    """One packet with the payload reads it needs (one burst, two if it crosses 4 KiB)."""
    def __init__(self):
        super().__init__({
            "desc": _QueuedLayout(),
            "n_ar": range(3),
            "ar0_addr": 64, "ar0_len": 8,
            "ar1_addr": 64, "ar1_len": 8,
        })


class ResponseGenerator(wiring.Component):
    """Turns response commands into IB RC response packet descriptors and READ payload
    reads for a :class:`PacketAssembler` of its own (docs/nic-responder.md).

    Pipeline, each stage a register that moves on when the next one takes it:

    1. the segmenter holds the command and builds one packet per cycle: an ACKNOWLEDGE
       (AETH from the command) or an ATOMIC ACKNOWLEDGE (AETH, AtomicAckETH with
       ``orig``) is one packet; a READ of ``length`` bytes is ``max(1, ceil(length /
       MTU))`` packets, PSNs from ``psn`` on (modulo 2^24), RDMA READ response ONLY, or
       FIRST, MIDDLE..., LAST, with the command's AETH on all but the MIDDLE ones and
       payload ``[va + i * MTU, ...)``;
    2. the read stage reserves the packet's beats of the assembler's payload buffer
       (``payload_buffer_beats``, given back one per ``payload_freed``) and issues its
       one or two bursts (id ``RESPONSE_ID``, cut at 4 KiB);
    3. a queue of ``packet_queue_depth`` descriptors towards the assembler, so that
       reads run ahead of the packets being sent by as much as the payload buffer
       allows (the assembler takes a descriptor only when the previous packet ends):
       a long READ keeps the wire busy once the memory latency is covered (64 entries:
       the 64-byte words of 64 packets of 256 bytes, 320 cycles of wire, cover a memory
       latency of 200 cycles at the smallest MTU).

    A stream of one-packet commands runs at one per cycle while the outputs are ready; a
    packet whose payload crosses 4 KiB takes two cycles of the read stage. LRH.SLID is
    ``slid``; BTH.SE, M, TVer and AckReq are 0. Counters count descriptors as they leave
    on ``packet``: ``acks_sent`` / ``naks_sent`` ACKNOWLEDGEs whose AETH syndrome bits
    7..5 are zero / not zero, ``read_response_packets``, ``atomic_responses``.

    Bad input: a command that cannot be sent is dropped and counted in ``bad_commands``:
    an unknown ``kind``, a ``vl`` this port does not have (``num_vls`` .. 15), or a READ
    whose ``mtu`` code is outside 1..5. A READ address range that wraps 2^64 is read
    modulo 2^64 (the responder engine's range checks reject it first).
    ``payload_freed`` with no beat reserved is ignored.
    """

    def __init__(self, *, num_vls=2, payload_buffer_beats=512, packet_queue_depth=64):
        for name, value, low, high in (
                ("num_vls", num_vls, 1, 15),
                ("payload_buffer_beats", payload_buffer_beats, MAX_DMA_BEATS, 1 << 16),
                ("packet_queue_depth", packet_queue_depth, 2, 1024)):
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer from {low} to {high}, not {value!r}")
        self.num_vls = num_vls
        self.payload_buffer_beats = payload_buffer_beats
        self.packet_queue_depth = packet_queue_depth
        super().__init__({
            "command": In(stream.Signature(ResponseCommandLayout())),
            "slid": In(16),
            "packet": Out(stream.Signature(PacketDescriptorLayout())),
            "ar": Out(stream.Signature(ArLayout())),
            "payload_freed": In(1),
            "acks_sent": Out(32),
            "naks_sent": Out(32),
            "read_response_packets": Out(32),
            "atomic_responses": Out(32),
            "bad_commands": Out(32),
        })

    def elaborate(self, platform):
        m = Module()

        # --- stage 1: segmenter --------------------------------------------------------------
        # The packet in hand is kept in registers that each field of its descriptor and
        # reads is a few LUTs from, its payload's words among them: the read stage
        # subtracts those from its room in the cycle it takes the packet. Each is loaded
        # from the command or stepped to the READ's next packet.
        j_valid = Signal()
        job = Signal(ResponseCommandLayout())
        va = Signal(64)                         # the packet's first byte
        remaining = Signal(32)                  # bytes of the READ from va on (else 0)
        fits = Signal()                         # the last: not a READ, or remaining <= MTU
        psn = Signal(PSN_BITS)
        first = Signal()
        mtu_bytes = Signal(range(4096 + 1))
        has_payload = Signal()                  # a READ of at least one byte
        # 64-byte words (and one fewer, modulo 2^7) of the packet's payload, of the bytes
        # of the READ from va on, of a whole MTU from va's offset.
        beats, beats_less1 = Signal(7), Signal(7)
        rest_beats, rest_less1 = Signal(7), Signal(7)
        mtu_beats, mtu_less1 = Signal(7), Signal(7)
        j_out = Signal()
        j_last = Signal()

        cmd = self.command.payload
        is_read_cmd = cmd.kind == ResponseKind.READ
        good = ((cmd.vl < self.num_vls)
                & ((cmd.kind == ResponseKind.ACK) | (cmd.kind == ResponseKind.ATOMIC)
                   | (is_read_cmd & (cmd.mtu >= 1) & (cmd.mtu <= 5))))
        m.d.comb += self.command.ready.eq(~j_valid | (j_out & j_last))
        accepted = self.command.valid & self.command.ready
        with m.If(accepted & ~good):
            m.d.sync += self.bad_commands.eq(self.bad_commands + 1)

        is_read = job.kind == ResponseKind.READ
        is_atomic = job.kind == ResponseKind.ATOMIC
        last = fits
        plen = Signal(range(4096 + 1))
        m.d.comb += [
            plen.eq(Mux(fits, remaining, mtu_bytes)),
            j_last.eq(last),
        ]

        opcode = Signal(8)
        with m.If(is_atomic):
            m.d.comb += opcode.eq(ATOMIC_ACKNOWLEDGE)
        with m.Elif(~is_read):
            m.d.comb += opcode.eq(ACKNOWLEDGE)
        with m.Elif(first & last):
            m.d.comb += opcode.eq(READ_RESPONSE_ONLY)
        with m.Elif(first):
            m.d.comb += opcode.eq(READ_RESPONSE_FIRST)
        with m.Elif(last):
            m.d.comb += opcode.eq(READ_RESPONSE_LAST)
        with m.Else():
            m.d.comb += opcode.eq(READ_RESPONSE_MIDDLE)

        with_aeth = ~is_read | first | last
        header_bytes = Signal(range(RESPONSE_HEADER_BYTES + 1))
        m.d.comb += header_bytes.eq(LRH_BYTES + BTH_BYTES + Mux(with_aeth, AETH_BYTES, 0)
                                    + Mux(is_atomic, ATOMIC_ACK_ETH_BYTES, 0))

        headers = iba_local_headers(
            m, vl=job.vl, sl=job.sl, dlid=job.dlid, slid=self.slid, opcode=opcode,
            pkey=job.pkey, destqp=job.destqp, psn=psn, header_bytes=header_bytes,
            payload_bytes=plen)
        aeth = Signal(AETH)
        atomic_ack = Signal(ATOMIC_ACK_ETH)
        m.d.comb += [
            aeth.syndrome.eq(job.syndrome), aeth.msn.eq(job.msn),
            atomic_ack.orig.eq(job.orig),
        ]
        ext = Signal(8 * (AETH_BYTES + ATOMIC_ACK_ETH_BYTES))
        with m.If(with_aeth):
            m.d.comb += ext.eq(Cat(to_wire(AETH, aeth),
                                   Mux(is_atomic, to_wire(ATOMIC_ACK_ETH, atomic_ack), 0)))

        # Payload reads: the 64-byte words holding the packet's bytes, cut at 4 KiB.
        bursts = payload_bursts(m, va, beats, beats_less1)

        item = Signal(_ItemLayout())
        m.d.comb += [
            item.desc.vl.eq(job.vl),
            item.desc.header.eq(Cat(headers, ext)),
            item.desc.header_bytes.eq(header_bytes),
            item.desc.payload_bytes.eq(plen),
        ]
        with m.If(has_payload):
            m.d.comb += dma_payload(item, bursts)

        # A command's first packet.
        cmd_mtu_bytes = Signal(range(4096 + 1))
        cmd_fits = Signal()
        cmd_has_payload = Signal()
        m.d.comb += [
            cmd_mtu_bytes.eq(Const(128, 13) << cmd.mtu),
            cmd_fits.eq(~is_read_cmd | (cmd.length <= cmd_mtu_bytes)),
            cmd_has_payload.eq(is_read_cmd & (cmd.length != 0)),
        ]
        cmd_rest_beats, cmd_rest_less1 = payload_words(m, cmd.va[:6], cmd.length, name="cmd_rest")
        cmd_mtu_beats, cmd_mtu_less1 = payload_words(m, cmd.va[:6], cmd_mtu_bytes, name="cmd_mtu")

        # The READ's next packet starts an MTU on; it is the last when the bytes left then
        # fit in an MTU, and holds those bytes and their words, else a whole MTU's.
        next_va = Signal(64)
        next_remaining = Signal(32)
        next_fits = Signal()
        next_rest_beats = Signal(7)
        next_rest_less1 = Signal(7)
        m.d.comb += [
            next_va.eq(lookahead_sum(m, va, mtu_bytes, name="next_va")),
            next_remaining.eq(lookahead_sum(m, remaining, ~Cat(mtu_bytes, C(0, 19)), 1,
                                            name="next_remaining")),
            next_fits.eq(remaining <= (mtu_bytes << 1)),
            next_rest_beats.eq(rest_beats - mtu_bytes[6:]),
            next_rest_less1.eq(rest_less1 - mtu_bytes[6:]),
        ]

        with m.If(j_out):
            with m.If(j_last):
                m.d.sync += j_valid.eq(0)
            with m.Else():
                m.d.sync += [
                    va.eq(next_va),
                    remaining.eq(next_remaining),
                    fits.eq(next_fits), psn.eq(psn + 1), first.eq(0),
                    rest_beats.eq(next_rest_beats), rest_less1.eq(next_rest_less1),
                    beats.eq(Mux(next_fits, next_rest_beats, mtu_beats)),
                    beats_less1.eq(Mux(next_fits, next_rest_less1, mtu_less1)),
                ]
        with m.If(accepted & good):
            m.d.sync += [
                j_valid.eq(1), job.eq(cmd),
                va.eq(cmd.va), remaining.eq(Mux(is_read_cmd, cmd.length, 0)),
                fits.eq(cmd_fits), psn.eq(cmd.psn), first.eq(1),
                mtu_bytes.eq(cmd_mtu_bytes), has_payload.eq(cmd_has_payload),
                rest_beats.eq(cmd_rest_beats), rest_less1.eq(cmd_rest_less1),
                mtu_beats.eq(cmd_mtu_beats), mtu_less1.eq(cmd_mtu_less1),
                beats.eq(Mux(cmd_fits, cmd_rest_beats, cmd_mtu_beats)),
                beats_less1.eq(Mux(cmd_fits, cmd_rest_less1, cmd_mtu_less1)),
            ]

        # --- stage 2: payload reads, then the descriptor queue ---------------------------------
        m.submodules.queue = queue = fifo.SyncFIFOBuffered(
            width=_QueuedLayout().size, depth=self.packet_queue_depth)
        p, p_out = payload_read_stage(
            m, layout=_ItemLayout(), item=item, item_valid=j_valid, item_taken=j_out,
            beats=beats, beats_less1=beats_less1,
            can_pass=queue.w_rdy, ar=self.ar, ar_id=RESPONSE_ID,
            buffer_beats=self.payload_buffer_beats, freed=self.payload_freed)
        m.d.comb += [queue.w_en.eq(p_out), queue.w_data.eq(p.desc)]

        queued = _QueuedLayout()(queue.r_data)
        desc = self.packet.payload
        m.d.comb += [
            self.packet.valid.eq(queue.r_rdy),
            queue.r_en.eq(self.packet.ready),
            desc.vl.eq(queued.vl),
            desc.header.eq(queued.header),
            desc.header_bytes.eq(queued.header_bytes),
            desc.payload_bytes.eq(queued.payload_bytes),
            desc.source.eq(queued.source),
            desc.offset.eq(queued.offset),
            desc.dma_beats.eq(queued.dma_beats),
        ]

        # --- counters: from the header of each descriptor that leaves ------------------------
        # Each increment under an enable: the event's decode runs beside the 32-bit
        # increment, not into its carries.
        sent = self.packet.valid & self.packet.ready
        sent_opcode = queued.header.word_select(OPCODE_BYTE, 8)
        sent_nak = queued.header.word_select(SYNDROME_BYTE, 8)[5:] != 0
        is_ack = sent_opcode == ACKNOWLEDGE
        for counter, event in (
                (self.acks_sent, is_ack & ~sent_nak),
                (self.naks_sent, is_ack & sent_nak),
                (self.read_response_packets,
                 (sent_opcode >= READ_RESPONSE_FIRST) & (sent_opcode <= READ_RESPONSE_ONLY)),
                (self.atomic_responses, sent_opcode == ATOMIC_ACKNOWLEDGE)):
            with m.If(sent & event):
                m.d.sync += counter.eq(counter + 1)
        return m
