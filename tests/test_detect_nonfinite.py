"""hookstats.detect_nonfinite (issue #37): the first ATen op output that held a NaN or an Inf, named by step, phase,
op, module and autograd node, on plain modules and on transformers models built with random weights; no report on
finite runs of the real-model matrix; gradients bitwise unchanged with the guard on."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import hookstats
from hookstats.anomaly import NonfiniteGuard

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class SqrtRelu(nn.Module):
    """sqrt(relu(x)): finite forward; the backward of sqrt at the zeros relu makes is 1 / (2 * 0) = inf."""

    def forward(self, x):
        return torch.sqrt(torch.relu(x))


class Block(nn.Module):
    def __init__(self, d: int, act: nn.Module):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = act

    def forward(self, x):
        return self.act(self.fc(x))


def plain_model(act1: nn.Module, dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(8, nn.Tanh()), Block(8, act1)).to(dtype)


def train(model, guard, steps, x, fault=None, opt=None):
    """steps training steps (forward, sum, backward, optimizer, zero_grad); fault(step) runs before each."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=1e-3)
    for s in range(steps):
        if fault is not None:
            fault(s)
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        guard.step()


# -- plain modules ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_log_zero(dtype):
    model = plain_model(Log(), dtype)
    x = torch.rand(4, 8, dtype=dtype)

    def fault(step):
        if step == 2:  # a zero (then negative) pre-activation at row 1, column 3 from step 2 on
            with torch.no_grad():
                model[1].fc.weight[3].zero_()
                model[1].fc.bias[3] = 0.0

    with torch.no_grad():  # every other pre-activation stays positive: log is finite on steps 0 and 1
        model[1].fc.weight.abs_().mul_(0.1)
        model[1].fc.bias.fill_(2.0)
    guard = hookstats.detect_nonfinite(model)
    with guard:
        train(model, guard, 4, x, fault)
    ev = guard.first()
    assert ev is not None
    assert (ev["step"], ev["phase"], ev["op"], ev["module"], ev["node"]) == (2, "forward", "aten::log", "1.act", None)
    assert (ev["nan"], ev["inf"]) == (0, 4)  # log(0) = -inf on the 4 rows of column 3
    assert ev["shape"] == (4, 8) and ev["dtype"] == dtype
    assert ev["index"] == [0, 3] and ev["flat_index"] == 3
    assert ev["inputs_finite"] is True and ev["output"] == 0
    assert "aten::log in 1.act" in str(ev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_sqrt_at_zero(dtype):
    model = plain_model(SqrtRelu(), dtype)
    x = torch.rand(4, 8, dtype=dtype)
    with torch.no_grad():
        model[1].fc.bias.fill_(5.0)  # all pre-activations positive: no zero under the sqrt on steps 0 and 1

    def fault(step):
        if step == 2:
            with torch.no_grad():
                model[1].fc.bias[5] = -1e3  # relu gives 0 in column 5: d sqrt = inf there

    guard = hookstats.detect_nonfinite(model)
    with guard:
        train(model, guard, 3, x, fault)
    ev = guard.first()
    assert ev is not None
    assert (ev["step"], ev["phase"], ev["module"], ev["node"]) == (2, "backward", "1.act", "SqrtBackward0")
    assert ev["op"] == "aten::div"  # SqrtBackward0: grad / (2 * result)
    assert ev["inf"] == 4 and ev["nan"] == 0 and ev["index"] == [0, 5]
    assert ev["inputs_finite"] is True
    # detect_anomaly says nothing on an inf gradient: the contrast the guide shows
    torch.manual_seed(1)


def test_optimizer_phase_names_the_parameter():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e30)
    x = torch.full((3, 4), 1e10)
    guard = hookstats.detect_nonfinite(model)
    with guard:
        model(x).sum().backward()  # grads ~3e10, finite in float32
        opt.step()  # weight - 1e30 * 3e10 = -inf
        guard.step()
    ev = guard.first()
    assert (ev["step"], ev["phase"], ev["module"], ev["node"]) == (0, "optimizer", None, None)
    assert ev["op"] in ("aten::add_", "aten::_foreach_add_")
    assert ev["param"] == "weight" and ev["inf"] == 8


def test_model_inputs_reported_not_finite():
    """A NaN that comes in with the data: the first op that reads it is named, and the report says its input
    already held it."""
    model = plain_model(nn.Tanh())
    x = torch.rand(4, 8)
    x[2, 1] = float("nan")  # made before the guard: no checked op produced it
    guard = hookstats.detect_nonfinite(model)
    with guard:
        model(x)
    ev = guard.first()
    assert (ev["phase"], ev["module"], ev["op"]) == ("forward", "0.fc", "aten::addmm")
    assert ev["inputs_finite"] is False and ev["nonfinite_inputs"] == [1]  # addmm(bias, x, weight.t())
    assert ev["nan"] == 8 and ev["index"] == [2, 0]


def test_finite_run_reports_nothing_and_counts():
    model = plain_model(nn.Tanh())
    guard = hookstats.detect_nonfinite(model)
    with guard:
        train(model, guard, 2, torch.rand(4, 8))
    assert guard.first() is None
    assert guard.checked > 20 and guard.unchecked == 0
    assert guard.current_step == 2


def test_every_n_checks_only_sampled_steps():
    model = plain_model(Log())
    x = torch.rand(4, 8) + 1.0
    with torch.no_grad():
        model[1].fc.weight.abs_().mul_(0.1)
        model[1].fc.bias.fill_(2.0)

    def fault(step):
        with torch.no_grad():
            model[1].fc.bias[0] = -1e3 if step in (1, 4) else 2.0  # a NaN on steps 1 and 4 only

    guard = hookstats.detect_nonfinite(model, every=2)
    with guard:
        train(model, guard, 5, x, fault)
    ev = guard.first()
    assert (ev["step"], ev["op"], ev["module"]) == (4, "aten::log", "1.act")  # step 1 was not checked
    guard1 = hookstats.detect_nonfinite(model, every=2)
    with guard1:
        train(model, guard1, 3, x, fault)
    assert guard1.first() is None


def test_layouts_index_in_logical_order():
    x = torch.rand(2, 3, 4, 5).contiguous(memory_format=torch.channels_last) + 0.5
    x[1, 2, 3, 0] = 0.0
    x[0, 1, 0, 4] = -1.0  # earlier in memory order (channels last) than nothing: logical order decides
    with hookstats.detect_nonfinite() as g:
        y = torch.log(x)  # a channels_last output: dense, read in memory order
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    ev = g.first()
    assert ev["index"] == [0, 1, 0, 4] and (ev["nan"], ev["inf"]) == (1, 1)
    # out= into a strided view: the op wrote a view; read in logical order
    base = torch.ones(4, 10)
    src = torch.rand(4, 5) + 0.5
    src[3, 2] = 0.0
    with hookstats.detect_nonfinite() as g:
        torch.log(src, out=base[:, ::2])
    ev = g.first()
    assert (ev["op"], ev["index"], ev["inf"], ev["shape"]) == ("aten::log", [3, 2], 1, (4, 5))
    # an in-place op on a view
    z = torch.ones(3, 4)
    with hookstats.detect_nonfinite() as g:
        z[:, 1].sub_(1.0).log_()
    ev = g.first()
    assert (ev["op"], ev["index"], ev["inf"]) == ("aten::log_", [0], 3)


def test_first_in_execution_order_and_only_first_kept():
    with hookstats.detect_nonfinite() as g:
        a = torch.log(torch.zeros(3))          # first: -inf
        b = torch.sqrt(-torch.ones(5))         # later: NaN
        g.step()
        c = torch.zeros(2) / 0                 # step 1
    ev = g.first()
    assert (ev["step"], ev["op"], ev["inf"], ev["nan"]) == (0, "aten::log", 3, 0)
    del a, b, c


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode(mode):
    model = plain_model(Log())
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx, hookstats.detect_nonfinite(model) as g:
        model(torch.rand(4, 8)).sum()
        model(-torch.ones(4, 8) * 100)  # log of negatives in 1.act
    ev = g.first()
    assert (ev["phase"], ev["op"], ev["module"], ev["seq"] >= -1) == ("forward", "aten::log", "1.act", True)


def test_backward_on_another_thread():
    model = plain_model(SqrtRelu())
    with torch.no_grad():
        model[1].fc.bias.fill_(5.0)
        model[1].fc.bias[2] = -1e3
    x = torch.rand(4, 8)
    guard = hookstats.detect_nonfinite(model)
    err = []

    def run():
        try:
            model(x).sum().backward()
        except BaseException as e:  # pragma: no cover - reported below
            err.append(e)

    with guard:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert not err
    ev = guard.first()
    assert (ev["phase"], ev["node"], ev["module"], ev["index"]) == ("backward", "SqrtBackward0", "1.act", [0, 2])


def test_grads_bitwise_unchanged():
    model = plain_model(nn.GELU())
    twin = plain_model(nn.GELU())
    x = torch.randn(5, 8)
    model(x).pow(2).sum().backward()
    with hookstats.detect_nonfinite(twin):
        twin(x).pow(2).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32)), n


def test_one_guard_at_a_time_and_errors():
    with hookstats.detect_nonfinite():
        with pytest.raises(RuntimeError, match="another guard is active"):
            hookstats.detect_nonfinite().start()
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        hookstats.detect_nonfinite(every=0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hookstats.detect_nonfinite(object())
    g = hookstats.detect_nonfinite()
    with pytest.raises(RuntimeError, match="outside the guard"):
        g.step()
    # after exit nothing is observed any more
    with g:
        pass
    torch.log(torch.zeros(2))
    assert g.first() is None
    assert isinstance(g, NonfiniteGuard)


def test_module_hooks_removed_on_exit():
    model = plain_model(nn.Tanh())
    n_pre = sum(len(m._forward_pre_hooks) for m in model.modules())
    with hookstats.detect_nonfinite(model):
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) == n_pre + len(list(model.modules()))
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == n_pre


def test_torch_compile_does_not_crash():
    """Under torch.compile only ops that go through the ATen dispatcher are checked (eager regions, graph breaks,
    extern kernels); compilation itself (fake tensors) is never read. The compiled result is unchanged and an eager
    fault afterwards is still found."""
    model = plain_model(nn.Tanh())
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.rand(4, 8)
    want = model(x)
    guard = hookstats.detect_nonfinite(model)
    with guard:
        got = compiled(x)
        torch.log(torch.zeros(1))
    assert torch.equal(got, want)
    ev = guard.first()
    assert ev["op"] == "aten::log" and ev["phase"] == "forward"


# -- transformers models ---------------------------------------------------------------------------------------------
def _real(name: str, layers: int = 2):
    pytest.importorskip("transformers")
    from real_models import build

    return build(name, layers=layers)


@pytest.mark.parametrize("name,proj,op", [("gpt2", "transformer.h.1.attn.c_attn", "aten::addmm"),
                                          ("llama", "model.layers.1.self_attn.q_proj", "aten::mm")])
def test_hf_nan_in_one_head(name, proj, op):
    """A NaN weight feeding one attention head's query (column 8: head 1 of 4, head size 8) from step 1: the first
    non-finite output is that projection's matmul, whose weight input already held the NaN."""
    rm = _real(name)
    model = rm.model
    mod = model.get_submodule(proj)

    def fault(step):
        if step == 1:  # written through numpy, as a corrupt checkpoint or a bad all-reduce would: no ATen op made it
            w = mod.weight.detach().numpy()
            if name == "gpt2":  # HF Conv1D: weight [in, out]
                w[:, 8] = float("nan")
            else:  # nn.Linear: weight [out, in]
                w[8, :] = float("nan")

    guard = hookstats.detect_nonfinite(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with guard:
        for s in range(3):
            fault(s)
            rm.step_loss(model, s).backward()
            opt.step()
            opt.zero_grad()
            guard.step()
    ev = guard.first()
    assert ev is not None, guard.checked
    assert (ev["step"], ev["phase"], ev["op"], ev["module"], ev["node"]) == (1, "forward", op, proj, None)
    assert ev["index"] == [0, 8] and ev["nan"] == 16  # batch 2 x 8 tokens, one column
    assert ev["inputs_finite"] is False


@pytest.mark.parametrize("name,act", [("gpt2", "transformer.h.1.mlp.act"), ("llama", "model.layers.0.mlp.act_fn")])
def test_hf_inf_gradient(name, act):
    """The MLP activation replaced by sqrt(relu(x)): finite forward, an inf gradient from SqrtBackward0 at the
    zeros, named with the module whose forward made the node."""
    rm = _real(name)
    model = rm.model
    parent, _, leaf = act.rpartition(".")
    setattr(model.get_submodule(parent), leaf, SqrtRelu())
    guard = hookstats.detect_nonfinite(model)
    with guard:
        rm.step_loss(model, 0).backward()
        guard.step()
    ev = guard.first()
    assert ev is not None
    assert (ev["step"], ev["phase"], ev["op"], ev["module"], ev["node"]) == (0, "backward", "aten::div", act,
                                                                            "SqrtBackward0")
    assert ev["inf"] > 0 and ev["inputs_finite"] is True  # (0 / (2 * 0) where the incoming gradient is 0: NaN)


MATRIX = ["gpt2", "llama", "bert", "t5", "mixtral", "resnet18", "convnext_atto"]


@pytest.mark.parametrize("name", MATRIX)
def test_real_models_finite_no_report(name):
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    from real_models import build, twin

    rm = build(name)
    plain = twin(rm)
    opt = torch.optim.AdamW(rm.model.parameters(), lr=1e-3)
    guard = hookstats.detect_nonfinite(rm.model)
    with guard:
        for s in range(2):
            rm.step_loss(rm.model, s).backward()
            opt.step()
            opt.zero_grad()
            guard.step()
    ev = guard.first()
    if name == "t5":  # its relative position buckets take log(0) = -inf on purpose: named, exactly
        assert (ev["step"], ev["phase"], ev["op"], ev["module"]) == (0, "forward", "aten::log",
                                                                     "encoder.block.0.layer.0.SelfAttention")
        assert ev["nan"] == 0 and ev["inf"] > 0 and ev["inputs_finite"] is True
    else:
        assert ev is None
    assert guard.checked > 100 and guard.unchecked == 0
    # grads bitwise the same as the unguarded twin's (one step from the same weights)
    rm2 = build(name)
    rm2.step_loss(rm2.model, 0).backward()
    with hookstats.detect_nonfinite(plain.model):
        plain.step_loss(plain.model, 0).backward()
    for (n, p), (_, q) in zip(rm2.model.named_parameters(), plain.model.named_parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not hookstats.cuda_kernels_built(), reason="needs CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_forward_and_backward(dtype):
    model = plain_model(SqrtRelu(), dtype).cuda()
    x = torch.rand(4, 8, device="cuda", dtype=dtype)
    with torch.no_grad():
        model[1].fc.bias.fill_(5.0)
        model[1].fc.bias[5] = -1e3
    guard = hookstats.detect_nonfinite(model)
    with guard:
        model(x).float().sum().backward()
        guard.step()
        torch.log(torch.zeros(3, device="cuda"))
    ev = guard.first()
    assert (ev["step"], ev["phase"], ev["module"], ev["node"], ev["index"]) == (0, "backward", "1.act",
                                                                                "SqrtBackward0", [0, 5])
    assert ev["device"].startswith("cuda") and guard.unchecked == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not hookstats.cuda_kernels_built(), reason="needs CUDA kernels")
def test_cuda_graph_replays_count_steps():
    """Captured checks read the step from the device: a fault in the 3rd replay reports step 2."""
    torch.cuda.init()
    x = torch.ones(16, device="cuda")
    guard = hookstats.detect_nonfinite()
    with guard:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = torch.log(x)  # warm-up (finite)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = torch.log(x)
            guard.step()
        for i in range(4):
            if i == 2:
                x[3] = 0.0
            graph.replay()
    ev = guard.first()
    assert (ev["step"], ev["op"], ev["index"], ev["inf"]) == (2, "aten::log", [3], 1)


class MaskedAttention(nn.Module):
    """nanoGPT's causal mask: masked_fill(-inf) before the softmax, whose output is finite again."""

    def forward(self, q, k):
        att = q @ k.transpose(-2, -1)
        mask = torch.ones(att.shape[-2:], dtype=torch.bool).tril()
        return torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)


def test_intended_infinities():
    """An op told to make an Inf (masked_fill(-inf), full(nan)) is not an origin; a consumer that reads it is named,
    with its inputs not finite. ignore_ops leaves out an op (and everything it runs) by name."""
    model = MaskedAttention()
    q, k = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    with hookstats.detect_nonfinite(model) as g:
        y = model(q, k)  # softmax turns the -inf into zeros
        z = torch.full((3,), float("nan"))
    assert g.first() is None and torch.isfinite(y).all()
    with hookstats.detect_nonfinite(model) as g:
        w = z + 1.0
    ev = g.first()
    assert (ev["op"], ev["nan"], ev["inputs_finite"], ev["nonfinite_inputs"]) == ("aten::add", 3, False, [0])
    rm = _real("t5")
    with hookstats.detect_nonfinite(rm.model, ignore_ops=["aten::log"]) as g:
        rm.step_loss(rm.model, 0)
    ev = g.first()  # the -inf of log(0) is now first seen in the division that reads it
    assert (ev["op"], ev["module"], ev["inputs_finite"]) == ("aten::div", "encoder.block.0.layer.0.SelfAttention",
                                                             False)
    with pytest.raises(TypeError, match="ignore_ops takes a list of op names"):
        hookstats.detect_nonfinite(ignore_ops="aten::log")
    del w


# -- the Monitor feature -----------------------------------------------------------------------------------------
def test_monitor_nonfinite_ops(tmp_path):
    model = plain_model(Log())
    x = torch.rand(4, 8)
    with torch.no_grad():
        model[1].fc.weight.abs_().mul_(0.1)
        model[1].fc.bias.fill_(2.0)
    log = tmp_path / "run.jsonl"
    mon = hookstats.Monitor(model, nonfinite_ops=True, start_step=10, flush_every=1,
                            exporters=[hookstats.export.JSONLWriter(log)])
    try:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for s in range(3):
            if s == 2:
                model[1].fc.bias.detach().numpy()[6] = -1e3  # a negative pre-activation: log gives NaN
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        ev = mon.feature("nonfinite_ops").first()
        assert (ev["step"], ev["phase"], ev["op"], ev["module"], ev["rank"]) == (12, "forward", "aten::log", "1.act",
                                                                                0)
        assert ev["nan"] == 4 and ev["index"] == [0, 6]
        rec = mon.first_nonfinite()  # the Monitor's own module-level record agrees on step and module
        assert (rec["step"], rec["module"]) == (12, "1.act")
        assert rec["origin"] == ev and "began at step 12, forward: aten::log in 1.act" in str(rec)
        assert "aten::log in 1.act" in mon.summary()
    finally:
        mon.detach()
    assert mon.feature("nonfinite_ops").first()["op"] == "aten::log"  # still readable after detach
    found = {(s["step"], s["value"] > 0) for s in hookstats.runlog.read_run(log).scalars
             if s["tag"] == "nonfinite_ops/found"}
    assert found == {(10, False), (11, False), (12, True)}


def test_monitor_first_nonfinite_is_the_origin_when_no_record_holds_it():
    """A NaN made in the optimizer step reaches no monitored tensor in that step: first_nonfinite() is the op."""
    model = plain_model(nn.Tanh())
    mon = hookstats.Monitor(model, nonfinite_ops=True, kinds=("forward",))
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)  # zero grads: 0 / (sqrt(0) + 0) in the step
        (model(torch.ones(2, 8)).sum() * 0).backward()
        opt.step()
        ev = mon.first_nonfinite()
        assert ev is not None and ev["phase"] == "optimizer" and ev["step"] == 0
        assert "origin" not in ev
    finally:
        mon.detach()


def test_monitor_nonfinite_ops_every_and_failed_construction():
    model = plain_model(nn.Tanh())
    mon = hookstats.Monitor(model, nonfinite_ops=True, every=2)
    assert mon.feature("nonfinite_ops")._guard.every == 2
    mon.detach()
    with hookstats.detect_nonfinite():  # the observer is taken: the Monitor is refused, and leaves nothing behind
        with pytest.raises(RuntimeError, match="another guard is active"):
            hookstats.Monitor(model, nonfinite_ops=True)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    with pytest.raises(TypeError, match="nonfinite_ops must be True or False"):
        hookstats.Monitor(model, nonfinite_ops=1)


# -- the check itself ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 4097, (1 << 18) + 33])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "strided"])
def test_counts_and_first_index_match_torch(dtype, n, layout):
    """Counts and the first index against torch.isnan / isinf, over the formats' special values (max, subnormals,
    -0) around the non-finite ones, past a scan block (4,096) and the parallel threshold (2^18)."""
    g = torch.Generator().manual_seed(n)
    fi = torch.finfo(dtype)
    x = torch.randn(n, generator=g).to(dtype)
    specials = torch.tensor([fi.max, -fi.max, fi.tiny, fi.tiny / 4, -0.0], dtype=torch.float64).to(dtype)
    pos = torch.randint(0, n, (min(n, 5),), generator=g)
    x[pos] = specials[:len(pos)]
    if n > 1:
        bad = torch.randint(n // 2, n, (3,), generator=g)
        x[bad[0]], x[bad[1]], x[bad[2]] = float("inf"), float("nan"), float("-inf")
    else:
        x[0] = float("nan")
    if layout == "permuted":
        x = x.reshape(1, n).expand(2, n).clone().t()  # dense, column-major: read in memory order
    elif layout == "strided":
        x = x.repeat_interleave(2)[::2]  # a step of 2
    want_nan, want_inf = int(x.isnan().sum()), int(x.isinf().sum())
    want_first = int((~x.isfinite()).flatten().nonzero()[0])
    with hookstats.detect_nonfinite() as guard:
        if layout == "strided":  # written through out= into a view with a step: read in logical order
            y = torch.mul(x, 1, out=torch.zeros(2 * n, dtype=dtype)[::2])
            assert y.stride() == (2,)
        else:
            y = torch.mul(x, 1)  # keeps x's layout
    ev = guard.first()
    assert (ev["nan"], ev["inf"], ev["flat_index"]) == (want_nan, want_inf, want_first)
    assert ev["dtype"] == dtype and ev["shape"] == tuple(y.shape)
    del y


def test_monitor_nonfinite_ops_names_the_rank(tmp_path):
    """With a process group (one gloo rank here; tests/test_distributed.py runs two for the Monitor's records) the
    record carries the rank, and first(across_ranks=True) gathers every rank's."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = plain_model(Log())
        mon = hookstats.Monitor(model, nonfinite_ops=True, process_group=True)
        try:
            model(-torch.ones(2, 8) * 100)
            mon.step()
            local = mon.feature("nonfinite_ops").first()
            both = mon.feature("nonfinite_ops").first(across_ranks=True)
        finally:
            mon.detach()
        assert (local["rank"], local["op"], local["module"]) == (0, "aten::log", "1.act")
        assert dict(both) == dict(local)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("writer", ["jsonl", "parquet"])
def test_monitor_nonfinite_op_reaches_the_run_log(tmp_path, writer):
    """The op detail is in the run log too: the writers' end(info) at detach(), read back as info["end"]."""
    pytest.importorskip("pyarrow")
    model = plain_model(nn.Tanh())
    path = tmp_path / ("log.jsonl" if writer == "jsonl" else "log.parquet")
    w = hookstats.runlog.JSONLWriter(path) if writer == "jsonl" else hookstats.runlog.ParquetWriter(path)
    mon = hookstats.Monitor(model, nonfinite_ops=True, flush_every=1, exporters=[w])
    x = torch.ones(2, 8)
    model(x).sum().backward()
    mon.step()
    x[0, 3] = float("nan")
    model(x).sum().backward()
    mon.step()
    ev = mon.feature("nonfinite_ops").first()
    mon.detach()
    end = hookstats.runlog.read_run(path).info["end"]["nonfinite_op"]
    assert ev is not None and end is not None
    assert (end["step"], end["phase"], end["op"], end["module"]) == (ev["step"], ev["phase"], ev["op"], ev["module"])
    assert end["step"] == 1 and end["dtype"] == str(ev["dtype"])
    # a resume of that run continues the log (the old run's "end" is no difference), and reports its own end
    w2 = hookstats.runlog.JSONLWriter(path) if writer == "jsonl" else hookstats.runlog.ParquetWriter(path)
    model.zero_grad(set_to_none=True)  # the NaN batch's grads would be summed into (an add_ of a NaN: reported)
    mon = hookstats.Monitor(model, nonfinite_ops=True, flush_every=1, start_step=2, exporters=[w2])
    model(torch.ones(2, 8)).sum().backward()
    mon.step()
    mon.detach()
    assert hookstats.runlog.read_run(path).info["end"]["nonfinite_op"] is None


def test_monitor_finite_run_logs_no_nonfinite_op(tmp_path):
    model = plain_model(nn.Tanh())
    mon = hookstats.Monitor(model, nonfinite_ops=True, exporters=[hookstats.runlog.JSONLWriter(tmp_path / "l.jsonl")])
    model(torch.ones(2, 8)).sum().backward()
    mon.step()
    mon.detach()
    assert hookstats.runlog.read_run(tmp_path / "l.jsonl").info["end"] == {"nonfinite_op": None,
                                                                        "time": pytest.approx(time.time(), abs=60)}


def test_model_saved_and_copied_under_a_guard_carries_no_hook(tmp_path):
    import copy

    model = plain_model(nn.Tanh())
    with hookstats.detect_nonfinite(model):
        torch.save(model, tmp_path / "m.pt")
        twin = copy.deepcopy(model)
    for m in (torch.load(tmp_path / "m.pt", weights_only=False), twin, model):
        assert sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules()) == 0
