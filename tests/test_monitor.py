"""hookstats.Monitor: what it records (per module, kind and step, with exact counts), against a plain-PyTorch capture
registered on the same hooks right after the Monitor's; every=N; NaN hunting; the growing buffer; histograms;
summaries; include/exclude globs; kind aliases; detach and the context manager; bad arguments. The contract is the
hooks API spec (issue #5) and the docstring of hookstats.Monitor (hookstats/monitor/core.py).

The capture: for each Monitor hook, a plain hook of the same kind on the same module (or parameter), registered
after it, so PyTorch calls the two back to back; it keeps (step, module, kind, index, clone) of every floating
tensor it sees (the index counts every tensor the hook saw, in depth-first order, None dropped) and counts the
non-floating ones. Records must list the same (step, module, kind, index) in the same order; their stats must
match hookstats.reference.stats of the clone within tests/_testing.py's tolerances for the tensor's dtype; their histograms
must equal hookstats.histogram / exp_histogram of the clone exactly.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import hookstats
from hookstats import reference

from _testing import DEVICES, DTYPES, flat, stats_mismatches

F = hookstats.STATS_FIELDS
NAN = float("nan")
INF = float("inf")
ALL_KINDS = ("forward_pre", "forward", "backward_pre", "backward", "grad")
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


# ---------------------------------------------------------------------------------------------------------------
# Models, the capture, and a training loop
# ---------------------------------------------------------------------------------------------------------------

def make_mlp(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return m.to(device=device, dtype=dtype)


def make_cnn(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Flatten(),
                      nn.Linear(6 * 4 * 4, 5))
    return m.to(device=device, dtype=dtype)


def make_transformer(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return m.to(device=device, dtype=dtype)


def inputs_for(name: str, step: int, dtype=torch.float32, device="cpu"):
    """Positional inputs of step `step` (a different batch each step). The transformer gets a bool key padding mask
    positionally: a non-floating tensor its root's forward_pre hooks see."""
    gen = torch.Generator().manual_seed(100 + step)
    if name == "mlp":
        return (torch.randn(6, 8, generator=gen).to(device=device, dtype=dtype),)
    if name == "cnn":
        return (torch.randn(2, 3, 6, 6, generator=gen).to(device=device, dtype=dtype),)
    if name == "transformer":
        x = torch.randn(2, 5, 32, generator=gen).to(device=device, dtype=dtype)
        mask = torch.zeros(2, 5, dtype=torch.bool, device=device)
        mask[0, 3:] = True
        return (x, None, mask)
    raise AssertionError(name)


MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer}


def loss_of(out: torch.Tensor) -> torch.Tensor:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    return (out * w).sum()



class Capture:
    """Plain hooks beside the Monitor's (see the module docstring)."""

    def __init__(self, model: nn.Module, kinds, modules, params=None):
        self.items: list = []
        self.nonfloat = 0
        self.step = 0
        self.on = True
        named = dict(model.named_modules())
        for name in modules:
            mod = named[name]
            for kind in kinds:
                if kind == "forward_pre":
                    mod.register_forward_pre_hook(self._hook(name, kind, lambda m, a: a))
                elif kind == "forward":
                    mod.register_forward_hook(self._hook(name, kind, lambda m, a, o: o))
                elif kind == "backward_pre":
                    mod.register_full_backward_pre_hook(self._hook(name, kind, lambda m, g: g))
                elif kind == "backward":
                    mod.register_full_backward_hook(self._hook(name, kind, lambda m, gi, go: gi))
        if "grad" in kinds:
            for pname, p in model.named_parameters():
                if params is None or pname in params:
                    p.register_post_accumulate_grad_hook(self._hook(pname, "grad", lambda q: q.grad))

    def _hook(self, name, kind, pick):
        def hook(*args):
            if not self.on:
                return None
            for i, t in enumerate(flat(pick(*args))):
                if t.dtype in FLOATS:
                    self.items.append((self.step, name, kind, i, t.detach().clone()))
                else:
                    self.nonfloat += 1
            return None

        return hook


def train(model, name, steps, mon=None, cap=None, dtype=torch.float32, device="cpu", before=None, every=1):
    """`steps` steps of forward + backward (grads zeroed each step); mon.step() after each. `before(step)` runs
    first in each step. The capture only captures the steps the Monitor records."""
    for s in range(steps):
        if before is not None:
            before(s)
        if cap is not None:
            cap.step = s
            cap.on = s % every == 0
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "full backward hook is firing ... no inputs require gradients"
            out = model(*inputs_for(name, s, dtype, device))
            loss_of(out).backward()
        if mon is not None:
            mon.step()


def stats_obj(rec_stats: dict) -> hookstats.Stats:
    return hookstats.Stats(*[torch.tensor(rec_stats[f], dtype=torch.float64) for f in F])


def assert_records_match(records: list, items: list, histogram=None) -> None:
    got = [(r["step"], r["module"], r["kind"], r["index"]) for r in records]
    want = [it[:4] for it in items]
    assert got == want, "records are not the captured tensors, in order:\n" + first_difference(got, want)
    for r, (_, _, _, _, t) in zip(records, items):
        assert r["stats"]["numel"] == t.numel()
        bad = stats_mismatches(stats_obj(r["stats"]), reference.stats(t), t.dtype)
        assert not bad, f"record {r['step']}/{r['module']}/{r['kind']}/{r['index']}: " + "; ".join(bad)
        if histogram is None:
            assert r["histogram"] is None
        elif histogram == "exp":
            assert r["histogram"] == hookstats.exp_histogram(t).tolist()
        else:
            bins, rng = histogram
            assert r["histogram"] == hookstats.histogram(t, bins, range=rng).tolist()


def first_difference(got, want) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return f"  at {i}: got {g}, want {w}"
    return f"  lengths {len(got)} vs {len(want)}"


def all_names(model) -> list:
    return [n for n, _ in model.named_modules()]


# ---------------------------------------------------------------------------------------------------------------
# Records against the capture
# ---------------------------------------------------------------------------------------------------------------

CASES = [pytest.param("mlp", torch.float32, id="mlp-fp32"), pytest.param("cnn", torch.float32, id="cnn-fp32"),
         pytest.param("transformer", torch.float32, id="transformer-fp32"),
         pytest.param("mlp", torch.float64, id="mlp-fp64"), pytest.param("mlp", torch.float16, id="mlp-fp16"),
         pytest.param("mlp", torch.bfloat16, id="mlp-bf16")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, dtype", CASES)
def test_records_equal_plain_capture_all_kinds(device, name, dtype):
    model = MAKERS[name](dtype, device)
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    assert mon.modules == all_names(model)
    cap = Capture(model, ALL_KINDS, all_names(model))
    train(model, name, 3, mon, cap, dtype, device)
    records = mon.records()
    assert_records_match(records, cap.items)
    assert mon.skipped == cap.nonfloat
    assert {r["step"] for r in records} == {0, 1, 2}
    assert mon.first_nonfinite() is None
    assert mon.records() == records  # reading again reads the same
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_default_kinds_are_forward_and_backward_pre(name):
    model = MAKERS[name]()
    mon = hookstats.Monitor(model)
    assert mon.kinds == ("forward", "backward_pre")
    cap = Capture(model, ("forward", "backward_pre"), all_names(model))
    train(model, name, 2, mon, cap)
    assert_records_match(mon.records(), cap.items)


def test_exact_counts_per_module_kind_step():
    """Linear(8,16), Tanh, Linear(16,16), Tanh, Linear(16,4) on an input that does not require grad: each module
    records one input, one output and one grad_output per step; grad_input exists for "1" to "4" only (the root's
    and "0"'s input is the data); each of the 6 parameters one grad."""
    model = make_mlp()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    train(model, "mlp", 4, mon)
    counts: dict = {}
    for r in mon.records():
        key = (r["step"], r["module"], r["kind"])
        counts[key] = counts.get(key, 0) + 1
    want = {}
    for step in range(4):
        for mod in ("", "0", "1", "2", "3", "4"):
            for kind in ("forward_pre", "forward", "backward_pre"):
                want[(step, mod, kind)] = 1
            if mod not in ("", "0"):
                want[(step, mod, "backward")] = 1
        for p in ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"):
            want[(step, p, "grad")] = 1
    assert counts == want
    assert len(mon.records()) == 4 * 28
    assert mon.skipped == 0
    # the records of one step, in hook order: forward pre/post nest, the root's forward last; backward from the end
    step0 = [(r["module"], r["kind"]) for r in mon.records() if r["step"] == 0]
    assert step0[:4] == [("", "forward_pre"), ("0", "forward_pre"), ("0", "forward"), ("1", "forward_pre")]
    assert step0[10:13] == [("4", "forward"), ("", "forward"), ("", "backward_pre")]
    grads = {r["module"]: r for r in mon.records() if r["kind"] == "grad" and r["step"] == 3}
    for pname, p in model.named_parameters():  # the grad after accumulation, i.e. the .grad backward left
        bad = stats_mismatches(stats_obj(grads[pname]["stats"]), reference.stats(p.grad), p.dtype)
        assert not bad, pname


def test_forward_pre_records_positional_inputs_only():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, y=None):
            return self.lin(x) if y is None else self.lin(x) + y

    torch.manual_seed(0)
    m = TwoInputs()
    mon = hookstats.Monitor(m, kinds=("forward_pre",))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    m(x, y=y)
    mon.step()
    m(x, y)
    recs = [(r["step"], r["module"], r["index"]) for r in mon.records()]
    assert recs == [(0, "", 0), (0, "lin", 0), (1, "", 0), (1, "", 1), (1, "lin", 0)]
    assert mon.skipped == 0  # the keyword tensor is not seen at all
    assert mon.records()[3]["stats"]["max"] == float(y.max())


def test_token_ids_and_masks_are_skipped_and_counted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    cap = Capture(model, ALL_KINDS, all_names(model))
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    for s in range(2):
        cap.step = s
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_of(model(ids)).backward()
        mon.step()
    assert mon.skipped == cap.nonfloat == 4  # the ids, seen by the root's and the embedding's forward_pre, twice
    recs = mon.records()
    assert_records_match(recs, cap.items)
    assert not [r for r in recs if r["kind"] == "forward_pre" and r["module"] in ("", "0")]
    assert not [r for r in recs if r["kind"] == "backward" and r["module"] in ("", "0")]  # grad_input (None,)


def test_counters_are_one_snapshot_of_every_count():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    mon = hookstats.Monitor(model, kinds=("forward_pre", "forward"))
    before = mon.counters
    model(torch.tensor([[1, 2, 3]]))
    after = mon.counters
    assert dataclasses.is_dataclass(after) and dataclasses.fields(after)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.skipped = 0  # a snapshot: it does not move with the Monitor
    assert (before.skipped, after.skipped) == (0, 2)  # the ids, seen by the root's and the embedding's forward_pre
    for f in dataclasses.fields(after):  # each counter is also a property of its own name, documented as the field
        assert getattr(mon, f.name) == getattr(after, f.name)
        assert type(mon).__dict__[f.name].__doc__ == f.metadata["doc"]
    assert after == type(after)(skipped=2)  # nothing else counted: no merge, no export, no graph
    mon.detach()

    # the transformer with a positional bool mask: the mask is skipped, once per step, at the root's forward_pre
    model = make_transformer()
    mon = hookstats.Monitor(model, kinds=("forward_pre",), include="")
    train(model, "transformer", 3, mon)
    assert mon.skipped == 3
    assert [(r["module"], r["index"]) for r in mon.records()] == [("", 0)] * 3


# ---------------------------------------------------------------------------------------------------------------
# every=N
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("every", [2, 3])
def test_every_n_records_steps_0_n_2n(every):
    model = make_mlp()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS, every=every)
    cap = Capture(model, ALL_KINDS, all_names(model))
    steps = 2 * every + 1
    train(model, "mlp", steps, mon, cap, every=every)
    records = mon.records()
    assert sorted({r["step"] for r in records}) == [0, every, 2 * every]
    assert len(records) == 3 * 28
    assert_records_match(records, cap.items)


def test_skipped_steps_launch_nothing():
    model = make_mlp()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS, every=3)
    launches = []
    for s in range(4):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(model, s)
        launches.append(sum(1 for e in prof.events() if "stats_into" in e.name))
        mon.step()
    assert launches == [28, 0, 0, 28]


def train_step(model, s):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(model(*inputs_for("mlp", s))).backward()


# ---------------------------------------------------------------------------------------------------------------
# NaN hunting
# ---------------------------------------------------------------------------------------------------------------

def test_first_nonfinite_nan_written_into_a_layer_input():
    model = make_mlp()

    def poison(m, args):
        if poison.on:
            x = args[0].clone()
            x[1, 5] = NAN
            return (x,)

    poison.on = False
    model[2].register_forward_pre_hook(poison)  # before the Monitor's: the Monitor sees the poisoned input
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    cap = Capture(model, ALL_KINDS, all_names(model))

    def before(s):
        poison.on = s == 2

    train(model, "mlp", 4, mon, cap, before=before)
    assert_records_match(mon.records(), cap.items)
    bad = mon.first_nonfinite()
    assert bad is not None
    assert (bad["step"], bad["module"], bad["kind"], bad["index"]) == (2, "2", "forward_pre", 0)
    assert bad["stats"]["nan_count"] == 1
    nan_steps = sorted({r["step"] for r in mon.records() if r["stats"]["nan_count"]})
    assert nan_steps == [2]


def test_first_nonfinite_nan_weight():
    model = make_mlp()
    mon = hookstats.Monitor(model)

    def before(s):
        if s == 1:
            with torch.no_grad():
                model[4].weight[2, 3] = NAN

    train(model, "mlp", 3, mon, before=before)
    bad = mon.first_nonfinite()
    assert (bad["step"], bad["module"], bad["kind"], bad["index"]) == (1, "4", "forward", 0)
    assert bad["stats"]["nan_count"] == 6  # column 2 of the [6, 4] output
    assert mon.records()[0]["stats"]["nan_count"] == 0


def test_first_nonfinite_inf_in_backward():
    model = make_mlp()
    mon = hookstats.Monitor(model, kinds=("backward",))
    step = {"s": 0}

    def blow_up(m, grad_output):
        if step["s"] == 1:
            g = grad_output[0].clone()
            g[0, 0] = INF
            return (g,)

    model[2].register_full_backward_pre_hook(blow_up)

    def before(s):
        step["s"] = s

    train(model, "mlp", 3, mon, before=before)
    bad = mon.first_nonfinite()
    assert (bad["step"], bad["module"], bad["kind"]) == (1, "2", "backward")
    assert bad["stats"]["inf_count"] > 0
    clean = [r for r in mon.records() if r["seq"] < bad["seq"]]
    assert [(r["step"], r["module"]) for r in clean if r["step"] == 1] == [(1, "4"), (1, "3")]
    assert all(r["stats"]["nan_count"] == r["stats"]["inf_count"] == 0 for r in clean)


def test_first_nonfinite_is_none_when_all_finite():
    model = make_cnn()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    train(model, "cnn", 2, mon)
    assert mon.records() and mon.first_nonfinite() is None


# ---------------------------------------------------------------------------------------------------------------
# The buffer and histograms
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("histogram", [None, (16, (-1.0, 1.0)), "exp"], ids=["none", "range", "exp"])
def test_buffer_grows_past_slots_and_keeps_every_record(device, histogram):
    model = make_mlp(device=device)
    mon = hookstats.Monitor(model, slots=4, histogram=histogram)
    cap = Capture(model, ("forward", "backward_pre"), all_names(model))
    train(model, "mlp", 6, mon, cap, device=device)
    first = mon.records()  # a flush in the middle; histogram rows must start from zero after it
    assert len(first) == 6 * 12
    for s in range(6, 11):
        cap.step = s
        train_step_on(model, s, device)
        mon.step()
    records = mon.records()
    assert len(records) == 11 * 12
    assert records[: len(first)] == first
    assert_records_match(records, cap.items, histogram)


def train_step_on(model, s, device):
    model.zero_grad(set_to_none=True)
    loss_of(model(*inputs_for("mlp", s, device=device))).backward()


@pytest.mark.parametrize("histogram", [(32, (-2.0, 2.0)), "exp"], ids=["range", "exp"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_histograms_equal_hookstats_histogram(dtype, histogram):
    model = make_mlp(dtype)
    mon = hookstats.Monitor(model, kinds=ALL_KINDS, histogram=histogram)
    cap = Capture(model, ALL_KINDS, all_names(model))
    train(model, "mlp", 2, mon, cap, dtype)
    records = mon.records()
    assert_records_match(records, cap.items, histogram)
    assert all(sum(r["histogram"]) == r["stats"]["numel"] for r in records)


# ---------------------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_summary_rows_equal_the_capture(nan):
    model = make_mlp()
    kinds = ("forward", "backward_pre", "grad")
    mon = hookstats.Monitor(model, kinds=kinds)
    cap = Capture(model, kinds, all_names(model))

    def before(s):
        if nan and s == 2:  # NaN in the last step's output of "4" (and what follows), via its weight
            with torch.no_grad():
                model[4].weight[1, 0] = NAN

    train(model, "mlp", 3, mon, cap, before=before)
    rows = mon.summary_rows()
    order = []
    for it in cap.items:
        if it[1:3] not in order:
            order.append(it[1:3])
    assert [(r["module"], r["kind"]) for r in rows] == order
    for row in rows:
        ts = [(step, t.double()) for step, mod, kind, _, t in cap.items if (mod, kind) == (row["module"], row["kind"])]
        assert row["records"] == len(ts) == 3
        assert row["last_step"] == 2
        assert row["nan"] == sum(int(torch.isnan(t).sum()) for _, t in ts)
        assert row["inf"] == sum(int(torch.isinf(t).sum()) for _, t in ts)
        last_l2 = math.sqrt(sum(float(t.pow(2).sum()) for step, t in ts if step == 2))
        if math.isnan(last_l2):
            assert math.isnan(row["l2"])
        else:
            assert row["l2"] == pytest.approx(last_l2, rel=2e-6, abs=0)
        if not nan:  # (with a NaN in a tensor, its linf, min and max are NaN: which the row shows is not specified)
            assert row["linf"] == max(float(t.abs().max()) for _, t in ts)
            assert row["min"] == min(float(t.min()) for _, t in ts)
            assert row["max"] == max(float(t.max()) for _, t in ts)
    with_nan = {(r["module"], r["kind"]) for r in rows if r["nan"]}
    if nan:
        assert {("4", "forward"), ("", "forward")} <= with_nan
        assert {(r["module"], r["kind"]): r["nan"] for r in rows}[("4", "forward")] == 6
    else:
        assert with_nan == set()

    text = mon.summary()
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    head = lines[0].split()
    for word in ("module", "kind", "records"):
        assert word in head
    for line, row in zip(lines[2:], rows):
        cells = line.split()
        assert cells[0] == (row["module"] or "<model>")
        assert cells[1] == row["kind"]
        assert cells[2] == str(row["records"])
        assert cells[-2:] == [str(row["nan"]), str(row["inf"])]


def test_summary_of_nothing():
    mon = hookstats.Monitor(make_mlp())
    assert mon.summary_rows() == []
    assert "module" in mon.summary()


# ---------------------------------------------------------------------------------------------------------------
# include / exclude, kinds
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("include, exclude, modules", [
    (("2", "4"), (), ["2", "4"]),
    ("*", ("", "1", "3"), ["0", "2", "4"]),
    ("[024]", (), ["0", "2", "4"]),
    ("*", "*", []),
    ("", (), [""]),
])
def test_include_exclude_globs_mlp(include, exclude, modules):
    model = make_mlp()
    mon = hookstats.Monitor(model, include=include, exclude=exclude, kinds=("forward", "backward_pre"))
    assert mon.modules == modules
    cap = Capture(model, ("forward", "backward_pre"), modules)
    train(model, "mlp", 2, mon, cap)
    assert_records_match(mon.records(), cap.items)
    assert {r["module"] for r in mon.records()} == set(modules)


def test_include_exclude_globs_transformer():
    model = make_transformer()
    mon = hookstats.Monitor(model, include="linear*", kinds=("forward",))
    assert mon.modules == ["linear1", "linear2"]
    mon2 = hookstats.Monitor(model, include=["self_attn*", "norm?"], exclude="*.out_proj", kinds=("forward",))
    assert mon2.modules == ["self_attn", "norm1", "norm2"]
    train(model, "transformer", 1, None)
    assert [r["module"] for r in mon.records()] == ["linear1", "linear2"]
    assert [r["module"] for r in mon2.records()] == ["self_attn", "norm1", "norm2"]


def test_grad_kind_globs_match_parameter_names():
    model = make_mlp()
    mon = hookstats.Monitor(model, include="*.weight", exclude="0.*", kinds=("grad",))
    assert mon.modules == []  # no module is named like a parameter
    cap = Capture(model, ("grad",), [], params={"2.weight", "4.weight"})
    train(model, "mlp", 2, mon, cap)
    records = mon.records()
    assert_records_match(records, cap.items)
    assert {r["module"] for r in records} == {"2.weight", "4.weight"}
    assert all(r["index"] == 0 for r in records)


def test_kind_aliases():
    model = make_mlp()
    mon = hookstats.Monitor(model, kinds=("grad_output", "grad_input"))
    assert mon.kinds == ("backward_pre", "backward")
    cap = Capture(model, ("backward_pre", "backward"), all_names(model))
    train(model, "mlp", 2, mon, cap)
    records = mon.records()
    assert {r["kind"] for r in records} == {"backward_pre", "backward"}
    assert_records_match(records, cap.items)


def test_bad_arguments_raise():
    model = make_mlp()
    with pytest.raises(TypeError):
        hookstats.Monitor(lambda x: x)
    with pytest.raises(TypeError):
        hookstats.Monitor(torch.randn(3))
    for kinds in (("forward", "activations"), ("backwards",), ("",)):
        with pytest.raises(ValueError, match="kind"):
            hookstats.Monitor(model, kinds=kinds)
    for every in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError):
            hookstats.Monitor(model, every=every)
    for slots in (0, -4, 2.5):
        with pytest.raises(ValueError):
            hookstats.Monitor(model, slots=slots)
    with pytest.raises(ValueError):
        hookstats.Monitor(model, histogram="log")
    with pytest.raises(ValueError):
        hookstats.Monitor(model, histogram=(8, (1.0, -1.0)))
    with pytest.raises(TypeError):
        hookstats.Monitor(model, histogram=8)
    # a refused Monitor left no hook behind
    assert not any(getattr(m, d) for m in model.modules() for d in HOOK_DICTS)
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# detach, the context manager, the model reference
# ---------------------------------------------------------------------------------------------------------------

def hooks_left(model) -> list:
    left = [f"{n or '<model>'}.{d}" for n, m in model.named_modules() for d in HOOK_DICTS if getattr(m, d)]
    left += [f"{n}._post_accumulate_grad_hooks" for n, p in model.named_parameters() if p._post_accumulate_grad_hooks]
    return left


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_detach_removes_every_hook_and_keeps_records(name):
    model = MAKERS[name]()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    assert len(hooks_left(model)) > 0
    train(model, name, 2, mon)
    mon.detach()  # without a records() first: detach flushes
    assert hooks_left(model) == []
    n = len(mon.records())

    # the same with the capture beside it: the records kept are the right ones, and nothing is added later
    model = MAKERS[name]()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    cap = Capture(model, ALL_KINDS, all_names(model))
    train(model, name, 2, mon, cap)
    mon.detach()
    records = mon.records()
    assert len(records) == n
    assert_records_match(records, cap.items)
    assert mon.skipped == cap.nonfloat
    cap.on = False
    train(model, name, 2, mon)
    assert mon.records() == records


def test_context_manager_leaves_no_hooks():
    model = make_cnn()
    with hookstats.Monitor(model, kinds=ALL_KINDS) as mon:
        # (root + 6 modules) x 3 module hooks (forward_pre; forward, which also hooks grad_output; full backward for
        # grad_input), 6 parameters
        assert len(hooks_left(model)) == 7 * 3 + 6
        train(model, "cnn", 2, mon)
    assert hooks_left(model) == []
    n = len(mon.records())
    assert n > 0
    train(model, "cnn", 1, mon)
    assert len(mon.records()) == n


@pytest.mark.parametrize("how", ["detach", "context"])
def test_model_is_freed_after_detach(how):
    model = make_mlp()
    if how == "detach":
        mon = hookstats.Monitor(model, kinds=ALL_KINDS)
        train(model, "mlp", 2, mon)
        mon.detach()
    else:
        with hookstats.Monitor(model, kinds=ALL_KINDS) as mon:
            train(model, "mlp", 2, mon)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the detached Monitor still holds the model"
    assert len(mon.records()) == 2 * 28  # the records outlive the model


def test_detach_between_forward_and_backward_records_nothing_more():
    """`with Monitor(model) as mon: out = model(x)` and the backward after the block: PyTorch captured the full
    backward hooks when the forward ran, but the Monitor was detached (its hooks removed, its buffers dropped), so
    nothing more may be recorded."""
    model = make_mlp()
    x = inputs_for("mlp", 0)[0]
    with hookstats.Monitor(model, kinds=ALL_KINDS) as mon:
        out = model(x)
    n = len(mon.records())
    assert n == 12  # forward_pre and forward of 6 modules
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(out).backward()
    late = mon.records()[n:]
    assert late == [], f"{len(late)} records after detach: {[(r['module'], r['kind']) for r in late]}"

    # nor after a step() that follows detach (a training loop that keeps calling it)
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    out = model(x)
    mon.detach()
    mon.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(out).backward()
    assert len(mon.records()) == 12


def test_kinds_may_be_a_single_name():
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    with hookstats.Monitor(m, kinds="forward") as mon:
        m(torch.randn(2, 3))
        assert mon.kinds == ("forward",)
        assert sorted((r["module"], r["kind"]) for r in mon.records()) == [("", "forward"), ("0", "forward"),
                                                                         ("1", "forward")]
