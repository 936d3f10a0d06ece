"""Reference models of both ends of an RC connection, for the NIC testbenches (a package:
``common``, ``requester``, ``completion``, ``responder``; every public name is here).

* :class:`RequesterModel` is what the NIC's send side must do with each WQE
  (docs/nic.md: segment rules, executor checks, MTU segmentation, PSNs): it returns the
  request packets (LRH .. ICRC, byte-exact), the completion status and the CQE expected.
* :class:`CompletionModel` is the NIC's completion unit: it takes the requester's results
  in WQE order and the responses coming back, and gives the CQE writes (address, bytes,
  owner bit) in the order the NIC must make them, with NAK error and flush handling.
* :class:`ResponderPeer` is the remote RC responder the testbench puts on the wire: it
  checks ICRC, PSNs and opcode sequences, executes requests against its memory, and
  answers with (coalesced) ACKs, READ responses, ATOMIC ACKNOWLEDGEs and injected NAKs.
* :class:`NicResponderModel` is the exact reference of the NIC's own responder
  (docs/nic-responder.md): receiver checks, P_Key, PSN rules, rkeys, receive queue, NAK
  codes, QP errors, receive completions and the hardware's counters.

Packets are built with models.ib's header codecs; the ICRC is computed with zlib (the
same CRC-32 as models.crc.icrc, whose masks are applied here) so that the responder
keeps up with thousands of packets per second.
"""

from models.nic.common import (PSN_MOD, VL15, ICRC_SIZE, MAX_OUTSTANDING_BLOCKS, QpState, Access, CompletionStatus,
                               QpContext, CqContext, QpConfig, CqConfig, Mkey, mkey_index,
                               qp_context_ok, read_response_opcode, psn_add, psn_diff, psn_le,
                               psn_lt, make_packet, Packet, decode_packet, NakCode,
                               masked_fetch_add, atomic_new_value)
from models.nic.requester import (WqeResult, RequesterModel, gather_pieces)
from models.nic.completion import (NAK_CODE_SYNDROME, Completion, RNR_TIMER_US,
                                   RNR_RETRY_UNLIMITED, Rewind, CompletionModel, expected_cqes)
from models.nic.responder import (ResponderQp, ACK_SYNDROME, SAVED_ATOMICS, RecvCompletion,
                                  Decision, MAX_PAYLOAD_BYTES, NAK, RNR_NAK, ResponderPeer,
                                  NicResponderModel)

__all__ = [
    "PSN_MOD", "VL15", "ICRC_SIZE", "MAX_OUTSTANDING_BLOCKS", "QpState", "Access", "CompletionStatus", "QpContext",
    "CqContext", "QpConfig", "CqConfig", "Mkey", "mkey_index", "qp_context_ok",
    "read_response_opcode", "psn_add", "psn_diff", "psn_le", "psn_lt", "make_packet", "Packet",
    "decode_packet", "NakCode", "masked_fetch_add", "atomic_new_value", "WqeResult", "RequesterModel", "gather_pieces", "NAK_CODE_SYNDROME", "Completion",
    "RNR_TIMER_US", "RNR_RETRY_UNLIMITED", "Rewind", "CompletionModel", "expected_cqes",
    "ResponderQp", "ACK_SYNDROME", "SAVED_ATOMICS", "RecvCompletion", "Decision",
    "MAX_PAYLOAD_BYTES", "NAK", "RNR_NAK", "ResponderPeer", "NicResponderModel",
]
