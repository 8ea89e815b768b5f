"""A guard for the "no host sync" rule: inside `forbid_host_sync()` any tensor method that reads a
device value on the host raises. On CPU there is no real sync to observe, so the tests patch the
methods that would cause one on a GPU."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def forbid_host_sync(what: str = "host sync") -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def boom(self, *args, **kwargs):
        raise AssertionError(what)

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, boom)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
