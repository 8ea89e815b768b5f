"""Which knob would make a plan fit: each knob alone, re-planned, and a greedy combination.

The knobs (config fields, so a suggestion is a `--set` the user can paste):
- recompute: `model.recompute` = ["layer"], ["attn","norm","moe"], ["moe"], ["attn"], ["norm"];
- expert parallelism: a larger `parallel.ep_size` (dividing the world and the experts);
- micro-batch: `train.batch_size` halved with `train.grad_accum` doubled (same tokens per step);
- bf16 moments: `train.optimizer="adamw_bf16"`;
- offload: `model.offload` is not in this tree (issue 12's offload part is built elsewhere): not
  planned, and said so.
A knob the config refuses (e.g. recompute with ep_size > 1, not implemented yet; bf16 moments with
buffered EP) is listed with the refusal instead of a figure.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from ..config import ModelConfig, RunConfig
from .model import Plan, plan, with_overrides

RECOMPUTE_CHOICES = (["layer"], ["attn", "norm", "moe"], ["moe"], ["attn"], ["norm"])
OFFLOAD_NOTE = ("offload: model.offload is not in this tree (issue 12's activation offload is built "
                "separately); not planned")


@dataclass(frozen=True)
class Suggestion:
    knob: str
    overrides: tuple[str, ...]
    peak: int | None  # None: the config refused it
    fits: bool
    refused: str = ""


def _recompute_value(modes: list[str]) -> str:
    return "[" + ",".join(f'"{m}"' for m in modes) + "]"


def knob_overrides(cfg: RunConfig, world: int) -> list[tuple[str, list[str]]]:
    """The single-knob changes worth planning for this config; `world`: the ranks an EP group may
    span (a pipeline stage's when folded)."""
    out: list[tuple[str, list[str]]] = []
    for modes in RECOMPUTE_CHOICES:
        if sorted(modes) != sorted(cfg.model.recompute):
            out.append(("recompute", [f"model.recompute={_recompute_value(modes)}"]))
    E, ep = cfg.model.moe.num_experts, cfg.parallel.ep_size
    for new in range(ep + 1, world + 1):
        if world % new == 0 and E % new == 0:
            out.append(("ep_size", [f"parallel.ep_size={new}"]))
    b, a = cfg.train.batch_size, cfg.train.grad_accum
    while b > 1:
        b, a = b // 2, a * 2
        out.append(("micro_batch", [f"train.batch_size={b}", f"train.grad_accum={a}"]))
    if cfg.train.optimizer != "adamw_bf16":
        out.append(("bf16_moments", ["train.optimizer=adamw_bf16"]))
    return out


def has_offload() -> bool:
    return any(f.name == "offload" for f in fields(ModelConfig))


def evaluate(cfg: RunConfig, world: int, device_bytes: int, knob: str, overrides: list[str],
             planner: Callable[[RunConfig, int], Plan] = plan) -> tuple[Suggestion, RunConfig | None]:
    try:
        new = with_overrides(cfg, overrides)
        p: Plan = planner(new, world)
    except ValueError as e:
        return Suggestion(knob, tuple(overrides), None, False, str(e)), None
    return Suggestion(knob, tuple(overrides), p.peak, p.peak <= device_bytes), new


def suggest(cfg: RunConfig, world: int, device_bytes: int,
            planner: Callable[[RunConfig, int], Plan] = plan,
            ep_world: int | None = None) -> tuple[list[Suggestion], Suggestion | None]:
    """Every single knob's predicted peak, and (when none fits alone) a greedy combination: apply the
    knob that lowers the peak most, then re-plan, up to four knobs, until it fits. `ep_world`: the
    ranks an EP group may span (default `world`; a pipeline stage's ranks when folded)."""
    ep_world = ep_world or world
    singles = []
    for knob, over in knob_overrides(cfg, ep_world):
        s, _ = evaluate(cfg, world, device_bytes, knob, over, planner=planner)
        singles.append(s)
    # micro-batch and EP size: listed up to the first that fits (the largest micro-batch, the smallest
    # EP group); every recompute mode is listed (they cost different amounts of time)
    shown, done = [], set()
    for s in singles:
        if s.knob in done:
            continue
        shown.append(s)
        if s.fits and s.knob in ("micro_batch", "ep_size"):
            done.add(s.knob)
    if any(s.fits for s in singles):
        return shown, None
    current, applied = cfg, []
    for _ in range(4):
        best = None
        for knob, over in knob_overrides(current, ep_world):
            s, new = evaluate(current, world, device_bytes, knob, over, planner=planner)
            if s.peak is not None and (best is None or s.peak < best[0].peak):
                best = (s, new)
        if best is None:
            break
        applied += list(best[0].overrides)
        current = best[1]
        if best[0].fits:
            break
    combined = evaluate(cfg, world, device_bytes, "combined", applied, planner=planner)[0] if applied else None
    return shown, combined
