"""The probes of scripts/gpu_check.sh, in seconds, each printed as one `key: value` line that the script copies into
its report (and reads `cuda` and `import` from).

    python scripts/gpu_preflight.py          before the build: python, torch and its CUDA, the GPU, the modules that
                                             the build and the stages need (numpy, pytest, xdist, setuptools, ninja)
    python scripts/gpu_preflight.py --built  after it: `import hookstats` (its error as it is: a missing module is
                                             reported as missing, not as a build without CUDA kernels) and
                                             hookstats.cuda_kernels_built()

Exit status: 0, or 1 when something the check cannot do without is missing (torch; after the build, a working
`import hookstats`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

# the module: what needs it
NEEDED = {"numpy": "import hookstats (the Monitor's host buffers)", "pytest": "the CUDA test stages",
          "setuptools": "the build (setup.py)", "ninja": "the build (parallel compiles)"}
OPTIONAL = {"xdist": "pytest-xdist: the test stages run in parallel workers (else one process)"}


def error_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:300]


def before() -> int:
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - the report says what it was
        print(f"torch: cannot import ({error_line(e)})")
        return 1
    print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}")
    t = time.time()
    ok = torch.cuda.is_available()
    print(f"cuda: {ok}")
    if ok:
        p = torch.cuda.get_device_properties(0)
        print(f"gpu: {torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
              f"{p.multi_processor_count} SMs (CUDA init {time.time() - t:.1f} s)")
    missing = []
    for name, why in {**NEEDED, **OPTIONAL}.items():
        try:
            mod = importlib.import_module(name)
            print(f"module {name}: {getattr(mod, '__version__', 'present')}")
        except Exception as e:  # noqa: BLE001
            print(f"module {name}: MISSING ({error_line(e)}); needed by {why}")
            missing += [name] if name in NEEDED else []
    print(f"missing: {', '.join(missing) if missing else 'none'}")
    return 0


def built() -> int:
    try:
        import hookstats
    except Exception as e:  # noqa: BLE001
        print(f"import: FAILED: {error_line(e)}")
        return 1
    print(f"import: ok ({os.path.dirname(hookstats.__file__)})")
    print(f"cuda_kernels_built: {hookstats.cuda_kernels_built()}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--built", action="store_true", help="the probes after the build")
    args = ap.parse_args()
    return built() if args.built else before()


if __name__ == "__main__":
    sys.exit(main())
