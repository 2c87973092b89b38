#!/usr/bin/env bash
# Regenerate constraints.txt, the verified version set that scripts/setup.sh installs (README,
# "Versions"). The resolver is uv's `uv pip compile`, installed into a throwaway venv, never .venv.
#
#   bash scripts/lock.sh                               # re-resolve, keeping every existing pin
#   bash scripts/lock.sh --upgrade-package onnxruntime # a deliberate upgrade of one package
#   bash scripts/lock.sh --upgrade                     # a deliberate upgrade of everything
#   bash scripts/lock.sh -c <(.venv/bin/pip freeze --exclude-editable)  # pin what a green env has
#
# Extra arguments go to `uv pip compile`. An upgrade is a change like any other: commit the new
# constraints.txt and CI installs exactly it from scratch and runs the whole suite on it.
# torch is the CPU build from the wheel that pip's find-links directory holds (TORCH_WHEELS,
# /opt/wheels on this project's machines): resolving against PyPI's torch would pull CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
if ! ls "$TORCH_WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  echo "error: no torch 2.13.0 CPU wheel in $TORCH_WHEELS; set TORCH_WHEELS to the folder that has it" >&2
  exit 2
fi
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
"${PYTHON:-python3}" -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install --quiet "uv==$UV_VERSION"
"$tools/venv/bin/uv" pip compile pyproject.toml --extra dev --extra openvino \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --find-links "$TORCH_WHEELS" --custom-compile-command "bash scripts/lock.sh" \
  --output-file constraints.txt "$@"
