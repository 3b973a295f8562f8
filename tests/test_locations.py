"""Element locations (hookstats.stats(x, locations=True), stats_into(..., loc=), Monitor(locations=True)): the flat
index of the first largest |x| and of the first NaN/Inf (Note [element locations] in csrc/core/loc_ops.h), against
float64 PyTorch, over dtypes, layouts and sizes; and the Monitor's coordinates, table, JSONL and report."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import DEVICES, DTYPES, assert_stats_close

NAN, INF = float("nan"), float("inf")


def torch_locations(x: torch.Tensor) -> tuple:
    """The rule, written with the torch calls the issue names, in float64: argmax of |x| with NaN taken out (torch's
    argmax would return a NaN's index), the smallest index among ties; the first non-finite by nonzero()."""
    xd = x.detach().to(torch.float64).flatten().cpu()
    a = xd.abs()
    finite_or_inf = ~torch.isnan(xd)
    if finite_or_inf.any():
        a = torch.where(finite_or_inf, a, torch.full_like(a, -1.0))
        amax_i = int(torch.argmax(a))
        # argmax does not promise the first of ties: take the first index holding the maximum
        amax_i = int((a == a[amax_i]).nonzero()[0, 0])
    else:
        amax_i = -1
    bad = torch.isfinite(xd).logical_not().nonzero()
    nf_i = int(bad[0, 0]) if bad.numel() else -1
    return amax_i, nf_i


def got_locations(x: torch.Tensor) -> tuple:
    s = hookstats.stats(x, locations=True)
    assert isinstance(s, hookstats.LocatedStats) and isinstance(s, hookstats.Stats)
    for t in (s.argmax_abs_index, s.first_nonfinite_index):
        assert t.dtype == torch.int64 and t.shape == () and t.device == x.device
    return int(s.argmax_abs_index), int(s.first_nonfinite_index)


def check(x: torch.Tensor) -> None:
    want = torch_locations(x)
    assert tuple(reference.locations(x).tolist()) == want
    assert got_locations(x) == want, f"shape {tuple(x.shape)} strides {x.stride()} {x.dtype}"


def _rand(n: int, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype).to(device)


def _plant(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A few special values at random positions of a contiguous 1-D tensor: a large one, a NaN and an Inf."""
    n = x.numel()
    if n < 4:
        return x
    g = torch.Generator().manual_seed(seed + 1)
    i, j, k = torch.randint(0, n, (3,), generator=g).tolist()
    x[i] = 1000.0
    x[j] = NAN
    x[max(k, j)] = -INF if seed % 2 else INF
    return x


SIZES = [0, 1, 2, 7, 4095, 4096, 4097, 65537, 300_001]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_contiguous(device, dtype, n, isa):
    x = _rand(n, dtype, device, n)
    check(x)
    check(_plant(x.clone(), n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "channels_last", "misaligned", "expanded", "strided", "permuted3"])
def test_layouts(device, dtype, layout):
    base = _rand(4 * 33 * 17 * 9, dtype, device, 7)
    base[1234] = 50.0
    base[999] = NAN
    if layout == "transposed":
        x = base.reshape(4 * 33, 17 * 9).t()
    elif layout == "channels_last":
        x = base.reshape(4, 33, 17, 9).contiguous(memory_format=torch.channels_last)
        x[2, 5, 3, 1] = -70.0
        x[1, 30, 0, 8] = INF
    elif layout == "misaligned":
        x = base[1:]
    elif layout == "expanded":
        x = base[:300].reshape(1, 300).expand(40, 300)
    elif layout == "strided":
        x = base.reshape(4 * 33, 17 * 9)[:, ::3]
    else:
        x = base.reshape(4, 33, 153).permute(2, 0, 1)
    check(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_smallest_index(device, dtype):
    # many equal |x| (small integers of both signs) across chunks and tasks
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (200_003,), generator=g).to(dtype).to(device)
    check(x)
    check(x.flip(0))
    z = torch.zeros(100_000, dtype=dtype, device=device)
    assert got_locations(z) == (0, -1)
    z[70_000] = -0.0
    z[90_001] = -1.0
    z[50_000] = 1.0
    assert got_locations(z) == (50_000, -1)
    check(z.reshape(100, 1000).t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_rules(device, dtype):
    x = torch.ones(10_000, dtype=dtype, device=device)
    x[9000] = NAN
    x[8000] = -INF  # Inf is the largest |x|, and a non-finite
    x[8500] = INF
    assert got_locations(x) == (8000, 8000)
    x[100] = NAN  # NaN is never the argmax
    assert got_locations(x) == (8000, 100)
    allnan = torch.full((5000,), NAN, dtype=dtype, device=device)
    assert got_locations(allnan) == (-1, 0)
    allnan[4321] = 0.0
    assert got_locations(allnan) == (4321, 0)
    allinf = torch.full((5000,), -INF, dtype=dtype, device=device)
    assert got_locations(allinf) == (0, 0)
    assert got_locations(torch.empty(0, dtype=dtype, device=device)) == (-1, -1)
    assert got_locations(torch.tensor(-2.5, dtype=dtype, device=device)) == (0, -1)
    # extremes of the dtype: the largest finite, subnormals
    fi = torch.finfo(dtype)
    y = torch.zeros(3000, dtype=dtype, device=device)
    y[17] = fi.tiny / 4
    assert got_locations(y) == (17, -1)
    y[2999] = -fi.max
    y[5] = fi.max
    assert got_locations(y) == (5, -1)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_unchanged_and_thread_independent(device, restore_threads):
    x = _rand(3_000_017, torch.float32, device, 11)
    x[2_000_000] = 9.0
    x[2_500_000] = -9.0
    x[123] = 9.0  # a tie with a smaller index, in the first task
    plain = hookstats.stats(x)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        s = hookstats.stats(x, locations=True)
        results.append((int(s.argmax_abs_index), int(s.first_nonfinite_index)))
        # a contiguous tensor is read the same way with or without locations: the same bits
        for f in hookstats.STATS_FIELDS:
            a, b = getattr(s, f), getattr(plain, f)
            assert torch.equal(a, b) or (a != a and b != b), f
    assert results == [(123, -1)] * 3
    x[2_900_000] = NAN  # in a late task
    x[1_500_000] = -INF  # in a middle one: the largest |x| and the first non-finite
    x[2_000_001] = INF
    got = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        got.append(got_locations(x))
    assert got == [(1_500_000, 1_500_000)] * 3 == [torch_locations(x)] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_permuted_stats_match_reference(device):
    # read in logical order with locations: the statistics stay within the usual tolerance
    x = _rand(64 * 40 * 33, torch.float32, device, 2).reshape(64, 40, 33).permute(2, 0, 1)
    assert_stats_close(hookstats.stats(x, locations=True), reference.stats(x), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("device", DEVICES)
def test_with_histogram(device, dtype):
    """The kernel that finds locations bins as the one that does not, and as the reference: exponent and range
    histograms (the range ones by exact thresholds on CUDA, counted by ordinal), values on edges included."""
    x = _rand(50_000, dtype, device, 4)
    x[::7] = torch.round(x[::7] * 5) / 5  # on the edges of the 10-bin range
    x[777] = NAN
    s, h = hookstats.stats(x, "exp", locations=True)
    s0, h0 = hookstats.stats(x, "exp")
    assert torch.equal(h, h0)
    assert (int(s.argmax_abs_index), int(s.first_nonfinite_index)) == torch_locations(x)
    for spec in ((10, (-1.0, 1.0)), (600, (-2.0, 2.0))):  # <= 512 bins: thresholds in the CUDA launch; more: not
        s, h = hookstats.stats(x, spec, locations=True)
        assert torch.equal(h, hookstats.stats(x, spec)[1])
        assert torch.equal(h.cpu(), reference.histogram_of(x.cpu(), hookstats.Histogram.range(spec[0], *spec[1])))
        assert int(s.first_nonfinite_index) == 777


def test_unravel_and_coordinates():
    assert hookstats.unravel(0, ()) == ()
    assert hookstats.unravel(-1, (3, 4)) is None
    assert hookstats.unravel(7, (3, 4)) == (1, 3)
    assert hookstats.unravel(torch.tensor(23), (2, 3, 4)) == (1, 2, 3)
    x = torch.zeros(2, 3, 4)
    x[1, 0, 2] = NAN
    x[0, 2, 1] = 4.0
    assert hookstats.stats(x, locations=True).coordinates() == {"argmax_abs": (0, 2, 1), "first_nonfinite": (1, 0, 2)}
    for i in range(24):
        assert hookstats.unravel(i, x.shape) == tuple(int(c) for c in torch.unravel_index(torch.tensor(i), x.shape))
    with pytest.raises(ValueError, match="outside"):
        hookstats.unravel(24, (2, 3, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_locations(device):
    buf = hookstats.stats_buffer(4, device=device)
    loc = hookstats.location_buffer(4, device=device)
    x = _rand(9000, torch.bfloat16, device, 5)
    x[4444] = INF
    hookstats.stats_into(x, buf, 2, loc=loc)
    assert loc[2].tolist() == [4444, 4444]
    assert loc[0].tolist() == [-1, -1]
    y = x.reshape(90, 100).t()
    hookstats.stats_into(y, buf, 1, loc=loc, loc_slot=3)
    assert loc[3].tolist() == list(torch_locations(y))
    ref = hookstats.stats_buffer(4, device=device)
    hookstats.stats_into(x, ref, 2)
    assert torch.equal(buf[2].nan_to_num(), ref[2].nan_to_num())
    hist = hookstats.histogram_buffer(4, "exp", torch.bfloat16, device=device)
    hookstats.stats_into(x, buf, 0, hist, histogram="exp", loc=loc)
    assert loc[0].tolist() == [4444, 4444] and int(hist[0].sum()) == 9000


@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_location_buffer_errors(device):
    x = torch.randn(10, device=device)
    buf = hookstats.stats_buffer(2, device=device)
    with pytest.raises(TypeError, match="int64 location buffer"):
        hookstats.stats_into(x, buf, 0, loc=torch.zeros(2, 2, device=device))
    with pytest.raises(ValueError, match=r"\[slots, 2\]"):
        hookstats.stats_into(x, buf, 0, loc=torch.zeros(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="location slot 5 is out of range"):
        hookstats.stats_into(x, buf, 0, loc=hookstats.location_buffer(2, device=device), loc_slot=5)
    with pytest.raises(TypeError, match="loc must be a tensor"):
        hookstats.stats_into(x, buf, 0, loc=[0, 0])
    with pytest.raises(ValueError, match="slots >= 1"):
        hookstats.location_buffer(0)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and hookstats.cuda_kernels_built()), reason="needs a GPU")
def test_location_buffer_on_other_device():
    with pytest.raises(ValueError, match="location buffer is on"):
        hookstats.stats_into(torch.randn(10, device="cuda"), hookstats.stats_buffer(2, device="cuda"), 0,
                             loc=hookstats.location_buffer(2))


OPCHECK_INPUTS = {
    "fp32_contiguous": lambda d: torch.randn(33, 17, device=d),
    "fp64_transposed": lambda d: torch.randn(17, 33, dtype=torch.float64, device=d).t(),
    "fp16_misaligned": lambda d: torch.randn(1001, device=d).half()[1:],
    "bf16_expanded": lambda d: torch.randn(1, 40, device=d).bfloat16().expand(30, 40),
}


@pytest.mark.parametrize("inp", list(OPCHECK_INPUTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, inp):
    x = OPCHECK_INPUTS[inp](device)
    torch.library.opcheck(torch.ops.hookstats.stats_loc.default, (x,))
    torch.library.opcheck(torch.ops.hookstats.stats_loc.default, (x, 2, 0, 0.0, 0.0))
    buf = hookstats.stats_buffer(3, device=device)
    loc = hookstats.location_buffer(3, device=device)
    torch.library.opcheck(torch.ops.hookstats.stats_into.default,
                          (x, buf, 1, None, 0, 0, 0, 0.0, 0.0, False, None, loc, 2))


def test_compile_fullgraph():
    def f(x):
        v, c, loc, _ = torch.ops.hookstats.stats_loc.default(x)
        return loc * 2, v[0]

    x = torch.randn(1000)
    x[321] = 55.0
    loc, _ = torch.compile(f, fullgraph=True)(x)
    assert loc.tolist() == [642, -2]
    g = torch.compile(lambda x: hookstats.stats(x, locations=True).argmax_abs_index + 1, fullgraph=True)
    assert int(g(x)) == 322


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_more_than_2_31_elements(device):
    # Expanded views (no memory): 3 rows of 2^30 + 1 elements, rows 1 and 2 start past 2^30 and 2^31.
    L = 2**30 + 1
    rows = torch.tensor([[1.0], [-3.0], [NAN]], dtype=torch.bfloat16, device=device)
    x = rows.expand(3, L)
    assert got_locations(x) == (L, 2 * L)
    assert 2 * L > 2**31
    x = torch.tensor([[1.0], [2.0], [-3.0]], dtype=torch.float32, device=device).expand(3, L)
    assert got_locations(x) == (2 * L, -1)


# -- Monitor -------------------------------------------------------------------------------------------------------
class TinyLM(torch.nn.Module):
    def __init__(self, vocab=40, dim=12):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, ids):
        return self.proj(self.embed(ids))


def _run(mon, model, steps=3, bad_step=2, bad=(1, 4, 7), batch=3, tokens=6):
    torch.manual_seed(0)
    for step in range(steps):
        ids = torch.randint(0, 40, (batch, tokens + step))  # the shape changes between steps
        if step == bad_step:
            h = model.embed.register_forward_hook(lambda m, a, out: out.index_put_(
                tuple(torch.tensor([b]) for b in bad), torch.tensor(NAN)), prepend=True)  # before the Monitor's
        model(ids).square().sum().backward()
        if step == bad_step:
            h.remove()
        mon.step()


def test_monitor_locations():
    torch.manual_seed(0)
    model = TinyLM()
    mon = hookstats.Monitor(model, include=["embed", "proj"], kinds=("forward", "backward_pre", "grad"),
                            locations=True)
    _run(mon, model)
    recs = mon.records()
    assert recs and all({"shape", "argmax_abs_index", "first_nonfinite_index"} <= set(r) for r in recs)
    for r in recs:
        assert len(r["shape"]) == (2 if r["kind"] == "grad" else 3)
        assert r["argmax_abs_index"] is None or len(r["argmax_abs_index"]) == len(r["shape"])
        if r["stats"]["nan_count"] + r["stats"]["inf_count"] == 0:
            assert r["first_nonfinite_index"] is None
    fwd = [r for r in recs if r["kind"] == "forward" and r["module"] == "embed"]
    assert [r["shape"] for r in fwd] == [(3, 6, 12), (3, 7, 12), (3, 8, 12)]
    bad = mon.first_nonfinite()
    assert bad["step"] == 2 and bad["module"] == "embed" and bad["kind"] == "forward"
    assert bad["first_nonfinite_index"] == (1, 4, 7)
    assert str(bad) == "step 2, module embed, kind forward, index 0, element (1, 4, 7)"
    # a Monitor without locations: the same statistics, no location keys
    torch.manual_seed(0)
    model2 = TinyLM()
    mon_plain = hookstats.Monitor(model2, include=["embed", "proj"], kinds=("forward", "backward_pre", "grad"))
    _run(mon_plain, model2)
    plain = mon_plain.records()
    assert len(plain) == len(recs)
    for a, b in zip(plain, recs):
        assert "argmax_abs_index" not in a and "shape" not in a
        assert json.dumps(a["stats"]) == json.dumps(b["stats"])  # NaN-safe exact equality
    assert "locations" not in mon_plain.run_info() and mon.run_info()["locations"] is True


def test_monitor_locations_match_stats():
    # every record's location equals hookstats.stats(x, locations=True) of the tensor the hook saw
    torch.manual_seed(1)
    lin = torch.nn.Linear(16, 16)
    seen = []
    lin.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    mon = hookstats.Monitor(lin, kinds=("forward",), locations=True, slots=1)
    for step in range(5):  # slots=1: the buffers grow while recording
        x = torch.randn(4, 3 + step, 16)
        if step == 3:
            x[2, 1, 5] = INF
        lin(x)
        lin(x * 2)
        mon.step()
    recs = mon.records()
    assert len(recs) == len(seen) == 10
    for r, t in zip(recs, seen):
        s = hookstats.stats(t, locations=True).coordinates()
        assert r["argmax_abs_index"] == s["argmax_abs"] and r["first_nonfinite_index"] == s["first_nonfinite"]
        assert r["shape"] == tuple(t.shape)


def test_monitor_locations_grad_with_optimizer_and_many_sites():
    torch.manual_seed(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(70)])  # more sites than the initial rows
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = hookstats.Monitor(model, kinds=("grad",), optimizer=opt, locations=True)
    model(torch.randn(2, 8)).sum().backward()
    model[30].weight.grad[3, 5] = NAN
    opt.step()
    mon.step()
    recs = mon.records()
    assert len(recs) == 140
    for (name, p), r in zip(model.named_parameters(), recs):
        assert r["module"] == name and r["shape"] == tuple(p.shape)
        c = hookstats.stats(p.grad, locations=True).coordinates()
        assert (r["argmax_abs_index"], r["first_nonfinite_index"]) == (c["argmax_abs"], c["first_nonfinite"])
    assert str(mon.first_nonfinite()) == "step 0, module 30.weight, kind grad, index 0, element (3, 5)"


def test_monitor_locations_argument_checks():
    with pytest.raises(TypeError, match="locations must be True or False"):
        hookstats.Monitor(torch.nn.Linear(2, 2), locations=1)


def test_record_hook_locations():
    rec = hookstats.record("x", locations=True)
    t = torch.zeros(2, 3)
    t[1, 2] = -5.0
    rec.forward(None, (), t)
    (r,) = rec.records()
    assert r["argmax_abs_index"] == (1, 2) and r["first_nonfinite_index"] is None and r["shape"] == (2, 3)


def test_table_jsonl_and_report(tmp_path):
    pytest.importorskip("pyarrow")
    from hookstats.runlog import JSONLWriter, read_jsonl
    from hookstats.runlog.schema import table_records

    model = TinyLM()
    path = tmp_path / "log.jsonl"
    mon = hookstats.Monitor(model, include=["embed", "proj"], kinds=("forward",), locations=True,
                            exporters=[JSONLWriter(path)])
    _run(mon, model)
    recs = mon.records()
    t = mon.table()
    for c in ("shape", "argmax_abs_index", "first_nonfinite_index"):
        assert c in t.column_names
    back = table_records(t)
    for a, b in zip(recs, back):
        for c in ("shape", "argmax_abs_index", "first_nonfinite_index"):
            assert a[c] == b[c]
    mon.detach()
    log = read_jsonl(path)
    assert [(r["argmax_abs_index"], r["first_nonfinite_index"], r["shape"]) for r in log.records] == \
        [(r["argmax_abs_index"], r["first_nonfinite_index"], r["shape"]) for r in recs]
    json.dumps(log.records)
    pytest.importorskip("matplotlib")
    from hookstats.export.report import make_report

    out = make_report(tmp_path, fmt="md")
    text = open(out["report.md"]).read()
    assert "step 2, module `embed`, kind forward, element (1, 4, 7) of a (3, 8, 12) tensor" in text


def test_parquet_log_and_report(tmp_path):
    pytest.importorskip("pyarrow")
    from hookstats.runlog import ParquetWriter, read_log

    model = TinyLM()
    mon = hookstats.Monitor(model, include=["embed"], kinds=("forward",), locations=True, flush_every=2,
                            exporters=[ParquetWriter(tmp_path / "log.parquet")])
    _run(mon, model)
    recs = mon.records()
    mon.detach()
    t = read_log(tmp_path / "log.parquet")
    assert t.column("first_nonfinite_index").to_pylist() == [None, None, [1, 4, 7]]
    assert t.column("shape").to_pylist() == [list(r["shape"]) for r in recs]
    assert t.column("argmax_abs_index").to_pylist() == [list(r["argmax_abs_index"]) for r in recs]
    pytest.importorskip("matplotlib")
    from hookstats.export.report import make_report

    text = open(make_report(tmp_path, fmt="md")["report.md"]).read()
    assert "element (1, 4, 7) of a (3, 8, 12) tensor" in text


def test_locations_without_extension_use_the_reference():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["hookstats._C"] = None
        warnings.simplefilter("ignore")
        import hookstats, torch
        assert not hookstats.HAVE_EXTENSION
        x = torch.zeros(3, 4)
        x[2, 1] = float("nan")
        x[1, 3] = -7.0
        s = hookstats.stats(x, locations=True)
        assert isinstance(s, hookstats.LocatedStats) and int(s.numel) == 12 and int(s.nan_count) == 1
        assert s.coordinates() == {"argmax_abs": (1, 3), "first_nonfinite": (2, 1)}, s.coordinates()
        s, h = hookstats.stats(x, "exp", locations=True)
        assert int(s.first_nonfinite_index) == 9 and int(h.sum()) == 12
        buf, loc = hookstats.stats_buffer(2), hookstats.location_buffer(2)
        hookstats.stats_into(x, buf, 1, loc=loc)
        assert loc.tolist() == [[-1, -1], [7, 9]], loc.tolist()
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_unravel_many_equals_unravel_record_by_record():
    """The flush's and the Arrow table's vectorized unravel (hookstats._ops.unravel_many) against hookstats.unravel,
    over records of mixed ndim (0-d included) with and without a location."""
    import numpy as np

    from hookstats._ops import unravel_many
    from hookstats.monitor.block import unravel_rows

    gen = torch.Generator().manual_seed(3)
    shapes = [tuple(int(d) for d in torch.randint(1, 6, (int(torch.randint(0, 5, (1,), generator=gen)),),
                                                  generator=gen)) for _ in range(200)]
    flat = [-1 if torch.rand(1, generator=gen) < 0.2 else
            int(torch.randint(0, max(1, math.prod(s)), (1,), generator=gen)) for s in shapes]
    ndim = np.array([len(s) for s in shapes])
    dims = np.array([d for s in shapes for d in s], dtype=np.int64)
    want = [hookstats.unravel(f, s) for f, s in zip(flat, shapes)]
    assert unravel_rows(np.array(flat), ndim, dims) == want
    coords, valid, off = unravel_many(flat, ndim, dims)
    assert valid.tolist() == [f >= 0 for f in flat] and off[-1] == len(dims)
    assert [tuple(coords[off[i]:off[i + 1]].tolist()) for i in range(len(shapes)) if valid[i]] == \
        [w for w in want if w is not None]
    assert unravel_rows(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
    with warnings.catch_warnings():  # a zero-size record has no location, and no dim is divided by
        warnings.simplefilter("error")
        assert unravel_rows(np.array([-1, 5]), np.array([2, 1]), np.array([0, 4, 7])) == [None, (5,)]
