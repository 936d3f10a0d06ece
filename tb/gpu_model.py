"""A GPU posting RDMA work the way NVSHMEM's IBGDA device code and DeepEP's copy of it post
(``ibgda_device.cuh``); docs/nic-formats.md ("What the GPU model posts") cites each function.

Each QP has the IBGDA bookkeeping NVSHMEM keeps in ``nvshmemi_ibgda_device_qp``:

- ``resv_head``: the next free basic block. A warp reserves its WQE slots with one atomic
  add (``ibgda_reserve_wqe_slots``); before that it waits until the ring has room, i.e.
  ``resv_head + n - cons_head <= ring size`` (``ibgda_wait_for_slot_availability``, which
  polls the CQ).
- the warp writes its WQE(s) into the ring in GPU memory (``ibgda_write_*_wqe``);
- ``ready_head``: warps publish in reservation order: a warp waits until ``ready_head`` is
  its base index, then moves it past its WQEs (``ibgda_submit_requests``);
- ``rung_head`` (``mvars->tx_wq.prod_idx``): ``ibgda_post_send`` raises it to the published
  index (an ``atomicMax``: a stale post rings nothing), writes the doorbell record
  (``ibgda_update_dbr``: big-endian producer index in the QP's DBR) and then rings the
  doorbell (``ibgda_ring_db``: the first 8 bytes of a control segment with the producer
  index and the QPN, one 64-bit MMIO write to the UAR page).

DeepEP's operations (``csrc/kernels/ibgda_device.cuh``) are :meth:`GpuModel.put_nbi_warp`,
:meth:`GpuModel.amo_nonfetch_add` and :meth:`GpuModel.quiet`; :meth:`GpuModel.post` posts
any other WQE (the NIC tests' mixes) with the testbench's doorbell cadence ``ring_every``.

``cons_head`` advances when a CQE for the QP is seen (the testbench tells the model as
the NIC writes each CQE: :meth:`GpuModel.completed`). Warps run concurrently as cocotb
coroutines; the memory writes of the GPU are immediate (they land before the doorbell,
as the fences before NVSHMEM's doorbell guarantee).
"""
from dataclasses import dataclass, field

import cocotb
from cocotb.triggers import RisingEdge

from models import mlx5

__all__ = ["GpuQp", "GpuModel", "put_chunks", "REQUESTS_PER_DOORBELL", "SIGNAL_BYTES"]

WQEBB = 64
# DeepEP's ibgda_submit_requests: a put rings when (message_idx + 1) % kNumRequestInBatch == 0.
REQUESTS_PER_DOORBELL = 4
# nvshmemi_ibgda_amo_nonfetch_add adds an int: a 4-byte masked fetch-add.
SIGNAL_BYTES = 4


@dataclass
class GpuQp:
    qpn: int
    sq_base: int
    log_sq_size: int
    dbr_address: int
    ibuf: int = 0           # qp->ibuf.buf: where a non-fetching atomic's old value lands
    ibuf_lkey: int = 0      # qp->ibuf.lkey
    resv_head: int = 0
    ready_head: int = 0
    cons_head: int = 0
    rung_head: int = 0
    unrung: int = 0         # WQEs published by post() since the last doorbell
    posted: list = field(default_factory=list)     # (wqe_index, blocks, tag) in ring order

    @property
    def ring_blocks(self):
        return 1 << self.log_sq_size

    def block_address(self, index):
        return self.sq_base + WQEBB * (index % self.ring_blocks)


def put_chunks(laddr, raddr, nbytes, chunk_bytes):
    """(laddr, raddr, bytes) of each RDMA WRITE ``nvshmemi_ibgda_put_nbi_warp`` splits a put
    into: a WQE ends where the local or the remote registration chunk ends
    (``ibgda_get_lkey_and_rkey`` returns the smaller of the two chunks' remainders;
    ``chunk_bytes`` is ``1 << log2_cumem_granularity``, chunks aligned to it)."""
    out = []
    while nbytes:
        n = min(nbytes, chunk_bytes - laddr % chunk_bytes, chunk_bytes - raddr % chunk_bytes)
        out.append((laddr, raddr, n))
        laddr, raddr, nbytes = laddr + n, raddr + n, nbytes - n
    return out


class GpuModel:
    """Posts WQEs from many warps and rings doorbells through ``tb.ring_doorbell``.

    ``tb`` provides ``clock``, ``memory`` (a cocotbext-axi ``AxiRam`` or what writes into
    it), ``async ring_doorbell(data8)`` (one 8-byte UAR write) and ``builder(qpn,
    **fields)`` (a ``build(index)`` for :func:`models.mlx5.build_wqe`'s fields that
    predicts the WQE's outcome). ``chunk_bytes``: the registration chunk a put may not
    cross (NVSHMEM's cumem granularity; the testbenches register each memory as one key,
    so the default never splits their puts)."""

    def __init__(self, tb, qps, *, ring_every=1, chunk_bytes=1 << 32):
        if ring_every < 1:
            raise ValueError(f"ring_every must be at least 1, not {ring_every!r}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be at least 1, not {chunk_bytes!r}")
        self.tb = tb
        self.qps = {qp.qpn: qp for qp in qps}
        self.ring_every = ring_every
        self.chunk_bytes = chunk_bytes
        self.doorbells_rung = 0

    async def _cycle(self):
        await RisingEdge(self.tb.clock)

    # --- the IBGDA steps every post takes ---------------------------------------------------

    async def _reserve(self, qp, blocks):
        """``ibgda_wait_for_slot_availability`` then ``ibgda_reserve_wqe_slots``."""
        while qp.resv_head + blocks - qp.cons_head > qp.ring_blocks:
            await self._cycle()
        base = qp.resv_head
        qp.resv_head += blocks
        return base

    def _write(self, qp, base, wqe, tag):
        for k in range(len(wqe) // WQEBB):          # the ring may wrap inside a WQE
            self.tb.memory.write(qp.block_address(base + k), wqe[k * WQEBB:(k + 1) * WQEBB])
        qp.posted.append((base % (1 << 16), len(wqe) // WQEBB, tag))

    async def _publish(self, qp, base, blocks):
        """``ibgda_submit_requests``' first half: publish in reservation order (its second
        half, whether to :meth:`post_send`, is each operation's)."""
        while qp.ready_head != base:
            await self._cycle()
        qp.ready_head = base + blocks

    async def post_send(self, qp, prod_idx):
        """``ibgda_post_send``: if ``prod_idx`` is beyond what was rung (``atomicMax`` on
        ``prod_idx``), write the doorbell record and then ring the doorbell."""
        qp.unrung = 0
        if prod_idx <= qp.rung_head:
            return
        qp.rung_head = prod_idx
        self.tb.memory.write(qp.dbr_address, mlx5.doorbell_record(prod_idx))
        self.doorbells_rung += 1
        await self.tb.ring_doorbell(mlx5.doorbell(qp.qpn, prod_idx))

    # --- DeepEP's operations ------------------------------------------------------------------

    async def put_nbi_warp(self, qpn, *, laddr, lkey, raddr, rkey, nbytes, message_idx,
                           always_post=False, tag=None):
        """``nvshmemi_ibgda_put_nbi_warp<always_post>``: one RDMA WRITE with a data segment
        per registration chunk (:func:`put_chunks`, each ``ibgda_write_rdma_write_wqe``:
        ds 3, CQ_UPDATE), reserved and published together; the doorbell only when
        ``always_post`` or ``(message_idx + 1) % 4 == 0``. Returns the first WQE index."""
        qp = self.qps[qpn]
        chunks = put_chunks(laddr, raddr, nbytes, self.chunk_bytes)
        base = await self._reserve(qp, len(chunks))
        for k, (chunk_laddr, chunk_raddr, n) in enumerate(chunks):
            build = self.tb.builder(qpn, opcode=mlx5.Opcode.RDMA_WRITE, byte_count=n, lkey=lkey,
                                    laddr=chunk_laddr, raddr=chunk_raddr, rkey=rkey,
                                    fm_ce_se=mlx5.CTRL_CQ_UPDATE)
            self._write(qp, base + k, build((base + k) % (1 << 16)), tag)
        await self._publish(qp, base, len(chunks))
        if always_post or (message_idx + 1) % REQUESTS_PER_DOORBELL == 0:
            await self.post_send(qp, qp.ready_head)
        return base % (1 << 16)

    async def amo_nonfetch_add(self, qpn, *, raddr, rkey, value, tag=None):
        """``nvshmemi_ibgda_amo_nonfetch_add``: ``ibgda_write_amo_add_wqe`` (a 4-byte masked
        fetch-add, field boundary 0, CQ_UPDATE, the old value into the QP's ``ibuf``:
        NVSHMEM's ADD of an int, :func:`models.mlx5.nvshmem_atomic_fields`), then always
        the doorbell. Returns the WQE's index."""
        qp = self.qps[qpn]
        base = await self._reserve(qp, 1)
        build = self.tb.builder(qpn, **mlx5.nvshmem_atomic_fields("ADD", SIGNAL_BYTES, value),
                                raddr=raddr, rkey=rkey, laddr=qp.ibuf, lkey=qp.ibuf_lkey,
                                byte_count=SIGNAL_BYTES, fm_ce_se=mlx5.CTRL_CQ_UPDATE)
        self._write(qp, base, build(base % (1 << 16)), tag)
        await self._publish(qp, base, 1)
        await self.post_send(qp, qp.ready_head)
        return base % (1 << 16)

    async def quiet(self, qpn):
        """``nvshmemi_ibgda_quiet``: wait until the CQEs cover every WQE published on QP
        ``qpn`` (DeepEP's ``ibgda_poll_cq`` up to ``ready_head``). It posts nothing: NVSHMEM
        adds a DUMP only after READs or fetching atomics, which DeepEP's kernels do not
        post."""
        qp = self.qps[qpn]
        while qp.cons_head < qp.ready_head:
            await self._cycle()

    # --- any WQE, for the NIC tests -----------------------------------------------------------

    async def post(self, qpn, blocks, build, tag=None, last=False):
        """One warp posts one WQE of ``blocks`` basic blocks to QP ``qpn``: ``build(index)``
        returns its bytes for ring index ``index``. The doorbell after every ``ring_every``
        WQEs published by this method, and after ``last`` (a warp's final WQE). Returns
        the WQE's index."""
        qp = self.qps[qpn]
        base = await self._reserve(qp, blocks)
        wqe = build(base % (1 << 16))
        if len(wqe) != blocks * WQEBB:
            raise ValueError(f"WQE of {len(wqe)} bytes for {blocks} basic blocks")
        self._write(qp, base, wqe, tag)
        await self._publish(qp, base, blocks)
        qp.unrung += 1
        if qp.unrung >= self.ring_every or last:
            await self.post_send(qp, qp.ready_head)
        return base % (1 << 16)

    async def flush(self):
        """Ring every QP that has published WQEs not rung yet (the WQEs a ``ring_every``
        batch of :meth:`post` left)."""
        for qp in self.qps.values():
            await self.post_send(qp, qp.ready_head)

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
        ``(qpn, blocks, build, tag)`` for :meth:`post`. Returns the tasks. A warp rings after
        its last WQE; WQEs other warps left in a batch need :meth:`flush`."""
        async def warp(items):
            for n, (qpn, blocks, build, tag) in enumerate(items):
                await self.post(qpn, blocks, build, tag, last=(n == len(items) - 1))
        return [cocotb.start_soon(warp(items)) for items in work]
