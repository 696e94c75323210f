# The two commands in the README: `make serve` and `make test`. Each sets up .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 30000
MODEL   ?= demo-vl
ARGS    ?=

.PHONY: setup serve test test-fast eval-vl train-vl eval-asr train-asr clean

# constraints.txt pins every package to the versions CI tests (pyproject.toml only gives ranges).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/tessera serve --model-path $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

# Tests run in TEST_WORKERS processes (pytest-xdist), a file per worker at a time so module fixtures (servers,
# checkpoints) are built once. Most tests wait on child processes (schedulers, servers) part of the time:
# two workers on 2 cores took the suite from 1064 to 720 s. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST  := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) $(ARGS)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" $(ARGS)

eval-vl: $(STAMP)
	$(BIN)/python -m tessera.demo.eval_vl --model-path tessera/assets/demo-vl

train-vl: $(STAMP)
	$(BIN)/python -m tessera.demo.train_vl --work-dir .train/demo-vl --out tessera/assets/demo-vl

# demo-asr data is synthesised with espeak-ng (apt-get install espeak-ng); tests and serving never need it.
eval-asr: $(STAMP)
	$(BIN)/python -m tessera.demo.eval_asr --model-path tessera/assets/demo-asr

train-asr: $(STAMP)
	$(BIN)/python -m tessera.demo.train_asr --work-dir .train/demo-asr --out tessera/assets/demo-asr

clean:
	rm -rf $(VENV) .pytest_cache
