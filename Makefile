# Fresh machine: `make demo` runs the main job, `make test` runs the tests. Each sets itself up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TMPDIR := $(CURDIR)/build/tmp
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/build/inductor

.PHONY: setup test test-fast demo grpo verl-trainer bench lint clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch resolved on a bare machine pulls a multi-GB CUDA build.
# verl (for mcore_engine.integrations.verl and its tests) without its dependencies: its pins on
# tensordict / transformers are older than ours; the `verl` extra brings what its modules import,
# held at our torch / tensordict / transformers by constraints.txt.
VERL_VERSION := 0.9.1
$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,kernels,hf,verl]'
	$(PY) -m pip install -q --no-deps verl==$(VERL_VERSION)
	touch $(STAMP)

test: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q tests -m "not slow"

demo: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 tools/train.py $(ARGS)

# GRPO recipe: a tiny random GPT learns a rule-rewarded toy task (count up mod V), TP=2 on CPU.
grpo: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 tools/grpo.py $(ARGS)

# verl 0.9.1's own trainer (main_ppo: GRPO + critic, on-policy distillation) on this engine, on CPU
verl-trainer: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q tests/integrations/test_verl_trainer.py

bench: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) tools/bench.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf build runs .pytest_cache
