"""hookstats.stats against the same statistics computed the usual PyTorch way, and against a one-read roof.

Each group `stats-{device}-{dtype}-2^{k}` holds three cases on one input:
  fused      hookstats.stats(x): one pass
  composite  the pure-PyTorch statistics as people write them (bf16 upcast to float32 first): 10+ passes
  roof       x.sum() on CPU (the cheapest full read); y.copy_(x) on CUDA (read + write)
`benchmarks/report.py` turns the JSON into GB/s and ratios. No timing is asserted here: speed targets live
in the report. The fused case checks its result against float64 PyTorch before timing, so a broken
kernel cannot post a fast time.
"""
from __future__ import annotations

import pytest
import torch

CASES = ("fused", "composite", "roof")


def composite_stats(x: torch.Tensor):
    """Everything hookstats.stats returns, the way a careful user writes it: upcast half types once, then
    one PyTorch call per statistic. Results stay on the device (no .item())."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mn, mx = torch.aminmax(xf)
    return (
        xf.sum(),
        xf.mean(),
        xf.var(),
        xf.std(),
        torch.linalg.vector_norm(xf, 1),
        torch.linalg.vector_norm(xf, 2),
        torch.linalg.vector_norm(xf, float("inf")),
        mn,
        mx,
        torch.isnan(xf).sum(),
        torch.isinf(xf).sum(),
        (xf == 0).sum(),
    )


def check_fused(s, x: torch.Tensor) -> None:
    """The fused result against float64 PyTorch: counts/min/max exact, sums and norms to 1e-5."""
    xd = x.double()
    l1 = torch.linalg.vector_norm(xd, 1).item()
    l2 = torch.linalg.vector_norm(xd, 2).item()
    assert s.numel.item() == x.numel()
    assert abs(s.l2.item() - l2) <= 1e-5 * l2, (s.l2.item(), l2)
    assert abs(s.l1.item() - l1) <= 1e-5 * l1, (s.l1.item(), l1)
    assert abs(s.sum.item() - xd.sum().item()) <= 1e-5 * l1, (s.sum.item(), xd.sum().item())
    var = xd.var().item()
    assert abs(s.var.item() - var) <= 1e-5 * var, (s.var.item(), var)
    assert s.min.item() == xd.min().item() and s.max.item() == xd.max().item()
    assert s.linf.item() == xd.abs().max().item()
    assert (s.nan_count.item(), s.inf_count.item()) == (0, 0)
    assert s.zero_count.item() == (x == 0).sum().item() > 0


@pytest.mark.parametrize("case", CASES)
def test_stats(benchmark, measure, hookstats, device, dtype_name, size_log2, x, case):
    if case == "fused":
        check_fused(hookstats.stats(x), x)
        op = lambda: hookstats.stats(x)  # noqa: E731
    elif case == "composite":
        op = lambda: composite_stats(x)  # noqa: E731
    elif device == "cuda":
        y = torch.empty_like(x)
        op = lambda: y.copy_(x)  # noqa: E731
    else:
        op = lambda: x.sum()  # noqa: E731

    benchmark.group = f"stats-{device}-{dtype_name}-2^{size_log2}"
    benchmark.extra_info.update(
        device=device,
        dtype=dtype_name,
        numel=x.numel(),
        size_log2=size_log2,
        bytes=x.numel() * x.element_size(),  # one read of x; the CUDA copy roof moves twice this
        roof="copy" if device == "cuda" else "sum",
        torch_threads=torch.get_num_threads(),
    )
    measure(op, case, device)
