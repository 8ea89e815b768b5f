"""`dropless routing-mismatch A B`: how often two routing records of the same tokens chose differently.

    dropless routing-mismatch A.rec B.rec [--json FILE]

Legend: L MoE layers, T tokens compared, K experts per token, E experts.

Definitions (per token, per layer, the K choices compared as sets, order-independent: two engines
that pick the same experts in another order agree; repeated ids count as a multiset):
- choice mismatch of a layer: the share of (token, choice) pairs of A whose expert is not among B's
  choices for that token, i.e. sum_t (K - |A_t & B_t|) / (T * K). With K = 1 it is the share of
  tokens routed elsewhere; it is symmetric in A and B (both sides hold K choices).
- token mismatch of a layer: the share of tokens whose expert set differs in that layer.
- tokens with any mismatch: the share of tokens whose expert set differs in at least one layer (the
  seeds' "94% of tokens met a different expert in at least one layer"); the overall choice mismatch
  is the mean of the layers' (their "about 10% of router choices differed").

Compared tokens: the two records must hold the same sequences of tokens (refused otherwise). A
sequence's routed tokens may differ in number (a sampler never routes its last sampled token, a
full forward routes all): the common prefix of the routed tokens is compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..data.routing_record import RoutingRecord

_CHUNK = 1 << 16  # tokens per one-hot block: bounds the [T, E] counts at 64k * E int16


def _overlap_T(a_TK: torch.Tensor, b_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """|A_t & B_t| as multisets, per token: the sum over experts of the smaller of the two counts."""
    out = []
    for s in range(0, a_TK.shape[0], _CHUNK):
        a, b = a_TK[s:s + _CHUNK], b_TK[s:s + _CHUNK]
        ca = torch.zeros(a.shape[0], num_experts, dtype=torch.int16).scatter_add_(
            1, a, torch.ones_like(a, dtype=torch.int16))
        cb = torch.zeros(b.shape[0], num_experts, dtype=torch.int16).scatter_add_(
            1, b, torch.ones_like(b, dtype=torch.int16))
        out.append(torch.minimum(ca, cb).sum(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def check_same_tokens(a: RoutingRecord, b: RoutingRecord) -> None:
    for key in ("moe_layers", "top_k", "num_experts", "identity_experts"):
        if getattr(a, key) != getattr(b, key):
            raise ValueError(f"the records route different models: {key}={getattr(a, key)} in A, "
                             f"{getattr(b, key)} in B")
    if len(a.tokens) != len(b.tokens):
        raise ValueError(f"the records hold different tokens: {len(a.tokens)} sequences in A, "
                         f"{len(b.tokens)} in B")
    for n, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
        if ta.numel() != tb.numel():
            raise ValueError(f"the records hold different tokens: sequence {n} has {ta.numel()} tokens "
                             f"in A, {tb.numel()} in B")
        diff = (ta != tb).nonzero()
        if diff.numel():
            raise ValueError(f"the records hold different tokens: sequence {n} differs first at "
                             f"position {int(diff[0])}")


def routing_mismatch(a: RoutingRecord, b: RoutingRecord) -> dict[str, Any]:
    """The mismatch figures (module note) of two records of the same tokens."""
    check_same_tokens(a, b)
    L, K, E = len(a.moe_layers), a.top_k, a.num_experts
    overlap, n_tokens = [], 0
    for ia, ib in zip(a.ids, b.ids):
        R = min(ia.shape[1], ib.shape[1])
        n_tokens += R
        overlap.append(torch.stack([_overlap_T(ia[l, :R], ib[l, :R], E) for l in range(L)]))
    if n_tokens == 0:
        raise ValueError("the records have no routed token in common")
    ov_LT = torch.cat(overlap, dim=1).long()  # [L, T]
    differs_LT = ov_LT < K
    choice_L = (K - ov_LT).sum(1).double() / (n_tokens * K)
    token_L = differs_LT.sum(1).double() / n_tokens
    layers = [{"block": blk, "choice_mismatch": c, "token_mismatch": t}
              for blk, c, t in zip(a.moe_layers, choice_L.tolist(), token_L.tolist())]
    return {"sequences": len(a.tokens), "tokens_compared": n_tokens, "top_k": K, "num_experts": E,
            "a_source": a.source, "b_source": b.source,
            "choice_mismatch": float(choice_L.mean()) if L else 0.0,
            "tokens_with_any_mismatch": float(differs_LT.any(0).double().mean()) if L else 0.0,
            "layers": layers}


def table(result: dict[str, Any]) -> str:
    lines = [f"A: {result['a_source']}   B: {result['b_source']}",
             f"{result['sequences']} sequences, {result['tokens_compared']} tokens compared, "
             f"K={result['top_k']} of E={result['num_experts']}", "",
             f"{'block':>5}  {'choices differing':>17}  {'tokens differing':>16}"]
    for r in result["layers"]:
        lines.append(f"{r['block']:>5}  {100 * r['choice_mismatch']:>16.2f}%  {100 * r['token_mismatch']:>15.2f}%")
    lines += [f"{'all':>5}  {100 * result['choice_mismatch']:>16.2f}%  "
              f"{100 * result['tokens_with_any_mismatch']:>15.2f}%  (tokens: in at least one layer)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless routing-mismatch",
                                description="Compare two routing records of the same tokens.")
    p.add_argument("a", help="routing record A")
    p.add_argument("b", help="routing record B")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        if args.json and not Path(args.json).parent.is_dir():
            raise FileNotFoundError(f"--json {args.json}: folder {Path(args.json).parent} does not exist")
        result = routing_mismatch(RoutingRecord.load(args.a), RoutingRecord.load(args.b))
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless routing-mismatch: error: {err}", file=sys.stderr)
        return 2
    result = {"a": args.a, "b": args.b, **result}
    print(table(result))
    if args.json:
        atomic.write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
