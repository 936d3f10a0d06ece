"""models/mlx5.py and models/nic/: mlx5 layouts byte by byte, the WQE format rules and
executor checks of docs/nic.md, MTU segmentation and PSNs, and requester + responder +
completion unit run against each other (data, CQEs, NAK error and flush)."""
import dataclasses
import random
import shutil
import time

import pytest

from hdl.nic import signatures as sig
from models import mlx5 as m
from models import nic as n
from models.ib import AETH, BTH, LRH, RETH, AtomicAckETH, AtomicETH, ImmDt, Opcode
from models.packet import build_packet, parse_packet

H = bytes.fromhex


# --- layouts, hand-computed from rdma-core mlx5dv.h and NVSHMEM ibgda_device.cuh -------------

def test_ctrl_segment_bytes():
    # struct mlx5_wqe_ctrl_seg { __be32 opmod_idx_opcode; __be32 qpn_ds; u8 signature;
    # u8 rsvd[2]; u8 fm_ce_se; __be32 imm; }, filled as ibgda_write_rdma_write_wqe does:
    # HTOBE32((wqe_idx << 8) | MLX5_OPCODE_RDMA_WRITE), HTOBE32((qpn << 8) | ds)
    seg = m.ctrl_segment(m.Opcode.RDMA_WRITE, 0x1234, 0xABCDEF, 3, fm_ce_se=m.CTRL_CQ_UPDATE,
                         imm=0x11223344)
    assert seg == H("00123408" "abcdef03" "00000008" "11223344")
    seg = m.ctrl_segment(0x12, 0xFFFF, 1, 63, opmod=0x09, fm_ce_se=0x82, signature=0x5A)
    assert seg == H("09ffff12" "0000013f" "5a000082" "00000000")


def test_other_segments_bytes():
    # mlx5_wqe_raddr_seg { __be64 raddr; __be32 rkey; __be32 reserved; }
    assert m.raddr_segment(0x0102030405060708, 0xAABBCCDD) == H("0102030405060708aabbccdd00000000")
    # mlx5_wqe_data_seg { __be32 byte_count; __be32 lkey; __be64 addr; }
    assert m.data_segment(0x40, 0x00123400, 0x7F0000001000) == H("0000004000123400" "00007f0000001000")
    # mlx5_wqe_inl_data_seg { __be32 byte_count; } | MLX5_INLINE_SEG, then the data
    assert m.inline_segment(b"\x01\x02\x03") == H("80000003010203") + bytes(9)
    assert len(m.inline_segment(bytes(12))) == 16 and len(m.inline_segment(bytes(13))) == 32
    # mlx5_wqe_atomic_seg { __be64 swap_add; __be64 compare; }
    assert m.atomic_segment(1, 0xFEDCBA9876543210) == H("0000000000000001fedcba9876543210")
    assert m.CTRL_CQ_UPDATE == 2 << 2 and m.CTRL_SOLICITED == 1 << 1 and m.CTRL_FENCE == 4 << 5


def test_doorbell_and_record():
    # ibgda_ring_db: ctrl_seg = {.opmod_idx_opcode = HTOBE32(prod_idx << 8),
    #                            .qpn_ds = HTOBE32(qp->qpn << 8)}; 8-byte store to the UAR
    assert m.doorbell(0x000123, 0x0456) == H("00045600" "00012300")
    assert m.parse_doorbell(m.doorbell(0xABCDEF, 0xFFFF)) == (0xABCDEF, 0xFFFF)
    assert m.doorbell(1, 0x10005)[:4] == H("00000500")       # pi is 16 bits
    # ibgda_update_dbr: HTOBE32(dbrec_head & 0xffff)
    assert m.doorbell_record(0x10456) == H("00000456")


def test_cqe_bytes():
    # mlx5_cqe64: byte_cnt @44, sop_drop_qpn @56, wqe_counter @60, signature @62, op_own @63
    cqe = m.build_requester_cqe(qpn=5, wqe_counter=0x0102, wqe_opcode=0x08, byte_cnt=0x1000, owner=1)
    expect = bytearray(64)
    expect[44:48] = H("00001000")
    expect[56:60] = H("08000005")
    expect[60:62] = H("0102")
    expect[63] = 0x01
    assert cqe == bytes(expect)
    # mlx5_err_cqe: vendor_err_synd @54, syndrome @55, s_wqe_opcode_qpn @56, op_own = 0xd << 4
    err = m.build_error_cqe(qpn=0x42, wqe_counter=0xFFFF, wqe_opcode=0x12, syndrome=0x13, owner=0)
    expect = bytearray(64)
    expect[55] = 0x13
    expect[56:60] = H("12000042")
    expect[60:62] = H("ffff")
    expect[63] = 0xD0
    assert err == bytes(expect)
    parsed = m.parse_cqe(err)
    assert parsed.is_error and parsed.syndrome == 0x13 and parsed.qpn == 0x42 and parsed.owner == 0
    assert parsed.pack() == err
    assert m.parse_cqe(cqe) == m.requester_cqe(5, 0x102, 8, 0x1000, owner=1)
    assert m.cqe_owner(7, 3) == 0 and m.cqe_owner(8, 3) == 1 and m.cqe_owner(3, 0) == 1
    assert m.cqe_address(0x1000, 2, False, 5) == 0x1040 and m.cqe_address(0x1000, 2, True, 5) == 0x1000


def test_enums_match_signatures():
    for e in sig.Syndrome:
        assert m.Syndrome[e.name] == e.value
    for e in sig.MlxOpcode:
        assert m.Opcode[e.name] == e.value
    for e in sig.Access:
        assert n.Access[e.name] == e.value
    for e in sig.QpState:
        assert n.QpState[e.name] == e.value
    for e in sig.CompletionStatus:
        assert n.CompletionStatus[e.name].code == e.value and n.CompletionStatus[e.name] == e.name
    # the layouts' fields, in order, then the context's own number
    assert [f.name for f in dataclasses.fields(n.QpContext)] == list(dict(sig.QpConfigLayout())) + ["qpn"]
    assert [f.name for f in dataclasses.fields(n.CqContext)] == list(dict(sig.CqConfigLayout())) + ["cqn"]
    assert [f.name for f in dataclasses.fields(n.Mkey)] == list(dict(sig.MkeyLayout()))


def test_build_parse_round_trip():
    rng = random.Random(1)
    for _ in range(300):
        op = rng.choice(list(m.Opcode))
        kw = dict(fm_ce_se=rng.choice([0, 8, 10]), imm=rng.getrandbits(32),
                  raddr=rng.getrandbits(64), rkey=rng.getrandbits(32))
        inline = None
        if op == m.Opcode.NOP:
            kw = dict(fm_ce_se=kw["fm_ce_se"], imm=kw["imm"])
            if rng.random() < 0.5:
                kw.update(byte_count=0)         # the ds 2 form
        elif op == m.Opcode.DUMP:
            kw = dict(fm_ce_se=kw["fm_ce_se"], imm=kw["imm"], byte_count=rng.getrandbits(31),
                      lkey=rng.getrandbits(32), laddr=rng.getrandbits(64))
        elif op in (m.Opcode.ATOMIC_CS, m.Opcode.ATOMIC_FA):
            kw.update(swap_add=rng.getrandbits(64), compare=rng.getrandbits(64),
                      lkey=rng.getrandbits(32), laddr=rng.getrandbits(64))
        elif op in m.MASKED_ATOMIC_OPCODES:
            opmod = rng.choice(list(m.EXT_AMO_OPMOD.values()))
            bits = 32 if opmod == m.EXT_AMO_OPMOD[4] else 64
            kw.update(opmod=opmod, lkey=rng.getrandbits(32), laddr=rng.getrandbits(64),
                      **{f: rng.getrandbits(bits) for f in ("swap_add", "compare", "swap_mask",
                                                            "compare_mask")})
        elif op == m.Opcode.RDMA_READ or rng.random() < 0.5:
            kw.update(byte_count=rng.getrandbits(rng.choice([0, 12, 31])),
                      lkey=rng.getrandbits(32), laddr=rng.getrandbits(64))
        elif rng.random() < 0.8:
            inline = rng.randbytes(rng.randrange(257))
            kw.update(inline=inline)
        idx = rng.getrandbits(16)
        wqe = m.build_wqe(op, idx, 77, **kw)
        assert len(wqe.data) == 64 * wqe.blocks == 64 * m.wqe_blocks(wqe.ds)
        p = m.parse_wqe(wqe.data)
        assert not p.format_error, (op, kw)
        assert (p.opcode, p.ds, p.ctrl_wqe_index, p.ctrl_qpn, p.fm_ce_se, p.imm) == \
            (op, wqe.ds, idx, 77, kw["fm_ce_se"], kw["imm"])
        if op == m.Opcode.NOP:
            assert wqe.ds == 1 + ("byte_count" in kw) and not p.has_data and not p.inline
            continue
        if op not in (m.Opcode.SEND, m.Opcode.SEND_IMM, m.Opcode.DUMP):
            assert (p.raddr, p.rkey) == (kw["raddr"], kw["rkey"])
        if inline is not None:
            assert p.inline and p.inline_data == inline and p.byte_count == len(inline)
        elif "byte_count" in kw:
            assert p.has_data and (p.byte_count, p.lkey, p.laddr) == (kw["byte_count"], kw["lkey"], kw["laddr"])
        if op in (m.Opcode.ATOMIC_CS, m.Opcode.ATOMIC_FA):
            assert (p.swap_add, p.compare, p.byte_count) == (kw["swap_add"], kw["compare"], 8)
        if op in m.MASKED_ATOMIC_OPCODES:
            fa = op == m.Opcode.ATOMIC_MASKED_FA
            assert (p.swap_add, p.compare, p.swap_mask, p.compare_mask, p.byte_count) == (
                kw["swap_add"], 0 if fa else kw["compare"], kw["swap_mask"],
                0 if fa else kw["compare_mask"], 4 if kw["opmod"] == 8 else 8)


def test_nvshmem_shapes():
    # RC ds as NVSHMEM computes them: write/read 3, inline write of <= 12 bytes 3, atomics 4
    assert m.build_wqe(m.Opcode.RDMA_WRITE, 0, 1, byte_count=8).ds == 3
    assert m.build_wqe(m.Opcode.RDMA_READ, 0, 1, byte_count=8).ds == 3
    assert m.build_wqe(m.Opcode.RDMA_WRITE, 0, 1, inline=bytes(12)).ds == 3
    assert m.build_wqe(m.Opcode.ATOMIC_FA, 0, 1).ds == 4
    assert m.build_wqe(m.Opcode.RDMA_WRITE, 0, 1, inline=bytes(64)).blocks == 2
    # ibgda_write_rdma_write_inl_wqe_combine_warp<T>: 32 * sizeof(T) inline bytes, ds as
    # ibgda_get_ds_in_inl_combine_warp gives them for RC; 8-byte T spans 5 blocks
    for size, ds in ((1, 5), (2, 7), (4, 11), (8, 19)):
        wqe = m.build_wqe(m.Opcode.RDMA_WRITE, 0, 1, inline=bytes(32 * size))
        assert wqe.ds == ds and m.parse_wqe(wqe.data).byte_count == 32 * size
    assert m.build_wqe(m.Opcode.RDMA_WRITE, 0, 1, inline=bytes(256)).blocks == 5
    # ibgda_write_nop_wqe: ds 2; the NOP ending a warp-combined put: ds 1;
    # ibgda_write_dump_wqe: ds 2
    assert m.build_wqe(m.Opcode.NOP, 0, 1, byte_count=0).ds == 2
    assert m.build_wqe(m.Opcode.NOP, 0, 1).ds == 1
    assert m.build_wqe(m.Opcode.DUMP, 0, 1).ds == 2


# --- a small world ----------------------------------------------------------------------------

LOCAL_BASE = 0x10000
REMOTE_BASE = 0x80000
MEM = 0x8000
PD = 3
LKEY = 0x00000501           # index 5, variant 1


def world(*, mtu=1, sq_psn=0, num_qps=2, sl_to_vl=None, log_cq=2, collapsed=False, access=None,
          num_vls=15):
    qps = [n.QpConfig(sq_base=0x4000 * (q + 1), log_sq_size=6, mtu=mtu, sl=q % 2,
                      dest_qpn=0x100 + q, dlid=0x20, pd=PD, pkey=0x8001, sq_psn=sq_psn,
                      cqn=q % 2) for q in range(num_qps)]
    cqs = [n.CqConfig(base=0x9000 + 0x1000 * c, log_size=log_cq, collapsed=collapsed)
           for c in range(2)]
    mkeys = [n.Mkey() for _ in range(8)]
    mkeys[5] = n.Mkey(key=LKEY, base=LOCAL_BASE, length=MEM,
                      access=n.Access.LOCAL_WRITE if access is None else access, pd=PD, valid=True)
    req = n.RequesterModel(0x11, sl_to_vl or [0, 1] + [0] * 14, qps, cqs, mkeys, num_vls=num_vls)
    local = bytearray(random.Random(7).randbytes(MEM))
    return req, local


def reader(local):
    def read(addr, size):
        assert LOCAL_BASE <= addr and addr + size <= LOCAL_BASE + MEM
        return bytes(local[addr - LOCAL_BASE:addr - LOCAL_BASE + size])
    return read


def writer(local):
    def write(addr, data):
        local[addr - LOCAL_BASE:addr - LOCAL_BASE + len(data)] = data
    return write


def run(req, local, qpn, idx, **kw):
    op = kw.pop("op")
    return req.execute(qpn, idx, m.build_wqe(op, idx, qpn, **kw).data, reader(local))


# --- format rules and executor checks ---------------------------------------------------------

def _raw(opcode, ds, *segs, opmod=0):
    return m.pad_blocks(m.ctrl_segment(opcode, 0, 0, ds, fm_ce_se=8, opmod=opmod)
                        + b"".join(segs))


RA = m.raddr_segment(REMOTE_BASE, 9)
DATA8 = m.data_segment(8, LKEY, LOCAL_BASE)
DATA4 = m.data_segment(4, LKEY, LOCAL_BASE)
MCS, MFA = m.Opcode.ATOMIC_MASKED_CS, m.Opcode.ATOMIC_MASKED_FA


def _masked(opcode, nbytes):
    return m.masked_atomic_segments(opcode, nbytes, 1, 2, 3, 4)

FORMAT_ERRORS = [
    ("ds 0", _raw(m.Opcode.SEND, 0, DATA8), m.Syndrome.LOCAL_QP_OP_ERR),
    ("NOP, ds 3", _raw(m.Opcode.NOP, 3), m.Syndrome.LOCAL_QP_OP_ERR),
    ("NOP, opmod 8", _raw(m.Opcode.NOP, 2, opmod=8), m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked FA, opmod 0", _raw(MFA, 4, RA, _masked(MFA, 8), DATA8), m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked CS, opmod 0x0a", _raw(MCS, 4, RA, _masked(MCS, 4), DATA4, opmod=0x0A),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked FA 8, ds 3", _raw(MFA, 3, RA, _masked(MFA, 8), opmod=9), m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked FA 8, ds 5", _raw(MFA, 5, RA, _masked(MFA, 8), DATA8, DATA8, opmod=9),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked CS 8, ds 4 (no room for its data segment)", _raw(MCS, 4, RA, _masked(MCS, 8), opmod=9),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked CS 4, ds 5", _raw(MCS, 5, RA, _masked(MCS, 4), DATA4, DATA4, opmod=8),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("masked FA 4, 8-byte data segment", _raw(MFA, 4, RA, _masked(MFA, 4), DATA8, opmod=8),
     m.Syndrome.LOCAL_LENGTH_ERR),
    ("masked CS 8, 4-byte data segment", _raw(MCS, 5, RA, _masked(MCS, 8), DATA4, opmod=9),
     m.Syndrome.LOCAL_LENGTH_ERR),
    ("masked FA 4, inline data", _raw(MFA, 4, RA, _masked(MFA, 4), m.inline_segment(bytes(4)),
                                      opmod=8), m.Syndrome.LOCAL_LENGTH_ERR),
    ("DUMP, ds 1", _raw(m.Opcode.DUMP, 1), m.Syndrome.LOCAL_QP_OP_ERR),
    ("DUMP, ds 3", _raw(m.Opcode.DUMP, 3, DATA8, DATA8), m.Syndrome.LOCAL_QP_OP_ERR),
    ("DUMP, inline", _raw(m.Opcode.DUMP, 2, m.inline_segment(bytes(1))),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("DUMP, opmod 1", _raw(m.Opcode.DUMP, 2, DATA8, opmod=1), m.Syndrome.LOCAL_QP_OP_ERR),
    ("write, five data segments", _raw(m.Opcode.RDMA_WRITE, 7, RA, *[DATA8] * 5),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("write, ds 1", _raw(m.Opcode.RDMA_WRITE, 1), m.Syndrome.LOCAL_QP_OP_ERR),
    # ds 1 with bytes beyond it that look like an over-long inline segment: the WQE ends
    # before its remote-address segment, so they are never read (as the fetcher does).
    ("write, ds 1, inline-looking tail", _raw(m.Opcode.RDMA_WRITE_IMM, 1, RA,
                                              m.inline_segment(bytes(100))),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("write, inline ds too big", _raw(m.Opcode.RDMA_WRITE, 4, RA, m.inline_segment(bytes(10))),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("write, inline ds too small", _raw(m.Opcode.RDMA_WRITE_IMM, 3, RA, m.inline_segment(bytes(13))),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("write, inline 257", _raw(m.Opcode.RDMA_WRITE, 19, RA, m.inline_segment(bytes(257))),
     m.Syndrome.LOCAL_LENGTH_ERR),
    ("write, inline 256, ds one short", _raw(m.Opcode.RDMA_WRITE, 18, RA,
                                             m.inline_segment(bytes(256))),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("send, inline 100 bad ds", _raw(m.Opcode.SEND, 2, m.inline_segment(bytes(100))),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("send, gather list with an inline-marked segment",
     _raw(m.Opcode.SEND_IMM, 4, DATA8, m.inline_segment(bytes(8)), DATA8), m.Syndrome.LOCAL_QP_OP_ERR),
    ("read, no data segment", _raw(m.Opcode.RDMA_READ, 2, RA), m.Syndrome.LOCAL_QP_OP_ERR),
    ("read, inline", _raw(m.Opcode.RDMA_READ, 3, RA, m.inline_segment(bytes(8))), m.Syndrome.LOCAL_QP_OP_ERR),
    ("read, ds 4", _raw(m.Opcode.RDMA_READ, 4, RA, DATA8, DATA8), m.Syndrome.LOCAL_QP_OP_ERR),
    ("atomic, ds 3", _raw(m.Opcode.ATOMIC_FA, 3, RA, m.atomic_segment(1)), m.Syndrome.LOCAL_QP_OP_ERR),
    ("atomic, ds 5", _raw(m.Opcode.ATOMIC_CS, 5, RA, m.atomic_segment(1), DATA8, DATA8),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("atomic, 4 bytes", _raw(m.Opcode.ATOMIC_FA, 4, RA, m.atomic_segment(1),
                             m.data_segment(4, LKEY, LOCAL_BASE)), m.Syndrome.LOCAL_LENGTH_ERR),
    ("atomic, inline data", _raw(m.Opcode.ATOMIC_CS, 4, RA, m.atomic_segment(1),
                                 m.inline_segment(bytes(8))[:16]), m.Syndrome.LOCAL_LENGTH_ERR),
]


@pytest.mark.parametrize("name,wqe,syndrome", FORMAT_ERRORS, ids=[f[0] for f in FORMAT_ERRORS])
def test_format_errors(name, wqe, syndrome):
    p = m.parse_wqe(wqe)
    assert p.format_error and p.syndrome == syndrome
    assert p.wqe_blocks == m.wqe_blocks(p.ds)
    req, local = world()
    completion = n.CompletionModel(req)
    r = req.execute(0, 3, wqe, reader(local))
    assert r.status == n.CompletionStatus.ERROR and r.syndrome == syndrome and not r.packets
    assert req.state[0] == n.QpState.ERR and req.state[1] == n.QpState.RTS
    (c,) = completion.post(r)
    assert c.cqe == m.error_cqe(0, 3, p.opcode, syndrome) and c.address == 0x9000
    good = m.build_wqe(m.Opcode.SEND, 4, 0, byte_count=8, lkey=LKEY, laddr=LOCAL_BASE)
    flushed = req.execute(0, 4, good.data, reader(local))
    assert flushed.status == n.CompletionStatus.FLUSH and not flushed.packets
    (c,) = completion.post(flushed)
    assert c.cqe.syndrome == m.Syndrome.WR_FLUSH_ERR and c.cqe.owner == 0 and c.address == 0x9040
    assert req.execute(1, 0, good.data, reader(local)).status == n.CompletionStatus.SENT


def test_fetch_error():
    req, local = world()
    good = m.build_wqe(m.Opcode.SEND, 0, 0, byte_count=8, lkey=LKEY, laddr=LOCAL_BASE)
    r = req.execute(0, 0, good.data, reader(local), fetch_error=True)
    assert r.status == n.CompletionStatus.ERROR and r.syndrome == m.Syndrome.LOCAL_QP_OP_ERR


EXECUTOR_CASES = [
    ("sl to vl15", dict(sl_to_vl=[15] * 16), dict(op=m.Opcode.SEND, inline=b"x"), m.Syndrome.LOCAL_QP_OP_ERR),
    ("sl to a VL the port lacks", dict(num_vls=1, sl_to_vl=[1] * 16), dict(op=m.Opcode.SEND, inline=b"x"),
     m.Syndrome.LOCAL_QP_OP_ERR),
    ("mtu code 0", dict(mtu=0), dict(op=m.Opcode.SEND, inline=b"x"), m.Syndrome.LOCAL_QP_OP_ERR),
    ("no key entry", {}, dict(op=m.Opcode.SEND, byte_count=4, lkey=0x601, laddr=LOCAL_BASE),
     m.Syndrome.LOCAL_PROT_ERR),
    ("key variant differs", {}, dict(op=m.Opcode.SEND, byte_count=4, lkey=0x502, laddr=LOCAL_BASE),
     m.Syndrome.LOCAL_PROT_ERR),
    ("key aliases index", {}, dict(op=m.Opcode.SEND, byte_count=4, lkey=0xD01, laddr=LOCAL_BASE),
     m.Syndrome.LOCAL_PROT_ERR),
    ("below the key", {}, dict(op=m.Opcode.RDMA_WRITE, byte_count=4, lkey=LKEY, laddr=LOCAL_BASE - 1),
     m.Syndrome.LOCAL_PROT_ERR),
    ("past the key", {}, dict(op=m.Opcode.RDMA_WRITE, byte_count=5, lkey=LKEY, laddr=LOCAL_BASE + MEM - 4),
     m.Syndrome.LOCAL_PROT_ERR),
    ("wraps", {}, dict(op=m.Opcode.RDMA_WRITE, byte_count=0x20, lkey=LKEY, laddr=(1 << 64) - 0x10),
     m.Syndrome.LOCAL_PROT_ERR),
    ("read without local write", dict(access=n.Access.REMOTE_READ),
     dict(op=m.Opcode.RDMA_READ, byte_count=4, lkey=LKEY, laddr=LOCAL_BASE), m.Syndrome.LOCAL_PROT_ERR),
    ("atomic without local write", dict(access=n.Access(0)),
     dict(op=m.Opcode.ATOMIC_FA, lkey=LKEY, laddr=LOCAL_BASE), m.Syndrome.LOCAL_PROT_ERR),
]


@pytest.mark.parametrize("name,world_kw,wqe_kw,syndrome", EXECUTOR_CASES, ids=[c[0] for c in EXECUTOR_CASES])
def test_executor_checks(name, world_kw, wqe_kw, syndrome):
    req, local = world(**world_kw)
    r = run(req, local, 0, 0, **wqe_kw)
    assert r.status == n.CompletionStatus.ERROR and r.syndrome == syndrome and not r.packets
    assert req.state[0] == n.QpState.ERR
    assert r.record() == dict(qpn=0, cqn=0, wqe_index=0, wqe_blocks=r.wqe_blocks, opcode=wqe_kw["op"],
                              byte_count=0, first_psn=0, last_psn=0, signaled=1, status=1,
                              syndrome=int(syndrome), laddr=0, mtu=req.qps[0].mtu, retry_cnt=7,
                              rnr_retry=7, ack_timeout=0)


def test_executor_checks_pass():
    # the PD must match too: a second world whose QP has another PD
    req, local = world()
    req.qps[0] = dataclasses.replace(req.qps[0], pd=PD + 1)
    r = run(req, local, 0, 0, op=m.Opcode.SEND, byte_count=4, lkey=LKEY, laddr=LOCAL_BASE)
    assert r.syndrome == m.Syndrome.LOCAL_PROT_ERR
    # and what must not fail: a write needs no LOCAL_WRITE, 0 bytes need no key at all,
    # the key's last byte is inside
    req, local = world(access=n.Access(0))
    for idx, kw in enumerate([
            dict(op=m.Opcode.RDMA_WRITE, byte_count=4, lkey=LKEY, laddr=LOCAL_BASE + MEM - 4),
            dict(op=m.Opcode.SEND, byte_count=0, lkey=0xBAD, laddr=0),
            dict(op=m.Opcode.RDMA_READ, byte_count=0, lkey=0xBAD, laddr=0)]):
        assert run(req, local, 0, idx, **kw).status == n.CompletionStatus.SENT, kw


# --- packets ----------------------------------------------------------------------------------

def _check_message(r, qp, req, local, laddr, length, op, *, imm=0, fm_ce_se=8, raddr=0, inline=None):
    mtu = qp.mtu_bytes
    parsed = [parse_packet(p) for p in r.packets]
    payload = b"".join(p.payload for p in parsed)
    if op == m.Opcode.RDMA_READ:
        assert len(parsed) == 1 and parsed[0].bth.opcode == Opcode.RDMA_READ_REQUEST
        assert parsed[0].ext == (RETH(va=raddr, rkey=9, dmalen=length),)
        assert n.psn_diff(r.last_psn, r.first_psn) == max(1, -(-length // mtu)) - 1
    else:
        assert len(parsed) == max(1, -(-length // mtu))
        assert payload == (inline if inline is not None else local[laddr - LOCAL_BASE:laddr - LOCAL_BASE + length])
        assert n.psn_diff(r.last_psn, r.first_psn) == len(parsed) - 1
    for i, p in enumerate(parsed):
        last = i == len(parsed) - 1
        assert p.icrc_ok and p.grh is None
        assert (p.lrh.vl, p.lrh.lver, p.lrh.sl, p.lrh.dlid, p.lrh.slid) == \
            (req.sl_to_vl[qp.sl], 0, qp.sl, qp.dlid, req.slid)
        assert (p.bth.m, p.bth.tver, p.bth.pkey, p.bth.resv8a, p.bth.destqp) == (0, 0, qp.pkey, 0, qp.dest_qpn)
        assert p.bth.psn == n.psn_add(r.first_psn, i)
        assert p.bth.ackreq == int(last)
        if op != m.Opcode.RDMA_READ:
            assert len(p.payload) == (mtu if not last else length - mtu * i)
        is_write = op in (m.Opcode.RDMA_WRITE, m.Opcode.RDMA_WRITE_IMM)
        has_imm = last and op in (m.Opcode.RDMA_WRITE_IMM, m.Opcode.SEND_IMM)
        expect_ext = ()
        if is_write and i == 0:
            expect_ext += (RETH(va=raddr, rkey=9, dmalen=length),)
        if has_imm:
            expect_ext += (ImmDt(imm=imm),)
        if op != m.Opcode.RDMA_READ:
            assert p.ext == expect_ext
            assert p.bth.se == int(last and bool(fm_ce_se & m.CTRL_SOLICITED) and op != m.Opcode.RDMA_WRITE)
        # byte-exact against the project's packet builder
        assert r.packets[i] == build_packet(lrh=p.lrh, bth=p.bth, ext=p.ext, payload=p.payload)


@pytest.mark.parametrize("mtu_code", [1, 3])
def test_segmentation_edges(mtu_code):
    req, local = world(mtu=mtu_code)
    qp = req.qps[0]
    mtu = qp.mtu_bytes
    idx = 0
    expected_psn = 0
    for op in (m.Opcode.RDMA_WRITE, m.Opcode.RDMA_WRITE_IMM, m.Opcode.SEND, m.Opcode.SEND_IMM,
               m.Opcode.RDMA_READ):
        for length in (0, 1, 3, mtu - 1, mtu, mtu + 1, 2 * mtu, 3 * mtu + 5):
            for laddr in (LOCAL_BASE, LOCAL_BASE + 1, LOCAL_BASE + 63, LOCAL_BASE + 4093):
                fm = random.Random(idx).choice([0, 8, 10, 2])
                r = run(req, local, 0, idx, op=op, byte_count=length, lkey=LKEY, laddr=laddr,
                        raddr=REMOTE_BASE + 7, rkey=9, imm=0xA5A5_0000 + idx, fm_ce_se=fm)
                assert r.status == n.CompletionStatus.SENT
                assert r.first_psn == expected_psn and r.signaled == bool(fm & 8)
                assert r.byte_count == length and r.cqe().byte_cnt == length
                _check_message(r, qp, req, local, laddr, length, op, imm=0xA5A5_0000 + idx,
                               fm_ce_se=fm, raddr=REMOTE_BASE + 7)
                expected_psn = n.psn_add(r.last_psn, 1)
                idx += 1
    for length in (0, 1, 13, 64):
        data = bytes(range(length))
        for op in (m.Opcode.RDMA_WRITE_IMM, m.Opcode.SEND):
            r = run(req, local, 0, idx, op=op, inline=data, raddr=REMOTE_BASE, rkey=9)
            _check_message(r, qp, req, local, 0, length, op, inline=data, raddr=REMOTE_BASE)
            idx += 1


def test_zero_length_read_and_atomics_on_the_wire():
    req, local = world()
    r = run(req, local, 0, 0, op=m.Opcode.RDMA_READ, byte_count=0, lkey=LKEY, laddr=LOCAL_BASE,
            raddr=REMOTE_BASE, rkey=9)
    assert r.first_psn == r.last_psn == 0
    r = run(req, local, 0, 1, op=m.Opcode.ATOMIC_FA, lkey=LKEY, laddr=LOCAL_BASE, raddr=REMOTE_BASE,
            rkey=9, swap_add=5, compare=0x1234)
    (p,) = [parse_packet(x) for x in r.packets]
    assert p.bth.opcode == Opcode.FETCH_ADD and p.bth.psn == 1 and p.bth.ackreq == 1 and p.bth.se == 0
    assert p.ext == (AtomicETH(va=REMOTE_BASE, rkey=9, swap_add=5, compare=0),) and not p.payload
    assert r.byte_count == 8 and r.cqe().byte_cnt == 8
    r = run(req, local, 0, 2, op=m.Opcode.ATOMIC_CS, lkey=LKEY, laddr=LOCAL_BASE, raddr=REMOTE_BASE,
            rkey=9, swap_add=5, compare=0x1234, fm_ce_se=m.CTRL_SOLICITED)
    (p,) = [parse_packet(x) for x in r.packets]
    assert p.bth.opcode == Opcode.COMPARE_SWAP and p.bth.psn == 2 and p.bth.se == 0
    assert p.ext[0].compare == 0x1234 and not r.signaled


def test_psn_wrap():
    req, local = world(mtu=1, sq_psn=(1 << 24) - 2)
    r = run(req, local, 0, 0, op=m.Opcode.RDMA_WRITE, byte_count=600, lkey=LKEY, laddr=LOCAL_BASE,
            raddr=REMOTE_BASE, rkey=9)
    assert [parse_packet(p).bth.psn for p in r.packets] == [0xFFFFFE, 0xFFFFFF, 0]
    assert (r.first_psn, r.last_psn) == (0xFFFFFE, 0)
    r = run(req, local, 0, 1, op=m.Opcode.RDMA_READ, byte_count=257, lkey=LKEY, laddr=LOCAL_BASE,
            raddr=REMOTE_BASE, rkey=9)
    assert (r.first_psn, r.last_psn) == (1, 2)
    req.next_psn[0] = 0xFFFFFF
    r = run(req, local, 0, 2, op=m.Opcode.RDMA_READ, byte_count=600, lkey=LKEY, laddr=LOCAL_BASE,
            raddr=REMOTE_BASE, rkey=9)
    assert (r.first_psn, r.last_psn, req.next_psn[0]) == (0xFFFFFF, 1, 2)
    assert n.psn_lt(0xFFFFFF, 0) and n.psn_le(0, 0) and not n.psn_lt(0, 0xFFFFFF)
    req.reset_qp(0)
    assert req.next_psn[0] == (1 << 24) - 2 and req.state[0] == n.QpState.RTS
    # the QP (1) with its own PSN space is untouched
    assert req.next_psn_of(1) == (1 << 24) - 2


def test_fetch_from_ring_wraps():
    req, local = world()
    qp = req.qps[0]
    ring = {}

    def read(addr, size):
        if qp.sq_base <= addr < qp.sq_base + 64 * 64:
            return ring[addr]
        return reader(local)(addr, size)
    wqe = m.build_wqe(m.Opcode.RDMA_WRITE, 63, 0, inline=bytes(range(40)), raddr=1, rkey=2)
    assert wqe.blocks == 2
    ring[qp.sq_base + 63 * 64] = wqe.data[:64]
    ring[qp.sq_base] = wqe.data[64:]
    r = req.fetch_and_execute(0, 63, read)
    assert r.wqe_blocks == 2 and parse_packet(r.packets[0]).payload == bytes(range(40))


# --- both ends in a loop ----------------------------------------------------------------------

def _random_wqe(rng, mtu):
    # masked atomics: test_nvshmem_atomics_both_ends, posted as NVSHMEM posts them
    op = rng.choice([op for op in m.Opcode if op not in m.MASKED_ATOMIC_OPCODES])
    kw = dict(op=op, raddr=REMOTE_BASE + rng.randrange(0, MEM - 8 * mtu), rkey=9, lkey=LKEY,
              fm_ce_se=rng.choice([0, 8, 8, 10]), imm=rng.getrandbits(32))
    if op == m.Opcode.NOP:
        kw = dict(op=op, fm_ce_se=kw["fm_ce_se"])
        if rng.random() < 0.5:
            kw.update(byte_count=0)         # the ds 2 form
    elif op == m.Opcode.DUMP:
        kw.update(byte_count=rng.choice([0, 1]), laddr=LOCAL_BASE + rng.randrange(0x7000))
    elif op in (m.Opcode.ATOMIC_CS, m.Opcode.ATOMIC_FA):
        kw.update(raddr=REMOTE_BASE + 8 * rng.randrange(16), laddr=LOCAL_BASE + 0x7000 + 8 * rng.randrange(64),
                  swap_add=rng.getrandbits(64), compare=rng.getrandbits(64))
        if rng.random() < 0.5:
            kw["compare"] = None       # filled in with the current value: the swap happens
    elif op != m.Opcode.RDMA_READ and rng.random() < 0.3:
        kw["inline"] = rng.randbytes(rng.randrange(257))
    else:
        length = rng.choice([0, 1, rng.randrange(2 * mtu), mtu, mtu + 1, rng.randrange(5 * mtu)])
        kw.update(byte_count=length, laddr=LOCAL_BASE + rng.randrange(0, 0x7000 - length))
    return kw


def _loop(seed, *, ack_every, count=120, collapsed=False):
    rng = random.Random(seed)
    req, local = world(mtu=1, sq_psn=(1 << 24) - 5, collapsed=collapsed)
    local_ref = bytearray(local)
    remote = bytearray(rng.randbytes(MEM))
    remote_ref = bytearray(remote)
    qps = {0x100 + q: n.ResponderQp(peer_qpn=q, epsn=(1 << 24) - 5, mtu=1) for q in range(2)}
    resp = n.ResponderPeer(0x55, qps, memory=remote, base=REMOTE_BASE, ack_every=ack_every)
    comp = n.CompletionModel(req, write_memory=writer(local))
    results = {0: [], 1: []}
    cqes = {0: [], 1: []}
    ordered = []
    sends = {0x100: [], 0x101: []}
    idx = [0, 0]
    for _ in range(count):
        qpn = rng.randrange(2)
        kw = _random_wqe(rng, 256)
        if "compare" in kw and kw["compare"] is None:
            off = kw["raddr"] - REMOTE_BASE
            kw["compare"] = int.from_bytes(remote_ref[off:off + 8], "little")
        r = run(req, local, qpn, idx[qpn], **kw)
        idx[qpn] += r.wqe_blocks
        assert r.status == n.CompletionStatus.SENT
        results[qpn].append(r)
        # the reference effect of the WQE
        op = kw["op"]
        data = kw.get("inline")
        if data is None and "byte_count" in kw and op not in m.LOCAL_OPCODES:
            data = bytes(local_ref[kw["laddr"] - LOCAL_BASE:][:kw["byte_count"]])
        roff = kw.get("raddr", REMOTE_BASE) - REMOTE_BASE
        if op in m.LOCAL_OPCODES:
            assert not r.packets and r.last_psn == (r.first_psn - 1) % (1 << 24)
        elif op in (m.Opcode.RDMA_WRITE, m.Opcode.RDMA_WRITE_IMM):
            remote_ref[roff:roff + len(data)] = data
        elif op in (m.Opcode.SEND, m.Opcode.SEND_IMM):
            sends[0x100 + qpn].append((data, kw["imm"] if op == m.Opcode.SEND_IMM else None))
        elif op == m.Opcode.RDMA_READ:
            loff = kw["laddr"] - LOCAL_BASE
            local_ref[loff:loff + len(data)] = remote_ref[roff:roff + len(data)]
        else:
            orig = int.from_bytes(remote_ref[roff:roff + 8], "little")
            new = ((orig + kw["swap_add"]) % (1 << 64) if op == m.Opcode.ATOMIC_FA
                   else kw["swap_add"] if orig == kw["compare"] else orig)
            remote_ref[roff:roff + 8] = new.to_bytes(8, "little")
            loff = kw["laddr"] - LOCAL_BASE
            local_ref[loff:loff + 8] = orig.to_bytes(8, "little")
        done = comp.post(r)
        for packet in r.packets:
            for answer in resp.receive(packet):
                done += comp.receive(answer)
        for c in done:
            cqes[c.qpn].append(c)
            ordered.append(c)
    for answer in resp.flush():
        for c in comp.receive(answer):
            cqes[c.qpn].append(c)
            ordered.append(c)
    assert remote == remote_ref
    assert local == local_ref
    for qpn in (0, 1):
        got = [dataclasses.replace(c.cqe, owner=0) for c in cqes[qpn] if c.cqe]
        assert got == n.expected_cqes(results[qpn])
        assert [c.wqe_index for c in cqes[qpn]] == [r.wqe_index for r in results[qpn]]
        assert not comp.outstanding[qpn]
        assert resp.qps[0x100 + qpn].received == sends[0x100 + qpn]
    # owner bits and addresses per CQ follow the CQ's producer index
    for cqn in (0, 1):
        written = [c for qpn in (0, 1) for c in cqes[qpn] if c.cqe and c.cqn == cqn]
        assert len(written) == comp.cq_pi[cqn]
    assert comp.counters["rx_dropped_unexpected"] == comp.counters["rx_dropped_icrc"] == 0
    return comp, resp, ordered


# No coalescing across AckReq: the completion unit takes a READ response or atomic
# acknowledge only at ack_psn + 1 (docs/nic-reliability.md), so a responder must acknowledge
# every message with AckReq before it answers the next READ or atomic (the NIC's does).
@pytest.mark.parametrize("seed,ack_every", [(1, 1), (2, 3), (3, 4)])
def test_loop(seed, ack_every):
    _loop(seed, ack_every=ack_every)


def test_loop_cq_owner_and_collapsed():
    # collapsed (log_size 2 here, which then counts as 0): entry 0, the owner flips every CQE
    comp, _, ordered = _loop(4, ack_every=1, count=40, collapsed=True)
    for cqn in (0, 1):
        written = [c for c in ordered if c.cqe and c.cqn == cqn]
        assert written and all(c.address == 0x9000 + 0x1000 * cqn for c in written)
        assert [c.cqe.owner for c in written] == [i & 1 for i in range(len(written))]
    # in the non-collapsed case the owner bit flips every 2^log_size CQEs of one CQ
    req, local = world(log_cq=1)
    comp = n.CompletionModel(req)
    owners, addresses = [], []
    for i in range(6):
        r = run(req, local, 0, i, op=m.Opcode.SEND, inline=b"a", fm_ce_se=8)
        comp.post(r)
        ack = n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55, opcode=Opcode.ACKNOWLEDGE, destqp=0,
                            psn=r.last_psn, ext=[AETH(syndrome=0, msn=i + 1)])
        (c,) = comp.receive(ack)
        owners.append(c.cqe.owner)
        addresses.append(c.address)
    assert owners == [0, 0, 1, 1, 0, 0]
    assert addresses == [0x9000, 0x9040] * 3


@pytest.mark.parametrize("code", [n.NakCode.INVALID_REQUEST, n.NakCode.REMOTE_ACCESS_ERROR,
                                  n.NakCode.REMOTE_OPERATIONAL_ERROR])
def test_nak_error_and_flush(code):
    req, local = world(mtu=1)
    remote = bytearray(MEM)
    resp = n.ResponderPeer(0x55, {0x100: n.ResponderQp(peer_qpn=0, mtu=1)}, memory=remote,
                            base=REMOTE_BASE, ack_every=2)
    comp = n.CompletionModel(req)
    results, got = [], []
    lengths = [100, 700, 600, 50, 0]
    idx = 0
    for i, length in enumerate(lengths):
        r = run(req, local, 0, idx, op=m.Opcode.RDMA_WRITE, byte_count=length, lkey=LKEY,
                laddr=LOCAL_BASE, raddr=REMOTE_BASE + 0x1000 * i, rkey=9, fm_ce_se=8 if i != 1 else 0)
        idx += r.wqe_blocks
        results.append(r)
    nak_psn = n.psn_add(results[2].first_psn, 1)       # the middle packet of the 3rd WQE
    resp.inject_nak(0x100, nak_psn, code)
    for r in results:
        got += comp.post(r)
        for p in r.packets:
            for a in resp.receive(p):
                got += comp.receive(a)
    syndrome = {1: m.Syndrome.REMOTE_INVAL_REQ_ERR, 2: m.Syndrome.REMOTE_ACCESS_ERR,
                3: m.Syndrome.REMOTE_OP_ERR}[code]
    cqes = [dataclasses.replace(c.cqe, owner=0) for c in got if c.cqe]
    assert [c.wqe_index for c in got] == [r.wqe_index for r in results]
    assert cqes == [results[0].cqe(),
                    m.error_cqe(0, results[2].wqe_index, m.Opcode.RDMA_WRITE, syndrome),
                    m.error_cqe(0, results[3].wqe_index, m.Opcode.RDMA_WRITE, m.Syndrome.WR_FLUSH_ERR),
                    m.error_cqe(0, results[4].wqe_index, m.Opcode.RDMA_WRITE, m.Syndrome.WR_FLUSH_ERR)]
    assert cqes == n.expected_cqes(results, nak=(nak_psn, code))
    assert req.state[0] == n.QpState.ERR and comp.counters["naks_received"] == 1
    assert resp.qps[0x100].error and resp.counters["dropped_qp_error"] > 0
    r = run(req, local, 0, idx, op=m.Opcode.SEND, inline=b"x")
    assert r.status == n.CompletionStatus.FLUSH
    (c,) = comp.post(r)
    assert c.cqe.syndrome == m.Syndrome.WR_FLUSH_ERR


def test_nak_on_first_wqe_and_nonfatal_naks():
    req, local = world()
    resp = n.ResponderPeer(0x55, {0x100: n.ResponderQp(peer_qpn=0)}, memory=bytearray(MEM),
                            base=REMOTE_BASE)
    comp = n.CompletionModel(req)
    r0 = run(req, local, 0, 0, op=m.Opcode.SEND, inline=b"a")
    r1 = run(req, local, 0, 1, op=m.Opcode.SEND, inline=b"b")
    comp.post(r0)
    comp.post(r1)
    resp.inject_rnr(0x100, 0)
    (rnr,) = resp.receive(r0.packets[0])
    assert parse_packet(rnr).ext[0].syndrome >> 5 == 0b001
    assert comp.receive(rnr) == [] and comp.counters["naks_received"] == 1
    # not executed, so the next PSN is out of sequence: one PSN-sequence NAK, counted only
    (seq,) = resp.receive(r1.packets[0])
    assert parse_packet(seq).ext[0].syndrome == 0x60 and parse_packet(seq).bth.psn == 0
    assert resp.receive(r1.packets[0]) == []
    assert comp.receive(seq) == [] and req.state[0] == n.QpState.RTS
    # a fatal NAK for the first WQE: it errs, the second is flushed
    nak = n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55, opcode=Opcode.ACKNOWLEDGE, destqp=0,
                        psn=0, ext=[AETH(syndrome=0x62, msn=0)])
    c = comp.receive(nak)
    assert [x.cqe.syndrome for x in c] == [m.Syndrome.REMOTE_ACCESS_ERR, m.Syndrome.WR_FLUSH_ERR]


def test_answers_only_for_packets_sent():
    """A record comes with its message's first packet (``post(..., on_wire=False)``): an
    answer past the highest PSN sent (``packet_sent``) is dropped, a sequence NAK for a
    packet sent rewinds while the message is still going out, resends below the highest
    PSN sent leave it there."""
    req, local = world(mtu=1)
    comp = n.CompletionModel(req)
    r = run(req, local, 0, 0, op=m.Opcode.RDMA_WRITE, byte_count=256 * 8, lkey=LKEY,
            laddr=LOCAL_BASE, raddr=REMOTE_BASE, rkey=9, fm_ce_se=8)
    assert len(r.packets) == 8
    comp.post(r, on_wire=False)

    def answer(psn, syndrome=0):
        return n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55, opcode=Opcode.ACKNOWLEDGE,
                             destqp=0, psn=n.psn_add(r.first_psn, psn), ext=[AETH(syndrome=syndrome, msn=0)])
    assert comp.receive(answer(0)) == []                # nothing sent yet
    for k in range(3):
        comp.packet_sent(0, n.psn_add(r.first_psn, k))
    assert comp.receive(answer(5)) == [] and comp.receive(answer(4, 0x60)) == []
    assert comp.counters["rx_dropped_unexpected"] == 3 and not comp.rewinds
    # packet 0 lost: the responder NAKs at it when packet 1 comes
    assert comp.receive(answer(0, 0x60)) == [] and comp.counters["naks_received"] == 1
    assert [(w.psn, w.cause) for w in comp.rewinds] == [(r.first_psn, "nak")]
    comp.packet_sent(0, r.first_psn)                    # the resend
    assert comp.progress[0].wire_psn == n.psn_add(r.first_psn, 2)
    for k in range(8):
        comp.packet_sent(0, n.psn_add(r.first_psn, k))
    (c,) = comp.receive(answer(7))
    assert c.cqe == r.cqe() and comp.counters["rx_dropped_unexpected"] == 3


def test_completion_rules():
    req, local = world(mtu=1)
    comp = n.CompletionModel(req, write_memory=writer(local))

    def resp(opcode, psn, qpn=0, ext=None, payload=b""):
        if ext is None:
            ext = [AETH(syndrome=0x1F, msn=1)]
        return n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55, opcode=opcode, destqp=qpn,
                             psn=psn, ext=ext, payload=payload)
    w = run(req, local, 0, 0, op=m.Opcode.RDMA_WRITE, byte_count=300, lkey=LKEY, laddr=LOCAL_BASE,
            raddr=REMOTE_BASE, rkey=9)                                   # PSN 0, 1
    rd = run(req, local, 0, 1, op=m.Opcode.RDMA_READ, byte_count=300, lkey=LKEY,
             laddr=LOCAL_BASE + 0x100, raddr=REMOTE_BASE, rkey=9)        # PSN 2, 3
    at = run(req, local, 0, 2, op=m.Opcode.ATOMIC_FA, lkey=LKEY, laddr=LOCAL_BASE + 0x800,
             raddr=REMOTE_BASE, rkey=9, swap_add=1)                      # PSN 4
    s = run(req, local, 0, 3, op=m.Opcode.SEND, inline=b"z")           # PSN 5
    for r in (w, rd, at, s):
        assert comp.post(r) == []
    # bad ICRC, not a response, an unknown QP, a PSN nobody waits for: dropped and counted
    bad = bytearray(resp(Opcode.ACKNOWLEDGE, 1))
    bad[-1] ^= 1
    assert comp.receive(bytes(bad)) == [] and comp.counters["rx_dropped_icrc"] == 1
    assert comp.receive(resp(Opcode.SEND_ONLY, 1, ext=[])) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 1, qpn=7)) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 100)) == []
    assert comp.counters["rx_dropped_unexpected"] == 3
    # an ACK of the first packet: nothing; of the second: the write completes
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 0)) == []
    (c,) = comp.receive(resp(Opcode.ACKNOWLEDGE, 1))
    assert c.wqe_index == 0
    # a stale ACK is dropped: PSNs at or before the newest acknowledged one
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 1)) == []
    # an ACK does not complete a READ: it waits for its LAST response
    # READ response FIRST/LAST (data lands at laddr + offset)
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_FIRST, 2, payload=bytes([1]) * 256)) == []
    (c,) = comp.receive(resp(Opcode.RDMA_READ_RESPONSE_LAST, 3, payload=bytes([2]) * 44))
    assert c.wqe_index == 1 and local[0x100:0x100 + 300] == bytes([1]) * 256 + bytes([2]) * 44
    # an ATOMIC ACK completes the atomic and hands back the original value
    (c,) = comp.receive(resp(Opcode.ATOMIC_ACKNOWLEDGE, 4,
                             ext=[AETH(syndrome=0, msn=3), AtomicAckETH(orig=0x0102030405060708)]))
    assert c.wqe_index == 2 and local[0x800:0x808] == H("0807060504030201")
    (c,) = comp.receive(resp(Opcode.ACKNOWLEDGE, 5))
    assert c.wqe_index == 3 and not comp.outstanding[0]
    assert comp.counters["acks_received"] == 3 and comp.counters["read_responses"] == 2
    assert comp.counters["atomic_acks"] == 1 and comp.counters["rx_dropped_unexpected"] == 4
    # an atomic completes only on its own ATOMIC ACKNOWLEDGE: an ACK covering it says its
    # acknowledge went missing (a rewind to it, ack_psn back to its first PSN - 1); a
    # later ACK is an echo (gap_seen) and moves ack_psn on; the acknowledge, behind
    # ack_psn now, is dropped; the timeout rewinds again and the acknowledge sent again
    # is taken
    at = run(req, local, 0, 4, op=m.Opcode.ATOMIC_CS, lkey=LKEY, laddr=LOCAL_BASE, raddr=REMOTE_BASE,
             rkey=9)                                                     # PSN 6
    s = run(req, local, 0, 5, op=m.Opcode.SEND, inline=b"z")           # PSN 7
    comp.post(at)
    comp.post(s)
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 6)) == []
    assert comp.rewinds == [n.Rewind(0, 4, 6, "nak")] and comp.progress[0].ack_psn == 5
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 7)) == []
    assert len(comp.rewinds) == 1 and comp.progress[0].ack_psn == 7
    atomic_ack = resp(Opcode.ATOMIC_ACKNOWLEDGE, 6, ext=[AETH(syndrome=0, msn=3),
                                                        AtomicAckETH(orig=0x1122334455667788)])
    assert comp.receive(atomic_ack) == [] and comp.counters["rx_dropped_unexpected"] == 5
    assert comp.timer_expired(0) == []
    assert comp.rewinds[-1] == n.Rewind(0, 4, 6, "timeout") and comp.progress[0].ack_psn == 5
    assert [c.wqe_index for c in comp.receive(atomic_ack)] == [4]
    assert local[:8] == (0x1122334455667788).to_bytes(8, "little")
    assert [c.wqe_index for c in comp.receive(resp(Opcode.ACKNOWLEDGE, 7))] == [5]
    assert comp.progress[0].retries_used == 0 and comp.counters["retransmits_timeout"] == 1
    # READ responses refer to the oldest READ still waiting for them: a response at its
    # first PSN acknowledges the WQEs before it (ACKs a responder coalesced); a later
    # READ's response while it waits is a gap (rewind to the head)
    r1 = run(req, local, 0, 6, op=m.Opcode.RDMA_READ, byte_count=8, lkey=LKEY, laddr=LOCAL_BASE,
             raddr=REMOTE_BASE, rkey=9)                                  # PSN 8
    s = run(req, local, 0, 7, op=m.Opcode.SEND, inline=b"z")           # PSN 9
    r2 = run(req, local, 0, 8, op=m.Opcode.RDMA_READ, byte_count=8, lkey=LKEY, laddr=LOCAL_BASE,
             raddr=REMOTE_BASE, rkey=9)                                  # PSN 10
    s2 = run(req, local, 0, 9, op=m.Opcode.SEND, inline=b"z")          # PSN 11
    for r in (r1, s, r2, s2):
        comp.post(r)
    rewinds = len(comp.rewinds)
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_ONLY, 10, payload=bytes(8))) == []
    assert comp.rewinds[rewinds:] == [n.Rewind(0, 6, 8, "nak")]
    assert [c.wqe_index for c in comp.receive(resp(Opcode.RDMA_READ_RESPONSE_ONLY, 8,
                                                   payload=bytes(8)))] == [6]
    assert [c.wqe_index for c in comp.receive(resp(Opcode.RDMA_READ_RESPONSE_ONLY, 10,
                                                   payload=bytes(8)))] == [7, 8]
    assert [c.wqe_index for c in comp.receive(resp(Opcode.ACKNOWLEDGE, 11))] == [9]
    # malformed AETHs: a READ response with a NAK syndrome, a reserved NAK code
    comp.post(run(req, local, 0, 10, op=m.Opcode.SEND, inline=b"z"))  # PSN 12
    before = comp.counters["rx_dropped_unexpected"]
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_ONLY, 12, ext=[AETH(syndrome=0x61)])) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 12, ext=[AETH(syndrome=0x65)])) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 12, ext=[AETH(syndrome=0x40)])) == []
    assert comp.counters["rx_dropped_unexpected"] == before + 3
    # malformed AETHs: a READ response with a NAK syndrome, a reserved NAK code
    comp.post(run(req, local, 0, 9, op=m.Opcode.SEND, inline=b"z"))  # PSN 11
    before = comp.counters["rx_dropped_unexpected"]
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_ONLY, 11, ext=[AETH(syndrome=0x61)])) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 11, ext=[AETH(syndrome=0x65)])) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 11, ext=[AETH(syndrome=0x40)])) == []
    assert comp.counters["rx_dropped_unexpected"] == before + 3


def test_responder_rejects():
    remote = bytearray(MEM)
    resp = n.ResponderPeer(0x55, {0x100 + q: n.ResponderQp(peer_qpn=q, mtu=1) for q in range(6)},
                            memory=remote, base=REMOTE_BASE)

    def req_packet(opcode, psn, qp=0x100, ext=(), payload=b""):
        return n.make_packet(vl=1, sl=1, dlid=0x55, slid=0x11, opcode=opcode, destqp=qp, psn=psn,
                             ackreq=1, ext=ext, payload=payload)

    def nak_code(packets):
        (p,) = packets
        p = parse_packet(p)
        assert p.bth.opcode == Opcode.ACKNOWLEDGE and p.ext[0].syndrome >> 5 == 0b011
        assert (p.lrh.dlid, p.lrh.slid, p.lrh.sl, p.lrh.vl) == (0x11, 0x55, 1, 1)
        return p.ext[0].syndrome & 0x1F
    bad = bytearray(req_packet(Opcode.SEND_ONLY, 0, payload=b"abc"))
    bad[20] ^= 0xFF
    assert resp.receive(bytes(bad)) == [] and resp.counters["dropped_icrc"] == 1
    assert resp.receive(req_packet(Opcode.SEND_ONLY, 0, qp=0x99)) == []
    assert nak_code(resp.receive(req_packet(Opcode.SEND_MIDDLE, 0, payload=bytes(256)))) == 1
    assert nak_code(resp.receive(req_packet(Opcode.RDMA_WRITE_ONLY, 0, qp=0x101,
                                            ext=[RETH(va=REMOTE_BASE + MEM - 2, rkey=1, dmalen=4)],
                                            payload=bytes(4)))) == 2
    assert nak_code(resp.receive(req_packet(Opcode.FETCH_ADD, 0, qp=0x102,
                                            ext=[AtomicETH(va=REMOTE_BASE + 4, rkey=1, swap_add=1)]))) == 1
    assert nak_code(resp.receive(req_packet(Opcode.SEND_FIRST, 0, qp=0x103, payload=bytes(100)))) == 1
    assert nak_code(resp.receive(req_packet(Opcode.SEND_ONLY, 5, qp=0x104, payload=b"x"))) == 0
    # a duplicate is acknowledged again with the newest PSN
    assert resp.receive(req_packet(Opcode.SEND_ONLY, 0, qp=0x105, payload=b"x"))
    (dup,) = resp.receive(req_packet(Opcode.SEND_ONLY, 0, qp=0x105, payload=b"x"))
    assert parse_packet(dup).ext[0].syndrome == n.ACK_SYNDROME and resp.counters["duplicates"] == 1
    # a READ at the MTU: FIRST/MIDDLE/LAST with AETH on FIRST and LAST only
    remote[:600] = bytes(range(256)) * 2 + bytes(88)
    out = resp.receive(req_packet(Opcode.RDMA_READ_REQUEST, 1, qp=0x105,
                                  ext=[RETH(va=REMOTE_BASE, rkey=1, dmalen=600)]))
    parsed = [parse_packet(p) for p in out]
    assert [p.bth.opcode for p in parsed] == [Opcode.RDMA_READ_RESPONSE_FIRST,
                                              Opcode.RDMA_READ_RESPONSE_MIDDLE,
                                              Opcode.RDMA_READ_RESPONSE_LAST]
    assert [p.bth.psn for p in parsed] == [1, 2, 3] and [len(p.ext) for p in parsed] == [1, 0, 1]
    assert b"".join(p.payload for p in parsed) == bytes(remote[:600])
    assert parsed[0].ext[0].msn == 2 and all(p.bth.destqp == 5 for p in parsed)


def test_responder_ack_coalescing():
    for ack_every, coalesce, expect in ((1, False, 6), (2, False, 3), (4, False, 1), (4, True, 1)):
        resp = n.ResponderPeer(0x55, {1: n.ResponderQp(peer_qpn=0, mtu=1)}, memory=bytearray(64),
                                base=0, ack_every=ack_every, coalesce_ackreq=coalesce)
        acks = []
        for psn in range(6):
            acks += resp.receive(n.make_packet(vl=0, sl=0, dlid=0x55, slid=0x11, opcode=Opcode.SEND_ONLY,
                                               destqp=1, psn=psn, ackreq=int(psn == 2), payload=b"q"))
        assert len(acks) == expect, (ack_every, coalesce)
        if coalesce:
            assert parse_packet(acks[0]).bth.psn == 3
            (final,) = resp.flush()
            assert parse_packet(final).bth.psn == 5 and parse_packet(final).ext[0].msn == 6
            assert resp.flush() == []


def test_responder_speed():
    resp = n.ResponderPeer(0x55, {1: n.ResponderQp(peer_qpn=0, mtu=5)}, memory=bytearray(1 << 16),
                            base=0, ack_every=8)
    packets = [n.make_packet(vl=0, sl=0, dlid=0x55, slid=0x11, opcode=Opcode.RDMA_WRITE_ONLY,
                             destqp=1, psn=psn, ext=[RETH(va=256 * (psn % 200), rkey=1, dmalen=256)],
                             payload=bytes(256)) for psn in range(3000)]
    start = time.perf_counter()
    for p in packets:
        resp.receive(p)
    assert time.perf_counter() - start < 1.5      # > 2000 packets per second


def test_make_packet_matches_build_packet():
    rng = random.Random(5)
    for _ in range(50):
        length = rng.randrange(300)
        args = dict(vl=rng.randrange(15), sl=rng.randrange(16), dlid=rng.getrandbits(16),
                    slid=rng.getrandbits(16), opcode=Opcode.SEND_ONLY, destqp=rng.getrandbits(24),
                    psn=rng.getrandbits(24), pkey=rng.getrandbits(16), se=rng.getrandbits(1),
                    ackreq=rng.getrandbits(1), payload=rng.randbytes(length))
        ours = n.make_packet(**args)
        theirs = build_packet(lrh=LRH(vl=args["vl"], sl=args["sl"], dlid=args["dlid"], slid=args["slid"]),
                              bth=BTH(opcode=args["opcode"], se=args["se"], pkey=args["pkey"],
                                      destqp=args["destqp"], ackreq=args["ackreq"], psn=args["psn"]),
                              payload=args["payload"])
        assert ours == theirs
        assert n.decode_packet(ours).icrc_ok


def test_qp_context_checks():
    assert n.qp_context_ok(n.QpConfig(sq_base=0x1000, log_sq_size=6, mtu=5, max_outstanding=63), 1)
    assert not n.qp_context_ok(n.QpConfig(mtu=0), 1)
    assert not n.qp_context_ok(n.QpConfig(mtu=6), 1)
    assert not n.qp_context_ok(n.QpConfig(max_outstanding=64), 1)
    assert not n.qp_context_ok(n.QpConfig(max_outstanding=0), 1)
    assert not n.qp_context_ok(n.QpConfig(cqn=1), 1)
    assert not n.qp_context_ok(n.QpConfig(sq_base=0x800, log_sq_size=6), 1)
    assert n.qp_context_ok(n.QpConfig(sq_base=0x800, log_sq_size=5), 1)


def test_tshark_decodes_requests_and_responses(tmp_path):
    if shutil.which("tshark") is None:
        pytest.skip("tshark not installed: apt-get install tshark (CI installs it)")
    from models.packet import wire_packet
    from models.pcap import LinkCapture, tshark_decode
    req, local = world(mtu=1, sq_psn=0xFFFFFE)
    resp = n.ResponderPeer(0x55, {0x100: n.ResponderQp(peer_qpn=0, epsn=0xFFFFFE, mtu=1)},
                            memory=bytearray(MEM), base=REMOTE_BASE)
    packets = []
    for i, kw in enumerate([dict(op=m.Opcode.RDMA_WRITE_IMM, byte_count=600),
                            dict(op=m.Opcode.RDMA_READ, byte_count=300),
                            dict(op=m.Opcode.ATOMIC_CS, swap_add=1, compare=0),
                            dict(op=m.Opcode.SEND, byte_count=10)]):
        if kw["op"] == m.Opcode.ATOMIC_CS:
            kw.pop("byte_count", None)
        r = run(req, local, 0, i, lkey=LKEY, laddr=LOCAL_BASE, raddr=REMOTE_BASE, rkey=9, **kw)
        for p in r.packets:
            packets.append(p)
            packets += resp.receive(p)
    path = tmp_path / "nic.pcapng"
    with LinkCapture(path) as capture:
        for t, p in enumerate(packets):
            capture.data(wire_packet(p), 10 * t)
    frames = tshark_decode(path, ("infiniband.bth.opcode", "infiniband.bth.psn",
                                  "infiniband.bth.destqp", "infiniband.lrh.dlid"))
    assert len(frames) == len(packets)
    for frame, p in zip(frames, packets):
        parsed = parse_packet(p)
        assert (frame["infiniband.bth.opcode"], frame["infiniband.bth.psn"],
                frame["infiniband.bth.destqp"], frame["infiniband.lrh.dlid"]) == \
            (parsed.bth.opcode, parsed.bth.psn, parsed.bth.destqp, parsed.lrh.dlid)
    assert {f["infiniband.bth.opcode"] for f in frames} >= {
        Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE, Opcode.RDMA_READ_REQUEST,
        Opcode.RDMA_READ_RESPONSE_FIRST, Opcode.COMPARE_SWAP, Opcode.ATOMIC_ACKNOWLEDGE,
        Opcode.SEND_ONLY, Opcode.ACKNOWLEDGE}


def test_context_forms_and_states():
    """Contexts as dicts (read when needed), a key dict with and without the table size,
    host state changes, and a responder that creates its QPs from the first packet."""
    qps = {3: n.QpContext(qpn=3, mtu=1, dest_qpn=0x103, pd=PD, sq_psn=10, cqn=1)}
    cqs = {1: n.CqContext(cqn=1, base=0x9000, log_size=0)}
    keys = {LKEY: n.Mkey(key=LKEY, base=LOCAL_BASE, length=MEM, access=n.Access.LOCAL_WRITE, pd=PD, valid=1),
            0xD01: n.Mkey(key=0xD01, base=LOCAL_BASE, length=MEM, access=0xF, pd=PD, valid=1)}
    local = bytearray(MEM)
    exact = n.RequesterModel(1, [0] * 16, qps, cqs, keys)
    table = n.RequesterModel(1, [0] * 16, qps, cqs, keys, num_mkeys=8)
    kw = dict(op=m.Opcode.SEND, byte_count=4, lkey=LKEY, laddr=LOCAL_BASE)
    assert run(exact, local, 3, 0, **kw).status == "SENT"
    # 0xD01 takes table entry 5 from 0x501 in an 8-entry table
    assert run(table, local, 3, 0, **kw).syndrome == m.Syndrome.LOCAL_PROT_ERR
    req = n.RequesterModel(1, [0] * 16, qps, cqs, keys)
    comp = n.CompletionModel(req)
    resp = n.ResponderPeer(2, memory_bytes=MEM, peer_qpn=lambda qpn: qpn - 0x100, mtu=1)
    results = [run(req, local, 3, i, op=m.Opcode.RDMA_WRITE, byte_count=300, lkey=LKEY,
                   laddr=LOCAL_BASE, raddr=64, rkey=1) for i in range(3)]
    assert results[0].first_psn == 10 and req.next_psn_of(3) == 16
    got = []
    for r in results[:2]:
        got += comp.post(r)
        for p in r.packets:
            for a in resp.receive(p):
                got += comp.receive(a)
    assert [c.cqe for c in got] == [results[0].cqe(0), results[1].cqe(1)]
    assert resp.qps[0x103].peer_qpn == 3 and resp.qps[0x103].epsn == 14
    # the host moves the QP to ERR: the outstanding WQE and every later one are flushed
    got = comp.post(results[2])
    assert got == []
    req.set_state(3, "ERR")
    (c,) = comp.flush_qp(3)
    assert c.cqe.syndrome == m.Syndrome.WR_FLUSH_ERR and c.wqe_index == 2
    r = run(req, local, 3, 3, **kw)
    assert r.status == n.CompletionStatus.FLUSH and r.status.code == 2
    (c,) = comp.post(r)
    assert c.cqe.syndrome == m.Syndrome.WR_FLUSH_ERR
    # RESET restarts the PSN from the context as it is now
    qps[3].sq_psn = 0xFFFFFF
    req.set_state(3, "RESET")
    comp.reset_qp(3)
    assert run(req, local, 3, 0, **kw).status == "FLUSH"
    req.set_state(3, n.QpState.RTS)
    assert run(req, local, 3, 0, **kw).first_psn == 0xFFFFFF


def test_completion_psn_marks_follow_completions():
    """read_psn/atomic_psn are pulled up by every completion, so a READ or atomic far
    (< 2^23) ahead of the last READ/atomic response never looks already answered."""
    for op in (m.Opcode.ATOMIC_FA, m.Opcode.RDMA_READ):
        req, local = world()
        comp = n.CompletionModel(req)
        first = run(req, local, 0, 0, op=m.Opcode.SEND, inline=b"a")           # PSN 0
        comp.post(first)
        ack = n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55, opcode=Opcode.ACKNOWLEDGE,
                            destqp=0, psn=0, ext=[AETH(syndrome=0, msn=1)])
        assert len(comp.receive(ack)) == 1
        req.next_psn[0] = 0x7FFFFF          # a long, fully acknowledged history
        far = run(req, local, 0, 1, op=op, byte_count=8, lkey=LKEY, laddr=LOCAL_BASE,
                  raddr=REMOTE_BASE, rkey=9)
        assert far.first_psn == 0x7FFFFF
        assert comp.post(far) == []


def test_reads_one_after_another_each_take_their_responses():
    """Each READ, posted after the one before it completed and was let go, takes its own
    response and lands its data. (R was once found by the ``id()`` of the WQEs already
    answered; a new WQE result allocated where a completed one had been inherited its id
    and was taken as answered: its response was dropped and its completion never came.)"""
    req, local = world(mtu=1)
    comp = n.CompletionModel(req, write_memory=writer(local))
    for index in range(64):
        result = run(req, local, 0, index, op=m.Opcode.RDMA_READ, byte_count=16, lkey=LKEY,
                     laddr=LOCAL_BASE + 0x100, raddr=REMOTE_BASE, rkey=9, fm_ce_se=8)
        assert comp.post(result) == []
        payload = bytes([index]) * 16
        response = n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55,
                                 opcode=Opcode.RDMA_READ_RESPONSE_ONLY, destqp=0,
                                 psn=result.first_psn, ext=[AETH(syndrome=0x1F, msn=index)],
                                 payload=payload)
        del result
        (done,) = comp.receive(response)
        assert done.wqe_index == index and done.cqe is not None
        assert local[0x100:0x110] == payload
    assert not comp.outstanding[0] and comp.responses_for(0) is None
    assert comp.counters["read_responses"] == 64 and comp.counters["rx_dropped_unexpected"] == 0


def test_rewinds_and_giving_up():
    """Sequence NAK and response gap rewind to the head once per loss (echoes ignored until
    progress); progress restores the retries; retry_cnt and rnr_retry exhausted: the head
    errs, the QP goes to ERR, the rest flush."""
    req, local = world(mtu=1)
    req.qps[0] = dataclasses.replace(req.qps[0], retry_cnt=2, rnr_retry=1)
    comp = n.CompletionModel(req, write_memory=writer(local))

    def resp(opcode, psn, syndrome=0, payload=b"", ext=None):
        return n.make_packet(vl=0, sl=0, dlid=0x11, slid=0x55, opcode=opcode, destqp=0,
                             psn=psn, payload=payload,
                             ext=[AETH(syndrome=syndrome, msn=1)] if ext is None else ext)
    w = run(req, local, 0, 0, op=m.Opcode.RDMA_WRITE, byte_count=300, lkey=LKEY, laddr=LOCAL_BASE,
            raddr=REMOTE_BASE, rkey=9)                                   # PSN 0, 1
    rd = run(req, local, 0, 1, op=m.Opcode.RDMA_READ, byte_count=600, lkey=LKEY,
             laddr=LOCAL_BASE + 0x1000, raddr=REMOTE_BASE, rkey=9)       # PSN 2, 3, 4
    s = run(req, local, 0, 2, op=m.Opcode.SEND, inline=b"z")           # PSN 5
    for r in (w, rd, s):
        comp.post(r)
    # PSN 1 lost: the responder NAKs 1 (sequence error); the echo NAK is ignored
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 0)) == []
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 1, syndrome=0x60)) == []
    assert comp.rewinds == [n.Rewind(0, 0, 0, "nak")] and comp.progress[0].ack_psn == n.PSN_MOD - 1
    # the echo moves ack_psn from where the rewind put it (PSN 0 - 1) to 0: progress,
    # which restarts the retries, but no second rewind (gap_seen before the echo counts)
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 1, syndrome=0x60)) == []
    assert len(comp.rewinds) == 1 and comp.progress[0].retries_used == 0
    # the replay: the WRITE is acknowledged (progress), READ FIRST taken, MIDDLE lost:
    # LAST is a gap, a rewind to the READ
    (c,) = comp.receive(resp(Opcode.ACKNOWLEDGE, 1))
    assert c.wqe_index == 0
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_FIRST, 2, payload=bytes([1]) * 256)) == []
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_LAST, 4, payload=bytes([3]) * 88)) == []
    assert comp.rewinds[-1] == n.Rewind(0, 1, 2, "nak") and comp.counters["retransmits_nak"] == 2
    # a response of the wrong length or opcode for its position is dropped
    before = comp.counters["rx_dropped_unexpected"]
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_FIRST, 2, payload=bytes(255))) == []
    assert comp.receive(resp(Opcode.RDMA_READ_RESPONSE_ONLY, 2, payload=bytes(256))) == []
    assert comp.counters["rx_dropped_unexpected"] == before + 2
    for psn, opcode, fill, size in ((2, Opcode.RDMA_READ_RESPONSE_FIRST, 1, 256),
                                    (3, Opcode.RDMA_READ_RESPONSE_MIDDLE, 2, 256)):
        ext = [] if opcode == Opcode.RDMA_READ_RESPONSE_MIDDLE else None
        assert comp.receive(resp(opcode, psn, payload=bytes([fill]) * size, ext=ext)) == []
    (c,) = comp.receive(resp(Opcode.RDMA_READ_RESPONSE_LAST, 4, payload=bytes([3]) * 88))
    assert c.wqe_index == 1
    assert local[0x1000:0x1000 + 600] == bytes([1]) * 256 + bytes([2]) * 256 + bytes([3]) * 88
    # the SEND times out twice (retry_cnt 2), then gives up; a later WQE is flushed
    assert comp.timer_expired(0) == [] and comp.timer_expired(0) == []
    (c,) = comp.timer_expired(0)
    assert c.cqe.syndrome == m.Syndrome.TRANSPORT_RETRY_EXC_ERR and c.wqe_index == 2
    assert req.state[0] == n.QpState.ERR and comp.counters["retries_exhausted"] == 1
    (c,) = comp.post(run(req, local, 0, 3, op=m.Opcode.SEND, inline=b"y"))
    assert c.cqe.syndrome == m.Syndrome.WR_FLUSH_ERR
    # RNR: rnr_retry 1 allows one rewind after the wait; the second RNR gives up
    req, local = world(mtu=1)
    req.qps[0] = dataclasses.replace(req.qps[0], rnr_retry=1)
    comp = n.CompletionModel(req)
    s0 = run(req, local, 0, 0, op=m.Opcode.SEND, inline=b"a")
    s1 = run(req, local, 0, 1, op=m.Opcode.SEND, inline=b"b", fm_ce_se=0)
    comp.post(s0)
    comp.post(s1)
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 0, syndrome=0x21)) == []   # RNR, 10 us
    assert comp.rnr_wait_ns(0) == 10000
    assert comp.rnr_wait_over(0) == [] and comp.rewinds == [n.Rewind(0, 0, 0, "rnr")]
    assert comp.receive(resp(Opcode.ACKNOWLEDGE, 0, syndrome=0x21)) == []
    got = comp.rnr_wait_over(0)
    assert [c.cqe.syndrome for c in got] == [m.Syndrome.RNR_RETRY_EXC_ERR, m.Syndrome.WR_FLUSH_ERR]
    assert comp.counters["retransmits_rnr"] == 1 and comp.counters["retries_exhausted"] == 1
    # rnr_retry 7 never gives up
    req, local = world(mtu=1)
    comp = n.CompletionModel(req)
    comp.post(run(req, local, 0, 0, op=m.Opcode.SEND, inline=b"a"))
    for _ in range(20):
        assert comp.receive(resp(Opcode.ACKNOWLEDGE, 0, syndrome=0x21)) == []
        assert comp.rnr_wait_over(0) == []
    (c,) = comp.receive(resp(Opcode.ACKNOWLEDGE, 0))
    assert c.wqe_index == 0 and not c.cqe.is_error


# --- NVSHMEM's atomics, posted as ibgda_write_atomic_wqe posts them --------------------------

def nvshmem_effect(amo, old, value, compare, nbytes):
    """What OpenSHMEM says operation ``amo`` leaves at the target (its fetched value is
    ``old``): the oracle the NIC's masked encoding must meet."""
    ones = (1 << (8 * nbytes)) - 1
    base = amo.removeprefix("FETCH_") if amo != "FETCH_ADD" else amo
    return {"INC": old + 1, "SET": value, "SWAP": value, "SIGNAL": value, "SIGNAL_SET": value,
            "ADD": old + value, "SIGNAL_ADD": old + value, "FETCH_ADD": old + value,
            "AND": old & value, "OR": old | value, "XOR": old ^ value, "FETCH": old,
            "COMPARE_SWAP": value if old == compare else old}[base] & ones


def nvshmem_reads(landed: bytes) -> int:
    """``nvshmemi_ibgda_amo_fetch_impl``: ``READ_ONCE(*(T *)laddr)``, BSWAP32 for 4 bytes."""
    value = int.from_bytes(landed, "little")
    return int.from_bytes(landed, "big") if len(landed) == 4 else value


@pytest.mark.parametrize("sizes", [(4,), (8,), (4, 8)], ids=["4B", "8B", "mixed"])
@pytest.mark.parametrize("seed", range(3))
def test_nvshmem_atomics_both_ends(sizes, seed):
    """Every NVSHMEM atomic of ``sizes`` bytes, built by models.mlx5.nvshmem_atomic_wqe
    (``ibgda_write_atomic_wqe``), random operands, a few target words so that operations
    pile up on one address, masked and plain (8-byte FETCH_ADD / COMPARE_SWAP) mixed: the
    remote words follow OpenSHMEM's meaning, each result lands as NVSHMEM reads it before
    its CQE, the CQEs are the expected ones and both QPs stay in RTS."""
    rng = random.Random(seed)
    req, local = world(mtu=1)
    remote = bytearray(rng.randbytes(MEM))
    ref = bytearray(remote)
    qps = {0x100 + q: n.ResponderQp(peer_qpn=q, mtu=1) for q in range(2)}
    resp = n.ResponderPeer(0x55, qps, memory=remote, base=REMOTE_BASE)
    comp = n.CompletionModel(req, write_memory=writer(local))
    results = {0: [], 1: []}
    cqes = {0: [], 1: []}
    idx = [0, 0]
    seen = set()
    for i in range(300):
        qpn = rng.randrange(2)
        nbytes = rng.choice(sizes)
        amo = rng.choice(m.NVSHMEM_AMOS)
        target = 8 * rng.randrange(3) + rng.choice([0, 4] if nbytes == 4 else [0])
        old = int.from_bytes(ref[target:target + nbytes], "little")
        value = rng.choice([rng.getrandbits(8 * nbytes), 1, (1 << 8 * nbytes) - 1])
        compare = old if rng.random() < 0.5 else rng.getrandbits(8 * nbytes)
        laddr = LOCAL_BASE + 0x100 + 8 * i
        wqe = m.nvshmem_atomic_wqe(amo, nbytes, idx[qpn], qpn, raddr=REMOTE_BASE + target, rkey=9,
                                   laddr=laddr, lkey=LKEY, value=value, compare=compare,
                                   fm_ce_se=rng.choice([0, m.CTRL_CQ_UPDATE]))
        seen.add((amo, nbytes, wqe.data[3]))
        r = req.execute(qpn, idx[qpn], wqe.data, reader(local))
        assert r.status == n.CompletionStatus.SENT and r.byte_count == nbytes
        idx[qpn] += r.wqe_blocks
        results[qpn].append(r)
        ref[target:target + nbytes] = nvshmem_effect(amo, old, value, compare, nbytes).to_bytes(
            nbytes, "little")
        done = comp.post(r)
        for packet in r.packets:
            for answer in resp.receive(packet):
                done += comp.receive(answer)
        assert [c.wqe_index for c in done] == [r.wqe_index]   # the result is in before the CQE
        assert nvshmem_reads(bytes(local[laddr - LOCAL_BASE:][:nbytes])) == old
        for c in done:
            cqes[c.qpn].append(c)
    assert remote == ref
    for qpn in (0, 1):
        got = [dataclasses.replace(c.cqe, owner=0) for c in cqes[qpn] if c.cqe]
        assert got == n.expected_cqes(results[qpn])
        assert not comp.outstanding[qpn] and req.state[qpn] == n.QpState.RTS
    # every operation and size drawn, on the opcode NVSHMEM uses for it
    assert {(amo, nb) for amo, nb, _ in seen} == {(a, nb) for a in m.NVSHMEM_AMOS for nb in sizes}
    plain = {(a, 8) for a in ("FETCH_ADD", "COMPARE_SWAP")}
    assert all((op in (m.Opcode.ATOMIC_FA, m.Opcode.ATOMIC_CS)) == ((amo, nb) in plain)
               for amo, nb, op in seen)


@pytest.mark.parametrize("opcode", m.MASKED_ATOMIC_OPCODES)
@pytest.mark.parametrize("nbytes", [4, 8])
def test_masked_atomic_on_the_wire(opcode, nbytes):
    """The request packet of a masked atomic: the BTH opcode of its kind and size, a
    MaskedAtomicETH with the WQE's fields (masked FA: boundary in swap_mask, compare and
    compare_mask 0, whatever the ring held), 68 bytes LRH .. ICRC."""
    req, local = world()
    wqe = m.build_wqe(opcode, 0, 0, opmod=m.EXT_AMO_OPMOD[nbytes], raddr=REMOTE_BASE + 8, rkey=9,
                      lkey=LKEY, laddr=LOCAL_BASE, swap_add=0x1111_2222_3333_4444,
                      compare=0x5555_6666_7777_8888, swap_mask=0x9999_AAAA_BBBB_CCCC,
                      compare_mask=0xDDDD_EEEE_FFFF_0000)
    r = req.execute(0, 0, wqe.data, reader(local))
    (packet,) = r.packets
    p = parse_packet(packet)
    fa = opcode == m.Opcode.ATOMIC_MASKED_FA
    assert len(packet) == 68 and p.bth.ackreq == 1
    assert p.bth.opcode == {(False, 8): 0xD3, (True, 8): 0xD4, (False, 4): 0xF3,
                            (True, 4): 0xF4}[fa, nbytes]
    low = (1 << 8 * nbytes) - 1
    (eth,) = p.ext
    assert (eth.va, eth.rkey, eth.swap_add, eth.compare, eth.swap_mask, eth.compare_mask) == (
        REMOTE_BASE + 8, 9, 0x1111_2222_3333_4444 & low, 0 if fa else 0x5555_6666_7777_8888 & low,
        0x9999_AAAA_BBBB_CCCC & low, 0 if fa else 0xDDDD_EEEE_FFFF_0000 & low)


def test_masked_fetch_add_field_boundaries():
    """MFetchAdd: a set boundary bit stops the carry out of that bit (the ConnectX
    pseudo-code), checked against adding each field on its own."""
    rng = random.Random(5)
    for _ in range(500):
        nbits = rng.choice([32, 64])
        orig, add, boundary = (rng.getrandbits(nbits) for _ in range(3))
        expect, low = 0, 0
        for bit in range(nbits):
            if boundary >> bit & 1 or bit == nbits - 1:
                width = bit + 1 - low
                field = ((orig >> low) + (add >> low)) & ((1 << width) - 1)
                expect |= field << low
                low = bit + 1
        assert n.masked_fetch_add(orig, add, boundary, nbits) == expect
    assert n.masked_fetch_add(0xFF, 0x01, 0x80, 8) == 0x00
    assert n.masked_fetch_add(0x0F, 0x01, 0x08, 8) == 0x00      # the low nibble wraps alone


def test_masked_atomics_decode_in_tshark(tmp_path):
    """tshark reads a masked atomic's LRH and BTH (DLID, opcode, DestQP, PSN); the rest it
    shows as vendor-specific data (docs/nic-formats.md)."""
    if not shutil.which("tshark"):
        pytest.skip("tshark not installed: apt-get install tshark (CI installs it)")
    from models.crc import vcrc_bytes
    from models.pcap import LinkCapture, tshark_data_mismatches
    req, local = world()
    packets = []
    for i, (opcode, nbytes) in enumerate([(o, b) for o in m.MASKED_ATOMIC_OPCODES for b in (4, 8)]):
        wqe = m.build_wqe(opcode, i, 0, opmod=m.EXT_AMO_OPMOD[nbytes], raddr=REMOTE_BASE, rkey=9,
                          lkey=LKEY, laddr=LOCAL_BASE, swap_add=i + 1, compare=2, swap_mask=3,
                          compare_mask=4)
        packets += req.execute(0, i, wqe.data, reader(local)).packets
    with LinkCapture(tmp_path / "masked.pcapng") as capture:
        for t, packet in enumerate(packets):
            capture.data(packet + vcrc_bytes(packet), t)
    assert tshark_data_mismatches(tmp_path / "masked.pcapng", packets) == []


@pytest.mark.parametrize("seed", range(4))
def test_gather_lists(seed):
    """WRITE and SEND with 1..4 data segments of random lengths (zero included): the
    message is their concatenation, cut at the MTU across segment boundaries; a bad key
    or range in any segment with bytes is LOCAL_PROT_ERR (a zero-length segment is not
    looked up); five segments are LOCAL_QP_OP_ERR."""
    rng = random.Random(seed)
    for trial in range(40):
        req, local = world(mtu=1)
        op = rng.choice([m.Opcode.RDMA_WRITE, m.Opcode.SEND, m.Opcode.SEND_IMM,
                         m.Opcode.RDMA_WRITE_IMM])
        count = rng.randint(1, 4)
        gather = []
        for _ in range(count):
            size = rng.choice([0, rng.randint(1, 300), rng.randint(300, 900)])
            laddr = LOCAL_BASE + rng.randrange(MEM - size)
            gather.append((size, LKEY, laddr))
        bad = rng.randrange(count + 2)        # a segment to spoil, or none
        if bad < count and gather[bad][0]:
            size, _, laddr = gather[bad]
            gather[bad] = rng.choice([(size, LKEY ^ 0x100, laddr), (size, LKEY, LOCAL_BASE - 8),
                                      (size, LKEY, LOCAL_BASE + MEM - size + 1)])
        else:
            bad = None
        result = run(req, local, 0, trial, op=op, gather=gather, raddr=REMOTE_BASE, rkey=9)
        if bad is not None:
            assert result.status == n.CompletionStatus.ERROR
            assert result.syndrome == m.Syndrome.LOCAL_PROT_ERR and not result.packets
            continue
        message = b"".join(bytes(local[a - LOCAL_BASE:a - LOCAL_BASE + s]) for s, _, a in gather)
        assert result.status == n.CompletionStatus.SENT and result.byte_count == len(message)
        payloads = b"".join(parse_packet(p).payload for p in result.packets)
        assert payloads == message
        assert len(result.packets) == max(1, -(-len(message) // 256))
    five = m.build_wqe(m.Opcode.SEND, 0, 0, gather=[(8, LKEY, LOCAL_BASE)] * 5)
    assert m.parse_wqe(five.data).syndrome == m.Syndrome.LOCAL_QP_OP_ERR
    # Segments each under 2^31 whose sum is over it (checked before any key), and exactly it.
    req, local = world(mtu=1)
    over = [((1 << 30) - 8, LKEY ^ 0x100, LOCAL_BASE), (1 << 30, LKEY, LOCAL_BASE), (9, LKEY, LOCAL_BASE)]
    result = run(req, local, 0, 0, op=m.Opcode.SEND, gather=over)
    assert (result.status, result.syndrome) == (n.CompletionStatus.ERROR, m.Syndrome.LOCAL_LENGTH_ERR)
    req, local = world(mtu=1)
    result = run(req, local, 0, 0, op=m.Opcode.SEND, gather=over[:2] + [(8, LKEY, LOCAL_BASE)])
    assert (result.status, result.syndrome) == (n.CompletionStatus.ERROR, m.Syndrome.LOCAL_PROT_ERR)
