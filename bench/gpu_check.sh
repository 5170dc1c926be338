#!/usr/bin/env bash
# bench/gpu_check.sh OUTDIR — the ONE script to run on a machine with an NVIDIA GPU.
#
# Builds specrt from source with the CUDA kernels, runs the CUDA kernel tests and the
# rest of the kernel tests with CUDA available, runs the kernel microbenchmark, and
# writes every log plus kernels.json into OUTDIR. It keeps going past a failing step;
# OUTDIR/summary.txt records each step's exit code and duration. Needs no network
# (no pip downloads). Sized to finish in under 8 minutes on an H200.
#
#   bench/gpu_check.sh /tmp/gpu-check        # then commit OUTDIR's kernels.json under
#                                            # bench/results/<date>-<machine>/
# Environment: PYTHON (default python3), MAX_JOBS (default 16).
set -u

OUT=${1:?usage: bench/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
T0=$(date +%s)
: > "$SUMMARY"
echo "specrt gpu_check $(date -Iseconds) host=$(hostname) commit=$(git rev-parse --short HEAD 2>/dev/null || echo none)" \
  | tee -a "$SUMMARY"

# Whole-script deadline (seconds after start): every step's limit is cut to what is
# left, so the script always ends in time even when a step hangs.
DEADLINE=$(( T0 + ${GPU_CHECK_BUDGET_S:-460} ))

# step NAME TIMEOUT_S CMD...: run with a time limit, log to OUTDIR/NAME.log, record rc
# (124/137 = timed out; "skipped" = no time left).
step() {
  local name=$1 limit=$2
  shift 2
  local start rc left cmd
  cmd=$(printf '%s ' "$@" | tr '\n' ' ' | cut -c1-70)
  start=$(date +%s)
  left=$(( DEADLINE - start ))
  if [ "$left" -lt 10 ]; then
    printf '%-22s rc=%-4s %4ss  (%s)\n' "$name" "skipped" 0 "no time left" | tee -a "$SUMMARY"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name: $cmd" >> "$OUT/steps.log"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-22s rc=%-4s %4ss  (%s)\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$cmd" | tee -a "$SUMMARY"
  return 0
}

# 1. environment
step nvidia_smi 30 nvidia-smi
step env 60 "$PY" -c "
import sys, platform, torch
print('python', sys.version)
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('device', p.name, 'sm', f'{p.major}.{p.minor}', 'SMs', p.multi_processor_count, 'mem GiB', p.total_memory >> 30)
"
step nvcc_version 30 bash -c 'command -v nvcc && nvcc --version || /usr/local/cuda/bin/nvcc --version'

# 2. build from source, CUDA on (fails loudly if it cannot)
export SPECRT_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0+PTX" MAX_JOBS=${MAX_JOBS:-16}
step build 330 "$PY" setup.py build_ext --inplace
step import 60 "$PY" -c "
import torch, specrt.ops as ops
print('cuda_built', ops.cuda_built(), 'cuda available', torch.cuda.is_available())
assert ops.cuda_built() and torch.cuda.is_available()
"

# 3. tests: the CUDA kernels first (bit-identical to CPU, graphs, no syncs), then the
#    rest of the kernel tests with CUDA available.
step test_cuda_kernels 200 "$PY" -m pytest -q -rs tests/test_cuda_kernels.py --junitxml="$OUT/test_cuda_kernels.xml"
# the other files with CUDA cases (paged attention, controls, fused ops, linear, opcheck, overlap)
CUDA_TESTS=()
for f in tests/test_attention_kernel.py tests/test_controls_kernels.py tests/test_fused_ops.py tests/test_linear.py \
         tests/test_opcheck.py tests/test_knobs_overlap.py tests/test_models.py; do
  [ -f "$f" ] && CUDA_TESTS+=("$f")
done
step test_cuda_more 150 "$PY" -m pytest -q -rs "${CUDA_TESTS[@]}" --junitxml="$OUT/test_cuda_more.xml"
KERNEL_TESTS=()
for f in tests/test_ops_reference.py tests/test_randomness.py tests/test_kv_ops.py tests/test_bad_input.py \
         tests/test_kv_cache.py; do
  [ -f "$f" ] && KERNEL_TESTS+=("$f")
done
if [ ${#KERNEL_TESTS[@]} -gt 0 ]; then
  step test_kernels 100 "$PY" -m pytest -q -rs "${KERNEL_TESTS[@]}" --junitxml="$OUT/test_kernels.xml"
fi
[ -f tests/test_sampling_exactness.py ] && \
  step test_exactness 60 "$PY" -m pytest -q -rs tests/test_sampling_exactness.py --junitxml="$OUT/test_exactness.xml"

# 4. kernel microbenchmark (CUDA events; GB/s vs measured copy bandwidth), ending with its
#    attention section (paged attention vs gather + SDPA, bench/attention.py)
step bench_kernels 150 "$PY" -m bench.kernels --out "$OUT/kernels.json"

# ---------------------------------------------------------------------------
# 5. END-TO-END (the bench/ package, `python -m bench`; results in OUTDIR/e2e/)
#  a) cost curve on random-weight Llama-shaped models built on the device (no files):
#     8B-shaped target / 1B-shaped draft in bf16: target step time vs verified tokens at
#     batch 1/8/32, draft step time, overlap hidden fraction, predicted speedup (~1-2 min).
#  b) the end-to-end benchmark on the built-in pair (--quick; sections trimmed to fit):
#     AR vs speculative per category, K sweep vs policies, batch curve, transformers peer.
# Each step gets what is left of the deadline (GPU_CHECK_BUDGET_S), so raise that when
# running only this part is not enough, e.g. GPU_CHECK_BUDGET_S=700.
# ---------------------------------------------------------------------------
step e2e_cost_curve 150 "$PY" -m bench cost-curve --target-shape 8b --draft-shape 1b --dtype bfloat16 \
  --device cuda --context 1024 --max-tokens 16 --batch-sizes 1,8,32 --reps 10 --out "$OUT/e2e/cost_curve"
step e2e_bench 200 "$PY" -m bench --quick --device cuda --target builtin --draft builtin --repeats 2 \
  --sections costs,categories,k_sweep,batch,peer,temperature,misaligned --out "$OUT/e2e"

echo "total $(( $(date +%s) - T0 ))s" | tee -a "$SUMMARY"
# Short digest of the results at the end of the summary.
{
  echo "--- test_cuda_kernels (tail)"; tail -n 15 "$OUT/test_cuda_kernels.log" 2>/dev/null
  echo "--- test_cuda_more (tail)"; tail -n 15 "$OUT/test_cuda_more.log" 2>/dev/null
  echo "--- test_kernels (tail)"; tail -n 8 "$OUT/test_kernels.log" 2>/dev/null
  echo "--- test_exactness (tail)"; tail -n 5 "$OUT/test_exactness.log" 2>/dev/null
  echo "--- bench_kernels"; cat "$OUT/bench_kernels.log" 2>/dev/null | tail -n 90
  echo "--- e2e_cost_curve"; tail -n 8 "$OUT/e2e_cost_curve.log" 2>/dev/null
  echo "--- e2e_bench"; tail -n 8 "$OUT/e2e_bench.log" 2>/dev/null
} >> "$SUMMARY"
exit 0
