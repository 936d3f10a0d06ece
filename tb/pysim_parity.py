"""Amaranth 0.5's Python simulator computes a reduction XOR (``Value.xor()``, every bit of the
CRCs) as ``format(x, 'b').count('1') % 2``; ``int.bit_count()`` (Python 3.10) is 5 to 20 times
faster. :func:`install` makes the simulator emit that instead: the same bit, the block tests
whose designs hold a CRC quicker (README, What `make test` does)."""
from amaranth.sim import _pyrtl

__all__ = ["install"]


def install():
    """Patch the simulator's expression compiler once per process; ``False`` if this
    Amaranth has no such compiler (the patch is then not needed or must be redone:
    ``tb/test_pysim_parity.py`` fails)."""
    compiler = getattr(_pyrtl, "_RHSValueCompiler", None)
    if compiler is None:
        return False
    if getattr(compiler.on_Operator, "bit_count_parity", False):
        return True
    emit_operator = compiler.on_Operator

    def on_Operator(self, value):
        if value.operator == "r^" and len(value.operands) == 1:
            arg, = value.operands
            return f"(({(1 << len(arg)) - 1:#x} & {self(arg)}).bit_count() & 1)"
        return emit_operator(self, value)

    on_Operator.bit_count_parity = True
    compiler.on_Operator = on_Operator
    return True
