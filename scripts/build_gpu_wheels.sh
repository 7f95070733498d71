#!/usr/bin/env bash
# Build the wheel bundle that scripts/gpu_check.py needs on the GPU machine (Python 3.12, x86_64, no network).
#
# That machine already has torch, transformers, accelerate, peft, tokenizers, pyarrow, pandas, xxhash, fsspec,
# aiohttp, huggingface-hub, pyyaml, tqdm and matplotlib. Missing there: trl, datasets (imported by TRL's GRPOTrainer
# and by this package), dill and multiprocess (datasets' own dependencies), and this package. fsspec and peft come
# along as fallbacks only (pip keeps the installed versions when they satisfy the pins). The datasets release is
# 5.0.0 rather than the newest: it accepts pyarrow >= 21 (5.1 and later want >= 24, and the machine's pyarrow
# version is not recorded); pyarrow itself (55 MB as a cp312 wheel) would not fit next to the working tree.
# WITH_PYARROW=1 adds pyarrow 21.0.0 anyway, for a machine whose pyarrow turns out older than 21.
#
# Usage: scripts/build_gpu_wheels.sh [OUT_DIR]   (default build/gpu_wheels, ignored by git through `build/`)
# Fails when the wheels, or the wheels plus the working tree that travels with them, exceed 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${1:-build/gpu_wheels}
LIMIT=$((64 * 1024 * 1024))

# Pure-Python wheels (multiprocess ships one per Python version, hence the cp312 target for all of them).
PINS=(trl==1.16.0 datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.4.0 peft==0.21.2)
if [[ "${WITH_PYARROW:-0}" == 1 ]]; then
    PINS+=(pyarrow==21.0.0)
fi

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$OUT_DIR" "${PINS[@]}"
# The build backend warns about the license table on every build; the wheel is fine.
PYTHONWARNINGS=ignore "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$OUT_DIR" .

wheel_bytes=$(du -cb "$OUT_DIR"/*.whl | tail -1 | cut -f1)
# What the device tool sends besides the carried folder: tracked files and untracked ones git does not ignore.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
ls -l "$OUT_DIR"
printf 'wheels: %d bytes (%.1f MiB); working tree: %.1f MiB; together %.1f MiB of the 64 MiB limit\n' \
    "$wheel_bytes" "$(bc -l <<<"$wheel_bytes / 1048576")" "$(bc -l <<<"$tree_bytes / 1048576")" \
    "$(bc -l <<<"($wheel_bytes + $tree_bytes) / 1048576")"
if ((wheel_bytes + tree_bytes > LIMIT)); then
    echo "error: the wheels and the working tree exceed 64 MiB together" >&2
    exit 1
fi
