from amaranth.hdl import C, Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from .matrices import check_parameters, advance_columns, data_matrix, multiply, rows

__all__ = ["BeatCRC"]


class BeatCRC(wiring.Component):
    """CRC over a stream of ``width``-byte beats, one full beat per cycle, ending at any ``granule``.

    Bytes are taken from lane 0 up (byte 0 of a beat in bits 7..0) and, for a
    reflected algorithm, each byte least-significant bit first, as
    ``algorithm(8).compute(bytes)`` does.

    ``lib.crc.Processor`` consumes whole words only, so a packet whose last beat
    is partial needs another structure. A CRC is linear over GF(2): with the
    CRC register ``s`` kept unreflected (most-significant bit first), ``n``
    bits ``d`` advance it to ``A^n·s ⊕ D_n·d``. The last beat of a packet
    carries ``k`` valid bytes in lanes ``0..k-1``; moving them into the top
    lanes ``width-k..width-1`` puts ``width-k`` zero bytes in front of them,
    and zero bytes processed from a zero register contribute nothing to the
    data term. So for any ``k``::

        next = G · aligned(data, k)  ⊕  F_k · state

    where ``G`` is the one full-width data matrix (``crc_width × 8·width``)
    and ``F_k = A^(8k)`` is a small ``crc_width × crc_width`` state-advance
    matrix for each valid count (``F_0`` is the identity, so ``count = 0``
    leaves the state unchanged). Powers of ``A`` commute, so ``F_k`` is
    built as two of them in series: with ``n = k / granule`` split into its
    low bits ``n_lo`` and high bits ``n_hi``,
    ``F_k = A^(8·granule·n_hi·2^b) · A^(8·granule·n_lo)``; two muxes over
    about ``2·sqrt(width/granule)`` matrix products replace one mux over
    ``width/granule + 1`` of them (17 instead of 65 for a 64-byte beat at
    granule 1), which keeps the logic, and the Verilator build, several
    times smaller. The hardware is one XOR tree for ``G``, a byte shifter
    for the alignment, and the two muxes; the matrices are computed here at
    elaboration from the algorithm's parameters.

    Parameters
    ----------
    algorithm : :class:`amaranth.lib.crc.Algorithm`
    width : int
        Bytes per beat, a power of two from 8 to 256.
    granule : int
        1, 2 or 4: ``count`` is always a multiple of it (other counts give an
        undefined result), so only those
        ``F_k`` are built.

    Ports
    -----
    start : In(1)
        This beat begins a new CRC: its state is the initial value.
    valid : In(1)
        A beat is present: the state register takes the new state at the clock edge.
    data : In(8 * width)
    count : In(range(width + 1))
        Valid bytes in this beat, from lane 0; ``width`` for a full beat.
    crc : Out(crc_width)
        Combinational: the final CRC (output reflection and XOR applied) of
        everything since ``start`` including this beat's ``count`` bytes, so a
        transmitter can append it on the cycle of the last beat.
    match : Out(1)
        Combinational: everything since ``start`` including this beat is a
        valid codeword (data followed by its CRC, least-significant byte
        first), so a receiver can check a packet on its last beat.
    """
    def __init__(self, algorithm, width, granule=1):
        check_parameters(algorithm, width)
        if granule not in (1, 2, 4):
            raise ValueError(f"Granule must be 1, 2 or 4 bytes, not {granule!r}")
        self._parameters = algorithm(8)
        self._algorithm = algorithm
        self._width = width
        self._granule = granule
        super().__init__({
            "start": In(1),
            "valid": In(1),
            "data": In(8 * width),
            "count": In(range(width + 1)),
            "crc": Out(algorithm.crc_width),
            "match": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        algorithm, width = self._algorithm, self._width
        beat_matrix, fine_matrices, coarse_matrices = _beat_matrices(algorithm, width, self._granule)

        state = Signal(algorithm.crc_width, init=algorithm.initial_crc)
        source = Signal(algorithm.crc_width)
        m.d.comb += source.eq(Mux(self.start, algorithm.initial_crc, state))
        aligned = Signal(8 * width)
        lead_bytes = Signal(range(width + 1))
        m.d.comb += [
            lead_bytes.eq(width - self.count),
            aligned.eq(self.data << Cat(C(0, 3), lead_bytes)),
        ]
        steps = self.count[exact_log2(self._granule):]
        fine_bits = exact_log2(len(fine_matrices))
        fine_step, coarse_step = steps[:fine_bits], steps[fine_bits:]
        fine_advanced = Signal(algorithm.crc_width)
        with m.Switch(fine_step):
            for step, matrix in enumerate(fine_matrices):
                with m.Case(step):
                    m.d.comb += fine_advanced.eq(multiply(matrix, source))
        advanced = Signal(algorithm.crc_width)
        with m.Switch(coarse_step):
            # Counts past the width are not allowed; the last case as the default keeps the case complete.
            for step, matrix in enumerate(coarse_matrices):
                with m.Case(step) if step < len(coarse_matrices) - 1 else m.Default():
                    m.d.comb += advanced.eq(multiply(matrix, fine_advanced))

        following = Signal(algorithm.crc_width)
        m.d.comb += following.eq(multiply(beat_matrix, aligned) ^ advanced)
        with m.If(self.valid):
            m.d.sync += state.eq(following)

        register_out = following[::-1] if algorithm.reflect_output else following
        m.d.comb += [
            self.crc.eq(register_out ^ algorithm.xor_output),
            self.match.eq(register_out == self._parameters.residue()),
        ]
        return m


def _beat_matrices(algorithm, width, granule):
    """The data matrix ``G`` and the fine and coarse state-advance matrices of a beat.

    ``fine[n]`` advances the state by ``n`` granules for ``n < 2^b`` and
    ``coarse[n]`` by ``n·2^b`` granules, with ``b`` half the bits of a count
    in granules.
    """
    steps = width // granule
    fine_steps = 1 << steps.bit_length() // 2
    powers = []  # powers[n] advances the state by n granules
    columns = advance_columns(algorithm, 0)
    for _ in range(steps + 1):
        powers.append(rows(columns, algorithm.crc_width))
        columns = advance_columns(algorithm, 8 * granule, columns)
    return data_matrix(algorithm, width), powers[:fine_steps], powers[::fine_steps]
