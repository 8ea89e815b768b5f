"""`train.lora`: low-rank adapters on a frozen base (layers/lora.py, ops/lora_experts.py, docs/finetune.md).

Off by default (`rank = 0`). With a rank, every base weight is frozen (no gradient, no optimizer
state) and the targets listed get adapters: W x + (x A) B * alpha / rank, B starting at zero, so the
adapted model starts as the base model, bit for bit.

Targets (names, not module paths, so one list serves every architecture):
    attn          the attention projections: q|k|v (one fused projection, one adapter) and the output;
                  under MLA its up and output projections (q_proj or q_b, kv_b, out)
    mla_low_rank  MLA's low-rank down projections (q_a, kv_a)
    shared        the MoE layers' shared experts (gate|up and down)
    dense         the dense layers' MLPs (gate|up and down)
    experts       the routed experts: A [E, D, r], B [E, r, W] for gate|up and A [E, F, r], B [E, r, D]
                  for down, applied on the grouped path's offsets (no [E, D, W] update ever formed)
    router        the router's weights train in full (E x D numbers per layer; no adapter)
`layers` picks blocks by index (empty: all); MTP modules are never adapted.

`base` is how the frozen routed experts are stored (QLoRA when 4-bit): "fp32" as loaded, "bf16",
"fp8" (e4m3 with one power-of-two scale per 32 weights, MXFP8), "mxfp4" or "nvfp4" (the packed
formats of layers/packed_experts.py); with any of them but fp32 the other frozen matrices are held
in bf16 (layers/frozen_base.py: the bf16 matrices at construction, the packed experts by
`pack_frozen_base` after the fill; a packed base needs one process, every narrow base full-precision
expert GEMMs and no hot-expert replicas: check_lora_model). `base_from` names the base ("hf:DIR",
"run:DIR", or "" for the initial weights of train.seed); checkpoints hold the adapters and a
checksum of the base, never the base.

Optimizers: adamw and adamw_bf16 (state for what trains only). muon is refused: every matrix Muon
orthogonalises is the frozen base, so the adapters would all take its AdamW half (check_lora_model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .configtree import _choice, _fail

LORA_TARGETS = ("attn", "mla_low_rank", "shared", "dense", "experts", "router")
LORA_BASES = ("fp32", "bf16", "fp8", "mxfp4", "nvfp4")


@dataclass
class LoRAConfig:
    rank: int = 0  # 0: off (every weight trains)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the input of each dense adapter (routed experts: refused, see validate)
    targets: list[str] = field(default_factory=lambda: ["attn", "experts"])
    layers: list[int] = field(default_factory=list)  # block indices to adapt; empty: all
    base: str = "fp32"
    base_from: str = ""  # "hf:DIR", "run:DIR", or "": the base is train.seed's initial weights

    def __post_init__(self) -> None:
        f = "train.lora"
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            _fail(f"{f}.rank", self.rank, "must be an integer >= 0 (0 = off)")
        if not self.alpha > 0:
            _fail(f"{f}.alpha", self.alpha, "must be > 0")
        if not 0 <= self.dropout < 1:
            _fail(f"{f}.dropout", self.dropout, "must be in [0, 1)")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if isinstance(self.layers, int):
            self.layers = [self.layers]
        for t in self.targets:
            _choice(f"{f}.targets", t, LORA_TARGETS)
        if len(set(self.targets)) != len(self.targets):
            _fail(f"{f}.targets", self.targets, "lists a target twice")
        if self.rank and not self.targets:
            _fail(f"{f}.targets", self.targets, "is empty: nothing would train")
        for i in self.layers:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                _fail(f"{f}.layers", self.layers, "must be block indices >= 0")
        _choice(f"{f}.base", self.base, LORA_BASES)
        if self.base_from and not self.base_from.startswith(("hf:", "run:")):
            _fail(f"{f}.base_from", self.base_from, "expected hf:DIR or run:DIR (or empty)")
        if self.rank and self.dropout and "experts" in self.targets:
            _fail(f"{f}.dropout", self.dropout, "with 'experts' in train.lora.targets: the routed experts' "
                  "adapters run inside the grouped GEMM path, which has no dropout (as peft's parameter "
                  "targets); set 0, or leave 'experts' out")
        for name, off in (("base", "fp32"), ("base_from", "")):
            if not self.rank and getattr(self, name) != off:
                _fail(f"{f}.{name}", getattr(self, name), "applies to a LoRA run only (set train.lora.rank)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, target: str, layer: int) -> bool:
        """Whether block `layer`'s `target` gets an adapter (or, for "router", trains)."""
        return self.enabled and target in self.targets and (not self.layers or layer in self.layers)


# the packed bases' block along both expert widths (ops/quant.py FORMATS: mxfp8 and mxfp4 32, nvfp4 16)
BASE_BLOCK = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}


def check_lora_model(lora: LoRAConfig, model, parallel, optimizer: str) -> None:  # ModelConfig, ParallelConfig
    """What `train.lora` asks of the model and the trainer (called by RunConfig; `optimizer` is
    train.optimizer): every target exists in a chosen block, the layers exist, the expert widths fit
    the base format, the optimizer has something of its own to do, and a base held narrow runs where
    it can (packed: ep_size 1, since every distributed run holds the experts as FSDP2 DTensors; the
    world size is not known here, so `pack_frozen_base` refuses a DTensor too). ValueError naming
    the field."""
    if not lora.enabled:
        return
    f = "train.lora"
    if optimizer == "muon":
        # Muon orthogonalises the base's weight matrices (train/muon.py split_params), all frozen here;
        # the adapters' factors and the routers are its AdamW half, so the run would be AdamW under
        # another name (and orthogonalising a rank-r factor is not what Muon's shape rule is for)
        _fail("train.optimizer", optimizer, f"with train.lora.rank={lora.rank}: every matrix Muon orthogonalises "
              "is frozen base; the adapters would all take its AdamW half. Use train.optimizer='adamw' (or "
              "'adamw_bf16')")
    for i in lora.layers:
        if i >= model.n_layers:
            _fail(f"{f}.layers", lora.layers, f"holds {i}, past model.n_layers={model.n_layers}")
    chosen = lora.layers or list(range(model.n_layers))
    moe_ids = set(model.moe_layer_ids)
    moe_chosen = [i for i in chosen if i in moe_ids]
    where = {"experts": (moe_chosen, "no chosen block is an MoE layer"),
             "router": (moe_chosen, "no chosen block is an MoE layer"),
             "shared": (moe_chosen if model.moe.n_shared_experts else [],
                        "the MoE layers have no shared experts (model.moe.n_shared_experts=0) in the chosen blocks"),
             "dense": ([i for i in chosen if i not in moe_ids], "no chosen block has a dense MLP"),
             "mla_low_rank": (chosen if model.attention == "mla" else [],
                              f"needs model.attention='mla' (it is {model.attention!r})"),
             "attn": (chosen, "")}
    for t in lora.targets:
        blocks, why = where[t]
        if not blocks:
            _fail(f"{f}.targets", lora.targets, f"names {t!r}, but {why}")
    if "experts" in lora.targets and model.moe.precision != "bf16":
        _fail(f"{f}.rank", lora.rank, f"with 'experts' in train.lora.targets and model.moe.precision="
              f"{model.moe.precision!r}: that recipe quantises the experts' GEMMs, adapters included; a frozen "
              "low-precision base is train.lora.base (QLoRA)")
    block = BASE_BLOCK.get(lora.base)
    if block:
        routed = (("model.moe.latent_dim", model.moe.latent_dim) if model.moe.latent_dim
                  else ("model.d_model", model.d_model))
        for name, width in (routed, ("model.moe.d_expert", model.moe.d_expert)):
            if width % block:
                _fail(f"{f}.base", lora.base, f"blocks the frozen experts by {block} along both widths; "
                      f"{name}={width} is not a multiple")
    if lora.base != "fp32" and model.moe.precision != "bf16":
        _fail(f"{f}.base", lora.base, f"holds the frozen experts narrow, and model.moe.precision="
              f"{model.moe.precision!r} would quantise their GEMMs again: set it to 'bf16'")
    if block and parallel.ep_size > 1:
        _fail(f"{f}.base", lora.base, f"packs the frozen experts in one process only (with parallel.ep_size="
              f"{parallel.ep_size} FSDP2 holds them as DTensors, layers/frozen_base.py); use 'bf16'")
    if lora.base != "fp32" and parallel.replicate_hot_experts:
        _fail(f"{f}.base", lora.base, f"holds the frozen experts narrow, with parallel.replicate_hot_experts="
              f"{parallel.replicate_hot_experts}: the replicas copy full-precision parameters")
    if parallel.replicate_hot_experts and "experts" in lora.targets:
        _fail(f"{f}.rank", lora.rank, f"with 'experts' in train.lora.targets and parallel.replicate_hot_experts="
              f"{parallel.replicate_hot_experts}: the replicas copy the base weights, not the adapters")
