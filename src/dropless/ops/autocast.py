"""Whether a device type has autocast, answered without calling into torch's C extension at trace time.

`torch.amp.is_autocast_available` calls `torch._C._is_autocast_available`, which dynamo on torch 2.11
cannot trace (`torch.compile(fullgraph=True)` fails with "Attempted to call function marked as
skipped"; seen on an H200 machine's torch 2.11, not on 2.13). The answer is fixed per device type,
so it is asked once, eagerly for the common types at import and lazily (outside a trace, in the
first eager call) for any other; a traced call then reads a dict.
"""

from __future__ import annotations

import torch

_AVAILABLE: dict[str, bool] = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "meta")}


def autocast_available(device_type: str) -> bool:
    if device_type not in _AVAILABLE:
        _AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return _AVAILABLE[device_type]
