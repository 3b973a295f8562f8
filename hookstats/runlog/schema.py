"""A Monitor's records as an Arrow table, built from the flushed Blocks' columns (never a dict per record).

Every column, its Arrow type and which runs have it come from the field specification (hookstats/_fields.py, Note
[record fields]); a table's columns are its fields in that order. Schema (RECORD_COLUMNS, then the histogram columns):
  seq int64, step int64                      -- as in records()
  module, kind, dtype: dictionary<int32, string>  -- the site columns, dictionary-encoded (a few hundred distinct
                                                      names for millions of rows)
  index int32                                -- the tensor's position in what the hook saw
  numel .. zero_count                        -- one column per STATS_FIELDS statistic: the COUNT_FIELDS as int64,
                                                the others float64 (or float32 when asked: ParquetWriter; Note
                                                [statistics that float32 cannot hold])
  shape, argmax_abs_index, first_nonfinite_index: list<int64>
                                             -- only in runs with Monitor(locations=True): the record's tensor shape
                                                and the coordinates of its first largest |x| / first NaN/Inf (null
                                                where there is none; Note [element locations])
  ranks int32, nonfinite_ranks list<int32>, location_rank int32
                                             -- only in runs merged across ranks (Monitor(process_group=...); Note
                                                [merging records across ranks]): how many ranks wrote the record,
                                                the ranks whose tensor held a NaN/Inf ([] for none), and with
                                                locations the rank whose element is named
  histogram_{L}: list<int64>                 -- one per histogram length L in the run (a range histogram has one
                                                length, an exponent histogram one per dtype): every entry exactly L
                                                counts, or null where the row has no histogram of that length. A list
                                                column, not fixed_size_list: a null costs nothing there, where a
                                                fixed-size list stores L zeros for it (histogram_every=10 on a float32
                                                exponent histogram, 514 counts, would hold 10x the data it has)
The run header (Monitor.run_info()) travels as schema metadata under b"hookstats.run" (JSON) where a writer puts it.
Note [statistics that float32 cannot hold]
A float32 log (stats_dtype="float32") keeps a statistic as float32 only where float32 holds it: a finite value past
float32's range (|v| > 3.4028235e38, which would read back as inf) or a nonzero one below its smallest subnormal
(|v| < 1.4e-45, which would read back as 0) is written as null (`stat_column` below; the writer reports it). Which
tensors give such values cannot be known before they are recorded (an l2 or var of float32 values overflows
float32; any statistic of a float64 tensor may), and one log keeps one type per column (readers take the first
file's schema), so float64, which holds every value the kernels produce, is the writers' default.
`table_records(table)` turns a table back into record dicts (records()'s form), `scalars_table` / `table_scalars`
do the same for the logged scalars. pyarrow is imported when a table is built: `import hookstats` never needs it.
"""
from __future__ import annotations

import json
from typing import Iterable, Optional, Sequence

import numpy as np

from .._fields import (  # noqa: F401  (HIST_PREFIX, LOCATION_COLUMNS, MERGE_COLUMNS: this module's names too)
    BY_NAME,
    FIELDS,
    HIST_PREFIX,
    IDENTITY_COLUMNS,
    LOCATION_COLUMNS,
    MERGE_COLUMNS,
    SITE_COLUMNS,
    STAT_KINDS,
    STATS_FIELDS,
    TABLE_CODECS,
    hist_column,
    hist_lengths,
    present,
    record_value,
    run_fields,
    unravel_many,
)

RECORD_COLUMNS = IDENTITY_COLUMNS + STATS_FIELDS
RUN_KEY = b"hookstats.run"


def _pa():
    try:
        import pyarrow as pa
    except ImportError as e:
        raise ImportError("hookstats tables and the Parquet log need pyarrow: pip install pyarrow") from e
    return pa


def arrow_type(pa, field, stats_dtype: str = "float64"):
    """A field's Arrow type (Note [record fields]); "float" is float32 in a float32 log."""
    t = field.arrow
    if t == "float":
        return pa.float32() if stats_dtype == "float32" else pa.float64()
    if t == "dict":
        return pa.dictionary(pa.int32(), pa.string())
    if t.startswith("list<"):
        return pa.list_(getattr(pa, t[len("list<"):-1])())
    return getattr(pa, t)()


def records_schema(info: dict, stats_dtype: str = "float64"):
    """The schema of every records table of a run, from its header: its fields (Note [record fields]: the location
    and merge columns when the run has them) and every histogram column its histogram spec can give."""
    pa = _pa()
    fields = [pa.field(f.name, arrow_type(pa, f, stats_dtype)) for f in run_fields(info) if f.kind != "histogram"]
    hist = BY_NAME["histogram"]
    fields += [pa.field(hist_column(n), arrow_type(pa, hist)) for n in hist_lengths(info.get("histogram"))]
    return pa.schema(fields)


def conform(table, schema):
    """table with schema's columns in schema's order (missing ones as nulls) and its types; columns the schema lacks
    are kept at the end (nothing is dropped)."""
    pa = _pa()
    cols, fields = [], []
    for f in schema:
        if f.name in table.column_names:
            c = table.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
        fields.append(f)
    for name in table.column_names:
        if schema.get_field_index(name) < 0:
            cols.append(table.column(name))
            fields.append(table.schema.field(name))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def hist_columns(names: Iterable[str]) -> list:
    """The histogram columns among names, by length."""
    return sorted((n for n in names if n.startswith(HIST_PREFIX)), key=lambda n: int(n[len(HIST_PREFIX):]))


class _SiteDicts:
    """Dictionary codes for module, kind and dtype of every site of a site table, and the dictionaries."""

    def __init__(self, t):
        pa = _pa()
        mods = list(dict.fromkeys(n for n, _ in t.hook_names))
        kinds = list(dict.fromkeys(k for _, k in t.hook_names))
        dts = list(dict.fromkeys(t.dtypes))
        mi = {m: i for i, m in enumerate(mods)}
        ki = {k: i for i, k in enumerate(kinds)}
        di = {d: i for i, d in enumerate(dts)}
        n = len(t)
        hooks = np.asarray(t.hook[:n], dtype=np.int64) if n else np.empty(0, dtype=np.int64)
        hook_m = np.array([mi[m] for m, _ in t.hook_names] or [0], dtype=np.int32)
        hook_k = np.array([ki[k] for _, k in t.hook_names] or [0], dtype=np.int32)
        self.site_codes = {"module": hook_m[hooks], "kind": hook_k[hooks],
                           "dtype": np.array([di[d] for d in t.dtypes[:n]], dtype=np.int32)}
        self.dicts = {"module": pa.array(mods or [""], pa.string()), "kind": pa.array(kinds or [""], pa.string()),
                      "dtype": pa.array(dts or [""], pa.string())}
        self.index = np.asarray(t.index[:n], dtype=np.int32)


_SITES: dict = {}  # one entry: (id(site table), hooks, sites) -> _SiteDicts; replaced whole (the export thread reads it)


def _site_dicts(t) -> _SiteDicts:
    key = (id(t), len(t.hook_names), len(t))
    sd = _SITES.get(key)
    if sd is None:
        sd = _SiteDicts(t)
        _SITES.clear()
        _SITES[key] = sd
    return sd


_F32 = np.finfo(np.float32)


def stat_column(pa, field: str, values: np.ndarray, stats_dtype: str, unfit: Optional[list] = None):
    """One statistic's column: int64 counts, float64, or float32 with the values float32 cannot hold as nulls (Note
    [statistics that float32 cannot hold]; each such column appended to `unfit` as (field, rows, values))."""
    f = BY_NAME.get(field)
    if f is not None and f.kind == "count":  # NaN: a record of a log written before the field existed
        missing = np.isnan(values)
        return pa.array(np.where(missing, 0, values).astype(np.int64), mask=missing if missing.any() else None)
    if stats_dtype != "float32":
        return pa.array(values.astype(np.float64, copy=False))
    with np.errstate(over="ignore", under="ignore"):
        f = values.astype(np.float32)
    bad = (np.isinf(f) & np.isfinite(values)) | ((f == 0) & (values != 0))
    if not bad.any():
        return pa.array(f)
    if unfit is not None:
        rows = np.flatnonzero(bad)
        unfit.append((field, rows, values[rows]))
    return pa.array(f, mask=bad)


def block_table(block, stats_dtype: str = "float64", metadata: Optional[dict] = None, unfit: Optional[list] = None):
    """The rows of one Block as a pyarrow.Table (see the module docstring). stats_dtype: "float64" or "float32" for
    the non-count statistics; unfit: a list that gets the float32 values written as null (stat_column)."""
    pa = _pa()
    if stats_dtype not in ("float64", "float32"):
        raise ValueError(f"hookstats: stats_dtype must be 'float64' or 'float32', got {stats_dtype!r}")
    n = len(block)
    locations = getattr(block, "loc", None) is not None
    merged = getattr(block, "ranks", None) is not None
    made = _identity_columns(pa, block)
    for j, f in enumerate(STATS_FIELDS):
        made[f] = stat_column(pa, f, block.stats[:, j], stats_dtype, unfit)
    if locations:
        made.update(_location_columns(pa, block))
    if merged:
        made.update(_merge_columns(pa, block))
    cols = {f.name: made.pop(f.name) for f in FIELDS
            if f.kind != "histogram" and present(f, locations=locations, merged=merged)}
    assert not made, f"columns outside the field specification: {sorted(made)}"
    by_len: dict = {}
    for g, h in enumerate(block.hists):
        by_len.setdefault(h.shape[-1], []).append(g)
    for length, groups in sorted(by_len.items()):
        has = np.isin(block.hist_group, groups) if len(groups) > 1 else block.hist_group == groups[0]
        rows = np.flatnonzero(has)
        if not len(rows):
            continue
        values = np.empty((len(rows), length), dtype=np.int64)
        for g in groups:
            sel = block.hist_group[rows] == g
            if sel.any():
                values[sel] = block.hists[g][block.hist_row[rows[sel]]]
        offsets = np.zeros(n + 1, dtype=np.int32)
        offsets[1:] = np.cumsum(has * length)
        cols[hist_column(length)] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.reshape(-1)),
                                                             mask=pa.array(~has))
    t = pa.table(cols)
    return with_run_info(t, metadata) if metadata is not None else t


def _identity_columns(pa, block) -> dict:
    """seq, step and the site columns of a block (the site ones through the site table's dictionary codes)."""
    n = len(block)
    sd = _site_dicts(block.table)
    sites = np.asarray(block.sites, dtype=np.int64)
    cols = {"seq": pa.array(np.arange(block.seq0, block.seq0 + n, dtype=np.int64)),
            "step": pa.array(np.asarray(block.steps, dtype=np.int64)), "index": pa.array(sd.index[sites])}
    for c in SITE_COLUMNS:
        cols[c] = pa.DictionaryArray.from_arrays(pa.array(sd.site_codes[c][sites]), sd.dicts[c])
    return cols


def _ragged(pa, values: np.ndarray, lengths: np.ndarray, valid: Optional[np.ndarray] = None):
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(values, dtype=np.int64)),
                                    mask=None if valid is None else pa.array(~valid))


def _location_columns(pa, block) -> dict:
    """The location columns of a block with locations: its shapes, and the coordinates of its flat indices (block.loc:
    one column per coordinate column, in LOCATION_COLUMNS order), in numpy."""
    ndim = np.asarray(block.shape_ndim, dtype=np.int64)
    dims = np.asarray(block.shape_dims, dtype=np.int64)
    shape, *coord_names = LOCATION_COLUMNS
    cols = {shape: _ragged(pa, dims, ndim)}
    for j, name in enumerate(coord_names):
        coords, valid, _ = unravel_many(block.loc[:, j], ndim, dims)
        keep = np.repeat(valid, ndim)
        cols[name] = _ragged(pa, coords[keep], np.where(valid, ndim, 0), valid)
    return cols


def _merge_columns(pa, block) -> dict:
    """The merge columns of a block merged across ranks: ranks, nonfinite_ranks (from the bitmask of ranks 0-62) and,
    with locations, location_rank."""
    mask = np.asarray(block.nonfinite_mask, dtype=np.int64)
    bits = (mask[:, None] >> np.arange(63, dtype=np.int64)) & 1 if len(mask) else np.zeros((0, 63), np.int64)
    cols = {"ranks": pa.array(np.asarray(block.ranks, dtype=np.int32)),
            "nonfinite_ranks": pa.ListArray.from_arrays(
                pa.array(np.concatenate([[0], np.cumsum(bits.sum(1))]).astype(np.int32)),
                pa.array(np.nonzero(bits)[1].astype(np.int32)))}
    if getattr(block, "location_rank", None) is not None:
        cols["location_rank"] = pa.array(np.asarray(block.location_rank, dtype=np.int32))
    return cols


def with_run_info(table, info: Optional[dict]):
    if info is None:
        return table
    meta = dict(table.schema.metadata or {})
    meta[RUN_KEY] = json.dumps(info, default=str).encode()
    return table.replace_schema_metadata(meta)


def run_info(table) -> dict:
    """The run header stored in a table's schema metadata ({} when there is none)."""
    meta = table.schema.metadata or {}
    raw = meta.get(RUN_KEY)
    return json.loads(raw) if raw else {}


def empty_table(stats_dtype: str = "float64"):
    """A table of no records: the columns every run has."""
    return records_schema({}, stats_dtype).empty_table()


def concat(tables: Sequence, stats_dtype: str = "float64"):
    """Tables of flushes as one (missing histogram columns become nulls); an empty table for none."""
    pa = _pa()
    tables = [t for t in tables if t.num_rows] or []
    if not tables:
        return empty_table(stats_dtype)
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="default")


def table_records(table) -> list:
    """The rows of a records table as record dicts (records()'s form: the fields the table has, stats as a dict of
    float / int, histogram as a list or None; Note [record fields])."""
    names = table.column_names
    hcols = hist_columns(names)
    py = {c: table.column(c).to_pylist() for c in names if c not in hcols}
    hists = [table.column(c).to_pylist() for c in hcols]
    n = table.num_rows
    stat_cols = [(f, py[f], BY_NAME[f].kind == "count") for f in STATS_FIELDS if f in py]
    before, after = [], []  # (name, record values) of the fields before the statistics and after the histogram
    for f in FIELDS:
        if f.kind in STAT_KINDS or f.kind == "histogram" or f.name not in py:
            continue
        codec = TABLE_CODECS[f.json]
        v = py[f.name] if codec is TABLE_CODECS["int"] else [codec(x) for x in py[f.name]]  # int: as they are
        (before if f.kind == "identity" else after).append((f.name, v))
    out = []
    for i in range(n):
        r = {name: v[i] for name, v in before}
        r["stats"] = {f: (None if v[i] is None else int(v[i]) if cnt else float(v[i])) for f, v, cnt in stat_cols}
        r["histogram"] = next((hc[i] for hc in hists if hc[i] is not None), None)
        for name, v in after:
            r[name] = v[i]
        out.append(r)
    return out


def records_table(records: Sequence[dict], stats_dtype: str = "float64", unfit: Optional[list] = None):
    """record dicts (a JSONL log read back) as a records table (stats_dtype and unfit: block_table): every field the
    records have (an identity column an old record lacks: its default; Note [record fields])."""
    pa = _pa()
    records = list(records)
    if not records:
        return empty_table(stats_dtype)
    cols = {}
    stats = np.array([[r["stats"].get(f, np.nan) for f in STATS_FIELDS] for r in records], dtype=np.float64)
    for f in FIELDS:
        if f.kind in STAT_KINDS:
            cols[f.name] = stat_column(pa, f.name, stats[:, STATS_FIELDS.index(f.name)], stats_dtype, unfit)
        elif f.kind == "histogram":
            continue
        elif f.when == "always" or any(f.name in r for r in records):
            vals = [record_value(f, r, i) for i, r in enumerate(records)]
            if f.arrow == "dict":
                cols[f.name] = pa.array(vals, pa.string()).dictionary_encode()
            else:
                cols[f.name] = pa.array(vals, arrow_type(pa, f, stats_dtype))
    lens = sorted({len(r["histogram"]) for r in records if r.get("histogram") is not None})
    for L in lens:
        cols[hist_column(L)] = pa.array([r["histogram"] if r.get("histogram") is not None and
                                         len(r["histogram"]) == L else None for r in records],
                                        arrow_type(pa, BY_NAME["histogram"]))
    return pa.table(cols)


def scalars_table(scalars: Sequence[dict]):
    pa = _pa()
    return pa.table({"seq": pa.array([s["seq"] for s in scalars], pa.int64()),
                     "step": pa.array([s["step"] for s in scalars], pa.int64()),
                     "tag": pa.array([s["tag"] for s in scalars], pa.string()).dictionary_encode(),
                     "value": pa.array([float(s["value"]) for s in scalars], pa.float64())})


def table_scalars(table) -> list:
    if table is None or table.num_rows == 0:
        return []
    cols = {c: table.column(c).to_pylist() for c in ("seq", "step", "tag", "value")}
    return [{"seq": a, "step": b, "tag": c, "value": float(d)} for a, b, c, d in
            zip(cols["seq"], cols["step"], cols["tag"], cols["value"])]


__all__ = ["block_table", "concat", "table_records", "records_table", "records_schema", "arrow_type", "conform", "scalars_table",
           "table_scalars", "run_info", "with_run_info", "hist_columns", "hist_column", "RECORD_COLUMNS",
           "SITE_COLUMNS", "RUN_KEY", "LOCATION_COLUMNS", "MERGE_COLUMNS", "HIST_PREFIX", "stat_column"]
