"""An AXI4 write slave over a byte-array memory, for testbenches in Amaranth's simulator.

The DmaWriter's and the ResponseWriter's benches (tb/test_dma_writer.py,
tb/test_response_writer.py) drive their component's AXI4 write port cycle by cycle; this is
the slave they share (cocotbext-axi's ``AxiRam`` needs cocotb, these benches run without).
Per cycle the bench calls, in order: :meth:`AxiWriteSlave.drive` (random AWREADY and WREADY,
the due B on the bus), :meth:`AxiWriteSlave.aw_burst` and :meth:`AxiWriteSlave.accept_aw` for
an AW that moves (after checking it against its own reference), :meth:`AxiWriteSlave.take_w`
for a W beat that moves, then :meth:`AxiWriteSlave.respond`. W beats may come before their AW
is accepted: they wait, and meet their AW in order. Bursts are INCR with a full beat a
transfer (what both components issue). Each burst's B follows its last W beat after a random
delay, SLVERR with probability ``p_slverr``, OKAY otherwise.

The random draws happen in a fixed order (AWREADY, WREADY in :meth:`drive`; the response and
the delay of each finished burst in :meth:`respond`), so a bench seeded the same plays the
same run.
"""
from collections import deque

__all__ = ["AxiWriteSlave", "OKAY", "SLVERR"]

OKAY, SLVERR = 0, 2


class AxiWriteSlave:
    """The slave on ``axi`` (an AXI4 write port: ``aw*``, ``w*``, ``b*`` members), answering
    with ID ``bid``. Its memory, ``mem``, is ``size`` random bytes at address ``base``; a W
    beat outside it fails the test. ``hold_b``: no B leaves while it is set."""

    def __init__(self, axi, rng, *, base, size, bid, p_aw, p_w, b_delay, p_slverr,
                 hold_b=False):
        self.axi, self.rng = axi, rng
        self.base, self.size, self.bid = base, size, bid
        self.p_aw, self.p_w, self.b_delay, self.p_slverr = p_aw, p_w, b_delay, p_slverr
        self.beat_bytes = len(axi.wdata) // 8
        self.mem = bytearray(rng.randbytes(size))
        self.hold_b = hold_b
        self.bursts = deque()           # [addr, len, beats applied, tag] accepted, not all written
        self.w_pending = deque()        # (bytes, strobe, last) waiting for their AW
        self.b_due = deque()            # (due cycle, resp, tag)
        self.errors = 0                 # B responses taken that were not OKAY
        self.awready = self.wready = False
        self.b = None                   # the B on the bus this cycle

    def drive(self, inputs, t):
        """Cycle ``t``'s inputs, set through ``inputs`` (a simulator context or a
        :class:`tb.amaranth_sim.Driver`): random AWREADY and WREADY, the oldest due B."""
        axi = self.axi
        self.awready = self.rng.random() < self.p_aw
        self.wready = self.rng.random() < self.p_w
        inputs.set(axi.awready, self.awready)
        inputs.set(axi.wready, self.wready)
        due = self.b_due and self.b_due[0][0] <= t and not self.hold_b
        self.b = self.b_due[0] if due else None
        inputs.set(axi.bvalid, self.b is not None)
        inputs.set(axi.bid, self.bid)
        inputs.set(axi.bresp, self.b[1] if self.b else OKAY)

    def aw_burst(self, ctx):
        """``(awaddr, awlen)`` of the AW that moves this cycle, None if none does."""
        axi = self.axi
        if ctx.get(axi.awvalid) and self.awready:
            return ctx.get(axi.awaddr), ctx.get(axi.awlen)
        return None

    def accept_aw(self, addr, length, tag=None):
        """Take the burst :meth:`aw_burst` gave; ``tag`` comes back with its B (:meth:`respond`)."""
        self.bursts.append([addr, length, 0, tag])

    def take_w(self, ctx):
        """The W beat that moves this cycle, as ``(bytes, strobe, last)``, kept for its
        burst; None if none moves."""
        axi = self.axi
        if not (ctx.get(axi.wvalid) and self.wready):
            return None
        beat = (ctx.get(axi.wdata).to_bytes(self.beat_bytes, "little"), ctx.get(axi.wstrb),
                ctx.get(axi.wlast))
        self.w_pending.append(beat)
        return beat

    def respond(self, ctx, t):
        """Write the W beats that have their AW into memory (``wlast`` must end each burst
        exactly), schedule the B of each finished burst, and take the B shown this cycle
        (BREADY must be high). Returns ``(resp, tag)`` of that B, None if none was shown."""
        while self.w_pending and self.bursts:
            raw, strobe, last = self.w_pending.popleft()
            burst = self.bursts[0]
            offset = burst[0] + burst[2] * self.beat_bytes - self.base
            assert 0 <= offset < self.size, (t, "write outside the memory")
            for j in range(self.beat_bytes):
                if strobe >> j & 1:
                    self.mem[offset + j] = raw[j]
            assert last == (burst[2] == burst[1]), (t, "wlast")
            burst[2] += 1
            if last:
                self.bursts.popleft()
                resp = SLVERR if self.rng.random() < self.p_slverr else OKAY
                self.b_due.append((t + self.rng.randint(1, self.b_delay), resp, burst[3]))
        if self.b is None:
            return None
        assert ctx.get(self.axi.bready), (t, "B not taken")
        self.b_due.popleft()
        self.errors += self.b[1] != OKAY
        return self.b[1], self.b[2]
