"""Generic helpers for dataclass config trees: validation messages, dicts, dotted overrides, TOML.

Kept apart from the tree itself (config.py) so that file reads as the list of what can be set.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"{name}={value!r}: {why}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(name, value, "must be a positive integer")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"must be one of {', '.join(choices)}")


def _resolve_type(tp: Any) -> Any:
    """Strip Optional[...] and return (base type, allows_none)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


@functools.cache  # resolving the annotations is most of the time of validating a config
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, refusing unknown keys by name."""
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in hints:
            raise ValueError(f"{name}: unknown config field (known: {', '.join(sorted(hints))})")
        tp, _ = _resolve_type(hints[key])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = from_dict(tp, value, prefix=f"{name}.")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ValueError as err:
        # A section validates itself under its short name ("moe.top_k=..."); name it by its place in
        # the tree instead ("model.moe.top_k=...") so the message matches what the user wrote.
        short = getattr(cls, "_name", None)
        text = str(err)
        if short and prefix and text.startswith(short + ".") and prefix != short + ".":
            # every mention of the section, not only the first: a combination's message names two fields
            raise ValueError(re.sub(rf"(?<![\w./]){short}\.", prefix[: -len(short) - 1] + short + ".", text)) from None
        raise


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_value(name: str, text: str, tp: Any) -> Any:
    """Parse an override string with the declared field type."""
    base, optional = _resolve_type(tp)
    if optional and text.strip().lower() in ("none", "null", ""):
        return None
    lists = [a for a in typing.get_args(tp) if typing.get_origin(a) is list]
    if lists and text.strip().startswith("["):  # an int-or-list field given a list
        base = lists[0]
    try:
        if base is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is str:
            return text
        if typing.get_origin(base) in (list, tuple):
            value = json.loads(text)
            return tuple(value) if typing.get_origin(base) is tuple else list(value)
    except (ValueError, json.JSONDecodeError):
        raise ValueError(f"{name}={text!r}: cannot parse as {getattr(base, '__name__', base)}") from None
    raise ValueError(f"{name}: cannot override a field of type {tp}")


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Return a copy of `cfg` with `a.b.c=value` overrides applied, then re-validated."""
    data = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected dotted.name=value")
        path, text = item.split("=", 1)
        keys = path.strip().split(".")
        if not all(keys):
            raise ValueError(f"override {item!r}: expected dotted.name=value (an empty name in {path!r})")
        cls: Any = type(cfg)
        node = data
        for i, key in enumerate(keys):
            hints = _field_types(cls)
            if key not in hints:
                where = ".".join(keys[: i + 1])
                raise ValueError(f"{where}: unknown config field (known: {', '.join(sorted(hints))})")
            tp, _ = _resolve_type(hints[key])
            if i == len(keys) - 1:
                if dataclasses.is_dataclass(tp):
                    raise ValueError(f"{path}: is a section, not a field")
                node[key] = parse_value(path, text, hints[key])
            else:
                if not dataclasses.is_dataclass(tp):
                    raise ValueError(f"{'.'.join(keys[: i + 1])}: is a field, not a section")
                node = node[key]
                cls = tp
    return from_dict(type(cfg), data)


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    with path.open("rb") as fh:
        return tomllib.load(fh)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def dumps_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Write a nested dict as TOML (None values are omitted: they mean 'default/off')."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((f"{prefix}{key}", value))
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(lines)
    for name, table in tables:
        body = dumps_toml(table, prefix=f"{name}.")
        out += f"\n\n[{name}]\n{body}" if body.strip() else ""
    return out.strip() + "\n"
