"""Per-layer gradient norms at every step, read back from the device once, at the end.

Shows: `hookstats.Monitor(model, kinds=("grad",))` puts a post-accumulate-grad hook on every parameter. Each hook
call is one fused kernel that writes 13 statistics of `p.grad` (l2, linf, min, max, NaN/Inf counts, ...) into a
row of a preallocated buffer on the grad's device; nothing is copied to the host until `mon.records()` /
`mon.summary()`, which read every row in one copy.

Plain PyTorch instead: `torch.linalg.vector_norm(p.grad).item()` for each parameter at each step (what
`wandb.watch` or Lightning's `grad_norm` do, plus more ops for min/max/NaN counts): one op per statistic per tensor
and one host sync per `.item()`, which on a GPU stalls the launch queue every time. `--check` computes exactly that,
beside the hooks, so the two can be compared.

    python examples/grad_norm_logging.py --steps 20 --out out/
"""
from __future__ import annotations

import math

import torch
from torch import nn

import hookstats
from _common import example_parser, mlp, parse_args, save_results, sgd_step, synthetic_batches

LR = 0.05


def build_model(seed: int = 0) -> nn.Module:
    return mlp(32, 64, 64, 1, names=False, seed=seed)  # unnamed layers: parameters "0.weight", ..., "4.bias"


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """Synthetic regression: y is the sum of the first four features."""
    def target(x, *_):
        return x, x[:, :4].sum(1, keepdim=True)
    return synthetic_batches(steps, (128, 32), target, seed=seed, device=device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=20)
    ap.add_argument("--check", action="store_true", help="also compute the norms the slow way, one .item() each")
    args = parse_args(ap, argv)

    model = build_model().to(args.device)
    reference: dict[str, list[float]] = {}
    # kinds=("grad",): one record per parameter per step, named by the parameter ("0.weight", ...). The hooks fire
    # inside backward(), as each .grad is accumulated; "backward_pre" would record the layers' output grads instead.
    with hookstats.Monitor(model, kinds=("grad",)) as mon:
        for x, y in batches(args.steps, device=args.device):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if args.check:  # the slow way: one norm op and one host sync per parameter
                for name, p in model.named_parameters():
                    reference.setdefault(name, []).append(torch.linalg.vector_norm(p.grad).item())
            sgd_step(model.parameters(), LR)
            mon.step()
        records = mon.records()  # the one device-to-host copy
        print(mon.summary())

    per_param: dict[str, list[float]] = {}
    for r in records:  # one record per parameter and step, in hook-call order
        per_param.setdefault(r["module"], [math.nan] * args.steps)[r["step"]] = r["stats"]["l2"]
    # A layer's norm is the norm of its weight and bias together.
    per_layer: dict[str, list[float]] = {}
    for name, norms in per_param.items():
        layer = name.rsplit(".", 1)[0]
        prev = per_layer.get(layer, [0.0] * args.steps)
        per_layer[layer] = [math.hypot(a, b) for a, b in zip(prev, norms)]

    print("\nper-layer grad norm by step:")
    for layer, norms in per_layer.items():
        print(f"  layer {layer}: " + " ".join(f"{n:.3g}" for n in norms))
    return save_results(args.out, "grad_norms.json", {"per_param": per_param, "per_layer": per_layer},
                        reference=reference, records=records)


if __name__ == "__main__":
    main()
