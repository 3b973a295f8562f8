"""per_sample=True: each sample's gradient norm per layer, every recorded step, from hookstats.PerSampleGradNorms;
kept on the device (one stacked [layers, samples] tensor a step) until read."""
from __future__ import annotations

from typing import List, Optional

import torch

from ...per_sample import PerSampleGradNorms
from ...per_sample.ranking import first_nonfinite_sample, top_samples
from ..feature import FeatureContext, Shortcut, register_feature


class PerSampleFeature:
    name = "per_sample"

    def __init__(self):
        self.norms: Optional[PerSampleGradNorms] = None
        self._rows: list = []  # (step, layer names, [layers, samples], [samples] total: device tensors) a step

    def attach(self, ctx: FeatureContext) -> None:
        self.norms = PerSampleGradNorms(ctx.model, include=ctx.include, exclude=ctx.exclude)

    def on_step(self, step: int, recorded: bool) -> None:
        psn = self.norms
        layers = psn.per_layer()
        if layers and recorded:
            names = list(layers)
            # the total is kept apart: a tied parameter counts in each layer holding it, once in the total
            self._rows.append((step, names, torch.stack([layers[n] for n in names]), psn.total()))
        psn.step()

    def results(self) -> list:
        """(step, layer names, [layers, samples] float64 host tensor) of every recorded step."""
        return [(s, names, t.cpu()) for s, names, t, _ in self._rows]

    def coverage(self):
        return self.norms.coverage()

    def summary(self) -> str:
        return str(self.norms.coverage())

    def top_samples(self, k: int = 1) -> List[dict]:
        """The k (step, sample) pairs with the largest total gradient norm over the recorded steps, largest first:
        dicts with step, sample, norm (Note [ranking samples]: NaN first, then inf; ties in (step, sample) order)."""
        return [r._asdict() for r in top_samples([(s, total) for s, _, _, total in self._rows], k)]

    def first_nonfinite_sample(self) -> Optional[dict]:
        """The first (step, sample) whose gradient norm is NaN or Inf: {"step", "sample", "norm", "layers"}, or
        None (Note [ranking samples])."""
        hit = first_nonfinite_sample(self._rows)
        return None if hit is None else hit._asdict()

    def detach(self) -> None:
        if self.norms is not None:
            self.norms.remove()


def _none():
    return None


F = PerSampleFeature
register_feature("per_sample", lambda v: F() if v else None, "per_sample=True", shortcuts=[
    Shortcut("coverage", F.coverage, None, """Which trainable parameters the per-sample norms cover and why the
        others are not (hookstats.per_sample.Coverage; per_sample=True)."""),
    Shortcut("sample_norms", F.results, list, """(step, layer names, [layers, samples] float64 host tensor) of every
        recorded step with per_sample=True: each sample's gradient norm per layer (hookstats.PerSampleGradNorms),
        one host copy per step when read; [] without per_sample."""),
    Shortcut("top_samples", F.top_samples, list, """The k (step, sample) pairs with the largest total gradient norm
        over the recorded steps (per_sample=True), largest first, non-finite first: dicts with step, sample, norm
        (Note [ranking samples]); [] without per_sample."""),
    Shortcut("first_nonfinite_sample", F.first_nonfinite_sample, _none, """The first (step, sample) whose gradient
        norm is NaN or Inf, with the layers where it is: {"step", "sample", "norm", "layers"}, or None (also without
        per_sample)."""),
])
