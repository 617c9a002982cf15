# Fresh machine: `make demo` runs the main job, `make test` runs the tests. Each sets itself up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TMPDIR := $(CURDIR)/build/tmp
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/build/inductor

.PHONY: setup test test-fast test-capability test-mcore-next demo grpo verl-trainer cookbook-venv tinker-cookbook \
	bench lint clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch resolved on a bare machine pulls a multi-GB CUDA build.
# verl (for mcore_engine.integrations.verl and its tests) without its dependencies: its pins on
# tensordict / transformers are older than ours; the `verl` extra brings what its modules import,
# held at our torch / tensordict / transformers by constraints.txt. skyrl (the Tinker API server of
# mcore_engine.integrations.tinker) the same way: its pins on transformers / peft are older than ours;
# the `tinker` extra brings its server's light dependencies and the tinker client.
VERL_VERSION := 0.9.1
SKYRL_VERSION := 0.3.0
$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,kernels,hf,verl,tinker]'
	$(PY) -m pip install -q --no-deps verl==$(VERL_VERSION)
	$(PY) -m pip install -q --no-deps skyrl==$(SKYRL_VERSION)
	touch $(STAMP)

test: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q tests --durations=15

test-fast: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q tests -m "not slow"

# The tests that compare layouts or code paths after optimizer steps, again under another CPU kernel
# set (ATEN_CPU_CAPABILITY: default = no SIMD, avx2, avx512): a comparison that passes under one and
# fails under another measures rounding, not math. CI runs CAPABILITY=default.
CAPABILITY ?= default
CAPABILITY_TESTS := tests/test_compare.py tests/test_context_parallel.py tests/test_sequence_parallel.py \
	tests/test_engine_parallel.py tests/test_moe.py tests/test_value_head.py tests/test_deepseek.py \
	tests/test_checkpoint.py tests/test_moe_routing.py tests/test_engine.py tests/integrations/test_verl.py \
	tests/test_hybrid_layouts.py tests/test_hybrid_features.py tests/layers/test_gated_delta_net.py \
	tests/test_gpt_oss_layouts.py tests/test_vlm_layouts.py tests/test_vlm_transformers.py \
	tests/test_grad_accumulation.py tests/integrations/test_tinker_backend.py
test-capability: $(STAMP)
	@mkdir -p $(TMPDIR)
	ATEN_CPU_CAPABILITY=$(CAPABILITY) $(PY) -m pytest -q $(CAPABILITY_TESTS)

# Second CI leg: the non-slow tests against the newest megatron-core 0.19.x, the line that GPU users
# on Python 3.12 run (setup.py accepts >=0.16.1,<0.20; the main venv stays on 0.16.1). Its own venv,
# set up as the main one (torch pinned first, our deps and verl's held by constraints.txt, which brings
# megatron-core 0.16.1), then 0.19.x over it without its deps: its wheel says Requires-Python >=3.12
# but a cp311 build is published; it needs nothing the main venv lacks (triton comes with `kernels`).
# the newest 0.19.x: `pip index versions --ignore-requires-python megatron-core` (plain: only <= 0.16.1)
MCORE_NEXT_VERSION := 0.19.2
NEXT_VENV  := .venv-mcore-next
NEXT_PY    := $(NEXT_VENV)/bin/python
NEXT_STAMP := $(NEXT_VENV)/.installed-$(MCORE_NEXT_VERSION)

$(NEXT_STAMP): setup.py constraints.txt
	test -x $(NEXT_PY) || $(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_PY) -m pip install -q --upgrade pip
	$(NEXT_PY) -m pip install -q torch==2.13.0
	$(NEXT_PY) -m pip install -q -c constraints.txt -e '.[dev,kernels,hf,verl,tinker]'
	$(NEXT_PY) -m pip install -q --no-deps verl==$(VERL_VERSION)
	$(NEXT_PY) -m pip install -q --no-deps skyrl==$(SKYRL_VERSION)
	$(NEXT_PY) -m pip install -q --no-deps --ignore-requires-python megatron-core==$(MCORE_NEXT_VERSION)
	touch $(NEXT_STAMP)

test-mcore-next: $(NEXT_STAMP)
	@mkdir -p $(TMPDIR)
	@$(NEXT_PY) -c "import importlib.metadata as m; print('megatron-core', m.version('megatron-core'))"
	$(NEXT_PY) -m pytest -q tests -m "not slow"

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

# An unmodified tinker-cookbook 0.4.3 recipe against the Tinker server (docs/tinker.md), in a venv of its
# own: the cookbook pins transformers<=5.5.4 (ours: 5.24). The server runs from the main venv.
COOKBOOK_VENV  := .venv-cookbook
COOKBOOK_PY    := $(COOKBOOK_VENV)/bin/python
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed
$(COOKBOOK_STAMP): constraints-cookbook.txt
	test -x $(COOKBOOK_PY) || $(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_PY) -m pip install -q --upgrade pip
	$(COOKBOOK_PY) -m pip install -q torch==2.13.0
	$(COOKBOOK_PY) -m pip install -q -c constraints-cookbook.txt tinker==0.24.1 tinker-cookbook==0.4.3 transformers==5.5.4
	touch $(COOKBOOK_STAMP)

cookbook-venv: $(COOKBOOK_STAMP)

tinker-cookbook: $(STAMP) $(COOKBOOK_STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) -m pytest -q tests/integrations/test_tinker_cookbook.py

bench: $(STAMP)
	@mkdir -p $(TMPDIR)
	$(PY) tools/bench.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf build runs .pytest_cache
