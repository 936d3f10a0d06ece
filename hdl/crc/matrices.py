"""GF(2) matrices of a CRC over bytes, built at elaboration from an algorithm's parameters.

The CRC register ``s`` is kept unreflected (most-significant bit first); ``n``
bits ``d`` advance it to ``A^n·s ⊕ D_n·d``. A matrix is a list of output rows,
each row the set of input bit indices XORed into that output bit.
"""
from amaranth.hdl import Cat, Const, Signal
from amaranth.lib import crc

__all__ = ["check_parameters", "data_matrix", "advance_columns", "rows", "multiply", "xor_nodes",
           "xor_tree"]


def check_parameters(algorithm, width):
    """The constructor checks of a beat CRC: a ``lib.crc`` algorithm and a beat width."""
    if not isinstance(algorithm, crc.Algorithm):
        raise ValueError(f"Algorithm must be an amaranth.lib.crc.Algorithm, not {algorithm!r}")
    if not isinstance(width, int) or width < 8 or width > 256 or width & (width - 1):
        raise ValueError(f"Beat width must be a power of two from 8 to 256 bytes, not {width!r}")


def _shifter(algorithm):
    crc_width, polynomial = algorithm.crc_width, algorithm.polynomial
    top, mask = 1 << (crc_width - 1), (1 << crc_width) - 1

    def shift(register):  # one zero bit through the unreflected register
        return ((register << 1) & mask) ^ (polynomial if register & top else 0)
    return shift


def data_matrix(algorithm, width):
    """``G``: the contribution of a ``width``-byte beat (byte 0 in bits 7..0) to a zero register."""
    shift = _shifter(algorithm)
    data_bits = 8 * width
    columns = [0] * data_bits
    # A data bit d entering a zero register leaves `polynomial·d`; each later bit shifts it once more.
    contribution = algorithm.polynomial
    for position in reversed(range(data_bits)):
        lane, order = divmod(position, 8)
        bit = order if algorithm.reflect_input else 7 - order
        columns[8 * lane + bit] = contribution
        contribution = shift(contribution)
    return rows(columns, algorithm.crc_width)


def advance_columns(algorithm, bits, columns=None):
    """The columns of ``A^bits`` (times the matrix of ``columns``, the identity if not
    given): where each register bit goes after ``bits`` zero bits."""
    shift = _shifter(algorithm)
    if columns is None:
        columns = [1 << bit for bit in range(algorithm.crc_width)]
    for _ in range(bits):
        columns = [shift(column) for column in columns]
    return columns


def rows(columns, crc_width):
    return [[index for index, column in enumerate(columns) if column >> row & 1]
            for row in range(crc_width)]


def multiply(matrix, vector):
    return Cat(Cat(vector[index] for index in row).xor() if row else Const(0, 1) for row in matrix)


def xor_nodes(m, terms, per_node, *, name):
    """The XORs of ``terms`` taken ``per_node`` at a time, each a kept net (one LUT6 when
    the terms hold six inputs between them): ABC would otherwise map a reduction as the
    chain it was written as, or merge the levels into deeper cones. The nets are the bits
    of one kept vector: a signal per net would multiply the netlist's signals."""
    groups = [terms[k:k + per_node] for k in range(0, len(terms), per_node)]
    xored = [k for k, group in enumerate(groups) if len(group) > 1]
    if not xored:
        return [group[0] for group in groups]
    node = Signal(len(xored), name=name, attrs={"keep": 1})
    m.d.comb += node.eq(Cat(*(Cat(groups[k]).xor() for k in xored)))
    bit = iter(node[i] for i in range(len(xored)))
    return [next(bit) if len(group) > 1 else group[0] for group in groups]


def xor_tree(m, terms, *, name):
    """The XOR of ``terms``, single bits, as a tree of 6-input XORs: one LUT6 level per
    factor of six."""
    level = 0
    while len(terms) > 1:
        terms = xor_nodes(m, terms, 6, name=f"{name}_x{level}")
        level += 1
    return terms[0] if terms else Const(0, 1)
