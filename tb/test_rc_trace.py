"""tb/rc_trace.py: recovery events from hand-made packet sequences (pure Python).

A requester A sends 2-packet WRITEs on QP 1, B answers each message's last packet with an
ACK. The cases: a lost last request exposed by the next message (sequence NAK taken, NAK
resend); a lost first request whose NAK comes back before the message's last packet went
out (taken: its PSN was sent; a NAK resend), and a NAK past the highest PSN sent (dropped:
past ``wire_psn``; a timeout resend); a lost last request with nothing after
it (timeout, timer from the last progress or the last packet sent); a lost NAK; a restart soon after progress
(skip), after which a NAK still counts; the counter lines; and the decoding of real packet
bytes.
"""
from models.ib import AETH, BTH, Opcode
from models.packet import build_packet, wire_packet
from tb import rc_trace
from tb.rc_trace import Packet

QP = 1
FIRST, LAST, ACK = Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_LAST, Opcode.ACKNOWLEDGE
SEQ_NAK = 0x60
TIMEOUT = 1000


def request(cycle, opcode, psn, lost=False):
    return Packet(cycle, "a", QP, opcode, psn, opcode == LAST, None, lost)


def answer(cycle, psn, syndrome=0, lost=False):
    return Packet(cycle, "b", QP, ACK, psn, False, syndrome, lost)


def kinds(events):
    return [(e.kind, e.cycle, e.psn, e.cause) for e in events]


def run(a, b):
    return rc_trace.trace({"a": a, "b": b}, wire_delay=8, timeout_cycles=TIMEOUT)


def test_nak_after_the_record_is_taken():
    events = run([request(0, FIRST, 10), request(10, LAST, 11, lost=True), request(20, FIRST, 12),
                  request(30, LAST, 13), request(100, FIRST, 10), request(110, LAST, 11)],
                 [answer(25, 11, SEQ_NAK), answer(115, 11)])
    assert kinds(events) == [("fault", 10, 11, ""), ("nak", 25, 11, "taken"),
                             ("resend", 100, 10, "NAK")]
    assert "next request past it on QP 1 at 20" in events[0].detail
    assert "from message 0 of QP 1 (first sent at 0)" in events[2].detail
    assert rc_trace.summary(events) == {"faults": 1, "naks taken": 1, "resends NAK": 1}


def test_nak_for_a_message_in_flight_is_taken():
    # The record comes with the message's first packet: a NAK for it counts while its last
    # packet has not gone out yet.
    events = run([request(0, FIRST, 10), request(10, LAST, 11), request(20, FIRST, 12, lost=True),
                  request(40, LAST, 13), request(100, FIRST, 12), request(110, LAST, 13)],
                 [answer(15, 11), answer(25, 12, SEQ_NAK), answer(115, 13)])
    assert kinds(events) == [("fault", 20, 12, ""), ("nak", 25, 12, "taken"),
                             ("resend", 100, 12, "NAK")]


def test_nak_past_the_wire_is_dropped_and_the_timer_resends():
    events = run([request(0, FIRST, 10), request(10, LAST, 11), request(20, FIRST, 12, lost=True),
                  request(2000, FIRST, 12), request(2010, LAST, 13)],
                 [answer(15, 11), answer(25, 13, SEQ_NAK), answer(2015, 13)])
    assert kinds(events) == [("fault", 20, 12, ""), ("nak", 25, 13, "dropped: past wire_psn 0x00000c"),
                             ("resend", 2000, 12, "timeout")]
    assert events[2].timer_since == 23      # the ACK of PSN 11: the last progress


def test_lost_last_packet_waits_for_the_timer():
    events = run([request(0, FIRST, 10), request(10, LAST, 11), request(20, FIRST, 12),
                  request(30, LAST, 13, lost=True), request(5000, FIRST, 12),
                  request(5010, LAST, 13)],
                 [answer(15, 11), answer(5015, 13)])
    assert kinds(events) == [("fault", 30, 13, ""), ("resend", 5000, 12, "timeout")]
    assert "no request past it on QP 1" in events[0].detail


def test_lost_nak_then_a_skip():
    events = run([request(0, FIRST, 10), request(10, LAST, 11), request(20, FIRST, 12, lost=True),
                  request(30, LAST, 13), request(100, FIRST, 14), request(5000, FIRST, 12),
                  request(5010, LAST, 13), request(5020, FIRST, 14), request(5100, FIRST, 14),
                  request(5110, LAST, 15)],
                 [answer(15, 11), answer(35, 12, SEQ_NAK, lost=True), answer(5015, 13)])
    assert kinds(events) == [("fault", 20, 12, ""), ("fault", 35, 12, ""), ("nak", 35, 12, "lost"),
                             ("resend", 5000, 12, "timeout"), ("resend", 5100, 14, "skip")]
    assert events[4].timer_since == 5023
    table = rc_trace.table(events + rc_trace.counter_events([(5090, "a", "wqes_squashed", 3)]))
    assert "| 5,000 | resend | a | 1 | 0x00000c | timeout | 100 (4,900) |" in table
    assert "| 5,090 | counter | a |  |  |  |  | wqes_squashed = 3 |" in table


def test_a_nak_after_a_skip_is_taken():
    # A skip is no rewind of the completion unit: no gap_seen, the NAK of a later loss counts.
    events = run([request(0, FIRST, 10), request(10, LAST, 11), request(20, FIRST, 12),
                  request(30, FIRST, 12), request(40, LAST, 13), request(50, FIRST, 14),
                  request(60, LAST, 15, lost=True), request(70, FIRST, 16),
                  request(200, FIRST, 14), request(210, LAST, 15)],
                 [answer(15, 11), answer(75, 15, SEQ_NAK)])
    assert kinds(events) == [("resend", 30, 12, "skip"), ("fault", 60, 15, ""),
                             ("nak", 75, 15, "taken"), ("resend", 200, 14, "NAK")]


def test_decode_reads_the_headers_of_wire_bytes():
    ack = wire_packet(build_packet(bth=BTH(opcode=ACK, destqp=7, psn=0x123456),
                                   ext=(AETH(syndrome=SEQ_NAK, msn=3),), sl=1))
    packet = rc_trace.decode((ack, False, 42), "b", lost=True, start=40)
    assert packet == Packet(2, "b", 7, ACK, 0x123456, False, SEQ_NAK, True)
    assert packet.nak == 0 and not packet.is_request
    assert packet.describe() == "ACKNOWLEDGE PSN 0x123456 NAK PSN_SEQUENCE_ERROR"
