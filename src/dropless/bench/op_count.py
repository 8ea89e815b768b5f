"""`dropless bench layer --count-ops`: ATen operators per MoE layer forward + backward.

Each op the dispatcher runs costs host time on the CPU and, on a GPU, one or more kernel launches;
at small widths that cost, not the GEMMs, sets the step time. So the count is a proxy for launch
overhead that a CPU can measure. What is counted: the *top-level* ATen ops of one forward and one
backward (ops that no other ATen op called: an `aten::linear` counts once, not again for the
`aten::addmm` inside it), read from the torch profiler, after one warm-up call. The call is
bench/layer.py's `_fwd_bwd` with `MARKS`: the forward is `variant(x)`; the backward is the loss
(`y.float().square().mean()`, the same for every variant) and `backward()`, so its few ops are in
every variant's count alike.

`non_view` leaves out the ops that only make a new view of storage or return their input (reshape,
transpose, slice, a `to` to the dtype the tensor has, ...): they launch nothing on a GPU. A CPU op
that loops over experts inside one ATen call (the CPU `_grouped_mm`) counts once, as it launches
once on a GPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple

from torch.profiler import ProfilerActivity, profile

from ..ops import lean_experts
from .timing import format_table

# ops that make a view, return their input or only allocate: no kernel on a GPU
VIEW_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::expand",
    "aten::expand_as", "aten::permute", "aten::transpose", "aten::t", "aten::unsqueeze",
    "aten::squeeze", "aten::select", "aten::slice", "aten::detach", "aten::alias", "aten::view_as",
    "aten::chunk", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::narrow",
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::lift_fresh",
    "aten::_unsafe_view", "aten::contiguous", "aten::flatten", "aten::unflatten", "aten::movedim",
    "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
    "aten::to(no-op)",  # a `to` to the dtype and device the tensor has (see _name)
})
FWD, BWD = "op_count_forward", "op_count_backward"
MARKS = (FWD, BWD)  # the profiler labels the counted call puts around its two phases


class OpCount(NamedTuple):
    forward: Counter
    backward: Counter

    def total(self, non_view: bool = False) -> int:
        return self.phase("forward", non_view) + self.phase("backward", non_view)

    def phase(self, which: str, non_view: bool = False) -> int:
        ops = self.forward if which == "forward" else self.backward
        return sum(n for name, n in ops.items() if not (non_view and name in VIEW_OPS))


def _phase(event) -> str | None:
    """The marker this top-level ATen event ran under, or None when it ran under another ATen op."""
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return None
        if p.name in (FWD, BWD):
            return p.name
        p = p.cpu_parent
    return None


def count_ops(call: Callable[[], object]) -> OpCount:
    """Top-level ATen ops of `call()`, a forward and a backward labelled with `MARKS` (module note)."""
    call()  # first-call work (lazy init, caches) is not the steady state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    fwd, bwd = Counter(), Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        where = _phase(e)
        if where == FWD:
            fwd[_name(e)] += 1
        elif where == BWD:
            bwd[_name(e)] += 1
    return OpCount(fwd, bwd)


def _name(event) -> str:
    """The op's name; a `to` that called no other op (it returned its input) is `aten::to(no-op)`."""
    if event.name == "aten::to" and not any(c.name.startswith("aten::") for c in event.cpu_children):
        return "aten::to(no-op)"
    return event.name


COLUMNS = ["variant", "fwd_ops", "bwd_ops", "ops", "non_view_ops"]


def count_variants(calls: dict[str, Callable[[], object]],
                   gpu_path: bool = True) -> tuple[list[dict], dict[str, OpCount]]:
    """One row per variant's labelled forward + backward call. `gpu_path`: count the ops a GPU runs,
    i.e. without the CPU's blocked SwiGLU recompute (ops/lean_experts.py: R / 64 blocks of ~9 ops
    each at F=512, a CPU cache optimisation with the same bits)."""
    saved = lean_experts.CPU_BLOCKS
    lean_experts.CPU_BLOCKS = not gpu_path
    try:
        counts = {name: count_ops(call) for name, call in calls.items()}
    finally:
        lean_experts.CPU_BLOCKS = saved
    rows = [{"variant": name, "fwd_ops": c.phase("forward"), "bwd_ops": c.phase("backward"),
             "ops": c.total(), "non_view_ops": c.total(non_view=True)} for name, c in counts.items()]
    return rows, counts


def format_rows(rows: list[dict]) -> str:
    return format_table(rows, COLUMNS)
