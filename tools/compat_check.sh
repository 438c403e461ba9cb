#!/usr/bin/env bash
# Release check: run the Megatron-facing tests against the newest megatron-core 0.19.x on Python 3.12.
#
#   tools/compat_check.sh                 # create/update the venv, then run the tests marked `megatron`
#   tools/compat_check.sh --install-only  # only create/update the venv
#
# The main test run (tools/env.sh, Python 3.11) covers megatron-core 0.16.x; 0.17+ needs Python
# 3.12.  This script covers the other end of the range that setup.py declares; .ci/run calls it
# as its second stage.  On Python 3.12 the install downloads PyTorch's CUDA build from PyPI
# (about 2.7 GB of wheels, 5.3 GB installed: PyPI has no CPU-only torch wheel for Linux); the
# tests run on the CPU all the same.
#
# Environment:
#   XHC_COMPAT_VENV     the venv (default: .venv-compat in the repository root, git-ignored)
#   XHC_COMPAT_PYTHON   a Python 3.12 interpreter (default: python3.12 on PATH, then pyenv's)
#   XHC_COMPAT_MCORE    the megatron-core requirement (default: the newest 0.19.x)
#   XHC_TORCH_SPEC      the torch requirement (default: torch==2.13.0)
#   XHC_COMPAT_MARKERS  the pytest marker expression (default: "megatron and not journey")
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${XHC_COMPAT_VENV:-$root/.venv-compat}"
mcore="${XHC_COMPAT_MCORE:-megatron-core>=0.19,<0.20}"
torch_spec="${XHC_TORCH_SPEC:-torch==2.13.0}"
install_only=0
[ "${1:-}" = "--install-only" ] && install_only=1

py="${XHC_COMPAT_PYTHON:-}"
if [ -z "$py" ]; then
  for cand in "$(command -v python3.12 || true)" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python 2>/dev/null | sort -rV); do
    # (a pyenv shim on PATH may exist and still fail: check that it runs)
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py="$cand"; break; fi
  done
fi
[ -n "$py" ] && [ -x "$py" ] || { echo "[compat] no Python 3.12 found: set XHC_COMPAT_PYTHON=/path/to/python3.12" >&2; exit 2; }

t0=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  echo "[compat] creating $venv with $("$py" --version)" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.xhc-compat-installed"
# No pip cache: 2.7 GB of CUDA wheels would stay on disk beside the 5.6 GB venv.
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"
want="$(sha1sum < "$root/setup.py" | cut -c1-12)-$mcore-$torch_spec"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[compat] installing $torch_spec, $mcore and xhc[test,hf] into $venv" >&2
  pip_q() {  # pip install -q without the local index's "is ignored" noise, keeping pip's exit code
    "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored" || true; }
    return "${PIPESTATUS[0]}"
  }
  pip_q --upgrade pip
  pip_q "$torch_spec"
  # one editable build of the checkout at a time (.ci/run runs tools/env.sh's install beside this one)
  if command -v flock >/dev/null; then
    exec 9> "$root/.xhc-install.lock"; flock 9; pip_q "$mcore" -e "$root[test,hf]"; flock -u 9
  else
    pip_q "$mcore" -e "$root[test,hf]"
  fi
  echo "$want" > "$stamp"
fi
t1=$(date +%s)
"$venv/bin/python" -c "import sys, torch, megatron.core as m; print(f'[compat] Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}')" 2>/dev/null
echo "[compat] install: $((t1 - t0)) s" >&2
[ "$install_only" = 1 ] && exit 0

# The tests that touch Megatron-Core: every test marked `megatron` (pytest.ini), in one pytest process;
# the documented-command journeys (`journey`) run in stage 1 only.  Extra arguments go to pytest.
cd "$root"
sel="${XHC_COMPAT_MARKERS:-megatron and not journey}"
s=$(date +%s)
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "$sel" --strict-skips -rs --durations=10 "$@" tests || rc=$?
echo "[compat] tests (-m \"$sel\"): exit $rc after $(( $(date +%s) - s )) s" >&2
exit "$rc"
