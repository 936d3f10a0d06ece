"""pytest launchers of the fabric scenarios (tb/fabric_scenarios.py) on the default fabric
(8 NICs, 4 leaves, 2 spines: the build `make sim` and tb/test_fabric.py share): a reduced
MoE step and a small KV-cache push. Each fails unless every check of the scenario passed
(tokens intact at the right rank and offset, signals counted, memories equal to the models,
no drop, no overflow, no retransmission, every CQE as predicted).

Marked full: a first build of the fabric takes 6 to 7 minutes on 2 cores (docs/fabric.md);
whether the reduced MoE joins `make test` is decided with the CI time budget.
"""
import json

import pytest

from tb.fabric_scenarios import launch

REDUCED_MOE = dict(scenario="moe", tokens=2, topk=2, experts_per_rank=2)
SMALL_KV = dict(scenario="kv", kv_blocks=4, kv_block_bytes=16384, background_messages=2,
                background_bytes=2048)


def run(config):
    run_dir = launch(config)
    results = json.loads((run_dir / "scenario_results.json").read_text())
    assert all(results["checks"].values()), results["checks"]
    print(f"{config['scenario']}: {results['cycles']} cycles, "
          f"{results['wall_seconds']} s of simulation")
    return results


@pytest.mark.full
def test_moe_reduced():
    results = run(REDUCED_MOE)
    assert {p["name"] for p in results["phases"]} == {"dispatch", "combine"}
    assert results["drops"]["total"] == 0 and results["retransmissions"]["total"] == 0


@pytest.mark.full
def test_kv_small():
    results = run(SMALL_KV)
    kv = next(p for p in results["phases"] if p["name"] == "kv")
    assert kv["end"] > kv["start"]
