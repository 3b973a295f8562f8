"""A monitored model through a run's life between steps (issue #32): saved whole, deep-copied (EMA, teacher), run with
activation checkpointing, and the errors of the edge cases (kinds=None, a tensor max_norm, nested and meta tensors,
a dataclass output). Each test compares with a twin: the same model without the Monitor's hooks, or without
checkpointing."""
from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookstats

import real_models

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_KINDS = ("forward_pre", "forward", "backward_pre", "backward", "grad")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _hook_count(model: nn.Module) -> int:
    return sum(len(getattr(m, d)) for m in model.modules() for d in _HOOK_DICTS)


def _step(model: nn.Module, seed: int = 1) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()


def _sites(records: list) -> list:
    return [(r["step"], r["module"], r["kind"], r["index"], r["stats"]["l2"]) for r in records]


# -- item 1: torch.save / pickle of a monitored model ------------------------------------------------------------------
def test_torch_save_of_monitored_model_keeps_file_and_loads_without_hooks(tmp_path):
    model = _mlp()
    path = tmp_path / "model.pt"
    torch.save(model, path)  # a checkpoint already on disk, as a training loop leaves one
    before = path.read_bytes()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS, channel_stats={"inputs": -1})
    _step(model)
    torch.save(model, path)  # used to raise after truncating the file
    data = path.read_bytes()
    assert b"hookstats" not in data  # nothing of hookstats in the pickle: it loads where hookstats is not installed
    assert len(data) >= len(before) - 64
    loaded = torch.load(path, weights_only=False)
    assert _hook_count(loaded) == 0
    assert "__getstate__" not in vars(loaded[0])
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    n = len(mon.records())
    _step(loaded)  # the loaded model records nothing anywhere
    assert len(mon.records()) == n
    _step(model)  # the original keeps recording
    assert len(mon.records()) > n
    mon.detach()
    assert _hook_count(model) == 0 and "__getstate__" not in vars(model[0])


def test_saved_model_loads_in_a_process_without_hookstats(tmp_path):
    model = _mlp()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    torch.save(model, tmp_path / "m.pt")
    mon.detach()
    code = textwrap.dedent(f"""
        import sys
        sys.modules["hookstats"] = None  # import hookstats fails here
        import torch
        m = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
        m(torch.randn(2, 4)).sum().backward()
        print(sum(len(getattr(x, d)) for x in m.modules() for d in {_HOOK_DICTS!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_pickle_and_shallow_copy_of_monitored_model():
    model = _mlp()
    model[0].register_forward_hook(_UserHook([]))  # the user's own hook stays with the copy
    mon = hookstats.Monitor(model, kinds=("forward", "backward"))
    clone = pickle.loads(pickle.dumps(model))
    hooks = [h for m in clone.modules() for h in m._forward_hooks.values()]
    assert len(hooks) == 1 and isinstance(hooks[0], _UserHook)
    n = len(mon.records())
    clone(torch.randn(2, 4))
    assert len(mon.records()) == n
    # A shallow copy shares the layers (and so their hooks, which record under the layers' names), not the root's.
    shallow = copy.copy(model)
    assert len(shallow._forward_hooks) == 0 and shallow[0] is model[0]
    shallow(torch.randn(2, 4))
    assert sorted({r["module"] for r in mon.records()[n:]}) == ["0", "1", "2"]
    mon.detach()
    assert _hook_count(model) == 1  # the user's


class _UserHook:
    def __init__(self, calls):
        self.calls = calls

    def __call__(self, module, args, output):
        self.calls.append(1)


class _OwnState(nn.Module):
    """A module with its own __getstate__ (as LightningModule drops its trainer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.trainer = object()

    def __getstate__(self):
        state = super().__getstate__()
        state["trainer"] = None
        return state

    def forward(self, x):
        return self.lin(x)


def test_class_getstate_is_kept():
    torch.manual_seed(0)
    model = _OwnState()
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    clone = pickle.loads(pickle.dumps(model))
    assert clone.trainer is None and model.trainer is not None
    assert _hook_count(clone) == 0
    mon.detach()


# -- item 2: deep copies (EMA / teacher) -------------------------------------------------------------------------------
def test_deepcopy_does_not_record_into_the_original():
    model = _mlp()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    ema = copy.deepcopy(model)
    assert _hook_count(ema) == 0 and "__getstate__" not in vars(ema[0])
    twin = _mlp()  # the same model, never monitored: what one step must record
    mon_twin = hookstats.Monitor(twin, kinds=ALL_KINDS)
    _step(model)
    _step(ema, seed=7)  # other inputs: a record from it would differ
    with torch.no_grad():
        ema(torch.randn(5, 4) * 100)
    _step(twin)
    mon.step()
    mon_twin.step()
    assert _sites(mon.records()) == _sites(mon_twin.records())
    mon.detach()
    mon_twin.detach()
    assert _hook_count(model) == 0 and _hook_count(ema) == 0


def test_deepcopy_of_model_with_channel_calibrator_and_per_sample():
    model = _mlp()
    mon = hookstats.Monitor(model, channel_stats={"inputs": -1}, per_sample=True)
    cal = hookstats.ChannelCalibrator(model, include="*")
    teacher = copy.deepcopy(model)
    assert _hook_count(teacher) == 0
    _step(teacher)
    assert cal.calls == {} and mon.feature_results()["channel_stats"] == {"inputs": {}}
    _step(model)
    assert set(cal.calls) == {"", "0", "1", "2"}
    cal.remove()
    mon.detach()
    assert _hook_count(model) == 0


# -- item 3: activation checkpointing ---------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.norm(self.lin(x)))


class _Stack(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


def _run(model, mon, steps=2):
    for s in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s), requires_grad=True)
        model(x).square().sum().backward()
        mon.step()
    return mon.records()


def _by_site(records):
    return [(r["step"], r["module"], r["kind"], r["index"], r["dtype"]) for r in records]


def _assert_same_records(got, want, kinds_exact=("forward", "forward_pre")):
    key = lambda r: (r["step"], r["module"], r["kind"], r["index"])  # noqa: E731
    got, want = sorted(got, key=key), sorted(want, key=key)
    assert [key(r) for r in got] == [key(r) for r in want]
    for g, w in zip(got, want):
        for f, v in w["stats"].items():
            if v != v:  # NaN (the variance of one element)
                assert g["stats"][f] != g["stats"][f], (key(g), f)
            elif g["kind"] in kinds_exact:
                assert g["stats"][f] == v, (key(g), f)
            elif f == "zero_count":  # a gradient that is 0 in exact arithmetic (a key bias's) may round to +-1e-9
                continue
            else:  # a sum that cancels is compared at the scale of its terms
                scale = {"sum": w["stats"]["l1"], "mean": w["stats"]["l1"] / max(w["stats"]["numel"], 1)}.get(f, 0.0)
                assert g["stats"][f] == pytest.approx(v, rel=1e-5, abs=1e-7 + 1e-6 * scale), (key(g), f)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_records_each_forward_once(reentrant):
    plain, ck = _Stack(None), _Stack(reentrant)
    ck.load_state_dict(plain.state_dict())
    kinds = ("forward_pre", "forward", "backward_pre", "backward", "grad")
    m_plain = hookstats.Monitor(plain, kinds=kinds)
    m_ck = hookstats.Monitor(ck, kinds=kinds)
    want, got = _run(plain, m_plain), _run(ck, m_ck)
    assert len([r for r in got if r["kind"] == "forward"]) == 2 * 14  # 3 x (block, lin, norm, act), head, root
    _assert_same_records(got, want)
    for p, q in zip(plain.parameters(), ck.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert "forward" in m_ck.summary()
    m_plain.detach()
    m_ck.detach()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_channel_calibrator_counts_each_call_once(reentrant):
    plain, ck = _Stack(None), _Stack(reentrant)
    ck.load_state_dict(plain.state_dict())
    cals = [hookstats.ChannelCalibrator(m, include="*lin*") for m in (plain, ck)]
    for m in (plain, ck):
        m(torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))).sum().backward()
    assert cals[0].calls == cals[1].calls == {f"blocks.{i}.lin": 1 for i in range(3)}
    for name, st in cals[0].results().items():
        assert torch.equal(st.absmax, cals[1].results()[name].absmax)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_record_hook_forms_record_once(reentrant):
    plain, ck = _Stack(None), _Stack(reentrant)
    ck.load_state_dict(plain.state_dict())
    recs = []
    for m in (plain, ck):
        rec = hookstats.record("lin")
        for b in m.blocks:
            b.lin.register_forward_hook(rec.forward)
            b.lin.register_forward_pre_hook(rec.forward_pre)
        m(torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))).sum().backward()
        recs.append(rec.records())
    assert [(r["kind"], r["stats"]["l2"]) for r in recs[1]] == [(r["kind"], r["stats"]["l2"]) for r in recs[0]]
    assert len(recs[0]) == 6


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_clip_forward_form_still_runs_in_the_recompute(reentrant):
    """A hook that changes the output must run again in the recompute (the recomputed values must be the first
    forward's): only recording hooks skip it."""
    plain, ck = _Stack(None), _Stack(reentrant)
    ck.load_state_dict(plain.state_dict())
    for m in (plain, ck):
        for b in m.blocks:
            b.lin.register_forward_hook(hookstats.fused_clip(0.5).forward)
        m(torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))).square().sum().backward()
    for p, q in zip(plain.parameters(), ck.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gpt2_gradient_checkpointing_records_like_without(reentrant):
    pytest.importorskip("transformers")
    rm = real_models.build("gpt2")
    twin = real_models.twin(rm)
    rm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert rm.model.is_gradient_checkpointing and rm.model.training
    kinds = ("forward", "backward_pre", "grad")
    mons = [hookstats.Monitor(m.model, kinds=kinds) for m in (twin, rm)]
    for m, mon in zip((twin, rm), mons):
        for s in range(2):
            m.step_loss(m.model, seed=s).backward()
            mon.step()
    want, got = (mon.records() for mon in mons)
    n_fwd = len([r for r in want if r["kind"] == "forward"])
    assert len([r for r in got if r["kind"] == "forward"]) == n_fwd
    _assert_same_records(got, want, kinds_exact=())  # the checkpointed forward may round differently
    for mon in mons:
        mon.detach()


# -- item 10: errors at the call, or recorded / counted ----------------------------------------------------------------
@pytest.mark.parametrize("option", ["kinds", "include", "exclude"])
def test_none_selection_options_mean_their_default(option):
    model = _mlp()
    mon = hookstats.Monitor(model, **{option: None})
    default = hookstats.Monitor(_mlp())
    assert mon.config.kinds == default.config.kinds
    assert mon.modules == default.modules
    _step(model)
    assert len(mon.records()) == 2 * len(default.modules)
    mon.detach()
    default.detach()


@pytest.mark.parametrize("option,value", [("kinds", 3), ("include", 5), ("exclude", [None])])
def test_bad_selection_options_are_named(option, value):
    with pytest.raises(TypeError, match=f"hookstats.Monitor: {option} must be"):
        hookstats.Monitor(_mlp(), **{option: value})


def test_fused_clip_with_a_tensor_bound():
    with pytest.raises(TypeError, match=r"max_norm must be a number or a one-element tensor, got a tensor of shape"):
        hookstats.fused_clip(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="max_norm must be a number"):
        hookstats.fused_clip("1.0")
    hookstats.fused_clip(torch.tensor(1.0))  # one element: fine


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensor_is_refused_by_name(layout):
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)
    with pytest.raises(TypeError, match="does not take a nested tensor"):
        hookstats.stats(nt)


def test_meta_model_is_refused_and_meta_forward_is_counted():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device.*to_empty"):
        hookstats.Monitor(meta)
    assert _hook_count(meta) == 0
    model = nn.Sequential(nn.ReLU(), nn.Tanh())  # no parameters: a meta forward runs
    mon = hookstats.Monitor(model, kinds=("forward",))
    model(torch.randn(3, 2, device="meta"))
    assert mon.records() == [] and mon.skipped == 3  # the outputs of ReLU, Tanh and the model
    model(torch.randn(3, 2))
    assert len(mon.records()) == 3
    mon.detach()


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    ids: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _FrozenOut:
    hidden: torch.Tensor
    scale: float


class _DataclassModel(nn.Module):
    def __init__(self, frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.frozen = frozen

    def forward(self, x):
        h = self.lin(x)
        if self.frozen:
            return _FrozenOut(h, 2.0)
        return _Out(h, torch.arange(3), h.tanh())


@pytest.mark.parametrize("frozen", [False, True])
def test_dataclass_output_is_recorded_like_a_tuple(frozen):
    model, twin = _DataclassModel(frozen), _DataclassModel(frozen)
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    out = model(torch.ones(3, 4))
    loss = out.hidden.square().sum() + (0 if frozen else out.aux.sum())
    loss.backward()
    mon.step()
    got = {(r["module"], r["kind"], r["index"]): r["stats"] for r in mon.records()}
    expect_fwd = [0] if frozen else [0, 2]
    assert sorted(i for (m, k, i) in got if m == "" and k == "forward") == expect_fwd
    assert sorted(i for (m, k, i) in got if m == "" and k == "backward_pre") == expect_fwd
    assert mon.skipped == (0 if frozen else 1)  # the int ids: seen, not recorded, counted
    # the values: the twin's tensors, and the gradient through each returned slot (Note [grad_output by tensor
    # hooks]): 2 * hidden through slot 0 (aux's use of the same tensor inside the module is not that slot's), 1 for aux
    tout = twin(torch.ones(3, 4))
    (tout.hidden.square().sum() + (0 if frozen else tout.aux.sum())).backward()
    h = tout.hidden.detach().double()
    assert got[("", "forward", 0)]["l2"] == pytest.approx(h.norm().item(), rel=1e-6)
    assert got[("", "backward_pre", 0)]["l2"] == pytest.approx((2 * h).norm().item(), rel=1e-6)
    if not frozen:
        assert got[("", "forward", 2)]["l2"] == pytest.approx(h.tanh().norm().item(), rel=1e-6)
        assert got[("", "backward_pre", 2)]["l2"] == pytest.approx(h.numel() ** 0.5, rel=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    mon.detach()


def test_saved_and_copied_hf_model_carry_no_hookstats_hook():
    pytest.importorskip("transformers")
    rm = real_models.build("gpt2")
    mon = hookstats.Monitor(rm.model, kinds=("forward", "backward_pre", "backward", "grad"), per_sample=True)
    rm.step_loss(rm.model).backward()
    mon.step()
    buf = io.BytesIO()
    torch.save(rm.model, buf)
    assert b"hookstats" not in buf.getvalue()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert _hook_count(loaded) == 0
    ema = copy.deepcopy(rm.model)
    n = len(mon.records())
    rm.step_loss(ema).backward()
    assert len(mon.records()) == n
    mon.detach()
    assert _hook_count(rm.model) == _hook_count(ema) == 0


# -- the same through the frameworks that do it for you ----------------------------------------------------------------
@pytest.mark.slow
def test_hf_trainer_with_gradient_checkpointing_records_each_forward_once(tmp_path):
    pytest.importorskip("transformers")
    from test_integrations import TokenData, count, gpt2, hf_args, per_batch
    from transformers import Trainer

    from hookstats.integrations.transformers import HookstatsCallback
    from hookstats.runlog import read_run

    tables = {}
    for ck in (False, True):
        out = tmp_path / f"ck{ck}"
        model = gpt2()
        Trainer(model=model, args=hf_args(out, gradient_checkpointing=ck, max_steps=3), train_dataset=TokenData(),
                callbacks=[HookstatsCallback(kinds=("forward", "backward_pre", "grad"))]).train()
        assert model.is_gradient_checkpointing == ck
        tables[ck] = read_run(out / "hookstats").records
    one = per_batch()
    assert count(tables[True]) == count(tables[False])
    assert all(count(tables[True])[(s, "forward")] == 2 * one["forward"] for s in (1, 2, 3))


def test_timm_model_ema_beside_a_monitor():
    """timm's ModelEmaV3 deep-copies the model it averages: its copy must not record into the model's Monitor."""
    timm_utils = pytest.importorskip("timm.utils")
    model, twin = _mlp(), _mlp()
    mon = hookstats.Monitor(model, kinds=ALL_KINDS)
    mon_twin = hookstats.Monitor(twin, kinds=ALL_KINDS)
    ema = timm_utils.ModelEmaV3(model, decay=0.9)
    assert _hook_count(ema.module) == 0
    for s in range(3):
        for m, mn in ((model, mon), (twin, mon_twin)):
            _step(m, seed=s)
            mn.step()
        ema.update(model)
        with torch.no_grad():
            ema.module(torch.randn(2, 4))
    assert _sites(mon.records()) == _sites(mon_twin.records())
    mon.detach()
    mon_twin.detach()
    assert _hook_count(model) == _hook_count(ema.module) == 0
