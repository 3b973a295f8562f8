"""The run log's old import paths (hookstats.monitor.table, hookstats.export.jsonl / parquet / log / _columns, and
the readers through hookstats.export) keep working for one release with a DeprecationWarning that names the new
path, and give back hookstats.runlog's own objects; the new paths, and the exporters through hookstats.export,
import and resolve without any warning; `import hookstats` loads no pyarrow."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import warnings

import pytest

import hookstats
import hookstats.export
import hookstats.runlog
from hookstats.runlog import columns, jsonl, parquet, read, schema

# old module -> (its new module, names to compare: public and private)
MOVED = {
    "hookstats.monitor.table": (schema, ["block_table", "concat", "with_run_info", "run_info", "table_records",
                                         "records_table", "HIST_PREFIX", "hist_columns", "hist_column", "_pa",
                                         "_SITES"]),
    "hookstats.export.jsonl": (jsonl, ["JSONLWriter", "RunLog", "read_jsonl", "encode_block", "encode_record",
                                       "decode_record", "_enc_float"]),
    "hookstats.export.parquet": (parquet, ["ParquetWriter", "log_paths", "LogPaths", "read_parquet_log",
                                           "is_parquet_log", "_pq"]),
    "hookstats.export.log": (read, ["read_log", "read_run", "find_log", "RunTable", "PARQUET_NAME", "JSONL_NAME"]),
    "hookstats.export._columns": (columns, ["Columns", "first_seen", "_codes"]),
}
READERS = ("read_log", "read_run", "find_log", "RunTable", "RunLog", "read_jsonl", "PARQUET_NAME")


@pytest.fixture
def fresh(monkeypatch):
    """Forgets an old module (restored at teardown), so that importing it runs it again and warns again."""

    def forget(name: str) -> None:
        parent, _, leaf = name.rpartition(".")
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(sys.modules[parent], leaf, raising=False)

    return forget


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_warns_and_gives_the_same_objects(old, fresh):
    new, names = MOVED[old]
    fresh(old)
    with pytest.warns(DeprecationWarning, match=re.escape(new.__name__)) as rec:
        mod = importlib.import_module(old)
    assert any(old in str(w.message) and "next release" in str(w.message) for w in rec)
    assert mod is not new
    for name in names:
        assert getattr(mod, name) is getattr(new, name), name
    star: dict = {}
    exec(f"from {old} import *", star)
    assert set(new.__all__) <= set(star)
    for name in new.__all__:
        assert star[name] is getattr(new, name), name
    assert set(new.__all__) <= set(dir(mod))
    with pytest.raises(AttributeError):
        mod.no_such_name


def test_old_module_warning_points_at_the_importing_line(fresh):
    fresh("hookstats.monitor.table")
    with pytest.warns(DeprecationWarning) as rec:
        from hookstats.monitor.table import block_table
    assert block_table is schema.block_table
    assert [os.path.basename(w.filename) for w in rec] == ["test_runlog_paths.py"]


def test_from_import_of_an_old_module_warns(fresh):
    fresh("hookstats.export.jsonl")
    with pytest.warns(DeprecationWarning, match="hookstats.runlog.jsonl"):
        from hookstats.export.jsonl import JSONLWriter, read_jsonl
    assert JSONLWriter is hookstats.runlog.JSONLWriter and read_jsonl is hookstats.runlog.read_jsonl


@pytest.mark.parametrize("name", READERS)
def test_readers_through_export_warn_and_are_the_same(name):
    with pytest.warns(DeprecationWarning, match=re.escape(f"hookstats.runlog.{name}")) as rec:
        obj = getattr(hookstats.export, name)
    assert obj is getattr(hookstats.runlog, name)
    assert os.path.basename(rec[0].filename) == "test_runlog_paths.py"
    ns: dict = {}
    with pytest.warns(DeprecationWarning, match=f"hookstats.export.{name} is deprecated"):
        exec(f"from hookstats.export import {name}", ns)
    assert ns[name] is obj


def test_exporters_through_export_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hookstats.export.JSONLWriter is hookstats.runlog.JSONLWriter
        assert hookstats.export.ParquetWriter is hookstats.runlog.ParquetWriter
        assert hookstats.export.LOG_NAME == hookstats.runlog.LOG_NAME == "log.jsonl"
        assert hookstats.runlog.PARQUET_NAME == "log.parquet"
        star: dict = {}
        exec("from hookstats.export import *", star)  # __all__ holds no deprecated name
    assert not set(READERS) & set(hookstats.export.__all__)
    assert {"JSONLWriter", "ParquetWriter", "Exporter", "TensorBoardWriter", "make_report"} <= set(star)
    with pytest.raises(AttributeError):
        hookstats.export.no_such_name
    for writer in (hookstats.runlog.JSONLWriter, hookstats.runlog.ParquetWriter):  # the run log's writers are exporters
        assert issubclass(writer, hookstats.export.Exporter), writer


def _python(code: str, *flags: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(hookstats.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)


def test_new_paths_import_without_any_warning():
    code = ("import warnings\n"
            "warnings.simplefilter('error')\n"
            "import hookstats, hookstats.export, hookstats.runlog\n"
            "import hookstats.runlog.schema, hookstats.runlog.jsonl, hookstats.runlog.parquet\n"
            "import hookstats.runlog.read, hookstats.runlog.columns\n"
            "import hookstats.export.report, hookstats.export.analysis, hookstats.export.plots\n"
            "import hookstats.integrations._common\n"
            "from hookstats.runlog import *\n"
            "from hookstats.export import *\n"
            "from hookstats.runlog import ParquetWriter, JSONLWriter, read_log, read_run, find_log, RunTable\n"
            "import sys\n"
            "old = [m for m in ('hookstats.monitor.table', 'hookstats.export.jsonl', 'hookstats.export.parquet',\n"
            "                   'hookstats.export.log', 'hookstats.export._columns') if m in sys.modules]\n"
            "assert not old, old\n"
            "print('ok')\n")
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_import_hookstats_needs_no_pyarrow(tmp_path):
    """The Parquet writer's module loads pyarrow only when a writer is made or a log is read; the JSONL log works
    without it."""
    code = ("import sys\n"
            "sys.modules['pyarrow'] = None\n"
            "import torch, hookstats\n"
            "from hookstats.runlog import JSONLWriter, ParquetWriter, read_jsonl\n"
            "net = torch.nn.Linear(3, 2)\n"
            "m = hookstats.Monitor(net, exporters=[JSONLWriter(sys.argv[1])])\n"
            "net(torch.ones(4, 3)).sum().backward(); m.step(); m.detach()\n"
            "assert len(read_jsonl(sys.argv[1]).records) > 0\n"
            "try:\n"
            "    ParquetWriter(sys.argv[1] + '.parquet')\n"
            "except ImportError as e:\n"
            "    assert 'pip install pyarrow' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('ParquetWriter without pyarrow')\n"
            "print('ok')\n")
    r = _python(code.replace("sys.argv[1]", repr(str(tmp_path / "log.jsonl"))))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
