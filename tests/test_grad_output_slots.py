"""backward_pre records are PyTorch's grad_output, per output slot (issue #23, section 1; Note [grad_output per
output slot] in csrc/monitor/slots.cpp, Note [grad_output by tensor hooks] in hookstats/monitor/hooks.py).

Each case runs a float64 model with a Monitor and a twin (same weights, same inputs) with PyTorch's
register_full_backward_pre_hook on every module (tests/real_models.PreHookTwin), never both on one model. Gradients
of the monitored model must be bitwise those of a third, unhooked copy.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hookstats
from real_models import OutOfPlace, PreHookTwin, SlotTwin, assert_grads_match, monitor_grads


class IdentityShortcut(nn.Module):
    """A 4-wide residual block whose shortcut is an nn.Identity (ResNets, HF blocks): the Identity's output is its
    input, which the block also feeds to fc."""

    def __init__(self, drop: nn.Module | None = None):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 4)
        self.short = nn.Identity() if drop is None else drop
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        return self.head(torch.sin(self.fc(h)) + self.short(h) * 2.0)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, y


class TwiceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.twice = Twice()

    def forward(self, x):
        a, b = self.twice(x)
        return (a.sin() * 2 + b.square()).sum(1)


class Router(nn.Module):
    """Mixtral's pattern: router logits used for the routing weights and returned (for the aux loss)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        logits = self.gate(x)
        w = logits.softmax(-1)
        out = sum(w[:, i:i + 1] * e(x) for i, e in enumerate(self.experts))
        return out, logits


class RouterNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = Router()

    def forward(self, x):
        out, logits = self.moe(x)
        return out.square().sum(1) + 0.1 * logits.logsumexp(-1).square()


class BiasLayer(nn.Module):
    """T5's pattern: the first layer computes a bias from its parameter and returns it; every layer takes it as a
    keyword argument, uses it and returns it again."""

    def __init__(self, first: bool):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rel = nn.Parameter(torch.randn(4)) if first else None

    def forward(self, x, bias=None):
        if bias is None:
            bias = self.rel * 1.5
        return torch.tanh(self.fc(x) + bias), bias


class BiasNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([BiasLayer(True), BiasLayer(False), BiasLayer(False)])

    def forward(self, x):
        bias = None
        for layer in self.layers:
            x, bias = layer(x, bias=bias)
        return x.square().sum(1)


class ReturnsParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.w


class ParamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = ReturnsParam()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        w = self.p(x)
        return (self.fc(x) * w).sum(1) + w.square().sum()


class InPlaceAfter(nn.Module):
    """In-place ops on module outputs: ReLU(inplace=True) and `x += shortcut` on an nn.Identity's output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Identity()
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        short = x * 1.0
        y = self.drop(self.fc(x))
        y += short  # timm's BasicBlock: `x += shortcut`, then act2 in place
        return self.fc2(self.act(y)).sin().sum(1)


def _block():
    return IdentityShortcut()


def _dropout_eval():
    m = IdentityShortcut(nn.Dropout(0.3))
    m.short.eval()
    return m


CASES = {
    "identity": _block,
    "dropout_eval": _dropout_eval,
    "dropout_p0": lambda: IdentityShortcut(nn.Dropout(0.0)),
    "twice": TwiceNet,
    "router": RouterNet,
    "t5_bias": BiasNet,
    "param": ParamNet,
    "in_place": InPlaceAfter,
}


def _loss(model, x):
    out = model(x)
    return out.sum() if out.dim() else out


def run_monitor(model, xs, **kw):
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"), **kw)
    for x in xs:
        _loss(model, x).backward()
        mon.step()
    recs = mon.records()
    mon.detach()
    return recs, mon


@pytest.mark.parametrize("case", list(CASES))
def test_backward_pre_is_pytorch_grad_output(case):
    torch.manual_seed(0)
    model = CASES[case]().double()
    plain, twin = copy.deepcopy(model), copy.deepcopy(model)
    xs = [torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    recs, _ = run_monitor(model, xs)
    called = {n for n, m in model.named_modules() if not isinstance(m, nn.ModuleList)}
    assert {r["module"] for r in recs if r["kind"] == "backward_pre"} == called  # every module has its record
    pre = PreHookTwin(twin)
    with OutOfPlace():
        for x in xs:
            _loss(twin, x).backward()
    for x in xs:
        _loss(plain, x).backward()
    assert_grads_match(monitor_grads(recs), pre.grads)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), n  # the Monitor changes no gradient bit


def test_the_reported_cases_differ_from_a_tensor_hook():
    # The numbers of the issue, on its 4-wide block: a tensor hook on the Identity's output sees its input's total
    # gradient, the pre-hook the part through the Identity; `return y, y` gives each slot its own part.
    torch.manual_seed(0)
    model = _block().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    recs, _ = run_monitor(model, [x])
    got = monitor_grads(recs)[("short", 0)][0]["l2"]
    h = torch.tanh(model.pre(x)).detach().requires_grad_()
    h_total = torch.autograd.grad(model.head(torch.sin(model.fc(h)) + h * 2.0).sum(), h)[0]
    through = torch.autograd.grad(model.head(torch.sin(model.fc(h.detach())) + h * 2.0).sum(), h)[0]
    assert got == pytest.approx(float(through.norm()), rel=1e-12)
    assert got != pytest.approx(float(h_total.norm()), rel=1e-3)

    model = TwiceNet().double()
    recs, _ = run_monitor(model, [x])
    g = monitor_grads(recs)
    assert g[("twice", 0)][0]["l2"] != pytest.approx(g[("twice", 1)][0]["l2"], rel=1e-3)


@pytest.mark.parametrize("kind", ["param", "leaf_input"])
def test_leaf_outputs_record_once_per_step_and_leave_no_hook(kind):
    torch.manual_seed(0)
    if kind == "param":
        model, x = ParamNet().double(), torch.randn(3, 4, dtype=torch.float64)
        site = ("p", 0)
    else:  # an input tensor reused across steps, passed through an Identity
        model = nn.Sequential(nn.Identity(), nn.Linear(4, 2)).double()
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        site = ("0", 0)
    mon = hookstats.Monitor(model, kinds=("backward_pre",))
    for _ in range(4):
        _loss(model, x).backward()
        mon.step()
    per_step = [sum(1 for r in mon.records() if (r["module"], r["index"]) == site and r["step"] == s)
                for s in range(4)]
    assert per_step == [1, 1, 1, 1]  # not 1, 2, 3, 4: no hook piles up on the leaf
    leaf = model.p.w if kind == "param" else x
    out = model.p(x) if kind == "param" else model[0](x)
    assert out is not leaf and out.grad_fn.name() == "hookstats::SlotGrad"  # an alias carries the record
    assert leaf._backward_hooks is None or len(leaf._backward_hooks) == 0
    mon.detach()
    out = model.p(x) if kind == "param" else model[0](x)
    assert out is leaf  # detached: nothing in the way of the output


def test_exact_outputs_keep_a_tensor_hook_and_their_object():
    # The common case costs nothing new: a Linear's output is its own (newest node, one slot): not replaced.
    lin = nn.Linear(4, 4)
    mon = hookstats.Monitor(lin, kinds=("backward_pre",))
    x = torch.randn(2, 4)
    seen = []
    lin.register_forward_hook(lambda m, a, o: seen.append(o))
    y = lin(x)
    assert y is seen[0] and y.grad_fn.name().startswith("Addmm")
    mon.detach()


def test_dict_outputs_get_their_slots_too():
    # PyTorch's pre-hook does not fire for a dict (it warns); the Monitor records the gradient through each value's
    # slot, as the SlotTwin (a view_as alias per value) does.
    class Dicty(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return {"y": y, "z": y.exp(), "loss": y.square().sum()}

    torch.manual_seed(0)
    model = Dicty().double()
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    mon = hookstats.Monitor(model, kinds=("backward_pre",))
    out = model(x)
    (out["loss"] + out["z"].sum() + out["y"].sin().sum()).backward()
    recs = mon.records()
    mon.detach()
    st = SlotTwin(twin)
    out = twin(x)
    (out["loss"] + out["z"].sum() + out["y"].sin().sum()).backward()
    assert_grads_match(monitor_grads(recs), st.grads)
    assert {k for k in monitor_grads(recs) if k[0] == ""} == {("", 0), ("", 1), ("", 2)}


def test_a_tuple_that_cannot_be_rebuilt_is_counted_not_recorded():
    class Pair(tuple):
        def __new__(cls, a, b):  # cannot be rebuilt from one iterable
            return super().__new__(cls, (a, b))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return Pair(y, y)

    m = M()
    mon = hookstats.Monitor(m, kinds=("backward_pre",))
    a, b = m(torch.randn(2, 4))
    (a.sum() + b.sum()).backward()
    assert [r for r in mon.records() if r["module"] == ""] == []
    assert mon.unrecorded_grad_outputs == 2
    assert "2 backward_pre slot(s) not recorded" in mon.summary()
    mon.detach()


def test_two_monitors_on_one_model_record_the_same_in_the_same_order():
    # The first Monitor's aliases are new outputs to the second; every output of a call that needs an alias gets
    # one, so both see a call's slots in one order.
    torch.manual_seed(0)
    model = RouterNet()
    a = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    b = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    for s in range(2):
        _loss(model, torch.randn(5, 4)).backward()
        a.step()
        b.step()
    ra, rb = a.records(), b.records()
    key = lambda r: (r["step"], r["module"], r["kind"], r["index"], r["stats"]["l2"])  # noqa: E731
    assert [key(r) for r in ra] == [key(r) for r in rb]
    assert any(r["module"] == "moe" and r["index"] == 1 for r in ra)
    a.detach()
    b.detach()
