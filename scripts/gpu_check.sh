#!/usr/bin/env bash
# The one command a GPU machine runs (under 9 minutes: build ~2 min, tests <= 200 s, benchmark <= 150 s): build hookstats against that
# machine's torch, run the whole test suite (CUDA tests included), and write a benchmark report.
#   OUT=/some/dir bash scripts/gpu_check.sh        (the device tool sets OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hookstats-gpu-check}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/env.txt"

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
start=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
$PY -c "import hookstats, sys; ok = hookstats.cuda_kernels_built(); print('CUDA kernels built:', ok); sys.exit(0 if ok else 1)" || exit 1

echo "== CUDA tests (the CPU ones run in CI; tests/test_cuda_graphs.py captures a monitored training step in a CUDA graph)"
timeout 200 $PY -m pytest tests -q -m "cuda and not slow" -p no:cacheprovider -ra 2>&1 | tail -40 | tee "$OUT/tests.log"
test_rc=${PIPESTATUS[0]}

echo "== benchmark"
timeout 150 $PY scripts/gpu_bench.py --out "$OUT/gpu_bench.md" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
