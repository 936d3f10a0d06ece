"""Interfaces between the NIC's blocks, in one place (docs/nic.md draws them).

Every record that travels between two NIC blocks is a ``lib.data`` struct here, with
fixed-width fields (a QP number is always 8 bits, a CQ number 8 bits), so that blocks
built with different ``num_qps`` still agree on layouts. The Python-side mirrors of the
host-visible formats (WQE segments, CQEs, doorbells) live in :mod:`models.mlx5`.

The flows between them (docs/nic.md, docs/nic-responder.md):

- requester: NicRegisters (doorbell) -> DoorbellScheduler -> WqeFetcher (AR id 0) -> WqeExecutor
  (AR id 1) -> PacketAssembler -> PacketMux[vl] -> LinkPort; WqeExecutor -> completion
  records -> CompletionUnit -> retire -> DoorbellScheduler, rewind -> DoorbellScheduler and
  WqeExecutor;
- responses: LinkPort -> RequestReceiver -> ResponseWriter (stores READ data and atomic
  results, AW id 2) -> CompletionUnit (verdict and discard back to the ResponseWriter,
  landed forward) -> CQEs (AW id 0);
- responder: RequestReceiver -> ResponderEngine -> DmaWriter (AW id 1), ReceiveQueue (AR id 3),
  AtomicUnit (AR/AW id 4), ResponseGenerator (AR id 2) -> PacketAssembler -> PacketMux[vl] ->
  LinkPort; receive completions -> CompletionUnit.
"""
from amaranth.lib import data, enum, wiring
from amaranth.lib.wiring import In, Out

__all__ = [
    "QpState", "QpConfigLayout", "CqConfigLayout", "MkeyLayout", "ContextReadSignature",
    "EventSignature", "DoorbellLayout", "FetchRequestLayout", "FetchDoneLayout",
    "RetireLayout", "WqeDescriptorLayout", "PayloadSource", "PacketDescriptorLayout",
    "CompletionStatus", "CompletionRecordLayout", "ArLayout", "RBeatLayout", "AxiReadSignature", "AxiWriteSignature",
    "MlxOpcode", "Syndrome", "Access",
    "RequestDescriptorLayout", "DmaWriteLayout", "ResponseKind", "ResponseCommandLayout",
    "RecvStatus", "RecvRequestLayout", "RecvResultLayout", "AtomicRequestLayout",
    "AtomicResultLayout", "RecvCqeOpcode", "ReceiveCompletionLayout",
    "RewindLayout", "PacketSentLayout", "ResponseVerdictLayout", "READ_DATA_ID", "EPOCH_BITS",
    "RESPONSE_SEQ_BITS",
    "RESPONSE_ID", "RECV_ID", "ATOMIC_ID", "CQE_ID", "DMA_WRITE_ID", "RX_BUFFER_BEAT_BITS",
    "MAX_PACKET_BEATS",
    "QPN_BITS", "CQN_BITS", "PSN_BITS", "WQEBB_BYTES", "MAX_WQE_BLOCKS", "MAX_INLINE_BYTES",
    "DESCRIPTOR_INLINE_BYTES",
    "MAX_NIC_HEADER_BYTES", "EXT_AMO_OPMOD_4", "EXT_AMO_OPMOD_8", "MAX_OUTSTANDING_BLOCKS",
    "RECORD_QUEUE_DEPTH",
    "MAX_MESSAGE_BYTES", "MAX_GATHER_SEGMENTS", "DataSegmentLayout", "GatherPieceLayout",
    "FETCH_ID", "PAYLOAD_ID", "AXI_ID_BITS", "COUNTERS",
]

QPN_BITS = 8                 # QP index inside the NIC (at most 256 QPs)
CQN_BITS = 8                 # CQ index (at most 256 CQs)
PSN_BITS = 24
WQEBB_BYTES = 64             # mlx5 WQE basic block
MAX_WQE_BLOCKS = 16          # ds is 6 bits of 16-byte units: at most 63 * 16 B = 16 blocks
MAX_INLINE_BYTES = 256       # inline data a WQE may carry (larger: LOCAL_LENGTH error CQE)
# Inline bytes a descriptor carries; the executor reads longer inline data back from the
# send queue (docs/nic.md, "Execution").
DESCRIPTOR_INLINE_BYTES = 64
EXT_AMO_OPMOD_4, EXT_AMO_OPMOD_8 = 0x08, 0x09   # NVSHMEM's IBGDA_4/8_BYTE_EXT_AMO_OPMOD >> 24
MAX_NIC_HEADER_BYTES = 64    # LRH + BTH + MaskedAtomicETH: the longest header the NIC sends or takes (no GRH)
RECORD_QUEUE_DEPTH = 64      # completion records kept per QP (CompletionUnit)
# Per-QP window of fetched, not yet retired WQE basic blocks. The record queue refuses a
# record at RECORD_QUEUE_DEPTH - 1 records (a registered flag), so a window one smaller
# than the queue never brings a record it refuses (docs/nic.md, "Completions").
MAX_OUTSTANDING_BLOCKS = RECORD_QUEUE_DEPTH - 1
MAX_MESSAGE_BYTES = 1 << 31  # IBA maximum message size
MAX_GATHER_SEGMENTS = 4      # data segments of a WRITE or SEND (a gather list, docs/nic.md)

AXI_ID_BITS = 3
FETCH_ID = 0                 # AR/R of WQE fetches
PAYLOAD_ID = 1               # AR/R of payload reads
RESPONSE_ID = 2              # AR/R of RDMA READ response payload (ResponseGenerator)
RECV_ID = 3                  # AR/R of receive WQEs and the receive doorbell record (ReceiveQueue)
ATOMIC_ID = 4                # AR/R and AW/W/B of the atomic unit's read-modify-write
CQE_ID = 0                   # AW/W/B of CQE writes (CompletionUnit)
DMA_WRITE_ID = 1             # AW/W/B of RDMA WRITE / SEND payload (DmaWriter)
READ_DATA_ID = 2             # AW/W/B of READ response data and atomic results (ResponseWriter)
EPOCH_BITS = 4               # per-QP rewind count carried by fetches and WQE descriptors
RESPONSE_SEQ_BITS = 16       # sequence number of a response packet the ResponseWriter stores

RX_BUFFER_BEAT_BITS = 12     # beat index into the responder's receive packet buffer
MAX_PACKET_BEATS = 66        # LRH .. ICRC of a 4096-byte payload with every header, 64-byte beats


# Every NIC counter (32 bits, wrapping), by the block that counts it. Each block has an
# ``Out(32)`` member of that name; the top joins them to the register block in this order.
COUNTERS = {
    "DoorbellScheduler": (
        ("doorbells_accepted", "doorbells that moved a QP's producer index forward"),
        ("doorbells_duplicate", "doorbells repeating the QP's newest index (they collapse)"),
        ("doorbells_bad_qpn", "doorbells for a QP number the NIC does not have"),
        ("doorbells_not_ready", "doorbells for a QP in RESET"),
        ("doorbells_backwards", "doorbells whose index is behind the newest one"),
        ("doorbells_too_far", "doorbells more than the send queue's size ahead of completions"),
        ("wqe_fetches", "fetch requests issued"),
    ),
    "WqeFetcher": (
        ("wqe_blocks_fetched", "WQE basic blocks read from memory"),
        ("wqes_parsed", "WQE descriptors produced"),
        ("wqe_blocks_refetched", "blocks dropped because their WQE was cut by the fetch's end"),
        ("fetch_read_errors", "WQE blocks read with RRESP not OKAY"),
    ),
    "WqeExecutor": (
        ("wqes_executed", "WQEs turned into packets"),
        ("packets_sent", "request packets handed to the assembler"),
        ("payload_bytes_sent", "payload bytes of those packets"),
        ("wqe_errors", "WQEs completed with a local error"),
        ("wqes_flushed", "WQEs completed with a flush error by the executor"),
        ("wqes_squashed", "WQEs dropped because their QP rewound after they were fetched"),
        ("packets_resent", "request packets sent again after a rewind (go-back-N)"),
    ),
    "PacketAssembler": (
        ("payload_read_errors", "payload beats read with RRESP not OKAY (packet sent end-bad)"),
        ("bad_descriptors", "packet descriptors dropped as malformed (their DMA beats discarded)"),
    ),
    "CompletionUnit": (
        ("acks_received", "ACK packets processed"),
        ("naks_received", "NAK packets processed"),
        ("read_responses", "RDMA READ response packets processed"),
        ("atomic_acks", "ATOMIC ACKNOWLEDGE packets processed"),
        ("cqes_written", "CQEs written, errors included"),
        ("error_cqes", "error and flush CQEs written"),
        ("rx_dropped_icrc", "received packets dropped for a bad ICRC"),
        ("rx_dropped_unexpected", "received packets dropped: not a response, unknown or idle QP, "
                                  "or a PSN no outstanding WQE waits for"),
        ("cqe_write_errors", "CQE writes answered with BRESP not OKAY"),
        ("recv_cqes", "receive CQEs written, errors included (also in cqes_written)"),
        ("retransmits_nak", "go-back-N rewinds after a NAK sequence error or a gap in the "
                            "responses"),
        ("retransmits_timeout", "go-back-N rewinds after the local ACK timeout"),
        ("retransmits_rnr", "rewinds after an RNR NAK's wait"),
        ("retries_exhausted", "WQEs completed with TRANSPORT_RETRY_EXC_ERR or "
                              "RNR_RETRY_EXC_ERR"),
    ),
    "ResponseWriter": (
        ("response_bytes_written", "READ response and atomic result bytes written to memory"),
        ("response_write_errors", "those writes answered with BRESP not OKAY"),
        ("responses_discarded", "stored response packets the completion unit did not take"),
    ),
    "RequestReceiver": (
        ("requests_received", "request packets kept for the responder"),
        ("rx_request_icrc_drops", "request packets dropped for a bad ICRC or marked end-bad"),
        ("rx_request_malformed", "request packets dropped as malformed (headers, lengths, "
                                 "DLID, opcode)"),
    ),
    "ResponderEngine": (
        ("requests_executed", "request packets at the expected PSN (those then NAKed or RNR "
                              "NAKed included: they count in their NAK counter too)"),
        ("duplicate_requests", "duplicate request packets (PSN behind the expected one)"),
        ("seq_naks", "NAK PSN sequence error sent"),
        ("rnr_naks", "RNR NAKs sent (no receive WQE posted)"),
        ("access_naks", "NAK remote access error sent (rights, keys, ranges)"),
        ("invalid_naks", "NAK invalid request sent (opcode sequence, lengths, alignment)"),
        ("op_naks", "NAK remote operational error sent (bad receive WQE, memory error)"),
        ("rx_dropped_qp", "requests dropped: no such QP, QP not ready, or not from its path"),
        ("rx_dropped_pkey", "requests dropped for a P_Key mismatch"),
        ("atomic_replays", "duplicate atomics answered from the saved result"),
    ),
    "DmaWriter": (
        ("dma_bytes_written", "payload bytes written to memory"),
        ("dma_write_errors", "payload writes answered with BRESP not OKAY"),
    ),
    "ReceiveQueue": (
        ("recv_wqes_consumed", "receive WQEs taken (good or bad)"),
        ("recv_wqe_errors", "receive requests answered ERROR (bad WQE, read error, unknown "
                            "QP) and doorbell records more than the queue's size ahead"),
        ("rq_doorbell_reads", "receive doorbell records read"),
    ),
    "AtomicUnit": (
        ("atomics_executed", "atomic read-modify-writes, failed ones included"),
        ("atomic_memory_errors", "atomics whose read or write was answered with an error"),
    ),
    "ResponseGenerator": (
        ("acks_sent", "ACK packets sent"),
        ("naks_sent", "NAK and RNR NAK packets sent"),
        ("read_response_packets", "RDMA READ response packets sent"),
        ("atomic_responses", "ATOMIC ACKNOWLEDGE packets sent"),
        ("bad_commands", "response commands dropped: unknown kind, VL out of range, READ MTU "
                         "code outside 1..5"),
    ),
}


class QpState(enum.Enum, shape=3):
    """IBA QP states, numbered as ``enum ibv_qp_state``; only these three are used."""
    RESET = 0
    RTS = 3
    ERR = 6


class MlxOpcode(enum.Enum, shape=8):
    """mlx5 send opcodes (``MLX5_OPCODE_*``), the low byte of a control segment's
    ``opmod_idx_opcode``."""
    NOP = 0x00                   # completes in order, sends nothing (NVSHMEM's CQ-update carrier)
    RDMA_WRITE = 0x08
    RDMA_WRITE_IMM = 0x09
    SEND = 0x0A
    SEND_IMM = 0x0B
    RDMA_READ = 0x10
    ATOMIC_CS = 0x11
    ATOMIC_FA = 0x12
    ATOMIC_MASKED_CS = 0x14      # opmod EXT_AMO_OPMOD_4 / _8: the operand size
    ATOMIC_MASKED_FA = 0x15
    DUMP = 0x23                  # NVSHMEM's IBGDA_MLX5_OPCODE_DUMP: a NOP with a data segment


class Syndrome(enum.Enum, shape=8):
    """mlx5 error-CQE syndromes (``MLX5_CQE_SYNDROME_*``)."""
    LOCAL_LENGTH_ERR = 0x01
    LOCAL_QP_OP_ERR = 0x02
    LOCAL_PROT_ERR = 0x04
    WR_FLUSH_ERR = 0x05
    BAD_RESP_ERR = 0x10
    LOCAL_ACCESS_ERR = 0x11
    REMOTE_INVAL_REQ_ERR = 0x12
    REMOTE_ACCESS_ERR = 0x13
    REMOTE_OP_ERR = 0x14
    TRANSPORT_RETRY_EXC_ERR = 0x15
    RNR_RETRY_EXC_ERR = 0x16


class Access(enum.Flag, shape=4):
    """Memory-key access rights (the low bits of ``enum ibv_access_flags``)."""
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


class QpConfigLayout(data.StructLayout):
    """A QP's context as the host programs it (docs/nic-registers.md)."""
    def __init__(self):
        super().__init__({
            "sq_base": 64,           # byte address of WQE basic block 0
            "log_sq_size": 4,        # the send queue holds 2**log_sq_size basic blocks
            "mtu": 3,                # IBA path MTU code: 1 = 256 B .. 5 = 4096 B
            "sl": 4,
            "max_outstanding": 7,    # WQE basic blocks fetched and not yet completed, 1..64
            "dest_qpn": 24,
            "dlid": 16,
            "pd": 24,
            "pkey": 16,
            "sq_psn": PSN_BITS,      # PSN of the first packet after RESET -> RTS
            "cqn": CQN_BITS,
            # Responder side (docs/nic-responder.md).
            "access": Access,        # remote rights the QP grants (REMOTE_WRITE/READ/ATOMIC)
            "rq_psn": PSN_BITS,      # the first request PSN expected after RESET -> RTS
            "min_rnr_timer": 5,      # IBA RNR timer code sent in RNR NAKs
            "rq_base": 64,           # byte address of receive WQE 0 (16 bytes each)
            "log_rq_size": 4,        # the receive queue holds 2**log_rq_size WQEs
            "rq_dbr": 64,            # byte address of the receive doorbell record (be32 counter)
            "rcqn": CQN_BITS,        # CQ of receive completions
            # Requester reliability (docs/nic-reliability.md).
            "retry_cnt": 3,          # retransmissions after a timeout or sequence NAK, 0..7
            "rnr_retry": 3,          # retransmissions after an RNR NAK, 0..6; 7: without limit
            "ack_timeout": 5,        # IBA local ACK timeout: 4.096 us * 2**n; 0: none
        })


class CqConfigLayout(data.StructLayout):
    def __init__(self):
        super().__init__({
            "base": 64,              # byte address of CQE 0
            "log_size": 4,           # 2**log_size CQEs of 64 bytes
            "collapsed": 1,          # every CQE goes to entry 0 (NVSHMEM IBGDA's setting)
        })


class MkeyLayout(data.StructLayout):
    """One memory-key table entry; the entry for key ``k`` is at index
    ``(k >> 8) % num_mkeys`` and matches only if ``key == k`` (mlx5 keys are
    index << 8 | an 8-bit variant)."""
    def __init__(self):
        super().__init__({
            "key": 32,
            "base": 64,
            "length": 64,
            "access": Access,
            "pd": 24,
            "valid": 1,
        })


class ContextReadSignature(wiring.Signature):
    """A synchronous read port on a context table, seen from the reader: ``data`` is the
    entry at the ``addr`` of the previous cycle (always enabled, so holding ``addr``
    keeps ``data`` current, one cycle late after a host write)."""
    def __init__(self, depth, layout):
        self.depth = depth
        self.layout = layout
        super().__init__({"addr": Out(range(depth)), "data": In(layout)})


class EventSignature(wiring.Signature):
    """A one-cycle strobe about one QP (``qp_reset``, ``qp_error``), seen from the sender."""
    def __init__(self):
        super().__init__({"valid": Out(1), "qpn": Out(QPN_BITS)})


class DoorbellLayout(data.StructLayout):
    """A doorbell write as the UAR page decodes it: the QPN (bits 31..8 of ``qpn_ds``)
    and the producer index (bits 23..8 of ``opmod_idx_opcode``)."""
    def __init__(self):
        super().__init__({"qpn": 24, "pi": 16})


class FetchRequestLayout(data.StructLayout):
    """Read ``blocks`` WQE basic blocks of QP ``qpn`` from ``wqe_index`` on (modulo the
    ring). ``first_only``: consume at most the first WQE (the QP's outstanding window
    is smaller than a fetch, and nothing is outstanding)."""
    def __init__(self):
        super().__init__({
            "qpn": QPN_BITS,
            "wqe_index": 16,
            "blocks": range(MAX_WQE_BLOCKS + 1),
            "first_only": 1,
            "epoch": EPOCH_BITS,     # the QP's rewind count when the fetch was issued
        })


class FetchDoneLayout(data.StructLayout):
    """The parser finished a fetch: ``consumed`` blocks (whole WQEs) became WQE
    descriptors; the rest of the fetch (a WQE cut by the fetch's end) is read again
    later."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS, "consumed": range(MAX_WQE_BLOCKS + 1),
                          "epoch": EPOCH_BITS})


class RewindLayout(data.StructLayout):
    """Go back N (docs/nic-reliability.md): QP ``qpn`` sends again from the WQE at
    basic-block index ``wqe_index``, whose first packet has PSN ``psn``. Everything the
    QP fetched or executed after that WQE is discarded and redone."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS, "wqe_index": 16, "psn": PSN_BITS})


class PacketSentLayout(data.StructLayout):
    """A request packet of QP ``qpn`` left the WQE executor for the wire; ``psn``: the last
    PSN it accounts for, its own (a READ request: the last PSN its responses take).
    The completion unit takes answers only for PSNs sent (docs/nic.md, "Completions")."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS, "psn": PSN_BITS})


class ResponseVerdictLayout(data.StructLayout):
    """The completion unit's decision on a response packet the ResponseWriter stored
    (``seq``): ``write`` its ``bytes`` payload bytes, found ``offset`` bytes into the
    packet, to memory at ``addr``; otherwise discard it."""
    def __init__(self):
        super().__init__({
            "seq": RESPONSE_SEQ_BITS,
            "write": 1,
            "addr": 64,
            "bytes": range(4096 + 1),
            "offset": 6,
        })


class RetireLayout(data.StructLayout):
    """WQE basic blocks of a QP whose WQE completed (its CQE, if any, was written):
    the send queue's consumer index moves on by ``blocks``. ``next_psn``: the PSN after
    the WQE's last (its ``last_psn + 1``; for a WQE that sent nothing, 0): where the QP's
    stream stands after it, should a retransmission have to skip it."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS, "blocks": range(MAX_WQE_BLOCKS + 1),
                          "next_psn": PSN_BITS})


class DataSegmentLayout(data.StructLayout):
    """An mlx5 data segment's fields, numeric values of its big-endian bytes."""
    def __init__(self):
        super().__init__({"byte_count": 32, "lkey": 32, "laddr": 64})


class GatherPieceLayout(data.StructLayout):
    """One piece of a packet's payload as the read stage issues it (a data segment's bytes
    within one packet): ``bytes`` (1 .. 4096) from byte ``start`` of its first raw beat,
    ``beats`` raw beats (``ceil((start + bytes) / 64)``), ``last`` on the packet's last
    piece (docs/nic.md, Gather packing)."""
    def __init__(self):
        super().__init__({"start": 6, "bytes": 13, "beats": 7, "last": 1})


class WqeDescriptorLayout(data.StructLayout):
    """One parsed WQE. Fields of segments the opcode does not have are zero.
    ``format_error`` with ``syndrome``: the WQE is malformed (unknown opcode, ``ds``
    inconsistent with the opcode, more than four data segments or an inline-marked one in
    a gather list, inline data too long); it completes with an error CQE and moves its QP
    to the error state. ``segments``: its data segments (0 without one, 1 to 4 for a
    WRITE or SEND), the first in ``byte_count``/``lkey``/``laddr``, the others in
    ``more_segments`` (zero past ``segments``)."""
    def __init__(self):
        super().__init__({
            "qpn": QPN_BITS,
            "epoch": EPOCH_BITS,                     # the fetch's epoch
            "wqe_index": 16,                         # basic-block index of the WQE's start
            "wqe_blocks": range(MAX_WQE_BLOCKS + 1),
            "opcode": 8,                             # mlx5 opcode, as in the control segment
            "opmod": 8,
            "ds": 6,
            "fm_ce_se": 8,
            "imm": 32,                               # control segment's imm (big-endian on the wire)
            "raddr": 64,
            "rkey": 32,
            "swap_add": 64,
            "compare": 64,
            "swap_mask": 64,                         # masked atomics (FA: the field boundary)
            "compare_mask": 64,
            "has_data": 1,                           # a data segment (lkey/laddr/byte_count)
            "lkey": 32,
            "laddr": 64,
            "byte_count": 32,                        # data segment or inline length
            "segments": range(MAX_GATHER_SEGMENTS + 1),
            "more_segments": data.ArrayLayout(DataSegmentLayout(), MAX_GATHER_SEGMENTS - 1),
            "inline": 1,
            "inline_data": 8 * DESCRIPTOR_INLINE_BYTES,   # byte 0 in bits 7..0
            "format_error": 1,
            "syndrome": Syndrome,
        })


class PayloadSource(enum.Enum, shape=2):
    NONE = 0
    INLINE = 1      # the descriptor's ``inline_data``
    DMA = 2         # the next beats of the payload buffer (AXI R, id PAYLOAD_ID)


class PacketDescriptorLayout(data.StructLayout):
    """One packet for the :class:`PacketAssembler`: ``header`` (LRH .. last extension
    header, wire order, byte 0 in bits 7..0, ``header_bytes`` long, LRH.PktLen and
    BTH.PadCnt already filled in) followed by ``payload_bytes`` of payload, the pad
    and the ICRC the assembler computes. A DMA payload starts at byte ``offset`` of
    the first payload-buffer beat and takes ``dma_beats`` beats of the buffer."""
    def __init__(self):
        super().__init__({
            "vl": 4,
            "header": 8 * MAX_NIC_HEADER_BYTES,
            "header_bytes": range(MAX_NIC_HEADER_BYTES + 1),
            "payload_bytes": range(4096 + 1),
            "source": PayloadSource,
            "offset": 6,
            "dma_beats": range(4096 // 64 + 2),
            "inline_data": 8 * DESCRIPTOR_INLINE_BYTES,
        })


class CompletionStatus(enum.Enum, shape=2):
    SENT = 0        # packets went out; completes when the responder acknowledges it
    ERROR = 1       # failed locally (``syndrome``); completes when it reaches the queue head
    FLUSH = 2       # its QP is in error: completes with WR_FLUSH_ERR in order


class CompletionRecordLayout(data.StructLayout):
    """What the executor tells the completion unit about each WQE, in WQE order per QP."""
    def __init__(self):
        super().__init__({
            "qpn": QPN_BITS,
            "cqn": CQN_BITS,             # the QP's CQ
            "wqe_index": 16,
            "wqe_blocks": range(MAX_WQE_BLOCKS + 1),
            "opcode": 8,                 # mlx5 opcode
            "byte_count": 32,
            "first_psn": PSN_BITS,
            "last_psn": PSN_BITS,        # READ: PSN of the last expected response
            "signaled": 1,               # fm_ce_se has CQ_UPDATE (0x08): write a CQE
            "status": CompletionStatus,
            "syndrome": Syndrome,
            # For the completion unit's reliability engine (docs/nic-reliability.md).
            "laddr": 64,                 # READ: where the data lands; atomics: the result
            "mtu": 3,                    # the QP's path MTU code
            "retry_cnt": 3,
            "rnr_retry": 3,
            "ack_timeout": 5,
        })


class ArLayout(data.StructLayout):
    """An AXI4 read request as a block issues it: an INCR burst of ``len + 1`` full-width
    beats from ``addr`` (not crossing 4 KiB). The top arbitrates these into the AR channel."""
    def __init__(self):
        super().__init__({"id": AXI_ID_BITS, "addr": 64, "len": 8})


class RBeatLayout(data.StructLayout):
    """An AXI4 read data beat as the top routes it (by ``rid``) to the block that asked."""
    def __init__(self, data_bytes=64):
        super().__init__({"data": 8 * data_bytes, "resp": 2, "last": 1})


class AxiReadSignature(wiring.Signature):
    """AXI4 read address and data channels, seen from the master (member names as
    cocotbext-axi's ``AxiBus`` expects them). INCR bursts only, ``arsize`` = the full
    data width."""
    def __init__(self, addr_width, data_bytes):
        self.addr_width = addr_width
        self.data_bytes = data_bytes
        super().__init__({
            "arid": Out(AXI_ID_BITS), "araddr": Out(addr_width), "arlen": Out(8),
            "arsize": Out(3), "arburst": Out(2), "arvalid": Out(1), "arready": In(1),
            "rid": In(AXI_ID_BITS), "rdata": In(8 * data_bytes), "rresp": In(2),
            "rlast": In(1), "rvalid": In(1), "rready": Out(1),
        })


class AxiWriteSignature(wiring.Signature):
    """AXI4 write address, data and response channels, seen from the master."""
    def __init__(self, addr_width, data_bytes):
        self.addr_width = addr_width
        self.data_bytes = data_bytes
        super().__init__({
            "awid": Out(AXI_ID_BITS), "awaddr": Out(addr_width), "awlen": Out(8),
            "awsize": Out(3), "awburst": Out(2), "awvalid": Out(1), "awready": In(1),
            "wdata": Out(8 * data_bytes), "wstrb": Out(data_bytes), "wlast": Out(1),
            "wvalid": Out(1), "wready": In(1),
            "bid": In(AXI_ID_BITS), "bresp": In(2), "bvalid": In(1), "bready": Out(1),
        })


# --- Responder side (docs/nic-responder.md) --------------------------------------------

class RequestDescriptorLayout(data.StructLayout):
    """A request packet the :class:`RequestReceiver` accepted (good ICRC, well formed, for
    this port's LID), stored in the receive buffer from beat ``buffer_beat`` on, for the
    :class:`ResponderEngine`. Header values are integers (wire byte order decoded); fields
    of headers the opcode does not have are zero. The payload starts at byte
    ``header_bytes`` of the packet (inside its first beat; a masked atomic's 64-byte
    header fills that beat and it has no payload)."""
    def __init__(self):
        super().__init__({
            "vl": 4,
            "sl": 4,
            "slid": 16,
            "opcode": 8,                         # BTH opcode (RC: transport bits 000)
            "se": 1,
            "ackreq": 1,
            "pkey": 16,
            "destqp": 24,
            "psn": PSN_BITS,
            "va": 64,                            # RETH.va or AtomicETH.va
            "rkey": 32,                          # RETH.rkey or AtomicETH.rkey
            "dmalen": 32,                        # RETH.dmalen
            "swap_add": 64,                      # AtomicETH, MaskedAtomicETH
            "compare": 64,                       # AtomicETH, MaskedAtomicETH
            "swap_mask": 64,                     # MaskedAtomicETH
            "compare_mask": 64,                  # MaskedAtomicETH
            "imm": 32,                           # ImmDt
            "header_bytes": range(MAX_NIC_HEADER_BYTES + 1),
            "payload_bytes": range(4096 + 1),
            "buffer_beat": RX_BUFFER_BEAT_BITS,  # the packet's first beat in the buffer
            "beats": range(MAX_PACKET_BEATS + 1),  # buffer beats the packet holds
        })


class DmaWriteLayout(data.StructLayout):
    """Write ``bytes`` payload bytes, taken from the receive buffer at beat ``src_beat``
    byte ``src_offset`` on, to memory at ``addr``; then free ``release_beats`` buffer
    beats. Every request descriptor gives exactly one command (``bytes`` = 0 for packets
    that write nothing), so the buffer is freed in order."""
    def __init__(self):
        super().__init__({
            "addr": 64,
            "bytes": range(4096 + 1),
            "src_beat": RX_BUFFER_BEAT_BITS,
            "src_offset": 6,
            "release_beats": range(MAX_PACKET_BEATS + 1),
        })


class ResponseKind(enum.Enum, shape=2):
    ACK = 0         # ACKNOWLEDGE with ``syndrome`` (an ACK, an RNR NAK or a NAK)
    READ = 1        # RDMA READ responses for ``va``/``length`` from ``psn`` on
    ATOMIC = 2      # ATOMIC ACKNOWLEDGE carrying ``orig``


class ResponseCommandLayout(data.StructLayout):
    """One response (or run of READ response packets) for the :class:`ResponseGenerator`,
    addressed from the QP's context: DLID, SL/VL, P_Key, the requester's QPN."""
    def __init__(self):
        super().__init__({
            "kind": ResponseKind,
            "vl": 4,
            "sl": 4,
            "dlid": 16,
            "pkey": 16,
            "destqp": 24,
            "psn": PSN_BITS,
            "syndrome": 8,                       # AETH syndrome
            "msn": 24,                           # AETH MSN
            "va": 64,                            # READ
            "length": 32,                        # READ
            "mtu": 3,                            # READ: path MTU code the responses are cut at
            "orig": 64,                          # ATOMIC
        })


class RecvStatus(enum.Enum, shape=2):
    OK = 0          # a receive WQE: ``addr``/``length`` checked against its lkey
    EMPTY = 1       # no receive WQE posted (RNR)
    ERROR = 2       # the WQE is bad (``syndrome``); the QP goes to the error state


class RecvRequestLayout(data.StructLayout):
    """Take the next receive WQE of QP ``qpn``."""
    def __init__(self):
        super().__init__({"qpn": QPN_BITS})


class RecvResultLayout(data.StructLayout):
    def __init__(self):
        super().__init__({
            "status": RecvStatus,
            "syndrome": Syndrome,
            "addr": 64,
            "length": 32,
            "wqe_counter": 16,
        })


class AtomicRequestLayout(data.StructLayout):
    """A read-modify-write of the little-endian word at ``addr``, 8 bytes (8-byte aligned)
    or with ``size4`` 4 bytes (4-byte aligned; operands in the low 32 bits of each field).
    ``fetch_add``: masked fetch-and-add, ``orig + swap_add`` where a set bit of
    ``swap_mask`` (the field boundary) stops the carry out of that bit (IBA FetchAdd: 0);
    else masked compare-and-swap: when ``(orig ^ compare) & compare_mask`` is 0, the bits
    of ``swap_mask`` take ``swap_add``'s (IBA CmpSwap: both masks all ones)."""
    def __init__(self):
        super().__init__({"addr": 64, "fetch_add": 1, "size4": 1, "swap_add": 64,
                          "compare": 64, "swap_mask": 64, "compare_mask": 64})


class AtomicResultLayout(data.StructLayout):
    """The word before the operation (a 4-byte one in the low 32 bits); ``error``: the read or write was answered with a
    response other than OKAY (nothing was written if the read failed)."""
    def __init__(self):
        super().__init__({"orig": 64, "error": 1})


class RecvCqeOpcode(enum.Enum, shape=4):
    """mlx5 CQE opcodes of receive completions (``MLX5_CQE_RESP_*``)."""
    RESP_WR_IMM = 1
    RESP_SEND = 2
    RESP_SEND_IMM = 3
    RESP_ERR = 14


class ReceiveCompletionLayout(data.StructLayout):
    """A receive completion the responder asks the :class:`CompletionUnit` to write as
    a CQE to CQ ``cqn``: a SEND or WRITE_WITH_IMM message that consumed receive WQE
    ``wqe_counter``, or (``RESP_ERR`` with ``syndrome``) a receive WQE that failed."""
    def __init__(self):
        super().__init__({
            "qpn": QPN_BITS,
            "cqn": CQN_BITS,
            "opcode": RecvCqeOpcode,
            "syndrome": Syndrome,
            "byte_count": 32,
            "imm": 32,
            "wqe_counter": 16,
        })
