"""The responder's reference models: the mlx5 receive formats (models/mlx5.py) and
models.nic.ResponderModel in its hardware mode (docs/nic-responder.md), pure Python."""

from models import mlx5 as m

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
    from hdl.nic import signatures as sig
    for e in sig.RecvCqeOpcode:
        assert m.CqeOpcode[e.name] == e.value
