"""The record's field specification (hookstats/_fields.py, Note [record fields]): the C++ row layout matches it, the
op layer, the merge and the histogram lengths derive from it, and every column of every run reaches records(),
Monitor.table(), the JSONL log and the Parquet log alike, for every combination of histogram, locations and a merge
across ranks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import hookstats
from hookstats import _fields as F
from hookstats import _kernels
from hookstats._types import SUPPORTED_DTYPES, ChannelStats, Stats, exp_layout, from_parts

NAN = float("nan")


@pytest.mark.skipif(not hookstats.HAVE_EXTENSION, reason="needs the compiled extension")
def test_cpp_stat_fields_match_the_spec():
    """Note [stats row layout]: the StatField enum's names (kStatFieldNames, static_assert'ed to one per field) are
    the spec's statistics, in the spec's order."""
    assert tuple(_kernels.extension().STAT_FIELD_NAMES) == F.STATS_FIELDS
    assert Stats._fields == F.STATS_FIELDS == hookstats.STATS_FIELDS


def test_spec_is_consistent():
    names = [f.name for f in F.FIELDS]
    assert len(names) == len(set(names))
    kinds = {"identity", "count", "value", "histogram", "location", "merge"}
    for f in F.FIELDS:
        assert f.kind in kinds and f.json in F.JSON_CODECS and f.when in (
            "always", "histogram", "locations", "merged", "merged+locations"), f
        assert (f.merge != "") == (f.kind in F.STAT_KINDS), f
        assert f.json in F.TABLE_CODECS or f.kind == "histogram", f
    # the statistics sit together, between the identity columns and the histogram (the order of a record dict)
    assert F.RECORD_KEYS[:len(F.IDENTITY_COLUMNS) + 2] == F.IDENTITY_COLUMNS + ("stats", "histogram")
    assert F.COUNT_FIELDS == ("numel", "nan_count", "inf_count", "zero_count")


def test_from_parts_puts_each_field_where_the_kernels_write_it():
    """The stats ops return (values: the value fields, counts: the count fields), each in row order (csrc/core/
    stats_ops.h out_values); channel_stats (values: the five sums and extremes, counts: nonfinite, count)."""
    values, counts = torch.arange(9.0), 100 + torch.arange(4)
    s = from_parts(Stats, values, counts)
    assert [int(v) for v in s] == [100, 0, 1, 2, 3, 4, 5, 6, 7, 8, 101, 102, 103]
    c = from_parts(ChannelStats, torch.arange(10.0).view(5, 2), 100 + torch.arange(4).view(2, 2))
    assert c.absmax.tolist() == [0, 1] and c.max.tolist() == [8, 9] and c.nonfinite.tolist() == [100, 101]
    assert c.count.tolist() == [102, 103]
    # and through the kernels: each count lands on its name
    x = torch.tensor([0.0, 0.0, 0.0, NAN, float("inf"), float("-inf"), 2.0])
    st = hookstats.stats(x).to_dict()
    assert (st["numel"], st["nan_count"], st["inf_count"], st["zero_count"]) == (7, 1, 2, 3)
    assert hookstats.stats(x[4:], locations=True).to_dict()["inf_count"] == 2


@pytest.mark.parametrize("cls,shape", [(Stats, ()), (ChannelStats, (3,))])
def test_field_views_equal_unbinds(cls, shape):
    """_kernels.result_of's fields (row views made by the extension, Note [field views]) against from_parts' unbind:
    the same values, dtype, shape, strides and storage offset, on the op's outputs (strided rows of a column-major
    block too), independent of the outputs' autograd; a tensor subclass takes unbind."""
    from hookstats._kernels import result_of

    k = len(shape) and shape[0]
    nv, nc = (9, 4) if cls is Stats else (5, 2)
    values = torch.randn(*((nv, k) if k else (nv,)), dtype=torch.float64)
    counts = torch.randint(0, 9, (nc, k) if k else (nc,))
    blocks = [(values, counts)]
    if k:  # rows strided (a transposed block) and offset in their storage
        blocks.append((torch.randn(k + 1, nv, dtype=torch.float64).t()[:, 1:], torch.randint(0, 9, (k, nc)).t()))
    for v, c in blocks:
        fast, slow = result_of(cls, v, c), from_parts(cls, v, c)
        assert type(fast) is cls
        for a, b in zip(fast, slow):
            assert a.dtype == b.dtype and a.shape == b.shape == shape and a.stride() == b.stride()
            assert a.storage_offset() == b.storage_offset() and a.data_ptr() == b.data_ptr() and torch.equal(a, b)
            assert not a.requires_grad and a.grad_fn is None

    class Sub(torch.Tensor):
        pass

    sub = result_of(cls, values.as_subclass(Sub), counts.as_subclass(Sub))
    assert all(type(f) is Sub and f._base is not None for f in sub)


def test_stats_types_pickle_and_copy():
    import copy
    import pickle

    x = torch.tensor([[1.0, -3.0], [NAN, 2.0]])
    for s in (hookstats.stats(x), hookstats.stats(x, locations=True)):
        for t in (pickle.loads(pickle.dumps(s)), copy.copy(s), copy.deepcopy(s)):
            assert type(t) is type(s) and t._fields == F.STATS_FIELDS
            assert str(t.to_dict()) == str(s.to_dict())
    t = pickle.loads(pickle.dumps(hookstats.stats(x, locations=True)))
    assert t.coordinates() == {"argmax_abs": (0, 1), "first_nonfinite": (1, 0)} and t.shape == (2, 2)


def test_every_merge_rule_is_implemented():
    from hookstats.monitor import merge

    assert {f.merge for f in F.STATS} <= set(merge.RULES)


def test_hist_lengths_match_the_op_layer():
    assert F.hist_lengths({"kind": "exp"}) == sorted({exp_layout(getattr(torch, d.name)).length for d in F.DTYPES})
    assert F.hist_lengths({"kind": "range", "bins": 8, "lo": -1.0, "hi": 1.0}) == [11]
    assert len(hookstats.histogram(torch.randn(20), 8, range=(-1.0, 1.0))) == F.range_hist_length(8)
    for d in F.DTYPES:
        x = torch.randn(5).to(getattr(torch, d.name))
        assert len(hookstats.exp_histogram(x)) == F.exp_hist_length(d.name)
    assert SUPPORTED_DTYPES == tuple(getattr(torch, d.name) for d in F.DTYPES)


class TwoDtypes(nn.Module):
    """A float32 layer and a float64 one: an exponent histogram gets two lengths."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, x):
        return self.b(self.a(x).double())


def _run(mon, m, steps=4, nan_step=2):
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        x = torch.randn(3, 4, generator=g)
        if s == nan_step:
            x[1, 2] = NAN
        m(x).sum().backward()
        mon.log("loss", float(s))
        mon.step()


def _dumps(records) -> str:
    """Records compared exactly, NaN equal to NaN, key order included (tuples and lists alike)."""
    return json.dumps(list(records))


HISTOGRAMS = {"none": None, "exp": "exp", "range": (8, (-2.0, 2.0))}


@pytest.mark.parametrize("merged", [False, True], ids=["local", "merged"])
@pytest.mark.parametrize("locations", [False, True], ids=["noloc", "loc"])
@pytest.mark.parametrize("hist", list(HISTOGRAMS))
def test_every_column_reaches_every_log(tmp_path, hist, locations, merged):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import torch.distributed as dist

    from hookstats.runlog import JSONLWriter, ParquetWriter, read_jsonl, read_run
    from hookstats.runlog import schema as T

    if merged:
        if not dist.is_available():
            pytest.skip("torch.distributed is not available")
        if dist.is_initialized():
            pytest.skip("a process group is already initialised in this process")
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        m = TwoDtypes()
        jl, pql, pql32 = tmp_path / "log.jsonl", tmp_path / "log.parquet", tmp_path / "f32" / "log.parquet"
        mon = hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram=HISTOGRAMS[hist],
                                locations=locations, process_group="world" if merged else None, flush_every=2,
                                exporters=[JSONLWriter(jl), ParquetWriter(pql),
                                           ParquetWriter(pql32, stats_dtype="float32")])
        _run(mon, m)
        mon.detach()
        info = mon.run_info()
        want = mon.records()
        assert len(want) > 0 and any(r["stats"]["nan_count"] for r in want)
    finally:
        if merged:
            dist.destroy_process_group()

    fields = F.run_fields(info)
    columns = [f.name for f in fields if f.kind != "histogram"]
    keys = [k for k in F.RECORD_KEYS if k == "stats" or k in columns or (k == "histogram")]
    assert set(columns) >= set(F.LOCATION_COLUMNS) if locations else not set(columns) & set(F.LOCATION_COLUMNS)
    assert set(columns) >= {"ranks", "nonfinite_ranks"} if merged else not set(columns) & set(F.MERGE_COLUMNS)
    assert ("location_rank" in columns) == (merged and locations)

    # records(): every field of the run, in the spec's order
    for r in want:
        assert list(r) == keys and list(r["stats"]) == list(F.STATS_FIELDS)
    # the JSONL lines hold the same keys
    with open(jl, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if '"type":"record"' in line]
    assert len(lines) == len(want) and all(list(d) == ["type"] + keys for d in lines)

    jrun, prun = read_run(jl), read_run(pql)
    tables = {"table()": mon.table(), "jsonl": jrun.records, "parquet": prun.records,
              "parquet float32": read_run(pql32).records}
    want32 = [{**r, "stats": {k: float(np.float32(v)) if F.BY_NAME[k].kind == "value" else v
                              for k, v in r["stats"].items()}} for r in want]
    for name, t in tables.items():
        assert [c for c in t.column_names if not c.startswith(F.HIST_PREFIX)] == columns, name
        stats_dtype = "float32" if name.endswith("float32") else "float64"
        for c in columns:  # each column of its spec's Arrow type
            want_type = T.arrow_type(pa, F.BY_NAME[c], stats_dtype)
            got = t.schema.field(c).type
            assert got == want_type or (pa.types.is_dictionary(want_type) and pa.types.is_dictionary(got)), (name, c)
        assert _dumps(T.table_records(t)) == _dumps(want32 if stats_dtype == "float32" else want), name

    # histograms: the columns with data are the same everywhere, each entry exactly its length; a log read back has
    # the run's schema, whichever the format (every length its histogram spec can give, all-null where no tensor of
    # that dtype was recorded); Monitor.table() the lengths recorded
    def with_data(t):
        return [c for c in T.hist_columns(t.column_names) if t.column(c).null_count < t.num_rows]

    lengths = sorted({len(r["histogram"]) for r in want if r["histogram"] is not None})
    assert [F.hist_column(n) for n in lengths] == with_data(tables["table()"]) == with_data(tables["jsonl"]) \
        == with_data(tables["parquet"]) == with_data(tables["parquet float32"])
    assert T.hist_columns(tables["table()"].column_names) == [F.hist_column(n) for n in lengths]
    for name in ("jsonl", "parquet", "parquet float32"):
        assert T.hist_columns(tables[name].column_names) == [F.hist_column(n) for n in F.hist_lengths(info["histogram"])]
        assert tables[name].schema.remove_metadata().equals(
            T.records_schema(info, "float32" if name.endswith("float32") else "float64")), name
    if hist == "range":
        assert lengths == [11]  # no all-null extra column (bins + 3 counts)
    if hist == "exp":
        assert lengths == [F.exp_hist_length("float32"), F.exp_hist_length("float64")]
    for t in tables.values():
        for c in T.hist_columns(t.column_names):
            n = int(c[len(F.HIST_PREFIX):])
            assert all(v is None or len(v) == n for v in t.column(c).to_pylist())
    for path, stats_dtype in ((pql, "float64"), (pql32, "float32")):
        files = sorted(p for p in path.iterdir() if p.suffix == ".parquet")
        assert files and all(pq.read_schema(p).remove_metadata().equals(T.records_schema(info, stats_dtype))
                             for p in files)

    # the JSONL log read as dicts gives records() back too, and the readers agree on the header and scalars
    assert _dumps(read_jsonl(jl).records) == _dumps(want)
    assert jrun.info["stats_fields"] == prun.info["stats_fields"] == list(F.STATS_FIELDS)
    assert [(s["step"], s["value"]) for s in jrun.scalars] == [(s["step"], s["value"]) for s in prun.scalars]
    if locations:
        assert any(r["first_nonfinite_index"] is not None for r in want)
    if merged:
        assert all(r["ranks"] == 1 for r in want) and any(r["nonfinite_ranks"] == [0] for r in want)


def test_a_log_of_an_older_spec_still_reads(tmp_path):
    """A JSONL record of a log written before dtype and index existed reads with their defaults (Note [record
    fields]), and a statistic it lacks reads as null."""
    pa = pytest.importorskip("pyarrow")
    from hookstats.runlog import read_run
    from hookstats.runlog import schema as T

    p = tmp_path / "log.jsonl"
    stats = {f: 1 for f in F.STATS_FIELDS if f != "zero_count"}
    lines = [{"type": "run", "histogram": None}, {"type": "record", "seq": 0, "step": 3, "module": "a",
                                                  "kind": "forward", "stats": stats, "histogram": None}]
    p.write_text("".join(json.dumps(d) + "\n" for d in lines))
    t = read_run(p).records
    assert [c for c in t.column_names] == list(F.IDENTITY_COLUMNS + F.STATS_FIELDS)
    (r,) = T.table_records(t)
    assert (r["index"], r["dtype"], r["step"]) == (0, "", 3)
    assert r["stats"]["zero_count"] is None and r["stats"]["numel"] == 1  # null, not int64(NaN)
    assert t.column("zero_count").type == pa.int64() and t.column("zero_count").null_count == 1
