"""Note [ranking samples]: one ranking of per-sample gradient norms behind PerSampleGradNorms and the Monitor
(per_sample=True), and PerSampleGradNorms.reset()."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookstats
from _testing import TableOverBatch
from hookstats.per_sample.ranking import first_nonfinite_sample, top_samples

NAN, INF = float("nan"), float("inf")


def test_order_nan_then_inf_then_largest_ties_in_step_sample_order():
    a = torch.tensor([1.0, NAN, 3.0, 3.0, INF, NAN, 0.5])
    b = torch.tensor([3.0, NAN, 7.0])
    got = [(r.step, r.sample) for r in top_samples([(0, a), (1, b)], 20)]
    assert got == [(0, 1), (0, 5), (1, 1), (0, 4), (1, 2), (0, 2), (0, 3), (1, 0), (0, 0), (0, 6)]
    assert top_samples([(0, a)], 0) == [] and top_samples([], 3) == []
    assert [r.sample for r in top_samples([(None, a)], 2)] == [1, 5]
    with pytest.raises(ValueError, match="k >= 0"):
        top_samples([(0, a)], -1)


def test_first_nonfinite_by_step_then_sample_with_its_layers():
    rows = [(0, ["x", "y"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([1.0, 2.0])),
            (1, ["x", "y"], torch.tensor([[1.0, NAN, 2.0], [3.0, INF, INF]]), torch.tensor([1.0, NAN, INF]))]
    hit = first_nonfinite_sample(rows)
    assert (hit.step, hit.sample, hit.layers) == (1, 1, ["x", "y"]) and math.isnan(hit.norm)
    assert first_nonfinite_sample(rows[:1]) is None
    # a total that overflowed while every layer's norm is finite is non-finite too, with no layer to name
    over = [(0, ["x"], torch.tensor([[1.0, 2.0]]), torch.tensor([1.0, INF]))]
    assert first_nonfinite_sample(over)._asdict() == {"step": 0, "sample": 1, "norm": INF, "layers": []}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batches():
    xs = []
    for s in range(3):
        x = torch.randn(6, 4)
        if s == 1:
            x[4] *= 100.0
        if s == 2:
            x[2, 0] = NAN
            x[5, 1] = NAN
        xs.append(x)
    return xs


def test_psn_and_monitor_rank_alike():
    """The same steps give the same ranking and the same first non-finite sample through PerSampleGradNorms (one
    step: (sample, norm) pairs and a dict without step) and the Monitor (every step: dicts with step)."""
    model = _model()
    mon = hookstats.Monitor(model, kinds="forward", per_sample=True)
    twin = _model()
    psn = hookstats.PerSampleGradNorms(twin)
    per_step = []
    for x in _batches():
        for m in (model, twin):
            m(x).pow(2).sum().backward()
            m.zero_grad()
        per_step.append((psn.top_samples(6), psn.first_nonfinite_sample(), psn.total().clone()))
        mon.step()
        psn.step()
    top = mon.top_samples(18)
    for s, (psn_top, _, total) in enumerate(per_step):
        mine = [(r["sample"], r["norm"]) for r in top if r["step"] == s][:6]
        assert [i for i, _ in mine] == [i for i, _ in psn_top]
        for (_, a), (_, b) in zip(mine, psn_top):
            assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6)
        assert [i for i, _ in psn_top] == [i for i, _ in sorted(
            enumerate(total.tolist()), key=lambda iv: (not math.isnan(iv[1]), -iv[1] if iv[1] == iv[1] else 0))][:6]
    assert [(r["step"], r["sample"]) for r in top[:2]] == [(2, 2), (2, 5)]  # NaNs first, in sample order
    assert (top[2]["step"], top[2]["sample"]) == (1, 4)
    bad = mon.first_nonfinite_sample()
    psn_bad = per_step[2][1]
    assert set(bad) == {"step", *psn_bad} and set(psn_bad) == {"sample", "norm", "layers"}
    want = (2, 2, ["0", "2"])
    assert (bad["step"], bad["sample"], bad["layers"]) == (2, psn_bad["sample"], psn_bad["layers"]) == want
    assert math.isnan(bad["norm"]) and math.isnan(psn_bad["norm"])
    assert per_step[0][1] is None and per_step[1][1] is None
    mon.detach()
    psn.remove()


def test_reset_forgets_run_time_refusals_step_keeps_them():
    torch.manual_seed(0)
    m = TableOverBatch()
    psn = hookstats.PerSampleGradNorms(m)
    with pytest.warns(UserWarning, match="layer table is refused"):
        m(torch.randn(3, 5, 4)).sum().backward()
    assert sorted(psn.per_param()) == ["fc.bias", "fc.weight"]
    psn.step()
    assert psn.samples == 0
    m(torch.randn(3, 5, 4)).sum().backward()
    assert sorted(psn.per_param()) == ["fc.bias", "fc.weight"]  # step(): still refused, no second warning
    assert "table.weight" in psn.coverage().not_covered
    psn.reset()
    assert psn.samples == 0 and "table.weight" not in psn.coverage().not_covered
    with pytest.warns(UserWarning, match="layer table is refused"):  # judged afresh
        m(torch.randn(3, 5, 4)).sum().backward()
    psn.reset()
    m(torch.randn(5, 5, 4)).sum().backward()  # now 5 rows for 5 samples: the table is not refused
    assert sorted(psn.per_param()) == ["fc.bias", "fc.weight", "table.bias", "table.weight"]
    psn.remove()
