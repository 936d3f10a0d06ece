"""Fabric assembly: large designs built from separately emitted Verilog modules
(docs/fabric.md)."""
