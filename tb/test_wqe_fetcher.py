"""WqeFetcher (hdl/nic/wqe_fetcher.py) against a Python reference, in Amaranth's simulator.

The bench plays every neighbour of the fetcher cycle by cycle:

* a context table answering ``qp_config`` one cycle late (the synchronous read port);
* a request source (random or a fixed list; stream rules kept: a presented request is held
  until taken), including requests the fetcher must reject (``blocks`` 0 or above 16, a
  QPN the NIC does not have);
* a memory model (AXI slave for id 0) with random ``ar.ready``, a random latency per burst,
  responses in order and random gaps between R beats; blocks marked bad come back with
  RRESP SLVERR/DECERR and random data. Every burst is checked when it is taken: id, 4 KiB
  rule, and address and length equal to the next expected burst (the fetch's blocks
  modulo the ring, cut only at the ring's end and at 4 KiB boundaries);
* random ``wqe`` backpressure, with the stream rule checked (a presented descriptor stays,
  unchanged, until taken).

The rings hold WQEs built here byte by byte (mlx5 layouts: control, remote-address, data,
inline and atomic segments, big-endian, random bytes wherever the parser must not look:
reserved bytes, inline padding, the top bits of the ds byte, the control segment's WQE
index and QPN copies, the second unit of a ds-2 NOP): every opcode (NVSHMEM's NOP of ds 1
and 2 and its DUMP included), inline lengths 0..256 (up to 5 blocks), multi-block WQEs, WQEs wrapping
around the ring's end, rings crossing 4 KiB pages, and malformed WQEs of every row of
docs/nic.md's table. A Python parser written from that table predicts, for every accepted
request, the bursts, every descriptor field and the fetch-done record; the bench checks
them in order, plus the reservation (blocks requested and not yet received never exceed
the buffer; blocks requested and not known to be parsed exceed it by at most one
fetch), ``r.ready`` always high, and every counter at the end.

Every request of the random runs carries a random epoch, which every descriptor of the
fetch and its fetch-done record must carry.

Directed tests: the format-error table row by row (syndromes spelled out by hand, not by
the reference parser); RRESP errors on a WQE's first and second block; exact bursts of
ring-wrap and 4 KiB splits; rejected requests; ``first_only``; a WQE cut by the fetch's
end; the reservation with a stalled consumer (exactly ``buffer_blocks`` blocks + what the
parser took); throughput (one-block WQEs at one descriptor per cycle, within a fetch and
across one-block fetches); parameter checks.
"""
import gc
import random
import warnings
from collections import deque

import pytest
from amaranth.hdl import UnusedElaboratable

from hdl.nic.signatures import MlxOpcode, Syndrome, WqeDescriptorLayout
from hdl.nic.wqe_fetcher import WqeFetcher
from tb.amaranth_sim import simulate

OPS = {op.name: op.value for op in MlxOpcode}
QP_OP = Syndrome.LOCAL_QP_OP_ERR.value
LEN = Syndrome.LOCAL_LENGTH_ERR.value
DESC_LAYOUT = WqeDescriptorLayout()
FIELDS = [(name, field.offset, field.width) for name, field in DESC_LAYOUT]


# --- WQE builders (mlx5 byte layouts) ---------------------------------------------------------

def rbytes(rng, n):
    return bytes(rng.randrange(256) for _ in range(n))


def ctrl_seg(rng, opcode, ds, *, opmod=None, fm_ce_se=None, imm=None):
    b = bytearray(rbytes(rng, 16))      # WQE index, QPN copy, signature, reserved: ignored
    b[0] = rng.randrange(256) if opmod is None else opmod
    b[3] = opcode
    b[7] = (rng.randrange(4) << 6) | ds  # ds is the low 6 bits
    b[11] = rng.randrange(256) if fm_ce_se is None else fm_ce_se
    b[12:16] = (rng.randrange(1 << 32) if imm is None else imm).to_bytes(4, "big")
    return bytes(b)


def raddr_seg(rng, raddr=None, rkey=None):
    raddr = rng.randrange(1 << 64) if raddr is None else raddr
    rkey = rng.randrange(1 << 32) if rkey is None else rkey
    return raddr.to_bytes(8, "big") + rkey.to_bytes(4, "big") + rbytes(rng, 4)


def data_seg(rng, byte_count=None, lkey=None, addr=None):
    byte_count = rng.randrange(1 << 31) if byte_count is None else byte_count
    lkey = rng.randrange(1 << 32) if lkey is None else lkey
    addr = rng.randrange(1 << 64) if addr is None else addr
    return byte_count.to_bytes(4, "big") + lkey.to_bytes(4, "big") + addr.to_bytes(8, "big")


def inline_seg(rng, n, length=None):
    """``length``: the length word's value, when it is to lie about ``n``."""
    body = (0x80000000 | (n if length is None else length)).to_bytes(4, "big") + rbytes(rng, n)
    return body + rbytes(rng, -len(body) % 16)


def atomic_seg(rng):
    return rbytes(rng, 16)


def wqe_bytes(rng, ctrl, *segments):
    """The WQE as its ``ds`` makes it: ``max(1, ceil(ds / 4))`` blocks, cut or padded."""
    ds = ctrl[7] & 0x3F
    size = 64 * max(1, -(-ds // 4))
    body = (ctrl + b"".join(segments))[:size]
    return body + rbytes(rng, size - len(body))


def inline_ds(base, n):
    return base + -(-(4 + n) // 16)


def good_wqe(rng, kind=None):
    kind = kind or rng.choice(["write", "write", "send", "send", "read", "atomic", "empty",
                               "nop", "dump", "masked"])
    if kind == "nop":
        # ibgda_write_nop_wqe (ds 2, its second unit left as the ring held it) and the NOP
        # ending ibgda_write_rdma_write_inl_wqe_combine_warp (ds 1)
        return wqe_bytes(rng, ctrl_seg(rng, OPS["NOP"], rng.choice([1, 2]), opmod=0),
                         rbytes(rng, 16))
    if kind == "dump":
        # ibgda_write_dump_wqe: ctrl, data segment (NVSHMEM: 1 byte of its internal buffer)
        return wqe_bytes(rng, ctrl_seg(rng, OPS["DUMP"], 2, opmod=0),
                         data_seg(rng, byte_count=rng.choice([0, 1, rng.randrange(1 << 31)])))
    if kind == "read":
        return wqe_bytes(rng, ctrl_seg(rng, OPS["RDMA_READ"], 3), raddr_seg(rng), data_seg(rng))
    if kind == "atomic":
        op = rng.choice([OPS["ATOMIC_CS"], OPS["ATOMIC_FA"]])
        return wqe_bytes(rng, ctrl_seg(rng, op, 4), raddr_seg(rng), atomic_seg(rng),
                         data_seg(rng, byte_count=8))
    if kind == "masked":
        # ibgda_write_atomic_wqe's masked atomics: opmod 0x08 (4 bytes) / 0x09 (8 bytes);
        # an 8-byte masked CS has two atomic segments and its data segment in block 1
        op = rng.choice([OPS["ATOMIC_MASKED_CS"], OPS["ATOMIC_MASKED_FA"]])
        size = rng.choice([4, 8])
        two = op == OPS["ATOMIC_MASKED_CS"] and size == 8
        return wqe_bytes(rng, ctrl_seg(rng, op, 5 if two else 4, opmod=8 if size == 4 else 9),
                         raddr_seg(rng), atomic_seg(rng), *([atomic_seg(rng)] if two else []),
                         data_seg(rng, byte_count=size))
    send = kind == "send" or (kind == "empty" and rng.random() < 0.5)
    op = rng.choice([OPS["SEND"], OPS["SEND_IMM"]] if send
                    else [OPS["RDMA_WRITE"], OPS["RDMA_WRITE_IMM"]])
    base = 1 if send else 2
    head = [] if send else [raddr_seg(rng)]
    if kind == "empty":
        return wqe_bytes(rng, ctrl_seg(rng, op, base), *head)
    if rng.random() < 0.5:
        n = rng.choice([0, 1, 12, 13, 28, 29, 44, 45, 60, 61, 64, rng.randrange(65),
                        65, 128, 252, 256, rng.randrange(65, 257)])
        return wqe_bytes(rng, ctrl_seg(rng, op, inline_ds(base, n)), *head, inline_seg(rng, n))
    # one data segment, or a gather list of up to four (some of them empty)
    segments = [data_seg(rng, byte_count=rng.choice([0, 1, 8, 4096, rng.randrange(1 << 31)]))
                for _ in range(rng.choice([1, 1, 2, 3, 4]))]
    return wqe_bytes(rng, ctrl_seg(rng, op, base + len(segments)), *head, *segments)


def bad_wqes(rng):
    """One WQE per format-error row of docs/nic.md, with the syndrome the table gives."""
    w, wi, s, si = OPS["RDMA_WRITE"], OPS["RDMA_WRITE_IMM"], OPS["SEND"], OPS["SEND_IMM"]
    rd, cs, fa = OPS["RDMA_READ"], OPS["ATOMIC_CS"], OPS["ATOMIC_FA"]
    mcs, mfa = OPS["ATOMIC_MASKED_CS"], OPS["ATOMIC_MASKED_FA"]
    r = raddr_seg
    cases = [
        # WRITE: five data segments, ds too small
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, w, 7), r(rng), *[data_seg(rng) for _ in range(5)])),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, wi, 1), r(rng))),
        # gather lists with an inline-marked segment: 2nd of 2 (first block), 3rd of 4 and
        # 4th of 4 (second block, bytes 0 and 16), the 4th of a SEND (second block)
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, w, 4), r(rng), data_seg(rng), inline_seg(rng, 12))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, wi, 6), r(rng), data_seg(rng), data_seg(rng),
                          inline_seg(rng, 12), data_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, w, 6), r(rng), data_seg(rng), data_seg(rng),
                          data_seg(rng), inline_seg(rng, 12))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, si, 5), data_seg(rng), data_seg(rng), data_seg(rng),
                          inline_seg(rng, 8))),
        # WRITE inline: ds one too many / one too few for the length
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, w, inline_ds(2, 20) + 1), r(rng),
                          inline_seg(rng, 20))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, wi, inline_ds(2, 61) - 1), r(rng),
                          inline_seg(rng, 61))),
        # inline longer than 256 bytes (LOCAL_LENGTH even when ds matches the length)
        (LEN, wqe_bytes(rng, ctrl_seg(rng, w, inline_ds(2, 257)), r(rng), inline_seg(rng, 257))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, s, 7), inline_seg(rng, 80, length=300))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, si, 3), inline_seg(rng, 12, length=0x7FFFFFFF))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, wi, 10), r(rng), inline_seg(rng, 130, length=512))),
        # 65..256 inline bytes (NVSHMEM's warp-combined puts: 128 and 256) with ds one short
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, w, inline_ds(2, 256) - 1), r(rng),
                          inline_seg(rng, 256))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, s, inline_ds(1, 128) - 1), inline_seg(rng, 128))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, s, inline_ds(1, 80) + 1), inline_seg(rng, 80))),
        # SEND: five data segments, inline ds wrong, ds 0
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, s, 6), *[data_seg(rng) for _ in range(5)])),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, si, inline_ds(1, 44) + 1), inline_seg(rng, 44))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, s, 0))),
        # READ: inline instead of a data segment, ds 2 and 4
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, rd, 3), r(rng), inline_seg(rng, 8))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, rd, 2), r(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, rd, 4), r(rng), data_seg(rng), data_seg(rng))),
        # atomics: ds 3 / 5 (LOCAL_QP_OP even with a bad byte count), byte count not 8
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, cs, 3), r(rng), atomic_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, fa, 5), r(rng), atomic_seg(rng),
                          data_seg(rng, byte_count=4), data_seg(rng))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, cs, 4), r(rng), atomic_seg(rng),
                        data_seg(rng, byte_count=4))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, fa, 4), r(rng), atomic_seg(rng),
                        data_seg(rng, byte_count=0x80000008))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, cs, 4), r(rng), atomic_seg(rng),
                        data_seg(rng, byte_count=0))),
        # NOP: ds 3 and 4, an opmod NVSHMEM does not write
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["NOP"], 3, opmod=0), r(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["NOP"], 4, opmod=0))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["NOP"], 2, opmod=rng.randrange(1, 256)))),
        # DUMP: ds 1 and 3, inline data instead of the data segment, an opmod
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["DUMP"], 1, opmod=0))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["DUMP"], 3, opmod=0), data_seg(rng),
                          data_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["DUMP"], 2, opmod=0), inline_seg(rng, 1))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, OPS["DUMP"], 2, opmod=rng.randrange(1, 256)),
                          data_seg(rng, byte_count=1))),
        # masked atomics: an opmod other than 0x08/0x09, ds off by one, the data word not
        # the opmod's size (in block 1 for an 8-byte CS)
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, mcs, 4, opmod=0), r(rng), atomic_seg(rng),
                          data_seg(rng, byte_count=8))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, mfa, 4, opmod=0x0A), r(rng), atomic_seg(rng),
                          data_seg(rng, byte_count=8))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, mcs, 4, opmod=9), r(rng), atomic_seg(rng),
                          atomic_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, mfa, 5, opmod=8), r(rng), atomic_seg(rng),
                          data_seg(rng, byte_count=4), data_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, mfa, 3, opmod=9), r(rng), atomic_seg(rng))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, mfa, 4, opmod=8), r(rng), atomic_seg(rng),
                        data_seg(rng, byte_count=8))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, mcs, 4, opmod=8), r(rng), atomic_seg(rng),
                        inline_seg(rng, 4))),
        (LEN, wqe_bytes(rng, ctrl_seg(rng, mcs, 5, opmod=9), r(rng), atomic_seg(rng),
                        atomic_seg(rng), data_seg(rng, byte_count=4))),
        # any other opcode; a long ds (many blocks)
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, 0x16, 5), r(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, 0x0C, 3), data_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, 0x18, 4), r(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, 0xFF, 1))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, w, 10), r(rng), data_seg(rng))),
        (QP_OP, wqe_bytes(rng, ctrl_seg(rng, s, 63), data_seg(rng))),
    ]
    return cases


def any_wqe(rng, max_blocks):
    while True:
        if rng.random() < 0.2:
            wqe = rng.choice(bad_wqes(rng))[1]
        else:
            wqe = good_wqe(rng)
        if len(wqe) // 64 <= max_blocks:
            return wqe


# --- Reference parser (docs/nic.md, "WQE fetch and parse") -------------------------------------

def be(b, start, n):
    return int.from_bytes(b[start:start + n], "big")


def ref_length(block, bad):
    ds = block[7] & 0x3F
    return 1 if bad or ds == 0 else -(-ds // 4)


def ref_descriptor(blocks, bads, qpn, index):
    """The descriptor of the WQE made of ``blocks`` (its bytes, per block) and ``bads``."""
    d = {name: 0 for name, _, _ in FIELDS}
    d.update(qpn=qpn, wqe_index=index & 0xFFFF, wqe_blocks=len(blocks))
    if bads[0]:
        d.update(format_error=1, syndrome=QP_OP)
        return d
    b = b"".join(blocks)
    opcode, ds = b[3], b[7] & 0x3F
    d.update(opcode=opcode, opmod=b[0], ds=ds, fm_ce_se=b[11], imm=be(b, 12, 4))
    seg = {}

    def data_at(at, count=1):
        seg.update(has_data=1, segments=count, byte_count=be(b, at, 4), lkey=be(b, at + 4, 4),
                   laddr=be(b, at + 8, 8))
        # a gather list's later segments, 128 bits each: byte_count, lkey, laddr
        seg.update(more_segments=sum(
            (be(b, at + 16 * k, 4) | be(b, at + 16 * k + 4, 4) << 32 | be(b, at + 16 * k + 8, 8) << 64)
            << 128 * (k - 1) for k in range(1, count)))

    def data_or_inline(at, base):
        if ds == base:
            return None
        if ds < base:
            return QP_OP
        word = be(b, at, 4)
        if word & 0x80000000:
            n = word & 0x7FFFFFFF
            if n > 256:
                return LEN
            if ds != inline_ds(base, n):
                return QP_OP
            # the descriptor carries up to 64 bytes (the executor reads longer data back
            # from the ring)
            seg.update(inline=1, byte_count=n,
                       inline_data=int.from_bytes(b[at + 4:at + 4 + n], "little") if n <= 64 else 0)
            return None
        count = ds - base           # data segments: one, or a gather list of up to four
        if count > 4 or any(be(b, at + 16 * k, 4) & 0x80000000 for k in range(1, count)):
            return QP_OP
        data_at(at, count)
        return None

    raddr = dict(raddr=be(b, 16, 8), rkey=be(b, 24, 4))
    if opcode in (OPS["RDMA_WRITE"], OPS["RDMA_WRITE_IMM"]):
        seg.update(raddr)
        error = data_or_inline(32, 2)
    elif opcode in (OPS["SEND"], OPS["SEND_IMM"]):
        error = data_or_inline(16, 1)
    elif opcode == OPS["RDMA_READ"]:
        seg.update(raddr)
        data_at(32)
        error = None if ds == 3 and not b[32] & 0x80 else QP_OP
    elif opcode in (OPS["ATOMIC_CS"], OPS["ATOMIC_FA"]):
        seg.update(raddr, swap_add=be(b, 32, 8), compare=be(b, 40, 8))
        data_at(48)
        error = QP_OP if ds != 4 else LEN if be(b, 48, 4) != 8 else None
    elif opcode in (OPS["ATOMIC_MASKED_CS"], OPS["ATOMIC_MASKED_FA"]):
        size = {8: 4, 9: 8}.get(b[0])
        two = opcode == OPS["ATOMIC_MASKED_CS"] and size == 8
        ops = [be(b, 32 + (size or 8) * k, size or 8) for k in range(4)]
        names = (("swap_add", "swap_mask") if opcode == OPS["ATOMIC_MASKED_FA"]
                 else ("swap_add", "compare", "swap_mask", "compare_mask"))
        seg.update(raddr, **dict(zip(names, ops)))
        data_at(64 if two else 48)
        error = (QP_OP if size is None or ds != (5 if two else 4)
                 else LEN if be(b, 64 if two else 48, 4) != size else None)
    elif opcode == OPS["NOP"]:
        error = None if ds in (1, 2) and b[0] == 0 else QP_OP
    elif opcode == OPS["DUMP"]:
        data_at(16)
        error = None if ds == 2 and b[0] == 0 and not b[16] & 0x80 else QP_OP
    else:
        error = QP_OP
    if any(bads):
        error = QP_OP
    if error is None:
        d.update(seg)
    else:
        d.update(format_error=1, syndrome=error)
    return d


class Ring:
    """One QP's send queue: ``2**log`` basic blocks at ``base``, filled around the ring with
    WQEs from a random start (so some wrap past its end); ``bad``: ring indices whose
    reads fail."""

    def __init__(self, rng, base, log, *, wqes=None, bad=()):
        self.base, self.log, self.size = base, log, 1 << log
        self.mem = bytearray(64 * self.size)
        self.starts = []
        self.bad = set(bad)
        at = rng.randrange(self.size)
        wqes = deque(wqes or [])
        left = self.size
        while left:
            wqe = wqes.popleft() if wqes else any_wqe(rng, left)
            assert len(wqe) // 64 <= left
            self.place(at, wqe)
            at = (at + len(wqe) // 64) % self.size
            left -= len(wqe) // 64

    def place(self, index, wqe):
        self.starts.append(index % self.size)
        for k in range(len(wqe) // 64):
            i = (index + k) % self.size
            self.mem[64 * i:64 * i + 64] = wqe[64 * k:64 * k + 64]

    def block(self, index):
        i = index % self.size
        return bytes(self.mem[64 * i:64 * i + 64])

    def is_bad(self, index):
        return index % self.size in self.bad

    def bursts(self, index, blocks):
        """(address, beats) of a fetch: cut at the ring's end and at 4 KiB boundaries."""
        out = []
        while blocks:
            addr = self.base + 64 * (index % self.size)
            n = min(blocks, self.size - index % self.size, (4096 - addr % 4096) // 64)
            out.append((addr, n))
            index += n
            blocks -= n
        return out


def ref_fetch(ring, req, num_qps):
    """(bursts, descriptors, consumed) the fetcher owes a request ``(qpn, index, blocks,
    first_only[, epoch])`` (epoch 0 if not given): every descriptor carries its epoch."""
    qpn, index, blocks, first_only = req[:4]
    epoch = req[4] if len(req) > 4 else 0
    if not 1 <= blocks <= 16 or qpn >= num_qps:
        return [], [], 0
    got = [(ring.block(index + k), ring.is_bad(index + k)) for k in range(blocks)]
    descriptors, pos = [], 0
    while pos < blocks:
        n = ref_length(*got[pos])
        if n > blocks - pos:
            break
        part = got[pos:pos + n]
        descriptors.append(dict(ref_descriptor([g[0] for g in part], [g[1] for g in part],
                                               qpn, index + pos), epoch=epoch))
        pos += n
        if first_only:
            break
    return ring.bursts(index, blocks), descriptors, pos


# --- Bench ------------------------------------------------------------------------------------

def unpack(raw):
    return {name: (raw >> offset) & ((1 << width) - 1) for name, offset, width in FIELDS}


class Bench:
    def __init__(self, dut, rings, requests, *, rng, fetch_p=0.5, ar_p=0.7, latency=(1, 30),
                 gap_p=0.2, wqe_p=0.7):
        self.dut, self.rings, self.rng = dut, rings, rng
        self.requests = deque(requests)
        self.fetch_p, self.ar_p, self.latency, self.gap_p = fetch_p, ar_p, latency, gap_p
        self.wqe_p = wqe_p if callable(wqe_p) else (lambda t, p=wqe_p: rng.random() < p)
        self.exp_bursts = deque()
        self.exp_desc = deque()
        self.exp_done = deque()
        self.beats = deque()            # (ready cycle, address, last) per R beat owed
        self.issued = 0                 # blocks requested on AR
        self.received = 0               # R beats delivered
        self.parsed = 0                 # blocks known to be parsed (done fetches, descriptors)
        self.read_errors = 0
        self.fetched = 0
        self.refetched = 0
        self.descriptors = 0
        self.ar_log = []                # (cycle, address, beats)
        self.wqe_cycles = []
        self.desc_log = []
        self.done_log = []

    def config(self, qpn):
        ring = self.rings.get(qpn)
        return {"sq_base": ring.base, "log_sq_size": ring.log} if ring else {"sq_base": 0}

    async def run(self, ctx, max_cycles=50_000, drain=40):
        dut, rng = self.dut, self.rng
        addr = 0
        presented = None
        last_wqe = None                 # descriptor presented and not taken last cycle
        last_ar = None
        idle = 0
        for t in range(max_cycles):
            ctx.set(dut.qp_config.data, self.config(addr))
            if presented is None and self.requests and rng.random() < self.fetch_p:
                presented = self.requests.popleft()
            ctx.set(dut.fetch.valid, presented is not None)
            if presented is not None:
                qpn, index, blocks, first_only = presented[:4]
                epoch = presented[4] if len(presented) > 4 else 0
                ctx.set(dut.fetch.payload, {"qpn": qpn, "wqe_index": index, "blocks": blocks,
                                            "first_only": first_only, "epoch": epoch})
            ctx.set(dut.ar.ready, rng.random() < self.ar_p)
            beat = None
            if self.beats and self.beats[0][0] <= t and rng.random() >= self.gap_p:
                beat = self.beats.popleft()
                _, baddr, last = beat
                ring = self.ring_at(baddr)
                index = (baddr - ring.base) // 64
                if ring.is_bad(index):
                    payload = int.from_bytes(rbytes(rng, 64), "little")
                    resp = rng.choice([2, 3])
                    self.read_errors += 1
                else:
                    payload, resp = int.from_bytes(ring.block(index), "little"), 0
                ctx.set(dut.r.payload, {"data": payload, "resp": resp, "last": last})
            ctx.set(dut.r.valid, beat is not None)
            wqe_ready = self.wqe_p(t)
            ctx.set(dut.wqe.ready, wqe_ready)

            assert ctx.get(dut.r.ready) == 1, t
            addr = ctx.get(dut.qp_config.addr)
            if beat is not None:
                self.received += 1

            if presented is not None and ctx.get(dut.fetch.ready):
                self.accept(presented)
                presented = None

            if ctx.get(dut.fetch_done.valid):
                self.take_done(t, ctx.get(dut.fetch_done.payload.qpn),
                               ctx.get(dut.fetch_done.payload.consumed),
                               ctx.get(dut.fetch_done.payload.epoch))

            if ctx.get(dut.ar.valid):
                ar = (ctx.get(dut.ar.payload.id), ctx.get(dut.ar.payload.addr),
                      ctx.get(dut.ar.payload.len))
                assert last_ar is None or last_ar == ar, (t, last_ar, ar)
                last_ar = ar
                if ctx.get(dut.ar.ready):
                    self.take_burst(t, *ar)
                    last_ar = None
            else:
                assert last_ar is None, (t, "AR withdrawn")

            if ctx.get(dut.wqe.valid):
                raw = ctx.get(dut.wqe.payload.as_value())
                assert last_wqe is None or last_wqe == raw, (t, "descriptor changed")
                last_wqe = raw
                if wqe_ready:
                    self.take_descriptor(t, unpack(raw))
                    last_wqe = None
            else:
                assert last_wqe is None, (t, "descriptor withdrawn")

            await ctx.tick()
            busy = (presented is not None or self.requests or self.beats or self.exp_desc
                    or self.exp_done)
            idle = 0 if busy else idle + 1
            if idle >= drain:
                break
        else:
            raise AssertionError(f"not drained: {len(self.exp_desc)} descriptors, "
                                 f"{len(self.exp_done)} fetch-dones left")
        assert not self.exp_bursts
        assert ctx.get(dut.wqe_blocks_fetched) == self.fetched == self.received
        assert ctx.get(dut.fetch_read_errors) == self.read_errors
        assert ctx.get(dut.wqes_parsed) == self.descriptors
        assert ctx.get(dut.wqe_blocks_refetched) == self.refetched

    def ring_at(self, addr):
        for ring in self.rings.values():
            if ring.base <= addr < ring.base + 64 * ring.size:
                return ring
        raise AssertionError(f"read outside every ring: {addr:#x}")

    def accept(self, req):
        qpn = req[0]
        bursts, descriptors, consumed = ref_fetch(self.rings.get(qpn), req, self.dut.num_qps)
        blocks = sum(n for _, n in bursts)
        self.exp_bursts.extend(bursts)
        fetch = [blocks, 0, False]
        self.exp_desc.extend((fetch, d) for d in descriptors)
        self.exp_done.append((qpn, consumed, req[4] if len(req) > 4 else 0, fetch))
        self.fetched += blocks
        self.refetched += blocks - consumed

    def take_burst(self, t, ident, addr, length):
        beats = length + 1
        assert ident == 0, (t, ident)
        assert addr % 64 == 0, (t, hex(addr))
        assert addr % 4096 + 64 * beats <= 4096, (t, hex(addr), beats)
        assert self.exp_bursts, (t, "unexpected burst", hex(addr), beats)
        assert (addr, beats) == self.exp_bursts.popleft(), (t, hex(addr), beats)
        self.issued += beats
        buffer = self.dut.buffer_blocks
        assert self.issued - self.received <= buffer, (t, self.issued, self.received)
        # Blocks of the fetch being parsed go back one by one, out of sight until its end.
        assert self.issued - self.parsed <= buffer + 16, (t, self.issued, self.parsed)
        start = max(t + 1 + self.rng.randint(*self.latency),
                    self.beats[-1][0] if self.beats else 0)
        for k in range(beats):
            self.beats.append((start, addr + 64 * k, k == beats - 1))
        self.ar_log.append((t, addr, beats))

    def take_descriptor(self, t, got):
        assert self.exp_desc, (t, "unexpected descriptor", got)
        fetch, want = self.exp_desc.popleft()
        diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        assert not diff, (t, want["qpn"], want["wqe_index"], diff)
        self.descriptors += 1
        if not fetch[2]:
            fetch[1] += got["wqe_blocks"]
            self.parsed += got["wqe_blocks"]
        self.wqe_cycles.append(t)
        self.desc_log.append(got)

    def take_done(self, t, qpn, consumed, epoch):
        assert self.exp_done, (t, "unexpected fetch done")
        want_qpn, want_consumed, want_epoch, fetch = self.exp_done.popleft()
        assert (qpn, consumed, epoch) == (want_qpn, want_consumed, want_epoch), \
            (t, qpn, consumed, epoch)
        self.parsed += fetch[0] - fetch[1]
        fetch[2] = True
        self.done_log.append((t, qpn, consumed))


def run_bench(dut, rings, requests, **kwargs):
    bench = Bench(dut, rings, requests, **kwargs)

    async def body(ctx):
        await bench.run(ctx)

    simulate(dut, body)
    return bench


# --- Random traffic ---------------------------------------------------------------------------

def random_rings(rng, num_qps):
    """Rings of many sizes: 1 block, small ones inside a 4 KiB page, one page, and rings
    of several pages (4 KiB boundaries inside); high 64-bit base addresses."""
    logs = [0, 2, 4, 6, 7, 8, 5, 3]
    rings = {}
    base = 0x7F12_3400_0000_0000
    for q in range(num_qps):
        log = logs[q % len(logs)]
        size = 64 << log
        align = min(4096, size)
        base = -(-base // align) * align
        bad = {rng.randrange(1 << log) for _ in range((1 << log) // 16)} if q % 3 == 1 else ()
        rings[q] = Ring(rng, base, log, bad=bad)
        base += size + align * rng.randrange(3)
    return rings


def random_requests(rng, rings, num_qps, count):
    out = []
    for _ in range(count):
        x = rng.random()
        qpn = rng.randrange(num_qps)
        ring = rings[qpn]
        if x < 0.85:
            index = rng.choice(ring.starts) if rng.random() < 0.9 else rng.randrange(ring.size)
            index = (index + ring.size * rng.randrange(1 << 16)) & 0xFFFF
            blocks = rng.choice([1, 2, 16, rng.randint(1, 16), rng.randint(1, 16)])
        elif x < 0.9:
            index, blocks = rng.randrange(1 << 16), rng.choice([0, 17, 31])
        elif x < 0.95:
            index, blocks = rng.randrange(1 << 16), rng.randint(1, 16)
            qpn = rng.randrange(num_qps, 256)
        else:
            index = (rng.choice(ring.starts) + 0xFFF0) & 0xFFFF if ring.size <= 16 else 0xFFF8
            blocks = 16
        out.append((qpn, index, blocks, int(rng.random() < 0.2), rng.randrange(16)))
    return out


@pytest.mark.parametrize("seed, buffer_blocks, fast", [
    (1, 256, False), (2, 256, True), (3, 16, False), (4, 40, False),
])
def test_random(seed, buffer_blocks, fast):
    rng = random.Random(seed)
    num_qps = 8
    dut = WqeFetcher(num_qps=num_qps, buffer_blocks=buffer_blocks)
    rings = random_rings(rng, num_qps)
    requests = random_requests(rng, rings, num_qps, 220)
    if fast:
        bench = run_bench(dut, rings, requests, rng=rng, fetch_p=0.9, ar_p=1.0,
                          latency=(1, 5), gap_p=0.0, wqe_p=1.0)
    else:
        bench = run_bench(dut, rings, requests, rng=rng)
    assert bench.descriptors > 200
    assert bench.read_errors > 0
    assert bench.refetched > 0


# --- Directed ---------------------------------------------------------------------------------

def one_ring(rng, wqes, *, log=6, base=0x4000_0000, bad=()):
    ring = Ring.__new__(Ring)
    ring.base, ring.log, ring.size = base, log, 1 << log
    ring.mem = bytearray(rbytes(rng, 64 * ring.size))
    ring.starts, ring.bad = [], set(bad)
    at = 0
    for wqe in wqes:
        ring.place(at, wqe)
        at += len(wqe) // 64
    return ring


def test_format_errors():
    """Every row of the segment table, with the syndrome spelled out by hand."""
    rng = random.Random(10)
    cases = bad_wqes(rng)
    good = [good_wqe(rng, kind) for kind in ["write", "send", "read", "atomic", "empty", "masked"]]
    # Gather lists whose ds stops before an inline-marked segment (past the WQE: not read),
    # of 2 (the mark at byte 48 of block 0) and 4 (at byte 16 of block 1), both SENDs.
    s = OPS["SEND"]
    past_ds = [wqe_bytes(rng, ctrl_seg(rng, s, 3), data_seg(rng), data_seg(rng),
                         inline_seg(rng, 8)),
               wqe_bytes(rng, ctrl_seg(rng, s, 5), *[data_seg(rng) for _ in range(4)],
                         inline_seg(rng, 8))]
    wqes = [wqe for _, wqe in cases] + good + past_ds
    assert sum(len(wqe) for wqe in wqes) <= 64 * 128
    ring = one_ring(rng, wqes, log=7)
    requests = [(0, index, len(wqe) // 64, 0) for index, wqe in zip(ring.starts, wqes)]
    bench = run_bench(WqeFetcher(num_qps=1), {0: ring}, requests, rng=rng)
    seen = [(d["format_error"], d["syndrome"]) for d in bench.desc_log]
    assert seen == [(1, syndrome) for syndrome, _ in cases] + [(0, 0)] * 8
    assert [d["segments"] for d in bench.desc_log[-2:]] == [2, 4]


def test_read_errors():
    """RRESP not OKAY: on a WQE's first block it is a one-block error WQE (its contents
    unknown) and the next block starts a WQE; on a later block the WQE keeps its control
    fields, and LOCAL_QP_OP wins over the WQE's own format error (a three-block WQE with
    too long inline data and a bad middle block)."""
    rng = random.Random(11)
    w = OPS["RDMA_WRITE"]
    two = [wqe_bytes(rng, ctrl_seg(rng, w, inline_ds(2, 64)), raddr_seg(rng), inline_seg(rng, 64))
           for _ in range(3)]
    one = good_wqe(rng, "read")
    three = wqe_bytes(rng, ctrl_seg(rng, w, 10), raddr_seg(rng), inline_seg(rng, 130))
    ring = one_ring(rng, two + [one, three], bad={0, 3, 8})
    requests = [(0, 0, 2, 0), (0, 2, 2, 0), (0, 4, 2, 0), (0, 6, 1, 0), (0, 7, 3, 0)]
    bench = run_bench(WqeFetcher(num_qps=1), {0: ring}, requests, rng=rng)
    assert bench.read_errors == 3
    last = bench.desc_log[-1]
    assert (last["wqe_index"], last["wqe_blocks"], last["ds"]) == (7, 3, 10)
    assert (last["format_error"], last["syndrome"]) == (1, QP_OP)
    # first fetch: the bad control block alone, then its second block parsed as a WQE
    first = ref_descriptor([ring.block(0)], [True], 0, 0)
    assert first["wqe_blocks"] == 1 and first["opcode"] == 0
    assert bench.done_log[0][2] == 2 - (ref_length(ring.block(1), False) > 1)
    # second fetch: good control block, bad second block
    second = ref_descriptor([ring.block(2), ring.block(3)], [False, True], 0, 2)
    assert second["opcode"] == w and second["format_error"] == 1 and second["raddr"] == 0
    assert [d[1:] for d in bench.done_log[1:]] == [(0, 2), (0, 2), (0, 1), (0, 3)]


def test_bursts_split():
    """Exact bursts: ring end (wrap to sq_base) and 4 KiB boundaries, on an 8 KiB ring, a
    1 KiB ring and a 1-block ring (a fetch of it reads the block again and again)."""
    rng = random.Random(12)
    big = one_ring(rng, [good_wqe(rng, "read") for _ in range(128)], log=7, base=0x10_0000_0000)
    small = one_ring(rng, [one_block(rng, "send") for _ in range(16)], log=4, base=0x2400)
    tiny = one_ring(rng, [good_wqe(rng, "atomic")], log=0, base=0x3040)
    rings = {0: big, 1: small, 2: tiny}
    requests = [(0, 60, 8, 0), (0, 124, 8, 0), (0, 0xFFFE, 4, 0), (0, 3, 16, 0),
                (1, 12, 8, 0), (1, 0x10, 16, 0), (2, 7, 3, 0)]
    bench = run_bench(WqeFetcher(num_qps=4), rings, requests, rng=rng)
    b = 0x10_0000_0000
    assert [(a, n) for _, a, n in bench.ar_log] == [
        (b + 64 * 60, 4), (b + 4096, 4), (b + 64 * 124, 4), (b, 4),
        (b + 64 * 126, 2), (b, 2), (b + 64 * 3, 16),
        (0x2400 + 64 * 12, 4), (0x2400, 4), (0x2400, 16),
        (0x3040, 1), (0x3040, 1), (0x3040, 1),
    ]
    assert [d[2] for d in bench.done_log] == [8, 8, 4, 16, 8, 16, 3]


def test_rejected_requests():
    """``blocks`` 0 or above 16 and unknown QPs: nothing read, fetch done with 0."""
    rng = random.Random(13)
    ring = one_ring(rng, [good_wqe(rng, "write") for _ in range(8)], log=3)
    requests = [(0, 0, 0, 0), (1, 0, 17, 0), (0, 0, 31, 1), (2, 0, 4, 0), (255, 3, 1, 0),
                (1, 0, 2, 0)]
    bench = run_bench(WqeFetcher(num_qps=2), {0: ring, 1: ring}, requests, rng=rng)
    assert [d[1:] for d in bench.done_log[:5]] == [(0, 0), (1, 0), (0, 0), (2, 0), (255, 0)]
    assert [(a, n) for _, a, n in bench.ar_log] == [(ring.base, 2)]


def test_first_only_and_cut():
    """``first_only`` stops after the first WQE; a WQE longer than what is left of the
    fetch is dropped with the rest of it (both counted as refetched)."""
    rng = random.Random(14)
    w = OPS["RDMA_WRITE"]
    two = wqe_bytes(rng, ctrl_seg(rng, w, inline_ds(2, 64)), raddr_seg(rng), inline_seg(rng, 64))
    ring = one_ring(rng, [one_block(rng, "send"), two, one_block(rng, "send"), two,
                          good_wqe(rng, "read")], log=3)
    requests = [(0, 0, 5, 1), (0, 0, 2, 0), (0, 0, 3, 0), (0, 1, 4, 1), (0, 1, 1, 0),
                (0, 0, 7, 0)]
    bench = run_bench(WqeFetcher(num_qps=1), {0: ring}, requests, rng=rng)
    assert [d[2] for d in bench.done_log] == [1, 1, 3, 2, 0, 7]
    assert bench.refetched == 4 + 1 + 0 + 2 + 1 + 0


def test_reservation_with_stalled_consumer():
    """With ``wqe`` stalled, the parser takes one block (into the descriptor register) and
    stops: exactly ``buffer_blocks`` + 1 blocks are requested (two 16-block fetches, then
    one of the one-block fetches behind them), however long the stall."""
    rng = random.Random(15)
    ring = one_ring(rng, [one_block(rng, "send") for _ in range(64)], log=6)
    requests = ([(0, 0, 16, 0), (0, 16, 16, 0)] + [(0, 32 + k, 1, 0) for k in range(8)]
                + [(0, 40, 16, 0)])
    stall = 400
    bench = run_bench(WqeFetcher(num_qps=1, buffer_blocks=32), {0: ring}, requests, rng=rng,
                      wqe_p=lambda t: t >= stall)
    assert sum(n for t, _, n in bench.ar_log if t < stall) == 33
    assert bench.wqe_cycles[0] == stall
    assert len(bench.wqe_cycles) == 56


@pytest.mark.parametrize("requests", [
    [(0, 0, 16, 0)] * 4,
    [(0, k, 1, 0) for k in range(48)],
], ids=["sixteen-block fetches", "one-block fetches"])
def test_throughput(requests):
    """One-block WQEs at one descriptor per cycle once their data is there (memory
    returning a beat every cycle, consumer always ready)."""
    rng = random.Random(16)
    ring = one_ring(rng, [one_block(rng) for _ in range(64)], log=6)
    bench = run_bench(WqeFetcher(num_qps=1), {0: ring}, requests, rng=rng, fetch_p=1.0,
                      ar_p=1.0, latency=(8, 8), gap_p=0.0, wqe_p=1.0)
    cycles = bench.wqe_cycles
    assert len(cycles) == sum(r[2] for r in requests)
    assert cycles[-1] - cycles[0] == len(cycles) - 1, cycles


def one_block(rng, kind=None):
    while True:
        wqe = good_wqe(rng, kind)
        if len(wqe) == 64:
            return wqe


def test_two_block_wqes_rate():
    """Two-block WQEs: one descriptor every other cycle."""
    rng = random.Random(17)
    w = OPS["RDMA_WRITE_IMM"]
    ring = one_ring(rng, [wqe_bytes(rng, ctrl_seg(rng, w, 7), raddr_seg(rng), inline_seg(rng, 63))
                          for _ in range(32)], log=6)
    bench = run_bench(WqeFetcher(num_qps=1), {0: ring}, [(0, 0, 16, 0)] * 4, rng=rng,
                      fetch_p=1.0, ar_p=1.0, latency=(8, 8), gap_p=0.0, wqe_p=1.0)
    cycles = bench.wqe_cycles
    assert len(cycles) == 32
    assert [b - a for a, b in zip(cycles, cycles[1:])] == [2] * 31


@pytest.mark.parametrize("kwargs", [
    dict(num_qps=0), dict(num_qps=257), dict(num_qps=2.0),
    dict(buffer_blocks=15), dict(buffer_blocks=4097), dict(buffer_blocks=None),
])
def test_parameters(kwargs):
    # A component whose constructor raised would warn, when collected, that it was never
    # elaborated: collect it here with that warning off.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        try:
            with pytest.raises(ValueError, match="must be"):
                WqeFetcher(**kwargs)
        finally:
            gc.collect()
