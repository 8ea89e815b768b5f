"""Which knob would make a plan fit: each knob alone, re-planned, and a greedy combination.

The knobs (config fields, so a suggestion is a `--set` the user can paste):
- recompute: `model.recompute` = ["layer"], ["attn","norm","moe"], ["moe"], ["attn"], ["norm"];
- expert parallelism: a larger `parallel.ep_size` (dividing the world and the experts);
- micro-batch: `train.batch_size` halved with `train.grad_accum` doubled (same tokens per step);
- bf16 moments: `train.optimizer="adamw_bf16"`;
- pipeline stages: a larger `parallel.pp_size` (dividing the world; the layers spread over more
  ranks), and under stages more `parallel.pp_microbatches` (smaller micro-batches: a schedule keeps
  at most its count of them alive, 1F1B pp_size - rank) or fewer micro-batches per schedule call
  with more calls (`pp_calls`: the same micro-batch and tokens per step; torch keeps a receive
  buffer per micro-batch of a call, and GPipe all of a call's activations);
- offload: `model.offload` = ["layer"], ["attn","norm","moe"], ["moe"], ["experts"], ["attn"],
  ["norm"]: the device peak re-planned with it and the host bytes it would hold (`Suggestion.host`).
Offload and recompute of overlapping scopes are refused by the config (config.check_offload), so a
recompute knob drops the offload names its scopes overlap and an offload knob the recompute names
its scopes overlap, both written in the knob's overrides: every knob listed is a valid config (e.g.
offload ["layer"] on a config with recompute ["moe"] is `model.offload=["layer"] model.recompute=[]`).
Recompute works with expert parallelism (a recomputed MoE layer repeats its all-to-alls). A knob the
config still refuses (bf16 moments with buffered EP) is listed with the refusal instead of a figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import RunConfig, check_offload
from ..expert_slots import ExpertSlots
from .model import Plan, plan, with_overrides

RECOMPUTE_CHOICES = (["layer"], ["attn", "norm", "moe"], ["moe"], ["attn"], ["norm"])
OFFLOAD_CHOICES = (["layer"], ["attn", "norm", "moe"], ["moe"], ["experts"], ["attn"], ["norm"])


@dataclass(frozen=True)
class Suggestion:
    knob: str
    overrides: tuple[str, ...]
    peak: int | None  # None: the config refused it
    fits: bool
    refused: str = ""
    host: int | None = None  # the host bytes model.offload holds with the knob (offload_host)


def _list_value(names: list[str]) -> str:
    return "[" + ",".join(f'"{m}"' for m in names) + "]"


def _compatible(offload: list[str], recompute: list[str]) -> bool:
    try:
        check_offload(offload, recompute)
    except ValueError:
        return False
    return True


def _recompute_knob(cfg: RunConfig, modes: list[str]) -> list[str]:
    """`model.recompute=modes`, less the current offload names it overlaps (config.check_offload)."""
    out = [f"model.recompute={_list_value(modes)}"]
    keep = [n for n in cfg.model.offload if _compatible([n], modes)]
    if keep != cfg.model.offload:
        out.append(f"model.offload={_list_value(keep)}")
    return out


def _offload_knob(cfg: RunConfig, names: list[str]) -> list[str]:
    """`model.offload=names`, less the current recompute modes it overlaps."""
    out = [f"model.offload={_list_value(names)}"]
    keep = [m for m in cfg.model.recompute if _compatible(names, [m])]
    if keep != cfg.model.recompute:
        out.append(f"model.recompute={_list_value(keep)}")
    return out


def _valid(cfg: RunConfig, overrides: list[str]) -> bool:
    try:
        with_overrides(cfg, overrides)
    except ValueError:
        return False
    return True


def knob_overrides(cfg: RunConfig, world: int) -> list[tuple[str, list[str]]]:
    """The single-knob changes worth planning for this config on `world` ranks (an EP group spans
    at most a pipeline stage's world / pp_size)."""
    out: list[tuple[str, list[str]]] = []
    par = cfg.parallel
    stage_world = world // par.pp_size
    for modes in RECOMPUTE_CHOICES:
        if sorted(modes) != sorted(cfg.model.recompute):
            out.append(("recompute", _recompute_knob(cfg, modes)))
    for names in OFFLOAD_CHOICES:
        if sorted(names) != sorted(cfg.model.offload):
            out.append(("offload", _offload_knob(cfg, names)))
    E, ep = ExpertSlots.from_config(cfg.model.moe).routed, par.ep_size
    for new in range(ep + 1, stage_world + 1):
        if stage_world % new == 0 and E % new == 0:
            out.append(("ep_size", [f"parallel.ep_size={new}"]))
    b, a = cfg.train.batch_size, cfg.train.grad_accum
    while b > 1:
        b, a = b // 2, a * 2
        if b % par.pipeline.microbatches == 0:
            out.append(("micro_batch", [f"train.batch_size={b}", f"train.grad_accum={a}"]))
    if not par.pp_layers:
        for new in range(par.pp_size + 1, world // ep + 1):
            if world % (new * ep) == 0 and _valid(cfg, [f"parallel.pp_size={new}"]):
                out.append(("pp_size", [f"parallel.pp_size={new}"]))
    b, m, a = cfg.train.batch_size, par.pipeline.microbatches, cfg.train.grad_accum
    while par.pp_size > 1 and m % 2 == 0 and b % 2 == 0:  # fewer micro-batches per call, more calls
        b, m, a = b // 2, m // 2, a * 2
        over = [f"train.batch_size={b}", f"parallel.pp_microbatches={m}", f"train.grad_accum={a}"]
        if _valid(cfg, over):
            out.append(("pp_calls", over))
    m = par.pipeline.microbatches
    while par.pp_size > 1 and cfg.train.batch_size % (2 * m) == 0:
        m *= 2
        if _valid(cfg, [f"parallel.pp_microbatches={m}"]):
            out.append(("pp_microbatches", [f"parallel.pp_microbatches={m}"]))
    if cfg.train.optimizer != "adamw_bf16":
        out.append(("bf16_moments", ["train.optimizer=adamw_bf16"]))
    return out


def evaluate(cfg: RunConfig, world: int, device_bytes: int, knob: str, overrides: list[str],
             planner: Callable[[RunConfig, int], Plan] = plan) -> tuple[Suggestion, RunConfig | None]:
    try:
        new = with_overrides(cfg, overrides)
        p: Plan = planner(new, world)
    except ValueError as e:
        return Suggestion(knob, tuple(overrides), None, False, str(e)), None
    return Suggestion(knob, tuple(overrides), p.peak, p.peak <= device_bytes, host=p.offload_host), new


def suggest(cfg: RunConfig, world: int, device_bytes: int,
            planner: Callable[[RunConfig, int], Plan] = plan) -> tuple[list[Suggestion], Suggestion | None]:
    """Every single knob's predicted peak, and (when none fits alone) a greedy combination: apply the
    knob that lowers the peak most, then re-plan, up to four knobs, until it fits or no knob lowers
    it. The combination's overrides are the last value of each field."""
    singles = []
    for knob, over in knob_overrides(cfg, world):
        s, _ = evaluate(cfg, world, device_bytes, knob, over, planner=planner)
        singles.append(s)
    # micro-batch and EP size: listed up to the first that fits (the largest micro-batch, the smallest
    # EP group); every recompute and offload choice is listed (they cost different amounts of time)
    shown, done = [], set()
    for s in singles:
        if s.knob in done:
            continue
        shown.append(s)
        if s.fits and s.knob in ("micro_batch", "ep_size", "pp_size", "pp_microbatches", "pp_calls"):
            done.add(s.knob)
    if any(s.fits for s in singles):
        return shown, None
    current, peak, applied = cfg, planner(cfg, world).peak, {}
    for _ in range(4):
        best = None
        for knob, over in knob_overrides(current, world):
            s, new = evaluate(current, world, device_bytes, knob, over, planner=planner)
            if s.peak is not None and s.peak < peak and (best is None or s.peak < best[0].peak):
                best = (s, new)
        if best is None:
            break
        for o in best[0].overrides:  # a later value of a field replaces the earlier one
            applied.pop(o.split("=", 1)[0], None)
            applied[o.split("=", 1)[0]] = o
        current, peak = best[1], best[0].peak
        if best[0].fits:
            break
    over = list(applied.values())
    combined = evaluate(cfg, world, device_bytes, "combined", over, planner=planner)[0] if over else None
    return shown, combined
