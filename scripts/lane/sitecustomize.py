"""Loaded by every Python of the emulated CPU lane (scripts/test-cpu-kinds.sh puts this folder on
PYTHONPATH). qemu-user emulates one process and does not follow exec: a child started with
``sys.executable`` would run natively, on the host's CPU kind. Pointing ``sys.executable`` at the
lane's wrapper makes every child (peak-RSS probes, servers, spawn pools) run emulated as well."""

import os
import sys

_lane = os.environ.get("SLIMLINE_LANE_PYTHON")
if _lane:
    sys.executable = _lane
