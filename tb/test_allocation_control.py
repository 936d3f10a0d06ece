"""AllocationControl (hdl/switch/allocation_control.py) in Amaranth's simulator: an output's offer
to the allocator after a start to it (docs/switch.md, In the switch, Allocate ahead). A packet
near its end from its start on (at most ALLOC_STAGES + 1 beats) leaves the output offered in
the cycles after its start, so 1-beat packets can start back to back; a longer one withdraws
the offer from the cycle after its start until its beats left say it is near its end."""
import pytest

from hdl.link.signatures import BLOCK_BYTES
from tb.amaranth_sim import simulate

PORTS, VLS = 4, 2


def offers_after_start(width, blocks):
    """Input 1 starts its only match, a packet of ``blocks`` blocks to output 0 on VL 0, from
    idle ports; its reader then sends the packet as the input buffer does (a beat handed to the
    crossbar every cycle). Returns output 0's ``out_ready`` in the start cycle and each cycle
    after it while the packet lasts."""
    from hdl.switch.allocation_control import AllocationControl
    dut = AllocationControl(ports=PORTS, num_vls=VLS, width=width)
    i, o, v = 1, 0, 0
    q = o * VLS + v
    beats = max(1, blocks * BLOCK_BYTES // width)
    offers = []

    async def testbench(ctx):
        ctx.set(dut.enabled, (1 << PORTS) - 1)
        ctx.set(dut.heads[i][q].valid, 1)
        ctx.set(dut.heads[i][q].blocks, blocks)
        await ctx.tick().repeat(2)          # the offers' registers see idle ports
        ctx.set(dut.match, 1 << (i * PORTS + o))
        ctx.set(dut.start_head, 1 << ((i * PORTS + o) * VLS + v))
        assert ctx.get(dut.start) == 1 << i
        offers.append(ctx.get(dut.out_ready) >> o & 1)
        await ctx.tick()
        # The reader holds the packet from the cycle after the start (VoqBuffer).
        ctx.set(dut.match, 0)
        ctx.set(dut.start_head, 0)
        ctx.set(dut.heads[i][q].valid, 0)
        ctx.set(dut.active, 1 << i)
        ctx.set(dut.sending, 1 << i)
        ctx.set(dut.out_port[i], o)
        ctx.set(dut.beat_valid, 1 << i)
        ctx.set(dut.beat_ready, 1 << i)
        for n in range(beats):
            ctx.set(dut.beat_start, (n == 0) << i)
            ctx.set(dut.beat_pktlen[i], blocks * BLOCK_BYTES // 4)
            ctx.set(dut.finishing, (n == beats - 1) << i)
            offers.append(ctx.get(dut.out_ready) >> o & 1)
            await ctx.tick()

    simulate(dut, testbench)
    return offers


@pytest.mark.parametrize("width", [16, 64])
def test_short_packet_keeps_its_output_offered(width):
    """The longest packet near its end from the start (4 beats: 1 block at 16-byte beats, 4 at
    64) leaves its output offered in every cycle."""
    blocks = 4 * width // BLOCK_BYTES
    assert offers_after_start(width, blocks) == [1] * (1 + 4)


@pytest.mark.parametrize("width", [16, 64])
def test_longer_packet_withdraws_its_output_until_near_its_end(width):
    """A block more (8 beats at 16-byte beats, 5 at 64): the output is not offered from the
    cycle after the start until the packet has at most 4 beats left (registered: a cycle
    later), never early."""
    blocks = 4 * width // BLOCK_BYTES + 1
    offers = offers_after_start(width, blocks)
    beats = blocks * BLOCK_BYTES // width
    # Offered in the start cycle (ports idle before it); withdrawn from the next one while
    # more than 4 beats are left at the end of the cycle before; offered again after.
    assert offers[0] == 1
    assert offers[1:] == [0] * (beats - 4 + 1) + [1] * 3, offers
