"""A GPU posting RDMA work the way NVSHMEM's IBGDA device code does (``ibgda_device.cuh``).

Each QP has the IBGDA bookkeeping NVSHMEM keeps in ``nvshmemi_ibgda_device_qp``:

- ``resv_head``: the next free basic block. A warp reserves its WQE slots with one atomic
  add (``ibgda_reserve_wqe_slots``); before that it waits until the ring has room, i.e.
  ``resv_head + n - cons_head <= ring size`` (``ibgda_wait_for_slot_availability``, which
  polls the CQ).
- the warp writes its WQE(s) into the ring in GPU memory (``ibgda_write_*_wqe``);
- ``ready_head``: warps publish in reservation order: a warp waits until ``ready_head`` is
  its base index, then moves it past its WQEs (``ibgda_submit_requests``);
- every ``ring_every`` published WQEs (and at a warp's last one) the warp writes the
  doorbell record (``ibgda_update_dbr``: big-endian producer index in the QP's DBR) and
  rings the doorbell (``ibgda_ring_db``: the first 8 bytes of a control segment with the
  producer index and the QPN, one 64-bit MMIO write to the UAR page).

``cons_head`` advances when a CQE for the QP is seen (the testbench tells the model as
the NIC writes each CQE: :meth:`GpuModel.completed`). Warps run concurrently as cocotb
coroutines; the memory writes of the GPU are immediate (they land before the doorbell,
as the ``__threadfence_system()`` before NVSHMEM's doorbell guarantees).
"""
from dataclasses import dataclass, field

import cocotb
from cocotb.triggers import RisingEdge

from models import mlx5

__all__ = ["GpuQp", "GpuModel"]

WQEBB = 64


@dataclass
class GpuQp:
    qpn: int
    sq_base: int
    log_sq_size: int
    dbr_address: int
    resv_head: int = 0
    ready_head: int = 0
    cons_head: int = 0
    rung_head: int = 0
    unrung: int = 0
    posted: list = field(default_factory=list)     # (wqe_index, blocks, tag) in ring order

    @property
    def ring_blocks(self):
        return 1 << self.log_sq_size

    def block_address(self, index):
        return self.sq_base + WQEBB * (index % self.ring_blocks)


class GpuModel:
    """Posts WQEs from many warps and rings doorbells through ``tb.ring_doorbell``.

    ``tb`` provides ``clock``, ``memory`` (a cocotbext-axi ``AxiRam``) and
    ``async ring_doorbell(data8)`` (one 8-byte UAR write).
    """

    def __init__(self, tb, qps, *, ring_every=1):
        if ring_every < 1:
            raise ValueError(f"ring_every must be at least 1, not {ring_every!r}")
        self.tb = tb
        self.qps = {qp.qpn: qp for qp in qps}
        self.ring_every = ring_every
        self.doorbells_rung = 0

    async def _cycle(self):
        await RisingEdge(self.tb.clock)

    async def post(self, qpn, blocks, build, tag=None, last=False):
        """One warp posts one WQE of ``blocks`` basic blocks to QP ``qpn``: ``build(index)``
        returns its bytes for ring index ``index``. ``last``: ring the doorbell after it
        whatever the batching (a warp's final WQE). Returns the WQE's index."""
        qp = self.qps[qpn]
        while qp.resv_head + blocks - qp.cons_head > qp.ring_blocks:
            await self._cycle()
        base = qp.resv_head                         # the atomicAdd
        qp.resv_head += blocks
        wqe = build(base % (1 << 16))
        if len(wqe) != blocks * WQEBB:
            raise ValueError(f"WQE of {len(wqe)} bytes for {blocks} basic blocks")
        for k in range(blocks):                     # the ring may wrap inside a WQE
            self.tb.memory.write(qp.block_address(base + k), wqe[k * WQEBB:(k + 1) * WQEBB])
        qp.posted.append((base % (1 << 16), blocks, tag))
        while qp.ready_head != base:
            await self._cycle()
        qp.ready_head = base + blocks
        qp.unrung += 1
        if qp.unrung >= self.ring_every or last:
            await self.ring(qp)
        return base % (1 << 16)

    async def ring(self, qp, pi=None):
        """Write the doorbell record and ring the doorbell with ``pi`` (default: the QP's
        ``ready_head``)."""
        pi = qp.ready_head if pi is None else pi
        qp.unrung = 0
        qp.rung_head = max(qp.rung_head, pi)
        self.tb.memory.write(qp.dbr_address, mlx5.doorbell_record(pi % (1 << 16)))
        self.doorbells_rung += 1
        await self.tb.ring_doorbell(mlx5.doorbell(qp.qpn, pi % (1 << 16)))

    async def quiet(self):
        """Ring every QP that has published WQEs not rung yet (what ``nvshmem_quiet`` does
        before it waits for completions: batched doorbells are flushed)."""
        for qp in self.qps.values():
            if qp.unrung:
                await self.ring(qp)

    def completed(self, qpn, wqe_index, blocks):
        """A CQE for QP ``qpn``'s WQE at ``wqe_index`` (``blocks`` long) was written: its
        slots, and those of every WQE before it, are free again."""
        qp = self.qps[qpn]
        end = wqe_index + blocks
        # Indices are 16 bits in the CQE; cons_head counts on.
        advance = (end - qp.cons_head) % (1 << 16)
        if advance > qp.ring_blocks:
            raise AssertionError(f"QP {qpn}: CQE for WQE {wqe_index} is outside the ring "
                                 f"(consumer at {qp.cons_head})")
        qp.cons_head += advance

    def start_warps(self, work):
        """Run one coroutine per warp: ``work`` is a list, one entry per warp, of
        ``(qpn, blocks, build, tag)``. Returns the tasks. A warp rings after its last WQE;
        WQEs other warps left in a batch need :meth:`quiet`."""
        async def warp(items):
            for n, (qpn, blocks, build, tag) in enumerate(items):
                await self.post(qpn, blocks, build, tag, last=(n == len(items) - 1))
        return [cocotb.start_soon(warp(items)) for items in work]
