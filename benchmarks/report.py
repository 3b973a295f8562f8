"""The benchmark report: pytest-benchmark JSON in, Markdown tables out (stdlib only).

    python -m pytest benchmarks --benchmark-only --benchmark-json=bench.json
    python benchmarks/report.py bench.json [more.json ...] [--markdown docs/benchmarks.md] [--command "..."]

Nothing here knows a benchmark. Each `benchmarks/test_bench_*.py` declares its tables in a module-level literal
`REPORT = [...]` (read with `ast.literal_eval`, names of other module-level literals resolved, so this script imports neither torch nor the benchmark files), and
the targets live in `benchmarks/targets.json`. A table spec is a dict:

    id        the name targets refer to
    title     the heading; `split` values are appended to it
    family    extra_info["family"] of the benchmarks it reads (a string or a list)
    where     optional expression over a record; records where it is false are left out
    explode   optional {"key": name, "fields": [f, ...]}: one record per key of the dict extra_info[f[0]]; each
              field's value at that key is merged in (a dict) or stored under the field's name
    split     extra_info keys: one table per combination of their values
    rows      extra_info keys: one row per combination, in the order the run measured them
    pivot     optional key (usually "case"): each record's time goes into `t.<value>` of its row
    aliases   optional {pivot value: name}: e.g. "histc_f32" -> "histc"
    define    optional [[name, expression], ...], computed per row in order, before the columns
    columns   [[header, expression, format], ...]
    labels    optional {value: text}, read by label(value) in expressions
    note      optional text printed under the table

Expressions are Python over a row: its records' extra_info (the first record's value wins), `time` (the median
in seconds, or the CUDA-event time when the benchmark recorded one), `iqr` (/ median), `rounds`, `t` (the pivot's
times), the defines, and `at(**match)` (another row of the same table), `rows` (all of them), `label`, `mean`.
A missing name is None, and a cell whose expression fails (None in arithmetic, a division by zero) prints "–".
Formats: us, ms (seconds), s, x (a ratio), gbps, pct, int, f1, f2, f3, or none (str).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import json
import os
import statistics
import sys
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# The order of the report's sections; a benchmark file not listed here comes after, by name.
FILES = ("test_bench_stats.py", "test_bench_hist.py", "test_bench_clip.py", "test_bench_channel.py",
         "test_bench_monitor.py", "test_bench_large_models.py", "test_bench_per_sample.py", "test_bench_compile.py",
         "test_bench_distributed.py", "test_bench_export.py")
SAFE_BUILTINS = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "dict", "float", "int", "isinstance", "len", "list", "max", "min", "round", "sorted", "str",
    "sum", "tuple")}


class Row(dict):
    """A row's namespace: attribute access, None for what the row does not have."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


class _Resolve(ast.NodeTransformer):
    def __init__(self, assigned: dict):
        self.assigned = assigned

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return self.visit(self.assigned[node.id]) if node.id in self.assigned else node


def read_specs(folder: str = HERE) -> list[dict]:
    """Every table spec, in FILES order: the `REPORT = [...]` literal of each benchmark file."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("test_bench_") and n.endswith(".py"))
    names.sort(key=lambda n: FILES.index(n) if n in FILES else len(FILES))
    specs = []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            tree = ast.parse(f.read(), name)
        assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        if "REPORT" in assigned:  # a name inside it may refer to another module-level literal (a labels dict)
            resolve = _Resolve(assigned)
            for spec in ast.literal_eval(resolve.visit(assigned["REPORT"])):
                specs.append(dict(spec, file=name))
    return specs


def read_records(paths: list[str]) -> tuple[list[dict], dict]:
    """The benchmarks of every JSON file as flat records (extra_info + time, iqr, rounds), and the first file's
    header (machine_info, datetime)."""
    records, header = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        header = header or {k: data.get(k) for k in ("machine_info", "datetime", "commit_info")}
        for bench in data.get("benchmarks", []):
            stats, extra = bench.get("stats") or {}, dict(bench.get("extra_info") or {})
            median = stats.get("median")
            time = extra["cuda_event_s"] if extra.get("cuda_event_s") is not None else median
            records.append(dict(extra, time=time, rounds=stats.get("rounds"), name=bench.get("name"),
                                iqr=stats["iqr"] / median if median and stats.get("iqr") is not None else None))
    return records, header


def evaluate(expr: str, ns: dict) -> Any:
    try:
        return eval(expr, ns)  # noqa: S307 - the expressions are this repository's own table specs
    except (TypeError, ZeroDivisionError, ValueError, KeyError, AttributeError, IndexError):
        return None


def _namespace(row: Row, table: list[Row], spec: dict) -> dict:
    def at(**match) -> Row:
        return next((r for r in table if all(r.get(k) == v for k, v in match.items())), Row())

    labels = spec.get("labels", {})
    ns = {"__builtins__": SAFE_BUILTINS, "at": at, "rows": table, "label": lambda v: labels.get(v, v),
          "mean": lambda xs: statistics.fmean(xs) if all(x is not None for x in xs) and xs else None}
    ns.update(dict.fromkeys(table[0].get("_keys", ()), None) if table else {})
    ns.update(row)
    return ns


def _explode(rec: dict, how: dict) -> list[dict]:
    fields = how["fields"]
    first = rec.get(fields[0]) or {}
    out = []
    for key in first:
        r = {k: v for k, v in rec.items() if k not in fields}
        r[how["key"]] = key
        for f in fields:
            v = (rec.get(f) or {}).get(key)
            r.update(v) if isinstance(v, dict) else r.__setitem__(f, v)
        out.append(r)
    return out


def build(spec: dict, records: list[dict]) -> dict[tuple, list[Row]]:
    """{split values: rows} of one spec: records selected, exploded, grouped into rows, defines computed."""
    families = spec["family"] if isinstance(spec["family"], list) else [spec["family"]]
    mine = [r for rec in records if rec.get("family") in families
            for r in (_explode(rec, spec["explode"]) if "explode" in spec else [rec])]
    keys = sorted({k for r in mine for k in r})
    chosen = [r for r in mine if "where" not in spec
              or evaluate(spec["where"], {"__builtins__": SAFE_BUILTINS, **dict.fromkeys(keys), **r})]
    tables: dict[tuple, dict[tuple, Row]] = {}
    pivot, aliases = spec.get("pivot"), spec.get("aliases", {})
    for rec in chosen:
        split = tuple(rec.get(k) for k in spec.get("split", ()))
        rowkey = tuple(str(rec.get(k)) for k in spec.get("rows", ()))
        row = tables.setdefault(split, {}).setdefault(rowkey, Row(_keys=keys, t=Row()))
        for k, v in rec.items():
            row.setdefault(k, v)
        if pivot is not None and rec.get(pivot) is not None:
            row["t"].setdefault(aliases.get(rec[pivot], rec[pivot]), rec["time"])
    out = {}
    for split, rows in tables.items():
        table = list(rows.values())
        for name, expr in spec.get("define", ()):
            for row in table:  # every row gets a define before the next one: a define may read another row's
                row[name] = evaluate(expr, _namespace(row, table, spec))
        out[split] = table
    return out


def fmt(value: Any, how: Optional[str]) -> str:
    if value is None:
        return "–"
    if how in ("us", "ms"):
        v = value * (1e6 if how == "us" else 1e3)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.2f}"
    formats = {"s": "{:.2f}", "x": "{:.2f}x", "gbps": "{:.1f}", "pct": "{:.0%}", "int": "{:,.0f}", "f1": "{:.1f}",
               "f2": "{:.2f}", "f3": "{:.3f}"}
    try:
        return formats[how].format(value) if how in formats else str(value)
    except (TypeError, ValueError):  # a string where a number was expected: show it as it is
        return str(value)


def check_target(target: dict, table: list[Row], spec: dict) -> Optional[str]:
    """One line: what was measured against the target; None when the run measured nothing for it."""
    op, goal = target["op"], target["target"]
    if target.get("per") == "table":
        values = [evaluate(target["value"], _namespace(Row(), table, spec))]
    else:
        picked = [r for r in table if evaluate(target.get("where", "True"), _namespace(r, table, spec))]
        values = [evaluate(target["value"], _namespace(r, table, spec)) for r in picked]
    values = [v for v in values if v is not None]
    if not values:
        return None
    met = all(v <= goal if op == "<=" else v >= goal for v in values)
    how = target.get("format", "x")
    shown = ", ".join(fmt(v, how) for v in values)
    line = f"- {target['text']}: {shown} (target {op} {fmt(goal, how)}: "
    return line + ("met)" if met else f"not reached; {target['limit']})" if target.get("limit") else "not reached)")


def render(specs: list[dict], records: list[dict], targets: list[dict]) -> str:
    out, missing = [], []
    for spec in specs:
        built = build(spec, records)
        if not any(built.values()):
            missing.append(f"{spec['title']} (`{spec['file']}`)")
        for split, table in built.items():
            if not table:
                continue
            title = spec["title"] + "".join(f", {v}" for v in split if v is not None)
            out += [f"### {title}", "", "| " + " | ".join(c[0] for c in spec["columns"]) + " |",
                    "|" + "|".join("---:" if len(c) > 2 and c[2] not in (None, "str") else "---"
                                   for c in spec["columns"]) + "|"]
            for row in table:
                ns = _namespace(row, table, spec)
                out.append("| " + " | ".join(fmt(evaluate(c[1], ns), c[2] if len(c) > 2 else None)
                                             for c in spec["columns"]) + " |")
            out.append("")
            if spec.get("note"):
                out += [spec["note"], ""]
            lines = []
            for target in targets:
                if target["table"] != spec["id"]:
                    continue
                if any(split[spec["split"].index(k)] != v for k, v in target.get("split", {}).items()):
                    continue
                line = check_target(target, table, spec)
                if line:
                    lines.append(line)
            if lines:
                out += ["Targets:", ""] + lines + [""]
    if missing and out:
        out += ["Not in this run: " + "; ".join(missing) + ".", ""]
    return "\n".join(out) if out else "No benchmarks of a known table in this file.\n"


def header(info: dict, paths: list[str], commands: list[str]) -> str:
    m = info.get("machine_info") or {}
    cpu = m.get("cpu") or {}
    machine = ", ".join(str(x) for x in (cpu.get("brand_raw"), f"{cpu.get('count')} cores" if cpu.get("count") else None,
                                          m.get("system"), m.get("release"),
                                          f"Python {m.get('python_version')}" if m.get("python_version") else None)
                        if x)
    commit = (info.get("commit_info") or {}).get("id")
    return "\n".join([
        "# Benchmarks", "",
        "Generated by `benchmarks/report.py` from a pytest-benchmark run; regenerate with `make bench`, or run a",
        "subset and `python benchmarks/report.py bench.json --markdown docs/benchmarks.md --command \"...\"`.", "",
        f"- **Machine**: {machine or 'unknown'}",
        f"- **Date**: {info.get('datetime') or 'unknown'}" + (f" (commit `{commit[:10]}`)" if commit else ""),
        *(f"- **Command**: `{c}`" for c in commands),
        f"- **Data**: {', '.join(os.path.basename(p) for p in paths)}", "", READING, ""])


READING = """Each hookstats case is timed beside the plain-PyTorch way of computing the same thing, and beside a one-read
roof (`x.sum()` on the CPU, a device copy on CUDA), in the same run; read the ratios rather than the absolute times,
which move with the machine and its load. Times are medians (µs or ms) unless a table says otherwise. The targets
under a table come from `benchmarks/targets.json`; where one is not reached, the line says what limits it. GPU
numbers come from `scripts/gpu_check.sh` on a GPU machine (its `bench.md`), not from this page.
"""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_paths", nargs="+", help="pytest-benchmark JSON files (--benchmark-json=PATH)")
    parser.add_argument("--markdown", metavar="OUT", help="also write the report, with its header, to this file")
    parser.add_argument("--command", action="append", help="the command that ran (one per JSON file, if several)")
    parser.add_argument("--preamble", metavar="FILE", help="Markdown inserted after the header (what was run)")
    parser.add_argument("--targets", default=os.path.join(HERE, "targets.json"))
    args = parser.parse_args(argv)
    records, info = read_records(args.json_paths)
    with open(args.targets) as f:
        targets = json.load(f)["targets"]
    text = render(read_specs(), records, targets)
    sys.stdout.write(text)
    if args.markdown:
        pre = open(args.preamble).read().rstrip() + "\n\n" if args.preamble else ""
        with open(args.markdown, "w") as f:
            commands = args.command or ["pytest benchmarks --benchmark-only"]
            f.write(header(info, args.json_paths, commands) + pre + text.rstrip() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
