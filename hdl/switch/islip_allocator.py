from amaranth import *
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from hdl.prim.round_robin import next_mask, round_robin_pick

__all__ = ["IslipAllocator"]


class IslipAllocator(wiring.Component):
    """iSLIP switch allocator (McKeown, 1999): a maximal-size-seeking matching in one cycle.

    ``requests`` bit ``i * ports + o`` says input ``i`` has a packet for output ``o``.
    ``grant`` (same layout) is a matching -- at most one bit per input row and per output
    column -- computed combinationally from ``requests`` and the pointer registers, every
    cycle; ``grant_valid[i]`` says input ``i`` is matched.

    All ``iterations`` are unrolled combinationally. Each considers only the inputs and
    outputs still unmatched: every unmatched output grants the first requesting unmatched
    input at or after its grant pointer ``g[o]``; every unmatched input accepts the first
    granting output at or after its accept pointer ``a[i]``; accepted pairs are matched.

    The pointers move only in cycles with ``enable`` high (the allocation is used), and only
    for the matches of the FIRST iteration: ``g[o] := (i + 1) mod ports`` for the input ``i``
    that accepted ``o``, ``a[i] := (o + 1) mod ports``. This is what desynchronises the
    pointers and makes iSLIP starvation-free: under a full request matrix it settles into
    ``ports`` different perfect matchings in turn.

    Combinational depth: ``2 * iterations`` round-robin arbiters of ``2 * ports`` bits in
    series (plus the unmatched masks). Generic Yosys ``abc -lut 6`` (no carry chains) puts
    the longest path at 57 LUT levels for 8 ports x 3 iterations, 22 for 16 x 1 and 108 for
    16 x 4: far beyond one 400 MHz cycle on an FPGA. Large configurations need the
    iterations pipelined or spread over the cycles a multi-beat packet takes.
    """

    def __init__(self, ports=8, iterations=1):
        if not isinstance(ports, int) or not 2 <= ports <= 16:
            raise ValueError(f"Ports must be an integer from 2 to 16, not {ports!r}")
        if not isinstance(iterations, int) or not 1 <= iterations <= 4:
            raise ValueError(f"Iterations must be an integer from 1 to 4, not {iterations!r}")
        self.ports = ports
        self.iterations = iterations
        super().__init__({
            "requests": In(ports * ports),
            "enable": In(1),
            "grant": Out(ports * ports),
            "grant_valid": Out(ports),
        })

    def elaborate(self, platform):
        m = Module()
        n = self.ports

        # Pointers as thermometer masks (bits at or after the pointer), all ones after reset.
        grant_ptr = [Signal(n, init=(1 << n) - 1, name=f"grant_mask{o}") for o in range(n)]
        accept_ptr = [Signal(n, init=(1 << n) - 1, name=f"accept_mask{i}") for i in range(n)]

        def request(i, o):
            return self.requests[i * n + o]

        in_free = out_free = C((1 << n) - 1, n)     # unmatched inputs / outputs
        matches = []        # per iteration: accepted[i] = one-hot over outputs
        for it in range(self.iterations):
            # Grant: each unmatched output picks among the unmatched inputs requesting it.
            granted = []    # granted[o] = one-hot over inputs
            for o in range(n):
                column = Cat(*(request(i, o) for i in range(n))) & in_free & out_free[o].replicate(n)
                granted.append(round_robin_pick(m, column, grant_ptr[o], name=f"it{it}_grant{o}"))
            # Accept: each unmatched input picks among the outputs that granted it.
            accepted = []
            for i in range(n):
                offers = Cat(*(granted[o][i] for o in range(n)))
                accepted.append(round_robin_pick(m, offers, accept_ptr[i], name=f"it{it}_accept{i}"))
            matches.append(accepted)
            next_in_free = Signal(n, name=f"in_free_{it + 1}")
            next_out_free = Signal(n, name=f"out_free_{it + 1}")
            taken = Signal(n, name=f"it{it}_outputs_taken")
            m.d.comb += [
                taken.eq(Cat(*(Cat(*(accepted[i][o] for i in range(n))).any() for o in range(n)))),
                next_in_free.eq(in_free & ~Cat(*(accepted[i].any() for i in range(n)))),
                next_out_free.eq(out_free & ~taken),
            ]
            in_free, out_free = next_in_free, next_out_free

        # Matches of different iterations never share a row or a column: OR them together.
        for i in range(n):
            row = Signal(n, name=f"grant_row{i}")
            m.d.comb += row.eq(Cat(*(Cat(*(it[i][o] for it in matches)).any() for o in range(n))))
            m.d.comb += [
                self.grant[i * n:(i + 1) * n].eq(row),
                self.grant_valid[i].eq(row.any()),
            ]

        # Pointers follow the first iteration's matches only.
        first = matches[0]
        with m.If(self.enable):
            for i in range(n):
                with m.If(first[i].any()):
                    m.d.sync += accept_ptr[i].eq(next_mask(first[i]))
            for o in range(n):
                winner = Cat(*(first[i][o] for i in range(n)))
                with m.If(winner.any()):
                    m.d.sync += grant_ptr[o].eq(next_mask(winner))
        return m
