"""Where train.lora puts adapters in a model's blocks, and what stays frozen (lora_config.py, layers/lora.py).

Called by model.py while the model is built (on the meta device: nothing is copied), so every later
step (materialise, the initial weights by name, FSDP2 and EP, checkpoints by name, the planner on
meta) sees the adapters as ordinary parameters of the modules they adapt.
"""

from __future__ import annotations

from torch import nn

from .layers import frozen_base
from .layers import lora as lora_layers
from .layers.attention import Attention
from .layers.mla import LatentAttention
from .layers.moe import MoELayer
from .lora_config import LoRAConfig

# which projections each target adapts, by attention kind (absent ones are skipped: MLA without q_lora_rank
# has q_proj instead of q_a / q_b)
ATTN = {Attention: ("qkv", "out"), LatentAttention: ("q_proj", "q_b", "kv_b", "out")}
MLA_LOW_RANK = ("q_a", "kv_a")
MLP = ("gate_up", "down")


def adapt_block(attn: nn.Module, ffn: nn.Module, index: int, lora: LoRAConfig | None) -> None:
    """Adapters on block `index`'s attention and feed-forward, as `lora` says (nothing when off)."""
    if lora is None or not lora.enabled:
        return
    r, s, p = lora.rank, lora.scale, lora.dropout

    def each(parent: nn.Module, names: tuple[str, ...]) -> None:
        for name in names:
            if isinstance(getattr(parent, name, None), nn.Linear):
                lora_layers.adapt(parent, name, r, s, p)

    if lora.adapts("attn", index):
        each(attn, ATTN[type(attn)])
    if lora.adapts("mla_low_rank", index) and isinstance(attn, LatentAttention):
        each(attn, MLA_LOW_RANK)
    if isinstance(ffn, MoELayer):
        if lora.adapts("experts", index):
            lora_layers.add_expert_adapters(ffn.experts, r, s)
        if lora.adapts("shared", index) and ffn.shared is not None:
            each(ffn.shared, MLP)
    elif lora.adapts("dense", index):
        each(ffn, MLP)


def trains(name: str, lora: LoRAConfig) -> bool:
    """Whether parameter `name` (the model's naming) trains in a LoRA run: the adapters, and the
    routers of the chosen blocks when "router" is a target."""
    if lora_layers.is_adapter(name):
        return True
    parts = name.split(".")
    return (len(parts) == 5 and parts[0] == "blocks" and parts[2:] == ["ffn", "router", "weight"]
            and lora.adapts("router", int(parts[1])))


def freeze(model: nn.Module, lora: LoRAConfig | None) -> None:
    """Every parameter that does not train stops requiring a gradient, and the frozen base is held as
    train.lora.base says (layers/frozen_base.py: bf16 matrices, on meta before any fill; the packed
    experts come later, `pack_frozen_base` after the fill). Nothing when LoRA is off."""
    if lora is None or not lora.enabled:
        return
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name, lora))
    frozen_base.hold_frozen_base(model, lora.base)


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]
