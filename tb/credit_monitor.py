"""The IBA credit rule checked on the wire, at the sender: every data packet that starts must be
covered by the flow-control credit its peer had granted (docs/link.md, "Credit rule on the
wire"). One :class:`CreditMonitor` watches one sender; testbenches with links run one per
sender, always on."""
from collections import deque

from models.ib import FlowControl, FlowControlOp
from models.link import CreditSender
from models.packet import blocks

__all__ = ["CreditMonitor", "CreditViolation", "FC_TO_START_CYCLES"]

# A flow-control packet on a port's wire_in in cycle c governs the data packets whose start
# beat is on its wire_out from cycle c + 7: the receiver reports it in c + 3, the credit limit
# register takes it in c + 4, the credit view in c + 5, where a start is decided; the beat
# register and the wire register follow (docs/link.md, Timing).
FC_TO_START_CYCLES = 7

WIRE_FIELDS = ("valid", "data", "start", "end", "count", "link")


class CreditViolation(AssertionError):
    pass


class CreditMonitor:
    """Checks one sender's data packets against its peer's flow-control credit.

    ``out_prefix``: the wire the sender drives; ``in_prefix``: the wire into the sender (its
    peer's flow-control packets), both ``<prefix>__valid`` etc. of ``dut``. A wire seen
    elsewhere than at the sender's pins is shifted to them by ``out_offset``/``in_offset``
    cycles: the far end of a pure-delay cable of d cycles is watched from the near end's
    pins with the near end's ``in`` wire as its ``out`` (offset -d) and the near end's
    ``out`` wire as its ``in`` (offset +d).

    Per VL it keeps the sender's FCTBS (the blocks of the data packets it started, from
    LRH.PktLen as the receiver charges them, on the VL of LRH.VL) and the latest FCCL of a
    good flow-control packet from the peer that the sender could have used, and raises
    :class:`CreditViolation` at the first start beat for which
    ``(FCCL - (FCTBS + blocks)) mod 4096 > 2048`` (``models.link.CreditSender``). The
    sender's own flow-control packets restart its FCTBS (INIT: the sender was cleared) or
    must agree with it (NORMAL).
    """

    def __init__(self, dut, out_prefix, in_prefix, width, num_vls, *, name, out_offset=0,
                 in_offset=0):
        if width < 8:
            raise ValueError(f"the LRH must fit a start beat: width {width} < 8")
        self.out = {f: getattr(dut, f"{out_prefix}__{f}") for f in WIRE_FIELDS}
        self.into = {f: getattr(dut, f"{in_prefix}__{f}") for f in WIRE_FIELDS}
        self.width = width
        self.num_vls = num_vls
        self.name = name
        self.out_offset = out_offset
        self.in_offset = in_offset
        self.vls = [CreditSender(0) for _ in range(num_vls)]
        self.granted = deque()      # (cycle at the sender, vl, fccl) not yet usable
        self.packets = [0] * num_vls    # data packets checked, per VL

    def _first_bytes(self, wire, count):
        return int(wire["data"].value).to_bytes(self.width, "little")[:count]

    def sample(self, cycle):
        if int(self.into["valid"].value) and int(self.into["link"].value):
            fc = self._flow_control(self.into)
            if fc is not None:
                self.granted.append((cycle + self.in_offset, fc.vl, fc.fccl))
        if not int(self.out["valid"].value):
            return
        now = cycle + self.out_offset
        if int(self.out["link"].value):
            fc = self._flow_control(self.out)
            if fc is None:
                return
            sender = self.vls[fc.vl]
            if fc.op == FlowControlOp.INIT:
                sender.fctbs = fc.fctbs
            elif fc.fctbs != sender.fctbs:
                raise CreditViolation(
                    f"{self.name}, cycle {now}: VL {fc.vl} flow-control packet says FCTBS "
                    f"{fc.fctbs}, but the data packets on the wire add up to {sender.fctbs}")
            return
        if not int(self.out["start"].value):
            return
        head = self._first_bytes(self.out, 8)
        vl = head[0] >> 4
        if vl >= self.num_vls:
            return          # the receiver drops it (invalid_vl): it takes no credit
        while self.granted and self.granted[0][0] <= now - FC_TO_START_CYCLES:
            _, fc_vl, fccl = self.granted.popleft()
            self.vls[fc_vl].update(fccl)
        pktlen = ((head[4] & 0x7) << 8) | head[5]
        need = blocks(pktlen * 4 + 2)
        sender = self.vls[vl]
        if not sender.can_send(need):
            raise CreditViolation(
                f"{self.name}, cycle {now}: a packet of {need} blocks started on VL {vl} with "
                f"FCTBS {sender.fctbs} and the peer's FCCL {sender.limit}: "
                f"{sender.blocks_available()} blocks of credit")
        sender.sent(need)
        self.packets[vl] += 1

    def _flow_control(self, wire):
        """The flow-control packet on ``wire`` as a receiver takes it, or None (malformed, bad
        LPCRC, not a data VL: dropped and counted by the receiver)."""
        if not (int(wire["start"].value) and int(wire["end"].value)
                and int(wire["count"].value) == FlowControl.SIZE):
            return None
        raw = self._first_bytes(wire, FlowControl.SIZE)
        if not FlowControl.lpcrc_ok(raw):
            return None
        fc = FlowControl.unpack(raw)
        if fc.op > FlowControlOp.INIT or fc.vl >= self.num_vls:
            return None
        return fc

    def drive(self, cycle):
        pass
