#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: the `minilm` example (all-MiniLM-L6-v2
# on the Lee corpus), a full optimize run with its report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/slimline optimize minilm "$@"
