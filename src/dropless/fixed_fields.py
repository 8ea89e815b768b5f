"""Which config fields define the network a checkpoint's weights belong to.

A resumed run may not change them (runs/resume.py says what may change and why), a routing record
hashes them to name the model it routed (data/routing_record.py), and an imported checkpoint takes
them from its config.json (hf/import_hf.py). The exceptions under `model.` change how the same network
is computed or trained, never what it is:
    model.init_std         read only at initialisation: no effect on a resumed run
    model.moe.backend      the grouped-GEMM implementation (the same math)
    model.moe.align        the routing plan's row padding (padding rows are never read)
    model.moe.precision    the expert GEMMs' number format (numerics, like train.dtype)
    model.moe.balance.*    balancing losses and bias rules (the training objective)
    model.recompute        which activations are recomputed in the backward (the same bits)
    model.offload          which activations wait in host memory for the backward (the same bits)
Outside `model.`, the tokenizer is fixed too: the embedding rows are one tokenizer's vocabulary.
"""

from __future__ import annotations

from typing import Any

MUTABLE_MODEL_FIELDS = ("model.init_std", "model.moe.backend", "model.moe.align", "model.moe.precision",
                        "model.moe.balance.", "model.recompute",
                        "model.offload")  # a trailing dot: the whole section
# and the adapters' shapes and their base (train.lora: alpha and dropout may change)
FIXED_FIELDS_OUTSIDE_MODEL = ("data.tokenizer", "data.tokenizer_path", "train.lora.rank", "train.lora.targets",
                              "train.lora.layers", "train.lora.base", "train.lora.base_from")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def is_fixed(name: str) -> bool:
    """Whether a resumed run may not change field `name` (see the module note)."""
    if name in FIXED_FIELDS_OUTSIDE_MODEL:
        return True
    if not name.startswith("model."):
        return False
    return not any(name == m or (m.endswith(".") and name.startswith(m)) for m in MUTABLE_MODEL_FIELDS)
