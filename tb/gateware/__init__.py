"""Simulation-only gateware for testbenches: packet generators and checkers that run at
Verilator speed instead of driving and checking every beat from Python.

See :mod:`tb.gateware.packet_generator` and :mod:`tb.gateware.packet_checker`.
"""
