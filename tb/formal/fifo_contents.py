"""What a ``SyncFIFOBuffered`` inside a component holds, for a harness's invariants over memory
contents (docs/formal.md, Memory contents).

k-induction starts from any state, and a FIFO's memory words are state like any register: an
invariant that ties them to the rest of the design has to read them. The FIFO is elaborated
here, before Amaranth does it, with Amaranth's own formal assertions on its pointers
(platform ``"formal"``), and its memory gets one combinational read port per word: the
harness reads every entry without changing the FIFO's logic.
"""
from amaranth import Array, Mux, Signal

__all__ = ["elaborate_now", "FifoContents"]


def elaborate_now(elaboratable, platform):
    """Elaborate ``elaboratable`` now and make Amaranth's own elaboration of it later return
    the same module, so that what it built (submodules, memories) can still be added to."""
    module = elaboratable.elaborate(platform)
    elaboratable.elaborate = lambda platform: module
    return module


class FifoContents:
    """The entries of ``fifo`` (a not yet elaborated ``SyncFIFOBuffered`` of depth 2 or more),
    head first: ``entries[j]`` is the j-th entry to be read, meaningful for ``j < level``.
    The head is the output register (while ``r_rdy``), the rest the memory words from the
    read pointer on."""

    def __init__(self, m, fifo):
        module = elaborate_now(fifo, "formal")
        storage = module.submodules.storage
        depth = storage.depth
        (consume_port,) = storage.read_ports
        words = []
        for address in range(depth):
            port = storage.read_port(domain="comb")
            m.d.comb += port.addr.eq(address)
            words.append(port.data)
        words = Array(words)
        consume = consume_port.addr
        self.level = fifo.level
        self.entries = []
        for j in range(depth + 1):
            word = Signal(fifo.width, name=f"{fifo.__class__.__name__.lower()}_entry{j}")
            if j == 0:
                m.d.comb += word.eq(Mux(fifo.r_rdy, fifo.r_data, words[consume]))
            else:
                offset = consume + j - fifo.r_rdy
                m.d.comb += word.eq(words[Mux(offset >= depth, offset - depth, offset)])
            self.entries.append(word)
