"""The host side of one NIC in a cocotb testbench: its registers and its memory.

:class:`NicHost` owns a 64-bit cocotbext-axi ``AxiLiteMaster`` on the NIC's registers and
UAR page (the GPU's MMIO writes) and an ``AxiRam`` as the GPU memory behind the NIC's AXI4
master, found by prefix on the top (``axil``/``axi`` for :class:`tb.nic_top.NicTop`,
``a_axil``/``a_axi`` ... for :class:`tb.nic_pair_top.NicPairTop`), with the register and
context programming every NIC test needs. It is what :class:`tb.gpu_model.GpuModel` posts
through (``clock``, ``memory``, ``ring_doorbell``).
"""
import logging

from hdl.nic import register_map as rmap

__all__ = ["NicHost"]


class NicHost:
    def __init__(self, dut, prefix, *, memory_bytes, num_mkeys):
        from cocotbext.axi import AxiBus, AxiLiteBus, AxiLiteMaster, AxiRam
        self.clock = dut.clk
        self.num_mkeys = num_mkeys
        self.axil = AxiLiteMaster(AxiLiteBus.from_prefix(dut, f"{prefix}axil", bus_separator="__"),
                                  dut.clk, dut.rst)
        self.memory = AxiRam(AxiBus.from_prefix(dut, f"{prefix}axi", bus_separator="__"), dut.clk,
                             dut.rst, size=memory_bytes)
        # A line per burst costs more than the burst: keep warnings only.
        for interface in (self.memory.read_if, self.memory.write_if):
            interface.log.setLevel(logging.WARNING)

    def hook_memory_writes(self, callback):
        """Call ``callback(address, data)`` for every AXI write the NIC makes, after it lands."""
        write = self.memory.write_if._write
        size = self.memory.size

        async def hooked(address, data):
            await write(address, data)
            callback(address % size, bytes(data))
        self.memory.write_if._write = hooked

    # --- registers ----------------------------------------------------------------------

    async def write(self, offset, value, expect_error=False):
        resp = await self.axil.write(offset, int(value).to_bytes(8, "little"))
        error = int(resp.resp) != rmap.OKAY
        if error != expect_error:
            raise AssertionError(f"register write {offset:#06x} = {value:#x}: response "
                                 f"{int(resp.resp)}, expected {'SLVERR' if expect_error else 'OKAY'}")

    async def read(self, offset):
        resp = await self.axil.read(offset, 8)
        assert int(resp.resp) == rmap.OKAY, f"register read {offset:#06x}: {int(resp.resp)}"
        return int.from_bytes(resp.data, "little")

    async def counter(self, name):
        return await self.read(rmap.register_offset(name))

    async def counters(self):
        return {name: await self.counter(name) for name, _, _ in rmap.counter_words()}

    async def ring_doorbell(self, data8):
        await self.axil.write(rmap.UAR_BASE + 0x800, data8)

    async def program_qp(self, qp, state=3):
        """Write QP context ``qp`` (a :class:`models.nic.QpContext`) and move it to ``state``."""
        for word in rmap.QP_WORDS[1:]:
            value = rmap.place_fields(word.fields, **{f.name: int(getattr(qp, f.name))
                                                      for f in word.fields})
            await self.write(rmap.context_offset("qp", qp.qpn, word.name), value)
        await self.write(rmap.context_offset("qp", qp.qpn, "state"), state)

    async def set_qp_state(self, qpn, state, expect_error=False):
        await self.write(rmap.context_offset("qp", qpn, "state"), state, expect_error)

    async def program_cq(self, cq):
        for word in rmap.CQ_WORDS:
            value = rmap.place_fields(word.fields, **{f.name: int(getattr(cq, f.name))
                                                      for f in word.fields})
            await self.write(rmap.context_offset("cq", cq.cqn, word.name), value)

    async def program_mkey(self, mkey):
        index = (mkey.key >> 8) % self.num_mkeys
        for word in rmap.MKEY_WORDS:
            value = rmap.place_fields(word.fields, **{f.name: int(getattr(mkey, f.name))
                                                      for f in word.fields})
            await self.write(rmap.context_offset("mkey", index, word.name), value)
