"""The internal vocabularies every tool shares: nested hook arguments (hookstats._nested, Note [nested hook arguments]:
the Python walk is the specification, the Monitor's C++ walk and DDP's own must agree with it), hook sites
(hookstats.Site: parsed once at the public edge, the log's labels unchanged) and the argument checks (_checks)."""
from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _find_tensors

import hookstats
from hookstats import Site
from hookstats._nested import first_floating, flatten, rebuild
from hookstats.distributed import after_ddp_allreduce


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: object = None
    ids: torch.Tensor = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: tuple


class ValuesNotADict:
    """Has values() but is no dict: neither DDP nor hookstats walks it."""

    def __init__(self, t):
        self.t = t

    def values(self):
        return [self.t]


class Reversed(collections.OrderedDict):
    """A dict subclass whose values() has its own order: walked in that order."""

    def values(self):
        return list(reversed(list(super().values())))


Pair = collections.namedtuple("Pair", "a b")


def _cases():
    """(name, builder(n) -> nested argument of distinct-size float tensors, an int64 tensor, None and others)."""
    def t(n):
        return torch.arange(float(n)) + 1.0

    return {
        "tensor": lambda: t(3),
        "tuple_none": lambda: (None, t(2), None, t(5)),
        "list_in_tuple": lambda: (t(1), [t(2), (t(3), None)], "text", 7),
        "dict_model_output": lambda: {"loss": t(1), "logits": t(4), "hidden": (t(2), t(3)), "n": 3},
        "ordered_dict": lambda: collections.OrderedDict(z=t(6), ids=torch.arange(4), a=t(2)),
        "dict_subclass_order": lambda: Reversed(first=t(2), second=t(3), third=t(5)),
        "namedtuple": lambda: Pair(t(3), Pair(None, t(2))),
        "structseq": lambda: torch.max(t(6).reshape(2, 3), 0),
        "dataclass": lambda: Out(t(4), aux={"k": t(2), "skip": None}, ids=torch.arange(3)),
        "frozen_dataclass": lambda: Frozen(t(2), (t(3), None, Out(t(5)))),
        "values_not_a_dict": lambda: (t(2), ValuesNotADict(t(3))),
        "deep": lambda: [[[[(t(1), {"x": [t(2), None]})]]], t(3)],
        "empty": lambda: ((), [], {}, None),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpp_walk_agrees_with_the_python_specification(name):
    """The Monitor's C++ hook path (csrc/monitor/monitor_py.cpp, `flatten`) records each floating tensor at its
    position in hookstats._nested.flatten(keep_none=True); non-floating ones are skipped (and counted)."""
    obj = CASES[name]()
    spec = flatten(obj, keep_none=True)
    want = [(i, t.numel(), float(t.sum())) for i, t in enumerate(spec) if t is not None and t.is_floating_point()]
    rec = hookstats.record("m")
    rec.forward(None, (), obj)
    got = [(r["index"], r["stats"]["numel"], r["stats"]["sum"]) for r in rec.records()]
    assert got == want
    assert rec.skipped == sum(1 for t in spec if t is not None and not t.is_floating_point())


@pytest.mark.parametrize("name", sorted(CASES))
def test_walk_finds_what_ddp_finds(name):
    """hookstats watches under DDP the output tensors DDP's reducer watches: dicts by values, dataclasses by fields,
    no other object (one with a values() method included)."""
    obj = CASES[name]()
    ours = flatten(obj)
    theirs = list(_find_tensors(obj))
    assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs))


def test_flatten_keeps_none_as_positions():
    a, b = torch.ones(2), torch.zeros(3)
    assert flatten((None, a, [None, b])) == [a, b]
    got = flatten((None, a, [None, b]), keep_none=True)
    assert got[0] is None and got[1] is a and got[2] is None and got[3] is b


@pytest.mark.parametrize("name", sorted(CASES))
def test_rebuild_replaces_tensors_in_place_of_each(name):
    obj = CASES[name]()
    tensors = flatten(obj)
    if name == "dict_subclass_order":  # values() in another order than keys(): no way back, so refused
        with pytest.raises(TypeError, match="Reversed whose values"):
            rebuild(obj, iter([t * 2 for t in tensors]))
        return
    new = rebuild(obj, iter([t * 2 for t in tensors]))
    assert type(new) is type(obj)
    got = flatten(new)
    assert len(got) == len(tensors) and all(torch.equal(g, t * 2) for g, t in zip(got, tensors))
    assert all(x is y for x, y in zip(flatten(obj), tensors))  # the original untouched


def test_rebuild_keeps_structure_and_copies_dataclasses():
    x = torch.ones(2)
    obj = Frozen(x, (x, None, Out(x, aux="a")))
    new = rebuild(obj, iter([torch.zeros(2)] * 3))
    assert isinstance(new, Frozen) and new is not obj and obj.a is x  # a copy: the frozen original is untouched
    assert new.b[1] is None and new.b[2].aux == "a" and torch.equal(new.b[2].logits, torch.zeros(2))
    m = torch.max(torch.randn(2, 3), 0)
    r = rebuild(m, iter([torch.zeros(3), torch.ones(3, dtype=torch.long)]))
    assert type(r) is type(m) and torch.equal(r.values, torch.zeros(3))
    p = rebuild(Pair(x, [x]), iter([x + 1, x + 2]))
    assert isinstance(p, Pair) and isinstance(p.b, list) and torch.equal(p.b[0], x + 2)


def test_first_floating():
    ids, h = torch.arange(3), torch.ones(2)
    assert first_floating((ids, {"h": h})) is h
    assert first_floating(Out(logits=h)) is h  # dataclass outputs too, as everywhere else
    assert first_floating((ids, None)) is None


@pytest.mark.parametrize("output", ["dataclass", "dict", "values_not_a_dict"])
def test_ddp_end_of_backward_record_follows_ddp_walk(output):
    """after_ddp_allreduce queues its record once per backward that reaches an output tensor DDP itself finds: a
    dataclass output (hookstats' old copy of the walk missed it, so the grads were never recorded) and a dict
    output do; an object that is only values()-like is not walked by DDP, so nothing waits on it."""
    lin = nn.Linear(3, 2)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            y = self.lin(x)
            if output == "dataclass":
                return Out(y)
            if output == "dict":
                return {"y": y}
            return ValuesNotADict(y)

    calls = []
    m = M()
    h = after_ddp_allreduce(m, lambda: calls.append(1))
    out = m(torch.randn(4, 3))
    y = out.logits if output == "dataclass" else out["y"] if output == "dict" else out.t
    y.sum().backward()
    assert calls == ([] if output == "values_not_a_dict" else [1])
    h.remove()


# -- sites ----------------------------------------------------------------------------------------------------------
def test_site_parse_takes_values_aliases_and_sites():
    assert Site.parse("inputs", list(Site), "x") is Site.FORWARD_PRE
    assert Site.parse("grad_output", list(Site), "x") is Site.BACKWARD_PRE
    assert Site.parse(Site.GRAD, [Site.GRAD], "x") is Site.GRAD
    assert Site.parse("forward", [Site.FORWARD], "x") is Site.FORWARD
    with pytest.raises(ValueError, match=r"^on must be a forward site, got 'grads': use one of 'forward_pre', "
                                         r"'forward' \(or an alias: 'inputs' for 'forward_pre', 'outputs' for "
                                         r"'forward'\)$"):
        Site.parse("grads", (Site.FORWARD_PRE, Site.FORWARD), "on must be a forward site, got")
    with pytest.raises(ValueError, match="'backward'"):  # a site, but not one of those accepted
        Site.parse("backward", (Site.FORWARD,), "on")
    with pytest.raises(TypeError, match="on 3: use one of 'forward'"):
        Site.parse(3, (Site.FORWARD,), "on")


def test_site_is_its_log_value():
    assert str(Site.FORWARD) == "forward" and f"{Site.BACKWARD_PRE}" == "backward_pre" and Site.GRAD == "grad"
    assert Site.BACKWARD.record_labels == ("backward:grad_input", "backward:grad_output")
    assert Site.GRAD.record_labels == ("post_accumulate",) and Site.TENSOR.record_labels == ("tensor",)
    assert hookstats.MONITOR_KINDS == ("forward_pre", "forward", "backward_pre", "backward", "grad")
    assert all(type(k) is str for k in hookstats.MONITOR_KINDS)


def test_the_public_edge_parses_sites_once():
    model = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="unknown kind 'tensor': use one of 'forward_pre'"):
        hookstats.Monitor(model, kinds="tensor")  # a hook object's site, not a Monitor kind
    mon = hookstats.Monitor(model, kinds=[Site.FORWARD, "grad_output", "forward"])
    assert mon.kinds == ("forward", "backward_pre") and all(type(k) is str for k in mon.kinds)
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert {type(r["kind"]) for r in mon.records()} == {str}
    assert sorted({r["kind"] for r in mon.records()}) == ["backward_pre", "forward"]
    mon.detach()
    with pytest.raises(ValueError, match=r"channel_stats key must be a forward site, got 'grads'"):
        hookstats.Monitor(model, channel_stats={"grads": -1})
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    cal = hookstats.ChannelCalibrator(model, include="*", on=Site.FORWARD)
    assert cal.on == "outputs" and cal.site is Site.FORWARD
    cal.remove()
    mon = hookstats.Monitor(model, kinds="forward", channel_stats={Site.FORWARD_PRE: -1, "outputs": 0})
    model(torch.randn(2, 3))
    assert set(mon.channel_results()) == {"inputs", "outputs"}
    mon.detach()


def test_record_labels_stay_what_logs_hold():
    lin = nn.Linear(3, 2)
    rec = hookstats.record("lin")
    lin.register_full_backward_hook(rec)
    lin.register_forward_pre_hook(rec.forward_pre)
    lin.register_forward_hook(rec.forward)
    lin.register_full_backward_pre_hook(rec.backward_pre)
    lin.weight.register_post_accumulate_grad_hook(rec.post_accumulate)
    x = torch.randn(4, 3, requires_grad=True)
    y = lin(x)
    y.register_hook(rec.tensor)
    y.sum().backward()
    kinds = [r["kind"] for r in rec.records()]
    assert sorted(set(kinds)) == sorted(["forward_pre", "forward", "tensor", "backward_pre", "backward:grad_input",
                                         "backward:grad_output", "post_accumulate"])
    assert all(type(k) is str for k in kinds)


# -- checks ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: hookstats.fused_clip(-1.0), "hookstats.fused_clip needs max_norm >= 0"),
    (lambda: hookstats.clip_norm_(torch.ones(2), -1.0), "hookstats.clip_norm_ needs max_norm >= 0"),
    (lambda: hookstats.fused_clip(1.0, 0), "hookstats.fused_clip needs norm_type > 0"),
    (lambda: hookstats.norm(torch.ones(2), -2), "hookstats.norm needs norm_type > 0"),
    (lambda: hookstats.fused_clip(1.0, nonfinite="skip"), "hookstats.fused_clip: nonfinite must be one of"),
    (lambda: hookstats.clip_grad_norm_([], 1.0, nonfinite="skip"), "hookstats.clip_grad_norm_: nonfinite must be"),
    (lambda: hookstats.clip_value(3.0, 1.0), r"hookstats.clip_value needs lo <= hi"),
    (lambda: hookstats.clip_value_(torch.ones(2), -1.0), r"hookstats.clip_value_\(v\) clamps to \[-v, v\]"),
    (lambda: hookstats.fused_clip(1.0, eps=math.inf), "hookstats.fused_clip needs a finite eps >= 0"),
])
def test_one_check_words_each_argument_everywhere(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_clip_grads_with_norm_error_names_its_own_switch():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="non-finite") as e:
        hookstats.clip_grads_with_norm_([p], 1.0, torch.tensor(float("inf")), nonfinite="error")
    assert "nonfinite=" in str(e.value) and "error_if_nonfinite" not in str(e.value)
    assert "order nan" not in str(e.value)
    assert torch.equal(p.grad, torch.ones(3))  # refused before any grad is touched


def test_clip_grad_norm_error_names_the_switch_that_was_set():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), float("nan"))
    with pytest.raises(RuntimeError, match="set `error_if_nonfinite=False`"):
        hookstats.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite.*pass nonfinite=\"propagate\"") as e:
        hookstats.clip_grad_norm_([p], 1.0, nonfinite="error")
    assert "error_if_nonfinite" not in str(e.value)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"dict_subclass_order"}))
def test_grad_output_aliases_go_where_the_walk_counts(name):
    """The Monitor's forward hook puts a grad_output alias at a flat index of the C++ walk (None counted):
    hookstats.monitor.hooks.replace_outputs must count the same positions. (A dict subclass whose values() disagree
    with its keys() in order: the next test.)"""
    from hookstats.monitor.hooks import replace_outputs

    n = len(flatten(CASES[name](), keep_none=True))
    for i in range(n):
        obj = CASES[name]()
        if flatten(obj, keep_none=True)[i] is None:
            continue
        marker = torch.full((1,), -7.0)
        unplaced = [0]
        new = replace_outputs(obj, {i: marker}, unplaced)
        assert flatten(new, keep_none=True)[i] is marker and unplaced == [0]


def test_grad_output_alias_in_a_reordered_dict_is_counted_not_misplaced():
    """A dict subclass whose values() are not in the order of its keys(): an alias at the C++ walk's index could not
    go back under the key its tensor came from, so replace_outputs leaves the dict as it is and counts the alias as
    unplaced (Monitor.unrecorded_grad_outputs), never putting it under another key."""
    from hookstats.monitor.hooks import replace_outputs

    obj = CASES["dict_subclass_order"]()
    before = dict(obj.items())
    n = len(flatten(obj, keep_none=True))
    for i in range(n):
        if flatten(obj, keep_none=True)[i] is None:
            continue
        unplaced = [0]
        new = replace_outputs(obj, {i: torch.full((1,), -7.0)}, unplaced)
        assert new is obj and unplaced == [1]
        assert list(obj.keys()) == list(before) and all(obj[k] is v for k, v in before.items())

