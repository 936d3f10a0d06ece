"""`make sim`'s front end without the simulator: option errors, the report's figures from a
hand-made results file (expected values worked out by hand below, not by the report's
code), the files it writes, and the exit status when a check failed."""
import copy
import io
import json
import os
import subprocess
import sys
import types

import pytest

from tb import runner, sim, sim_report

CONFIG = {"scenario": "moe", "ranks": 4, "nics_per_leaf": 2, "leaves": 2, "spines": 1,
          "tokens": 2, "topk": 2, "experts_per_rank": 2, "hidden": 7168,
          "dispatch_bytes": 7408, "combine_bytes": 14336, "kv_block_bytes": 65536,
          "kv_blocks": 16, "kv_src": 0, "kv_dst": 3, "wire_delay": 8, "memory_latency": 200,
          "seed": 1, "clock_ns": 2.5, "beat_bytes": 64, "pcap_link": "nic0.p0"}


def message(kind, src, dst, hops, posted, landed, size, phase=None):
    return {"kind": kind, "phase": phase or kind, "src": src, "dst": dst, "bytes": size,
            "hops": hops, "posted": posted, "landed": landed}


def rank(n, leaf, dispatch, combine, busy):
    return {"rank": n, "leaf": leaf, "dispatch_start": dispatch[0], "dispatch_end": dispatch[1],
            "combine_start": combine[0], "combine_end": combine[1], "bytes_sent": 1000 * (n + 1),
            "bytes_received": 2000, "messages_sent": 3, "messages_received": 3,
            "busy_cycles": busy}


RESULTS = {
    "schema": 1,
    "config": CONFIG,
    "latency": {
        "hop_cycles": [4, 4, 5, 4],
        "hop1": {"src": 0, "dst": 1, "total": 259, "nic_a": 8, "memory": 202, "nic_a_wire": 12,
                 "cables": 16, "switches": 4, "nic_b": 17, "hops": 1},
        "hop3": {"src": 0, "dst": 3, "total": 283, "nic_a": 8, "memory": 202, "nic_a_wire": 12,
                 "cables": 32, "switches": 12, "nic_b": 17, "hops": 3},
    },
    "phases": [{"name": "dispatch", "start": 1000, "end": 2000},
               {"name": "combine", "start": 3000, "end": 4000}],
    "ranks": [rank(0, "leaf0", (1000, 1800), (3000, 3600), 300),
              rank(1, "leaf0", (1000, 1900), (3000, 3800), 600),
              rank(2, "leaf1", (1100, 2000), (3000, 4000), 900),
              rank(3, "leaf1", (1000, 1700), (3100, 3900), 0)],
    "messages": [
        message("dispatch", 0, 1, 1, 1000, 1400, 7408),
        message("dispatch", 0, 2, 3, 1000, 1500, 7408),
        message("signal", 0, 1, 1, 1400, 1450, 8, phase="dispatch"),
        message("dispatch", 1, 3, 3, 1100, 1300, 7408),
        message("dispatch", 2, 0, 3, 1200, 1600, 7408),
        message("dispatch", 3, 1, 3, 1000, 1100, 7408),
        message("combine", 1, 0, 1, 3000, 3400, 14336),
        message("combine", 2, 0, 3, 3000, 3700, 14336),
        message("combine", 0, 2, 3, 3100, 3600, 14336),
        message("combine", 3, 1, 3, 3200, 3500, 14336),
    ],
    "links": [
        {"name": "nic0.p0", "cable": "nic0-leaf0", "a": ["nic0", 0], "b": ["leaf0", 0],
         "credit_stall_cycles": 0, "packets": 10, "bytes": 40000,
         "utilisation": [0.0, 0.5, 1.0, 0.5], "utilisation_ba": [0.75, 0.25, 0.0, 0.0],
         "future_key": 1},
        {"name": "leaf0.p2", "cable": "leaf0-spine0", "a": ["leaf0", 2], "b": ["spine0", 0],
         "credit_stall_cycles": 120, "packets": 4, "bytes": 30000, "utilisation": [0.25, 0.25],
         "utilisation_ba": [0.5, 0.0]},
    ],
    "sample_cycles": 1000,
    "drops": {"total": 0, "by_counter": {"leaf0.p2.vl0.drop_vcrc": 0}},
    "overflows": 0,
    "retransmissions": {"total": 0, "by_nic": {"nic0": {"retransmits_nak": 0}}},
    "cqes": {"posted_wqes": 10, "send_cqes": 10, "receive_cqes": 0, "errors": 0},
    "checks": {"tokens_intact": True, "signals_counted": True, "memories_match_model": True,
               "no_drops": True, "no_overflow": True, "no_retransmissions": True},
    "failures": [],
    "workload_start": 1000, "workload_end": 4000,
    "cycles": 5000, "wall_seconds": 20.0,
    "timing": [{"phase": "start-up", "cycle": 0, "seconds": 0.4},
               {"phase": "latency", "cycle": 600, "seconds": 3.0},
               {"phase": "dispatch", "cycle": 1000, "seconds": 5.0},
               {"phase": "combine", "cycle": 2000, "seconds": 10.0},
               {"phase": "drain", "cycle": 3900, "seconds": 17.0},
               {"phase": "counters", "cycle": 4000, "seconds": 17.4},
               {"phase": "results", "cycle": 5000, "seconds": 19.8}],
    "pcap": "link.pcap",
    "a_key_the_report_does_not_know": {"anything": [1, 2]},
}


def results(**changes):
    r = copy.deepcopy(RESULTS)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = r
        for key in parents:
            node = node[key]
        node[leaf] = value
    return r


# --- figures ---------------------------------------------------------------------------------

def test_hop_and_path_latency():
    f = sim_report.derive(results())
    # Hops 4, 4, 5, 4: nearest-rank median is the 2nd of [4, 4, 4, 5].
    assert f["hop"] == {"count": 4, "min_cycles": 4, "max_cycles": 5, "median_cycles": 4,
                        "median_ns": 10.0}
    one, three = f["paths"]["hop1"], f["paths"]["hop3"]
    assert (one["cycles"], one["ns"]) == (259, 647.5)
    assert one["parts_cycles"] == {"NIC logic": 8 + 12 + 17, "memory wait": 202, "cables": 16,
                                   "switches": 4}
    assert one["parts_share"]["memory wait"] == pytest.approx(202 / 259)
    assert one["dominant"] == three["dominant"] == "memory wait"
    assert (three["cycles"], three["ns"]) == (283, 707.5)
    assert three["parts_cycles"]["switches"] == 12 and three["parts_cycles"]["cables"] == 32
    assert f["failures"] == []


def test_nic_logic_dominates_without_memory_wait():
    r = results(latency__hop1={"src": 0, "dst": 1, "total": 59, "nic_a": 8, "memory": 2,
                               "nic_a_wire": 12, "cables": 16, "switches": 4, "nic_b": 17,
                               "hops": 1})
    assert sim_report.derive(r)["paths"]["hop1"]["dominant"] == "NIC logic"


def test_rank_times_and_bandwidth():
    f = sim_report.derive(results())
    r0 = f["ranks"][0]
    assert (r0["dispatch_cycles"], r0["dispatch_us"]) == (800, 2.0)
    assert (r0["combine_cycles"], r0["combine_us"]) == (600, 1.5)
    # Rank 0's messages: [1000, 1400], [1000, 1500], [1400, 1450], [3100, 3600]: in flight
    # 500 + 500 cycles; 7408 + 7408 + 8 + 14336 = 29160 bytes: 29.16 B/cycle.
    assert r0["in_flight_cycles"] == 1000
    assert r0["message_bytes_sent"] == 29160
    assert r0["gbytes_per_s"] == pytest.approx(29.16 / 2.5)
    assert r0["wire_fraction"] == pytest.approx(29.16 / 64)
    # Busy 300 cycles of the workload (first phase start 1000 .. last phase end 4000).
    assert f["workload_cycles"] == 3000
    assert r0["wire_busy_fraction"] == pytest.approx(0.1)
    # Rank 3 sent one dispatch [1000, 1100] and one combine [3200, 3500]: 400 cycles.
    assert f["ranks"][3]["in_flight_cycles"] == 400
    assert f["ranks"][3]["gbytes_per_s"] == pytest.approx((7408 + 14336) / 400 / 2.5)


def test_message_latency_by_kind_and_hops():
    f = sim_report.derive(results())
    rows = {(m["kind"], m["hops"]): m for m in f["messages"]}
    assert sorted(rows) == [("combine", 1), ("combine", 3), ("dispatch", 1), ("dispatch", 3),
                            ("signal (dispatch)", 1)]
    # Dispatch over 3 hops: 500, 200, 400, 100 cycles.
    d3 = rows["dispatch", 3]
    assert (d3["count"], d3["min_cycles"], d3["p50_cycles"], d3["p99_cycles"], d3["max_cycles"]) \
        == (4, 100, 200, 500, 500)
    assert d3["p50_us"] == 0.5
    # Combine over 3 hops: 700, 500, 300.
    c3 = rows["combine", 3]
    assert (c3["p50_cycles"], c3["p99_cycles"]) == (500, 700)
    assert rows["signal (dispatch)", 1]["max_cycles"] == 50


def test_links():
    f = sim_report.derive(results())
    first, second = f["links"]
    assert (first["credit_stall_cycles"], first["up_mean_utilisation"],
            first["up_peak_utilisation"]) == (0, 0.5, 1.0)
    assert (first["down_mean_utilisation"], first["down_peak_utilisation"]) == (0.25, 0.75)
    assert (second["credit_stall_cycles"], second["up_mean_utilisation"],
            second["down_mean_utilisation"]) == (120, 0.25, 0.25)


def test_percentile_and_busy_span():
    assert sim_report.percentile([3, 1, 2], 0.5) == 2
    assert sim_report.percentile(list(range(1, 101)), 0.99) == 99
    assert sim_report.percentile([7], 0.99) == 7
    assert sim_report.busy_span([(0, 10), (5, 20), (30, 40), (31, 35)]) == 30
    assert sim_report.busy_span([]) == 0


@pytest.mark.parametrize("changes, reason", [
    ({"drops__total": 2, "drops__by_counter": {"leaf0.p2.vl0.drop_vcrc": 2}},
     "2 packets dropped (must be 0): leaf0.p2.vl0.drop_vcrc 2"),
    ({"retransmissions__total": 3, "retransmissions__by_nic": {"nic5": {"retransmits_nak": 3}}},
     "3 retransmissions on a fault-free run (must be 0): nic5.retransmits_nak 3"),
    ({"overflows": 1}, "1 receive-buffer overflows (must be 0)"),
    ({"cqes__send_cqes": 9}, "9 send CQEs for 10 posted WQEs"),
    ({"cqes__errors": 1}, "1 CQEs with an error status"),
    ({"checks__tokens_intact": False}, "scenario check failed: tokens intact"),
    ({"phases": [{"name": "dispatch", "start": 1000, "end": 2000},
                 {"name": "combine", "start": 3000, "end": None}]}, "phase did not finish: combine"),
])
def test_each_failed_check_is_reported(changes, reason):
    f = sim_report.derive(results(**changes))
    assert f["failures"] == [reason]
    assert "FAILED: " + reason in sim_report.summary(results(**changes), f)


def test_scenario_reasons_follow_its_failed_checks():
    """A failed check the report explains itself is not listed twice; the scenario's own
    reasons (which token, which memory) follow."""
    r = results(drops__total=1, checks__no_drops=False, checks__memories_match_model=False,
                failures=["memories: nic3 differs at 0xc01000"])
    assert sim_report.derive(r)["failures"] == [
        "1 packets dropped (must be 0)", "scenario check failed: memories match model",
        "scenario: memories: nic3 differs at 0xc01000"]


def test_summary_table():
    r = results()
    text = sim_report.summary(r, sim_report.derive(r))
    assert "4 cycles = 10.0 ns, median of 4 hops measured (min 4, max 5)" in text
    assert "| 1 hop, NIC 0 -> 1 | 259 = 647.5 ns | 37 (14%) | 202 (78%) | 16 (6%) | 4 (2%) | memory wait |" in text
    assert "2 more hops cost 24 cycles (60.0 ns): 8 in switches, 16 on cables" in text
    assert "| 0 | leaf0 | 2.00 | 1.50 | 1.0 | 2.0 | 11.66 | 46% | 10% |" in text
    assert "| dispatch | 3 | 4 | 200 (0.50) | 500 (1.25) | 500 (1.25) |" in text
    assert "| leaf0.p2 (leaf0-spine0) | 4 | 0.03 | 120 | 25% / 25% | 25% / 50% |" in text
    assert "| CQEs | 10 send for 10 posted WQEs, 0 receive, 0 errors | ok |" in text
    assert ("simulated 5,000 cycles (12.5 us) in 20 s wall (250 cycles/s, start-up 2.6 s, "
            "latency probe 2.0 s, workload 12 s, counters 2.4 s)") in text
    assert text.endswith("PASSED: every check held")


def test_wall_split():
    split = sim_report.derive(results())["simulation"]["wall_split"]
    assert split == pytest.approx({"start-up": 2.6, "latency probe": 2.0, "workload": 12.4,
                                   "counters": 2.4})
    # a results file from before the scenario recorded its phases' times
    r = results()
    del r["timing"]
    text = sim_report.summary(r, sim_report.derive(r))
    assert "simulated 5,000 cycles (12.5 us) in 20 s wall (250 cycles/s)\n" in text


def test_kv_scenario_without_phase_times():
    r = results(config__scenario="kv")
    for row in r["ranks"]:
        for key in ("dispatch_start", "dispatch_end", "combine_start", "combine_end"):
            row[key] = None     # as the scenario writes them for kv
    r["phases"] = [{"name": "kv", "start": 1000, "end": 4000}]
    r["messages"] = [m for m in r["messages"] if m["src"] != 3]
    text = sim_report.summary(r, sim_report.derive(r))
    assert "KV-cache transfer: rank 0 -> rank 3, 16 blocks of 65,536 B" in text
    assert "dispatch (us)" not in text
    # Rank 3 sent nothing: no bandwidth.
    assert "| 3 | leaf1 | 3.9 | 2.0 | - | - | 0% |" in text


# --- files -----------------------------------------------------------------------------------

def test_report_files(tmp_path):
    figures = sim_report.write_report(results(), tmp_path, files={"pcap": "x.pcap"})
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["config"] == CONFIG and saved["passed"] is True
    assert saved["figures"]["paths"]["hop3"]["cycles"] == 283
    assert saved["figures"] == json.loads(json.dumps(figures))
    markdown = (tmp_path / "report.md").read_text()
    assert "| 3 hops, NIC 0 -> 3 | 283 = 707.5 ns" in markdown
    assert "(message_latency.png)" in markdown and "`x.pcap`" in markdown
    for name in sim_report.PLOTS.values():
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000, name


# --- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("args, line", [
    (["--scenario", "allreduce"], "error: argument --scenario: invalid choice: 'allreduce' "
                                  "(choose from 'moe', 'kv') (see --help)"),
    (["--ranks", "eight"], "error: argument --ranks: invalid int value: 'eight' (see --help)"),
    (["--bogus"], "error: unrecognized arguments: --bogus (see --help)"),
    (["--ranks", "7"], "error: --ranks must be even (2 NICs per leaf), not 7"),
    (["--spines", "15"], "error: --spines must be 1 to 14, not 15"),
    (["--ranks", "4", "--experts-per-rank", "1", "--topk", "5"],
     "error: --topk 5 exceeds --ranks x --experts-per-rank (4)"),
    (["--tokens", "0"], "error: --tokens must be 1 to 65536, not 0"),
    (["--hidden", "1000"], "error: --hidden must be a multiple of 128"),
    (["--wire-delay", "0"], "error: --wire-delay must be 1 to 4096, not 0"),
    (["--memory-latency", "-1"], "error: --memory-latency must be 1 to 1023, not -1"),
    (["--pcap-link", "nowhere"], "error: --pcap-link 'nowhere' is not a link: one of nic0.p0,"),
    (["--scenario", "kv", "--kv-src", "3", "--kv-dst", "3"],
     "error: --kv-src and --kv-dst must differ, both are 3"),
])
def test_invalid_option_fails_with_one_line(capsys, args, line):
    with pytest.raises(SystemExit) as exit:
        sim.main(args)
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(line), err
    assert out == ""


def test_command_line_exit_status():
    """The same through ``python -m tb.sim``, as make runs it."""
    done = subprocess.run([sys.executable, "-m", "tb.sim", "--ranks", "7"], cwd=runner.REPO,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == \
        (2, "", "error: --ranks must be even (2 NICs per leaf), not 7\n")


def test_option_names_in_messages():
    assert sim.with_option_names("topk 9 exceeds ranks x experts_per_rank (8)") == \
        "--topk 9 exceeds --ranks x --experts-per-rank (8)"


@pytest.mark.parametrize("changes, status", [({}, 0), ({"checks__memories_match_model": False}, 1)])
def test_exit_status(tmp_path, monkeypatch, capsys, changes, status):
    """main() with the simulation replaced by a run directory holding a results file."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "link.pcap").write_bytes(b"pcap bytes")

    class ScenarioFailed(Exception):
        def __init__(self, run_dir):
            super().__init__("scenario checks failed")
            self.run_dir = run_dir

    def launch(config, *, progress_file, waves):
        (run_dir / "scenario_results.json").write_text(json.dumps(results(**changes)))
        if changes:
            raise ScenarioFailed(run_dir)
        return run_dir

    real = sim._scenarios()
    monkeypatch.setattr(sim, "_scenarios", lambda: types.SimpleNamespace(
        full_config=real.full_config, launch=launch, ScenarioFailed=ScenarioFailed))
    out = tmp_path / "out"
    assert sim.main(["--out", str(out)]) == status
    captured = capsys.readouterr()
    assert ("FAILED" in captured.err) == bool(status)
    assert (out / "nic0.p0.pcapng").read_bytes() == b"pcap bytes"
    assert (out / "report.md").exists() and "Checks" in captured.out
    assert json.loads((out / "scenario_results.json").read_text()) == results(**changes)


def test_report_from_saved_results(tmp_path, capsys):
    path = tmp_path / "scenario_results.json"
    path.write_text(json.dumps(results(overflows=2)))
    assert sim_report.main([str(path), "--out", str(tmp_path / "again")]) == 1
    assert "FAILED: 2 receive-buffer overflows (must be 0)" in capsys.readouterr().out
    assert (tmp_path / "again" / "report.json").exists()


def test_progress_line(tmp_path):
    """Build note until the scenario writes progress.json, then its phase, cycle and count;
    on a pipe, no line more often than ``every`` seconds."""
    stream = io.StringIO()
    progress = sim.Progress(tmp_path / "progress.json", stream, every=0)
    progress.update()
    (tmp_path / "progress.json").write_text(json.dumps(
        {"phase": "dispatch", "cycle": 12000, "done": 40, "total": 96}))
    progress.update()
    (tmp_path / "progress.json").write_text(json.dumps(
        {"phase": "latency", "cycle": 900, "done": 0, "total": 0}))
    progress.update()
    first, second, third = stream.getvalue().splitlines()
    assert first.endswith("] " + sim.BUILD_NOTE)
    assert second.endswith("] dispatch: cycle 12,000, messages landed 40/96")
    assert third.endswith("] latency: cycle 900")
    quiet = sim.Progress(tmp_path / "progress.json", io.StringIO(), every=3600)
    quiet.update()
    quiet.update()
    assert quiet.stream.getvalue().count("\n") == 1


@pytest.mark.parametrize("variables, options", [
    ([], ""),
    (["SCENARIO=kv", "TOPK=3", "WAVES=1", "SIM_ARGS=--hidden 1024"],
     "--scenario kv --topk 3 --waves --hidden 1024"),
    (["RANKS=4", "TOKENS=2", "WIRE_DELAY=3", "MEMORY_LATENCY=0", "SEED=4", "WAVES=0"],
     "--ranks 4 --tokens 2 --wire-delay 3 --memory-latency 0 --seed 4"),
])
def test_make_variables(variables, options):
    # Make reads its variables from the environment too: none of them may leak in from it.
    names = ("SCENARIO", "RANKS", "TOKENS", "TOPK", "WIRE_DELAY", "MEMORY_LATENCY", "SEED",
             "WAVES", "SIM_ARGS", "MAKEFLAGS", "MFLAGS")
    env = {k: v for k, v in os.environ.items() if k not in names}
    done = subprocess.run(["make", "-n", "--no-print-directory", "sim", *variables],
                          cwd=runner.REPO, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == \
        [".venv/bin/python", "-m", "tb.sim", *options.split()]
