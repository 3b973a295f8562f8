#!/usr/bin/env bash
# The one command a GPU machine runs, sized for the lease that exists: one call of at most ~540 s
# (BUDGET_S, counted from the script's start) on the GPU machine's own python3 and torch (2.11 there; no venv, no
# internet). A preflight in seconds, then stages in the order of what is worth knowing first, each under its own cap
# (and what is left of the budget), each writing its log under $OUT as it goes and its outcome into $OUT/report.md
# the moment it ends, so that a stage cut by its cap, or the whole call killed, still leaves every earlier result:
#   0. preflight   python, torch, CUDA, the GPU, numpy/pytest/xdist/setuptools/ninja (scripts/gpu_preflight.py)
#   1. build       `setup.py build_ext --inplace`, HOOKSTATS_CUDA=1, TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16; then
#                  `import hookstats` and cuda_kernels_built(): an import error is reported as it is      build.log
#   2. smoke       scripts/gpu_smoke.py: every op against the CPU kernels (its table goes into report.md) smoke.log
#   3. graphs      pytest -m "cuda and not slow": CUDA graphs and rings, flushes across streams, the shared-memory
#                  band (tests/test_cuda_graphs.py, test_cuda_streams.py, test_cuda_smem.py)            graphs.log
#   4. bandwidth   scripts/gpu_bench.py --sections bandwidth: stats against a device copy             bench.log
#   5. monitor     scripts/gpu_bench.py --sections monitor: the Monitor on a transformer's training step bench.log
#   6. tests       the rest of the CUDA tests, pytest-xdist where it is installed                      tests.log
#   7. extra       with budget left: the other gpu_bench sections                                     bench.log
#   8. large       with budget left: scripts/gpu_large_models.py --quick                              bench.log
# Each test stage's outcomes also go to tests_live.log as they happen (scripts/pytest_live.py). $OUT gets at most 7
# files (the device tool returns 8), all at its top. A stage's outcome: ok, failed (rc), cut (at its cap: what it
# printed so far is kept), skipped (why), or not run (budget spent, or what it needs failed). report.md ends with a
# table of them. Exit status: 1 when a stage failed, else 0 (a cut stage is reported, not failed).
# Without a GPU (or with a CPU-only torch) it builds in place, says why the GPU stages are skipped, and exits 0.
#   OUT=/some/dir bash scripts/gpu_check.sh        (the device tool sets OUT)
#   PYTHON=...       the interpreter (default python3; it must have torch)
#   BUDGET_S         the whole call (540); each stage's cap: BUILD_CAP_S (240), SMOKE_CAP_S (60), GRAPHS_CAP_S (90),
#                    BANDWIDTH_CAP_S (60), MONITOR_CAP_S (60), TESTS_CAP_S (240), EXTRA_CAP_S (90), LARGE_CAP_S (60);
#                    a stage with less than MIN_STAGE_S (10) of the budget left is not run
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/hookstats-gpu-check}
mkdir -p "$OUT"
REPORT=$OUT/report.md
: > "$REPORT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export HOOKSTATS_CUDA=1
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}
export HOOKSTATS_LIVE_LOG=$OUT/tests_live.log
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}
MIN_STAGE_S=${MIN_STAGE_S:-10}
T0=$(date +%s)
STAGES=()    # "name|outcome|seconds" per stage, in order
FAILED=0
GRAPH_TESTS=(tests/test_cuda_graphs.py tests/test_cuda_streams.py tests/test_cuda_smem.py)

now() { echo $(( $(date +%s) - T0 )); }
say() { echo "$*" | tee -a "$REPORT"; }
# cap WANT: WANT seconds, or what is left of the budget when that is less; 0 (not run) when that is under MIN_STAGE_S.
cap() {
  local w=$1 l=$(( BUDGET_S - $(now) ))
  if (( l < w )); then w=$l; (( w < MIN_STAGE_S )) && w=0; fi
  echo $(( w > 0 ? w : 0 ))
}
# outcome RC CAP: a command's end in words.
outcome() { case $1 in 0) echo "ok";; 124|137) echo "cut at its $2 s cap";; *) echo "failed (rc $1)";; esac; }
# done_stage NAME OUTCOME SECONDS: one summary row; "failed" outcomes set the exit status.
done_stage() {
  STAGES+=("$1|$2|$3")
  [[ $2 == failed* ]] && FAILED=1
  say "- **$1: $2** ($3 s; at $(now) s of $BUDGET_S)"
}
not_run() { for s in "$@"; do STAGES+=("$s|$NOT_RUN_WHY|0"); done; }
finish() {
  say ""
  say "## Summary ($(now) s in all)"
  say ""
  say "| stage | outcome | s |"
  say "|---|---|---:|"
  for s in "${STAGES[@]}"; do IFS='|' read -r n o t <<< "$s"; say "| $n | $o | $t |"; done
  exit "$FAILED"
}
# run NAME CAP LOG CMD...: CMD under `timeout CAP`, appending to $OUT/LOG; sets RC and SECS.
run() {
  local name=$1 c=$2 log=$3 t; shift 3
  echo "== $name: $* (cap $c s, at $(now) s)" >> "$OUT/$log"
  t=$(date +%s)
  timeout -k 5 "$c" "$@" >> "$OUT/$log" 2>&1
  RC=$?
  SECS=$(( $(date +%s) - t ))
}

say "# hookstats GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say ""
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' + local changes')"
say "- BUDGET_S=$BUDGET_S TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS PYTHON=$PY"

# 0. preflight -----------------------------------------------------------------------------------------------------
say ""
say "## 0. Preflight"
t=$(date +%s)
pre=$(timeout -k 5 60 "$PY" scripts/gpu_preflight.py 2>&1)
rc=$?
sed 's/^/- /' <<< "$pre" >> "$REPORT"
smi=$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
say "- GPU (nvidia-smi): ${smi:-none (nvidia-smi not found or no device)}"
nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
say "- nvcc: $("$nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo "not found ($nvcc)") ($nvcc; CUDA_HOME=${CUDA_HOME:-unset: setup.py uses /usr/local/cuda when it has nvcc})"
gpu=$(sed -n 's/^cuda: //p' <<< "$pre")
missing=$(sed -n 's/^missing: //p' <<< "$pre")
if (( rc != 0 )) || [[ -z $gpu ]]; then
  done_stage preflight "failed ($PY has no working torch: set PYTHON)" $(( $(date +%s) - t ))
  NOT_RUN_WHY="not run (preflight failed)"
  not_run build smoke graphs bandwidth monitor tests extra large
  finish
fi
if [[ -n $missing && $missing != none ]]; then
  done_stage preflight "failed (missing: $missing)" $(( $(date +%s) - t ))
else
  done_stage preflight ok $(( $(date +%s) - t ))
fi

# 1. build ---------------------------------------------------------------------------------------------------------
say ""
say "## 1. Build"
c=$(cap "${BUILD_CAP_S:-240}")
t=$(date +%s)
run build "$c" build.log "$PY" setup.py build_ext --inplace
out=$(outcome $RC "$c")
# ninja's log, when this build wrote it: each compile step's wall time (the slowest are the build's critical path)
nlog=$(ls -t build/temp.*/.ninja_log 2>/dev/null | head -1)
if [[ -n $nlog ]] && (( $(stat -c %Y "$nlog") >= t )); then
  say "- slowest compile steps (wall s, from $nlog): $(awk -F'\t' 'NR > 1 {n = split($4, p, "/"); print ($2 - $1) / 1000, p[n]}' "$nlog" | sort -rn | head -6 | awk '{printf "%s%s %.0f", (NR > 1 ? ", " : ""), $2, $1}')"
fi
if (( RC != 0 )); then
  { echo '```'; grep -iE "error|fatal" "$OUT/build.log" | head -20; tail -25 "$OUT/build.log"; echo '```'; } >> "$REPORT"
  done_stage build "$out" "$SECS"
  NOT_RUN_WHY="not run (the build did not finish)"
  not_run smoke graphs bandwidth monitor tests extra large
  finish
fi
post=$(timeout -k 5 60 "$PY" scripts/gpu_preflight.py --built 2>&1)
sed 's/^/- /' <<< "$post" >> "$REPORT"
if ! grep -q '^import: ok' <<< "$post"; then
  # the import's own error (a missing numpy is a missing numpy, not a build without CUDA kernels)
  why=$(sed -n 's/^import: FAILED: //p' <<< "$post" | head -1)
  done_stage build "failed (built, but ${why:-the import probe ended with: $(tail -1 <<< "$post")})" "$SECS"
  NOT_RUN_WHY="not run (import hookstats failed)"
  not_run smoke graphs bandwidth monitor tests extra large
  finish
fi
if [[ $gpu != True ]]; then
  done_stage build ok "$SECS"
  say ""
  say "No GPU here (torch.cuda.is_available() is $gpu): the GPU stages are skipped."
  NOT_RUN_WHY="skipped (no GPU)"
  not_run smoke graphs bandwidth monitor tests extra large
  finish
fi
if ! grep -q '^cuda_kernels_built: True' <<< "$post"; then
  done_stage build "failed (a GPU, but no CUDA kernels in this build: nvcc on PATH? CUDA_HOME? see build.log)" "$SECS"
  NOT_RUN_WHY="not run (no CUDA kernels)"
  not_run smoke graphs bandwidth monitor tests extra large
  finish
fi
done_stage build ok "$SECS"

# 2.-8. ------------------------------------------------------------------------------------------------------------
: > "$HOOKSTATS_LIVE_LOG"
xdist=()
if grep -q '^module xdist: [0-9]' <<< "$pre"; then xdist=(-n "${XDIST_WORKERS:-8}"); fi

# stage NAME TITLE CAP LOG CMD...: a section header, the command under its cap, its outcome.
stage() {
  local name=$1 title=$2 want=$3 log=$4 c; shift 4
  say ""
  say "## $title"
  c=$(cap "$want")
  if (( c == 0 )); then
    done_stage "$name" "not run (budget spent)" 0
    return
  fi
  say "- \`$*\` (cap $c s, log: $log)"
  run "$name" "$c" "$log" "$@"
  done_stage "$name" "$(outcome $RC "$c")" "$SECS"
}
# test_stage NAME TITLE CAP LOG PYTEST_ARGS...: a pytest stage; its counts from the live log (a cut run's too).
test_stage() {
  local name=$1 title=$2 want=$3 log=$4 before part c; shift 4
  before=$(wc -l < "$HOOKSTATS_LIVE_LOG")
  stage "$name" "$title" "$want" "$log" "$PY" -m pytest -q -m "cuda and not slow" -p pytest_live -p no:cacheprovider \
    "${xdist[@]}" "$@"
  part=$(tail -n +$(( before + 1 )) "$HOOKSTATS_LIVE_LOG")
  say "- $(grep -c '^PASSED' <<< "$part") passed, $(grep -c '^FAILED' <<< "$part") failed, $(grep -c '^ERROR' <<< "$part") errors, $(grep -c '^SKIPPED' <<< "$part") skipped (each as it happened: tests_live.log)"
  if grep -q '^\(FAILED\|ERROR\)' <<< "$part"; then
    { echo '```'; grep -A6 '^\(FAILED\|ERROR\)' <<< "$part" | grep -v '^--$' | head -60; echo '```'; } >> "$REPORT"
  fi
}
# bench_stage NAME TITLE CAP SECTIONS: gpu_bench.py sections; their tables into the report (a cut run's too).
bench_stage() {
  local name=$1 title=$2 want=$3 sections=$4 md
  md=$(mktemp)
  stage "$name" "$title" "$want" bench.log "$PY" scripts/gpu_bench.py --sections "$sections" --out "$md"
  [[ -s $md ]] && { echo; cat "$md"; } >> "$REPORT"
  rm -f "$md"
}

stage smoke "2. Smoke (scripts/gpu_smoke.py: every op, CUDA against the CPU kernels)" "${SMOKE_CAP_S:-60}" smoke.log \
  "$PY" scripts/gpu_smoke.py --report "$REPORT"
test_stage graphs "3. CUDA graphs and rings, flushes across streams, the shared-memory band" "${GRAPHS_CAP_S:-90}" \
  graphs.log "${GRAPH_TESTS[@]}"
bench_stage bandwidth "4. Bandwidth against a device copy (scripts/gpu_bench.py)" "${BANDWIDTH_CAP_S:-60}" bandwidth
bench_stage monitor "5. The Monitor on a transformer's training step (scripts/gpu_bench.py)" "${MONITOR_CAP_S:-60}" \
  monitor
ignore=()
for f in "${GRAPH_TESTS[@]}"; do ignore+=("--ignore=$f"); done
test_stage tests "6. The other CUDA tests" "${TESTS_CAP_S:-240}" tests.log tests "${ignore[@]}"
bench_stage extra "7. Extra, with budget left: the other benchmarks (clipping, where in the tensor, by distribution)" \
  "${EXTRA_CAP_S:-90}" clip,where,distribution
md=$(mktemp)
stage large "8. Extra, with budget left: the Monitor on large models (scripts/gpu_large_models.py --quick)" \
  "${LARGE_CAP_S:-60}" bench.log "$PY" scripts/gpu_large_models.py --quick --out "$md"
[[ -s $md ]] && { echo; cat "$md"; } >> "$REPORT"
rm -f "$md"
finish
