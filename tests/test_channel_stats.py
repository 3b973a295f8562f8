"""hookstats.channel_stats / channel_stats_into / ChannelCalibrator against plain-PyTorch float64 reductions.

Tolerances: absmax, min, max and the counts exactly; sum_abs and sum_sq relative 2e-6 (float32 accumulation of
pieces, added in float64) plus two ulps of the result dtype for the final cast; 1e-12 for float64 inputs.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookstats
from hookstats import reference
from _testing import DEVICES, DTYPES, result_dtype

FIELDS = hookstats.CHANNEL_FIELDS
EXACT = ("absmax", "min", "max", "nonfinite", "count")


def oracle(x: torch.Tensor, dim: int):
    """The float64 statistics of x (no final rounding): the reference on x converted to float64 exactly."""
    return reference.channel_stats(x.detach().to(torch.float64), dim)


def assert_channel_close(got, ref, dtype, out_dtype=None):
    out_dtype = out_dtype or result_dtype(dtype)
    rel = 1e-12 if dtype == torch.float64 else 2e-6
    eps = torch.finfo(out_dtype).eps
    for f in FIELDS:
        g = getattr(got, f).detach().to(torch.float64).cpu()
        r = getattr(ref, f).detach().to(torch.float64).cpu()
        assert g.shape == r.shape, f"{f}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        if f in EXACT:
            r = r.to(out_dtype).to(torch.float64)
            assert torch.equal(g, r), f"{f} differs: max |diff| {(g - r).abs().nan_to_num().max()}\n{g}\n{r}"
        else:
            tol = (rel + 4 * eps) * r.abs()  # a float32 buffer rounds at each call
            # A true sum that overflows or underflows the result dtype must come out as its rounding (inf or 0).
            rounded = r.to(out_dtype).to(torch.float64)
            bad = ~((g - r).abs() <= tol) & ~((g == rounded) & ((rounded == 0) | torch.isinf(rounded)))
            assert not bad.any(), f"{f}: got {g[bad][:5].tolist()}, expected {r[bad][:5].tolist()}"


def check(x: torch.Tensor, dim: int):
    got = hookstats.channel_stats(x, dim)
    c = x.shape[dim]
    rt = result_dtype(x.dtype)
    for f in FIELDS:
        t = getattr(got, f)
        assert t.shape == (c,), f
        assert t.device == x.device, f
        assert t.dtype == (torch.int64 if f in ("nonfinite", "count") else rt), f
    assert_channel_close(got, oracle(x, dim), x.dtype)
    return got


def randn(*shape, dtype, device, seed=0, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype=dtype, device=device)


# Each layout: (name, builder(dtype, device) -> tensor, dims to test)
LAYOUTS = {
    "contiguous_2d": (lambda dt, dev: randn(37, 300, dtype=dt, device=dev), (0, 1, -1)),
    "btc": (lambda dt, dev: randn(3, 17, 129, dtype=dt, device=dev, seed=1), (-1, 1, 0)),
    "transposed": (lambda dt, dev: randn(300, 41, dtype=dt, device=dev, seed=2).t(), (0, 1)),
    "channels_last": (lambda dt, dev: randn(4, 33, 5, 7, dtype=dt, device=dev, seed=3).to(
        memory_format=torch.channels_last), (1, 0, 3)),
    "expanded": (lambda dt, dev: randn(5, 1, 9, dtype=dt, device=dev, seed=4).expand(5, 11, 9), (0, 1, 2)),
    "expanded_channels": (lambda dt, dev: randn(1, 70, dtype=dt, device=dev, seed=5).expand(30, 70), (0, 1)),
    "misaligned": (lambda dt, dev: randn(50 * 33 + 1, dtype=dt, device=dev, seed=6)[1:].view(50, 33), (0, 1)),
    "step_slice": (lambda dt, dev: randn(40, 90, dtype=dt, device=dev, seed=7)[:, ::3], (0, 1)),
    "step_both": (lambda dt, dev: randn(40, 90, dtype=dt, device=dev, seed=8).t()[::2, 1::3], (0, 1)),
    "permuted_3d": (lambda dt, dev: randn(6, 7, 8, dtype=dt, device=dev, seed=9).permute(2, 0, 1), (0, 1, 2)),
    "one_d": (lambda dt, dev: randn(1000, dtype=dt, device=dev, seed=10), (0,)),
    "one_channel": (lambda dt, dev: randn(500, 1, dtype=dt, device=dev, seed=11), (1, 0)),
    "empty_rows": (lambda dt, dev: torch.empty(0, 5, dtype=dt, device=dev), (1, 0)),
    "empty_channels": (lambda dt, dev: torch.empty(4, 0, 3, dtype=dt, device=dev), (1, 0)),
    "offset_mean": (lambda dt, dev: randn(64, 40, dtype=dt, device=dev, seed=12, offset=1000.0), (1, 0)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(device, dtype, layout, isa):
    build, dims = LAYOUTS[layout]
    x = build(dtype, device)
    for d in dims:
        check(x, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((70001, 8), -1), ((8, 70001), 0), ((300001, 3), 1), ((2, 1100, 1030), -1),
                                       ((16, 64, 65, 3), 1)], ids=["many_rows", "long_runs", "tiny_c", "big_c",
                                                                   "nchw"])
def test_large(device, dtype, shape, dim, isa, restore_threads):
    x = randn(*shape, dtype=dtype, device=device, seed=13)
    got = check(x, dim)
    if device == "cpu":  # bitwise identical whatever the thread count
        torch.set_num_threads(1)
        one = hookstats.channel_stats(x, dim)
        for f in FIELDS:
            assert torch.equal(getattr(one, f), getattr(got, f)), f


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_nonfinite(device, dtype, dim, isa):
    x = randn(200, 70, dtype=dtype, device=device, seed=14)
    x[3, 5] = float("nan")
    x[7, 5] = float("inf")
    x[9, 6] = float("-inf")
    x[:, 10] = float("nan")  # a channel with no finite value (dim=1)
    x[11, :] = float("inf")  # a row of infs (a channel without finite values for dim=0)
    x[150:, 20] = float("-inf")
    got = check(x, dim)
    if dim == 1:
        assert got.nonfinite[10] == 200 and got.absmax[10] == 0
        assert got.min[10] == float("inf") and got.max[10] == float("-inf")
        assert got.nonfinite[5] == 3 and got.nonfinite[0] == 1
        assert math.isfinite(float(got.absmax[5]))
    else:
        assert got.nonfinite[11] == 70 and got.sum_sq[11] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_extreme_magnitudes(device, dtype, dim, isa):
    """Squares of float32 values above 2^64 overflow float32 and those below 2^-63 underflow: the careful path
    keeps sum_sq exact in float64 (the float32 result is inf when the true sum_sq does not fit it)."""
    fi = torch.finfo(dtype)
    x = randn(100, 40, dtype=torch.float64, device="cpu", seed=15)
    x[:, 0] *= fi.max / 8  # near the dtype's max
    x[:, 1] *= fi.tiny * 4  # near the smallest normal
    x[:, 2] = fi.max
    x[:, 3] = fi.smallest_normal / 2  # subnormal (flushed to 0 in the reference only if the dtype has none)
    x[50, 4] = 1e30 if dtype != torch.float16 else 6e4
    x = x.to(dtype=dtype, device=device)
    check(x, dim)
    buf = hookstats.channel_stats_buffer(x.shape[dim], device=device)
    hookstats.channel_stats_into(x, buf, dim)
    assert_channel_close(hookstats.ChannelStats.from_buffer(buf), oracle(x, dim), torch.float64
                         if dtype == torch.float64 else dtype, out_dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("buf_dtype", [torch.float64, torch.float32], ids=["buf64", "buf32"])
def test_into_accumulates(device, dtype, buf_dtype):
    xs = [randn(5, 9, 33, dtype=dtype, device=device, seed=20 + i, scale=1.0 + i) for i in range(3)]
    xs[1][2, 3, 4] = float("nan")
    buf = hookstats.channel_stats_buffer(33, device=device, dtype=buf_dtype)
    for x in xs:
        hookstats.channel_stats_into(x, buf, -1)
    hookstats.channel_stats_into(torch.empty(0, 33, dtype=dtype, device=device), buf, 1)  # changes nothing
    want = oracle(torch.cat(xs), -1)
    assert_channel_close(hookstats.ChannelStats.from_buffer(buf), want, dtype, out_dtype=buf_dtype)


def test_buffer_identities():
    buf = hookstats.channel_stats_buffer(4)
    s = hookstats.ChannelStats.from_buffer(buf)
    assert buf.dtype == torch.float64 and buf.shape == (7, 4)
    assert (s.absmax == 0).all() and (s.min == float("inf")).all() and (s.max == float("-inf")).all()
    assert (s.count == 0).all()


def test_derived():
    x = randn(50, 6, dtype=torch.float32, device="cpu")
    x[0, 0] = float("nan")
    s = hookstats.channel_stats(x)
    xd = x.double()
    fin = torch.isfinite(xd)
    mean_abs = torch.where(fin, xd.abs(), 0).sum(0) / fin.sum(0)
    torch.testing.assert_close(s.mean_abs().double(), mean_abs, rtol=1e-6, atol=0)
    rms = torch.sqrt(torch.where(fin, xd * xd, 0).sum(0) / fin.sum(0))
    torch.testing.assert_close(s.rms().double(), rms, rtol=1e-6, atol=0)
    d = s.to_dict()
    assert d["count"] == [50.0] * 6 and d["nonfinite"][0] == 1.0


def test_errors():
    x = torch.randn(4, 5)
    with pytest.raises(TypeError, match="floating"):
        hookstats.channel_stats(torch.arange(4))
    with pytest.raises(ValueError, match="out of range"):
        hookstats.channel_stats(x, 2)
    with pytest.raises(ValueError, match="0-d"):
        hookstats.channel_stats(torch.tensor(1.0), 0)
    with pytest.raises(TypeError, match="dim must be an int"):
        hookstats.channel_stats(x, (0, 1))
    with pytest.raises(ValueError, match=r"shape \[7, 5\]"):
        hookstats.channel_stats_into(x, hookstats.channel_stats_buffer(4), -1)
    with pytest.raises(TypeError, match="float32 or float64 buffer"):
        hookstats.channel_stats_into(x, torch.zeros(7, 5, dtype=torch.int64), -1)
    with pytest.raises(ValueError, match="out of range"):  # the raw op checks too
        torch.ops.hookstats.channel_stats(x, 5)
    with pytest.raises(TypeError):
        hookstats.channel_stats_buffer(3, dtype=torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for x, dim in [(torch.randn(6, 5, device=device), 1), (torch.randn(3, 4, 5, device=device).transpose(0, 2), 0),
                   (torch.randn(7, 3, dtype=torch.bfloat16, device=device), 0)]:
        torch.library.opcheck(torch.ops.hookstats.channel_stats.default, (x, dim))
        buf = hookstats.channel_stats_buffer(x.shape[dim], device=device)
        torch.library.opcheck(torch.ops.hookstats.channel_stats_into.default, (x, buf, dim),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_compile_traces():
    def f(x, buf):
        hookstats.channel_stats_into(x, buf, -1)
        return hookstats.channel_stats(x * 2, 0).absmax

    x = torch.randn(8, 6)
    buf = hookstats.channel_stats_buffer(6)
    got = torch.compile(f, fullgraph=True, backend="eager")(x, buf)
    torch.testing.assert_close(got, (x * 2).abs().amax(1))
    torch.testing.assert_close(buf[0].float(), x.abs().amax(0))


# ---------------------------------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, idx):
        return self.fc2(self.act(self.fc1(self.emb(idx))))


def test_calibrator_inputs_and_outputs():
    model = Net()
    batches = [torch.randint(0, 20, (4, 7), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ins: dict = {"fc1": [], "fc2": []}
    outs: dict = {"fc1": [], "fc2": []}

    def keep(n):
        def hook(m, a, o):
            ins[n].append(a[0])
            outs[n].append(o)
        return hook

    hs = [getattr(model, n).register_forward_hook(keep(n)) for n in ("fc1", "fc2")]
    with hookstats.ChannelCalibrator(model, include="*Linear*") as cal_in, \
            hookstats.ChannelCalibrator(model, include=("fc*", "emb"), exclude="fc1", on="outputs") as cal_out:
        with torch.no_grad():
            for b in batches:
                model(b)
        res_in, res_out = cal_in.results(), cal_out.results()
    for h in hs:
        h.remove()
    assert sorted(res_in) == ["fc1", "fc2"] and cal_in.calls == {"fc1": 3, "fc2": 3}
    assert sorted(res_out) == ["emb", "fc2"]
    for n in ("fc1", "fc2"):
        want = oracle(torch.cat([t.reshape(-1, t.shape[-1]) for t in ins[n]]), -1)
        assert_channel_close(res_in[n], want, torch.float32, out_dtype=torch.float64)
        assert res_in[n].absmax.device.type == "cpu"
        # what SmoothQuant collects with plain PyTorch: x.abs().amax(dims) + torch.maximum into a buffer
        plain = torch.stack([t.abs().amax(dim=(0, 1)) for t in ins[n]]).amax(0)
        torch.testing.assert_close(res_in[n].absmax.float(), plain, rtol=0, atol=0)
    want = oracle(torch.cat([t.reshape(-1, 8) for t in outs["fc2"]]), -1)
    assert_channel_close(res_out["fc2"], want, torch.float32, out_dtype=torch.float64)
    # removed: more batches change nothing
    before = cal_in.buffers["fc1"].clone()
    model(batches[0])
    assert torch.equal(before, cal_in.buffers["fc1"])


def test_calibrator_conv_channels_and_errors():
    conv = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 4, 1))
    cal = hookstats.ChannelCalibrator(conv, include="*Conv2d*", dim=1)
    xs = [torch.randn(2, 3, 9, 9) for _ in range(2)]
    seen = []
    h = conv[2].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    for x in xs:
        conv(x).sum().backward()
    h.remove()
    stats = cal.stats()
    assert stats["0"].count.tolist() == [2 * 2 * 81.0] * 3
    assert_channel_close(cal.results()["2"], oracle(torch.cat(seen), 1), torch.float32, out_dtype=torch.float64)
    cal.remove()
    with pytest.raises(ValueError, match="no module matches"):
        hookstats.ChannelCalibrator(conv, include="*Linear*")
    with pytest.raises(ValueError, match="on must be"):
        hookstats.ChannelCalibrator(conv, on="grads")
    lin = nn.Linear(4, 4)
    cal = hookstats.ChannelCalibrator(lin, include="*")
    lin(torch.randn(2, 4))
    cal.reset()
    assert cal.buffers == {}
    lin(torch.randn(3, 4))
    assert cal.results()[""].count.tolist() == [3.0] * 4


def test_without_extension_uses_the_reference():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["hookstats._C"] = None
        warnings.simplefilter("ignore")
        import torch, hookstats
        assert not hookstats.HAVE_EXTENSION
        x = torch.tensor([[1.0, -2.0], [float("nan"), 4.0], [-3.0, 0.5]])
        s = hookstats.channel_stats(x, -1)
        assert s.absmax.tolist() == [3.0, 4.0] and s.nonfinite.tolist() == [1, 0] and s.count.tolist() == [3, 3]
        assert s.min.tolist() == [-3.0, -2.0] and s.sum_sq.tolist() == [10.0, 20.25]
        buf = hookstats.channel_stats_buffer(2)
        hookstats.channel_stats_into(x, buf, 1)
        hookstats.channel_stats_into(x, buf, 1)
        assert buf[6].tolist() == [6.0, 6.0] and buf[0].tolist() == [3.0, 4.0] and buf[2].tolist() == [20.0, 40.5]
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
