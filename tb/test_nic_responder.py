"""The NIC's responder under Verilator, driven by hand-made request packets from the far end
of its cable (tb/responder_tb.py): valid operations, every hostile or malformed case on a
QP of its own while another QP streams, and a fuzz of thousands of random and mutated
packets. Each test ends with :meth:`tb.responder_tb.ResponderTB.check_responder`: every
response byte-equal to models.nic.NicResponderModel's and in order per QP, every receive CQE,
the NIC's whole memory outside its CQs equal to the model's, every counter equal.
"""
import os
import random

import cocotb
import pytest

from models import mlx5
from models.crc import icrc_bytes
from models.ib import RETH, AtomicETH, ImmDt, Opcode
from models.nic import Mkey
from tb import runner
from tb.nic_tb import NIC_LID, REMOTE_LID
from tb.responder_tb import ResponderTB

PD = 0x1234
LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC = 1, 2, 4, 8
WRITE_REGION = 0x800000         # remote writes, sends and atomics land here
WRITE_BYTES = 0x100000
READ_REGION = 0xA00000          # READ sources: nothing writes here
READ_BYTES = 0x100000
RECV_REGION = 0xC00000          # receive buffers
RECV_BYTES = 0x100000
RO_REGION = 0xE00000            # a region remote requesters may only read
KEYS = {
    "write": Mkey(key=mlx5.make_key(1, 0x11), base=WRITE_REGION, length=WRITE_BYTES, pd=PD,
                  access=LOCAL_WRITE | REMOTE_WRITE | REMOTE_ATOMIC, valid=1),
    "read": Mkey(key=mlx5.make_key(2, 0x22), base=READ_REGION, length=READ_BYTES, pd=PD,
                 access=REMOTE_READ, valid=1),
    "recv": Mkey(key=mlx5.make_key(3, 0x33), base=RECV_REGION, length=RECV_BYTES, pd=PD,
                 access=LOCAL_WRITE, valid=1),
    "readonly": Mkey(key=mlx5.make_key(4, 0x44), base=RO_REGION, length=0x10000, pd=PD,
                     access=REMOTE_READ, valid=1),
    "other_pd": Mkey(key=mlx5.make_key(5, 0x55), base=RO_REGION + 0x10000, length=0x10000,
                     pd=PD + 1, access=0xF, valid=1),
    "invalid": Mkey(key=mlx5.make_key(6, 0x66), base=RO_REGION + 0x20000, length=0x10000,
                    pd=PD, access=0xF, valid=0),
}


async def start(dut, seed, qps=8, mtu=3, access=0xE, access_of=None, memory_latency=100):
    tb = ResponderTB(dut, seed=seed, memory_latency=memory_latency)
    await tb.reset()
    await tb.setup_responder(qps, mkeys=list(KEYS.values()), mtu=mtu, access=access,
                             access_of=access_of)
    rng = random.Random(seed)
    for base, size in ((WRITE_REGION, WRITE_BYTES), (READ_REGION, READ_BYTES),
                       (RO_REGION, 0x30000)):
        tb.host_write(base, rng.randbytes(size))
    return tb, rng


def tb_qps(dut):
    return runner.tb_params().get("num_qps", 64)


# Opcodes of a SEND or WRITE message's packets: (ONLY, FIRST, MIDDLE, LAST), without and
# with an immediate.
_MESSAGE_OPCODES = {
    ("send", False): (Opcode.SEND_ONLY, Opcode.SEND_FIRST, Opcode.SEND_MIDDLE, Opcode.SEND_LAST),
    ("send", True): (Opcode.SEND_ONLY_WITH_IMMEDIATE, Opcode.SEND_FIRST, Opcode.SEND_MIDDLE,
                     Opcode.SEND_LAST_WITH_IMMEDIATE),
    ("write", False): (Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
                       Opcode.RDMA_WRITE_LAST),
    ("write", True): (Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, Opcode.RDMA_WRITE_FIRST,
                      Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE),
}


def message(tb, q, kind, data, imm=None, va=None):
    """The packets of one SEND or RDMA WRITE (``kind``), with an immediate if ``imm``, cut
    at the QP's path MTU; a WRITE's RETH names ``va`` and the write key."""
    mtu = 128 << tb.qps[q].mtu
    chunks = [data[i:i + mtu] for i in range(0, len(data), mtu)] or [b""]
    only, first_op, middle_op, last_op = _MESSAGE_OPCODES[(kind, imm is not None)]
    packets = []
    for i, chunk in enumerate(chunks):
        first, last = i == 0, i == len(chunks) - 1
        op = only if first and last else first_op if first else last_op if last else middle_op
        ext = [RETH(va=va, rkey=KEYS["write"].key, dmalen=len(data))] if first and kind == "write" else []
        ext += [ImmDt(imm=imm)] if last and imm is not None else []
        packets.append(tb.request(q, op, payload=chunk, ext=ext, ackreq=int(last)))
    return packets


def write_message(tb, q, va, data, imm=None):
    return message(tb, q, "write", data, imm, va)


def send_message(tb, q, data, imm=None):
    return message(tb, q, "send", data, imm)


def read_request(tb, q, va, length, key="read"):
    """An RDMA READ request; the requester's next PSN moves past its responses."""
    packet = tb.request(q, Opcode.RDMA_READ_REQUEST,
                        ext=[RETH(va=va, rkey=KEYS[key].key, dmalen=length)])
    mtu = 128 << tb.qps[q].mtu
    tb.next_psn[q] = (tb.next_psn[q] + max(1, -(-length // mtu)) - 1) % (1 << 24)
    return packet


def atomic(tb, q, va, add=None, swap=None, compare=0, key="write"):
    op = Opcode.FETCH_ADD if add is not None else Opcode.COMPARE_SWAP
    return tb.request(q, op, ext=[AtomicETH(va=va, rkey=KEYS[key].key,
                                            swap_add=add if add is not None else swap,
                                            compare=compare)])


def send_all(tb, packets):
    for packet in packets:
        tb.send(packet)


@cocotb.test()
async def valid_operations(dut):
    """Every operation, multi-packet messages interleaved over QPs, duplicates of each
    kind, a PSN gap, an RNR NAK and the retried SEND."""
    tb, rng = await start(dut, seed=1)
    w = WRITE_REGION
    for q in range(4):          # one for the WRITE_WITH_IMM, one for the SEND
        for n in range(2):
            tb.post_receive(q, 5000, KEYS["recv"].key, RECV_REGION + 0x4000 * q + 0x2000 * n)
    streams, read_psns = [], {}
    for q in range(4):
        packets = write_message(tb, q, w + 0x10000 * q + 3, rng.randbytes(3000))
        packets += write_message(tb, q, w + 0x10000 * q + 0x2000, rng.randbytes(700),
                                 imm=rng.getrandbits(32))
        packets += send_message(tb, q, rng.randbytes(2100), imm=q if q % 2 else None)
        read_psns[q] = tb.next_psn[q]
        packets.append(read_request(tb, q, READ_REGION + 0x1000 * q + 5, 2500))
        packets.append(atomic(tb, q, w + 0x10000 * q + 0x8000, add=rng.getrandbits(64)))
        packets.append(atomic(tb, q, w + 0x10000 * q + 0x8008, swap=7, compare=0))
        packets += write_message(tb, q, w + 0x10000 * q + 0x9000, rng.randbytes(64))
        streams.append(packets)
    while any(streams):          # interleave the QPs packet by packet
        for s in streams:
            if s:
                tb.send(s.pop(0))
    await tb.check_responder()
    # Duplicates: a WRITE (re-ACKed, not executed), the READ (executed again from its
    # PSN) and an atomic (answered from the saved result, not executed again).
    q = 0
    tb.send(tb.request(q, Opcode.RDMA_WRITE_ONLY, psn=(tb.next_psn[q] - 5) % (1 << 24),
                       payload=rng.randbytes(64),
                       ext=[RETH(va=w, rkey=KEYS["write"].key, dmalen=64)]))
    tb.send(tb.request(q, Opcode.RDMA_READ_REQUEST, psn=read_psns[q],
                       ext=[RETH(va=READ_REGION + 5, rkey=KEYS["read"].key, dmalen=2500)]))
    last_atomic = atomic(tb, q, w + 0x2000, add=5)
    tb.send(last_atomic)
    tb.send(last_atomic)
    # A PSN gap: one NAK sequence error, then silence until the expected PSN comes.
    ahead = tb.request(q, Opcode.RDMA_WRITE_ONLY, psn=(tb.next_psn[q] + 3) % (1 << 24),
                       payload=b"x" * 8, ext=[RETH(va=w, rkey=KEYS["write"].key, dmalen=8)])
    tb.send(ahead)
    tb.send(ahead)
    # RNR: a SEND on a QP with no receive WQE left, then the receive, then the retry.
    q = 5
    retry_psn = tb.next_psn[q]
    message = send_message(tb, q, rng.randbytes(100))
    send_all(tb, message)
    await tb.check_responder()
    assert tb.model.counters["rnr_naks"] == 1
    tb.post_receive(q, 200, KEYS["recv"].key, RECV_REGION + 0x40000)
    tb.next_psn[q] = retry_psn
    send_all(tb, send_message(tb, q, rng.randbytes(100)))
    await tb.check_responder()
    for name in ("duplicate_requests", "atomic_replays", "seq_naks"):
        assert tb.model.counters[name] >= 1, name


@cocotb.test()
async def hostile_requests(dut):
    """Each hostile or malformed request on a QP of its own while QP 0 streams good
    WRITEs: rejected as IBA says (NAK, QP to ERR, or silent drop), counted, and no byte of
    memory outside the good WRITEs' ranges changes."""
    no_write_qp = 1         # the first case's QP grants only remote reads
    tb, rng = await start(dut, seed=2, qps=tb_qps(dut) - 1, access_of={no_write_qp: REMOTE_READ})
    wk, w = KEYS["write"].key, WRITE_REGION

    def reth(va, length, key=wk):
        return [RETH(va=va, rkey=key, dmalen=length)]

    def slot(q):
        """Where QP ``q``'s case writes if it is (wrongly or rightly) executed: QPs are on
        different VLs, so only their own packets keep their order."""
        return w + 0x80000 + 0x2000 * q

    cases = {
        "QP without the remote-write right": lambda q: tb.request(
            q, Opcode.RDMA_WRITE_ONLY, payload=b"a" * 16, ext=reth(slot(q), 16)),
        "unknown key": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"a" * 16,
                                            ext=reth(slot(q), 16, key=wk ^ 0x01)),
        "range past the region": lambda q: tb.request(
            q, Opcode.RDMA_WRITE_ONLY, payload=b"b" * 32, ext=reth(w + WRITE_BYTES - 16, 32)),
        "range before the region": lambda q: tb.request(
            q, Opcode.RDMA_WRITE_ONLY, payload=b"b" * 32, ext=reth(w - 8, 32)),
        "range wrapping 2^64": lambda q: tb.request(
            q, Opcode.RDMA_WRITE_ONLY, payload=b"c" * 64, ext=reth((1 << 64) - 16, 64)),
        "write to a read-only region": lambda q: tb.request(
            q, Opcode.RDMA_WRITE_ONLY, payload=b"d" * 8,
            ext=reth(RO_REGION, 8, key=KEYS["readonly"].key)),
        "read without the right": lambda q: read_request(tb, q, w, 64, key="write"),
        "atomic without the right": lambda q: atomic(tb, q, RO_REGION, add=1, key="readonly"),
        "other PD": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"e" * 8,
                                         ext=reth(RO_REGION + 0x10000, 8,
                                                  key=KEYS["other_pd"].key)),
        "invalid key entry": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"f" * 8,
                                                  ext=reth(RO_REGION + 0x20000, 8,
                                                           key=KEYS["invalid"].key)),
        "wrong P_Key": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"g" * 8,
                                            ext=reth(slot(q), 8), pkey=0x7FFF ^ 0x1234),
        "limited-member P_Key (the QP is a full member)": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY,
                                                        payload=b"g" * 8, ext=reth(slot(q), 8),
                                                        pkey=0x7FFF),
        "QP that does not exist": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY,
                                                       payload=b"h" * 8, ext=reth(slot(q), 8),
                                                       destqp=tb.num_qps + 3),
        "QP not ready (RESET)": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY,
                                                     payload=b"i" * 8, ext=reth(slot(q), 8),
                                                     destqp=tb.num_qps - 1),
        "from another LID": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"j" * 8,
                                                 ext=reth(slot(q), 8), slid=REMOTE_LID + 1),
        "to another LID": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"j" * 8,
                                               ext=reth(slot(q), 8), dlid=NIC_LID + 1),
        "bad ICRC": lambda q: corrupt_icrc(tb.request(q, Opcode.RDMA_WRITE_ONLY,
                                                      payload=b"k" * 8, ext=reth(slot(q), 8))),
        "opcode out of sequence": lambda q: tb.request(q, Opcode.RDMA_WRITE_MIDDLE,
                                                       payload=b"l" * 1024),
        "SEND inside a WRITE": lambda q: [tb.request(q, Opcode.RDMA_WRITE_FIRST,
                                                     payload=b"m" * 1024, ext=reth(slot(q), 4096)),
                                          tb.request(q, Opcode.SEND_LAST, payload=b"m" * 8)],
        "FIRST shorter than the MTU": lambda q: tb.request(q, Opcode.RDMA_WRITE_FIRST,
                                                           payload=b"n" * 1000,
                                                           ext=reth(slot(q), 4096)),
        "payload beyond the RETH length": lambda q: tb.request(q, Opcode.RDMA_WRITE_ONLY,
                                                               payload=b"o" * 64,
                                                               ext=reth(slot(q), 32)),
        "misaligned atomic": lambda q: atomic(tb, q, w + 4, add=1),
        "SEND longer than the receive buffer": lambda q: send_message(tb, q, b"q" * 900),
        "receive WQE without LOCAL_WRITE": lambda q: send_message(tb, q, b"r" * 100),
        "receive WQE of another PD": lambda q: send_message(tb, q, b"s" * 100),
        "receive WQE beyond its key": lambda q: send_message(tb, q, b"t" * 100),
    }
    bad_receives = {
        "SEND longer than the receive buffer": (512, KEYS["recv"].key, RECV_REGION),
        "receive WQE without LOCAL_WRITE": (512, KEYS["readonly"].key, RO_REGION),
        "receive WQE of another PD": (512, KEYS["other_pd"].key, RO_REGION + 0x10000),
        "receive WQE beyond its key": (512, KEYS["recv"].key, RECV_REGION + RECV_BYTES - 256),
    }
    # QP 0 streams good WRITEs, QP 1 has the first case, the others take the rest in
    # batches, reset between batches; the last QP stays in RESET.
    assert next(iter(cases)).startswith("QP without")
    spare = list(range(no_write_qp + 1, tb.num_qps - 1))
    plan = [(no_write_qp, *next(iter(cases.items())))]
    plan += [(spare[i % len(spare)], name, make)
             for i, (name, make) in enumerate(list(cases.items())[1:])]
    good = 0
    for n, (q, name, make) in enumerate(plan):
        if n > 1 and q == spare[0]:
            await tb.check_responder()
            await tb.reset_qps(spare)
        if name in bad_receives:
            tb.post_receive(q, *bad_receives[name])
        made = make(q)
        for packet in made if isinstance(made, list) else [made]:
            tb.send(packet)
        send_all(tb, write_message(tb, 0, w + 0x1000 * good, rng.randbytes(100)))
        good += 1
        # A later good request on the same QP: dropped if the case errored the QP.
        tb.send(tb.request(q, Opcode.RDMA_WRITE_ONLY, payload=b"z" * 8,
                           ext=reth(slot(q) + 0x1000, 8)))
    # A packet marked end-bad upstream: the NIC's link port drops it. One a word longer
    # than its LRH.PktLen: the sending port cuts it there, and the cut packet's last four
    # bytes are no ICRC.
    tb.send(tb.request(0, Opcode.RDMA_WRITE_ONLY, payload=b"x" * 8, ext=reth(w, 8)),
            end_bad=True)
    overlong = bad_pktlen(tb.request(0, Opcode.RDMA_WRITE_ONLY, payload=b"p" * 64,
                                     ext=reth(w, 64)))
    tb.send(overlong, arrives_as=overlong[:-4])
    await tb.check_responder()
    counters = tb.model.counters
    for name in ("access_naks", "invalid_naks", "op_naks", "rx_dropped_qp", "rx_dropped_pkey",
                 "rx_request_icrc_drops", "rx_request_malformed"):
        assert counters[name] >= 1, name


def corrupt_icrc(packet):
    return packet[:-1] + bytes([packet[-1] ^ 0x5A])


def bad_pktlen(packet):
    """The same packet with LRH.PktLen one word short (ICRC recomputed, so only the length
    check can catch it)."""
    body = bytearray(packet[:-4])
    pktlen = (body[4] & 0x07) << 8 | body[5]
    body[4] = (body[4] & 0xF8) | ((pktlen - 1) >> 8)
    body[5] = (pktlen - 1) & 0xFF
    return bytes(body) + icrc_bytes(bytes(body))


@cocotb.test()
async def fuzz(dut):
    """Thousands of random and mutated request packets (half with a recomputed ICRC so
    they reach the deeper checks), in rounds; QPs the fuzz put in ERR are reset between
    rounds. No hang, nothing written outside what the model allows, counters add up."""
    tb, rng = await start(dut, seed=3, qps=8, mtu=1, memory_latency=40)
    rounds = int(os.environ.get("FUZZ_ROUNDS", "8"))
    per_round = 400
    for round_ in range(rounds):
        for q in range(8):
            tb.post_receive(q, 300, KEYS["recv"].key, RECV_REGION + 0x1000 * q)
        for _ in range(per_round):
            tb.send(fuzz_packet(tb, rng))
        await tb.check_responder()
        await tb.reset_qps([q for q in range(8) if tb.model.qp_state(q) != 3])
    total = sum(tb.model.counters[n] for n in ("rx_request_icrc_drops", "rx_request_malformed",
                                                "requests_received", "responses_steered"))
    assert total == rounds * per_round
    # Still alive: a good WRITE on every QP lands.
    for q in range(8):
        send_all(tb, write_message(tb, q, WRITE_REGION + 0x100 * q, rng.randbytes(40)))
    await tb.check_responder()


def fuzz_packet(tb, rng):
    """A valid request of a random kind, then maybe mutated."""
    q = rng.randrange(8)
    w = WRITE_REGION + rng.randrange(0, WRITE_BYTES - 512)
    kind = rng.randrange(6)          # 5: any opcode byte, any payload
    psn = (tb.next_psn[q] + rng.choice([0, 0, 0, 0, -1, -2, 1, 5])) % (1 << 24)
    if kind == 0:
        packet = tb.request(q, rng.choice([Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_FIRST]),
                            psn=psn, payload=rng.randbytes(rng.choice([8, 256, 100])),
                            ext=[RETH(va=w, rkey=KEYS["write"].key, dmalen=rng.choice([8, 256, 512]))])
    elif kind == 1:
        packet = tb.request(q, rng.choice([Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST,
                                           Opcode.SEND_MIDDLE, Opcode.SEND_LAST]),
                            psn=psn, payload=rng.randbytes(rng.choice([256, 40])))
    elif kind == 2:
        packet = tb.request(q, rng.choice([Opcode.SEND_ONLY, Opcode.SEND_FIRST,
                                           Opcode.SEND_ONLY_WITH_IMMEDIATE]),
                            psn=psn, payload=rng.randbytes(rng.choice([256, 40])),
                            ext=[])
    elif kind == 3:
        packet = tb.request(q, Opcode.RDMA_READ_REQUEST, psn=psn,
                            ext=[RETH(va=READ_REGION + rng.randrange(0, READ_BYTES - 2048),
                                      rkey=KEYS["read"].key, dmalen=rng.randrange(0, 1200))])
    elif kind == 4:
        packet = tb.request(q, rng.choice([Opcode.FETCH_ADD, Opcode.COMPARE_SWAP]), psn=psn,
                            ext=[AtomicETH(va=w & ~7, rkey=KEYS["write"].key,
                                           swap_add=rng.getrandbits(64),
                                           compare=rng.getrandbits(64))])
    else:
        packet = tb.request(q, rng.randrange(256), psn=psn, payload=rng.randbytes(rng.randrange(0, 200)))
    if psn == tb.next_psn[q] and kind in (0, 1, 2, 4):
        tb.next_psn[q] = (psn + 1) % (1 << 24)
    if rng.random() < 0.4:
        body = bytearray(packet[:-4])
        for _ in range(rng.randrange(1, 4)):
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        # Cut to a random length of at least 24 bytes (a packet of no more has nothing to cut).
        if rng.random() < 0.2 and len(body) > 24:
            del body[rng.randrange(24, len(body) + 1) & ~3:]
        # The link port checks LRH.VL and LRH.PktLen before anything else sees the
        # packet (tested with the link): keep those two consistent, so every mutation
        # reaches the NIC's own receiver.
        body[0] = (packet[0] & 0xF0) | (body[0] & 0x0F)
        pktlen = (len(body) + 4) // 4
        body[4] = (body[4] & 0xF8) | (pktlen >> 8)
        body[5] = pktlen & 0xFF
        # A good ICRC half the time, so that the mutation reaches the checks behind it.
        tail = icrc_bytes(bytes(body)) if rng.random() < 0.5 else rng.randbytes(4)
        packet = bytes(body) + tail
    return packet


def run_responder_tests(**env):
    from tb.nic_top import BUILD_ARGS, NIC, nic_top
    runner.run(module="tb.test_nic_responder", toplevel="nic_top", factory=nic_top, params=NIC,
               build_args=BUILD_ARGS, extra_env=env)


def test_nic_responder():
    """On the requester tests' build (tb/test_nic.py): 3,200 fuzz packets."""
    run_responder_tests()


@pytest.mark.full
def test_nic_responder_long_fuzz():
    """``make test-full``: 20,000 fuzz packets."""
    run_responder_tests(FUZZ_ROUNDS="50")
