"""per_sample=True: each sample's gradient norm per layer, every recorded step, from hookstats.PerSampleGradNorms;
kept on the device (one stacked [layers, samples] tensor a step) until read."""
from __future__ import annotations

from typing import List, Optional

import torch

from ...per_sample import PerSampleGradNorms
from ..feature import FeatureContext, register_feature


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
        out = []
        for s, _, _, total in self._rows:
            out += [{"step": s, "sample": i, "norm": v} for i, v in enumerate(total.cpu().tolist())]
        nan_first = lambda r: (r["norm"] != r["norm"], 0.0 if r["norm"] != r["norm"] else r["norm"])  # noqa: E731
        return sorted(out, key=nan_first, reverse=True)[:k]

    def first_nonfinite_sample(self) -> Optional[dict]:
        for s, names, t, total in self._rows:
            t = t.cpu()
            bad = ~torch.isfinite(t)
            hit = bad.any(0).nonzero()
            if hit.numel():
                i = int(hit[0, 0])
                return {"step": s, "sample": i, "norm": float(total[i]),
                        "layers": [names[j] for j in bad[:, i].nonzero()[:, 0].tolist()]}
        return None

    def detach(self) -> None:
        if self.norms is not None:
            self.norms.remove()


register_feature("per_sample", lambda v: PerSampleFeature() if v else None, "per_sample=True")
