#!/usr/bin/env bash
# The emulated AVX2 lane: run the tests marked `cpu_kinds` (their expectation depends on INT8
# kernels, formats or numerics, or on which format the machine picks) under an AVX2-only CPU,
# whatever this machine is. `qemu-x86_64 -cpu Haswell-noTSX` executes AVX2 and reports no AVX512
# and no VNNI through CPUID, so ONNX Runtime, OpenVINO and PyTorch take their AVX2 kernels, as on
# a real AVX2 machine. Timing under emulation is not timing: the marked tests assert none.
#
#   bash scripts/test-cpu-kinds.sh            # the marked set
#   bash scripts/test-cpu-kinds.sh -k qat     # extra pytest arguments narrow it
#
# Needs QEMU >= 8 (scripts/install-qemu.sh; Debian 12's 7.2 mis-emulates AVX2).
set -euo pipefail
cd "$(dirname "$0")/.."
QEMU_MIN_MAJOR=8
qemu=${SLIMLINE_QEMU:-}
for cand in "$qemu" /usr/local/bin/qemu-x86_64 "$(command -v qemu-x86_64 || true)"; do
  [ -n "$cand" ] && [ -x "$cand" ] || continue
  major=$("$cand" --version 2>/dev/null | sed -n 's/^qemu-x86_64 version \([0-9]*\)\..*/\1/p' | head -1)
  if [ "${major:-0}" -ge "$QEMU_MIN_MAJOR" ]; then qemu=$cand; break; fi
  qemu=""
done
if [ -z "$qemu" ]; then
  msg="the emulated AVX2 lane needs qemu-x86_64 >= $QEMU_MIN_MAJOR: install it with 'bash scripts/install-qemu.sh' (root, Debian) or your distribution's qemu-user package"
  if [ "${CI:-}" = true ]; then echo "error: $msg" >&2; exit 1; fi
  echo "notice: $msg; skipping the lane" >&2
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  echo "notice: the emulated AVX2 lane is for x86-64 hosts; skipping it on $(uname -m)" >&2
  exit 0
fi

python=$PWD/.venv/bin/python
native=$("$python" -c 'from slimline.cpu import detect; print(detect().kind)')
if [ "$native" = x86-avx2 ] && [ -z "${SLIMLINE_LANE_ANYWAY:-}" ]; then
  echo "notice: this CPU is already x86-avx2, what the lane emulates: the native run covered it" >&2
  exit 0
fi
lane=$(mktemp -d)
trap 'rm -rf "$lane"' EXIT
cat >"$lane/python" <<WRAP
#!/bin/sh
exec "$qemu" -cpu Haswell-noTSX "$python" "\$@"
WRAP
chmod +x "$lane/python"
export SLIMLINE_LANE_PYTHON="$lane/python"
export PYTHONPATH="$PWD/scripts/lane${PYTHONPATH:+:$PYTHONPATH}"
export SLIMLINE_EXPECT_CPU_KIND=x86-avx2  # tests/conftest.py stops the run if CPUID says otherwise
export HF_HUB_OFFLINE=1
# the same cache as the native run: step results are keyed by CPU kind, and the examples' trained
# weights are a model like any other (training them again under emulation would only cost time)
export SLIMLINE_CACHE="${SLIMLINE_CACHE:-$PWD/.slimline-cache}"
echo "emulated AVX2 lane: $("$qemu" --version | head -1), -cpu Haswell-noTSX"
# only the files that mark tests: collecting the whole suite under emulation would import every
# module of it (Ray, the servers...) at a tenth of native speed, for tests that are not run
mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.cpu_kinds|cpu_kind\b' tests | sort)
# emulation_slow: the few marked tests whose PyTorch training takes minutes under emulation; each
# says which lane test covers what it checks that depends on the CPU kind
# one emulated worker per core (pytest-xdist): each test runs single-threaded under qemu-user, so
# the lane's wall time divides by the cores; SLIMLINE_LANE_WORKERS=0 runs it in one process
workers=${SLIMLINE_LANE_WORKERS:-$(nproc)}
"$lane/python" -m pytest -q -p no:cacheprovider -n "$workers" -m "cpu_kinds and not emulation_slow" \
  "${files[@]}" "$@"
