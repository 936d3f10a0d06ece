"""``make sim``: an MoE all-to-all step (or a KV-cache transfer) on the simulated fabric.

Builds the leaf/spine fabric of real NIC and switch RTL with Verilator (once; later runs
reuse the build), runs the scenario of tb/fabric_scenarios.py on it with a progress line,
then prints a summary table and writes, into ``--out`` (build/sim):

- report.md, report.json: the configuration and every figure (tb/sim_report.py);
- message_latency.png, link_utilisation.png: latency distributions by message kind and
  hop count, per-link utilisation over time;
- the pcap of one link (``--pcap-link``), and with ``--waves`` the path of an FST waveform.

Exit status 0 when every check held, 1 when one failed (drops, retransmissions, CQE
counts, data integrity: the reason is printed), 2 for invalid options (one line).

    python -m tb.sim --help          # docs/sim.md
"""
import argparse
import json
import re
import shutil
import sys
import threading
import time
from pathlib import Path

from models import moe
from tb import runner, sim_report

OUT = runner.REPO / "build" / "sim"
BUILD_NOTE = "building the fabric with Verilator: the first build takes about 5 minutes"
QUIET_PROGRESS_SECONDS = 10     # a progress line this often when stdout is not a terminal
POLL_SECONDS = 0.5

# What each option of the scenario (models.moe.DEFAULTS, the same names with dashes) means.
HELP = {
    "scenario": "moe: dispatch + combine of one MoE step; kv: a KV-cache push under background "
                "all-to-all",
    "ranks": "GPUs, one NIC each, 2 per leaf switch (so ranks / 2 leaves)",
    "spines": "spine switches, each linked to every leaf (a leaf has 2 + spines ports)",
    "tokens": "tokens per rank (moe)",
    "topk": "experts each token goes to (moe)",
    "experts_per_rank": "experts each rank owns (moe)",
    "hidden": "hidden size: a dispatch message is 16 + hidden + hidden/32 bytes (FP8 and "
              "scales), a combine message 2 x hidden (BF16)",
    "kv_block_bytes": "bytes of one KV block, one RDMA WRITE (kv)",
    "kv_blocks": "KV blocks pushed (kv)",
    "kv_src": "rank pushing the KV cache (kv)",
    "kv_dst": "rank receiving it (kv)",
    "background_bytes": "bytes of one background message (kv)",
    "background_messages": "background messages from every other rank to each of the others (kv)",
    "wire_delay": "one-way delay of every cable in cycles (cable plus PHY)",
    "memory_latency": "GPU memory read latency the NICs see, cycles",
    "seed": "seed of the expert choice and the payload bytes",
    "pcap_link": "cable whose traffic goes into the pcap, <node>.p<port> (e.g. leaf0.p2: "
                 "leaf 0 up to spine 0)",
    "sample_cycles": "width of one per-link utilisation window, cycles",
    "ack_timeout": "every QP's local ACK timeout code: 0 no timer, n: 4.096 us x 2^n "
                   "(IBA; 3: 13,104 cycles)",
    "cut_link": "cable to cut both ways during the workload, <node>.p<port> (e.g. leaf0.p2); "
                "restored once both its ends went down; needs --ack-timeout",
    "cut_at": "workload cycles before the cut",
}


def _scenarios():
    # Imported once the options parse: it pulls in cocotb and amaranth (about a second).
    from tb import fabric_scenarios
    return fabric_scenarios


def option_name(key):
    return "--" + key.replace("_", "-")


def with_option_names(message):
    """The scenario's ValueErrors name config keys (``experts_per_rank``): name the options."""
    for key in sorted(moe.DEFAULTS, key=len, reverse=True):
        message = re.sub(rf"(?<![-\w.]){key}(?![\w.])", option_name(key), message)
    return message


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block above them)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def parser():
    p = OneLineParser(
        prog="python -m tb.sim",
        description="Run an MoE all-to-all step (or a KV-cache transfer) on a leaf/spine fabric "
                    "of the real NIC and switch RTL under Verilator, and report what each hop "
                    "and NIC cost. Every figure is in simulated cycles (2.5 ns at 400 MHz).",
        epilog="Make variables: SCENARIO, RANKS, TOKENS, TOPK, WIRE_DELAY, MEMORY_LATENCY, SEED, "
               "WAVES=1; SIM_ARGS for the other options. docs/sim.md explains the report.")
    for key, default in moe.DEFAULTS.items():
        kwargs = {"type": int} if isinstance(default, int) else {}
        if key == "scenario":
            kwargs = {"choices": moe.SCENARIOS}
        p.add_argument(option_name(key), dest=key, default=default, metavar=key.upper(),
                       help=f"{HELP.get(key, key.replace('_', ' '))} (default {default})", **kwargs)
    p.add_argument("--waves", action="store_true",
                   help="also write an FST waveform of the whole fabric (slower; needs "
                        "liblz4-dev zlib1g-dev)")
    p.add_argument("--out", type=Path, default=OUT, help=f"output directory (default {OUT})")
    return p


def parse(argv=None):
    """Command line -> (arguments, the scenario's options), validated before anything is
    built: invalid options exit with status 2 and one line, argparse's own or the scenario's
    ValueError (models/moe.py's rules) with the option named."""
    p = parser()
    args = p.parse_args(argv)
    options = {key: getattr(args, key) for key in moe.DEFAULTS}
    try:
        _scenarios().full_config(options)
    except ValueError as error:
        p.exit(2, f"error: {with_option_names(str(error))}\n")
    return args, options


class Progress:
    """One progress line: rewritten in place on a terminal, printed every few seconds to a
    pipe or log."""

    def __init__(self, progress_file, stream=sys.stdout, every=QUIET_PROGRESS_SECONDS):
        self.file = Path(progress_file)
        self.stream = stream
        self.every = every
        self.tty = stream.isatty()
        self.started = time.time()
        self.printed = 0.0
        self.width = 0

    def line(self):
        elapsed = time.time() - self.started
        clock = f"[{int(elapsed // 60)}:{int(elapsed % 60):02d}]"
        try:
            state = json.loads(self.file.read_text())
        except (OSError, ValueError):     # not written yet, or caught mid-write
            return f"{clock} {BUILD_NOTE}"
        landed = (f", messages landed {state['done']:,}/{state['total']:,}" if state["total"]
                  else "")
        return f"{clock} {state['phase']}: cycle {state['cycle']:,}{landed}"

    def update(self):
        now = time.time()
        if self.tty:
            text = self.line()
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
            self.stream.flush()
        elif now - self.printed >= self.every:
            self.printed = now
            print(self.line(), file=self.stream, flush=True)

    def close(self):
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def run_scenario(options, *, out, waves):
    """launch() in a worker thread while the main thread shows progress. Returns the run
    directory, or raises what launch raised."""
    launch = _scenarios().launch
    progress_file = out / "progress.json"
    progress_file.unlink(missing_ok=True)
    outcome = {}

    def work():
        try:
            outcome["run_dir"] = launch(options, progress_file=progress_file, waves=waves)
        except BaseException as error:     # handed to the main thread
            outcome["error"] = error

    worker = threading.Thread(target=work, name="fabric scenario", daemon=True)
    progress = Progress(progress_file)
    worker.start()
    while worker.is_alive():
        progress.update()
        worker.join(POLL_SECONDS)
    progress.update()
    progress.close()
    if "error" in outcome:
        raise outcome["error"]
    return Path(outcome["run_dir"])


def finish(run_dir, out, *, waves, failure=None):
    """Report a finished run: summary on stdout, files into ``out``. Returns the exit status."""
    results_path = Path(run_dir) / "scenario_results.json"
    if not results_path.exists():
        print(f"error: the scenario wrote no results ({failure or results_path} missing)",
              file=sys.stderr)
        return 1
    results = json.loads(results_path.read_text())
    files = {}
    if results.get("pcap"):
        pcap = out / f"{results['config']['pcap_link']}.pcapng"
        shutil.copyfile(Path(run_dir) / results["pcap"], pcap)
        files["pcap"] = str(pcap)
    if waves:
        fst = Path(run_dir) / "dump.fst"
        files["waveform"] = str(fst) if fst.exists() else f"none written (expected {fst})"
    saved = out / "scenario_results.json"
    shutil.copyfile(results_path, saved)
    files["scenario results"] = str(saved)
    figures = sim_report.write_report(results, out, files=files)
    print(sim_report.summary(results, figures))
    print()
    for name, path in files.items():
        print(f"{name}: {path}")
    print(f"report: {out / 'report.md'}, {out / 'report.json'}, plots: "
          + ", ".join(str(out / name) for name in sim_report.PLOTS.values()))
    reasons = list(figures["failures"])
    if failure and not reasons:
        reasons.append(str(failure))
    if reasons:
        print("FAILED: " + "; ".join(reasons), file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    args, options = parse(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    scenarios = _scenarios()
    try:
        run_dir = run_scenario(options, out=out, waves=args.waves)
        failure = None
    except scenarios.ScenarioFailed as error:
        if error.run_dir is None:
            print(f"error: the scenario did not run: {error}", file=sys.stderr)
            return 1
        run_dir, failure = error.run_dir, error
    return finish(run_dir, out, waves=args.waves, failure=failure)


if __name__ == "__main__":
    sys.exit(main())
