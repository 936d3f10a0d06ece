"""LinkReceiver alone in Amaranth's simulator: packets that end without their last bytes take
buffer beats beyond their bytes (the empty end beat that closes a packet cut short, an end beat
of no bytes), and are charged for them, so that a peer keeping the credit rule never
overflows the buffer (found by the proof in docs/formal.md). A good packet at the head, which
the stalled consumer does not take, keeps the packets behind it in the buffer."""
import pytest

from hdl.link.link_receiver import LinkReceiver
from hdl.link.signatures import FCCL_BITS, LinkState
from models.crc import vcrc_bytes
from models.ib import LRH, FlowControl
from tb.amaranth_sim import simulate

MODULUS = 1 << FCCL_BITS
PKTLEN = 31                 # 126 bytes on the wire: 2 blocks, cut short after the first


def beat(width, data=b"", *, start=0, end=0, count=0, link=0):
    return dict(valid=1, data=int.from_bytes(data.ljust(width, b"\0"), "little"), start=start,
                end=end, count=count, link=link)


def whole_packet(width, pktlen):
    """A packet of ``pktlen`` words on VL 0 with its VCRC: good, whatever its bytes."""
    packet = LRH(vl=0, pktlen=pktlen).pack().ljust(4 * pktlen, b"\xa5")
    packet += vcrc_bytes(packet)
    chunks = [packet[at:at + width] for at in range(0, len(packet), width)]
    return [beat(width, chunk, start=n == 0, end=n == len(chunks) - 1, count=len(chunk))
            for n, chunk in enumerate(chunks)]


def packet_cut_short(width, fctbs, ending):
    """One block of a 2-block packet on VL 0, then what ends it: the peer's flow-control packet
    (which also carries its FCTBS), or an end beat with no bytes."""
    beats = [beat(width, LRH(vl=0, pktlen=PKTLEN).pack(), start=1)]
    beats += [beat(width) for _ in range(64 // width - 1)]
    if ending == "end_beat_of_no_bytes":
        beats.append(beat(width, end=1, count=0))
    beats.append(beat(width, FlowControl(fctbs=fctbs, vl=0).pack(), start=1, end=1,
                      count=FlowControl.SIZE, link=1))
    return beats


@pytest.mark.parametrize("ending", ["flow_control_packet", "end_beat_of_no_bytes"])
@pytest.mark.parametrize("width, buffer_blocks", [(8, 12), (16, 12), (64, 6)])
def test_packets_cut_short_at_a_block_boundary_never_overflow(width, buffer_blocks, ending):
    dut = LinkReceiver(width=width, num_vls=2, mtu=256, buffer_blocks=buffer_blocks)
    record = {"overflow": 0, "sent": 0}

    async def testbench(ctx):
        ctx.set(dut.state, LinkState.ACTIVE)

        async def step(fields=None):
            for name in ("valid", "data", "start", "end", "count", "link"):
                ctx.set(getattr(dut.wire, name), (fields or {}).get(name, 0))
            await ctx.tick()
            record["overflow"] |= ctx.get(dut.overflow)

        fctbs = 0
        for fields in whole_packet(width, 6):   # 1 block, at the head for good
            await step(fields)
        fctbs += 1
        while not record["overflow"]:
            for _ in range(6):          # the credit loop: FCCL follows in 4 cycles
                await step()
            credit = (ctx.get(dut.fccl[0]) - fctbs) % MODULUS
            if credit > 2048 or credit < 1:
                break
            if credit == 1:             # room for a last packet of a block only
                for fields in whole_packet(width, 15):
                    await step(fields)
                fctbs += 1
                continue
            fctbs += 2
            record["sent"] += 1
            for fields in packet_cut_short(width, fctbs, ending):
                await step(fields)
        for _ in range(6):
            await step()
        # Drain: every block comes back.
        ctx.set(dut.data_out[0].ready, 1)
        for _ in range(8 * buffer_blocks * max(1, 64 // width)):
            await step()
        record["used"] = ctx.get(dut.used_blocks[0])
        record["room"] = (ctx.get(dut.fccl[0]) - fctbs) % MODULUS

    simulate(dut, testbench)
    assert record["sent"] >= 2
    assert record["overflow"] == 0, f"{record['sent']} packets, each within credit, overflowed"
    assert record["used"] == 0 and record["room"] == buffer_blocks, record
