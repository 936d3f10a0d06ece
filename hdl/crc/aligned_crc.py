from amaranth.hdl import C, Cat, Module, Mux, Signal, Value
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .matrices import check_parameters, advance_columns, data_matrix, multiply, rows, state_lane_bit

__all__ = ["AlignedCRC", "align", "lead"]


def align(data, count, width):
    """A beat's ``count`` bytes moved to the top lanes, zeros in front: what :class:`AlignedCRC` takes."""
    return data << Cat(C(0, 3), width - Value.cast(count))


def lead(count, width):
    """One-hot ``width + 1`` bits, bit ``width - count`` set: where an aligned beat's bytes begin."""
    return (C(1, width + 1) << (width - Value.cast(count)).as_unsigned())[:width + 1]


class AlignedCRC(wiring.Component):
    """CRC over a stream of ``width``-byte beats with the last one front-padded, shallow
    enough for the last stage of a pipeline whose every input comes from a register.

    A beat of ``k`` bytes arrives with them in lanes ``width-k..width-1`` (:func:`align`)
    and ``lead`` one-hot at bit ``width - k`` (:func:`lead`); a full beat has ``k = width``.
    Processing bits from a register ``s`` is the same as processing them from a zero
    register with ``s`` XORed into their first ``crc_width`` bits. So instead of
    advancing the state by a count-selected matrix, the state is XORed into the data at
    the lane where the beat's bytes begin (one gate per data bit, selected by ``lead``)
    and the beat goes through the one full-width data matrix ``G``. State bits that would
    land past the beat (``k`` below ``crc_width / 8``) are added back through small
    per-count matrices, computed here at elaboration. The depth is one gate plus an XOR
    tree over at most ``8 * width + crc_width`` inputs: 5 LUT6 levels for 64-byte beats.

    Ports
    -----
    start : In(1)
        This beat begins a new CRC: the state is the initial value.
    valid : In(1)
        A beat is present: the state register takes the new state at the clock edge.
        ``k = 0`` (``lead`` at bit ``width``) leaves the state unchanged.
    data : In(8 * width)
        The aligned beat; lanes below ``width - k`` must be zero.
    lead : In(width + 1)
    crc : Out(crc_width)
        Combinational: the final CRC (output reflection and XOR applied) of everything
        since ``start`` including this beat.
    """
    def __init__(self, algorithm, width):
        check_parameters(algorithm, width)
        self._algorithm = algorithm
        self._width = width
        super().__init__({
            "start": In(1),
            "valid": In(1),
            "data": In(8 * width),
            "lead": In(width + 1),
            "crc": Out(algorithm.crc_width),
        })

    def elaborate(self, platform):
        m = Module()
        algorithm, width = self._algorithm, self._width
        crc_width = algorithm.crc_width
        beat_matrix = data_matrix(algorithm, width)
        beat_columns = [0] * (8 * width)
        for row, indices in enumerate(beat_matrix):
            for index in indices:
                beat_columns[index] |= 1 << row

        state = Signal(crc_width, init=algorithm.initial_crc)
        source = Signal(crc_width)
        m.d.comb += source.eq(Mux(self.start, algorithm.initial_crc, state))

        injected = [self.data[bit] for bit in range(8 * width)]
        spilled_terms, spilled_columns = [], []
        for first in range(width + 1):
            advance = advance_columns(algorithm, 8 * (width - first))
            for bit in range(crc_width):
                byte, within = state_lane_bit(algorithm, bit)
                lane = first + byte
                term = self.lead[first] & source[bit]
                entered = 0
                if lane < width:
                    position = 8 * lane + within
                    injected[position] = injected[position] ^ term
                    entered = beat_columns[position]
                if advance[bit] != entered:
                    # This bit stays in the register past the beat's end.
                    spilled_terms.append(term)
                    spilled_columns.append(advance[bit] ^ entered)
                    if width - first >= crc_width // 8:
                        raise AssertionError("a whole register was injected but did not cancel")
        data = Signal(8 * width)
        spilled = Signal(len(spilled_terms))
        m.d.comb += [data.eq(Cat(injected)), spilled.eq(Cat(spilled_terms))]
        following = Signal(crc_width)
        m.d.comb += following.eq(multiply(beat_matrix, data)
                                 ^ multiply(rows(spilled_columns, crc_width), spilled))
        with m.If(self.valid):
            m.d.sync += state.eq(following)

        register_out = following[::-1] if algorithm.reflect_output else following
        m.d.comb += self.crc.eq(register_out ^ algorithm.xor_output)
        return m
