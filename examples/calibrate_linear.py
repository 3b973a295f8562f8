"""Calibrate Linear layers for int8 quantization: per-input-channel statistics over calibration batches.

Shows: `hookstats.ChannelCalibrator(model, include="*Linear*", dim=-1, on="inputs")` puts a forward pre-hook on
every nn.Linear; each call is one fused kernel (`channel_stats_into`) that folds the input's per-channel absmax,
sum|x|, sum x^2, min, max and non-finite count into a float64 buffer on the device. After the calibration batches,
`cal.results()` copies every buffer to the host at once. The model's embedding has two outlier channels (as
LLM activations do); the script finds them and computes SmoothQuant's smoothing factors for each layer,
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), which move the outliers' range from the activations into the weights.

Plain PyTorch instead (what SmoothQuant's and AWQ's calibration scripts do): a forward hook per Linear calling
`x.abs().amax(dim=...)` and `torch.maximum` into a buffer for the absmax, one more pass each for the mean
magnitude (AWQ), min/max or a NaN check; each statistic reads the whole activation again.

    python examples/calibrate_linear.py --steps 8 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import example_parser, parse_args, save_results, synthetic_batches

OUTLIERS = (3, 11)  # channels of the embedding with a ~40x larger range
D = 16


class TokenMixer(nn.Module):
    """A tiny transformer-ish block: embedding (with outlier channels) -> Linear -> GELU -> Linear -> head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        gain = torch.ones(D)
        gain[list(OUTLIERS)] = 40.0
        self.register_buffer("gain", gain)
        self.fc1 = nn.Linear(D, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, D)
        self.head = nn.Linear(D, 50)

    def forward(self, idx):
        h = self.emb(idx) * self.gain
        return self.head(h + self.fc2(self.act(self.fc1(h))))


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TokenMixer()


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """Calibration batches of token ids [8, 24]."""
    def tokens(z, step, g):
        return torch.randint(0, 50, (8, 24), generator=g)
    return synthetic_batches(steps, (1,), tokens, seed=seed, device=device)


def smoothquant_scales(absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) (SmoothQuant, eq. 4): X / s and W * s quantize better."""
    w = weight.detach().abs().amax(0).double().clamp(min=1e-5)
    return absmax.clamp(min=1e-5).pow(alpha) / w.pow(1 - alpha)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=8, steps_help="calibration batches")
    ap.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's migration strength")
    args = parse_args(ap, argv)

    model = build_model().to(args.device).eval()
    with hookstats.ChannelCalibrator(model, include="*Linear*", dim=-1, on="inputs") as cal, torch.no_grad():
        for idx in batches(args.steps, device=args.device):
            model(idx)
        res = cal.results()  # one device-to-host copy for every layer

    out: dict = {"layers": {}}
    for name, s in res.items():
        mod = model.get_submodule(name)
        scales = smoothquant_scales(s.absmax, mod.weight.cpu(), args.alpha)
        top = torch.topk(s.absmax, 2).indices.tolist()
        out["layers"][name] = {
            "calls": cal.calls[name], "channels": s.absmax.numel(), "values_per_channel": int(s.count[0]),
            "nonfinite": int(s.nonfinite.sum()), "absmax": s.absmax.tolist(), "mean_abs": s.mean_abs().tolist(),
            "min": s.min.tolist(), "max": s.max.tolist(), "top_channels": sorted(top),
            "smoothquant_scales": scales.tolist(),
        }
        print(f"{name:5s} {s.absmax.numel():3d} input channels, {int(s.count[0])} values each over "
              f"{cal.calls[name]} calls: absmax {float(s.absmax.min()):.3g}..{float(s.absmax.max()):.3g}, "
              f"largest channels {sorted(top)}, smoothing factors {float(scales.min()):.3g}..{float(scales.max()):.3g}")
    return save_results(args.out, "calibration.json", out, results=res)


if __name__ == "__main__":
    main()
