# tokenfabric: every target that needs Python tools creates .venv itself.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOBS ?= 2
# A Verilator build's items on one worker, the rest one by one in tb/conftest.py's order.
DIST := --dist loadgroup --no-loadscope-reorder
# Verilator's generated makefiles call `python`: put the venv first on PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONPATH := $(CURDIR)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: all sim test test-full bench fpga formal verilog lint clean prereqs

all: test

prereqs:
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found: apt-get install python3"; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { echo "error: Python venv support missing: apt-get install python3-venv"; exit 1; }
	@$(PYTHON) tools/check_libpython.py || exit 1
	@command -v perl >/dev/null || { echo "error: perl not found (Verilator needs it): apt-get install perl"; exit 1; }
	@command -v g++ >/dev/null || { echo "error: g++ not found (Verilator needs it): apt-get install g++"; exit 1; }

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory prereqs
	@echo "Creating $(VENV) and installing tokenfabric's dependencies from PyPI..."
	@$(PYTHON) -m venv $(VENV)
	@$(VPY) -m pip install -q --upgrade pip
	@$(VPY) -m pip install -q -e .
	@touch $@

# make sim SCENARIO=kv RANKS=8 TOKENS=4 TOPK=2 WIRE_DELAY=8 MEMORY_LATENCY=200 SEED=1 WAVES=1:
# each variable given becomes its option of `python -m tb.sim` (--help); SIM_ARGS the others.
sim_option = $(if $($(1)),$(2) $($(1)))
SIM_OPTIONS = $(strip $(call sim_option,SCENARIO,--scenario) $(call sim_option,RANKS,--ranks) \
	$(call sim_option,TOKENS,--tokens) $(call sim_option,TOPK,--topk) \
	$(call sim_option,WIRE_DELAY,--wire-delay) $(call sim_option,MEMORY_LATENCY,--memory-latency) \
	$(call sim_option,SEED,--seed) $(if $(filter-out 0,$(WAVES)),--waves))

sim: $(STAMP)
	$(VPY) -m tb.sim $(SIM_OPTIONS) $(SIM_ARGS)

test: $(STAMP)
	$(VPY) -m pytest -n $(JOBS) $(DIST) -m "not full" --durations=30 $(PYTEST_ARGS)

test-full: $(STAMP)
	$(VPY) -m pytest -n $(JOBS) $(DIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VPY) -m tb.bench $(BENCH_ARGS)

# Synthesis of every top (docs/fpga.md): build/fpga/report.md and fpga.* in build/bench/results.json.
fpga: $(STAMP)
	$(VPY) -m tb.bench --only fpga $(BENCH_ARGS)

# SymbiYosys proofs of the lossless rules (docs/formal.md); the fast ones also run in make test.
formal: $(STAMP)
	$(VPY) -m pytest -n $(JOBS) tb/test_formal.py $(PYTEST_ARGS)

verilog: $(STAMP)
	$(VPY) -m hdl.emit --out build/verilog

lint: verilog
	$(VPY) -m hdl.lint build/verilog

clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
