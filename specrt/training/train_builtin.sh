#!/usr/bin/env bash
# Retrain the built-in pair from scratch (about 1.5 h on one CPU thread), from the repo root.
# Each step is resumable/skippable: python -m specrt.training.recipe --only <step> ...
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
mkdir -p ckpt
$PY -m specrt.training.recipe --dry-run
$PY -m specrt.training.recipe 2>&1 | tee ckpt/recipe.log
