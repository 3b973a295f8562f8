"""Fixtures and collection hooks of the test suite; the helpers test files import are in tests/_testing.py."""
from __future__ import annotations

import pathlib

import pytest
import torch

import hookstats

TESTS_DIR = pathlib.Path(__file__).parent


def _in_tests(item) -> bool:
    """Collection hooks see every item of a session (`pytest tests benchmarks` collects both folders)."""
    return TESTS_DIR in pathlib.Path(str(item.path)).parents


def pytest_report_header(config):
    return f"hookstats: CUDA kernels built: {hookstats.cuda_kernels_built()}, GPU: {torch.cuda.is_available()}, " \
           f"CPU code path: {torch.ops.hookstats._cpu_isa('')}"


def pytest_collection_modifyitems(config, items):
    """Without a GPU the cuda-marked tests are deselected rather than reported one by one as skipped: there are
    over two thousand of them, and pytest spends ~5 ms on each skip. (With a GPU but no CUDA kernels they are
    skipped by their own marks, and test_cuda_tensor_without_cuda_kernels runs.)"""
    if torch.cuda.is_available():
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("cuda") and _in_tests(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(params=["avx512", "avx2", "default"])
def isa(request):
    """Runs the test under each CPU SIMD code path (Note [cpu dispatch]); restores the previous one afterwards."""
    mode = request.param
    device = request.node.callspec.params.get("device", "cpu") if hasattr(request.node, "callspec") else "cpu"
    if device != "cpu" and mode != "default":
        pytest.skip("the CPU code path does not matter for CUDA tensors")
    before = torch.ops.hookstats._cpu_isa("")
    try:
        got = torch.ops.hookstats._cpu_isa(mode)
        if got != mode:
            pytest.skip(f"this CPU lacks {mode} (ATen's AVX2 / AVX-512 levels; got {got})")
        yield mode
    finally:
        torch.ops.hookstats._cpu_isa(before)


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """One thread for the test: on this shared 2-core machine float64 convolutions and tiny models run ~10x faster
    than on an oversubscribed pool, and one thread gives the same reduction order every run."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
