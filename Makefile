# Two commands do everything: `make demo` and `make test`. The venv lives in .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.browser
PROMETHEUS_STAMP := $(VENV)/.prometheus
# glibc's allocator settings for every process make starts (mesh/allocator.py, where the launcher
# takes them from; docs/engineering-notes.md G3 and G14): without the pad the heap is trimmed and
# regrown per received frame; with the pad alone every block from 128 KiB up is a fresh mmap;
# with an arena per thread each thread keeps its own free memory.
export MALLOC_TOP_PAD_ ?= 67108864
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_ARENA_MAX ?= 2

.PHONY: demo multihost sim-dashboard sim-compare chaos test lint bench bench-wire bench-model bench-link bench-kernel-link bench-cachedir bench-sim bench-router bench-tracing-off bench-policies sim-scheduler sim-paper search-paper validate-sim train browser clean prometheus

# A fresh machine downloads torch first (hundreds of MB): each step says what it does, and pip
# shows its own progress. Once installed, the stamps keep `make test` and `make demo` quiet.
TORCH_PIN := $(shell sed -n 's/^torch==//p' constraints.txt)
PIP_INSTALL := $(PIP) install --progress-bar on --disable-pip-version-check -c constraints.txt

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { echo "==> creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> upgrading pip"
	@$(PIP) install --quiet --upgrade pip
	@echo "==> installing torch $(TORCH_PIN) (large download, a few minutes on a fresh machine)"
	@$(PIP_INSTALL) torch
	@echo "==> installing the project and its dev tools"
	@$(PIP_INSTALL) -e '.[dev]'
	@touch $(STAMP)
	@echo "==> installed into $(VENV)"

# Debian's chromium for the browser tests (driven by playwright, installed with the project);
# never a browser download.
$(BROWSER_STAMP): $(STAMP)
	@echo "==> installing chromium for the browser tests (playwright drives Debian's chromium)"
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	@touch $(BROWSER_STAMP)

browser: $(BROWSER_STAMP)

# Debian's prometheus (with promtool) for the test that scrapes a running mesh
# (tests/test_prometheus.py); never a download of its own.
$(PROMETHEUS_STAMP): $(STAMP)
	@echo "==> installing prometheus for the scrape test (Debian's package)"
	@test -x /usr/bin/prometheus -a -x /usr/bin/promtool || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)
	@touch $(PROMETHEUS_STAMP)

prometheus: $(PROMETHEUS_STAMP)

# The supervisor (services/cli/supervisor.py) runs the Procfile, restarts a process that dies,
# prints the ready line once the router says ready, and exits 0 on Ctrl-C. It generates an
# admin token for the run unless PRFAAS_ADMIN_TOKEN is set.
demo: $(STAMP)
	exec $(VENV)/bin/prfaas up --procfile Procfile

# The demo mesh across two network namespaces made for the run (PrfaaS cluster | PD cluster,
# joined by a veth the kernel shapes to the link's rate; the browser stays here): the rehearsal
# of two machines (docs/deploy.md). Needs root; Ctrl-C removes every namespace it made.
multihost: $(STAMP)
	exec $(VENV)/bin/prfaas multihost --procfile Procfile

# Fault scenarios against the real mesh (services/chaos/); writes docs/reliability.md.
# About 5-10 minutes on 2 cores; CHAOS_ARGS=--quick for a short run.
chaos: $(STAMP)
	$(VENV)/bin/prfaas chaos $(CHAOS_ARGS)

# The dashboard on the simulated paper deployment (no GPU, no mesh): SPEED x the wall clock.
SPEED ?= 10
sim-dashboard: $(STAMP)
	$(VENV)/bin/prfaas sim-dashboard --speed $(SPEED) --port 8080

# PrfaaS-PD and homogeneous PD side by side on the same arrivals, 2.5 req/s (between their
# capacities): the compare page (docs/dashboard.md, "Comparing deployments").
sim-compare: $(STAMP)
	$(VENV)/bin/prfaas sim-dashboard --compare prfaas-pd,homogeneous --rate 2.5 --speed $(SPEED) --port 8080

test: $(STAMP) $(BROWSER_STAMP) $(PROMETHEUS_STAMP)
	$(PY) -m ruff check mesh services netem ui tests benchmarks
	$(PY) -m mypy mesh services netem ui
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check mesh services netem ui tests benchmarks
	$(PY) -m mypy mesh services netem ui

bench: bench-wire bench-model bench-link bench-cachedir bench-sim bench-router

bench-wire: $(STAMP)
	$(PY) benchmarks/bench_wire.py

bench-model: $(STAMP)
	$(PY) benchmarks/bench_model.py

bench-link: $(STAMP)
	$(PY) benchmarks/bench_link.py

# Not part of `bench`: it needs root (two network namespaces, tbf). The same KV transfers
# through the link emulator and over a tbf-shaped veth (docs/deploy.md); about a minute.
bench-kernel-link: $(STAMP)
	$(PY) benchmarks/bench_kernel_link.py

bench-cachedir: $(STAMP)
	$(PY) benchmarks/bench_cachedir.py

# One virtual hour of the paper's PrfaaS-PD at 3 req/s, on the virtual clock.
bench-sim: $(STAMP)
	$(PY) benchmarks/bench_sim.py --check-determinism

# The router's own cost: the real router against workers whose compute is free, beside a
# bare endpoint, and beside the router of BENCH_ROUTER_AGAINST if set (a commit or a
# checkout: both routers' CPU per request in the same rounds, then their calls per request).
BENCH_ROUTER_AGAINST ?=
bench-router: $(STAMP)
	$(PY) benchmarks/bench_router.py $(if $(BENCH_ROUTER_AGAINST),--against $(BENCH_ROUTER_AGAINST) --count-calls 2000)

# What tracing costs when off: the router of the merge that brought tracing (68d2110) against
# the router of its parent (868b00c), both exported from git, over this tree's backend: their
# instructions per request under callgrind (tracing_off_instructions_ratio, beside the parent
# against itself), calls per request, and CPU time per request over BENCH_TRACING_RUNS pairs
# of runs with an A/A control (about 12 minutes on 2 cores).
BENCH_TRACING_RUNS ?= 5
bench-tracing-off: $(STAMP)
	$(PY) benchmarks/bench_tracing_off.py --runs $(BENCH_TRACING_RUNS)

# The paper's Table 6, measured by the simulation: saturation and SLO capacity over 5 seeds,
# then the bandwidth-bound check on 8 Gbps (docs/simulation.md; QUICK=1 for a smoke run). Each
# seed's search is a Ray task on a local Ray instance, so every core works (docs/search.md).
sim-paper: $(STAMP)
	$(VENV)/bin/prfaas sim --scenario paper --out sim-results/paper --ray $(if $(QUICK),--quick)
	$(VENV)/bin/prfaas sim --scenario bandwidth-bound --out sim-results/bandwidth-bound --ray $(if $(QUICK),--quick)

# The paper's "about 15% at equal cost", measured: PrfaaS-PD against 16 H20 instances of
# homogeneous PD (one H200 instance priced as two H20; docs/paper-notes.md 5.4), each one's SLO
# capacity over seeds as Ray tasks on every core, and the same search run serially to time it
# (docs/search.md; about 25 minutes on 2 cores; QUICK=1 for a smoke run).
search-paper: $(STAMP)
	$(VENV)/bin/prfaas search --config services/sim/searches/paper-equal-cost.toml --out search-results/paper-equal-cost --against-serial $(if $(QUICK),--quick)

# The simulation against the live mesh under load (docs/simulation.md, "Validation against the
# live system"): profiles the engine first, then for each deployment (every request remote; the
# router deciding between a PrfaaS and a PD prefill worker) three loads of 150 requests on the
# live mesh and in the simulation; writes validation-results/<deployment>/ (about 15 minutes a
# deployment on 2 cores).
validate-sim: $(STAMP)
	$(VENV)/bin/prfaas validate-sim --reprofile --repeats 3 --deployment remote-1p1d \
		--deployment routed-1+1p1d --out validation-results

# The schedulers' scenario matrix (bandwidth dips at three loads, a slow ramp of the link, load
# bursts, slices of the Mooncake trace) under every policy and a sweep of static thresholds
# (the oracle), 3 seeds, on Ray; rewrites docs/policies.md's matrix section and its plots
# (services/sim/matrix.py; SEEDS=1 for a quicker look).
SEEDS ?= 3
sim-scheduler: $(STAMP)
	$(VENV)/bin/prfaas sim-scheduler --seeds $(SEEDS) --out sim-results/scheduler --docs docs/policies.md

# Not part of `bench`: it runs the whole mesh three times (about 10 minutes).
bench-policies: $(STAMP)
	$(PY) benchmarks/compare_policies.py

train: $(STAMP)
	$(VENV)/bin/prfaas train

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
