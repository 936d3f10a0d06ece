from functools import reduce
from operator import xor

from amaranth.hdl import Array, C, Cat, Module, Mux, Signal, Value
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .matrices import check_parameters, advance_columns, data_matrix, xor_nodes, xor_tree

__all__ = ["AlignedCRC", "align", "advance_and_seed"]


def align(data, count, width):
    """A beat's ``count`` bytes moved to the top lanes, zeros in front: what :class:`AlignedCRC` takes."""
    # Shifted right by count bytes from above the beat: no subtraction before the shifter.
    return (Cat(C(0, 8 * width), data) >> Cat(C(0, 3), Value.cast(count)))[:8 * width]


def advance_and_seed(algorithm, count, start, width):
    """``(advance, seed)`` of a beat of ``count`` bytes as :class:`AlignedCRC` takes them:
    ``A^(8·count)`` (the register advanced over the beat, bit ``crc_width·row + column``)
    and zero, or on a ``start`` beat zero and ``A^(8·count)`` times the initial value."""
    crc_width = algorithm.crc_width
    matrices, seeds = [], []
    for k in range(width + 1):
        columns = advance_columns(algorithm, 8 * k)
        matrices.append(C(sum((columns[col] >> row & 1) << (crc_width * row + col)
                              for row in range(crc_width) for col in range(crc_width)), crc_width ** 2))
        seeds.append(C(reduce(xor, (columns[col] for col in range(crc_width)
                                    if algorithm.initial_crc >> col & 1), 0), crc_width))
    start = Value.cast(start)
    return (Mux(start, 0, Array(matrices)[count]), Mux(start, Array(seeds)[count], 0))


class AlignedCRC(wiring.Component):
    """CRC over a stream of ``width``-byte beats with the last one front-padded, shallow
    enough for the last stage of a pipeline whose every input comes from a register.

    A beat of ``k`` bytes arrives with them in lanes ``width-k..width-1`` (:func:`align`):
    zeros in front leave a zero register zero, so the beat adds the full-width data matrix
    ``G`` times the beat. The register advances over the beat by ``A^(8k)``, which depends
    on ``k``, so that matrix arrives registered (``advance``; zero on a start beat, whose
    initial value arrives advanced as ``seed``): the new state is
    ``G·data ⊕ advance·state ⊕ seed``, 6-input XORs of at most ``8 * width`` data bits, of
    three ``advance & state`` products, and the seed: 4 LUT6 levels at 64-byte beats.

    Ports
    -----
    valid : In(1)
        A beat is present: the state register takes the new state at the clock edge.
    data : In(8 * width)
        The aligned beat; lanes below ``width - k`` must be zero.
    advance, seed : In(crc_width ** 2), In(crc_width)
        :func:`advance_and_seed` of the beat's byte count and start flag. An empty
        beat (``k = 0``, advance the identity) leaves the state unchanged.
    crc : Out(crc_width)
        Combinational: the final CRC (output reflection and XOR applied) of everything
        since the start beat including this beat.
    """
    def __init__(self, algorithm, width):
        check_parameters(algorithm, width)
        self._algorithm = algorithm
        self._width = width
        super().__init__({
            "valid": In(1),
            "data": In(8 * width),
            "advance": In(algorithm.crc_width ** 2),
            "seed": In(algorithm.crc_width),
            "crc": Out(algorithm.crc_width),
        })

    def elaborate(self, platform):
        m = Module()
        algorithm, width = self._algorithm, self._width
        crc_width = algorithm.crc_width

        state = Signal(crc_width, init=algorithm.initial_crc)
        following = Signal(crc_width)
        for row, indices in enumerate(data_matrix(algorithm, width)):
            name = f"following{row}"
            data = xor_nodes(m, [self.data[index] for index in indices], 6, name=f"{name}_data")
            carried = xor_nodes(m, [self.advance[crc_width * row + column] & state[column]
                                    for column in range(crc_width)], 3, name=f"{name}_state")
            m.d.comb += following[row].eq(xor_tree(m, data + carried + [self.seed[row]], name=name))
        with m.If(self.valid):
            m.d.sync += state.eq(following)

        register_out = following[::-1] if algorithm.reflect_output else following
        m.d.comb += self.crc.eq(register_out ^ algorithm.xor_output)
        return m
