"""Build an Amaranth component into Verilog and run cocotb tests on it under Verilator.

Every pytest launcher in tb/ calls :func:`run`: one build directory per
(design, parameter set), built once even when pytest-xdist workers ask for it
together, and one run directory per test filter and environment. The
parameter dict reaches both the hardware (the component factory) and the
testbench (the ``TB_PARAMS`` environment variable, read by :func:`tb_params`).
A top may instantiate large components as separately built modules (Verilator
hierarchical blocks, :mod:`hdl.fabric.separate_modules`), declared as its ``hier_blocks``.
"""
import contextlib
import fcntl
import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path

from hdl.emit import write_verilog
from hdl.fabric.separate_modules import modules_of
from hdl.lint import setup_verilator_env
from tb import hier_build
from tb.sources import BUILD, REPO, source_digest, stamp_sources

__all__ = ["BUILD", "REPO", "bench_record", "param_tag", "run", "tb_params"]


VERILATOR_WARNINGS = [
    # Amaranth's arithmetic output widens and truncates on purpose.
    "-Wno-WIDTHEXPAND", "-Wno-WIDTHTRUNC", "-Wno-CASEOVERLAP", "-Wno-CASEINCOMPLETE",
    "-Wno-CMPCONST",
]


def param_tag(params, salt=""):
    text = json.dumps([params, salt], sort_keys=True, default=str)
    readable = "_".join(f"{k}{v}" for k, v in sorted(params.items()) if isinstance(v, (int, str, bool)))
    readable = "".join(c if c.isalnum() or c in "_-" else "" for c in readable)[:60]
    return f"{readable}_{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def public_top_config(toplevel):
    """The Verilator control file that keeps ``toplevel``'s own signals public in a private
    build (:func:`run`) (written once, atomically: builds under pytest-xdist may read it meanwhile;
    rewritten only if its text changes, so no rebuild follows)."""
    text = f'`verilator_config\npublic_flat_rw -module "{toplevel}" -var "*"\n'
    path = BUILD / toplevel / "public_top.vlt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def run(*, module, toplevel, factory, params, testcase=None, test_filter=None,
        expect_tests=None, extra_env=None, build_args=(), waves=None, log_to_file=True,
        hierarchical=True, public=False, label=None):
    """Elaborate ``factory(**params)``, build it with Verilator, run ``module``'s cocotb tests.

    Returns the run's directory (its log, results and whatever the tests wrote there), named
    by ``label`` (default: the testcase, or the filter's letters).

    ``expect_tests`` guards against a filter that silently matches nothing:
    the run fails unless exactly that many tests ran (all of them when None).
    The simulation's output goes to ``test.log`` in the run directory, or to
    the terminal with ``log_to_file=False``.

    The top's separately built modules (its ``hier_blocks``, :func:`hdl.fabric.separate_modules.modules_of`)
    are each a hierarchical block unless ``hierarchical`` is False
    (:func:`tb.hier_build.build_inputs`).

    Only the top's own signals are reachable from Python unless ``public``: cocotb's
    runner asks Verilator for --public-flat-rw, which keeps every internal signal of every
    block as a variable of its own (the NIC block's C++ 5 times larger, its simulation up to
    19 times slower: docs/verilog.md, Simulation builds); a private build takes that back
    and keeps the top public by a control file (:func:`public_top_config`).
    """
    from cocotb_tools.check_results import get_results
    from cocotb_tools.runner import get_runner

    setup_verilator_env()
    waves = bool(int(os.environ.get("WAVES", "0"))) if waves is None else waves
    # Tracing needs zlib and lz4 headers (liblz4-dev, zlib1g-dev): only waveform runs build with it.
    # One build per design and parameter set, shared by every module that tests it.
    design = f"{factory.__module__}.{factory.__qualname__}"
    flavour = ("_waves" if waves else "") + ("" if hierarchical else "_flat") + \
        ("_public" if public else "")
    if not public:
        build_args = ["--no-public-flat-rw", str(public_top_config(toplevel)), *build_args]
    build_dir = BUILD / toplevel / (param_tag(params, design) + flavour)
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / f"{toplevel}.v"

    runner = get_runner("verilator")
    # pytest-xdist workers may ask for the same build at once: one builds, the others wait
    # and then find it up to date.
    with open(build_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Elaborating a large top (a switch) takes a minute: do it only when the Python it
        # comes from changed since the Verilog was written.
        stamp = build_dir / ".source_digest"
        declared = build_dir / ".hier_blocks.json"     # the top's own separate modules
        digest = source_digest()
        if not (source.exists() and declared.exists() and stamp.exists()
                and stamp.read_text() == digest):
            top = factory(**params)
            declared.write_text(json.dumps(modules_of(top), sort_keys=True))
            write_verilog(top, toplevel, source)
            stamp_sources(stamp, digest)
        specs = json.loads(declared.read_text())
        module_sources, module_args = hier_build.build_inputs(specs, build_dir, hierarchical)
        args = [*VERILATOR_WARNINGS, *(["--trace-fst", "--trace-structs"] if waves else []),
                *module_args, *build_args]
        # A build already made from these sources and arguments only finds itself up to date
        # (Verilator's and make's checks): it needs no turn on the separate modules' locks,
        # which would make it wait while another top sharing a module (the NIC's) compiles.
        built = build_dir / ".built"
        key = json.dumps([digest, [str(path) for path in module_sources], [str(a) for a in args],
                          version("verilator")])
        up_to_date = built.exists() and built.read_text() == key and (build_dir / toplevel).exists()
        built.unlink(missing_ok=True)
        with contextlib.nullcontext() if up_to_date else hier_build.build_lock(specs, flavour):
            runner.build(sources=[source, *module_sources], hdl_toplevel=toplevel,
                         build_dir=build_dir, build_args=args, waves=waves,
                         log_file=build_dir / "build.log")
        if stamp.exists() and stamp.read_text() == digest:
            built.write_text(key)
    env = {"TB_PARAMS": json.dumps(params)}
    env.update(extra_env or {})
    # Each distinct run (module, test filter, environment) gets its own directory for logs
    # and outputs: modules sharing a build may run at once (pytest-xdist).
    run_tag = hashlib.sha1(json.dumps([module, testcase, test_filter, env],
                                      sort_keys=True).encode()).hexdigest()[:8]
    label = label or testcase or (test_filter and "".join(c for c in test_filter
                                                          if c.isalnum() or c == "_"))
    test_dir = build_dir / f"run_{module.rsplit('.', 1)[-1]}_{label or 'all'}_{run_tag}"
    test_dir.mkdir(exist_ok=True)
    results = runner.test(
        test_module=module,
        hdl_toplevel=toplevel,
        testcase=testcase,
        test_filter=test_filter,
        build_dir=build_dir,
        test_dir=test_dir,
        extra_env=env,
        waves=waves,
        results_xml=str(test_dir / "results.xml"),
        log_file=test_dir / "test.log" if log_to_file else None,
    )
    num_tests, num_failed = get_results(Path(results))
    if expect_tests is not None and num_tests != expect_tests:
        raise AssertionError(f"{module}: expected {expect_tests} cocotb tests to run, {num_tests} ran")
    if num_tests == 0:
        raise AssertionError(f"{module}: no cocotb test ran")
    if num_failed:
        raise AssertionError(f"{module}: {num_failed} of {num_tests} cocotb tests failed "
                             f"(log: {test_dir / 'test.log'})")
    return test_dir


def tb_params():
    """The parameter dict the pytest launcher passed to this simulation."""
    return json.loads(os.environ.get("TB_PARAMS", "{}"))


def bench_record(name, value, unit, config):
    """Append one benchmark record to the file named by ``BENCH_RECORDS`` (set by
    tb/bench.py for each cocotb benchmark run)."""
    path = os.environ["BENCH_RECORDS"]
    records = json.loads(Path(path).read_text()) if os.path.exists(path) else []
    records.append({"name": name, "value": value, "unit": unit, "config": config})
    Path(path).write_text(json.dumps(records, indent=1))
