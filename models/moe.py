"""What the fabric scenarios send, where it lands and what must be found there at the end
(docs/fabric.md, Scenarios): a DeepEP-style MoE step (:class:`MoePlan`) and a
prefill-to-decode KV-cache push under background all-to-all traffic (:class:`KvPlan`).

Pure Python: the cocotb scenario (tb/fabric_scenarios.py) posts the plan's writes and
signals and checks the memories against it; ``make sim`` validates its options with
:func:`scenario_config` before it builds anything.

MoE step (DeepEP low-latency mode), ``ranks`` ranks of ``tokens`` tokens each, expert ``e``
on rank ``e // experts_per_rank``:

- **routing**: each token picks ``topk`` distinct experts, drawn from the seed, the rank
  and the token (independent of any iteration order);
- **dispatch**: one message per (token, destination rank), even when several of the token's
  experts live there: FP8, ``16 + hidden + hidden / 128 * 4`` bytes (7,408 for hidden
  7,168): the header (:func:`dispatch_header`), the hidden vector and one float32 scale
  per 128 values; written from the source's send buffer into the destination's receive
  buffer at the slot of (source rank, token); then one signal per destination rank, every
  rank: DeepEP's ``nvshmemi_ibgda_amo_nonfetch_add`` of ``-count - 1`` on the source's
  4-byte dispatch signal word in the destination's memory (``count`` tokens sent there,
  zero included: a word that is still 0 has not been signalled; the receiver decodes
  ``-word - 1``, :func:`signalled_count`);
- **combine**: each rank sends every token it received back to its source (BF16,
  ``2 * hidden`` bytes) into the source's combine buffer at (token, slot), ``slot`` being the
  destination's position among the token's destination ranks in ascending order; then
  adds 1 to its combine signal word in every source's memory (DeepEP's combine flag).

Tokens whose expert is on their own rank do not cross the network: the GPU copies them
(:meth:`MoePlan.local_dispatch`, :meth:`MoePlan.local_combine`), and stores its own
signal word (DeepEP's ``st_release_sys_global`` for a rank it reaches without RDMA).

Payload bytes are a function of (seed, phase, rank, token), so every byte's right place
is known: :meth:`MoePlan.expected` lists the receive buffers' final contents.
"""
import random
from dataclasses import dataclass

from models.fabric import LeafSpine, _check_int

__all__ = ["MoePlan", "KvPlan", "Write", "Signal", "dispatch_bytes", "combine_bytes",
           "dispatch_header", "parse_dispatch_header", "scenario_config", "signal_bytes",
           "signalled_count", "DEFAULTS",
           "DEFAULT_REGIONS", "HEADER_BYTES", "SLOT_ALIGN", "SIGNAL_BYTES", "MAX_TOPK",
           "MAX_EXPERTS", "CLOCK_NS", "BEAT_BYTES"]

HEADER_BYTES = 16
SCALE_GROUP = 128           # hidden values per FP8 scale (DeepEP: per-128-channel scales)
SCALE_BYTES = 4             # float32
MAX_TOPK = 8                # expert ids in the header
MAX_EXPERTS = 256           # an expert id is one byte
NO_EXPERT = 0xFF            # header filler after the token's top-k expert ids
SLOT_ALIGN = 64             # buffer slots start on a 64-byte beat
SIGNAL_BYTES = 4            # DeepEP's int signal words (rdma_recv_count, rdma_recv_flag)
CLOCK_NS = 2.5              # the fabric's clock (400 MHz), for derived figures
BEAT_BYTES = 64

# The regions of each NIC's 16 MiB memory the scenarios may use: tb/nic_pair_tb.py's
# SOURCE_REGION (the GPU's send buffers) and TARGET_REGION (what other NICs write).
# (base, bytes).
DEFAULT_REGIONS = {"send": (0x800000, 0x200000), "receive": (0xC00000, 0x400000)}

# Options of a scenario run (`make sim`), with their defaults. Derived keys (fabric shape,
# message sizes, clock) are added by scenario_config. Small, for a short `make sim`: the
# fabric simulates about 50 cycles/s under this traffic (docs/fabric.md, Figures).
DEFAULTS = dict(scenario="moe", ranks=8, spines=2, tokens=4, topk=2, experts_per_rank=2, hidden=7168,
                kv_block_bytes=65536, kv_blocks=8, kv_src=0, kv_dst=7, background_bytes=4096,
                background_messages=4, wire_delay=8, memory_latency=200, seed=1,
                pcap_link="nic0.p0", sample_cycles=500, ack_timeout=0, cut_link="", cut_at=500)
SCENARIOS = ("moe", "kv")
MAX_ACK_TIMEOUT = 31            # the QP context's 5-bit local ACK timeout code
# The fabric of a run: NICS_PER_LEAF ranks on each leaf (so ranks / 2 leaves and both path
# lengths, 1 and 3 switches), ``spines`` spines; a leaf has NICS_PER_LEAF + spines of the
# switch's at most 16 ports.
NICS_PER_LEAF = 2
MAX_SPINES = 14


def _round_up(n, align=SLOT_ALIGN):
    return -(-n // align) * align


def _check_hidden(hidden):
    _check_int("hidden", hidden, SCALE_GROUP)
    if hidden % SCALE_GROUP:
        raise ValueError(f"hidden must be a multiple of {SCALE_GROUP} (one FP8 scale per "
                         f"{SCALE_GROUP} values), not {hidden}")


def dispatch_bytes(hidden):
    """Bytes of one FP8 dispatch message: header, hidden vector, float32 scales."""
    return HEADER_BYTES + hidden + hidden // SCALE_GROUP * SCALE_BYTES


def combine_bytes(hidden):
    """Bytes of one BF16 combine message."""
    return 2 * hidden


def dispatch_header(token, source, experts):
    """The 16-byte dispatch header: token index (u32 LE), source rank (u16 LE), top-k (u8),
    a reserved 0 byte, then the token's expert ids (u8 each, in routing order, ``0xFF`` after
    the last). The routing weights stay with the source, which applies them to what comes
    back in the combine (as DeepEP's low-latency combine does)."""
    if len(experts) > MAX_TOPK:
        raise ValueError(f"at most {MAX_TOPK} experts fit in the header, not {len(experts)}")
    ids = bytes(experts) + bytes([NO_EXPERT] * (MAX_TOPK - len(experts)))
    return (token.to_bytes(4, "little") + source.to_bytes(2, "little") + bytes([len(experts), 0])
            + ids)


def parse_dispatch_header(header):
    """(token, source, experts) of a dispatch header."""
    topk = header[6]
    return (int.from_bytes(header[0:4], "little"), int.from_bytes(header[4:6], "little"),
            tuple(header[8:8 + topk]))


def signal_bytes(value):
    """A signal word holding ``value`` (a signed int), as GPU memory keeps it: 4 bytes,
    little-endian, two's complement."""
    return (value & ((1 << 8 * SIGNAL_BYTES) - 1)).to_bytes(SIGNAL_BYTES, "little")


def signalled_count(word):
    """The token count a dispatch signal word announces, as DeepEP's receiver decodes it
    (``num_recv_tokens = -num_recv_tokens - 1`` of the nonzero int); None while it is 0."""
    value = int.from_bytes(word, "little", signed=True)
    return None if value == 0 else -value - 1


def _stream(*key):
    """Deterministic bytes for ``key``: a generator seeded by the key's text."""
    return random.Random("/".join(str(k) for k in key))


@dataclass(frozen=True)
class Write:
    """One RDMA WRITE: ``payload`` from ``laddr`` in ``src``'s memory to ``raddr`` in
    ``dst``'s. ``token``: the token it carries (MoE: of ``src`` in the dispatch, of ``dst``
    in the combine), else None; ``index``: the message's number in its stream (KV block,
    background message)."""
    kind: str
    src: int
    dst: int
    laddr: int
    raddr: int
    payload: bytes
    token: int | None = None
    index: int | None = None

    @property
    def nbytes(self):
        return len(self.payload)


@dataclass(frozen=True)
class Signal:
    """DeepEP's signal: ``nvshmemi_ibgda_amo_nonfetch_add`` of ``add`` (a signed int) from
    ``src`` on the 4-byte word at ``address`` in ``dst``'s memory. ``src == dst``: the GPU
    stores ``add`` itself (no network; the word starts at 0)."""
    kind: str
    src: int
    dst: int
    address: int
    add: int


class _Regions:
    def __init__(self, regions):
        regions = {**DEFAULT_REGIONS, **(regions or {})}
        unknown = set(regions) - set(DEFAULT_REGIONS)
        if unknown:
            raise ValueError(f"unknown regions: {', '.join(sorted(unknown))}")
        (self.send, self.send_bytes), (self.receive, self.receive_bytes) = \
            (regions[k] for k in ("send", "receive"))

    def fit(self, region, need, what):
        have = getattr(self, f"{region}_bytes")
        if need > have:
            raise ValueError(f"{what}: {need:,} bytes do not fit the {region} region of "
                             f"{have:,} bytes")


class MoePlan:
    """One MoE step: routing, every WRITE and signal of dispatch and combine, the local
    copies, and the final contents of every receive buffer. Options are validated with
    ``ValueError`` naming the option."""

    def __init__(self, ranks=8, tokens=4, topk=2, experts_per_rank=2, hidden=7168, seed=1,
                 regions=None):
        _check_int("ranks", ranks, 2)
        _check_int("tokens", tokens, 1, 1 << 16)
        _check_int("experts_per_rank", experts_per_rank, 1)
        _check_hidden(hidden)
        _check_int("seed", seed, 0)
        experts = ranks * experts_per_rank
        if experts > MAX_EXPERTS:
            raise ValueError(f"ranks x experts_per_rank = {experts} experts: at most "
                             f"{MAX_EXPERTS} (an expert id is one byte of the header)")
        _check_int("topk", topk, 1, MAX_TOPK)
        if topk > experts:
            raise ValueError(f"topk {topk} exceeds ranks x experts_per_rank ({experts})")
        self.ranks, self.tokens, self.topk = ranks, tokens, topk
        self.experts_per_rank, self.experts = experts_per_rank, experts
        self.hidden, self.seed = hidden, seed
        self.dispatch_bytes, self.combine_bytes = dispatch_bytes(hidden), combine_bytes(hidden)
        self.dispatch_stride = _round_up(self.dispatch_bytes)
        self.combine_stride = _round_up(self.combine_bytes)
        self.slots = min(topk, ranks)       # destination ranks a token can have
        self.signal_area = _round_up(2 * ranks * SIGNAL_BYTES)
        r = self.regions = _Regions(regions)
        r.fit("send", tokens * self.dispatch_stride + ranks * tokens * self.combine_stride,
              f"tokens {tokens}: the send buffers (dispatch per token, combine per received "
              f"token)")
        r.fit("receive", self.signal_area + ranks * tokens * self.dispatch_stride
              + tokens * self.slots * self.combine_stride,
              f"tokens {tokens}: the receive buffers (dispatch per source and token, combine "
              f"per token and slot)")
        self.routing = {}
        for rank in range(ranks):
            for token in range(tokens):
                chosen = _stream("moe", seed, "topk", rank, token).sample(range(experts), topk)
                self.routing[(rank, token)] = tuple(chosen)
        self.destinations = {key: tuple(sorted({e // experts_per_rank for e in chosen}))
                             for key, chosen in self.routing.items()}

    # --- layout ------------------------------------------------------------------------

    def dispatch_send(self, token):
        return self.regions.send + token * self.dispatch_stride

    def combine_send(self, source, token):
        return (self.regions.send + self.tokens * self.dispatch_stride
                + (source * self.tokens + token) * self.combine_stride)

    def signal_word(self, phase, source):
        """Address of ``source``'s signal word for ``phase`` in any rank's memory."""
        return self.regions.receive + SIGNAL_BYTES * (self._phase(phase) * self.ranks + source)

    def dispatch_slot(self, source, token):
        return (self.regions.receive + self.signal_area
                + (source * self.tokens + token) * self.dispatch_stride)

    def combine_slot(self, token, slot):
        return (self.regions.receive + self.signal_area
                + self.ranks * self.tokens * self.dispatch_stride
                + (token * self.slots + slot) * self.combine_stride)

    @staticmethod
    def _phase(phase):
        return ("dispatch", "combine").index(phase)

    # --- payloads ----------------------------------------------------------------------

    def dispatch_payload(self, rank, token):
        body = _stream("moe", self.seed, "dispatch", rank, token).randbytes(
            self.dispatch_bytes - HEADER_BYTES)
        return dispatch_header(token, rank, self.routing[(rank, token)]) + body

    def combine_payload(self, expert_rank, source, token):
        return _stream("moe", self.seed, "combine", expert_rank, source, token).randbytes(
            self.combine_bytes)

    # --- dispatch ----------------------------------------------------------------------

    def staging(self, rank, phase):
        """(address, bytes) the GPU of ``rank`` writes into its send buffer before ``phase``:
        its tokens (dispatch), or its experts' outputs for the tokens it received from other
        ranks (combine)."""
        if phase == "dispatch":
            return [(self.dispatch_send(t), self.dispatch_payload(rank, t))
                    for t in range(self.tokens)]
        return [(self.combine_send(s, t), self.combine_payload(rank, s, t))
                for s, t in self.received(rank) if s != rank]

    def dispatch_writes(self, rank):
        """``{destination: [Write]}`` of ``rank``'s dispatch, in token order, every other
        rank a key (an empty list when no token goes there)."""
        out = {d: [] for d in range(self.ranks) if d != rank}
        for t in range(self.tokens):
            for d in self.destinations[(rank, t)]:
                if d != rank:
                    out[d].append(Write("dispatch", rank, d, self.dispatch_send(t),
                                        self.dispatch_slot(rank, t),
                                        self.dispatch_payload(rank, t), token=t))
        return out

    def local_dispatch(self, rank):
        """(address, bytes) the GPU of ``rank`` copies into its own receive buffer: its tokens
        with an expert on the rank itself."""
        return [(self.dispatch_slot(rank, t), self.dispatch_payload(rank, t))
                for t in range(self.tokens) if rank in self.destinations[(rank, t)]]

    def count(self, source, destination):
        """Tokens of ``source`` with an expert on ``destination``."""
        return sum(destination in self.destinations[(source, t)] for t in range(self.tokens))

    def signals(self, rank, phase):
        """``rank``'s signals of ``phase`` to every rank (itself included): dispatch
        ``-count - 1``, ``count`` the tokens ``rank`` sent there (DeepEP's expert count);
        combine 1 (DeepEP's flag)."""
        return [Signal(phase, rank, d, self.signal_word(phase, rank),
                       -self.count(rank, d) - 1 if phase == "dispatch" else 1)
                for d in range(self.ranks)]

    def received(self, rank):
        """(source, token) of every token ``rank`` receives in the dispatch (its own too)."""
        return [(s, t) for s in range(self.ranks) for t in range(self.tokens)
                if rank in self.destinations[(s, t)]]

    # --- combine -----------------------------------------------------------------------

    def slot_of(self, source, token, expert_rank):
        return self.destinations[(source, token)].index(expert_rank)

    def combine_writes(self, rank):
        """``{source: [Write]}`` of ``rank``'s combine: every token it received from
        another rank, back to that rank's combine buffer."""
        out = {s: [] for s in range(self.ranks) if s != rank}
        for s, t in self.received(rank):
            if s != rank:
                out[s].append(Write("combine", rank, s, self.combine_send(s, t),
                                    self.combine_slot(t, self.slot_of(s, t, rank)),
                                    self.combine_payload(rank, s, t), token=t))
        return out

    def local_combine(self, rank):
        return [(self.combine_slot(t, self.slot_of(rank, t, rank)),
                 self.combine_payload(rank, rank, t))
                for t in range(self.tokens) if rank in self.destinations[(rank, t)]]

    # --- outcome -----------------------------------------------------------------------

    def expected(self, rank):
        """(address, bytes, what) of everything ``rank``'s receive buffers must hold after the
        step: every token it received at its (source, token) slot, every combine result at
        its (token, slot), every signal word as :meth:`signals` left it."""
        out = [(self.dispatch_slot(s, t), self.dispatch_payload(s, t),
                f"dispatch token {t} of rank {s}") for s, t in self.received(rank)]
        for t in range(self.tokens):
            for k, d in enumerate(self.destinations[(rank, t)]):
                out.append((self.combine_slot(t, k), self.combine_payload(d, rank, t),
                            f"combine of token {t} from rank {d}"))
        for phase in ("dispatch", "combine"):
            for s in range(self.ranks):
                add = next(x.add for x in self.signals(s, phase) if x.dst == rank)
                out.append((self.signal_word(phase, s), signal_bytes(add),
                            f"{phase} signal of rank {s}"))
        return out


class KvPlan:
    """Prefill-to-decode KV-cache transfer: ``kv_src`` writes ``kv_blocks`` blocks of
    ``kv_block_bytes`` into ``kv_dst``'s receive buffer, then signals it (one fetch-and-add
    of ``kv_blocks`` on a flag word); meanwhile every other rank writes
    ``background_messages`` messages of ``background_bytes`` to each of the others (an
    all-to-all that shares the spines with the KV stream)."""

    def __init__(self, ranks=8, kv_src=0, kv_dst=7, kv_blocks=16, kv_block_bytes=65536,
                 background_bytes=4096, background_messages=4, seed=1, regions=None):
        _check_int("ranks", ranks, 2)
        _check_int("kv_src", kv_src, 0, ranks - 1)
        _check_int("kv_dst", kv_dst, 0, ranks - 1)
        if kv_src == kv_dst:
            raise ValueError(f"kv_src and kv_dst must differ, both are {kv_src}")
        _check_int("kv_blocks", kv_blocks, 1)
        _check_int("kv_block_bytes", kv_block_bytes, 1, 1 << 31)
        _check_int("background_bytes", background_bytes, 1, 1 << 31)
        _check_int("background_messages", background_messages, 0)
        _check_int("seed", seed, 0)
        self.ranks, self.kv_src, self.kv_dst = ranks, kv_src, kv_dst
        self.kv_blocks, self.kv_block_bytes = kv_blocks, kv_block_bytes
        self.background_bytes, self.background_messages = background_bytes, background_messages
        self.seed = seed
        self.kv_stride = _round_up(kv_block_bytes)
        self.background_stride = _round_up(background_bytes)
        self.background_ranks = [r for r in range(ranks) if r not in (kv_src, kv_dst)]
        r = self.regions = _Regions(regions)
        r.fit("send", kv_blocks * self.kv_stride,
              f"kv_blocks {kv_blocks} x kv_block_bytes {kv_block_bytes}")
        r.fit("receive", SLOT_ALIGN + kv_blocks * self.kv_stride,
              f"kv_blocks {kv_blocks} x kv_block_bytes {kv_block_bytes}")
        peers = max(len(self.background_ranks) - 1, 0)
        r.fit("send", peers * background_messages * self.background_stride,
              f"background_messages {background_messages} x background_bytes "
              f"{background_bytes} to {peers} ranks")
        r.fit("receive", SLOT_ALIGN + ranks * background_messages * self.background_stride,
              f"background_messages {background_messages} x background_bytes "
              f"{background_bytes} from {peers} ranks")

    @property
    def flag(self):
        """The word in ``kv_dst``'s memory the KV stream's signal adds to."""
        return self.regions.receive

    def kv_writes(self):
        return [Write("kv", self.kv_src, self.kv_dst, self.regions.send + b * self.kv_stride,
                      self.regions.receive + SLOT_ALIGN + b * self.kv_stride,
                      _stream("kv", self.seed, self.kv_src, b).randbytes(self.kv_block_bytes),
                      index=b)
                for b in range(self.kv_blocks)]

    def kv_signal(self):
        return Signal("kv", self.kv_src, self.kv_dst, self.flag, self.kv_blocks)

    def background_writes(self, rank):
        """``{peer: [Write]}`` of background rank ``rank`` (empty for the KV ranks)."""
        if rank not in self.background_ranks:
            return {}
        peers = [p for p in self.background_ranks if p != rank]
        return {p: [Write("background", rank, p,
                          self.regions.send + (k * self.background_messages + m)
                          * self.background_stride,
                          self.regions.receive + SLOT_ALIGN
                          + (rank * self.background_messages + m) * self.background_stride,
                          _stream("background", self.seed, rank, p, m).randbytes(
                              self.background_bytes), index=m)
                    for m in range(self.background_messages)]
                for k, p in enumerate(peers)}

    def staging(self, rank):
        """(address, bytes) the GPU of ``rank`` writes into its send buffer first."""
        writes = self.kv_writes() if rank == self.kv_src else \
            [w for ws in self.background_writes(rank).values() for w in ws]
        return [(w.laddr, w.payload) for w in writes]

    def expected(self, rank):
        """(address, bytes, what) ``rank``'s receive buffer must hold at the end."""
        out = []
        if rank == self.kv_dst:
            out += [(w.raddr, w.payload, f"KV block {w.index}") for w in self.kv_writes()]
            out.append((self.flag, signal_bytes(self.kv_blocks), "KV flag"))
        for src in self.background_ranks:
            for w in self.background_writes(src).get(rank, ()):
                out.append((w.raddr, w.payload, f"background message {w.index} of rank {src}"))
        return out


def scenario_config(config, *, max_ranks):
    """The full configuration of a scenario run (schema's ``config``) from the options given
    (``DEFAULTS`` for the others): validated (``ValueError`` naming the option), the plan
    built once to check it fits, derived keys added. ``max_ranks``: the fabric's NICs have
    that many QPs (one per peer)."""
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
    c = {**DEFAULTS, **config}
    if c["scenario"] not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, not {c['scenario']!r}")
    _check_int("ranks", c["ranks"], 4, max_ranks)
    if c["ranks"] % 2:
        raise ValueError(f"ranks must be even (2 NICs per leaf), not {c['ranks']}")
    _check_int("spines", c["spines"], 1, MAX_SPINES)
    _check_int("memory_latency", c["memory_latency"], 1, 1023)
    _check_int("sample_cycles", c["sample_cycles"], 1)
    fabric = LeafSpine(NICS_PER_LEAF, c["ranks"] // NICS_PER_LEAF, c["spines"],
                       wire_delay=c["wire_delay"])
    c.update(nics_per_leaf=NICS_PER_LEAF, leaves=fabric.leaves)
    link_names(fabric, c["pcap_link"])
    _check_int("ack_timeout", c["ack_timeout"], 0, MAX_ACK_TIMEOUT)
    _check_int("cut_at", c["cut_at"], 0)
    if c["cut_link"]:
        link_names(fabric, c["cut_link"], option="cut_link")
        if not c["ack_timeout"]:
            raise ValueError("cut_link needs an ack_timeout: without the timer, a message "
                             "whose last packets the cut lost is never resent")
    if c["scenario"] == "moe":
        MoePlan(c["ranks"], c["tokens"], c["topk"], c["experts_per_rank"], c["hidden"], c["seed"])
    else:
        KvPlan(c["ranks"], c["kv_src"], c["kv_dst"], c["kv_blocks"], c["kv_block_bytes"],
               c["background_bytes"], c["background_messages"], c["seed"])
    _check_hidden(c["hidden"])
    c.update(dispatch_bytes=dispatch_bytes(c["hidden"]), combine_bytes=combine_bytes(c["hidden"]),
             clock_ns=CLOCK_NS, beat_bytes=BEAT_BYTES)
    return c


def link_names(fabric, link_name=None, *, option="pcap_link"):
    """``{name: Link}`` of every cable, named ``<a node>.p<a port>`` (``nic0.p0``,
    ``leaf0.p2``); with ``link_name`` (that name or the cable's ``nic0-leaf0``) checks it
    names one (``ValueError`` naming ``option``) and returns only it."""
    names = {f"{link.a[0]}.p{link.a[1]}": link for link in fabric.links}
    if link_name is None:
        return names
    for name, link in names.items():
        if link_name in (name, link.name):
            return {name: link}
    raise ValueError(f"{option} {link_name!r} is not a link: one of {', '.join(names)}")
