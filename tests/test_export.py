"""hookstats.export: Monitor records through the exporters and back, checked against independent computations.

JSONL: read_jsonl gives back exactly Monitor.records() / scalars() (NaN and Inf included, strict JSON on disk), the
run header, flush_every, keep_records=False, appending writers, and a run killed with SIGKILL mid-training.
TensorBoard: the event files read back with tensorboard's EventAccumulator: scalar tags and values per record and
statistic, Monitor.log scalars, exponent histograms against floor(log2|x|) of the fed tensor, range histograms
against torch.histc, half types, argument checks, a caller's SummaryWriter left open. W&B: the real wandb package in
offline mode, its run history read back from the run's transaction log (tests/wandb_offline.py), and a fake module
for which run the writer finishes. Exporter and Monitor.log argument checks.
"""
from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
import torch
from torch import nn

import hookstats
from hookstats.runlog import JSONLWriter, read_jsonl

NAN = float("nan")
INF = float("inf")
# What the exporters write as scalars by default (hookstats.export._common.DEFAULT_STATS), spelled out here.
DEFAULT_STATS = ("l2", "linf", "mean", "std", "min", "max", "nan_count", "inf_count", "zero_count")
RECORD_KEYS = {"seq", "step", "module", "kind", "index", "dtype", "stats", "histogram"}


# ---------------------------------------------------------------------------------------------------------------
# Models and helpers
# ---------------------------------------------------------------------------------------------------------------

class Split(nn.Module):
    """Returns two tensors: records with index 0 and 1."""

    def forward(self, x):
        return x * 2, x - 1


class Net(nn.Module):
    """lin -> split (a tuple) -> out; `probe` is an Identity the tests call directly with any tensor they like."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.split = Split()
        self.out = nn.Linear(6, 2)
        self.probe = nn.Identity()

    def forward(self, x):
        a, b = self.split(self.lin(x))
        return self.out(a * b)


def make_net():
    torch.manual_seed(0)
    return Net()


def odd_tensor(dtype):
    """Zeros (both signs), NaN, +-inf, values across many binades, and (float32/float64) subnormals."""
    vals = [0.0, -0.0, NAN, INF, -INF, 1.5, -2.5, 0.25, 3e4, -7e-3, 1.0, -1.0, 0.999, 6e-5]
    if dtype == torch.float32:
        vals += [1e-40, -3e-42, 1.2e-38, 1e30, -2e-45]
    if dtype == torch.float64:
        vals += [1e-310, -5e-324, 1e300, 1e-40]
    g = torch.Generator().manual_seed(3)
    rnd = torch.randn(200, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-20, 20, (200,),
                                                                                           generator=g).double())
    return torch.cat([torch.tensor(vals, dtype=torch.float64), rnd]).to(dtype)


def train(mon, net, steps, nan_step=None, inf_step=None, probe=None):
    """A few steps of training net with mon attached; logs the loss; probe(step) -> tensor fed to net.probe."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(3, 4, generator=g)
        if step == nan_step:
            x[0, 1] = NAN
        if step == inf_step:
            x[1, 2] = INF
        loss = net(x).square().mean()
        loss.backward()
        mon.log("loss", loss)
        if probe is not None:
            net.probe(probe(step))
        mon.step()


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return type(a) is type(b) and a == b


def assert_same_records(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w) == RECORD_KEYS, (set(g), set(w))
        for k in RECORD_KEYS - {"stats"}:
            assert g[k] == w[k], (k, g[k], w[k])
        assert set(g["stats"]) == set(w["stats"]) == set(hookstats.STATS_FIELDS)
        for k, v in w["stats"].items():
            assert same_value(g["stats"][k], v), (k, g["stats"][k], v, w)


def strict_json(line: str):
    def bad(c):
        raise ValueError(f"non-strict JSON constant {c}")

    return json.loads(line, parse_constant=bad)


def tb_reader(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_tensor_name(r) -> str:
    name = r["module"] or "model"
    return f"{name}[{r['index']}]" if r["index"] else name


def f32(v: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def tb_scalar_map(acc) -> dict:
    """{(tag, step): value}, each (tag, step) exactly once."""
    out = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            assert (tag, ev.step) not in out, f"two events for {tag} at step {ev.step}"
            out[(tag, ev.step)] = ev.value
    return out


def tb_hist_map(acc) -> dict:
    out = {}
    for tag in acc.Tags()["histograms"]:
        for ev in acc.Histograms(tag):
            assert (tag, ev.step) not in out, f"two histograms for {tag} at step {ev.step}"
            out[(tag, ev.step)] = ev.histogram_value
    return out


# ---------------------------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("histogram", [None, "exp", (8, (-1.0, 1.0))], ids=["nohist", "exp", "range"])
def test_jsonl_round_trip_equals_records_and_scalars(tmp_path, histogram):
    path = tmp_path / "run" / "log.jsonl"  # the parent folder is made
    net = make_net()
    mon = hookstats.Monitor(net, kinds=("forward", "backward_pre", "grad"), histogram=histogram,
                            exporters=[JSONLWriter(path)])
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    train(mon, net, 5, nan_step=2, inf_step=3, probe=lambda s: odd_tensor(dtypes[s % 4]))
    mon.log("inf_scalar", INF)
    mon.log("nan_scalar", torch.tensor(NAN))
    mon.log("neg_inf", -INF)
    want, want_sc = mon.records(), mon.scalars()
    mon.detach()

    log = read_jsonl(path)
    assert log.bad_lines == 0
    assert_same_records(log.records, want)
    assert len(log.scalars) == len(want_sc) == 5 + 3
    for g, w in zip(log.scalars, want_sc):
        assert set(g) == set(w) == {"seq", "step", "tag", "value"}
        assert (g["seq"], g["step"], g["tag"]) == (w["seq"], w["step"], w["tag"])
        assert same_value(g["value"], w["value"])
    assert [s["value"] for s in log.scalars[-3:]][0] == INF and math.isnan(log.scalars[-2]["value"])
    assert log.scalars[-1]["value"] == -INF

    # Non-finite values made it to the file, and the file is strict JSON throughout.
    assert any(r["stats"]["nan_count"] for r in want) and any(r["stats"]["inf_count"] for r in want)
    assert any(math.isnan(r["stats"]["l2"]) for r in want) and any(r["stats"]["linf"] == INF for r in want)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(want) + len(want_sc)
    for line in lines:
        strict_json(line)

    # The run header.
    info = log.info
    assert info == {k: v for k, v in strict_json(lines[0]).items() if k != "type"}
    assert strict_json(lines[0])["type"] == "run"
    assert info["modules"] == ["", "lin", "split", "out", "probe"] == mon.modules
    assert info["kinds"] == ["forward", "backward_pre", "grad"]
    assert info["stats_fields"] == list(hookstats.STATS_FIELDS)
    assert info["hookstats"] == hookstats.__version__ and info["torch"] == torch.__version__
    assert isinstance(info["time"], float) and abs(info["time"] - time.time()) < 600
    if histogram is None:
        assert info["histogram"] is None
        assert all(r["histogram"] is None for r in log.records)
    elif histogram == "exp":
        assert info["histogram"] == {"kind": "exp"}
        for r in log.records:
            dt = getattr(torch, r["dtype"])
            assert len(r["histogram"]) == hookstats.Histogram.exponent().length(dt)
            assert sum(r["histogram"]) == r["stats"]["numel"]
    else:
        assert info["histogram"] == {"kind": "range", "bins": 8, "lo": -1.0, "hi": 1.0}
        for r in log.records:
            assert len(r["histogram"]) == 8 + 3 and sum(r["histogram"]) == r["stats"]["numel"]
    assert {r["dtype"] for r in log.records} == {"float32", "float16", "bfloat16", "float64"}


def test_jsonl_probe_stats_are_the_tensors(tmp_path):
    """The numbers in the file are the fed tensor's (independently computed), not only equal to records()."""
    path = tmp_path / "log.jsonl"
    net = make_net()
    mon = hookstats.Monitor(net, include="probe", kinds="forward", exporters=[JSONLWriter(path)])
    xs = [odd_tensor(torch.float32), torch.arange(-3.0, 4.0), odd_tensor(torch.float64)]
    for x in xs:
        net.probe(x)
        mon.step()
    mon.detach()
    recs = read_jsonl(path).records
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r, x in zip(recs, xs):
        s = r["stats"]
        assert s["numel"] == x.numel()
        assert s["nan_count"] == int(x.isnan().sum()) and s["inf_count"] == int(x.isinf().sum())
        assert s["zero_count"] == int((x == 0).sum())
    assert recs[1]["stats"]["sum"] == 0.0 and recs[1]["stats"]["min"] == -3.0 and recs[1]["stats"]["max"] == 3.0
    assert recs[1]["stats"]["l2"] == pytest.approx(math.sqrt(28.0), rel=1e-6)
    assert math.isnan(recs[0]["stats"]["sum"]) and math.isnan(recs[2]["stats"]["max"])


def test_flush_every_writes_at_every_nth_step_only(tmp_path):
    path = tmp_path / "log.jsonl"
    net = make_net()
    mon = hookstats.Monitor(net, exporters=[JSONLWriter(path)], flush_every=3)

    def nlines():
        return len(path.read_text().splitlines())

    counts = [nlines()]
    assert counts[0] == 1  # the run header, written when the Monitor attached
    g = torch.Generator().manual_seed(0)
    for _ in range(7):
        loss = net(torch.randn(2, 4, generator=g)).sum()
        loss.backward()
        mon.log("loss", loss)
        assert nlines() == counts[-1]  # nothing written between step() calls
        mon.step()
        mon.drain()  # the writes run on the export thread: wait for them before reading the file
        counts.append(nlines())
    grew = [i + 1 for i in range(7) if counts[i + 1] != counts[i]]
    assert grew == [3, 6], counts
    per_step = (counts[3] - counts[0]) // 3
    assert counts[3] - counts[0] == 3 * per_step and counts[6] - counts[3] == 3 * per_step and per_step > 1
    mon.detach()  # flushes step 6 (the 7th)
    assert nlines() == counts[6] + per_step
    log = read_jsonl(path)
    assert sorted({r["step"] for r in log.records}) == list(range(7))
    assert [s["step"] for s in log.scalars] == list(range(7))


def test_keep_records_false_keeps_nothing_but_the_file_has_everything(tmp_path):
    net = make_net()
    kw = dict(kinds=("forward", "backward_pre", "grad"), histogram="exp")
    kept = hookstats.Monitor(net, exporters=[JSONLWriter(tmp_path / "kept.jsonl")], **kw)
    lean = hookstats.Monitor(net, exporters=[JSONLWriter(tmp_path / "lean.jsonl")], flush_every=2,
                             keep_records=False, **kw)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x = torch.randn(2, 4, generator=g)
        loss = net(x).sum()
        loss.backward()
        for m in (kept, lean):
            m.log("loss", loss)
            m.step()
    want, want_sc = kept.records(), kept.scalars()
    assert lean.records() == [] and lean.scalars() == [] and lean.first_nonfinite() is None
    assert lean._store.blocks == [] and lean._scalars.flushed == []
    lean.detach()
    kept.detach()
    log = read_jsonl(tmp_path / "lean.jsonl")
    assert len(want) > 5
    assert_same_records(log.records, want)
    assert [(s["step"], s["tag"], s["value"]) for s in log.scalars] == \
           [(s["step"], s["tag"], s["value"]) for s in want_sc]


def test_a_resumed_run_appends_and_another_run_is_refused(tmp_path):
    path = tmp_path / "log.jsonl"
    net = make_net()
    m1 = hookstats.Monitor(net, include="lin", kinds="forward", exporters=[JSONLWriter(path)])
    train(m1, net, 2)
    first = m1.records()
    m1.detach()
    before = path.read_text()
    # another run (other modules, a histogram) and a new run of the same options from step 0: refused at the
    # Monitor's construction, before a step, with the file untouched and no hook left
    for kw, why in ((dict(include="out", histogram="exp"), "its histogram is None, this run's is"),
                    (dict(include="lin"), "starts at step 0")):
        with pytest.raises(ValueError, match=why):
            hookstats.Monitor(net, kinds="forward", exporters=[JSONLWriter(path)], **kw)
        assert path.read_text() == before
        assert not any(m._forward_hooks for m in net.modules())
    # the same run resumed at its checkpoint's step appends, keeping the first header and adding its own
    m2 = hookstats.Monitor(net, include="lin", kinds="forward", start_step=2, exporters=[JSONLWriter(path)])
    train(m2, net, 3)
    second = m2.records()
    m2.detach()
    text = path.read_text()
    assert text.startswith(before) and len(text) > len(before)  # appended, nothing rewritten
    heads = [strict_json(l) for l in text.splitlines() if strict_json(l)["type"] == "run"]
    assert [h["start_step"] for h in heads] == [0, 2]
    log = read_jsonl(path)
    assert log.info["modules"] == ["lin"] and log.info["start_step"] == 0  # the first header
    assert_same_records(log.records, first + second)
    assert [r["step"] for r in log.records] == sorted(r["step"] for r in log.records)
    assert len(log.scalars) == 5


def test_jsonl_writer_never_writes_into_a_file_not_its_own(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    f = tmp_path / "x.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), f)
    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    d = tmp_path / "log.parquet"
    d.mkdir()
    for p, why in ((f, "not a hookstats JSONL log"), (other, "not a hookstats JSONL log"), (d, "is a directory")):
        blob = p.read_bytes() if p.is_file() else None
        with pytest.raises(ValueError, match=why):
            JSONLWriter(p)
        if blob is not None:
            assert p.read_bytes() == blob
    assert pq.read_table(f).num_rows == 2
    JSONLWriter(tmp_path / "empty.jsonl").close()  # an empty file (created, never begun) is a new log
    JSONLWriter(tmp_path / "empty.jsonl").close()


def test_read_jsonl_skips_a_cut_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    net = make_net()
    mon = hookstats.Monitor(net, kinds="forward", exporters=[JSONLWriter(path)])
    train(mon, net, 2)
    want = mon.records()
    mon.detach()
    text = path.read_text()
    path.write_text(text + text.splitlines()[-2][:37])  # a record line cut short
    log = read_jsonl(path)
    assert log.bad_lines == 1
    assert_same_records(log.records, want)


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import hookstats
    from hookstats.export import JSONLWriter, ParquetWriter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    writer = ParquetWriter(sys.argv[1]) if sys.argv[2:] == ["parquet"] else JSONLWriter(sys.argv[1])
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre", "grad"), histogram="exp",
                            exporters=[writer], flush_every=1)
    step = 0
    while True:
        x = torch.randn(8, 16)
        loss = model(x).square().sum()
        loss.backward()
        mon.log("loss", loss)
        mon.step()
        if step % 2:  # the export thread has written every flush so far: what is printed must be on disk
            mon.drain()
            print(step, flush=True)
        step += 1
""")


def _kill_expected_per_step() -> int:
    """Records one step of the subprocess's model gives (same model, same Monitor)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre", "grad"), histogram="exp")
    model(torch.randn(8, 16)).square().sum().backward()
    n = len(mon.records())
    mon.detach()
    return n


def _train_and_kill(path, fmt: str) -> int:
    """Runs _KILL_SCRIPT writing `path` (fmt "jsonl" or "parquet"), SIGKILLs it a little after it printed its sixth
    drained step, and returns the last step it printed (every flush up to it was written)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(path), fmt], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0, cwd=os.path.dirname(str(path)), env=env)
    printed: list[int] = []
    buf = b""
    deadline = time.monotonic() + 120
    try:
        while len(printed) < 6:
            left = deadline - time.monotonic()
            assert left > 0, f"the training subprocess printed only {printed}"
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the training subprocess exited: rc={proc.wait()}, stderr={proc.stderr.read()[-3000:]!r}"
            buf += chunk
            *done, buf = buf.split(b"\n")
            printed += [int(s) for s in done]
        time.sleep(0.02)  # let it get somewhere into the following steps (flushes in flight on the export thread)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert printed == list(range(1, 2 * len(printed), 2))  # drained (and printed) at every odd step
    return printed[-1]


def test_sigkill_leaves_every_flushed_step_complete(tmp_path):
    path = tmp_path / "log.jsonl"
    expected = _kill_expected_per_step()
    assert expected == 4 + 4 + 4  # forward of "", 0, 1, 2; backward_pre of the same; 4 parameter grads
    last_done = _train_and_kill(path, "jsonl")

    raw = path.read_bytes().decode("utf-8", errors="replace")
    lines = raw.split("\n")
    complete, tail = lines[:-1], lines[-1]  # tail: "" when the file ends with a newline, else a cut line
    for line in complete:
        strict_json(line)
    log = read_jsonl(path)
    assert log.bad_lines <= 1
    if not tail:
        assert log.bad_lines == 0
    per_step: dict[int, int] = {}
    for r in log.records:
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    steps = sorted(per_step)
    assert steps == list(range(len(steps))) and len(steps) >= last_done + 1
    for s in range(last_done + 1):  # flushed before the subprocess said so: complete
        assert per_step[s] == expected, (s, per_step)
    for s in steps[last_done + 1:]:  # flushed after the last line we read (the kill may have cut the last one)
        assert per_step[s] <= expected
    assert all(per_step[s] == expected for s in steps[:-1])  # only the very last step may be cut
    loss_steps = [s["step"] for s in log.scalars]
    assert loss_steps[: last_done + 1] == list(range(last_done + 1))
    assert log.info["modules"] == ["", "0", "1", "2"]


# ---------------------------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture()
def TensorBoardWriter():
    pytest.importorskip("tensorboard", reason="needs the tensorboard package")
    from hookstats.export import TensorBoardWriter

    return TensorBoardWriter


def test_tensorboard_scalars_equal_each_record_stat(tmp_path, TensorBoardWriter):
    logdir = tmp_path / "tb"
    net = make_net()
    mon = hookstats.Monitor(net, kinds=("forward", "backward_pre", "grad"), exporters=[TensorBoardWriter(logdir)],
                            flush_every=2)
    train(mon, net, 5, nan_step=3, inf_step=1)
    recs, scs = mon.records(), mon.scalars()
    mon.detach()
    acc = tb_reader(logdir)
    got = tb_scalar_map(acc)

    want = {}
    for r in recs:
        for stat in DEFAULT_STATS:
            key = (f"{r['kind']}.{stat}/{tb_tensor_name(r)}", r["step"])
            assert key not in want
            want[key] = float(r["stats"][stat])
    for s in scs:
        want[(s["tag"], s["step"])] = s["value"]
    assert set(got) == set(want)
    for key, v in want.items():
        assert same_value(float(got[key]), f32(v)), (key, got[key], v)
    tags = set(acc.Tags()["scalars"])
    assert {"forward.l2/split", "forward.l2/split[1]", "backward_pre.max/split[1]", "grad.std/lin.weight",
            "forward.nan_count/model", "loss"} <= tags
    assert math.isnan(got[("forward.l2/out", 3)])
    assert got[("forward.nan_count/lin", 3)] == 6.0  # one NaN in x: a full row of lin's output
    assert got[("forward.inf_count/lin", 1)] > 0
    assert acc.Tags()["histograms"] == []  # no histogram configured
    assert [ev.step for ev in acc.Scalars("loss")] == [0, 1, 2, 3, 4]


def test_tensorboard_exponent_histograms_match_log2(tmp_path, TensorBoardWriter):
    logdir = tmp_path / "tb"
    net = make_net()
    mon = hookstats.Monitor(net, include="probe", kinds="forward", histogram="exp",
                            exporters=[TensorBoardWriter(logdir)])
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    fed = []
    for dt in dtypes:
        x = odd_tensor(dt)
        fed.append(x)
        net.probe(x)
        mon.step()
    net.probe(torch.zeros(5))  # nothing to bin: no histogram event
    mon.step()
    mon.detach()
    acc = tb_reader(logdir)
    assert acc.Tags()["histograms"] == ["forward.log2abs/probe"]
    events = acc.Histograms("forward.log2abs/probe")
    assert [e.step for e in events] == [0, 1, 2, 3]
    for ev, x, dt in zip(events, fed, dtypes):
        h = ev.histogram_value
        lay = hookstats.exp_layout(dt)
        xd = x.double()  # exact
        nonzero_finite = xd[(xd != 0) & xd.isfinite()]
        expect_num = x.numel() - int((x == 0).sum()) - int(x.isnan().sum()) - int(x.isinf().sum())
        assert h.num == sum(h.bucket) == expect_num == nonzero_finite.numel()
        sub = nonzero_finite.abs() < 2.0 ** lay.emin
        e = torch.floor(torch.log2(nonzero_finite[~sub].abs()))
        assert len(h.bucket) == len(h.bucket_limit)
        n_sub = int(sub.sum())
        if dt in (torch.float32, torch.float64):
            assert n_sub > 0
        for lim, c in zip(h.bucket_limit, h.bucket):
            if lim == lay.emin and n_sub:  # the subnormal bucket, just below the smallest normal exponent
                assert c == n_sub
            else:
                assert c == int((e == lim - 1).sum()), (dt, lim, c)
        assert list(h.bucket_limit) == [float(v) for v in range(int(h.bucket_limit[0]), int(h.bucket_limit[-1]) + 1)]
        assert h.max == float(e.max()) + 1 == h.bucket_limit[-1]
        if n_sub:
            assert h.min < lay.emin and h.bucket_limit[0] == lay.emin
        else:
            assert h.min == float(e.min()) and h.bucket_limit[0] == h.min + 1


def _range_inputs():
    g = torch.Generator().manual_seed(5)
    mixed = torch.cat([torch.tensor([-1.0, 1.0, 0.0, -0.25, 0.25, -1.5, 2.0, NAN, INF, -INF, 1.0000001]),
                       torch.rand(300, generator=g) * 3 - 1.5])
    inside = torch.rand(200, generator=g) * 1.8 - 0.9
    inside[:2] = torch.tensor([-1.0, 1.0])
    both_finite = torch.cat([torch.rand(100, generator=g) * 4 - 2, torch.tensor([-3.0, 5.0])])
    only_over = torch.rand(50, generator=g) * 1.5
    return [("mixed", mixed), ("inside", inside), ("both_finite", both_finite), ("only_over", only_over),
            ("fp16", (torch.randn(300, generator=g) * 0.8).half()),
            ("bf16", (torch.randn(300, generator=g) * 0.8).bfloat16()),
            ("fp64", torch.randn(300, generator=g, dtype=torch.float64) * 0.7)]


def test_tensorboard_range_histograms_match_histc(tmp_path, TensorBoardWriter):
    logdir = tmp_path / "tb"
    net = make_net()
    mon = hookstats.Monitor(net, include="probe", kinds="forward", histogram=(8, (-1.0, 1.0)),
                            exporters=[TensorBoardWriter(logdir)])
    inputs = _range_inputs()
    for _, x in inputs:
        net.probe(x)
        mon.step()
    mon.detach()
    acc = tb_reader(logdir)
    assert acc.Tags()["histograms"] == ["forward.hist/probe"]
    events = acc.Histograms("forward.hist/probe")
    assert [e.step for e in events] == list(range(len(inputs)))
    edges = [-1.0 + 0.25 * (i + 1) for i in range(8)]
    for ev, (name, x) in zip(events, inputs):
        h = ev.histogram_value
        xd = x.double()
        fin = xd[xd.isfinite()]
        inrange = fin[(fin >= -1) & (fin <= 1)]
        want_in = torch.histc(inrange, 8, -1.0, 1.0).long().tolist()
        under, over = int((xd < -1).sum()), int((xd > 1).sum())  # -inf / +inf included
        assert len(h.bucket) == 8 + (under > 0) + (over > 0), name
        i0 = 1 if under else 0
        assert [int(c) for c in h.bucket[i0:i0 + 8]] == want_in, name
        assert list(h.bucket_limit[i0:i0 + 8]) == pytest.approx(edges, abs=1e-12)
        if under:
            assert h.bucket[0] == under and h.bucket_limit[0] == -1.0
        if over:
            assert h.bucket[-1] == over
        assert h.num == sum(h.bucket) == x.numel() - int(x.isnan().sum())
        if x.isfinite().all():
            assert h.min == (float(xd.min()) if under else -1.0), name
            assert h.max == (float(xd.max()) if over else 1.0), name
            if over:
                assert h.bucket_limit[-1] == float(xd.max())
            tol = 1e-5 * float(xd.abs().sum()) + 1e-6
            assert h.sum == pytest.approx(float(xd.sum()), abs=tol), name
            assert h.sum_squares == pytest.approx(float((xd * xd).sum()), rel=1e-5), name
        else:
            assert math.isfinite(h.min) and math.isfinite(h.max) and h.max >= h.bucket_limit[-2]
    # the ones with no underflow / overflow really have none of those buckets
    by_name = dict(zip([n for n, _ in inputs], events))
    assert len(by_name["inside"].histogram_value.bucket) == 8
    assert len(by_name["only_over"].histogram_value.bucket) == 9
    assert len(by_name["both_finite"].histogram_value.bucket) == 10


def test_tensorboard_half_types_through_a_model(tmp_path, TensorBoardWriter):
    for dt in (torch.float16, torch.bfloat16):
        logdir = tmp_path / str(dt)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).to(dt)
        mon = hookstats.Monitor(model, kinds=("forward", "backward_pre", "grad"), histogram="exp",
                                exporters=[TensorBoardWriter(logdir)])
        for _ in range(2):
            model(torch.randn(3, 4).to(dt)).float().sum().backward()
            mon.step()
        recs = mon.records()
        mon.detach()
        assert {r["dtype"] for r in recs} == {str(dt).replace("torch.", "")}
        acc = tb_reader(logdir)
        got = tb_scalar_map(acc)
        for r in recs:
            assert same_value(float(got[(f"{r['kind']}.l2/{tb_tensor_name(r)}", r["step"])]), f32(r["stats"]["l2"]))
        hists = tb_hist_map(acc)
        assert len(hists) == len(recs)
        for r in recs:
            h = hists[(f"{r['kind']}.log2abs/{tb_tensor_name(r)}", r["step"])]
            s = r["stats"]
            assert h.num == s["numel"] - s["zero_count"] - s["nan_count"] - s["inf_count"]


def test_tensorboard_writer_rejects_unknown_stats(tmp_path, TensorBoardWriter):
    with pytest.raises(ValueError, match="bogus"):
        TensorBoardWriter(tmp_path / "tb", stats=("l2", "bogus"))
    assert not (tmp_path / "tb").exists()
    w = TensorBoardWriter(tmp_path / "tb2", stats=("l1", "var"))  # any STATS_FIELDS
    net = make_net()
    mon = hookstats.Monitor(net, include="lin", kinds="forward", exporters=[w])
    train(mon, net, 1)
    mon.detach()
    assert set(tb_reader(tmp_path / "tb2").Tags()["scalars"]) == {"forward.l1/lin", "forward.var/lin", "loss"}


def test_tensorboard_callers_summary_writer_stays_open(tmp_path, TensorBoardWriter):
    from torch.utils.tensorboard import SummaryWriter

    sw = SummaryWriter(log_dir=str(tmp_path / "tb"))
    tbw = TensorBoardWriter(writer=sw)
    assert tbw.log_dir == str(tmp_path / "tb")
    net = make_net()
    mon = hookstats.Monitor(net, include="out", kinds="forward", exporters=[tbw])
    train(mon, net, 2)
    mon.detach()
    assert sw.file_writer is not None and sw.all_writers is not None  # SummaryWriter.close() sets both to None
    sw.add_scalar("mine", 7.0, 5)
    sw.flush()
    files = [f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out.tfevents")]
    assert len(files) == 1  # the same file: not closed and reopened
    acc = tb_reader(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("mine")] == [(5, 7.0)]
    assert [e.step for e in acc.Scalars("forward.l2/out")] == [0, 1]
    sw.close()

    own = TensorBoardWriter(tmp_path / "own")
    mon = hookstats.Monitor(make_net(), exporters=[own])
    mon.detach()
    assert own.writer.all_writers is None  # a writer it made itself is closed


# ---------------------------------------------------------------------------------------------------------------
# Weights & Biases
# ---------------------------------------------------------------------------------------------------------------

class FakeHistogram:
    def __init__(self, sequence=None, np_histogram=None, num_bins=64):
        assert sequence is None, "the exporter must pass its own bins"
        self.np_histogram = np_histogram


class FakeRun:
    def __init__(self):
        self.logged = []
        self.finished = 0
        self.config = types.SimpleNamespace(updates=[])
        self.config.update = lambda d, allow_val_change=False: self.config.updates.append(d)

    def log(self, d, step=None):
        assert self.finished == 0, "log after finish"
        self.logged.append((step, dict(d)))

    def finish(self):
        self.finished += 1


def fake_wandb():
    mod = types.ModuleType("wandb")
    mod.run = None
    mod.init_calls = []
    mod.runs = []

    def init(**kw):
        mod.init_calls.append(kw)
        r = FakeRun()
        mod.runs.append(r)
        return r

    mod.init = init
    mod.Histogram = FakeHistogram
    return mod


def test_wandb_writer_logs_what_tensorboard_gets(tmp_path, monkeypatch, TensorBoardWriter):
    """The real wandb package, offline (no network): the run's history read back from its transaction log
    (tests/wandb_offline.py) holds every statistic and histogram TensorBoard got, at the same steps."""
    try:
        import wandb
    except ImportError:
        pytest.skip("wandb is not installed (pip install wandb: it is in the test dependencies)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import wandb_offline
    finally:
        sys.path.pop(0)
    from hookstats.export import WandbWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    ww = WandbWriter(project="hookstats-test", mode="offline", dir=str(tmp_path))
    assert ww.run is wandb.run and ww.run.offline
    net = make_net()
    mon = hookstats.Monitor(net, kinds=("forward", "backward_pre", "grad"), histogram="exp",
                            exporters=[ww, TensorBoardWriter(tmp_path / "tb")], flush_every=2)
    assert ww.run.config["hookstats"]["modules"] == mon.run_info()["modules"]
    train(mon, net, 5, nan_step=2)
    recs = mon.records()
    mon.detach()
    assert wandb.run is None  # finished: the writer made it

    # wandb's service process writes the transaction log; on a busy machine its last records can land a moment
    # after finish() returns (seen twice under load): read until every step is there, for a few seconds at most.
    for _ in range(40):
        hist = wandb_offline.history(str(tmp_path))
        steps = [row["_step"] for row in hist]
        if steps == [0, 1, 2, 3, 4]:
            break
        time.sleep(0.25)
    assert steps == [0, 1, 2, 3, 4], (steps, [sorted(row)[:3] for row in hist])  # in increasing step order
    acc = tb_reader(tmp_path / "tb")
    tb_sc, tb_h = tb_scalar_map(acc), tb_hist_map(acc)
    logged, hists = {}, {}
    for row in hist:
        for k, v in row.items():
            if k.startswith("_"):
                continue
            base, _, leaf = k.rpartition("/")
            if leaf in ("_type", "bins", "values") and any(f"{base}/{x}" in row for x in ("bins", "values")):
                hists.setdefault((base, row["_step"]), {})[leaf] = v
            else:
                logged[(k, row["_step"])] = v
    assert set(logged) == set(tb_sc)
    assert set(hists) == set(tb_h) and len(hists) > 10
    for r in recs:
        for stat in DEFAULT_STATS:
            v = logged[(f"{r['kind']}.{stat}/{tb_tensor_name(r)}", r["step"])]
            want = float(r["stats"][stat])
            assert same_value(float(v), want) or (isinstance(v, str) and math.isnan(want)), (r, stat, v)
    for key, h in hists.items():
        assert h["_type"] == "histogram"
        counts, edges = h["values"], h["bins"]
        assert len(edges) == len(counts) + 1 and all(b > a for a, b in zip(edges, edges[1:]))
        t = tb_h[key]
        assert counts == [int(c) for c in t.bucket]
        assert f32(edges[0]) == f32(t.min) and [f32(e) for e in edges[1:]] == [f32(e) for e in t.bucket_limit]
    for (tag, s), v in logged.items():
        if tag == "loss":
            assert same_value(float(v), [x for x in mon.scalars() if x["step"] == s][0]["value"])


def test_wandb_writer_finishes_only_its_own_run(monkeypatch):
    fake = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from hookstats.export import WandbWriter

    theirs = FakeRun()
    fake.run = theirs  # wandb.init() already called by the user
    w = WandbWriter()
    assert w.run is theirs and fake.init_calls == []
    mon = hookstats.Monitor(make_net(), include="lin", kinds="forward", exporters=[w])
    train(mon, mon._model, 2)
    mon.detach()
    assert theirs.finished == 0 and [s for s, _ in theirs.logged] == [0, 1]

    explicit = FakeRun()
    w = WandbWriter(run=explicit, stats=("l1",), histograms=False)
    mon = hookstats.Monitor(make_net(), include="lin", kinds="forward", histogram="exp", exporters=[w])
    train(mon, mon._model, 1)
    mon.detach()
    assert explicit.finished == 0 and theirs.finished == 0
    assert explicit.logged == [(0, {"forward.l1/lin": explicit.logged[0][1]["forward.l1/lin"],
                                    "loss": explicit.logged[0][1]["loss"]})]

    fake.run = None
    w = WandbWriter(name="x")
    mon = hookstats.Monitor(make_net(), include="lin", kinds="forward", exporters=[w])
    mon.detach()
    assert fake.init_calls == [{"name": "x"}] and fake.runs[0].finished == 1


def test_wandb_writer_without_wandb_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    from hookstats.export import WandbWriter

    with pytest.raises(ImportError, match="pip install wandb"):
        WandbWriter()


# ---------------------------------------------------------------------------------------------------------------
# Exporter and Monitor.log argument checks
# ---------------------------------------------------------------------------------------------------------------

def test_exporter_validation():
    net = make_net()
    with pytest.raises(TypeError, match="write"):
        hookstats.Monitor(net, exporters=[object()])
    with pytest.raises(ValueError, match="keep_records=False"):
        hookstats.Monitor(net, keep_records=False)
    for bad in (0, -1, 2.0, "3"):
        with pytest.raises(ValueError, match="flush_every"):
            hookstats.Monitor(net, flush_every=bad)
    # nothing was attached by the failed constructions
    for m in net.modules():
        assert not m._forward_hooks and not m._backward_pre_hooks

    class WriteOnly:  # begin/close are optional
        def __init__(self):
            self.calls = []

        def write(self, records, scalars):
            self.calls.append((list(records), list(scalars)))

    w = WriteOnly()
    mon = hookstats.Monitor(net, include="lin", kinds="forward", exporters=[w], keep_records=False)
    assert mon.flush() == [] and w.calls == []  # nothing new: write() is not called
    train(mon, net, 2)
    mon.detach()
    assert len(w.calls) == 1
    recs, scs = w.calls[0]
    assert [(r["step"], r["module"]) for r in recs] == [(0, "lin"), (1, "lin")]
    assert [(s["step"], s["tag"]) for s in scs] == [(0, "loss"), (1, "loss")]


def test_log_argument_checks_and_copy():
    net = make_net()
    mon = hookstats.Monitor(net, include="lin", kinds="forward")
    for bad_tag in ("", None, 3, b"x"):
        with pytest.raises(TypeError, match="tag"):
            mon.log(bad_tag, 1.0)
    with pytest.raises(ValueError, match="one-element"):
        mon.log("v", torch.ones(2))
    with pytest.raises(ValueError, match="one-element"):
        mon.log("v", torch.ones(0))
    for bad in ("1.0", None, True, [1.0]):
        with pytest.raises(TypeError, match="tensor or a number"):
            mon.log("v", bad)
    assert mon.scalars() == []

    t = torch.tensor(1.5)
    mon.log("a", t)
    t.add_(1.0)  # in place, after logging
    u = torch.ones(1, 1, dtype=torch.float16) * 3
    mon.log("b", u)
    u.zero_()
    mon.log("c", 4)
    mon.step()
    mon.log("d", torch.tensor(2.0, dtype=torch.bfloat16, requires_grad=True) * 1)
    assert [(s["step"], s["tag"], s["value"]) for s in mon.scalars()] == \
           [(0, "a", 1.5), (0, "b", 3.0), (0, "c", 4.0), (1, "d", 2.0)]
    mon.detach()
    with pytest.raises(RuntimeError, match="detach"):
        mon.log("late", 1.0)
    assert len(mon.scalars()) == 4


def test_failed_exporter_begin_leaves_no_hooks(tmp_path):
    w = JSONLWriter(tmp_path / "log.jsonl")
    hookstats.Monitor(make_net(), exporters=[w]).detach()  # closes w
    net = make_net()
    with pytest.raises(RuntimeError, match="closed"):
        hookstats.Monitor(net, exporters=[w])
    for m in net.modules():
        assert not m._forward_hooks and not m._backward_pre_hooks, "hooks left by the failed Monitor"
