"""Simulation-only: holds each AXI4 read request for a run-time number of cycles.

GPU or host memory seen across PCIe answers a read after hundreds of nanoseconds, while
cocotbext-axi's ``AxiRam`` answers at once. Put between a master's AR channel and the
``AxiRam``, this block gives every burst the same extra latency, ``latency`` cycles from
its acceptance here to its appearance at the RAM (at least :data:`MIN_LATENCY`), without limiting how many bursts are in
flight (up to ``depth``; beyond that the master sees ``arready`` low, as from a real
interconnect that ran out of tags). Requests leave in order, as they came.

The latency is a port, not a parameter, so one Verilator build serves every latency a
benchmark sweeps.
"""
from amaranth import *
from amaranth.lib import data, wiring
from amaranth.lib.fifo import SyncFIFOBuffered
from amaranth.lib.wiring import In, Out

from hdl.nic.signatures import AXI_ID_BITS

__all__ = ["AxiReadDelay", "AR_MEMBERS", "MIN_LATENCY"]

AR_MEMBERS = ("arid", "araddr", "arlen", "arsize", "arburst")

# The request queue's own latency: ``latency`` values below it act as this.
MIN_LATENCY = 2


class AxiReadDelay(wiring.Component):
    def __init__(self, *, addr_width=64, id_width=AXI_ID_BITS, depth=128, max_latency=4095):
        if depth < 2:
            raise ValueError(f"Depth must be at least 2 requests, not {depth!r}")
        if not 0 <= max_latency < 1 << 16:
            raise ValueError(f"Maximum latency must be 0 to 65535 cycles, not {max_latency!r}")
        self._entry = data.StructLayout({
            "arid": id_width, "araddr": addr_width, "arlen": 8, "arsize": 3, "arburst": 2,
            "stamp": 16,
        })
        self._depth = depth
        channel = {"arid": id_width, "araddr": addr_width, "arlen": 8, "arsize": 3, "arburst": 2}
        super().__init__({
            **{f"up_{name}": In(width) for name, width in channel.items()},
            "up_arvalid": In(1), "up_arready": Out(1),
            **{f"down_{name}": Out(width) for name, width in channel.items()},
            "down_arvalid": Out(1), "down_arready": In(1),
            "latency": In(range(max_latency + 1)),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.queue = queue = SyncFIFOBuffered(width=self._entry.size, depth=self._depth)
        now = Signal(16)
        m.d.sync += now.eq(now + 1)

        entry_in = Signal(self._entry)
        entry_out = self._entry(queue.r_data)
        m.d.comb += [
            *(getattr(entry_in, name).eq(getattr(self, f"up_{name}")) for name in AR_MEMBERS),
            entry_in.stamp.eq(now),
            queue.w_data.eq(entry_in),
            queue.w_en.eq(self.up_arvalid),
            self.up_arready.eq(queue.w_rdy),
        ]
        # ``now - stamp`` counts modulo 2**16, so latencies up to 65535 are exact.
        waited = Signal(16)
        m.d.comb += waited.eq(now - entry_out.stamp)
        due = Signal()
        m.d.comb += [
            due.eq(queue.r_rdy & (waited >= self.latency)),
            self.down_arvalid.eq(due),
            queue.r_en.eq(due & self.down_arready),
            *(getattr(self, f"down_{name}").eq(getattr(entry_out, name)) for name in AR_MEMBERS),
        ]
        return m
