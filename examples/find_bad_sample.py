"""Find the bad sample in a batch: per-sample gradient norms from the kept activations, no per-sample gradients.

Shows: `hookstats.PerSampleGradNorms(model)` keeps each Linear's input (autograd keeps it anyway) and, in the
backward, combines it with the output's gradient into each sample's gradient norm (||g_b|| ||x_b|| for [B, in]
inputs), a [B] vector per layer on the device. At step `--bad-step` one sample of the batch has its features in the
wrong unit (x1000): its gradient dominates the batch's, and `top_samples(1)` names it. At the step after, another
sample holds a NaN: every `.grad` becomes NaN, but `first_nonfinite_sample()` still says which sample it was (the
other samples' norms stay finite), and in which layers.

Plain PyTorch instead: per-sample gradients with `torch.func.vmap(torch.func.grad(...))`, B copies of every
gradient in memory, or B separate backward passes; the total gradient norm alone only says that the batch is bad.

    python examples/find_bad_sample.py --steps 10 --out out/
"""
from __future__ import annotations

import math

from torch import nn

import hookstats
from _common import example_parser, mlp, parse_args, save_results, sgd_step, synthetic_batches

LR = 0.05
BAD_SAMPLE, NAN_SAMPLE = 13, 5


def build_model(seed: int = 0) -> nn.Module:
    return mlp(20, 64, 64, 1, seed=seed)  # fc1, act1, fc2, act2, head


def batches(steps: int, bad_step: int, seed: int = 1, device: str = "cpu"):
    """Regression batches of 32 samples; at bad_step sample 13 is in the wrong unit, at bad_step + 1 sample 5 holds a
    NaN."""
    def make(z, step, g):
        x = z.clone()
        if step == bad_step:
            x[BAD_SAMPLE] *= 1000.0
        if step == bad_step + 1:
            x[NAN_SAMPLE, 7] = float("nan")
        return x, z[:, :5].sum(1, keepdim=True)
    return synthetic_batches(steps, (32, 20), make, seed=seed, device=device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=10)
    ap.add_argument("--bad-step", type=int, default=None, help="the step with the bad sample (default: steps // 2)")
    args = parse_args(ap, argv)
    bad_step = args.steps // 2 if args.bad_step is None else args.bad_step

    model = build_model().to(args.device)
    steps, totals = [], []
    with hookstats.PerSampleGradNorms(model) as psn:
        for step, (x, y) in enumerate(batches(args.steps, bad_step, device=args.device)):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            top = psn.top_samples(3)  # one small host copy: (sample, norm) pairs
            bad = psn.first_nonfinite_sample()
            totals.append(psn.total().cpu())
            grad_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
            steps.append({"step": step, "loss": float(loss.detach()), "grad_norm": grad_norm, "top_samples": top,
                          "median_sample_norm": float(totals[-1].nanmedian()), "first_nonfinite": bad})
            hookstats.clip_grad_norm_(model.parameters(), 1.0, nonfinite="zero")  # skip a NaN update on the device
            sgd_step(model.parameters(), LR)
            psn.step()
    for s in steps:
        (i, n), = s["top_samples"][:1]
        note = f"; first non-finite: sample {s['first_nonfinite']['sample']} in {s['first_nonfinite']['layers']}" \
            if s["first_nonfinite"] else ""
        print(f"step {s['step']:2d}: loss {s['loss']:.3g}, batch grad norm {s['grad_norm']:.3g}; largest sample "
              f"{i} ({n:.3g}, median {s['median_sample_norm']:.3g}){note}")
    out = {"bad_step": bad_step, "bad_sample": BAD_SAMPLE, "nan_sample": NAN_SAMPLE, "steps": steps}
    return save_results(args.out, "bad_samples.json", out, totals=totals)


if __name__ == "__main__":
    main()
