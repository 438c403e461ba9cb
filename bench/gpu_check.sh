#!/usr/bin/env bash
# The GPU path, proven on a GPU in under 8 minutes (docs/gpu.md).  One PASS / FAIL / SKIP line
# per check, with its numbers, and a summary; the full output goes to a log file.
#
#   bash bench/gpu_check.sh                  # one GPU: steps 1-6
#   bash bench/gpu_check.sh --nproc 2        # two GPUs: TP, PP, VPP, EP, CP, DP layouts + the
#                                            #   overlap_param_gather save check
#   bash bench/gpu_check.sh --dry-run        # print the plan (the commands), run nothing
#   bash bench/gpu_check.sh --cpu-smoke      # the Python checks shrunk, on CPU (no GPU needed)
#
# Options: --log FILE (default runs/gpu_check-<time>.log), --python PY (an interpreter that
# has torch; default: $XHC_PYTHON, then ./runs/.venv-gpu, then python3), --wheels DIR (offline
# wheels for what that interpreter lacks: megatron-core, pyyaml, ...), --budget SECONDS
# (default 470: later steps are skipped once the budget is spent).
#
# Python: if the interpreter imports torch but not megatron.core, a venv runs/.venv-gpu is made
# with --system-site-packages (it reuses the CUDA torch), the missing requirements are
# installed (from --wheels when given) and this repository with `pip install -e . --no-deps`.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
NPROC=1
DRY=0
SMOKE=0
LOG=""
PY="${XHC_PYTHON:-}"
WHEELS=""
BUDGET=470

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) NPROC="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --log) LOG="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$NPROC" in 1|2) ;; *) echo "error: --nproc must be 1 or 2, got $NPROC" >&2; exit 2 ;; esac

STAMP=$(date +%Y%m%d-%H%M%S)
[ -n "$LOG" ] || LOG="runs/gpu_check-$STAMP.log"
mkdir -p "$(dirname "$LOG")"
WORK="runs/gpu_check-$STAMP"
DEVICE=cuda
CHECK_ARGS=(--workdir "$WORK")
if [ "$SMOKE" = 1 ]; then DEVICE=cpu; CHECK_ARGS+=(--device cpu --smoke); fi

# ---- the plan: name, time limit (s), command ---------------------------------------------------
PLAN_NAMES=()
PLAN_LIMITS=()
PLAN_CMDS=()
plan() { PLAN_NAMES+=("$1"); PLAN_LIMITS+=("$2"); PLAN_CMDS+=("$3"); }
CHK="\$PY -m bench.gpu_checks ${CHECK_ARGS[*]}"
if [ "$NPROC" = 1 ]; then
  plan "1+4+5 train/eval, pipeline boundary, spec parity" 120 "$CHK train_eval pipeline spec"
  plan "2 variants (selective recompute)" 80 "$CHK variants"
  plan "3 checkpoint round trips" 110 "$CHK resume"
  if [ "$SMOKE" = 1 ]; then
    plan "6a kernel tests (CUDA)" 5 "echo 'SKIP kernel tests: CPU smoke run'"
    plan "6b HC kernel benchmark" 5 "echo 'SKIP HC kernel benchmark: CPU smoke run'"
  else
    plan "6a kernel tests (CUDA)" 60 "if [ -f tests/test_hc_kernels.py ]; then \$PY -m pytest -q -x -p no:cacheprovider tests/test_hc_kernels.py tests/test_liger_mhc.py -k 'cuda or liger_backend' && echo 'PASS kernel tests: tests/test_hc_kernels.py -k cuda, tests/test_liger_mhc.py -k liger_backend' || echo 'FAIL kernel tests: see the log'; else echo 'SKIP (not present) kernel tests: tests/test_hc_kernels.py'; fi"
    plan "6b HC kernel benchmark" 40 "if [ -f bench/hc_kernels.py ]; then \$PY -m bench.hc_kernels --device cuda --dtype bf16 --hidden 2048 --tokens 8192 && echo 'PASS HC kernel benchmark: numbers above' || echo 'FAIL HC kernel benchmark: see the log'; else echo 'SKIP (not present) HC kernel benchmark: bench/hc_kernels.py'; fi"
  fi
  plan "6c throughput, shrunk paper preset" 90 "$CHK throughput"
else
  LAUNCH="\$TORCHRUN --standalone --nproc_per_node 2"
  plan "2-GPU layouts + overlap_param_gather save" 420 "$LAUNCH -m bench.gpu_checks ${CHECK_ARGS[*]} multi"
fi

if [ "$DRY" = 1 ]; then
  echo "bench/gpu_check.sh plan (--nproc $NPROC, device $DEVICE, budget ${BUDGET}s, log $LOG):"
  echo "  0. environment: python with torch + megatron.core (venv runs/.venv-gpu if needed), GPU name, versions"
  for i in "${!PLAN_NAMES[@]}"; do
    echo "  step ${PLAN_NAMES[$i]} (limit ${PLAN_LIMITS[$i]}s): ${PLAN_CMDS[$i]}"
  done
  exit 0
fi

exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
echo "[gpu_check] $(date -u +%Y-%m-%dT%H:%M:%SZ) nproc=$NPROC device=$DEVICE log=$LOG"
if command -v git >/dev/null 2>&1 && git rev-parse --git-dir >/dev/null 2>&1; then
  echo "[gpu_check] commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ local changes)')"
fi
SUMMARY=()

# ---- 0. environment ------------------------------------------------------------------------------
has() { "$1" -c "import $2" >/dev/null 2>&1; }
pick_python() {
  for cand in "$PY" "$ROOT/runs/.venv-gpu/bin/python" python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if has "$cand" torch; then PY="$cand"; return 0; fi
  done
  return 1
}
env_fail() { echo "FAIL environment: $1"; SUMMARY+=("FAIL environment: $1"); }
if ! pick_python; then
  env_fail "no python with torch found (set --python or XHC_PYTHON)"
else
  [ -d runs/.gpu-deps ] && export PYTHONPATH="$ROOT/runs/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"  # an earlier install
  if ! has "$PY" "megatron.core" || ! has "$PY" yaml; then
    # A venv on top of the interpreter's packages (its CUDA torch stays the one used); where
    # venv is unavailable, a --target folder on PYTHONPATH.  megatron-core without its
    # dependencies, so that pip never replaces torch.
    PIPOPT=(-q --disable-pip-version-check)
    [ -n "$WHEELS" ] && PIPOPT+=(--no-index --find-links "$WHEELS")
    mkdir -p runs
    [ -x runs/.venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages runs/.venv-gpu >/dev/null 2>&1
    if [ -x runs/.venv-gpu/bin/python ] && has runs/.venv-gpu/bin/python torch; then
      echo "[gpu_check] $PY lacks megatron.core / yaml: installing into runs/.venv-gpu (system site packages)"
      PY="$ROOT/runs/.venv-gpu/bin/python"
      DEST=()
    else  # no venv module, or $PY is itself a venv (a venv on top of it does not see its torch)
      rm -rf runs/.venv-gpu
      echo "[gpu_check] $PY lacks megatron.core / yaml: installing into runs/.gpu-deps (on PYTHONPATH)"
      DEST=(--target "$ROOT/runs/.gpu-deps")
      export PYTHONPATH="$ROOT/runs/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -m pip install "${PIPOPT[@]}" "${DEST[@]}" --no-deps "megatron-core>=0.16.1" \
      && "$PY" -m pip install "${PIPOPT[@]}" "${DEST[@]}" pyyaml packaging tqdm \
      || echo "[gpu_check] installing the requirements failed (offline? pass --wheels DIR with megatron-core and pyyaml)"
  fi
  if ! "$PY" -c "import training.pretrain" >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
      || echo "[gpu_check] pip install -e . --no-deps failed; running from the source tree (PYTHONPATH)"
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  INFO=$("$PY" - "$DEVICE" <<'PY' 2>&1
import sys
import torch
want = sys.argv[1]
try:
    import megatron.core as mc
    mcv = getattr(mc, "__version__", "?")
except Exception as e:  # reported, the checks will fail loudly
    mcv = f"MISSING ({type(e).__name__})"
try:
    import transformer_engine
    te = transformer_engine.__version__
except Exception:
    te = "not installed"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
n = torch.cuda.device_count()
ok = (want == "cpu" or torch.cuda.is_available()) and not mcv.startswith("MISSING")
print(f"{'PASS' if ok else 'FAIL'} environment: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {n} GPU(s): {gpu}; megatron-core {mcv}; transformer-engine {te}")
PY
)
  echo "$INFO"
  VERDICT=$(echo "$INFO" | grep -E '^(PASS|FAIL) environment' | tail -1)
  [ -n "$VERDICT" ] || VERDICT="FAIL environment: $PY: $(echo "$INFO" | tail -1)"
  SUMMARY+=("$VERDICT")
  TORCHRUN=("$PY" -m torch.distributed.run)
  if [ "$NPROC" = 2 ] && [ "$SMOKE" = 0 ]; then
    NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    [ "$NGPU" -ge 2 ] || env_fail "--nproc 2 needs 2 GPUs, found $NGPU"
  fi
fi

# ---- the steps ---------------------------------------------------------------------------------
run_step() {
  local name="$1" limit="$2" cmd="$3" out rc now left
  now=$(date +%s)
  left=$((BUDGET - (now - T0)))
  if [ "$left" -lt 15 ]; then
    echo "SKIP step $name: time budget spent"; SUMMARY+=("SKIP step $name: time budget spent"); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo ""
  echo "=== step $name (limit ${limit}s)"
  cmd=${cmd//\$PY/$PY}
  cmd=${cmd//\$TORCHRUN/${TORCHRUN[*]}}
  out=$(mktemp)
  timeout --signal=TERM --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  local lines
  lines=$(grep -E '^(PASS|FAIL|SKIP) ' "$out")
  if [ -n "$lines" ]; then
    while IFS= read -r l; do SUMMARY+=("$l"); done <<< "$lines"
  fi
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    SUMMARY+=("FAIL step $name: timed out after ${limit}s")
  elif [ "$rc" != 0 ] && ! grep -qE '^FAIL ' "$out"; then
    SUMMARY+=("FAIL step $name: exit code $rc (see $LOG)")
  fi
  echo "[gpu_check] step $name: exit $rc after $(( $(date +%s) - now ))s"
  rm -f "$out"
}

if printf '%s\n' "${SUMMARY[@]}" | grep -q '^FAIL environment'; then
  echo "[gpu_check] environment not usable: steps not run"
else
  for i in "${!PLAN_NAMES[@]}"; do
    run_step "${PLAN_NAMES[$i]}" "${PLAN_LIMITS[$i]}" "${PLAN_CMDS[$i]}"
  done
fi

# ---- summary -----------------------------------------------------------------------------------
echo ""
echo "=== summary ($(( $(date +%s) - T0 ))s, log $LOG)"
NFAIL=0
for l in "${SUMMARY[@]}"; do
  echo "$l"
  case "$l" in FAIL*) NFAIL=$((NFAIL + 1)) ;; esac
done
if [ "$NFAIL" = 0 ]; then echo "[gpu_check] ALL PASSED (SKIP lines are not failures)"; else echo "[gpu_check] $NFAIL FAILED"; fi
rm -rf "$WORK"
[ "$NFAIL" = 0 ]
