"""Switch allocators by name: iSLIP (McKeown 1999), whose exact pointer rules docs/models.md
gives and an RTL allocator is compared with cycle for cycle."""

from __future__ import annotations

import numpy as np

from models.arbiters import round_robin_pick

__all__ = ["ALLOCATORS", "IslipAllocator"]


class IslipAllocator:
    """iSLIP (McKeown 1999) with ``iterations`` request-grant-accept rounds.

    Deterministic; pointer rules in the module docstring. ``allocate`` takes requests as
    a set of ``(input, output)`` pairs or an ``N_in x N_out`` boolean matrix and returns
    ``{input: output}``; ``allocate_masks`` takes one output bitmask per input.
    """

    def __init__(self, ports: int, iterations: int = 1, outputs: int | None = None):
        if ports < 1 or iterations < 1:
            raise ValueError("need at least one port and one iteration")
        self.inputs = ports
        self.outputs = ports if outputs is None else outputs
        self.iterations = iterations
        self.grant_ptr = [0] * self.outputs
        self.accept_ptr = [0] * self.inputs

    def reset(self) -> None:
        self.grant_ptr = [0] * self.outputs
        self.accept_ptr = [0] * self.inputs

    def allocate(self, requests) -> dict[int, int]:
        masks = [0] * self.inputs
        if isinstance(requests, (set, frozenset, list, tuple)) and (
                not requests or isinstance(next(iter(requests)), tuple)):
            for i, o in requests:
                if not (0 <= i < self.inputs and 0 <= o < self.outputs):
                    raise ValueError(f"request {(i, o)} out of range")
                masks[i] |= 1 << o
        else:
            matrix = np.asarray(requests, dtype=bool)
            if matrix.shape != (self.inputs, self.outputs):
                raise ValueError(f"request matrix must be {self.inputs}x{self.outputs}")
            for i in range(self.inputs):
                for o in np.flatnonzero(matrix[i]):
                    masks[i] |= 1 << int(o)
        return self.allocate_masks(masks)

    def allocate_masks(self, masks) -> dict[int, int]:
        n_in, n_out = self.inputs, self.outputs
        grant_ptr, accept_ptr = self.grant_ptr, self.accept_ptr
        # Column view: which inputs request each output.
        column = [0] * n_out
        for i, mask in enumerate(masks):
            while mask:
                low = mask & -mask
                column[low.bit_length() - 1] |= 1 << i
                mask ^= low
        match: dict[int, int] = {}
        matched_in = matched_out = 0
        for iteration in range(self.iterations):
            grants = {}
            for o in range(n_out):
                if matched_out >> o & 1:
                    continue
                requesters = column[o] & ~matched_in
                if requesters:
                    i = round_robin_pick(requesters, grant_ptr[o], n_in)
                    grants[i] = grants.get(i, 0) | (1 << o)
            if not grants:
                break
            for i, granted in grants.items():
                o = round_robin_pick(granted, accept_ptr[i], n_out)
                match[i] = o
                matched_in |= 1 << i
                matched_out |= 1 << o
                if iteration == 0:
                    accept_ptr[i] = (o + 1) % n_out
                    grant_ptr[o] = (i + 1) % n_in
        return match


# Router(allocator=name) builds ALLOCATORS[name](inputs, iterations, outputs=outputs).
ALLOCATORS = {"islip": IslipAllocator}
