#!/usr/bin/env bash
# The one command a GPU machine runs: a ladder of stages, most telling first, each appending its part to
# $OUT/report.md the moment it finishes, so that a run cut short (a crash, a hang, the lease running out) still
# reports what it got to. docs/development.md ("The GPU check") says how to read the report.
#   1. build     `setup.py build_ext --inplace` (no wheel, no pip) against that machine's torch, one arch
#                (TORCH_CUDA_ARCH_LIST=9.0), HOOKSTATS_CUDA=1, MAX_JOBS=16; timed            -> build.log  (~1 min)
#   2. smoke     scripts/gpu_smoke.py: every op on a few shapes and dtypes against the CPU kernels, the Monitor on
#                a tiny model, a captured clip_grad_norm_, a no-sync check                  -> smoke.log
#   3. graphs    pytest -m "cuda and not slow" tests/test_cuda_graphs.py tests/test_clip.py: CUDA graph replays
#                (rings, Note [ring memory]) and clipping; each outcome logged as it happens
#                (scripts/pytest_live.py)                                          -> tests.log, tests_live.log
#   4. bench     scripts/gpu_bench.py: stats bandwidth against a device copy, clipping, Monitor step overhead,
#                locations, distributions; every section guarded (a failed one is reported, the others run)
#                                                                                 -> bench.log, bench.md
#   5. tests     the rest of the CUDA tests, same markers                         -> tests.log, tests_live.log
#   6. large     scripts/gpu_large_models.py: issue #13's Monitor targets, when >= 20 s of the budget are left
# The stages share a budget of BUDGET_S seconds counted from the script's start (default 200: with the machine's
# start-up, well inside a 5-minute run); each gets at most its cap and what is left. $OUT receives at most 7
# files, all at its top. Without a GPU (or on a CPU-only torch) it builds in place, says why the GPU stages are
# skipped, and exits 0.
#   OUT=/some/dir bash scripts/gpu_check.sh        (the device tool sets OUT)
#   PYTHON=...                the interpreter (default python3; it must have torch)
#   BUDGET_S, BUILD_CAP_S     the whole budget (200 s) and the build's cap (90 s)
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
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-200}
BUILD_CAP_S=${BUILD_CAP_S:-90}
T0=$(date +%s)
STATUS=()

now() { echo $(( $(date +%s) - T0 )); }
# cap WANT: WANT seconds, or what is left of the budget when that is less (at least 1).
cap() { local w=$1 l=$(( BUDGET_S - $(now) )); (( l < w )) && w=$l; (( w < 1 )) && w=1; echo "$w"; }
say() { echo "$*" | tee -a "$REPORT"; }
finish() {
  say ""
  say "## Summary: ${STATUS[*]:-nothing ran}; $(now) s in all"
  exit "$1"
}
# timed RC SECONDS: a stage's outcome in words (124/137: cut by its cap).
outcome() { case $1 in 0) echo "ok";; 124|137) echo "cut at its ${2} s cap";; *) echo "failed (rc $1)";; esac; }

say "# hookstats GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say ""
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' + local changes')"
say "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'none (nvidia-smi not found or no device)')"
say "- $($PY -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1 | tail -1)"
say "- nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
say "- TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS BUDGET_S=$BUDGET_S"

if ! "$PY" -c "import torch" > /dev/null 2>&1; then
  say ""
  say "$PY cannot import torch: set PYTHON to an interpreter that has it. Nothing was built."
  STATUS+=("no torch")
  finish 1
fi
gpu=$($PY -c "import torch; print(torch.cuda.is_available())" 2>&1 | tail -1)

# 1. build ---------------------------------------------------------------------------------------------------------
say ""
say "## 1. Build"
build=("$PY" setup.py build_ext --inplace)
t=$(date +%s)
c=$(cap "$BUILD_CAP_S")
timeout "$c" "${build[@]}" > "$OUT/build.log" 2>&1
rc=$?
say "- \`${build[*]}\`: $(outcome $rc "$c") in $(( $(date +%s) - t )) s (log: build.log)"
# ninja's log: each compile step's wall time (the slowest are the build's critical path)
nlog=$(ls -t build/temp.*/.ninja_log 2>/dev/null | head -1)
if [[ -n $nlog ]]; then
  say "- slowest compile steps (wall s, from $nlog): $(awk -F'\t' 'NR > 1 {n = split($4, p, "/"); print ($2 - $1) / 1000, p[n]}' "$nlog" | sort -rn | head -6 | awk '{printf "%s%s %.0f", (NR > 1 ? ", " : ""), $2, $1}')"
fi
if (( rc != 0 )); then
  { echo '```'; grep -iE "error|fatal" "$OUT/build.log" | head -20; tail -25 "$OUT/build.log"; echo '```'; } >> "$REPORT"
  STATUS+=("build $(outcome $rc "$c")")
  finish 1
fi
kernels=$($PY -c "import hookstats; print(hookstats.cuda_kernels_built(), hookstats.__file__)" 2>&1 | tail -1)
say "- hookstats.cuda_kernels_built(), imported from: $kernels; torch.cuda.is_available(): $gpu"
STATUS+=("build ok")
if [[ $gpu != True ]]; then
  say ""
  say "No GPU here (torch.cuda.is_available() is $gpu): the smoke, CUDA test and benchmark stages are skipped."
  STATUS+=("no GPU: GPU stages skipped")
  finish 0
fi
if [[ $kernels != True* ]]; then
  say ""
  say "A GPU but no CUDA kernels in this build (is nvcc on PATH, CUDA_HOME set?): GPU stages skipped."
  STATUS+=("no CUDA kernels")
  finish 1
fi

# 2. smoke ---------------------------------------------------------------------------------------------------------
say ""
say "## 2. Smoke (scripts/gpu_smoke.py: CUDA against the CPU kernels)"
t=$(date +%s)
c=$(cap 50)
timeout "$c" "$PY" scripts/gpu_smoke.py --report "$REPORT" > "$OUT/smoke.log" 2>&1
rc=$?
say "- smoke: $(outcome $rc "$c") in $(( $(date +%s) - t )) s (log: smoke.log)"
STATUS+=("smoke $(outcome $rc "$c")")

# 3.-6.: CUDA tests, the benchmarks, the rest of the tests, large models ---------------------------------------------
export HOOKSTATS_LIVE_LOG=$OUT/tests_live.log
: > "$HOOKSTATS_LIVE_LOG"
: > "$OUT/tests.log"
xdist=()
if $PY -c "import xdist" 2>/dev/null; then xdist=(-n 8); fi
run_tests() {  # NAME CAP RESERVE ARGS...: one pytest run (leaving RESERVE s of the budget), its counts into the report
  local name=$1 want=$2 reserve=$3; shift 3
  local l=$(( BUDGET_S - $(now) - reserve ))
  (( l < want )) && want=$l
  if (( want < 10 )); then
    say "- $name: not run (budget spent)"
    STATUS+=("tests $name not run")
    return
  fi
  local before t rc
  before=$(wc -l < "$HOOKSTATS_LIVE_LOG")
  t=$(date +%s)
  echo "== $name: pytest $*" >> "$OUT/tests.log"
  timeout "$want" "$PY" -m pytest -q -m "cuda and not slow" -p pytest_live -p no:cacheprovider "${xdist[@]}" "$@" \
    >> "$OUT/tests.log" 2>&1
  rc=$?
  local part counts
  part=$(tail -n +$(( before + 1 )) "$HOOKSTATS_LIVE_LOG")
  counts="$(grep -c '^PASSED' <<< "$part") passed, $(grep -c '^FAILED' <<< "$part") failed, $(grep -c '^ERROR' <<< "$part") errors, $(grep -c '^SKIPPED' <<< "$part") skipped"
  case $rc in 0|5) rc_text="ok";; 1) rc_text="failures";; *) rc_text=$(outcome $rc "$want");; esac
  say "- $name: $counts in $(( $(date +%s) - t )) s ($rc_text)"
  if grep -q '^\(FAILED\|ERROR\)' <<< "$part"; then
    { echo '```'; grep -A6 '^\(FAILED\|ERROR\)' <<< "$part" | grep -v '^--$' | head -60; echo '```'; } >> "$REPORT"
  fi
  STATUS+=("tests $name $rc_text")
}

say ""
say "## 3. CUDA graph and clipping tests (pytest -m \"cuda and not slow\")"
run_tests "graphs+clip" 45 60 tests/test_cuda_graphs.py tests/test_clip.py

say ""
say "## 4. Benchmarks (scripts/gpu_bench.py)"
t=$(date +%s)
c=$(cap 60)
if (( c < 15 )); then
  say "- not run (budget spent)"
  STATUS+=("bench not run")
else
  rm -f "$OUT/bench.md"
  timeout "$c" "$PY" scripts/gpu_bench.py --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1
  rc=$?
  say "- gpu_bench: $(outcome $rc "$c") in $(( $(date +%s) - t )) s (log: bench.log; tables: bench.md)"
  grep '^gpu_bench: ' "$OUT/bench.log" | sed 's/^/  - /' >> "$REPORT"
  if (( rc != 0 )); then { echo '```'; tail -15 "$OUT/bench.log"; echo '```'; } >> "$REPORT"; fi
  [[ -s $OUT/bench.md ]] && { echo; cat "$OUT/bench.md"; } >> "$REPORT"
  STATUS+=("bench $(outcome $rc "$c")")
fi

say ""
say "## 5. The other CUDA tests"
run_tests "the rest" 120 20 tests --ignore=tests/test_cuda_graphs.py --ignore=tests/test_clip.py
say "- per-test outcomes: tests_live.log; pytest output: tests.log"

say ""
say "## 6. Monitor on large models (scripts/gpu_large_models.py)"
t=$(date +%s)
c=$(cap 60)
if (( c >= 20 )); then
  timeout "$c" "$PY" scripts/gpu_large_models.py --out "$OUT/large.md" >> "$OUT/bench.log" 2>&1
  rc=$?
  say "- gpu_large_models: $(outcome $rc "$c") in $(( $(date +%s) - t )) s (log appended to bench.log)"
  [[ -s $OUT/large.md ]] && { echo; cat "$OUT/large.md"; } >> "$REPORT"
  rm -f "$OUT/large.md"  # its table is in report.md: $OUT keeps at most 7 files
  STATUS+=("large $(outcome $rc "$c")")
else
  say "- not run (budget spent)"
  STATUS+=("large not run")
fi
failed=0
for s in "${STATUS[@]}"; do [[ $s == *" ok" || $s == "build ok" ]] || failed=1; done
finish $failed
