"""Captured steps (Note [monitor graph replays] in csrc/monitor/recorder.h): ring rows whose slot is read on the device
(Note [ring rows]), the step prologue op, and the Monitor's bookkeeping of replays. Real CUDA graphs are tested in
tests/test_cuda_graphs.py (GPU machine); here the recorder's test capture stands in for one on the CPU: records made
while it is set behave as captured records, and "replays" run the same hooks again under the same capture id."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import DEVICES, bits

SPECS = [None, (16, (-1.0, 1.0)), "exp"]


def _inputs(device):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 33, generator=g)
    xs = [torch.randn(4097, generator=g), base.t(), base[:, ::2].to(torch.bfloat16), torch.randn(7, generator=g).half()]
    xs[0][11] = float("nan")
    return [x.to(device) for x in xs]


def _hist_spec_len(spec, dtype):
    return hookstats._ops.as_histogram(spec).length(dtype)


# -- the ops -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("p", [0, 2, 5, 11, -1])
def test_stats_into_ring_writes_slot_p_mod_slots(device, spec, p):
    slots, rows = 4, 3
    for x in _inputs(device):
        want = hookstats.stats_buffer(rows, device=device)
        wh = None if spec is None else torch.zeros(rows, _hist_spec_len(spec, x.dtype), dtype=torch.int64,
                                                   device=device)
        if spec is None:
            hookstats.stats_into(x, want, 1)
        else:
            hookstats.stats_into(x, want, 1, wh, 2, spec)
        ring = torch.tensor([p, 99], dtype=torch.int64, device=device)
        out = torch.full((slots, rows, 13), float("nan"), dtype=torch.float64, device=device)
        hist = None if spec is None else torch.full((slots, rows, wh.shape[1]), 7, dtype=torch.int64, device=device)
        hookstats.stats_into(x, out, 1, hist, 2, spec, ring=ring)
        s = p % slots
        assert torch.equal(bits(out[s, 1]), bits(want[1]))
        others = [i for i in range(slots) if i != s]
        assert torch.isnan(out[others]).all() and torch.isnan(out[s, [0, 2]]).all()
        if spec is not None:
            assert torch.equal(hist[s, 2], wh[2])  # written, not added to the 7s
            assert (hist[others] == 7).all() and (hist[s, :2] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [None, (16, (-1.0, 1.0))])
def test_stats_multi_into_ring_rows_equal_stats_into(device, spec):
    xs = _inputs(device)
    n = len(xs)
    want = hookstats.stats_buffer(n, device=device)
    wh = None if spec is None else torch.zeros(n, 19, dtype=torch.int64, device=device)
    hookstats.stats_multi_into(xs, want, list(range(n)), wh, None, spec)
    out = torch.full((3, n, 13), float("nan"), dtype=torch.float64, device=device)
    hist = None if spec is None else torch.zeros(3, n, 19, dtype=torch.int64, device=device)
    ring = torch.tensor([4], dtype=torch.int64, device=device)
    hookstats.stats_multi_into(xs, out, list(range(n)), hist, None, spec, ring=ring)
    assert torch.equal(bits(out[1]), bits(want))
    assert torch.isnan(out[[0, 2]]).all()
    if spec is not None:
        assert torch.equal(hist[1], wh) and (hist[[0, 2]] == 0).all()


def test_ring_argument_errors():
    x = torch.randn(10)
    out = torch.full((2, 3, 13), float("nan"), dtype=torch.float64)
    with pytest.raises(TypeError, match="ring must be an int64"):
        hookstats.stats_into(x, out, 0, ring=torch.zeros(1))
    with pytest.raises(ValueError, match=r"ring slots, rows"):
        hookstats.stats_into(x, out[0], 0, ring=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="out of range"):
        hookstats.stats_into(x, out, 3, ring=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="histogram buffer is"):
        hookstats.stats_into(x, out, 0, torch.zeros(3, 3, 19, dtype=torch.int64), 0, (16, (-1.0, 1.0)),
                             ring=torch.zeros(1, dtype=torch.int64))
    assert torch.isnan(out).all()


def test_reference_ring_rows_match_the_kernel():
    x = torch.randn(100)
    ring = torch.tensor([5], dtype=torch.int64)
    a = torch.full((3, 2, 13), float("nan"), dtype=torch.float64)
    b = a.clone()
    hookstats.stats_into(x, a, 1, ring=ring)
    p, out2d, _ = reference.ring_rows(ring, b, None, "stats_into")
    reference.stats_into(x, out2d, 1)
    assert p == 2
    torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_ring_advance(device):
    state = torch.tensor([0, -1], dtype=torch.int64, device=device)
    steps = torch.full((3,), -1, dtype=torch.int64, device=device)
    for k in range(7):
        step = torch.tensor([100 + k], dtype=torch.int64, device=device)
        torch.ops.hookstats._ring_advance(state, steps, step)
        assert state.tolist() == [k + 1, k % 3]
        assert int(steps[k % 3]) == 100 + k
    with pytest.raises(ValueError, match="state is"):
        torch.ops.hookstats._ring_advance(torch.zeros(3, dtype=torch.int64, device=device), steps, step)


# -- the Monitor ----------------------------------------------------------------------------------------------------

def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _strip(recs):
    return [{k: v for k, v in r.items() if k != "seq"} for r in recs]


def _train_step(m, opt, x):
    opt.zero_grad(set_to_none=False)
    m(x.requires_grad_()).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("slots", [8, 3])
@pytest.mark.parametrize("histogram", [None, "exp", (16, (-2.0, 2.0))])
@pytest.mark.parametrize("kinds", [("forward", "backward_pre", "backward"), ("forward", "grad")])
def test_replays_record_what_eager_steps_record(histogram, kinds, slots):
    """Warm-up, capture, replays with new data (mon.step() after each), then eager steps: the records equal those of
    a twin Monitor that ran every step eagerly (except the capture's step, which records nothing: a capture runs
    no kernel), in step order, values bit for bit. With 3 slots the second flush's replays wrap around the ring."""
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(8)]
    m, twin = _net(), _net()
    opt, topt = (torch.optim.SGD(mm.parameters(), lr=0.01) for mm in (m, twin))
    kw = dict(kinds=kinds, histogram=histogram, slots=slots)
    if "grad" in kinds:
        mon, tmon = hookstats.Monitor(m, optimizer=opt, **kw), hookstats.Monitor(twin, optimizer=topt, **kw)
    else:
        mon, tmon = hookstats.Monitor(m, **kw), hookstats.Monitor(twin, **kw)
    rec = mon._rec.rec
    rec._set_test_capture(0)
    _train_step(m, opt, xs[0]); mon.step()          # step 0: warm-up
    _train_step(twin, topt, xs[0]); tmon.step()
    rec._set_test_capture(17)                       # step 1: the capture (its kernels do not count)
    _train_step(m, opt, xs[1])
    rec._set_test_capture(0)
    # The capture ran the optimizer once on the CPU; the twin makes the same update without recording it.
    tmon._rec.rec.begin_step(1, False, False)
    _train_step(twin, topt, xs[1])
    mon.step(); tmon.step()
    for i in range(2, 6):                           # steps 2..5: replays
        rec._set_test_capture(17, True)
        _train_step(m, opt, xs[i])
        rec._set_test_capture(0)
        mon.step()
        _train_step(twin, topt, xs[i]); tmon.step()
        if i == 3:
            mon.flush(); tmon.flush()
    _train_step(m, opt, xs[6]); mon.step()          # step 6: eager again
    _train_step(twin, topt, xs[6]); tmon.step()
    assert rec.num_rings == 1
    got, want = _strip(mon.records()), _strip(tmon.records())
    assert sorted({r["step"] for r in got}) == [0, 2, 3, 4, 5, 6]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert len({r["stats"]["l2"] for r in got if r["kind"] == "forward" and r["module"] == "0"}) == 6
    assert got == want or _nan_equal(got, want)
    assert mon.dropped_replays == 0
    mon.detach(); tmon.detach()


def _nan_equal(a, b):
    import math

    def same(u, v):
        if isinstance(u, float) and isinstance(v, float):
            return u == v or (math.isnan(u) and math.isnan(v))
        if isinstance(u, dict):
            return u.keys() == v.keys() and all(same(u[k], v[k]) for k in u)
        if isinstance(u, (list, tuple)):
            return len(u) == len(v) and all(same(p, q) for p, q in zip(u, v))
        return u == v
    return same(a, b)


def test_more_replays_than_slots_are_counted_and_warned():
    m = _net()
    mon = hookstats.Monitor(m, kinds=("forward",), slots=3)
    rec = mon._rec.rec
    rec._set_test_capture(0)
    x = torch.randn(2, 8)
    m(x); mon.step()
    rec._set_test_capture(5); m(x); rec._set_test_capture(0); mon.step()
    for _ in range(5):
        rec._set_test_capture(5, True); m(x * 2); rec._set_test_capture(0); mon.step()
    with pytest.warns(RuntimeWarning, match="2 replays of a captured CUDA graph were overwritten"):
        recs = mon.flush()
    steps = sorted({r["step"] for r in recs})
    assert steps == [0, 4, 5, 6]  # warm-up, then the last 3 replays
    assert mon.dropped_replays == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(mon.flush()) == 0  # nothing new, nothing lost
    mon.detach()


def test_capture_rules_have_clear_errors():
    m = _net()
    mon = hookstats.Monitor(m, kinds=("forward",), slots=4)
    rec = mon._rec.rec
    rec._set_test_capture(3)  # no warm-up: the device's buffers do not exist yet
    with pytest.raises(RuntimeError, match="once outside capture first"):
        m(torch.randn(2, 8))
    rec._set_test_capture(0)
    m(torch.randn(2, 8)); mon.step()
    rec._set_test_capture(4)
    m(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="recorded the same hook call twice"):
        rec.begin_step(99, True, True)  # mon.step() inside the captured region, then the same hooks again
        m(torch.randn(2, 8))
    rec._set_test_capture(0)
    mon.detach()


def test_captured_step_may_not_grow_the_buffers():
    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    mon = hookstats.Monitor(m, kinds=("forward",), slots=2)
    mon._rec.rec._set_test_capture(0)
    m(torch.randn(1, 4)); mon.step()  # 4 sites (3 layers + the container): fits the 64 initial rows
    big = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(70)])
    mon2 = hookstats.Monitor(big, kinds=("forward",), slots=2)
    rec2 = mon2._rec.rec
    rec2._set_test_capture(0)
    big[0](torch.randn(1, 4)); mon2.step()  # one site: the buffer has 64 rows
    rec2._set_test_capture(8)
    with pytest.raises(RuntimeError, match="needs more rows than the buffer has"):
        big(torch.randn(1, 4))
    rec2._set_test_capture(0)
    mon.detach(); mon2.detach()


def test_eager_monitor_without_captures_is_unchanged():
    """No capture: no ring, and begin_step fills nothing on the CPU (the CUDA fill is one small kernel a step)."""
    m = _net()
    with hookstats.Monitor(m, kinds=("forward",)) as mon:
        for _ in range(3):
            m(torch.randn(2, 8)); mon.step()
        assert mon._rec.rec.num_rings == 0
        assert len(mon.flush()) == 12


@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_ring_with_locations(device):
    x = torch.randn(3000, device=device)
    x[1234] = 50.0
    x[2000] = float("inf")
    out = torch.full((3, 2, 13), float("nan"), dtype=torch.float64, device=device)
    loc = torch.full((3, 2, 2), -7, dtype=torch.int64, device=device)
    hookstats.stats_into(x, out, 1, ring=torch.tensor([4], device=device), loc=loc)
    assert loc[1, 1].tolist() == [2000, 2000]  # +inf is the largest |x|, and the first non-finite
    assert (loc[[0, 2]] == -7).all() and (loc[1, 0] == -7).all()
    with pytest.raises(ValueError, match="location buffer is"):
        hookstats.stats_into(x, out, 1, ring=torch.tensor([4], device=device), loc=loc[0])


def test_locations_monitor_refuses_capture_clearly():
    m = _net()
    mon = hookstats.Monitor(m, kinds=("forward",), locations=True)
    rec = mon._rec.rec
    rec._set_test_capture(0)
    m(torch.randn(2, 8)); mon.step()
    rec._set_test_capture(9)
    with pytest.raises(RuntimeError, match=r"locations=True\) does not record inside CUDA graph capture"):
        m(torch.randn(2, 8))
    rec._set_test_capture(0)
    mon.detach()
