"""Adders and reductions built for LUT depth.

Yosys maps ``a + b`` to a carry-lookahead tree that ABC9, in a generic 6-input-LUT
mapping (docs/fpga.md), turns into 5 LUT levels at 13 bits, 7 at 32 and 8 at 64.
:func:`lookahead_sum` writes the carries out instead: every 3 bits' generate and
propagate in one LUT each, a radix-3 prefix over those groups, each sum bit from its
group's carry-in: 3 levels at 13 bits, 4 at 32 (5 with a carry in), 5 at 64.
:func:`sum3` adds three operands with one carry-save layer before that sum, not two sums.
:func:`count_registered` counts an event from a register, so its adder starts from flip-flops.
:func:`or_all` ORs values as a balanced tree, not the chain a loop writes.
:func:`named` gives an expression used more than once a signal of its own.
"""
from amaranth import C, Cat, Const, Signal, Value

__all__ = ["count_registered", "lookahead_sum", "named", "or_all", "sum3"]

_GROUP = 3          # bits per group: a group's generate reads 6 inputs, one LUT
_RADIX = 3          # groups joined per prefix level: 3 (G, P) pairs, one LUT


def lookahead_sum(m, a, b, carry=0, *, half=None, name="sum"):
    """``a + b + carry`` (``carry`` one bit), ``max(len(a), len(b)) + 1`` bits wide, the
    carry out on top, as combinational logic in ``m``. Its wires are driven in ``m.d.comb``
    where it is called: outside any ``m.If``, whose condition would gate them.

    ``half``: each sum bit's own half sum, instead of ``a ^ b``, for an add whose carries
    stop at chosen bits (a masked fetch-and-add): clear those bits in ``a`` and ``b`` (no
    carry leaves them) and give their real half sums here, as registers like ``a`` and
    ``b``, so the sum is no deeper than a plain one."""
    a, b, carry = Value.cast(a), Value.cast(b), Value.cast(carry)
    n = max(len(a), len(b), 1)
    a = Cat(a, C(0, n - len(a))) if len(a) < n else a
    b = Cat(b, C(0, n - len(b))) if len(b) < n else b

    def wire(value, suffix):
        # A named wire, one per vector: an expression used twice would be emitted twice,
        # and a wire per bit would multiply the netlist's signals by the width.
        signal = Signal(len(value), name=f"{name}_{suffix}")
        m.d.comb += signal.eq(value)
        return signal

    generate = wire(a & b, "g")
    propagate = wire(a ^ b, "p")
    own = propagate if half is None else Value.cast(half)[:n]
    # A carry in takes one input of the first group's LUT: that group is a bit shorter.
    first = _GROUP if isinstance(carry, Const) else _GROUP - 1
    groups = [range(0, min(first, n))] + [range(start, min(start + _GROUP, n))
                                          for start in range(first, n, _GROUP)]

    # Each group's carry out given no carry in (the first group's given ``carry``), and
    # whether a carry in would pass through it.
    group_g, group_p = [], []
    for k, bits in enumerate(groups):
        g, p = carry if k == 0 else Const(0), Const(1)
        for i in bits:
            g = generate[i] | (propagate[i] & g)
            p = p & propagate[i]
        group_g.append(g)
        group_p.append(p)
    group_g = _bits(wire(Cat(*group_g), "gg"))
    group_p = _bits(wire(Cat(*group_p), "gp"))

    # Prefix: after a level of span s, group k's pair covers groups k - s*_RADIX + 1 .. k;
    # the first group's pair carries ``carry``, so a pair reaching it is the carry out.
    span = 1
    while span < len(groups):
        next_g, next_p = [], []
        for k in range(len(groups)):
            g, p = group_g[k], group_p[k]
            for j in range(1, _RADIX):
                low = k - j * span
                if low < 0:
                    break
                g = g | (p & group_g[low])
                p = p & group_p[low]
            next_g.append(g)
            next_p.append(p)
        group_g = _bits(wire(Cat(*next_g), f"cg{span}"))
        group_p = _bits(wire(Cat(*next_p), f"cp{span}"))
        span *= _RADIX

    carries = []
    for k, group in enumerate(groups):
        into = carry if k == 0 else group_g[k - 1]
        for i in group:
            carries.append(into)
            into = generate[i] | (propagate[i] & into)
    return Cat(own ^ Cat(*carries), group_g[-1])


def _bits(signal):
    return [signal[i] for i in range(len(signal))]


def sum3(m, a, b, c, width, *, plus_one=False, name="sum3"):
    """``(a + b + c + plus_one) mod 2^width``: one carry-save layer (a LUT level), then
    :func:`lookahead_sum`; ``plus_one`` takes the carry vector's free low bit. Driven in
    ``m.d.comb`` like :func:`lookahead_sum`. An ``int`` operand is taken modulo 2^width
    (so -16 is a constant that subtracts 16); a value is zero-extended."""
    a, b, c = (C(x % (1 << width), width) if isinstance(x, int) else
               Cat(Value.cast(x), C(0, width))[:width] for x in (a, b, c))
    partial = Signal(width, name=f"{name}_s")
    carries = Signal(width, name=f"{name}_c")
    m.d.comb += [partial.eq(a ^ b ^ c), carries.eq((a & b) | (a & c) | (b & c))]
    return lookahead_sum(m, partial, Cat(C(int(plus_one), 1), carries[:width - 1]),
                         name=name)[:width]


def count_registered(m, counter, event):
    """``counter`` counts ``event`` a cycle after it: the event is registered first, so the
    sum starts from flip-flops."""
    counted = Signal(name=f"{counter.name}_event")
    m.d.sync += [counted.eq(event),
                 counter.eq(lookahead_sum(m, counter, counted, name=f"{counter.name}_next"))]


def count_registered_sum(m, counter, events, registered=()):
    """``counter`` counts ``events``, several in a cycle, two cycles after them: the events
    are registered, then their sum, so the adder starts from flip-flops. ``registered``:
    more events, already registered by a block beside it (they count with the others)."""
    counted = Signal(len(events), name=f"{counter.name}_events")
    amount = Signal(range(len(events) + len(registered) + 1), name=f"{counter.name}_amount")
    bits = [counted[i] for i in range(len(events))] + list(registered)
    m.d.sync += [
        counted.eq(Cat(events)),
        amount.eq(sum(bits)),
        counter.eq(lookahead_sum(m, counter, amount, name=f"{counter.name}_next")),
    ]


def named(m, value, name, width=None):
    """``value`` as a combinational signal ``name`` (``width`` bits, default its own): an
    expression used more than once is emitted once, where Amaranth writes it at every use."""
    signal = Signal(len(Value.cast(value)) if width is None else width, name=name)
    m.d.comb += signal.eq(value)
    return signal


def or_all(values):
    """The OR of ``values`` (at least one) as a balanced tree: log2(n) deep, not n."""
    values = list(values)
    if not values:
        raise ValueError("or_all needs at least one value")
    while len(values) > 1:
        values = [values[i] | values[i + 1] if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]
