"""Random WQE mixes for the NIC testbenches: the fields of one valid WQE of a given kind,
for :func:`models.mlx5.build_wqe` (through a testbench's ``builder``)."""
from models import mlx5

__all__ = ["KINDS", "RECEIVING_KINDS", "wqe_fields", "gather_list"]

Op = mlx5.Opcode
KINDS = ("write_inline", "write", "write_imm", "send", "send_imm", "send_inline", "read",
         "fetch_add", "compare_swap", "nvshmem_atomic")
RECEIVING_KINDS = frozenset({"send", "send_imm", "send_inline", "write_imm"})   # take a receive WQE


def wqe_fields(kind, rng, *, length, lkey, laddr, raddr, rkey, read_raddr=None,
               atomic_raddr=None):
    """A WQE of ``kind`` (one of :data:`KINDS`): ``length`` bytes from ``laddr`` (key
    ``lkey``) to ``raddr`` (key ``rkey``); a READ reads ``read_raddr`` and an atomic works
    on ``atomic_raddr`` when given (else ``raddr``, 8-byte aligned down). Signaled 4 times
    in 5, solicited 1 in 5; immediates, inline bytes and atomic operands random.
    ``nvshmem_atomic``: a random NVSHMEM operation of 4 or 8 bytes as NVSHMEM posts it
    (:func:`models.mlx5.nvshmem_atomic_fields`; a 4-byte one on either half of the word).
    A WRITE or SEND is a gather list (:func:`gather_list`) 1 time in 4."""
    signaled = mlx5.CTRL_CQ_UPDATE if rng.random() < 0.8 else 0
    fields = dict(fm_ce_se=signaled | (mlx5.CTRL_SOLICITED if rng.random() < 0.2 else 0))
    if kind in ("write_inline", "send_inline"):
        fields.update(opcode=Op.RDMA_WRITE if kind == "write_inline" else Op.SEND,
                      inline=rng.randbytes(rng.randrange(0, 257)))
        if kind == "write_inline":
            fields.update(raddr=raddr, rkey=rkey)
    elif kind in ("write", "write_imm", "send", "send_imm"):
        opcode = {"write": Op.RDMA_WRITE, "write_imm": Op.RDMA_WRITE_IMM, "send": Op.SEND,
                  "send_imm": Op.SEND_IMM}[kind]
        fields.update(opcode=opcode, byte_count=length, lkey=lkey, laddr=laddr,
                      imm=rng.getrandbits(32))
        if rng.random() < 0.25:
            fields["gather"] = gather_list(rng, length=length, lkey=lkey, laddr=laddr)
        if kind.startswith("write"):
            fields.update(raddr=raddr, rkey=rkey)
    elif kind == "read":
        fields.update(opcode=Op.RDMA_READ, byte_count=length, lkey=lkey, laddr=laddr,
                      raddr=raddr if read_raddr is None else read_raddr, rkey=rkey)
    elif kind in ("fetch_add", "compare_swap"):
        fields.update(opcode=Op.ATOMIC_FA if kind == "fetch_add" else Op.ATOMIC_CS,
                      lkey=lkey, laddr=laddr & ~7,
                      raddr=(raddr if atomic_raddr is None else atomic_raddr) & ~7, rkey=rkey,
                      swap_add=rng.getrandbits(64), compare=rng.getrandbits(64))
    elif kind == "nvshmem_atomic":
        nbytes = rng.choice([4, 8])
        word = (raddr if atomic_raddr is None else atomic_raddr) & ~7
        fields.update(mlx5.nvshmem_atomic_fields(
            rng.choice(mlx5.NVSHMEM_AMOS), nbytes, rng.getrandbits(64), rng.getrandbits(64)),
            lkey=lkey, laddr=laddr & ~7, byte_count=nbytes, rkey=rkey,
            raddr=word + (rng.choice([0, 4]) if nbytes == 4 else 0))
    else:
        raise ValueError(f"unknown WQE kind {kind!r}")
    return fields


def gather_list(rng, *, length, lkey, laddr):
    """1 to 4 data segments (``(byte_count, lkey, laddr)`` each, zero-length ones among
    them) holding the ``length`` bytes from ``laddr`` cut at random points and put in a
    random order, so a message's segments are neither contiguous nor ascending."""
    cuts = sorted(rng.randint(0, length) for _ in range(rng.randint(0, 3)))
    bounds = [0] + cuts + [length]
    segments = [(high - low, lkey, laddr + low) for low, high in zip(bounds, bounds[1:])]
    rng.shuffle(segments)
    return segments
