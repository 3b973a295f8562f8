"""What a record is made of: every column of a record, in one place (Note [record fields]). Pure Python (no torch,
no compiled extension), so that a log reader needs neither: the op layer (`_types`), the merge across ranks, the
Monitor's blocks, the Arrow tables and every writer and reader of the run log derive their columns from here.

Note [record fields]
A record (one recorded tensor at one step) is one row of `FIELDS`, in this order; each field says
  kind    identity (which tensor, when), count / value (a statistic: int64 / float), histogram, location (with
          Monitor(locations=True)), merge (records merged across ranks)
  arrow   its Arrow type ("float": float64, or float32 in a float32 log; "dict": dictionary<int32, string>)
  json    its JSON codec in the JSONL log and its form in a record dict ("float": a non-finite float as the string
          "NaN" / "Infinity" / "-Infinity"; "coords": a list of ints or null, a tuple in a record dict; "sparse": a
          histogram as {"length", "nonzero": [[i, count], ...]}, dense in a record dict)
  when    which runs have it: "always", "histogram" (one column histogram_{L} per histogram length L), "locations",
          "merged", "merged+locations"
  merge   how a statistic combines across ranks (Note [merging records across ranks] in monitor/merge.py): "sum", or a
          rule of its own there
The statistics (kinds count and value) are listed in the order of a stats row: the StatField enum of
csrc/core/stats_ops.h (Note [stats row layout]; tests/test_fields.py checks the two against each other). The kernels
return a statistic's value in `values` or `counts` by its kind, in row order within each (`STAT_PARTS`). In a record
dict the statistics sit under "stats" ({name: value}), the histogram under "histogram" (a list, or None); a log
written before a column existed reads with the column missing (records) or null (tables).
Adding a statistic: its Field here (its merge rule, if not "sum", in monitor/merge.py) and its math in
csrc/core/stats_ops.h (enum, name table, partial / merge / finalize) and hookstats/reference.py.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional


class Field(NamedTuple):
    name: str
    kind: str  # identity | count | value | histogram | location | merge
    arrow: str  # int64 | int32 | float | dict | list<int64> | list<int32>
    json: str  # int | str | float | coords | list | sparse
    when: str = "always"  # always | histogram | locations | merged | merged+locations
    merge: str = ""  # statistics: "sum", or the name of a rule in monitor/merge.py
    site: bool = False  # identity columns kept once per site (Note [monitor sites]), not per row
    default: object = None  # what a record dict of an old log lacking the key reads as (None: required)


def _count(name: str) -> Field:
    return Field(name, "count", "int64", "int", merge="sum")


def _value(name: str, merge: str) -> Field:
    return Field(name, "value", "float", "float", merge=merge)


FIELDS: tuple = (
    Field("seq", "identity", "int64", "int", default="row"),  # records are numbered in flush order
    Field("step", "identity", "int64", "int"),
    Field("module", "identity", "dict", "str", site=True),
    Field("kind", "identity", "dict", "str", site=True),
    Field("index", "identity", "int32", "int", site=True, default=0),  # the tensor's place in what the hook saw
    Field("dtype", "identity", "dict", "str", site=True, default=""),
    # Note [stats row layout]: the statistics, in the order of a stats row
    _count("numel"),
    _value("sum", "sum"),
    _value("mean", "mean"),
    _value("var", "var"),
    _value("std", "std"),
    _value("l1", "sum"),
    _value("l2", "l2"),
    _value("linf", "linf"),
    _value("min", "min"),
    _value("max", "max"),
    _count("nan_count"),
    _count("inf_count"),
    _count("zero_count"),
    Field("histogram", "histogram", "list<int64>", "sparse", "histogram"),
    # Note [element locations] (csrc/core/loc_ops.h): the tensor's shape, then coordinates (null: no such element)
    Field("shape", "location", "list<int64>", "coords", "locations"),
    Field("argmax_abs_index", "location", "list<int64>", "coords", "locations"),
    Field("first_nonfinite_index", "location", "list<int64>", "coords", "locations"),
    # Note [merging records across ranks]: how many ranks wrote the record, those whose tensor held a NaN/Inf, and
    # the rank of the element named by the location columns
    Field("ranks", "merge", "int32", "int", "merged"),
    Field("nonfinite_ranks", "merge", "list<int32>", "list", "merged"),
    Field("location_rank", "merge", "int32", "int", "merged+locations"),
)
BY_NAME = {f.name: f for f in FIELDS}

STAT_KINDS = ("count", "value")
STATS = tuple(f for f in FIELDS if f.kind in STAT_KINDS)
STATS_FIELDS = tuple(f.name for f in STATS)  # hookstats.STATS_FIELDS
COUNT_FIELDS = tuple(f.name for f in STATS if f.kind == "count")
VALUE_FIELDS = tuple(f.name for f in STATS if f.kind == "value")
STAT_INDEX = {name: i for i, name in enumerate(STATS_FIELDS)}  # a statistic's column in a stats row


def parts_of(fields, counts) -> tuple:
    """Where each of `fields` is in a kernel's (values, counts) outputs, the count fields `counts` in the second and
    the others in the first, each in the order of `fields`: (("values" | "counts", position), ...)."""
    values = [f for f in fields if f not in counts]
    return tuple(("counts", list(counts).index(f)) if f in counts else ("values", values.index(f)) for f in fields)


STAT_PARTS = parts_of(STATS_FIELDS, COUNT_FIELDS)  # the stats ops' (values, counts)

IDENTITY_COLUMNS = tuple(f.name for f in FIELDS if f.kind == "identity")
SITE_COLUMNS = tuple(f.name for f in FIELDS if f.arrow == "dict")  # dictionary-encoded
LOCATION_COLUMNS = tuple(f.name for f in FIELDS if f.kind == "location")
MERGE_COLUMNS = tuple(f.name for f in FIELDS if f.kind == "merge")
HIST_PREFIX = "histogram_"


def hist_column(length: int) -> str:
    """The table column of histograms of `length` counts."""
    return f"{HIST_PREFIX}{int(length)}"


def present(field: Field, *, histogram: bool = False, locations: bool = False, merged: bool = False) -> bool:
    """Whether a run with these options has the field."""
    w = field.when
    return (w == "always" or (w == "histogram" and histogram) or (w == "locations" and locations)
            or (w == "merged" and merged) or (w == "merged+locations" and merged and locations))


def run_fields(info: dict) -> tuple:
    """The fields of a run, from its header (Monitor.run_info(): "histogram", "locations", "merged")."""
    opts = {"histogram": bool(info.get("histogram")), "locations": bool(info.get("locations")),
            "merged": bool(info.get("merged"))}
    return tuple(f for f in FIELDS if present(f, **opts))


# -- float dtypes -----------------------------------------------------------------------------------------------------
class FloatDType(NamedTuple):
    name: str  # torch's name, and a record's "dtype"
    scalar_type: str  # c10's ScalarType name (what the C++ recorder reports)
    exponent_bits: int
    mantissa_bits: int


# The dtypes the kernels take. A dtype's position is its code (the merge's buffers).
DTYPES = (FloatDType("float32", "Float", 8, 23), FloatDType("float64", "Double", 11, 52),
          FloatDType("float16", "Half", 5, 10), FloatDType("bfloat16", "BFloat16", 8, 7))
DTYPE_BY_NAME = {d.name: d for d in DTYPES}
DTYPE_NAMES = {d.scalar_type: d.name for d in DTYPES}  # ScalarType name -> dtype name


def range_hist_length(bins: int) -> int:
    """A range histogram: the bins, then underflow, overflow and NaN (Note [histogram layouts])."""
    return int(bins) + 3


def exp_hist_length(dtype: str) -> int:
    """An exponent histogram of `dtype` (a DTYPES name): every normal binade by sign, then subnormals, zero, Infs and
    NaN (Note [histogram layouts])."""
    d = DTYPE_BY_NAME.get(dtype)
    if d is None:
        raise TypeError(f"hookstats: no exponent histogram for {dtype}; supported: "
                        f"{', '.join(x.name for x in DTYPES)}")
    return 2 * (2 ** d.exponent_bits - 2) + 6


def hist_lengths(spec: Optional[dict]) -> list:
    """Every histogram length a run can have, from its header's histogram spec ({"kind": "exp"} or {"kind": "range",
    "bins": B}; None: none): one for a range histogram, one per dtype for an exponent histogram."""
    if not spec:
        return []
    if spec["kind"] == "exp":
        return sorted({exp_hist_length(d.name) for d in DTYPES})
    return [range_hist_length(spec["bins"])]


# -- codecs -----------------------------------------------------------------------------------------------------------
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def enc_float(v: float):
    """A float as strict JSON holds it: a non-finite one as "NaN", "Infinity" or "-Infinity"."""
    if v != v:
        return "NaN"
    if v == math.inf:
        return "Infinity"
    if v == -math.inf:
        return "-Infinity"
    return v


def dec_float(v):
    return _NONFINITE[v] if isinstance(v, str) else v


def stats_dict(row) -> dict:
    """A stats row (STATS_FIELDS order) as a record's "stats": counts as int (NaN stays NaN: a row never written)."""
    st = dict(zip(STATS_FIELDS, row))
    for k in COUNT_FIELDS:
        v = st[k]
        if v == v:
            st[k] = int(v)
    return st


# The keys of a record dict, in order: the statistics under one key, "stats", where they are in FIELDS (Block.record
# builds its dicts in this order; tests/test_fields.py checks them).
RECORD_KEYS = tuple(dict.fromkeys("stats" if f.kind in STAT_KINDS else f.name for f in FIELDS))


def unravel_many(flat, ndim, dims):
    """The location columns' coordinates from flat indices, for many records at once (records of different ndim):
    flat[i] in record i's shape, its ndim[i] sizes at dims[off[i]:off[i + 1]] (off: the running sum of ndim).
    Returns (coords, valid, off): coords laid out like dims (int64; zeros where flat[i] is -1), valid = flat >= 0."""
    import numpy as np

    flat = np.asarray(flat, dtype=np.int64)
    ndim = np.asarray(ndim, dtype=np.int64)
    dims = np.asarray(dims, dtype=np.int64)
    off = np.zeros(len(ndim) + 1, dtype=np.int64)
    np.cumsum(ndim, out=off[1:])
    valid = flat >= 0
    coords = np.zeros(len(dims), dtype=np.int64)
    rest = np.where(valid, flat, 0)
    for k in range(int(ndim.max()) if len(ndim) else 0):  # row-major: the last dim first
        has = valid & (ndim > k)  # (a record without a location may have a 0-size dim)
        pos = off[:-1][has] + ndim[has] - 1 - k
        d = dims[pos]
        coords[pos] = rest[has] % d
        rest[has] //= d
    return coords, valid, off


def _sparse(h):
    return None if h is None else {"length": len(h), "nonzero": [[i, c] for i, c in enumerate(h) if c]}


def _dense(h):
    if h is None:
        return None
    out = [0] * h["length"]
    for i, c in h["nonzero"]:
        out[i] = c
    return out


def _coords_out(v):
    return None if v is None else list(v)


def _coords_in(v):
    return None if v is None else tuple(v)


def _same(v):
    return v


# JSON codec name -> (record value -> JSON value, JSON value -> record value)
JSON_CODECS = {"int": (_same, _same), "str": (_same, _same), "list": (_same, _same),
               "float": (lambda v: enc_float(v) if isinstance(v, float) else v, dec_float),
               "coords": (_coords_out, _coords_in), "sparse": (_sparse, _dense)}
# what a table's Python value (pyarrow's to_pylist) is in a record dict
TABLE_CODECS = {"int": _same, "str": _same, "list": _same, "coords": _coords_in,
                "float": lambda v: None if v is None else float(v)}


def encode_record(r: dict) -> dict:
    """A record dict as its JSONL object: the identity fields (an optional one as null where the record lacks it),
    the statistics, the histogram, then every other field the record has, each through its JSON codec."""
    out = {"type": "record"}
    for f in FIELDS:
        if f.kind in STAT_KINDS:
            continue
        if f.kind == "identity":
            out[f.name] = r[f.name] if f.default is None else r.get(f.name)
        elif f.kind == "histogram":  # the statistics go just before it
            out["stats"] = {k: JSON_CODECS["float"][0](v) for k, v in r["stats"].items()}
            out[f.name] = JSON_CODECS[f.json][0](r.get(f.name))
        elif f.name in r:
            out[f.name] = JSON_CODECS[f.json][0](r[f.name])
    return out


def decode_record(d: dict) -> dict:
    """A JSONL record object back as a record dict (the keys it has; statistics and histogram through their
    codecs)."""
    r = {}
    for f in FIELDS:
        if f.kind in STAT_KINDS:
            continue
        if f.kind == "histogram":
            r["stats"] = {k: JSON_CODECS["float"][1](v) for k, v in d["stats"].items()}
            r[f.name] = JSON_CODECS[f.json][1](d.get(f.name))
        elif f.name in d:
            r[f.name] = JSON_CODECS[f.json][1](d[f.name])
    return r


def record_value(f: Field, r: dict, i: int):
    """Field f of record dict r (row i of its log) for a table: a statistic from r["stats"] (NaN where an old
    record lacks it), an identity column's default where an old record lacks it (None or missing)."""
    if f.kind in STAT_KINDS:
        return r["stats"].get(f.name, math.nan)
    v = r.get(f.name)
    if v is None and f.default is not None:
        return i if f.default == "row" else f.default
    return None if v is None else (list(v) if f.json == "coords" else v)


__all__ = ["Field", "FIELDS", "BY_NAME", "STATS", "STATS_FIELDS", "COUNT_FIELDS", "VALUE_FIELDS", "STAT_INDEX",
           "STAT_PARTS", "parts_of", "IDENTITY_COLUMNS", "SITE_COLUMNS", "LOCATION_COLUMNS", "MERGE_COLUMNS", "HIST_PREFIX",
           "hist_column", "present", "run_fields", "FloatDType", "DTYPES", "DTYPE_BY_NAME", "DTYPE_NAMES",
           "range_hist_length", "exp_hist_length", "hist_lengths", "enc_float", "dec_float", "stats_dict",
           "unravel_many", "RECORD_KEYS", "encode_record", "decode_record", "record_value", "JSON_CODECS", "TABLE_CODECS"]
