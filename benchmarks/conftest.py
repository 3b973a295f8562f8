"""Fixtures and collection hooks of the benchmarks; the helpers benchmark files import are in benchmarks/_benching.py."""
from __future__ import annotations

import pathlib
from typing import Callable

import pytest
import torch

from _benching import (DEVICES, DTYPES, SIZES_LOG2, SMOKE_MAX_SIZE_LOG2, _IMPORT_ERROR, _hookstats, cuda_event_seconds,
                       make_input, plan_rounds, synced)

BENCH_DIR = pathlib.Path(__file__).parent


def _too_big_for_smoke(item) -> bool:
    callspec = getattr(item, "callspec", None)
    size = callspec.params.get("size_log2") if callspec is not None else None
    return isinstance(size, int) and size > SMOKE_MAX_SIZE_LOG2


def pytest_collection_modifyitems(config, items):
    if not config.getoption("benchmark_disable", False):
        return
    keep, drop = [], []
    for item in items:
        (drop if _too_big_for_smoke(item) and BENCH_DIR in pathlib.Path(str(item.path)).parents else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def bench_smoke(pytestconfig) -> bool:
    """True when benchmarks run once, untimed (--benchmark-disable): benchmark files size their inputs down."""
    return bool(pytestconfig.getoption("benchmark_disable", False))


@pytest.fixture(scope="session")
def hookstats():
    """The hookstats module, or a skip that says why it cannot be benchmarked."""
    if _hookstats is None:
        pytest.skip(
            f"hookstats cannot be imported ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); "
            "build it first: `pip install --no-build-isolation -e .`"
        )
    if not _hookstats.HAVE_EXTENSION:
        why = getattr(_hookstats._ops, "_EXTENSION_ERROR", "unknown error")
        pytest.skip(
            f"hookstats._C is not built ({why}); timing the pure-PyTorch fallback would be meaningless. "
            "Build it: `pip install --no-build-isolation -e .`"
        )
    return _hookstats


@pytest.fixture(params=DEVICES)
def device(request, hookstats) -> str:
    dev = request.param
    if dev == "cuda" and not hookstats.cuda_kernels_built():
        pytest.skip(
            "CUDA is available but this build of hookstats has no CUDA kernels; rebuild with a CUDA toolkit "
            "(`HOOKSTATS_CUDA=1 CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e .`)"
        )
    return dev


@pytest.fixture(params=list(DTYPES), ids=list(DTYPES))
def dtype_name(request) -> str:
    return request.param


@pytest.fixture(params=SIZES_LOG2, ids=[f"2^{k}" for k in SIZES_LOG2])
def size_log2(request) -> int:
    return request.param


@pytest.fixture
def x(device: str, dtype_name: str, size_log2: int) -> torch.Tensor:
    """The input of one group: seeded, shared by the group's cases."""
    return make_input(size_log2, dtype_name, device)


@pytest.fixture
def measure(benchmark):
    """measure(op, case, device, kind=None): times `op` with pytest-benchmark, rounds planned by cost
    (`plan_rounds`) from the budget of `kind` (default: the budget of `case`). `case` goes into extra_info.

    On CUDA the timed call ends with a synchronize, since pytest-benchmark reads the host clock; the device
    time from CUDA events (`cuda_event_seconds`) goes into extra_info["cuda_event_s"] as well.
    """

    def run(op: Callable[[], object], case: str, device: str, kind: str | None = None) -> None:
        fn = synced(op, device)
        rounds, iterations = (1, 1) if benchmark.disabled else plan_rounds(fn, kind or case)
        benchmark.extra_info.update(case=case, rounds=rounds, iterations=iterations)
        benchmark.pedantic(fn, rounds=rounds, iterations=iterations, warmup_rounds=1)
        if device == "cuda" and not benchmark.disabled:
            benchmark.extra_info["cuda_event_s"] = cuda_event_seconds(op)

    return run


@pytest.fixture
def one_thread():
    """One thread: ratios measured on this shared 2-core VM are stable only then (docs/development.md)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
