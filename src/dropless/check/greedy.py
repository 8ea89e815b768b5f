"""The generate stage's checks beyond the command's exit: the KV cache against the recompute path.

1. Logits: the cached path (the prompts left-padded into one batch and prefilled, then one token per
   step, as `generate` runs it) fed the recompute path's greedy tokens must give, at every step, the
   logits of a full forward of that sequence alone, within tests/tolerances.py KV_DECODE (the
   tolerance the suite holds the cache to). A barely trained model's greedy tokens hardly depend on
   position or context, so equal tokens alone would pass a cache that mixes up positions.
   Low-precision experts (fp8, fp4) run this check in full precision: they quantise their inputs in
   blocks, so the one-ulp differences of the two paths' batch shapes can carry a value across a
   rounding boundary, a whole quantisation step (measured: 7e-7 at an MoE input became 0.02 in the
   logits with fp8_blockwise). What is checked here, positions, masks and cache slots, does not
   depend on the experts' arithmetic; the token check below runs at the run's precision.
2. Tokens: greedy tokens with and without the cache must be equal, except where the first
   difference is a pick between two logits closer than that noise floor: the paths run other batch
   shapes through the GEMMs (serve/generate.py), and a model after a few steps has many near-equal
   logits.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from ..layers.experts import GroupedExperts
from ..ops import quant_gemm
from ..serve.generate import _Cached, generate
from ..hf.load_run import load_model
from ..data.tokenizer import load_tokenizer
from .runner import Failed

RTOL, ATOL = 1e-5, 3e-5  # tests/tolerances.py KV_DECODE (module note)


def compare(run: Path, prompts: list[str], new_tokens: int) -> str:
    """A note when the cache agrees with the recompute path (module note); Failed otherwise."""
    model, cfg = load_model(run, "cpu")
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    ids = [tok.encode(p) for p in prompts]
    plain = generate(model, ids, new_tokens, temperature=0, use_cache=False).tokens
    with torch.inference_mode(), _full_precision_experts(model):
        _cached_logits_match(model, ids, plain)
    with torch.inference_mode():
        cached = generate(model, ids, new_tokens, temperature=0).tokens
        notes = [n for i, (a, b) in enumerate(zip(cached, plain)) if (n := _tie(model, ids[i], a, b, i))]
    return "; ".join(notes) or "cached logits and greedy tokens equal the recompute path's"


@contextlib.contextmanager
def _full_precision_experts(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every expert GEMM in full precision (module note, 1.)."""
    changed = [(m, m.precision) for m in model.modules()
               if isinstance(m, GroupedExperts) and m.precision != quant_gemm.FULL_PRECISION]
    for m, _ in changed:
        m.precision = quant_gemm.FULL_PRECISION
    try:
        yield
    finally:
        for m, p in changed:
            m.precision = p


def _cached_logits_match(model: torch.nn.Module, ids: list[list[int]], plain: list[list[int]]) -> None:
    n = min(map(len, plain))
    state = _Cached(model, ids, max(map(len, ids)) + n)
    steps = [state.prefill()[0]]
    for j in range(n - 1):
        steps.append(state.step(torch.tensor([t[j] for t in plain]))[0])
    for b, (prompt, tokens) in enumerate(zip(ids, plain)):
        full = model(torch.tensor([prompt + tokens[:n]])).logits[0]
        for j, got in enumerate(steps):
            want = full[len(prompt) - 1 + j]
            err = (got[b] - want).abs()
            if not bool((err <= ATOL + RTOL * want.abs()).all()):
                raise Failed(f"KV cache: prompt {b}, step {j}: logits differ from the full forward by up to "
                             f"{float(err.max()):.3g} (tolerance {ATOL:g} + {RTOL:g} x |logit|)")


def _tie(model: torch.nn.Module, prompt: list[int], a: list[int], b: list[int], i: int) -> str:
    j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return ""
    logits = model(torch.tensor([prompt + b[:j]])).logits[0, -1]
    gap = abs(float(logits[a[j]] - logits[b[j]]))
    floor = ATOL + RTOL * float(logits.abs().max())
    if gap > floor:
        raise Failed(f"greedy tokens differ with and without the KV cache: prompt {i}, step {j}: token "
                     f"{a[j]} vs {b[j]}, their logits {gap:.3g} apart (noise floor {floor:.3g})")
    return f"prompt {i} step {j}: a tie ({gap:.2g} <= {floor:.2g})"
