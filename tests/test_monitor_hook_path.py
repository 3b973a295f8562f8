"""The Monitor's hook path without a forward pre-hook where a module's outputs are known (issue #36; Note
[grad_output per output slot] in csrc/monitor/slots.cpp, module_outputs in hookstats/monitor/hooks.py): which modules
get one, that the records stay PyTorch's grad_output where the call's start is not taken, and that several Monitors
on one model each record what one alone records."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import hookstats
from real_models import SlotTwin, assert_grads_match, monitor_grads


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2.0


class MyLinear(nn.Linear):  # a subclass that overrides forward: its forward is its own
    def forward(self, x):
        return super().forward(x) + 1.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.0)
        self.drop_inplace = nn.Dropout(0.5, inplace=True)
        self.short = nn.Identity()
        self.custom = Custom()
        self.mine = MyLinear(4, 4)

    def forward(self, x):
        h = self.act(self.fc(x))
        y = self.drop(h) + self.short(input=h) * 3.0  # Identity by keyword: its hook does not see the input
        z = self.drop_inplace(self.custom(y) * 1.0)
        return (self.mine(z).sin() + self.short(h)).sum(1)


def test_pre_hooks_only_where_the_start_is_needed():
    model = Net()
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    pre = {n: len(m._forward_pre_hooks) for n, m in model.named_modules()}
    assert pre == {"": 1, "fc": 0, "act": 0, "drop": 0, "drop_inplace": 1, "short": 0, "custom": 1, "custom.fc": 0,
                   "mine": 1}
    mon.detach()
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    mon = hookstats.Monitor(model, kinds=("forward",))  # no grad_output: no start needed anywhere
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    mon.detach()


def test_records_without_a_start_are_pytorch_grad_output():
    torch.manual_seed(0)
    model = Net().double()
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    xs = [torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    for s, x in enumerate(xs):
        torch.manual_seed(100 + s)  # the same dropout masks in every copy
        model(x).sum().backward()
        mon.step()
    recs = mon.records()
    mon.detach()
    st = SlotTwin(twin)
    for s, x in enumerate(xs):
        torch.manual_seed(100 + s)
        twin(x).sum().backward()
        torch.manual_seed(100 + s)
        plain(x).sum().backward()
    assert_grads_match(monitor_grads(recs), st.grads)
    assert {k for k in monitor_grads(recs) if k[0] == "short"} == {("short", 0)}
    assert len(monitor_grads(recs)[("short", 0)]) == 4  # two calls a step (by keyword and positional), two steps
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        # h has four consumers, three through aliases: their sum may round in another grouping (Note [grad_output
        # by tensor hooks]), as it did before with a pre-hook; nothing more
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=0, msg=n)


def test_known_modules_keep_their_output_object():
    # A Linear's and a ReLU's outputs are exact with no start: tensor hooks, the output objects unchanged.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    mon = hookstats.Monitor(model, kinds=("backward_pre",))
    seen = []
    for m in model:
        m.register_forward_hook(lambda mod, a, o: seen.append(o))
    y = model(torch.randn(2, 4))
    assert y is seen[1] and seen[0].grad_fn.name().startswith("Addmm") and y.grad_fn.name().startswith("Relu")
    y.sum().backward()
    assert {(r["module"], r["index"]) for r in mon.records()} == {("", 0), ("0", 0), ("1", 0)}
    mon.detach()


class Net2(nn.Module):  # the root returns its last Linear's output: one node fills two modules' slots
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)))


def _records_of(make, n_monitors: int, x: torch.Tensor) -> list:
    torch.manual_seed(0)
    net = make().double()
    mons = [hookstats.Monitor(net, kinds=("forward", "backward_pre")) for _ in range(n_monitors)]
    for _ in range(2):
        torch.manual_seed(7)  # the same dropout masks for every count of Monitors
        net(x).sum().backward()
        for m in mons:
            m.step()
    out = [[(r["step"], r["module"], r["kind"], r["index"], r["stats"]["sum"]) for r in m.records()] for m in mons]
    for m in mons:
        m.detach()
    return out


@pytest.mark.parametrize("make", [Net, Net2], ids=["aliases", "shared_node"])
def test_each_of_several_monitors_records_what_one_alone_records(make):
    """Monitors interleave their hooks (A's pre-hook, B's, ..., A's forward hook, B's): each takes back its own
    call's start (csrc/monitor/slots.cpp), so each records what a Monitor alone records, in the same order, whether
    the thread has made autograd nodes before or not (a fresh thread's sequence numbers start at 0)."""
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (alone,) = _records_of(make, 1, x)
    assert _records_of(make, 2, x) == [alone, alone]
    assert _records_of(make, 3, x) == [alone, alone, alone]
    if make is Net2:  # the child's record first, then the container's (Note [grad_output by tensor hooks])
        assert [r[1] for r in alone if r[2] == "backward_pre" and r[0] == 0] == ["out", "", "lin"]
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(_records_of(make, 2, x)))
    t.start()
    t.join()
    assert fresh == [[alone, alone]]
