from amaranth import *
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from .link_receiver import LinkReceiver
from .link_transmitter import LinkTransmitter
from .signatures import BeatLayout, FlowControlOp, LinkState, WireSignature

__all__ = ["LinkPort", "INIT_REPEATS"]

# INIT packets per VL sent after hearing the peer's INIT, before arming.
INIT_REPEATS = 8


class LinkPort(wiring.Component):
    """One end of a credit-based IBA link: transmitter, receiver and link state.

    Flow-control initialisation (docs/link.md has the table of states): INIT
    sends Op INIT packets and takes only the peer's; ARMED, once the peer's
    INIT was heard and ours went out ``INIT_REPEATS`` times for every VL since,
    sends NORMAL packets and no data but takes the peer's data; ACTIVE, on the
    peer's first NORMAL packet or good data packet, sends data. Data packets are dropped
    only in the INIT after a reset, before the port first arms. An Op INIT
    packet in ACTIVE means the peer was reset: forget FCTBS, ABR and credit
    limits and initialise again; in ARMED it is the peer still initialising.
    A port left ARMED for ``4 * fc_period`` cycles (the peer was reset again
    and ignores NORMAL packets) starts over from INIT, and so does an ACTIVE port that
    hears no good flow-control packet for ``fail_timeout`` = ``8 * fc_period`` cycles
    outside data packets (the link failed: the peer sends one per VL at least every
    ``fc_period`` between its packets); a packet with no beat for ``4 * fc_period`` cycles
    is closed as truncated (docs/link.md, Link failure and recovery).
    """

    def __init__(self, *, width=64, num_vls=2, mtu=4096, buffer_blocks=None, cut_through=True,
                 fc_period=1024, fc_min_interval=64, fc_batch_blocks=64, store="internal",
                 routed=False):
        self.transmitter = LinkTransmitter(width=width, num_vls=num_vls, mtu=mtu,
                                           fc_period=fc_period, fc_min_interval=fc_min_interval,
                                           fc_batch_blocks=fc_batch_blocks)
        # A peer pauses inside a data packet only while its own source does (a cut-through
        # packet whose input link failed); four periods of that and the packet is closed.
        self.receiver = LinkReceiver(width=width, num_vls=num_vls, mtu=mtu,
                                     buffer_blocks=buffer_blocks, cut_through=cut_through,
                                     store=store, routed=routed, stall_timeout=4 * fc_period)
        self.width = width
        self.num_vls = num_vls
        self.buffer_blocks = self.receiver.buffer_blocks
        # An answer to our INIT comes within a round trip and one flow-control period.
        self.armed_timeout = 4 * fc_period
        # An ACTIVE peer sends each VL's flow-control packet at least every fc_period cycles
        # (after a data packet in progress); eight periods of silence are a failed link, not
        # flow-control packets lost to noise.
        self.fail_timeout = 8 * fc_period
        # With an external store (a switch port) the receiver's store, route and drop
        # events are used directly as ``port.receiver.store`` etc.; there is no data_out.
        outputs = ({"data_out": Out(stream.Signature(BeatLayout(width))).array(num_vls)}
                   if store == "internal" else {})
        super().__init__({
            "data_in": In(stream.Signature(BeatLayout(width))).array(num_vls),
            **outputs,
            "wire_out": Out(WireSignature(width)),
            "wire_in": In(WireSignature(width)),
            "vl_weight": In(8).array(num_vls),
            "state": Out(LinkState),
            # Times the link re-entered INIT from ACTIVE: the peer's INIT, or a failed link.
            "link_inits": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.transmitter = tx = self.transmitter
        m.submodules.receiver = rx = self.receiver
        num_vls = self.num_vls

        for v in range(num_vls):
            wiring.connect(m, wiring.flipped(self.data_in[v]), tx.data_in[v])
            if rx.store_kind == "internal":
                wiring.connect(m, rx.data_out[v], wiring.flipped(self.data_out[v]))
            m.d.comb += [
                tx.vl_weight[v].eq(self.vl_weight[v]),
                tx.advertise_fccl[v].eq(rx.fccl[v]),
            ]
        wiring.connect(m, tx.wire, wiring.flipped(self.wire_out))
        wiring.connect(m, wiring.flipped(self.wire_in), rx.wire)
        m.d.comb += [
            tx.state.eq(self.state),
            rx.state.eq(self.state),
        ]
        wiring.connect(m, rx.flow_control, tx.credit_update)

        heard_init = Signal()
        armed_cycles = Signal(range(self.armed_timeout + 1))
        # ACTIVE, since a flow-control packet, outside data packets (none can come inside one).
        quiet_cycles = Signal(range(self.fail_timeout + 1))
        init_sent = Signal(num_vls)
        clear = Signal()
        # From reset until we first arm, the peer may still send data meant for our earlier
        # life, against credit we no longer hold: that is dropped. In an INIT entered later
        # (ARMED timed out, or the peer's INIT in ACTIVE) the peer's data was sent against
        # this life's credit and is taken. Throughout INIT, ABR stays 0: the peer's FCTBS
        # is 0 or becomes 0 when it hears our INIT.
        since_reset = Signal(init=1)
        in_init = self.state == LinkState.INIT
        with m.If(self.state == LinkState.ARMED):
            m.d.sync += since_reset.eq(0)
        m.d.comb += [tx.clear.eq(clear), rx.clear.eq(clear | in_init), rx.close.eq(clear),
                     rx.link_down.eq(in_init & since_reset)]

        peer_fc = rx.flow_control
        peer_init = peer_fc.valid & (peer_fc.op == FlowControlOp.INIT)
        peer_normal = peer_fc.valid & (peer_fc.op == FlowControlOp.NORMAL)
        init_repeats = [Signal(range(INIT_REPEATS + 1), name=f"init_repeats{v}")
                        for v in range(num_vls)]
        with m.If(tx.fc_sent.valid & (tx.fc_sent.op == FlowControlOp.INIT) & (heard_init | peer_init)):
            for v in range(num_vls):
                with m.If((tx.fc_sent.vl == v) & (init_repeats[v] != INIT_REPEATS)):
                    m.d.sync += init_repeats[v].eq(init_repeats[v] + 1)
        m.d.comb += init_sent.eq(Cat(count == INIT_REPEATS for count in init_repeats))

        with m.Switch(self.state):
            with m.Case(LinkState.INIT):
                with m.If(peer_init):
                    m.d.sync += heard_init.eq(1)
                with m.If(heard_init & init_sent.all()):
                    m.d.sync += self.state.eq(LinkState.ARMED)
            with m.Case(LinkState.ARMED):
                m.d.sync += armed_cycles.eq(armed_cycles + 1)
                # A good data packet says the peer is ACTIVE as surely as a NORMAL packet
                # says it is ARMED; the packet itself was taken (ARMED takes data).
                with m.If(peer_normal | rx.received):
                    m.d.sync += [self.state.eq(LinkState.ACTIVE), armed_cycles.eq(0)]
                with m.Elif(armed_cycles == self.armed_timeout):
                    # The peer never answered: it was reset again after hearing us, and
                    # waits for INIT packets. Start over.
                    m.d.comb += clear.eq(1)
                    m.d.sync += [self.state.eq(LinkState.INIT), heard_init.eq(0), armed_cycles.eq(0)]
                    m.d.sync += [count.eq(0) for count in init_repeats]
            with m.Case(LinkState.ACTIVE):
                with m.If(peer_fc.valid):
                    m.d.sync += quiet_cycles.eq(0)
                with m.Elif(~rx.in_packet):
                    m.d.sync += quiet_cycles.eq(quiet_cycles + 1)
                with m.If(peer_init):
                    # The peer was reset. This INIT packet counts as heard, and the
                    # transmitter takes its credit limit over the clear.
                    m.d.comb += clear.eq(1)
                    m.d.sync += [self.state.eq(LinkState.INIT), heard_init.eq(1),
                                 self.link_inits.eq(self.link_inits + 1), quiet_cycles.eq(0)]
                    m.d.sync += [count.eq(0) for count in init_repeats]
                with m.Elif(quiet_cycles == self.fail_timeout):
                    # The link failed (cable cut, peer gone): initialise again, which
                    # completes by itself once the peer's INIT packets arrive.
                    m.d.comb += clear.eq(1)
                    m.d.sync += [self.state.eq(LinkState.INIT), heard_init.eq(0),
                                 self.link_inits.eq(self.link_inits + 1), quiet_cycles.eq(0)]
                    m.d.sync += [count.eq(0) for count in init_repeats]
        return m
