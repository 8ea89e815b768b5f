"""The Hugging Face libraries are an optional extra (`pip install 'dropless[hf]'`): imported where a
command needs them, with an ImportError that says which command needs which package."""

from __future__ import annotations

import importlib
from typing import Any


def require(module: str, needed_by: str, attr: str | None = None) -> Any:
    """`module` (or its `attr`), or an ImportError naming the package and the command that needs it."""
    package = module.split(".")[0]
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{needed_by} needs `{package}`: pip install {package} "
                          "(or pip install 'dropless[hf]')") from e
    return getattr(found, attr) if attr else found
