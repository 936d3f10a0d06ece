"""Arbiters by name: the round robin every RTL block takes from hdl/prim/round_robin.py,
as a pure function its tests and the allocator models share."""

from __future__ import annotations

__all__ = ["round_robin_pick", "turn_pick"]


def round_robin_pick(requests: int, pointer: int, n: int) -> int | None:
    """The first set bit of ``requests`` (n bits) in the order pointer, pointer + 1, ...
    (mod n); None when no bit is set."""
    if not 0 <= pointer < n:
        raise ValueError(f"pointer {pointer!r} is not one of {n} requests")
    requests &= (1 << n) - 1
    if not requests:
        return None
    high = requests >> pointer
    if high:
        return pointer + (high & -high).bit_length() - 1
    return (requests & -requests).bit_length() - 1


def turn_pick(requests: int, turn: int, keep: bool, n: int) -> int | None:
    """The weighted round robin's pick: ``turn`` again while ``keep`` (its turn has budget
    left) and it is requested, else the first request after it, ``turn`` itself last; None
    when nothing is requested."""
    if keep and requests >> turn & 1:
        return turn
    return round_robin_pick(requests, (turn + 1) % n, n)
