"""hookstats.stats_multi_into: many tensors of one device, one row each, in one call. Every row (and histogram row)
must equal, bit for bit, what stats_into writes for the same tensor, whatever the thread count; the checks run
before anything is written."""
from __future__ import annotations

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import DEVICES, bits, stats_mismatches


def tensors(device, dtype=None):
    g = torch.Generator().manual_seed(5)
    dts = [torch.float32, torch.float64, torch.float16, torch.bfloat16] if dtype is None else [dtype]
    out = []
    for i, n in enumerate([0, 1, 7, 4096, 4097, 40000, 70001, 300]):
        x = (torch.randn(n, generator=g) * (10.0 ** (i % 5 - 2))).to(dts[i % len(dts)])
        out.append(x.to(device))
    last = dts[-1]
    base = torch.randn(64, 33, generator=g).to(device=device, dtype=last)
    out += [base.t(), base[1:], base[:, ::2], torch.randn(3, 1, generator=g).to(device=device, dtype=last).expand(3, 50000)]
    out[3][5] = float("nan")
    out[4][-1] = float("inf")
    return out


def singles(xs, hist_spec=None):
    out = hookstats.stats_buffer(len(xs) + 3, device=xs[0].device)
    hist = None
    for i, x in enumerate(xs):
        if hist_spec is None:
            hookstats.stats_into(x, out, i + 2)
        else:
            if hist is None:
                hist = hookstats.histogram_buffer(len(xs) + 3, hist_spec, dtype=x.dtype, device=x.device)
            hookstats.stats_into(x, out, i + 2, hist=hist, histogram=hist_spec)
    return out, hist


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_equal_stats_into(device, threads, restore_threads):
    torch.set_num_threads(threads)
    xs = tensors(device)
    want, _ = singles(xs)
    got = hookstats.stats_buffer(len(xs) + 3, device=device)
    hookstats.stats_multi_into(xs, got, [i + 2 for i in range(len(xs))])
    assert torch.equal(bits(got), bits(want))
    assert torch.isnan(got[:2]).all() and torch.isnan(got[-1]).all()  # rows not named stay unwritten
    for i, x in enumerate(xs):
        st = hookstats.Stats.from_row(got[i + 2].cpu())
        assert not stats_mismatches(st, reference.stats(x), x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [(16, (-1.0, 1.0)), "exp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_histogram_rows_equal_stats_into(device, spec, dtype):
    xs = tensors(device, dtype)
    want, want_h = singles(xs, spec)
    got = hookstats.stats_buffer(len(xs) + 3, device=device)
    got_h = hookstats.histogram_buffer(len(xs) + 3, spec, dtype=dtype, device=device)
    rows = [i + 2 for i in range(len(xs))]
    hookstats.stats_multi_into(xs, got, rows, hist=got_h, histogram=spec)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(got_h, want_h)
    for i, x in enumerate(xs):
        assert int(got_h[i + 2].sum()) == x.numel()


def test_one_call_for_any_number_of_tensors():
    from torch.profiler import ProfilerActivity, profile

    xs = [torch.randn(10) for _ in range(500)]
    out = hookstats.stats_buffer(500)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        hookstats.stats_multi_into(xs, out, range(500))
    names = [e.name for e in prof.events() if "hookstats" in e.name]
    assert names.count("hookstats::stats_multi_into") == 1 and "hookstats::stats_into" not in names
    assert torch.allclose(out[:, 1], torch.stack([x.sum() for x in xs]).double(), rtol=1e-5, atol=1e-6)


def test_checks_come_before_any_write():
    xs = [torch.randn(4), torch.randn(4)]
    out = hookstats.stats_buffer(3)
    with pytest.raises(ValueError, match="rows"):
        hookstats.stats_multi_into(xs, out, [0])
    with pytest.raises(ValueError, match="out of range"):
        hookstats.stats_multi_into(xs, out, [0, 7])
    assert torch.isnan(out).all()
    with pytest.raises(TypeError):
        hookstats.stats_multi_into([torch.arange(3)], out, [0])
    h = hookstats.histogram_buffer(3, "exp", dtype=torch.float32)
    with pytest.raises(ValueError):  # an fp16 exponent histogram has another length
        hookstats.stats_multi_into([torch.randn(3), torch.randn(3).half()], out, [0, 1], hist=h, histogram="exp")
    assert torch.isnan(out).all() and int(h.sum()) == 0
    hookstats.stats_multi_into([], out, [])


def test_opcheck():
    xs = [torch.randn(5, 3), torch.randn(7, dtype=torch.float64)]
    out = hookstats.stats_buffer(4)
    torch.library.opcheck(torch.ops.hookstats.stats_multi_into.default, (xs, out, [1, 3]),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    h = hookstats.histogram_buffer(4, (8, (-2.0, 2.0)), dtype=torch.float32)
    torch.library.opcheck(torch.ops.hookstats.stats_multi_into.default,
                          ([xs[0]], out, [0], h, [2], 1, 8, -2.0, 2.0),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
