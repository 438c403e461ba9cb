#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on the lent GPU machine, which has no package
# registry (docs/gpu.md).  Run it here, where pip reaches PyPI; then carry the folder with the run
# (device tool: carry [".whl"]).  The image has torch, triton, transformers, numpy, packaging,
# pyyaml; it lacks megatron-core and liger-kernel, and their own requirements (torch, numpy,
# packaging; torch, triton) are all in the image, so nothing else is needed.
#
#   tools/device_wheels.sh                         # .whl/ for the device: CPython 3.12, x86-64
#   tools/device_wheels.sh --dest DIR --python-version 3.11    # e.g. for the install test here
#
# Only binary wheels (--only-binary=:all:), without dependencies (--no-deps: pip must never
# replace the image's torch).  megatron-core is capped below 0.20 (setup.py's tested range:
# 0.19.x on Python 3.12, 0.16.x on 3.11).  One version of each package is kept (the older files
# are removed): two versions of one package stop the whole install there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=.whl
PYV=3.12
PIP="${PIP:-python3 -m pip}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST="${2:?--dest needs a folder}"; shift 2 ;;
    --python-version) PYV="${2:?--python-version needs e.g. 3.12}"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$PYV" in
  3.12|3.13) MEGATRON="megatron-core>=0.19,<0.20" ;;
  3.11) MEGATRON="megatron-core>=0.16.1,<0.17" ;;
  *) echo "error: --python-version $PYV: megatron-core's tested range covers 3.11 (0.16.x) and 3.12 (0.19.x)" >&2; exit 2 ;;
esac
mkdir -p "$DEST"
rm -f "$DEST"/megatron_core-*.whl "$DEST"/liger_kernel-*.whl
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do PLAT+=(--platform "$p"); done
$PIP download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp "${PLAT[@]}" -d "$DEST" "$MEGATRON" "liger-kernel>=0.8.5,<0.9"
ls "$DEST"/megatron_core-*.whl "$DEST"/liger_kernel-*.whl >/dev/null
echo "wheels for CPython $PYV in $DEST ($(du -sh "$DEST" | cut -f1); the device tool carries at most 64 MiB with the tree):"
for w in "$DEST"/*.whl; do echo "  $(basename "$w")"; done
