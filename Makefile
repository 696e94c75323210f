# The two commands in the README: `make serve` and `make test`. Each sets up .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
HOST    ?= 127.0.0.1
PORT    ?= 30000
MODEL   ?= demo-vl
ARGS    ?=
# constraints.txt pins every package to the versions CI tests (pyproject.toml only gives ranges). compat: the
# checkout goes on sys.path itself, so a script run from the clone's parent folder imports the package, not the
# clone's folder as an empty namespace package.
PIP_INSTALL := $(BIN)/pip install --progress-bar on -c constraints.txt --config-settings editable_mode=compat

.PHONY: setup serve test test-fast eval-vl train-vl train-draft eval-asr train-asr clean

# `make serve` installs what serving needs; `make test` adds the test tools (pytest, lm-eval, selenium, ...).
$(STAMP): pyproject.toml constraints.txt
	@echo "== Setting up $(VENV) (first time only): torch, transformers and Tessera's other dependencies."
	@echo "   About 1.5 minutes and 5.9 GB with PyPI's torch (3.2 GB of it CUDA libraries, used on a GPU only);"
	@echo "   see docs/usage.md for the smaller CPU-only torch."
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP_INSTALL) -e .
	touch $(STAMP)

# SGLang's benchmark client, which tests/server/test_peer_clients.py points at `tessera serve`: the sglang
# package without its dependencies (its GPU stack), plus the few modules bench_serving imports (~15 s). instructor
# (tests/server/test_app_libraries.py) comes the same way: its metadata asks for jiter < 0.15 and rich < 15, older
# than the pinned openai's jiter and typer's rich, but it runs on both; docstring-parser is its one missing module.
PEER_CLIENT := sglang orjson pybase64 msgspec ipython traitlets apache-tvm-ffi sentencepiece gguf \
	instructor docstring-parser

$(TEST_STAMP): $(STAMP)
	@echo "== Adding the test tools to $(VENV)"
	$(PIP_INSTALL) -e '.[test]'
	$(BIN)/pip install --progress-bar on -c constraints.txt --no-deps $(PEER_CLIENT)
	touch $(TEST_STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/tessera serve --model-path $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

# Tests run in TEST_WORKERS processes (pytest-xdist), a file per worker at a time so module fixtures (servers,
# checkpoints) are built once (the files that run every family, by family: tests/conftest.py). Most tests wait on
# child processes (schedulers, servers) part of the time: two workers on 2 cores took the suite from 1064 to
# 720 s; with six more families, three workers ran it in 616 s. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
PYTEST  := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(TEST_STAMP)
	$(PYTEST) $(ARGS)

test-fast: $(TEST_STAMP)
	$(PYTEST) -m "not slow" $(ARGS)

eval-vl: $(STAMP)
	$(BIN)/python -m demo.eval_vl --model-path tessera/assets/demo-vl

# Stages 1-4 (the scenes), then stage 5 (the copy task) from their checkpoint into the shipped one.
train-vl: $(STAMP)
	$(BIN)/python -m demo.train_vl --work-dir .train/demo-vl --out .train/demo-vl/scenes
	$(BIN)/python -m demo.train_copy --base .train/demo-vl/scenes --work-dir .train/demo-vl-copy \
		--out tessera/assets/demo-vl

# demo-vl-draft, demo-vl's STANDALONE speculative draft, distilled from demo-vl's greedy outputs (minutes).
train-draft: $(STAMP)
	$(BIN)/python -m demo.train_draft --work-dir .train/demo-vl-draft --out tessera/assets/demo-vl-draft

# demo-asr data is synthesised with espeak-ng (apt-get install espeak-ng); tests and serving never need it.
eval-asr: $(STAMP)
	$(BIN)/python -m demo.eval_asr --model-path tessera/assets/demo-asr

train-asr: $(STAMP)
	$(BIN)/python -m demo.train_asr --work-dir .train/demo-asr --out tessera/assets/demo-asr

clean:
	rm -rf $(VENV) .pytest_cache
