"""Find the bad token: which (batch, token, channel) element of which module's output went NaN or huge, and when.

A small transformer language model (embedding, one encoder layer, a head) trains on random token sequences. Its
embedding table was loaded from a corrupt checkpoint: token BAD_TOKEN's row holds a NaN in channel BAD_CHANNEL, and
token HUGE_TOKEN's row a 1e4 in channel HUGE_CHANNEL. Neither token occurs in the data until HUGE_TOKEN shows up at
(batch 1, token 5) of step 1 and BAD_TOKEN at (batch 3, token 17) of step `--bad-step`.

`hookstats.Monitor(model, locations=True)` records every module's output and output gradient as usual, and in the
same kernel call the flat index of each tensor's first largest |x| and first NaN/Inf (Note [element locations]),
into device buffers: no host sync, no extra pass over the tensor. Records carry them as coordinates of the tensor's
shape, so `print(mon.first_nonfinite())` reads `step 4, module embed, kind forward, index 0, element (3, 17, 250)`,
and the embedding's record of step 1 names (1, 5, HUGE_CHANNEL) as its largest |x|. The token id at that position
of the batch is the bad token. `clip_grad_norm_(nonfinite="zero")` skips the non-finite update meanwhile.

Plain PyTorch instead: `torch.isnan(out).nonzero()` in a forward hook of every module (a sync and a temporary per
module and step), or re-running the bad step under `torch.autograd.detect_anomaly()`, which names the op but not
the element.

    python examples/find_bad_token.py --steps 8 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import example_parser, parse_args, sgd_step, write_json

VOCAB, DIM, BATCH, TOKENS = 64, 256, 8, 32
BAD_TOKEN, BAD_CHANNEL, BAD_AT = 7, 250, (3, 17)
HUGE_TOKEN, HUGE_CHANNEL, HUGE_AT, HUGE_STEP = 11, 42, (1, 5), 1
LR = 0.05


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=2 * DIM, dropout=0.0,
                                                  batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


def build_model(seed: int = 0) -> TinyLM:
    """The model as loaded from the corrupt checkpoint."""
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():
        model.embed.weight[BAD_TOKEN, BAD_CHANNEL] = float("nan")
        model.embed.weight[HUGE_TOKEN, HUGE_CHANNEL] = 1e4
    return model


def batches(steps: int, bad_step: int, seed: int = 1, device: str = "cpu"):
    """(ids, next-token targets) per step, ids [BATCH, TOKENS]; the two corrupt tokens only where the docstring says."""
    g = torch.Generator().manual_seed(seed)
    ordinary = torch.tensor([t for t in range(VOCAB) if t not in (BAD_TOKEN, HUGE_TOKEN)])
    for step in range(steps):
        ids = ordinary[torch.randint(0, len(ordinary), (BATCH, TOKENS + 1), generator=g)]
        if step == HUGE_STEP:
            ids[HUGE_AT] = HUGE_TOKEN
        if step == bad_step:
            ids[BAD_AT] = BAD_TOKEN
        yield ids[:, :-1].to(device), ids[:, 1:].to(device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=8)
    ap.add_argument("--bad-step", type=int, default=None, help="the step whose batch holds the bad token "
                    "(default: steps // 2)")
    args = parse_args(ap, argv)
    bad_step = args.steps // 2 if args.bad_step is None else args.bad_step

    model = build_model().to(args.device)
    losses, seen = [], []
    with hookstats.Monitor(model, kinds=("forward", "backward_pre"), locations=True) as mon:
        for ids, targets in batches(args.steps, bad_step, device=args.device):
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            hookstats.clip_grad_norm_(model.parameters(), 1.0, nonfinite="zero")  # skip a non-finite update
            sgd_step(model.parameters(), LR)
            losses.append(loss.detach())
            seen.append(ids.cpu())
            mon.step()
        first = mon.first_nonfinite()  # flushes: one host copy of every record
        records = mon.records()

    embed = [r for r in records if r["module"] == "embed" and r["kind"] == "forward"]
    huge = embed[HUGE_STEP] if len(embed) > HUGE_STEP else None
    out = {"bad_step": bad_step, "losses": torch.stack(losses).tolist(), "first_nonfinite": None, "huge": None}
    if huge is not None:
        b, t, c = huge["argmax_abs_index"]
        out["huge"] = {"step": huge["step"], "element": [b, t, c], "token": int(seen[huge["step"]][b, t]),
                       "linf": huge["stats"]["linf"]}
        print(f"largest |x| of step {huge['step']}: module embed, kind forward, element {(b, t, c)} "
              f"= {huge['stats']['linf']:.3g}; token id there: {out['huge']['token']}")
    if first is None:
        print("no NaN or Inf seen")
    else:
        where = first["first_nonfinite_index"]
        token = int(seen[first["step"]][where[0], where[1]]) if first["module"] == "embed" else None
        out["first_nonfinite"] = {"step": first["step"], "module": first["module"], "kind": first["kind"],
                                  "element": list(where), "shape": list(first["shape"]), "token": token,
                                  "nan_count": first["stats"]["nan_count"], "text": str(first)}
        print(f"first NaN/Inf: {first} of a {first['shape']} tensor"
              + (f"; token id there: {token}" if token is not None else ""))
        later = [r for r in records if r["stats"]["nan_count"] and r["seq"] != first["seq"]][:4]
        for r in later:
            print(f"  then {r['module'] or '<model>'}:{r['kind']} at {r['first_nonfinite_index']} "
                  f"({r['stats']['nan_count']} NaN)")
    print("losses: " + " ".join(f"{v:.3g}" for v in out["losses"]))
    write_json(args.out, "find_bad_token.json", out)
    return out


if __name__ == "__main__":
    main()
