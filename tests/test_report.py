"""hookstats.export.plots and make_report: runs of a small MLP recorded with Monitor + JSONLWriter (no histogram,
exponent and range histograms, a NaN batch), turned into PNGs, report.md and report.html."""
from __future__ import annotations

import math
import os
import shutil
from html.parser import HTMLParser

import pytest
import torch

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")
from PIL import ImageStat  # noqa: E402

import hookstats  # noqa: E402
from hookstats.runlog import JSONLWriter, read_jsonl  # noqa: E402
from hookstats.export import plots  # noqa: E402
from hookstats.export.report import make_report  # noqa: E402
from hookstats.monitor import summary_cells, summary_rows  # noqa: E402

HIDDEN = 16
PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def _train(run_dir, histogram=None, steps=4, nan_step=None):
    """A 3-layer MLP trained for `steps` steps with a Monitor writing run_dir/log.jsonl. Returns {(param, step):
    l2 norm of its .grad} (torch.linalg.vector_norm, before the optimizer step). The optimizer skips steps with
    non-finite grads (as GradScaler does), so only nan_step holds NaN."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = {}
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre", "grad"), histogram=histogram,
                            exporters=[JSONLWriter(os.path.join(run_dir, "log.jsonl"), fsync=False)], flush_every=2)
    for step in range(steps):
        x = torch.randn(6, 8)
        if step == nan_step:
            x[0, 0] = float("nan")
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            grads[(name, step)] = torch.linalg.vector_norm(p.grad.double()).item()
        mon.log("loss", loss)
        mon.log("lr", 0.1)
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
        mon.step()
    mon.detach()
    return grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, hist, nan_step in (("plain", None, None), ("exp", "exp", 2), ("range", (16, (-2.0, 2.0)), None)):
        d = str(base / name)
        out[name] = (d, _train(d, hist, nan_step=nan_step))
    return out


@pytest.fixture(scope="module")
def reports(runs):
    return {name: make_report(d) for name, (d, _) in runs.items()}


def _check_png(path):
    assert os.path.isfile(path), path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
        assert 400 <= w <= 8000 and 250 <= h <= 8000, (path, im.size)
        rgb = im.convert("RGB")
        assert max(ImageStat.Stat(rgb).var) > 0, f"{path} is blank"
        assert len(rgb.getcolors(maxcolors=1 << 20) or range(1 << 20)) > 10, f"{path} has almost no colors"


class _Html(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.imgs, self.errors, self.text = [], [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append((tag, list(self.stack)))
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse_html(path):
    p = _Html()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    return p


# -- the report ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "exp", "range"])
def test_report_files(runs, reports, name):
    d, _ = runs[name]
    paths = reports[name]
    pngs = {"grad_flow.png", "norm_heatmap.png", "scalars.png"} | ({"hist_evolution.png"} if name != "plain" else set())
    assert set(paths) == pngs | {"report.md", "report.html"}
    for k, p in paths.items():
        assert os.path.dirname(p) == os.path.join(d, "report") and os.path.basename(p) == k
        if k.endswith(".png"):
            _check_png(p)
    assert not os.path.exists(os.path.join(d, "report", "hist_evolution.png")) or name != "plain"

    log = read_jsonl(os.path.join(d, "log.jsonl"))
    md = open(paths["report.md"], encoding="utf-8").read()
    lines = md.splitlines()
    rows = summary_cells(summary_rows(log.records))
    assert len(rows) == 6 * 3  # 6 modules ("" and 0..4) x forward / backward_pre, 6 params x grad
    for r in rows:
        want = "| " + " | ".join([f"`{r[0]}`"] + r[1:]) + " |"
        assert want in lines, want
    for png in pngs:
        assert f"]({png})" in md
    for tag in ("loss", "lr"):
        assert any(line.startswith(f"| `{tag}` |") for line in lines)
    assert "| `lr` | 4 | 3 | 0.1 |" in md

    page = _parse_html(paths["report.html"])
    assert sorted(page.imgs) == sorted(pngs)
    text = "".join(page.text)
    for r in rows:
        assert r[0] in text
    if name == "exp":
        assert "First non-finite value: step 2, module `0`, kind forward (16 NaN, 0 Inf)" in md
        assert "First non-finite value: step 2, module 0, kind forward (16 NaN, 0 Inf)" in text
    else:
        assert "No NaN or Inf in any recorded tensor." in md


def test_report_info_and_escaping(runs, reports):
    md = open(reports["range"]["report.md"], encoding="utf-8").read()
    assert "range: 16 bins over [-2.0, 2.0]" in md
    assert "| steps | 4 (0 .. 3) |" in md
    assert "`<model>`" in md  # the root module as code, not a stray HTML tag
    assert "max \\|x\\|" in md  # the pipe in the summary header escaped
    raw = open(reports["range"]["report.html"], encoding="utf-8").read()
    assert "&lt;model&gt;" in raw and "<model>" not in raw


def test_report_truncated_log(runs, tmp_path):
    d, _ = runs["plain"]
    run = tmp_path / "killed"
    run.mkdir()
    shutil.copy(os.path.join(d, "log.jsonl"), run / "log.jsonl")
    with open(run / "log.jsonl", "a", encoding="utf-8") as f:
        f.write('{"type":"record","seq":999,"step":4,"module":"0","kind":"forw')  # killed mid-write
    out = tmp_path / "elsewhere"
    paths = make_report(str(run / "log.jsonl"), str(out), fmt="md")  # the log file itself works too
    assert set(paths) == {"grad_flow.png", "norm_heatmap.png", "scalars.png", "report.md"}
    assert all(os.path.dirname(p) == str(out) for p in paths.values())
    md = open(paths["report.md"], encoding="utf-8").read()
    assert "skipped lines | 1 line(s)" in md
    assert f"| run directory | {run} |" in md


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_report(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"has no log\.parquet or log\.jsonl.*JSONLWriter.*hookstats demo --out RUN_DIR"):
        make_report(str(tmp_path))
    (tmp_path / "log.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        make_report(str(tmp_path))
    with JSONLWriter(tmp_path / "log.jsonl") as w:
        w.begin({"hookstats": "0", "histogram": None})
    with pytest.raises(ValueError, match="no records"):
        make_report(str(tmp_path))
    with pytest.raises(ValueError, match="unknown format"):
        make_report(str(tmp_path), fmt=("pdf",))
    assert not (tmp_path / "report").exists()


# -- plots and their data ------------------------------------------------------------------------------------------
def test_norm_matrix_matches_grads(runs):
    for name in ("plain", "exp"):
        d, grads = runs[name]
        log = read_jsonl(os.path.join(d, "log.jsonl"))
        layers, steps, values = plots.norm_matrix(log.records, "grad", log.info["modules"])
        assert layers == PARAMS and steps == [0, 1, 2, 3]
        assert values.shape == (6, 4)
        for i, p in enumerate(layers):
            for j, s in enumerate(steps):
                want = grads[(p, s)]
                if math.isnan(want):
                    assert name == "exp" and s == 2 and math.isnan(values[i, j])
                else:
                    assert values[i, j] == pytest.approx(want, rel=1e-5), (p, s)
        # without the header's module order: the forward hooks' order
        layers2, _, values2 = plots.norm_matrix(log.records, "grad")
        assert [n.rsplit(".", 1)[0] for n in layers2] == ["0", "0", "2", "2", "4", "4"]
        assert sorted(layers2) == sorted(PARAMS)
    assert plots.layer_order(log.records, "forward", log.info["modules"]) == ["", "0", "1", "2", "3", "4"]
    assert plots.layer_order(log.records, "backward_pre", log.info["modules"]) == ["", "0", "1", "2", "3", "4"]
    assert plots.gradient_kind(log.records) == "grad"


def test_norm_matrix_combines_tensors():
    def rec(seq, step, module, kind, index, l2, nan=0):
        return {"seq": seq, "step": step, "module": module, "kind": kind, "index": index,
                "stats": {"l2": l2, "nan_count": nan, "inf_count": 0}}

    recs = [rec(0, 0, "a", "backward", 0, 3.0), rec(1, 0, "a", "backward", 1, 4.0), rec(2, 0, "b", "backward", 0, 1.0),
            rec(3, 2, "a", "backward", 0, 2.0), rec(4, 0, "w", "grad", 0, 1.0), rec(5, 0, "w", "grad", 0, 7.0)]
    layers, steps, v = plots.norm_matrix(recs, "backward")
    assert steps == [0, 2]
    assert v[layers.index("a")].tolist() == [5.0, 2.0]  # sqrt(3^2 + 4^2)
    assert math.isnan(v[layers.index("b"), 1])  # not recorded
    assert plots.norm_matrix(recs, "grad")[2].tolist() == [[7.0]]  # the accumulated (last) grad
    assert plots.gradient_kind(recs) == "grad"
    assert plots.gradient_kind([r for r in recs if r["kind"] != "grad"]) == "backward"
    assert plots.gradient_kind([]) is None


def test_nonfinite_events(runs):
    d, _ = runs["exp"]
    log = read_jsonl(os.path.join(d, "log.jsonl"))
    ev = plots.nonfinite_events(log.records)
    assert ev[0] == (2, "0", "forward", HIDDEN, 0)
    assert ev[0].step == 2 and ev[0].module == "0" and ev[0].nan_count == HIDDEN
    assert {e.step for e in ev} == {2}
    assert {(e.module, e.kind) for e in ev} >= {(p, "grad") for p in PARAMS}
    assert plots.nonfinite_events(read_jsonl(os.path.join(runs["plain"][0], "log.jsonl")).records) == []

    def rec(seq, step, module, kind, index, nan, inf):
        return {"seq": seq, "step": step, "module": module, "kind": kind, "index": index,
                "stats": {"nan_count": nan, "inf_count": inf}}

    # by step, then hook order; one event per (step, module, kind) with the counts summed; file order ignored
    recs = [rec(9, 5, "b", "forward", 0, 1, 0), rec(4, 3, "c", "backward", 1, 0, 2),
            rec(3, 3, "c", "backward", 0, 1, 1), rec(2, 3, "a", "forward", 0, 0, 0), rec(5, 3, "d", "grad", 0, 0, 3)]
    assert plots.nonfinite_events(recs) == [(3, "c", "backward", 1, 3), (3, "d", "grad", 0, 3),
                                            (5, "b", "forward", 1, 0)]


def test_exp_hist_evolution(runs, tmp_path):
    d, _ = runs["plain"]
    log = read_jsonl(os.path.join(d, "log.jsonl"))
    p = tmp_path / "h.png"
    assert plots.exp_hist_evolution(log.records, log.info, p) is None
    assert not p.exists()
    d, _ = runs["range"]
    log = read_jsonl(os.path.join(d, "log.jsonl"))
    assert plots.exp_hist_evolution(log.records, log.info, p, modules=[("2", "forward"), "0"]) == str(p)
    _check_png(str(p))
    with pytest.raises(ValueError, match="no histograms"):
        plots.exp_hist_evolution(log.records, log.info, p, modules=["nope"])


def test_plots_without_data(tmp_path):
    p = tmp_path / "x.png"
    assert plots.grad_flow([], p) is None
    assert plots.norm_heatmap([], p) is None
    assert plots.scalars_plot([], p) is None
    assert not p.exists()
    # all-NaN scalars and a single step still draw
    assert plots.scalars_plot([{"step": 0, "tag": "loss", "value": math.nan}], p, nonfinite_steps=[0]) == str(p)
    _check_png(str(p))
