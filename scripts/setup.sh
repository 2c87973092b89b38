#!/usr/bin/env bash
# Create .venv and install slimline with its dependencies. Idempotent; safe to rerun.
# torch is installed first, pinned to the CPU build, so no later resolve can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
.venv/bin/python -c "import torch, onnxruntime; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(); print('slimline environment ready: torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
