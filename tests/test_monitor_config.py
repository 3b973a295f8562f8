"""MonitorConfig (the Monitor's options, grouped) and the feature protocol (Note [monitor features])."""
import dataclasses
import weakref

import pytest
import torch
from torch import nn

import hookstats
from hookstats.monitor import GROUPS, Feature, MonitorConfig


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _run(mon, model, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        mon.step()


def test_every_option_has_a_group_and_a_doc():
    fields = dataclasses.fields(MonitorConfig)
    assert {f.metadata["group"] for f in fields} == set(GROUPS)
    assert all(len(f.metadata["doc"]) > 20 for f in fields)
    assert sum(len(MonitorConfig.group(g)) for g in GROUPS) == len(fields)
    assert MonitorConfig.group("cadence")[:2] == ("every", "start_step")
    with pytest.raises(ValueError, match="no group 'timing'"):
        MonitorConfig.group("timing")


def test_config_and_keywords_record_the_same():
    a, b = _model(), _model()
    sel = ["0", "2", "*.weight"]  # two Linear outputs, their weights' grads
    cfg = MonitorConfig(kinds=("forward", "grad"), include=sel, every=2, histogram=(8, (-2.0, 2.0)))
    m1 = hookstats.Monitor(a, cfg)
    m2 = hookstats.Monitor(b, kinds=("forward", "grad"), include=sel, every=2, histogram=(8, (-2.0, 2.0)))
    _run(m1, a)
    _run(m2, b)
    r1, r2 = m1.records(), m2.records()
    assert len(r1) == len(r2) == 2 * (2 + 2)  # steps 0 and 2
    for x, y in zip(r1, r2):
        assert (x["step"], x["module"], x["kind"], x["histogram"]) == (y["step"], y["module"], y["kind"], y["histogram"])
        assert x["stats"] == y["stats"]
    assert m1.config == m2.config
    assert m1.config.include == sel and m1.config.include is not sel and m1.config.kinds == ("forward", "grad")
    assert cfg.kinds == ("forward", "grad") and cfg.slots is None  # the caller's config is not changed


def test_keywords_replace_config_fields():
    cfg = MonitorConfig(kinds="forward", every=3)
    mon = hookstats.Monitor(_model(), cfg, every=1, kinds="grad_output")
    assert mon.every == 1 and mon.kinds == ("backward_pre",) and mon.config.every == 1
    mon.detach()


def test_unknown_option_names_the_close_ones():
    with pytest.raises(TypeError, match=r"unknown option 'flush_evry'; did you mean 'flush_every'"):
        hookstats.Monitor(_model(), flush_evry=4)
    with pytest.raises(TypeError, match="config must be a hookstats.MonitorConfig"):
        hookstats.Monitor(_model(), {"every": 2})


@pytest.mark.parametrize("options, error, match", [
    ({"every": 0}, ValueError, "every must be an int >= 1"),
    ({"kinds": "outputz"}, ValueError, "unknown kind 'outputz'"),
    ({"export_rank": -1}, ValueError, "export_rank must be an int >= 0"),
    ({"keep_records": False}, ValueError, "keep_records=False without exporters"),
    ({"locations": 1}, TypeError, "locations must be True or False"),
    ({"per_sample": "yes"}, TypeError, "per_sample must be True or False"),
    ({"channel_stats": [-1]}, TypeError, "channel_stats must be a dict"),
])
def test_bad_options_are_refused_by_name(options, error, match):
    model = _model()
    with pytest.raises(error, match=match):
        hookstats.Monitor(model, **options)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class Counting:
    """A user's feature: counts the forward calls of the selected Linear layers, per recorded step."""

    name = "linear_calls"

    def __init__(self):
        self.events, self.per_step, self._calls, self._handles = [], {}, 0, []

    def attach(self, ctx):
        self.events.append("attach")
        assert isinstance(ctx.selection, hookstats.Selection) and ctx.include == ["*"]
        for name, mod in ctx.selection.modules(ctx.model):
            if isinstance(mod, nn.Linear):
                self._handles.append(mod.register_forward_hook(self._hook))
        self.monitor_step = lambda: ctx.monitor.current_step

    def _hook(self, mod, args, out):
        self._calls += 1

    def on_step(self, step, recorded):
        self.events.append(("step", step, recorded, self.monitor_step()))
        if recorded:
            self.per_step[step] = self._calls
        self._calls = 0

    def results(self):
        return dict(self.per_step)

    def run_info(self):
        return {"linear_calls": True}

    def summary(self):
        return f"linear calls: {sum(self.per_step.values())}"

    def detach(self):
        self.events.append("detach")
        for h in self._handles:
            h.remove()


def test_a_users_feature_follows_the_protocol():
    model, f = _model(), Counting()
    assert isinstance(f, Feature)
    mon = hookstats.Monitor(model, features=[f], every=2)
    model(torch.randn(2, 6)).sum().backward()
    mon.step()  # step 0: recorded
    model(torch.randn(2, 6)).sum().backward()
    mon.step()  # step 1: skipped by every
    mon.pause()
    model(torch.randn(2, 6))
    mon.step()  # step 2: paused, so not recorded
    model(torch.randn(2, 6))
    model(torch.randn(2, 6))
    mon.step()  # step 3: skipped
    model(torch.randn(2, 6))
    mon.step()  # step 4: recorded
    assert f.events[1:] == [("step", s, s in (0, 4), s) for s in range(5)]
    assert mon.feature("linear_calls") is f and mon.features == {"linear_calls": f}
    assert mon.feature_results() == {"linear_calls": {0: 2, 4: 2}}
    assert mon.run_info()["linear_calls"] is True
    assert mon.summary().endswith("linear calls: 4")
    mon.detach()
    mon.detach()
    assert f.events.count("detach") == 1
    assert not any(m._forward_hooks for m in model.modules())


def test_a_feature_holds_the_monitor_weakly():
    model, f = _model(), Counting()
    mon = hookstats.Monitor(model, features=[f])
    ref = weakref.ref(mon)
    mon.detach()
    del mon
    assert ref() is None


def test_built_in_features_are_features():
    mon = hookstats.Monitor(_model(), per_sample=True, channel_stats={"inputs": -1}, locations=True)
    assert list(mon.features) == ["channel_stats", "locations", "per_sample"]  # registration order
    assert all(isinstance(f, Feature) for f in mon.features.values())
    assert mon.run_info()["locations"] is True
    mon.detach()


def test_a_missing_feature_says_which_option_attaches_it():
    mon = hookstats.Monitor(_model())
    with pytest.raises(RuntimeError, match=r"no 'per_sample' feature: construct it with Monitor\(\.\.\., per_sample"):
        mon.coverage()
    assert mon.channel_results() == {} and mon.top_samples(3) == [] and mon.first_nonfinite_sample() is None
    assert mon.sample_norms() == []
    mon.detach()


def test_features_are_refused_when_they_do_not_follow_the_protocol():
    with pytest.raises(TypeError, match="a feature needs a name and attach, on_step, results and detach"):
        hookstats.Monitor(_model(), features=[object()])
    with pytest.raises(ValueError, match="two features are named 'linear_calls'"):
        hookstats.Monitor(_model(), features=[Counting(), Counting()])


def test_a_failing_feature_leaves_no_hook_behind():
    class Broken(Counting):
        name = "broken"

        def attach(self, ctx):
            super().attach(ctx)
            raise RuntimeError("broken attach")

    model, ok = _model(), Counting()
    with pytest.raises(RuntimeError, match="broken attach"):
        hookstats.Monitor(model, features=[ok, Broken()], kinds=("forward", "backward_pre", "grad"))
    assert ok.events[-1] == "detach"  # and Broken's partial attach was undone by its detach
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_locations_feature_lists_the_nonfinite_records():
    model = _model()
    mon = hookstats.Monitor(model, locations=True, kinds="forward")
    x = torch.randn(4, 6)
    x[2, 3] = float("nan")
    model(x)
    mon.step()
    bad = mon.feature_results()["locations"]
    assert [r["module"] for r in bad] == ["0", "1", "2", ""]
    assert bad[0]["first_nonfinite_index"] == (2, 0)
    mon.detach()


@pytest.mark.parametrize("framework", ["transformers", "lightning"])
def test_callbacks_check_their_options_when_made(framework):
    if framework == "transformers":
        pytest.importorskip("transformers")
        from hookstats.integrations.transformers import HookstatsCallback
    else:
        pytest.importorskip("lightning")
        from hookstats.integrations.lightning import HookstatsCallback
    with pytest.raises(TypeError, match="unknown option 'histogram_evry'"):
        HookstatsCallback(histogram_evry=2)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        HookstatsCallback(every=0)
    with pytest.raises(TypeError, match="optimizer= is set by the callback"):
        HookstatsCallback(optimizer="manual")
    cb = HookstatsCallback(include="*Linear*", locations=True)
    assert cb.config.include == "*Linear*" and cb.config.locations and cb.config.keep_records is False


def test_a_feature_serves_one_monitor_at_a_time():
    f = Counting()
    cfg = MonitorConfig(features=[f])
    a, b = _model(), _model()
    mon = hookstats.Monitor(a, cfg)
    with pytest.raises(ValueError, match="'linear_calls' is attached to another Monitor"):
        hookstats.Monitor(b, cfg)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in b.modules())
    assert f.events.count("attach") == 1
    mon.detach()
    again = hookstats.Monitor(b, cfg)  # detached, it may serve the next one (a callback's next trainer.train())
    assert f.events.count("attach") == 2
    again.detach()


def test_a_dropped_monitor_releases_its_features():
    import gc

    f = Counting()
    model = _model()
    hookstats.Monitor(model, features=[f])  # dropped without detach()
    gc.collect()
    assert f.events[-1] == "detach" and not any(m._forward_hooks for m in model.modules())
    hookstats.Monitor(model, features=[f]).detach()
