"""Simulation tops built from separately compiled modules (Verilator hierarchical blocks).

A NIC flattened into every top that uses it is verilated and compiled again for each of
them, and two NICs flattened into one top are compiled twice (76 MB of C++ for the NIC
pair). Instead, a top instantiates its large components through
:class:`hdl.fabric.blackbox.BlackBox`, as a Verilog module emitted on its own:

- :class:`hdl.fabric.separate_modules.SeparateModules` makes the black boxes of one top and
  records what each one is (kind and constructor arguments); the top keeps it as its
  ``hier_blocks`` attribute. The module is named after the component's kind and *all* its
  constructor arguments, defaults included (``module_name``), so every top that asks for
  the same hardware gets the same module name and the same Verilog text.
- :func:`emit_modules` writes each module once into ``build/tb/modules/``, in a file named
  by a digest of hdl/ and the arguments: a module is emitted again only when the RTL or
  its arguments change, and the tops share the file.
- :func:`build_inputs` gives :func:`tb.runner.run` the files and Verilator arguments: with
  ``hierarchical`` (the default) ``--hierarchical`` and a control file making each module
  a ``hier_block``, so Verilator verilates and compiles it once per build as a library all
  its instances share, and ccache finds the objects of an identical module compiled by
  another top's build (docs/verilog.md, Simulation builds). Builds of tops that share a
  module take turns (:func:`build_lock`): run at once (pytest-xdist), both would compile it.

The tests use one NIC configuration, :data:`TEST_NIC`, in every top (NicTop, NicPairTop,
FabricTop), so a cold ``make test`` compiles the NIC once.
"""
import contextlib
import fcntl
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from hdl.emit import write_verilog
from hdl.fabric.separate_modules import component, parameter_key
from tb.sources import BUILD, source_digest

__all__ = ["TEST_NIC", "emit_modules", "hier_config", "build_inputs", "build_lock"]

# The NIC of every test top: enough QPs for the 8-NIC fabric (one per peer) and the pair
# tests (up to 16), small enough to keep the NIC's C++ about 28 MB.
TEST_NIC = dict(num_qps=16, num_cqs=16, num_mkeys=16, num_vls=2, mtu=4096, addr_width=64)


def _emit_one(name, kind, kwargs, path):
    t0 = time.monotonic()
    write_verilog(component(kind, kwargs), name, path)
    return time.monotonic() - t0


def module_paths(specs, out_dir):
    """``{module name: path}``: each file is named by a digest of hdl/ and the module's
    kind and parameters."""
    digest = source_digest(("hdl",))
    return {name: Path(out_dir) / f"{name}_{parameter_key(digest, kind, kwargs)[:12]}.v"
            for name, (kind, kwargs) in specs.items()}


def emit_modules(specs, out_dir=None, jobs=2, log=print):
    """Emit the modules of ``specs`` (``{name: (kind, kwargs)}``) not yet in ``out_dir``
    (default ``build/tb/modules``) for this hdl/, ``jobs`` at a time. Returns their paths.
    Builds running at once (pytest-xdist) take turns: one emits, the others find the files."""
    out_dir = Path(out_dir or BUILD / "modules")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = module_paths(specs, out_dir)
    if all(path.exists() for path in paths.values()):     # each written whole (os.replace)
        return list(paths.values())
    with open(out_dir / ".emit.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = [(name, *specs[name], path) for name, path in paths.items() if not path.exists()]
        if todo:
            t0 = time.monotonic()
            with ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                                     mp_context=get_context("spawn")) as pool:
                futures = [(item, pool.submit(_emit_one, *item)) for item in todo]
                for (name, _, _, path), future in futures:
                    seconds = future.result()
                    log(f"emitted {name} ({path.stat().st_size:,} bytes) in {seconds:.1f} s")
            log(f"modules emitted in {time.monotonic() - t0:.1f} s")
    return list(paths.values())


def hier_config(names, path):
    """A Verilator control file making each module in ``names`` a hierarchical block."""
    text = "`verilator_config\n" + "".join(f'hier_block -module "{name}"\n'
                                           for name in sorted(names))
    path = Path(path)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def build_inputs(specs, build_dir, hierarchical=True):
    """``(sources, verilator arguments)`` for a top whose separately built modules are
    ``specs``: the module files, and with ``hierarchical`` each as a hierarchical block
    (its control file written into ``build_dir``). Without, Verilator compiles the
    modules as one design with the top (far bigger C++: docs/verilog.md)."""
    if not specs:
        return [], []
    sources = [str(path) for path in emit_modules(specs)]
    if not hierarchical:
        return sources, []
    config = hier_config(specs, Path(build_dir) / "hier_blocks.vlt")
    # Without --build: Verilator then verilates the blocks one at a time, and the runner's
    # `make -j` compiles them (Vtop.mk includes their rules). With --build -j 2 the
    # generated makefile's two-target rule verilated each block twice at once.
    return sources, ["--hierarchical", str(config)]


@contextlib.contextmanager
def build_lock(specs, flavour=""):
    """Held around a top's Verilator build: one build at a time per separately built
    module, so that the second top to build a module finds its objects in ccache instead of
    compiling them alongside the first. Builds of another ``flavour`` (with waveform
    tracing, say) compile other objects and take their own turns."""
    out_dir = BUILD / "modules"
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        for name in sorted(specs):          # one order for every top: no deadlock
            lock = stack.enter_context(open(out_dir / f".{name}{flavour}.build.lock", "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
