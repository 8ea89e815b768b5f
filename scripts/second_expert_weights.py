"""Share of validation tokens whose second expert gets a small routing weight, per trained run.

    PYTHONPATH=src python scripts/second_expert_weights.py RUN_DIR [RUN_DIR ...]

For each run: the final checkpoint in eval mode on 2 validation batches of 8 x 256 tokens; for every
MoE layer, the mean weight of each token's second routed expert and the share of tokens for which it
is below 0.05 (a pair that costs a full expert row and adds almost nothing), averaged over the layers.
docs/balancing.md "Measured on the 8-expert model" reads it (top-k >= 2 runs only).
"""

from __future__ import annotations

import sys

import torch

from dropless.runs.load import load_model
from dropless.data.batches import eval_batches, load_splits
from dropless.data.tokenizer import load_tokenizer

SMALL = 0.05


def second_weights(run: str) -> tuple[float, float]:
    model, cfg = load_model(run)
    model.eval()
    d = cfg.data
    _, val = load_splits(None, load_tokenizer(d.tokenizer, d.tokenizer_path), val_fraction=d.val_fraction,
                         max_bytes=d.max_bytes or None)
    rows: list[tuple[float, float]] = []

    def keep(module: torch.nn.Module, args: tuple, out) -> None:
        w2_T = out.weights_TK[:, 1].float()
        rows.append((w2_T.mean().item(), (w2_T < SMALL).float().mean().item()))

    hooks = [layer.router.register_forward_hook(keep) for layer in model.moe_layers()]
    with torch.no_grad():
        for x, y in eval_batches(val, 8, 256, 2):
            model(x, y)
    for h in hooks:
        h.remove()
    return sum(r[0] for r in rows) / len(rows), sum(r[1] for r in rows) / len(rows)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    for run in argv:
        mean_w2, small = second_weights(run)
        print(f"{run}: mean second weight {mean_w2:.3f}, share below {SMALL}: {small:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
