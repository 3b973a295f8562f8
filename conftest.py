"""What a pytest run at the project root collects.

  pytest                      the test suite (pyproject.toml: testpaths = ["tests"])
  pytest --benchmark-only     the benchmark suite (benchmarks/), timed, with pytest-benchmark's tables
  pytest benchmarks ...       the benchmarks, as named; with --benchmark-disable a quick untimed smoke run
                              (benchmarks/conftest.py: SMOKE_MAX_SIZE_LOG2), which `make test` runs after the tests

Both folders can be collected in one session (`pytest tests benchmarks --benchmark-disable`): their helpers are
modules of their own (tests/_testing.py, benchmarks/_benching.py) and each folder's collection hooks touch only its
own items.
"""
from __future__ import annotations

import os

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks")


def pytest_configure(config):
    # `pytest --benchmark-only` with no path: the benchmarks, not the testpaths (whose tests it would only skip).
    from_testpaths = getattr(config, "args_source", None) == getattr(config.ArgsSource, "TESTPATHS", object())
    if config.getoption("benchmark_only", False) and from_testpaths:
        config.args[:] = [BENCH_DIR]
