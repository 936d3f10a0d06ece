"""Simulation-only packet checker: checks :class:`PacketGenerator` streams in gateware.

The partner of :mod:`tb.gateware.packet_generator` (whose docstring has the
measured speed): a benchmark reads this block's counters instead of looking at
every beat from Python, and computes throughput from ``first_start_cycle``,
``last_end_cycle`` and the byte counts.

Checks, per packet (LRH .. ICRC, no VCRC, as a block's stream carries it):

* ``end_bad``: the end beat carries ``end_bad``.
* ``bad_length``: the bytes received are not ``4 * LRH.PktLen``, PktLen is below 6
  words (LRH + BTH + ICRC), or a start beat arrived inside a packet (the cut
  packet counts here).
* ``bad_payload``: a payload word differs from the generator's sequence,
  regenerated from the packet's own PSN and SLID (``payload_bytes``).
* ``bad_icrc``: :class:`hdl.crc.icrc_engine.IcrcEngine` (check mode) rejects it.
* ``out_of_order``: its PSN is not the last PSN from the same source plus one
  (mod 2^24); with ``psn_increasing`` high, not *after* the last PSN from the same
  source, ``(psn - last - 1) mod 2^24 < 2^23`` (a checker behind a switch sees
  only the packets each source sent to it: gaps are expected and count as
  nothing, a repeated or earlier PSN counts). A source is ``SLID mod sources``;
  the first packet of a source sets its PSN. With ``psn_vls = n > 1`` a source has
  one PSN tracker per LRH.VL (``VL mod n``): behind a switch, order holds per
  (input, output, VL) only. Every packet that got as far as the end of its BTH updates its
  source's PSN, good or not, so a lost packet counts once here and a corrupt one
  (unless its PSN itself was hit) not at all.

Each packet counts in exactly one of ``good_packets``, ``end_bad``,
``bad_length``, ``bad_payload``, ``bad_icrc``, ``out_of_order``, in that order
of precedence (a flipped payload bit also breaks the ICRC: it counts as
``bad_payload``), so their sum is ``received_packets``. ``stray_beats`` counts
beats outside a packet (no start beat before them); they are otherwise ignored.

Ports
-----
data_in : In(stream.Signature(BeatLayout(width)))
stall_rate : In(8)
    ``ready`` is low on a cycle with probability ``stall_rate / 256`` (an LFSR
    draws it); 0 keeps ``ready`` high.
psn_increasing : In(1)
    PSN order per source: strictly increasing instead of +1 steps (above).
clear : In(1)
    Zero every counter and forget the first start cycle (the PSN trackers stay).
received_packets, good_packets, end_bad, bad_length, bad_payload, bad_icrc,
out_of_order, stray_beats : Out(32)
good_bytes : Out(48)
    Payload bytes of the good packets (``4 * PktLen - 24`` each).
beats : Out(32)
    Beats accepted (including stray ones).
cycle : Out(32)
    Free-running cycle counter since reset.
first_start_cycle, last_end_cycle : Out(32)
    ``cycle`` when the first start beat (since reset/clear) and the latest end
    beat were accepted; ``first_seen`` says the former is meaningful.
source_packets : Out(32).array(sources), source_bytes : Out(48).array(sources)
    Only with ``per_source=True``: good packets and their payload bytes per source
    (for fairness figures such as Jain's index over the inputs of an incast).
"""
from amaranth import Array, C, Cat, DomainRenamer, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.crc.icrc_engine import IcrcEngine
from hdl.ib.headers import BTH, LRH, from_wire
from hdl.link.signatures import BeatLayout, check_width

from .packet_generator import HEADER_WORDS, MAX_PKTLEN_WORDS, core_domain, lfsr_sequence, registered, seed_signal

__all__ = ["PacketChecker", "ERROR_COUNTERS"]

ERROR_COUNTERS = ("end_bad", "bad_length", "bad_payload", "bad_icrc", "out_of_order")


class PacketChecker(wiring.Component):
    """See the module docstring."""

    def __init__(self, width=64, sources=16, per_source=False, psn_vls=1):
        check_width(width)
        if not isinstance(sources, int) or not 1 <= sources <= 256 or sources & (sources - 1):
            raise ValueError(f"Sources must be a power of two from 1 to 256, not {sources!r}")
        if not isinstance(psn_vls, int) or not 1 <= psn_vls <= 16 or psn_vls & (psn_vls - 1):
            raise ValueError(f"psn_vls must be a power of two from 1 to 16, not {psn_vls!r}")
        self.psn_vls = psn_vls
        self.width = width
        self.sources = sources
        self.per_source = bool(per_source)
        extra = {}
        if self.per_source:
            extra = {"source_packets": Out(32).array(sources), "source_bytes": Out(48).array(sources)}
        super().__init__({
            "data_in": In(stream.Signature(BeatLayout(width))),
            "stall_rate": In(8),
            "psn_increasing": In(1),
            "clear": In(1),
            "received_packets": Out(32),
            "good_packets": Out(32),
            "good_bytes": Out(48),
            **{name: Out(32) for name in ERROR_COUNTERS},
            "stray_beats": Out(32),
            "beats": Out(32),
            "cycle": Out(32),
            "first_start_cycle": Out(32),
            "first_seen": Out(1),
            "last_end_cycle": Out(32),
            **extra,
        })

    def elaborate(self, platform):
        m = Module()
        width = self.width
        lanes = width // 4
        shift = exact_log2(width)
        max_beats = -(-4 * MAX_PKTLEN_WORDS // width) + 1
        beat_in = self.data_in.payload
        core = core_domain(m, "checker_core")
        stall_rate = registered(m, core, self.stall_rate)
        clear = registered(m, core, self.clear)
        psn_increasing = registered(m, core, self.psn_increasing)

        # --- backpressure ---
        stall_rng = Signal(16, init=0x1D2B)
        ready = Signal(init=1)
        m.d[core] += [
            stall_rng.eq(Mux(stall_rng[0], (stall_rng >> 1) ^ 0xB400, stall_rng >> 1)),
            ready.eq(stall_rng[:8] >= stall_rate),
        ]
        m.d.comb += self.data_in.ready.eq(ready)
        accepted = Signal()
        m.d.comb += accepted.eq(self.data_in.valid & ready)

        m.d[core] += self.cycle.eq(self.cycle + 1)

        # --- framing ---
        in_packet = Signal()
        beat_count = Signal(range(max_beats + 1))       # beats of the packet so far
        start = beat_in.start
        end = beat_in.end
        take = Signal()                 # a beat of a packet
        stray = Signal()
        cut = Signal()                  # a start beat inside a packet: that packet is cut short
        m.d.comb += [
            take.eq(accepted & (start | in_packet)),
            stray.eq(accepted & ~start & ~in_packet),
            cut.eq(accepted & start & in_packet),
        ]
        beat = Signal.like(beat_count)
        m.d.comb += beat.eq(Mux(start, 0, beat_count))
        with m.If(take):
            m.d[core] += [
                in_packet.eq(~end),
                beat_count.eq(Mux(end, 0, Mux(beat == max_beats, max_beats, beat + 1))),
            ]

        # --- header: words 0..4 may span several narrow beats ---
        words = [beat_in.data[32 * lane:32 * lane + 32] for lane in range(lanes)]
        header_kept = Signal(32 * HEADER_WORDS)
        header_words = []
        for word in range(HEADER_WORDS):
            b, lane = divmod(word, lanes)
            kept = header_kept[32 * word:32 * word + 32]
            header_words.append(Mux(beat == b, words[lane], kept))
            with m.If(take & (beat == b)):
                m.d[core] += kept.eq(words[lane])
        header = Signal(32 * HEADER_WORDS)
        m.d.comb += header.eq(Cat(*header_words))
        lrh = from_wire(LRH, header[:64])
        bth = from_wire(BTH, header[64:])
        pktlen = Signal(11)
        psn = Signal(24)
        slid = Signal(16)
        m.d.comb += [pktlen.eq(lrh.pktlen), psn.eq(bth.psn), slid.eq(lrh.slid)]
        body_words = Signal(11)
        m.d.comb += body_words.eq(pktlen - 1)

        # --- payload against the regenerated sequence ---
        header_beat = (HEADER_WORDS - 1) // lanes      # the beat that completes the header
        seed = seed_signal(m, psn, slid)
        lfsr = Signal(32)
        lfsr_now = Signal(32)
        seed_advanced = lfsr_sequence(m, seed, header_beat * lanes, name="seed_step")[-1]
        m.d.comb += lfsr_now.eq(Mux(beat == header_beat, seed_advanced, lfsr))
        expected = lfsr_sequence(m, lfsr_now, lanes, name="expected")
        with m.If(take):
            m.d[core] += lfsr.eq(expected[lanes])
        base = Signal(range(max_beats * lanes + lanes + 1))
        m.d.comb += base.eq(beat * lanes)
        mismatches = []
        for lane in range(lanes):
            index = base + lane
            present = ~end | (beat_in.count >= 4 * lane + 4)
            compared = (index >= HEADER_WORDS) & (index < body_words) & present
            mismatches.append(compared & (words[lane] != expected[lane]))
        payload_bad_kept = Signal()
        payload_bad = Signal()
        m.d.comb += payload_bad.eq((payload_bad_kept & ~start) | Cat(*mismatches).any())
        with m.If(take):
            m.d[core] += payload_bad_kept.eq(payload_bad)

        # --- ICRC ---
        m.submodules.icrc = icrc = DomainRenamer(core)(IcrcEngine(width, "check"))
        m.d.comb += [
            icrc.valid.eq(take),
            icrc.start.eq(start),
            icrc.end.eq(end),
            icrc.count.eq(beat_in.count),
            icrc.data.eq(beat_in.data),
        ]

        # --- length ---
        received_bytes = Signal(range(max_beats * width + width + 1))
        m.d.comb += received_bytes.eq((beat << shift) + beat_in.count)
        length_ok = Signal()
        m.d.comb += length_ok.eq((pktlen >= HEADER_WORDS + 1) & (received_bytes == 4 * pktlen))

        # --- PSN order per source ---
        source_bits = exact_log2(self.sources)
        source = slid[:source_bits] if source_bits else C(0, 1)
        vl_bits = exact_log2(self.psn_vls)
        tracker = Cat(lrh.vl[:vl_bits], source) if vl_bits else source
        trackers = self.sources * self.psn_vls
        last_psn = Array(Signal(24, name=f"last_psn{s}") for s in range(trackers))
        seen = Array(Signal(name=f"seen{s}") for s in range(trackers))
        in_order = Signal()
        step = Signal(24)               # psn - last - 1, mod 2^24
        m.d.comb += [
            step.eq(psn - last_psn[tracker] - 1),
            in_order.eq(~seen[tracker] | Mux(psn_increasing, ~step[23], step == 0)),
        ]

        ending = Signal()
        m.d.comb += ending.eq(take & end)
        with m.If(ending & (received_bytes >= 4 * HEADER_WORDS)):
            m.d[core] += [seen[tracker].eq(1), last_psn[tracker].eq(psn)]

        # --- counters ---
        verdict = {name: Signal(name=f"is_{name}") for name in ("good", *ERROR_COUNTERS)}
        with m.If(beat_in.end_bad):
            m.d.comb += verdict["end_bad"].eq(1)
        with m.Elif(~length_ok):
            m.d.comb += verdict["bad_length"].eq(1)
        with m.Elif(payload_bad):
            m.d.comb += verdict["bad_payload"].eq(1)
        with m.Elif(~icrc.icrc_ok):
            m.d.comb += verdict["bad_icrc"].eq(1)
        with m.Elif(~in_order):
            m.d.comb += verdict["out_of_order"].eq(1)
        with m.Else():
            m.d.comb += verdict["good"].eq(1)

        with m.If(clear):
            m.d[core] += [getattr(self, name).eq(0) for name in (
                "received_packets", "good_packets", "good_bytes", *ERROR_COUNTERS, "stray_beats",
                "beats", "first_seen", "first_start_cycle", "last_end_cycle")]
        with m.Else():
            m.d[core] += [
                self.received_packets.eq(self.received_packets + ending + cut),
                self.good_packets.eq(self.good_packets + (ending & verdict["good"])),
                self.good_bytes.eq(self.good_bytes + Mux(ending & verdict["good"],
                                                         4 * (pktlen - HEADER_WORDS - 1), 0)),
                self.end_bad.eq(self.end_bad + (ending & verdict["end_bad"])),
                self.bad_length.eq(self.bad_length + (ending & verdict["bad_length"]) + cut),
                self.bad_payload.eq(self.bad_payload + (ending & verdict["bad_payload"])),
                self.bad_icrc.eq(self.bad_icrc + (ending & verdict["bad_icrc"])),
                self.out_of_order.eq(self.out_of_order + (ending & verdict["out_of_order"])),
                self.stray_beats.eq(self.stray_beats + stray),
                self.beats.eq(self.beats + accepted),
            ]
            with m.If(take & start & ~self.first_seen):
                m.d[core] += [self.first_seen.eq(1), self.first_start_cycle.eq(self.cycle)]
            with m.If(ending):
                m.d[core] += self.last_end_cycle.eq(self.cycle)
        if self.per_source:
            packets = Array(self.source_packets)
            nbytes = Array(self.source_bytes)
            with m.If(clear):
                m.d[core] += [c.eq(0) for c in (*self.source_packets, *self.source_bytes)]
            with m.Elif(ending & verdict["good"]):
                m.d[core] += [packets[source].eq(packets[source] + 1),
                              nbytes[source].eq(nbytes[source] + 4 * (pktlen - HEADER_WORDS - 1))]
        return m
