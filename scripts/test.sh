#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
export SLIMLINE_CACHE="${SLIMLINE_CACHE:-$PWD/.slimline-cache}"
.venv/bin/ruff check src tests bench
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
