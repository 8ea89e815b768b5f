"""Initial weights as a function of (seed, parameter name): the same values at every world size,
EP layout and device, whichever rows of a parameter a process holds.

Each parameter has a `Rule` (a distribution): the module that owns it says which (`init_rules()`,
a dict from parameter names relative to the module to rules); a module higher up overrides a rule
of a module below it (the model scales its residual projections by depth); `nn.Linear` and
`nn.Embedding` have PyTorch's defaults. A parameter with no rule is a ValueError: a new parameter
must say how it starts.

Values. Row r of a parameter (its slice along dim 0; an element of a 1-D one) is drawn by its own
CPU generator (mt19937) seeded from (seed, name, r), in fp32, then cast to the parameter's dtype and
copied to its device. A process that holds rows [start, start + n) of a parameter (FSDP2 shards
and EP slices both cut dim 0: distributed/parallelize.py) draws exactly those rows, and gets the
bits one process holding the whole parameter gets: a row is always drawn whole, by the same
kernel, so no sharding changes a value. Why per row and on the CPU: the CPU generator has no
offset to skip to a shard's first element (CUDA's Philox has, but its numbers differ from the
CPU's), and a row is the finest unit every sharding keeps whole. Cost: one generator seeding per
row (microseconds), paid once per run; the fill copies rows to the device in chunks of up to
`CHUNK_BYTES`.

mt19937 takes a 32-bit seed, so two rows of different parameters may share one (about n^2 / 2^33
pairs for n rows in all: a handful of identical rows in a model of millions, harmless to training).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

CHUNK_BYTES = 64 * 2**20
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = 2**64 - 1


@dataclass(frozen=True)
class Rule:
    kind: str  # "normal" (scale = std), "uniform" (scale = bound: U(-bound, bound)), "const" (scale = value)
    scale: float


def normal(std: float) -> Rule:
    return Rule("normal", float(std))


def uniform(bound: float) -> Rule:
    return Rule("uniform", float(bound))


def const(value: float) -> Rule:
    return Rule("const", float(value))


def _default_rules(module: nn.Module) -> dict[str, Rule]:
    """PyTorch's own initialisation of its layers (nn.Linear: kaiming_uniform(a=sqrt(5)), which is
    U(+-1/sqrt(fan_in)), for the weight and the bias; nn.Embedding: N(0, 1))."""
    if isinstance(module, nn.Linear):
        bound = module.in_features ** -0.5 if module.in_features > 0 else 0.0
        return {"weight": uniform(bound), "bias": uniform(bound)}
    if isinstance(module, nn.Embedding):
        return {"weight": normal(1.0)}
    return {}


def collect_rules(root: nn.Module) -> dict[str, Rule]:
    """Every parameter of `root` (by its name in `root.named_parameters()`) with its rule."""
    rules: dict[str, Rule] = {}
    modules = list(root.named_modules())
    for prefix, module in reversed(modules):  # children first: a parent's rule overrides
        own = {**_default_rules(module), **(module.init_rules() if hasattr(module, "init_rules") else {})}
        for name, rule in own.items():
            rules[f"{prefix}.{name}" if prefix else name] = rule
    out = {}
    for name, _ in root.named_parameters():
        if name not in rules:
            raise ValueError(f"parameter {name!r} has no initialisation rule (its module's init_rules())")
        out[name] = rules[name]
    return out


@dataclass(frozen=True)
class LocalRows:
    """A process's part of one parameter: `tensor` holds rows [start, start + len(tensor)) of the
    global parameter, which has `rows` rows (dim 0)."""
    tensor: torch.Tensor
    start: int
    rows: int


# (parameter name, parameter) -> this process's rows of it; `whole` in one process
Where = Callable[[str, torch.Tensor], LocalRows]


def whole(name: str, p: torch.Tensor) -> LocalRows:
    return LocalRows(p.data, 0, p.shape[0] if p.dim() else 1)


def _base_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def row_seed(base: int, row: int) -> int:
    """splitmix64 of (base + row * golden): well-spread seeds for consecutive rows."""
    z = (base + (row + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 32  # mt19937 keeps 32 bits of its seed: the well-mixed high ones


def _draw(rule: Rule, g: torch.Generator, out: torch.Tensor) -> None:
    if rule.kind == "normal":
        out.normal_(0.0, rule.scale, generator=g)
    else:
        out.uniform_(-rule.scale, rule.scale, generator=g)


def _chunks(n: int, row_numel: int) -> Iterator[tuple[int, int]]:
    per = max(1, CHUNK_BYTES // max(1, 4 * row_numel))
    for a in range(0, n, per):
        yield a, min(n, a + per)


@torch.no_grad()
def fill_(part: LocalRows, rule: Rule, seed: int, name: str) -> None:
    """Fill `part.tensor` with rows [start, start + n) of parameter `name`'s initial values."""
    t = part.tensor
    if t.numel() == 0:
        return
    if rule.kind == "const":
        t.fill_(rule.scale)
        return
    flat = t.view(t.shape[0], -1) if t.dim() else t.view(1, 1)  # [rows, row elements]
    row_numel = flat.shape[1]
    base, g = _base_seed(seed, name), torch.Generator()
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous():
        for i in range(flat.shape[0]):  # drawn in place: no staging copy
            g.manual_seed(row_seed(base, part.start + i))
            _draw(rule, g, flat[i])
        return
    for a, b in _chunks(flat.shape[0], row_numel):
        buf = torch.empty(b - a, row_numel, dtype=torch.float32)
        for i in range(b - a):
            g.manual_seed(row_seed(base, part.start + a + i))
            _draw(rule, g, buf[i])
        flat[a:b].copy_(buf)


def init_parameters(root: nn.Module, seed: int, where: Where = whole,
                    only: Callable[[str], bool] | None = None) -> None:
    """Every parameter of `root` (module note), or those whose name `only` accepts (a LoRA run's
    adapters after its base was loaded), each process drawing only its own rows."""
    rules = collect_rules(root)
    for name, p in root.named_parameters():
        if only is None or only(name):
            fill_(where(name, p), rules[name], seed, name)


def apply_rules(module: nn.Module) -> None:
    """A module built on its own (not inside a model): its parameters from its rules, drawn from
    the global generator (as nn.init does)."""
    rules = collect_rules(module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            rule = rules[name]
            if p.device.type == "meta":
                continue
            if rule.kind == "const":
                p.fill_(rule.scale)
            elif rule.kind == "normal":
                p.normal_(0.0, rule.scale)
            else:
                p.uniform_(-rule.scale, rule.scale)
