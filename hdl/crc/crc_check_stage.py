from functools import reduce
from operator import xor

from amaranth.hdl import Array, C, Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .matrices import check_parameters, advance_columns, data_matrix, multiply, rows

__all__ = ["CRCCheckStage"]


class CRCCheckStage(wiring.Component):
    """Checks a CRC over a stream of ``width``-byte beats, one pipeline stage behind them.

    Each beat's bytes past ``count`` are masked off (``keep``, a bit per lane) instead of
    being aligned, so the whole beat always goes through the one full-width data matrix:
    the registered state after a beat of ``k`` bytes is ``A^(8·(width-k))`` times the
    true CRC register. A codeword leaves the true register at the algorithm's residue,
    so the check compares the state with ``A^(8·(width-k))·residue``, a constant per
    count registered with it. Every data bit goes through one AND and an XOR tree into
    the state register; ``match`` is a 16-bit compare of two registers.

    Ports
    -----
    start : In(1)
        This beat begins a new CRC: its state is the initial value.
    valid : In(1)
        A beat is present.
    data : In(8 * width)
    keep : In(width)
        Lane ``i`` holds one of the beat's bytes: lanes ``0..count-1`` set (a register,
        so that the mask adds no depth).
    count : In(range(width + 1))
        Valid bytes in this beat; ``width`` for a full beat.
    match : Out(1)
        In the cycle after a beat: everything since ``start`` up to and including that
        beat is a valid codeword (data followed by its CRC, least-significant byte first).
    """
    def __init__(self, algorithm, width):
        check_parameters(algorithm, width)
        self._algorithm = algorithm
        self._width = width
        super().__init__({
            "start": In(1),
            "valid": In(1),
            "data": In(8 * width),
            "keep": In(width),
            "count": In(range(width + 1)),
            "match": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        algorithm, width = self._algorithm, self._width
        crc_width = algorithm.crc_width

        residue = algorithm(8).residue()
        if algorithm.reflect_output:
            residue = int(f"{residue:0{crc_width}b}"[::-1], 2)
        expected = []
        for count in range(width + 1):
            columns = advance_columns(algorithm, 8 * (width - count))
            expected.append(C(reduce(xor, (column for bit, column in enumerate(columns)
                                           if residue >> bit & 1), 0), crc_width))

        state = Signal(crc_width, init=algorithm.initial_crc)
        compare = Signal(crc_width)
        source = Signal(crc_width)
        masked = Signal(8 * width)
        m.d.comb += [
            source.eq(Mux(self.start, algorithm.initial_crc, state)),
            masked.eq(self.data & Cat(self.keep[lane].replicate(8) for lane in range(width))),
        ]
        full_beat = rows(advance_columns(algorithm, 8 * width), crc_width)
        with m.If(self.valid):
            m.d.sync += [
                state.eq(multiply(data_matrix(algorithm, width), masked) ^ multiply(full_beat, source)),
                compare.eq(Array(expected)[self.count]),
            ]
        m.d.comb += self.match.eq(state == compare)
        return m
