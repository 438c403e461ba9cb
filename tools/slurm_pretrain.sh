#!/usr/bin/env bash
# Multi-node pre-training on SLURM: one job = one run of `python -m training.pretrain`.
#
#   sbatch --nodes 8 tools/slurm_pretrain.sh configs/pretrain/moe-18b-xhc.yaml [key=value ...]
#
#   # A sweep of configs/sweeps/*.yaml as one array (written by `python -m tools.sweep run --executor slurm`)
#   XHC_SWEEP_ARMS=runs/sweeps/<name>/slurm_arms.jsonl sbatch --array 0-<arms-1> tools/slurm_pretrain.sh CONFIG.yaml
#
#   # N-sweep as a job array: task i trains arm i of XHC_SWEEP (variants of the config's preset file)
#   XHC_SWEEP="mhc-n2 mhc-n4 mhc-n8 mhc-n16 xhc-n2 xhc-n4 xhc-n8 xhc-n16" \
#     sbatch --array 0-7 --nodes 2 tools/slurm_pretrain.sh configs/pretrain/moe-2p5b-nsweep.yaml
#
# Launchers (XHC_LAUNCHER):
#   srun      (default) one SLURM task per GPU; RANK/WORLD_SIZE/LOCAL_RANK come from SLURM.  The
#             pre-emption signal reaches every rank directly, so a large checkpoint can take as
#             long as it needs.
#   torchrun  one task per node running `torchrun --nnodes ... --rdzv_backend c10d`.  torchrun
#             forwards SIGTERM to its workers but kills them 30 s later: the checkpoint must fit.
#
# Pre-emption and time limits: SLURM sends SIGTERM XHC_SIGNAL_LEAD seconds (default 300) before the
# end (`--signal=TERM@300` below); every rank then saves a checkpoint at the next step boundary and
# exits 0.  With XHC_REQUEUE=1 (default) an unfinished run requeues itself and resumes from that
# checkpoint (checkpoint.load: auto, and a fixed run.dir, as in the shipped GPU configs).
#
# Hangs: a rank whose watchdog finds a hang exits with status 86 (docs/reliability.md, "Hangs"); every
# rank leaves within its section's timeout.  Such a job is requeued too (XHC_REQUEUE=1) and resumes from
# the last verified checkpoint, up to XHC_MAX_HANG_RETRIES (default 3) hangs in a row (attempts.jsonl
# in the run dir).  Any status counts when status.json records a hang of this launch (torchrun reports
# a status of its own).
#
# Environment: XHC_VENV (the venv to activate; default .venv in the repository), XHC_MASTER_PORT
# (29500), XHC_GPUS_PER_NODE (SLURM_GPUS_ON_NODE or 8), NCCL_* as your cluster needs.
#SBATCH --job-name=xhc-pretrain
#SBATCH --nodes=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%A_%a.out
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: sbatch [--nodes N] tools/slurm_pretrain.sh CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/setup.py" ] && root="$SLURM_SUBMIT_DIR"
cd "$root"
config="$1"; shift
overrides=("$@")

# ---- one arm of a sweep ----------------------------------------------------------------------
# `python -m tools.sweep run --executor slurm` writes XHC_SWEEP_ARMS, a JSONL file whose line i holds
# the overrides of arm i (its run.dir included); task SLURM_ARRAY_TASK_ID trains that arm.
if [ -n "${XHC_SWEEP_ARMS:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
  mapfile -d '' -t arm_overrides < <(python3 -c "import json,sys; l=open(sys.argv[1]).read().splitlines()[int(sys.argv[2])]; sys.stdout.write(''.join(o+chr(0) for o in json.loads(l)['overrides']))" "$XHC_SWEEP_ARMS" "$SLURM_ARRAY_TASK_ID")
  overrides+=("${arm_overrides[@]}")
fi
if [ -n "${XHC_SWEEP:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
  read -r -a arms <<< "$XHC_SWEEP"
  arm="${arms[$SLURM_ARRAY_TASK_ID]}"
  file="$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['model']['preset'].rsplit(':',1)[0])" "$config")"
  name="$(basename "$config" .yaml)-$arm"
  overrides+=("model.preset=$file:$arm" "run.name=$name" "run.dir=runs/$name")
fi

venv="${XHC_VENV:-$root/.venv}"
# shellcheck disable=SC1091
[ -f "$venv/bin/activate" ] && source "$venv/bin/activate"

# Resolve the config once (errors show here, before any GPU is touched) and find the run dir.
run_dir="$(python -m training.pretrain --config "$config" "${overrides[@]}" --print-config \
  | python -c "import sys,yaml; print(yaml.safe_load(sys.stdin)['run']['dir'] or '')")"
if [ -z "$run_dir" ]; then  # a fixed run dir is what lets a requeued job resume
  run_dir="runs/$(basename "$config" .yaml)-${SLURM_JOB_ID:-local}"
  overrides+=("run.dir=$run_dir")
fi
mkdir -p logs

nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
gpus="${XHC_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"  # sed reads it all: no SIGPIPE under pipefail
port="${XHC_MASTER_PORT:-29500}"
export MASTER_ADDR="$head" MASTER_PORT="$port"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron's TP/SP comm overlap ordering
echo "[xhc] job ${SLURM_JOB_ID:-?}: $nodes node(s) x $gpus GPU(s), head $head:$port, run dir $run_dir"
echo "[xhc] config $config ${overrides[*]:-}"

status=0
launched_at="$(date +%s)"
case "${XHC_LAUNCHER:-srun}" in
  srun)
    # One task per GPU; each task maps SLURM's ids to torch.distributed's env:// variables.
    srun --kill-on-bad-exit=1 --ntasks-per-node="$gpus" --gpus-per-node="$gpus" --cpu-bind=none \
      bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE;
               exec python -m training.pretrain "$@"' _ --config "$config" "${overrides[@]}" || status=$?
    ;;
  torchrun)
    srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpu-bind=none \
      torchrun --nnodes "$nodes" --nproc_per_node "$gpus" --rdzv_id "${SLURM_JOB_ID:-xhc}" \
        --rdzv_backend c10d --rdzv_endpoint "$head:$port" \
        -m training.pretrain --config "$config" "${overrides[@]}" || status=$?
    ;;
  *) echo "XHC_LAUNCHER must be srun or torchrun" >&2; exit 2 ;;
esac

# ---- requeue a run a hang stopped (exit 86, or status.json's "hang" of this launch)
if [ "$status" -ne 0 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  verdict="$(python -c "import sys; from training.run import hang_retry; ok, why = hang_retry(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])); print(('requeue ' if ok else 'stop ') + why if why else '')" \
    "$run_dir" "$status" "$launched_at" "${XHC_MAX_HANG_RETRIES:-3}" || true)"
  if [ -n "$verdict" ]; then
    echo "[xhc] ${verdict#* }"
    if [ "${verdict%% *}" = "requeue" ] && [ "${XHC_REQUEUE:-1}" = "1" ]; then
      scontrol requeue "$SLURM_JOB_ID"
    fi
    exit 86
  fi
fi

# ---- requeue an unfinished run (time limit / pre-emption); training.pretrain writes status.json
if [ "$status" -eq 0 ] && [ "${XHC_REQUEUE:-1}" = "1" ] && [ -n "${SLURM_JOB_ID:-}" ] && [ -f "$run_dir/status.json" ]; then
  if python -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))['finished'] else 1)" "$run_dir/status.json"; then
    echo "[xhc] training finished"
  else
    echo "[xhc] stopped before the last step: requeueing job $SLURM_JOB_ID to resume from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  fi
fi
exit "$status"
