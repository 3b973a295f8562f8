"""hookstats.record: a hook object that records what it sees, for users who register hooks themselves."""
from __future__ import annotations

from typing import Optional

from .._forms import HookForms
from .._owned_hooks import in_backward
from .._select import Site
from .recorder import Recorder
from .store import Store
from .compile import is_compiling, record_traced

# What a record hook's records are labelled with (Site.record_labels: a full backward hook records both sides), in
# the order their hook ids are made.
_RECORD_LABELS = tuple(label for site in (Site.BACKWARD, Site.BACKWARD_PRE, Site.FORWARD_PRE, Site.FORWARD, Site.TENSOR,
                                          Site.GRAD) for label in site.record_labels)


class record(HookForms):
    """A hook that records statistics (and a histogram) of what it sees into a device buffer, returns nothing and
    changes nothing. Register the object (full backward hook: grad_input and grad_output are both recorded) or one
    of its forms (see hookstats.hooks); read with `records()` (which flushes: one host copy). Records carry
    `step`: set `rec.step` (or call `rec.next_step()`) to number them; every call within a step is its own site
    (Note [monitor sites]), in call order. locations=True: records also name the elements of largest |x| and first
    NaN/Inf, as Monitor(locations=True) does. A forward form run again by activation checkpointing's recomputation
    records nothing the second time."""

    _name = "hookstats.record"

    def __init__(self, name: str = "", *, histogram=None, slots: int = 16, locations: bool = False):
        self.name = name
        self._rec = Recorder(histogram, slots, locations=locations)
        self._store = Store(self._rec.empty_block)
        self._hooks = {label: self._rec.hook(name, label) for label in _RECORD_LABELS}
        self._step = 0
        self._rec.begin_step(0, True, True)

    @property
    def step(self) -> int:
        """The step the next records carry; set it to number them yourself (e.g. `rec.step = global_step`)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)
        self._rec.begin_step(self._step, True, True)

    def next_step(self) -> None:
        """Moves on to step + 1."""
        self.step = self._step + 1

    def _add(self, label: str, obj) -> None:
        hid = self._hooks[label]
        if is_compiling():  # no read of step or call counts in traced code: Note [monitor under torch.compile]
            return record_traced(self._rec.id, hid, obj)
        self._rec.record(hid, obj)
        return None

    def _process(self, site, obj, extra=None):
        if site in (Site.FORWARD, Site.FORWARD_PRE) and not is_compiling() and in_backward():
            return None  # activation checkpointing's recomputation: the first forward recorded this call
        labels = site.record_labels
        self._add(labels[0], obj)
        if site is Site.BACKWARD:  # grad_output beside grad_input
            self._add(labels[1], extra)
        return None

    def flush(self) -> None:
        """Copies the recorded rows to the host (one copy per buffer); records() and first_nonfinite() flush too."""
        self._store.add(self._rec.take())
        self._store.drop_ready()  # no exporters here

    def records(self) -> list[dict]:
        """Every record so far, as the Monitor's records() are: seq, step, module (this hook's name), kind (the
        label of what it saw), index, dtype, stats, histogram."""
        self.flush()
        return self._store.records()

    def first_nonfinite(self) -> Optional[dict]:
        """The first record whose tensor held a NaN or Inf, or None."""
        self.flush()
        return self._store.first_nonfinite()

    @property
    def skipped(self) -> int:
        """Non-floating tensors this hook saw and did not record."""
        return self._rec.skipped
