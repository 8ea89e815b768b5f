"""The package graph goes one way (docs/design.md "Layout"): a module imports only from its own
package or from packages on lower levels, never sideways between siblings of one level, and no
import circle exists between modules. Read from the source with `ast`, lazy imports inside functions
and `TYPE_CHECKING` blocks included: a dependency is a dependency wherever it is written."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "dropless"

# level -> its groups; a group is the top-level modules and packages it holds. Siblings (groups of one
# level) may not import each other.
LEVELS: list[dict[str, set[str]]] = [
    {"ops": {"ops"}, "base": {"atomic", "cpu_alloc", "saved_bytes"}},
    {"config": {"config", "configtree", "moe_config", "attn_config", "parallel_config", "pipeline_config", "model_knobs",
                "expert_slots", "fixed_fields", "lora_config", "train_config"},
     "device": {"device"}},
    {"layers": {"layers"}},
    {"model": {"model", "model_lora"}},
    {"distributed": {"distributed"}, "monitor": {"monitor"}},
    {"data": {"data"}},
    {"runs": {"runs"}},
    {"hf": {"hf"}},
    {"train": {"train"}, "serve": {"serve"}},
    {"plan": {"plan"}},
    {"bench": {"bench"}, "check": {"check"}},
    {"cli": {"cli"}},
]
GROUP_OF = {top: (level, group) for level, groups in enumerate(LEVELS)
            for group, tops in groups.items() for top in tops}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every dropless import in the file; `from pkg import name` counts
    `pkg.name` when that is a module."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dropless"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "dropless":
                continue
            for a in node.names:
                full = f"{src}.{a.name}"
                out.append((node.lineno, full if is_module(full) else src))
    return out


def is_module(name: str) -> bool:
    p = SRC.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def graph() -> dict[str, list[tuple[int, str]]]:
    return {module_name(p): imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_top_level_module_has_a_level() -> None:
    tops = {p.stem if p.suffix == ".py" else p.name for p in SRC.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert tops - set(GROUP_OF) == set(), "place the new module in LEVELS (and docs/design.md)"
    assert set(GROUP_OF) - tops == set(), "LEVELS names a module that no longer exists"


def violations(g: dict[str, list[tuple[int, str]]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        if mod == "dropless":  # the package's public names re-export what users import
            continue
        level, group = GROUP_OF[top(mod)]
        for line, dep in deps:
            if dep == "dropless":
                bad.append(f"{mod} line {line}: imports the package root")
                continue
            dep_level, dep_group = GROUP_OF[top(dep)]
            if dep_group == group:
                continue
            if dep_level > level:
                bad.append(f"{mod} line {line}: imports {dep}, a higher level ({dep_group} over {group})")
            elif dep_level == level:
                bad.append(f"{mod} line {line}: imports {dep}, a sibling ({dep_group} beside {group})")
    return bad


def cycles(g: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each an import circle."""
    edges = {m: sorted({d for _, d in deps if d in g and d != m}) for m, deps in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_imports_go_down_and_never_sideways() -> None:
    bad = violations(graph())
    assert not bad, "\n".join(bad)


def test_no_import_circle() -> None:
    found = cycles(graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("line, expect", [
    ("from ..train import optim", "a higher level (train over hf)"),
    ("from ..serve.generate import generate", "a sibling (serve beside train)"),
])
def test_the_check_names_the_file_and_the_import(line: str, expect: str) -> None:
    """The rule reads a new upward or sideways import (a line added to a module's imports)."""
    g = graph()
    target = "dropless.hf.export_hf" if "train" in line else "dropless.train.loop"
    dep = line.split()[1].replace("..", "dropless.")
    g[target] = [*g[target], (999, dep if not line.endswith("optim") else dep + ".optim")]
    assert any(target in b and "line 999" in b and expect in b for b in violations(g))


def test_a_circle_is_found() -> None:
    g = graph()
    g["dropless.distributed.comm"] = [*g["dropless.distributed.comm"], (1, "dropless.distributed.parallelize")]
    assert any("dropless.distributed.comm" in c and "dropless.distributed.parallelize" in c for c in cycles(g))
