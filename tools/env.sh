#!/usr/bin/env bash
# Run a command inside xhc's virtual environment, creating and updating it first.
#
#   tools/env.sh python -m training.pretrain      # Quickstart 1: the embedded default pre-training
#   tools/env.sh python -m pytest -q tests         # Quickstart 2: the test suite
#
# Environment:
#   XHC_VENV          where the venv lives (default: .venv in the repository root)
#   XHC_TORCH_SPEC    the torch requirement to install first (default: torch==2.13.0, which on
#                     CPU-only machines of this project resolves to the local CPU build; on a GPU
#                     cluster set e.g. XHC_TORCH_SPEC="torch" or use the NGC container's torch and
#                     XHC_VENV_SYSTEM=1)
#   XHC_VENV_SYSTEM=1 create the venv with --system-site-packages (reuse a container's torch/TE/apex)
#   XHC_EXTRAS        pip extras to install (default: test, which holds everything the suite needs:
#                     hf, eval, plot and kernels (Triton, run by the tests under TRITON_INTERPRET=1))
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${XHC_VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[xhc] creating virtual environment in $venv" >&2
  if [ "${XHC_VENV_SYSTEM:-0}" = "1" ]; then "$py" -m venv --system-site-packages "$venv"; else "$py" -m venv "$venv"; fi
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"

stamp="$venv/.xhc-installed"
# No pip cache: the wheels would take as much disk again as the venv (CI machines share their disk).
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"
want="$(cat "$root/setup.py" | sha1sum | cut -c1-12)-${XHC_EXTRAS:-test}-${XHC_TORCH_SPEC:-torch==2.13.0}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[xhc] installing dependencies into $venv (once)" >&2
  python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "${XHC_TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v "is ignored" >&2 || true
  fi
  # one editable build of the checkout at a time (.ci/run installs the Python 3.12 venv beside this one)
  lock=(); command -v flock >/dev/null && lock=(flock "$root/.xhc-install.lock")
  "${lock[@]}" python -m pip install -q -e "$root[${XHC_EXTRAS:-test}]" 2>&1 | grep -v "is ignored" >&2 || true
  python -c "import torch, megatron.core, xhc" || { echo "[xhc] installation failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
cd "$root"
exec "$@"
