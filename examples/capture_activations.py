"""Capture activation statistics of every ReLU with forward hooks: mean, std, fraction of zeros (units that did
not fire) and an exponent histogram, which says whether the activations would fit a low-precision format.

Shows: `hookstats.Monitor(model, include="act*", kinds=("forward",), histogram="exp")` records each matching
module's output: 13 statistics and the counts per power of two (`floor(log2|x|)`, plus zeros, subnormals,
Inf, NaN), all from one read of the tensor into a device buffer. `hookstats.format_fit` turns an exponent
histogram into the fraction of values that would overflow or flush to zero in float16, bfloat16 and float8. Layer
`act2` sits behind a badly initialised bias, so most of its units never fire: the zero fraction shows it.

Plain PyTorch instead: `x.mean()`, `x.std()`, `(x == 0).float().mean()` and a histogram per layer per batch are
four or more passes and a host sync each; `torch.histc` needs a range (a min/max pass when automatic), drops
values outside it and has no notion of binades.

    python examples/capture_activations.py --steps 5 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import example_parser, mlp, parse_args, synthetic_batches, write_json


def build_model(seed: int = 0) -> nn.Module:
    model = mlp(32, 128, 128, 128, 10, seed=seed)  # fc1, act1, fc2, act2, fc3, act3, head
    with torch.no_grad():
        model.fc2.bias.fill_(-0.3)  # a bad init: most of act2's units stay at zero ("dead")
    return model


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """Inputs only (no training): standard normal, 256 x 32."""
    return synthetic_batches(steps, (256, 32), seed=seed, device=device)


def main(argv=None) -> dict:
    args = parse_args(example_parser(__doc__, steps=5, steps_help="batches to run through the model"), argv)

    model = build_model().to(args.device).eval()
    with hookstats.Monitor(model, include="act*", kinds=("forward",), histogram="exp") as mon, torch.no_grad():
        for x in batches(args.steps, device=args.device):
            model(x)
            mon.step()
        records = mon.records()  # one host copy for every layer and batch

    layers: dict[str, dict] = {}
    for r in records:
        s = r["stats"]
        layer = layers.setdefault(r["module"], {"mean": [], "std": [], "zero_fraction": [], "hist": None})
        layer["mean"].append(s["mean"])
        layer["std"].append(s["std"])
        layer["zero_fraction"].append(s["zero_count"] / s["numel"])
        h = torch.tensor(r["histogram"])
        layer["hist"] = h if layer["hist"] is None else layer["hist"] + h  # summed over batches

    lay = hookstats.exp_layout(torch.float32)
    print(f"{'layer':<6} {'mean':>7} {'std':>7} {'zeros':>6}  {'binades (2^e: count) of the positive values'}")
    for name, layer in layers.items():
        h = layer["hist"]
        fit = hookstats.format_fit(h, torch.float32)
        layer["fp16_underflow"] = float(fit["float16"]["underflow"])
        layer["e4m3_underflow"] = float(fit["float8_e4m3fn"]["underflow"])
        pos = h[lay.pos]  # index i <-> exponent emin + i
        nz = pos.nonzero().flatten().tolist()
        layer["binades"] = {lay.emin + i: int(pos[i]) for i in nz}
        top = sorted(layer["binades"].items(), key=lambda kv: -kv[1])[:4]
        print(f"{name:<6} {layer['mean'][-1]:>7.3f} {layer['std'][-1]:>7.3f} {layer['zero_fraction'][-1]:>6.1%}  "
              + ", ".join(f"2^{e}: {c}" for e, c in sorted(top))
              + f"   (float8 e4m3 would flush {layer['e4m3_underflow']:.2%} to zero)")
        layer["hist"] = h.tolist()

    path = write_json(args.out, "activations.json", layers, indent=None)
    return {"layers": layers, "json": path}


if __name__ == "__main__":
    main()
