"""The Monitor's C++ hook path (issue #13): grad_output recorded by C++ tensor hooks, against PyTorch's own
register_full_backward_pre_hook in every case where the two could differ (Note [grad_output by tensor hooks] in
hookstats/monitor/hooks.py); sites and their call numbers; the columnar flush; a dropped Monitor frees its model;
histogram_every; grads once per step through optimizer= and record_grads().

The reference is a plain full backward pre-hook on the same modules that clones what it sees. Records are compared
per step as multisets of (module, index, stats): the order of grad_output records follows the order autograd runs
the hooks, which is where the two mechanisms may differ (the tests say where they do).
"""
from __future__ import annotations

import gc
import math
import pickle
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import hookstats
from hookstats import reference

from _testing import stats_mismatches


class PreCapture:
    """register_full_backward_pre_hook on every named module: (step, module, index, clone) of each grad_output."""

    def __init__(self, model: nn.Module):
        self.items: list = []
        self.step = 0
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_full_backward_pre_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, grad_output):
            for i, g in enumerate(grad_output):
                if g is not None:
                    self.items.append((self.step, name, i, g.detach().clone()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def run(make, body, steps: int = 2):
    """(monitor records of kind backward_pre, PyTorch's captured grad_outputs) of `steps` calls of body(model, s),
    on two identical models: one with a Monitor, one with the capture."""
    torch.manual_seed(0)
    m1 = make()
    torch.manual_seed(0)
    m2 = make()
    m2.load_state_dict(m1.state_dict())
    mon = hookstats.Monitor(m1, kinds="backward_pre")
    cap = PreCapture(m2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            cap.step = s
            torch.manual_seed(100 + s)
            body(m1, s)
            torch.manual_seed(100 + s)
            body(m2, s)
            mon.step()
    recs = mon.records()
    mon.detach()
    cap.remove()
    return recs, cap.items


def assert_same(recs, items):
    def key_r(r):
        return (r["step"], r["module"], r["index"], r["stats"]["numel"], round(r["stats"]["sum"], 4))

    def key_i(it):
        s, name, i, g = it
        return (s, name, i, g.numel(), round(float(g.double().sum()), 4))

    assert sorted(map(key_r, recs)) == sorted(map(key_i, items))
    by_key = {}
    for it in items:
        by_key.setdefault(key_i(it), []).append(it[3])
    for r in recs:
        t = by_key[key_r(r)].pop()
        st = hookstats.Stats(*[torch.tensor(r["stats"][f], dtype=torch.float64) for f in hookstats.STATS_FIELDS])
        bad = stats_mismatches(st, reference.stats(t), t.dtype)
        assert not bad, (key_r(r), bad)


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def test_plain_model_equals_full_backward_pre_hooks():
    def body(m, s):
        m(torch.randn(5, 4)).pow(2).sum().backward()

    recs, items = run(mlp, body)
    assert len(recs) == 2 * 4  # root, 0, 1, 2 a step
    assert_same(recs, items)


def test_container_output_is_its_childs_output():
    """nn.Sequential returns its last child's output tensor: both hooks see it; both record the same values. Tensor
    hooks run in registration order (the child's forward hook registered first), PyTorch's pre-hooks the
    container's first."""
    def body(m, s):
        m(torch.randn(5, 4)).sum().backward()

    recs, items = run(mlp, body, steps=1)
    assert_same(recs, items)
    order = [r["module"] for r in recs]
    assert order.index("2") < order.index("")
    assert [it[1] for it in items].index("") < [it[1] for it in items].index("2")


class InPlaceAfter(nn.Module):
    """A child whose output is modified in place by the parent after the child returns."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(3.0)  # in place on the child's output
        return y.tanh()


def test_output_modified_in_place_after_the_module():
    """PyTorch's full backward pre-hook refuses this ("Output 0 of BackwardHookFunction is a view and is being
    modified inplace"); the Monitor's tensor hook records the gradient w.r.t. the value lin returned."""
    torch.manual_seed(0)
    m = InPlaceAfter()
    x = torch.randn(5, 4)
    cap = PreCapture(m)
    with pytest.raises(RuntimeError, match="modified inplace"):
        m(x)
    cap.remove()
    mon = hookstats.Monitor(m, kinds="backward_pre")
    m(x).sum().backward()
    lin = [r for r in mon.records() if r["module"] == "lin"]
    y0 = m.lin(x).detach().requires_grad_()
    (y0 * 3.0).tanh().sum().backward()  # the same function, out of place
    assert len(lin) == 1
    assert math.isclose(lin[0]["stats"]["sum"], float(y0.grad.double().sum()), rel_tol=1e-5)
    assert math.isclose(lin[0]["stats"]["l2"], float(y0.grad.double().norm()), rel_tol=1e-5)


class ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.view = View()

    def forward(self, x):
        return self.view(self.lin(x))


class View(nn.Module):
    def forward(self, x):
        return x.view(-1, 2, 3).transpose(1, 2)


def test_output_that_is_a_view():
    def body(m, s):
        (m(torch.randn(5, 4)) * torch.arange(6.0).view(2, 3).t()).sum().backward()

    recs, items = run(ViewOut, body)
    assert_same(recs, items)


class PartlyNoGrad(nn.Module):
    """Two outputs: one detached (needs no grad), one not used by the loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.split = Split()

    def forward(self, x):
        return self.split(self.lin(x))


class Split(nn.Module):
    def forward(self, x):
        a, b, c = x.chunk(3, dim=1)
        return a, b.detach(), c


def test_outputs_without_grad_and_unused_outputs_are_not_recorded():
    def body(m, s):
        a, b, c = m(torch.randn(5, 4))
        (a * 2).sum().backward()  # c unused, b needs no grad

    recs, items = run(PartlyNoGrad, body)
    assert_same(recs, items)
    assert {(r["module"], r["index"]) for r in recs} == {("", 0), ("split", 0), ("lin", 0)}


def test_no_grad_forward_records_no_grad_output():
    torch.manual_seed(0)
    m = mlp()
    mon = hookstats.Monitor(m)
    with torch.no_grad():
        m(torch.randn(3, 4))
    assert {r["kind"] for r in mon.records()} == {"forward"}


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_module_called_twice_in_a_step():
    def body(m, s):
        m(torch.randn(5, 4)).pow(2).sum().backward()

    recs, items = run(Twice, body)
    assert_same(recs, items)
    assert sum(1 for r in recs if r["module"] == "lin" and r["step"] == 0) == 2


def test_gradient_accumulation_and_retain_graph():
    def body(m, s):
        for k in range(3):  # three micro-batches: three backward calls a step
            out = m(torch.randn(5, 4)).pow(2).sum()
            out.backward(retain_graph=True)
            if k == 2:
                out.backward()  # the same graph twice (retain_graph)

    recs, items = run(mlp, body)
    assert_same(recs, items)
    assert sum(1 for r in recs if r["module"] == "0" and r["step"] == 1) == 4


def test_forward_records_and_sites():
    """A site per (hook, index, call): a module called twice in a step has two sites, reused by the next steps; the
    step block holds one row per site."""
    torch.manual_seed(0)
    m = Twice()
    mon = hookstats.Monitor(m, kinds="forward")
    for _ in range(3):
        m(torch.randn(2, 4))
        mon.step()
    recs = mon.records()
    assert [(r["step"], r["module"]) for r in recs] == [(s, n) for s in range(3) for n in ("lin", "lin", "")]
    assert len(mon._rec.table) == 3  # lin call 0, lin call 1, root
    assert [r["seq"] for r in recs] == list(range(9))


def test_new_sites_at_a_later_step_keep_call_order():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, n):
            for _ in range(n):
                x = self.lin(x)
            return x

    torch.manual_seed(0)
    m = Grows()
    mon = hookstats.Monitor(m, kinds="forward", slots=1, include="lin")
    for n in (1, 3, 2, 5):
        m(torch.randn(2, 4), n)
        mon.step()
    steps = [r["step"] for r in mon.records()]
    assert steps == [0] + [1] * 3 + [2] * 2 + [3] * 5  # past 1 slot and past the first sites: the buffers grew


def test_flush_is_one_block_of_columns():
    torch.manual_seed(0)
    m = mlp()
    mon = hookstats.Monitor(m, histogram=(8, (-2.0, 2.0)))
    for _ in range(3):
        m(torch.randn(4, 4)).sum().backward()
        mon.step()
    block = mon._flush_block()
    assert len(block) == 3 * 8
    assert block.stats.shape == (24, 13) and block.steps.tolist() == [0] * 8 + [1] * 8 + [2] * 8
    assert (block.hist_group >= 0).all() and sum(len(h) for h in block.hists) == 24
    assert list(block.column("kind")[:8]) == ["forward"] * 4 + ["backward_pre"] * 4
    recs = block.records()  # the dicts, built on demand from the columns
    assert recs[0]["histogram"] is not None and sum(recs[0]["histogram"]) == recs[0]["stats"]["numel"]
    assert mon._rec.pending == 0


def _dense_gather(block, slot, row):
    return block[slot, row]


@pytest.mark.parametrize("order", ["consecutive", "scattered", "one_row", "empty"])
@pytest.mark.parametrize("big", [False, True], ids=["int32", "int64"])
def test_flushed_histogram_rows_keep_their_nonzero_columns(order, big):
    """A flush keeps a block's histogram rows as the columns that hold a count somewhere (HistRows, int32 when every
    count fits): indexing them gives the dense int64 rows, for consecutive rows (one copy) and gathered ones, across
    more rows than one scan pass (_SCAN_ROWS), and counts past int32."""
    from hookstats.monitor.block import _SCAN_ROWS, HistRows, gather_rows
    gen = np.random.default_rng(0)
    slots, sites, length = 3, _SCAN_ROWS // 2 + 7, 66
    buf = np.zeros((slots + 1, sites + 5, length), dtype=np.int64)
    block = buf[:slots, :sites]  # what a flush gets: the used rows of a larger buffer (not contiguous)
    used = gen.choice(length, 9, replace=False)  # a few columns only, as exponent histograms have
    block[:, :, used] = gen.integers(0, 5, (slots, sites, 9))
    block[1, 3, used[0]] = 2**40 if big else 2**31 - 1
    slot = np.repeat(np.arange(slots), sites)
    row = np.tile(np.arange(sites), slots)
    if order == "scattered":
        perm = gen.permutation(len(slot))
        slot, row = slot[perm], row[perm]
    elif order == "one_row":
        slot, row = slot[sites + 3:sites + 4], row[sites + 3:sites + 4]
    elif order == "empty":
        slot, row = slot[:0], row[:0]
    got = gather_rows(block, slot, row)
    want = _dense_gather(block, slot, row)
    assert isinstance(got, HistRows) and got.shape == want.shape and len(got) == len(want)
    assert got.data.dtype == (np.int64 if big and order != "empty" else np.int32)
    assert got.data.shape[1] <= 9  # only the used columns are stored
    assert np.array_equal(got[:], want) and got[:].dtype == np.int64 and np.array_equal(np.asarray(got), want)
    # array methods and attributes answer as the dense rows do (exporters written against [rows, bins] arrays)
    assert np.array_equal(got.sum(axis=0), want.sum(axis=0)) and got.ndim == 2 and got.T.shape == want.T.shape
    assert np.array_equal(got[:, used[0]], want[:, used[0]]) and np.array_equal(got[..., 3], want[..., 3])
    assert np.array_equal(got + 1, want + 1) and np.array_equal(np.minimum(got, 2), np.minimum(want, 2))
    assert np.array_equal(pickle.loads(pickle.dumps(got))[:], want)
    if len(want):
        i = len(want) // 2
        assert np.array_equal(got[i], want[i]) and got[i].tolist() == want[i].tolist()
        pick = np.array([len(want) - 1, 0, i])
        assert np.array_equal(got[pick], want[pick])
        assert got[i, used[1]] == want[i, used[1]] and np.array_equal(got[1:3, used], want[1:3, used])


def test_flush_leaves_the_recorder_rows_free_for_the_next_steps():
    """CPU blocks are read in place by the flush (no copy first): what the next steps write does not reach the
    rows an earlier flush returned."""
    torch.manual_seed(0)
    m = mlp()
    mon = hookstats.Monitor(m, histogram="exp")
    x = torch.randn(4, 4)
    m(x).sum().backward()
    mon.step()
    first = [dict(r, stats=dict(r["stats"])) for r in mon.flush()]
    for _ in range(2):
        m(x * 1e6).sum().backward()
        mon.step()
    mon.flush()
    again = mon.records()[:len(first)]
    assert [r["histogram"] for r in again] == [r["histogram"] for r in first]
    assert [r["stats"] for r in again] == [r["stats"] for r in first]


def test_dropped_monitor_frees_model_and_grads():
    """The "grad" kind's post-accumulate hooks are held by PyTorch in C++: a hook that reached the Monitor would
    keep the model and every gradient alive once the Monitor is dropped without detach()."""
    torch.manual_seed(0)
    model = mlp()
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre", "backward", "grad"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(3, 4)).sum().backward()
    mon.step()
    ref, grad_ref = weakref.ref(model), weakref.ref(model[0].weight.grad)
    mon_ref = weakref.ref(mon)
    del mon
    gc.collect()
    assert mon_ref() is None
    del model
    gc.collect()
    assert ref() is None and grad_ref() is None


def test_dropped_monitor_with_optimizer_frees_model():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = hookstats.Monitor(model, kinds=("forward", "grad"), optimizer=opt)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ref = weakref.ref(mon)
    del mon
    gc.collect()
    assert ref() is None
    opt.step()  # the optimizer's pre-hook outlives the Monitor harmlessly


def test_histogram_every():
    torch.manual_seed(0)
    m = mlp()
    mon = hookstats.Monitor(m, kinds="forward", histogram="exp", histogram_every=3)
    for _ in range(7):
        m(torch.randn(3, 4))
        mon.step()
    recs = mon.records()
    with_hist = sorted({r["step"] for r in recs if r["histogram"] is not None})
    assert with_hist == [0, 3, 6] and {r["step"] for r in recs} == set(range(7))
    for r in recs:
        if r["histogram"] is not None:
            assert sum(r["histogram"]) == r["stats"]["numel"]


def test_histogram_every_counts_recorded_steps():
    torch.manual_seed(0)
    m = mlp()
    mon = hookstats.Monitor(m, kinds="forward", histogram="exp", every=2, histogram_every=2)
    for _ in range(9):
        m(torch.randn(3, 4))
        mon.step()
    recs = mon.records()
    assert sorted({r["step"] for r in recs}) == [0, 2, 4, 6, 8]
    assert sorted({r["step"] for r in recs if r["histogram"] is not None}) == [0, 4, 8]


def test_grads_once_per_step_with_optimizer():
    """With optimizer=, "grad" records every parameter's accumulated grad once per step, at opt.step(), instead of
    once per accumulation."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = hookstats.Monitor(model, kinds="grad", optimizer=opt)
    want = []
    for s in range(3):
        for _ in range(2):  # two micro-batches
            model(torch.randn(3, 4)).pow(2).sum().backward()
        want.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        mon.step()
    recs = mon.records()
    assert [(r["step"], r["module"]) for r in recs] == [(s, n) for s in range(3) for n, _ in model.named_parameters()]
    for r in recs:
        g = want[r["step"]][r["module"]]
        st = hookstats.Stats(*[torch.tensor(r["stats"][f], dtype=torch.float64) for f in hookstats.STATS_FIELDS])
        assert not stats_mismatches(st, reference.stats(g), g.dtype)


def test_record_grads_on_demand():
    torch.manual_seed(0)
    model = mlp()
    mon = hookstats.Monitor(model, kinds=("forward", "grad"), include=["2", "2.*"])
    model(torch.randn(3, 4)).sum().backward()
    n_acc = len([r for r in mon.records() if r["kind"] == "grad"])
    mon.record_grads()
    grads = [r for r in mon.records() if r["kind"] == "grad"]
    assert n_acc == 2 and len(grads) == 4  # after accumulation (no optimizer), then on demand
    assert [r["module"] for r in grads[2:]] == ["2.weight", "2.bias"]
    with pytest.raises(RuntimeError, match="'grad' kind"):
        hookstats.Monitor(model, kinds="forward").record_grads()


def test_bad_cadence_arguments():
    m = mlp()
    for kw in ({"histogram_every": 0}, {"every": 0}, {"slots": 0}, {"flush_every": 0}):
        with pytest.raises(ValueError):
            hookstats.Monitor(m, **kw)
    with pytest.raises(TypeError, match="Optimizer"):
        hookstats.Monitor(m, optimizer=object())


def test_model_output_dicts_and_namedtuples_are_flattened_in_cpp():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")

    class Out(nn.Module):
        def forward(self, x):
            return {"first": x * 2, "rest": [Pair(x + 1, None), OrderedDict(z=x.sum(), ids=x.long())]}

    m = Out()
    mon = hookstats.Monitor(m, kinds="forward")
    x = torch.randn(3, 2)
    m(x)
    recs = mon.records()
    assert [r["index"] for r in recs] == [0, 1, 3]  # None keeps index 2; the int64 tensor (index 4) is skipped
    assert mon.skipped == 1
    assert math.isclose(recs[2]["stats"]["sum"], float(x.sum()), rel_tol=1e-6)


def test_channel_stats_option_calibrates_linear_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    mon = hookstats.Monitor(model, kinds="forward", channel_stats={"inputs": -1}, include="*Linear*")
    xs = [torch.randn(5, 6) * torch.arange(1.0, 7.0) for _ in range(3)]
    for x in xs:
        model(x)
        mon.step()
    assert {r["module"] for r in mon.records()} == {"0", "2"}  # class-name globs select the Linears
    res = mon.channel_results()["inputs"]
    assert set(res) == {"0", "2"}
    want = torch.cat(xs).abs().amax(0)
    assert torch.allclose(res["0"].absmax.double(), want.double())
    h = torch.relu(model[0](torch.cat(xs)))
    assert torch.allclose(res["2"].absmax.double(), h.abs().amax(0).double(), rtol=1e-6)
    mon.detach()
    model(xs[0])  # the calibrator's hooks are gone too
    assert torch.allclose(mon.channel_results()["inputs"]["0"].absmax.double(), want.double())


def test_per_sample_option_names_the_bad_sample():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mon = hookstats.Monitor(model, kinds="forward", per_sample=True)
    for s in range(3):
        x = torch.randn(6, 4)
        if s == 1:
            x[4] *= 100.0  # a wild sample
        if s == 2:
            x[2, 0] = float("nan")
        model(x).pow(2).sum().backward()
        model.zero_grad()
        mon.step()
    top = mon.top_samples(2)
    assert (top[0]["step"], top[0]["sample"]) == (2, 2) and top[0]["norm"] != top[0]["norm"]  # NaN ranks first
    assert (top[1]["step"], top[1]["sample"]) == (1, 4)
    bad = mon.first_nonfinite_sample()
    assert (bad["step"], bad["sample"]) == (2, 2) and bad["layers"] == ["0", "2"]
    steps = [s for s, _, _ in mon.sample_norms()]
    assert steps == [0, 1, 2] and mon.sample_norms()[0][2].shape == (2, 6)
