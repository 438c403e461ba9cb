#!/usr/bin/env bash
# Prove on CPU that xhc works with the GPU check image's versions (docs/gpu.md): Python 3.12, torch
# 2.11.0, triton 3.6.0, transformers 5.17.0, megatron-core 0.19.x.  Makes a venv, installs them
# from PyPI (torch 2.11.0 from PyPI is the CUDA build: about 3 GB with its nvidia-* wheels; it runs
# on CPU), then this repository with the test and hf extras (pip keeps the pinned versions), and runs
# the HC ops, the Megatron layer and the Hugging Face export tests.  Not part of CI (the download
# and the CPU time do not fit its budget); run it by hand, e.g. `nice -n 15 tools/device_env_check.sh`.
#
#   tools/device_env_check.sh                    # venv runs/.venv-device-env, log runs/device_env_check.log
#   PYTHON=/path/to/python3.12 tools/device_env_check.sh
#   tools/device_env_check.sh -m "not slow"     # extra pytest arguments
#
# Environment: PYTHON (default python3.12), XHC_DEVICE_ENV_VENV (default runs/.venv-device-env).
# Exit status: pytest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3.12}"
VENV="${XHC_DEVICE_ENV_VENV:-runs/.venv-device-env}"
LOG=runs/device_env_check.log
# numpy < 2.4: Triton 3.6's interpreter (how the tests run the kernels on CPU) calls int() on
# one-element arrays (`range(t_max)` in a kernel), which numpy 2.4 and 2.5 refuse ("only
# 0-dimensional arrays can be converted to Python scalars"; Triton 3.9's interpreter does not).  The
# GPU image's numpy 2.5 does not matter there: its kernels run compiled, not interpreted.
PINS=("torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" "numpy<2.4")
TESTS=(tests/test_hc_kernels.py tests/test_hc_megatron.py tests/test_convert_hf.py)
command -v "$PY" >/dev/null 2>&1 || { echo "error: $PY not found; set PYTHON to a Python 3.12 interpreter" >&2; exit 2; }
mkdir -p runs
exec > >(tee "$LOG") 2>&1
echo "[device-env] $(date -u +%FT%TZ) $("$PY" --version) -> $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}"
# the project with its test + hf extras; the constraints keep the image's versions
printf '%s\n' "${PINS[@]}" > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$VENV/constraints.txt" -e ".[test,hf,kernels]"
"$VENV/bin/python" - <<'PY'
import sys
from importlib import metadata
for d in ("torch", "triton", "transformers", "numpy", "megatron-core", "liger-kernel"):
    print(f"[device-env] {d} {metadata.version(d)}")
print(f"[device-env] python {sys.version.split()[0]}")
PY
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
