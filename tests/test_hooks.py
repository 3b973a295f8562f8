"""The hook objects hookstats.fused_clip, clip_value and record, in every hook kind's form, on small real models
(an MLP, a small CNN, an nn.TransformerEncoderLayer), against the same computation done with plain PyTorch in the
same hook. The contract is the hooks API spec (issue #5) and the docstring of hookstats/hooks.py; the PyTorch hook
facts tested here are the ones people get wrong (which hook gets what, when it fires, what its return value does):
docs/guide/hooks-semantics.md and the table at the top of hookstats/hooks.py.

The plain-PyTorch references:
  fused_clip   the hook returns the same structure with every floating tensor t replaced by t * coef, where
               coef = min(1, max_norm / (N + 1e-6)) is computed under no_grad in float64 from N, the norm of the
               float64 norms of the floating tensors the hook sees (torch.linalg.vector_norm), and cast to float32
               (float64 for float64 tensors) before the product. post_accumulate: torch.nn.utils.clip_grad_norm_
               applied to the one parameter.
  clip_value   t.clamp(lo, hi) for every floating tensor; post_accumulate: torch.nn.utils.clip_grad_value_.
  record       a plain hook registered right after the record hook captures clones of what it sees; the record's
               stats must match hookstats.reference.stats of the capture (tests/_testing.py tolerances), its histogram
               hookstats.histogram / exp_histogram of the capture exactly; the run must be bit-identical to a run
               without hooks.

Tolerances for outputs and gradients (compared in float64): |got - want| <= rtol * (|want| + max|want|), with rtol
fp64 1e-12, fp32 1e-5, fp16 2e-3, bf16 2e-2. The two sides run the same PyTorch ops on the same inputs; they differ
only in how the norm is accumulated (hookstats' kernel vs float64 torch: about 1e-7 relative for fp32-accumulated
inputs), which can move the float32 coefficient by an ulp and the low-precision products that follow by an ulp of
their dtype; the max|want| term covers cancellation in the layers downstream. Measured on the CPU (worst element
over all cases): fp64 3e-16, fp32 1.8e-7, fp16 4.6e-4, bf16 4.0e-3; clip_value cases are bit-exact. Every clipping
case also checks that the hook changed the run by much more than that (clipping to half the norm, or clamping at
half the largest value). "Changes nothing" (record, removed handles) is bit-exact on the CPU; on CUDA, where cuDNN
and attention backward kernels are not deterministic, it is the same tolerance.
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn

import hookstats
from hookstats import reference

from _testing import DEVICES, DTYPES, bits, flat, stats_mismatches

F = hookstats.STATS_FIELDS
NAN = float("nan")
INF = float("inf")
EPS = 1e-6  # PyTorch's clip_grad_norm_ epsilon, the contract's default
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

MODELS = ("mlp", "cnn", "transformer")
KINDS = ("backward", "backward_pre", "forward_pre", "forward", "tensor", "post_accumulate")
FNS = ("fused_clip", "clip_value", "record")


# ---------------------------------------------------------------------------------------------------------------
# Models and runs
# ---------------------------------------------------------------------------------------------------------------

def build(name: str, dtype=torch.float32, device="cpu"):
    """A seeded model, its input (requires grad) and the name of the submodule the module hooks go on."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        x, target = torch.randn(6, 8, generator=gen), "2"
    elif name == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Flatten(),
                              nn.Linear(6 * 4 * 4, 5))
        x, target = torch.randn(2, 3, 6, 6, generator=gen), "2"
    elif name == "transformer":
        # self_attn sees (x, x, x) positionally, returns (attn_output, None) and gets three input grads
        model = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        x, target = torch.randn(2, 5, 32, generator=gen), "self_attn"
    else:
        raise AssertionError(name)
    model = model.to(device=device, dtype=dtype)
    return model, x.to(device=device, dtype=dtype).requires_grad_(), target


def loss_of(out: torch.Tensor) -> torch.Tensor:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    return (out * w).sum()


def run(name, dtype=torch.float32, device="cpu", install=None):
    """Forward + backward of a fresh model with `install(model, target_module, x)` applied first. Returns a dict of
    the output, the input grad and every parameter grad (clones)."""
    model, x, target = build(name, dtype, device)
    if install is not None:
        install(model, model.get_submodule(target), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "full backward hook is firing ... no inputs require gradients"
        out = model(x)
        loss_of(out).backward()
    res = {"out": out.detach().clone(), "x.grad": x.grad.clone()}
    res.update({n: p.grad.clone() for n, p in model.named_parameters()})
    return res



def remap(obj, fn):
    """obj with fn applied to each tensor (containers and their types kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [remap(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [remap(o, fn) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, remap(v, fn)) for k, v in obj.items())
    return obj


def is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FLOATS


def register(kind: str, model: nn.Module, module: nn.Module, hook) -> list:
    """Registers `hook` as a hook of `kind`: module hooks on the target module, tensor hooks on the target module's
    (first) output tensor, post-accumulate hooks on every parameter of the model."""
    if kind == "backward":
        return [module.register_full_backward_hook(hook)]
    if kind == "backward_pre":
        return [module.register_full_backward_pre_hook(hook)]
    if kind == "forward_pre":
        return [module.register_forward_pre_hook(hook)]
    if kind == "forward":
        return [module.register_forward_hook(hook)]
    if kind == "tensor":
        def on_output(m, args, out):
            flat(out)[0].register_hook(hook)

        return [module.register_forward_hook(on_output)]
    if kind == "post_accumulate":
        return [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    raise AssertionError(kind)


def form(obj, kind: str):
    return obj if kind == "backward" else getattr(obj, kind)


def what_clip_sees(kind: str, calls: list):
    """A plain hook of `kind` that appends, per call, clones of the tensors a clipping form processes."""
    def keep(obj):
        calls.append([t.detach().clone() for t in flat(obj)])

    return {
        "backward": lambda m, gi, go: keep(gi),
        "backward_pre": lambda m, go: keep(go),
        "forward_pre": lambda m, args: keep(args),
        "forward": lambda m, args, out: keep(out),
        "tensor": lambda g: keep(g),
        "post_accumulate": lambda p: keep(p.grad),
    }[kind]


def what_record_sees(kind: str, items: list):
    """A plain hook of `kind` that appends (kind name, index, clone) for every tensor a record form records."""
    def keep(obj, k):
        items.extend((k, i, t.detach().clone()) for i, t in enumerate(flat(obj)))

    return {
        "backward": lambda m, gi, go: (keep(gi, "backward:grad_input"), keep(go, "backward:grad_output"))[-1],
        "backward_pre": lambda m, go: keep(go, "backward_pre"),
        "forward_pre": lambda m, args: keep(args, "forward_pre"),
        "forward": lambda m, args, out: keep(out, "forward"),
        "tensor": lambda g: keep(g, "tensor"),
        "post_accumulate": lambda p: keep(p.grad, "post_accumulate"),
    }[kind]


def joint_norm(tensors, p=2.0) -> torch.Tensor:
    """Plain PyTorch: the p-norm of the float64 per-tensor p-norms."""
    per = [torch.linalg.vector_norm(t.detach().to(torch.float64), p) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(per), p)


def coef_of(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    return torch.clamp(max_norm / (norm + EPS), max=1.0)


def scaled(t: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return t * coef.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def plain_fused_clip(kind: str, max_norm: float, norms: list, p=2.0, per_tensor=False):
    """The plain-PyTorch fused_clip hook of `kind` (see the module docstring); appends the norms it computes."""
    def clip(obj):
        floats = [t for t in flat(obj) if is_float(t)]
        if not floats:
            return None
        with torch.no_grad():
            if per_tensor:
                coefs = {id(t): coef_of(joint_norm([t], p), max_norm) for t in floats}
                norms.extend(joint_norm([t], p) for t in floats)
            else:
                n = joint_norm(floats, p)
                norms.append(n)
                coefs = {id(t): coef_of(n, max_norm) for t in floats}
        return remap(obj, lambda t: scaled(t, coefs[id(t)]) if is_float(t) else t)

    def post(param):
        with torch.no_grad():
            norms.append(joint_norm([param.grad], p))
        torch.nn.utils.clip_grad_norm_([param], max_norm, norm_type=p)

    return by_kind(kind, clip, post)


def by_kind(kind: str, clip, post):
    """The plain-PyTorch hook of one kind: clip(obj) on what the kind sees, post(param) for post-accumulate."""
    return {
        "backward": lambda m, gi, go: clip(gi),
        "backward_pre": lambda m, go: clip(go),
        "forward_pre": lambda m, args: clip(args),
        "forward": lambda m, args, out: clip(out),
        "tensor": lambda g: clip(g),
        "post_accumulate": post,
    }[kind]


def plain_clip_value(kind: str, lo: float, hi: float, counts: list):
    def clip(obj):
        floats = [t for t in flat(obj) if is_float(t)]
        if not floats:
            return None
        counts.append(sum(int(((t < lo) | (t > hi)).sum()) for t in floats))
        return remap(obj, lambda t: t.clamp(lo, hi) if is_float(t) else t)

    def post(param):
        counts.append(int(((param.grad < lo) | (param.grad > hi)).sum()))
        assert lo == -hi
        torch.nn.utils.clip_grad_value_([param], hi)

    return by_kind(kind, clip, post)


def mismatch(got: torch.Tensor, want: torch.Tensor, dtype) -> str:
    """'' when got is close to want (module docstring), else a message with the worst element."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} vs {want.dtype}"
    g, w = got.detach().to(torch.float64).cpu(), want.detach().to(torch.float64).cpu()
    if g.numel() == 0:
        return ""
    tol = RTOL[dtype] * (w.abs() + w.abs().max())
    err = (g - w).abs()
    bad = ~(err <= tol)
    if not bad.any():
        return ""
    i = int(torch.argmax(torch.where(bad, err / tol.clamp_min(1e-300), torch.zeros_like(err))))
    return f"element {i}: got {g.reshape(-1)[i].item()!r}, want {w.reshape(-1)[i].item()!r} ({int(bad.sum())} bad)"


def assert_runs_close(got: dict, want: dict, dtype) -> None:
    assert got.keys() == want.keys()
    bad = {k: m for k in want if (m := mismatch(got[k], want[k], dtype))}
    assert not bad, "differs from the plain-PyTorch hook:\n  " + "\n  ".join(f"{k}: {m}" for k, m in bad.items())


def assert_runs_bitwise_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    if any(t.is_cuda for t in want.values()):  # nondeterministic backward kernels: see the module docstring
        return assert_runs_close(got, want, next(iter(want.values())).dtype)
    bad = [k for k in want if not torch.equal(bits(got[k]), bits(want[k]))]
    assert not bad, f"a hook that must change nothing changed {bad}"


def changed_keys(got: dict, base: dict, dtype) -> list:
    return [k for k in base if mismatch(got[k], base[k], dtype)]


def stats_obj(rec_stats: dict) -> hookstats.Stats:
    return hookstats.Stats(*[torch.tensor(rec_stats[f], dtype=torch.float64) for f in F])


def assert_record_matches(rec: dict, t: torch.Tensor) -> None:
    bad = stats_mismatches(stats_obj(rec["stats"]), reference.stats(t), t.dtype)
    assert not bad, f"record {rec['module']}/{rec['kind']}/{rec['index']}: " + "; ".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# Every hook kind x every hook function, on each model, against the plain-PyTorch hook
# ---------------------------------------------------------------------------------------------------------------

CASES = [pytest.param("mlp", torch.float32, id="mlp-fp32"), pytest.param("cnn", torch.float32, id="cnn-fp32"),
         pytest.param("transformer", torch.float32, id="transformer-fp32"),
         pytest.param("mlp", torch.float64, id="mlp-fp64"), pytest.param("mlp", torch.float16, id="mlp-fp16"),
         pytest.param("mlp", torch.bfloat16, id="mlp-bf16")]


def probe(name, dtype, device, kind) -> list:
    """What a clipping form of `kind` would see, per call, in an unhooked run."""
    calls: list = []
    run(name, dtype, device, lambda m, mod, x: register(kind, m, mod, what_clip_sees(kind, calls)))
    assert calls and all(c for c in calls), f"the {kind} hook never saw a tensor"
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name, dtype", CASES)
def test_fused_clip_matches_plain_hook(device, name, dtype, kind):
    calls = probe(name, dtype, device, kind)
    if kind == "post_accumulate":  # per-parameter clipping; the median norm: some parameters clipped, some not
        max_norm = float(torch.stack([joint_norm(c) for c in calls]).median())
    else:
        max_norm = 0.5 * float(joint_norm(calls[0]))
    base = run(name, dtype, device)
    fc = hookstats.fused_clip(max_norm)
    got = run(name, dtype, device, lambda m, mod, x: register(kind, m, mod, form(fc, kind)))
    norms: list = []
    want = run(name, dtype, device, lambda m, mod, x: register(kind, m, mod, plain_fused_clip(kind, max_norm, norms)))
    assert_runs_close(got, want, dtype)
    assert changed_keys(got, base, dtype), "clipping to half the norm changed nothing"
    # last_norm: the last norm seen, float64, on the device
    assert fc.last_norm is not None and fc.last_norm.dtype == torch.float64 and fc.last_norm.shape == ()
    assert fc.last_norm.device.type == torch.device(device).type
    assert float(fc.last_norm) == pytest.approx(float(norms[-1]), rel=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name, dtype", CASES)
def test_clip_value_matches_plain_hook(device, name, dtype, kind):
    calls = probe(name, dtype, device, kind)
    v = 0.5 * max(float(t.abs().max()) for c in calls for t in c)
    v = float(torch.tensor(v, dtype=dtype))  # a bound the dtype holds: the count then has one meaning
    base = run(name, dtype, device)
    cv = hookstats.clip_value(v)
    got = run(name, dtype, device, lambda m, mod, x: register(kind, m, mod, form(cv, kind)))
    counts: list = []
    want = run(name, dtype, device, lambda m, mod, x: register(kind, m, mod, plain_clip_value(kind, -v, v, counts)))
    assert_runs_close(got, want, dtype)
    assert changed_keys(got, base, dtype), "clamping at half the largest value changed nothing"
    assert cv.last_count is not None and cv.last_count.dtype == torch.int64
    assert cv.last_count.device.type == torch.device(device).type
    assert int(cv.last_count) == counts[-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name, dtype", CASES)
def test_record_matches_plain_capture_and_changes_nothing(device, name, dtype, kind):
    # The baseline has a plain hook of the same kind: a module with a full backward hook runs its inputs through
    # BackwardHookFunction, which makes self_attn's q, k, v distinct tensors and so takes MHA's unpacked in-projection
    # (other rounding) even when the hook does nothing.
    base = run(name, dtype, device, lambda m, mod, x: register(kind, m, mod, what_record_sees(kind, [])))
    rec = hookstats.record("target")
    items: list = []

    def install(m, mod, x):
        register(kind, m, mod, form(rec, kind))
        register(kind, m, mod, what_record_sees(kind, items))  # after the record hook: sees what it saw

    got = run(name, dtype, device, install)
    assert_runs_bitwise_equal(got, base)
    records = rec.records()
    assert len(records) == len(items) > 0
    for r, (k, i, t) in zip(records, items):
        assert (r["module"], r["kind"], r["index"], r["step"]) == ("target", k, i, 0)
        assert r["histogram"] is None
        assert r["stats"]["numel"] == t.numel()
        assert_record_matches(r, t)
    assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)
    assert len({r["seq"] for r in records}) == len(records)
    assert rec.skipped == 0
    assert rec.first_nonfinite() is None


@pytest.mark.parametrize("kind", KINDS)
def test_fused_clip_under_max_norm_changes_nothing(kind):
    """coef = min(1, ...): when the norm is under max_norm every tensor is multiplied by exactly 1."""
    calls = probe("mlp", torch.float32, "cpu", kind)
    max_norm = 2.0 * max(float(joint_norm(c)) for c in calls)
    fc = hookstats.fused_clip(max_norm)
    got = run("mlp", install=lambda m, mod, x: register(kind, m, mod, form(fc, kind)))
    assert_runs_bitwise_equal(got, run("mlp"))
    assert float(fc.last_norm) < max_norm


@pytest.mark.parametrize("eps", [None, 0.0, 1e-5])
def test_fused_clip_eps(eps):
    """coef = max_norm / (norm + eps): with a norm of 1e-6, PyTorch's eps of 1e-6 halves the coefficient."""
    g = torch.zeros(3, 4, dtype=torch.float64)
    g[1, 2] = 1e-6
    fc = hookstats.fused_clip(1e-7) if eps is None else hookstats.fused_clip(1e-7, eps=eps)
    e = EPS if eps is None else eps
    got = fc.tensor(g)
    assert float(got[1, 2]) == pytest.approx(1e-6 * 1e-7 / (1e-6 + e), rel=1e-12)
    p = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
    p.grad = g.clone()
    fc.post_accumulate(p)
    assert float(p.grad[1, 2]) == pytest.approx(1e-6 * 1e-7 / (1e-6 + e), rel=1e-12)


def test_object_and_backward_form_are_the_same_hook():
    calls = probe("mlp", torch.float32, "cpu", "backward")
    max_norm = 0.5 * float(joint_norm(calls[0]))
    a = run("mlp", install=lambda m, mod, x: mod.register_full_backward_hook(hookstats.fused_clip(max_norm)))
    b = run("mlp", install=lambda m, mod, x: mod.register_full_backward_hook(hookstats.fused_clip(max_norm).backward))
    assert_runs_bitwise_equal(a, b)
    assert changed_keys(a, run("mlp"), torch.float32)


@pytest.mark.parametrize("p", [pytest.param(1.0, id="p1"), pytest.param(INF, id="pinf"), pytest.param(3.0, id="p3")])
@pytest.mark.parametrize("kind", ["backward", "forward", "post_accumulate"])
def test_fused_clip_norm_types(kind, p):
    calls = probe("transformer", torch.float32, "cpu", kind)
    if kind == "post_accumulate":
        max_norm = float(torch.stack([joint_norm(c, p) for c in calls]).median())
    else:
        max_norm = 0.5 * float(joint_norm(calls[0], p))
    fc = hookstats.fused_clip(max_norm, norm_type=p)
    got = run("transformer", install=lambda m, mod, x: register(kind, m, mod, form(fc, kind)))
    norms: list = []
    want = run("transformer", install=lambda m, mod, x: register(kind, m, mod, plain_fused_clip(kind, max_norm,
                                                                                               norms, p=p)))
    assert_runs_close(got, want, torch.float32)
    assert changed_keys(got, run("transformer"), torch.float32)
    assert float(fc.last_norm) == pytest.approx(float(norms[-1]), rel=1e-5)


@pytest.mark.parametrize("kind", ["backward", "forward_pre", "forward"])
def test_fused_clip_per_tensor(kind):
    """self_attn sees three tensors (q, k, v inputs and their grads; its output pair has one tensor): per_tensor
    scales each by its own norm."""
    calls = probe("transformer", torch.float32, "cpu", kind)
    max_norm = 0.5 * min(float(joint_norm([t])) for t in calls[0])
    fc = hookstats.fused_clip(max_norm, per_tensor=True)
    got = run("transformer", install=lambda m, mod, x: register(kind, m, mod, form(fc, kind)))
    norms: list = []
    want = run("transformer", install=lambda m, mod, x: register(kind, m, mod, plain_fused_clip(
        kind, max_norm, norms, per_tensor=True)))
    assert_runs_close(got, want, torch.float32)
    if len(calls[0]) > 1:  # per tensor is not the joint clip
        joint = run("transformer", install=lambda m, mod, x: register(kind, m, mod, plain_fused_clip(
            kind, max_norm, [])))
        assert changed_keys(got, joint, torch.float32)


def test_clip_value_asymmetric_bounds():
    cv = hookstats.clip_value(-0.05, 0.02)
    got = run("mlp", install=lambda m, mod, x: register("backward_pre", m, mod, cv.backward_pre))
    counts: list = []
    want = run("mlp", install=lambda m, mod, x: register("backward_pre", m, mod,
                                                         plain_clip_value("backward_pre", -0.05, 0.02, counts)))
    assert_runs_close(got, want, torch.float32)
    assert changed_keys(got, run("mlp"), torch.float32)
    assert int(cv.last_count) == counts[-1] > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "forward", "backward", "post_accumulate"])
def test_clip_value_bounds_and_count_exactly(kind, dtype):
    """Values on a bound are not clipped, NaN stays NaN and is not counted; the result is torch.clamp's, bit for
    bit."""
    t = torch.tensor([-3.0, -0.5, -0.25, 0.0, -0.0, 0.5, 1.0, 2.0, NAN, INF, -INF], dtype=dtype)
    want = t.clamp(-0.5, 1.0)
    cv = hookstats.clip_value(-0.5, 1.0)
    if kind == "tensor":
        got = cv.tensor(t)
    elif kind == "forward":
        got = cv.forward(nn.Identity(), (t,), t)
    elif kind == "backward":
        got = cv(nn.Identity(), (None, t), (t,))[1]
    else:
        p = nn.Parameter(torch.zeros_like(t))
        p.grad = t.clone()
        assert cv.post_accumulate(p) is None
        got = p.grad
    assert torch.equal(bits(got), bits(want))
    assert cv.last_count.dtype == torch.int64 and int(cv.last_count) == 4  # -3, 2, inf, -inf


# ---------------------------------------------------------------------------------------------------------------
# The PyTorch hook facts people get wrong (docs/guide/hooks-semantics.md)
# ---------------------------------------------------------------------------------------------------------------

def linear_setup(device="cpu", x_requires_grad=True):
    torch.manual_seed(3)
    lin = nn.Linear(8, 4).to(device)
    x = torch.randn(5, 8, device=device, requires_grad=x_requires_grad)
    w = torch.randn(5, 4, device=device)
    return lin, x, w


@pytest.mark.parametrize("device", DEVICES)
def test_linear_full_backward_grad_input_is_the_input_grad_only(device):
    """nn.Linear's full backward hook gets one grad_input entry, the input grad (not weight and bias): fused_clip's
    joint norm is the input grad's norm alone, and the weight and bias grads are left alone."""
    lin, x, w = linear_setup(device)
    (lin(x) * w).sum().backward()
    gx, gw, gb = x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()

    lin, x, w = linear_setup(device)
    seen = []
    lin.register_full_backward_hook(lambda m, gi, go: seen.append(len(gi)))
    rec = hookstats.record("lin")
    lin.register_full_backward_hook(rec)
    (lin(x) * w).sum().backward()
    assert seen == [1]
    got = [(r["kind"], r["index"], r["stats"]["numel"]) for r in rec.records()]
    assert got == [("backward:grad_input", 0, x.numel()), ("backward:grad_output", 0, 5 * 4)]
    assert_record_matches(rec.records()[0], gx)
    assert_record_matches(rec.records()[1], w)  # d(sum(y * w))/dy = w

    max_norm = 0.25 * float(gx.norm())
    lin, x, w = linear_setup(device)
    fc = hookstats.fused_clip(max_norm)
    lin.register_full_backward_hook(fc)
    (lin(x) * w).sum().backward()
    assert float(fc.last_norm) == pytest.approx(float(gx.double().norm()), rel=1e-6)
    assert not mismatch(x.grad, scaled(gx, coef_of(gx.double().norm(), max_norm)), torch.float32)
    assert torch.equal(lin.weight.grad, gw) and torch.equal(lin.bias.grad, gb)


@pytest.mark.parametrize("device", DEVICES)
def test_param_grads_do_not_come_from_grad_input(device):
    """A module's parameter grads come from grad_output, not from grad_input: clipping grad_input (full backward
    hook) leaves the module's own parameter grads alone and scales the grads of the layers before it, while
    clipping grad_output (backward_pre) scales the module's own grads too. To clip parameter grads use the
    post-accumulate form. The backward pre-hook fires before the module's parameter grads exist; when the full
    backward hook fires they may already be accumulated (PyTorch 2.x runs AccumulateGrad nodes first; the order is
    not documented), so a full backward hook must not rely on .grad either way."""
    model, x, _ = build("mlp", device=device)
    seen = []
    model[2].register_full_backward_pre_hook(lambda m, go: seen.append(m.weight.grad))
    loss_of(model(x)).backward()
    assert seen == [None]
    assert model[2].weight.grad is not None

    base = run("mlp", device=device)
    calls = probe("mlp", torch.float32, device, "backward")
    max_norm = 0.5 * float(joint_norm(calls[0]))
    coef = coef_of(joint_norm(calls[0]), max_norm)
    got = run("mlp", device=device, install=lambda m, mod, x: mod.register_full_backward_hook(
        hookstats.fused_clip(max_norm)))
    for k in ("2.weight", "2.bias", "4.weight", "4.bias", "out"):
        assert torch.equal(got[k], base[k]), k
    for k in ("0.weight", "0.bias", "x.grad"):
        assert not mismatch(got[k], scaled(base[k], coef), torch.float32), k

    calls = probe("mlp", torch.float32, device, "backward_pre")
    max_norm = 0.5 * float(joint_norm(calls[0]))
    coef = coef_of(joint_norm(calls[0]), max_norm)
    got = run("mlp", device=device, install=lambda m, mod, x: mod.register_full_backward_pre_hook(
        hookstats.fused_clip(max_norm).backward_pre))
    for k in ("2.weight", "2.bias", "0.weight", "x.grad"):
        assert not mismatch(got[k], scaled(base[k], coef), torch.float32), k
    assert torch.equal(got["4.weight"], base["4.weight"])


@pytest.mark.parametrize("fn", FNS)
def test_no_input_requires_grad_hook_gets_nones(fn):
    """Nothing before nn.Linear requires grad: the full backward hook fires with grad_input (None,), and the hook
    keeps it None (PyTorch raises if such a hook returns a tensor)."""
    obj = {"fused_clip": hookstats.fused_clip(1e-4), "clip_value": hookstats.clip_value(1e-4),
           "record": hookstats.record("first")}[fn]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    spy = []
    model[0].register_full_backward_hook(obj)
    model[0].register_full_backward_hook(lambda m, gi, go: spy.append((gi, go[0].detach().clone())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(model(x)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(spy) == 1 and spy[0][0] == (None,)
    # the direct call says the same: nothing to return
    out = obj(model[0], (None,), (spy[0][1],))
    assert out is None or (isinstance(out, tuple) and all(o is None for o in out))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    loss_of(plain(x)).backward()
    for n, p in plain.named_parameters():
        assert torch.equal(got[n], p.grad), n
    if fn == "record":
        recs = obj.records()
        assert [r["kind"] for r in recs] == ["backward:grad_output", "backward:grad_output"]  # the model call and ours
        assert_record_matches(recs[0], spy[0][1])
        assert obj.skipped == 0


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y=None):
        out = self.lin(x)
        return out if y is None else out + y


@pytest.mark.parametrize("device", DEVICES)
def test_forward_hooks_see_positional_inputs_only(device):
    torch.manual_seed(0)
    m = TwoInputs().to(device)
    x = torch.randn(3, 4, device=device)
    y = torch.randn(3, 4, device=device) * 10
    kw = []
    m.register_forward_pre_hook(lambda mod, args, kwargs: kw.append(sorted(kwargs)), with_kwargs=True)
    rec = hookstats.record("m")
    m.register_forward_pre_hook(rec.forward_pre)
    m(x, y=y)
    assert kw == [["y"]]
    r = rec.records()
    assert [(q["kind"], q["index"]) for q in r] == [("forward_pre", 0)]
    assert_record_matches(r[0], x)
    m(x, y)  # now both are positional
    r = rec.records()
    assert [(q["kind"], q["index"]) for q in r[1:]] == [("forward_pre", 0), ("forward_pre", 1)]
    assert_record_matches(r[2], y)

    # fused_clip.forward_pre clips the positional x only (its norm alone), y passes as it was
    max_norm = 0.5 * float(x.norm())
    fc = hookstats.fused_clip(max_norm)
    h = m.register_forward_pre_hook(fc.forward_pre)
    got = m(x, y=y)
    want = m.lin(scaled(x, coef_of(x.double().norm(), max_norm))) + y
    assert not mismatch(got, want, torch.float32)
    assert float(fc.last_norm) == pytest.approx(float(x.double().norm()), rel=1e-6)
    # positional y: the joint norm of x and y
    got = m(x, y)
    n = joint_norm([x, y])
    c = coef_of(n, max_norm)
    assert not mismatch(got, m.lin(scaled(x, c)) + scaled(y, c), torch.float32)
    h.remove()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["fused_clip", "clip_value"])
def test_post_accumulate_clips_in_place_like_torch_per_parameter(device, fn):
    """Two backward passes into the same grads (accumulation): after each, every parameter's accumulated grad is
    clipped in place, as torch.nn.utils.clip_grad_norm_ / clip_grad_value_ of that one parameter."""
    obj = hookstats.fused_clip(0.05) if fn == "fused_clip" else hookstats.clip_value(0.01)

    def twice(hooked: bool):
        model, x, _ = build("mlp", device=device)
        if hooked:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(obj.post_accumulate)
        for _ in range(2):
            loss_of(model(x)).backward()
            if not hooked:
                for p in model.parameters():
                    if fn == "fused_clip":
                        torch.nn.utils.clip_grad_norm_(p, 0.05)
                    else:
                        torch.nn.utils.clip_grad_value_(p, 0.01)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    got, want = twice(True), twice(False)
    for n in want:
        assert not mismatch(got[n], want[n], torch.float32), n
    model, x, _ = build("mlp", device=device)
    loss_of(model(x)).backward()
    unclipped = {n: p.grad for n, p in model.named_parameters()}
    assert any(mismatch(got[n], unclipped[n], torch.float32) for n in got)

    # in place: the same grad tensor, scaled; returns None
    p = model[2].weight
    g = p.grad
    before = g.clone()
    ptr = g.data_ptr()
    assert obj.post_accumulate(p) is None
    assert p.grad is g and p.grad.data_ptr() == ptr
    if fn == "fused_clip":
        assert not mismatch(g, scaled(before, coef_of(before.double().norm(), 0.05)), torch.float32)
        assert float(obj.last_norm) == pytest.approx(float(before.double().norm()), rel=1e-6)
    else:
        assert torch.equal(g, before.clamp(-0.01, 0.01))
        assert int(obj.last_count) == int((before.abs() > 0.01).sum()) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["fused_clip", "clip_value"])
def test_tensor_form_returns_the_new_grad(device, fn):
    torch.manual_seed(0)
    g = torch.randn(7, 5, device=device)
    keep = g.clone()
    obj = hookstats.fused_clip(0.5) if fn == "fused_clip" else hookstats.clip_value(0.3)
    new = obj.tensor(g)
    assert isinstance(new, torch.Tensor) and new is not g and new.data_ptr() != g.data_ptr()
    assert torch.equal(bits(g), bits(keep)), "the tensor hook modified its argument"
    want = scaled(keep, coef_of(keep.double().norm(), 0.5)) if fn == "fused_clip" else keep.clamp(-0.3, 0.3)
    assert not mismatch(new, want, torch.float32)
    assert mismatch(new, keep, torch.float32)

    # registered on a leaf: its .grad is the returned tensor
    x = torch.randn(7, 5, device=device, requires_grad=True)
    x.register_hook(obj.tensor)
    (x * keep).sum().backward()
    assert not mismatch(x.grad, want, torch.float32)


def direct_calls(obj, t1, t2, t3):
    """Each form called directly, with arguments PyTorch would give it."""
    m = nn.Identity()
    return {
        "backward": lambda: obj(m, (t1, None, t2), (t3,)),
        "backward_pre": lambda: obj.backward_pre(m, (t1, t2)),
        "forward_pre": lambda: obj.forward_pre(m, (t1, t2)),
        "forward": lambda: obj.forward(m, (t3,), (t1, [t2])),
        "tensor": lambda: obj.tensor(t1),
    }


@pytest.mark.parametrize("kind", KINDS[:-1])
@pytest.mark.parametrize("fn", FNS)
def test_forms_do_not_modify_their_arguments(fn, kind):
    torch.manual_seed(0)
    t1, t2, t3 = torch.randn(4, 3) * 3, torch.randn(5) * 3, torch.randn(2) * 3
    keep = [bits(t) for t in (t1, t2, t3)]
    obj = {"fused_clip": hookstats.fused_clip(0.1), "clip_value": hookstats.clip_value(0.1),
           "record": hookstats.record()}[fn]
    out = direct_calls(obj, t1, t2, t3)[kind]()
    assert all(torch.equal(k, bits(t)) for k, t in zip(keep, (t1, t2, t3))), "a hook modified its arguments"
    if fn == "record":
        assert out is None
        return
    news = flat(out)
    assert news and not any(n is t for n in news for t in (t1, t2, t3))
    assert all(n.data_ptr() not in (t1.data_ptr(), t2.data_ptr(), t3.data_ptr()) for n in news)
    if kind == "backward":
        assert isinstance(out, tuple) and len(out) == 3 and out[1] is None  # None entries kept in place


# ---------------------------------------------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------------------------------------------

def objects():
    return [hookstats.fused_clip(1.0), hookstats.clip_value(1.0), hookstats.record("r")]


@pytest.mark.parametrize("nargs", [0, 1, 2, 4])
def test_call_with_wrong_argument_count_is_a_type_error(nargs):
    for obj in objects():
        args = [nn.Identity(), (torch.ones(2),), (torch.ones(2),), None][:nargs]
        with pytest.raises(TypeError) as e:
            obj(*args)
        msg = str(e.value)
        for name in (".tensor", ".post_accumulate", ".forward_pre", ".forward", ".backward_pre"):
            assert name in msg, f"{type(obj).__name__}: {msg!r} does not name {name}"


def test_registered_as_backward_pre_hook_is_a_type_error_at_backward():
    for obj in objects():
        lin = nn.Linear(3, 3)
        lin.register_full_backward_pre_hook(obj)  # the object is the full backward hook; this kind calls it with 2
        with pytest.raises(TypeError):
            lin(torch.randn(2, 3, requires_grad=True)).sum().backward()


def test_tensor_forms_need_a_tensor():
    for obj in objects():
        for bad in (1.0, (torch.ones(2),)):
            with pytest.raises(TypeError):
                obj.tensor(bad)
        for bad in (1.0, None, (torch.ones(2),)):
            with pytest.raises(TypeError):
                obj.post_accumulate(bad)


def test_tensor_forms_pass_none_through():
    """PyTorch calls a tensor hook with grad=None for an output of a multi-output op (chunk, unbind) that the loss
    does not use (test_autograd's test_grad_nonleaf_register_hook): the hook must return None, not abort the
    backward pass."""
    for obj in objects():
        assert obj.tensor(None) is None
        x = torch.randn(4, 3, requires_grad=True)
        a, b = x.chunk(2)
        b.register_hook(obj.tensor)  # b is not used by the loss
        a.register_hook(obj.tensor)
        (a * 2).sum().backward()
        assert torch.equal(x.grad[2:], torch.zeros(2, 3))
        if isinstance(obj, hookstats.record):
            assert [r["kind"] for r in obj.records()] == ["tensor"]  # a's grad only
        else:
            assert torch.all(x.grad[:2] != 0)


@pytest.mark.parametrize("which", ["object", "backward_form"])
def test_legacy_register_backward_hook_is_refused(which):
    for obj in objects():
        lin = nn.Linear(3, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lin.register_backward_hook(obj if which == "object" else obj.backward)
            y = lin(torch.randn(2, 3, requires_grad=True))
        with pytest.raises(RuntimeError, match=r"register_full_backward_hook"):
            y.sum().backward()
    # the same module with the full hook works
    lin = nn.Linear(3, 3)
    lin.register_full_backward_hook(hookstats.fused_clip(1.0))
    lin(torch.randn(2, 3, requires_grad=True)).sum().backward()


def test_bad_constructor_arguments():
    for bad in (-1.0, NAN):
        with pytest.raises(ValueError):
            hookstats.fused_clip(bad)
    for bad in (0, -2.0, NAN):
        with pytest.raises(ValueError):
            hookstats.fused_clip(1.0, norm_type=bad)
    with pytest.raises(ValueError):
        hookstats.fused_clip(1.0, nonfinite="ignore")
    with pytest.raises(ValueError):
        hookstats.fused_clip(1.0, eps=-1.0)
    for args in ((-1.0,), (NAN,), (2.0, 1.0), (NAN, 1.0)):
        with pytest.raises(ValueError):
            hookstats.clip_value(*args)
    with pytest.raises(ValueError):
        hookstats.record(slots=0)
    with pytest.raises((ValueError, TypeError)):
        hookstats.record(histogram="fancy")
    with pytest.raises(ValueError):
        hookstats.record(histogram=(0, (0.0, 1.0)))


def test_nonfinite_policies():
    g = torch.tensor([1.0, NAN, 2.0])
    with pytest.raises(RuntimeError):
        hookstats.fused_clip(1.0, nonfinite="error").tensor(g)
    assert torch.equal(hookstats.fused_clip(1.0, nonfinite="zero").tensor(g), torch.zeros(3))
    assert torch.isnan(hookstats.fused_clip(1.0).tensor(g)).all()  # propagate: NaN coefficient, like torch
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([INF, 1.0, 1.0])
    hookstats.fused_clip(1.0, nonfinite="zero").post_accumulate(p)
    assert torch.equal(p.grad, torch.zeros(3))
    p.grad = torch.tensor([INF, 1.0, 1.0])
    with pytest.raises(RuntimeError):
        hookstats.fused_clip(1.0, nonfinite="error").post_accumulate(p)


# ---------------------------------------------------------------------------------------------------------------
# Removing the handle
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", FNS)
def test_removing_the_handle_removes_every_effect(fn, kind):
    calls = probe("mlp", torch.float32, "cpu", kind)
    obj = {"fused_clip": hookstats.fused_clip(0.1 * float(joint_norm(calls[0]))),
           "clip_value": hookstats.clip_value(0.1 * float(calls[0][0].abs().max())),
           "record": hookstats.record("r")}[fn]
    base = run("mlp")
    model, x, target = build("mlp")
    mod = model.get_submodule(target)

    def once():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        out = model(x)
        loss_of(out).backward()
        res = {"out": out.detach().clone(), "x.grad": x.grad.clone()}
        res.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return res

    if kind == "tensor":
        handles = [x.register_hook(obj.tensor)]
    else:
        handles = register(kind, model, mod, form(obj, kind))
    hooked = once()
    if fn == "record":
        n = len(obj.records())
        assert n > 0
        assert_runs_bitwise_equal(hooked, base)
    else:
        assert changed_keys(hooked, base, torch.float32), "the hook had no effect to remove"
    for h in handles:
        h.remove()
    assert_runs_bitwise_equal(once(), base)
    if fn == "record":
        assert len(obj.records()) == n


# ---------------------------------------------------------------------------------------------------------------
# Structures and non-floating tensors
# ---------------------------------------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["a", "b", "ids"])


class Structured(nn.Module):
    """Returns its outputs in `how`, with non-floating tensors (int64 ids, a bool mask) and non-tensors in it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 6)

    def forward(self, x, ids, mask):
        a = self.lin(x)
        b = torch.tanh(a) * 3
        if self.how == "tuple":
            return (a, ids, (b, "tag"), None)
        if self.how == "list":
            return [a, [b, mask], 7]
        if self.how == "dict":
            return {"a": a, "mask": mask, "inner": {"b": b, "ids": ids}, "n": 3}
        if self.how == "namedtuple":
            return Pair(a, b, ids)
        raise AssertionError(self.how)


def structured_inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    ids = torch.tensor([3, 1, 2])
    mask = torch.tensor([True, False, True])
    return x, ids, mask


def same_structure(a, b) -> None:
    assert type(a) is type(b), f"{type(a)} vs {type(b)}"
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same_structure(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same_structure(a[k], b[k])
    elif not isinstance(a, torch.Tensor):
        assert a == b


@pytest.mark.parametrize("how", ["tuple", "list", "dict", "namedtuple"])
@pytest.mark.parametrize("fn", FNS)
def test_forward_output_structures_are_kept(fn, how):
    torch.manual_seed(1)
    m = Structured(how)
    x, ids, mask = structured_inputs()
    plain_out = m(x, ids, mask)
    floats = [t for t in flat(plain_out) if is_float(t)]
    nonfloats = [t for t in flat(plain_out) if not is_float(t)]
    assert len(floats) == 2 and len(nonfloats) in (1, 2)
    max_norm = 0.5 * float(joint_norm(floats))
    obj = {"fused_clip": hookstats.fused_clip(max_norm), "clip_value": hookstats.clip_value(1.0),
           "record": hookstats.record("s")}[fn]
    m.register_forward_hook(obj.forward)
    out = m(x, ids, mask)
    same_structure(out, plain_out)
    got = flat(out)
    # non-floating tensors pass through untouched, as the same objects
    kept = [t for t in got if not is_float(t)]
    assert len(kept) == len(nonfloats) and all(a is b for a, b in zip(kept, nonfloats))
    if fn == "fused_clip":
        c = coef_of(joint_norm(floats), max_norm)
        want = [scaled(t, c) for t in floats]
    elif fn == "clip_value":
        want = [t.clamp(-1.0, 1.0) for t in floats]
    else:
        want = floats
        assert got[0] is floats[0] or torch.equal(got[0], floats[0])
        recs = obj.records()
        assert obj.skipped == len(nonfloats)
        float_idx = [i for i, t in enumerate(got) if is_float(t)]
        assert [r["index"] for r in recs] == float_idx and [r["kind"] for r in recs] == ["forward", "forward"]
        for r, t in zip(recs, floats):
            assert_record_matches(r, t)
    newf = [t for t in got if is_float(t)]
    for g, w in zip(newf, want):
        assert not mismatch(g, w, torch.float32)
    if fn != "record":
        assert any(mismatch(g, t, torch.float32) for g, t in zip(newf, floats))
    # autograd runs through the kept structure (fused_clip: a constant coefficient; clip_value: through clamp)
    sum(t.sum() for t in newf).backward()
    gx = x.grad.clone()
    x.grad = None
    sum(t.sum() for t in want).backward()
    assert not mismatch(gx, x.grad, torch.float32)


def test_forward_output_torch_return_types_namedtuple_is_kept():
    """torch.max(x, dim) returns what PyTorch documents as a namedtuple (values, indices); a clipping forward hook
    must give back the same type, so that `.values` keeps working downstream."""
    class Max(nn.Module):
        def forward(self, x):
            return torch.max(x, 1)

    x = torch.randn(3, 4) * 5
    for obj in (hookstats.fused_clip(0.1), hookstats.clip_value(0.1)):
        m = Max()
        m.register_forward_hook(obj.forward)
        out = m(x)
        assert type(out) is torch.return_types.max, f"{obj!r} returned {type(out)}"
        assert out.indices is not None


@pytest.mark.parametrize("fn", FNS)
def test_token_ids_pass_through_an_embedding(fn):
    """nn.Embedding's input is int64 token ids: nothing to clip (the hook changes nothing), record skips and counts
    them; its full backward hook gets grad_input (None,)."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    w = torch.randn(2, 3, 4)
    (emb(ids) * w).sum().backward()
    want_out, want_grad = emb(ids).detach().clone(), emb.weight.grad.clone()
    emb.weight.grad = None
    obj = {"fused_clip": hookstats.fused_clip(1e-3), "clip_value": hookstats.clip_value(1e-3),
           "record": hookstats.record("emb")}[fn]
    seen = []
    emb.register_forward_pre_hook(obj.forward_pre)
    emb.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    emb.register_full_backward_hook(obj)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = emb(ids)
        (out * w).sum().backward()
    assert seen[0] is ids
    assert torch.equal(out, want_out)  # nothing to clip, or record: nothing changed
    if fn == "record":
        assert obj.skipped == 1
        recs = obj.records()
        assert [r["kind"] for r in recs] == ["backward:grad_output"]
        assert_record_matches(recs[0], w)
        assert torch.equal(emb.weight.grad, want_grad)
    else:  # the full backward hook got (None,) and returned nothing: the weight grad is the plain one
        assert torch.equal(emb.weight.grad, want_grad)


@pytest.mark.parametrize("fn", FNS)
def test_bool_mask_passes_through_forward_pre(fn):
    """A TransformerEncoderLayer called as layer(x, None, mask): the positional args hold a float tensor, None and a
    bool mask; the mask reaches the layer untouched and only x is clipped / recorded."""
    model, x, _ = build("transformer")
    mask = torch.tensor([[False, False, False, True, True], [False] * 5])
    base = model(x, None, mask).detach().clone()
    max_norm = 0.5 * float(x.detach().norm())
    obj = {"fused_clip": hookstats.fused_clip(max_norm), "clip_value": hookstats.clip_value(0.5),
           "record": hookstats.record("layer")}[fn]
    seen = []
    model.register_forward_pre_hook(obj.forward_pre)
    model.register_forward_pre_hook(lambda m, args: seen.append(args))
    out = model(x, None, mask)
    args = seen[0]
    assert len(args) == 3 and args[1] is None and args[2] is mask
    if fn == "record":
        assert torch.equal(out, base) and args[0] is x
        assert obj.skipped == 1
        recs = obj.records()
        assert [(r["kind"], r["index"]) for r in recs] == [("forward_pre", 0)]
        assert_record_matches(recs[0], x)
        return
    want_x = scaled(x, coef_of(x.double().norm(), max_norm)) if fn == "fused_clip" else x.clamp(-0.5, 0.5)
    assert not mismatch(args[0], want_x, torch.float32)
    assert not mismatch(out, model(want_x.detach(), None, mask), torch.float32)
    assert mismatch(out, base, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Autograd through the forward forms
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_fused_clip_forward_coefficient_is_a_constant_for_autograd(device):
    """y = lin(x) * c with c = min(1, max_norm / (||lin(x)|| + eps)): dL/dx = c * (w @ W), not the derivative
    through the norm."""
    lin, x, w = linear_setup(device)
    y0 = lin(x).detach()
    max_norm = 0.3 * float(y0.norm())
    c = coef_of(y0.double().norm(), max_norm)
    lin.register_forward_hook(hookstats.fused_clip(max_norm).forward)
    y = lin(x)
    assert not mismatch(y, scaled(y0, c), torch.float32)
    (y * w).sum().backward()
    assert not mismatch(x.grad, scaled(w @ lin.weight.detach(), c), torch.float32)
    assert not mismatch(lin.weight.grad, scaled(w.t() @ x.detach(), c), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_value_forward_keeps_autograd_through_clamp(device):
    lin, x, w = linear_setup(device)
    y0 = lin(x).detach()
    lin.register_forward_hook(hookstats.clip_value(0.2).forward)
    y = lin(x)
    assert torch.equal(y, y0.clamp(-0.2, 0.2))
    (y * w).sum().backward()
    inside = (y0.abs() <= 0.2).to(w.dtype)
    assert 0 < int(inside.sum()) < inside.numel()
    assert not mismatch(x.grad, (w * inside) @ lin.weight.detach(), torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# record: histograms, steps, NaN, growth
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hist", ["range", "exp"])
def test_record_histograms_equal_hookstats_histogram(device, hist):
    spec = (16, (-1.0, 1.0)) if hist == "range" else "exp"
    rec = hookstats.record("h", histogram=spec, slots=2)  # past 2 slots: the buffers grow
    items: list = []
    model, x, target = build("mlp", device=device)
    mod = model.get_submodule(target)
    mod.register_full_backward_hook(rec)
    mod.register_full_backward_hook(what_record_sees("backward", items))
    mod.register_forward_hook(rec.forward)
    mod.register_forward_hook(what_record_sees("forward", items))
    for step in range(3):
        rec.step = step
        loss_of(model(x * (step + 1))).backward()
        if step == 1:
            rec.flush()  # histogram rows are added into: a flushed row must start from zero again
    recs = rec.records()
    assert len(recs) == len(items) == 9
    for r, (k, i, t) in zip(recs, items):
        assert r["kind"] == k
        want = hookstats.histogram(t, 16, range=(-1.0, 1.0)) if hist == "range" else hookstats.exp_histogram(t)
        assert r["histogram"] == want.tolist()
        assert sum(r["histogram"]) == t.numel()
        assert_record_matches(r, t)
    assert [r["step"] for r in recs] == [0] * 3 + [1] * 3 + [2] * 3


def test_record_first_nonfinite_and_growth():
    rec = hookstats.record("lin", slots=4)
    lin = nn.Linear(4, 3)
    lin.register_forward_hook(rec.forward)
    xs = [torch.randn(2, 4) for _ in range(20)]
    xs[13][1, 2] = NAN
    outs = []
    for step, x in enumerate(xs):
        rec.step = step
        outs.append(lin(x).detach().clone())
        if step == 12:
            assert rec.first_nonfinite() is None
    recs = rec.records()
    assert len(recs) == 20
    for r, o in zip(recs, outs):
        assert_record_matches(r, o)
    bad = rec.first_nonfinite()
    assert bad is not None and (bad["step"], bad["kind"], bad["module"]) == (13, "forward", "lin")
    assert bad["stats"]["nan_count"] == 3  # one NaN input element reaches every output of its row


@pytest.mark.parametrize("make", [lambda: hookstats.fused_clip(1.0), lambda: hookstats.clip_value(0.5),
                                  lambda: hookstats.record("x")], ids=["fused_clip", "clip_value", "record"])
def test_object_registered_as_forward_hook_is_refused(make):
    lin = torch.nn.Linear(3, 3)
    lin.register_forward_hook(make())
    with pytest.raises(TypeError, match=r"register_forward_hook.*\.forward"):
        lin(torch.randn(2, 3))


def test_record_index_is_the_position_in_what_the_hook_saw():
    seen = {}

    def plain(module, grad_input, grad_output):
        seen["gi"] = [i for i, g in enumerate(grad_input) if g is not None]
        seen["go"] = [i for i, g in enumerate(grad_output) if g is not None]

    rec = hookstats.record("lin")
    lin = torch.nn.Linear(4, 4)
    lin.register_full_backward_hook(plain)
    lin.register_full_backward_hook(rec)
    lin(torch.randn(3, 4, requires_grad=True)).sum().backward()
    got = [(r["kind"], r["index"]) for r in rec.records()]
    want = [("backward:grad_input", i) for i in seen["gi"]] + [("backward:grad_output", i) for i in seen["go"]]
    assert got == want, (got, want)
    # A tuple with a None first: the tensor after it is recorded at index 1.
    rec2 = hookstats.record("t")
    rec2.backward_pre(None, (None, torch.ones(2)))
    assert [(r["kind"], r["index"]) for r in rec2.records()] == [("backward_pre", 1)]
