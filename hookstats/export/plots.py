"""Plots of a Monitor run (records and scalars, e.g. from `read_jsonl`), as PNG files: the gradient flow across layers,
a layers x steps heatmap of norms, the evolution of histograms over steps, and the logged scalars. The numbers they
draw come from analysis.py (numpy only); this module draws them.

Every function draws on its own `matplotlib.figure.Figure` with the Agg canvas: no pyplot, no global backend
switch, so it works under any backend, in threads and without a display. matplotlib is imported when a plot is
made; `nonfinite_events`, `norm_matrix` and `layer_order` need only numpy.

Layers are shown in model order: the order of `order` (the run header's "modules", named_modules order) when given,
a parameter ("grad" kind) placed at its module; without it, the order in which the forward hooks first saw them (the
backward hooks see them in reverse).
"""
from __future__ import annotations

import math
import os
from typing import Iterable, Optional, Sequence

import numpy as np

from ..runlog.columns import Columns
from .analysis import (  # noqa: F401  (the data functions, re-exported: plots.norm_matrix etc. keep working)
    _KIND_TITLES,
    GRAD_KINDS,
    KIND_ORDER,
    NonfiniteEvent,
    _exp_panel,
    _hist_groups,
    _hist_spec,
    _matrix,
    _range_panel,
    gradient_kind,
    kinds_present,
    layer_order,
    nonfinite_events,
    norm_matrix,
    pick_layers,
)

DPI = 110


def _mpl():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("hookstats plots need matplotlib: pip install matplotlib") from e
    return Figure, FigureCanvasAgg


def _figure(w: float, h: float, layout: Optional[str] = "constrained"):
    """A figure on its own Agg canvas. layout=None for plots laid out by hand (in inches): constrained layout
    measures every text twice, which doubles the time of a figure with many panels."""
    Figure, FigureCanvasAgg = _mpl()
    fig = Figure(figsize=(w, h), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path) -> str:
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def label(name: str, width: int = 36) -> str:
    """A layer name as a tick label: "<model>" for the root, long names shortened in the middle."""
    if not name:
        return "<model>"
    if len(name) <= width:
        return name
    k = (width - 1) // 2
    return name[:k] + "\u2026" + name[-(width - 1 - k):]


def _tick_every(n: int, most: int) -> int:
    return max(1, math.ceil(n / most))


def _label_size(n: int) -> float:
    return 9 if n <= 20 else 8 if n <= 40 else 7 if n <= 70 else 6


def _sample(n: int, k: int) -> list:
    """At most k indices out of range(n), evenly spaced, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, max(k, 2))})


def _step_axis(ax, steps: Sequence[int], axis: str = "x", nbins: int = 10) -> None:
    """Column (or row) index -> step number tick labels."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    def fmt(x, _pos):
        i = int(round(x))
        return str(steps[i]) if 0 <= i < len(steps) and abs(x - i) < 1e-6 else ""

    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(MaxNLocator(nbins=nbins, integer=True))
    a.set_major_formatter(FuncFormatter(fmt))


def _names_list(names: Sequence[str], most: int = 4) -> str:
    shown = ", ".join(label(n, 24) for n in names[:most])
    return shown + (f" +{len(names) - most} more" if len(names) > most else "")


# -- plots -------------------------------------------------------------------------------------------------------
def grad_flow(records, path, kind: Optional[str] = None, max_lines: int = 8,
              order: Optional[Sequence[str]] = None, max_layers: int = 60) -> Optional[str]:
    """The gradient flow chart: the l2 norm (log scale) of each layer's gradient, layers in model order on x, one
    line per sampled step (at most max_lines, evenly spaced, colored by step), over the grey band of each layer's
    min..max across all steps. Layers whose gradient held NaN/Inf at any step get a red x at the top, with the first
    such step. kind: default "grad", else "backward_pre", else "backward". More than max_layers layers: the ones
    pick_layers() chooses (non-finite, largest norm, largest change), in model order. Returns path, or None (nothing
    written) when there are no records of that kind."""
    records = Columns.of(records)
    kind = kind or gradient_kind(records)
    if kind is None:
        return None
    layers, steps, values, recorded, bad = _matrix(records, kind, order)
    if not layers:
        return None
    keep, picked_note = pick_layers(values, bad, max_layers)
    if picked_note:
        layers = [layers[i] for i in keep]
        values, recorded, bad = values[keep], recorded[keep], bad[keep]
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    n = len(layers)
    fig = _figure(min(22.0, max(8.0, 3.0 + 0.24 * n)), 6.2)
    ax = fig.add_subplot()
    x = np.arange(n)
    good = np.where(recorded & ~bad & (values > 0), values, np.nan)
    with np.errstate(all="ignore"):
        lo = np.nanmin(np.where(np.isnan(good), np.inf, good), axis=1)
        hi = np.nanmax(np.where(np.isnan(good), -np.inf, good), axis=1)
    lo[~np.isfinite(lo)] = np.nan
    hi[~np.isfinite(hi)] = np.nan
    if len(steps) > 1:
        ax.fill_between(x, lo, hi, color="0.85", step=None, label="min..max over all steps", zorder=1)
    cmap = colormaps["viridis"]
    vmin, vmax = steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1
    norm = Normalize(vmin, vmax)
    picked = _sample(len(steps), max_lines)
    for j in picked:
        col = good[:, j]
        c = cmap(norm(steps[j]))
        ax.plot(x, col, "-o", color=c, lw=1.6, ms=3.5, zorder=3)
    ax.set_yscale("log")
    if np.isfinite(good).any():
        ymin, ymax = float(np.nanmin(good)), float(np.nanmax(good))
        span = max(ymax / ymin, 10.0)
        # headroom above the lines for the non-finite markers and their step labels
        ax.set_ylim(ymin / span ** 0.05, ymax * span ** (0.35 if bad.any() else 0.08))
    else:
        ax.set_ylim(1e-3, 1.0)
    # non-finite: a red x at the top of the axis over each layer, with its first bad step
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    nbad_layers = 0
    for i in range(n):
        js = np.flatnonzero(bad[i])
        if js.size == 0:
            continue
        nbad_layers += 1
        ax.plot([i], [0.97], marker="x", color="red", ms=9, mew=2.2, transform=trans, clip_on=False, zorder=5)
        more = f" (+{js.size - 1})" if js.size > 1 else ""
        ax.text(i, 0.93, f"step {steps[js[0]]}{more}", transform=trans, color="red", fontsize=7, rotation=90,
                ha="center", va="top", zorder=5)
    ax.set_xticks(x)
    ax.set_xticklabels([label(m) for m in layers], rotation=90 if n > 6 else 30,
                       ha="center" if n > 6 else "right", fontsize=_label_size(n))
    every = _tick_every(n, 90)
    if every > 1:
        for t, lab in enumerate(ax.get_xticklabels()):
            lab.set_visible(t % every == 0)
    ax.set_xlim(-0.5, n - 0.5)
    ax.grid(True, which="major", axis="both", alpha=0.3)
    ax.set_xlabel("layer (model order)" if kind != "grad" else "parameter (model order)")
    ax.set_ylabel(f"gradient l2 norm, {kind} (log scale)")
    title = f"Gradient flow: {_KIND_TITLES.get(kind, kind)}, {len(picked)} of {len(steps)} steps"
    if picked_note:
        title += f"; {picked_note}"
    if nbad_layers:
        first = min((steps[np.flatnonzero(bad[i])[0]], i) for i in range(n) if bad[i].any())
        title += f"\nred x: NaN/Inf in {nbad_layers} layer(s), first at step {first[0]} in {label(layers[first[1]])}"
    ax.set_title(title, fontsize=11)
    sm = ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, ax=ax, pad=0.01, fraction=0.04)
    cb.set_label("step")
    from matplotlib.ticker import MaxNLocator

    cb.locator = MaxNLocator(nbins=8, integer=True)
    cb.update_ticks()
    handles = [Line2D([], [], color="0.85", lw=8, label="min..max over all steps")] if len(steps) > 1 else []
    if nbad_layers:
        handles.append(Line2D([], [], color="red", marker="x", ls="", ms=8, mew=2, label="NaN/Inf (first step)"))
    if handles:
        ax.legend(handles=handles, loc="best", fontsize=8, framealpha=0.85)
    return _save(fig, path)


def norm_heatmap(records, path, kind: Optional[str] = None, order: Optional[Sequence[str]] = None,
                 max_layers: int = 120) -> Optional[str]:
    """A layers x steps heatmap of log10(l2) for `kind`, or one panel per kind present (KIND_ORDER). Red cells held
    NaN/Inf (also marked with an x when there are few), white ones were exactly zero, grey ones were not recorded;
    each panel's title counts the non-finite cells and names the first. More than max_layers layers in a panel: the
    ones pick_layers() chooses, in model order. Returns path, or None without records."""
    records = Columns.of(records)
    kinds = [kind] if kind else kinds_present(records)
    panels = []
    notes = {}
    for k in kinds:
        layers, steps, values, recorded, bad = _matrix(records, k, order)
        if layers:
            keep, note = pick_layers(values, bad, max_layers)
            if note:
                layers = [layers[i] for i in keep]
                values, recorded, bad = values[keep], recorded[keep], bad[keep]
                notes[k] = note
            panels.append((k, layers, steps, values, recorded, bad))
    if not panels:
        return None
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    total_rows = sum(len(p[1]) for p in panels)
    row_h = min(0.2, max(0.1, 26.0 / total_rows))
    heights = [max(1.6, len(p[1]) * row_h) + 0.9 for p in panels]
    nsteps = max(len(p[2]) for p in panels)
    longest = max(len(label(m)) for p in panels for m in p[1])
    fig = _figure(min(16.0, max(9.0, 4.5 + 0.05 * nsteps + 0.06 * longest)), sum(heights) + 0.6)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    cmap = colormaps["viridis"].with_extremes(bad="0.8")
    for ax, (k, layers, steps, values, recorded, bad) in zip(axes, panels):
        with np.errstate(all="ignore"):
            logv = np.log10(values)
        show = recorded & ~bad & (values > 0)
        img = np.ma.masked_array(logv, mask=~show)
        vmin = float(img.min()) if show.any() else 0.0
        vmax = float(img.max()) if show.any() else 1.0
        if vmax <= vmin:
            vmin, vmax = vmin - 0.5, vmax + 0.5
        im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax,
                       origin="upper")
        over = np.zeros(values.shape + (4,))
        over[recorded & ~bad & (values == 0)] = to_rgba("white")
        over[bad] = to_rgba("red")
        ax.imshow(over, aspect="auto", interpolation="nearest", origin="upper")
        nb = int(bad.sum())
        if 0 < nb <= 200:
            ii, jj = np.nonzero(bad)
            ax.scatter(jj, ii, marker="x", color="darkred", s=28 if len(steps) <= 60 else 14, lw=1.2)
        n = len(layers)
        ax.set_yticks(range(n))
        ax.set_yticklabels([label(m) for m in layers], fontsize=min(_label_size(n), row_h * 72 * 0.8))
        every = _tick_every(n, 100)
        if every > 1:
            for t, lab in enumerate(ax.get_yticklabels()):
                lab.set_visible(t % every == 0)
        _step_axis(ax, steps, "x", nbins=12)
        ax.set_xlabel("step")
        title = f"{_KIND_TITLES.get(k, k)}: log10 l2 norm" + (f" ({notes[k]})" if k in notes else "")
        if nb:
            ii, jj = np.nonzero(bad)
            j0 = int(jj.min())
            first_rows = [layers[i] for i in ii[jj == j0]]
            title += (f"\nNaN/Inf (red) in {nb} cell(s), {int(bad.any(axis=1).sum())} layer(s); first at step "
                      f"{steps[j0]}: {_names_list(first_rows)}")
        else:
            title += "  (no NaN/Inf)"
        ax.set_title(title, fontsize=10, color="darkred" if nb else "black")
        cb = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.035)
        cb.set_label("log10 l2", fontsize=8)
    fig.suptitle("Per-layer l2 norms over steps  (red: NaN/Inf, white: exactly 0, grey: not recorded)", fontsize=11)
    return _save(fig, path)


def exp_hist_evolution(records: Sequence[dict], info: Optional[dict], path, modules=None, max_panels: int = 6,
                       order: Optional[Sequence[str]] = None) -> Optional[str]:
    """How histograms change over steps, for a few tensors: one image per (module, kind), x = step, y = exponent
    floor(log2|x|) (both signs together, cropped to the occupied range, with zero and subnormal rows at the bottom
    and Inf / NaN rows at the top when present), color = count (log scale). For range histograms, y = bin centers
    with the under/overflow (and NaN) rows. modules: names (every kind with histograms) or (module, kind) pairs; by
    default the gradient-kind tensors (grad, else backward_pre, else backward) that held NaN/Inf, then those with the
    widest spread. Returns path, or None (nothing written) when no record has a histogram. Only the tensors drawn
    are read as records: the choice is made from the columns."""
    c = Columns.of(records)
    spec = _hist_spec(c, info)
    if spec is None:
        return None
    groups = _hist_groups(c, spec)
    if not groups:
        return None

    def build(keys):
        nk = max(1, len(c.kind_names))
        want = {c.module_names.index(m) * nk + c.kind_names.index(k) for m, k in keys}
        has = c.has_hist()
        rows = np.flatnonzero(has & np.isin(c.module * nk + c.kind, list(want)))
        per: dict = {}
        for r in c.records_at(rows):
            per.setdefault((r["module"], r["kind"]), []).append(r)
        return [_exp_panel(*k, per.get(k, [])) if spec["kind"] == "exp" else _range_panel(*k, per.get(k, []), spec)
                for k in keys]

    kinds = kinds_present(c)
    pos = {}
    for k in kinds:
        for i, m in enumerate(layer_order(c, k, order)):
            pos[(m, k)] = (kinds.index(k), i)
    if modules is not None:
        keys = []
        for m in ([modules] if isinstance(modules, (str, tuple)) else modules):
            if isinstance(m, tuple):
                keys += [m] if m in groups else []
            else:
                keys += [key for key in groups if key[0] == m]
        keys = sorted(dict.fromkeys(keys), key=lambda kk: pos.get(kk, (99, 0)))[:max_panels]
        if not keys:
            raise ValueError(f"hookstats.exp_hist_evolution: no histograms for {modules!r}; "
                             f"recorded: {sorted(groups)[:10]}")
    else:
        gk = next((k for k in GRAD_KINDS if any(key[1] == k for key in groups)), None)
        cand = [k for k in groups if gk is None or k[1] == gk]
        cand.sort(key=lambda k: (not groups[k][0], -groups[k][1], pos.get(k, (99, 0))))
        keys = sorted(cand[:max_panels], key=lambda k: pos.get(k, (99, 0)))
    panels = build(keys)
    panels = [p for p in panels if p.steps]
    if not panels:
        return None
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, LogNorm

    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    # laid out by hand, in inches: each cell is [y labels | image | colorbar | its labels]
    cw, ch, top = 7.0, 3.6, 0.45
    fw, fh = cw * ncols, ch * nrows + top
    fig = _figure(fw, fh, layout=None)
    axes, caxes = [], []
    for k in range(len(panels)):
        r, c = divmod(k, ncols)
        x0, y0 = c * cw, fh - top - (r + 1) * ch
        axes.append(fig.add_axes(((x0 + 1.0) / fw, (y0 + 0.6) / fh, (cw - 2.15) / fw, (ch - 1.0) / fh)))
        caxes.append(fig.add_axes(((x0 + cw - 1.05) / fw, (y0 + 0.6) / fh, 0.16 / fw, (ch - 1.0) / fh)))
    cmap = colormaps["magma_r"].with_extremes(bad="white")
    for ax, cax, p in zip(axes, caxes, panels):
        nr, ns = len(p.rows), len(p.steps)
        special = [p.row_kind == "exp" and r is not None or p.row_kind == "range" and not (0 < i < p.nbins + 1)
                   for i, r in enumerate(p.rows)]
        nmid = nr - sum(special)
        # special rows (0, subnormal, under/overflow, Inf, NaN) drawn taller than one exponent/bin row
        hs = max(1.0, nmid / 14)
        heights = np.array([hs if sp else 1.0 for sp in special])
        yedges = np.concatenate([[0.0], np.cumsum(heights)])
        centers = (yedges[:-1] + yedges[1:]) / 2
        xedges = np.arange(ns + 1) - 0.5
        c = np.ma.masked_less_equal(p.counts.astype(float), 0)
        vmax = max(2.0, float(p.counts.max()))
        im = ax.pcolormesh(xedges, yedges, c, cmap=cmap, norm=LogNorm(vmin=1, vmax=vmax), shading="flat",
                           rasterized=True)
        for i in range(1, nr):  # a line where special rows meet the exponent / bin rows
            if special[i] != special[i - 1]:
                ax.axhline(yedges[i], color="0.35", lw=0.9)
        # NaN / Inf cells: solid red, with an x (a column can be thinner than a pixel)
        for i, r in enumerate(p.rows):
            if r in ("NaN", "\u00b1Inf") and p.counts[i].any():
                ax.pcolormesh(xedges, yedges[i:i + 2], np.ma.masked_equal(p.counts[i:i + 1], 0) * 0, shading="flat",
                              cmap=ListedColormap(["red"]), rasterized=True)
                js = np.flatnonzero(p.counts[i])
                ax.scatter(js, np.full(js.size, centers[i]), marker="x", color="black", s=24, lw=1.2, zorder=4,
                           clip_on=False)
        # y ticks: every special row, exponent / bin rows thinned to about 10
        mids = [i for i in range(nr) if not special[i]]
        every = _tick_every(len(mids), 10)
        ticks, labels = [], []
        for i, r in enumerate(p.rows):
            if not special[i]:
                if (i - mids[0]) % every:
                    continue
                labels.append(f"$2^{{{p.exps[i - p.first_exp_row]}}}$" if p.row_kind == "exp" else r)
            else:
                labels.append(r)
            ticks.append(centers[i])
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=8)
        for lab, txt in zip(ax.get_yticklabels(), labels):
            if txt in ("NaN", "\u00b1Inf"):
                lab.set_color("red")
        ax.set_ylim(0, yedges[-1])
        ax.set_xlim(-0.5, ns - 0.5)
        _step_axis(ax, p.steps, "x", nbins=8)
        ax.set_xlabel("step")
        ax.set_ylabel("floor(log2 |x|)" if p.row_kind == "exp" else "value (bin center)")
        title = f"{label(p.module, 40)} \u2014 {p.kind}"
        if p.nonfinite:
            title += "  (NaN/Inf!)"
        ax.set_title(title, fontsize=10, color="darkred" if p.nonfinite else "black")
        cb = fig.colorbar(im, cax=cax)
        cb.set_label("count (log)", fontsize=8)
        cb.ax.tick_params(labelsize=8)
    what = "Exponent histograms (both signs)" if spec["kind"] == "exp" else \
        f"Histograms ({spec.get('bins')} bins" + (f" over [{spec['lo']:.3g}, {spec['hi']:.3g}])"
                                                  if spec.get("lo") is not None else ")")
    fig.suptitle(f"{what} over steps, {len(panels)} of {len(groups)} tensors  (white: empty)", fontsize=11)
    return _save(fig, path)


def scalars_plot(scalars: Sequence[dict], path, nonfinite_steps: Iterable[int] = ()) -> Optional[str]:
    """One panel per scalar tag (Monitor.log) over steps (log scale for positive values spanning > 2 decades).
    Steps where the tag's value was NaN/Inf: solid red vertical lines; `nonfinite_steps` (where any record held
    NaN/Inf, e.g. from nonfinite_events): dashed orange lines. Returns path, or None without scalars."""
    tags: dict = {}
    for s in scalars:
        tags.setdefault(s["tag"], []).append((s["step"], float(s["value"])))
    if not tags:
        return None
    from matplotlib.lines import Line2D

    nf_steps = sorted(set(int(s) for s in nonfinite_steps))
    n = len(tags)
    fw, ph, top, bottom = 10.0, 2.3, 0.45, 0.55
    fh = ph * n + top + bottom
    fig = _figure(fw, fh, layout=None)
    axes = fig.subplots(n, 1, squeeze=False, sharex=True, gridspec_kw=dict(
        left=1.05 / fw, right=1 - 0.25 / fw, top=1 - (top + 0.3) / fh, bottom=bottom / fh,
        hspace=0.55 / (ph - 0.55)))[:, 0]
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:pink", "tab:gray"]
    for t, (ax, (tag, pts)) in enumerate(zip(axes, tags.items())):
        st = np.array([p[0] for p in pts], dtype=float)
        v = np.array([p[1] for p in pts], dtype=float)
        fin = np.isfinite(v)
        yv = np.where(fin, v, np.nan)
        ax.plot(st, yv, "-", color=colors[t % len(colors)], lw=1.4, marker="o" if len(v) <= 60 else None, ms=3)
        good = v[fin]
        if good.size and (good > 0).all() and good.max() / good.min() > 100:
            ax.set_yscale("log")
        bad_steps = np.unique(st[~fin])
        if nf_steps:
            ax.vlines(nf_steps, 0, 1, transform=ax.get_xaxis_transform(), colors="darkorange", linestyles="--",
                      lw=1.0, alpha=0.8)
        if bad_steps.size:
            ax.vlines(bad_steps, 0, 1, transform=ax.get_xaxis_transform(), colors="red", lw=1.6, alpha=0.8)
        title = tag
        if good.size:
            title += f"  (last finite: {good[-1]:.4g}"
            title += f"; {int((~fin).sum())} non-finite" if (~fin).any() else ""
            title += ")"
        else:
            title += "  (no finite value)"
        ax.set_title(title, fontsize=10, loc="left", color="darkred" if (~fin).any() else "black")
        ax.set_ylabel(tag)
        ax.grid(True, alpha=0.3)
        if not good.size:
            ax.set_ylim(0, 1)
    axes[-1].set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    axes[-1].xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    handles = []
    if any(not math.isfinite(p[1]) for pts in tags.values() for p in pts):
        handles.append(Line2D([], [], color="red", lw=1.6, label="value NaN/Inf"))
    if nf_steps:
        handles.append(Line2D([], [], color="darkorange", ls="--", lw=1.0, label="NaN/Inf in recorded tensors"))
    if handles:
        fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(1 - 0.25 / fw, 1 - 0.08 / fh), ncol=2,
                   fontsize=8, frameon=False)
    fig.suptitle("Logged scalars over steps", fontsize=11, x=0.3)
    return _save(fig, path)


__all__ = ["NonfiniteEvent", "nonfinite_events", "kinds_present", "gradient_kind", "layer_order", "norm_matrix",
           "grad_flow", "norm_heatmap", "exp_hist_evolution", "scalars_plot", "label", "DPI"]
