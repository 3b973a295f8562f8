#!/usr/bin/env bash
# `make check-torch-range`: every csrc/**/*.cpp through `g++ -fsyntax-only` against the headers of each torch given,
# with the C++ standard and defines that torch's own cpp_extension builds with (torch 2.11: -std=c++17; 2.14:
# c++20). Catches an autograd or ATen API that one end of the supported range lacks (issue 33: the GPU machine's
# torch 2.11 could not build the Monitor's SlotGrad node) without installing that torch. The .cu files need nvcc
# and are compiled by CI's CUDA build against the venv's torch only.
#   bash scripts/check_torch_range.sh PYTHON SITE...
#     PYTHON  the interpreter whose Python.h the sources see
#     SITE    a folder holding torch/include and torch/utils/cpp_extension.py: a site-packages, or an unpacked wheel
#   JOBS=N    parallel compiles (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$1
shift
pyinc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
mapfile -t sources < <(find csrc -name '*.cpp' | sort)
status=0
for site in "$@"; do
  inc=$site/torch/include
  ver=$(sed -n 's/^#define TORCH_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)/\2/p' "$inc/torch/headeronly/version.h" \
        2>/dev/null | paste -sd.)
  [[ -n $ver ]] || ver=$(sed -n 's/^__version__ = .\([^+'"'"']*\).*/\1/p' "$site/torch/version.py" 2>/dev/null)
  std=$(grep -o "common_cflags += \['-std=c++[0-9]*'" "$site/torch/utils/cpp_extension.py" | grep -o 'c++[0-9]*' | head -1)
  [[ -n $std ]] || { echo "check_torch_range: no -std flag found in $site/torch/utils/cpp_extension.py" >&2; exit 2; }
  flags=(-fsyntax-only "-std=$std" -fopenmp -Wall -Wno-unknown-pragmas -Wno-psabi
         -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1
         -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -isystem "$pyinc")
  t=$(date +%s)
  log=$(mktemp)
  if printf '%s\n' "${sources[@]}" | xargs -P "${JOBS:-2}" -I{} sh -c 'g++ "$@" {} || { echo "FAILED: {}"; exit 1; }' \
       sh "${flags[@]}" > "$log" 2>&1; then
    echo "torch $ver (-std=$std, $site): ${#sources[@]} files compile ($(( $(date +%s) - t )) s)"
  else
    cat "$log"
    echo "torch $ver (-std=$std, $site): $(grep -c '^FAILED: ' "$log" || true) of ${#sources[@]} files FAIL"
    status=1
  fi
  rm -f "$log"
done
exit $status
