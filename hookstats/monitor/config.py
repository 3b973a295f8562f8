"""MonitorConfig: every option of a hookstats.Monitor, in one dataclass, grouped along what the option decides.

`Monitor(model, **options)` builds one from its keywords; `Monitor(model, config)` takes one built beforehand (a
training script's config, a callback's), and keywords given beside it replace its fields. `checked()` validates
every field once, with the option's name in the error, and returns the normalised copy the Monitor keeps
(`Monitor.config`).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .._select import MONITOR_SITES, Site
from ..export.protocol import is_exporter

# Hook kinds a Monitor attaches (the values of hookstats.Site's MONITOR_SITES; Site.parse takes their aliases too).
MONITOR_KINDS = tuple(s.value for s in MONITOR_SITES)
_DEFAULT_KINDS = (Site.FORWARD.value, Site.BACKWARD_PRE.value)

GROUPS = ("selection", "cadence", "payload", "output", "distributed")


def _opt(group: str, default=dataclasses.MISSING, doc: str = ""):
    return field(default=default, metadata={"group": group, "doc": doc})


@dataclass
class MonitorConfig:
    """The options of a Monitor. Each field belongs to one group (`MonitorConfig.group(name)`; docs/guide/monitor.md):

    selection: which modules and hook sites. cadence: when to record and flush. payload: what each record carries
    besides the 13 statistics, and the features that add their own results. output: where records go and what stays
    in memory. distributed: merging across ranks.
    """

    # -- selection ------------------------------------------------------------------------------------------------
    include: Any = _opt("selection", "*", "globs on qualified module names or class names ('' is the model itself, "
                        "'*Linear*' every nn.Linear); the 'grad' kind matches parameter names; None: every module")
    exclude: Any = _opt("selection", (), "globs that remove modules (parameters) the include globs matched; None: "
                        "none")
    kinds: Any = _opt("selection", _DEFAULT_KINDS,
                      "hook sites: 'forward', 'forward_pre', 'backward_pre' (alias 'grad_output'), 'backward' "
                      "(alias 'grad_input'), 'grad' (each parameter's .grad); None: the default two")
    # -- cadence --------------------------------------------------------------------------------------------------
    every: int = _opt("cadence", 1, "record every N-th step (counted from step 0); other steps launch nothing")
    start_step: int = _opt("cadence", 0, "the first step's number: a resumed run continues its numbering ("
                           "`every` still counts from step 0)")
    histogram_every: int = _opt("cadence", 1, "the histogram every M-th recorded step, the statistics every one")
    flush_every: Optional[int] = _opt("cadence", None, "flush at every N-th step() (one host copy per buffer then)")
    optimizer: Any = _opt("cadence", None, "the 'grad' kind records once per step, at this optimizer's step (one "
                          "C++ call per device); 'manual': only when record_grads() is called")
    # -- payload --------------------------------------------------------------------------------------------------
    histogram: Any = _opt("payload", None, "a histogram recorded with every tensor: (bins, (lo, hi)), "
                          "Histogram.range(...) or 'exp'")
    locations: bool = _opt("payload", False, "each record also names its tensor's first largest |x| and first "
                           "NaN/Inf element, found by the same kernel call (Note [element locations]); off, it "
                           "costs nothing")
    channel_stats: Optional[dict] = _opt("payload", None, "{'inputs': dim} and/or {'outputs': dim}: per-channel "
                                         "statistics accumulated over every call (Monitor.channel_results())")
    per_sample: bool = _opt("payload", False, "each sample's gradient norm per layer, every recorded step "
                            "(Monitor.top_samples(), sample_norms(), coverage())")
    nonfinite_ops: bool = _opt("payload", False, "also find the first ATen op whose output held a NaN or an Inf "
                               "(hookstats.detect_nonfinite on the recorded steps: op, phase, module, autograd node, "
                               "element; mon.feature('nonfinite_ops').first())")
    features: Sequence[Any] = _opt("payload", (), "your own hookstats.monitor.Feature objects, attached after "
                                   "the built-in ones")
    # -- output ---------------------------------------------------------------------------------------------------
    exporters: Sequence[Any] = _opt("output", (), "objects implementing hookstats.export.Exporter (or "
                                    "RecordWriter): each flush's records, on a background thread")
    keep_records: bool = _opt("output", True, "False: no host copy is kept once exporters have the records (long runs)")
    slots: Optional[int] = _opt("output", None, "steps the device buffers hold before they grow (default: "
                                "flush_every, or 16)")
    export_queue: int = _opt("output", 8, "flushes the export thread may be behind before a flush waits")
    # -- distributed ----------------------------------------------------------------------------------------------
    process_group: Any = _opt("distributed", None, "a ProcessGroup or 'world': flush() merges every rank's records "
                              "(docs/distributed.md)")
    export_rank: int = _opt("distributed", 0, "the rank whose exporters write")

    @classmethod
    def group(cls, name: str) -> tuple:
        """The field names of one group, in order."""
        if name not in GROUPS:
            raise ValueError(f"hookstats.MonitorConfig: no group {name!r}; the groups are {GROUPS}")
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["group"] == name)

    @classmethod
    def from_options(cls, config: Optional["MonitorConfig"] = None, **options) -> "MonitorConfig":
        """`config` (or the defaults) with `options` replacing its fields; an unknown option is a TypeError that
        names the closest ones."""
        if config is not None and not isinstance(config, MonitorConfig):
            raise TypeError(f"hookstats.Monitor: config must be a hookstats.MonitorConfig, got {type(config).__name__}"
                            " (pass options as keywords: Monitor(model, include=..., kinds=...))")
        names = {f.name for f in dataclasses.fields(cls)}
        for k in options:
            if k not in names:
                close = difflib.get_close_matches(k, sorted(names), n=3)
                raise TypeError(f"hookstats.Monitor: unknown option {k!r}"
                                + (f"; did you mean {' or '.join(map(repr, close))}?" if close else "")
                                + f" (the options: {', '.join(sorted(names))})")
        return dataclasses.replace(config if config is not None else cls(), **options)

    def checked(self) -> "MonitorConfig":
        """A validated, normalised copy: include/exclude and exporters as lists, kinds as a tuple of Site values,
        slots resolved. Raises ValueError/TypeError naming the option."""
        every = _positive("every", self.every)
        flush_every = _positive("flush_every", self.flush_every, optional=True)
        exporters = list(self.exporters)
        for e in exporters:
            if not is_exporter(e):
                raise TypeError(f"hookstats.Monitor: an exporter needs a write(records, scalars) or "
                                f"write_block(block, scalars) method; {type(e).__name__} has neither")
        if not self.keep_records and not exporters:
            raise ValueError("hookstats.Monitor: keep_records=False without exporters would throw every record away")
        opt = self.optimizer
        if opt is not None and opt != "manual" and not callable(getattr(opt, "register_step_pre_hook", None)):
            raise TypeError(f"hookstats.Monitor: optimizer= needs a torch.optim.Optimizer (or \"manual\"), got "
                            f"{type(opt).__name__}")
        if not isinstance(self.start_step, int) or isinstance(self.start_step, bool) or self.start_step < 0:
            raise ValueError(f"hookstats.Monitor: start_step must be an int >= 0, got {self.start_step!r}")
        if not isinstance(self.export_rank, int) or isinstance(self.export_rank, bool) or self.export_rank < 0:
            raise ValueError(f"hookstats.Monitor: export_rank must be an int >= 0, got {self.export_rank!r}")
        for name in ("keep_records", "locations", "per_sample", "nonfinite_ops"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"hookstats.Monitor: {name} must be True or False, got {getattr(self, name)!r}")
        return dataclasses.replace(
            self, include=_globs("include", self.include, "*"), exclude=_globs("exclude", self.exclude, ()),
            kinds=_kinds(self.kinds if self.kinds is not None else _DEFAULT_KINDS), every=every,
            flush_every=flush_every, histogram_every=_positive("histogram_every", self.histogram_every),
            slots=_positive("slots", self.slots if self.slots is not None else (flush_every or 16)),
            exporters=exporters, export_queue=_positive("export_queue", self.export_queue),
            features=list(self.features))


def _globs(name: str, v, default) -> list:
    if v is None:
        v = default
    if isinstance(v, str):
        return [v]
    if not isinstance(v, (list, tuple, set, frozenset)) or not all(isinstance(g, str) for g in v):
        raise TypeError(f"hookstats.Monitor: {name} must be a glob (str), a list of globs or None, got {v!r}")
    return list(v)


def _kinds(kinds) -> tuple:
    if not isinstance(kinds, (str, Site, list, tuple, set, frozenset)):
        raise TypeError(f"hookstats.Monitor: kinds must be a kind (str), a list of kinds or None, got {kinds!r}; "
                        f"use any of {MONITOR_KINDS}")
    ks = []
    for k in ([kinds] if isinstance(kinds, (str, Site)) else kinds):
        site = Site.parse(k, MONITOR_SITES, "hookstats.Monitor: unknown kind")
        if site.value not in ks:
            ks.append(site.value)
    return tuple(ks)


def _positive(name: str, v, optional: bool = False):
    if optional and v is None:
        return v
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"hookstats.Monitor: {name} must be {'None or ' if optional else ''}an int >= 1, got {v!r}")
    return v


def _options_doc() -> str:
    """Each group's fields with their docs, appended to MonitorConfig's docstring (one source: the field metadata)."""
    lines = []
    for g in GROUPS:
        lines.append(f"    {g}:")
        for f in dataclasses.fields(MonitorConfig):
            if f.metadata["group"] == g:
                lines.append(f"      {f.name} = {f.default!r}: {f.metadata['doc']}")
    return "\n".join(lines) + "\n"


MonitorConfig.__doc__ = (MonitorConfig.__doc__ or "").rstrip() + "\n\n" + _options_doc()
