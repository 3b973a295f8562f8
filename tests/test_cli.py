"""The hookstats command line end to end: `python -m hookstats demo|report|bench` in subprocesses (cwd a temporary
folder, tiny step counts), the demo's training for each model in-process, and the argument errors (exit code 2 with a
message saying what is wrong).

The demo's run directory: log.jsonl (read back with read_jsonl), tensorboard/ (an event file), report/ (report.md,
report.html and PNG plots, from hookstats.export.make_report). The injected NaN batch is at step 3 * steps // 4.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import hookstats
from hookstats.runlog import read_jsonl
from hookstats.monitor import SUMMARY_HEADER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300


def run_cli(*args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # the checkout's hookstats, from any cwd
    env.setdefault("MPLBACKEND", "Agg")
    return subprocess.run([sys.executable, "-m", "hookstats", *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd, env=env)


def event_files(d) -> list:
    return [f for f in os.listdir(d) if f.startswith("events.out.tfevents")]


def check_report_dir(report_dir, n_records=None) -> None:
    names = os.listdir(report_dir)
    assert "report.md" in names and "report.html" in names, names
    pngs = [n for n in names if n.endswith(".png")]
    assert pngs, names
    for n in pngs:
        with open(os.path.join(report_dir, n), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", n
    md = open(os.path.join(report_dir, "report.md"), encoding="utf-8").read()
    page = open(os.path.join(report_dir, "report.html"), encoding="utf-8").read()
    assert page.lstrip().lower().startswith("<!doctype html") or "<html" in page.lower()
    for n in pngs:  # the page shows every plot, by relative path
        assert n in page, n
    if n_records is not None:
        assert str(n_records) in md


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`demo --steps 4 --model mlp` once, shared by the tests that read its run directory (they copy it first)."""
    cwd = tmp_path_factory.mktemp("cwd")
    out = tmp_path_factory.mktemp("run") / "demo"
    t0 = time.perf_counter()
    r = run_cli("demo", "--steps", 4, "--model", "mlp", "--no-bench", "--no-examples", "--no-progress", "--out", out,
                cwd=cwd)
    return r, out, time.perf_counter() - t0


def test_demo_mlp_writes_the_run_directory(demo_run):
    r, out, _ = demo_run
    assert r.returncode == 0, r.stderr[-3000:]
    # log.jsonl: 4 steps of records, the same number each step, and the logged scalars
    log = read_jsonl(out / "log.jsonl")
    assert log.bad_lines == 0
    per_step: dict = {}
    for rec in log.records:
        per_step[rec["step"]] = per_step.get(rec["step"], 0) + 1
    assert sorted(per_step) == [0, 1, 2, 3]
    assert len(set(per_step.values())) == 1
    assert {s["tag"] for s in log.scalars} == {"loss", "grad_norm", "nonfinite_ops/found"}  # nonfinite_ops=True
    assert sorted(s["step"] for s in log.scalars if s["tag"] == "loss") == [0, 1, 2, 3]
    assert log.info["kinds"] == ["forward", "backward_pre", "grad"] and log.info["histogram"] == {"kind": "exp"}
    first_bad = next(rec for rec in log.records if rec["stats"]["nan_count"] or rec["stats"]["inf_count"])
    assert first_bad["step"] == 3 and first_bad["module"] == "0" and first_bad["kind"] == "forward"
    # tensorboard/: one event file
    assert len(event_files(out / "tensorboard")) == 1
    # report/
    check_report_dir(out / "report", n_records=len(log.records))
    # stdout: the summary table and the NaN found
    lines = r.stdout.splitlines()
    head = [l for l in lines if all(h in l for h in SUMMARY_HEADER)]
    assert len(head) == 1, r.stdout[-3000:]
    i = lines.index(head[0])
    assert set(lines[i + 1].replace(" ", "")) == {"-"}
    body = lines[i + 2:]
    assert any(l.split()[:2] == ["<model>", "forward"] for l in body)
    assert f"{len(log.records)} records" in r.stdout
    assert "first NaN/Inf: step 3, module '0', kind forward" in r.stdout
    assert "Statistics of example tensors" not in r.stdout and "Benchmark" not in r.stdout  # --no-examples/bench
    for name in ("log.jsonl", "report.md", "report.html"):
        assert name in r.stdout


@pytest.mark.parametrize("model,modules", [("transformer", "embed"),
                                           ("cnn", "features.0")])
def test_demo_train_each_model(tmp_path, model, modules):
    from hookstats.demo import train

    out = str(tmp_path / "run")
    res = train(model, steps=2, out=out, progress=False)
    assert res["model"] == model and res["steps"] == 2 and res["device"] == "cpu" and res["out"] == out
    assert res["nan_step"] == 1  # 3 * 2 // 4
    assert len(res["loss"]) == len(res["grad_norm"]) == 2
    assert res["loss"][0] == res["loss"][0] and res["loss"][0] > 0
    bad = res["first_nonfinite"]
    assert bad is not None and bad["step"] == 1 and bad["stats"]["nan_count"] > 0
    assert (bad["module"], bad["kind"]) == (modules, "forward")  # where the NaN was put in, not downstream
    log = read_jsonl(res["log"])
    assert res["log"] == os.path.join(out, "log.jsonl")
    assert len(log.records) == res["records"] > 0
    assert sorted({r["step"] for r in log.records}) == [0, 1]
    assert modules in log.info["modules"]
    assert {r["kind"] for r in log.records} == {"forward", "backward_pre", "grad"}
    assert not any(r["stats"]["nan_count"] for r in log.records if r["step"] == 0)
    assert res["tensorboard"] == os.path.join(out, "tensorboard") and len(event_files(res["tensorboard"])) == 1
    rows = res["summary_rows"]
    assert sum(row["records"] for row in rows) == res["records"]
    assert all(h in res["summary"].splitlines()[0] for h in SUMMARY_HEADER)
    if model == "cnn":  # (the cheap one) a rerun into the same folder replaces the log instead of appending to it
        res2 = train(model, steps=2, out=out, progress=False)
        assert len(read_jsonl(res2["log"]).records) == res2["records"] == res["records"]
        assert len(event_files(res2["tensorboard"])) == 1


def test_demo_rerun_replaces_a_parquet_log_and_its_sidecars(tmp_path):
    """A Parquet log is a records directory, a scalars directory and a header file (Note [one run per log]): a
    rerun replaces all three, so the log holds the new run's scalars only and is not refused as another run's."""
    pytest.importorskip("pyarrow")
    from hookstats.demo import train
    from hookstats.runlog import read_run

    out = str(tmp_path / "run")
    runs = [train("mlp", steps=3, out=out, progress=False, log_format="parquet", tensorboard=False) for _ in range(2)]
    log = read_run(out)
    assert log.format == "parquet" and log.records.num_rows == runs[1]["records"] == runs[0]["records"]
    assert len(log.scalars) == len({(s["step"], s["tag"]) for s in log.scalars}) > 0  # no step logged twice
    assert "resumed" not in log.info


def test_default_demo_prints_the_example_tensors(tmp_path, capsys, monkeypatch):
    """The default demo (example tensors on, default model) with --steps 2, in-process with the report stubbed out:
    the report is what costs time here, and the other tests make it (the subprocess demo above, `report`)."""
    import hookstats.__main__ as cli

    made = []
    monkeypatch.setattr(cli, "_write_report", lambda run_dir, out_dir=None: made.append(run_dir) or {})
    out = tmp_path / "run"
    assert cli.main(["demo", "--steps", "2", "--no-bench", "--no-progress", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "Statistics of example tensors" in stdout
    head = [l for l in stdout.splitlines() if l.split()[:3] == ["tensor", "dtype", "numel"]]
    assert len(head) == 1 and "nan_count" in head[0] and "zero_count" in head[0], stdout[:3000]
    assert "grad with a NaN and an Inf" in stdout and "fp16 1000 x 6e4" in stdout
    assert "Would activations with std 300 fit low-precision formats?" in stdout
    assert "Training a small transformer" in stdout  # the default model
    assert "first NaN/Inf: step 1" in stdout
    assert made == [str(out)]
    assert len(read_jsonl(out / "log.jsonl").records) > 0


def test_report_rewrites_the_run_report(demo_run, tmp_path, capsys):
    """`report DIR` (in-process, to spare a second matplotlib start-up; `report` runs as a process in the tests of
    its errors and, through the demo, in test_demo_mlp_writes_the_run_directory)."""
    from hookstats.__main__ import main

    r, out, _ = demo_run
    assert r.returncode == 0
    run = tmp_path / "copy"
    shutil.copytree(out, run)
    os.remove(run / "report" / "report.md")
    (run / "report" / "report.html").write_text("stale")
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(run / "report" / "report.md") in printed and str(run / "report" / "report.html") in printed
    for p in printed:
        assert os.path.isfile(p) and os.path.dirname(p) == str(run / "report"), p
    assert (run / "report" / "report.html").read_text() != "stale"
    check_report_dir(run / "report", n_records=len(read_jsonl(run / "log.jsonl").records))


def test_report_out_writes_elsewhere(demo_run, tmp_path, capsys):
    from hookstats.__main__ import main

    r, out, _ = demo_run
    assert r.returncode == 0
    run = tmp_path / "copy"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("report"))
    other = tmp_path / "elsewhere" / "rep"
    assert main(["report", str(run), "--out", str(other)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(os.path.dirname(p) == str(other) for p in printed)
    check_report_dir(other)
    assert not (run / "report").exists()  # nothing written into the run directory


def test_report_of_a_log_file_path(demo_run, tmp_path, capsys):
    """`report RUN_DIR/log.jsonl` is accepted as well as the directory."""
    from hookstats.__main__ import main

    r, out, _ = demo_run
    assert r.returncode == 0
    run = tmp_path / "copy"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("report"))
    assert main(["report", str(run / "log.jsonl"), "--out", str(tmp_path / "rep")]) == 0
    check_report_dir(tmp_path / "rep")


def test_report_of_a_missing_directory_fails_clearly(tmp_path):
    r = run_cli("report", "/nonexistent/run", cwd=tmp_path)
    assert r.returncode == 2
    assert "/nonexistent/run" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_report_of_a_directory_without_log_fails_clearly(tmp_path, capsys):
    from hookstats.__main__ import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "log.jsonl" in err and str(empty) in err
    assert err.count("hookstats report:") == 1  # make_report's message already starts with it: not twice
    assert not (empty / "report").exists()


def test_console_script_entry_point(capsys):
    from importlib.metadata import entry_points

    from hookstats.__main__ import main

    assert main(["report", "/nonexistent"]) == 2
    assert "/nonexistent" in capsys.readouterr().err
    eps = [e for e in entry_points(group="console_scripts") if e.name == "hookstats"]
    if eps:  # installed (pip install -e .): the script is __main__.main
        assert eps[0].value == "hookstats.__main__:main"


def test_demo_argument_errors(tmp_path, capsys):
    """Each bad argument: exit code 2 and a message naming the problem, before any training."""
    from hookstats.__main__ import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", "nope", "--out", str(out)])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err

    assert main(["demo", "--steps", "0", "--out", str(out)]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["demo", "--steps", "2", "--out", str(afile)]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert afile.read_text() == "x"

    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda", "--out", str(out)]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
    elif not hookstats.cuda_kernels_built():
        assert main(["demo", "--device", "cuda", "--out", str(out)]) == 2
        assert "without CUDA kernels" in capsys.readouterr().err
    assert not out.exists()  # nothing was written


def test_bench_runs_a_tiny_selection(tmp_path):
    pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark")
    if not os.path.isdir(os.path.join(ROOT, "benchmarks")):
        pytest.skip("no benchmarks/ folder")
    out = tmp_path / "bench.json"
    # two cases of the smallest group: stats-cpu-float32-2^10, fused and roof (well under a second of timing)
    r = run_cli("bench", "--json", out, "--", "-k", "test_stats and cpu-float32 and (10-fused or 10-roof)",
                cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "2 passed" in r.stdout
    assert os.path.isfile(out)
    assert "| 2^10 |" in r.stdout and "fused" in r.stdout  # the report table


def test_demo_deep_writes_a_parquet_run_of_a_thousand_modules(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    from hookstats.__main__ import main
    from hookstats.runlog import read_run
    from hookstats.runlog.schema import run_info

    out = tmp_path / "deep"
    assert main(["demo", "--model", "deep", "--steps", "2", "--no-bench", "--no-examples", "--no-progress",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1000 modules" in text and "log.parquet" in text and "more rows: the report has them all" in text
    assert (out / "log.parquet").is_dir() and not (out / "log.jsonl").exists()
    assert not (out / "tensorboard").exists()  # thousands of tags a step: not for the deep model by default
    r = read_run(out)
    assert r.format == "parquet" and len(r.info["modules"]) == 1001  # 500 x (Linear, ReLU) and the model itself
    assert run_info(r.records)["modules"] == r.info["modules"]
    kinds = set(r.records.column("kind").to_pylist())
    assert kinds == {"forward", "backward_pre", "grad"}
    assert r.records.num_rows == 2 * (1001 + 1001 + 1000)  # forward and grad_output of every module, 1,000 grads
    md = (out / "report" / "report.md").read_text()
    assert md.count("| `") >= 3000  # the per-layer summary: every (module, kind)
    assert "First non-finite value: step 1" in md


def test_demo_log_parquet_and_report_of_it(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    from hookstats.__main__ import main
    from hookstats.runlog import read_jsonl, read_log

    out = tmp_path / "mlp"
    assert main(["demo", "--model", "mlp", "--steps", "3", "--log", "parquet", "--no-bench", "--no-examples",
                 "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    assert (out / "log.parquet").is_dir() and (out / "tensorboard").is_dir()
    t = read_log(out)
    assert sorted(set(t.column("step").to_pylist())) == [0, 1, 2]
    rep = tmp_path / "rep"
    assert main(["report", str(out), "--out", str(rep)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(rep / "report.md") in printed and "parquet:" in (rep / "report.md").read_text()
    # --log jsonl into the same directory replaces the Parquet log
    assert main(["demo", "--model", "mlp", "--steps", "2", "--log", "jsonl", "--no-bench", "--no-examples",
                 "--no-progress", "--out", str(out)]) == 0
    assert not (out / "log.parquet").exists() and len({r["step"] for r in read_jsonl(out / "log.jsonl").records}) == 2


def test_demo_progress_bar_shows_the_last_loss(tmp_path, capsys):
    """The bar's loss and grad_norm are the last flushed ones, whatever the features log after them
    (nonfinite_ops/found): a finite run never shows loss=nan."""
    pytest.importorskip("tqdm")
    from hookstats.demo import train

    train("mlp", steps=8, out=str(tmp_path / "run"), progress=True, nan_step=None, flush_every=2)
    out = capsys.readouterr().out
    assert "loss=" in out and "loss=nan" not in out and "grad_norm=nan" not in out
