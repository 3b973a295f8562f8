"""benchmarks/report.py: the table specs the benchmark files declare, the targets file, and the pivot itself on a
small pytest-benchmark JSON written here."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_report():
    spec = importlib.util.spec_from_file_location("hookstats_bench_report", BENCH / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = load_report()


def test_every_benchmark_file_declares_its_tables():
    specs = report.read_specs()
    files = {s["file"] for s in specs}
    assert files == {p.name for p in BENCH.glob("test_bench_*.py")}
    ids = [s["id"] for s in specs]
    assert len(ids) == len(set(ids))
    for s in specs:
        for col in s["columns"]:
            ast.parse(col[1], mode="eval")  # a typo in an expression fails here, not as a silent "–"
            assert len(col) < 3 or col[2] in (None, "str", "us", "ms", "s", "x", "gbps", "pct", "int", "f1", "f2", "f3")
        for _, expr in s.get("define", ()):
            ast.parse(expr, mode="eval")


def test_every_target_names_a_table_and_a_direction():
    ids = {s["id"]: s for s in report.read_specs()}
    targets = json.loads((BENCH / "targets.json").read_text())["targets"]
    assert targets
    for t in targets:
        assert t["table"] in ids, t
        assert t["op"] in ("<=", ">="), t
        assert set(t.get("split", {})) <= set(ids[t["table"]].get("split", ())), t
        ast.parse(t["value"], mode="eval")


def bench(name, extra, median, iqr=0.0, rounds=10):
    return {"name": name, "extra_info": extra, "stats": {"median": median, "iqr": iqr, "rounds": rounds}}


@pytest.fixture
def run_json(tmp_path):
    stats = dict(family="stats", device="cpu", dtype="float32", size_log2=20, numel=2**20, bytes=4 * 2**20, roof="sum")
    data = {
        "datetime": "2026-12-01T22:00:00", "machine_info": {"cpu": {"brand_raw": "Test CPU", "count": 2},
                                                            "system": "Linux", "python_version": "3.11.0"},
        "benchmarks": [
            bench("a", dict(stats, case="fused"), 200e-6),
            bench("b", dict(stats, case="roof"), 50e-6),
            bench("c", dict(stats, case="composite"), 10e-3),
            bench("d", dict(stats, size_log2=24, numel=2**24, bytes=4 * 2**24, case="fused"), 4e-3),  # no roof
            bench("e", dict(family="large", bench="step", model="gpt12", step_s={"none": 0.02, "monitor": 0.023},
                            ratios={"none": 1.0, "monitor": 1.15}, median_ratios={"none": 1.0, "monitor": 1.2}), 0.1),
            bench("f", dict(family="something_else", case="fused"), 1.0),
        ],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_pivot_ratios_and_missing_cases(run_json):
    records, _ = report.read_records([str(run_json)])
    text = report.render(report.read_specs(), records, [])
    lines = [line for line in text.splitlines() if line.startswith("| 2^")]
    assert lines[0] == "| 2^20 | 200 | 21.0 | 50.0 | 4.00x | 10,000 | 50.00x |", lines
    assert lines[1] == "| 2^24 | 4,000 | 16.8 | – | – | – | – |", lines  # a case that did not run prints "–"
    assert "### hookstats.stats: all 13 statistics in one read, cpu, float32" in text
    assert "something_else" not in text


def test_explode_and_targets(run_json):
    records, _ = report.read_records([str(run_json)])
    targets = [
        {"table": "large_step", "split": {"model": "gpt12"}, "where": "case == 'monitor'", "value": "ratios",
         "op": "<=", "target": 1.10, "text": "GPT Monitor", "limit": "what limits it"},
        {"table": "large_step", "split": {"model": "mlp1000"}, "where": "case == 'monitor'", "value": "ratios",
         "op": "<=", "target": 1.2, "text": "MLP Monitor"},  # not measured: no line
        {"table": "stats", "where": "size_log2 == 20", "value": "t.composite / t.fused", "op": ">=", "target": 10,
         "text": "vs composite"},
    ]
    text = report.render(report.read_specs(), records, targets)
    assert "| Monitor, default kinds | 23.0 | 1.15x | 1.20x |" in text
    assert "- GPT Monitor: 1.15x (target <= 1.10x: not reached; what limits it)" in text
    assert "MLP Monitor" not in text
    assert "- vs composite: 50.00x (target >= 10.00x: met)" in text


def test_markdown_header(run_json, tmp_path, capsys):
    out = tmp_path / "benchmarks.md"
    assert report.main([str(run_json), "--markdown", str(out), "--command", "make bench"]) == 0
    page = out.read_text()
    assert page.startswith("# Benchmarks")
    assert "- **Machine**: Test CPU, 2 cores, Linux, Python 3.11.0" in page
    assert "- **Date**: 2026-12-01T22:00:00" in page and "- **Command**: `make bench`" in page
    assert "| 2^20 | 200 |" in capsys.readouterr().out  # and the same tables on stdout
