"""tb/gpu_model.py posts byte for byte what DeepEP's copy of NVSHMEM's IBGDA code posts
(DeepEP ``csrc/kernels/ibgda_device.cuh``): every WQE, the doorbell record and the doorbell,
in that order, with DeepEP's doorbell cadence. Pure Python: the reference layouts below are
written from the C structs and stores, not from models/mlx5.py's builders."""
import asyncio
import random
import struct

import pytest

from models import mlx5
from tb.gpu_model import GpuModel, GpuQp, put_chunks

QPN = 0x2A5
SQ_BASE = 0x10000
DBR = 0x8000
IBUF, IBUF_LKEY = 0x9000, 0x0000_0B5A


class FakeGpuSide:
    """What GpuModel needs of a testbench: memory writes and doorbells, kept in one list in
    the order the GPU made them, and a builder of mlx5.build_wqe's fields."""

    def __init__(self):
        self.memory = self
        self.events = []
        self.ring = bytearray(1 << 16)

    def write(self, address, data):
        self.events.append(("write", address, bytes(data)))
        if SQ_BASE <= address < SQ_BASE + len(self.ring):
            self.ring[address - SQ_BASE:address - SQ_BASE + len(data)] = data

    async def ring_doorbell(self, data8):
        self.events.append(("doorbell", bytes(data8)))

    def builder(self, qpn, **fields):
        opcode = fields.pop("opcode")
        return lambda index: mlx5.build_wqe(opcode, index, qpn, **fields).data

    def block(self, gpu, index):
        """The basic block at ring index ``index`` of the QP."""
        address = gpu.qps[QPN].block_address(index) - SQ_BASE
        return bytes(self.ring[address:address + 64])

    def doorbells(self):
        """(doorbell record bytes written just before, doorbell bytes) of each doorbell."""
        out = []
        for k, event in enumerate(self.events):
            if event[0] == "doorbell":
                before = self.events[k - 1]
                out.append((before[2] if before[:2] == ("write", DBR) else None, event[1]))
        return out


def gpu_of(side, log_sq_size=6, **kwargs):
    return GpuModel(side, [GpuQp(qpn=QPN, sq_base=SQ_BASE, log_sq_size=log_sq_size,
                                 dbr_address=DBR, ibuf=IBUF, ibuf_lkey=IBUF_LKEY)], **kwargs)


# --- DeepEP's stores, field by field (ibgda_device.cuh) ----------------------------------------

def deepep_ctrl(opmod_idx_opcode, ds):
    """ctrl_seg = {0}; qpn_ds = HtoBE32((qp->qpn << 8) | ds); fm_ce_se = CQ_UPDATE."""
    return struct.pack(">IIBBBBI", opmod_idx_opcode, QPN << 8 | ds, 0, 0, 0, 0x08, 0)


def deepep_rdma_write(index, laddr, lkey, raddr, rkey, nbytes):
    """ibgda_write_rdma_write_wqe: ctrl (RDMA_WRITE, ds 3), raddr_seg, data_seg."""
    return (deepep_ctrl(index << 8 | 0x08, 3) + struct.pack(">QII", raddr, rkey, 0)
            + struct.pack(">IIQ", nbytes, lkey, laddr))


def deepep_amo_add(index, value, raddr, rkey):
    """ibgda_write_amo_add_wqe: MLX5_OPCODE_ATOMIC_MASKED_FA | wqe_idx << 8 | 0x08000000,
    ds 4, ibgda_atomic_32_masked_fa_seg_t {HtoBE32(value), 0, reserved}, data_seg of
    sizeof(int) at qp->ibuf. DeepEP leaves the 8 reserved bytes unwritten (the NIC does not
    read them); the model writes zeros."""
    return (deepep_ctrl(0x08000000 | index << 8 | 0x15, 4) + struct.pack(">QII", raddr, rkey, 0)
            + struct.pack(">II", value & 0xFFFFFFFF, 0) + bytes(8)
            + struct.pack(">IIQ", 4, IBUF_LKEY, IBUF))


def deepep_doorbell(pi):
    """ibgda_update_dbr then ibgda_ring_db: HtoBE32(pi & 0xffff) into the DBR, then the 8
    bytes {HtoBE32(pi << 8), HtoBE32(qpn << 8)} to the UAR."""
    return struct.pack(">I", pi & 0xFFFF), struct.pack(">II", (pi & 0xFFFF) << 8, QPN << 8)


# --- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_put_and_signal_as_deepep(seed):
    """A warp's puts to one rank then its signal (DeepEP's dispatch and combine): every WQE
    byte for byte, the rest of its block zero, a doorbell after every 4th put and after the
    signal, each preceded by its doorbell record."""
    rng = random.Random(seed)
    side = FakeGpuSide()
    gpu = gpu_of(side)
    puts = [dict(laddr=rng.randrange(1 << 24), lkey=rng.getrandbits(32),
                 raddr=rng.randrange(1 << 40), rkey=rng.getrandbits(32),
                 nbytes=rng.randrange(1, 1 << 16)) for _ in range(rng.randrange(1, 11))]
    value = -rng.randrange(1, 100)
    amo = dict(raddr=rng.randrange(1 << 40) & ~3, rkey=rng.getrandbits(32))

    async def warp():
        for k, put in enumerate(puts):
            assert await gpu.put_nbi_warp(QPN, **put, message_idx=k) == k
        assert await gpu.amo_nonfetch_add(QPN, **amo, value=value) == len(puts)
    asyncio.run(warp())

    for k, put in enumerate(puts):
        want = deepep_rdma_write(k, **put)
        assert side.block(gpu, k) == want.ljust(64, b"\0"), f"put {k}"
    assert side.block(gpu, len(puts)) == deepep_amo_add(len(puts), value, **amo).ljust(64, b"\0")
    rung = [pi for pi in range(1, len(puts) + 1) if pi % 4 == 0] + [len(puts) + 1]
    assert side.doorbells() == [deepep_doorbell(pi) for pi in rung]


def test_always_post_and_ring_wrap():
    """kAlwaysDoPostSend rings every put; indices wrap the 16-bit fields and the ring."""
    side = FakeGpuSide()
    gpu = gpu_of(side, log_sq_size=2)
    qp = gpu.qps[QPN]
    qp.resv_head = qp.ready_head = qp.cons_head = qp.rung_head = 0xFFFE

    async def warp():
        for k in range(3):
            await gpu.put_nbi_warp(QPN, laddr=64 * k, lkey=1, raddr=128 * k, rkey=2, nbytes=8,
                                   message_idx=k, always_post=True)
            gpu.completed(QPN, (0xFFFE + k) % (1 << 16), 1)
    asyncio.run(warp())
    for k in range(3):
        index = (0xFFFE + k) % (1 << 16)
        assert side.block(gpu, 0xFFFE + k) == \
            deepep_rdma_write(index, 64 * k, 1, 128 * k, 2, 8).ljust(64, b"\0")
    assert side.doorbells() == [deepep_doorbell(pi) for pi in (0xFFFF, 0x10000, 0x10001)]


@pytest.mark.parametrize("seed", range(4))
def test_put_split_at_registration_chunks(seed):
    """nvshmemi_ibgda_put_nbi_warp: a put is one WQE per piece between registration chunk
    boundaries of the local or the remote buffer, reserved and published together."""
    rng = random.Random(seed)
    chunk = 1 << rng.randrange(8, 13)
    laddr, raddr = rng.randrange(1 << 20), rng.randrange(1 << 20)
    nbytes = rng.randrange(1, 5 * chunk)
    pieces = put_chunks(laddr, raddr, nbytes, chunk)
    assert sum(n for _, _, n in pieces) == nbytes and pieces[0][:2] == (laddr, raddr)
    for (la, ra, n), (nla, nra, _) in zip(pieces, pieces[1:] + [(laddr + nbytes,
                                                                raddr + nbytes, 0)]):
        assert (nla, nra) == (la + n, ra + n)
        # no piece crosses a boundary; each but the last ends at one
        assert la // chunk == (la + n - 1) // chunk and ra // chunk == (ra + n - 1) // chunk
    assert all((la + n) % chunk == 0 or (ra + n) % chunk == 0 for la, ra, n in pieces[:-1])

    side = FakeGpuSide()
    gpu = gpu_of(side, chunk_bytes=chunk)
    asyncio.run(gpu.put_nbi_warp(QPN, laddr=laddr, lkey=5, raddr=raddr, rkey=6, nbytes=nbytes,
                                 message_idx=3))
    for k, (la, ra, n) in enumerate(pieces):
        assert side.block(gpu, k) == deepep_rdma_write(k, la, 5, ra, 6, n).ljust(64, b"\0")
    assert side.doorbells() == [deepep_doorbell(len(pieces))]


def test_quiet_waits_for_the_last_cqe():
    """nvshmemi_ibgda_quiet polls the CQ until every published WQE has completed, and
    posts nothing."""
    side = FakeGpuSide()
    gpu = gpu_of(side)
    waits = []

    async def cycle():
        waits.append(gpu.qps[QPN].cons_head)
        gpu.completed(QPN, len(waits) - 1, 1)      # one CQE per cycle
    gpu._cycle = cycle

    async def warp():
        for k in range(3):
            await gpu.put_nbi_warp(QPN, laddr=0, lkey=1, raddr=0, rkey=2, nbytes=64,
                                   message_idx=k, always_post=True)
        events = len(side.events)
        await gpu.quiet(QPN)
        assert len(side.events) == events
    asyncio.run(warp())
    assert waits == [0, 1, 2] and gpu.qps[QPN].cons_head == 3


def test_post_rings_the_record_first_and_never_backwards():
    """post() (any WQE) rings through the same ibgda_post_send: the record, then the
    doorbell, every ring_every WQEs; flush() rings what a batch left, once."""
    side = FakeGpuSide()
    gpu = gpu_of(side, ring_every=4)

    async def warp():
        for k in range(6):
            await gpu.post(QPN, 1, side.builder(QPN, opcode=mlx5.Opcode.NOP))
        await gpu.flush()
        await gpu.flush()
    asyncio.run(warp())
    assert side.doorbells() == [deepep_doorbell(4), deepep_doorbell(6)]
    assert gpu.doorbells_rung == 2
