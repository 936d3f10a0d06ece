"""Round-robin arbitration, the one copy every block uses: a one-hot pick from a request
vector and a thermometer mask (no comparator in the path), and the mask's next value."""
from amaranth import *

__all__ = ["round_robin_pick", "turn_pick", "next_mask", "mask_at", "mask_after", "one_hot_index"]


def round_robin_pick(m, requests, mask, *, name):
    """One-hot pick of the first set bit of ``requests`` at or after the round-robin pointer.

    The pointer is held as a thermometer ``mask`` (bits at or after it set: all ones for
    pointer 0), so no comparator sits in the path: bit k wins when it is requested and
    either it is at or after the pointer with no such request below it, or no request is
    at or after the pointer and none is below it (the wrap-around). About three LUT levels
    for 8 requests. Zero when nothing is requested.
    """
    n = len(requests)
    high = Signal(n, name=f"{name}_high")
    m.d.comb += high.eq(requests & mask)
    pick = Signal(n, name=f"{name}_pick")
    for k in range(n):
        high_below = high[:k].any() if k else C(0, 1)
        any_below = requests[:k].any() if k else C(0, 1)
        m.d.comb += pick[k].eq(requests[k] & Mux(mask[k], ~high_below, ~high.any() & ~any_below))
    return pick


def turn_pick(m, requests, turn, keep, *, name):
    """The weighted round robin's pick, as an index: request ``turn`` (an index) again while
    ``keep`` (its turn has budget left) and it is requested, else the first request after it,
    ``turn`` itself last. 0 when nothing is requested."""
    n = len(requests)
    holder = Signal(n, name=f"{name}_turn")
    m.d.comb += holder.eq(Cat(turn == k for k in range(n)))
    mask = Signal(n, name=f"{name}_mask")
    m.d.comb += mask.eq(Mux(keep, mask_at(holder), next_mask(holder)))
    return one_hot_index(round_robin_pick(m, requests, mask, name=name))


def next_mask(one_hot):
    """Thermometer mask of the pointer ``(k + 1) mod n`` for the set bit ``k`` of ``one_hot``:
    the request after the one granted goes first next time."""
    n = len(one_hot)
    return Cat(*(one_hot[n - 1] | (one_hot[:j].any() if j else C(0, 1)) for j in range(n)))


def mask_at(one_hot):
    """Thermometer mask of the pointer ``k`` itself for the set bit ``k`` of ``one_hot``: the
    request granted goes first again (a turn that continues)."""
    return Cat(*(one_hot[:j + 1].any() for j in range(len(one_hot))))


def mask_after(k, n):
    """The constant :func:`next_mask` of a grant of request ``k``: a mask register's reset
    value when request ``k`` counts as granted last."""
    if not 0 <= k < n:
        raise ValueError(f"request {k!r} is not one of {n}")
    return (1 << n) - 1 if k == n - 1 else ((1 << n) - 1) ^ ((1 << (k + 1)) - 1)


def one_hot_index(one_hot):
    """The index of the set bit of ``one_hot`` (at most one is set; 0 when none is): an OR
    per index bit."""
    n = len(one_hot)
    width = max(1, (n - 1).bit_length())
    return Cat(*(Cat(one_hot[k] for k in range(n) if k >> b & 1).any() if n > 1 << b else C(0, 1)
                 for b in range(width)))
