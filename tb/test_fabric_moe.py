"""pytest launchers of the fabric scenarios (tb/fabric_scenarios.py). Each fails unless every
check of the scenario passed (tokens intact at the right rank and offset, signals counted,
memories equal to the models, no overflow, every CQE as predicted, every message landed;
no drop and no retransmission, or with a cut cable drops only where the cut explains them
and the link back up).

- ``test_moe_reduced`` (in ``make test``): an MoE step of 2 tokens per rank, top-2, on a
  fabric whose switches are all one module: 6 NICs on 3 leaves, 1 spine, every switch
  3 ports (1-hop and 3-hop paths; ``make sim RANKS=6 SIM_ARGS="--spines 1"``'s build). Its
  NIC is hier_build.TEST_NIC, built private (tb/fabric_top.py), so compiled apart from
  NicTop's public one; with one switch module, the cheapest shape measured
  (docs/fabric.md, Scenarios: Figures).
- ``test_moe_reduced_spine_cut`` (in ``make test``): the same step on the same build with
  leaf 0's spine cable cut both ways ``cut_at`` cycles into the workload (mid-packet) and
  restored once both ends went down (docs/fabric.md, A cut cable): every token still
  arrives byte-exact, the loss only where the cut explains it, recovered by RC
  retransmission (local ACK timeout code 3, 13,104 cycles).
- ``test_moe_8_ranks``, ``test_kv_small``: the default 8-NIC fabric (the build ``make sim``
  and tb/test_fabric.py share), marked full: a first build of it takes 6 to 7 minutes.
"""
import json

import pytest

from tb.fabric_scenarios import launch

REDUCED_MOE = dict(scenario="moe", ranks=6, spines=1, tokens=2, topk=2, experts_per_rank=2)
MOE_8_RANKS = dict(scenario="moe", ranks=8, tokens=2, topk=2, experts_per_rank=2)
SMALL_KV = dict(scenario="kv", kv_blocks=4, kv_block_bytes=16384, background_messages=2,
                background_bytes=2048)
# What the scenario checks (fabric_scenarios.Scenario.run): a check that went missing would
# pass silently.
CHECKS = {"tokens_intact", "signals_counted", "memories_match_model", "no_overflow",
          "cqes_complete", "messages_landed"}
LOSSLESS_CHECKS = {"no_drops", "no_retransmissions"}
CUT_CHECKS = {"drops_only_from_the_cut", "cut_recovered"}
SPINE_CUT_MOE = dict(REDUCED_MOE, ack_timeout=3, cut_link="leaf0.p2", cut_at=700)


def run(config):
    run_dir = launch(config)
    results = json.loads((run_dir / "scenario_results.json").read_text())
    cut = bool(config.get("cut_link"))
    assert set(results["checks"]) == CHECKS | (CUT_CHECKS if cut else LOSSLESS_CHECKS), \
        sorted(results["checks"])
    assert all(results["checks"].values()), (results["checks"], results["failures"])
    if not cut:
        assert results["drops"]["total"] == 0 and results["retransmissions"]["total"] == 0
    assert results["overflows"] == 0
    assert results["cqes"]["send_cqes"] == results["cqes"]["posted_wqes"] > 0
    print(f"{config['scenario']}, {results['config']['ranks']} ranks: {results['cycles']} "
          f"cycles, {results['wall_seconds']} s of simulation")
    return results


def check_moe(results):
    assert {p["name"] for p in results["phases"]} == {"dispatch", "combine"}
    # every signal went as DeepEP posts it (a 4-byte masked fetch-add), every token as a
    # put, besides the latency probe's inline WRITEs (one per trial on each of 2 paths)
    kinds = {kind: sum(m["kind"] == kind for m in results["messages"])
             for kind in ("signal", "dispatch", "combine")}
    probe = 2 * results["latency"]["trials"]
    assert results["cqes"]["send_cqes_by_opcode"] == {
        "ATOMIC_MASKED_FA": kinds["signal"],
        "RDMA_WRITE": kinds["dispatch"] + kinds["combine"] + probe}
    assert all(p["end"] > p["start"] for p in results["phases"])
    # both path lengths crossed: the latency probe's and the workload's own messages
    assert results["latency"]["hop1"]["hops"] == 1 and results["latency"]["hop3"]["hops"] == 3
    assert {m["hops"] for m in results["messages"]} == {1, 3}


def test_moe_reduced():
    check_moe(run(REDUCED_MOE))


def test_moe_reduced_spine_cut():
    results = run(SPINE_CUT_MOE)
    check_moe(results)
    cut = results["cut"]
    assert cut["cable"] == "leaf0-spine0" and cut["cut"] < cut["down"] < cut["up"], cut
    # the cut hit traffic, and RC recovered it
    assert results["drops"]["total"] > 0 and results["retransmissions"]["total"] > 0
    dispatch, combine = (p["end"] - p["start"] for p in results["phases"])
    print(f"spine cable cut at {cut['cut']}, down at {cut['down']}, up at {cut['up']}; "
          f"dispatch {dispatch}, combine {combine} cycles; drops {results['drops']['total']}, "
          f"retransmissions {results['retransmissions']['total']}")


@pytest.mark.full
def test_moe_8_ranks():
    check_moe(run(MOE_8_RANKS))


@pytest.mark.full
def test_kv_small():
    results = run(SMALL_KV)
    kv = next(p for p in results["phases"] if p["name"] == "kv")
    assert kv["end"] > kv["start"]
