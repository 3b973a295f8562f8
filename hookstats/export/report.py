"""A one-page report of a run directory: `make_report(RUN_DIR)` reads RUN_DIR/log.parquet (ParquetWriter) or
RUN_DIR/log.jsonl (JSONLWriter) into columns (hookstats.runlog.read_run) and writes RUN_DIR/report/
(PNG plots from hookstats.export.plots, report.md and report.html). `python -m hookstats report RUN_DIR` calls it.

The report: the run (versions, steps, records, histogram, modules), the first NaN/Inf and a table of the first
non-finite events, the scalars' final values, the plots (gradient flow, per-layer norm heatmap, histogram evolution,
scalars), and the per-layer summary table (Monitor.summary). The HTML page is self-contained (inline CSS) and shows
the PNGs by relative path, so the report folder can be moved or served as is.
"""
from __future__ import annotations

import html
import math
import os
from typing import Iterable, Optional, Sequence

import numpy as np

from ..monitor.summary import SUMMARY_HEADER, summary_cells, summary_from_groups
from ..runlog import JSONL_NAME as LOG_NAME
from ..runlog import find_log, read_run
from ..runlog.columns import Columns, first_seen
from . import analysis, plots

REPORT_DIR = "report"
MAX_EVENTS = 20
MAX_MODULES = 60
# file name -> (section title, caption)
IMAGES = {
    "grad_flow.png": ("Gradient flow", "l2 norm of each layer's gradient for a few steps (color: step; grey band: "
                                       "min..max over all steps; red x: NaN/Inf)."),
    "norm_heatmap.png": ("Per-layer norms over steps", "log10 of each layer's l2 norm at every step, per hook kind "
                                                       "(red: NaN/Inf, white: 0, grey: not recorded)."),
    "hist_evolution.png": ("Histograms over steps", "Per-step histograms of a few tensors (color: count, log scale)."),
    "scalars.png": ("Scalars", "Logged scalars (red lines: NaN/Inf values; dashed: steps where a recorded tensor "
                               "held NaN/Inf)."),
}


def _log_path(run_dir: str) -> str:
    if not os.path.exists(run_dir):
        raise FileNotFoundError(f"hookstats report: run directory {run_dir!r} does not exist; make one with "
                                f"Monitor(..., exporters=[ParquetWriter(RUN_DIR/log.parquet)]) (or JSONLWriter(RUN_DIR/"
                                f"{LOG_NAME})) or `python -m hookstats demo --out RUN_DIR`")
    try:
        return find_log(run_dir)
    except FileNotFoundError:
        raise FileNotFoundError(f"hookstats report: {run_dir} has no log.parquet or {LOG_NAME}; make one with "
                                f"Monitor(..., exporters=[ParquetWriter(RUN_DIR/log.parquet)]) (or JSONLWriter(RUN_DIR/"
                                f"{LOG_NAME})) or `python -m hookstats demo --out RUN_DIR`") from None


def summary_of(c: Columns) -> list:
    """Monitor.summary_rows() of a run's columns: grouped by (module, kind) codes, in the order first seen."""
    if not c.n:
        return []
    nk = max(1, len(c.kind_names))
    key = c.module * nk + c.kind
    u, first, inv = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(u), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(u))
    group = rank[inv]
    names = [None] * len(u)
    for j, k in enumerate(u):
        names[rank[j]] = (c.module_names[k // nk], c.kind_names[k % nk])
    return summary_from_groups(group, names, c.step, c.stats_matrix())


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Inf" if v > 0 else "-Inf"
        return f"{v:.6g}"
    return str(v)


def _hist_text(spec: Optional[dict]) -> str:
    if not spec:
        return "none"
    if spec.get("kind") == "exp":
        return "exponent (floor(log2|x|) per dtype exponent)"
    if spec.get("kind") == "range":
        return f"range: {spec.get('bins')} bins over [{spec.get('lo')}, {spec.get('hi')}] + under/overflow, NaN"
    return str(spec)


def _scalar_rows(scalars: Sequence[dict]) -> list:
    """[tag, values, last step, final value, min, max, non-finite] per tag (min/max over finite values)."""
    tags: dict = {}
    for s in scalars:
        tags.setdefault(s["tag"], []).append((s["step"], float(s["value"])))
    rows = []
    for tag, pts in tags.items():
        fin = [v for _, v in pts if math.isfinite(v)]
        last_step, last = pts[-1]
        rows.append([tag, str(len(pts)), str(last_step), _fmt(last), _fmt(min(fin)) if fin else "-",
                     _fmt(max(fin)) if fin else "-", str(len(pts) - len(fin))])
    return rows


SCALAR_HEADER = ("tag", "values", "last step", "final value", "min", "max", "NaN/Inf")
EVENT_HEADER = ("step", "module", "kind", "NaN", "Inf")


def _name(m: str) -> str:
    return m or "<model>"


# -- markdown ----------------------------------------------------------------------------------------------------
def _md_cell(s: str, code: bool = False) -> str:
    s = str(s).replace("|", "\\|").replace("\n", " ")
    return f"`{s}`" if code and s else s


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]], code_cols: Sequence[int] = ()) -> list:
    out = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_md_cell(c, i in code_cols) for i, c in enumerate(r)) + " |")
    return out


# -- report ------------------------------------------------------------------------------------------------------
class _Content:
    """What both formats show, computed once."""

    def __init__(self, run_dir: str, log, images: dict, cols: Columns, events: list):
        info, scalars = log.info, log.scalars
        records = cols
        self.title = f"hookstats report: {os.path.basename(os.path.normpath(run_dir)) or run_dir}"
        steps = sorted(set(np.unique(cols.step).tolist()) | {s["step"] for s in scalars})
        modules = info.get("modules")
        if modules is None:
            notgrad = ~cols.kind_mask("grad")
            modules = [cols.module_names[m] for m in first_seen(cols.module[notgrad])]
        self.modules = [_name(m) for m in modules[:MAX_MODULES]]
        self.modules_more = max(0, len(modules) - MAX_MODULES)
        shown = ", ".join(self.modules) + (f", ... ({self.modules_more} more)" if self.modules_more else "")
        kinds = info.get("kinds") or analysis.kinds_present(records)
        self.info_rows = [
            ("run directory", os.path.abspath(run_dir)),
            ("hookstats / torch", f"{info.get('hookstats', '?')} / {info.get('torch', '?')}"),
            ("steps", f"{len(steps)} ({steps[0]} .. {steps[-1]})" if steps else "0"),
            ("records / scalars", f"{cols.n} / {len(scalars)}"),
            ("log", f"{log.format}: {log.path}"),
            ("hook kinds", ", ".join(kinds) if kinds else "-"),
            ("histogram", _hist_text(info.get("histogram"))),
            (f"modules ({len(modules)})", shown or "-"),
        ]
        if info.get("every", 1) != 1:
            self.info_rows.append(("recorded every", f"{info['every']} steps"))
        if not info:
            self.info_rows.append(("note", "the log has no run header line"))
        if log.bad_lines:
            self.info_rows.append(("skipped lines", f"{log.bad_lines} line(s) that were not valid JSON (a last line "
                                                    "cut short when the run was killed)"))
        self.events = events
        ev = self.events
        self.first_event = ev[0] if ev else None
        self.first_element = ""  # runs with Monitor(locations=True): where in the first bad tensor
        if ev:
            r = cols.first_nonfinite_row()
            where = cols.coordinates("first_nonfinite_index", r) if r >= 0 else None
            if where is not None:
                shape = cols.coordinates("shape", r)
                self.first_element = f", element {where}" + (f" of a {tuple(shape)} tensor" if shape else "")
            e = ev[0]
            self.first = (f"First non-finite value: step {e.step}, module {_name(e.module)}, kind {e.kind}"
                          f"{self.first_element} ({e.nan_count} NaN, {e.inf_count} Inf)")
            nsteps = len({x.step for x in ev})
            self.events_note = f"{len(ev)} non-finite (step, module, kind) events in {nsteps} step(s)" + (
                f"; the first {MAX_EVENTS} are shown" if len(ev) > MAX_EVENTS else "")
        else:
            self.first = "No NaN or Inf in any recorded tensor."
            self.events_note = ""
        self.event_rows = [[str(x.step), _name(x.module), x.kind, str(x.nan_count), str(x.inf_count)]
                           for x in ev[:MAX_EVENTS]]
        self.scalar_rows = _scalar_rows(scalars)
        self.summary_rows = summary_cells(summary_of(cols))
        self.images = images
        self.grad_kind = analysis.gradient_kind(records)


def _markdown(c: _Content) -> str:
    out = [f"# {c.title}", "", "## Run", ""]
    mods = ", ".join(f"`{m}`" for m in c.modules) + (f", ... ({c.modules_more} more)" if c.modules_more else "")
    out += ["|  |  |", "|---|---|"]
    for k, v in c.info_rows:  # module names as code: "<model>" is not an HTML tag
        out.append(f"| {_md_cell(k)} | {(mods or '-') if k.startswith('modules (') else _md_cell(v)} |")
    first = c.first
    if c.first_event is not None:
        e = c.first_event
        first = (f"First non-finite value: step {e.step}, module `{_name(e.module)}`, kind {e.kind}"
                 f"{c.first_element} ({e.nan_count} NaN, {e.inf_count} Inf)")
    out += ["", "## Non-finite values", "", f"**{first}**", ""]
    if c.event_rows:
        out += [c.events_note + ":", ""]
        out += _md_table(EVENT_HEADER, c.event_rows, code_cols=(1,))
        out.append("")
    out += ["## Scalars", ""]
    if c.scalar_rows:
        out += _md_table(SCALAR_HEADER, c.scalar_rows, code_cols=(0,))
    else:
        out.append("No scalars were logged (Monitor.log).")
    out += ["", "## Plots", ""]
    if not c.images:
        out += ["No plots (nothing to draw).", ""]
    for name in c.images:
        title, caption = IMAGES[name]
        if name == "grad_flow.png" and c.grad_kind:
            caption += f" Kind: {c.grad_kind}."
        out += [f"### {title}", "", caption, "", f"![{title}]({name})", ""]
    out += ["## Per-layer summary", "",
            "Per (module, kind): records, the last step's l2 norm, the largest |x|, min and max over records without "
            "NaN, NaN and Inf totals.", ""]
    out += _md_table(SUMMARY_HEADER, c.summary_rows, code_cols=(0,))
    out.append("")
    return "\n".join(out)


_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1.5em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { font-size: 1.3em; margin-top: 1.8em; border-bottom: 1px solid #eee; padding-bottom: .2em; }
h3 { font-size: 1.1em; }
table { border-collapse: collapse; margin: .6em 0 1em; font-size: .9em; }
th, td { border: 1px solid #d0d0d0; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-family: SFMono-Regular, Consolas, Menlo, monospace; font-size: .92em; }
.bad { color: #b00020; font-weight: bold; }
.ok { color: #1b7f3b; font-weight: bold; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; height: auto; border: 1px solid #e5e5e5; }
figcaption { color: #555; font-size: .9em; margin-top: .3em; }
"""


def _html_table(header: Sequence[str], rows: Iterable[Sequence[str]], code_cols: Sequence[int] = (),
                num_cols: Sequence[int] = (), bad_col: Optional[Sequence[int]] = None) -> str:
    e = html.escape
    out = ["<table>"]
    if any(header):
        out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
    for r in rows:
        cells = []
        for i, v in enumerate(r):
            txt = f"<code>{e(str(v))}</code>" if i in code_cols else e(str(v))
            cls = []
            if i in num_cols:
                cls.append("num")
            if bad_col and i in bad_col and str(v) not in ("0", "-", ""):
                cls.append("bad")
            attr = f' class="{" ".join(cls)}"' if cls else ""
            cells.append(f"<td{attr}>{txt}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _html(c: _Content) -> str:
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{e(c.title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{e(c.title)}</h1>",
           "<h2>Run</h2>", _html_table(("", ""), c.info_rows), "<h2>Non-finite values</h2>",
           f'<p class="{"bad" if c.event_rows else "ok"}">{e(c.first)}</p>']
    if c.event_rows:
        out += [f"<p>{e(c.events_note)}:</p>",
                _html_table(EVENT_HEADER, c.event_rows, code_cols=(1,), num_cols=(0, 3, 4), bad_col=(3, 4))]
    out.append("<h2>Scalars</h2>")
    if c.scalar_rows:
        out.append(_html_table(SCALAR_HEADER, c.scalar_rows, code_cols=(0,), num_cols=(1, 2, 3, 4, 5, 6),
                               bad_col=(6,)))
    else:
        out.append("<p>No scalars were logged (Monitor.log).</p>")
    out.append("<h2>Plots</h2>")
    if not c.images:
        out.append("<p>No plots (nothing to draw).</p>")
    for name in c.images:
        title, caption = IMAGES[name]
        if name == "grad_flow.png" and c.grad_kind:
            caption += f" Kind: {c.grad_kind}."
        out += [f"<h3>{e(title)}</h3>", "<figure>", f'<a href="{e(name)}"><img src="{e(name)}" alt="{e(title)}">'
                                                     "</a>", f"<figcaption>{e(caption)}</figcaption>", "</figure>"]
    out += ["<h2>Per-layer summary</h2>",
            "<p>Per (module, kind): records, the last step's l2 norm, the largest |x|, min and max over records "
            "without NaN, NaN and Inf totals.</p>",
            _html_table(SUMMARY_HEADER, c.summary_rows, code_cols=(0,), num_cols=(2, 3, 4, 5, 6, 7, 8),
                        bad_col=(7, 8)),
            "</body>", "</html>", ""]
    return "\n".join(out)


def make_report(run_dir, out_dir=None, fmt: Sequence[str] | str = ("md", "html")) -> dict:
    """Reads RUN_DIR/log.parquet or RUN_DIR/log.jsonl (or a log given directly) into columns and writes into out_dir (default RUN_DIR/report) the
    plots (grad_flow.png, norm_heatmap.png, hist_evolution.png when the run has histograms, scalars.png when it
    logged scalars) and report.md / report.html (fmt: "md", "html" or both). Returns {file name: path} of what was
    written. A log whose last line was cut short by a kill is read up to it (Parquet: every completed flush).
    Layers are grouped with numpy on the site columns' codes; plots of many layers show the ones that matter
    (analysis.pick_layers). Raises FileNotFoundError without a log, ValueError when it holds no record and no
    scalar."""
    run_dir = os.fspath(run_dir)
    fmts = (fmt,) if isinstance(fmt, str) else tuple(fmt)
    bad = [f for f in fmts if f not in ("md", "html")]
    if bad:
        raise ValueError(f"hookstats report: unknown format(s) {bad}; use 'md' and/or 'html'")
    log_path = _log_path(run_dir)
    if os.path.abspath(log_path) == os.path.abspath(run_dir):  # a log given directly
        run_dir = os.path.dirname(os.path.abspath(run_dir))
    log = read_run(log_path)
    if not log.records.num_rows and not log.scalars:
        why = "is empty" if not log.info and not log.bad_lines else (
            "has a run header but no records yet (did the run flush? Monitor flushes at flush_every steps and at "
            "detach())" if log.info else "holds no valid line")
        raise ValueError(f"hookstats report: {log_path} {why}; nothing to report")
    out_dir = os.fspath(out_dir) if out_dir is not None else os.path.join(run_dir, REPORT_DIR)
    os.makedirs(out_dir, exist_ok=True)
    records = Columns.of(log.records)
    scalars, info = log.scalars, log.info
    order = info.get("modules")
    events = analysis.nonfinite_events(records)
    written: dict = {}
    images: dict = {}
    for name, draw in (
            ("grad_flow.png", lambda p: plots.grad_flow(records, p, order=order)),
            ("norm_heatmap.png", lambda p: plots.norm_heatmap(records, p, order=order)),
            ("hist_evolution.png", lambda p: plots.exp_hist_evolution(records, info, p, order=order)),
            ("scalars.png", lambda p: plots.scalars_plot(scalars, p, sorted({e.step for e in events})))):
        path = draw(os.path.join(out_dir, name))
        if path is not None:
            images[name] = path
    written.update(images)
    content = _Content(run_dir, log, images, records, events)
    if "md" in fmts:
        p = os.path.join(out_dir, "report.md")
        with open(p, "w", encoding="utf-8") as f:
            f.write(_markdown(content))
        written["report.md"] = p
    if "html" in fmts:
        p = os.path.join(out_dir, "report.html")
        with open(p, "w", encoding="utf-8") as f:
            f.write(_html(content))
        written["report.html"] = p
    return written


__all__ = ["make_report"]
