"""Scale and clip the gradient of an intermediate tensor with tensor hooks, recording it before and after.

Shows `h.register_hook(fn)` on the encoder's output `h`: PyTorch calls `fn(grad)` when the gradient w.r.t. `h`
is ready and uses what it returns in its place; everything upstream (the encoder's weights, the input, a leaf
that requires grad here, as for saliency maps) receives the replacement. Hooks on one tensor run in
registration order, each seeing the previous one's result:
  1. `hookstats.record("raw").tensor`: statistics of the gradient as the head produced it (returns None: unchanged);
  2. `lambda g: g * scale`: scales the encoder's learning signal (scale -1 is a gradient-reversal layer);
  3. `hookstats.fused_clip(max_norm).tensor`: rescales to norm <= max_norm, one fused norm pass;
  4. `hookstats.record("clipped").tensor`: what the encoder receives.
Each returns a new tensor: a tensor hook must not modify `grad` in place (PyTorch's rule: autograd may hand the
same tensor to other parts of the graph, and `g.mul_(s)` fails outright on expanded gradients such as `.sum()`'s).

Plain PyTorch instead: the clip is a norm, a host-side or device-side comparison and a multiply; recording the
raw and clipped gradient's statistics takes one op per statistic and `.item()` calls inside backward().

    python examples/scale_gradient.py --steps 10 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import cpu_state_dict, example_parser, parse_args, save_results, sgd_step, synthetic_batches

LR = 0.05


def build_model(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
    head = nn.Linear(32, 3)
    return encoder, head


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """3 classes from two features' thresholds."""
    def label(x, *_):
        return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return synthetic_batches(steps, (32, 16), label, seed=seed, device=device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=10)
    ap.add_argument("--scale", type=float, default=4.0, help="factor on the gradient reaching the encoder")
    ap.add_argument("--max-norm", type=float, default=0.05, help="max norm of that gradient after scaling")
    args = parse_args(ap, argv)

    encoder, head = build_model()
    encoder.to(args.device)
    head.to(args.device)
    params = [*encoder.parameters(), *head.parameters()]
    raw, clipped = hookstats.record("raw"), hookstats.record("clipped")
    clip = hookstats.fused_clip(args.max_norm)

    input_grads = []
    for x, y in batches(args.steps, device=args.device):
        x.requires_grad_(True)  # a leaf: its .grad shows what reached the bottom of the graph
        h = encoder(x)
        h.register_hook(raw.tensor)  # tensor hooks live on this step's tensor: register them each step
        h.register_hook(lambda g: g * args.scale)
        h.register_hook(clip.tensor)
        h.register_hook(clipped.tensor)
        loss = nn.functional.cross_entropy(head(h), y)
        loss.backward()
        input_grads.append(x.grad.detach().cpu())
        sgd_step(params, LR)
        raw.step += 1
        clipped.step += 1

    out = {
        "raw_norm": [r["stats"]["l2"] for r in raw.records()],  # one host copy per record object
        "clipped_norm": [r["stats"]["l2"] for r in clipped.records()],
    }
    print(f"{'step':>4}  {'grad of h':>9}  {'x scale, clipped':>16}")
    for i in range(args.steps):
        print(f"{i:>4}  {out['raw_norm'][i]:>9.4g}  {out['clipped_norm'][i]:>16.4g}")
    state_dict = {**cpu_state_dict(encoder, "encoder."), **cpu_state_dict(head, "head.")}
    return save_results(args.out, "scale_gradient.json", out, input_grads=input_grads, state_dict=state_dict)


if __name__ == "__main__":
    main()
