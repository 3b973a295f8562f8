"""The examples in examples/: each main() is run on a few steps and its results checked against the same
computation written in plain PyTorch (same model, data and seed), and each script runs as a script."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from torch import nn

import hookstats

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = ["grad_norm_logging", "clip_by_norm", "clip_by_value", "capture_activations", "modify_inputs",
           "scale_gradient", "grad_cam", "nan_hunting", "calibrate_linear", "find_bad_sample",
           "find_bad_token", "accelerate_monitor"]


@lru_cache(maxsize=None)
def load(name: str):
    """Imports examples/<name>.py. Its `from _common import ...` finds examples/_common.py as `python
    examples/<name>.py` would, with examples/ on sys.path."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"hookstats_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def close(a, b, rel=1e-5, abs_=1e-9) -> bool:
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=abs_) for x, y in zip(a, b, strict=True))


def assert_same_params(got: dict, model: nn.Module, atol: float = 1e-6) -> None:
    want = {k: v.detach() for k, v in model.state_dict().items()}
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=lambda m: f"{k}: {m}")


@torch.no_grad()
def sgd(params, lr: float) -> None:
    """Plain SGD for the reference runs, torch.optim.SGD's update (p.add_(grad, alpha=-lr), so the runs stay bitwise
    comparable), without torch.optim, whose first use imports torch._dynamo (~3 s here)."""
    for p in params:
        p.add_(p.grad, alpha=-lr)
        p.grad = None


def vnorm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.detach().double()).item()


# ---------------------------------------------------------------------------------------------------------------
def test_grad_norm_logging(tmp_path):
    mod = load("grad_norm_logging")
    steps = 3
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path), "--check"])
    assert (tmp_path / "grad_norms.json").stat().st_size > 0

    # The same training without hooks, norms the plain way: the hooks must neither miss nor change anything.
    model = mod.build_model()
    params = list(model.parameters())
    plain: dict[str, list[float]] = {}
    layer_plain: dict[str, list[float]] = {}
    for x, y in mod.batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        for name, p in model.named_parameters():
            plain.setdefault(name, []).append(vnorm(p.grad))
        for layer in ("0", "2", "4"):
            m = model.get_submodule(layer)
            layer_plain.setdefault(layer, []).append(vnorm(torch.cat([m.weight.grad.flatten(), m.bias.grad])))
        sgd(params, mod.LR)

    assert res["per_param"].keys() == plain.keys() == res["reference"].keys()
    for name in plain:
        assert close(res["per_param"][name], plain[name]), name
        assert close(res["per_param"][name], res["reference"][name]), name
    assert res["per_layer"].keys() == layer_plain.keys()
    for layer in layer_plain:
        assert close(res["per_layer"][layer], layer_plain[layer]), layer
    # Non-trivial: the norms differ between steps.
    assert len(set(res["per_param"]["0.weight"])) == steps
    assert len(res["records"]) == steps * len(plain)


# ---------------------------------------------------------------------------------------------------------------
def test_clip_by_norm(tmp_path):
    mod = load("clip_by_norm")
    steps, act_max, max_norm = 4, 0.01, 0.25
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path), "--act-max-norm", str(act_max),
                    "--max-norm", str(max_norm)])

    model = mod.build_model()
    params = list(model.parameters())
    before, after, totals = [], [], []

    def clip_hook(module, grad_input, grad_output):
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grad_input
                                                      if g is not None]))
        before.append(total.item())
        coef = torch.clamp(act_max / (total + 1e-6), max=1.0)
        return tuple(None if g is None else g * coef for g in grad_input)

    model.fc2.register_full_backward_hook(clip_hook)
    model.act1.register_full_backward_pre_hook(lambda m, go: after.append(vnorm(go[0])))
    for x, y in mod.batches(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        sgd(params, mod.LR)

    assert close(res["grad_input_norm_before"], before)
    assert close(res["grad_input_norm_after"], after)
    assert close(res["total_norm_before"], totals)
    assert all(a <= act_max * (1 + 1e-6) for a in res["grad_input_norm_after"])
    # Both clips really clipped, at least once.
    assert max(res["grad_input_norm_before"]) > 2 * act_max
    assert max(res["total_norm_before"]) > max_norm
    assert_same_params(res["state_dict"], model)


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("during_backward", [False, True], ids=["clip_grad_value_", "post_accumulate"])
def test_clip_by_value(tmp_path, during_backward):
    mod = load("clip_by_value")
    steps, act_c, c = 3, 0.002, 0.05
    argv = ["--steps", str(steps), "--out", str(tmp_path), "--act-clip", str(act_c), "--clip", str(c)]
    res = mod.main(argv + (["--during-backward"] if during_backward else []))

    model = mod.build_model()
    params = list(model.parameters())
    act_counts, param_counts, max_abs = [], [], []

    def clamp_grad(g):
        act_counts.append(int((g.abs() > act_c).sum()))
        return g.clamp(-act_c, act_c)

    def attach(m, args, out):  # returns None: a forward hook's return value would replace the output
        out.register_hook(clamp_grad)

    model.fc1.register_forward_hook(attach)
    for x, y in mod.batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        param_counts.append(sum(int((p.grad.abs() > c).sum()) for p in model.parameters()))
        torch.nn.utils.clip_grad_value_(model.parameters(), c)
        max_abs.append(max(p.grad.abs().max().item() for p in model.parameters()))
        sgd(params, mod.LR)

    assert res["act_clipped"] == act_counts
    assert res["param_clipped"] == param_counts
    assert res["max_abs_grad"] == pytest.approx(max_abs, rel=1e-6)
    assert all(0 < n < 64 * 64 for n in act_counts)  # some, not all, were clipped
    assert all(0 < n < res["n_params"] for n in param_counts)
    assert_same_params(res["state_dict"], model)


# ---------------------------------------------------------------------------------------------------------------
def test_capture_activations(tmp_path):
    mod = load("capture_activations")
    steps = 2
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path)])
    layers = res["layers"]
    assert list(layers) == ["act1", "act2", "act3"]

    model = mod.build_model().eval()
    seen: dict[str, list[torch.Tensor]] = {}
    for name in layers:
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: seen.setdefault(name, []).append(out.detach().clone()))
    with torch.no_grad():
        for x in mod.batches(steps):
            model(x)

    lay = hookstats.exp_layout(torch.float32)
    for name, outs in seen.items():
        got = layers[name]
        assert close(got["mean"], [o.double().mean().item() for o in outs], rel=1e-5, abs_=1e-7), name
        assert close(got["std"], [o.double().std().item() for o in outs], rel=1e-5, abs_=1e-7), name
        assert got["zero_fraction"] == [(o == 0).double().mean().item() for o in outs], name
        # The exponent histogram, summed over batches, from torch.frexp: x = m * 2**e, m in [0.5, 1).
        allx = torch.cat([o.flatten() for o in outs])
        hist = torch.tensor(got["hist"])
        assert int(hist.sum()) == allx.numel()
        assert int(hist[lay.zero]) == int((allx == 0).sum())
        assert int(hist[lay.neg].sum()) == 0 and int(hist[lay.nan]) == 0
        pos = allx[allx > 0]
        exps = torch.frexp(pos).exponent - 1
        want = torch.bincount(exps - lay.emin, minlength=lay.pos.stop - lay.pos.start)
        assert torch.equal(hist[lay.pos], want), name
        assert {int(k): v for k, v in got["binades"].items()} == {
            int(e): int(n) for e, n in zip(*torch.unique(exps, return_counts=True))}
        # float8 e4m3fn's smallest subnormal is 2**-9: values below it flush to zero (binade resolution).
        assert got["e4m3_underflow"] == pytest.approx(int(((allx > 0) & (allx < 2.0**-9)).sum()) / allx.numel())
    # The badly initialised layer shows up as mostly zeros.
    assert min(layers["act2"]["zero_fraction"]) > 0.8 > max(layers["act1"]["zero_fraction"])


# ---------------------------------------------------------------------------------------------------------------
def test_modify_inputs_layer_receives_new_args():
    """Directly: with the example's pre-hooks, fc1 receives standardize(clamp(x)); the caller's x is unchanged."""
    mod = load("modify_inputs")
    model = mod.build_model()
    clip = hookstats.clip_value(mod.LO, mod.HI)
    model.fc1.register_forward_pre_hook(clip.forward_pre)
    model.fc1.register_forward_pre_hook(mod.standardize)
    received = []
    model.fc1.register_forward_pre_hook(lambda m, args: received.append(args[0].detach().clone()))
    x, _ = next(mod.batches(1))
    x_before = x.clone()
    out = model(x)

    c = x.clamp(mod.LO, mod.HI)
    want = (c - c.mean()) / c.std()
    torch.testing.assert_close(received[0], want, rtol=1e-5, atol=1e-5)
    fc1 = nn.functional.linear(want, model.fc1.weight, model.fc1.bias)  # model.fc1(...) would run the hooks again
    torch.testing.assert_close(out, model.head(model.act(fc1)), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before) and x.max() == 1000.0  # not modified in place
    assert int(clip.last_count) == int(((x < mod.LO) | (x > mod.HI)).sum()) > 0


def test_modify_inputs(tmp_path):
    mod = load("modify_inputs")
    steps = 3
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path)])

    model = mod.build_model()
    params = list(model.parameters())
    counts, received = [], []

    def clamp(m, args):
        counts.append(int(((args[0] < mod.LO) | (args[0] > mod.HI)).sum()))
        return (args[0].clamp(mod.LO, mod.HI),)

    def standardize(m, args):
        return ((args[0] - args[0].mean()) / args[0].std(),)

    model.fc1.register_forward_pre_hook(clamp)
    model.fc1.register_forward_pre_hook(standardize)
    model.fc1.register_forward_pre_hook(lambda m, args: received.append(args[0].detach().double()))
    for x, y in mod.batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        sgd(params, mod.LR)

    assert res["clipped"] == counts and all(n > 0 for n in counts)
    assert res["raw_max"] == [1000.0] * steps
    assert close(res["seen_min"], [r.min().item() for r in received])
    assert close(res["seen_max"], [r.max().item() for r in received])
    assert close(res["seen_std"], [r.std().item() for r in received])
    assert close(res["seen_mean"], [r.mean().item() for r in received], abs_=1e-6)
    assert_same_params(res["state_dict"], model)


# ---------------------------------------------------------------------------------------------------------------
def test_scale_gradient(tmp_path):
    mod = load("scale_gradient")
    steps, scale, max_norm = 3, 4.0, 0.05
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path), "--scale", str(scale),
                    "--max-norm", str(max_norm)])

    encoder, head = mod.build_model()
    params = [*encoder.parameters(), *head.parameters()]
    raw, clipped, input_grads = [], [], []

    def clip(g):
        coef = torch.clamp(max_norm / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)
        return g * coef

    for x, y in mod.batches(steps):
        x.requires_grad_(True)
        h = encoder(x)
        h.register_hook(lambda g: raw.append(vnorm(g)))
        h.register_hook(lambda g: g * scale)
        h.register_hook(clip)
        h.register_hook(lambda g: clipped.append(vnorm(g)))
        nn.functional.cross_entropy(head(h), y).backward()
        input_grads.append(x.grad.detach())
        sgd(params, mod.LR)

    assert close(res["raw_norm"], raw)
    assert close(res["clipped_norm"], clipped)
    assert all(n <= max_norm * (1 + 1e-6) for n in res["clipped_norm"])
    assert all(r * scale > max_norm for r in raw)  # the clip did act
    for got, want in zip(res["input_grads"], input_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    state = {**{"encoder." + k: v for k, v in encoder.state_dict().items()},
             **{"head." + k: v for k, v in head.state_dict().items()}}
    assert res["state_dict"].keys() == state.keys()
    for k, v in state.items():
        torch.testing.assert_close(res["state_dict"][k], v, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
def test_grad_cam(tmp_path):
    mod = load("grad_cam")
    res = mod.main(["--steps", "20", "--out", str(tmp_path)])
    png = Path(res["png"])
    assert png == tmp_path / "grad_cam.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The CAM, recomputed without hooks: split the model at relu2 and differentiate w.r.t. its output.
    model, x, y = res["model"], res["x"], res["labels"]
    with torch.no_grad():
        a = model[:4](x)
    a.requires_grad_(True)
    score = model[4:](a).gather(1, y[:, None]).sum()
    (grad,) = torch.autograd.grad(score, a)
    cam = torch.relu((grad.mean(dim=(2, 3), keepdim=True) * a.detach()).sum(1))
    torch.testing.assert_close(res["cam"], cam, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res["grads"], grad, rtol=1e-5, atol=1e-9)

    # The logged statistics of the captured gradients, against torch ops on them.
    g, dA = res["grad_stats"], res["grads"]
    assert g["numel"] == dA.numel() and g["zero_count"] == int((dA == 0).sum())
    assert g["min"] == dA.min().item() and g["max"] == dA.max().item()
    assert g["l2"] == pytest.approx(vnorm(dA), rel=1e-5)

    # The CAM peaks on the spot (within 2 pixels) for most images.
    cy, cx = res["centres"]
    assert res["hits"].float().mean() >= 0.75
    assert res["accuracy"] >= 0.75  # it did learn bright from dark
    peak = cam.flatten(1).argmax(1)
    assert torch.equal(peak // cam.shape[2], res["peak"][0]) and torch.equal(peak % cam.shape[2], res["peak"][1])


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_step", [1, 2])
def test_nan_hunting(tmp_path, bad_step):
    mod = load("nan_hunting")
    steps = 4
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path), "--bad-step", str(bad_step)])
    first = res["first"]
    assert first is not None
    assert (first["module"], first["kind"], first["step"], first["index"]) == ("log", "forward", bad_step, 0)

    # Plain PyTorch: the same batches; where does log(x) become non-finite?
    xs = [x for x, _ in mod.batches(steps, bad_step)]
    logs = [torch.log(x) for x in xs]
    assert [bool(torch.isfinite(v).all()) for v in logs] == [i != bad_step for i in range(steps)]
    assert first["stats"]["inf_count"] == int(torch.isinf(logs[bad_step]).sum()) == 1
    assert first["stats"]["nan_count"] == 0 and first["stats"]["numel"] == logs[bad_step].numel()
    # Only that step's records are non-finite: clip_grad_norm_(nonfinite="zero") kept the weights finite after it.
    assert {r["step"] for r in res["bad_records"]} == {bad_step}
    assert [math.isfinite(v) for v in res["losses"]] == [i != bad_step for i in range(steps)]
    assert res["params_finite"]  # clip_grad_norm_(nonfinite="zero") skipped the bad update


def test_nan_hunting_clean_run(tmp_path):
    res = load("nan_hunting").main(["--steps", "2", "--out", str(tmp_path), "--bad-step", "99"])
    assert res["first"] is None and res["bad_records"] == []


# ---------------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------------
def test_calibrate_linear(tmp_path):
    mod = load("calibrate_linear")
    steps = 3
    res = mod.main(["--steps", str(steps), "--out", str(tmp_path)])

    # The plain-PyTorch calibration hook: x.abs().amax over the token dims, torch.maximum into a buffer, and the
    # mean magnitude AWQ uses, on the same model and batches.
    model = mod.build_model().eval()
    amax: dict = {}
    sums: dict = {}

    def hook(name):
        def pre(m, args):
            x = args[0].detach().double()
            amax[name] = torch.maximum(amax.get(name, torch.zeros(x.shape[-1], dtype=torch.float64)),
                                       x.abs().amax(dim=(0, 1)))
            sums[name] = sums.get(name, 0) + x.abs().sum(dim=(0, 1))
        return pre

    for name in ("fc1", "fc2", "head"):
        model.get_submodule(name).register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for idx in mod.batches(steps):
            model(idx)
    layers = res["layers"]
    assert sorted(layers) == ["fc1", "fc2", "head"]
    for name in layers:
        lay = layers[name]
        assert lay["calls"] == steps and lay["nonfinite"] == 0
        assert lay["absmax"] == amax[name].tolist(), name
        n = lay["values_per_channel"]
        assert n == steps * 8 * 24
        assert close(lay["mean_abs"], (sums[name] / n).tolist(), rel=2e-6)  # float32 pieces, summed in float64
        want = mod.smoothquant_scales(amax[name], model.get_submodule(name).weight)
        assert close(lay["smoothquant_scales"], want.tolist(), rel=1e-12)
    assert layers["fc1"]["top_channels"] == list(mod.OUTLIERS) == layers["head"]["top_channels"]


# ---------------------------------------------------------------------------------------------------------------
def test_find_bad_sample(tmp_path):
    mod = load("find_bad_sample")
    res = mod.main(["--steps", "4", "--bad-step", "1", "--out", str(tmp_path)])
    steps = res["steps"]
    assert steps[1]["top_samples"][0][0] == mod.BAD_SAMPLE
    assert steps[1]["top_samples"][0][1] > 100 * steps[1]["median_sample_norm"]
    assert steps[0]["first_nonfinite"] is None and steps[1]["first_nonfinite"] is None
    bad = steps[2]["first_nonfinite"]
    assert bad["sample"] == mod.NAN_SAMPLE and bad["layers"] == ["fc1", "fc2", "head"]
    assert int(torch.isfinite(res["totals"][2]).sum()) == 31  # only the NaN sample's norm is non-finite
    assert math.isfinite(steps[3]["loss"])  # the NaN step was skipped (clip_grad_norm_(nonfinite="zero"))

    # Step 0 against per-sample gradients materialised by torch.func, on the same model and batch.
    from torch.func import functional_call, grad, vmap

    model = mod.build_model()
    x, y = next(iter(mod.batches(1, bad_step=1)))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xb, yb):  # sample b's share of the batch's mean-squared error
        return (functional_call(model, p, (xb.unsqueeze(0),)) - yb).square().sum() / x.shape[0]

    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    want = torch.stack([v.reshape(v.shape[0], -1).square().sum(1) for v in g.values()]).sum(0).sqrt()
    torch.testing.assert_close(res["totals"][0], want.double(), rtol=1e-5, atol=1e-8)
    assert steps[0]["top_samples"][0][0] == int(want.argmax())


# ---------------------------------------------------------------------------------------------------------------
def test_find_bad_token(tmp_path):
    mod = load("find_bad_token")
    res = mod.main(["--steps", "6", "--bad-step", "3", "--out", str(tmp_path)])
    bad = res["first_nonfinite"]
    assert (bad["step"], bad["module"], bad["kind"]) == (3, "embed", "forward")
    assert bad["element"] == [*mod.BAD_AT, mod.BAD_CHANNEL] and bad["token"] == mod.BAD_TOKEN
    assert bad["shape"] == [mod.BATCH, mod.TOKENS, mod.DIM] and bad["nan_count"] == 1
    assert bad["text"] == f"step 3, module embed, kind forward, index 0, element {(*mod.BAD_AT, mod.BAD_CHANNEL)}"
    huge = res["huge"]
    assert huge["step"] == mod.HUGE_STEP and huge["element"] == [*mod.HUGE_AT, mod.HUGE_CHANNEL]
    assert huge["token"] == mod.HUGE_TOKEN and huge["linf"] == 1e4
    assert math.isnan(res["losses"][3]) and all(math.isfinite(v) for i, v in enumerate(res["losses"]) if i != 3)
    # the same element by plain PyTorch: the embedding output of the bad step's batch
    model = mod.build_model()
    ids, _ = list(mod.batches(4, bad_step=3))[3]
    e = model.embed(ids).detach()
    assert tuple(torch.isnan(e).nonzero()[0].tolist()) == (*mod.BAD_AT, mod.BAD_CHANNEL)


@pytest.fixture(scope="module", autouse=True)
def script_runs(request, tmp_path_factory):
    """Runs the selected scripts as subprocesses, two at a time, from the module's first test on, beside the
    in-process tests (each script costs ~5 s of CPU here, mostly torch's import)."""
    names = [item.callspec.params["script"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_runs_as_script"]
    tmp = tmp_path_factory.mktemp("scripts")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}

    def run(name):
        out = tmp / name
        return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--steps", "1", "--out", str(out)],
                              cwd=EXAMPLES.parent, env=env, capture_output=True, text=True, timeout=180), out

    pool = ThreadPoolExecutor(max_workers=2)
    slow_first = sorted(dict.fromkeys(names), key=lambda n: n != "grad_cam")  # it also imports matplotlib
    futures = {name: pool.submit(run, name) for name in slow_first}
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_as_script(script, script_runs):
    proc, out = script_runs[script].result()
    assert proc.returncode == 0, f"{script}.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert out.is_dir() and any(out.iterdir()), f"{script}.py wrote nothing to --out"


def test_readme_lists_every_script():
    readme = (EXAMPLES / "README.md").read_text()
    found = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))  # not _common.py
    assert found == sorted(SCRIPTS)
    for name in SCRIPTS:
        assert f"python examples/{name}.py" in readme, name
