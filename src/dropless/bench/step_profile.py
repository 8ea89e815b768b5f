"""The profile split of `dropless bench train` (bench/train_step.py): each part's share of one step.

Forward hooks open a `record_function` range named after the part ("moe", "attention") around each
module of that part; the caller wraps the optimizer in an "optimizer" range and the whole step in
"bench.step". A backward op belongs to the part whose forward created its autograd node: the
profiler gives each forward op and the backward node it creates the same sequence number, so the
backward time of a part is the summed time of the top-level `autograd::engine::evaluate_function`
events whose sequence numbers were issued inside that part's forward ranges.
share = (forward + backward time of the part) / the step's time. Ranges may nest (bench/step.py puts
the experts' range inside the MoE layer's): the outer part keeps its self time only.
CPU: host time (the ranges' wall time); CUDA: the kernels' device time (not yet run on a GPU).
"""

from __future__ import annotations

import torch
from torch import nn

PARTS = ("moe", "attention", "optimizer")


def ranges(modules: dict[str, list[nn.Module]]) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward hooks that open a record_function range named after each module's part."""
    handles = []
    open_ranges: dict[int, torch.profiler.record_function] = {}  # kept off the modules themselves
    for part, mods in modules.items():
        for m in mods:
            def pre(mod: nn.Module, args: object, part: str = part) -> None:
                open_ranges[id(mod)] = torch.profiler.record_function(part)
                open_ranges[id(mod)].__enter__()

            def post(mod: nn.Module, args: object, out: object) -> None:
                open_ranges.pop(id(mod)).__exit__(None, None, None)

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def split(events, device: torch.device, parts: tuple[str, ...] = PARTS) -> dict[str, float]:
    """Each part's share of the profiled step (module note). Parts may nest (the experts' range inside
    the MoE layer's): a part's share is then its self time, its enclosed parts' time taken out, and a
    backward op belongs to the innermost part whose forward created it."""
    cuda = device.type == "cuda"

    def t(e) -> float:
        return float(e.device_time_total if cuda else e.cpu_time_total)

    total = sum(t(e) for e in events if e.name == "bench.step")
    time_of = {p: 0.0 for p in parts}
    seqs: dict[int, str] = {}
    todo = [(e, None) for e in events if e.cpu_parent is None]  # (event, the part enclosing it)
    while todo:
        e, part = todo.pop()
        if e.name in parts:
            time_of[e.name] += t(e)
            if part is not None:
                time_of[part] -= t(e)
            part = e.name
        elif part is not None and e.sequence_nr >= 0:
            seqs[e.sequence_nr] = part
        todo.extend((c, part) for c in e.cpu_children)
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in seqs:
            time_of[seqs[e.sequence_nr]] += t(e)
    return {p: (v / total if total > 0 else 0.0) for p, v in time_of.items()}
