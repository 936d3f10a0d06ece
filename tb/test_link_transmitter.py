"""LinkTransmitter's credit decision in Amaranth's simulator: the registered credit view
against IBA's modular rule for every limit, and the transmitter under limits of every kind
(inside the window, past FCTBS, and the odd range where FCCL - FCTBS > 2048): a packet starts
only when (FCCL - (FCTBS + blocks)) mod 4096 <= 2048, checked in the cycle it is taken
against FCTBS and the limit the transmitter's registered view was made from (the previous
cycle's: a credit update counts from the second cycle after it)."""
import random

from amaranth.hdl import Module, Signal

from hdl.link.link_transmitter import CREDIT_WINDOW, LinkTransmitter, credit_view
from hdl.link.signatures import FCCL_BITS, LinkState, blocks_of, max_wire_bytes
from tb.amaranth_sim import Driver, simulate

MASK = (1 << FCCL_BITS) - 1


def rule(limit, fctbs, blocks):
    return ((limit - fctbs - blocks) & MASK) <= CREDIT_WINDOW


def test_credit_view_is_the_iba_rule():
    max_blocks = blocks_of(max_wire_bytes(4096))
    bits = max_blocks.bit_length()
    m = Module()
    limit, fctbs, ahead = Signal(FCCL_BITS), Signal(FCCL_BITS), Signal(FCCL_BITS)
    lim, over = credit_view(m, limit, fctbs, ahead, bits, name="view")
    lim_out, over_out = Signal(bits + 1), Signal()
    m.d.comb += [lim_out.eq(lim), over_out.eq(over)]
    rng = random.Random(16)
    # Every wrap of the three ranges, both ends of the window, and random ones.
    counts = [0, 1, 127, 128, 1919, 1920, 1983, 2047, 2048, 2049, 3967, 3968, 4000, 4095]
    counts += [rng.randrange(4096) for _ in range(4)]

    async def testbench(ctx):
        for count in counts:
            ctx.set(fctbs, count)
            ctx.set(ahead, (count + (1 << bits)) & MASK)
            for room in range(4096):
                ctx.set(limit, (count + room) & MASK)
                lim_value, over_value = ctx.get(lim_out), ctx.get(over_out)
                for blocks in range(1, max_blocks + 1):
                    fits = bool(over_value) ^ (blocks - 1 < lim_value)
                    assert fits == rule(count + room, count, blocks), \
                        f"FCTBS {count} room {room} blocks {blocks}: view says {fits}"

    simulate(m, testbench, clock=False)


def beats(rng, width, nbytes, pktlen):
    data = bytearray(rng.randrange(256) for _ in range(nbytes))
    data[4] = (pktlen >> 8) & 7
    data[5] = pktlen & 0xFF
    count = -(-nbytes // width)
    return [dict(data=int.from_bytes(bytes(data[i * width:(i + 1) * width]), "little"),
                 start=int(i == 0), end=int(i == count - 1),
                 count=nbytes - i * width if i == count - 1 else width, end_bad=0)
            for i in range(count)]


def test_transmitter_starts_only_what_the_rule_allows():
    width, num_vls = 16, 2
    dut = LinkTransmitter(width=width, num_vls=num_vls, fc_period=1024, fc_min_interval=512)
    rng = random.Random(7)

    def packet():
        # Mostly one-beat packets (back to back on one VL), some longer, a few whose PktLen
        # claims more than the beats carry.
        words = rng.choice([rng.randrange(2, (width - 2) // 4 + 1), rng.randrange(2, 200)])
        pktlen = rng.randrange(2048) if rng.random() < 0.02 else words
        return beats(rng, width, 4 * words, pktlen)

    async def testbench(ctx):
        drive = Driver()
        drive.set(dut.state, LinkState.ACTIVE)
        for v in range(num_vls):
            drive.set(dut.vl_weight[v], 16)
        queues = [[] for _ in range(num_vls)]
        starts = odd_starts = 0
        previous_limit = [0] * num_vls
        for cycle in range(6000):
            update = rng.random() < 0.1
            vl = rng.randrange(num_vls)
            fctbs = ctx.get(dut.fctbs[vl])
            kind = rng.random()
            if kind < 0.2:
                fccl = rng.randrange(4096)
            elif kind < 0.7:
                fccl = fctbs + rng.randrange(-8, 150)
            else:
                fccl = fctbs + CREDIT_WINDOW + rng.randrange(-8, 20)
            drive.set(dut.credit_update.valid, update)
            drive.set(dut.credit_update.vl, vl)
            drive.set(dut.credit_update.fccl, fccl & MASK)
            valid = []
            for v in range(num_vls):
                if not queues[v]:
                    queues[v] = packet()
                valid.append(rng.random() < 0.9)
                drive.set(dut.data_in[v].valid, valid[v])
                drive.set(dut.data_in[v].payload, queues[v][0])
            drive.apply(ctx)
            for v in range(num_vls):
                if valid[v] and ctx.get(dut.data_in[v].ready):
                    beat = queues[v].pop(0)
                    pktlen = ((beat["data"] >> 32) & 7) << 8 | (beat["data"] >> 40) & 0xFF
                    # (A head beyond the MTU is taken too: it is discarded, not started.)
                    if beat["start"] and 4 * pktlen + 2 <= max_wire_bytes(dut.mtu):
                        blocks = blocks_of(4 * pktlen + 2)
                        limit, count = previous_limit[v], ctx.get(dut.fctbs[v])
                        assert rule(limit, count, blocks), \
                            f"cycle {cycle}: VL {v} started {blocks} blocks, FCTBS {count}, FCCL {limit}"
                        starts += 1
                        odd_starts += ((limit - count) & MASK) > CREDIT_WINDOW
            previous_limit = [ctx.get(dut.credit_limit[v]) for v in range(num_vls)]
            await ctx.tick()
        # The credit rule let traffic through, including from the odd range.
        assert starts > 300 and odd_starts > 0, (starts, odd_starts)

    simulate(dut, testbench)


def test_a_start_flag_inside_a_packet_starts_nothing():
    """A malformed upstream sets the start flag on a beat inside a packet: the wire still
    carries one packet (one start beat, the credit counted once) and its VCRC, restarted at
    that beat, is not the packet's, so the peer drops it (docs/link.md)."""
    from models.crc import vcrc_bytes

    width = 16
    dut = LinkTransmitter(width=width, num_vls=1, fc_period=1024, fc_min_interval=512)
    rng = random.Random(3)
    good = beats(rng, width, 48, 12)
    flagged = [dict(beat) for beat in good]
    flagged[1]["start"] = 1

    async def testbench(ctx):
        ctx.set(dut.state, LinkState.ACTIVE)
        ctx.set(dut.vl_weight[0], 16)
        ctx.set(dut.credit_update.valid, 1)
        ctx.set(dut.credit_update.fccl, 100)
        await ctx.tick()
        ctx.set(dut.credit_update.valid, 0)
        queue = flagged + good
        wire = []
        for _ in range(40):
            ctx.set(dut.data_in[0].valid, bool(queue))
            if queue:
                ctx.set(dut.data_in[0].payload, queue[0])
            taken = queue and ctx.get(dut.data_in[0].ready)
            if ctx.get(dut.wire.valid) and not ctx.get(dut.wire.link):
                wire.append({name: ctx.get(getattr(dut.wire, name))
                             for name in ("data", "start", "end", "count")})
            await ctx.tick()
            if taken:
                queue.pop(0)
        assert not queue
        assert [beat["start"] for beat in wire] == [1, 0, 0, 0, 1, 0, 0, 0], wire
        assert ctx.get(dut.fctbs[0]) == 2 * blocks_of(50)
        packets = [wire[:4], wire[4:]]
        payload = b"".join(beat["data"].to_bytes(width, "little") for beat in good[:3])
        on_wire = [b"".join(beat["data"].to_bytes(width, "little")[:beat["count"]]
                            for beat in packet) for packet in packets]
        assert on_wire[1] == payload + vcrc_bytes(payload)        # the good packet's VCRC
        assert on_wire[0][:48] == payload and on_wire[0][48:] != vcrc_bytes(payload)

    simulate(dut, testbench)
