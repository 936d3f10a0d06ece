"""The responder's reference models: the mlx5 receive formats (models/mlx5.py) and
models.nic.NicResponderModel (docs/nic-responder.md), pure Python."""

import random

import pytest

from hdl.nic import signatures as sig
from models import mlx5 as m
from models import nic as n
from models.crc import icrc_bytes
from models.ib import (AETH, MASKED_ATOMICS, RETH, AtomicETH, ImmDt, MaskedAtomicETH, Opcode, atomic_operand_bytes,
                       carries_payload, extension_headers)
from models.nic.responder import _REQUEST_OPCODES as REQUEST_OPCODES
from models.packet import parse_packet

H = bytes.fromhex


def test_recv_wqe_and_doorbell_record_bytes():
    # mlx5_wqe_data_seg { __be32 byte_count; __be32 lkey; __be64 addr; }
    wqe = m.recv_wqe(0x00001234, 0x00ABCD01, 0x0102030405060708)
    assert wqe == H("00001234" "00abcd01" "0102030405060708")
    assert m.parse_recv_wqe(wqe) == (0x1234, 0xABCD01, 0x0102030405060708)
    assert m.parse_recv_wqe(wqe + bytes(16)) == (0x1234, 0xABCD01, 0x0102030405060708)
    # rdma-core mlx5_post_recv: qp->db[MLX5_RCV_DBR] = htobe32(qp->rq.head & 0xffff)
    assert m.rq_doorbell_record(0x12345) == H("00002345")
    assert m.parse_rq_doorbell_record(H("ffff0007")) == 7


def test_responder_cqe_bytes():
    # mlx5_cqe64: imm_inval_pkey @36, byte_cnt @44, sop_drop_qpn @56, wqe_counter @60,
    # signature @62, op_own @63 (opcode << 4 | owner)
    for opcode, imm in ((m.CqeOpcode.RESP_WR_IMM, 0xA1B2C3D4), (m.CqeOpcode.RESP_SEND_IMM, 0x01020304),
                        (m.CqeOpcode.RESP_SEND, 0)):
        cqe = m.build_responder_cqe(qpn=0xABCDEF, wqe_counter=0x1234, opcode=opcode,
                                    byte_cnt=0x80000001, imm=imm, owner=1)
        expect = bytearray(64)
        expect[36:40] = imm.to_bytes(4, "big")
        expect[44:48] = H("80000001")
        expect[56:60] = H("00abcdef")
        expect[60:62] = H("1234")
        expect[63] = opcode << 4 | 1
        assert cqe == bytes(expect)
        parsed = m.parse_cqe(cqe)
        assert parsed == m.responder_cqe(0xABCDEF, 0x1234, opcode, 0x80000001, imm, owner=1)
        assert parsed.pack() == cqe and not parsed.is_error and parsed.imm == imm
    assert [int(o) for o in (m.CqeOpcode.RESP_WR_IMM, m.CqeOpcode.RESP_SEND,
                             m.CqeOpcode.RESP_SEND_IMM, m.CqeOpcode.RESP_ERR)] == [1, 2, 3, 14]
    # RESP_SEND carries no immediate even if one is given
    assert m.responder_cqe(1, 0, m.CqeOpcode.RESP_SEND, 4, imm=5).imm == 0
    # mlx5_err_cqe: syndrome @55, s_wqe_opcode_qpn @56, wqe_counter @60, op_own = 0xe << 4
    err = m.build_responder_cqe(qpn=0x42, wqe_counter=0x10005, opcode=m.CqeOpcode.RESP_ERR,
                                byte_cnt=99, imm=0xFFFFFFFF, syndrome=m.Syndrome.LOCAL_PROT_ERR)
    expect = bytearray(64)
    expect[55] = 0x04
    expect[56:60] = H("00000042")
    expect[60:62] = H("0005")
    expect[63] = 0xE0
    assert err == bytes(expect)
    parsed = m.parse_cqe(err)
    assert parsed.is_error and parsed.syndrome == 4 and parsed.imm == 0 and parsed.byte_cnt == 0
    assert parsed == m.responder_error_cqe(0x42, 5, m.Syndrome.LOCAL_PROT_ERR)


def test_responder_cqe_opcodes_match_signatures():
    for e in sig.RecvCqeOpcode:
        assert m.CqeOpcode[e.name] == e.value


# --- NicResponderModel --------------------------------------------------------------------

LID, PEER_LID, QPN, PEER_QPN, PD, PKEY = 0x55, 0x11, 5, 0x33, 7, 0x8001
MEM = 1 << 16
REMOTE = (0x1000, 0x4000)          # the rkey's region
RBUF = (0x8000, 0x2000)            # the receive buffers' lkey region
RQ_BASE, RQ_DBR, LOG_RQ = 0xA000, 0xA100, 2
ALL = n.Access.REMOTE_WRITE | n.Access.REMOTE_READ | n.Access.REMOTE_ATOMIC
RKEY = m.make_key(1, 0x11)
LKEY = m.make_key(2, 0x22)
MTU = 256
EPSN = 100


def world(**ctx_kw):
    mem = bytearray(MEM)
    mkeys = {1: n.Mkey(key=RKEY, base=REMOTE[0], length=REMOTE[1], access=ALL | n.Access.LOCAL_WRITE,
                       pd=PD, valid=True),
             2: n.Mkey(key=LKEY, base=RBUF[0], length=RBUF[1], access=n.Access.LOCAL_WRITE, pd=PD,
                       valid=True)}
    kw = dict(qpn=QPN, dest_qpn=PEER_QPN, dlid=PEER_LID, sl=2, pkey=PKEY, pd=PD, mtu=1, access=ALL,
              rq_psn=EPSN, min_rnr_timer=14, rq_base=RQ_BASE, log_rq_size=LOG_RQ, rq_dbr=RQ_DBR,
              rcqn=3)
    kw.update(ctx_kw)
    sl_to_vl = [s % 4 for s in range(16)]
    sl_to_vl[2] = 1
    resp = n.NicResponderModel(LID, memory=mem, contexts={QPN: n.QpContext(**kw)}, num_qps=16,
                            mkeys=mkeys, num_mkeys=8, sl_to_vl=sl_to_vl)
    return resp, mem


def req(op, psn, *, ext=(), payload=b"", ackreq=1, slid=PEER_LID, pkey=PKEY, destqp=QPN, dlid=LID):
    return n.make_packet(vl=1, sl=2, dlid=dlid, slid=slid, opcode=op, destqp=destqp, psn=psn,
                         pkey=pkey, ackreq=ackreq, ext=ext, payload=payload)


def write_only(psn, va, data, rkey=RKEY, dmalen=None, imm=None, **kw):
    ext = [RETH(va=va, rkey=rkey, dmalen=len(data) if dmalen is None else dmalen)]
    op = Opcode.RDMA_WRITE_ONLY
    if imm is not None:
        ext.append(ImmDt(imm=imm))
        op = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
    return req(op, psn, ext=ext, payload=data, **kw)


def read_req(psn, va, length, rkey=RKEY, **kw):
    return req(Opcode.RDMA_READ_REQUEST, psn, ext=[RETH(va=va, rkey=rkey, dmalen=length)], **kw)


def fetch_add(psn, va, add, rkey=RKEY, **kw):
    return req(Opcode.FETCH_ADD, psn, ext=[AtomicETH(va=va, rkey=rkey, swap_add=add)], **kw)


def acks(decision):
    """(psn, syndrome, msn) of each ACKNOWLEDGE; checks the responses' addressing."""
    out = []
    for raw in decision.packets:
        p = parse_packet(raw)
        assert (p.lrh.dlid, p.lrh.slid, p.lrh.sl, p.lrh.vl) == (PEER_LID, LID, 2, 1)
        assert p.bth.destqp == PEER_QPN and p.bth.pkey == PKEY and p.icrc_ok
        if p.bth.opcode == Opcode.ACKNOWLEDGE:
            out.append((p.bth.psn, p.ext[0].syndrome, p.ext[0].msn))
    return out


def nak(code):
    return 0x60 | code


def check_partition(c):
    """Every packet counted exactly once (see NicResponderModel.process)."""
    assert c["packets"] == (c["responses_steered"] + c["rx_request_icrc_drops"]
                            + c["rx_request_malformed"] + c["requests_received"])
    assert c["requests_received"] == sum(c[k] for k in (
        "rx_dropped_qp", "rx_dropped_pkey", "seq_naks", "seq_dropped", "duplicate_requests",
        "requests_executed"))
    assert c["atomic_replays"] + c["duplicates_dropped"] <= c["duplicate_requests"]
    assert c["rnr_naks"] + c["access_naks"] + c["invalid_naks"] + c["op_naks"] <= c["requests_executed"]


def test_write_read_atomic_execute():
    resp, mem = world()
    d = resp.process(write_only(EPSN, 0x1100, b"hello world"))
    assert d.fate == "requests_executed" and mem[0x1100:0x110B] == b"hello world"
    assert acks(d) == [(EPSN, n.ACK_SYNDROME, 1)] and d.dma == (0x1100, 11)
    # multi-packet WRITE, AckReq only on the LAST: one ACK
    data = bytes(random.Random(1).getrandbits(8) for _ in range(600))
    pkts = [req(Opcode.RDMA_WRITE_FIRST, EPSN + 1, ext=[RETH(va=0x1201, rkey=RKEY, dmalen=600)],
                payload=data[:256], ackreq=0),
            req(Opcode.RDMA_WRITE_MIDDLE, EPSN + 2, payload=data[256:512], ackreq=0),
            req(Opcode.RDMA_WRITE_LAST, EPSN + 3, payload=data[512:])]
    out = [resp.process(p) for p in pkts]
    assert [acks(d) for d in out] == [[], [], [(EPSN + 3, n.ACK_SYNDROME, 2)]]
    assert [d.dma for d in out] == [(0x1201, 256), (0x1301, 256), (0x1401, 88)]
    assert mem[0x1201:0x1201 + 600] == data
    # READ of 600 bytes at MTU 256: 3 responses, epsn advances by 3
    d = resp.process(read_req(EPSN + 4, 0x1201, 600))
    ps = [parse_packet(p) for p in d.packets]
    assert [p.bth.opcode for p in ps] == [Opcode.RDMA_READ_RESPONSE_FIRST,
                                          Opcode.RDMA_READ_RESPONSE_MIDDLE,
                                          Opcode.RDMA_READ_RESPONSE_LAST]
    assert [p.bth.psn for p in ps] == [EPSN + 4, EPSN + 5, EPSN + 6]
    assert b"".join(p.payload for p in ps) == data and ps[0].ext[0].msn == 3
    assert d.commands[0]["kind"] == "READ" and d.commands[0]["length"] == 600 and d.dma == (0, 0)
    assert resp.responder_state(QPN).epsn == EPSN + 7
    # zero-length READ: one ONLY response, no key needed
    d = resp.process(read_req(EPSN + 7, 0, 0, rkey=0xDEAD))
    (p,) = [parse_packet(x) for x in d.packets]
    assert p.bth.opcode == Opcode.RDMA_READ_RESPONSE_ONLY and p.payload == b"" and p.ext[0].msn == 4
    # atomics on little-endian words
    mem[0x2000:0x2008] = (5).to_bytes(8, "little")
    d = resp.process(fetch_add(EPSN + 8, 0x2000, 3))
    (p,) = [parse_packet(x) for x in d.packets]
    assert p.bth.opcode == Opcode.ATOMIC_ACKNOWLEDGE and p.ext[1].orig == 5 and p.ext[0].msn == 5
    assert int.from_bytes(mem[0x2000:0x2008], "little") == 8
    assert d.atomic == dict(addr=0x2000, fetch_add=1, swap_add=3, compare=0, orig=5)
    cs = req(Opcode.COMPARE_SWAP, EPSN + 9, ext=[AtomicETH(va=0x2000, rkey=RKEY, swap_add=77, compare=8)])
    assert parse_packet(resp.process(cs).packets[0]).ext[1].orig == 8
    assert int.from_bytes(mem[0x2000:0x2008], "little") == 77
    cs = req(Opcode.COMPARE_SWAP, EPSN + 10, ext=[AtomicETH(va=0x2000, rkey=RKEY, swap_add=1, compare=8)])
    assert parse_packet(resp.process(cs).packets[0]).ext[1].orig == 77
    assert int.from_bytes(mem[0x2000:0x2008], "little") == 77
    # WRITE of 0 bytes needs no key; no AckReq, no ACK
    d = resp.process(write_only(EPSN + 11, 0, b"", rkey=0xBAD, ackreq=0))
    assert d.fate == "requests_executed" and d.packets == [] and d.dma == (0, 0)
    assert resp.counters["requests_executed"] == 10 and resp.responder_state(QPN).msn == 8
    check_partition(resp.counters)


def test_receiver_drops():
    resp, mem = world()
    good = write_only(EPSN, 0x1000, b"abcd")

    def fix_icrc(b):
        b = bytes(b)
        return b[:-4] + icrc_bytes(b[:-4])

    cases = []
    bad = bytearray(good)
    bad[30] ^= 1
    cases.append(("rx_request_icrc_drops", bytes(bad), False))
    cases.append(("rx_request_icrc_drops", good, True))                      # end-bad
    cases.append(("rx_request_icrc_drops", b"", False))
    cases.append(("rx_request_icrc_drops", b"\x00\x01\x02", False))
    bad = bytearray(good)
    bad[1] = (bad[1] & ~3) | 3                                                 # LNH 3 (GRH)
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    bad = bytearray(good)
    bad[2:4] = (0x56).to_bytes(2, "big")                                      # another DLID
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    bad = bytearray(good)
    bad[9] |= 1                                                               # TVer 1
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    cases.append(("rx_request_malformed", fix_icrc(good[:-8] + good[-4:]), False))   # PktLen
    bad = bytearray(good)
    bad[8] = 0x15                                                              # not RC request
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    bad = bytearray(good)
    bad[8] = 0x64                                                              # UD SEND_ONLY
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    # headers cut: an RDMA_WRITE_ONLY of 4 bytes re-labelled as carrying an AtomicETH
    bad = bytearray(good)
    bad[8] = Opcode.FETCH_ADD
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    short = req(Opcode.SEND_ONLY, EPSN)                                         # 24 bytes, fine
    bad = bytearray(short)
    bad[8] = Opcode.RDMA_WRITE_ONLY                                              # RETH missing
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    bad = bytearray(short)
    bad[9] |= 0x30                                                              # PadCnt 3 > payload
    cases.append(("rx_request_malformed", fix_icrc(bad), False))
    cases.append(("rx_request_malformed", write_only(EPSN, 0x1000, bytes(4100)), False))  # > 4096
    cases.append(("rx_request_malformed",
                  req(Opcode.RDMA_READ_REQUEST, EPSN, ext=[RETH(va=0x1000, rkey=RKEY, dmalen=4)],
                      payload=b"\0\0\0\0"), False))                              # READ with payload
    cases.append(("rx_request_malformed",
                  req(Opcode.FETCH_ADD, EPSN, ext=[AtomicETH(va=0x1000, rkey=RKEY)], payload=b"1234"),
                  False))
    cases.append(("responses_steered", req(Opcode.ACKNOWLEDGE, EPSN, ext=[AETH()]), False))
    for fate, pkt, end_bad in cases:
        before = dict(resp.counters)
        d = resp.process(pkt, end_bad=end_bad)
        assert d.fate == fate and d.packets == [] and d.dma is None, (fate, pkt.hex())
        assert resp.counters[fate] == before[fate] + 1
    assert bytes(mem) == bytes(MEM) and resp.counters["requests_received"] == 0
    # the exact-size limits pass
    assert resp.process(write_only(EPSN, 0x1000, bytes(256))).fate == "requests_executed"
    check_partition(resp.counters)


def test_qp_and_pkey_drops():
    resp, mem = world()
    assert resp.process(write_only(EPSN, 0x1000, b"x", destqp=4)).fate == "rx_dropped_qp"    # RESET
    assert resp.process(write_only(EPSN, 0x1000, b"x", destqp=16)).fate == "rx_dropped_qp"   # >= num_qps
    assert resp.process(write_only(EPSN, 0x1000, b"x", slid=0x12)).fate == "rx_dropped_qp"   # SLID
    psn = EPSN
    for pkey, ok in ((0x0001, True), (0x8001, True), (0x8002, False), (0x0002, False)):
        fate = resp.process(write_only(psn, 0x1000, b"x", pkey=pkey, ackreq=0)).fate
        assert fate == ("requests_executed" if ok else "rx_dropped_pkey"), hex(pkey)
        psn += ok
    # both limited members: dropped
    resp2, _ = world(pkey=0x0001)
    assert resp2.process(write_only(EPSN, 0x1000, b"x", pkey=0x0001)).fate == "rx_dropped_pkey"
    assert resp2.process(write_only(EPSN, 0x1000, b"x", pkey=0x8001)).fate == "requests_executed"
    # ERR drops; RESET -> RTS starts again at rq_psn
    resp.set_state(QPN, "ERR")
    assert resp.process(write_only(psn, 0x1000, b"x")).fate == "rx_dropped_qp"
    resp.reset_qp(QPN)
    assert resp.qp_state(QPN) == n.QpState.RTS and resp.responder_state(QPN).epsn == EPSN
    assert resp.process(write_only(EPSN, 0x1000, b"y")).fate == "requests_executed"
    assert acks(resp.last) == [(EPSN, n.ACK_SYNDROME, 1)]
    check_partition(resp.counters)


def test_psn_rules_and_duplicates():
    resp, mem = world()
    assert resp.process(write_only(EPSN, 0x1000, b"AAAA")).fate == "requests_executed"
    # out of sequence: one NAK (PSN = epsn), then silence, until an in-sequence packet
    d = resp.process(write_only(EPSN + 3, 0x1000, b"BBBB"))
    assert d.fate == "seq_naks" and acks(d) == [(EPSN + 1, nak(0), 1)]
    assert resp.process(write_only(EPSN + 4, 0x1000, b"BBBB")).fate == "seq_dropped"
    assert resp.process(write_only(EPSN + 1, 0x1004, b"CC")).fate == "requests_executed"
    assert resp.process(write_only(EPSN + 5, 0x1000, b"BBBB")).fate == "seq_naks"
    assert mem[0x1000:0x1006] == b"AAAACC"
    # half the PSN space ahead is still "ahead"; beyond it is "behind"
    far = (EPSN + 2 + (1 << 23)) % (1 << 24)
    assert resp.process(write_only(far - 1, 0x1000, b"Z")).fate == "seq_dropped"
    assert resp.process(write_only(far, 0x1000, b"Z")).fate == "duplicate_requests"
    # duplicate WRITE: ACK epsn-1 with the current MSN, not executed
    mem[0x1000:0x1004] = b"zzzz"
    d = resp.process(write_only(EPSN, 0x1000, b"AAAA", ackreq=0))
    assert d.fate == "duplicate_requests" and acks(d) == [(EPSN + 1, n.ACK_SYNDROME, 2)]
    assert mem[0x1000:0x1004] == b"zzzz" and d.writes == [] and d.dma == (0, 0)
    # READ then its duplicate: re-executed from the duplicate's PSN, epsn and MSN unchanged
    mem[0x1100:0x1300] = bytes(range(256)) * 2
    resp.process(read_req(EPSN + 2, 0x1100, 512))
    assert resp.responder_state(QPN).epsn == EPSN + 4 and resp.responder_state(QPN).msn == 3
    mem[0x1100] = 0xEE
    d = resp.process(read_req(EPSN + 2, 0x1100, 300))
    ps = [parse_packet(p) for p in d.packets]
    assert d.fate == "duplicate_requests" and [p.bth.psn for p in ps] == [EPSN + 2, EPSN + 3]
    assert ps[0].payload[0] == 0xEE and ps[0].ext[0].msn == 3 and len(ps[1].payload) == 44
    assert resp.responder_state(QPN).epsn == EPSN + 4 and resp.responder_state(QPN).msn == 3
    # a duplicate READ failing its checks is dropped (and the QP stays in RTS)
    d = resp.process(read_req(EPSN + 2, 0x1100, 300, rkey=RKEY + 1))
    assert d.fate == "duplicate_requests" and d.packets == [] and resp.counters["duplicates_dropped"] == 1
    assert resp.qp_state(QPN) == n.QpState.RTS
    # atomics: a duplicate of one of the newest SAVED_ATOMICS replays its result, an older
    # one is dropped
    mem[0x2000:0x2008] = (10).to_bytes(8, "little")
    for k in range(n.SAVED_ATOMICS + 1):
        resp.process(fetch_add(EPSN + 4 + k, 0x2000, 1))
    last = EPSN + 4 + n.SAVED_ATOMICS
    d = resp.process(fetch_add(last, 0x2000, 1))
    assert d.fate == "duplicate_requests" and parse_packet(d.packets[0]).ext[1].orig == 14
    assert parse_packet(d.packets[0]).ext[0].msn == 3 + n.SAVED_ATOMICS + 1
    d = resp.process(fetch_add(EPSN + 5, 0x2000, 1))          # the oldest still kept
    assert parse_packet(d.packets[0]).ext[1].orig == 11 and resp.counters["atomic_replays"] == 2
    assert int.from_bytes(mem[0x2000:0x2008], "little") == 15
    d = resp.process(fetch_add(EPSN + 4, 0x2000, 1))          # no longer kept
    assert d.packets == [] and resp.counters["duplicates_dropped"] == 2
    assert int.from_bytes(mem[0x2000:0x2008], "little") == 15
    check_partition(resp.counters)


KEY_CASES = [
    ("no entry", dict(rkey=m.make_key(3, 0x11))),
    ("variant", dict(rkey=m.make_key(1, 0x12))),
    ("index modulo", dict(rkey=m.make_key(9, 0x11))),
    ("below base", dict(va=REMOTE[0] - 1)),
    ("beyond end", dict(va=REMOTE[0] + REMOTE[1] - 7)),
    ("wraps 2^64", dict(va=(1 << 64) - 4)),
]


@pytest.mark.parametrize("op", ["write", "read", "atomic"])
@pytest.mark.parametrize("name,bad", KEY_CASES, ids=[c[0] for c in KEY_CASES])
def test_rkey_checks(op, name, bad):
    resp, mem = world()
    va, rkey = bad.get("va", REMOTE[0] + 8), bad.get("rkey", RKEY)
    pkt = {"write": lambda: write_only(EPSN, va, bytes(8), rkey=rkey),
           "read": lambda: read_req(EPSN, va, 8, rkey=rkey),
           "atomic": lambda: fetch_add(EPSN, va, 1, rkey=rkey)}[op]()
    if op == "atomic" and va % 8:
        expect = nak(1)      # alignment is checked before the key
    else:
        expect = nak(2)
    d = resp.process(pkt)
    assert acks(d) == [(EPSN, expect, 0)] and d.qp_error and resp.qp_errors == [QPN]
    assert bytes(mem) == bytes(MEM) and resp.qp_state(QPN) == n.QpState.ERR
    assert resp.process(write_only(EPSN, REMOTE[0], b"x")).fate == "rx_dropped_qp"


@pytest.mark.parametrize("op,right", [("write", n.Access.REMOTE_WRITE), ("read", n.Access.REMOTE_READ),
                                      ("atomic", n.Access.REMOTE_ATOMIC)])
@pytest.mark.parametrize("where", ["qp", "key", "pd", "invalid"])
def test_rights(op, right, where):
    resp, mem = world()
    if where == "qp":
        resp.context(QPN).access = ALL & ~right
    elif where == "key":
        resp.mkeys[1].access = (ALL | n.Access.LOCAL_WRITE) & ~right
    elif where == "pd":
        resp.mkeys[1].pd = PD + 1
    else:
        resp.mkeys[1].valid = False
    pkt = {"write": write_only(EPSN, 0x1000, bytes(8)), "read": read_req(EPSN, 0x1000, 8),
           "atomic": fetch_add(EPSN, 0x1000, 1)}[op]
    d = resp.process(pkt)
    assert d.fate == "access_naks" and acks(d) == [(EPSN, nak(2), 0)] and bytes(mem) == bytes(MEM)
    # the QP's right is needed even without a key (length 0)
    if where == "qp" and op != "atomic":
        resp, mem = world(access=ALL & ~right)
        pkt = write_only(EPSN, 0, b"") if op == "write" else read_req(EPSN, 0, 0)
        assert resp.process(pkt).fate == "access_naks"


def test_invalid_requests():
    cases = {
        "MIDDLE without FIRST": [req(Opcode.RDMA_WRITE_MIDDLE, EPSN, payload=bytes(MTU))],
        "LAST without FIRST": [req(Opcode.SEND_LAST, EPSN, payload=b"x")],
        "FIRST inside a message": [
            req(Opcode.SEND_FIRST, EPSN, payload=bytes(MTU)),
            req(Opcode.SEND_FIRST, EPSN + 1, payload=bytes(MTU))],
        "SEND LAST in a WRITE": [
            req(Opcode.RDMA_WRITE_FIRST, EPSN, ext=[RETH(va=0x1000, rkey=RKEY, dmalen=300)],
                payload=bytes(MTU)),
            req(Opcode.SEND_LAST, EPSN + 1, payload=bytes(44))],
        "READ inside a message": [
            req(Opcode.SEND_FIRST, EPSN, payload=bytes(MTU)), read_req(EPSN + 1, 0x1000, 4)],
        "atomic inside a message": [
            req(Opcode.SEND_FIRST, EPSN, payload=bytes(MTU)), fetch_add(EPSN + 1, 0x1000, 4)],
        "FIRST short of the MTU": [req(Opcode.SEND_FIRST, EPSN, payload=bytes(MTU - 4))],
        "MIDDLE beyond the MTU": [
            req(Opcode.SEND_FIRST, EPSN, payload=bytes(MTU)),
            req(Opcode.SEND_MIDDLE, EPSN + 1, payload=bytes(MTU + 4))],
        "LAST empty": [
            req(Opcode.SEND_FIRST, EPSN, payload=bytes(MTU)), req(Opcode.SEND_LAST, EPSN + 1)],
        "ONLY beyond the MTU": [req(Opcode.SEND_ONLY, EPSN, payload=bytes(MTU + 4))],
        "WRITE beyond the RETH length": [write_only(EPSN, 0x1000, bytes(8), dmalen=4)],
        "WRITE short of the RETH length": [write_only(EPSN, 0x1000, bytes(8), dmalen=12)],
        "WRITE LAST short": [
            req(Opcode.RDMA_WRITE_FIRST, EPSN, ext=[RETH(va=0x1000, rkey=RKEY, dmalen=600)],
                payload=bytes(MTU)),
            req(Opcode.RDMA_WRITE_LAST, EPSN + 1, payload=bytes(100))],
        "FIRST beyond the RETH length": [
            req(Opcode.RDMA_WRITE_FIRST, EPSN, ext=[RETH(va=0x1000, rkey=RKEY, dmalen=100)],
                payload=bytes(MTU))],
        "atomic unaligned": [fetch_add(EPSN, 0x1004, 1)],
    }
    for name, pkts in cases.items():
        resp, mem = world()
        for _ in range(4):
            resp.post_recv(QPN, 0x1000, LKEY, RBUF[0])
        for p in pkts[:-1]:
            assert resp.process(p).fate == "requests_executed", name
        before = bytes(mem)
        d = resp.process(pkts[-1])
        assert d.fate == "invalid_naks" and d.qp_error, name
        assert [a[:2] for a in acks(d)] == [(parse_packet(pkts[-1]).bth.psn, nak(1))], name
        assert d.writes == [] and bytes(mem) == before, name
        check_partition(resp.counters)


def test_receive_queue():
    resp, mem = world()
    # nothing posted: RNR NAK with min_rnr_timer, nothing consumed, epsn unchanged
    send_imm = req(Opcode.SEND_ONLY_WITH_IMMEDIATE, EPSN, ext=[ImmDt(imm=0xCAFEBABE)], payload=b"hi")
    d = resp.process(send_imm)
    assert d.fate == "rnr_naks" and acks(d) == [(EPSN, 0x20 | 14, 0)] and not d.qp_error
    assert d.recv_result["status"] == "EMPTY" and d.recv_taken is None
    assert resp.responder_state(QPN).epsn == EPSN and resp.completions == {}
    d = resp.process(write_only(EPSN, 0x1000, b"data", imm=7))
    assert d.fate == "rnr_naks" and bytes(mem[0x1000:0x1004]) == bytes(4)
    # post two, the retries go through
    assert resp.post_recv(QPN, 100, LKEY, RBUF[0]) == 0
    assert resp.post_recv(QPN, 0, LKEY, 0) == 1            # a 0-byte WQE: its address is free
    assert mem[RQ_DBR:RQ_DBR + 4] == m.rq_doorbell_record(2)
    d = resp.process(send_imm)
    assert d.fate == "requests_executed" and d.recv_taken == 0 and mem[RBUF[0]:RBUF[0] + 2] == b"hi"
    (c,) = d.completions
    assert c == n.RecvCompletion(qpn=QPN, cqn=3, opcode=m.CqeOpcode.RESP_SEND_IMM, byte_count=2,
                                 imm=0xCAFEBABE, wqe_counter=0)
    assert c.cqe(owner=1).pack() == m.build_responder_cqe(QPN, 0, m.CqeOpcode.RESP_SEND_IMM, 2,
                                                          0xCAFEBABE, owner=1)
    d = resp.process(write_only(EPSN + 1, 0x1000, b"data", imm=7))
    assert mem[0x1000:0x1004] == b"data" and d.completions[0].opcode == m.CqeOpcode.RESP_WR_IMM
    assert d.completions[0].byte_count == 4 and d.completions[0].imm == 7 and d.recv_taken == 1
    # WRITE_WITH_IMM over three packets: the WQE is taken at the LAST only
    data = bytes(range(256)) * 2 + b"tail"
    resp.post_recv(QPN, 8, LKEY, RBUF[0])
    first = resp.process(req(Opcode.RDMA_WRITE_FIRST, EPSN + 2, payload=data[:256], ackreq=0,
                             ext=[RETH(va=0x1100, rkey=RKEY, dmalen=len(data))]))
    assert first.recv_taken is None
    resp.process(req(Opcode.RDMA_WRITE_MIDDLE, EPSN + 3, payload=data[256:512], ackreq=0))
    last = resp.process(req(Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE, EPSN + 4, payload=data[512:],
                            ext=[ImmDt(imm=1)]))
    assert last.recv_taken == 2 and last.completions[0].byte_count == len(data)
    assert mem[0x1100:0x1100 + len(data)] == data
    # a multi-packet SEND scattered into one WQE; RESP_SEND carries no immediate
    resp.post_recv(QPN, 600, LKEY, RBUF[0] + 0x100)
    msg = bytes(random.Random(2).getrandbits(8) for _ in range(520))
    resp.process(req(Opcode.SEND_FIRST, EPSN + 5, payload=msg[:256], ackreq=0))
    resp.process(req(Opcode.SEND_MIDDLE, EPSN + 6, payload=msg[256:512], ackreq=0))
    d = resp.process(req(Opcode.SEND_LAST, EPSN + 7, payload=msg[512:]))
    assert mem[RBUF[0] + 0x100:RBUF[0] + 0x100 + 520] == msg
    assert d.completions == [n.RecvCompletion(QPN, 3, m.CqeOpcode.RESP_SEND, 520, 0, 3)]
    assert acks(d) == [(EPSN + 7, n.ACK_SYNDROME, 4)]
    assert [c.wqe_counter for c in resp.completions[3]] == [0, 1, 2, 3]
    assert resp.responder_state(QPN).rq_ci == 4
    check_partition(resp.counters)


def test_receive_queue_wraps():
    resp, mem = world(log_rq_size=1)
    for i in range(5):
        resp.post_recv(QPN, 4, LKEY, RBUF[0] + 16 * i)
        d = resp.process(req(Opcode.SEND_ONLY, EPSN + i, payload=b"%4d" % i))
        assert d.recv_taken == i and mem[RBUF[0] + 16 * i:RBUF[0] + 16 * i + 4] == b"%4d" % i
    # the 16-bit counters wrap too
    resp2, mem2 = world(log_rq_size=1)
    resp2.responder_state(QPN).rq_ci = resp2.responder_state(QPN).rq_pi = 0xFFFF
    mem2[RQ_DBR:RQ_DBR + 4] = m.rq_doorbell_record(0xFFFF)
    resp2.post_recv(QPN, 4, LKEY, RBUF[0])
    d = resp2.process(req(Opcode.SEND_ONLY, EPSN, payload=b"wrap"))
    assert d.recv_taken == 0xFFFF and resp2.responder_state(QPN).rq_ci == 0


@pytest.mark.parametrize("name", ["lkey", "variant", "pd", "local_write", "range", "wrap"])
def test_bad_receive_wqe(name):
    resp, mem = world()
    lkey, addr, length = LKEY, RBUF[0], 64
    if name == "lkey":
        lkey = m.make_key(5, 0x22)
    elif name == "variant":
        lkey = LKEY ^ 1
    elif name == "pd":
        resp.mkeys[2].pd = PD + 1
    elif name == "local_write":
        resp.mkeys[2].access = n.Access(0)
    elif name == "range":
        addr = RBUF[0] + RBUF[1] - 63
    else:
        addr = (1 << 64) - 32
    resp.post_recv(QPN, length, lkey, addr)
    d = resp.process(req(Opcode.SEND_ONLY, EPSN, payload=b"abc"))
    assert d.fate == "op_naks" and acks(d) == [(EPSN, nak(3), 0)] and d.qp_error
    assert d.completions == [n.RecvCompletion(QPN, 3, m.CqeOpcode.RESP_ERR, 0, 0, 0,
                                              m.Syndrome.LOCAL_PROT_ERR)]
    assert m.parse_cqe(d.completions[0].cqe().pack()).syndrome == m.Syndrome.LOCAL_PROT_ERR
    assert d.recv_result == dict(status="ERROR", syndrome=m.Syndrome.LOCAL_PROT_ERR, addr=0,
                                 length=0, wqe_counter=0)
    assert bytes(mem[RBUF[0]:RBUF[0] + RBUF[1]]) == bytes(RBUF[1])
    # a WRITE_WITH_IMM taking a bad WQE fails the same way, writing nothing
    resp, mem = world()
    resp.post_recv(QPN, length, lkey, addr)
    if name == "pd":
        resp.mkeys[2].pd = PD + 1
    elif name == "local_write":
        resp.mkeys[2].access = n.Access(0)
    d = resp.process(write_only(EPSN, REMOTE[0], b"abcd", imm=9))
    assert d.fate == "op_naks" and d.writes == [] and d.completions[0].opcode == m.CqeOpcode.RESP_ERR
    assert bytes(mem[REMOTE[0]:REMOTE[0] + 4]) == bytes(4)


def test_send_too_long():
    resp, mem = world()
    resp.post_recv(QPN, 300, LKEY, RBUF[0])
    resp.process(req(Opcode.SEND_FIRST, EPSN, payload=b"a" * MTU, ackreq=0))
    d = resp.process(req(Opcode.SEND_LAST, EPSN + 1, payload=b"b" * 100))
    assert d.fate == "invalid_naks" and acks(d) == [(EPSN + 1, nak(1), 0)] and d.qp_error
    assert d.completions == [n.RecvCompletion(QPN, 3, m.CqeOpcode.RESP_ERR, 0, 0, 0,
                                              m.Syndrome.LOCAL_LENGTH_ERR)]
    assert mem[RBUF[0]:RBUF[0] + 300] == b"a" * MTU + bytes(44)
    # at the ONLY packet
    resp, mem = world()
    resp.post_recv(QPN, 3, LKEY, RBUF[0])
    d = resp.process(req(Opcode.SEND_ONLY, EPSN, payload=b"abcd"))
    assert d.fate == "invalid_naks" and d.completions[0].syndrome == m.Syndrome.LOCAL_LENGTH_ERR
    assert d.writes == [] and mem[RBUF[0]:RBUF[0] + 4] == bytes(4)


def test_construction_errors():
    with pytest.raises(ValueError, match="num_mkeys"):
        n.NicResponderModel(1, memory_bytes=16, contexts={}, mkeys={0: n.Mkey()})
    with pytest.raises(ValueError, match="below num_mkeys"):
        n.NicResponderModel(1, memory_bytes=16, contexts={}, mkeys={4: n.Mkey()}, num_mkeys=4)
    with pytest.raises(ValueError, match="sl_to_vl"):
        n.NicResponderModel(1, memory_bytes=16, contexts={}, sl_to_vl=[0] * 15)


# --- random traffic with loss, duplicates and RNR; fuzz ---------------------------------------

BIG = 1 << 20
RREGION = (0x10000, 0x70000)       # rkey: WRITE targets, READ sources, atomic words
LREGION = (0x80000, 0x70000)       # lkey: receive buffers


def big_world(qpns=(5, 6), log_rq_size=3):
    mem = bytearray(BIG)
    mkeys = [n.Mkey() for _ in range(4)]
    mkeys[1] = n.Mkey(key=RKEY, base=RREGION[0], length=RREGION[1], access=ALL, pd=PD, valid=True)
    mkeys[2] = n.Mkey(key=LKEY, base=LREGION[0], length=LREGION[1], access=n.Access.LOCAL_WRITE,
                      pd=PD, valid=True)
    contexts = {q: n.QpContext(qpn=q, dest_qpn=0x100 + q, dlid=PEER_LID, sl=0, pkey=0xFFFF, pd=PD,
                               mtu=1, access=ALL, rq_psn=(1 << 24) - 20 + q, min_rnr_timer=3,
                               rq_base=0xF0000 + 0x1000 * i, log_rq_size=log_rq_size,
                               rq_dbr=0xF8000 + 64 * i, rcqn=i)
                for i, q in enumerate(qpns)}
    resp = n.NicResponderModel(LID, memory=mem, contexts=contexts, mkeys=mkeys)
    return resp, mem, contexts


class _Peer:
    """One requester QP: messages as packets, go-back-N on NAKs, random loss/duplicates."""

    def __init__(self, rng, qpn, ctx, resp, mem, write_base, recv_base, atomic_va):
        self.rng, self.qpn, self.ctx, self.resp, self.mem = rng, qpn, ctx, resp, mem
        self.packets = []          # (psn, bytes, message index)
        self.messages = []
        self.psn = ctx.rq_psn
        self.write_at, self.recv_at, self.atomic_va = write_base, recv_base, atomic_va
        self.next = 0              # index into packets of the next one to send
        self.wqes_posted = 0
        self.sends_expected = []   # (buffer, data, imm or None) per SEND message, in order
        self.atomic_total = 0
        self.atomic_origs = {}     # psn -> orig seen first

    def _pkt(self, op, msg, ext=(), payload=b"", ackreq=0):
        self.packets.append((self.psn, n.make_packet(
            vl=0, sl=0, dlid=LID, slid=PEER_LID, opcode=op, destqp=self.qpn, psn=self.psn,
            pkey=0xFFFF, ackreq=ackreq, ext=ext, payload=payload), msg))
        self.psn = (self.psn + 1) % (1 << 24)

    def add_message(self):
        rng = self.rng
        kind = rng.choice(["write", "write_imm", "send", "send_imm", "read", "atomic"])
        msg = len(self.messages)
        length = rng.choice([0, 1, 255, 256, 257, 512, 700, rng.randrange(800)])
        data = bytes(rng.getrandbits(8) for _ in range(length))
        imm = rng.getrandbits(32)
        self.messages.append((kind, data))
        if kind == "read":
            va = RREGION[0] + rng.randrange(0x8000)
            self._pkt(Opcode.RDMA_READ_REQUEST, msg, [RETH(va=va, rkey=RKEY, dmalen=length)], ackreq=1)
            self.psn = (self.psn + max(1, -(-length // MTU)) - 1) % (1 << 24)
            return
        if kind == "atomic":
            add = rng.getrandbits(16)
            self.atomic_total += add
            self._pkt(Opcode.FETCH_ADD, msg, [AtomicETH(va=self.atomic_va, rkey=RKEY, swap_add=add)],
                      ackreq=1)
            return
        chunks = [data[i:i + MTU] for i in range(0, length, MTU)] or [b""]
        with_imm = kind.endswith("imm")
        if kind.startswith("write"):
            va = self.write_at
            self.write_at += length + rng.randrange(8)
            self.messages[-1] = (kind, data, va)
            ops = (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
                   Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE if with_imm else Opcode.RDMA_WRITE_LAST,
                   Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE if with_imm else Opcode.RDMA_WRITE_ONLY)
        else:
            ops = (Opcode.SEND_FIRST, Opcode.SEND_MIDDLE,
                   Opcode.SEND_LAST_WITH_IMMEDIATE if with_imm else Opcode.SEND_LAST,
                   Opcode.SEND_ONLY_WITH_IMMEDIATE if with_imm else Opcode.SEND_ONLY)
        if kind in ("write_imm", "send", "send_imm"):
            self.sends_expected.append((kind, data, imm if kind != "send" else 0))
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            op = ops[3] if len(chunks) == 1 else ops[0] if i == 0 else ops[2] if last else ops[1]
            ext = []
            if kind.startswith("write") and i == 0:
                ext.append(RETH(va=va, rkey=RKEY, dmalen=length))
            if last and with_imm:
                ext.append(ImmDt(imm=imm))
            self._pkt(op, msg, ext, chunk, ackreq=int(last or rng.random() < 0.2))

    def post_recv(self):
        self.resp.post_recv(self.qpn, 1024, LKEY, self.recv_at + 1024 * self.wqes_posted)
        self.wqes_posted += 1

    def step(self, stats):
        """Send something; returns the Decision."""
        rng = self.rng
        consumed = self.resp.responder_state(self.qpn).rq_ci
        if self.wqes_posted - consumed < 4 and rng.random() < 0.4:
            self.post_recv()            # posted lazily, so that the queue sometimes runs dry
        r = rng.random()
        atomics = [i for i in range(self.next) if self.messages[self.packets[i][2]][0] == "atomic"]
        if r < 0.03 and atomics:
            index = atomics[-1]                       # a retry of the newest atomic: replayed
        elif r < 0.1 and self.next > 0:
            index = rng.randrange(self.next)          # a duplicate of something sent
        elif r < 0.18 and self.next + 1 < len(self.packets):
            index = self.next + rng.randrange(1, min(4, len(self.packets) - self.next))   # loss
        else:
            index = self.next
        psn, raw, msg = self.packets[index]
        d = self.resp.process(raw)
        stats[d.fate] = stats.get(d.fate, 0) + 1
        syndromes = [parse_packet(p).ext[0].syndrome for p in d.packets
                     if parse_packet(p).bth.opcode == Opcode.ACKNOWLEDGE]
        assert all(s >> 5 != 0b011 or s == 0x60 for s in syndromes), (d, syndromes)
        assert not d.qp_error
        for p in d.packets:
            pp = parse_packet(p)
            if pp.bth.opcode == Opcode.ATOMIC_ACKNOWLEDGE:
                assert self.atomic_origs.setdefault(pp.bth.psn, pp.ext[1].orig) == pp.ext[1].orig
            elif pp.bth.opcode != Opcode.ACKNOWLEDGE and pp.payload:
                va = parse_packet(raw).ext[0].va + n.psn_diff(pp.bth.psn, psn) * MTU
                assert pp.payload == bytes(self.mem[va:va + len(pp.payload)])
        epsn = self.resp.responder_state(self.qpn).epsn
        # go-back-N: the requester resumes at whatever the responder expects
        self.next = next((i for i, (p, _, _) in enumerate(self.packets)
                          if n.psn_diff(p, epsn) >= 0), len(self.packets))
        return d

    @property
    def done(self):
        return self.next >= len(self.packets)


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic(seed):
    rng = random.Random(seed)
    resp, mem, contexts = big_world()
    # READ sources: random bytes nobody writes (writes go above 0x20000)
    mem[RREGION[0]:RREGION[0] + 0x9000] = bytes(rng.getrandbits(8) for _ in range(0x9000))
    peers = [_Peer(rng, q, contexts[q], resp, mem, 0x20000 + 0x28000 * i, LREGION[0] + 0x30000 * i,
                   RREGION[0] + 0x9000 + 8 * i) for i, q in enumerate(contexts)]
    for p in peers:
        for _ in range(120):
            p.add_message()
    write_count = {}
    stats = {}
    steps = 0
    while not all(p.done for p in peers):
        peer = rng.choice([p for p in peers if not p.done])
        d = peer.step(stats)
        for addr, data in d.writes:
            if addr in (pp.atomic_va for pp in peers):
                continue
            for a in range(addr, addr + len(data)):
                write_count[a] = write_count.get(a, 0) + 1
        steps += 1
        assert steps < 20000
    # every payload byte written exactly once: duplicates were never executed again
    assert set(write_count.values()) == {1}
    for p in peers:
        completions = resp.completions[contexts[p.qpn].rcqn]
        assert len(completions) == len(p.sends_expected)
        for i, (c, (kind, data, imm)) in enumerate(zip(completions, p.sends_expected)):
            opcode = {"write_imm": m.CqeOpcode.RESP_WR_IMM, "send": m.CqeOpcode.RESP_SEND,
                      "send_imm": m.CqeOpcode.RESP_SEND_IMM}[kind]
            assert (c.opcode, c.byte_count, c.imm, c.wqe_counter, c.qpn) == (
                opcode, len(data), imm, i, p.qpn)
            if kind != "write_imm":
                buf = p.recv_at + 1024 * i
                assert mem[buf:buf + len(data)] == data
        for kind, data, *va in p.messages:
            if kind.startswith("write"):
                assert mem[va[0]:va[0] + len(data)] == data
        assert int.from_bytes(mem[p.atomic_va:p.atomic_va + 8], "little") == p.atomic_total
        assert resp.responder_state(p.qpn).epsn == p.psn
    c = resp.counters
    check_partition(c)
    assert c["requests_executed"] - c["rnr_naks"] == sum(len(p.packets) for p in peers)
    assert c["access_naks"] == c["invalid_naks"] == c["op_naks"] == 0
    # the run exercised every rule it is meant to
    assert min(c["seq_naks"], c["seq_dropped"], c["duplicate_requests"], c["rnr_naks"],
               c["atomic_replays"], c["duplicates_dropped"]) > 0, c


def _fuzz_packet(rng, valid_pool, lid):
    r = rng.random()
    if r < 0.15:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(64)))
    raw = bytearray(rng.choice(valid_pool))
    if r < 0.55:
        return bytes(raw)
    for _ in range(rng.randrange(1, 4)):
        what = rng.random()
        if what < 0.5 and raw:
            raw[rng.randrange(min(len(raw), 64))] ^= 1 << rng.randrange(8)
        elif what < 0.7:
            del raw[rng.randrange(len(raw) + 1):]
        elif what < 0.8:
            raw += bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 9)))
        elif len(raw) >= 24:
            raw[8] = rng.randrange(0x16)                    # another opcode, same bytes
    if rng.random() < 0.5 and len(raw) >= 12:
        if rng.random() < 0.5 and len(raw) % 4 == 0:
            raw[2:4] = lid.to_bytes(2, "big")
            raw[4:6] = (len(raw) // 4).to_bytes(2, "big")
        raw[-4:] = icrc_bytes(bytes(raw[:-4]))
    return bytes(raw)


def test_fuzz():
    rng = random.Random(7)
    resp, mem, contexts = big_world(log_rq_size=2)
    mem[RREGION[0]:RREGION[0] + 0x1000] = bytes(rng.getrandbits(8) for _ in range(0x1000))
    granted = [RREGION, LREGION]

    def outside(buf):
        """Memory nothing may write (the receive queues above LREGION are the test's)."""
        return bytes(buf[:RREGION[0]]) + bytes(buf[RREGION[0] + RREGION[1]:LREGION[0]])

    def refill(q):
        ctx = contexts[q]
        for slot in range(4):
            good = rng.random() < 0.9
            wqe = m.recv_wqe(rng.choice([0, 8, 300, 4096]), LKEY if good else rng.getrandbits(32),
                             LREGION[0] + 0x1000 * rng.randrange(64) if good else rng.getrandbits(64))
            mem[ctx.rq_base + 16 * slot:ctx.rq_base + 16 * slot + 16] = wqe
        ci = resp.responder_state(q).rq_ci
        mem[ctx.rq_dbr:ctx.rq_dbr + 4] = m.rq_doorbell_record(ci + rng.randrange(4))

    def valid_packets(q):
        st = resp.responder_state(q)
        psn = (st.epsn + rng.choice([0, 0, 0, -1, -2, 1, 5])) % (1 << 24)
        if st.saved_atomics and rng.random() < 0.1:
            psn = rng.choice(st.saved_atomics)[0]
        va = rng.choice([RREGION[0] + 8 * rng.randrange(64), RREGION[0] - 8, rng.getrandbits(64) & ~7,
                         RREGION[0] + RREGION[1] - 8])
        rkey = rng.choice([RKEY, RKEY, LKEY, rng.getrandbits(32)])
        length = rng.choice([0, 1, 8, 256, 300, 700])
        common = dict(vl=0, sl=0, dlid=LID, slid=rng.choice([PEER_LID] * 9 + [3]), destqp=rng.choice(
            [q, q, q, q, 7, rng.getrandbits(24)]), psn=psn, pkey=rng.choice([0xFFFF] * 9 + [0x7FFF]),
            ackreq=rng.getrandbits(1))
        op = rng.choice(sorted(REQUEST_OPCODES))
        ext = []
        for cls in extension_headers(op):
            ext.append({RETH: RETH(va=va, rkey=rkey, dmalen=length),
                        AtomicETH: AtomicETH(va=va + rng.choice([0, 0, 4]), rkey=rkey,
                                             swap_add=rng.getrandbits(64), compare=rng.getrandbits(64)),
                        MaskedAtomicETH: MaskedAtomicETH(
                            va=va + rng.choice([0, 0, 2, 4]), rkey=rkey,
                            **{f: rng.getrandbits(64) for f in ("swap_add", "compare", "swap_mask",
                                                                "compare_mask")}),
                        ImmDt: ImmDt(imm=rng.getrandbits(32))}[cls])
        payload = b"" if not carries_payload(op) else bytes(rng.getrandbits(8) for _ in range(
            rng.choice([0, 1, 4, 256, 256, 300, length])))
        return n.make_packet(opcode=op, ext=ext, payload=payload, **common)

    before = outside(mem)
    for i in range(4000):
        q = rng.choice(list(contexts))
        if resp.qp_state(q) != n.QpState.RTS or rng.random() < 0.002:
            resp.reset_qp(q)
        refill(q)
        pool = [valid_packets(q) for _ in range(3)]
        d = resp.process(_fuzz_packet(rng, pool, LID), end_bad=rng.random() < 0.01)
        for addr, data in d.writes:
            assert any(b <= addr and addr + len(data) <= b + size for b, size in granted)
        for p in d.packets:
            assert parse_packet(p).icrc_ok
    assert outside(mem) == before
    c = resp.counters
    assert c["packets"] == 4000
    check_partition(c)
    # the fuzz reached every outcome
    for name in resp.HW_COUNTERS + ("responses_steered", "seq_dropped", "duplicates_dropped"):
        assert c[name] > 0, (name, c)


def test_peer_never_raises():
    rng = random.Random(3)
    resp = n.ResponderPeer(0x55, {1: n.ResponderQp(peer_qpn=0, mtu=1)}, memory=bytearray(4096))
    pool = [n.make_packet(vl=0, sl=0, dlid=0x55, slid=0x11, opcode=Opcode.RDMA_WRITE_ONLY, destqp=1,
                          psn=0, ext=[RETH(va=16, rkey=1, dmalen=8)], payload=bytes(8))]
    for _ in range(2000):
        resp.receive(_fuzz_packet(rng, pool, 0x55))
    assert resp.counters["dropped_malformed"] > 0


def test_range_wrapping_2_64():
    """A key whose range runs past 2^64: an access that wraps is refused even though
    its end is below the key's end; one that ends at 2^64 exactly is fine."""
    sparse = {}

    def read(addr, size):
        return bytes(sparse.get(addr + i, 0) for i in range(size))

    def write(addr, data):
        sparse.update((addr + i, b) for i, b in enumerate(data))

    top = 1 << 64
    key = n.Mkey(key=RKEY, base=top - 0x100, length=0x1000, access=ALL, pd=PD, valid=True)
    ctx = n.QpContext(qpn=QPN, dest_qpn=PEER_QPN, dlid=PEER_LID, sl=2, pkey=PKEY, pd=PD, mtu=1,
                      access=ALL, rq_psn=EPSN)
    resp = n.NicResponderModel(LID, read=read, write=write, contexts={QPN: ctx}, mkeys=[n.Mkey(), key])
    d = resp.process(write_only(EPSN, top - 8, b"12345678"))
    assert d.fate == "requests_executed" and read(top - 8, 8) == b"12345678"
    d = resp.process(write_only(EPSN + 1, top - 4, b"12345678"))
    assert d.fate == "access_naks" and d.writes == []


def test_icrc_of_any_bytes_matches_models_crc():
    """The receiver's ICRC (any length, GRH or not) is models.crc's where that applies."""
    from models import crc
    rng = random.Random(4)
    for _ in range(500):
        body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(60, 200)))
        assert icrc_bytes(body) == crc.icrc_bytes(body)
    pkt = write_only(EPSN, 0x1000, b"abc")
    assert icrc_bytes(pkt[:-4]) == pkt[-4:]
    for size in range(0, 24):           # short strings give a CRC, never an exception
        assert len(icrc_bytes(bytes(size))) == 4


def test_receive_queue_cache_and_bad_records():
    """The ReceiveQueue's rules: cached producer index, records too far ahead, low
    address bits, a 0-byte WQE still needs its lkey."""
    resp, mem = world(log_rq_size=2, rq_dbr=RQ_DBR + 3, rq_base=RQ_BASE + 15)
    c = resp.counters
    mem[RQ_DBR:RQ_DBR + 4] = m.rq_doorbell_record(5)          # 5 ahead of a ring of 4
    d = resp.process(req(Opcode.SEND_ONLY, EPSN, payload=b"a"))
    assert d.fate == "rnr_naks" and c["recv_wqe_errors"] == 1 and c["rq_doorbell_reads"] == 1
    for i in range(3):
        mem[RQ_BASE + 16 * i:RQ_BASE + 16 * i + 16] = m.recv_wqe(8, LKEY, RBUF[0] + 8 * i)
    mem[RQ_DBR:RQ_DBR + 4] = m.rq_doorbell_record(3)
    assert resp.process(req(Opcode.SEND_ONLY, EPSN, payload=b"a")).recv_taken == 0
    mem[RQ_DBR:RQ_DBR + 4] = m.rq_doorbell_record(0)          # ignored: 3 are cached
    assert resp.process(req(Opcode.SEND_ONLY, EPSN + 1, payload=b"b")).recv_taken == 1
    assert resp.process(req(Opcode.SEND_ONLY, EPSN + 2, payload=b"c")).recv_taken == 2
    assert c["rq_doorbell_reads"] == 2 and mem[RBUF[0]:RBUF[0] + 17:8] == b"abc"
    d = resp.process(req(Opcode.SEND_ONLY, EPSN + 3, payload=b"d"))   # record 0 is behind ci 3
    assert d.fate == "rnr_naks" and c["recv_wqe_errors"] == 2 and c["rq_doorbell_reads"] == 3
    assert c["recv_wqes_consumed"] == 3
    # a 0-byte WQE: any address, but its key must still be valid, of the PD, LOCAL_WRITE
    mem[RQ_BASE + 48:RQ_BASE + 64] = m.recv_wqe(0, LKEY ^ 1, 0)
    mem[RQ_DBR:RQ_DBR + 4] = m.rq_doorbell_record(4)
    d = resp.process(req(Opcode.SEND_ONLY, EPSN + 3))
    assert d.fate == "op_naks" and d.completions[0].wqe_counter == 3 and c["recv_wqe_errors"] == 3


@pytest.mark.parametrize("ctx_kw", [dict(sl=3), dict(mtu=0), dict(mtu=6)])
def test_qp_path_drops(ctx_kw):
    """A QP whose SL maps to a VL the port lacks, or with a path MTU code outside 1..5,
    drops its requests (as the engine does)."""
    resp, mem = world(**ctx_kw)
    resp.num_vls = 3                                 # world's sl_to_vl maps SL 3 to VL 3
    assert resp.process(write_only(EPSN, 0x1000, b"x")).fate == "rx_dropped_qp"
    assert bytes(mem) == bytes(MEM)


@pytest.mark.parametrize("opcode", sorted(MASKED_ATOMICS))
def test_masked_atomic_replay_never_reexecutes(opcode):
    """A duplicate of an executed masked atomic answers the saved original value and leaves
    memory as it is (executing it again would move the word: each request here changes it);
    a misaligned one or one past its key is NAKed; 4-byte ones touch only
    their 4 bytes and operate little-endian."""
    resp, mem = world()
    nbytes = atomic_operand_bytes(opcode)
    fa = opcode in (Opcode.MASKED_FETCH_ADD, Opcode.MASKED_FETCH_ADD_4)
    mem[0x2000:0x2010] = bytes(range(0xA0, 0xB0))
    word = int.from_bytes(mem[0x2000:0x2000 + nbytes], "little")

    def masked(psn, va=0x2000, rkey=RKEY):
        # FA: add 1 in one 4-bit field; CS: compare on nothing, swap the low byte to ~itself
        eth = MaskedAtomicETH(va=va, rkey=rkey, swap_add=1 if fa else 0xFF ^ (word & 0xFF),
                              swap_mask=0x0F if fa else 0xFF)
        return req(opcode, psn, ext=[eth])

    first = resp.process(masked(EPSN))
    orig = parse_packet(first.packets[0]).ext[1].orig
    after = bytes(mem[0x2000:0x2010])
    assert orig == word and after != bytes(range(0xA0, 0xB0))
    assert after[nbytes:] == bytes(range(0xA0 + nbytes, 0xB0))
    assert int.from_bytes(after[:nbytes], "little") == n.atomic_new_value(
        opcode, word, MaskedAtomicETH(swap_add=1 if fa else 0xFF ^ (word & 0xFF),
                                      swap_mask=0x0F if fa else 0xFF))
    for _ in range(3):
        d = resp.process(masked(EPSN))
        assert d.fate == "duplicate_requests" and d.writes == []
        assert parse_packet(d.packets[0]).ext[1].orig == orig
        assert bytes(mem[0x2000:0x2010]) == after
    assert resp.counters["atomic_replays"] == 3
    assert resp.responder_state(QPN).epsn == EPSN + 1
    d = resp.process(masked(EPSN + 1, va=0x2000 + nbytes // 2))       # misaligned
    assert d.fate == "invalid_naks" and resp.qp_state(QPN) == n.QpState.ERR
    resp.reset_qp(QPN)
    d = resp.process(masked(EPSN, va=REMOTE[0] + REMOTE[1]))                  # past the key
    assert d.fate == "access_naks" and bytes(mem[0x2000:0x2010]) == after
