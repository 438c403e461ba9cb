#!/usr/bin/env bash
# CI stage 2, started by .ci/run in the background at its start: the Python 3.12 venv with the newest
# megatron-core (tools/compat_check.sh), then the Megatron-facing fast tests there in one pytest
# process, which runs beside the Quickstart's main job (its two threads leave about a third of the 2
# cores idle).  Writes "EXIT_STATUS SECONDS" to the file $1 (install failure: the install's status).
set -uo pipefail
cd "$(dirname "$0")/.."
out="$1"
t0=$(date +%s)
tools/compat_check.sh --install-only
rc=$?
echo "[ci] stage 2 install (Python 3.12) exit $rc after $(( $(date +%s) - t0 )) s"
if [ "$rc" -eq 0 ]; then
  t1=$(date +%s)
  XHC_COMPAT_MARKERS="megatron and not slow" tools/compat_check.sh
  rc=$?
  echo "[ci] stage 2 tests (Python 3.12, newest megatron-core) exit $rc after $(( $(date +%s) - t1 )) s"
fi
echo "$rc $(( $(date +%s) - t0 ))" > "$out"
