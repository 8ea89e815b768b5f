"""The generate stage's tie rule: greedy tokens with and without the KV cache must be equal, except
where the first difference is a pick between two logits closer than the two paths' noise floor.

The cached path runs other batch shapes through the GEMMs (one token per step, prompts left-padded
together), so its logits agree with the recompute path's to the fp32 noise floor, not bit for bit
(serve/generate.py); a model after a few steps of training has many near-equal logits, and an argmax
between two of them may go either way. The floor is tests/tolerances.py KV_DECODE, the tolerance the
cache's logits are held to against the full forward.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..serve.generate import generate
from ..serve.load import load_model
from ..train.tokenizer import load_tokenizer
from .runner import Failed

RTOL, ATOL = 1e-5, 3e-5  # tests/tolerances.py KV_DECODE (module note)


def compare(run: Path, prompts: list[str], new_tokens: int) -> str:
    """A note when the tokens are equal or first differ at a tie; Failed otherwise."""
    model, cfg = load_model(run, "cpu")
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    ids = [tok.encode(p) for p in prompts]
    cached = generate(model, ids, new_tokens, temperature=0).tokens
    plain = generate(model, ids, new_tokens, temperature=0, use_cache=False).tokens
    notes = []
    for i, (a, b) in enumerate(zip(cached, plain)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids[i] + b[:j]])).logits[0, -1]
        gap = abs(float(logits[a[j]] - logits[b[j]]))
        floor = ATOL + RTOL * float(logits.abs().max())
        if gap > floor:
            raise Failed(f"greedy tokens differ with and without the KV cache: prompt {i}, step {j}: token "
                         f"{a[j]} vs {b[j]}, their logits {gap:.3g} apart (noise floor {floor:.3g})")
        notes.append(f"prompt {i} step {j}: a tie ({gap:.2g} <= {floor:.2g})")
    return "greedy tokens equal through the API" if not notes else "; ".join(notes)
