"""Serving with fewer experts per token than the model was trained with (k1 < k).

A model trained with top-k can run only its top K1 experts per token, cutting the routed-expert
compute by K1/k. What matters is the denominator of the kept weights (ops/routing.py, module note):
- renorm="mass" (the seeds' rule): route the top K2 >= K1 exactly as the model would and keep the
  first K1 slots, so each kept weight is its score over the mass of the top K2 (K2 = k by default:
  each kept expert gets exactly the weight training gave it; the dropped experts' terms are missing).
- renorm="kept": renormalise the K1 weights to sum to 1 (then the scaling factor), which raises each
  kept expert above its trained weight. Offered because users compare the two.

Everything here is a map from the trained `ModelConfig` to the serving one; the parameters are the
same (a token-choice router's weights do not depend on k), so `serve.load.load_model` loads the
checkpoint unchanged into the served model:

    model, cfg = load_model(run_dir, device, model_cfg=serving_map(k1=1, k2=2))

CLI flags (any command that loads a model can take them: `add_serving_args` + `serving_map_from_args`):
    --serve-top-k K1         experts run per token (default: the trained k)
    --serve-norm-top-k K2    mass denominator, K2 >= K1 (default: max(trained k, K1)); renorm mass only
    --serve-renorm mass|kept the rule above (default mass)

Top-1 detail: plain pre-softmax top-1 routing keeps the raw probability p as the weight (renormalising
one weight gives a constant and no router gradient), so K1 = 1 with K2 = 1 or renorm kept sets an
explicit norm_top_k=1 (weight = the scaling factor), and K1 = 1 without a K2 on a model trained with
k = 1 is that model unchanged.

K1 > k is allowed: nothing in a token-choice checkpoint depends on k, and the rule is the model's own
at top_k=K1 (K2 defaults to K1); the model never trained that way, so measure before trusting it.

The served config drops `model.recompute` (a training setting: nothing is recomputed without a
backward), so a run trained with recompute moe/layer serves with a norm_top_k; everything else the
config checks still holds for the served model.

Refused (ValueError naming the flag and value): K1 < 1 or > E, K2 < K1 or > E (or beyond the
experts group-limited routing leaves eligible), K2 with renorm kept, K2 on a model whose weights are
never normalised (renormalize=false, no post-softmax: the raw scores, no mass to divide by; K1 alone
then keeps each expert's trained weight), and any strategy but token_choice (hash's table and expert
choice's capacity are functions of k; expert threshold picks a variable count).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Callable

from ..config import ModelConfig
from ..expert_slots import ExpertSlots

RENORMS = ("mass", "kept")


def normalises(model_cfg: ModelConfig) -> bool:
    """Whether the model's combine weights are normalised over the chosen experts at all (post-softmax,
    or renormalize=true); otherwise they are the raw scores and there is no K2 mass to divide by."""
    r = model_cfg.moe.router
    return r.renormalize or (r.score_func == "softmax" and not r.pre_softmax)


def weight_denominator(model_cfg: ModelConfig) -> int | None:
    """K2: how many of the top experts' scores the weights are normalised over; None for raw scores
    (renormalize=false, or plain pre-softmax top-1, whose one weight is its probability p)."""
    r, k = model_cfg.moe.router, model_cfg.moe.top_k
    if r.norm_top_k is not None:
        return r.norm_top_k
    if r.score_func == "softmax" and not r.pre_softmax:
        return k
    return k if r.renormalize and k > 1 else None


def _check_flags(k1: int | None, k2: int | None, renorm: str) -> None:
    """The checks that need no model."""
    if renorm not in RENORMS:
        raise ValueError(f"--serve-renorm={renorm!r} (renorm): must be one of {', '.join(RENORMS)}")
    if k1 is not None and (isinstance(k1, bool) or not isinstance(k1, int) or k1 < 1):
        raise ValueError(f"--serve-top-k={k1!r} (k1): must be an integer >= 1")
    if k2 is not None and (isinstance(k2, bool) or not isinstance(k2, int) or k2 < 1):
        raise ValueError(f"--serve-norm-top-k={k2!r} (k2): must be an integer >= 1")
    if k1 is not None and k2 is not None and k2 < k1:
        raise ValueError(f"--serve-norm-top-k={k2} (k2): must be >= --serve-top-k={k1} (the run experts "
                         "are among the top K2 whose mass normalises them)")
    if renorm == "kept" and k2 is not None and k2 != k1:
        raise ValueError(f"--serve-norm-top-k={k2} (k2): --serve-renorm=kept normalises over the K1 run "
                         "experts alone; use --serve-renorm=mass to normalise over the top K2")


def serving_top_k(model_cfg: ModelConfig, k1: int | None = None, k2: int | None = None,
                  renorm: str = "mass") -> ModelConfig:
    """The serving ModelConfig: run the top `k1` experts (None: the trained k), weights normalised over
    the top `k2` (renorm "mass"; None: max(trained k, k1)) or over the k1 kept ("kept"). With k1 = k
    and renorm "mass" the trained model is returned unchanged (the same logits, bit for bit)."""
    _check_flags(k1, k2, renorm)
    moe, r = model_cfg.moe, model_cfg.moe.router
    slots, k = ExpertSlots.from_config(moe), moe.top_k
    E = slots.selectable  # what the router chooses among
    among = f"model.moe.num_experts={slots.routed}" + (
        f" + n_identity_experts={slots.identity}" if slots.identity else "")
    if model_cfg.n_moe_layers == 0:
        raise ValueError("--serve-top-k: the model has no MoE layer (model.n_moe_layers=0)")
    if r.strategy != "token_choice":
        raise ValueError(f"model.moe.router.strategy={r.strategy!r}: serving with another top_k needs "
                         "token_choice routing (hash tables and expert-choice capacity are built for the "
                         "trained k; expert threshold has no fixed k)")
    k1 = k if k1 is None else k1
    if k1 > E:
        raise ValueError(f"--serve-top-k={k1} (k1): exceeds {among}")
    if k2 is not None and k2 > E:
        raise ValueError(f"--serve-norm-top-k={k2} (k2): exceeds {among}")
    if r.norm_top_k is not None:
        raise ValueError(f"model.moe.router.norm_top_k={r.norm_top_k}: the run already serves a reduced "
                         "top-k; apply the serving flags to the trained config")
    if renorm == "kept":
        # post-softmax already normalises over the kept logits; renormalize is what the others need,
        # and an explicit norm_top_k=1 at K1 = 1 (plain top-1 keeps the raw probability instead)
        router = replace(r, renormalize=True, norm_top_k=1 if k1 == 1 else None)
    elif not normalises(model_cfg):
        if k2 is not None:
            raise ValueError(f"--serve-norm-top-k={k2} (k2): the model's weights are its raw "
                             f"{r.score_func} scores (model.moe.router.renormalize=false, no post-softmax), "
                             "never normalised, so there is no mass to divide by; --serve-top-k alone keeps "
                             "each run expert's trained weight")
        router = r
    else:
        k2 = max(k, k1) if k2 is None else k2
        # K2 = K1 is the model's own rule at top_k=K1 (norm_top_k=None), except at K1 = 1 of a model
        # trained with k > 1: plain top-1 would keep the raw probability, the mass of all E
        same = k2 == k1 and (k1 > 1 or k == 1)
        router = replace(r, norm_top_k=None if same else k2)
    eligible = router.topk_groups * (E // router.n_groups)
    for flag, value in (("--serve-top-k", k1), ("--serve-norm-top-k", router.norm_top_k)):
        if value is not None and value > eligible:
            raise ValueError(f"{flag}={value}: exceeds the {eligible} experts group-limited routing leaves "
                             f"eligible (model.moe.router.topk_groups={r.topk_groups} of "
                             f"n_groups={r.n_groups})")
    if k1 == k and router == r:
        return model_cfg
    # replace() re-runs the config's validation, which names model.moe.* fields for anything left.
    # model.recompute is dropped: it acts only while autograd records (layers/recompute.py), and its
    # rules (norm_top_k refused with moe/layer) are about a backward that serving never runs
    return replace(model_cfg, recompute=[], moe=replace(moe, top_k=k1, router=router))


def serving_map(k1: int | None = None, k2: int | None = None, renorm: str = "mass",
                ) -> Callable[[ModelConfig], ModelConfig] | None:
    """The `model_cfg=` argument of `serve.load.load_model` for these settings, or None when they ask
    for no change (all defaults). Checks what it can without the model at once."""
    _check_flags(k1, k2, renorm)
    if k1 is None and k2 is None and renorm == "mass":
        return None
    return lambda cfg: serving_top_k(cfg, k1, k2, renorm)


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    """The --serve-* flags (module note)."""
    g = parser.add_argument_group("fewer experts at serving time (docs/serving.md)")
    g.add_argument("--serve-top-k", type=int, default=None, metavar="K1",
                   help="experts run per token (default: the trained top_k)")
    g.add_argument("--serve-norm-top-k", type=int, default=None, metavar="K2",
                   help="normalise the K1 weights by the score mass of the top K2 >= K1 "
                        "(default: max(trained top_k, K1))")
    g.add_argument("--serve-renorm", choices=RENORMS, default="mass",
                   help="mass: over the top K2 (default); kept: renormalise over the K1 run experts")


def serving_map_from_args(args: argparse.Namespace) -> Callable[[ModelConfig], ModelConfig] | None:
    return serving_map(args.serve_top_k, args.serve_norm_top_k, args.serve_renorm)
